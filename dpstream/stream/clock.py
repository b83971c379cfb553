"""The step clock every flow kind shares: place records in time steps, per input partition.

**Each record's step comes from that record alone.** A record carries its
event time (decoded by the flow kind) and the broker's timestamp (Kafka's
record timestamp). Its *placement time* is its event time clamped into
``[broker time - flow.lateness, broker time]``: an event stamped in the future
counts at its broker time, an event older than the lateness counts at broker
time minus the lateness. No other record can change where it is counted
(pitfall 10).

**Steps close by broker time, which no client can push.** A partition's
frontier (the first step it has not closed) is the step of ``max broker time
seen - flow.lateness``. With ``flow.clock = "broker"`` (the default) only
broker-set timestamps (``message.timestamp.type=LogAppendTime`` on the topic)
are trusted; a record with a producer-set timestamp (CreateTime) or none is a
dead letter, so a client cannot move the clock. ``flow.clock = "producer"``
trusts producer timestamps: only for topics whose every producer is trusted
(the demo, tests, a single internal producer).

**What "late" means.** Broker time only moves forward within a partition,
so no record placed by its own broker timestamp can fall into a closed step.
A record is late (a dead letter) only if its step is already closed in its
partition: the broker's clock went backwards (a leader moved to a broker whose
clock is behind), or the step was closed at the end of a bounded input
(:meth:`StepClock.end_of_input`) and the topic grew before a resume. Lateness is a function
of the partition's records in their offset order, which Kafka fixes, so a
replay after a crash accepts and rejects exactly the same records.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from operator import countOf
from typing import Any, Final, Protocol

import numpy as np

from dpstream.messages import (
    TICK,
    TIMESTAMP_CREATE_TIME,
    TIMESTAMP_LOG_APPEND_TIME,
    DeadLetter,
    RawBatch,
    RawMessage,
)

__all__ = ["ClockRules", "MAX_SECONDS", "ShardUpdate", "StepClock", "bad_time", "undecodable"]

MAX_SECONDS: Final = 253_402_300_799.0  # 9999-12-31T23:59:59Z: keeps every step index in int64


def bad_time(field: str) -> str:
    """The dead-letter reason of a record without a usable event time."""
    return f"field {field!r} missing or not a finite Unix time in seconds or an ISO-8601 string"


def undecodable(exc: BaseException) -> str:
    """The dead-letter reason of a record whose decoding raised ``exc``.

    Only the exception's type is named: a parser's message can quote the record's values
    (pitfall 5), and dead-letter reasons also label a metric.
    """
    return f"undecodable record ({type(exc).__name__})"


def _untrusted(kind: int) -> str:
    """Why a record's timestamp cannot place it (with ``flow.clock = "broker"``)."""
    if kind == TIMESTAMP_CREATE_TIME:
        return ("the record's timestamp is producer-set (CreateTime) and flow.clock = "
                "'broker' trusts only broker time: set message.timestamp.type="
                "LogAppendTime on the input topic")
    return "the record has no broker timestamp"


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


class StepClock:
    """The broker-time watermark of one input partition, and the placement of its records."""

    def __init__(self, rules: ClockRules, state: dict[str, Any] | None = None) -> None:
        self.rules = rules
        self.partition: int | None = None if state is None else state["partition"]
        self.watermark: float | None = None if state is None else state["watermark"]
        # steps closed at the end of a bounded input: a later record before it is late
        self.closed: int | None = None if state is None else state.get("closed")
        self.events = 0
        self.dead_letters = 0
        self.ticks = 0

    # -- what a flow kind provides --
    def decode(self, partition: int, messages: RawBatch, dead: list[DeadLetter]
               ) -> tuple[list[Any], np.ndarray | list[float], range | list[int]]:
        """Decode records: their payloads (a list, or an array), event times and indexes.

        ``messages`` is read as columns (``messages.values``) or as :data:`RawMessage`
        tuples. Records that cannot be used go to ``dead`` (with :meth:`dead_letter`); the
        third element gives, for each payload, the index of its record in ``messages``
        (``range`` when every record decoded).
        """
        raise NotImplementedError

    def route(self, payloads: list[Any], steps: int | list[int]) -> list[dict[int, Any]]:
        """Group accepted payloads by shard and step: one ``{step: bucket}`` per shard.

        ``steps`` is one step for every payload (the usual case) or one step per payload.
        """
        raise NotImplementedError

    def dead_letter(self, reason: str, message: RawMessage) -> DeadLetter:
        """The dead letter of an unusable record."""
        partition, raw, offset, topic, _, _ = message
        return DeadLetter(reason, raw or b"", topic, partition, offset)

    def _decode_guarded(self, partition: int, messages: RawBatch, dead: list[DeadLetter]
                        ) -> tuple[list[Any], np.ndarray | list[float], range | list[int]]:
        """:meth:`decode`, turning any exception into dead letters of the records that raise.

        The usual case costs one ``try``. If the batch raises, its dead letters so far are
        dropped and each record is decoded alone (results discarded) to find those that
        raise; they become dead letters (:func:`undecodable`) and the others are decoded
        again as one batch. Should that batch still raise (records that decode alone but
        not together: a bug), its records become dead letters too, rather than stop the flow.
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
            alone = RawBatch(messages.partition, messages.values[i:i + 1],
                             messages.offsets[i:i + 1], messages.topics[i:i + 1],
                             messages.broker_ms[i:i + 1], messages.kinds[i:i + 1])
            try:
                self.decode(partition, alone, [])
            except Exception as exc:
                raising[i] = True
                reasons[i] = undecodable(exc)
        for i in np.flatnonzero(raising).tolist():
            dead.append(self.dead_letter(reasons[i], messages[i]))
        index = np.flatnonzero(~raising)
        if not index.size:
            return [], [], []
        mark = len(dead)
        try:
            payloads, times, refs = self.decode(partition, messages.keep(~raising), dead)
        except Exception as exc:
            del dead[mark:]
            dead.extend(self.dead_letter(undecodable(exc), messages[i])
                        for i in index.tolist())
            return [], [], []
        return payloads, times, [int(index[j]) for j in refs]

    # -- time --
    def to_state(self) -> dict[str, Any]:
        """Snapshot for recovery."""
        return {"partition": self.partition, "watermark": self.watermark, "closed": self.closed}

    def _step_of(self, seconds: float) -> int:
        return math.floor((seconds - self.rules.origin_seconds) / self.rules.step_seconds)

    def frontier(self) -> int | None:
        """The first step not yet closed from this partition's point of view."""
        if self.watermark is None:
            return self.closed
        step = self._step_of(self.watermark - self.rules.lateness_seconds)
        return step if self.closed is None else max(step, self.closed)

    def end_of_input(self) -> list[ShardUpdate]:
        """Close this partition's steps through its watermark's step (a bounded input ended).

        The partition then tells every shard its final frontier; a record that arrives for a
        closed step after a resume (the topic grew) is late, never silently lost.
        """
        assert self.partition is not None and self.watermark is not None
        self.closed = max(self._step_of(self.watermark) + 1, self.closed or 0)
        return [ShardUpdate(s, self.partition, self.frontier(), {})
                for s in range(self.rules.shards)]

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
        rules = self.rules
        dead: list[DeadLetter] = []
        n = len(messages)
        broker = messages.broker_ms / 1000.0
        kinds = messages.kinds
        if rules.clock == "broker":
            trusted = kinds == TIMESTAMP_LOG_APPEND_TIME
        else:
            trusted = (kinds == TIMESTAMP_LOG_APPEND_TIME) | (kinds == TIMESTAMP_CREATE_TIME)
        trusted &= broker <= MAX_SECONDS
        start = -np.inf if self.watermark is None else self.watermark
        running = np.maximum.accumulate(
            np.concatenate(([start], np.where(trusted, broker, -np.inf))))
        if running[-1] > start:
            self.watermark = float(running[-1])
        before_all = running[:-1]
        if countOf(messages.values, TICK):  # heartbeats: clock only
            keep = np.fromiter((value != TICK for value in messages.values), dtype=bool,
                               count=n)
            messages = messages.keep(keep)
            broker, trusted, kinds, before_all = broker[keep], trusted[keep], kinds[keep], \
                before_all[keep]
            self.ticks += n - len(messages)
            n = len(messages)
        payloads, times, refs = self._decode_guarded(partition, messages, dead) if n \
            else ([], [], [])
        accepted: Any = []
        accepted_steps: list[int] = []
        single_step: int | None = None
        if len(times):
            origin, step_len, lateness = rules.origin_seconds, rules.step_seconds, \
                rules.lateness_seconds
            seconds = np.asarray(times, dtype=np.float64)
            if isinstance(refs, range) and len(refs) == n:  # every record decoded
                own_broker, own_trusted, before = broker, trusted, before_all
            else:
                index = np.asarray(refs, dtype=np.int64)
                own_broker, own_trusted, before = broker[index], trusted[index], before_all[index]
            finite = np.isfinite(seconds)
            placed = np.minimum(np.maximum(seconds, own_broker - lateness), own_broker)
            if not finite.all():
                placed = np.where(finite, placed, own_broker)
            steps = np.floor((placed - origin) / step_len)
            frontier_before = np.floor((before - lateness - origin) / step_len)
            if self.closed is not None:
                frontier_before = np.maximum(frontier_before, self.closed)
            before_origin = finite & ((seconds < origin) | (placed < origin))
            ok = own_trusted & finite & ~before_origin & (steps >= frontier_before)
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
                else:
                    reason = ("late: the record's step is already closed in this partition (the "
                              "broker's timestamps went backwards, or the step was closed at "
                              "the end of a bounded input)")
                dead.append(self.dead_letter(reason, message))
            if ok.all():
                accepted, kept = payloads, steps
            else:
                keep = np.flatnonzero(ok)
                kept = steps[keep]
                accepted = (payloads[keep] if isinstance(payloads, np.ndarray)
                            else [payloads[i] for i in keep.tolist()])
            if kept.size and kept.min() == kept.max():
                single_step = int(kept[0])  # the usual case: the whole batch lies in one step
            else:
                accepted_steps = kept.astype(np.int64).tolist()
        self.events += len(accepted)
        self.dead_letters += len(dead)
        per_shard = self.route(accepted, single_step if single_step is not None
                               else accepted_steps)
        frontier = self.frontier()
        dead.sort(key=lambda letter: letter.offset if letter.offset is not None else -1)
        return [ShardUpdate(s, partition, frontier, per_shard[s])
                for s in range(rules.shards)], dead
