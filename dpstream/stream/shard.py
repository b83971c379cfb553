"""One shard of the keyed statistics: closes time steps and steps every key.

Keys are spread over a fixed number of shards (``flow.shards``); Bytewax
partitions the shards over workers and snapshots each shard's state for
recovery. A shard learns every input partition's frontier (the first step that
partition has not closed) from the updates it receives, and closes step ``s``
once all ``partitions`` input partitions have moved past it. Closing a step
steps *every* key of the shard, with zero increments for keys that had no
events, so steps without events still release for admitted keys. In the open
universe a key not admitted by the end of its monitor window is forgotten; an
admitted key whose budget is exhausted is retired: only its name is kept, so that
a later event cannot start it again with a fresh ledger. At the end of a bounded
input (EOF) every partition closes its steps through its last record's step and says so
(see :meth:`PartitionClock.end_of_input`); a partition that never had a record is
then no longer waited for.

**What is counted is a function of the input alone.** A step's increments are
summed from every partition's updates and the step is closed only once every
partition's frontier has passed it; a partition sends a step's increments no
later than the update that moves its frontier past that step, and Bytewax keeps
one partition's updates in order. So the sum for a step does not depend on
batching, on how the partitions' updates interleave, on the number of workers or
on restarts. No step is ever skipped while increments for it may still arrive.

The snapshot records the flow instance and the noise key's fingerprint; resuming
it under another instance or key is refused (pitfall 13).
"""

from __future__ import annotations

from typing import Any

from dpstream.core.key_statistics import KeyStatistics, Output, StatisticsSpec
from dpstream.core.noise import NoiseKey
from dpstream.errors import InvalidParameterError, NoiseKeyError, RecoveryMismatchError
from dpstream.stream import stopping
from dpstream.stream.events import ShardUpdate

__all__ = ["ShardState"]


class ShardState:
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
        self.spec, self.partitions, self.noise = spec, partitions, noise
        self._declared_by_shard = declared_by_shard
        self.shard: int | None = None
        self.declared_keys: list[str] | None = None
        self.frontiers: dict[int, int] = {}
        self.ended_empty: set[int] = set()  # partitions that ended without any record
        self.pending: dict[int, dict[str, int]] = {}
        self.keys: dict[str, KeyStatistics] = {}
        self.retired: set[str] = set()  # admitted keys that can never publish again: name only
        self.next_step: int | None = 0 if declared_by_shard is not None else None
        if state is not None:
            if state.get("instance") != spec.instance:
                raise RecoveryMismatchError(
                    "the recovery store belongs to another flow instance; refusing to resume")
            if state.get("mechanisms") != spec.mechanisms_digest:
                raise InvalidParameterError(
                    "the recovery store was made with other mechanism parameters; a flow "
                    "instance's mechanisms cannot change (start a new flow instance)")
            if state.get("noise_fingerprint") != noise.fingerprint():
                raise NoiseKeyError(
                    "the recovery store was made with another noise key (fingerprint "
                    f"{state.get('noise_fingerprint')}, now {noise.fingerprint()}); resuming would "
                    "publish replayed releases with fresh noise")
            self._bind(state["shard"])
            self.frontiers = dict(state["frontiers"])
            self.ended_empty = set(state.get("ended_empty", ()))
            self.pending = {s: dict(k) for s, k in state["pending"].items()}
            self.next_step = state["next_step"]
            self.keys = {k: self._restore_key(k, s) for k, s in state["keys"].items()}
            self.retired = set(state["retired"])

    def to_state(self) -> dict[str, Any]:
        """Plain-data snapshot (holds true counts: the recovery store is secret)."""
        return {
            "instance": self.spec.instance,
            "noise_fingerprint": self.noise.fingerprint(),
            "mechanisms": self.spec.mechanisms_digest,
            "shard": self.shard,
            "frontiers": dict(self.frontiers),
            "ended_empty": sorted(self.ended_empty),
            "pending": {s: dict(k) for s, k in self.pending.items()},
            "next_step": self.next_step,
            "keys": {k: stats.to_state() for k, stats in self.keys.items()},
            "retired": sorted(self.retired),
        }

    def update(self, update: ShardUpdate) -> list[Output]:
        """Take one partition's update and release every step that is now closed."""
        if self.shard is None:
            self._bind(update.shard)
        if update.frontier is not None:
            self.frontiers[update.partition] = max(
                update.frontier, self.frontiers.get(update.partition, update.frontier))
            self.ended_empty.discard(update.partition)
        for step, keys in update.increments.items():
            bucket = self.pending.get(step)
            if bucket is None:
                self.pending[step] = dict(keys)  # a C-speed copy; never mutate the input
                continue
            for key, n in keys.items():
                bucket[key] = bucket.get(key, 0) + n
        if not self.frontiers or len(self.frontiers) + len(self.ended_empty) < self.partitions:
            return []
        return self._close_until(min(self.frontiers.values()))

    def _new_key(self, key: str, step: int) -> KeyStatistics:
        """The statistics of a key first seen at ``step`` (benchmarks override this)."""
        return KeyStatistics(self.spec, key, step, self.noise)

    def _restore_key(self, key: str, state: dict[str, Any]) -> KeyStatistics:
        return KeyStatistics(self.spec, key, 0, self.noise, state)

    def _bind(self, shard: int | None) -> None:
        self.shard = shard
        if self._declared_by_shard is not None and shard is not None:
            self.declared_keys = sorted(self._declared_by_shard.get(shard, []))

    def end_of_input(self) -> list[Output]:
        """The whole bounded input ended: stop waiting for partitions that had no record.

        Every partition that had records has sent its final frontier before this (see
        :meth:`PartitionClock.end_of_input`), so the steps closed now are exactly those every
        partition with data has closed.
        """
        self.ended_empty.update(p for p in range(self.partitions) if p not in self.frontiers)
        if not self.frontiers:
            return []
        return self._close_until(min(self.frontiers.values()))

    def _close_until(self, end: int) -> list[Output]:
        """Close the steps before ``end``.

        With no live key (open universe), steps without increments are skipped, but never
        beyond ``end`` nor beyond the first step that has increments: those still to come
        for a step before ``end`` would otherwise be lost.
        """
        if self.next_step is None:
            if not self.pending:
                return []
            self.next_step = min(min(self.pending), end)
        out: list[Output] = []
        while self.next_step < end:
            if stopping.stop_requested():  # a long run of steps must not delay a stop: the
                break  # state stays consistent (closed through next_step - 1), the rest later
            if not self.keys and self.declared_keys is None:
                self.next_step = min([s for s in self.pending if s >= self.next_step] + [end])
                if self.next_step >= end:
                    break
            out.extend(self._close(self.next_step))
            self.next_step += 1
        return out

    def _close(self, step: int) -> list[Output]:
        increments = self.pending.pop(step, {})
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
