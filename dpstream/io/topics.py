"""Small Kafka helpers (kafka-python) to create, fill and read topics outside a dataflow.

Used by the demo, the tests and the tools to prepare input topics and to read back what a flow
wrote. The flows themselves use Bytewax's confluent-kafka connector.

The helpers avoid consumer groups and "latest offset" queries: `read_all` assigns every partition
explicitly and starts at offset 0, and knows it is done when it has read the expected number of
records or nothing more arrives. That works on any Kafka, including brokers (such as the embedded
Tansu broker) whose ListOffsets(latest) answers are unreliable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any, Final, NamedTuple, NoReturn

import kafka.errors
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic

from dpstream.errors import DpstreamError
from dpstream.io import retry

__all__ = ["Record", "ensure_topics", "produce", "read_all", "topic_partitions"]

_POLL_MS: Final = 100
_METADATA_RETRY_S: Final = 0.05


class Record(NamedTuple):
    """One record read back from a topic (a plain, picklable stand-in for ConsumerRecord)."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int
    """Milliseconds since the epoch, as stored by the broker (create or log-append time)."""


def _config(cls: Any, bootstrap: str, timeout: float, **extra: Any) -> dict[str, Any]:
    """Build client settings, keeping only those this kafka-python version knows."""
    timeout_ms = max(1000, int(timeout * 1000))
    wanted: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "client_id": "dpstream-topics",
        # kafka-python >= 3: fail fast instead of the 30 s default when nobody answers.
        "bootstrap_timeout_ms": timeout_ms,
        "allow_auto_create_topics": False,
        **extra,
    }
    known = cls.DEFAULT_CONFIG
    return {k: v for k, v in wanted.items() if k in known}


def _connect(cls: Any, bootstrap: str, timeout: float, **extra: Any) -> Any:
    try:
        return cls(**_config(cls, bootstrap, timeout, **extra))
    except kafka.errors.KafkaError as exc:
        raise DpstreamError(f"cannot reach a Kafka broker at {bootstrap!r}: {exc}") from exc


def _metadata_client(bootstrap: str, timeout: float) -> KafkaConsumer:
    """Connect a consumer used only for metadata: no group, no subscription, no commits."""
    consumer: KafkaConsumer = _connect(
        KafkaConsumer, bootstrap, timeout, group_id=None, enable_auto_commit=False
    )
    return consumer


def _partition_counts(client: KafkaConsumer, names: Iterable[str]) -> dict[str, int]:
    """Fresh partition counts of those ``names`` that exist (``topics()`` refreshes metadata)."""
    existing = client.topics()
    counts = {}
    for name in names:
        if name in existing:
            counts[name] = len(client.partitions_for_topic(name) or ())
    return counts


def _validate_name(topic: str) -> None:
    if not isinstance(topic, str) or not topic:
        raise DpstreamError(f"topic name must be a non-empty string, got {topic!r}")


def ensure_topics(bootstrap: str, topics: Mapping[str, int], timeout: float = 10.0) -> None:
    """Create the missing ``topics`` (name -> partition count) and wait until metadata shows them.

    Idempotent: topics that already exist with the requested partition count are left alone.

    Args:
        bootstrap: ``host:port[,host:port...]`` of the Kafka cluster.
        topics: Partition count wanted for each topic (replication factor 1).
        timeout: Seconds to wait for the broker and for the topics to appear in metadata.

    Raises:
        DpstreamError: the broker is unreachable, a partition count is not a positive integer, an
            existing topic has a different partition count, or the topics did not appear in time.

    """
    for name, partitions in topics.items():
        _validate_name(name)
        if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
            raise DpstreamError(
                f"partition count for topic {name!r} must be an integer >= 1, got {partitions!r}"
            )
    if not topics:
        return
    deadline = time.monotonic() + timeout
    client = _metadata_client(bootstrap, timeout)
    try:
        counts = _partition_counts(client, topics)
        _check_counts(topics, counts)
        missing = [name for name in topics if name not in counts]
        if missing:
            _create(bootstrap, {name: topics[name] for name in missing}, timeout)
        last: list[tuple[dict[str, int], dict[str, int | str]]] = []

        def visible(_attempt: int) -> None:
            counts = _partition_counts(client, topics)
            _check_counts(topics, counts, final=False)
            pending = {n: p for n, p in topics.items() if counts.get(n) != p}
            if pending:
                last[:] = [(pending, {n: counts.get(n, "missing") for n in pending})]
                raise retry.NotYet(f"wanted {last[0][0]}, saw {last[0][1]}")

        def give_up(_gave_up: retry.GaveUp) -> NoReturn:
            pending, seen = last[0]
            raise DpstreamError(
                f"topics not visible in metadata of {bootstrap!r} after {timeout} s: "
                f"wanted {pending}, saw {seen}"
            )

        retry.retry(visible, what="the topics in the metadata", deadline=deadline,
                    delay=retry.fixed(_METADATA_RETRY_S), level=logging.DEBUG, give_up=give_up)
    finally:
        client.close()


def _check_counts(
    wanted: Mapping[str, int], seen: Mapping[str, int], *, final: bool = True
) -> None:
    for name, count in seen.items():
        # While a topic is being created its metadata may list fewer partitions for a moment.
        if count != wanted[name] and (final or count > wanted[name]):
            raise DpstreamError(
                f"topic {name!r} already exists with {count} partitions, not {wanted[name]}"
            )


def _create(bootstrap: str, topics: Mapping[str, int], timeout: float) -> None:
    admin = _connect(KafkaAdminClient, bootstrap, timeout)
    try:
        for name, partitions in topics.items():
            try:
                admin.create_topics(
                    [NewTopic(name, num_partitions=partitions, replication_factor=1)],
                    timeout_ms=int(timeout * 1000),
                )
            except kafka.errors.TopicAlreadyExistsError:
                pass  # created concurrently; the metadata check that follows verifies the count
            except kafka.errors.KafkaError as exc:
                raise DpstreamError(
                    f"cannot create topic {name!r} ({partitions} partitions) "
                    f"on {bootstrap!r}: {exc}"
                ) from exc
    finally:
        admin.close()


def topic_partitions(bootstrap: str, topic: str, timeout: float = 10.0) -> int:
    """Return the number of partitions of ``topic``.

    Raises:
        DpstreamError: the broker is unreachable or the topic does not exist (the message names
            the topic and the topics that do exist).

    """
    _validate_name(topic)
    client = _metadata_client(bootstrap, timeout)
    try:
        counts = _partition_counts(client, [topic])
        if topic not in counts:
            existing = sorted(t for t in client.topics() if not t.startswith("__"))
            shown = ", ".join(repr(t) for t in existing[:20]) or "none"
            more = f" and {len(existing) - 20} more" if len(existing) > 20 else ""
            raise DpstreamError(
                f"Kafka topic {topic!r} does not exist on {bootstrap!r} "
                f"(existing topics: {shown}{more}); create it first, e.g. with ensure_topics()"
            )
        return counts[topic]
    finally:
        client.close()


def read_all(
    bootstrap: str,
    topic: str,
    timeout: float = 30.0,
    expect: int | None = None,
    idle: float = 1.0,
) -> list[Record]:
    """Read every record of every partition of ``topic``, starting at offset 0.

    Partitions are assigned explicitly (no consumer group, nothing committed). Reading stops when

    * ``expect`` is given and at least that many records were read, or
    * ``expect`` is ``None`` and no record arrived for ``idle`` seconds, or
    * ``timeout`` seconds have passed (whatever was read so far is returned; the caller compares
      the count with what it expected).

    Args:
        bootstrap: ``host:port[,host:port...]`` of the Kafka cluster.
        topic: The topic to read; it must exist.
        timeout: Upper bound on the whole read, in seconds.
        expect: Number of records the caller waits for (e.g. what a running flow will write).
        idle: Quiet period that ends a read without ``expect``.

    Returns:
        The records sorted by ``(partition, offset)``. May hold more than ``expect`` records if
        more were in the topic.

    Raises:
        DpstreamError: the broker is unreachable or the topic does not exist.

    """
    if expect is not None and expect < 0:
        raise DpstreamError(f"expect must be >= 0 or None, got {expect}")
    if timeout <= 0 or idle <= 0:
        raise DpstreamError(f"timeout and idle must be > 0, got timeout={timeout}, idle={idle}")
    deadline = time.monotonic() + timeout
    partitions = topic_partitions(bootstrap, topic, timeout)
    records: list[Record] = []
    if expect == 0:
        return records
    consumer = _connect(
        KafkaConsumer,
        bootstrap,
        timeout,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",  # only used if offset 0 was deleted by retention
        fetch_max_wait_ms=_POLL_MS,
    )
    try:
        assignment = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(assignment)
        for tp in assignment:
            consumer.seek(tp, 0)
        last_progress = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= deadline:
                break
            if expect is None and now - last_progress >= idle:
                break
            wait_ms = max(1, min(_POLL_MS, int((deadline - now) * 1000)))
            batches = consumer.poll(timeout_ms=wait_ms)
            got = 0
            for batch in batches.values():
                for msg in batch:
                    records.append(
                        Record(msg.partition, msg.offset, msg.key, msg.value, msg.timestamp)
                    )
                got += len(batch)
            if got:
                last_progress = time.monotonic()
                if expect is not None and len(records) >= expect:
                    break
    finally:
        consumer.close()
    records.sort(key=lambda r: (r.partition, r.offset))
    return records


def produce(
    bootstrap: str,
    topic: str,
    messages: Iterable[tuple[bytes | None, bytes | None] | tuple[bytes | None, bytes | None, int]],
    partition: int | None = None,
    timeout: float = 30.0,
) -> int:
    """Write ``(key, value)`` pairs to ``topic`` and wait until the broker acknowledged all of them.

    Args:
        bootstrap: ``host:port[,host:port...]`` of the Kafka cluster.
        topic: An existing topic.
        messages: ``(key, value)`` byte pairs, or ``(key, value, timestamp_ms)`` to set the
            record's (producer) timestamp; ``key`` may be ``None``.
        partition: Write every message to this partition; ``None`` lets the producer's default
            partitioner choose (by key hash, or spread for ``None`` keys).
        timeout: Seconds to wait for the final flush (and for metadata).

    Returns:
        The number of messages written.

    Raises:
        DpstreamError: the broker is unreachable, the topic or partition does not exist, or the
            broker rejected or did not acknowledge a message in time.

    """
    partitions = topic_partitions(bootstrap, topic, timeout)
    if partition is not None and not 0 <= partition < partitions:
        raise DpstreamError(
            f"partition {partition} does not exist in topic {topic!r} "
            f"(it has partitions 0..{partitions - 1})"
        )
    producer = _connect(
        KafkaProducer,
        bootstrap,
        timeout,
        acks="all",
        linger_ms=5,
        batch_size=256 * 1024,
        max_block_ms=int(timeout * 1000),
    )
    failures: list[BaseException] = []
    sent = 0
    try:
        for message in messages:
            key, value = message[0], message[1]
            stamp = message[2] if len(message) > 2 else None
            future = producer.send(topic, value=value, key=key, partition=partition,
                                   timestamp_ms=stamp)
            future.add_errback(failures.append)
            sent += 1
            if failures:
                break
        try:
            producer.flush(timeout=timeout)
        except kafka.errors.KafkaError as exc:
            raise DpstreamError(
                f"{topic!r}: messages not acknowledged by {bootstrap!r} within {timeout} s: {exc}"
            ) from exc
    except kafka.errors.KafkaError as exc:
        raise DpstreamError(f"cannot produce to {topic!r} on {bootstrap!r}: {exc}") from exc
    finally:
        producer.close(timeout=timeout)
    if failures:
        raise DpstreamError(
            f"the broker at {bootstrap!r} rejected messages for {topic!r} "
            f"({len(failures)} failure(s), first: {failures[0]!r})"
        )
    return sent
