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
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson

from dpstream.io.records import DeadLetter

__all__ = ["EventRules", "PartitionClock", "ShardUpdate", "shard_of"]

MAX_KEY_LENGTH = 256


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

    def _timestamp(self, value: Any) -> float | None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            seconds = float(value)
        elif isinstance(value, str):
            try:
                seconds = datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                return None
        else:
            return None
        return seconds if math.isfinite(seconds) else None

    def process(self, partition: int, messages: list[tuple[bytes | None, int | None, str | None]]
                ) -> tuple[list[ShardUpdate], list[DeadLetter]]:
        """Parse a batch of ``(value, offset, topic)`` of ``partition``.

        Returns:
            One update per shard (it carries the watermark even without increments) and
            the dead letters.
        """
        self.partition = partition
        rules = self.rules
        kf, tf = rules.key_field, rules.time_field
        declared = rules.declared_keys
        origin, step_len = rules.origin_seconds, rules.step_seconds
        per_shard: dict[int, dict[int, dict[str, int]]] = defaultdict(
            lambda: defaultdict(lambda: defaultdict(int)))
        dead: list[DeadLetter] = []
        frontier = self.frontier()
        watermark = self.watermark
        shards = rules.shards
        for raw, offset, topic in messages:
            reason = None
            try:
                event = orjson.loads(raw) if raw is not None else None
            except orjson.JSONDecodeError:
                event, reason = None, "invalid JSON"
            if reason is None:
                if not isinstance(event, dict):
                    reason = "not a JSON object"
                else:
                    key = event.get(kf)
                    seconds = self._timestamp(event.get(tf))
                    if not isinstance(key, str) or not key:
                        reason = f"field {kf!r} missing or not a non-empty string"
                    elif len(key) > MAX_KEY_LENGTH:
                        reason = f"field {kf!r} longer than {MAX_KEY_LENGTH} characters"
                    elif seconds is None:
                        reason = (f"field {tf!r} missing or not a finite Unix time in seconds "
                                  "or an ISO-8601 string")
                    elif declared is not None and key not in declared:
                        reason = "key is not in admission.keys"
                    else:
                        step = math.floor((seconds - origin) / step_len)
                        if step < 0:
                            reason = "event time before flow.origin"
                        elif frontier is not None and step < frontier:
                            reason = ("late: its step is already closed for this partition "
                                      "(raise flow.lateness to accept later events)")
                        else:
                            per_shard[shard_of(key, shards)][step][key] += 1
                            self.events += 1
                            if watermark is None or seconds > watermark:
                                watermark = seconds
                                frontier = math.floor(
                                    (seconds - rules.lateness_seconds - origin) / step_len)
            if reason is not None:
                self.dead_letters += 1
                dead.append(DeadLetter(reason, raw or b"", topic, self.partition, offset))
        self.watermark = watermark
        last_step = None if watermark is None else self._step_of(watermark)
        updates = [
            ShardUpdate(s, partition, frontier, last_step,
                        {step: dict(keys) for step, keys in per_shard.get(s, {}).items()})
            for s in range(shards)
        ]
        return updates, dead
