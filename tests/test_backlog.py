"""Issue 22 item 6: a backlog (``flow.origin`` in the past) is closed in chunks written out as
they close, reported as a backlog, estimated up front, and a stop during it is prompt."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from bytewax.inputs import FixedPartitionedSource, StatefulSourcePartition
from bytewax.outputs import DynamicSink, StatelessSinkPartition
from bytewax.testing import run_main
from support.configs import counters, write
from support.messages import message

from dpstream.core.noise.keys import NoiseKey
from dpstream.kinds.counters.records import RecordEncoder
from dpstream.kinds.counters.shard import ShardState
from dpstream.metrics import FlowMetrics
from dpstream.platform import build_flow, parse_config
from dpstream.stream import operators
from dpstream.stream.clock import ShardUpdate

ORIGIN = 1_790_000_000  # 2026-09-21T14:13:20Z
KEYS = ["k1", "k2", "k3", "k4", "k5"]
BACKLOG = 5000  # steps between the origin and the first event


def config(shards: int = 2):
    return parse_config({
        "flow": {"name": "backlog", "origin": "2026-09-21T14:13:20Z", "step": "1s",
                 "shards": shards},
        "admission": {"mode": "declared", "keys": KEYS},
        "metrics": {"port": 0}})


def events() -> list:
    """One event per key, all at step BACKLOG: every earlier step closes at once."""
    return [message(0, k, ORIGIN + BACKLOG + 0.5, i) for i, k in enumerate(KEYS)]


class _Arrivals:
    """What the sink received, batch by batch, and when."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batches: list[tuple[float, list[Any]]] = []

    def count(self) -> int:
        with self.lock:
            return sum(len(b) for _, b in self.batches)


class _Sink(DynamicSink[Any]):
    def __init__(self, arrivals: _Arrivals) -> None:
        self.arrivals = arrivals

    def build(self, step_id: str, worker_index: int, worker_count: int
              ) -> StatelessSinkPartition[Any]:
        arrivals = self.arrivals

        class Part(StatelessSinkPartition[Any]):
            def write_batch(self, items: list[Any]) -> None:
                with arrivals.lock:
                    arrivals.batches.append((time.monotonic(), list(items)))

        return Part()


class _OpenSource(FixedPartitionedSource[Any, None]):
    """The events, then an open but idle input until ``expected`` records were written.

    (A bounded input ends with everything closed at once: the backlog must be closed while
    the input is open, as on Kafka.)
    """

    def __init__(self, items: list, arrivals: _Arrivals, expected: int, timeout: float) -> None:
        self.items, self.arrivals, self.expected = items, arrivals, expected
        self.timeout = timeout
        self.ended_at: float | None = None

    def list_parts(self) -> list[str]:
        return ["0"]

    def build_part(self, step_id: str, for_part: str, resume_state: None
                   ) -> StatefulSourcePartition[Any, None]:
        source = self
        deadline = time.monotonic() + self.timeout

        class Part(StatefulSourcePartition[Any, None]):
            sent = False

            def next_batch(self) -> list[Any]:
                if not self.sent:
                    self.sent = True
                    return list(source.items)
                if source.arrivals.count() >= source.expected or time.monotonic() > deadline:
                    source.ended_at = time.monotonic()
                    raise StopIteration
                time.sleep(0.01)
                return []

            def snapshot(self) -> None:
                return None

        return Part()


@pytest.mark.flow
def test_a_backlog_is_written_out_in_chunks_while_it_closes(monkeypatch):
    monkeypatch.setattr(operators, "BACKLOG_CHUNK_SECONDS", 0.02, raising=False)
    arrivals = _Arrivals()
    expected = BACKLOG * len(KEYS)  # the declared keys release at every step before BACKLOG
    source = _OpenSource(events(), arrivals, expected, timeout=120)
    metrics = FlowMetrics("backlog")
    started = time.monotonic()
    run_main(build_flow(config(), NoiseKey.for_tests(1), instance="i" * 32, partitions=1,
                        source=source, sink=_Sink(arrivals), metrics=metrics))
    releases = [item for _, batch in arrivals.batches for item in batch
                if item[0] == "releases"]
    assert len(releases) >= expected  # everything (the input ended once it was written)
    assert source.ended_at is not None and source.ended_at - started < 110
    sizes = [len(batch) for _, batch in arrivals.batches]
    # many chunks, each written as it closed; the first long before the last
    assert len(sizes) >= 5, sizes[:20]
    assert max(sizes) <= expected // 2, sizes[:20]
    assert metrics.registry.get_sample_value("dpstream_backlog_steps",
                                             {"flow": "backlog"}) == 0


def _records(chunk_seconds: float, monkeypatch) -> tuple[list, int]:
    """The records of a run whose input stays open until steps 0..399 were written."""
    monkeypatch.setattr(operators, "BACKLOG_CHUNK_SECONDS", chunk_seconds, raising=False)
    items = [message(0, k, ORIGIN + step + 0.5, i) for i, (step, k) in
             enumerate((s, k) for s in (3, 250, 251, 400) for k in KEYS[:3])]
    arrivals = _Arrivals()
    source = _OpenSource(items, arrivals, 400 * len(KEYS), timeout=60)
    run_main(build_flow(config(), NoiseKey.for_tests(2), instance="j" * 32, partitions=1,
                        source=source, sink=_Sink(arrivals)))
    return [item for _, batch in arrivals.batches for item in batch], len(arrivals.batches)


@pytest.mark.flow
def test_chunked_closing_publishes_the_same_records_byte_for_byte(monkeypatch):
    whole, _ = _records(float("inf"), monkeypatch)
    one_step_a_time, writes = _records(0.0, monkeypatch)
    assert len(whole) >= 400 * len(KEYS)
    assert writes > 100  # the steps were written a few at a time
    assert sorted(one_step_a_time) == sorted(whole)


def _update(partition: int, frontier: int, shard: int = 0) -> ShardUpdate:
    return ShardUpdate(shard=shard, partition=partition, frontier=frontier, increments={})


def test_a_snapshot_between_chunks_resumes_the_backlog_exactly():
    from dpstream.kinds.counters.kind import statistics_spec

    cfg = config(shards=1)
    spec = statistics_spec(cfg, "s" * 32)
    noise = NoiseKey.for_tests(4)

    def fresh(state=None):
        return ShardState(spec, 2, cfg.declared_layout, noise, state)

    whole = fresh()
    whole.update_batches(_update(0, 300))
    expected = whole.update_batches(_update(1, 300))
    assert [o.step for o in expected] == list(range(300))

    chunked = fresh()
    chunked.chunk_seconds = 0.0  # spent: the update closes nothing
    assert chunked.update_batches(_update(0, 300)) == []
    assert chunked.update_batches(_update(1, 300)) == []
    assert chunked.backlog() == 300
    got = []
    chunked.chunk_seconds = 1e-9  # one step a call
    for _ in range(100):
        got += chunked.close_backlog_batches()
    assert chunked.backlog() == 200
    resumed = fresh(chunked.to_state())  # a snapshot mid-backlog
    assert resumed.backlog() == 200
    resumed.chunk_seconds = None
    got += resumed.close_backlog_batches()
    assert resumed.backlog() == 0
    encoder = RecordEncoder("backlog", cfg.origin, 1.0, instance="s" * 32)
    assert [list(encoder.encode_step(o)) for o in got] == \
        [list(encoder.encode_step(o)) for o in expected]


def test_progress_tells_a_backlog_from_waiting_for_partitions():
    from dpstream.runner import progress_line

    metrics = FlowMetrics("p")
    metrics.observe_shard(0, 10, 0, 5000)
    line = progress_line(metrics.registry)
    assert "closing 5000 steps of backlog" in line and "waiting" not in line
    metrics.observe_shard(0, 5010, 7, 0)
    line = progress_line(metrics.registry)
    assert "7 steps waiting for input partitions" in line and "backlog" not in line


@pytest.mark.parametrize("lagging", [True, False])
def test_the_operator_reports_backlog_and_waiting_apart(lagging, monkeypatch):
    from dpstream.kinds.counters.kind import statistics_spec

    cfg = config(shards=1)
    shard = ShardState(statistics_spec(cfg, "s" * 32), 2, cfg.declared_layout,
                       NoiseKey.for_tests(4))
    seen: list = []

    class Observer(operators._Nobody):
        def observe_shard(self, shard, closed, pending, backlog=0):
            seen.append((pending, backlog))

    monkeypatch.setattr(operators, "BACKLOG_CHUNK_SECONDS", 0.0,
                        raising=False)  # one step an activation
    logic = operators._ShardLogic(shard, Observer(), lambda out: None)
    logic.on_batch([_update(0, 500), _update(1, 20 if lagging else 500)])
    # the first update closes nothing (one partition reported); the second has no time left
    assert seen[-1] == ((480, 20) if lagging else (0, 500))
    assert logic.notify_at() == operators._PAST  # the rest at the next activation
    logic.on_notify()
    assert seen[-1] == ((480, 19) if lagging else (0, 499))


# -- a real `dpstream run` over a backlog ----------------------------------------------------


def _run_config(path, broker, topics: dict[str, str], origin: str) -> None:
    write(path, counters(broker.bootstrap, topics, name="backlog-run", keys=KEYS,
                         flow={"origin": origin, "heartbeat": "1s"},
                         kafka={"tail": True, "startup_timeout": None},
                         privacy=None, counter=None))


@pytest.mark.integration
def test_sigterm_during_a_backlog_stops_a_real_run_within_10_s(broker, topic_factory, tmp_path):
    from dpstream.io.topics import produce, read_all

    topics = {role: topic_factory(1, role) for role in ("events", "releases", "alerts", "dead")}
    now = time.time()
    origin = datetime.fromtimestamp(now - 14 * 3600, UTC).replace(microsecond=0)
    _run_config(tmp_path / "b.toml", broker, topics,
                origin.isoformat().replace("+00:00", "Z"))
    produce(broker.bootstrap, topics["events"],
            [(None, json.dumps({"key": k, "ts": now}).encode(), int(now * 1000)) for k in KEYS])
    env = dict(os.environ, PYTHONUNBUFFERED="1", DPSTREAM_PROGRESS_SECONDS="1",
               DPSTREAM_NOISE_KEY="5e6f9d1c2b3a48577b0c1d2e3f40516"
                                  "2738495a6b7c8d9eafb0c1d2e3f405162")
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "dpstream.cli", "run", "--config",
                             str(tmp_path / "b.toml"), "--ephemeral"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # the first releases of the 50,400-step backlog are out long before the backlog is
        # closed (before: nothing for as long as closing all of it took)
        first = read_all(broker.bootstrap, topics["releases"], expect=len(KEYS), timeout=10)
        waited = time.monotonic() - started
        if proc.poll() is not None:
            pytest.fail(proc.communicate()[0].decode(errors="replace")[-4000:])
        time.sleep(1.5)  # a progress line or two
        asked = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # in the middle of the backlog
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - asked
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.decode(errors="replace")
    print(f"{len(first)} releases read {waited:.1f} s after the start; stopped {took:.1f} s "
          "after SIGTERM")
    assert first, f"no release within {waited:.1f} s of the start\n{text[-3000:]}"
    assert min(json.loads(r.value)["step"] for r in first) == 0
    assert proc.returncode == 0, text[-3000:]
    assert took < 10, f"{took:.1f} s to stop\n{text[-3000:]}"
    assert "closing a backlog of" in text, text[-3000:]
    assert re.search(r"backlog at start: 50,40\d steps from flow.origin to now x 5 declared "
                     r"keys = 252,0\d\d to close; about", text)  # the start-up log
    written = read_all(broker.bootstrap, topics["releases"], timeout=10)
    print(f"{len(written)} releases written")
    assert len(written) < 50_000 * len(KEYS)  # stopped in the middle of the backlog
    assert "closing" in text and "steps of backlog" in text  # the progress line


# -- check-config and the estimate ------------------------------------------------------------


def test_the_estimate_counts_steps_times_declared_keys_and_measures_the_rate():
    from dpstream.backlog import estimate

    cfg = config(shards=2)
    now = ORIGIN + 14 * 3600 + 0.5
    found = estimate(cfg, now=now)
    assert (found.steps, found.members, found.member_steps) == (50_400, 5, 252_000)
    assert found.seconds_per_step is not None and found.seconds_per_step > 0
    assert found.seconds == pytest.approx(50_400 * found.seconds_per_step)
    line = found.describe()
    assert line.startswith("backlog at start: 50,400 steps from flow.origin to now x 5 "
                           "declared keys = 252,000 to close; about ")
    assert "key-steps/s" in line and "measured in this process" in line
    assert estimate(cfg, now=ORIGIN - 10).describe() == \
        "backlog at start: none (flow.origin is not in the past)"
    unmeasured = estimate(cfg, now=now, measure=False)
    assert unmeasured.seconds is None and "about" not in unmeasured.describe()


def test_check_config_prints_the_backlog(tmp_path, capsys):
    from dpstream.cli import main

    origin = datetime.fromtimestamp(time.time() - 14 * 3600 - 30, UTC).replace(microsecond=0)
    path = tmp_path / "c.toml"
    path.write_text(f"""
[flow]
name = "c"
step = "1s"
origin = "{origin.isoformat().replace('+00:00', 'Z')}"
[admission]
mode = "declared"
keys = {json.dumps(KEYS)}
""")
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "backlog at start: 50,4" in out and " x 5 declared keys = 252," in out
    assert "key-steps/s" in out


@pytest.mark.integration
def test_a_backlog_stopped_midway_resumes_from_the_recovery_store(broker, topic_factory,
                                                                  tmp_path):
    """SIGTERM mid-backlog, restart on the same store: every step once, replays identical."""
    from dpstream.io.topics import produce, read_all

    topics = {role: topic_factory(1, role) for role in ("events", "releases", "alerts", "dead")}
    now = time.time()
    steps = 7200  # 2 h of 1 s steps
    origin = datetime.fromtimestamp(now - steps, UTC).replace(microsecond=0)
    _run_config(tmp_path / "r.toml", broker, topics, origin.isoformat().replace("+00:00", "Z"))
    produce(broker.bootstrap, topics["events"],
            [(None, json.dumps({"key": k, "ts": now}).encode(), int(now * 1000)) for k in KEYS])
    env = dict(os.environ, PYTHONUNBUFFERED="1", DPSTREAM_BACKLOG_CHUNK_SECONDS="0",
               DPSTREAM_INSTANCE_ID="ab" * 16,
               DPSTREAM_NOISE_KEY="5e6f9d1c2b3a48577b0c1d2e3f40516"
                                  "2738495a6b7c8d9eafb0c1d2e3f405162")
    command = [sys.executable, "-m", "dpstream.cli", "run", "--config", str(tmp_path / "r.toml"),
               "--recovery-dir", str(tmp_path / "recovery")]
    outputs = []
    for until in (len(KEYS), steps * len(KEYS)):
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        try:
            read_all(broker.bootstrap, topics["releases"], expect=until, timeout=120)
            proc.send_signal(signal.SIGTERM)
            outputs.append(proc.communicate(timeout=60)[0].decode(errors="replace"))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, outputs[-1][-3000:]
        if len(outputs) == 1:  # stopped in the middle of the backlog
            written = len(read_all(broker.bootstrap, topics["releases"], timeout=10))
            print(f"{written} releases before the restart")
            assert written < (steps - 100) * len(KEYS)
    assert "resumed" in outputs[1], outputs[1][-3000:]
    values: dict[tuple[str, int], set[bytes]] = {}
    for record in read_all(broker.bootstrap, topics["releases"], timeout=30):
        body = json.loads(record.value)
        values.setdefault((body["key"], body["step"]), set()).add(record.value)
    assert all((k, s) in values for k in KEYS for s in range(steps - 1))  # none skipped
    assert all(len(v) == 1 for v in values.values())  # a replayed step: byte for byte
