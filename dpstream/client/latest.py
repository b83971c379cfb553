"""The latest value of every key, from an at-least-once stream of records.

A flow's delivery is at least once: after a crash it publishes the open epoch again, byte
for byte (same noise), so a consumer sees some records twice, and an older step's copy may
arrive after a newer step. :class:`LatestValues` keeps, per key, the record of the highest
step, and counts what it drops:

* ``duplicates``: an identical copy of the record it holds (a replay);
* ``stale``: a record of an older step than the one it holds (in practice a replayed copy;
  the store keeps no history to compare it with);
* ``conflicts``: a *different* record for the same coordinates as the one it holds. A
  correct flow never publishes one: two differently noised values of the same count could
  be averaged. The first record is kept; report a conflict to the flow's operators.

What a "key" is depends on the record type:

========================  ===========================================================
releases, statuses        ``(flow, key)``
alerts                    ``(flow, key)``
answers                   ``(flow, histogram)``: the latest step's answers, by arrival
models                    ``(flow, stream, role, level)``: each role and level of a stream
                          is its own series (a base, its updates, the multi-resolution
                          levels)
dead letters              not stored: counted by reason
========================  ===========================================================

It is not thread-safe: feed it from one thread.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from dpstream.client.records import (
    Alert,
    Answer,
    DeadLetter,
    Model,
    Record,
    Release,
    Status,
)

__all__ = ["LatestValues", "StoreCounts"]

_R = TypeVar("_R", Release, Status, Alert, Model)


@dataclass
class StoreCounts:
    """What :class:`LatestValues` dropped (see the module docstring)."""

    duplicates: int = 0
    stale: int = 0
    conflicts: int = 0


@dataclass
class _Latest(Generic[_R]):
    """The record of the highest step per slot."""

    counts: StoreCounts
    records: dict[tuple[Any, ...], _R] = field(default_factory=dict)

    def add(self, slot: tuple[Any, ...], record: _R) -> bool:
        held = self.records.get(slot)
        if held is None or record.step > held.step:
            self.records[slot] = record
            return True
        if record.step < held.step:
            self.counts.stale += 1
        elif record == held:
            self.counts.duplicates += 1
        else:
            self.counts.conflicts += 1
        return False


class LatestValues:
    """The latest release, status, alert, answer and model of every key (see module docs)."""

    def __init__(self) -> None:
        self.counts = StoreCounts()
        self._releases: _Latest[Release] = _Latest(self.counts)
        self._statuses: _Latest[Status] = _Latest(self.counts)
        self._alerts: _Latest[Alert] = _Latest(self.counts)
        self._models: _Latest[Model] = _Latest(self.counts)
        self._answers: dict[tuple[str, str], tuple[int, dict[str, Answer]]] = {}
        self._latest_answer: dict[tuple[str, str], Answer] = {}
        self.dead_letters: Counter[str] = Counter()
        """Dead letters seen, by reason (replayed copies included)."""

    def add(self, record: Record) -> bool:
        """Take one record; True if it is new (not a duplicate, stale or conflicting copy)."""
        if isinstance(record, Release):
            return self._releases.add((record.flow, record.key), record)
        if isinstance(record, Status):
            return self._statuses.add((record.flow, record.key), record)
        if isinstance(record, Alert):
            return self._alerts.add((record.flow, record.key), record)
        if isinstance(record, Model):
            return self._models.add((record.flow, record.stream, record.role, record.level),
                                    record)
        if isinstance(record, Answer):
            return self._add_answer(record)
        if isinstance(record, DeadLetter):
            self.dead_letters[record.reason] += 1
            return True
        raise TypeError(f"not a dpstream record: {type(record).__name__}")

    def _add_answer(self, answer: Answer) -> bool:
        """Keep the answers of the latest step of each histogram (by id) and the last one."""
        slot = (answer.flow, answer.histogram)
        step, by_id = self._answers.get(slot, (-1, {}))
        if answer.step < step:
            self.counts.stale += 1
            return False
        if answer.step > step:
            step, by_id = answer.step, {}
            self._answers[slot] = (step, by_id)
        held = by_id.get(answer.id)
        if held is not None:
            if held == answer:
                self.counts.duplicates += 1
            else:
                self.counts.conflicts += 1
            return False
        by_id[answer.id] = answer
        self._latest_answer[slot] = answer
        return True

    # -- reading ------------------------------------------------------------------------------

    def release(self, flow: str, key: str) -> Release | None:
        """The latest release of ``key`` in ``flow``."""
        return self._releases.records.get((flow, key))

    def status(self, flow: str, key: str) -> Status | None:
        """The latest status of ``key`` (budget exhausted), if any."""
        return self._statuses.records.get((flow, key))

    def alert(self, flow: str, key: str) -> Alert | None:
        """The latest alert of ``key``, if any."""
        return self._alerts.records.get((flow, key))

    def answer(self, flow: str, histogram: str) -> Answer | None:
        """The last answer of ``histogram`` (of its latest step)."""
        return self._latest_answer.get((flow, histogram))

    def model(self, flow: str, stream: str, role: str, level: int | None = None
              ) -> Model | None:
        """The latest model of one role (and level) of ``stream``."""
        return self._models.records.get((flow, stream, role, level))

    def releases(self, flow: str | None = None) -> list[Release]:
        """Every key's latest release (of ``flow``, or all flows), sorted by flow and key."""
        return _sorted(self._releases.records, flow)

    def statuses(self, flow: str | None = None) -> list[Status]:
        """Every key's latest status, sorted by flow and key."""
        return _sorted(self._statuses.records, flow)

    def alerts(self, flow: str | None = None) -> list[Alert]:
        """Every key's latest alert, sorted by flow and key."""
        return _sorted(self._alerts.records, flow)

    def answers(self, flow: str | None = None) -> list[Answer]:
        """Every histogram's last answer, sorted by flow and histogram."""
        return _sorted(self._latest_answer, flow)

    def models(self, flow: str | None = None) -> list[Model]:
        """The latest model of every (stream, role, level), sorted by them."""
        return [self._models.records[slot] for slot in sorted(
            self._models.records, key=lambda s: (s[0], s[1], s[2], -1 if s[3] is None else s[3]))
            if flow is None or slot[0] == flow]

    def keys(self, flow: str | None = None) -> list[tuple[str, str]]:
        """Every ``(flow, key)`` with a release, status or alert, sorted."""
        slots = set(self._releases.records) | set(self._statuses.records) \
            | set(self._alerts.records)
        return sorted(s for s in slots if flow is None or s[0] == flow)

    def flows(self) -> list[str]:
        """Every flow seen."""
        names = {s[0] for table in (self._releases.records, self._statuses.records,
                                    self._alerts.records, self._models.records,
                                    self._latest_answer) for s in table}
        return sorted(names)


def _sorted(table: dict[Any, Any], flow: str | None) -> list[Any]:
    return [table[slot] for slot in sorted(table) if flow is None or slot[0] == flow]
