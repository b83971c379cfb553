"""The counters flow's events: a key and an event time per JSON record.

:class:`PartitionClock` is the counters' :class:`~dpstream.stream.clock.StepClock`: it decodes
``{"key": ..., "ts": ...}`` records (a typed msgspec decoder over the whole batch, and a
slower parser that explains each record that fails it) and counts events per key and step,
grouped by the key's shard. Placing records in steps, trusting timestamps and detecting late
records is the shared clock's job (:mod:`dpstream.stream.clock`).
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from operator import attrgetter, itemgetter
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import orjson

from dpstream.core.key_index import KeyIndex
from dpstream.messages import (
    TICK,
    TIMESTAMP_CREATE_TIME,
    TIMESTAMP_LOG_APPEND_TIME,
    TIMESTAMP_NONE,
    DeadLetter,
    RawMessage,
)
from dpstream.stream.clock import MAX_SECONDS, ShardUpdate, StepClock, bad_time

__all__ = [
    "EventRules",
    "MAX_SECONDS",
    "PartitionClock",
    "RawMessage",
    "ShardUpdate",
    "TIMESTAMP_CREATE_TIME",
    "TIMESTAMP_LOG_APPEND_TIME",
    "TIMESTAMP_NONE",
    "TICK",
    "shard_of",
]

MAX_KEY_LENGTH = 256
_VALUE = itemgetter(1)
_KEY = attrgetter("key")
_TS = attrgetter("ts")
_bad_time = bad_time


def _bad_key(field: str) -> str:
    return f"field {field!r} missing or not a non-empty string"


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


def shard_of(key: str, shards: int) -> int:
    """Return the shard of ``key`` (stable across processes, unlike ``hash``)."""
    return zlib.crc32(key.encode()) % shards


def shards_of(keys: list[str], shards: int) -> np.ndarray:
    """:func:`shard_of` of every key, as an int64 array (C-speed maps, no Python loop)."""
    crcs = np.fromiter(map(zlib.crc32, map(str.encode, keys)), dtype=np.int64, count=len(keys))
    return crcs % shards  # type: ignore[no-any-return]


@dataclass(frozen=True)
class EventRules:
    """How to read an event and place it in a step."""

    key_field: str
    time_field: str
    origin: datetime
    step_seconds: float
    lateness_seconds: float
    shards: int
    declared_keys: KeyIndex | None = None
    clock: Literal["broker", "producer"] = "broker"

    @property
    def origin_seconds(self) -> float:
        """The origin as Unix seconds."""
        return self.origin.timestamp()


class PartitionClock(StepClock):
    """The counters' step clock: decodes key/time events and counts them per key and step."""

    def __init__(self, rules: EventRules, state: dict[str, Any] | None = None) -> None:
        super().__init__(rules, state)
        self.rules: EventRules = rules
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

    def decode(self, partition: int, messages: list[RawMessage], dead: list[DeadLetter]
               ) -> tuple[list[Any], np.ndarray | list[float], range | list[int]]:
        """Decode the whole batch in one C call, else record by record (explaining failures)."""
        fast = self._decode_batch(messages)
        if fast is not None:
            keys, times = fast
            return keys, times, range(len(messages))
        return self._decode_each(partition, messages, dead)

    def route(self, payloads: list[Any], steps: int | list[int]) -> list[dict[int, Any]]:
        """Count events per key and step, grouped by the key's shard.

        Vectorised over the batch: one ``Counter`` per step, the shards of the distinct keys
        as one array (:func:`shards_of`), and one ``dict(zip(...))`` per shard. No cache: a
        cache of every key's shard would cost more memory per key than the key's state.
        """
        shards = self.rules.shards
        per_shard: list[dict[int, Any]] = [{} for _ in range(shards)]
        if not payloads:
            return per_shard
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
        if declared is not None and not declared.contains_all(keys):
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
                ts = iso_seconds(ts)
                if ts is None:
                    reason = bad_time(rules.time_field)
            if not key:
                reason = _bad_key(rules.key_field)
            elif len(key) > MAX_KEY_LENGTH:
                reason = f"field {rules.key_field!r} longer than {MAX_KEY_LENGTH} characters"
            if reason is not None:
                dead.append(DeadLetter(reason, raw or b"", topic, partition, offset))
                continue
            keys.append(key)
            times.append(ts)  # type: ignore[arg-type]
            refs.append(i)
        if declared is not None and keys:  # one vectorized lookup for the whole batch
            known = declared.rows(keys) >= 0
            if not known.all():
                for j in np.flatnonzero(~known).tolist():
                    _, raw, offset, topic, _, _ = messages[refs[j]]
                    dead.append(DeadLetter("key is not in admission.keys", raw or b"", topic,
                                           partition, offset))
                keep = known.tolist()
                keys = list(itertools.compress(keys, keep))
                times = list(itertools.compress(times, keep))
                refs = list(itertools.compress(refs, keep))
        return keys, times, refs
