"""``dpstream tail`` and ``dpstream budget`` as a user runs them: subprocesses against the real
broker, a running flow's real metrics endpoint and a real Prometheus scraping it."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.request
from pathlib import Path

import orjson
import pytest
from prometheus_client import start_http_server
from test_client import (  # the flow and the records the client tests use
    ENV,
    HOT,
    INSTANCE,
    ORIGIN,
    STEPS,
    counters_values,
    flow_topics,
    produce_events,
    release_body,
    run_real_flow,
    write_flow_config,
)

from dpstream.core.counting import outputs as core
from dpstream.io.broker import free_port
from dpstream.io.topics import produce, read_all
from dpstream.kinds.counters.records import RecordEncoder
from dpstream.kinds.pmwg.metrics import register_metrics as pmwg_series
from dpstream.kinds.pmwg.shard import AnswerRecord
from dpstream.metrics import FlowMetrics

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).parent.parent
TAIL_TIMEOUT = 60


def dpstream(*args: str, timeout: float = TAIL_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpstream.cli", *args], env=ENV,
                          capture_output=True, timeout=timeout)


def status_record(step: int) -> bytes:
    """A budget-exhausted status of the first hot key, as the flow's encoder writes it."""
    encoder = RecordEncoder("it", ORIGIN, 1.0, instance=INSTANCE)
    return encoder.encode(core.BudgetExhausted(HOT[0], step, "counter", "budget exhausted",
                                               10.0, 10.0, "epsilon"))[2]


@pytest.fixture
def flow_run(broker, topic_factory, tmp_path) -> dict[str, str]:
    """A real counters flow's topics after a bounded run, a status, another flow's record."""
    topics = run_real_flow(broker, topic_factory, tmp_path)
    produce(broker.bootstrap, topics["releases"],
            [(HOT[0].encode(), status_record(STEPS)),
             (b"k1", counters_values(flow="other")["release"])])
    return topics


def test_tail_json_prints_each_record_once_as_published(broker, flow_run, tmp_path):
    releases = read_all(broker.bootstrap, flow_run["releases"], expect=STEPS * len(HOT) + 2)
    alerts = read_all(broker.bootstrap, flow_run["alerts"], expect=len(HOT))
    ours = [r.value for r in releases if json.loads(r.value)["flow"] == "it"]
    expected = len(ours) + len(alerts)

    out = dpstream("tail", "--brokers", broker.bootstrap, "--topic", flow_run["releases"],
                   "--topic", flow_run["alerts"], "--flow", "it", "--from-beginning", "--json",
                   "--max-records", str(expected))
    assert out.returncode == 0, out.stderr.decode()
    lines = out.stdout.splitlines()
    assert len(lines) == expected
    by_topic = {flow_run["releases"]: ours, flow_run["alerts"]: [a.value for a in alerts]}
    assert [line for line in lines if b'"dpstream.alert/1"' not in line] == ours
    assert [line for line in lines if b'"dpstream.alert/1"' in line] == by_topic[
        flow_run["alerts"]]
    assert all(json.loads(line)["flow"] == "it" for line in lines)

    # a restart's replay puts byte-identical copies on the topic: tail shows each record once
    produce(broker.bootstrap, flow_run["releases"],
            [(r.key, r.value) for r in releases[-len(HOT) - 2:-2]])
    config = write_flow_config(tmp_path / "tail.toml", broker, flow_run)  # flow "it"
    again = dpstream("tail", "--config", str(config), "--from-beginning", "--json",
                     "--timeout", "4")
    assert again.returncode == 0, again.stderr.decode()
    assert again.stdout.splitlines() == lines  # same records, same order, no copies
    summary = again.stderr.decode()
    assert "1 of other flows" in summary and f"{len(HOT)} duplicates" in summary, summary


def test_tail_table_appends_a_row_per_record_when_not_on_a_terminal(broker, flow_run):
    expected = STEPS * len(HOT) + len(HOT) + 1  # releases, alerts, the status
    out = dpstream("tail", "--brokers", broker.bootstrap, "--topic",
                   f"{flow_run['releases']},{flow_run['alerts']}", "--flow", "it",
                   "--from-beginning", "--max-records", str(expected), "--timeout", "30")
    assert out.returncode == 0, out.stderr.decode()
    text = out.stdout.decode()
    lines = text.splitlines()
    assert re.match(r"WHAT +KEY +VALUE +± STD +STEP +WINDOW END +PRIVACY +NOTE", lines[0])
    rows = [line.split() for line in lines[1:]]
    assert len(rows) == expected
    assert "\x1b[" not in text  # no terminal control codes in a pipe
    releases = [r for r in rows if r[0] == "release"]
    assert len(releases) == STEPS * len(HOT)
    last = [r for r in releases if r[4] == str(STEPS - 1)]
    assert sorted(r[1] for r in last) == HOT
    for row in last:  # release KEY VALUE STD STEP END PRIVACY...
        assert float(row[2]) == pytest.approx(40 * STEPS, abs=8 * float(row[3]))
        assert row[5] == "2026-09-21T14:13:32Z" and row[6:8] == ["10/10", "ε"]
    alerts = [r for r in rows if r[0] == "alert"]
    assert sorted(r[1] for r in alerts) == HOT and all(r[2] == "0" for r in alerts)
    status = [r for r in rows if r[0] == "status"]
    assert status == [["status", HOT[0], str(STEPS), "2026-09-21T14:13:33Z", "10/10", "ε",
                       "budget_exhausted:", "refused", "counter"]]


def read_screen(master: int, until, timeout: float) -> str:
    """Read a pseudo-terminal until ``until(text)`` holds; return what was read."""
    text, deadline = "", time.monotonic() + timeout
    while time.monotonic() < deadline and not until(text):
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                text += os.read(master, 65536).decode(errors="replace")
            except OSError:  # the child closed the terminal
                break
    return text


def test_tail_table_redraws_in_place_on_a_terminal_and_stops_cleanly_on_ctrl_c(broker,
                                                                                flow_run):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpstream.cli", "tail", "--brokers", broker.bootstrap,
         "--topic", flow_run["releases"], "--topic", flow_run["alerts"], "--flow", "it",
         "--from-beginning"], env=ENV, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    try:
        def complete(text: str) -> bool:
            screen = text.rsplit("\x1b[H\x1b[2J", 1)[-1]
            return "EXHAUSTED@12" in screen and "dropped" in screen
        text = read_screen(master, complete, 30)
        screen = text.rsplit("\x1b[H\x1b[2J", 1)[-1]
        assert complete(text), text[-3000:]
        rows = {line.split()[1]: line.split() for line in screen.splitlines()
                if line.startswith("release ")}
        assert sorted(rows) == HOT  # one row per key: its latest step, its alert
        for row in rows.values():
            assert row[4] == str(STEPS - 1) and "alert@0" in row
        assert "EXHAUSTED@12" in rows[HOT[0]]

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 130  # 128 + SIGINT: Ctrl-C, as a shell expects
        rest = read_screen(master, lambda t: "dpstream tail: read" in t, 5)
        assert "Traceback" not in text + rest and "dpstream tail: read" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_tail_stops_on_a_newer_schema_version_unless_told_to_skip(broker, topic_factory):
    topic = topic_factory(1, "v2")
    newer = orjson.dumps(release_body(schema="dpstream.release/2"))
    produce(broker.bootstrap, topic, [(None, counters_values()["release"]), (None, newer),
                                      (None, b"garbage")])
    strict = dpstream("tail", "--brokers", broker.bootstrap, "--topic", topic,
                      "--from-beginning", "--json", "--timeout", "10")
    assert strict.returncode == 2
    assert "dpstream.release/2" in strict.stderr.decode() and "upgrade" in strict.stderr.decode()
    assert strict.stdout.splitlines() == [counters_values()["release"]]

    lenient = dpstream("tail", "--brokers", broker.bootstrap, "--topic", topic,
                       "--from-beginning", "--json", "--timeout", "3", "--skip-unsupported")
    assert lenient.returncode == 0, lenient.stderr.decode()
    assert lenient.stdout.splitlines() == [counters_values()["release"]]
    assert "2 skipped (1 not JSON, 1 unsupported dpstream.release/2)" in lenient.stderr.decode()


def test_tail_names_what_is_missing(broker):
    out = dpstream("tail", "--brokers", broker.bootstrap, "--timeout", "1")
    assert out.returncode == 2 and "no topics" in out.stderr.decode()
    out = dpstream("tail", "--brokers", broker.bootstrap, "--topic", "absent", "--timeout", "1")
    assert out.returncode == 2 and "'absent'" in out.stderr.decode()
    assert "Traceback" not in out.stderr.decode()


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())


def test_tail_web_serves_the_live_view_of_the_records(broker, flow_run):
    rising = RisingSpend()  # with --metrics, the page shows the spend of these endpoints
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpstream.cli", "tail", "--brokers", broker.bootstrap, "--topic",
         flow_run["releases"], "--topic", flow_run["alerts"], "--flow", "it",
         "--from-beginning", "--web", "127.0.0.1:0", "--metrics", f"127.0.0.1:{rising.port}",
         "--timeout", "40"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = proc.stderr.readline().decode()
        match = re.search(r"live view at (http://\S+)", line)
        assert match, line + proc.stderr.read().decode()
        base = match.group(1).rstrip("/")
        expected = {"releases": STEPS * len(HOT), "alerts": len(HOT), "statuses": 1}

        def complete(state) -> bool:
            return all(state["counts"][k] == n for k, n in expected.items()) \
                and state["budget"]["source"] == "metrics"
        deadline, state = time.monotonic() + 20, get_json(base + "/state.json")
        while time.monotonic() < deadline and not complete(state):
            time.sleep(0.3)
            state = get_json(base + "/state.json")
        assert complete(state), state
        keys = {k["key"]: k for k in state["keys"]}
        assert sorted(keys) == HOT and all(k["alerted"] for k in keys.values())
        assert keys[HOT[0]]["exhausted"] and keys[HOT[0]]["last_step"] == STEPS - 1
        assert [r["mechanism"] for r in state["budget"]["rows"]] == ["pmwg histogram=sessions"]
        series = get_json(f"{base}/state.json?key={HOT[1]}")["series"]
        assert [p["step"] for p in series] == list(range(STEPS))
        with urllib.request.urlopen(base + "/", timeout=5) as page:
            assert page.status == 200 and b"<html" in page.read().lower()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=15)
        rising.close()
    assert proc.returncode == 130  # 128 + SIGINT: Ctrl-C


# -- budget --------------------------------------------------------------------------------------


def wait_for_metric(port: int, pattern: str, timeout: float = 60) -> str:
    """Poll a metrics endpoint until a line matches ``pattern``."""
    deadline, text = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
                text = reply.read().decode()
        except OSError:
            text = ""
        if re.search(pattern, text, re.M):
            return text
        time.sleep(0.2)
    raise AssertionError(f"no line matching {pattern!r} on :{port} within {timeout} s:\n"
                         f"{text[-2000:]}")


class RisingSpend:
    """A PMWG flow's metrics (a real FlowMetrics on a real endpoint) whose spend grows at RATE/s."""

    RATE = 0.01

    def __init__(self) -> None:
        self.metrics = FlowMetrics("sim")
        self.server, _ = start_http_server(0, addr="127.0.0.1", registry=self.metrics.registry)
        self.port = self.server.server_port
        self.stop = threading.Event()
        self.began = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        step = 0
        while not self.stop.wait(0.02):
            spent = 0.2 + self.RATE * (time.monotonic() - self.began)
            pmwg_series(self.metrics).observe_answers([AnswerRecord(
                "sessions", "pmwg", f"q{step}", step, 1000, "hard", 0.5, None, None, spent,
                1.0, step)])
            step += 1

    def run_out(self) -> None:
        """Publish a bottom answer: the histogram's budget is gone."""
        pmwg_series(self.metrics).observe_answers([AnswerRecord(
            "sessions", "pmwg", "last", 10**6, 1000, "bottom", None, None,
            "privacy budget exhausted", 1.0, 1.0, 0)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def running_flow(broker, topic_factory, tmp_path):
    """The counters flow running (tail = true) with its metrics endpoint; yields the port."""
    topics = flow_topics(topic_factory)
    produce_events(broker, topics["events"])
    port = free_port()
    config = write_flow_config(tmp_path / "m.toml", broker, topics, budget=12.0, tail=True,
                               metrics_port=port)
    proc = subprocess.Popen([sys.executable, "-m", "dpstream.cli", "run", "--config",
                             str(config), "--ephemeral"], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for_metric(port, r'^dpstream_releases_total\{.*flow="it".*\} [1-9]')
        yield port
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rows_of(out: subprocess.CompletedProcess) -> dict[tuple, dict]:
    assert out.returncode == 0, out.stderr.decode()
    data = json.loads(out.stdout)
    return {(r["flow"], r["mechanism"], r["scope"]): r for r in data["rows"]}


def test_budget_from_metrics_endpoints_and_from_prometheus(running_flow, prometheus_factory):
    flow_port, rising = running_flow, RisingSpend()
    try:
        prom = prometheus_factory([f"127.0.0.1:{flow_port}", f"127.0.0.1:{rising.port}"])

        # one sample of the flow's endpoint: spend and remaining, no burn rate
        rows = rows_of(dpstream("budget", "--metrics", f"127.0.0.1:{flow_port}", "--json"))
        counter = rows[("it", "tree-laplace", None)]
        assert (counter["spent"], counter["budget"], counter["unit"]) == (10.0, 12.0, "epsilon")
        assert counter["remaining"] == pytest.approx(2.0)
        assert counter["state"] == "committed"  # a counter pays up front: never "exhausted"
        table = dpstream("budget", "--metrics", f"http://127.0.0.1:{flow_port}/metrics")
        text = table.stdout.decode()
        assert table.returncode == 0 and "tree-laplace" in text and "committed up front" in text

        # two samples of an endpoint whose spend grows: the burn rate and the projection
        rows = rows_of(dpstream("budget", "--metrics", f"127.0.0.1:{rising.port}",
                                "--metrics", f"127.0.0.1:{flow_port}", "--interval", "2",
                                "--json"))
        sim = rows[("sim", "pmwg", "histogram=sessions")]
        assert sim["state"] == "spending" and sim["budget"] == 1.0
        assert sim["burn_rate"] == pytest.approx(RisingSpend.RATE, rel=0.25)
        assert sim["exhaustion_seconds"] == pytest.approx(sim["remaining"] / sim["burn_rate"])
        assert rows[("it", "tree-laplace", None)]["burn_rate"] == 0.0
        text = dpstream("budget", "--metrics", f"127.0.0.1:{rising.port}").stdout.decode()
        assert "unknown (sample twice: --interval SECONDS)" in text

        # Prometheus: the burn rate over a window
        prom.wait_for('count_over_time(dpstream_histogram_privacy_spent{flow="sim"}[10s])',
                      lambda r: len(r) == 1 and r[0][1] >= 4, timeout=30)
        prom.wait_for('dpstream_privacy_spent{flow="it"}', timeout=30)
        rows = rows_of(dpstream("budget", "--prometheus", prom.url, "--window", "10s",
                                "--json"))
        sim = rows[("sim", "pmwg", "histogram=sessions")]
        assert sim["burn_rate"] == pytest.approx(RisingSpend.RATE, rel=0.25)
        assert 0 < sim["exhaustion_seconds"] < 1.0 / RisingSpend.RATE
        counter = rows[("it", "tree-laplace", None)]
        assert (counter["spent"], counter["remaining"], counter["burn_rate"]) == (10.0, 2.0, 0.0)
        only = rows_of(dpstream("budget", "--prometheus", prom.url, "--flow", "sim", "--json"))
        assert {flow for flow, _, _ in only} == {"sim"}

        # a bottom answer: the flow says the mechanism stopped for want of budget
        rising.run_out()
        rows = rows_of(dpstream("budget", "--metrics", f"127.0.0.1:{rising.port}", "--json"))
        assert rows[("sim", "pmwg", "histogram=sessions")]["state"] == "stopped"
        text = dpstream("budget", "--metrics", f"127.0.0.1:{rising.port}").stdout.decode()
        assert "STOPPED" in text
    finally:
        rising.close()


def test_budget_names_an_endpoint_it_cannot_read():
    out = dpstream("budget", "--metrics", f"127.0.0.1:{free_port()}")
    assert out.returncode == 2 and "cannot read the metrics endpoint" in out.stderr.decode()
    out = dpstream("budget", "--prometheus", f"http://127.0.0.1:{free_port()}")
    assert out.returncode == 2 and "cannot read the Prometheus" in out.stderr.decode()
