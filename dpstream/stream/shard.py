"""One shard of the counters' keyed statistics: steps every key when a step closes.

Keys are spread over a fixed number of shards (``flow.shards``); Bytewax
partitions the shards over workers and snapshots each shard's state for
recovery. The shard is a :class:`~dpstream.stream.barrier.StepBarrier`: it closes step ``s``
once all input partitions have moved past it, with the step's increments summed over every
partition (so what is counted is a function of the input alone, see the barrier). Closing a
step steps *every* key of the shard, with zero increments for keys that had no events, so
steps without events still release for admitted keys. In the open universe a key not
admitted by the end of its monitor window is forgotten; an admitted key whose budget is
exhausted is retired: only its name is kept, so that a later event cannot start it again
with a fresh ledger. With no live key (open universe), steps without events are skipped.

The snapshot records the flow instance and the noise key's fingerprint; resuming
it under another instance or key is refused (pitfall 13).
"""

from __future__ import annotations

from typing import Any

from dpstream.core.key_statistics import KeyStatistics, Output, StatisticsSpec
from dpstream.core.noise import NoiseKey
from dpstream.stream.barrier import StepBarrier, binding, check_binding

__all__ = ["ShardState"]


class ShardState(StepBarrier):
    """The statistics of the keys of one shard, and the step clock that drives them.

    Args:
        spec: what to compute per key.
        partitions: how many input partitions must close a step before it is released.
        declared_by_shard: the declared keys of every shard (declared universe), else None;
            the shard takes its own when its first update tells it which shard it is.
        noise: the secret noise key.
        state: a :meth:`to_state` snapshot to resume from.
    """

    def __init__(self, spec: StatisticsSpec, partitions: int,
                 declared_by_shard: dict[int, list[str]] | None, noise: NoiseKey,
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

    def merge(self, step: int, bucket: dict[str, int]) -> None:
        """Add one partition's per-key increments for ``step``."""
        pending = self.pending.get(step)
        if pending is None:
            self.pending[step] = dict(bucket)  # a C-speed copy; never mutate the input
            return
        for key, n in bucket.items():
            pending[key] = pending.get(key, 0) + n

    def idle(self) -> bool:
        """No live key in an open universe: steps without events publish nothing."""
        return not self.keys and self.declared_keys is None

    def _new_key(self, key: str, step: int) -> KeyStatistics:
        """The statistics of a key first seen at ``step`` (benchmarks override this)."""
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
