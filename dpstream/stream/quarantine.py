"""Records the operator quarantined: named by (topic, partition, offset), skipped as dead letters.

No record should be able to stop a flow (every decoding error is a dead letter, see
:mod:`dpstream.stream.clock`), but a record that still crashes the flow — a bug — would crash
it again on every replay from the recovery store (privacy-pitfalls.md, item 16: a way to stop
publication, or to force a new instance whose spend adds). The operator names such a record
at the next start (``dpstream run --skip-record TOPIC:PARTITION:OFFSET``, or
``$DPSTREAM_SKIP_RECORDS``); the flow's first operator, before any decoding, turns it into a
dead letter with the reason :data:`QUARANTINED` and drops it (it moves no clock either). The
same happens for both sources (Kafka and in-memory), since they meet here.

Skipping is deterministic, so a replay skips the same record identically. The flow instance
records every skip in its manifest (:mod:`dpstream.instance`), append-only: once skipped in an
instance, a record is skipped on every later run of it, named again or not. Otherwise a resume
without the option would count a record that an earlier run of the same instance did not,
and republish steps whose releases already went out with other true values under the same
noise (pitfall 11).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, NamedTuple

import numpy as np

from dpstream.errors import ConfigError
from dpstream.messages import DeadLetter, RawBatch

__all__ = ["QUARANTINED", "Quarantine", "SkippedRecord", "parse_skipped"]

QUARANTINED: Final = "quarantined by the operator"
"""The dead-letter reason of a quarantined record."""
_FORM: Final = re.compile(r"([A-Za-z0-9._-]{1,249}):(\d{1,10}):(\d{1,19})")
"""``TOPIC:PARTITION:OFFSET`` (Kafka's topic characters, which exclude ``:``)."""


class SkippedRecord(NamedTuple):
    """One quarantined record: its topic, its partition in that topic, its offset."""

    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}:{self.partition}:{self.offset}"


def parse_skipped(texts: Iterable[str]) -> list[SkippedRecord]:
    """Parse ``TOPIC:PARTITION:OFFSET`` names (several may be separated by commas or spaces).

    Raises:
        ConfigError: a name that is not of that form.
    """
    out: list[SkippedRecord] = []
    for text in texts:
        for item in re.split(r"[,\s]+", text.strip()):
            if not item:
                continue
            match = _FORM.fullmatch(item)
            if match is None:
                raise ConfigError(
                    f"a record to skip is named TOPIC:PARTITION:OFFSET (the partition of that "
                    f"topic, from 0), e.g. events:2:1734; got {item!r}")
            out.append(SkippedRecord(match.group(1), int(match.group(2)),
                                     int(match.group(3))))
    return sorted(set(out))


@dataclass(frozen=True)
class Quarantine:
    """The records to skip, found in the batches of the flow's input partitions.

    Attributes:
        records: the quarantined records.
        bases: the first flow input partition of each input topic (a second topic's
            partitions follow the first's): a batch's topic partition is its flow input
            partition minus its topic's base.
    """

    records: frozenset[SkippedRecord]
    bases: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        by_partition: dict[tuple[str, int], set[int]] = {}
        for record in self.records:
            by_partition.setdefault((record.topic, record.partition), set()).add(record.offset)
        object.__setattr__(self, "_offsets", by_partition)

    def split(self, batch: RawBatch) -> tuple[RawBatch, list[DeadLetter]]:
        """The batch without its quarantined records, and their dead letters."""
        if not self.records or not len(batch):
            return batch, []
        offsets_of: dict[tuple[str, int], set[int]] = self._offsets  # type: ignore[attr-defined]
        topics = set(batch.topics)
        mask = np.zeros(len(batch), dtype=bool)
        for topic in topics:
            if topic is None:
                continue
            offsets = offsets_of.get((topic, batch.partition - self.bases.get(topic, 0)))
            if offsets:
                mask |= np.fromiter(
                    (t == topic and o in offsets for t, o in zip(batch.topics, batch.offsets,
                                                                 strict=True)),
                    dtype=bool, count=len(batch))
        if not mask.any():
            return batch, []
        dead = []
        for i in np.flatnonzero(mask).tolist():
            _, raw, offset, topic, _, _ = batch[i]
            dead.append(DeadLetter(QUARANTINED, raw or b"", topic,
                                   batch.partition - self.bases.get(topic or "", 0), offset))
        return batch.keep(~mask), dead
