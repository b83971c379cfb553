"""dpstream's Kafka edge against a genuine Apache Kafka 0.9.0.1 broker (the ``old_kafka`` fixture).

* ``dpstream run`` refuses a broker older than Kafka 0.10 (its records carry no timestamps) with
  one clear error line and exit code 2, both when the settings say so and when the broker does
  not answer the ApiVersions probe.
* :class:`~dpstream.io.kafka.KafkaOutput` loses nothing when the broker is away longer than
  ``message.timeout.ms``: it re-sends what timed out and returns only once all is acknowledged.
* A record the broker refuses for good (too large) stops the flow with an
  :class:`~dpstream.io.kafka.OutputError` naming the role and the size.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import bytewax.operators as op
import confluent_kafka
import pytest
from bytewax.dataflow import Dataflow
from bytewax.testing import TestingSource, run_main
from support.configs import counters, write
from support.old_kafka import OldKafka

from dpstream.io.kafka import KafkaClients, KafkaOutput, OutputError

pytestmark = [pytest.mark.integration]

ENV = dict(os.environ, PYTHONUNBUFFERED="1",
           DPSTREAM_NOISE_KEY="5e6f9d1c2b3a48577b0c1d2e3f405162738495a6b7c8d9eafb0c1d2e3f405162")
ROLES = ("releases", "alerts", "dead_letters")
MESSAGE_TIMEOUT_MS = 3000
OUTAGE_SECONDS = 6.5  # > 2 x message.timeout.ms: every record sent during it times out twice
RECORDS = 300
STOP_AFTER = 60  # the broker goes down when this item passes


def _unique(stem: str) -> str:
    return f"old-broker-{stem}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def topics(old_kafka: OldKafka) -> dict[str, str]:
    """Topics on the old broker: the flow's input and one per output role."""
    names = {"events": _unique("events"), **{role: _unique(role) for role in ROLES}}
    for name in names.values():
        old_kafka.create_topic(name, partitions=1)
    return names


# --- 1. `dpstream run` refuses a broker older than 0.10 ------------------------------------

def _write_config(path: Path, bootstrap: str, topics: dict[str, str],
                  add_config: dict[str, str] | None) -> Path:
    return write(path, counters(
        bootstrap, {**topics, "dead": topics["dead_letters"]}, name="old-broker",
        origin=1_790_000_000, steps=60, keys=["k0", "k1"], flow={"shards": 1},
        kafka={"startup_timeout": "10s", "tail": False, "add_config": add_config},
        privacy={"accounting": "pure"}, counter={"horizon": 64}))


@pytest.mark.timeout(90, func_only=True)
@pytest.mark.parametrize("path", ["probe", "settings"])
def test_run_refuses_a_broker_older_than_0_10(old_kafka: OldKafka, topics: dict[str, str],
                                               tmp_path: Path, path: str) -> None:
    add_config = dict(old_kafka.CONFLUENT_SETTINGS) if path == "settings" else None
    config = _write_config(tmp_path / "old.toml", old_kafka.bootstrap, topics, add_config)
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "dpstream.cli", "run", "--config", str(config),
                             "--ephemeral"], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    elapsed = time.monotonic() - started
    text = out.decode(errors="replace")
    assert proc.returncode == 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("dpstream: error:")]
    assert len(errors) == 1, text[-3000:]
    line = errors[0]
    assert "older than Kafka 0.10" in line and "carry no timestamps" in line, line
    assert old_kafka.bootstrap in line, line
    why = "broker.version.fallback" if path == "settings" else "ApiVersions"
    assert why in line, line
    print(f"{path}: exit 2 after {elapsed:.1f} s: {line[:160]}...")


# --- 2. an outage longer than message.timeout.ms loses nothing -----------------------------

def _old_clients(old_kafka: OldKafka, **extra: str) -> KafkaClients:
    return KafkaClients((old_kafka.bootstrap,),
                        {**old_kafka.CONFLUENT_SETTINGS, **extra}, environ={})


def _read_topic(old_kafka: OldKafka, topic: str, expected: set[int], timeout: float
                ) -> list[bytes]:
    """Every value of ``topic`` (partition 0) from the beginning, until ``expected`` all came."""
    consumer = confluent_kafka.Consumer(old_kafka.confluent_config(
        group_id=f"reader-{uuid.uuid4().hex[:8]}", enable_auto_commit=False))
    values: list[bytes] = []
    seen: set[int] = set()
    try:
        consumer.assign([confluent_kafka.TopicPartition(topic, 0,
                                                        confluent_kafka.OFFSET_BEGINNING)])
        deadline = time.monotonic() + timeout
        while not expected <= seen and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            values.append(msg.value())
            seen.add(int(msg.value().split(b":")[1]))
    finally:
        consumer.close()
    return values


class _Outage:
    """Stops the broker when item ``STOP_AFTER`` passes, restarts it from another thread."""

    def __init__(self, kafka: OldKafka) -> None:
        self.kafka = kafka
        self.down_at: float | None = None
        self.restart_called: float | None = None
        self.restart_ready: float | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._restart_later, name="restart-old-kafka",
                                       daemon=True)

    def on_item(self, _step: str, item: tuple[str, bytes, bytes]) -> None:
        if int(item[2].split(b":")[1]) == STOP_AFTER and self.down_at is None:
            self.kafka.stop_broker()  # in the flow's thread: later items meet a stopped broker
            self.down_at = time.monotonic()
            self.thread.start()

    def _restart_later(self) -> None:
        try:
            time.sleep(OUTAGE_SECONDS)
            self.restart_called = time.monotonic()
            self.kafka.start_broker()
            self.restart_ready = time.monotonic()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def finish(self) -> None:
        if self.down_at is not None:
            self.thread.join(90)
        if not self.kafka.broker_running():  # leave the session's broker running
            self.kafka.start_broker()


@pytest.fixture
def outage(old_kafka: OldKafka) -> Iterator[_Outage]:
    outage = _Outage(old_kafka)
    try:
        yield outage
    finally:
        outage.finish()


@pytest.mark.timeout(180, func_only=True)
def test_an_outage_longer_than_the_message_timeout_loses_no_output(
        old_kafka: OldKafka, topics: dict[str, str], outage: _Outage) -> None:
    items = [(ROLES[i % 3], f"k{i % 7}".encode(), f"{ROLES[i % 3]}:{i:05d}".encode())
             for i in range(RECORDS)]
    calls: list[tuple[float, int, dict[str, int], int]] = []

    def observe(pending: int, delivered: dict[str, int], retried: int) -> None:
        calls.append((time.monotonic(), pending, dict(delivered), retried))

    clients = _old_clients(old_kafka, **{"message.timeout.ms": str(MESSAGE_TIMEOUT_MS)})
    output = KafkaOutput(clients, {role: topics[role] for role in ROLES}, observe)
    flow = Dataflow("old-broker-outage")
    stream = op.input("in", flow, TestingSource(items, batch_size=10))
    stream = op.inspect("outage", stream, outage.on_item)
    op.output("out", stream, output)

    started = time.monotonic()
    run_main(flow)
    finished = time.monotonic()
    outage.thread.join(90)
    assert outage.error is None, outage.error
    assert outage.down_at is not None and outage.restart_called is not None
    assert outage.restart_ready is not None

    # read back: every sequence number at least once, in the topic of its role
    missing: dict[str, list[int]] = {}
    duplicates = 0
    for role in ROLES:
        expected = {i for i in range(RECORDS) if ROLES[i % 3] == role}
        values = _read_topic(old_kafka, topics[role], expected, timeout=20)
        numbers = Counter(int(v.split(b":")[1]) for v in values)
        assert all(v.startswith(role.encode() + b":") for v in values), role
        missing[role] = sorted(expected - set(numbers))
        duplicates += sum(n - 1 for n in numbers.values())
        assert set(numbers) <= expected, role
    assert missing == {role: [] for role in ROLES}

    retried = sum(c[3] for c in calls)
    waits = sum(1 for c in calls if c[1] > 0)
    assert retried > 0, "no record was re-sent: the outage did not happen while writing"
    assert calls[-1][1] == 0, calls[-1]
    assert sum(n for c in calls for n in c[2].values()) >= RECORDS
    # the flow cannot have finished before the broker came back
    assert finished > outage.restart_called
    assert finished - outage.down_at >= OUTAGE_SECONDS
    print(f"outage: down {outage.restart_ready - outage.down_at:.1f} s (restart took "
          f"{outage.restart_ready - outage.restart_called:.1f} s); flow ran "
          f"{finished - started:.1f} s and finished {finished - outage.restart_ready:+.1f} s "
          f"after the broker was ready; {retried} re-sent, {waits} waiting report(s), "
          f"{duplicates} duplicate(s) read back")


# --- 3. a permanent failure fails loudly ----------------------------------------------------

@pytest.mark.timeout(90, func_only=True)
def test_a_record_the_broker_refuses_for_good_raises_output_error(
        old_kafka: OldKafka) -> None:
    topic = _unique("big")
    old_kafka.create_topic(topic, partitions=1)
    size = 1_500_000  # 0.9's message.max.bytes is 1,000,012; the client allows 2,000,000
    clients = _old_clients(old_kafka, **{"message.max.bytes": "2000000",
                                         "message.timeout.ms": "10000"})
    calls: list[tuple[int, dict[str, int], int]] = []
    output = KafkaOutput(clients, {"releases": topic},
                         lambda p, d, r: calls.append((p, dict(d), r)))
    flow = Dataflow("old-broker-too-large")
    stream = op.input("in", flow, TestingSource([("releases", b"k", b"x" * size)]))
    op.output("out", stream, output)

    started = time.monotonic()
    with pytest.raises(RuntimeError) as raised:  # Bytewax wraps the sink's exception
        run_main(flow)
    elapsed = time.monotonic() - started
    chain: list[BaseException] = []
    exc: BaseException | None = raised.value
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    found = [e for e in chain if isinstance(e, OutputError)]
    assert found, [f"{type(e).__name__}: {e}" for e in chain]
    message = str(found[0])
    assert "releases" in message and f"{size} bytes" in message, message
    assert topic in message, message
    assert not any(c[1] for c in calls), calls  # nothing was reported as delivered
    kinds = " <- ".join(type(e).__name__ for e in chain)
    print(f"refused after {elapsed:.1f} s ({kinds}): {re.sub(r'; nothing.*', '', message)}")
