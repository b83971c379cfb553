"""The latest value of every key, from an at-least-once stream of records.

A flow's delivery is at least once: after a crash it publishes the open epoch again, byte
for byte (same noise), so a consumer sees some records twice, and an older step's copy may
arrive after a newer step. :class:`LatestValues` keeps, per key *and flow instance*, the
record of the highest step, and counts what it drops.

**Coordinates.** A record's coordinate is what a correct flow instance publishes exactly
once: ``(flow, instance, record type, subject, step)``, where the subject is the key
(releases, statuses, alerts), the histogram and question id (answers), or the model stream,
role and level (models). The store remembers a digest of every record it took for the last
``history`` steps of each subject (default :data:`HISTORY_STEPS`) and compares each record
with the one already seen at its coordinate, **whatever the order of arrival**:

* ``duplicates``: an identical copy of a record seen at the same coordinate (a replay);
* ``conflicts``: a *different* record at a coordinate already seen. A correct flow never
  publishes one: two differently noised values of the same count could be averaged. The
  first record is kept; report a conflict to the flow's operators;
* ``stale``: the first record of a coordinate older than the subject's latest step (it
  arrived after a newer step; it is checked and remembered, but is not the latest value);
* ``unchecked``: a record older than the remembered history of its subject, which can be
  neither compared nor kept.

**Instances.** Every record names the flow instance that published it (``instance``). Two
instances of one flow name (a reprocessing, a second deployment) publish the same
coordinates with independent noise: those are two series, not a conflict, and are kept
apart. :meth:`LatestValues.instances` lists the instances seen of each flow; the readers take
an ``instance=`` argument, and without it return the record of the highest step over every
instance (the first one seen on a tie). To read one instance only, filter at the source
(``RecordConsumer(instance=...)``, ``dpstream tail --instance``). Records of a dpstream that
did not write the field have instance None, which is one instance like any other.

What a "key" is depends on the record type:

========================  ===========================================================
releases, statuses        ``(flow, key)``
alerts                    ``(flow, key)``
answers                   ``(flow, histogram)``: the latest step's answers, by arrival
models                    ``(flow, stream, role, level)``: each role and level of a stream
                          is its own series (a base, its updates, the multi-resolution
                          levels)
serving records           ``(flow, stream)``: the model to serve, see below
dead letters              not stored: counted by reason
========================  ===========================================================

**Serving.** A ``dpstream.serving/1`` record names the model of its stream to serve, by
its role, level and step; it follows that model on the stream's partition of the models
topic. When the latest serving record of a stream arrives, the store resolves it against the
latest model of the named role and level and keeps that model with it
(:meth:`LatestValues.served`): the model a consumer should use, even after a newer model of
the same role and level arrives ahead of the next serving record. A consumer that started
reading after the named model was published (``from_beginning=False``) has the serving
record but not its model until the next release is chosen.

It is not thread-safe: feed it from one thread.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

import msgspec

from dpstream.schemas import (
    Alert,
    Answer,
    DeadLetter,
    Model,
    Record,
    Release,
    Serving,
    Status,
)

__all__ = ["HISTORY_STEPS", "LatestValues", "StoreCounts"]

HISTORY_STEPS: Final = 64
"""How many steps behind a subject's latest one the store still compares copies with."""

_R = TypeVar("_R", Release, Status, Alert, Model, Answer, Serving)


def _digest(record: Any) -> bytes:
    """A record's content as 16 bytes (BLAKE2b of its msgpack encoding).

    Python's ``hash`` would not do: ``hash(-1.0) == hash(-2.0)`` in CPython, so two
    differently noised values of one coordinate could count as a duplicate, not a conflict.
    """
    return hashlib.blake2b(msgspec.msgpack.encode(record), digest_size=16).digest()


@dataclass
class StoreCounts:
    """What :class:`LatestValues` dropped or flagged (see the module docstring)."""

    duplicates: int = 0
    stale: int = 0
    conflicts: int = 0
    unchecked: int = 0


@dataclass
class _Series(Generic[_R]):
    """One subject of one flow instance: its latest record, and the digests it remembers."""

    latest: _R
    seen: dict[tuple[Any, ...], bytes] = field(default_factory=dict)
    """Coordinate ``(step, detail)`` -> the digest of the record first seen there, in order of
    arrival (pruned from the front once older than the history)."""


@dataclass
class _Latest(Generic[_R]):
    """The series of one record type, by subject and instance."""

    counts: StoreCounts
    history: int
    series: dict[tuple[Any, ...], dict[str | None, _Series[_R]]] = field(default_factory=dict)

    def add(self, slot: tuple[Any, ...], record: _R, detail: Any = None) -> bool:
        """Take ``record`` of subject ``slot`` (``detail``: what else its coordinate holds)."""
        by_instance = self.series.setdefault(slot, {})
        series = by_instance.get(record.instance)
        step, digest = record.step, _digest(record)
        if series is None:
            by_instance[record.instance] = _Series(record, {(step, detail): digest})
            return True
        held = series.seen.get((step, detail))
        if held is not None:
            if held == digest:
                self.counts.duplicates += 1
            else:
                self.counts.conflicts += 1
            return False
        newest = series.latest.step
        if step < newest - self.history:
            self.counts.unchecked += 1
            return False
        seen = series.seen
        seen[(step, detail)] = digest
        if step < newest:
            self.counts.stale += 1
            return False
        series.latest = record
        floor = step - self.history
        while seen:
            oldest = next(iter(seen))
            if oldest[0] >= floor:
                break
            del seen[oldest]
        return True

    def get(self, slot: tuple[Any, ...], instance: str | None | type[_Any]) -> _R | None:
        """The latest record of ``slot`` (of ``instance``; of any: the highest step)."""
        by_instance = self.series.get(slot)
        if not by_instance:
            return None
        if instance is not _Any:
            series = by_instance.get(instance)  # type: ignore[arg-type]
            return None if series is None else series.latest
        best: _R | None = None
        for series in by_instance.values():
            if best is None or series.latest.step > best.step:
                best = series.latest
        return best

    def slots(self) -> list[tuple[Any, ...]]:
        return list(self.series)

    def instances(self) -> set[tuple[str, str | None]]:
        return {(slot[0], instance) for slot, by in self.series.items() for instance in by}


class _Any:
    """Any instance (the default of the readers)."""


ANY: Final = _Any


class LatestValues:
    """The latest release, status, alert, answer and model of every key (see module docs).

    Args:
        history: how many steps behind a subject's latest one copies are still compared
            (see the module docstring); each remembered coordinate costs about 100 bytes.
    """

    def __init__(self, history: int = HISTORY_STEPS) -> None:
        if history < 0:
            raise ValueError(f"history must be >= 0 steps, got {history}")
        self.counts = StoreCounts()
        self._releases: _Latest[Release] = _Latest(self.counts, history)
        self._statuses: _Latest[Status] = _Latest(self.counts, history)
        self._alerts: _Latest[Alert] = _Latest(self.counts, history)
        self._models: _Latest[Model] = _Latest(self.counts, history)
        self._answers: _Latest[Answer] = _Latest(self.counts, history)
        self._servings: _Latest[Serving] = _Latest(self.counts, history)
        self._served: dict[tuple[str, str, str | None], Model] = {}
        self.dead_letters: Counter[str] = Counter()
        """Dead letters seen, by reason (replayed copies included)."""
        self._dead_instances: set[tuple[str, str | None]] = set()

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
            return self._answers.add((record.flow, record.histogram), record, record.id)
        if isinstance(record, Serving):
            new = self._servings.add((record.flow, record.stream), record)
            if new:
                self._resolve(record)
            return new
        if isinstance(record, DeadLetter):
            self.dead_letters[record.reason] += 1
            self._dead_instances.add((record.flow, record.instance))
            return True
        raise TypeError(f"not a dpstream record: {type(record).__name__}")

    def _resolve(self, serving: Serving) -> None:
        """Keep the model ``serving`` names, if this store holds it (see the module docstring)."""
        slot = (serving.flow, serving.stream, serving.instance)
        named = serving.model
        model = None if named is None else self._models.get(
            (serving.flow, serving.stream, named.role, named.level), serving.instance)
        if model is not None and named is not None and model.step == named.step:
            self._served[slot] = model
        else:
            self._served.pop(slot, None)

    # -- reading ------------------------------------------------------------------------------

    def release(self, flow: str, key: str, instance: Any = ANY) -> Release | None:
        """The latest release of ``key`` in ``flow`` (of ``instance``, or of any)."""
        return self._releases.get((flow, key), instance)

    def status(self, flow: str, key: str, instance: Any = ANY) -> Status | None:
        """The latest status of ``key`` (budget exhausted), if any."""
        return self._statuses.get((flow, key), instance)

    def alert(self, flow: str, key: str, instance: Any = ANY) -> Alert | None:
        """The latest alert of ``key``, if any."""
        return self._alerts.get((flow, key), instance)

    def answer(self, flow: str, histogram: str, instance: Any = ANY) -> Answer | None:
        """The last answer of ``histogram`` (of its latest step)."""
        return self._answers.get((flow, histogram), instance)

    def model(self, flow: str, stream: str, role: str, level: int | None = None,
              instance: Any = ANY) -> Model | None:
        """The latest model of one role (and level) of ``stream``."""
        return self._models.get((flow, stream, role, level), instance)

    def serving(self, flow: str, stream: str, instance: Any = ANY) -> Serving | None:
        """The latest serving record of ``stream`` (of ``instance``, or of any)."""
        return self._servings.get((flow, stream), instance)

    def servings(self, flow: str | None = None) -> list[Serving]:
        """Every stream's latest serving record, sorted by flow and stream."""
        return _sorted(self._servings, flow)

    def served(self, flow: str, stream: str, instance: Any = ANY) -> Model | None:
        """The model the latest serving record of ``stream`` names, if this store has read it.

        None before a serving record, while it names none (no model released yet), or when
        the named model was published before this store began reading.
        """
        serving = self.serving(flow, stream, instance)
        if serving is None:
            return None
        return self._served.get((flow, stream, serving.instance))

    def releases(self, flow: str | None = None) -> list[Release]:
        """Every key's latest release (of ``flow``, or all flows), sorted by flow and key."""
        return _sorted(self._releases, flow)

    def statuses(self, flow: str | None = None) -> list[Status]:
        """Every key's latest status, sorted by flow and key."""
        return _sorted(self._statuses, flow)

    def alerts(self, flow: str | None = None) -> list[Alert]:
        """Every key's latest alert, sorted by flow and key."""
        return _sorted(self._alerts, flow)

    def answers(self, flow: str | None = None) -> list[Answer]:
        """Every histogram's last answer, sorted by flow and histogram."""
        return _sorted(self._answers, flow)

    def models(self, flow: str | None = None) -> list[Model]:
        """The latest model of every (stream, role, level), sorted by them."""
        slots = sorted(self._models.slots(),
                       key=lambda s: (s[0], s[1], s[2], -1 if s[3] is None else s[3]))
        return [m for s in slots if flow is None or s[0] == flow
                if (m := self._models.get(s, ANY)) is not None]

    def keys(self, flow: str | None = None) -> list[tuple[str, str]]:
        """Every ``(flow, key)`` with a release, status or alert, sorted."""
        slots = set(self._releases.series) | set(self._statuses.series) \
            | set(self._alerts.series)
        return sorted((s[0], s[1]) for s in slots if flow is None or s[0] == flow)

    def flows(self) -> list[str]:
        """Every flow with a release, status, alert, answer or model."""
        return sorted({flow for flow, _ in self._all_instances(dead_letters=False)})

    def instances(self, flow: str | None = None) -> dict[str, list[str | None]]:
        """The flow instances seen, by flow (None: records without the ``instance`` field)."""
        out: dict[str, set[str | None]] = {}
        for name, instance in self._all_instances():
            if flow is None or name == flow:
                out.setdefault(name, set()).add(instance)
        return {name: sorted(found, key=lambda i: "" if i is None else i)
                for name, found in sorted(out.items())}

    def _all_instances(self, dead_letters: bool = True) -> set[tuple[str, str | None]]:
        found = (self._releases.instances() | self._statuses.instances()
                 | self._alerts.instances() | self._models.instances()
                 | self._answers.instances() | self._servings.instances())
        return found | self._dead_instances if dead_letters else found


def _sorted(table: _Latest[Any], flow: str | None) -> list[Any]:
    return [r for slot in sorted(table.slots()) if flow is None or slot[0] == flow
            if (r := table.get(slot, ANY)) is not None]
