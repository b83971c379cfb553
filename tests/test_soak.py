"""A soak test: the counters flow under steady traffic, bad records, a broker outage and a restart.

One run of about two minutes, on its own embedded broker (a 3-partition input topic), that
combines what the other integration tests check one at a time:

* a producer thread writes good events at a steady rate (200/s) to partitions 0 and 1, with
  the producer timestamp equal to the event time (``flow.clock = "producer"``); partition 2
  gets no events, so the heartbeat ticks (``flow.heartbeat = "500ms"``) must keep the steps
  closing. Every event the broker acknowledged is recorded with its ``(partition, offset)``,
  key and step;
* bad records of every kind, at intervals: invalid JSON, not an object, key missing, key not a
  string, key too long (one of them a 900 KB record), a bad time, an event time before
  ``flow.origin``, a key outside ``admission.keys`` and an untrusted timestamp (a producer
  timestamp after the year 9999: Kafka 0.10+ always stamps records, so a record *without* a
  timestamp cannot be produced here). An event stamped a year in the future is *not* bad:
  it is placed ``flow.max_skew`` (5 min) ahead of its partition's latest tick, in a step that
  does not close during the run, and it moves no other record (only ticks move the clock);
* a broker outage. Tansu is memory-only, so a "broker restart" would lose every topic; the
  outage is simulated by SIGSTOP of the broker for 6 s, longer than the flow's
  ``message.timeout.ms`` (2 s), then SIGCONT. So that output is in flight when the broker
  stops, the flow is paused (SIGSTOP) for a second first, a bad record is written to the idle
  partition 2 meanwhile (the broker answers the flow's pending fetch with it), the broker is
  stopped, and only then the flow resumes: it reads the record, writes its dead letter (and
  the releases of the steps it closes) to a broker that does not answer;
* a SIGTERM of the flow midway and a restart with the same recovery directory, while the
  producer keeps producing;
* at the end the producer stops, and the flow runs until its releases cover every step up to
  one past the step of the moment the producer's last record was acknowledged (a heartbeat
  tick stamped after that lies after every event in each partition's offset order, so every
  event has been read by then), then SIGTERM.

Then: both runs exit 0 cleanly; every bad record has exactly one dead letter (de-duplicated on
its source: delivery is at least once) with the reason that was sent, the 900 KB one truncated;
every copy of a release is byte-identical; each key's last covered release is within 6 std of
its true count; the outage shows in the metrics and the logs.

No good event may come back as a *late* dead letter. With producer time, records of two
producers (the test's and the heartbeat) are not appended in timestamp order, and after the
outage both producers' queued records are appended in an arbitrary interleaving. Only the
heartbeat's ticks move the clock (stamped ``flow.tick_delay`` behind the flow host's clock),
and an event older than ``flow.lateness`` behind its partition's latest tick is counted in the
open step, never dropped as late; a ``flow.lateness`` longer than the outage keeps every
delayed event in its own step. The heartbeat drops ticks it cannot deliver within their
interval instead of appending them after an outage.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support.configs import counters, write
from support.flows import scrape

from dpstream.io.broker import EmbeddedBroker, free_port
from dpstream.io.topics import ensure_topics, read_all
from dpstream.stream.encoded import MAX_ORIGINAL_BYTES

pytestmark = [pytest.mark.soak, pytest.mark.slow]

NOISE_KEY = "5d1c9b7a3e8f402b6c1d9e0f7a8b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d"
ENV = dict(os.environ, PYTHONUNBUFFERED="1", DPSTREAM_NOISE_KEY=NOISE_KEY,
           DPSTREAM_PROGRESS_SECONDS="2", DPSTREAM_STALL_REPORT_SECONDS="5")
FLOW = "soak"
KEYS = ["k0", "k1", "k2", "k3", "k4"]
WEIGHTS = [5, 3, 2, 1, 1]  # distinct true counts per key
RATE = 200  # good events per second
LATENESS = 10  # seconds (= steps): records delayed by the outage still count
GOOD_PARTITIONS = (0, 1)  # partition 2 gets no events: heartbeats close its steps

# the timeline, in seconds after the producer started
PRODUCE_SECONDS = 95.0
OUTAGE_AT = 22.0
OUTAGE_SECONDS = 6.0
FLOW_PAUSE_SECONDS = 1.0
FIRST_STOP_AT = 45.0
RESTART_AT = 50.0

BAD_KEY = "field 'key' missing or not a non-empty string"
LONG_KEY = "field 'key' longer than 256 characters"
BAD_TIME = "field 'ts' missing or not a finite Unix time in seconds or an ISO-8601 string"
REASONS = {
    "invalid_json": "invalid JSON",
    "not_object": "not a JSON object",
    "key_missing": BAD_KEY,
    "key_not_string": BAD_KEY,
    "key_too_long": LONG_KEY,
    "huge": LONG_KEY,
    "bad_time": BAD_TIME,
    "before_origin": "event time before flow.origin",
    "undeclared": "key is not in admission.keys",
    "untrusted": "the record's timestamp is after the year 9999",
}
CYCLE = [k for k in REASONS if k != "huge"]
AFTER_YEAR_9999_MS = 253_402_300_800_000 + 1_000
HUGE_SIZE = 900_000


# --- the flow process ------------------------------------------------------------------------

def write_config(path: Path, bootstrap: str, origin: int, metrics_port: int) -> Path:
    topics = {"events": "events", "releases": "releases", "alerts": "alerts", "dead": "dead"}
    return write(path, counters(
        bootstrap, topics, name=FLOW, origin=origin, keys=KEYS,
        # producer time: records delayed by the outage still count; a future event is placed
        # 5 min ahead of the ticks: never covered here
        flow={"lateness": f"{LATENESS}s", "heartbeat": "500ms", "max_skew": "5m"},
        kafka={"batch_size": 200, "startup_timeout": "10s", "add_config": {
            "message.timeout.ms": "2000", "reconnect.backoff.max.ms": "500"}},
        metrics={"port": metrics_port, "exact_counts": True}))  # the tests read exact counts


class FlowRun:
    """One ``dpstream run`` child process, its output going to a file (no pipe to fill)."""

    def __init__(self, config: Path, recovery: Path, log: Path, port: int) -> None:
        self.log, self.port = log, port
        self._handle = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dpstream.cli", "run", "--config", str(config),
             "--recovery-dir", str(recovery), "--snapshot-interval", "0.5"],
            env=ENV, stdout=self._handle, stderr=subprocess.STDOUT, text=True)
        self.started = time.monotonic()
        self.stopped: float | None = None

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def scrape(self) -> dict[str, float]:
        return scrape(self.port)

    def stop(self, timeout: float = 40.0) -> str:
        """SIGTERM, wait for the exit; kill and fail if it does not come."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the flow did not stop within {timeout} s:\n{self.output[-3000:]}")
        finally:
            self._handle.close()
            self.stopped = time.monotonic()
        return self.output

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # in case it is paused
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._handle.close()


def metric(values: dict[str, float], name: str) -> float:
    return sum(v for k, v in values.items() if k == name or k.startswith(name + "{"))


def dead_letter_reasons(values: dict[str, float]) -> set[str]:
    """The ``reason`` labels of ``dpstream_dead_letters_total`` in a scrape."""
    found = set()
    for name in values:
        if name.startswith("dpstream_dead_letters_total{"):
            match = re.search(r'reason="((?:[^"\\]|\\.)*)"', name)
            if match:
                found.add(match.group(1).replace('\\"', '"').replace("\\\\", "\\"))
    return found


def wait_until(check, timeout: float, what: str, run: FlowRun | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        if run is not None and not run.alive():
            pytest.fail(f"the flow exited ({run.proc.returncode}) while waiting for {what}:\n"
                        f"{run.output[-3000:]}")
        time.sleep(0.3)
    tail = f"\n{run.output[-3000:]}" if run is not None else ""
    pytest.fail(f"timed out after {timeout} s waiting for {what}{tail}")


def sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


# --- the traffic -----------------------------------------------------------------------------

class Traffic(threading.Thread):
    """Good events at a steady rate plus scheduled bad records, all recorded by source offset."""

    def __init__(self, bootstrap: str, origin: int, schedule: list[tuple[float, str]]) -> None:
        super().__init__(name="soak-producer", daemon=True)
        self.bootstrap, self.origin = bootstrap, origin
        self.schedule = sorted(schedule)
        self.good: dict[tuple[int, int], tuple[str, int]] = {}  # source -> (key, step)
        self.bad: dict[tuple[int, int], tuple[str, bytes]] = {}  # source -> (kind, value)
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.halt = threading.Event()
        self.started_at: float | None = None  # monotonic
        self.done_at: float | None = None  # wall clock, after the final flush
        self.last_step = -1
        self.rng = random.Random(20251120)

    def producer(self):
        from confluent_kafka import Producer

        return Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 5,
                         "enable.idempotence": True,  # in order, once, across retries
                         "log_level": 3,  # librdkafka's own stderr lines: errors only
                         "message.max.bytes": 2_000_000})

    def step_of(self, stamp_ms: int) -> int:
        return (stamp_ms - self.origin * 1000) // 1000

    def report(self, record):
        def callback(error, message) -> None:
            with self.lock:
                if error is not None:
                    self.errors.append(f"{record}: {error}")
                    return
                source = (message.partition(), message.offset())
                if record[0] == "good":
                    self.good[source] = record[1:]
                else:
                    self.bad[source] = record[1:]
        return callback

    def send_good(self, producer, n: int, stamp_ms: int, ts: float | None = None,
                  step_ms: int | None = None) -> None:
        """A good event; ``step_ms``: where it counts if not at its stamp (recorded only)."""
        key = self.rng.choices(KEYS, WEIGHTS)[0]
        value = json.dumps({"key": key, "ts": stamp_ms / 1000 if ts is None else ts,
                            "seq": n}).encode()
        step = self.step_of(stamp_ms if step_ms is None else step_ms)
        self.last_step = max(self.last_step, self.step_of(stamp_ms))
        producer.produce("events", value, partition=GOOD_PARTITIONS[n % 2], timestamp=stamp_ms,
                         on_delivery=self.report(("good", key, step)))

    def bad_record(self, kind: str, stamp_ms: int) -> tuple[bytes, int]:
        """The value and timestamp of a bad record of ``kind``."""
        now = stamp_ms / 1000
        body: Any
        if kind == "invalid_json":
            return b'{"key": "k0", "ts": ', stamp_ms
        if kind == "not_object":
            return b"[1, 2, 3]", stamp_ms
        if kind == "key_missing":
            body = {"ts": now}
        elif kind == "key_not_string":
            body = {"key": 17, "ts": now}
        elif kind == "key_too_long":
            body = {"key": "k" * 300, "ts": now}
        elif kind == "huge":
            head = b'{"key": "'
            tail = f'", "ts": {now}}}'.encode()
            return head + b"x" * (HUGE_SIZE - len(head) - len(tail)) + tail, stamp_ms
        elif kind == "bad_time":
            body = {"key": "k1", "ts": "not a time"}
        elif kind == "before_origin":
            body = {"key": "k2", "ts": self.origin - 3600}
        elif kind == "undeclared":
            body = {"key": "intruder", "ts": now}
        elif kind == "untrusted":
            return json.dumps({"key": "k3", "ts": now}).encode(), AFTER_YEAR_9999_MS
        else:
            raise AssertionError(kind)
        return json.dumps(body).encode(), stamp_ms

    def send_bad(self, producer, kind: str, partition: int) -> None:
        value, stamp = self.bad_record(kind, int(time.time() * 1000))
        producer.produce("events", value, partition=partition, timestamp=stamp,
                         on_delivery=self.report(("bad", kind, value)))

    def run(self) -> None:
        producer = self.producer()
        producer.produce("warmup", b"")  # the producer id and metadata, before the clock runs
        if producer.flush(30):
            self.errors.append("the warm-up record was not acknowledged")
        self.started_at = start = time.monotonic()
        sent = 0
        bad_sent = 0
        try:
            while not self.halt.is_set():
                elapsed = time.monotonic() - start
                while sent < int(elapsed * RATE):
                    self.send_good(producer, sent, int(time.time() * 1000))
                    sent += 1
                while self.schedule and self.schedule[0][0] <= elapsed:
                    _, kind = self.schedule.pop(0)
                    if kind == "future":  # a year ahead: placed max_skew (300 s) ahead of
                        stamp = int(time.time() * 1000)  # the ticks: never covered here
                        self.send_good(producer, sent, stamp, ts=stamp / 1000 + 365 * 86400,
                                       step_ms=stamp + 290_000)
                        sent += 1
                    else:
                        self.send_bad(producer, kind, GOOD_PARTITIONS[bad_sent % 2])
                        bad_sent += 1
                producer.poll(0.005)
            left = producer.flush(60)
            if left:
                self.errors.append(f"{left} record(s) not acknowledged after 60 s")
        except Exception as exc:
            self.errors.append(f"producer thread: {exc!r}")
        self.done_at = time.time()


def schedule() -> list[tuple[float, str]]:
    plan = [(3.0 + 2.5 * i, CYCLE[i % len(CYCLE)])
            for i in range(int((PRODUCE_SECONDS - 6) / 2.5))]
    plan += [(8.2, "huge"), (12.3, "future"), (63.3, "future")]
    return plan


# --- the test --------------------------------------------------------------------------------

def test_soak_traffic_bad_records_outage_and_restart(tmp_path):
    began = time.monotonic()
    recovery = tmp_path / "recovery"
    with EmbeddedBroker() as broker:
        ensure_topics(broker.bootstrap, {"events": 3, "releases": 1, "alerts": 1, "dead": 1,
                                         "warmup": 1})
        origin = int(time.time()) - 4
        traffic = Traffic(broker.bootstrap, origin, schedule())
        runs: list[FlowRun] = []
        broker_paused = False
        figures: dict[str, Any] = {}
        try:
            traffic.start()
            wait_until(lambda: traffic.started_at is not None, 10, "the producer")
            t0 = traffic.started_at
            assert t0 is not None

            # run 1: up, then the outage
            port1 = free_port()
            first = FlowRun(write_config(tmp_path / "run1.toml", broker.bootstrap, origin,
                                         port1), recovery, tmp_path / "run1.log", port1)
            runs.append(first)
            wait_until(lambda: metric(first.scrape(), "dpstream_releases_total")
                       >= 3 * len(KEYS), 60, "the first releases", first)
            figures["first releases after"] = time.monotonic() - first.started
            sleep_until(t0 + OUTAGE_AT)

            from confluent_kafka import Producer

            trigger = Producer({"bootstrap.servers": broker.bootstrap, "linger.ms": 0,
                                "log_level": 3})
            os.kill(first.proc.pid, signal.SIGSTOP)  # the flow pauses ...
            try:
                stamp = int(time.time() * 1000)
                value = b'{"key": "k0", "ts": '  # ... a bad record reaches its fetch ...
                trigger.produce("events", value, partition=2, timestamp=stamp,
                                on_delivery=traffic.report(("bad", "invalid_json", value)))
                assert trigger.flush(10) == 0
                time.sleep(FLOW_PAUSE_SECONDS)
                os.kill(broker.pid, signal.SIGSTOP)  # ... the broker goes away ...
                broker_paused = True
                outage_began = time.monotonic()
                outage_steps = [math.floor(time.time() - origin)]
            finally:
                os.kill(first.proc.pid, signal.SIGCONT)  # ... and the flow writes to nobody
            pending_max = 0.0
            try:
                while time.monotonic() < outage_began + OUTAGE_SECONDS:
                    pending_max = max(pending_max, metric(
                        first.scrape(), "dpstream_output_pending_records"))
                    time.sleep(0.5)
            finally:
                os.kill(broker.pid, signal.SIGCONT)
                broker_paused = False
                outage_steps.append(math.floor(time.time() - origin))
            figures["outage seconds"] = time.monotonic() - outage_began
            figures["pending during outage (max)"] = pending_max

            def retried() -> float:
                return metric(first.scrape(), "dpstream_output_retries_total")

            retries = wait_until(retried, 30, "re-sent output records", first) \
                if pending_max == 0 else 0.0
            retries = max(retries, retried())

            def caught_up() -> bool:
                values = first.scrape()
                now_step = math.floor(time.time() - origin)
                return metric(values, "dpstream_closed_step") >= now_step - 3 - LATENESS and \
                    metric(values, "dpstream_output_pending_records") == 0

            wait_until(caught_up, 60, "the flow to catch up after the outage", first)
            figures["caught up after outage"] = time.monotonic() - outage_began - \
                OUTAGE_SECONDS
            sleep_until(t0 + FIRST_STOP_AT)
            last_scrape_1 = first.scrape()
            retries = max(retries, metric(last_scrape_1, "dpstream_output_retries_total"))
            figures["retries (run 1)"] = retries
            out1 = first.stop()
            figures["run 1 seconds"] = first.stopped - first.started  # type: ignore[operator]

            # run 2: the same recovery store, the producer never stopped
            sleep_until(t0 + RESTART_AT)
            port2 = free_port()
            second = FlowRun(write_config(tmp_path / "run2.toml", broker.bootstrap, origin,
                                          port2), recovery, tmp_path / "run2.log", port2)
            runs.append(second)
            figures["downtime seconds"] = second.started - first.stopped  # type: ignore[operator]
            sleep_until(t0 + PRODUCE_SECONDS)
            traffic.halt.set()
            traffic.join(90)
            assert not traffic.is_alive(), "the producer did not finish"
            assert traffic.done_at is not None
            target = math.floor(traffic.done_at - origin) + 1
            wait_until(lambda: metric(second.scrape(), "dpstream_closed_step") >= target, 90,
                       f"releases through step {target}", second)
            last_scrape_2 = second.scrape()
            out2 = second.stop()
            figures["run 2 seconds"] = second.stopped - second.started  # type: ignore[operator]
        finally:
            traffic.halt.set()
            if broker_paused:
                os.kill(broker.pid, signal.SIGCONT)
            for run in runs:
                run.kill()
            traffic.join(90)

        releases = [r.value for r in read_all(broker.bootstrap, "releases", timeout=60, idle=2)]
        dead = [json.loads(r.value) for r in read_all(broker.bootstrap, "dead", timeout=60,
                                                      idle=2)]
        alerts = read_all(broker.bootstrap, "alerts", timeout=10, idle=1)

    # --- both runs: clean exits, the expected log lines -------------------------------------
    assert not traffic.errors, traffic.errors[:10]
    for name, run, out in (("run 1", first, out1), ("run 2", second, out2)):
        assert run.proc.returncode == 0, f"{name} exited {run.proc.returncode}:\n{out[-3000:]}"
        assert "Traceback" not in out and "panicked" not in out, f"{name}:\n{out[-3000:]}"
        assert "stopping (SIGTERM)" in out, f"{name}:\n{out[-3000:]}"
        assert "progress:" in out, f"{name}:\n{out[-3000:]}"
    assert "re-sending" in out1 or "waiting" in out1, out1[-3000:]
    assert pending_max > 0 or retries > 0, (pending_max, retries, out1[-3000:])
    assert not alerts  # declared keys, no monitor

    # --- dead letters: one per bad record, with the reason sent; late good events apart ------
    by_source: dict[tuple[int, int], set[str]] = {}
    letters: dict[tuple[int, int], dict[str, Any]] = {}
    for body in dead:
        assert body["schema"] == "dpstream.dead_letter/1" and body["flow"] == FLOW
        assert body["source"]["topic"] == "events"
        source = (body["source"]["partition"], body["source"]["offset"])
        by_source.setdefault(source, set()).add(json.dumps(body, sort_keys=True))
        letters[source] = body
    assert all(len(copies) == 1 for copies in by_source.values())  # replays reproduce them
    late = {s for s, b in letters.items() if s in traffic.good}
    assert not late, f"{len(late)} good events were late despite flow.lateness"
    for source in late:
        assert letters[source]["reason"].startswith("late:"), letters[source]
    unexpected = set(letters) - late - set(traffic.bad)
    assert not unexpected, [letters[s] for s in sorted(unexpected)][:5]
    missing = set(traffic.bad) - set(letters)
    assert not missing, [traffic.bad[s][0] for s in sorted(missing)]
    sent_reasons = Counter(REASONS[kind] for kind, _ in traffic.bad.values())
    got_reasons = Counter(letters[s]["reason"] for s in traffic.bad)
    assert got_reasons == sent_reasons, (got_reasons, sent_reasons)
    for source, (kind, value) in traffic.bad.items():
        body = letters[source]
        assert body["reason"] == REASONS[kind], (kind, body["reason"])
        assert body["original_size"] == len(value)
        assert body["original_sha256"] == hashlib.sha256(value).hexdigest()
        kept = base64.b64decode(body["original_base64"])
        if kind == "huge":
            assert body["original_truncated"] is True
            assert len(value) == HUGE_SIZE and kept == value[:MAX_ORIGINAL_BYTES]
        else:
            assert body["original_truncated"] is False and kept == value
    kinds_sent = {kind for kind, _ in traffic.bad.values()}
    assert kinds_sent == set(REASONS), kinds_sent
    labels = dead_letter_reasons(last_scrape_1) | dead_letter_reasons(last_scrape_2)
    assert {REASONS[k].split(":")[0] for k in REASONS} <= labels, labels

    # --- releases: replays byte-identical, every step covered, the counts reflected ----------
    copies: dict[tuple[str, int], set[bytes]] = {}
    for raw in releases:
        body = json.loads(raw)
        assert body["schema"] == "dpstream.release/1", body
        copies.setdefault((body["key"], body["step"]), set()).add(raw)
    differing = {c: v for c, v in copies.items() if len(v) > 1}
    assert not differing, list(differing.items())[:3]
    assert {key for key, _ in copies} == set(KEYS)
    true_steps: dict[str, Counter[int]] = {key: Counter() for key in KEYS}
    for source, (key, step) in traffic.good.items():
        if source not in late:
            true_steps[key][step] += 1
    zs = []
    covered_through = {}
    for key in KEYS:
        last = -1
        while (key, last + 1) in copies:
            last += 1
        covered_through[key] = last
        assert last >= target, (key, last, target)
        release = json.loads(next(iter(copies[(key, last)])))
        truth = sum(n for step, n in true_steps[key].items() if step <= last)
        z = (release["value"] - truth) / release["std"]
        zs.append(z)
        assert abs(z) <= 6, (key, last, release["value"], truth, release["std"])
    assert abs(sum(zs) / len(zs)) < 1.5, zs

    total = time.monotonic() - began
    print(f"\nsoak summary ({total:.0f} s in all):")
    print(f"  good events acknowledged: {len(traffic.good)} (last step {traffic.last_step}), "
          f"of which late dead letters: {len(late)}")
    late_steps = Counter(traffic.good[s][1] for s in late)
    in_outage = sum(n for step, n in late_steps.items()
                    if outage_steps[0] <= step <= outage_steps[1])
    print(f"  late dead letters: {in_outage} stamped during the outage (steps "
          f"{outage_steps[0]}-{outage_steps[1]}), {len(late) - in_outage} elsewhere; by step "
          f"{dict(sorted(late_steps.items()))}")
    print(f"  bad records: {len(traffic.bad)} -> dead letters {len(dead)} "
          f"({len(dead) - len(letters)} duplicates); per reason "
          f"{dict(Counter(letters[s]['reason'].split(':')[0] for s in letters))}")
    print(f"  releases: {len(releases)} records, {len(copies)} coordinates "
          f"({len(releases) - len(copies)} duplicates, all byte-identical); covered through "
          f"step {min(covered_through.values())} (target {target})")
    print("  z = (value - true) / std at the last covered step: "
          + ", ".join(f"{k}={z:+.2f}" for k, z in zip(KEYS, zs, strict=True)))
    outage_lines = [line for line in out1.splitlines()
                    if "re-sending" in line or "waiting" in line and "acknowledge" in line]
    print(f"  outage: pending max {pending_max:.0f}, retries {retries:.0f}, "
          f"{len(outage_lines)} log line(s), first: {outage_lines[:1]}")
    for name, value in figures.items():
        shown = f"{value:.1f}" if isinstance(value, float) else value
        print(f"  {name}: {shown}")
