"""``dpstream demo``: the whole system on one machine, no Kafka of your own needed.

It starts the embedded Kafka-protocol broker, creates the topics, produces a
synthetic stream (page views of 300 pages with Zipf-like popularity, plus a few
malformed records that end up on the dead-letter topic), runs the counters
flow in a child process (``dpstream run``) and prints the releases and alerts
as they arrive, with a legend in plain words. The noise key is generated for this run only.
It also serves a live page (:class:`dpstream.web.LiveView`, on 127.0.0.1:8765 or a free port
when that is taken; ``web_port`` / ``$DPSTREAM_DEMO_WEB_PORT`` choose another, 0 turns it off)
with plots of a page's private count and its error band, the privacy budget spent per
mechanism (read from the flow's metrics, or from the releases when the metrics are off) and
the alerts.

``dpstream demo --unit user`` protects one visitor instead of one page view: the synthetic
page views name their visitor (field ``user``, 20,000 visitors of Zipf-like activity) and the
flow caps each visitor's contribution per period (:data:`USER_LEVEL_CONTRIBUTION`).

The broker and the flow run in sessions of their own, so a Ctrl-C in the terminal reaches the
demo only; the demo then stops everything in order (the producer, the flow, the viewer, and the
broker last) and prints a summary. SIGTERM and SIGHUP stop it the same way; a second signal
while stopping kills the flow instead of waiting for it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import os
import random
import shlex
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any, Final

from dpstream.errors import DpstreamError
from dpstream.web import LiveView

__all__ = ["demo_config", "run_demo", "synthetic_events"]

PAGES: Final = 300
DEFAULT_METRICS_PORT: Final = 9464
METRICS_PORT_ENV: Final = "DPSTREAM_DEMO_METRICS_PORT"
DEFAULT_WEB_PORT: Final = 8765
WEB_PORT_ENV: Final = "DPSTREAM_DEMO_WEB_PORT"
FLOW_STOP_TIMEOUT: Final = 20.0
"""Seconds the flow gets to stop after SIGTERM before it is killed."""
_REFRESH_SECONDS: Final = 2.0
_TOP: Final = 8

DEMO_CONFIG = """\
# Written by `dpstream demo`.
[flow]
name = "demo"
step = "1s"
origin = "{origin}"
lateness = "1s"
shards = 8
# Tansu, the embedded broker, ignores message.timestamp.type=LogAppendTime; the demo's own
# producer is the only one, so its record timestamps are trusted.
clock = "producer"

[kafka]
brokers = ["{bootstrap}"]
input_topic = "events"
releases_topic = "releases"
alerts_topic = "alerts"
dead_letter_topic = "dead-letters"
batch_size = 5000

[privacy]
accounting = "pure"
budget = 1.0
delta = 1e-6

[counter]
epsilon = 0.6
horizon = 65536

[monitor]
epsilon = 0.2
horizon = 3600

[admission]
mode = "open"
initial_epsilon = 0.2

[metrics]
port = {metrics_port}
{contribution}"""

USER_LEVEL_CONTRIBUTION = """
# `dpstream demo --unit user`: one visitor (not one page view) is protected. Per period of
# 10 steps a visitor counts on at most 4 pages, at most 5 views each; the noise scales by the
# caps (`dpstream check-config` prints the per-person guarantee and the noise std).
[contribution]
unit = "user"
user_field = "user"
period = "10s"
max_keys = 4
max_per_key = 5
"""
"""The demo's ``[contribution]`` table at ``unit = "user"`` (the event level has none)."""

VISITORS: Final = 20_000
"""Synthetic visitors of ``--unit user`` (Zipf-like activity: a few visit very often)."""

LEGEND = """\
How to read what follows
  * A release is one page's view count so far, with random noise added on purpose: the noise is
    what makes it private (no single page view can be told from the numbers). A page that is
    shown gets a fresh release every step (1 s of events); each refresh lists the top {top}.
  * "1234.5 ± 7.1 (noise std)": 7.1 is one standard deviation of that noise; the true count is
    usually within a few of those of the value shown.
  * "privacy: 1 of 1 ε committed up front ...": each page has a privacy budget ε (epsilon;
    smaller is more private). Its counter charges the whole budget with its first release, and
    that one charge covers every future release of the page: the budget is not running out.
  * Rare pages stay hidden: a page is shown only once a private threshold test says it has had
    enough views (that moment is its alert). Of the {pages} pages only the popular ones get there;
    hiding the rest is the privacy at work, not lost data.
  * Malformed records are not counted; they go to the dead-letter topic.{unit}
  * {metrics}{web}
"""

USER_LEVEL_LEGEND = """
  * Privacy unit: one visitor, not one page view (--unit user). Every 10 s period a visitor
    counts on at most 4 pages, at most 5 views each; views beyond that are dropped before
    counting, and the noise is scaled to what one whole visitor can change."""

# Runs the broker binary in a session (and process group) of its own: `EmbeddedBroker` starts
# its binary in the caller's process group, where the terminal's Ctrl-C would kill it first.
_SESSION_LAUNCHER = """\
#!/bin/sh
# Written by `dpstream demo`: starts the broker in a session of its own, so that a Ctrl-C in the
# terminal reaches the demo only, and the demo stops the broker last.
exec {python} -I -S -c 'import os, sys; os.setsid(); os.execv(sys.argv[1], sys.argv[1:])' \\
    {binary} "$@"
"""


def _say(*parts: object) -> None:
    """Print and flush; a closed terminal (SIGHUP) must not break the orderly stop."""
    with contextlib.suppress(OSError, ValueError):
        print(*parts, flush=True)


# -- the metrics port ---------------------------------------------------------------------------


def _port_is_free(port: int) -> bool:
    """Whether the flow's metrics server could bind ``port`` now (tried the way it binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server does
        try:
            sock.bind(("0.0.0.0", port))  # the flow serves its metrics on all interfaces
        except OSError:
            return False
    return True


def _metrics_port() -> tuple[int, int | None]:
    """Return ``(port, busy)``: the port for the flow's metrics and the busy one it replaces.

    The wanted port is ``$DPSTREAM_DEMO_METRICS_PORT`` or 9464; 0 turns the metrics off.
    """
    from dpstream.io.broker import free_port

    raw = os.environ.get(METRICS_PORT_ENV, "").strip()
    try:
        wanted = int(raw) if raw else DEFAULT_METRICS_PORT
    except ValueError:
        wanted = -1
    if not 0 <= wanted <= 65535:
        raise DpstreamError(f"{METRICS_PORT_ENV} must be a TCP port number (0 = no metrics), "
                            f"got {raw!r}")
    if wanted == 0 or _port_is_free(wanted):
        return wanted, None
    for _ in range(5):
        port = free_port()
        if _port_is_free(port):
            return port, wanted
    raise DpstreamError(f"metrics port {wanted} is busy and no free port was found")


# -- the live page ------------------------------------------------------------------------------


def _web_port(wanted: int | None) -> int:
    """The live page's port: ``wanted``, else ``$DPSTREAM_DEMO_WEB_PORT``, else 8765; 0 = off."""
    if wanted is None:
        raw = os.environ.get(WEB_PORT_ENV, "").strip()
        try:
            wanted = int(raw) if raw else DEFAULT_WEB_PORT
        except ValueError:
            wanted = -1
        if not 0 <= wanted <= 65535:
            raise DpstreamError(f"{WEB_PORT_ENV} must be a TCP port number (0 = no live page), "
                                f"got {raw!r}")
    elif not 0 <= wanted <= 65535:
        raise DpstreamError(f"the live page's port must be in 0..65535 (0 = off), got {wanted}")
    return wanted


def _start_live_view(port: int) -> LiveView | None:
    """Serve the live page on 127.0.0.1:``port`` (a free port when it is busy); 0: none."""
    if port == 0:
        return None
    live = LiveView(port=port, title="dpstream demo: page views, privately")
    try:
        live.start()
    except OSError:
        _say(f"live page port {port} is busy; using a free port instead "
             f"(set {WEB_PORT_ENV} to choose another)")
        live = LiveView(port=0, title=live.title)
        live.start()
    return live


def _budget_from_metrics(url: str) -> list[dict[str, Any]]:
    """Budget rows (mechanism, unit, spent, budget) from the flow's metrics; [] if unreadable.

    Reads ``dpstream_privacy_spent*`` and ``dpstream_privacy_budget*`` gauges, with the unit
    from their ``unit`` label or from a name suffix (``_epsilon``, ``_rho``), and keeps, per
    mechanism and unit, the largest value of any series.
    """
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            text = response.read().decode()
        families = list(text_string_to_metric_families(text))
    except (OSError, ValueError):
        return []
    found: dict[str, dict[tuple[str, str], float]] = {"spent": {}, "budget": {}}
    for family in families:
        for kind, values in found.items():
            prefix = f"dpstream_privacy_{kind}"
            if family.name != prefix and not family.name.startswith(prefix + "_"):
                continue
            for sample in family.samples:
                unit = sample.labels.get("unit") or family.name[len(prefix) + 1:]
                slot = (sample.labels.get("mechanism", ""), unit)
                if slot[0] and unit and sample.value >= values.get(slot, -1.0):
                    values[slot] = sample.value
    spent, budget = found["spent"], found["budget"]
    return [{"mechanism": m, "unit": u, "spent": spent[m, u], "budget": budget[m, u]}
            for m, u in sorted(spent) if (m, u) in budget]


# -- the synthetic stream and the viewer --------------------------------------------------------


def synthetic_events(rng: random.Random, count: int, now: float,
                     visitors: int | None = None) -> list[dict[str, Any]]:
    """``count`` synthetic page views at time ``now``: Zipf-like pages (and visitors).

    With ``visitors`` every event also names its visitor in field ``user`` (``user-00042``),
    drawn with Zipf-like activity over that many visitors, for ``--unit user``.
    """
    pages = rng.choices(_PAGE_NAMES, _PAGE_WEIGHTS, k=count)
    if visitors is None:
        return [{"key": page, "ts": now} for page in pages]
    weights = _visitor_weights(visitors)
    users = rng.choices(range(visitors), cum_weights=weights, k=count)
    return [{"key": page, "user": f"user-{user:05d}", "ts": now}
            for page, user in zip(pages, users, strict=True)]


_PAGE_NAMES: Final = [f"page-{i:03d}" for i in range(PAGES)]
_PAGE_WEIGHTS: Final = [1.0 / (i + 1) ** 1.1 for i in range(PAGES)]


@functools.cache
def _visitor_weights(visitors: int) -> list[float]:
    """Cumulative Zipf-like weights of the visitors (exponent 1)."""
    return list(itertools.accumulate(1.0 / (i + 1) for i in range(visitors)))


def _produce(bootstrap: str, rate: int, stop: threading.Event, sent: Counter[str],
             visitors: int | None = None) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20)
    rng = random.Random()
    tick = 0.05
    while not stop.is_set():
        started = time.monotonic()
        now = time.time()
        batch = max(1, int(rate * tick))
        for event in synthetic_events(rng, batch, now, visitors):
            producer.send("events", json.dumps(event).encode())
        sent["events"] += batch
        if rng.random() < 0.05:  # a malformed record now and then
            producer.send("events", b'{"key": 42, "ts": "yesterday"}')
            sent["malformed"] += 1
        time.sleep(max(0.0, tick - (time.monotonic() - started)))
    producer.flush(10)
    producer.close(5)


def _budget_unit(accounting: object) -> str:
    """The budget's unit as printed: the ledgers account in ``epsilon`` or ``rho`` (zCDP)."""
    return {"epsilon": "ε", "pure": "ε", "rho": "ρ (zCDP)"}.get(str(accounting), str(accounting))


def _release_line(body: dict[str, Any], step: int) -> str:
    """One row of a refresh: key, noisy value ± noise std, and the key's privacy commitment."""
    privacy = body.get("privacy") or {}
    when = f" (as of step {body['step']})" if int(body["step"]) != step else ""
    noise = f"± {float(body['std']):.1f} (noise std){when}"
    return (f"   {body['key']:<10} {float(body['value']):>12.1f} {noise:<20}  "
            f"privacy: {float(privacy.get('spent', 0)):g} of "
            f"{float(privacy.get('budget', 0)):g} {_budget_unit(privacy.get('accounting'))} "
            "committed up front for all future releases of this key")


def _visible_line(visible: int) -> str:
    return (f"   {visible} of {PAGES} pages visible; the others have too few events "
            "to be shown privately")


class _Viewer:
    """Reads the releases, alerts and dead letters; prints a refresh every two seconds."""

    def __init__(self, bootstrap: str, started: float, metrics: str,
                 live: LiveView | None = None, metrics_url: str | None = None,
                 unit: str = "event") -> None:
        self.bootstrap, self.started, self.metrics = bootstrap, started, metrics
        self.unit = unit
        self.live, self.metrics_url = live, metrics_url
        self.stop = threading.Event()
        self.latest: dict[str, dict[str, Any]] = {}
        self.seen: Counter[str] = Counter()
        self.first_release: float | None = None

    def run(self) -> None:
        from kafka import KafkaConsumer, TopicPartition

        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False,
                                 group_id=None, consumer_timeout_ms=500)
        parts = [TopicPartition(t, p) for t in ("releases", "alerts", "dead-letters")
                 for p in consumer.partitions_for_topic(t) or {0}]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        last_print = 0.0
        try:
            while not self.stop.is_set():
                self._poll(consumer, 300)
                if time.monotonic() - last_print >= _REFRESH_SECONDS and self.latest:
                    last_print = time.monotonic()
                    self._refresh()
                    self._update_budget()
            # Stopping: the flow has ended (or was killed), read what it published last.
            drain_until = time.monotonic() + 3
            while self._poll(consumer, 200) and time.monotonic() < drain_until:
                pass
        finally:
            consumer.close()

    def _poll(self, consumer: Any, timeout_ms: int) -> int:
        count = 0
        for records in consumer.poll(timeout_ms=timeout_ms).values():
            for record in records:
                count += 1
                self._take(record.topic, json.loads(record.value))
        return count

    def _take(self, topic: str, body: dict[str, Any]) -> None:
        live = self.live
        if topic == "alerts":
            self.seen["alerts"] += 1
            if live is not None:
                live.add_alert(body)
        elif topic == "dead-letters":
            self.seen["dead letters"] += 1  # operator data: never on the live page
        elif str(body.get("schema", "")).startswith("dpstream.release"):
            self.seen["releases"] += 1
            self.latest[body["key"]] = body
            if live is not None:
                live.add_release(body)
            if self.first_release is None:
                self.first_release = time.monotonic() - self.started
                web = f"\n  * Live plots in your browser: {live.url}" if live is not None else ""
                unit = USER_LEVEL_LEGEND if self.unit == "user" else ""
                _say("\n" + LEGEND.format(top=_TOP, pages=PAGES, metrics=self.metrics, web=web,
                                          unit=unit))
                _say(f"first release after {self.first_release:.1f} s")
        else:
            self.seen["status records"] += 1
            if live is not None:
                live.add_status(body)

    def _update_budget(self) -> None:
        """Give the live page the budget rows of the flow's metrics (if on and readable)."""
        if self.live is not None and self.metrics_url is not None:
            rows = _budget_from_metrics(self.metrics_url)
            if rows:
                self.live.set_budget(rows)

    def _refresh(self) -> None:
        top = sorted(self.latest.values(), key=lambda b: -float(b["value"]))[:_TOP]
        step = max(int(b["step"]) for b in self.latest.values())
        lines = [f"\n-- step {step}: {len(self.latest)} keys admitted, "
                 f"{self.seen['alerts']} alerts, {self.seen['dead letters']} dead letters, "
                 f"{self.seen['status records']} status records",
                 _visible_line(len(self.latest))]
        lines += [_release_line(body, step) for body in top]
        _say("\n".join(lines))


# -- the demo -----------------------------------------------------------------------------------


def _session_launcher(directory: Path, binary: Path) -> Path:
    """Write a launcher that runs ``binary`` in a new session; return its path."""
    launcher = directory / "tansu-in-own-session"
    launcher.write_text(_SESSION_LAUNCHER.format(python=shlex.quote(sys.executable),
                                                 binary=shlex.quote(str(binary))))
    launcher.chmod(launcher.stat().st_mode | stat.S_IXUSR)
    return launcher


class _Demo:
    def __init__(self, duration: float, rate: int, workers: int, web_port: int = 0,
                 unit: str = "event") -> None:
        self.duration, self.rate, self.workers = duration, rate, workers
        self.unit = unit
        self.web_port = web_port
        self.live: LiveView | None = None
        self.started = time.monotonic()
        self.interrupt = threading.Event()  # Ctrl-C, SIGTERM or SIGHUP: stop in order
        self.first_signal: int | None = None
        self.hurry = threading.Event()  # a second one: kill the flow, do not wait for it
        self.stopping = False
        self.sent: Counter[str] = Counter()
        self.producer_stop = threading.Event()
        self.producer: threading.Thread | None = None
        self.flow: subprocess.Popen[bytes] | None = None
        self.flow_killed = False
        self.flow_early = False
        self.viewer: _Viewer | None = None
        self.viewer_thread: threading.Thread | None = None

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if not self.interrupt.is_set():
            self.first_signal = signum
            self.interrupt.set()
        elif self.stopping and not self.hurry.is_set():
            self.hurry.set()
            _say("(second interrupt: the flow is killed instead of waiting for it)")

    def run(self) -> int:
        from dpstream.io.broker import EmbeddedBroker, find_tansu_binary
        from dpstream.io.topics import ensure_topics

        with tempfile.TemporaryDirectory(prefix="dpstream-demo-") as tmp:
            broker = EmbeddedBroker(binary=_session_launcher(Path(tmp), find_tansu_binary()))
            broker.start()  # an interrupt meanwhile only sets self.interrupt (see run_demo)
            try:
                _say(f"broker up at {broker.bootstrap} ({time.monotonic() - self.started:.1f} s)")
                if self.interrupt.is_set():
                    return self._finish(flow_started=False)
                ensure_topics(broker.bootstrap, {"events": 3, "releases": 3, "alerts": 1,
                                                 "dead-letters": 1})
                if self.interrupt.is_set():
                    return self._finish(flow_started=False)
                self._start(Path(tmp), broker.bootstrap)
                self._wait()
                self._stop()
                return self._finish(flow_started=True)
            finally:
                self._stop()  # idempotent; here only if something above raised
                broker.stop()  # last: everything else that talks to it has stopped

    def _start(self, tmp: Path, bootstrap: str) -> None:
        metrics_port, busy = _metrics_port()
        origin = datetime.fromtimestamp(int(time.time()), tz=UTC).isoformat().replace(
            "+00:00", "Z")
        config = tmp / "demo.toml"
        config.write_text(demo_config(origin, bootstrap, metrics_port, self.unit))
        if metrics_port:
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            metrics = f"Metrics (Prometheus, e.g. the privacy spent per page): {url}"
        else:
            url, metrics = "off", f"Metrics are off ({METRICS_PORT_ENV}=0)."
        if busy is not None:
            _say(f"metrics port {busy} is busy; using port {metrics_port} instead "
                 f"(set {METRICS_PORT_ENV} to choose another)")
        _say(f"configuration: {config} (metrics on {url})")
        self.live = _start_live_view(self.web_port)
        if self.live is not None:
            _say(f"live page: {self.live.url} (plots of a page's private count, the privacy "
                 "budget and the alerts)")
        env = dict(os.environ, DPSTREAM_NOISE_KEY=os.urandom(32).hex())
        self.flow = subprocess.Popen(
            [sys.executable, "-m", "dpstream.cli", "run", "--config", str(config),
             "--workers", str(self.workers), "--recovery-dir", str(tmp / "recovery")],
            env=env, stdin=subprocess.DEVNULL,
            start_new_session=True)  # the terminal's Ctrl-C is for the demo, which stops it
        self.producer = threading.Thread(target=_produce, name="demo-producer", daemon=True,
                                         args=(bootstrap, self.rate, self.producer_stop,
                                               self.sent,
                                               VISITORS if self.unit == "user" else None))
        self.viewer = _Viewer(bootstrap, self.started, metrics, self.live,
                              url if metrics_port else None, self.unit)
        self.viewer_thread = threading.Thread(target=self.viewer.run, name="demo-viewer",
                                              daemon=True)
        self.producer.start()
        self.viewer_thread.start()

    def _wait(self) -> None:
        assert self.flow is not None
        deadline = None if self.duration <= 0 else time.monotonic() + self.duration
        while deadline is None or time.monotonic() < deadline:
            if self.flow.poll() is not None:
                self.flow_early = True
                _say(f"the flow exited early with code {self.flow.returncode}")
                return
            left = 0.5 if deadline is None else min(0.5, max(0.0, deadline - time.monotonic()))
            if self.interrupt.wait(left):
                break
        _say("\nstopping: the producer, then the flow (up to "
             f"{FLOW_STOP_TIMEOUT:.0f} s), the viewer and the broker")

    def _stop(self) -> None:
        """Stop the producer, then the flow, then the viewer (the broker is the caller's)."""
        if self.stopping:
            return
        self.stopping = True
        logging.getLogger("kafka").setLevel(logging.CRITICAL)  # no client noise while stopping
        self.producer_stop.set()
        if self.producer is not None:
            self.producer.join(20)
        if self.flow is not None and self.flow.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.flow.send_signal(signal.SIGTERM)  # `dpstream run` stops cleanly on it
            deadline = time.monotonic() + FLOW_STOP_TIMEOUT
            while (self.flow.poll() is None and time.monotonic() < deadline
                   and not self.hurry.is_set()):
                time.sleep(0.1)
            if self.flow.poll() is None:
                if not self.hurry.is_set():
                    _say(f"the flow did not stop within {FLOW_STOP_TIMEOUT:.0f} s; killing it")
                self.flow_killed = True
                with contextlib.suppress(ProcessLookupError):
                    self.flow.kill()
                self.flow.wait()
        if self.viewer is not None and self.viewer_thread is not None:
            self.viewer.stop.set()
            self.viewer_thread.join(10)
        if self.live is not None:
            self.live.stop()

    def _finish(self, *, flow_started: bool) -> int:
        """Print the summary; return the demo's exit code."""
        viewer = self.viewer
        seen = viewer.seen if viewer is not None else Counter[str]()
        visible = len(viewer.latest) if viewer is not None else 0
        if self.flow is None:
            flow = "not started"
        else:
            code = self.flow.returncode
            flow = str(code)
            if self.flow_killed:
                flow += (" (killed on a second interrupt)" if self.hurry.is_set()
                         else f" (killed: it did not stop within {FLOW_STOP_TIMEOUT:.0f} s)")
            elif self.flow_early:
                flow += " (it exited by itself before the end)"
            elif code == 0:
                flow += " (stopped cleanly)"
        rows = [
            ("events sent", f"{self.sent['events']}"),
            ("malformed records sent", f"{self.sent['malformed']} (they go to the dead-letter "
                                       "topic, not into the counts)"),
            ("releases seen", f"{seen['releases']}"),
            ("alerts seen", f"{seen['alerts']} (pages that passed the threshold test)"),
            ("dead letters seen", f"{seen['dead letters']}"),
            ("pages visible", f"{visible} of {PAGES}"),
            ("flow exit code", flow),
        ]
        if seen["status records"]:
            rows.insert(5, ("status records seen", f"{seen['status records']}"))
        _say("\nsummary\n" + "\n".join(f"   {name:<24}{value}" for name, value in rows))
        if not flow_started:
            return 130
        if self.flow is None or self.flow.returncode != 0 or self.flow_early or self.flow_killed:
            return 1
        return 130 if self.first_signal == signal.SIGINT else 0  # Ctrl-C: 128 + SIGINT


@contextlib.contextmanager
def _stop_signals(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """Route SIGINT, SIGTERM and SIGHUP to ``handler`` (main thread only), then restore."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = [signal.SIGINT, signal.SIGTERM]
    if hasattr(signal, "SIGHUP"):
        names.append(signal.SIGHUP)
    previous = {signum: signal.signal(signum, handler) for signum in names}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def demo_config(origin: str, bootstrap: str, metrics_port: int, unit: str = "event") -> str:
    """The demo flow's TOML configuration (``unit``: ``event`` or ``user``)."""
    return DEMO_CONFIG.format(origin=origin, bootstrap=bootstrap, metrics_port=metrics_port,
                              contribution=USER_LEVEL_CONTRIBUTION if unit == "user" else "")


def run_demo(duration: float = 30.0, rate: int = 5_000, workers: int = 1,
             web_port: int | None = None, unit: str = "event") -> int:
    """Run the demo for ``duration`` seconds (0: until Ctrl-C); return an exit code.

    ``web_port`` is the live page's port on 127.0.0.1 (None: ``$DPSTREAM_DEMO_WEB_PORT`` or
    8765; a free port when it is busy; 0: no page). ``unit = "user"`` protects one visitor
    instead of one page view: the synthetic events name their visitor (field ``user``) and
    the flow bounds each visitor's contribution (:data:`USER_LEVEL_CONTRIBUTION`).

    Returns 0 when the flow ran and stopped cleanly (at the end of ``duration``, or on SIGTERM
    or SIGHUP), 130 when it did so after Ctrl-C (SIGINT) or was interrupted before the flow
    started, 1 when it failed or had to be killed.
    """
    if not (isinstance(rate, int) and rate >= 1):
        raise DpstreamError(f"the demo's rate must be an integer >= 1 event per second, got "
                            f"{rate!r}")
    if not (isinstance(workers, int) and workers >= 1):
        raise DpstreamError(f"the demo's workers must be an integer >= 1, got {workers!r}")
    if not duration >= 0 or duration == float("inf"):
        raise DpstreamError(f"the demo's duration must be a number of seconds >= 0 (0 = until "
                            f"Ctrl-C), got {duration!r}")
    if unit not in ("event", "user"):
        raise DpstreamError(f"the demo's unit must be 'event' or 'user', got {unit!r}")
    demo = _Demo(duration, rate, workers, _web_port(web_port), unit)
    kafka_log = logging.getLogger("kafka")
    kafka_level = kafka_log.level
    try:
        with _stop_signals(demo.on_signal):
            return demo.run()
    finally:
        kafka_log.setLevel(kafka_level)
