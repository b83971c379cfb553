"""`dpstream demo`, the README's first command, shows private releases within 30 seconds.

It explains what it shows in plain words, survives a busy metrics port, and stops in order on
Ctrl-C (no Kafka error lines from a broker killed first) with a summary.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from dpstream.demo import _metrics_port, _port_is_free, _release_line
from dpstream.io.broker import free_port


def slow_integration(test: Callable[..., None]) -> Callable[..., None]:
    """Mark a test that runs the whole demo (embedded broker + flow child)."""
    return pytest.mark.integration(pytest.mark.slow(test))


def demo_env(metrics_port: int) -> dict[str, str]:
    return dict(os.environ, DPSTREAM_DEMO_METRICS_PORT=str(metrics_port), PYTHONUNBUFFERED="1")


# Lines a Kafka client prints when the broker went away under it (what the demo printed at
# Ctrl-C when the terminal's SIGINT killed the broker before the flow and the clients).
KAFKA_ERRORS = re.compile(r"Connection refused|ECONNREFUSED|KafkaConnectionError"
                          r"|NoBrokersAvailable|Connection lost|socket disconnected"
                          r"|Disconnected|BrokerTransportFailure|brokers? (are )?down"
                          r"|Connect attempt|ERROR kafka")


class LiveDemo:
    """``dpstream demo`` in a session of its own, its output (stdout + stderr) read as it comes."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "dpstream.cli", "demo", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        self.lines: list[str] = []
        self._first_release = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "first release after" in line:
                self._first_release.set()
        self._first_release.set()  # EOF: stop waiting

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for_first_release(self, timeout: float = 60) -> None:
        self._first_release.wait(timeout)
        assert "first release after" in self.text, self.text[-3000:]

    def finish(self, timeout: float = 90) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def kill(self) -> None:
        """Stop a demo a failed test left running (SIGTERM: it still stops the broker)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture
def live_demo() -> Iterator[Callable[..., LiveDemo]]:
    started: list[LiveDemo] = []

    def start(args: list[str], env: dict[str, str]) -> LiveDemo:
        started.append(LiveDemo(args, env))
        return started[-1]

    yield start
    for demo in started:
        demo.kill()


@pytest.fixture(scope="module")
def demo_run() -> tuple[int, str]:
    """One 15 s demo run, shared by the tests that read its output."""
    out = subprocess.run([sys.executable, "-m", "dpstream.cli", "demo", "--duration", "15",
                          "--rate", "5000"], capture_output=True, text=True, timeout=120,
                         env=demo_env(free_port()))
    return out.returncode, out.stdout + out.stderr


@slow_integration
def test_demo_shows_releases_quickly_and_exits_cleanly(demo_run):
    code, text = demo_run
    assert code == 0, text[-3000:]
    first = re.search(r"first release after ([0-9.]+) s", text)
    assert first, text[-3000:]
    assert float(first.group(1)) < 30
    assert re.search(r"-- step \d+: [1-9]\d* keys admitted", text)
    assert re.search(r"page-\d{3}\s+-?[0-9.]+ ± [0-9.]+", text)
    assert "noise key fingerprint" in text
    assert "malformed records" in text


@slow_integration
def test_demo_explains_what_it_shows(demo_run):
    code, text = demo_run
    assert code == 0, text[-3000:]
    # The legend, once, before the first numbers.
    assert text.count("How to read what follows") == 1
    assert text.index("How to read what follows") < text.index("first release after")
    for phrase in ("noise added on purpose", "one standard deviation of that noise",
                   "covers every future release", "Rare pages stay hidden",
                   "dead-letter topic", "/metrics"):
        assert phrase in text, phrase
    # Labelled numbers: the noise std and the privacy commitment in plain words.
    assert re.search(r"page-\d{3}\s+-?[0-9.]+ ± [0-9.]+ \(noise std\)\s+privacy: 1 of 1 ε "
                     r"committed up front for all future releases of this key", text), \
        text[-3000:]
    assert "eps spent" not in text
    visible = re.findall(r"(\d+) of 300 pages visible; the others have too few events to be "
                         r"shown privately", text)
    assert visible and int(visible[-1]) > 0
    # The summary.
    summary = text[text.rindex("\nsummary\n"):]
    for label in ("events sent", "malformed records sent", "releases seen", "alerts seen",
                  "dead letters seen", "pages visible", "flow exit code"):
        assert re.search(rf"^   {label}\s+\S", summary, re.M), (label, summary)
    assert re.search(r"events sent\s+[1-9]\d*", summary)
    assert re.search(r"releases seen\s+[1-9]\d*", summary)
    assert re.search(r"flow exit code\s+0 ", summary)


@slow_integration
def test_demo_runs_at_the_user_level():
    """`dpstream demo --unit user`: visitors are the unit, their views capped, releases shown."""
    out = subprocess.run([sys.executable, "-m", "dpstream.cli", "demo", "--unit", "user",
                          "--duration", "15", "--web-port", "0"], capture_output=True,
                         text=True, timeout=120, env=demo_env(free_port()))
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    # the flow's start-up summary and the legend say what is protected, and with which caps
    assert "privacy unit: one person (field 'user'), per period of 10 steps" in text, text[:3000]
    assert "caps max_keys = 4, max_per_key = 5" in text
    assert "Privacy unit: one visitor, not one page view" in text
    assert re.search(r"page-\d{3}\s+-?[0-9.]+ ± [0-9.]+ \(noise std\)", text), text[-3000:]
    assert re.search(r"releases seen\s+[1-9]\d*", text)
    assert not re.search(r"user-\d{5}", text)  # no visitor id in anything the demo prints


@slow_integration
def test_demo_uses_another_metrics_port_when_the_wanted_one_is_busy(live_demo):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        wanted = busy.getsockname()[1]
        demo = live_demo(["--duration", "0"], demo_env(wanted))  # until the Ctrl-C below
        demo.wait_for_first_release()
        used = re.search(rf"metrics port {wanted} is busy; using port (\d+) instead", demo.text)
        assert used, demo.text[-3000:]
        port = int(used.group(1))
        assert port != wanted
        assert f"metrics on http://127.0.0.1:{port}/metrics" in demo.text
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert b"dpstream_releases" in reply.read()
        os.killpg(os.getpgid(demo.proc.pid), signal.SIGINT)
        code = demo.finish()
    assert code == 130, demo.text[-3000:]  # 128 + SIGINT: Ctrl-C, as a shell expects
    assert "Traceback" not in demo.text, demo.text[-3000:]


@slow_integration
def test_ctrl_c_stops_the_demo_in_order_without_kafka_errors(live_demo):
    demo = live_demo(["--duration", "0"], demo_env(free_port()))
    demo.wait_for_first_release()
    time.sleep(1)  # a refresh or two, with the producer, the flow and the viewer all busy
    os.killpg(os.getpgid(demo.proc.pid), signal.SIGINT)  # what the terminal does on Ctrl-C
    code = demo.finish()
    text = demo.text
    assert code == 130, text[-3000:]  # 128 + SIGINT, after the orderly stop below
    summary = text[text.index("\nsummary\n"):]
    assert re.search(r"events sent\s+[1-9]\d*", summary), summary
    assert "malformed records sent" in summary
    assert re.search(r"flow exit code\s+0 \(stopped cleanly\)", summary), summary
    assert not KAFKA_ERRORS.search(text), text[-5000:]
    assert "Traceback" not in text, text[-5000:]
    # A Rust panic trace here would come from how `dpstream run` stops on SIGTERM (Bytewax turns
    # a KeyboardInterrupt into a panic), not from the demo: the demo only sends one SIGTERM.
    assert "panicked" not in text, text[-5000:]


# -- no broker needed ---------------------------------------------------------------------------


def test_a_busy_metrics_port_is_replaced_by_a_free_one(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        wanted = busy.getsockname()[1]
        assert not _port_is_free(wanted)
        monkeypatch.setenv("DPSTREAM_DEMO_METRICS_PORT", str(wanted))
        port, replaced = _metrics_port()
    assert replaced == wanted and port != wanted and _port_is_free(port)


def test_a_free_metrics_port_is_kept_and_zero_turns_metrics_off(monkeypatch):
    wanted = free_port()
    monkeypatch.setenv("DPSTREAM_DEMO_METRICS_PORT", str(wanted))
    assert _metrics_port() == (wanted, None)
    monkeypatch.setenv("DPSTREAM_DEMO_METRICS_PORT", "0")
    assert _metrics_port() == (0, None)


def test_a_release_row_says_what_its_numbers_are():
    body = {"key": "page-007", "step": 4, "value": 505.04, "std": 40.7,
            "privacy": {"accounting": "epsilon", "spent": 1.0, "budget": 1.0}}
    row = _release_line(body, step=4)
    assert re.match(r"\s+page-007\s+505.0 ± 40.7 \(noise std\)\s+privacy: 1 of 1 ε committed "
                    r"up front for all future releases of this key$", row), row
    assert "(as of step 3)" in _release_line(dict(body, step=3), step=4)
