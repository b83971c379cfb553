"""Issue 22 item 8: a re-created topic, a changed partition count or offsets past the end are loud.

Against the embedded broker, on one recovery store: a first bounded run reads a topic; the topic
is then deleted and re-created (another partition count, or the same count with fewer records)
and the flow is started again on the same store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from support.configs import counters, write

pytestmark = [pytest.mark.integration]

KEY = "6c1f0e9a1c5d4e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6b"
ENV = dict(os.environ, PYTHONUNBUFFERED="1", DPSTREAM_NOISE_KEY=KEY)
ENV.pop("DPSTREAM_FLOW_CLOCK", None)


def _config(path: Path, bootstrap: str, topics: dict[str, str], origin: float) -> Path:
    return write(path, counters(bootstrap, topics, name="topo", origin=origin, steps=50,
                                kafka={"tail": False}))


def _events(origin: float, first: float, n: int) -> list[tuple[bytes, bytes, int]]:
    out = []
    for i in range(n):
        ts = origin + first + i * 0.25
        out.append((b"a" if i % 2 else b"b",
                    json.dumps({"key": "ab"[i % 2], "ts": ts}).encode(), int(ts * 1000)))
    return out


def _run(config: Path, recovery: Path, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpstream.cli", "run", "--config", str(config),
                           "--recovery-dir", str(recovery)], env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def _recreate(bootstrap: str, topic: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient

    from dpstream.io.topics import ensure_topics, topic_partitions

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_topics([topic], operation_timeout=10).values():
        future.result(10)
    deadline = time.monotonic() + 20
    while True:  # until the metadata forgets the old topic
        try:
            topic_partitions(bootstrap, topic, timeout=2)
        except Exception:  # noqa: BLE001 - "does not exist" is what we wait for
            break
        assert time.monotonic() < deadline, f"{topic} still listed after deletion"
        time.sleep(0.2)
    ensure_topics(bootstrap, {topic: partitions})


def _topics(bootstrap: str, partitions: int) -> dict[str, str]:
    from dpstream.io.topics import ensure_topics

    tag = uuid.uuid4().hex[:8]
    names = {role: f"topo-{role}-{tag}" for role in ("events", "releases", "alerts", "dead")}
    ensure_topics(bootstrap, {name: (partitions if role == "events" else 1)
                              for role, name in names.items()})
    return names


def test_a_changed_partition_count_stops_the_resume_with_one_line(broker, tmp_path):
    from dpstream.io.topics import produce

    origin = time.time() - 60
    topics = _topics(broker.bootstrap, 2)
    events = topics["events"]
    produce(broker.bootstrap, events, _events(origin, 1, 20), partition=0)
    produce(broker.bootstrap, events, _events(origin, 1, 12), partition=1)
    config = _config(tmp_path / "c.toml", broker.bootstrap, topics, origin)
    recovery = tmp_path / "recovery"
    first = _run(config, recovery)
    assert first.returncode == 0, first.stderr[-3000:]

    _recreate(broker.bootstrap, events, 1)  # events[1] vanished
    again = _run(config, recovery)
    assert again.returncode == 2, again.stderr[-3000:]
    [error] = [line for line in again.stderr.splitlines() if line.startswith("dpstream: error:")]
    assert f"input topic {events!r} has 1 partition(s) but the recovery store read 2" in error
    assert f"{events}[0] at offset 20" in error and f"{events}[1] at offset 12" in error
    assert f"{events}[1] vanished" in error and "new flow instance" in error
    assert "Traceback" not in again.stderr

    _recreate(broker.bootstrap, events, 3)  # a partition more than the store read
    again = _run(config, recovery)
    assert again.returncode == 2, again.stderr[-3000:]
    [error] = [line for line in again.stderr.splitlines() if line.startswith("dpstream: error:")]
    assert f"input topic {events!r} has 3 partition(s) but the recovery store read 2" in error
    assert f"{events}[2]..{events}[2] are new" in error

    # the same check in-process: the metric counts it
    from prometheus_client import CollectorRegistry

    from dpstream.errors import ConfigError
    from dpstream.metrics import FlowMetrics
    from dpstream.platform import check_input_topology, kafka_clients, load_config

    cfg = load_config(config, environ={})
    metrics = FlowMetrics("topo", CollectorRegistry())
    with pytest.raises(ConfigError, match="re-created or re-partitioned"):
        check_input_topology(cfg, kafka_clients(cfg), {events: 3}, str(recovery), metrics)
    assert metrics.registry.get_sample_value(
        "dpstream_topology_anomalies_total",
        {"flow": "topo", "topic": events, "reason": "partition_count_changed"}) == 1


def test_offsets_past_the_end_of_a_recreated_topic_warn_and_read_it_from_its_start(
        broker, tmp_path):
    from prometheus_client import CollectorRegistry

    from dpstream.io.topics import produce, read_all
    from dpstream.metrics import FlowMetrics
    from dpstream.platform import check_input_topology, kafka_clients, load_config

    origin = time.time() - 60
    topics = _topics(broker.bootstrap, 1)
    events = topics["events"]
    produce(broker.bootstrap, events, _events(origin, 1, 40))
    config = _config(tmp_path / "c.toml", broker.bootstrap, topics, origin)
    recovery = tmp_path / "recovery"
    first = _run(config, recovery)
    assert first.returncode == 0, first.stderr[-3000:]
    before = [json.loads(r.value) for r in read_all(broker.bootstrap, topics["releases"],
                                                     idle=1)]
    last_step = max(r["step"] for r in before)

    cfg = load_config(config, environ={})
    metrics = FlowMetrics("topo", CollectorRegistry())
    # the intact topic: the store's offset 40 is its end (the broker under-reports its high
    # watermark; the record before 40 shows the offset is within the partition): no anomaly
    assert check_input_topology(cfg, kafka_clients(cfg), {events: 1}, str(recovery),
                                metrics) == {}
    assert metrics.registry.get_sample_value(
        "dpstream_topology_anomalies_total",
        {"flow": "topo", "topic": events, "reason": "offset_past_end"}) is None

    _recreate(broker.bootstrap, events, 1)  # same count, 6 records: the store's 40 is past it
    produce(broker.bootstrap, events, _events(origin, 30, 6))

    rewind = check_input_topology(cfg, kafka_clients(cfg), {events: 1}, str(recovery), metrics)
    assert rewind == {events: {0: 40}}
    assert metrics.registry.get_sample_value(
        "dpstream_topology_anomalies_total",
        {"flow": "topo", "topic": events, "reason": "offset_past_end"}) == 1

    again = _run(config, recovery)  # before: a silent stall (the fetch past the end is empty)
    assert again.returncode == 0, again.stderr[-3000:]
    [warning] = [line for line in again.stderr.splitlines() if "resumes at offset" in line]
    assert f"{events}[0]: the recovery store resumes at offset 40 but the partition ends at " \
           "offset 6" in warning, warning
    # the new topic's events were read: flow.end closed every step in the first run, so
    # its 6 events (steps 30-31) are late dead letters of the re-created partition
    dead = [json.loads(r.value) for r in read_all(broker.bootstrap, topics["dead"], idle=1)]
    assert last_step == 49
    assert sorted(d["source"]["offset"] for d in dead if d["reason"].startswith("late")) == \
        list(range(6))
    assert "Traceback" not in again.stderr


def test_check_topology_rules_without_a_broker():
    from dpstream.topology import check_topology, rewinds

    def never(_t, _p, _o):
        return None

    # a store split over per-process volumes may hold only some partitions: not "added"
    assert check_topology({"e": {0: 5}}, {"e": 2}, never, complete=False) == []
    [added] = check_topology({"e": {0: 5}}, {"e": 2}, never, complete=True)
    assert added.fatal and added.reason == "partition_count_changed" and "e[1]..e[1]" in added.text
    # a vanished partition is certain whatever the store holds
    [gone] = check_topology({"e": {0: 5, 3: 7}}, {"e": 2}, never, complete=False)
    assert gone.fatal and gone.reason == "partition_vanished" and "e[3] vanished" in gone.text
    # start positions (never read: negative) are not offsets; a past-end offset is a warning
    past = check_topology({"e": {0: -2, 1: 9}}, {"e": 2},
                          lambda t, p, o: 4 if (t, p, o) == ("e", 1, 9) else None)
    assert [(a.reason, a.fatal, a.partition) for a in past] == [("offset_past_end", False, 1)]
    assert rewinds(past) == {"e": {1: 9}}
    assert "e[1]: the recovery store resumes at offset 9 but the partition ends at offset 4" \
        in past[0].text


def test_a_tailing_partition_whose_position_is_past_the_end_reads_it_again_from_its_start(
        broker, topic_factory, monkeypatch):
    """While the flow runs: a position past the end (a topic re-created under the flow).

    The embedded broker answers a fetch past the end with nothing at all (no error, no end of
    partition): the reader was silent for ever. Deleting a topic under a running consumer
    crashes librdkafka against this broker (see NOTES.md), so the reader is started past the
    end of a topic instead, as it is after a re-creation.
    """
    from dpstream.io import kafka
    from dpstream.io.kafka import KafkaClients, KafkaInput
    from dpstream.io.topics import produce

    monkeypatch.setattr(kafka, "TOPOLOGY_CHECK_SECONDS", 0.0)
    topic = topic_factory(1)
    produce(broker.bootstrap, topic, [(None, b'{"key":"a","ts":1}')] * 5)
    seen: list[tuple[str, str]] = []
    reader = KafkaInput(KafkaClients((broker.bootstrap,)), topic, 1, group_id="g-past-end",
                        observe_anomaly=lambda t, r: seen.append((t, r)))
    part = reader.build_part("s", "0", 40)  # resumed at 40, the partition has 5 records
    try:
        got: list[int] = []
        deadline = time.monotonic() + 30
        while len(got) < 5 and time.monotonic() < deadline:
            for batch in part.next_batch():
                got.extend(batch.offsets)
            time.sleep(0.05)
        assert got == [0, 1, 2, 3, 4]
        assert seen == [(topic, "offset_past_end")]
        assert part.snapshot() == 5
    finally:
        part.close()
