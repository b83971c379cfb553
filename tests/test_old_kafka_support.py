"""The genuine Apache Kafka 0.9.0.1 test broker works and persists its data.

The ``old_kafka`` fixture comes from tests/support/old_kafka.py (registered in conftest.py).
"""

from __future__ import annotations

import time
import uuid

import confluent_kafka
import pytest
from support.old_kafka import OldKafka

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COUNT = 50


def _read_all(kafka: OldKafka, topic: str, partitions: int, expected: int) -> list:
    """Read ``topic`` from the beginning of every partition until ``expected`` messages arrived."""
    consumer = confluent_kafka.Consumer(
        kafka.confluent_config(
            group_id=f"reader-{uuid.uuid4().hex[:8]}",
            enable_auto_commit=False,
        )
    )
    try:
        consumer.assign([
            confluent_kafka.TopicPartition(topic, p, confluent_kafka.OFFSET_BEGINNING)
            for p in range(partitions)
        ])
        messages: list = []
        deadline = time.monotonic() + 30
        while len(messages) < expected and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            messages.append(msg)
        return messages
    finally:
        consumer.close()


def test_produce_consume_and_survive_a_broker_restart(old_kafka: OldKafka) -> None:
    topic = f"old-kafka-{uuid.uuid4().hex[:8]}"
    old_kafka.create_topic(topic, partitions=2)

    producer = confluent_kafka.Producer(old_kafka.confluent_config())
    errors: list = []
    for i in range(COUNT):
        producer.produce(
            topic,
            key=f"k{i % 7}".encode(),
            value=f"v{i}".encode(),
            on_delivery=lambda err, _msg: errors.append(err) if err is not None else None,
        )
    assert producer.flush(30) == 0
    assert errors == []

    def check(messages: list) -> None:
        values = sorted(int(m.value().decode()[1:]) for m in messages)
        assert values == list(range(COUNT))
        assert {m.partition() for m in messages} == {0, 1}  # both partitions were written
        for m in messages:
            assert m.timestamp() == (confluent_kafka.TIMESTAMP_NOT_AVAILABLE, 0)

    check(_read_all(old_kafka, topic, 2, COUNT))

    old_kafka.stop_broker()
    assert not old_kafka.broker_running()
    old_kafka.start_broker()
    assert old_kafka.broker_running()

    check(_read_all(old_kafka, topic, 2, COUNT))


def test_kafka_python_reads_with_the_old_api_version(old_kafka: OldKafka) -> None:
    kafka = pytest.importorskip("kafka")
    topic = f"old-kafka-py-{uuid.uuid4().hex[:8]}"
    old_kafka.create_topic(topic, partitions=1)
    producer = kafka.KafkaProducer(
        bootstrap_servers=old_kafka.bootstrap, api_version=OldKafka.KAFKA_PYTHON_API_VERSION
    )
    for i in range(5):
        producer.send(topic, f"p{i}".encode())
    producer.flush(30)
    producer.close()

    consumer = kafka.KafkaConsumer(
        bootstrap_servers=old_kafka.bootstrap,
        api_version=OldKafka.KAFKA_PYTHON_API_VERSION,
        enable_auto_commit=False,
    )
    try:
        partition = kafka.TopicPartition(topic, 0)
        consumer.assign([partition])
        consumer.seek_to_beginning(partition)
        values: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(values) < 5 and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                values.extend(r.value for r in records)
    finally:
        consumer.close()
    assert values == [f"p{i}".encode() for i in range(5)]


def test_client_settings_constants() -> None:
    assert dict(OldKafka.CONFLUENT_SETTINGS) == {
        "api.version.request": "false",
        "broker.version.fallback": "0.9.0.1",
    }
    assert OldKafka.KAFKA_PYTHON_API_VERSION == (0, 9)
