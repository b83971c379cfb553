"""The reference counters engine: one KeyStatistics per key of a shard (the tests' oracle).

:class:`ReferenceShardState` is the readable per-key engine the columnar
:class:`~dpstream.core.counting.key_table.KeyTable` (run by
:class:`~dpstream.kinds.counters.shard.ShardState`) is tested against: with the same noise key
both publish the same outputs, bit for bit. Production runs the table only; a snapshot of
this engine is refused at resume
(:data:`~dpstream.kinds.counters.shard.REFERENCE_SNAPSHOT_REFUSED`).
:func:`step_outputs` groups its flat outputs of a step as the table's
:class:`~dpstream.core.counting.outputs.StepOutputs`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dpstream.core.counting.outputs import (
    Alert,
    BudgetExhausted,
    Output,
    Release,
    ReleaseColumns,
    StepOutputs,
)
from dpstream.core.counting.statistics_spec import StatisticsSpec
from dpstream.core.noise.keys import NoiseKey
from dpstream.kinds.counters.layout import RowCounts
from dpstream.kinds.counters.shard import _merge
from dpstream.stream.barrier import StepBarrier, binding, check_binding
from support.key_statistics import KeyStatistics

__all__ = ["ReferenceShardState", "step_outputs"]


class ReferenceShardState(StepBarrier):
    """The reference engine: one :class:`KeyStatistics` per key of the shard.

    Args:
        spec: what to compute per key.
        partitions: how many input partitions must close a step before it is released.
        declared_by_shard: the declared keys of every shard (declared universe), else None;
            the shard takes its own when its first update tells it which shard it is.
        noise: the secret noise key.
        state: a :meth:`to_state` snapshot to resume from.
    """

    def __init__(self, spec: StatisticsSpec, partitions: int,
                 declared_by_shard: Mapping[int, Sequence[str]] | None, noise: NoiseKey,
                 state: dict[str, Any] | None = None) -> None:
        super().__init__(partitions, 0 if declared_by_shard is not None else None)
        self.spec, self.noise = spec, noise
        self._declared_by_shard = declared_by_shard
        self.declared_keys: list[str] | None = None
        self.keys: dict[str, KeyStatistics] = {}
        self.retired: set[str] = set()  # admitted keys that can never publish again: name only
        if state is not None:
            check_binding(state, spec.instance, spec.mechanisms_digest, noise)
            self.restore_barrier(state)
            self.pending = {s: dict(k) for s, k in state["pending"].items()}
            self.keys = {k: self._restore_key(k, s) for k, s in state["keys"].items()}
            self.retired = set(state["retired"])

    def to_state(self) -> dict[str, Any]:
        """Plain-data snapshot (holds true counts: the recovery store is secret)."""
        return {
            **binding(self.spec.instance, self.spec.mechanisms_digest, self.noise),
            **self.barrier_state(),
            "pending": {s: dict(k) for s, k in self.pending.items()},
            "keys": {k: stats.to_state() for k, stats in self.keys.items()},
            "retired": sorted(self.retired),
        }

    def merge(self, step: int, bucket: dict[str, int] | RowCounts) -> None:
        """Add one partition's per-key increments for ``step`` (by name, or by row)."""
        if isinstance(bucket, RowCounts):
            assert self.declared_keys is not None, "rows name declared keys"
            bucket = bucket.named(self.declared_keys)
        _merge(self.pending, step, bucket)

    def idle(self) -> bool:
        """No live key in an open universe: steps without events publish nothing."""
        return not self.keys and self.declared_keys is None

    def _new_key(self, key: str, step: int) -> KeyStatistics:
        """The statistics of a key first seen at ``step``."""
        return KeyStatistics(self.spec, key, step, self.noise)

    def _restore_key(self, key: str, state: dict[str, Any]) -> KeyStatistics:
        return KeyStatistics(self.spec, key, 0, self.noise, state)

    def bind(self, shard: int | None) -> None:
        """Learn the shard, and with it the declared keys it owns."""
        self.shard = shard
        if self._declared_by_shard is not None and shard is not None:
            self.declared_keys = sorted(self._declared_by_shard.get(shard, []))

    def close(self, step: int, bucket: dict[str, int] | None) -> list[Output]:
        """Step every key of the shard (declared, live, or new in this step)."""
        increments = bucket or {}
        if self.declared_keys is not None and len(self.keys) + len(self.retired) < len(
                self.declared_keys):  # first close: start every declared key, never a retired one
            for key in self.declared_keys:
                if key not in self.keys and key not in self.retired:
                    self.keys[key] = self._new_key(key, step)
        for key in increments:
            if key not in self.keys and key not in self.retired:
                self.keys[key] = self._new_key(key, step)
        out: list[Output] = []
        for key in sorted(self.keys):
            stats = self.keys[key]
            out.extend(stats.step(increments.get(key, 0)))
            if stats.expired:  # not admitted within its monitor window: forgotten
                del self.keys[key]
            elif stats.retired:  # admitted and exhausted: keep the name only, so a later
                del self.keys[key]  # event cannot start it again with a fresh ledger
                self.retired.add(key)
        return out



def step_outputs(step: int, outputs: list[Output], open_universe: bool) -> StepOutputs:
    """Group one closed step's outputs of the reference engine into :class:`StepOutputs`.

    Releases that share every field but key and value form one :class:`ReleaseColumns`, in
    their order of first appearance. In the open universe the release of a key that has an
    alert in the same step is its initial count (the counter releases from the next step).
    """
    statuses = [o for o in outputs if isinstance(o, BudgetExhausted)]
    alerts = [o for o in outputs if isinstance(o, Alert)]
    admitted = {a.key for a in alerts} if open_universe else set()
    groups: dict[tuple[Any, ...], tuple[list[str], list[float]]] = {}
    for o in outputs:
        if isinstance(o, Release):
            shared = (o.std, o.mechanism, o.spent, o.budget, o.unit, o.delta,
                      o.key not in admitted)
            keys, values = groups.setdefault(shared, ([], []))
            keys.append(o.key)
            values.append(o.value)
    columns = [ReleaseColumns(step=step, keys=keys, values=np.array(values, dtype=np.float64),
                              std=std, mechanism=mechanism, spent=spent, budget=budget,
                              unit=unit, delta=delta, periodic=periodic)
               for (std, mechanism, spent, budget, unit, delta, periodic), (keys, values)
               in groups.items()]
    return StepOutputs(step=step, statuses=statuses, alerts=alerts, releases=columns)

