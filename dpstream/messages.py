"""The plain data every layer shares: raw input messages, dead letters, encoded outputs.

This module imports nothing from dpstream, so the stream layer (Bytewax glue) and the edges
(Kafka, records) both build on it without leaning on each other: a source produces a
:class:`RawBatch` (or :data:`RawMessage` tuples), the step clock turns unusable records into
:class:`DeadLetter` values, and the record encoders turn outputs into :data:`Encoded` triples
for a sink.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import compress
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "DeadLetter",
    "Encoded",
    "RawBatch",
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



@dataclass(frozen=True, eq=False)
class RawBatch:
    """Consecutive records of one input partition, as columns: what a source hands the clock.

    One stream item per consumed batch instead of one tuple per record: the step clock reads
    the broker times and timestamp types as arrays and the values as one list, and Bytewax
    moves one object instead of thousands. Iterated or indexed, it gives the records'
    :data:`RawMessage` tuples, in offset order.

    Attributes:
        partition: the flow's input partition (as in :data:`RawMessage`).
        values: each record's value (None: a record without one).
        offsets: each record's offset.
        topics: each record's topic.
        broker_ms: each record's timestamp, ms since the epoch (float64, as the clock reads
            it: exact below 2^53 ms, far beyond the year 9999 the clock accepts).
        kinds: each record's timestamp type (int64: ``TIMESTAMP_*``).
    """

    partition: int
    values: list[bytes | None]
    offsets: list[int | None]
    topics: list[str | None]
    broker_ms: npt.NDArray[np.float64]
    kinds: npt.NDArray[np.int64]

    def __post_init__(self) -> None:
        n = len(self.values)
        if not (len(self.offsets) == len(self.topics) == self.broker_ms.size
                == self.kinds.size == n):
            raise ValueError("a RawBatch's columns must all have one entry per record")

    @classmethod
    def of(cls, messages: Sequence[RawMessage]) -> RawBatch:
        """The batch of ``messages``, which must all be of one input partition."""
        if not messages:
            raise ValueError("a RawBatch holds at least one record")
        partition = messages[0][0]
        partitions, values, offsets, topics, stamps, kinds = zip(*messages, strict=True)
        if partitions.count(partition) != len(partitions):
            raise ValueError("a RawBatch holds the records of one input partition")
        n = len(messages)
        return cls(partition, list(values), list(offsets), list(topics),
                   np.fromiter(stamps, dtype=np.float64, count=n),
                   np.fromiter(kinds, dtype=np.int64, count=n))

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: int) -> RawMessage:
        """Record ``index`` as a :data:`RawMessage` tuple."""
        return (self.partition, self.values[index], self.offsets[index], self.topics[index],
                int(self.broker_ms[index]), int(self.kinds[index]))

    def __iter__(self) -> Iterator[RawMessage]:
        return map(self.__getitem__, range(len(self)))

    def keep(self, mask: npt.NDArray[np.bool_]) -> RawBatch:
        """The records where ``mask`` is true, in order."""
        chosen = mask.tolist()
        return RawBatch(self.partition, list(compress(self.values, chosen)),
                        list(compress(self.offsets, chosen)), list(compress(self.topics, chosen)),
                        self.broker_ms[mask], self.kinds[mask])


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
