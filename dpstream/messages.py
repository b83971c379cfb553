"""The plain data every layer shares: raw input messages, dead letters, encoded outputs.

This module imports nothing from dpstream, so the stream layer (Bytewax glue) and the edges
(Kafka, records) both build on it without leaning on each other: a Kafka source produces
:data:`RawMessage` tuples, the step clock turns unusable ones into :class:`DeadLetter`
values, and the record encoders turn outputs into :data:`Encoded` triples for a sink.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

__all__ = [
    "step_window",
    "DeadLetter",
    "Encoded",
    "RawMessage",
    "TICK",
    "TIMESTAMP_CREATE_TIME",
    "TIMESTAMP_LOG_APPEND_TIME",
    "TIMESTAMP_NONE",
]

RawMessage = tuple[int, bytes | None, int | None, str | None, int, int]
"""An input record: (input partition, value, offset, topic, broker timestamp in ms since the
epoch, timestamp type). The input partition numbers every partition of every input topic of a
flow (a second input topic's partitions follow the first's)."""

Encoded = tuple[str, bytes | None, bytes]
"""An output record: (topic role, key, value); the sink maps the role to a topic."""

TIMESTAMP_NONE: Final = 0  # the Kafka record timestamp types (as confluent-kafka reports them)
TIMESTAMP_CREATE_TIME: Final = 1
TIMESTAMP_LOG_APPEND_TIME: Final = 2

TICK: Final = b'{"dpstream.tick":1}'
"""A heartbeat record's value (see :class:`dpstream.io.kafka.Heartbeat`): it moves its
partition's broker clock like any record, and is otherwise skipped (no event, no dead letter)."""


@dataclass(frozen=True)
class DeadLetter:
    """An input record that was not used, and why."""

    reason: str
    original: bytes
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None


def step_window(origin: datetime, step_seconds: float, first: int,
                last: int | None = None) -> dict[str, str]:
    """The event-time window ``[start, end)`` of steps ``first..last`` (ISO-8601, ``Z``)."""
    start = origin + timedelta(seconds=first * step_seconds)
    end = origin + timedelta(seconds=((first if last is None else last) + 1) * step_seconds)
    return {"start": _iso(start), "end": _iso(end)}


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")
