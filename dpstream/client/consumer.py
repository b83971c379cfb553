"""Read a flow's output topics with kafka-python: typed records, live, de-duplicated.

:class:`RecordConsumer` assigns every partition of the topics it is given (no consumer group,
nothing committed: any number of consumers read independently) and starts at the end of
each partition, or at its beginning with ``from_beginning=True``. Each record is decoded by
:func:`~dpstream.client.records.decode`, filtered by flow (and flow instance), and added to a
:class:`~dpstream.client.latest.LatestValues` store (``consumer.latest``), which marks
replayed copies: iterating yields only new records unless asked for every one.

Records this client cannot use are counted in ``consumer.stats`` and skipped, never raised,
except a known record type at another major version with ``strict_versions=True`` (the
default): that raises :class:`~dpstream.client.records.SchemaVersionError`, because a
reader built for ``/1`` that skipped ``/2`` would show stale values without saying why.

"The end" of a partition is what the broker's ListOffsets answers. A broker whose answers
lag (the embedded test broker answers the last batch's base offset + 1) only makes the
consumer read a few older records; the store recognises them as already seen or stale.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import kafka.errors
import orjson
from kafka import KafkaConsumer, TopicPartition

from dpstream.client.latest import LatestValues
from dpstream.client.records import SchemaVersionError, UnknownRecordError, decode
from dpstream.errors import DpstreamError
from dpstream.io import retry
from dpstream.schemas import Record

__all__ = ["ReadStats", "Received", "RecordConsumer"]

log = logging.getLogger("dpstream.client")

_POLL_MS: Final = 200
_CONNECT_TIMEOUT_MS: Final = 10_000


@dataclass(frozen=True, slots=True)
class Received:
    """One decoded record and where it was read.

    Attributes:
        record: the typed record.
        new: False for a replayed copy (a duplicate, or an older step than the store holds)
            and for a conflicting copy (see :class:`~dpstream.client.latest.LatestValues`).
        value: the record's bytes as published (JSON).
    """

    record: Record
    new: bool
    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    key: bytes | None
    value: bytes

    def body(self) -> dict[str, Any]:
        """The record as published: its JSON object."""
        body: dict[str, Any] = orjson.loads(self.value)
        return body


@dataclass
class ReadStats:
    """What a consumer read: records decoded, and records skipped by reason."""

    read: int = 0
    """Records read from the topics."""
    decoded: int = 0
    """Records of the flow (or every flow) decoded."""
    other_flows: int = 0
    """Records of other flows, skipped (``flow=`` filter)."""
    other_instances: int = 0
    """Records of other flow instances, skipped (``instance=`` filter)."""
    skipped: Counter[str] = field(default_factory=Counter)
    """Records that are not usable, by reason (``not JSON``, ``unknown schema``, ...)."""

    def describe(self) -> str:
        """``read 12 records: 10 decoded, 2 skipped (1 not JSON, 1 unknown schema)``."""
        parts = [f"read {self.read} records: {self.decoded} decoded"]
        if self.other_flows:
            parts.append(f"{self.other_flows} of other flows")
        if self.other_instances:
            parts.append(f"{self.other_instances} of other flow instances")
        if self.skipped:
            reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
            parts.append(f"{sum(self.skipped.values())} skipped ({reasons})")
        return ", ".join(parts)


class RecordConsumer:
    """Read dpstream records from Kafka topics into typed records and a latest-value store.

    Args:
        brokers: ``host:port`` of the bootstrap brokers (a comma-separated string or a list).
        topics: the topics to read (a flow's releases, alerts, answers or models topic).
        flow: keep only this flow's records (others are counted in ``stats.other_flows``).
        instance: keep only this flow instance's records (its 32 hex digits, or a prefix of
            them; others are counted in ``stats.other_instances``). Records without an
            ``instance`` field (an older dpstream) never match.
        from_beginning: start at the first record of each partition instead of its end.
        strict_versions: raise :class:`SchemaVersionError` on a known record type at another
            major version; with False, count and skip it.
        latest: the store to update (a fresh :class:`LatestValues` if None).
        **kafka_config: kafka-python consumer settings (``security_protocol="SASL_SSL"``,
            ``sasl_mechanism``, ...); :func:`dpstream.query_client.kafka_python_settings`
            translates a flow's librdkafka settings.

    Raises:
        DpstreamError: no broker answers, or a topic does not exist.
        ValueError: no broker or topic given, or an unknown kafka-python setting.

    Example::

        with RecordConsumer("kafka:9092", ["releases", "alerts"], flow="demo") as consumer:
            for record in consumer:                      # live, until interrupted
                if isinstance(record, Release):
                    print(record.key, record.value, "+-", record.std)
    """

    def __init__(self, brokers: str | Sequence[str], topics: str | Sequence[str], *,
                 flow: str | None = None, instance: str | None = None,
                 from_beginning: bool = False,
                 strict_versions: bool = True, latest: LatestValues | None = None,
                 **kafka_config: Any) -> None:
        self.brokers = _names(brokers, "brokers", "host:port")
        self.topics = _names(topics, "topics", "topic")
        unknown = set(kafka_config) - set(KafkaConsumer.DEFAULT_CONFIG)
        if unknown:
            raise ValueError(f"unknown kafka-python consumer setting(s): "
                             f"{', '.join(sorted(unknown))}")
        self.flow, self.strict_versions = flow, strict_versions
        if instance is not None and not instance:
            raise ValueError("instance must name a flow instance (its id, or a prefix of it)")
        self.instance = instance
        self.latest = latest if latest is not None else LatestValues()
        self.stats = ReadStats()
        self._consumer: KafkaConsumer | None = None
        self._version_error: SchemaVersionError | None = None
        self._failures = 0  # failed polls in a row
        settings: dict[str, Any] = {
            "bootstrap_servers": self.brokers, "client_id": "dpstream-client",
            "group_id": None, "enable_auto_commit": False, "auto_offset_reset": "earliest",
            "fetch_max_wait_ms": _POLL_MS, "allow_auto_create_topics": False,
            "bootstrap_timeout_ms": _CONNECT_TIMEOUT_MS, **kafka_config}
        settings = {k: v for k, v in settings.items() if k in KafkaConsumer.DEFAULT_CONFIG}
        try:
            self._consumer = KafkaConsumer(**settings)
            self._assign(from_beginning)
        except kafka.errors.KafkaError as exc:
            self.close()
            raise DpstreamError(f"cannot reach a Kafka broker at {','.join(self.brokers)}: "
                                f"{exc}") from None
        except BaseException:
            self.close()
            raise

    def _assign(self, from_beginning: bool) -> None:
        """Assign every partition of every topic, at its beginning or its end."""
        consumer = self._consumer
        assert consumer is not None
        existing = consumer.topics()  # refreshes the metadata
        missing = [t for t in self.topics if t not in existing]
        if missing:
            shown = ", ".join(sorted(t for t in existing if not t.startswith("__"))[:20])
            raise DpstreamError(f"topic(s) {', '.join(map(repr, missing))} do not exist on "
                                f"{','.join(self.brokers)} (existing: {shown or 'none'})")
        assignment = [TopicPartition(topic, p) for topic in self.topics
                      for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(assignment)
        if from_beginning:
            for tp in assignment:  # offset 0; auto_offset_reset covers a topic with retention
                consumer.seek(tp, 0)
        else:
            for tp, offset in consumer.end_offsets(assignment).items():
                consumer.seek(tp, offset)
        for tp in assignment:  # resolve every position now, not at the first poll
            consumer.position(tp)

    def __enter__(self) -> RecordConsumer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Record]:
        """New records, live, for ever (until the caller stops or interrupts)."""
        return (received.record for received in self.received())

    def received(self, *, timeout: float | None = None, max_records: int | None = None,
                 idle: float | None = None, only_new: bool = True) -> Iterator[Received]:
        """Yield records as they arrive, with where they were read.

        Args:
            timeout: stop after this many seconds (None: never).
            max_records: stop after yielding this many records.
            idle: stop when nothing was read for this many seconds (e.g. to read a topic
                from the beginning up to "now").
            only_new: skip replayed and conflicting copies (``Received.new`` False).

        Raises:
            SchemaVersionError: see the class (``strict_versions``).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        last_read = time.monotonic()
        yielded = 0
        while max_records is None or yielded < max_records:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            if idle is not None and now - last_read >= idle:
                return
            wait = _POLL_MS / 1000
            if deadline is not None:
                wait = min(wait, deadline - now)
            before = self.stats.read
            batch = self.poll(max(wait, 0.001))
            if self.stats.read != before:
                last_read = time.monotonic()
            for item in batch:
                if only_new and not item.new:
                    continue
                yield item
                yielded += 1
                if max_records is not None and yielded >= max_records:
                    return

    def poll(self, timeout: float = _POLL_MS / 1000) -> list[Received]:
        """Read what arrived within ``timeout`` seconds; every decoded record, new or not.

        Raises:
            SchemaVersionError: see the class (``strict_versions``). The records read before
                the offending one are returned first; every later call raises.
        """
        if self._version_error is not None:
            raise self._version_error
        if self._consumer is None:
            raise DpstreamError("the consumer is closed")
        try:
            batches = self._consumer.poll(timeout_ms=max(1, int(timeout * 1000)))
        except kafka.errors.KafkaError as exc:
            self._failures += 1
            retry.pause(f"Kafka topic(s) {', '.join(self.topics)}", self._failures, str(exc),
                        timeout, logger=log.log)
            return []
        self._failures = 0
        out: list[Received] = []
        for records in batches.values():
            for message in records:
                try:
                    item = self._take(message)
                except SchemaVersionError as exc:
                    self._version_error = exc
                    return out
                if item is not None:
                    out.append(item)
        return out

    def _take(self, message: Any) -> Received | None:
        """Decode, filter and store one Kafka record."""
        self.stats.read += 1
        try:
            record = decode(message.value or b"")
        except UnknownRecordError as exc:
            self.stats.skipped[exc.reason] += 1
            return None
        except SchemaVersionError as exc:
            if self.strict_versions:
                raise
            self.stats.skipped[exc.reason] += 1
            return None
        if self.flow is not None and record.flow != self.flow:
            self.stats.other_flows += 1
            return None
        if self.instance is not None and not (record.instance or "").startswith(self.instance):
            self.stats.other_instances += 1
            return None
        self.stats.decoded += 1
        new = self.latest.add(record)
        return Received(record, new, message.topic, message.partition, message.offset,
                        message.timestamp, message.key, message.value)

    def close(self) -> None:
        """Close the Kafka consumer (idempotent)."""
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            try:
                consumer.close(autocommit=False)
            except Exception:  # noqa: BLE001 - closing must not hide the caller's error
                log.debug("closing the consumer failed", exc_info=True)


def _names(value: str | Sequence[str], what: str, example: str) -> list[str]:
    """A non-empty list of names from a comma-separated string or a sequence."""
    items = value.split(",") if isinstance(value, str) else list(value)
    names = [item.strip() for item in items if item and item.strip()]
    if not names:
        raise ValueError(f"{what} must name at least one {example}")
    return names
