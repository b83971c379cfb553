"""Ask a running PMWG flow questions over Kafka, and wait for its answers.

A PMWG flow (:mod:`dpstream.kinds.pmwg.kind`) reads questions from its queries topic and writes
``dpstream.answer/1`` records to its answers topic when the step holding the question's
broker time closes::

    from dpstream.query_client import QueryClient

    with QueryClient("kafka:9092", flow="sessions") as client:
        answer = client.ask("sessions", {"kind": "count",
                                         "where": [{"attr": "country", "eq": "de"}]})
        print(answer["kind"], answer["value"])

**Nothing is missed.** The client assigns every partition of the answers topic at its end
offset when it is created, before any question is sent, and keeps reading from there: an
answer written after that moment is seen whatever the timing. (A broker whose end-offset
answers lag, such as the embedded test broker, only makes it read a few older records, which
it skips.) Questions are keyed by histogram name, so the questions to one histogram stay in
one partition and are answered in the order they were sent.

**Replays.** A flow resumed from its recovery store may publish an answer again (delivery is
at least once); a replayed answer is byte-identical to the first. The client keeps the
*first* record with an id and ignores later ones. With ``flow`` given, records of other
flows sharing the answers topic are ignored, and records that are not ``dpstream.answer/1``
are always ignored.

**Ids** are the caller's (at most 256 characters) or a fresh ``uuid4`` hex. An id used twice
gets the first answer the client saw for it: use fresh ids.

The client uses kafka-python (no consumer group, nothing committed). ``**kafka_config`` are
kafka-python settings (``security_protocol="SASL_SSL"``, ``sasl_mechanism``,
``sasl_plain_username``, ...); :func:`kafka_python_settings` translates a flow's librdkafka
settings (``[kafka] add_config`` and ``DPSTREAM_KAFKA_*``) into them.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Final

import kafka.errors
import msgspec
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from dpstream.errors import DpstreamError
from dpstream.io import retry
from dpstream.schemas import Answer

__all__ = ["QUERY_SCHEMA", "QueryClient", "describe_answer",
           "kafka_python_settings"]

log = logging.getLogger("dpstream")

_ANSWER: Final = msgspec.json.Decoder(Answer)
QUERY_SCHEMA: Final = "dpstream.query/1"
MAX_QUERY_ID: Final = 256
"""The longest id the flow accepts (longer ones become dead letters)."""
MAX_HISTOGRAM_NAME: Final = 64
_POLL_MS: Final = 200
_REMEMBERED: Final = 10_000
"""Answers kept for ids already returned (so asking again gives the same record)."""

_LIBRDKAFKA_TO_KAFKA_PYTHON: Final = {
    "security.protocol": "security_protocol",
    "sasl.mechanism": "sasl_mechanism",
    "sasl.mechanisms": "sasl_mechanism",
    "sasl.username": "sasl_plain_username",
    "sasl.password": "sasl_plain_password",
    "sasl.kerberos.service.name": "sasl_kerberos_service_name",
    "ssl.ca.location": "ssl_cafile",
    "ssl.certificate.location": "ssl_certfile",
    "ssl.key.location": "ssl_keyfile",
    "ssl.key.password": "ssl_password",
    "ssl.crl.location": "ssl_crlfile",
    "client.dns.lookup": "client_dns_lookup",
}


def kafka_python_settings(settings: Mapping[str, str]) -> dict[str, Any]:
    """Translate a flow's librdkafka settings into kafka-python's (connection and security).

    ``bootstrap.servers`` is left out (the client takes the brokers separately); tuning
    settings that have no kafka-python counterpart are skipped (logged at debug level).
    ``ssl.endpoint.identification.algorithm = none`` turns host name checks off.
    """
    out: dict[str, Any] = {}
    for name, value in settings.items():
        if name == "bootstrap.servers":
            continue
        if name in _LIBRDKAFKA_TO_KAFKA_PYTHON:
            target = _LIBRDKAFKA_TO_KAFKA_PYTHON[name]
            out[target] = value.upper() if target in ("security_protocol",
                                                      "sasl_mechanism") else value
        elif name == "ssl.endpoint.identification.algorithm":
            out["ssl_check_hostname"] = value.lower() != "none"
        else:
            log.debug("query client: librdkafka setting %s has no kafka-python counterpart; "
                      "skipped", name)
    return out


def _check_envelope(histogram: Any, query: Any, query_id: Any) -> None:
    """Raise a precise ValueError when the flow would refuse the question as a dead letter."""
    if not isinstance(query_id, str) or not query_id or len(query_id) > MAX_QUERY_ID:
        raise ValueError(f"query_id must be a non-empty string of at most {MAX_QUERY_ID} "
                         f"characters, got {query_id!r:.80}")
    if (not isinstance(histogram, str) or not histogram or len(histogram) > MAX_HISTOGRAM_NAME
            or not all(c.isalnum() or c in "_.-" for c in histogram)):
        raise ValueError(f"histogram must name a configured histogram (1-{MAX_HISTOGRAM_NAME} "
                         f"characters of [A-Za-z0-9_.-]), got {histogram!r:.80}")
    if not isinstance(query, Mapping):
        raise ValueError(f"query must be a JSON object ({QUERY_SCHEMA}, e.g. "
                         '{"kind": "count", "where": [...]}), got '
                         f"{type(query).__name__}")


class QueryClient:
    """Submit questions to a PMWG flow's queries topic and read its answers.

    Args:
        brokers: ``host:port`` of the bootstrap brokers (a comma-separated string or a list).
        queries_topic: the flow's ``kafka.queries_topic``.
        answers_topic: the flow's ``kafka.answers_topic``.
        flow: the flow's ``flow.name``; when given, answers of other flows are ignored.
        **kafka_config: kafka-python settings for both the producer and the consumer (each
            gets those it knows; a setting neither knows is a ValueError).

    Raises:
        DpstreamError: the brokers cannot be reached or the answers topic does not exist.
        ValueError: an unknown kafka-python setting.
    """

    def __init__(self, brokers: str | list[str], *, queries_topic: str = "queries",
                 answers_topic: str = "answers", flow: str | None = None,
                 **kafka_config: Any) -> None:
        bootstrap = brokers.split(",") if isinstance(brokers, str) else list(brokers)
        self.brokers = [b.strip() for b in bootstrap if b and b.strip()]
        if not self.brokers:
            raise ValueError("brokers must name at least one host:port")
        self.queries_topic, self.answers_topic, self.flow = queries_topic, answers_topic, flow
        unknown = set(kafka_config) - set(KafkaConsumer.DEFAULT_CONFIG) \
            - set(KafkaProducer.DEFAULT_CONFIG)
        if unknown:
            raise ValueError(f"unknown kafka-python setting(s): {', '.join(sorted(unknown))}")
        common = {"bootstrap_servers": self.brokers, "client_id": "dpstream-query",
                  "allow_auto_create_topics": False}
        self._consumer: KafkaConsumer | None = None
        self._producer: KafkaProducer | None = None
        self._pending: set[str] = set()
        self._found: dict[str, dict[str, Any]] = {}
        self._delivered: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._failures = 0  # failed polls in a row
        where = ",".join(self.brokers)
        try:
            self._consumer = KafkaConsumer(**self._only(KafkaConsumer, {
                **common, "group_id": None, "enable_auto_commit": False,
                "auto_offset_reset": "earliest", "fetch_max_wait_ms": _POLL_MS,
                **kafka_config}))
            partitions = self._consumer.partitions_for_topic(answers_topic)
            if not partitions:
                raise DpstreamError(f"the answers topic {answers_topic!r} does not exist on "
                                    f"{where}: is this the flow's kafka.answers_topic?")
            # Start reading at the end *before* any question is sent: nothing is missed.
            assignment = [TopicPartition(answers_topic, p) for p in sorted(partitions)]
            self._consumer.assign(assignment)
            for tp, offset in self._consumer.end_offsets(assignment).items():
                self._consumer.seek(tp, offset)
            for tp in assignment:  # resolve every position now, not at the first poll
                self._consumer.position(tp)
            self._producer = KafkaProducer(**self._only(KafkaProducer, {
                **common, "acks": "all", "linger_ms": 0, **kafka_config}))
        except kafka.errors.KafkaError as exc:
            self.close()
            raise DpstreamError(f"cannot reach a Kafka broker at {where}: {exc}") from None
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _only(cls: Any, settings: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in settings.items() if k in cls.DEFAULT_CONFIG}

    def __enter__(self) -> QueryClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def submit(self, histogram: str, query: Mapping[str, Any],
               query_id: str | None = None) -> str:
        """Send one question; return its id (a fresh uuid4 hex when ``query_id`` is None).

        ``"schema": "dpstream.query/1"`` is added to ``query`` when missing. The query itself
        is checked by the flow, which answers a malformed one with ``kind = "error"`` and the
        reason.

        Raises:
            ValueError: the envelope is not one the flow accepts (id, histogram, query type).
            DpstreamError: the broker did not acknowledge the question.
        """
        if self._producer is None:
            raise DpstreamError("the query client is closed")
        query_id = uuid.uuid4().hex if query_id is None else query_id
        _check_envelope(histogram, query, query_id)
        body = dict(query)
        body.setdefault("schema", QUERY_SCHEMA)
        try:
            value = json.dumps({"id": query_id, "histogram": histogram, "query": body},
                               allow_nan=False, separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"query must be JSON-serialisable (finite numbers only): "
                             f"{exc}") from None
        self._pending.add(query_id)
        try:
            future = self._producer.send(self.queries_topic, value=value,
                                         key=histogram.encode())
            future.get(timeout=30)
        except kafka.errors.KafkaError as exc:
            self._pending.discard(query_id)
            raise DpstreamError(f"query {query_id} was not accepted by the broker (topic "
                                f"{self.queries_topic!r}): {exc}") from None
        return query_id

    def answer(self, query_id: str, timeout: float = 60.0) -> dict[str, Any]:
        """Wait for the ``dpstream.answer/1`` record of ``query_id`` and return it (decoded).

        Only answers written after the client was created are seen. The first record with the
        id wins (a replayed answer is an identical copy).

        Raises:
            DpstreamError: no answer within ``timeout`` seconds, or the client is closed.
        """
        if self._consumer is None:
            raise DpstreamError("the query client is closed")
        if not math.isfinite(timeout) or timeout < 0:
            raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
        self._pending.add(query_id)
        deadline = time.monotonic() + timeout
        while True:
            found = self._found.pop(query_id, None) or self._delivered.get(query_id)
            if found is not None:
                self._pending.discard(query_id)
                self._delivered[query_id] = found
                self._delivered.move_to_end(query_id)
                while len(self._delivered) > _REMEMBERED:
                    self._delivered.popitem(last=False)
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                raise DpstreamError(
                    f"no answer for query {query_id} within {timeout:g} s: is the flow running, "
                    "and are steps closing (heartbeat/clock)? (A question the flow cannot use, "
                    "e.g. for an unknown histogram or stamped in an already closed step, goes "
                    "to its dead-letter topic instead)")
            self._read(min(_POLL_MS, max(1, int(left * 1000))))

    def ask(self, histogram: str, query: Mapping[str, Any],
            timeout: float = 60.0) -> dict[str, Any]:
        """:meth:`submit` a question with a fresh id and wait for its :meth:`answer`."""
        return self.answer(self.submit(histogram, query), timeout)

    def _read(self, timeout_ms: int) -> None:
        """Poll the answers topic once; keep the first answer of every id asked about."""
        assert self._consumer is not None
        try:
            batches = self._consumer.poll(timeout_ms=timeout_ms)
        except kafka.errors.KafkaError as exc:
            self._failures += 1
            retry.pause(f"answers on {self.answers_topic}", self._failures, str(exc),
                        timeout_ms / 1000, logger=log.log)
            return
        self._failures = 0
        for records in batches.values():
            for record in records:
                body = self._decode(record.value)
                if body is None:
                    continue
                qid = body["id"]
                if qid in self._pending and qid not in self._found:
                    self._found[qid] = body

    def _decode(self, value: bytes | None) -> dict[str, Any] | None:
        if value is None:
            return None
        try:
            answer = _ANSWER.decode(value)  # a dpstream.answer/1 record, or None
        except msgspec.DecodeError:
            return None
        if self.flow is not None and answer.flow != self.flow:
            return None
        return answer.to_dict()

    def close(self) -> None:
        """Close the producer and the consumer (idempotent)."""
        producer, consumer = self._producer, self._consumer
        self._producer = self._consumer = None
        if producer is not None:
            try:
                producer.close(timeout=5)
            except Exception:  # noqa: BLE001 - closing must not hide the caller's error
                log.debug("query client: closing the producer failed", exc_info=True)
        if consumer is not None:
            try:
                consumer.close()
            except Exception:  # noqa: BLE001
                log.debug("query client: closing the consumer failed", exc_info=True)


def _number(value: Any) -> str:
    return "\u22a5" if value is None else f"{value:.4f}"


def describe_answer(answer: Mapping[str, Any]) -> str:
    """One readable line for a ``dpstream.answer/1`` record (what ``dpstream query`` prints).

    ``q1: 0.2143 (hard, t = 1204312, spent 0.41 of 1 epsilon)``,
    ``q1: \u22a5 privacy budget exhausted``, ``q1: error: <why the query was refused>``.
    """
    qid, kind, reason = answer.get("id"), answer.get("kind"), answer.get("reason")
    if kind == "error":
        return f"{qid}: error: {reason}"
    if kind == "waiting":
        return f"{qid}: waiting: {reason}"
    if kind == "bottom":
        return f"{qid}: \u22a5 {reason}"
    privacy = answer.get("privacy") or {}
    unit = "rho" if privacy.get("accounting") == "zcdp" else "epsilon"
    spent = f"spent {privacy.get('spent', float('nan')):.4g} of " \
            f"{privacy.get('budget', float('nan')):g} {unit}"
    approx = privacy.get("approx_dp")
    if approx:
        spent += f" (epsilon {approx['epsilon']:.4g} at delta {approx['delta']:g})"
    t = answer.get("t")
    if kind == "marginal":
        values = answer.get("value") or []
        kinds = answer.get("kinds") or []
        text = (f"{qid}: [{', '.join(_number(v) for v in values)}] "
                f"(marginal: {', '.join(kinds)}; t = {t}, {spent})")
        return f"{text}; {reason}" if reason else text
    return f"{qid}: {_number(answer.get('value'))} ({kind}, t = {t}, {spent})"
