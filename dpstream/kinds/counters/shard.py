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

Two engines keep the keys, with the same outputs for the same noise key:

* :class:`~dpstream.core.counting.key_table.KeyTable` (columnar: numpy arrays, vectorized noise),
  for every specification it supports (:meth:`KeyTable.supports`: pure accounting with the
  tree counter, zCDP with the BLT counter);
* :class:`ReferenceShardState`, one :class:`~dpstream.core.counting.key_statistics.KeyStatistics`
  per key: the readable reference the table is tested against, and the engine of any other
  specification and of the snapshots it made (zCDP flows before the columnar BLT).

:meth:`ShardState.close` returns a closed step's outputs as one
:class:`~dpstream.core.counting.key_table.StepOutputs` (releases in columns, not one object per
release); the Bytewax operator passes those on whole (:meth:`ShardState.update_batches`), and
:meth:`~dpstream.stream.barrier.StepBarrier.update` gives them as a flat list of outputs.
``release_every = k`` publishes the counters' periodic releases only at steps ``s`` with
``(s + 1) % k == 0`` (post-processing: the keys still step, and pay, at every step).

The snapshot records the flow instance and the noise key's fingerprint; resuming
it under another instance or key is refused (pitfall 13). It also records its engine: a
snapshot of the reference engine (every snapshot before the table existed) resumes with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from dpstream.core.counting.key_statistics import (
    Alert,
    BudgetExhausted,
    KeyStatistics,
    Output,
    Release,
    StatisticsSpec,
)
from dpstream.core.counting.key_table import KeyTable, ReleaseColumns, StepOutputs
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError
from dpstream.kinds.counters.layout import DeclaredLayout, RowCounts
from dpstream.stream.barrier import StepBarrier, binding, check_binding
from dpstream.stream.clock import ShardUpdate

__all__ = ["ReferenceShardState", "ShardState", "step_outputs"]

_NO_INCREMENTS = np.zeros(0, dtype=np.int64)


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


def _merge(pending: dict[int, dict[str, int]], step: int, bucket: dict[str, int]) -> None:
    """Add one partition's per-key increments for ``step`` to the pending buckets.

    Partitions usually hold disjoint keys (a keyed topic): then the merge is one C-speed
    ``update``; keys in both are summed one by one.
    """
    merged = pending.get(step)
    if merged is None:
        pending[step] = dict(bucket)  # a C-speed copy; never mutate the input
    elif merged.keys().isdisjoint(bucket.keys()):
        merged.update(bucket)
    else:
        for key, n in bucket.items():
            merged[key] = merged.get(key, 0) + n


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


class ShardState(StepBarrier):
    """The statistics of the keys of one shard, and the step clock that drives them.

    Args:
        spec: what to compute per key.
        partitions: how many input partitions must close a step before it is released.
        declared_by_shard: the declared keys of every shard (declared universe), else None;
            the shard takes its own when its first update tells it which shard it is.
        noise: the secret noise key.
        state: a :meth:`to_state` snapshot to resume from.
        release_every: publish the periodic counter releases of every ``k``-th step only
            (``release.every``); initial counts, alerts and statuses are always published.

    Attributes:
        table_class: the columnar engine (``bench/``'s non-private baseline swaps it).
    """

    table_class: ClassVar[Any] = KeyTable

    def __init__(self, spec: StatisticsSpec, partitions: int,
                 declared_by_shard: Mapping[int, Sequence[str]] | None, noise: NoiseKey,
                 state: dict[str, Any] | None = None, *, release_every: int = 1) -> None:
        super().__init__(partitions, 0 if declared_by_shard is not None else None)
        if not (isinstance(release_every, int) and release_every >= 1):
            raise InvalidParameterError(f"release_every must be an integer >= 1, got "
                                        f"{release_every!r}")
        self.spec, self.noise, self.release_every = spec, noise, release_every
        self._declared_by_shard = declared_by_shard
        self.table: Any = None  # a table_class instance, built once the shard is known
        self._declared_keys: Sequence[str] = ()  # this shard's, sorted (declared universe)
        self.reference: ReferenceShardState | None = None
        self._table_state: dict[str, Any] | None = None
        self._batches: list[StepOutputs] | None = None
        engine = "table" if self.table_class.supports(spec) else "reference"
        if state is not None:
            check_binding(state, spec.instance, spec.mechanisms_digest, noise)
            engine = state.get("engine", "reference")  # older snapshots: the reference's
            self._table_state = state.get("table")
        if engine == "reference":
            self.reference = ReferenceShardState(spec, partitions, declared_by_shard, noise,
                                                 state)
        elif not self.table_class.supports(spec):
            raise InvalidParameterError(
                "this snapshot was made by the columnar key table, which does not support "
                "these mechanisms")
        if state is not None:
            self.restore_barrier(state)
            self.pending = {s: dict(k) for s, k in state["pending"].items()}
        elif declared_by_shard is None:
            self.bind(None)  # the open universe's table needs no shard

    @property
    def engine(self) -> str:
        """``"table"`` (columnar) or ``"reference"`` (one object per key)."""
        return "reference" if self.reference is not None else "table"

    def to_state(self) -> dict[str, Any]:
        """Plain-data snapshot (holds true counts: the recovery store is secret)."""
        own = {**binding(self.spec.instance, self.spec.mechanisms_digest, self.noise),
               **self.barrier_state(), "engine": self.engine,
               "pending": {s: self._named(k) for s, k in self.pending.items()}}
        if self.reference is not None:
            return {**self.reference.to_state(), **own}  # the barrier is this shard's
        own["table"] = self._table_state if self.table is None else self.table.to_state()
        return own

    def merge(self, step: int, bucket: dict[str, int] | RowCounts) -> None:
        """Add one partition's per-key increments for ``step``.

        Buckets by row (:class:`RowCounts`, the declared universe) are kept as a list until
        the step closes; a bucket by name (or a pending one restored from a snapshot) makes
        the step's pending bucket a dict by name.
        """
        pending = self.pending.get(step)
        if isinstance(bucket, RowCounts):
            if pending is None or isinstance(pending, list):
                self.pending.setdefault(step, []).append(bucket)
                return
            bucket = bucket.named(self._declared_keys)
        elif isinstance(pending, list):
            self.pending[step] = self._named(pending)
        _merge(self.pending, step, bucket)

    def _named(self, pending: dict[str, int] | list[RowCounts]) -> dict[str, int]:
        """A pending bucket by key name (buckets by row summed)."""
        if not isinstance(pending, list):
            return dict(pending)
        named: dict[int, dict[str, int]] = {}
        for bucket in pending:
            _merge(named, 0, bucket.named(self._declared_keys))
        return named.get(0, {})

    def idle(self) -> bool:
        """No live key in an open universe: steps without events publish nothing."""
        if self.reference is not None:
            return self.reference.idle()
        if self.table is None:
            return self._declared_by_shard is None
        return bool(self.table.idle())

    def bind(self, shard: int | None) -> None:
        """Learn the shard, and with it the declared keys it owns; build the engine."""
        self.shard = shard
        if self._declared_by_shard is not None and shard is not None:
            if isinstance(self._declared_by_shard, DeclaredLayout):  # sorted already, shared
                self._declared_keys = self._declared_by_shard.keys_of(shard)
            else:
                self._declared_keys = sorted(self._declared_by_shard.get(shard, ()))
        if self.reference is not None:
            self.reference.bind(shard)
        elif self.table is None and (shard is not None or self._declared_by_shard is None):
            declared = None if self._declared_by_shard is None else self._declared_keys
            self.table = self.table_class(self.spec, self.noise, declared, self._table_state)
            self._table_state = None

    # -- what a shard holds (tests, diagnostics) --
    @property
    def keys(self) -> Any:
        """The live keys (a container: ``key in shard.keys``)."""
        if self.reference is not None:
            return self.reference.keys
        if self.table is None:
            return {}
        return self.table.keys

    @property
    def retired(self) -> set[str]:
        """The retired keys (admitted, budget exhausted: name only)."""
        if self.reference is not None:
            return self.reference.retired
        return set() if self.table is None else set(self.table.retired)

    # -- closing steps --
    def update_batches(self, update: ShardUpdate) -> list[StepOutputs]:
        """:meth:`update`, with every closed step's outputs as one :class:`StepOutputs`."""
        self._batches = batches = list[StepOutputs]()
        try:
            self.update(update)
        finally:
            self._batches = None
        return batches

    def close_backlog_batches(self) -> list[StepOutputs]:
        """:meth:`close_backlog`, with every closed step's outputs as one StepOutputs."""
        self._batches = batches = list[StepOutputs]()
        try:
            self.close_backlog()
        finally:
            self._batches = None
        return batches

    def end_of_input_batches(self) -> list[StepOutputs]:
        """:meth:`end_of_input`, with every closed step's outputs as one StepOutputs."""
        self._batches = batches = list[StepOutputs]()
        try:
            self.end_of_input()
        finally:
            self._batches = None
        return batches

    def close(self, step: int,  # type: ignore[override]  # the barrier only iterates it
              bucket: dict[str, int] | None) -> Sequence[Output]:
        """Step every key of the shard (declared, live, or new in this step).

        Returns the step's :class:`StepOutputs` (the barrier's :meth:`update` lists them
        one by one), or nothing while :meth:`update_batches` keeps the steps whole.
        """
        outputs = self.close_step(step, bucket)
        if self._batches is not None:  # the operator's path: keep the step whole
            if any(outputs.count()):
                self._batches.append(outputs)
            return ()
        return outputs

    def close_step(self, step: int, bucket: dict[str, int] | list[RowCounts] | None
                   ) -> StepOutputs:
        """What closing ``step`` publishes (after ``release_every``)."""
        if self.reference is not None:
            named = self._named(bucket) if isinstance(bucket, list) else bucket
            outputs = step_outputs(step, self.reference.close(step, named),
                                   self.spec.mode == "open")
        else:
            assert self.table is not None, "a declared shard closes once it knows its shard"
            if isinstance(bucket, list):  # by row: no key is looked up
                outputs = self.table.close_declared(
                    step, np.concatenate([b.rows for b in bucket]),
                    np.concatenate([b.counts for b in bucket]))
            elif bucket:
                keys = list(bucket)
                increments = np.fromiter(bucket.values(), dtype=np.int64, count=len(keys))
                outputs = self.table.close(step, keys, increments)
            else:
                outputs = self.table.close(step, [], _NO_INCREMENTS)
        every = self.release_every
        if every > 1 and (step + 1) % every and any(c.periodic for c in outputs.releases):
            outputs = dataclasses.replace(
                outputs, releases=[c for c in outputs.releases if not c.periodic])
        return outputs
