"""Thin Bytewax operators around :class:`PartitionClock` and :class:`ShardState`.

Each operator is ``op(step_id, up, ...) -> Stream``; the logic lives in the
bytewax-free classes, and the ``StatefulBatchLogic`` adapters only pass batches
in, outputs out and snapshots to the recovery store. Bytewax builders receive
only the resume state, not the key, so partition and shard ids travel with the
items and are kept in the snapshots.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import bytewax.operators as op
from bytewax.dataflow import Stream, operator
from bytewax.operators import StatefulBatchLogic

from dpstream.core.key_statistics import Output, StatisticsSpec
from dpstream.core.noise import NoiseKey
from dpstream.io.records import DeadLetter
from dpstream.stream.events import EventRules, PartitionClock, RawMessage, ShardUpdate, shard_of
from dpstream.stream.shard import ShardState

__all__ = ["StepAssignment", "assign_steps", "keyed_statistics"]

Observer = Callable[[str, int], None]


def _ignore(_name: str, _amount: int) -> None:
    return None


class _PartitionLogic(StatefulBatchLogic[list[RawMessage], Any, dict[str, Any]]):
    def __init__(self, clock: PartitionClock, observe: Observer) -> None:
        self.clock, self.observe = clock, observe

    def on_batch(self, values: list[list[RawMessage]]) -> tuple[list[Any], bool]:
        out: list[Any] = []
        for batch in values:
            before = self.clock.events
            updates, dead = self.clock.process(batch[0][0], batch)
            out.extend((str(update.shard), update) for update in updates)
            out.extend(dead)
            self.observe("events", self.clock.events - before)
            for letter in dead:
                self.observe("dead_letter:" + letter.reason.split(":")[0], 1)
        return out, StatefulBatchLogic.RETAIN

    def on_eof(self) -> tuple[list[Any], bool]:
        if self.clock.watermark is None:  # no trusted record yet: nothing to close
            return [], StatefulBatchLogic.RETAIN
        return ([(str(u.shard), u) for u in self.clock.end_of_input()],
                StatefulBatchLogic.RETAIN)

    def snapshot(self) -> dict[str, Any]:
        return self.clock.to_state()


@dataclass(frozen=True)
class StepAssignment:
    """The two outputs of :func:`assign_steps`."""

    updates: Stream[tuple[str, ShardUpdate]]
    dead_letters: Stream[DeadLetter]


def _group_by_partition(batch: list[RawMessage]) -> list[tuple[str, list[RawMessage]]]:
    partitions = set(map(itemgetter(0), batch))
    if len(partitions) == 1:  # the usual case: a Kafka source batch comes from one partition
        return [(str(partitions.pop()), batch)]
    groups: dict[int, list[RawMessage]] = defaultdict(list)
    for message in batch:
        groups[message[0]].append(message)
    return [(str(p), msgs) for p, msgs in groups.items()]


@operator
def assign_steps(step_id: str, up: Stream[RawMessage], rules: EventRules,
                 observe: Observer = _ignore) -> StepAssignment:
    """Parse raw messages per input partition and route step increments to shards."""
    grouped = op.flat_map_batch("group_by_partition", up, _group_by_partition)
    parsed = op.stateful_batch(
        "parse", grouped, lambda state: _PartitionLogic(PartitionClock(rules, state), observe))
    flat = op.key_rm("unkey", parsed)
    branches = op.branch("split", flat, lambda item: isinstance(item, DeadLetter))
    return StepAssignment(branches.falses, branches.trues)  # type: ignore[arg-type]


class _ShardLogic(StatefulBatchLogic[ShardUpdate, Output, dict[str, Any]]):
    def __init__(self, shard: ShardState, observe: Callable[[list[Output]], None]) -> None:
        self.shard, self.observe = shard, observe

    def on_batch(self, values: list[ShardUpdate]) -> tuple[list[Output], bool]:
        out: list[Output] = []
        for update in values:
            out.extend(self.shard.update(update))
        self.observe(out)
        return out, StatefulBatchLogic.RETAIN

    def on_eof(self) -> tuple[list[Output], bool]:
        out = self.shard.end_of_input()
        self.observe(out)
        return out, StatefulBatchLogic.RETAIN

    def snapshot(self) -> dict[str, Any]:
        return self.shard.to_state()


def _ignore_outputs(_outputs: list[Output]) -> None:
    return None


@operator
def keyed_statistics(step_id: str, up: Stream[tuple[str, ShardUpdate]], spec: StatisticsSpec,
                     partitions: int, shards: int, declared_keys: tuple[str, ...] | None,
                     noise: NoiseKey,
                     observe: Callable[[list[Output]], None] = _ignore_outputs,
                     shard_class: type[ShardState] = ShardState) -> Stream[Output]:
    """Run every key's monitor and counter, shard by shard; emit releases, alerts, statuses.

    ``shard_class`` exists for the non-private baseline of ``bench/``; keep the default.
    """
    declared_by_shard: dict[int, list[str]] | None = None
    if declared_keys is not None:
        declared_by_shard = defaultdict(list)
        for key in declared_keys:
            declared_by_shard[shard_of(key, shards)].append(key)
        declared_by_shard = dict(declared_by_shard)

    def build(state: dict[str, Any] | None) -> _ShardLogic:
        return _ShardLogic(shard_class(spec, partitions, declared_by_shard, noise, state), observe)

    keyed = op.stateful_batch("shards", up, build)
    return op.key_rm("unkey", keyed)
