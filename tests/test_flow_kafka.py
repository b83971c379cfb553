"""The counters flow end to end against a real Kafka-protocol broker, as a user runs it.

``dpstream run`` runs in a child process: with 1 and 2 workers, killed with SIGKILL mid-stream and
resumed from its Bytewax recovery store, and scraped by a real Prometheus.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from support.configs import counters, write

from dpstream.io.broker import free_port
from dpstream.io.topics import produce, read_all
from dpstream.messages import TICK

pytestmark = [pytest.mark.integration]

ORIGIN = 1_790_000_000
ENV = dict(os.environ, PYTHONUNBUFFERED="1",
           DPSTREAM_NOISE_KEY="5e6f9d1c2b3a48577b0c1d2e3f405162738495a6b7c8d9eafb0c1d2e3f405162")
KEYS = [f"k{i:02d}" for i in range(20)]


def write_config(path: Path, broker, topics: dict[str, str], *, steps: int, tail=False,
                 metrics_port=0, batch_size=500, name="it", heartbeat="auto") -> Path:
    """A counters flow over ``steps`` steps of data: flow.end closes them all, with or without
    tail (the heartbeat's ticks carry today's time, long after the data's)."""
    return write(path, counters(
        broker.bootstrap, topics, name=name, origin=ORIGIN, steps=steps, keys=KEYS,
        flow={"shards": 4, "heartbeat": heartbeat},
        kafka={"tail": tail, "batch_size": batch_size, "startup_timeout": None},
        privacy={"accounting": "pure"},
        metrics={"port": metrics_port, "exact_counts": True}))  # the tests read exact counts


def make_topics(topic_factory) -> dict[str, str]:
    return {"events": topic_factory(3, "events"), "releases": topic_factory(1, "releases"),
            "alerts": topic_factory(1, "alerts"), "dead": topic_factory(1, "dead")}


def produce_events(broker, topic: str, steps: int, seed: int = 0, bad: int = 0,
                   ticks_every: int = 0) -> int:
    """Events for every key in time order, round-robin over 3 partitions; returns the count.

    ``ticks_every``: a heartbeat tick (stamped at the step's start) to every partition every
    that many steps, as a ticking flow would have written them: under the producer clock
    only ticks close steps, so the flow then closes them as it reads, not all at the end.
    """
    rng = random.Random(seed)
    per_partition: dict[int, list] = defaultdict(list)
    i = 0
    for step in range(steps):
        if ticks_every and step and step % ticks_every == 0:
            for p in range(3):
                per_partition[p].append((b"dpstream.tick", TICK, (ORIGIN + step) * 1000))
        for key in KEYS:
            for _ in range(rng.randint(0, 3)):
                ts = ORIGIN + step + rng.random() * 0.999
                per_partition[i % 3].append(
                    (None, json.dumps({"key": key, "ts": ts}).encode(), int(ts * 1000)))
                i += 1
    for b in range(bad):
        per_partition[0].insert(5 + b, (None, b'{"broken', ORIGIN * 1000))
    for partition, messages in per_partition.items():
        produce(broker.bootstrap, topic, messages, partition=partition)
    return i


def run_flow(config: Path, *args: str, **kwargs) -> subprocess.Popen:
    if "--recovery-dir" not in args:
        args = (*args, "--ephemeral")
    return subprocess.Popen([sys.executable, "-m", "dpstream.cli", "run", "--config", str(config),
                             *args], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            **kwargs)


def finish(proc: subprocess.Popen, timeout: float = 180) -> str:
    out, _ = proc.communicate(timeout=timeout)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    return text


def releases_by_coordinate(records) -> dict[tuple[str, int], set[bytes]]:
    grouped: dict[tuple[str, int], set[bytes]] = defaultdict(set)
    for record in records:
        body = json.loads(record.value)
        assert body["schema"] == "dpstream.release/1", body
        assert body["privacy"]["spent"] <= body["privacy"]["budget"]
        grouped[(body["key"], body["step"])].add(record.value)
    return grouped


def test_one_and_two_workers_release_the_same_statistics(broker, topic_factory, tmp_path):
    topics = make_topics(topic_factory)
    steps = 60
    produce_events(broker, topics["events"], steps, bad=3)
    one = write_config(tmp_path / "one.toml", broker, topics, steps=steps)
    finish(run_flow(one, "--recovery-dir", str(tmp_path / "r1")))
    first = read_all(broker.bootstrap, topics["releases"], expect=steps * len(KEYS), timeout=60)
    assert len(first) == steps * len(KEYS)
    dead = read_all(broker.bootstrap, topics["dead"], expect=3, timeout=30)
    assert [json.loads(d.value)["reason"] for d in dead] == ["invalid JSON"] * 3

    # the same input through two workers, into fresh output topics
    topics2 = dict(topics, releases=topic_factory(1, "releases2"), alerts=topic_factory(1, "a2"),
                   dead=topic_factory(1, "dead2"))
    two = write_config(tmp_path / "two.toml", broker, topics2, steps=steps)
    # the same flow instance (its manifest, not its state): the same noise, from scratch
    (tmp_path / "r2").mkdir(mode=0o700)  # the recovery store must be private to its owner
    shutil.copy(tmp_path / "r1" / "dpstream-instance.json", tmp_path / "r2")
    finish(run_flow(two, "--workers", "2", "--recovery-dir", str(tmp_path / "r2")))
    second = read_all(broker.bootstrap, topics2["releases"], expect=len(first), timeout=60)
    assert sorted(r.value for r in second) == sorted(r.value for r in first)


@pytest.mark.slow
def test_kill_minus_nine_and_resume_gives_exactly_one_value_per_release(broker, topic_factory,
                                                                       tmp_path):
    topics = make_topics(topic_factory)
    steps = 3000
    produce_events(broker, topics["events"], steps, seed=1, ticks_every=1)
    expected = {(k, s) for k in KEYS for s in range(steps)}
    # the first run tails (it never ends by itself, so the kill lands while it runs); the
    # resume reads to the end. Tailing changes no fixed setting of the flow instance. Its own
    # heartbeat is off: its ticks carry today's time and would close every step before
    # flow.end at once; the input's ticks (one a step) close the steps as they are read.
    config = write_config(tmp_path / "rec.toml", broker, topics, steps=steps, batch_size=20,
                          tail=True, heartbeat="off")
    recovery = tmp_path / "recovery"
    args = ("--recovery-dir", str(recovery), "--snapshot-interval", "0.2")

    proc = run_flow(config, *args)
    deadline = time.monotonic() + 120
    seen = 0
    while time.monotonic() < deadline and seen == 0:
        time.sleep(0.2)
        assert proc.poll() is None, "the flow stopped before it could be killed"
        seen = len(read_all(broker.bootstrap, topics["releases"], timeout=5, idle=0.2))
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert 0 < seen < len(expected), "the kill must land mid-stream"

    bounded = write_config(tmp_path / "rec-end.toml", broker, topics, steps=steps,
                           batch_size=20)
    finish(run_flow(bounded, *args))  # resumes from the recovery store, runs to the end
    records = read_all(broker.bootstrap, topics["releases"], timeout=60, idle=2)
    grouped = releases_by_coordinate(records)
    assert set(grouped) == expected  # every release coordinate is there...
    conflicting = {c: v for c, v in grouped.items() if len(v) != 1}
    assert not conflicting  # ...with exactly one value: replayed duplicates are byte-identical
    duplicates = len(records) - len(grouped)
    assert duplicates >= 0
    print(f"kill -9 after {seen} releases; {duplicates} replayed duplicates, all identical")


def test_metrics_reach_a_real_prometheus(broker, topic_factory, tmp_path, prometheus_factory):
    topics = make_topics(topic_factory)
    steps = 40
    produce_events(broker, topics["events"], steps, bad=2)
    port = free_port()
    config = write_config(tmp_path / "m.toml", broker, topics, steps=steps, tail=True,
                          metrics_port=port, name="metrics-it")
    proc = run_flow(config)
    try:
        prom = prometheus_factory([f"127.0.0.1:{port}"])
        expected = steps * len(KEYS)  # tail=true: the ticks close every step before flow.end
        prom.wait_for('dpstream_releases_total{flow="metrics-it"}',
                      lambda r: len(r) == 1 and r[0][1] == expected, timeout=60)
        spent = prom.query('dpstream_privacy_spent{flow="metrics-it"}')
        assert spent == [({"__name__": "dpstream_privacy_spent", "flow": "metrics-it",
                           "instance": f"127.0.0.1:{port}", "job": "dpstream",
                           "mechanism": "tree-laplace", "unit": "epsilon"}, 0.9)]
        remaining = prom.query('dpstream_privacy_remaining{flow="metrics-it"}')
        assert remaining[0][1] == pytest.approx(0.1)
        dead = prom.query('sum(dpstream_dead_letters_total{flow="metrics-it"})')
        assert dead[0][1] == 2
        events = prom.query('dpstream_events_total{flow="metrics-it"}')
        assert events[0][1] > 0
        # no series carries a key: labels come from a fixed, key-free vocabulary
        for labels, _ in prom.query('{__name__=~"dpstream_.*"}'):
            assert not any(k in value for value in labels.values() for k in KEYS), labels
    finally:
        proc.send_signal(signal.SIGINT)  # clean shutdown on Ctrl-C
        try:
            assert proc.wait(20) == 130  # 128 + SIGINT: interrupted, though stopped cleanly
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def test_sigterm_stops_the_flow_cleanly(broker, topic_factory, tmp_path):
    topics = make_topics(topic_factory)
    produce_events(broker, topics["events"], 5)
    config = write_config(tmp_path / "t.toml", broker, topics, steps=5, tail=True)
    proc = run_flow(config)
    read_all(broker.bootstrap, topics["releases"], expect=4 * len(KEYS), timeout=60)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out.decode()[-2000:]
    assert b"stopped" in out


def test_bytewax_runner_entry_point(broker, topic_factory, tmp_path):
    """The documented cluster entry point: python -m bytewax.run flows.counters:flow."""
    topics = make_topics(topic_factory)
    produce_events(broker, topics["events"], 10)
    config = write_config(tmp_path / "bw.toml", broker, topics, steps=10)
    root = Path(__file__).parent.parent
    out = subprocess.run([sys.executable, "-m", "bytewax.run", "flows.counters:flow", "-w", "2"],
                         cwd=root, env=dict(ENV, DPSTREAM_CONFIG=str(config),
                                            DPSTREAM_EPHEMERAL="1"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    records = read_all(broker.bootstrap, topics["releases"], expect=10 * len(KEYS), timeout=60)
    assert len(releases_by_coordinate(records)) == 10 * len(KEYS)
