"""Parse raw events and assign them to time steps, one input partition at a time.

Each input partition keeps its own event-time watermark (the largest
timestamp it has delivered). A step is closed *from a partition's point of
view* once that watermark, less the allowed lateness, has passed the step's
end; an event whose step is already closed from its own partition's point of
view is late and goes to the dead-letter topic. Steps are released only when
every partition has closed them (see :mod:`dpstream.stream.shard`). Because
lateness depends only on the order of records *within* one partition, which
Kafka fixes, a replay after a crash accepts and rejects exactly the same
events, so every release coordinate gets exactly one value.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from operator import attrgetter, itemgetter
from typing import Annotated, Any

import msgspec
import numpy as np
import orjson

from dpstream.io.records import DeadLetter

__all__ = ["EventRules", "PartitionClock", "RawMessage", "ShardUpdate", "shard_of"]

RawMessage = tuple[int, bytes | None, int | None, str | None]  # partition, value, offset, topic

MAX_KEY_LENGTH = 256
MAX_SECONDS = 253_402_300_799.0  # 9999-12-31T23:59:59Z: keeps every step index inside int64
_VALUE = itemgetter(1)
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
        last_step: the step of this partition's watermark (None: no event yet).
        increments: ``{step: {key: events}}`` for keys of this shard.
    """

    shard: int
    partition: int
    frontier: int | None
    last_step: int | None
    increments: dict[int, dict[str, int]] = field(default_factory=dict)


class PartitionClock:
    """The watermark of one input partition, and the parser that uses it."""

    def __init__(self, rules: EventRules, state: dict[str, Any] | None = None) -> None:
        self.rules = rules
        self.partition: int | None = None if state is None else state["partition"]
        self.watermark: float | None = None if state is None else state["watermark"]
        self.events = 0
        self.dead_letters = 0
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
        return {"partition": self.partition, "watermark": self.watermark}

    def _step_of(self, seconds: float) -> int:
        return math.floor((seconds - self.rules.origin_seconds) / self.rules.step_seconds)

    def frontier(self) -> int | None:
        """The first step not yet closed from this partition's point of view."""
        if self.watermark is None:
            return None
        return self._step_of(self.watermark - self.rules.lateness_seconds)

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
        for i, (_, raw, offset, topic) in enumerate(messages):
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
        """Parse a batch of raw ``(partition, value, offset, topic)`` messages of ``partition``.

        Decoding is per record (a typed msgspec decoder; a record that fails it
        is explained by a slower parser for its dead letter); placing events in
        steps and detecting late ones is vectorised over the batch. An event is
        late if its step is before the partition's frontier *as it stood just
        before the event* (the running maximum of the earlier accepted events),
        exactly as if the records were processed one by one.

        Returns:
            One update per shard (it carries the watermark even without increments) and
            the dead letters.
        """
        self.partition = partition
        rules = self.rules
        dead: list[DeadLetter] = []
        fast = self._decode_batch(messages)
        refs: range | list[int]
        times: np.ndarray | list[float]
        if fast is not None:
            keys, times = fast
            refs = range(len(messages))
        else:
            keys, times, refs = self._decode_each(partition, messages, dead)
        accepted_keys: list[str] = []
        accepted_steps: list[int] = []
        single_step: int | None = None
        if len(times):
            origin, step_len = rules.origin_seconds, rules.step_seconds
            seconds = np.asarray(times, dtype=np.float64)
            out_of_range = seconds > MAX_SECONDS
            steps = np.floor((np.minimum(seconds, MAX_SECONDS) - origin) / step_len)
            before_origin = steps < 0
            usable = np.where(before_origin | out_of_range, -np.inf, seconds)
            start = -np.inf if self.watermark is None else self.watermark
            running = np.maximum.accumulate(np.concatenate(([start], usable)))
            frontier_before = np.floor((running[:-1] - rules.lateness_seconds - origin) / step_len)
            late = ~before_origin & ~out_of_range & (steps < frontier_before)
            ok = ~(before_origin | out_of_range | late)
            if running[-1] > start:
                self.watermark = float(running[-1])
            for i in np.flatnonzero(~ok).tolist():
                _, raw, offset, topic = messages[refs[i]]
                if out_of_range[i]:
                    reason = f"field {rules.time_field!r} is after the year 9999"
                elif before_origin[i]:
                    reason = "event time before flow.origin"
                else:
                    reason = ("late: its step is already closed for this partition "
                              "(raise flow.lateness to accept later events)")
                dead.append(DeadLetter(reason, raw or b"", topic, partition, offset))
            if ok.all():
                accepted_keys, kept = keys, steps
            else:
                index = np.flatnonzero(ok)
                accepted_keys, kept = [keys[i] for i in index.tolist()], steps[index]
            if kept.size and kept.min() == kept.max():
                single_step = int(kept[0])  # the usual case: the whole batch lies in one step
            else:
                accepted_steps = kept.astype(np.int64).tolist()
        self.events += len(accepted_keys)
        self.dead_letters += len(dead)
        per_shard: list[dict[int, dict[str, int]]] = [{} for _ in range(rules.shards)]
        shard_cache = self._shard_cache
        if single_step is not None:
            counts = {(key, single_step): n for key, n in Counter(accepted_keys).items()}
        else:
            counts = Counter(zip(accepted_keys, accepted_steps, strict=True))
        for (key, step), n in counts.items():
            shard = shard_cache.get(key)
            if shard is None:
                if len(shard_cache) > 100_000:
                    shard_cache.clear()
                shard = shard_cache[key] = shard_of(key, rules.shards)
            per_shard[shard].setdefault(step, {})[key] = n
        frontier = self.frontier()
        last_step = None if self.watermark is None else self._step_of(self.watermark)
        dead.sort(key=lambda letter: letter.offset if letter.offset is not None else -1)
        return [ShardUpdate(s, partition, frontier, last_step, per_shard[s])
                for s in range(rules.shards)], dead
