"""dpstream's own Kafka edge: one client configuration, the input, the delivery-checked output.

Bytewax's Kafka connector was replaced because a privacy system cannot lose what it released:

* **Nothing released is lost.** :class:`KafkaOutput` waits for the broker's delivery report of
  every record of a batch before it returns, re-sends what failed for a transient reason (the
  broker is away longer than ``message.timeout.ms``) and fails loudly on a permanent one.
  Bytewax commits an epoch's snapshot only after its outputs were written, so a snapshot never
  covers a release that was not acknowledged (Bytewax's own sink flushes without looking at the
  delivery reports: releases vanished while the snapshots committed).
* **One client configuration.** :class:`KafkaClients` holds the brokers, ``[kafka] add_config``
  and credentials from the environment (``DPSTREAM_KAFKA_SASL_PASSWORD`` ->
  ``sasl.password``, any ``DPSTREAM_KAFKA_<PROPERTY>``); every connection the flow makes uses
  it, the partition lookup at start-up included.
* **Start-up waits for the broker** with a bounded, logged retry, refuses a broker too old to
  stamp records (Kafka < 0.10, no timestamps for the step clock) and says which topics are
  missing.
* **librdkafka's logs** go through Python logging (logger ``dpstream.kafka``), rate-limited.
* **The input** (:class:`KafkaInput`) reads assigned partitions from the recovery offset, or
  from ``kafka.start_offset`` on a fresh start, commits its position to the consumer group
  ``kafka.group_id`` (so standard lag tools see the flow; the recovery store, not the group,
  is what a restart resumes from), ends its input on a stop request (a clean stop, see
  :mod:`dpstream.stream.stopping`) and reports per-partition lag.
* **Heartbeats** (:class:`Heartbeat`) write a tick record to every input partition at a fixed
  interval, so an idle partition's clock still moves and steps keep closing (under
  ``flow.clock = "producer"`` the ticks are the only records that move it). The ticks are
  records in the partition's offset order, so a replay sees exactly the same ticks: the rule
  is as replay-deterministic as the events themselves.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final, NoReturn

import numpy as np
import orjson
from bytewax.inputs import FixedPartitionedSource, StatefulSourcePartition
from bytewax.outputs import DynamicSink, StatelessSinkPartition
from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    OFFSET_STORED,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from dpstream.errors import ConfigError, DpstreamError
from dpstream.io import retry
from dpstream.messages import TICK, Encoded, RawBatch
from dpstream.stream import stopping
from dpstream.stream.encoded import EncodedBatch

__all__ = [
    "Heartbeat",
    "KafkaClients",
    "KafkaInput",
    "KafkaOutput",
    "OutputError",
    "RateLimitedLog",
    "broker_time_problem",
    "is_secret",
    "offset_past_end",
    "probe_timestamp_type",
    "wait_for_topics",
]

log = logging.getLogger("dpstream")
kafka_log = logging.getLogger("dpstream.kafka")

ENV_PREFIX: Final = "DPSTREAM_KAFKA_"
START_OFFSETS: Final = {"earliest": OFFSET_BEGINNING, "latest": OFFSET_END,
                        "committed": OFFSET_STORED}
_SECRET_WORDS: Final = ("password", "secret", "token", "jaas", "ssl.key.pem")


class OutputError(DpstreamError):
    """The broker refused a record for good (the flow stops; nothing is marked as sent)."""


class RateLimitedLog:
    """Log a kind of message at most once per ``interval`` seconds, counting the rest."""

    def __init__(self, logger: logging.Logger, interval: float = 30.0) -> None:
        self.logger, self.interval = logger, interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, kind: str, level: int, message: str, *args: Any) -> None:
        """Log ``message % args`` at ``level`` unless ``kind`` was logged too recently."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            message += " (%d similar message(s) suppressed in the last %.0f s)"
            args = (*args, suppressed, self.interval)
        self.logger.log(level, message, *args)


class _LibrdkafkaLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """What librdkafka's ``logger`` setting calls: rate-limited by facility."""

    def __init__(self, client: str, on_error: Callable[[str], None]) -> None:
        super().__init__(kafka_log, {})
        self.client, self.on_error = client, on_error
        self.limited = RateLimitedLog(kafka_log, 30.0)

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        text = str(msg) % args if args else str(msg)
        if level >= logging.ERROR:
            self.on_error(self.client)
        facility = text.split(" ", 2)[1] if text.count(" ") >= 2 else text[:20]
        self.limited(f"{self.client}:{facility}", level, "%s: %s", self.client, text)


def _ignore_error(_client: str) -> None:
    return None


def is_secret(name: str) -> bool:
    """Whether a librdkafka setting holds a credential (masked; belongs in the environment)."""
    return any(word in name for word in _SECRET_WORDS)


def _redact(settings: Mapping[str, str]) -> dict[str, str]:
    return {k: ("***" if is_secret(k) else v) for k, v in settings.items()}


@dataclass(frozen=True)
class KafkaClients:
    """The librdkafka settings every connection of a flow uses.

    Args:
        brokers: ``host:port`` of the bootstrap brokers.
        add_config: librdkafka properties from ``[kafka] add_config``.
        environ: the environment; ``DPSTREAM_KAFKA_<PROPERTY>`` sets ``<property>`` with
            ``_`` read as ``.`` (``DPSTREAM_KAFKA_SASL_PASSWORD`` -> ``sasl.password``).
            Credentials belong there, not in the configuration file.
        on_error: called with the client kind on every error-level librdkafka log line.
    """

    brokers: tuple[str, ...]
    add_config: Mapping[str, str] = field(default_factory=dict)
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    on_error: Callable[[str], None] = _ignore_error

    @property
    def bootstrap(self) -> list[str]:
        """The bootstrap brokers actually used (the environment may override the file)."""
        return [b.strip() for b in self.settings["bootstrap.servers"].split(",") if b.strip()]

    @property
    def settings(self) -> dict[str, str]:
        """The common settings, with the environment's credentials."""
        settings = {"bootstrap.servers": ",".join(self.brokers), **self.add_config}
        for name, value in self.environ.items():
            if name.startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX):
                settings[name[len(ENV_PREFIX):].lower().replace("_", ".")] = value
        return settings

    def describe(self) -> str:
        """The settings with secrets masked (for logs and errors)."""
        return ", ".join(f"{k}={v}" for k, v in sorted(_redact(self.settings).items()))

    def config(self, client: str, **extra: Any) -> dict[str, Any]:
        """Settings for one client (``consumer``, ``producer`` or ``admin``)."""
        return {**self.settings, "client.id": f"dpstream-{client}",
                "logger": _LibrdkafkaLogger(client, self.on_error), **extra}

    @property
    def too_old_for_timestamps(self) -> bool:
        """The settings themselves say the broker predates Kafka 0.10 (no record timestamps)."""
        fallback = self.settings.get("broker.version.fallback", "")
        try:
            major, minor = (int(x) for x in fallback.split(".")[:2])
        except ValueError:
            return False
        return (major, minor) < (0, 10) and \
            self.settings.get("api.version.request", "true").lower() == "false"

    @property
    def plaintext(self) -> bool:
        """Whether the connection is plain TCP (the version probe speaks only that)."""
        return self.settings.get("security.protocol", "plaintext").lower() == "plaintext"


_TOO_OLD = ("the Kafka broker at {where} is older than Kafka 0.10 ({why}): its records carry no "
            "timestamps, and dpstream's step clock places and closes time steps by the "
            "broker's record timestamps (flow.clock = 'broker' needs topics with "
            "message.timestamp.type=LogAppendTime, 'producer' needs producer timestamps). "
            "Use Kafka 0.10 or later")


def _ask(address: str, api_key: int, body: bytes, timeout: float) -> bool | None:
    """Send one version-0 request; True if answered, False if not, None if unreachable."""
    host, _, port = address.rpartition(":")
    client = b"dpstream-probe"
    request = struct.pack(">hhih", api_key, 0, 7, len(client)) + client + body
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except (OSError, ValueError):
        return None
    try:
        sock.settimeout(timeout)
        sock.sendall(struct.pack(">i", len(request)) + request)
        header = sock.recv(8)
        return len(header) >= 8 and struct.unpack(">ii", header[:8])[1] == 7
    except OSError:
        return False
    finally:
        sock.close()


def probe_api_versions(address: str, timeout: float = 3.0) -> bool | None:
    """Whether a plaintext broker is too old to stamp records (Kafka < 0.10).

    Kafka 0.10 introduced both record timestamps and the ApiVersions request. A broker that
    answers a Metadata v0 request but stays silent on ApiVersions is older; one that answers
    neither is not ready (or not Kafka), and start-up keeps waiting for it.

    Returns:
        True if it answered ApiVersions (0.10 or later), False if it is older, None if it
        cannot be reached or does not answer yet.
    """
    answered = _ask(address, 18, b"", timeout)
    if answered is not False:
        return answered
    return False if _ask(address, 3, struct.pack(">i", 0), timeout) else None


def _kafka_reason(exc: BaseException) -> str:
    """The text of a :class:`KafkaException`'s error (or of the exception)."""
    return exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)


def wait_for_topics(clients: KafkaClients, input_topic: str, output_topics: Iterable[str],
                    timeout: float = 60.0) -> int:
    """Wait for the cluster, check the topics, return the input topic's partition count.

    Retries an unreachable cluster for ``timeout`` seconds, logging each attempt. Refuses a
    broker older than Kafka 0.10 (no record timestamps) and missing topics, naming them.

    Raises:
        DpstreamError: unreachable after ``timeout``, a broker too old, a topic missing.
    """
    where = ",".join(clients.bootstrap)
    if clients.too_old_for_timestamps:
        raise DpstreamError(_TOO_OLD.format(
            where=where, why="the settings say broker.version.fallback="
            + clients.settings["broker.version.fallback"]))
    deadline = time.monotonic() + timeout

    def attempt(_attempt: int) -> Any:
        if clients.plaintext:
            answers = [probe_api_versions(a) for a in clients.bootstrap]
            if False in answers and True not in answers:
                raise DpstreamError(_TOO_OLD.format(
                    where=where, why="it does not answer the ApiVersions request"))
        admin = AdminClient(clients.config("admin"))
        return admin.list_topics(timeout=min(2.0, max(0.5, deadline - time.monotonic())))

    def give_up(gave_up: retry.GaveUp) -> NoReturn:
        if gave_up.stopped:
            raise DpstreamError("stopped while waiting for Kafka") from None
        raise DpstreamError(
            f"cannot reach a Kafka broker at {where} after {timeout:.0f} s "
            f"({gave_up.attempts} attempts; last: {gave_up.reason}); "
            f"settings: {clients.describe()}") from None

    metadata = retry.retry(attempt, what=f"Kafka at {where}", retry_on=(KafkaException,),
                           reason=_kafka_reason, deadline=deadline,
                           delay=retry.linear(2.0, 10.0), logger=log.log, interruptible=True,
                           give_up=give_up)
    topics = {name: t for name, t in metadata.topics.items() if t.error is None}
    missing = [t for t in (input_topic, *output_topics) if t not in topics]
    if missing:
        existing = sorted(t for t in topics if not t.startswith("__"))
        shown = ", ".join(existing[:20]) or "none"
        raise DpstreamError(
            f"Kafka topic(s) {', '.join(repr(t) for t in missing)} do not exist on {where} "
            f"(existing: {shown}). dpstream does not create topics while it runs: create "
            "them with `dpstream topics --config FILE` or your cluster's tools (the input "
            "topic with message.timestamp.type=LogAppendTime)")
    return len(topics[input_topic].partitions)


def create_missing_topics(clients: KafkaClients, wanted: Mapping[str, tuple[int, dict[str, str]]],
                          timeout: float = 30.0) -> dict[str, int | None]:
    """Create the topics of ``wanted`` (name -> (partitions, topic settings)) that are missing.

    Uses the flow's own client settings (security and credentials included).

    Returns:
        For each topic, its partition count if it existed already, None if it was created.

    Raises:
        DpstreamError: the cluster is unreachable or refused to create a topic.
    """
    from confluent_kafka.cimpl import NewTopic

    admin = AdminClient(clients.config("admin"))
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
        raise DpstreamError(f"cannot reach a Kafka broker at {','.join(clients.bootstrap)} "
                            f"({reason})") from None
    existing = {name: len(t.partitions) for name, t in metadata.topics.items()
                if t.error is None}
    missing = [NewTopic(name, num_partitions=partitions, replication_factor=-1, config=settings)
               for name, (partitions, settings) in wanted.items() if name not in existing]
    for name, future in (admin.create_topics(missing, request_timeout=timeout).items()
                         if missing else []):
        try:
            future.result(timeout)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise DpstreamError(f"cannot create topic {name!r}: {exc.args[0].str()}") from None
    return {name: existing.get(name) for name in wanted}


# --- timestamp probe ------------------------------------------------------------------------

PROBE_TIMEOUT_SECONDS: Final = 10.0
TIMESTAMP_NAMES: Final = {0: "none", 1: "CreateTime", 2: "LogAppendTime"}


def probe_timestamp_type(clients: KafkaClients, topic: str, partition: int = 0, *,
                         write: bool = True, timeout: float = PROBE_TIMEOUT_SECONDS
                         ) -> int | None:
    """The timestamp type the broker gives records of ``topic[partition]``.

    With ``write``, a heartbeat tick (:data:`~dpstream.messages.TICK`, which every consumer
    of the flow skips) is written to the partition and read back at the offset its delivery
    report names, so the answer is what the broker did with a record written now: a topic
    with ``message.timestamp.type=LogAppendTime`` on a broker that honours it gives 2
    (LogAppendTime); a topic without it, or a broker that ignores it (Tansu, the embedded
    ``dpstream broker``), gives 1 (CreateTime). Without ``write`` the partition's newest
    record is read (nothing is written), if there is one: a topic switched to LogAppendTime
    keeps its older CreateTime records.

    Returns:
        0 (no timestamp), 1 (CreateTime) or 2 (LogAppendTime); None when nothing could be
        read back within ``timeout`` (an empty partition without ``write``).

    Raises:
        DpstreamError: the probe record could not be written.
    """
    offset = OFFSET_BEGINNING
    if write:
        producer = Producer(clients.config(
            "producer", **{"linger.ms": 0, "client.id": "dpstream-probe",
                           "message.timeout.ms": max(1000, int(timeout * 1000))}))
        reports: list[tuple[KafkaError | None, int | None]] = []
        producer.produce(topic, TICK, b"dpstream.tick", partition=partition,
                         on_delivery=lambda err, msg: reports.append((err, msg.offset())))
        producer.flush(timeout)
        if not reports or reports[0][0] is not None or reports[0][1] is None:
            why = reports[0][0].str() if reports and reports[0][0] is not None else "no answer"
            raise DpstreamError(f"cannot write a probe record (a heartbeat tick) to "
                                f"{topic}[{partition}] to check its timestamps: {why}")
        offset = reports[0][1]
    consumer = Consumer(clients.config(
        "consumer", **{"group.id": "dpstream-probe", "enable.auto.commit": False,
                       "enable.partition.eof": True, "auto.offset.reset": "earliest"}))
    try:
        if not write:  # the newest record: a topic switched to LogAppendTime keeps its older
            try:  # CreateTime records, which are dead letters, not a reason to refuse the run
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                                           timeout=timeout)
                if high > low:
                    offset = high - 1
            except KafkaException:
                pass  # cannot tell: read from the start
        consumer.assign([TopicPartition(topic, partition, offset)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = consumer.poll(min(0.5, max(0.01, deadline - time.monotonic())))
            if message is None:
                continue
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF and not write:
                    return None
                continue
            return int(message.timestamp()[0])
        return None
    finally:
        consumer.close()


def offset_past_end(clients: KafkaClients, topic: str, partition: int, offset: int,
                    timeout: float = 3.0) -> int | None:
    """The end of ``topic[partition]`` if ``offset`` provably lies beyond it, else None.

    Fails closed: only an end of partition read before ``offset`` counts as evidence; a
    timeout or an unanswered fetch is taken as "within the partition" (the caller re-reads
    a partition from its start only on evidence, never on doubt).

    The broker's high watermark answers first; a broker that under-reports it (Tansu) is
    checked by reading the record just before ``offset``: a record there, or an end of
    partition at ``offset`` or later, means the offset is within the partition. A fetch
    beyond the end returns nothing on such a broker (a silent stall), which is what this
    catches.
    """
    consumer = Consumer(clients.config(
        "consumer", **{"group.id": "dpstream-probe", "enable.auto.commit": False,
                       "enable.partition.eof": True, "auto.offset.reset": "error"}))
    try:
        try:
            _low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                                        timeout=timeout)
        except KafkaException:
            return None  # cannot tell: the reader itself reports what it meets
        if offset <= high:
            return None
        # a record at or after offset - 1, or an end at or after offset: within the partition
        first = _first_position(consumer, topic, partition, offset - 1, timeout, records=True)
        if first is not None and first >= offset - 1:
            return None
        first = _first_position(consumer, topic, partition, offset - 1, timeout)
        if first is not None and first >= offset:
            return None
        # past the end only on evidence: a read from the reported high watermark stops at an
        # end before offset. Anything unconfirmed (a timeout, no answer) is "within": a false
        # "past the end" would re-read records already counted (fail closed)
        end = _first_position(consumer, topic, partition, max(high, 0), timeout, eof=True)
        return end if end is not None and end < offset else None
    finally:
        consumer.close()


def _first_position(consumer: Consumer, topic: str, partition: int, offset: int,
                    timeout: float, eof: bool = False, records: bool = False) -> int | None:
    """The offset of the first record at or after ``offset``, or of the partition's end.

    With ``eof``, read on to the end of the partition and return its offset; with
    ``records``, only a record counts (an end gives None). None when the broker answered
    nothing (a fetch past the end on some brokers) or refused the offset.
    """
    consumer.assign([TopicPartition(topic, partition, offset)])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = consumer.poll(0.2)
        if message is None:
            continue
        error, position = message.error(), message.offset()
        if error is None:
            if eof:
                continue
            return position
        if error.code() == KafkaError._PARTITION_EOF:
            return None if records else position
        return None  # out of range (auto.offset.reset = error)
    return None


def broker_time_problem(topic: str, kind: int | None) -> str | None:
    """Why ``flow.clock = "broker"`` cannot read ``topic`` (from a probed timestamp type).

    None when the records carry broker time (LogAppendTime) or nothing could be probed.
    """
    if kind is None or kind == 2:
        return None
    got = ("the producer's time (CreateTime)" if kind == 1 else "no timestamp")
    return (f"input topic {topic!r}: records of {topic}[0] come back with {got}, not broker "
            "time (LogAppendTime), so flow.clock = \"broker\" would dead-letter every event. "
            "Either the topic lacks message.timestamp.type=LogAppendTime (set it: kafka-configs "
            f"--alter --entity-type topics --entity-name {topic} --add-config "
            "message.timestamp.type=LogAppendTime), or the broker ignores it (the embedded "
            "`dpstream broker` does: use a broker that honours it), or, if every producer of "
            "the topic is trusted, set flow.clock = \"producer\" (or DPSTREAM_FLOW_CLOCK=producer)")


# --- input ----------------------------------------------------------------------------------

Observer = Callable[[int, int], None]  # partition, records not yet read
AnomalyObserver = Callable[[str, str], None]  # topic, reason (dpstream.topology.REASONS)
TOPOLOGY_CHECK_SECONDS: Final = float(os.environ.get("DPSTREAM_TOPOLOGY_CHECK_SECONDS", "60"))
"""How long a tailing input partition is idle before it checks its position is in the topic."""
_GONE: Final = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION,
                          KafkaError._UNKNOWN_TOPIC})
_IDLE_WAIT: Final = timedelta(milliseconds=20)


class _InputPartition(StatefulSourcePartition[RawBatch, int]):
    """One input partition, read from an explicit offset (no group rebalancing)."""

    def __init__(self, config: dict[str, Any], topic: str, partition: int, offset: int,
                 batch_size: int, tail: bool, observe_lag: Observer,
                 first_partition: int = 0,
                 observe_anomaly: AnomalyObserver | None = None,
                 clients: KafkaClients | None = None) -> None:
        self.topic, self.partition, self.batch_size, self.tail = topic, partition, \
            batch_size, tail
        self.observe_anomaly = observe_anomaly or (lambda _t, _r: None)
        self._reported: set[str] = set()
        self.clients = clients
        self._idle_since: float | None = None
        self.flow_partition = first_partition + partition
        self.observe_lag = observe_lag
        self.offset = offset
        config = dict(config)
        config["stats_cb"] = self._stats
        self.consumer = Consumer(config)
        self.consumer.assign([TopicPartition(topic, partition, offset)])
        self._eof = False
        self._idle = False
        self.errors = RateLimitedLog(log, 30.0)

    def _stats(self, text: str) -> None:
        try:
            stats = orjson.loads(text)["topics"][self.topic]["partitions"][str(self.partition)]
        except (KeyError, orjson.JSONDecodeError):
            return
        lag = stats.get("consumer_lag", -1)
        if isinstance(lag, int) and lag >= 0:
            self.observe_lag(self.flow_partition, lag)

    def next_batch(self) -> list[RawBatch]:
        if self._eof or stopping.stop_requested():
            raise StopIteration
        messages = self.consumer.consume(self.batch_size, 0.001)
        values: list[bytes | None] = []
        offsets: list[int | None] = []
        stamps: list[tuple[int, int]] = []
        topic, partition = self.topic, self.partition
        for m in messages:
            error = m.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    if not self.tail:
                        self._eof = True
                    continue
                if error.code() in _GONE:
                    self._anomaly("partition_vanished",
                                  "input %s[%d] vanished (at offset %d): %s; the flow waits for "
                                  "it, and steps stay open until it is back",
                                  topic, partition, self.offset, error.str())
                self.errors(f"consume:{error.code()}", logging.WARNING,
                            "input %s[%d]: %s", topic, partition, error.str())
                continue
            values.append(m.value())
            offsets.append(m.offset())
            stamps.append(m.timestamp())
        self._idle = not values
        if not values:
            self._check_when_idle()
            return []
        self._idle_since = None
        if self.offset >= 0 and offsets[0] < self.offset:  # type: ignore[operator]
            self._anomaly("offsets_went_back",
                          "input %s[%d]: expected offset %d next, the broker delivered offset %d: "
                          "the partition is shorter than what was read (the topic was re-created "
                          "or truncated); reading on from there", topic, partition, self.offset,
                          offsets[0])
        self.offset = offsets[-1] + 1  # type: ignore[operator]
        kinds_ms = np.array(stamps, dtype=np.int64).reshape(-1, 2)
        return [RawBatch(self.flow_partition, values, offsets, [topic] * len(values),
                         kinds_ms[:, 1].astype(np.float64), kinds_ms[:, 0].copy())]

    def _check_when_idle(self) -> None:
        """After ``TOPOLOGY_CHECK_SECONDS`` without records, check the position is in the topic.

        A topic re-created while the flow runs leaves the reader's position past the new
        partition's end; some brokers (Tansu) then answer every fetch with nothing, not an
        error, and the partition holds every step open in silence. Then the partition is
        read from its start, with a warning and ``offset_past_end`` counted.
        """
        if not self.tail or self.clients is None or self.offset < 0:
            return
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
            return
        if now - self._idle_since < TOPOLOGY_CHECK_SECONDS:
            return
        self._idle_since = now
        end = offset_past_end(self.clients, self.topic, self.partition, self.offset)
        if end is None:
            return
        self._anomaly("offset_past_end",
                      "input %s[%d]: the next offset %d is past the partition's end %d (the "
                      "topic was re-created or truncated while the flow ran): reading it from "
                      "its start", self.topic, self.partition, self.offset, end)
        self.consumer.assign([TopicPartition(self.topic, self.partition, OFFSET_BEGINNING)])
        self.offset = OFFSET_BEGINNING

    def _anomaly(self, reason: str, message: str, *args: Any) -> None:
        """Count a topology anomaly; log it once per reason and partition."""
        self.observe_anomaly(self.topic, reason)
        if reason not in self._reported:
            self._reported.add(reason)
            log.warning(message, *args)

    def next_awake(self) -> datetime | None:
        if self._idle:  # nothing arrived: do not spin on the broker
            return datetime.now(UTC) + _IDLE_WAIT
        return None

    def snapshot(self) -> int:
        if self.offset >= 0:  # tell the consumer group where we are (for lag tools only)
            try:
                self.consumer.commit(offsets=[TopicPartition(self.topic, self.partition,
                                                             self.offset)], asynchronous=True)
            except KafkaException as exc:
                self.errors("commit", logging.WARNING, "input %s[%d]: offset commit failed: %s",
                            self.topic, self.partition, exc)
        return self.offset

    def close(self) -> None:
        self.consumer.close()


class KafkaInput(FixedPartitionedSource[RawBatch, int]):
    """Every partition of one topic, one :class:`~dpstream.messages.RawBatch` per read batch.

    Args:
        clients: the flow's Kafka settings.
        topic: the input topic.
        partitions: its partition count (from :func:`wait_for_topics`).
        group_id: the consumer group offsets are committed to (for lag tools).
        start_offset: ``earliest``, ``latest`` or ``committed`` (the group's offset, else
            earliest), used for a partition with no recovery state.
        batch_size: most records per batch.
        tail: keep reading at the end (``False``: the input ends at the end of the topic).
        observe_lag: called with (partition, records not yet read) from librdkafka's statistics.
        rewind: partition -> a recovery offset found past the partition's end at start-up
            (:mod:`dpstream.topology`): that partition is read from its start instead.
        observe_anomaly: called with (topic, reason) on a topology anomaly met while reading.
        first_partition: the flow's input partition number of this topic's partition 0 (a
            flow with several input topics numbers their partitions one after the other).
    """

    def __init__(self, clients: KafkaClients, topic: str, partitions: int, *,
                 group_id: str, start_offset: str = "earliest", batch_size: int = 10_000,
                 tail: bool = True, observe_lag: Observer | None = None,
                 first_partition: int = 0, rewind: Mapping[int, int] | None = None,
                 observe_anomaly: AnomalyObserver | None = None) -> None:
        if start_offset not in START_OFFSETS:
            raise ConfigError(f"kafka.start_offset must be one of {sorted(START_OFFSETS)}, "
                              f"got {start_offset!r}")
        self.clients, self.topic, self.partitions = clients, topic, partitions
        self.group_id, self.start_offset = group_id, start_offset
        self.batch_size, self.tail = batch_size, tail
        self.observe_lag = observe_lag or (lambda _p, _n: None)
        self.first_partition = first_partition
        self.rewind = dict(rewind or {})
        self.observe_anomaly = observe_anomaly

    def list_parts(self) -> list[str]:
        """One Bytewax input partition per Kafka partition, named by its index."""
        return [str(p) for p in range(self.partitions)]

    def build_part(self, step_id: str, for_part: str, resume_state: int | None
                   ) -> _InputPartition:
        """Read partition ``for_part`` from its recovery offset or the start offset."""
        config = self.clients.config(
            "consumer", **{"group.id": self.group_id, "enable.auto.commit": False,
                           "enable.auto.offset.store": False,
                           "enable.partition.eof": not self.tail,
                           "auto.offset.reset": "earliest",
                           "statistics.interval.ms": 5000})
        offset = START_OFFSETS[self.start_offset] if resume_state is None else resume_state
        partition = int(for_part)
        if resume_state is not None and self.rewind.get(partition) == resume_state:
            offset = OFFSET_BEGINNING  # past the partition's end (dpstream.topology)
        return _InputPartition(config, self.topic, partition, offset, self.batch_size,
                               self.tail, self.observe_lag, self.first_partition,
                               self.observe_anomaly, self.clients)


# --- output ---------------------------------------------------------------------------------

DeliveryObserver = Callable[[int, dict[str, int], int], None]  # pending, delivered, retried
STOP_GRACE_SECONDS: Final = 10.0


def _permanent(error: KafkaError) -> bool:
    if error.fatal():
        return True
    return error.code() in {KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.TOPIC_AUTHORIZATION_FAILED,
                            KafkaError.INVALID_RECORD, KafkaError.RECORD_LIST_TOO_LARGE,
                            KafkaError._INVALID_ARG, KafkaError.INVALID_REQUIRED_ACKS,
                            KafkaError.CLUSTER_AUTHORIZATION_FAILED}


class _OutputPartition(StatelessSinkPartition[Encoded | EncodedBatch]):
    def __init__(self, config: dict[str, Any], topics: Mapping[str, str],
                 observe: DeliveryObserver) -> None:
        self.producer = Producer(config)
        self.topics, self.observe = dict(topics), observe
        self.waiting = RateLimitedLog(log, 10.0)

    def write_batch(self, items: list[Encoded | EncodedBatch]) -> None:
        """Send ``items`` and return only once the broker acknowledged every one of them.

        An item is a record ``(role, key, value)`` or an :class:`EncodedBatch` of them (a
        closed step's records), sent in order.
        """
        pending: list[Encoded] = []
        for item in items:
            if isinstance(item, EncodedBatch):
                pending.extend(item)
            else:
                pending.append(item)
        delivered: dict[str, int] = {}
        retried = 0
        started = time.monotonic()

        def send(attempt: int) -> None:
            nonlocal pending, retried
            if attempt > 1:
                self._waiting(len(pending), started)
            failed: list[tuple[Encoded, KafkaError]] = []
            self._produce(pending, delivered, failed)
            while len(self.producer) > 0:
                self.producer.flush(1.0)
                if len(self.producer) > 0:
                    self._waiting(len(self.producer), started)
            permanent = [(item, err) for item, err in failed if _permanent(err)]
            if permanent:
                (role, _key, value), err = permanent[0]
                raise OutputError(
                    f"the broker refused a {role} record for good ({err.str()}, "
                    f"{len(value)} bytes, topic {self.topics[role]!r}); nothing of this "
                    "epoch is marked as sent: fix the cause and restart (the recovery store "
                    "replays it with the same noise)")
            pending = [item for item, _err in failed]
            if pending:
                retried += len(pending)
                raise retry.NotYet(
                    f"{len(pending)} output record(s) not delivered ({failed[0][1].str()}); "
                    "re-sending (the snapshot waits for them)")

        if pending:  # resent until delivered: the snapshot waits for them (no bound, no delay)
            retry.retry(send, what="the broker to take the output", delay=retry.fixed(0.0),
                        logger=functools.partial(self.waiting, "retry"))
        self.observe(0, delivered, retried)

    def _produce(self, items: list[Encoded], delivered: dict[str, int],
                 failed: list[tuple[Encoded, KafkaError]]) -> None:
        """Hand ``items`` to the producer; delivery reports count them or list the failures.

        One delivery callback per role (not one closure per record): a failed record is
        rebuilt from the reported message, which holds the same key and value.
        """
        def reporter(role: str) -> Callable[[KafkaError | None, Any], None]:
            def report(error: KafkaError | None, message: Any) -> None:
                if error is None:
                    delivered[role] = delivered.get(role, 0) + 1
                else:
                    failed.append(((role, message.key(), message.value()), error))
            return report

        reports = {role: reporter(role) for role in self.topics}
        produce, topics = self.producer.produce, self.topics
        for item in items:
            role, key, value = item
            try:
                produce(topics[role], value, key, on_delivery=reports[role])
            except BufferError:  # the local queue is full: let deliveries drain it
                self._produce_blocked(item, reports[role], failed)
            except KafkaException as exc:
                failed.append((item, exc.args[0]))

    def _produce_blocked(self, item: Encoded, report: Callable[[KafkaError | None, Any], None],
                         failed: list[tuple[Encoded, KafkaError]]) -> None:
        role, key, value = item

        def produce(_attempt: int) -> None:
            self.producer.poll(0.1)  # the wait: serves delivery reports, which drain the queue
            self.producer.produce(self.topics[role], value, key, on_delivery=report)

        try:
            retry.retry(produce, what="room in the producer's queue", retry_on=(BufferError,),
                        delay=retry.fixed(0.0), level=logging.DEBUG)
        except KafkaException as exc:
            failed.append((item, exc.args[0]))

    def _waiting(self, pending: int, started: float) -> None:
        self.observe(pending, {}, 0)
        self.waiting("wait", logging.WARNING,
                     "waiting %.0f s for the broker to acknowledge %d output record(s)",
                     time.monotonic() - started, pending)
        if stopping.stop_requested() and time.monotonic() - started > STOP_GRACE_SECONDS:
            log.error("stopping with %d output record(s) not acknowledged: this epoch is not "
                      "committed, so a restart with the same recovery store re-sends them "
                      "(same noise)", pending)
            logging.shutdown()
            os._exit(3)

    def close(self) -> None:
        self.producer.flush(5.0)


class KafkaOutput(DynamicSink[Encoded | EncodedBatch]):
    """Write ``(role, key, value)`` records to the topic of their role, delivery-checked.

    Items are records, or :class:`~dpstream.stream.encoded.EncodedBatch` sequences of them.

    Args:
        clients: the flow's Kafka settings.
        topics: topic name of each role (``releases``, ``alerts``, ``dead_letters``).
        observe: called with (records pending, delivered per role, re-sent).
    """

    def __init__(self, clients: KafkaClients, topics: Mapping[str, str],
                 observe: DeliveryObserver | None = None) -> None:
        self.clients, self.topics = clients, dict(topics)
        self.observe = observe or (lambda _p, _d, _r: None)

    def build(self, step_id: str, worker_index: int, worker_count: int) -> _OutputPartition:
        """One delivery-checked producer per worker."""
        config = self.clients.config("producer", **{"acks": "all", "linger.ms": 5})
        return _OutputPartition(config, self.topics, self.observe)


# --- heartbeat ------------------------------------------------------------------------------

class Heartbeat:
    """Write a tick record to every partition of the input topic every ``interval`` seconds.

    A tick carries no event: the flow reads only its timestamp, so an input partition
    without traffic still moves its clock and the steps keep closing (otherwise one idle
    partition holds every step open). Under ``flow.clock = "producer"`` the ticks are the
    only records that move the watermark (:mod:`dpstream.stream.clock`): each is stamped with
    this host's clock minus ``delay`` (``flow.tick_delay``), so that a tick does not overtake
    the batches producers have in flight (an event overtaken anyway is placed in the open
    step, not lost). Under the broker clock the broker stamps the ticks (LogAppendTime) in
    append order and ``delay`` is 0. Other consumers of the input topic must skip records
    whose value is ``{"dpstream.tick":1}``.
    """

    def __init__(self, clients: KafkaClients, topic: str, partitions: int,
                 interval: float, delay: float = 0.0,
                 now: Callable[[], float] = time.time) -> None:
        self.clients, self.topic, self.partitions, self.interval = clients, topic, \
            partitions, interval
        self.delay, self.now = delay, now
        self.failures = RateLimitedLog(log, 60.0)
        self._thread = threading.Thread(target=self._run, name="dpstream-heartbeat",
                                        daemon=True)
        self._stop = threading.Event()

    def start(self) -> Heartbeat:
        """Start ticking in a daemon thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop ticking."""
        self._stop.set()

    def stamp(self) -> int:
        """A tick's timestamp (ms since the epoch): now minus the delay."""
        return int((self.now() - self.delay) * 1000)

    def _run(self) -> None:
        # a tick is only useful when fresh: one that cannot be delivered within its interval
        # is dropped rather than appended after an outage, behind records stamped earlier
        timeout_ms = max(1000, int(self.interval * 1000))
        producer = Producer(self.clients.config(
            "producer", **{"linger.ms": 0, "client.id": "dpstream-heartbeat",
                           "message.timeout.ms": timeout_ms}))

        def report(error: KafkaError | None, _message: Any) -> None:
            if error is not None:
                self.failures("tick", logging.WARNING,
                              "heartbeat to %s failed (%s): idle partitions stop closing "
                              "steps until it works", self.topic, error.str())

        while not self._stop.is_set() and not stopping.stop_requested():
            stamp = self.stamp()
            for p in range(self.partitions):
                try:
                    producer.produce(self.topic, TICK, b"dpstream.tick", partition=p,
                                     on_delivery=report, timestamp=stamp)
                except (BufferError, KafkaException) as exc:
                    self.failures("tick", logging.WARNING, "heartbeat: %s", exc)
            producer.poll(0)
            self._stop.wait(self.interval)
        producer.flush(2.0)
