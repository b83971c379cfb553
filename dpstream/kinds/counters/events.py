"""The counters flow's events: a key and an event time per JSON record.

:class:`PartitionClock` is the counters' :class:`~dpstream.stream.clock.StepClock`: it decodes
``{"key": ..., "ts": ...}`` records (a typed msgspec decoder over the whole batch, and a
slower parser that explains each record that fails it; any other exception a record raises,
such as msgspec's ``RecursionError`` on deep nesting, makes it a dead letter naming the
exception's type) and counts events per key and step,
grouped by the key's shard. Placing records in steps, trusting timestamps and detecting late
records is the shared clock's job (:mod:`dpstream.stream.clock`).

At the user level (``EventRules.user_field`` set) the events are ``{"key": ..., "ts": ...,
"user": ...}`` and both paths also read the person (a non-empty string, else a dead letter,
:func:`~dpstream.stream.clock.bad_person`) into ``decoded_people``; the event-level decoders
are left as they are.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from operator import attrgetter
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import orjson

from dpstream.kinds.counters.layout import DeclaredLayout, PeopleCounts, RowCounts
from dpstream.messages import (
    TICK,
    TIMESTAMP_CREATE_TIME,
    TIMESTAMP_LOG_APPEND_TIME,
    TIMESTAMP_NONE,
    DeadLetter,
    RawBatch,
    RawMessage,
)
from dpstream.stream.clock import (
    MAX_SECONDS,
    ShardUpdate,
    StepClock,
    bad_person,
    bad_time,
    iso_seconds,
    undecodable,
)
from dpstream.stream.sharding import shards_of

__all__ = [
    "EventRules",
    "MAX_SECONDS",
    "PartitionClock",
    "RawMessage",
    "RowCounts",
    "ShardUpdate",
    "TIMESTAMP_CREATE_TIME",
    "TIMESTAMP_LOG_APPEND_TIME",
    "TIMESTAMP_NONE",
    "TICK",
]

MAX_KEY_LENGTH = 256
_KEY = attrgetter("key")
_TS = attrgetter("ts")
_USER = attrgetter("user")
_bad_time = bad_time


def _bad_key(field: str) -> str:
    return f"field {field!r} missing or not a non-empty string"


@dataclass(frozen=True)
class EventRules:
    """How to read an event and place it in a step."""

    key_field: str
    time_field: str
    origin: datetime
    step_seconds: float
    lateness_seconds: float
    shards: int
    declared: DeclaredLayout | None = None
    """The declared universe's layout: events of other keys are dead letters, and the
    events of declared keys are routed to their shards as rows (:class:`RowCounts`)."""
    clock: Literal["broker", "producer"] = "broker"
    max_skew_seconds: float = 300.0
    """With the producer clock: how far ahead of the watermark an event may be placed."""
    end: datetime | None = None
    """``flow.end``: the public end of a bounded run (None: not set)."""
    user_field: str | None = None
    """At the user level, the field that names the person (None: the event level)."""

    @property
    def origin_seconds(self) -> float:
        """The origin as Unix seconds."""
        return self.origin.timestamp()

    @property
    def end_seconds(self) -> float | None:
        """``flow.end`` as Unix seconds, or None."""
        return None if self.end is None else self.end.timestamp()


class PartitionClock(StepClock):
    """The counters' step clock: decodes key/time events and counts them per key and step."""

    def __init__(self, rules: EventRules, state: dict[str, Any] | None = None) -> None:
        super().__init__(rules, state)
        self.rules: EventRules = rules
        user = rules.user_field
        people: list[tuple[str, Any]] = [] if user is None else [("user", str)]
        rename = {"key": rules.key_field, "ts": rules.time_field,
                  **({} if user is None else {"user": user})}
        event_type = msgspec.defstruct(
            "Event", [("key", str), ("ts", float | str), *people], rename=rename, gc=False)
        # a Struct made at run time: its fields are not known statically, so events are Any
        self._decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(event_type)
        strict_people: list[tuple[str, Any]] = [] if user is None else [
            ("user", Annotated[str, msgspec.Meta(min_length=1)])]
        strict_type = msgspec.defstruct(  # the fast path: key length and float time checked in C
            "StrictEvent",
            [("key", Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY_LENGTH)]),
             ("ts", float), *strict_people], rename=rename, gc=False)
        self._strict_decoder = msgspec.json.Decoder(strict_type)

    def decode(self, partition: int, messages: RawBatch, dead: list[DeadLetter]
               ) -> tuple[list[Any] | np.ndarray, np.ndarray | list[float], range | list[int]]:
        """Decode the whole batch in one C call, else record by record (explaining failures)."""
        fast = self._decode_batch(messages)
        if fast is not None:
            keys, times = fast
            return keys, times, range(len(messages))
        return self._decode_records(partition, messages, dead)

    def route(self, payloads: list[Any] | np.ndarray, steps: int | list[int]
              ) -> list[dict[int, Any]]:
        """Count events per key and step, grouped by the key's shard.

        Vectorised over the batch: one ``Counter`` per step, the shards of the distinct keys
        as one array (:func:`shards_of`), and one ``dict(zip(...))`` per shard. No cache: a
        cache of every key's shard would cost more memory per key than the key's state. In
        the declared universe the payloads are positions, and a bucket is a
        :class:`RowCounts` (the layout fixed every key's shard and row at start-up).
        """
        shards = self.rules.shards
        per_shard: list[dict[int, Any]] = [{} for _ in range(shards)]
        if not len(payloads):
            return per_shard
        if isinstance(payloads, np.ndarray):  # declared positions
            return self._route_positions(payloads, steps, per_shard)
        if isinstance(steps, int):
            by_step = {steps: Counter(payloads)}
        else:
            by_step = {}
            for key, step in zip(payloads, steps, strict=True):
                bucket = by_step.get(step)
                if bucket is None:
                    bucket = by_step[step] = Counter()
                bucket[key] += 1
        for step, counts in by_step.items():
            if shards == 1:
                per_shard[0][step] = dict(counts)
                continue
            keys = list(counts)
            owner = shards_of(keys, shards)
            order = np.argsort(owner, kind="stable")
            bounds = np.searchsorted(owner[order], np.arange(shards + 1)).tolist()
            ordered = list(map(keys.__getitem__, order.tolist()))
            values = list(map(counts.__getitem__, ordered))
            for shard in range(shards):
                lo, hi = bounds[shard], bounds[shard + 1]
                if hi > lo:
                    per_shard[shard][step] = dict(zip(ordered[lo:hi], values[lo:hi], strict=True))
        return per_shard

    def route_bounded(self, payloads: list[Any] | np.ndarray, first: np.ndarray, step: int
                      ) -> list[dict[int, Any]]:
        """Route one closed step's *kept* events (user level), with their people counts.

        The bounding stage calls this instead of :meth:`route` with the events it kept for one
        step and ``first[i]``: event ``i`` is its person's first kept event at its key in the
        period. Each shard gets one bucket for ``step``: a
        :class:`~dpstream.kinds.counters.layout.PeopleCounts` by key name (open universe) or a
        :class:`RowCounts` with its ``people`` column (declared universe): the events per key
        (the counters' input) and the people counted for the first time per key (the
        threshold monitors' input: each person adds at most one to a key, per period).
        """
        shards = self.rules.shards
        per_shard: list[dict[int, Any]] = [{} for _ in range(shards)]
        if not len(payloads):
            return per_shard
        flags = np.asarray(first, dtype=bool).reshape(-1)
        if flags.size != len(payloads):
            raise ValueError(f"route_bounded: {len(payloads)} payloads but {flags.size} flags")
        layout = self.rules.declared
        if layout is not None:  # declared positions (in whatever sequence the stage keeps)
            positions = np.asarray(payloads, dtype=np.int64).reshape(-1)
            for shard, rows in enumerate(layout.route(positions, flags)):
                if rows is not None:
                    per_shard[shard][step] = rows
            return per_shard
        if isinstance(payloads, np.ndarray):  # keys kept in an object column
            payloads = payloads.tolist()
        events = Counter(payloads)
        people = Counter(itertools.compress(payloads, flags.tolist()))
        keys = list(events)
        owner = np.zeros(len(keys), dtype=np.int64) if shards == 1 else shards_of(keys, shards)
        for shard in np.unique(owner).tolist():
            mine = list(itertools.compress(keys, (owner == shard).tolist()))
            per_shard[shard][step] = PeopleCounts(
                {key: events[key] for key in mine},
                {key: people[key] for key in mine if key in people})
        return per_shard

    def _route_positions(self, positions: np.ndarray, steps: int | list[int],
                         per_shard: list[dict[int, Any]]) -> list[dict[int, Any]]:
        """:meth:`route` in the declared universe: positions counted in bulk, by row."""
        layout = self.rules.declared
        assert layout is not None
        if isinstance(steps, int):
            by_step = {steps: positions}
        else:
            step_of = np.asarray(steps, dtype=np.int64)
            by_step = {step: positions[step_of == step] for step in np.unique(step_of).tolist()}
        for step, mine in by_step.items():
            for shard, bucket in enumerate(layout.route(mine)):
                if bucket is not None:
                    per_shard[shard][step] = bucket
        return per_shard

    def _explain(self, raw: bytes | None) -> str:
        """Why a record failed the decoder (the slow path, for dead letters only)."""
        try:
            event = orjson.loads(raw) if raw is not None else None
        except orjson.JSONDecodeError:
            return "invalid JSON"
        if not isinstance(event, dict):
            return "not a JSON object"
        key = event.get(self.rules.key_field)
        if not isinstance(key, str) or not key:
            return _bad_key(self.rules.key_field)
        user = self.rules.user_field
        if user is not None and (not isinstance(event.get(user), str) or not event.get(user)):
            return bad_person(user)
        return _bad_time(self.rules.time_field)

    def _decode_batch(self, messages: RawBatch
                      ) -> tuple[list[str] | np.ndarray, np.ndarray] | None:
        """Decode a whole batch in one C call, or return None to take the per-record path.

        The payloads are the keys, or in the declared universe their positions
        (:class:`~dpstream.kinds.counters.layout.DeclaredLayout`).

        The records are joined as JSON lines. The join is only trusted when no record
        holds a newline and every line decoded into exactly one event, so each event
        is exactly one record; any invalid, blank or odd record sends the whole batch
        to :meth:`_decode_records`, which explains each failure.
        """
        values = messages.values
        if not values or None in values:
            return None
        buf = b"\n".join(values)  # type: ignore[arg-type]
        if buf.count(b"\n") != len(values) - 1:
            return None
        try:
            events = self._strict_decoder.decode_lines(buf)
        except Exception:  # any failure (RecursionError, invalid UTF-8, ...): the records
            return None  # are explained one by one
        if len(events) != len(values):
            return None
        keys = list(map(_KEY, events))
        times = np.fromiter(map(_TS, events), dtype=np.float64, count=len(events))
        if self.rules.user_field is not None:
            self.decoded_people = list(map(_USER, events))
        layout = self.rules.declared
        if layout is None:
            return keys, times
        positions = layout.positions(keys)
        if (positions < 0).any():  # an undeclared key: explained record by record
            return None
        return positions, times

    def _decode_records(self, partition: int,
                     messages: RawBatch,
                     dead: list[DeadLetter]
                     ) -> tuple[list[str] | np.ndarray, list[float], list[int]]:
        """Decode record by record, sending each unusable one to ``dead`` with its reason.

        The payloads are as :meth:`_decode_batch` gives them.
        """
        rules = self.rules
        layout = rules.declared
        decode = self._decoder.decode
        keys: list[str] = []
        times: list[float] = []
        refs: list[int] = []
        user_level = rules.user_field is not None
        people: list[str] = []
        for i, (_, raw, offset, topic, _, _) in enumerate(messages):
            try:
                event = decode(raw)  # type: ignore[arg-type]
            except (msgspec.DecodeError, TypeError, ValueError):  # ValueError: invalid UTF-8
                dead.append(DeadLetter(self._explain(raw), raw or b"", topic, partition, offset))
                continue
            except Exception as exc:  # e.g. RecursionError on deep nesting: never a crash
                dead.append(DeadLetter(undecodable(exc), raw or b"", topic, partition, offset))
                continue
            key, ts = event.key, event.ts
            reason = None
            if type(ts) is str:  # the decoder gives a float or a str
                ts = iso_seconds(ts)
                if ts is None:
                    reason = bad_time(rules.time_field)
            if not key:
                reason = _bad_key(rules.key_field)
            elif len(key) > MAX_KEY_LENGTH:
                reason = f"field {rules.key_field!r} longer than {MAX_KEY_LENGTH} characters"
            elif user_level and not event.user:
                reason = bad_person(rules.user_field)  # type: ignore[arg-type]
            if reason is not None:
                dead.append(DeadLetter(reason, raw or b"", topic, partition, offset))
                continue
            keys.append(key)
            times.append(ts)
            refs.append(i)
            if user_level:
                people.append(event.user)
        if user_level:
            self.decoded_people = people
        if layout is None:
            return keys, times, refs
        positions = layout.positions(keys)  # one vectorized lookup for the whole batch
        known = positions >= 0
        if not known.all():
            for j in np.flatnonzero(~known).tolist():
                _, raw, offset, topic, _, _ = messages[refs[j]]
                dead.append(DeadLetter("key is not in admission.keys", raw or b"", topic,
                                       partition, offset))
            keep = known.tolist()
            times = list(itertools.compress(times, keep))
            refs = list(itertools.compress(refs, keep))
            if user_level:
                self.decoded_people = list(itertools.compress(people, keep))
        return positions[known], times, refs
