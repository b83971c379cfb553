"""Parse raw events and place them in time steps, one input partition at a time.

**Each record's step comes from that record alone.** A record carries its
event time (a field of the JSON value) and the broker's timestamp (Kafka's
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

**What "late" means now.** Broker time only moves forward within a partition,
so no record placed by its own broker timestamp can fall into a closed step.
A record is late (a dead letter) only if its step is already closed in its
partition: the broker's clock went backwards (a leader moved to a broker whose
clock is behind), or the step was closed at the end of a bounded input
(:meth:`PartitionClock.end_of_input`) and the topic grew before a resume. Lateness is a function
of the partition's records in their offset order, which Kafka fixes, so a
replay after a crash accepts and rejects exactly the same records.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from operator import attrgetter, countOf, itemgetter
from typing import Annotated, Any, Final, Literal

import msgspec
import numpy as np
import orjson

from dpstream.io.records import DeadLetter

__all__ = [
    "EventRules",
    "PartitionClock",
    "RawMessage",
    "ShardUpdate",
    "TIMESTAMP_CREATE_TIME",
    "TIMESTAMP_LOG_APPEND_TIME",
    "TIMESTAMP_NONE",
    "TICK",
    "shard_of",
]

# partition, value, offset, topic, broker timestamp (ms since the epoch), timestamp type
RawMessage = tuple[int, bytes | None, int | None, str | None, int, int]

TIMESTAMP_NONE: Final = 0  # the Kafka record timestamp types (as confluent-kafka reports them)
TIMESTAMP_CREATE_TIME: Final = 1
TIMESTAMP_LOG_APPEND_TIME: Final = 2

TICK: Final = b'{"dpstream.tick":1}'
"""A heartbeat record's value (see :class:`dpstream.io.kafka.Heartbeat`): it moves its
partition's broker clock like any record, and is otherwise skipped (no event, no dead letter)."""

MAX_KEY_LENGTH = 256
MAX_SECONDS = 253_402_300_799.0  # 9999-12-31T23:59:59Z: keeps every step index inside int64
_VALUE = itemgetter(1)
_BROKER_MS = itemgetter(4)
_KIND = itemgetter(5)
_KEY = attrgetter("key")
_TS = attrgetter("ts")


def _bad_key(field: str) -> str:
    return f"field {field!r} missing or not a non-empty string"


def _bad_time(field: str) -> str:
    return f"field {field!r} missing or not a finite Unix time in seconds or an ISO-8601 string"


def _iso_seconds(text: str) -> float | None:
    """Unix seconds of an ISO-8601 time (naive times are UTC), or None."""
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _untrusted(kind: int) -> str:
    """Why a record's timestamp cannot place it (with ``flow.clock = "broker"``)."""
    if kind == TIMESTAMP_CREATE_TIME:
        return ("the record's timestamp is producer-set (CreateTime) and flow.clock = "
                "'broker' trusts only broker time: set message.timestamp.type="
                "LogAppendTime on the input topic")
    return "the record has no broker timestamp"


def shard_of(key: str, shards: int) -> int:
    """Return the shard of ``key`` (stable across processes, unlike ``hash``)."""
    return zlib.crc32(key.encode()) % shards


@dataclass(frozen=True)
class EventRules:
    """How to read an event and place it in a step."""

    key_field: str
    time_field: str
    origin: datetime
    step_seconds: float
    lateness_seconds: float
    shards: int
    declared_keys: frozenset[str] | None = None
    clock: Literal["broker", "producer"] = "broker"

    @property
    def origin_seconds(self) -> float:
        """The origin as Unix seconds."""
        return self.origin.timestamp()


@dataclass
class ShardUpdate:
    """What one batch of one input partition tells one shard.

    Attributes:
        shard: the shard this update is for.
        partition: the input partition.
        frontier: the first step this partition has not closed (None: no event yet).
        increments: ``{step: {key: events}}`` for keys of this shard.
    """

    shard: int
    partition: int
    frontier: int | None
    increments: dict[int, dict[str, int]] = field(default_factory=dict)


class PartitionClock:
    """The broker-time watermark of one input partition, and the parser that uses it."""

    def __init__(self, rules: EventRules, state: dict[str, Any] | None = None) -> None:
        self.rules = rules
        self.partition: int | None = None if state is None else state["partition"]
        self.watermark: float | None = None if state is None else state["watermark"]
        # steps closed at the end of a bounded input: a later record before it is late
        self.closed: int | None = None if state is None else state.get("closed")
        self.events = 0
        self.dead_letters = 0
        self.ticks = 0
        self._shard_cache: dict[str, int] = {}
        event_type = msgspec.defstruct(
            "Event", [("key", str), ("ts", float | str)],
            rename={"key": rules.key_field, "ts": rules.time_field}, gc=False)
        self._decoder = msgspec.json.Decoder(event_type)
        strict_type = msgspec.defstruct(  # the fast path: key length and float time checked in C
            "StrictEvent",
            [("key", Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY_LENGTH)]),
             ("ts", float)],
            rename={"key": rules.key_field, "ts": rules.time_field}, gc=False)
        self._strict_decoder = msgspec.json.Decoder(strict_type)

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
        return _bad_time(self.rules.time_field)

    def _decode_batch(self, messages: list[RawMessage]
                      ) -> tuple[list[str], np.ndarray] | None:
        """Decode a whole batch in one C call, or return None to take the per-record path.

        The records are joined as JSON lines. The join is only trusted when no record
        holds a newline and every line decoded into exactly one event, so each event
        is exactly one record; any invalid, blank or odd record sends the whole batch
        to :meth:`_decode_each`, which explains each failure.
        """
        values = list(map(_VALUE, messages))
        if not values or None in values:
            return None
        buf = b"\n".join(values)  # type: ignore[arg-type]
        if buf.count(b"\n") != len(values) - 1:
            return None
        try:
            events = self._strict_decoder.decode_lines(buf)
        except msgspec.DecodeError:
            return None
        if len(events) != len(values):
            return None
        keys = list(map(_KEY, events))
        times = np.fromiter(map(_TS, events), dtype=np.float64, count=len(events))
        declared = self.rules.declared_keys
        if declared is not None and not declared.issuperset(keys):
            return None
        return keys, times

    def _decode_each(self, partition: int,
                     messages: list[RawMessage],
                     dead: list[DeadLetter]) -> tuple[list[str], list[float], list[int]]:
        """Decode record by record, sending each unusable one to ``dead`` with its reason."""
        rules = self.rules
        declared = rules.declared_keys
        decode = self._decoder.decode
        keys: list[str] = []
        times: list[float] = []
        refs: list[int] = []
        for i, (_, raw, offset, topic, _, _) in enumerate(messages):
            try:
                event = decode(raw)  # type: ignore[arg-type]
            except (msgspec.DecodeError, TypeError):
                dead.append(DeadLetter(self._explain(raw), raw or b"", topic, partition, offset))
                continue
            key, ts = event.key, event.ts
            reason = None
            if type(ts) is str:  # the decoder gives a float or a str
                ts = _iso_seconds(ts)
                if ts is None:
                    reason = _bad_time(rules.time_field)
            if not key:
                reason = _bad_key(rules.key_field)
            elif len(key) > MAX_KEY_LENGTH:
                reason = f"field {rules.key_field!r} longer than {MAX_KEY_LENGTH} characters"
            elif declared is not None and key not in declared:
                reason = "key is not in admission.keys"
            if reason is not None:
                dead.append(DeadLetter(reason, raw or b"", topic, partition, offset))
                continue
            keys.append(key)
            times.append(ts)  # type: ignore[arg-type]
            refs.append(i)
        return keys, times, refs

    def process(self, partition: int, messages: list[RawMessage]
                ) -> tuple[list[ShardUpdate], list[DeadLetter]]:
        """Parse a batch of raw messages of ``partition`` (see :data:`RawMessage`).

        Decoding is per record (a typed msgspec decoder; a record that fails it
        is explained by a slower parser for its dead letter); placing events in
        steps and detecting late ones is vectorised over the batch, exactly as if
        the records were processed one by one: a record is late if its step is
        before the partition's frontier as it stood just before the record.

        Returns:
            One update per shard (it carries the frontier even without increments) and
            the dead letters.
        """
        self.partition = partition
        rules = self.rules
        dead: list[DeadLetter] = []
        n = len(messages)
        broker = np.fromiter(map(_BROKER_MS, messages), dtype=np.float64, count=n) / 1000.0
        kinds = np.fromiter(map(_KIND, messages), dtype=np.int64, count=n)
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
        if countOf(map(_VALUE, messages), TICK):  # heartbeats: clock only
            keep = np.fromiter((m[1] != TICK for m in messages), dtype=bool, count=n)
            messages = [m for m in messages if m[1] != TICK]
            broker, trusted, kinds, before_all = broker[keep], trusted[keep], kinds[keep], \
                before_all[keep]
            self.ticks += n - len(messages)
            n = len(messages)
        fast = self._decode_batch(messages)
        refs: range | list[int]
        times: np.ndarray | list[float]
        if fast is not None:
            keys, times = fast
            refs = range(n)
        else:
            keys, times, refs = self._decode_each(partition, messages, dead)
        accepted_keys: list[str] = []
        accepted_steps: list[int] = []
        single_step: int | None = None
        if len(times):
            origin, step_len, lateness = rules.origin_seconds, rules.step_seconds, \
                rules.lateness_seconds
            seconds = np.asarray(times, dtype=np.float64)
            if fast is not None:  # every record decoded: no need to pick them out
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
                _, raw, offset, topic, _, kind = messages[refs[i]]
                if not own_trusted[i]:
                    reason = _untrusted(kind)
                    if kind in (TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME) and \
                            own_broker[i] > MAX_SECONDS:
                        reason = "the record's timestamp is after the year 9999"
                elif not finite[i]:
                    reason = _bad_time(rules.time_field)
                elif before_origin[i]:
                    reason = "event time before flow.origin"
                else:
                    reason = ("late: the record's step is already closed in this partition (the "
                              "broker's timestamps went backwards, or the step was closed at "
                              "the end of a bounded input)")
                dead.append(DeadLetter(reason, raw or b"", topic, partition, offset))
            if ok.all():
                accepted_keys, kept = keys, steps
            else:
                keep = np.flatnonzero(ok)
                accepted_keys, kept = [keys[i] for i in keep.tolist()], steps[keep]
            if kept.size and kept.min() == kept.max():
                single_step = int(kept[0])  # the usual case: the whole batch lies in one step
            else:
                accepted_steps = kept.astype(np.int64).tolist()
        self.events += len(accepted_keys)
        self.dead_letters += len(dead)
        per_shard: list[dict[int, dict[str, int]]] = [{} for _ in range(rules.shards)]
        shard_cache = self._shard_cache
        if single_step is not None:
            counts = {(key, single_step): c for key, c in Counter(accepted_keys).items()}
        else:
            counts = Counter(zip(accepted_keys, accepted_steps, strict=True))
        for (key, step), c in counts.items():
            shard = shard_cache.get(key)
            if shard is None:
                if len(shard_cache) > 100_000:
                    shard_cache.clear()
                shard = shard_cache[key] = shard_of(key, rules.shards)
            per_shard[shard].setdefault(step, {})[key] = c
        frontier = self.frontier()
        dead.sort(key=lambda letter: letter.offset if letter.offset is not None else -1)
        return [ShardUpdate(s, partition, frontier, per_shard[s])
                for s in range(rules.shards)], dead
