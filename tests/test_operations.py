"""The counters flow as a user meets it (issue 6): faults, stalls, stops and start-up, for real.

Each test runs ``dpstream run`` (or ``python -m bytewax.run``) as a child process against the
embedded Kafka-protocol broker, and checks what the user sees: the records, the exit code, the
log lines and the metrics.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.configs import counters, write
from support.flows import scrape

from dpstream.io.broker import EmbeddedBroker, free_port
from dpstream.io.topics import produce, read_all
from dpstream.messages import TICK
from dpstream.stream.encoded import MAX_ORIGINAL_BYTES

pytestmark = [pytest.mark.integration]

KEY = "7b3f0e9a1c5d4e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6b"
ENV = dict(os.environ, PYTHONUNBUFFERED="1", DPSTREAM_NOISE_KEY=KEY,
           DPSTREAM_STALL_REPORT_SECONDS="2", DPSTREAM_PROGRESS_SECONDS="2")
KEYS = ["a", "b", "c"]


def now_origin() -> int:
    return int(time.time()) - 5


def write_config(path: Path, bootstrap: str, topics: dict[str, str], *, origin: int,
                 tail: bool = True, heartbeat: str = "off", metrics_port: int = 0,
                 kafka: dict | None = None, name: str = "ops", steps: int | None = None) -> Path:
    """``steps``: flow.end is ``origin + steps`` (a bounded producer-clock run needs it);
    ``kafka``: settings of the kafka table added or replaced."""
    return write(path, counters(
        bootstrap, topics, name=name, origin=origin, steps=steps, keys=KEYS,
        flow={"heartbeat": heartbeat},
        kafka={"tail": tail, "batch_size": 200, **(kafka or {})},
        metrics={"port": metrics_port, "exact_counts": True}))  # the tests read exact counts


def make_topics(topic_factory, partitions: int = 3) -> dict[str, str]:
    return {"events": topic_factory(partitions, "events"), "releases": topic_factory(1, "rel"),
            "alerts": topic_factory(1, "alerts"), "dead": topic_factory(1, "dead")}


def event(key: str, ts: float) -> tuple[None, bytes, int]:
    return None, json.dumps({"key": key, "ts": ts}).encode(), int(ts * 1000)


def tick(ts: float) -> tuple[bytes, bytes, int]:
    """A heartbeat tick stamped ``ts``: under the producer clock only ticks close steps."""
    return b"dpstream.tick", TICK, int(ts * 1000)


def start(config: Path, *args: str, env: dict[str, str] | None = None,
          **kwargs) -> subprocess.Popen:
    if "--recovery-dir" not in args:
        args = (*args, "--ephemeral")
    return subprocess.Popen([sys.executable, "-m", "dpstream.cli", "run", "--config",
                             str(config), *args], env=env or ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> str:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the flow did not stop within {timeout} s:\n{out[-3000:]}")
    return out


def metric(values: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in values.items() if k.startswith(prefix + "{") or k == prefix)


def wait_until(check, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the flow exited ({proc.returncode}) while waiting for {what}:\n"
                        f"{proc.communicate()[0][-3000:]}")
        time.sleep(0.3)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def assert_clean(out: str) -> None:
    assert "panicked" not in out and "Traceback" not in out, out[-3000:]


# --- item 1: a large bad record -------------------------------------------------------------

def test_a_huge_bad_record_becomes_a_small_dead_letter(broker, topic_factory, tmp_path):
    topics = make_topics(topic_factory, partitions=1)
    origin = now_origin()
    huge = b'{"key": "' + b"x" * 900_000 + b'", "ts": "not a time"}'
    produce(broker.bootstrap, topics["events"],
            [event("a", origin + 0.5), (None, huge, (origin + 1) * 1000), event("b", origin + 2.5)])
    config = write_config(tmp_path / "c.toml", broker.bootstrap, topics, origin=origin,
                          tail=False, steps=3)
    proc = start(config)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    [dead] = read_all(broker.bootstrap, topics["dead"], expect=1, timeout=30)
    body = json.loads(dead.value)
    assert len(dead.value) < 2 * MAX_ORIGINAL_BYTES
    assert body["original_size"] == len(huge) and body["original_truncated"] is True
    assert len(body["original_sha256"]) == 64
    releases = read_all(broker.bootstrap, topics["releases"], timeout=30, idle=1)
    assert {json.loads(r.value)["step"] for r in releases} == {0, 1, 2}
    assert "input ended:" in out  # the one-line summary of a bounded input


# --- item 2: idle partitions, far-future events -----------------------------------------

def test_an_idle_partition_is_reported_and_the_heartbeat_moves_it(broker, topic_factory,
                                                                 tmp_path):
    topics = make_topics(topic_factory, partitions=3)
    origin = now_origin()
    produce(broker.bootstrap, topics["events"],
            [event(k, time.time()) for k in KEYS for _ in range(5)], partition=0)
    produce(broker.bootstrap, topics["events"], [event("a", time.time())], partition=1)
    for partition in (0, 1):  # ticks (another writer's) move partitions 0 and 1, not 2
        produce(broker.bootstrap, topics["events"], [tick(time.time())], partition=partition)
    port = free_port()
    config = write_config(tmp_path / "idle.toml", broker.bootstrap, topics, origin=origin,
                          metrics_port=port)
    proc = start(config)
    try:  # without heartbeats partition 2 holds every step open, and says so
        def read_and_waiting() -> dict[str, float] | None:
            values = scrape(port)
            done = metric(values, "dpstream_events_total") == 3 * 5 + 1  # both partitions read
            return values if done and metric(values, "dpstream_steps_pending") > 0 else None

        values = wait_until(read_and_waiting, 60, "steps pending", proc)
        assert metric(values, "dpstream_releases_total") == 0
        # partitions are named topic[partition] (issue 22 item 9)
        assert (f'dpstream_partition_frontier_step{{flow="ops",partition="{topics["events"]}[0]"}}'
                in values)
        time.sleep(2 * float(ENV["DPSTREAM_STALL_REPORT_SECONDS"]))  # the report's interval
    finally:
        out = stop(proc)
    assert proc.returncode == 0
    assert_clean(out)
    assert f"wait for input partition(s) {topics['events']}[2]" in out, out[-3000:]

    # the same flow with heartbeats: partition 2 moves by the ticks alone
    hb_topics = dict(topics, releases=topic_factory(1, "rel2"))
    config = write_config(tmp_path / "hb.toml", broker.bootstrap, hb_topics, origin=origin,
                          heartbeat="500ms")
    proc = start(config)
    try:
        releases = wait_until(
            lambda: read_all(broker.bootstrap, hb_topics["releases"], timeout=5, idle=0.5), 60,
            "releases with heartbeats", proc)
        assert {json.loads(r.value)["key"] for r in releases} <= set(KEYS)
    finally:
        out = stop(proc)
    assert proc.returncode == 0
    assert "heartbeat: a tick" in out
    dead = read_all(broker.bootstrap, topics["dead"], timeout=3, idle=0.5)
    assert not dead  # ticks are not dead letters


def test_a_far_future_event_time_does_not_stop_the_releases(broker, topic_factory, tmp_path):
    topics = make_topics(topic_factory, partitions=1)
    origin = now_origin()
    year = 365 * 86400
    messages = [event("a", origin + 0.5), event("b", origin + 1.5)]
    body = json.dumps({"key": "c", "ts": origin + 2.5 + year}).encode()
    messages.append((None, body, (origin + 2) * 1000 + 500))  # stamped a year ahead
    messages += [event(k, origin + s + 0.5) for s in range(3, 6) for k in KEYS]
    produce(broker.bootstrap, topics["events"], messages)
    config = write_config(tmp_path / "f.toml", broker.bootstrap, topics, origin=origin,
                          tail=False, steps=6)
    proc = start(config)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    releases = [json.loads(r.value) for r in
                read_all(broker.bootstrap, topics["releases"], timeout=30, idle=1)]
    assert {r["step"] for r in releases} == set(range(6))  # the run ends at flow.end
    assert len(releases) == 6 * len(KEYS)
    # no tick preceded it, so it was placed by its own time: after flow.end, a dead letter
    [dead] = read_all(broker.bootstrap, topics["dead"], expect=1, timeout=30)
    assert json.loads(dead.value)["reason"].startswith("after flow.end")


def test_producer_clock_on_the_embedded_broker_a_record_an_hour_ahead_moves_nothing(
        broker, topic_factory, tmp_path):
    """Issue 22, items 4 and 9, as a user runs it: a tailing producer-clock flow with the
    default heartbeat (ticks stamped flow.tick_delay behind this host's clock), live events
    on both partitions, one of them stamped an hour ahead. No event is late, no step beyond
    the ticks closes, and the progress line never reads "-3585 s behind the clock"."""
    topics = make_topics(topic_factory, partitions=2)
    origin = now_origin()
    port = free_port()
    config = write_config(tmp_path / "live.toml", broker.bootstrap, topics, origin=origin,
                          heartbeat="auto", metrics_port=port)
    proc = start(config)
    try:
        sent = 0
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            now = time.time()
            batch = [event(KEYS[i % 3], now) for i in range(20)]
            if sent == 40:
                batch.append(event("a", now + 3600))  # an hour ahead
            for partition in (0, 1):
                produce(broker.bootstrap, topics["events"], batch, partition=partition)
            sent += 20
            time.sleep(0.2)
        wait_until(lambda: metric(scrape(port), "dpstream_releases_total") >= 3 * len(KEYS),
                   60, "releases", proc)
        time.sleep(3)  # a progress line (every 2 s here) after the future record was read
        values = scrape(port)
        closed = metric(values, "dpstream_closed_step")
        assert closed <= time.time() - origin  # no step in the future closed
        events = metric(values, "dpstream_events_total")
    finally:
        out = stop(proc)
    assert proc.returncode == 0
    assert_clean(out)
    assert "stamped 2 s behind this host's clock (flow.tick_delay)" in out
    assert not re.search(r"-\d+ s behind the clock", out), out[-3000:]
    dead = read_all(broker.bootstrap, topics["dead"], timeout=3, idle=0.5)
    assert not dead, [json.loads(d.value)["reason"] for d in dead]  # nothing late, no loss
    assert events >= 2 * sent  # every event read was counted (the future one too)


# --- items 3, 6, 9: stop cleanly, resume, consumer group ------------------------------------

def test_sigterm_and_sigint_stop_cleanly_and_the_group_shows_the_position(broker, topic_factory,
                                                                         tmp_path):
    from confluent_kafka import Consumer, TopicPartition

    topics = make_topics(topic_factory, partitions=1)
    origin = now_origin()
    produce(broker.bootstrap, topics["events"],
            [event(k, origin + s + 0.5) for s in range(6) for k in KEYS] + [tick(origin + 6)])
    config = write_config(tmp_path / "s.toml", broker.bootstrap, topics, origin=origin)
    recovery = tmp_path / "recovery"
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc = start(config, "--recovery-dir", str(recovery), "--snapshot-interval", "0.5")
        wait_until(lambda: read_all(broker.bootstrap, topics["releases"], timeout=5, idle=0.5),
                   60, "releases", proc)
        time.sleep(1.5)  # a snapshot commits the position
        out = stop(proc, sig, timeout=20)
        assert proc.returncode == (130 if sig == signal.SIGINT else 0), out[-3000:]
        assert_clean(out)
        assert "stopped; a restart resumes from the recovery store" in out
    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "dpstream.ops"})
    try:
        [committed] = consumer.committed([TopicPartition(topics["events"], 0)], timeout=10)
    finally:
        consumer.close()
    assert committed.offset == 6 * len(KEYS) + 1  # lag tools see the position (events, tick)
    releases = read_all(broker.bootstrap, topics["releases"], timeout=10, idle=1)
    by_coordinate = values_by_coordinate(releases)
    assert all(len(v) == 1 for v in by_coordinate.values())  # duplicates are byte-identical


# --- item 9: a broker outage longer than the message timeout ---------------------------------

BACKLOG_STEPS = 20_000


def backlog_flow(own: EmbeddedBroker, tmp_path: Path) -> tuple[Path, int]:
    """A backlog of BACKLOG_STEPS steps on ``own`` broker, and a flow config that reads it in
    small batches (so output is written for a while) with a 2 s message timeout."""
    from dpstream.io.topics import ensure_topics

    topics = {"events": "events", "releases": "releases", "alerts": "alerts", "dead": "dead"}
    ensure_topics(own.bootstrap, {"events": 1, "releases": 1, "alerts": 1, "dead": 1})
    origin = now_origin() - BACKLOG_STEPS
    # a tick at each step's start (as the heartbeat of a flow that was running would have
    # written them): the flow closes the steps as it reads, the last one stays open
    produce(own.bootstrap, "events",
            [m for s in range(BACKLOG_STEPS)
             for m in [tick(origin + s)] + [event(k, origin + s + 0.5) for k in KEYS]])
    port = free_port()
    config = write_config(tmp_path / "o.toml", own.bootstrap, topics, origin=origin,
                          metrics_port=port, kafka={"batch_size": 20, "add_config": {
                              "message.timeout.ms": "2000", "reconnect.backoff.max.ms": "500"}})
    return config, port


def values_by_coordinate(records) -> dict[tuple[str, int], set[bytes]]:
    """Every distinct release value of each (key, step)."""
    grouped: dict[tuple[str, int], set[bytes]] = {}
    for r in records:
        body = json.loads(r.value)
        grouped.setdefault((body["key"], body["step"]), set()).add(r.value)
    return grouped


def test_a_broker_outage_longer_than_the_message_timeout_loses_no_release(tmp_path):
    steps = BACKLOG_STEPS
    with EmbeddedBroker() as own:
        config, port = backlog_flow(own, tmp_path)
        expected = (steps - 1) * len(KEYS)  # tailing: the last step stays open
        proc = start(config)
        try:
            wait_until(lambda: metric(scrape(port), "dpstream_releases_total") >= 3000,
                       60, "the first releases", proc)
            os.kill(own.pid, signal.SIGSTOP)  # the broker is away for 3x the message timeout
            try:
                time.sleep(6)
                during = scrape(port)
            finally:
                os.kill(own.pid, signal.SIGCONT)
            assert metric(during, "dpstream_output_pending_records") > 0  # output was waiting
            wait_until(lambda: metric(scrape(port), "dpstream_output_delivered_total")
                       >= expected, 180, "every release delivered", proc)
            values = scrape(port)
            assert metric(values, "dpstream_output_retries_total") > 0  # re-sent, not lost
            assert metric(values, "dpstream_output_pending_records") == 0
        finally:
            out = stop(proc)
        assert proc.returncode == 0, out[-3000:]
        assert_clean(out)
        assert "re-sending (the snapshot waits for them)" in out
        releases = read_all(own.bootstrap, "releases", timeout=60, expect=expected)
        coordinates = set(values_by_coordinate(releases))
        assert coordinates == {(k, s) for k in KEYS for s in range(steps - 1)}
        kafka_lines = [line for line in out.splitlines() if "dpstream.kafka" in line]
        assert len(kafka_lines) < 60, kafka_lines[:80]  # librdkafka's logs, rate-limited


# --- items 5, 8, 10: start-up --------------------------------------------------------------

def test_startup_errors_are_one_clear_line(broker, topic_factory, tmp_path):
    topics = make_topics(topic_factory, partitions=1)
    origin = now_origin()
    missing = dict(topics, events="no-such-topic")
    out = subprocess.run([sys.executable, "-m", "dpstream.cli", "run", "--ephemeral",
                          "--config", str(write_config(tmp_path / "m.toml", broker.bootstrap,
                                                       missing, origin=origin))],
                         env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "'no-such-topic'" in out.stderr and "dpstream topics --config" in out.stderr
    assert "Traceback" not in out.stderr

    nobody = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "dpstream.cli", "run", "--ephemeral",
                          "--config", str(write_config(tmp_path / "n.toml", nobody, topics,
                                                       origin=origin))],
                         env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"cannot reach a Kafka broker at {nobody} after 5 s" in out.stderr
    assert "waiting for Kafka" in out.stderr  # each attempt was logged
    assert time.monotonic() - started < 40

    with socket.socket() as busy:  # two flows, one metrics port
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "dpstream.cli", "run", "--ephemeral",
                              "--config", str(write_config(tmp_path / "p.toml",
                                                           broker.bootstrap, topics,
                                                           origin=origin, metrics_port=port))],
                             env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"metrics port {port} is in use" in out.stderr and "Traceback" not in out.stderr


def test_the_start_up_lookup_uses_the_flows_client_settings(broker, topic_factory, tmp_path):
    """One client configuration for every connection: add_config reaches the partition lookup."""
    topics = make_topics(topic_factory, partitions=2)
    origin = now_origin()
    produce(broker.bootstrap, topics["events"], [event("a", origin + 0.5)], partition=0)
    nobody = f"127.0.0.1:{free_port()}"
    config = write_config(tmp_path / "a.toml", nobody, topics, origin=origin, tail=False,
                          steps=1)
    env = dict(ENV, DPSTREAM_KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap)  # from the environment
    proc = start(config, env=env)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    assert read_all(broker.bootstrap, topics["releases"], expect=len(KEYS), timeout=30)


def test_a_flow_started_before_the_broker_waits_for_it(tmp_path):
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    topics = {"events": "events", "releases": "releases", "alerts": "alerts", "dead": "dead"}
    origin = now_origin()
    config = write_config(tmp_path / "w.toml", bootstrap, topics, origin=origin, tail=False,
                          kafka={"startup_timeout": "60s"}, steps=1)
    proc = start(config)
    time.sleep(3)
    assert proc.poll() is None
    from dpstream.io.topics import ensure_topics

    with EmbeddedBroker(port=port) as late:
        ensure_topics(late.bootstrap, {"events": 1, "releases": 1, "alerts": 1, "dead": 1})
        produce(late.bootstrap, "events", [event("a", origin + 0.5)])
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, out[-3000:]
        assert "waiting for Kafka at" in out
        assert read_all(late.bootstrap, "releases", expect=len(KEYS), timeout=30)


def test_the_documented_bytewax_command_works_from_any_directory(broker, topic_factory,
                                                                 tmp_path):
    topics = make_topics(topic_factory, partitions=2)
    origin = now_origin()
    produce(broker.bootstrap, topics["events"],
            [event(k, origin + s + 0.5) for s in range(3) for k in KEYS])
    config = write_config(tmp_path / "bw.toml", broker.bootstrap, topics, origin=origin,
                          tail=False, steps=3)
    recovery = tmp_path / "recovery"
    recovery.mkdir(mode=0o700)
    subprocess.run([sys.executable, "-m", "bytewax.recovery", str(recovery), "1"], check=True,
                   capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run([sys.executable, "-m", "bytewax.run", "dpstream.flows.counters:flow",
                          "-w", "2", "-r", str(recovery), "-s", "5", "-b", "0"],
                         cwd=elsewhere, capture_output=True, text=True, timeout=120,
                         env=dict(ENV, DPSTREAM_CONFIG=str(config),
                                  DPSTREAM_RECOVERY_DIR=str(recovery)))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "INFO dpstream: flow instance" in out.stderr  # dpstream logs under bytewax.run
    assert "input ended:" in out.stderr
    assert read_all(broker.bootstrap, topics["releases"], expect=3 * len(KEYS), timeout=30)


def test_a_stop_during_an_outage_exits_and_the_restart_resends(tmp_path):
    """SIGTERM while releases wait for an absent broker: exit 3 after a grace, nothing lost."""
    steps = BACKLOG_STEPS
    with EmbeddedBroker() as own:
        config, port = backlog_flow(own, tmp_path)
        recovery = tmp_path / "recovery"
        args = ("--recovery-dir", str(recovery), "--snapshot-interval", "0.5")
        proc = start(config, *args)
        try:
            wait_until(lambda: metric(scrape(port), "dpstream_releases_total") >= 3000,
                       60, "the first releases", proc)
            os.kill(own.pid, signal.SIGSTOP)
            try:
                wait_until(lambda: metric(scrape(port), "dpstream_output_pending_records") > 0,
                           30, "output waiting for the broker", proc)
                started = time.monotonic()
                out = stop(proc, signal.SIGTERM, timeout=40)
                waited = time.monotonic() - started
            finally:
                os.kill(own.pid, signal.SIGCONT)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 3, out[-3000:]
        assert "not acknowledged" in out and "a restart with the same recovery store re-sends" \
            in out
        assert_clean(out)
        assert waited < 30
        expected = (steps - 1) * len(KEYS)
        proc = start(config, *args)  # resumes; the unacknowledged epoch is replayed
        try:
            wait_until(lambda: metric(scrape(port), "dpstream_closed_step") >= steps - 2, 180,
                       "the resumed flow to close every step", proc)
        finally:
            out = stop(proc)
        assert proc.returncode == 0, out[-3000:]
        releases = read_all(own.bootstrap, "releases", timeout=60, idle=2)
        by_coordinate = values_by_coordinate(releases)
        assert len(by_coordinate) == expected  # nothing lost
        assert all(len(v) == 1 for v in by_coordinate.values())  # replays never re-noise


def test_malloc_tuning_is_skipped_when_the_operator_chose_or_disabled_it():
    from dpstream.runner import keep_freed_memory

    assert keep_freed_memory({"DPSTREAM_MALLOC_TUNING": "0"}) is False
    assert keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "1000"}) is False
    assert keep_freed_memory({"MALLOC_MMAP_THRESHOLD_": "1000"}) is False
    import sys
    if sys.platform.startswith("linux"):  # glibc here: the thresholds are accepted
        assert keep_freed_memory({}) is True
