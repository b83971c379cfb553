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

The keys are kept by the columnar :class:`~dpstream.core.counting.key_table.KeyTable`
(numpy arrays, vectorized noise), which supports every specification a configuration can
give (:meth:`KeyTable.supports`: pure accounting with the tree counter, zCDP with the BLT
counter). The per-key reference engine it is tested against, bit for bit, lives with the
tests.

:meth:`ShardState.close` returns a closed step's outputs as one
:class:`~dpstream.core.counting.outputs.StepOutputs` (releases in columns, not one object per
release); the Bytewax operator passes those on whole (:meth:`ShardState.update_batches`), and
:meth:`~dpstream.stream.barrier.StepBarrier.update` gives them as a flat list of outputs.
``release_every = k`` publishes the counters' periodic releases only at steps ``s`` with
``(s + 1) % k == 0`` (post-processing: the keys still step, and pay, at every step).

The snapshot records the flow instance and the noise key's fingerprint; resuming
it under another instance or key is refused (pitfall 13). It also records its engine
(``"table"``): a snapshot of the per-key reference engine (written before the columnar table
ran every specification) is refused with :data:`REFERENCE_SNAPSHOT_REFUSED`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final

import numpy as np

from dpstream.core.counting.key_table import KeyTable
from dpstream.core.counting.outputs import (
    StepOutputs,
)
from dpstream.core.counting.statistics_spec import StatisticsSpec
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError
from dpstream.kinds.counters.layout import DeclaredLayout, PeopleCounts, RowCounts
from dpstream.stream.barrier import StepBarrier, binding, check_binding
from dpstream.stream.clock import ShardUpdate

__all__ = ["REFERENCE_SNAPSHOT_REFUSED", "ShardState"]

REFERENCE_SNAPSHOT_REFUSED: Final = (
    "this shard snapshot was made by the per-key reference engine, which this version no "
    "longer runs: resume it with dpstream 0.1.0 (the last version with that engine) until its "
    "flow instance ends, or start a new flow instance")
"""Why a snapshot without ``"engine": "table"`` is refused (one line)."""

_NO_INCREMENTS = np.zeros(0, dtype=np.int64)


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
        self._table_state: dict[str, Any] | None = None
        if not self.table_class.supports(spec):
            raise InvalidParameterError(
                "the columnar key table does not support these mechanisms")
        if state is not None:
            check_binding(state, spec.instance, spec.mechanisms_digest, noise)
            if state.get("engine") != "table":  # older snapshots: the reference engine's
                raise InvalidParameterError(REFERENCE_SNAPSHOT_REFUSED)
            self._table_state = state.get("table")
            self.restore_barrier(state)
            self.pending = {s: PeopleCounts.from_state(k) if spec.user_level else dict(k)
                            for s, k in state["pending"].items()}
        elif declared_by_shard is None:
            self.bind(None)  # the open universe's table needs no shard

    def to_state(self) -> dict[str, Any]:
        """Plain-data snapshot (holds true counts: the recovery store is secret)."""
        own = {**binding(self.spec.instance, self.spec.mechanisms_digest, self.noise),
               **self.barrier_state(), "engine": "table",
               "pending": {s: self._plain(k) for s, k in self.pending.items()}}
        own["table"] = self._table_state if self.table is None else self.table.to_state()
        return own

    def merge(self, step: int, bucket: dict[str, int] | RowCounts | PeopleCounts) -> None:
        """Add one partition's per-key increments for ``step``.

        Buckets by row (:class:`RowCounts`, the declared universe) are kept as a list until
        the step closes; a bucket by name (or a pending one restored from a snapshot) makes
        the step's pending bucket a dict by name (at the user level a :class:`PeopleCounts`:
        events and people by name).
        """
        pending = self.pending.get(step)
        if isinstance(bucket, RowCounts):
            if pending is None or isinstance(pending, list):
                self.pending.setdefault(step, []).append(bucket)
                return
            bucket = (bucket.named_people(self._declared_keys) if self.spec.user_level
                      else bucket.named(self._declared_keys))
        elif isinstance(pending, list):
            self.pending[step] = self._named(pending)
        if self.spec.user_level and not isinstance(bucket, PeopleCounts):
            bucket = PeopleCounts(bucket, {})  # events that name no person count no one
        if isinstance(bucket, PeopleCounts):
            merged = self.pending.get(step)
            if merged is None:
                self.pending[step] = bucket.copy()  # never mutate the input
            else:
                merged.add(bucket)
            return
        _merge(self.pending, step, bucket)

    def _named(self, pending: dict[str, int] | list[RowCounts] | PeopleCounts
               ) -> dict[str, int] | PeopleCounts:
        """A pending bucket by key name (buckets by row summed)."""
        if isinstance(pending, PeopleCounts):
            return pending.copy()
        if not isinstance(pending, list):
            return dict(pending)
        if self.spec.user_level:
            people = PeopleCounts({}, {})
            for bucket in pending:
                people.add(bucket.named_people(self._declared_keys))
            return people
        named: dict[int, dict[str, int]] = {}
        for bucket in pending:
            _merge(named, 0, bucket.named(self._declared_keys))
        return named.get(0, {})

    def _plain(self, pending: dict[str, int] | list[RowCounts] | PeopleCounts
               ) -> dict[str, Any]:
        """A pending bucket as a snapshot holds it (by key name; plain data)."""
        named = self._named(pending)
        return named.to_state() if isinstance(named, PeopleCounts) else named

    def idle(self) -> bool:
        """No live key in an open universe: steps without events publish nothing."""
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
        if self.table is None and (shard is not None or self._declared_by_shard is None):
            declared = None if self._declared_by_shard is None else self._declared_keys
            self.table = self.table_class(self.spec, self.noise, declared, self._table_state)
            self._table_state = None

    # -- what a shard holds (tests, diagnostics) --
    @property
    def keys(self) -> Any:
        """The live keys (a container: ``key in shard.keys``)."""
        if self.table is None:
            return {}
        return self.table.keys

    @property
    def retired(self) -> set[str]:
        """The retired keys (admitted, budget exhausted: name only)."""
        return set() if self.table is None else set(self.table.retired)

    # -- closing steps --
    def update_batches(self, update: ShardUpdate) -> list[StepOutputs]:
        """:meth:`update`, with every closed step's outputs as one :class:`StepOutputs`."""
        return self.update(update, whole=True)

    def close_backlog_batches(self) -> list[StepOutputs]:
        """:meth:`close_backlog`, with every closed step's outputs as one StepOutputs."""
        return self.close_backlog(whole=True)

    def end_of_input_batches(self) -> list[StepOutputs]:
        """:meth:`end_of_input`, with every closed step's outputs as one StepOutputs."""
        return self.end_of_input(whole=True)

    def close(self, step: int, bucket: dict[str, int] | list[RowCounts] | PeopleCounts | None
              ) -> StepOutputs:
        """Step every key of the shard (declared, live, or new in this step).

        Returns what closing ``step`` publishes (after ``release_every``).
        """
        assert self.table is not None, "a declared shard closes once it knows its shard"
        if isinstance(bucket, list) and self.spec.user_level:  # by row, with people
            outputs: StepOutputs = self.table.close_declared(
                step, np.concatenate([b.rows for b in bucket]),
                np.concatenate([b.counts for b in bucket]),
                np.concatenate([np.zeros_like(b.counts) if b.people is None else b.people
                                for b in bucket]))
        elif isinstance(bucket, list):  # by row: no key is looked up
            outputs = self.table.close_declared(
                step, np.concatenate([b.rows for b in bucket]),
                np.concatenate([b.counts for b in bucket]))
        elif isinstance(bucket, PeopleCounts):
            keys = list(bucket.events)
            increments = np.fromiter(bucket.events.values(), dtype=np.int64, count=len(keys))
            people = np.fromiter(map(bucket.people.get, keys, itertools.repeat(0)),
                                 dtype=np.int64, count=len(keys))
            outputs = self.table.close(step, keys, increments, people)
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
