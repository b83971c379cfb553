"""The step clock every flow kind shares: place records in time steps, per input partition.

**Each record's step comes from that record alone** (and from the partition's trusted clock
as it stood at the record, in offset order). A record carries its event time (decoded by the
flow kind) and Kafka's record timestamp. Its *placement time* is its event time clamped into
a window around a trusted time; an event outside the window counts at the window's edge. No
other record's event time can change where it is counted (pitfall 10):

* ``flow.clock = "broker"`` (the default): the window is ``[broker time - flow.lateness,
  broker time]`` of the record itself. Only broker-set timestamps
  (``message.timestamp.type=LogAppendTime`` on the topic) are trusted; a record with a
  producer-set timestamp (CreateTime) or none is a dead letter, so a client cannot move the
  clock.
* ``flow.clock = "producer"``: the event time (the kind's time field) is clamped into
  ``[watermark - flow.lateness, watermark + flow.max_skew]``, where the watermark is the
  partition's trusted clock just before the record. Before a partition's first trusted tick
  there is no watermark: the record is placed by its own time (a time before
  ``flow.origin`` is a dead letter) and waits in the step barrier until ticks close its step.
  A record with neither a producer nor a broker timestamp is a dead letter.
  An accepted record placed at a limit of the window is counted per input topic and bound
  (:attr:`StepClock.clamped`: ``ahead``, more than ``max_skew`` after the watermark;
  ``behind``, more than ``lateness`` before it) and reported by the operators'
  observer: ``dpstream_clamped_records_total`` and a log line (:mod:`dpstream.metrics`).

**Steps close by a trusted clock, which no data record can push** (pitfall 15). A
partition's *watermark* is the latest trusted time it has seen, and its frontier (the first
step it has not closed) is the step of ``watermark - flow.lateness``. Which records are
trusted clock records:

* ``clock = "broker"``: every record with a broker timestamp (LogAppendTime), data and
  heartbeat ticks alike. Broker time only moves forward within a partition (the broker stamps
  records in append order), so the ticks, which the broker stamps too, keep their place.
* ``clock = "producer"``: only the heartbeat ticks (:data:`~dpstream.messages.TICK`, stamped
  by dpstream's own :class:`~dpstream.io.kafka.Heartbeat` with its host's clock minus
  ``flow.tick_delay``), and any record with a broker timestamp (broker time is trusted).
  A data record's own timestamp never moves the watermark, so a record stamped an hour ahead
  closes no step and makes no other record late. A tick is not an event: whoever can write
  to the input topic can forge one and stall or hurry the flow (availability, like any
  writer of the topic), but a tick changes no event's count, so a forged tick is not a
  neighbouring-stream concern; the flow's ticks are as trusted as the flow's host.
  ``flow.tick_delay`` (default 2 s) keeps ticks from overtaking a healthy producer's
  in-flight batches; an event overtaken anyway is not lost: its placement is clamped
  forward into the open step.

**What "late" means.** A record is late (a dead letter) only if its step is already closed in
its partition. Under the producer clock that happens only after a bounded end (below): the
clamp keeps every other record in an open step. Under the broker clock it happens when the
broker's clock went backwards (a leader moved to a broker whose clock is behind), or after a
bounded end. Lateness is a function of the partition's records in their offset order, which
Kafka fixes, so a replay after a crash accepts and rejects exactly the same records.

**A bounded run ends at a public step** (pitfall 14). With ``flow.end`` set, the steps from
``flow.end``'s step on never close (records placed there are dead letters, "after flow.end"),
and at the end of a bounded input (:meth:`StepClock.end_of_input`) every partition closes
through the step before it: the last released step is a function of the configuration
alone. Without ``flow.end`` a partition closes through the step of its watermark: under the
producer clock its last tick's (never a data record's time); under the broker clock the
broker's time at the partition's last record, which is when that record arrived, not what
it says: set ``flow.end`` to make the end independent of arrival times too.

**No record can stop a flow** (pitfall 16). A kind's :meth:`~StepClock.decode` explains the
records it expects to fail; whatever else it raises on a batch (a ``RecursionError`` from a
parser on a deeply nested record, a bug) is caught here: the batch is decoded again record by
record, each record whose decoding raises on its own becomes a dead letter (reason
:func:`undecodable`: the exception's type, never its text), and the rest of the batch is
decoded as usual. Which records are dead letters therefore depends on each record alone, never
on how records were batched, so a replay rejects exactly the same records.

A flow kind subclasses :class:`StepClock` with two methods: :meth:`~StepClock.decode` (what
a record holds, or why it is a dead letter) and :meth:`~StepClock.route` (which shard gets
what, per step). Everything about time is here, once.

**People, at the user level** (``contribution.unit = "user"``, pitfall 17). The platform gives
the clock a :class:`~dpstream.core.contribution.people.PersonHasher` (:attr:`StepClock.hasher`,
keyed by the flow's secret lane ``(instance, flow name, "people")``). The kind's decoder then
also fills :attr:`StepClock.decoded_people`, the person of each payload it returns, 1:1 (a
record without a non-empty string in the user field is a dead letter, reason
:func:`bad_person`). :meth:`StepClock.process` hashes the people of the accepted records at once
(a keyed 128-bit AES CBC-MAC: only the 16-byte hash leaves this method, never the id) and sends,
instead of the kind's routing, one update per *person shard* whose buckets are
:class:`PersonEvents` columns (hash, input partition, offset, payload): the bounding stage
(:mod:`dpstream.stream.bounding`) keeps each person's events within the caps and routes the kept
ones to the kind's shards. Which person shard an event goes to, and what its bucket holds,
depends on that record alone, so batching changes nothing here either. A partition whose records
are no person's (:meth:`StepClock.carries_people` false: PMWG's questions) sends them as a
:class:`PassThrough` bucket, which the stage routes on unbounded. A decoder at the user level
that does not set ``decoded_people`` for a partition of people is a bug and stops the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from operator import countOf
from typing import Any, Final, Protocol

import numpy as np

from dpstream.core.contribution.people import PersonHasher, person_shards
from dpstream.messages import (
    TICK,
    TIMESTAMP_CREATE_TIME,
    TIMESTAMP_LOG_APPEND_TIME,
    DeadLetter,
    RawBatch,
    RawMessage,
)

__all__ = ["ClockRules", "MAX_SECONDS", "UNDECODABLE", "PassThrough", "PersonEvents",
           "ShardUpdate", "StepClock", "bad_person", "bad_time", "event_seconds", "iso_seconds",
           "undecodable"]

MAX_SECONDS: Final = 253_402_300_799.0  # 9999-12-31T23:59:59Z: keeps every step index in int64
UNDECODABLE: Final = "undecodable record"
_UNSET: Final[list[str]] = []
"""``decoded_people`` before a decode: a decoder that leaves it so has named no people."""
"""How the dead-letter reason of every undecodable record starts (:func:`undecodable`)."""


def event_seconds(value: Any) -> float | None:
    """An event time read from JSON: finite Unix seconds, or an ISO-8601 string; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    return iso_seconds(value) if isinstance(value, str) else None


def iso_seconds(text: str) -> float | None:
    """Unix seconds of an ISO-8601 time (naive times are UTC), or None."""
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def bad_time(field: str) -> str:
    """The dead-letter reason of a record without a usable event time."""
    return f"field {field!r} missing or not a finite Unix time in seconds or an ISO-8601 string"


def bad_person(field: str) -> str:
    """The dead-letter reason of a record without a usable person (user level).

    Names the field, never its value: the reason labels a metric and a person id must not
    reach one (pitfall 17).
    """
    return f"field {field!r} missing or not a non-empty string"


def undecodable(exc: BaseException) -> str:
    """The dead-letter reason of a record whose decoding raised ``exc``.

    Only the exception's type is named: a parser's message can quote the record's values
    (pitfall 5), and dead-letter reasons also label a metric.
    """
    return f"{UNDECODABLE} ({type(exc).__name__})"


_LATE: Final = {
    "broker": ("late: the record's step is already closed in this partition (the broker's "
               "timestamps went backwards, or the step was closed at the end of a bounded "
               "input)"),
    "producer": ("late: the record's step is already closed in this partition (it was closed "
                 "at the end of a bounded input)"),
}
_AFTER_END: Final = ("after flow.end: the record's step is at or after the step of flow.end, "
                     "which never closes")


def _untrusted(kind: int) -> str:
    """Why a record's timestamp cannot place it (with ``flow.clock = "broker"``)."""
    if kind == TIMESTAMP_CREATE_TIME:
        return ("the record's timestamp is producer-set (CreateTime) and flow.clock = "
                "'broker' trusts only broker time: set message.timestamp.type="
                "LogAppendTime on the input topic")
    return "the record has no broker timestamp"


def _alone(messages: RawBatch, i: int) -> RawBatch:
    """Record ``i`` of ``messages`` as a batch of its own."""
    return RawBatch(messages.partition, messages.values[i:i + 1], messages.offsets[i:i + 1],
                    messages.topics[i:i + 1], messages.broker_ms[i:i + 1],
                    messages.kinds[i:i + 1])


class ClockRules(Protocol):
    """What the clock needs to know about the flow's steps."""

    @property
    def origin_seconds(self) -> float:
        """Start of step 0 (Unix seconds)."""

    @property
    def step_seconds(self) -> float:
        """Length of a step."""

    @property
    def lateness_seconds(self) -> float:
        """How far behind its broker time an event may still count at its own time."""

    @property
    def shards(self) -> int:
        """How many shards the updates go to."""

    @property
    def clock(self) -> str:
        """``broker`` or ``producer``."""

    @property
    def time_field(self) -> str:
        """The event-time field (for dead-letter reasons)."""

    @property
    def max_skew_seconds(self) -> float:
        """With the producer clock: how far ahead of the watermark a record may be placed."""

    @property
    def end_seconds(self) -> float | None:
        """``flow.end`` (Unix seconds): the public end of a bounded run, or None."""


@dataclass
class ShardUpdate:
    """What one batch of one input partition tells one shard.

    Attributes:
        shard: the shard this update is for.
        partition: the input partition.
        frontier: the first step this partition has not closed (None: no record yet).
        increments: ``{step: bucket}`` for this shard; a bucket is the flow kind's data
            (the counters flow: ``{key: events}``).
    """

    shard: int
    partition: int
    frontier: int | None
    increments: dict[int, Any] = field(default_factory=dict)


@dataclass
class PersonEvents:
    """A bucket of events at the user level, in columns: who, where from, and what.

    Attributes:
        people: each event's person, as the keyed 16-byte hash (dtype ``V16``), never the id.
        partitions: each event's input partition (int64).
        offsets: each event's offset in its partition (int64; -1 if the source gave none).
        payloads: each event's payload as the kind's decoder gave it (a list, or an array).

    Together ``(partition, offset)`` names an event uniquely and orders a person's events
    deterministically, whatever the batching (the bounder's order).
    """

    people: np.ndarray
    partitions: np.ndarray
    offsets: np.ndarray
    payloads: list[Any] | np.ndarray

    def __len__(self) -> int:
        return int(self.people.shape[0])

    @classmethod
    def merge(cls, parts: list[PersonEvents]) -> PersonEvents:
        """The events of every bucket of ``parts`` as one bucket (concatenated once).

        The buckets are taken by their first event's (partition, offset), so that buckets
        of consecutive offsets, as a partition's batches give them, join already in the
        order :meth:`in_order` wants (which then sorts nothing).
        """
        parts = [p for p in parts if len(p)] or parts[:1]
        if len(parts) == 1:
            return parts[0]
        parts = sorted(parts, key=lambda p: (int(p.partitions[0]), int(p.offsets[0])))
        payloads: list[Any] | np.ndarray
        if all(isinstance(p.payloads, np.ndarray) for p in parts):
            payloads = np.concatenate([np.asarray(p.payloads) for p in parts])
        else:
            payloads = [x for p in parts for x in p.payloads]
        return cls(np.concatenate([p.people for p in parts]),
                   np.concatenate([p.partitions for p in parts]),
                   np.concatenate([p.offsets for p in parts]), payloads)

    def take(self, index: np.ndarray) -> PersonEvents:
        """The events at ``index`` (int positions), in that order."""
        return PersonEvents(self.people[index], self.partitions[index], self.offsets[index],
                            self.take_payloads(index))

    def take_payloads(self, index: np.ndarray) -> list[Any] | np.ndarray:
        """The payloads of the events at ``index`` (int positions), in that order."""
        payloads = self.payloads
        return (payloads[index] if isinstance(payloads, np.ndarray)
                else [payloads[i] for i in index.tolist()])

    def cut(self, begin: int, end: int) -> PersonEvents:
        """The events ``begin .. end - 1`` (views of the columns, a slice of a list)."""
        return PersonEvents(self.people[begin:end], self.partitions[begin:end],
                            self.offsets[begin:end], self.payloads[begin:end])

    def in_order(self) -> PersonEvents:
        """The events sorted by (partition, offset): the order the bounder decides in."""
        partitions, offsets = self.partitions, self.offsets
        if bool(((partitions[1:] > partitions[:-1])
                 | ((partitions[1:] == partitions[:-1]) & (offsets[1:] > offsets[:-1]))).all()):
            return self  # already in order (a merge of consecutive batches): nothing to move
        order = np.lexsort((offsets, partitions))
        return self.take(order)


@dataclass
class PassThrough:
    """A bucket of records that are no person's, at the user level: passed on unbounded.

    A kind's input can hold records that are not data about people (PMWG's questions, asked
    by the analyst): :meth:`StepClock.carries_people` says so per partition, and the bounding
    stage hands them to the kind's ``route`` as they are, after the step's kept events, in
    (partition, offset) order (so their order does not depend on the batching either). They
    cost no one's cap and are not counted as kept or dropped.

    Attributes:
        partitions: each record's input partition (int64).
        offsets: each record's offset in its partition (int64; -1 if the source gave none).
        payloads: each record's payload as the kind's decoder gave it.
    """

    partitions: np.ndarray
    offsets: np.ndarray
    payloads: list[Any]

    @classmethod
    def merge_in_order(cls, parts: list[PassThrough]) -> list[Any]:
        """The payloads of every bucket of ``parts``, sorted by (partition, offset)."""
        payloads = [x for p in parts for x in p.payloads]
        order = np.lexsort((np.concatenate([p.offsets for p in parts]),
                            np.concatenate([p.partitions for p in parts])))
        return [payloads[i] for i in order.tolist()]


class StepClock:
    """The broker-time watermark of one input partition, and the placement of its records."""

    hasher: PersonHasher | None = None
    """The keyed person hash at the user level (set by the platform), else None."""
    person_shards: int = 0
    """How many person shards the updates go to at the user level (set with :attr:`hasher`)."""

    def __init__(self, rules: ClockRules, state: dict[str, Any] | None = None) -> None:
        self.rules = rules
        self.partition: int | None = None if state is None else state["partition"]
        self.watermark: float | None = None if state is None else state["watermark"]
        # steps closed at the end of a bounded input: a later record before it is late
        self.closed: int | None = None if state is None else state.get("closed")
        self.events = 0
        self.dead_letters = 0
        self.ticks = 0
        # records placed at a clamp's limit (producer clock): cumulative per (topic, bound),
        # and those of the last batch, per bound: (how many, the first one's offset)
        self.clamped: dict[tuple[str, str], int] = {}
        self.clamped_last: dict[str, tuple[int, int | None]] = {}
        self.decoded_people: list[str] = []
        """At the user level, the person of each payload the last :meth:`decode` returned."""

    # -- what a flow kind provides --
    def decode(self, partition: int, messages: RawBatch, dead: list[DeadLetter]
               ) -> tuple[list[Any] | np.ndarray, np.ndarray | list[float], range | list[int]]:
        """Decode records: their payloads (a list, or an array), event times and indexes.

        ``messages`` is read as columns (``messages.values``) or as :data:`RawMessage`
        tuples. Records that cannot be used go to ``dead`` (with :meth:`dead_letter`); the
        third element gives, for each payload, the index of its record in ``messages``
        (``range`` when every record decoded).
        """
        raise NotImplementedError

    def route(self, payloads: list[Any] | np.ndarray, steps: int | list[int]
              ) -> list[dict[int, Any]]:
        """Group accepted payloads by shard and step: one ``{step: bucket}`` per shard.

        ``steps`` is one step for every payload (the usual case) or one step per payload.
        """
        raise NotImplementedError

    def dead_letter(self, reason: str, message: RawMessage) -> DeadLetter:
        """The dead letter of an unusable record."""
        partition, raw, offset, topic, _, _ = message
        return DeadLetter(reason, raw or b"", topic, partition, offset)

    def standalone(self, partition: int, payloads: list[Any] | np.ndarray
                   ) -> list[Any] | np.ndarray:
        """The last decode's payloads made independent of the decoder's state.

        A kind whose payloads index arrays its decoder keeps for the last batch (PMWG's
        cells, ERM's rows) returns here payloads that carry their own data, which its
        :meth:`route` also reads; :meth:`_decode_each` joins decodes of single records, each
        of which replaces those arrays. Default: the payloads as they are (self-contained).
        """
        return payloads

    def _fresh_people(self) -> None:
        """Before a decode at the user level: no people named yet."""
        if self.hasher is not None:
            self.decoded_people = _UNSET

    def _named_people(self, partition: int) -> list[str]:
        """The people the last decode named (a decoder that named none is a bug)."""
        if not self.carries_people(partition):
            return []
        if self.decoded_people is _UNSET:
            raise RuntimeError(f"{type(self).__name__}.decode did not set decoded_people at "
                               "contribution.unit = 'user'")
        return self.decoded_people

    def _decode_guarded(
            self, partition: int, messages: RawBatch, dead: list[DeadLetter]
    ) -> tuple[list[Any] | np.ndarray, np.ndarray | list[float], range | list[int]]:
        """:meth:`decode`, turning any exception into dead letters of the records that raise.

        The usual case costs one ``try``. If the batch raises, its dead letters so far are
        dropped and each record is decoded alone (results discarded) to find those that
        raise; they become dead letters (:func:`undecodable`) and the others are decoded
        again as one batch. Should that batch still raise (records that decode alone but
        not together: a bug), they are decoded one by one and the results joined, so which
        records are accepted never depends on how the records were batched.
        """
        mark = len(dead)
        try:
            return self.decode(partition, messages, dead)
        except Exception:  # any exception: see the docstring
            del dead[mark:]
        n = len(messages)
        raising = np.zeros(n, dtype=bool)
        reasons: dict[int, str] = {}
        for i in range(n):
            try:
                self.decode(partition, _alone(messages, i), [])
            except Exception as exc:
                raising[i] = True
                reasons[i] = undecodable(exc)
        for i in np.flatnonzero(raising).tolist():
            dead.append(self.dead_letter(reasons[i], messages[i]))
        index = np.flatnonzero(~raising)
        if not index.size:
            return [], [], []
        mark = len(dead)
        self._fresh_people()
        try:
            payloads, times, refs = self.decode(partition, messages.keep(~raising), dead)
        except Exception:  # records that decode alone but not together (a bug): decode each
            del dead[mark:]  # alone and join the results, so nothing depends on the batching
            return self._decode_each(partition, messages, index.tolist(), dead)
        return payloads, times, [int(index[j]) for j in refs]

    def _decode_each(self, partition: int, messages: RawBatch, indexes: list[int],
                     dead: list[DeadLetter]) -> tuple[Any, list[float], list[int]]:
        """Decode the records at ``indexes`` one by one (each already decoded alone once)."""
        parts: list[Any] = []
        times: list[float] = []
        refs: list[int] = []
        people: list[str] = []
        for i in indexes:
            self._fresh_people()
            one, at, _ = self.decode(partition, _alone(messages, i), dead)
            parts.append(self.standalone(partition, one))
            times.extend(float(t) for t in at)
            refs.extend([i] * len(at))
            if self.hasher is not None:
                people.extend(self._named_people(partition))
        self.decoded_people = people
        if parts and all(isinstance(one, np.ndarray) for one in parts):
            return np.concatenate(parts), times, refs  # the kind's payload type, kept
        return [p for one in parts for p in one], times, refs

    def _count_clamped(self, messages: RawBatch, refs: range | list[int], seconds: np.ndarray,
                       low: np.ndarray, high: np.ndarray, ok: np.ndarray) -> None:
        """Count the accepted records placed at a limit of the producer clock's clamp.

        ``ahead``: stamped more than ``flow.max_skew`` after the partition's trusted clock;
        ``behind``: more than ``flow.lateness`` before it. Counted per input topic and bound
        in :attr:`clamped`; the last batch's in :attr:`clamped_last` (for the log line).
        """
        for bound, beyond in (("ahead", seconds > high), ("behind", seconds < low)):
            hits = np.flatnonzero(beyond & ok)
            if not hits.size:
                continue
            for i in hits.tolist():
                topic = messages.topics[refs[i]] or ""
                self.clamped[topic, bound] = self.clamped.get((topic, bound), 0) + 1
            self.clamped_last[bound] = (int(hits.size), messages.offsets[refs[int(hits[0])]])

    # -- time --
    def to_state(self) -> dict[str, Any]:
        """Snapshot for recovery."""
        return {"partition": self.partition, "watermark": self.watermark, "closed": self.closed}

    def _step_of(self, seconds: float) -> int:
        return math.floor((seconds - self.rules.origin_seconds) / self.rules.step_seconds)

    def end_step(self) -> int | None:
        """The step of ``flow.end`` (it and every later step never close), or None."""
        end = self.rules.end_seconds
        return None if end is None else self._step_of(end)

    def frontier(self) -> int | None:
        """The first step not yet closed from this partition's point of view."""
        if self.watermark is None:
            step = self.closed
        else:
            step = self._step_of(self.watermark - self.rules.lateness_seconds)
            if self.closed is not None:
                step = max(step, self.closed)
        end = self.end_step()
        return step if step is None or end is None else min(step, end)

    def end_of_input(self) -> list[ShardUpdate]:
        """Close this partition's steps at the end of a bounded input; tell every shard.

        With ``flow.end`` the partition closes through the step before ``flow.end``'s (a
        configured, public end); without it through its watermark's step (its trusted
        clock: never a data record's own time under the producer clock). Nothing is closed
        (no update) if neither is known. A record that arrives for a closed step after a
        resume (the topic grew) is late, never silently lost.
        """
        if self.partition is None:
            return []
        end = self.end_step()
        if end is not None:
            target = end
        elif self.watermark is not None:
            target = self._step_of(self.watermark) + 1
        else:
            return []
        self.closed = max(target, self.closed) if self.closed is not None else target
        return [ShardUpdate(s, self.partition, self.frontier(), {})
                for s in range(self._targets())]

    def carries_people(self, partition: int) -> bool:
        """Whether ``partition``'s records are people's events, bounded at the user level.

        Every partition does unless the kind says otherwise (PMWG: its questions partitions):
        those records then go to the bounding stage as a :class:`PassThrough`, unbounded.
        """
        return True

    def _route_through(self, messages: RawBatch, payloads: Any, refs: range | list[int],
                       keep: np.ndarray | None, steps: int | list[int]
                       ) -> list[dict[int, Any]]:
        """The accepted records of a partition without people, as :class:`PassThrough`.

        They all go to one person shard (the partition's, modulo the person shards): the
        stage passes them on unbounded, so which shard carries them changes nothing.
        """
        per_shard: list[dict[int, Any]] = [{} for _ in range(self.person_shards)]
        if keep is not None:
            refs = [refs[i] for i in keep.tolist()]
        n = len(refs)
        offsets = messages.offsets
        offset_column = np.fromiter((-1 if o is None else o for o in map(offsets.__getitem__,
                                                                         refs)),
                                    dtype=np.int64, count=n)
        step_of = (np.full(n, steps, dtype=np.int64) if isinstance(steps, int)
                   else np.asarray(steps, dtype=np.int64))
        into = per_shard[messages.partition % self.person_shards]
        for step in np.unique(step_of).tolist():
            index = np.flatnonzero(step_of == step)
            into[int(step)] = PassThrough(np.full(index.size, messages.partition,
                                                  dtype=np.int64), offset_column[index],
                                          [payloads[i] for i in index.tolist()])
        return per_shard

    def _targets(self) -> int:
        """How many shards this clock's updates go to (person shards at the user level)."""
        return self.person_shards if self.hasher is not None else self.rules.shards

    def _route_people(self, messages: RawBatch, payloads: Any, refs: range | list[int],
                      keep: np.ndarray | None, steps: int | list[int]
                      ) -> list[dict[int, Any]]:
        """The accepted events as :class:`PersonEvents` per person shard and step.

        ``keep``: the accepted payloads' positions among the decoded ones (None: all).
        The people are hashed here, at once; the raw ids go no further.
        """
        assert self.hasher is not None
        people = self._named_people(messages.partition)
        if len(people) != len(refs):
            raise RuntimeError("the kind's decoder gave a person for "
                               f"{len(people)} of {len(refs)} payloads (decoded_people)")
        shards = self.person_shards
        per_shard: list[dict[int, Any]] = [{} for _ in range(shards)]
        if keep is not None:
            people = [people[i] for i in keep.tolist()]
            refs = [refs[i] for i in keep.tolist()]
        n = len(people)
        if not n:
            return per_shard
        hashes = self.hasher.hash_many(people)
        # the ids go no further, and are released at once: kept until the next batch, they
        # interleave with its short-lived objects in memory (measurably slower decoding)
        people = self.decoded_people = _UNSET
        try:  # offsets are ints from Kafka; a source without them gives None (-1)
            offsets = np.fromiter(messages.offsets, dtype=np.int64, count=len(messages))
        except TypeError:
            offsets = np.array([-1 if o is None else o for o in messages.offsets], np.int64)
        if not (isinstance(refs, range) and len(refs) == len(offsets)):
            offsets = offsets[np.asarray(refs, dtype=np.int64)]
        events = PersonEvents(hashes, np.full(n, messages.partition, dtype=np.int64), offsets,
                              payloads)
        owner = person_shards(hashes, shards).astype(np.int64)
        step_of = (np.full(n, steps, dtype=np.int64) if isinstance(steps, int)
                   else np.asarray(steps, dtype=np.int64))
        if isinstance(steps, int):  # one step: by shard, stable (a radix sort on int16)
            narrow = owner.astype(np.int16) if shards <= np.iinfo(np.int16).max else owner
            order = np.argsort(narrow, kind="stable")
        else:
            order = np.lexsort((owner, step_of))  # by step, then shard; stable within
        owner, step_of, events = owner[order], step_of[order], events.take(order)
        begins = np.flatnonzero(np.concatenate(
            ([True], (step_of[1:] != step_of[:-1]) | (owner[1:] != owner[:-1]))))
        ends = [*begins[1:].tolist(), n]
        for begin, end, shard, step in zip(begins.tolist(), ends, owner[begins].tolist(),
                                           step_of[begins].tolist(), strict=True):
            per_shard[shard][step] = events.cut(begin, end)  # one reorder, then views
        return per_shard

    def process(self, partition: int, messages: RawBatch | list[RawMessage]
                ) -> tuple[list[ShardUpdate], list[DeadLetter]]:
        """Place a batch of raw records of ``partition`` in steps.

        ``messages`` is a :class:`~dpstream.messages.RawBatch` (what the sources hand over)
        or a list of :data:`RawMessage` tuples. Placing records in steps and detecting late
        ones is vectorised over the batch, exactly as if the records were processed one by
        one: a record is late if its step is before the partition's frontier as it stood
        just before the record.

        Returns:
            One update per shard (it carries the frontier even without increments) and
            the dead letters, in offset order.
        """
        if not isinstance(messages, RawBatch):
            messages = RawBatch.of(messages) if messages else RawBatch(
                partition, [], [], [], np.empty(0, np.float64), np.empty(0, np.int64))
        self.partition = partition
        self.clamped_last = {}
        rules = self.rules
        dead: list[DeadLetter] = []
        n = len(messages)
        broker = messages.broker_ms / 1000.0
        kinds = messages.kinds
        producer_clock = rules.clock == "producer"
        has_ticks = bool(countOf(messages.values, TICK))
        ticks = (np.fromiter((value == TICK for value in messages.values), dtype=bool, count=n)
                 if has_ticks else None)
        in_range = broker <= MAX_SECONDS
        log_append = kinds == TIMESTAMP_LOG_APPEND_TIME
        if producer_clock:  # a record must carry a timestamp; only ticks and broker time count
            trusted = (log_append | (kinds == TIMESTAMP_CREATE_TIME)) & in_range
            moves = log_append & in_range
            if ticks is not None:
                moves |= trusted & ticks
        else:
            trusted = moves = log_append & in_range
        start = -np.inf if self.watermark is None else self.watermark
        running = np.maximum.accumulate(
            np.concatenate(([start], np.where(moves, broker, -np.inf))))
        if running[-1] > start:
            self.watermark = float(running[-1])
        before_all = running[:-1]  # the trusted clock just before each record
        at_all = running[1:]  # ... and with the record (which moves it only if trusted)
        if ticks is not None:  # heartbeats: clock only
            keep = ~ticks
            messages = messages.keep(keep)
            broker, trusted, kinds = broker[keep], trusted[keep], kinds[keep]
            before_all, at_all = before_all[keep], at_all[keep]
            self.ticks += n - len(messages)
            n = len(messages)
        self._fresh_people()
        payloads, times, refs = self._decode_guarded(partition, messages, dead) if n \
            else ([], [], [])
        accepted: Any = []
        accepted_steps: list[int] = []
        single_step: int | None = None
        chosen: np.ndarray | None = None  # the accepted payloads' positions (None: all)
        if len(times):
            origin, step_len, lateness = rules.origin_seconds, rules.step_seconds, \
                rules.lateness_seconds
            seconds = np.asarray(times, dtype=np.float64)
            if isinstance(refs, range) and len(refs) == n:  # every record decoded
                own_broker, own_trusted, before, at = broker, trusted, before_all, at_all
            else:
                index = np.asarray(refs, dtype=np.int64)
                own_broker, own_trusted, before, at = broker[index], trusted[index], \
                    before_all[index], at_all[index]
            finite = np.isfinite(seconds)
            if producer_clock:  # own time, clamped around the trusted clock (if any yet)
                known = np.isfinite(at)
                low = np.where(known, at - lateness, -np.inf)
                high = np.where(known, at + rules.max_skew_seconds, MAX_SECONDS)
                placed = np.minimum(np.maximum(seconds, low), np.minimum(high, MAX_SECONDS))
            else:  # own time, clamped into [own broker time - lateness, own broker time]
                placed = np.minimum(np.maximum(seconds, own_broker - lateness), own_broker)
            if not finite.all():
                placed = np.where(finite, placed, origin)
            steps = np.floor((placed - origin) / step_len)
            frontier_before = np.floor((before - lateness - origin) / step_len)
            if self.closed is not None:
                frontier_before = np.maximum(frontier_before, self.closed)
            end = self.end_step()
            after_end = np.zeros(len(steps), dtype=bool) if end is None else steps >= end
            before_origin = finite & ((seconds < origin) | (placed < origin))
            ok = own_trusted & finite & ~before_origin & ~after_end & (steps >= frontier_before)
            for i in np.flatnonzero(~ok).tolist():
                message = messages[refs[i]]
                kind = message[5]
                if not own_trusted[i]:
                    reason = _untrusted(kind)
                    if kind in (TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME) and \
                            own_broker[i] > MAX_SECONDS:
                        reason = "the record's timestamp is after the year 9999"
                elif not finite[i]:
                    reason = bad_time(rules.time_field)
                elif before_origin[i]:
                    reason = "event time before flow.origin"
                elif after_end[i]:
                    reason = _AFTER_END
                else:
                    reason = _LATE[rules.clock]
                dead.append(self.dead_letter(reason, message))
            if producer_clock:
                self._count_clamped(messages, refs, seconds, low, high, ok)
            if ok.all():
                accepted, kept = payloads, steps
            else:
                keep = chosen = np.flatnonzero(ok)
                kept = steps[keep]
                accepted = (payloads[keep] if isinstance(payloads, np.ndarray)
                            else [payloads[i] for i in keep.tolist()])
            if kept.size and kept.min() == kept.max():
                single_step = int(kept[0])  # the usual case: the whole batch lies in one step
            else:
                accepted_steps = kept.astype(np.int64).tolist()
        self.events += len(accepted)
        self.dead_letters += len(dead)
        at_steps = single_step if single_step is not None else accepted_steps
        per_shard: list[dict[int, Any]]
        if self.hasher is not None:
            if not len(accepted):
                per_shard = [{} for _ in range(self.person_shards)]
            elif self.carries_people(partition):
                per_shard = self._route_people(messages, accepted, refs, chosen, at_steps)
            else:  # no person's records (PMWG's questions): past the bounding, unbounded
                per_shard = self._route_through(messages, accepted, refs, chosen, at_steps)
            self.decoded_people = _UNSET  # the ids are released with the batch
        else:
            if self.decoded_people:  # fail closed: never route a person's events unbounded
                raise RuntimeError(
                    f"{type(self).__name__} decoded people (a user-level configuration) but has "
                    "no person hasher: user-level clocks are built by the platform, which "
                    "routes every event through the bounding stage")
            per_shard = self.route(accepted, at_steps)
        frontier = self.frontier()
        dead.sort(key=lambda letter: letter.offset if letter.offset is not None else -1)
        return [ShardUpdate(s, partition, frontier, per_shard[s])
                for s in range(self._targets())], dead
