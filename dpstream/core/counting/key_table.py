"""Columnar key state: every key of a shard in numpy columns, stepped in bulk.

:class:`KeyTable` is the columnar equivalent of the per-key reference engine (one
``KeyStatistics`` per key, kept with the tests as their oracle): the same threshold monitor,
initial count, binary tree counter and ledger rules
(:mod:`dpstream.core.counting.statistics_spec`), for pure accounting with a
:class:`~dpstream.core.counting.tree_counter.TreeCounterSpec` counter and for zCDP accounting
with a :class:`~dpstream.core.counting.blt_counter.BltCounterSpec` counter
(:meth:`KeyTable.supports`), in the declared and the open key universe. With the
same noise key it publishes exactly what the per-key engine publishes, bit for bit: every
draw comes from the same lane and coordinates (:mod:`dpstream.core.noise.bulk`), and every
floating-point operation is done in the per-key classes' order.

**Layout.** A :class:`~dpstream.core.counting.key_index.KeyIndex` (an int32 open-addressing table,
not a dict) maps a key to its row and holds the keys by row;
everything else is numpy columns (struct of arrays): per row, the key's true count since it
started (``prefix``, which is also its monitor's count) and a byte of flags (which charges it
paid, admitted, exhausted, watched by a live monitor); per *watched* row only, the monitor's
lane and threshold noise; per admitted row, its counter's columns in its group (below). Rows
keep their order: the new keys of a step are sorted and appended, and expiry or retirement
compacts the columns keeping the order of the rest. At a million keys this is about 80 bytes
a key (declared, three steps) to 100 (open universe, admitted) beyond the key string and
the index's 16-24 bytes, where a ``KeyStatistics`` object took about 2.5 kB.

**Binary tree counters in groups** (binary tree mechanism, Dwork, Naor, Pitassi, Rothblum
2010 and Chan, Shi, Song 2011, with the doubling epochs of Chan, Shi, Song 2011; see
:mod:`dpstream.core.counting.tree_counter`). The counters of the keys whose counter started at
the same step form a :class:`~dpstream.core.counting.tree_columns.TreeGroup`: they are at the
same counter step, so they share the epoch, the position in it, the node noise scale and the
shape of the stack of maximal completed nodes; a step draws the noise of every node completed
in it with one bulk call per (group, height), with the per-key counter's IEEE operations, so
the values are equal bit for bit (see that module).

**BLT counters in groups** (buffered linear Toeplitz mechanism, Dvijotham, McMahan,
Pillutla, Steinke and Thakurta 2024; see :mod:`dpstream.core.counting.blt_counter` for the integer
grid and the privacy argument). The keys whose BLT counter started at the same step form a
:class:`~dpstream.core.counting.blt_columns.BltGroup`: shared epoch and step in it, the exact
integer
buffers as multi-limb columns (:mod:`dpstream.core.counting.wide_int`), the float buffers of the
inverse, the partial sums and the epoch base as float64 columns, the step's discrete Gaussian
noise one bulk draw per group. Under zCDP the monitor's epsilon is charged as
``epsilon^2 / 2`` and the initial count is a discrete Gaussian (``sigma^2 = 1 / (2 rho)``)
or, for an epsilon charge, a discrete Laplace, as in the per-key engine.

**Threshold monitors** (AboveThreshold, Dwork & Roth 2014, Algorithm 1; see
:mod:`dpstream.core.counting.threshold_monitor`), as the columns of
:class:`~dpstream.core.counting.monitor_columns.MonitorColumns`. Every watched key is tested at
the same index ``t`` of its monitor (the global step in the declared universe, the step's index
in the monitor window in the open one), so the query noise of all of them is one bulk draw per
step; the threshold noise is drawn once per (key, window), when the monitor starts.

**User level** (:attr:`StatisticsSpec.user_level`; see
:mod:`dpstream.core.counting.statistics_spec` for the privacy argument). A ``people`` column
holds, per row, the key's count of distinct people since it started (each person counted once
per period, in the step of their first kept event for the key: the stage's ``first`` flags);
the threshold monitors test it instead of ``prefix``. The initial count still releases
``prefix`` (events), with its noise scaled by ``max_per_key``; the counters' own scaling is
their spec's ``sensitivity``. At the event level there is no such column and nothing changes.

**Ledger.** Every key that paid the same charges has the same spend, so a real ledger per
*stage* (the set of charges paid, :mod:`dpstream.core.counting.stage_ledgers`) checks
and commits each charge for all the keys that reach it in a step (check-then-commit; a
refusal exhausts the keys, with a :class:`BudgetExhausted` status for admitted keys only,
never naming a key before its admission), and gives every release's ``spent``, ``budget``
and ``delta``. A restore under another budget re-checks every stage, as the per-key engine
re-checks every key.

**State.** :meth:`KeyTable.to_state` is plain data (numpy arrays, lists of strings, ints
and floats). It holds true counts and partial sums: the recovery store that keeps it must be
treated as secret. It never holds a lane or a noise value: both are recomputed from the keys
and the noise key on restore.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from dpstream.core.accounting.ledger import exact
from dpstream.core.counting.blt_columns import BltGroup
from dpstream.core.counting.blt_counter import BltCounterSpec
from dpstream.core.counting.key_index import KeyIndex
from dpstream.core.counting.monitor_columns import MonitorColumns
from dpstream.core.counting.outputs import (
    AlertColumns,
    BudgetExhausted,
    StepOutputs,
)
from dpstream.core.counting.stage_ledgers import (
    COUNTER_PAID,
    INITIAL_PAID,
    MONITOR_PAID,
    PAID,
    StageLedgers,
)
from dpstream.core.counting.statistics_spec import StatisticsSpec
from dpstream.core.counting.threshold_monitor import ThresholdMonitorSpec
from dpstream.core.counting.tree_columns import TreeGroup
from dpstream.core.counting.tree_counter import TreeCounterSpec
from dpstream.core.noise import bulk as bulk_noise
from dpstream.core.noise import bulk_gaussian
from dpstream.core.noise.coordinates import (
    TAG_INITIAL,
)
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import discrete_gaussian_variance, discrete_laplace_variance
from dpstream.errors import InvalidParameterError

__all__ = ["KeyTable"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
FlagArray = npt.NDArray[np.uint8]
WordArray = npt.NDArray[np.uint64]
RowArray = npt.NDArray[np.int32]

_ROW: Final = np.int32  # a group's rows (a shard holds fewer than 2^31 keys): 4 bytes a key
_STATE_KIND: Final = "key-table"
_STATE_VERSION: Final = 1

# the flags byte of a row (and the charges paid: MONITOR_PAID, INITIAL_PAID, COUNTER_PAID)
_EXHAUSTED: Final = 8
_ADMITTED: Final = 16
_WATCHING: Final = 32  # a live monitor tests the key (paid, not fired, not exhausted)
_RETIRING: Final = _EXHAUSTED | _ADMITTED


def _clear(bits: int) -> np.uint8:
    return np.uint8(0xFF ^ bits)


class KeyTable:
    """The keyed statistics of one shard, as columns (see the module docstring).

    Args:
        spec: what to compute per key (pure with a tree counter, zCDP with a BLT counter:
            :meth:`supports`).
        noise: the secret noise key (never stored in the state, nor anything derived from it).
        declared: the shard's declared keys (declared universe), started at the first close
            (kept, not copied: the caller must not change them).
        state: a :meth:`to_state` snapshot to resume from, possibly under another budget.

    Raises:
        InvalidParameterError: the spec is not supported, or ``state`` is malformed or was
            made with other mechanism parameters.
    """

    def __init__(self, spec: StatisticsSpec, noise: NoiseKey,
                 declared: Sequence[str] | None = None,
                 state: dict[str, Any] | None = None) -> None:
        if not self.supports(spec):
            raise InvalidParameterError(
                "the columnar key table supports pure accounting with a tree counter and "
                "zCDP accounting with a BLT counter only")
        self.spec, self._noise = spec, noise
        self._counter: TreeCounterSpec | BltCounterSpec = spec.counter
        self._monitor: ThresholdMonitorSpec | None = spec.monitor
        self._open = spec.mode == "open"
        self._window = spec.window if self._open else 0
        self._declared = declared  # not copied (a million keys): the caller's, unchanged
        self._index = KeyIndex()  # key -> row, and the keys by row (``self._index.names``)
        # declared position -> row (-1: retired), while valid (None after a change)
        self._by_position: npt.NDArray[np.int32] | None = None
        self._prefix: IntArray = np.zeros(0, dtype=np.int64)
        # user level only: each row's distinct people since it started (the monitors' count)
        self._people: IntArray | None = np.zeros(0, dtype=np.int64) if spec.user_level else None
        self._flags: FlagArray = np.zeros(0, dtype=np.uint8)
        # the watched keys only (rows with _WATCHING, ascending): their monitors
        self._monitors = None if spec.monitor is None else MonitorColumns(spec.monitor)
        self._groups: list[TreeGroup | BltGroup] = []
        self._pending: list[BudgetExhausted] = []
        self._retire_due = False
        self._stages = StageLedgers(spec)
        self.retired: set[str] = set()  # admitted keys that never publish again: name only
        self.next_step: int | None = None
        if state is not None:
            self._restore(state)

    @staticmethod
    def supports(spec: StatisticsSpec) -> bool:
        """Whether the table computes ``spec``.

        Pure accounting with a tree counter (epsilon charges), or zCDP accounting with a BLT
        counter (an initial count charged in rho or in epsilon).
        """
        initial = spec.initial
        if spec.accounting == "pure" and isinstance(spec.counter, TreeCounterSpec):
            return initial is None or (initial.rho == 0 and initial.epsilon > 0)
        if spec.accounting == "zcdp" and isinstance(spec.counter, BltCounterSpec):
            return initial is None or initial.epsilon > 0 or initial.rho > 0
        return False

    @property
    def keys(self) -> KeyIndex:
        """The live keys, a read-only set (``key in table.keys``, ``len``, iteration)."""
        return self._index

    @property
    def live(self) -> int:
        """The number of live keys (retired and forgotten keys are not)."""
        return len(self._index)

    def idle(self) -> bool:
        """No live key in an open universe: steps without events publish nothing."""
        return not len(self._index) and self._declared is None

    # -- lanes (secret-derived: memory only) --
    def _lanes(self, names: Sequence[str], mechanism: str, digest: str,
               number: int) -> WordArray:
        """The lanes ``(instance, key, mechanism, digest, number)`` of ``names``."""
        return self._noise.lane_words(  # type: ignore[no-any-return]
            (self.spec.instance,), names, (mechanism, digest, number))

    def _monitor_lanes(self, names: Sequence[str], window: int) -> WordArray:
        """The monitor lanes of ``names`` in ``window``."""
        return self._lanes(names, "monitor", self.spec.monitor_digest, window)

    # -- closing a step --
    def close(self, step: int, keys: Sequence[str], increments: npt.ArrayLike,
              people: npt.ArrayLike | None = None) -> StepOutputs:
        """Step every live key at global ``step``, exactly as the per-key engine does.

        Declared keys start at the first close; keys with events that are neither live nor
        retired start now. ``keys[i]`` had ``increments[i]`` events (keys are distinct) and,
        at the user level, ``people[i]`` people counted for the first time (None: none).
        Steps are closed in order: while keys are live, ``step`` is the step after the
        last one closed.

        Raises:
            InvalidParameterError: an increment is not an integer >= 0, the lengths differ,
                or ``step`` is not the next step of the live keys.
        """
        counts = _checked_increments(increments, len(keys))
        firsts = None if people is None else _checked_increments(people, len(keys))
        out = self._open_step(step)
        rows = self._rows(keys)
        declared = self._declared
        first_declared = declared is not None and not len(self._index) and not self.retired
        if first_declared and not set(keys).difference(declared):  # type: ignore[arg-type]
            self._create(declared, step, out)  # type: ignore[arg-type]  # sorted already
            rows = self._rows(keys)
        else:
            fresh: set[str] = set()
            if declared is not None and len(self._index) + len(self.retired) < len(declared):
                unknown = np.flatnonzero(self._index.rows(declared) < 0).tolist()
                fresh.update(k for k in map(declared.__getitem__, unknown)
                             if k not in self.retired)
            missing = np.flatnonzero(rows < 0)
            if missing.size:
                new = keys if missing.size == len(keys) else list(
                    map(keys.__getitem__, missing.tolist()))
                fresh.update(new)
                if self.retired:  # a retired key never starts again (CPython's set
                    fresh = fresh - self.retired  # difference walks the smaller side)
            if fresh:
                self._create(sorted(fresh), step, out)
                if missing.size:
                    rows[missing] = self._index.rows([keys[i] for i in missing.tolist()])
        inc = np.zeros(len(self._index), dtype=np.int64)
        fresh_people = None if firsts is None else np.zeros(len(self._index), dtype=np.int64)
        if rows.size:
            found = rows >= 0
            if found.all():
                inc[rows] = counts
                if fresh_people is not None and firsts is not None:
                    fresh_people[rows] = firsts
            else:
                inc[rows[found]] = counts[found]
                if fresh_people is not None and firsts is not None:
                    fresh_people[rows[found]] = firsts[found]
        return self._advance(step, inc, out, fresh_people)

    def close_declared(self, step: int, positions: npt.ArrayLike,
                       increments: npt.ArrayLike,
                       people: npt.ArrayLike | None = None) -> StepOutputs:
        """:meth:`close` in the declared universe, each key given by its declared position.

        ``positions[i]`` indexes the table's ``declared`` list (repeats are summed: the
        events of several input partitions); ``increments[i]`` events. The outputs are those
        of :meth:`close` with the keys' names. No key string is looked up: the declared keys
        start at the first close in their order, so a position is a row until a key
        retires (then the positions are mapped to rows once, by name, until the next change).

        Raises:
            InvalidParameterError: as :meth:`close`; a position outside the declared list;
                or the table is of the open universe.
        """
        declared = self._declared
        if declared is None:
            raise InvalidParameterError("close_declared needs the declared universe")
        counts = _checked_increments(increments, np.size(positions))
        firsts = None if people is None else _checked_increments(people, np.size(positions))
        where = np.asarray(positions, dtype=np.int64).reshape(-1)
        if where.size and (where.min() < 0 or where.max() >= len(declared)):
            raise InvalidParameterError("a declared position is outside the declared keys")
        if self._by_position is None and (len(self._index) or self.retired):
            # resumed, or keys retired: by name this once
            distinct, slot = np.unique(where, return_inverse=True)
            sums = np.zeros(distinct.size, dtype=np.int64)
            np.add.at(sums, slot, counts)
            people_sums = None
            if firsts is not None:
                people_sums = np.zeros(distinct.size, dtype=np.int64)
                np.add.at(people_sums, slot, firsts)
            out = self.close(step, [declared[i] for i in distinct.tolist()], sums, people_sums)
            self._by_position = self._index.rows(declared).astype(np.int32)
            return out
        out = self._open_step(step)
        if self._by_position is None:  # the first close: every declared key starts, in order
            self._create(declared, step, out)
            self._by_position = np.arange(len(declared), dtype=np.int32)
        rows = self._by_position[where]
        retired = rows < 0  # a retired key's events are not counted (as in close)
        if retired.any():
            rows, counts = rows[~retired], counts[~retired]
            firsts = None if firsts is None else firsts[~retired]
        inc = np.zeros(len(self._index), dtype=np.int64)
        np.add.at(inc, rows, counts)
        fresh_people = None
        if firsts is not None:
            fresh_people = np.zeros(len(self._index), dtype=np.int64)
            np.add.at(fresh_people, rows, firsts)
        return self._advance(step, inc, out, fresh_people)

    def _open_step(self, step: int) -> StepOutputs:
        """Check that ``step`` is the next one; the outputs, with the statuses still due."""
        if len(self._index) and self.next_step is not None and step != self.next_step:
            raise InvalidParameterError(
                f"step {step} closed while the live keys are at step {self.next_step}")
        out = StepOutputs(step)
        out.statuses.extend(self._pending)
        self._pending = []
        return out

    def _advance(self, step: int, inc: IntArray, out: StepOutputs,
                 people: IntArray | None = None) -> StepOutputs:
        """Step every live key by ``inc`` (one increment per row): the close's second half.

        ``people``: the rows' new distinct people (user level; None: none this step).
        """
        self._prefix += inc
        if self._people is not None and people is not None:
            self._people += people
        fired = self._watch(step, out)
        for group in self._groups:  # open: groups admitted now start at the next step
            self._step_group(group, step, inc, out)
        if fired is not None:
            self._admit(fired, step, out)
        self._compact(step)
        self.next_step = step + 1
        return out

    def _rows(self, keys: Sequence[str]) -> IntArray:
        """The rows of ``keys``, -1 for a key that is not live."""
        return self._index.rows(keys)

    def _create(self, names: Sequence[str], step: int, out: StepOutputs) -> None:
        """Start ``names`` (sorted, new) at ``step``: KeyStatistics' constructor, in bulk."""
        m, first = len(names), len(self._index)
        self._index.append(names)
        self._by_position = None
        monitor, code, exhausted, watching = self._monitor, 0, False, False
        if monitor is not None:
            reason = self._stages.refusal(code, MONITOR_PAID, monitor.charge)
            if reason is None:
                code |= MONITOR_PAID
                watching = self._open or monitor.horizon is None or step < monitor.horizon
            else:
                exhausted = True
                if not self._open:  # declared keys are public; never name an open one
                    out.statuses.extend(self._stages.statuses(names, step, monitor.charge.label,
                                                       reason, code))
        if not self._open and not exhausted:
            charge = self._counter.charge
            reason = self._stages.refusal(code, COUNTER_PAID, charge)
            if reason is None:
                code |= COUNTER_PAID
                rows = np.arange(first, first + m, dtype=_ROW)
                lanes = self._lanes(names, "counter", self.spec.counter_digest, step)
                # ``names`` is never mutated (the caller's declared list or a fresh one): shared
                self._groups.append(self._new_group(step, code, rows, names, lanes, None, 0.0))
            else:
                exhausted = True
                out.statuses.extend(self._stages.statuses(names, step, charge.label, reason, code))
        flags = code | (0 if self._open else _ADMITTED)
        if exhausted:
            flags |= _EXHAUSTED
            self._retire_due |= not self._open
        elif watching:
            flags |= _WATCHING
        self._prefix = np.concatenate([self._prefix, np.zeros(m, dtype=np.int64)])
        if self._people is not None:
            self._people = np.concatenate([self._people, np.zeros(m, dtype=np.int64)])
        self._flags = np.concatenate([self._flags, np.full(m, flags, dtype=np.uint8)])
        if flags & _WATCHING:  # appended rows: the watched rows stay ascending
            assert self._monitors is not None
            window = step // self._window if self._open else 0
            self._monitors.start(self._noise, np.arange(first, first + m, dtype=np.int64),
                                 self._monitor_lanes(names, window))

    def _watch(self, step: int, out: StepOutputs) -> IntArray | None:
        """Test every watched key (AboveThreshold line 3); return the open universe's admitted."""
        monitor, monitors = self._monitor, self._monitors
        if monitor is None or monitors is None:
            return None
        flags, watched = self._flags, monitors.rows
        if not watched.size:
            return None
        if self._open:
            t = step % self._window  # the step's index in its monitor window
        else:
            t = step  # declared monitors start at index = their (first) step
            if monitor.horizon is not None and t >= monitor.horizon:
                flags &= _clear(_WATCHING)  # expired: never tested again
                monitors.keep(np.zeros(watched.size, dtype=bool))
                return None
        counted = self._prefix if self._people is None else self._people  # user level: people
        count = counted if watched.size == flags.size else counted[watched]
        hit = monitors.above(self._noise, count, t)
        if not hit.any():
            return None
        fired = watched[hit]
        monitors.keep(~hit)
        flags[fired] &= _clear(_WATCHING)  # halted
        out.alerts = AlertColumns(step, self._index.names[fired].tolist(), monitor.threshold,
                                  monitor.epsilon)
        return fired if self._open else None

    def _admit(self, rows: IntArray, step: int, out: StepOutputs) -> None:
        """Admit the open universe's fired keys: initial count, then a counter from next step."""
        names = self._index.names[rows].tolist()
        flags = self._flags
        code = int(flags[rows[0]]) & PAID  # every watched key paid its monitor, nothing else
        exhausted = False
        initial_values: FloatArray | None = None
        initial_var = 0.0
        initial = self.spec.initial
        if initial is not None:
            reason = self._stages.refusal(code, INITIAL_PAID, initial)
            if reason is None:
                code |= INITIAL_PAID
                lanes = self._lanes(names, "initial", self.spec.initial_digest, step)
                # events, sensitivity Linf (1 at the event level: the same scale, bit for bit)
                linf = self.spec.max_per_key
                if initial.epsilon:  # KeyStatistics._initial_count: Laplace for an epsilon
                    scale = linf / exact(initial.epsilon)
                    noise = bulk_noise.laplace(self._noise, lanes, scale, TAG_INITIAL, 0, 0, 0)
                    initial_var = discrete_laplace_variance(scale)
                else:  # a rho charge: N_Z(0, Linf^2 / (2 rho)), CKS 2020
                    sigma2 = Fraction(linf * linf) / (2 * exact(initial.rho))
                    noise = bulk_gaussian.gaussian(self._noise, lanes, sigma2, TAG_INITIAL, 0, 0,
                                                   0)
                    initial_var = discrete_gaussian_variance(sigma2)
                initial_values = (self._prefix[rows] + noise).astype(np.float64)
            else:
                exhausted = True
                out.statuses.extend(self._stages.statuses(names, step, initial.label, reason, code))
        if not exhausted:
            charge = self._counter.charge
            reason = self._stages.refusal(code, COUNTER_PAID, charge)
            if reason is None:
                code |= COUNTER_PAID
                lanes = self._lanes(names, "counter", self.spec.counter_digest, step)
                self._groups.append(self._new_group(step, code, rows.astype(_ROW), names,
                                                    lanes, initial_values, initial_var))
            else:
                exhausted = True
                out.statuses.extend(self._stages.statuses(names, step, charge.label, reason, code))
        flags[rows] = (flags[rows] & _clear(PAID)) | np.uint8(
            code | _ADMITTED | (_EXHAUSTED if exhausted else 0))
        if exhausted:
            self._retire_due = True
            return
        values = np.zeros(len(names)) if initial_values is None else initial_values.copy()
        out.releases.append(self._stages.columns(step, list(names), values, initial_var, code,
                                                 False))

    def _new_group(self, start: int, code: int, rows: RowArray, names: Sequence[str],
                   lanes: WordArray, initial: FloatArray | None,
                   initial_var: float) -> TreeGroup | BltGroup:
        """The group of counters of ``names``, started at ``start`` (tree or BLT)."""
        if isinstance(self._counter, BltCounterSpec):
            return BltGroup(self._counter, start, code, rows, names, lanes, initial,
                            initial_var)
        return TreeGroup(start, code, rows, names, lanes, initial, initial_var)

    def _step_group(self, group: TreeGroup | BltGroup, step: int, inc: IntArray,
                    out: StepOutputs) -> None:
        """One step of every counter of ``group``: TreeCounter.step, column by column."""
        if not group.keys:
            return
        if isinstance(group, BltGroup):  # BltCounter.step (blt_columns), one bulk noise draw
            values, variance = group.step(self._noise, inc)
            out.releases.append(self._stages.columns(step, group.keys, values, variance,
                                                     group.code, True))
            return
        assert isinstance(self._counter, TreeCounterSpec)
        value, variance = group.step(self._counter, self._noise, inc[group.rows])
        std = math.sqrt(variance)
        if group.initial is not None:  # KeyStatistics: initial_value + estimate.value
            value = group.initial + value
        out.releases.append(self._stages.columns(step, group.keys, value,
                                                 group.initial_var + std**2, group.code, True))

    def _compact(self, step: int) -> None:
        """Forget the open keys whose window ended unadmitted; retire the exhausted admitted."""
        flags = self._flags
        remove: npt.NDArray[np.bool_] | None = None
        if self._open and (step + 1) % self._window == 0:
            remove = (flags & _ADMITTED) == 0
        if self._retire_due:
            self._retire_due = False
            retire = (flags & _RETIRING) == _RETIRING
            self.retired.update(self._index.names[retire].tolist())
            remove = retire if remove is None else remove | retire
        if remove is None or not remove.any():
            return
        keep = ~remove
        self._index.rebuild(self._index.names[keep])
        self._by_position = None
        self._prefix, self._flags = self._prefix[keep], flags[keep]
        if self._people is not None:
            self._people = self._people[keep]
        position = np.cumsum(keep, dtype=np.int64) - 1
        monitors = self._monitors
        if monitors is not None and monitors.rows.size:
            kept = keep[monitors.rows]
            if not kept.all():
                monitors.keep(kept)
            monitors.rows = position[monitors.rows]
        for group in self._groups:  # their keys are admitted and not exhausted: all kept
            group.rows = position[group.rows].astype(_ROW)

    # -- state --
    def to_state(self) -> dict[str, Any]:
        """Plain-data snapshot (holds true counts: the recovery store is secret); no lanes."""
        people = {} if self._people is None else {"people": self._people.copy()}
        return {**people,
            "kind": _STATE_KIND, "version": _STATE_VERSION,
            "mechanisms": self.spec.mechanisms_digest,
            "next_step": self.next_step,
            "keys": list(self._index),
            "prefix": self._prefix.copy(),
            "flags": self._flags.copy(),
            "groups": [group.to_state() for group in self._groups],
            "pending": [[s.key, s.step, s.label, s.reason, s.spent, s.budget, s.unit]
                        for s in self._pending],
            "retired": sorted(self.retired),
        }

    def _restore(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`to_state`, under today's budget (as the per-key engine does)."""
        if state.get("kind") != _STATE_KIND or state.get("version") != _STATE_VERSION:
            raise InvalidParameterError(
                f"not a key table state of version {_STATE_VERSION}: kind "
                f"{state.get('kind')!r}, version {state.get('version')!r}")
        if state.get("mechanisms") != self.spec.mechanisms_digest:
            raise InvalidParameterError(
                "this key table's state was made with other mechanism parameters; a flow "
                "instance's mechanisms cannot change (start a new flow instance)")
        try:
            self.next_step = None if state["next_step"] is None else int(state["next_step"])
            names = [str(k) for k in state["keys"]]
            if len(set(names)) != len(names):
                raise InvalidParameterError("malformed key table state: a key appears twice")
            self._index = KeyIndex(names)
            self._prefix = np.array(state["prefix"], dtype=np.int64).reshape(len(names))
            if self._people is not None:
                self._people = np.array(state["people"], dtype=np.int64).reshape(len(names))
            self._flags = np.array(state["flags"], dtype=np.uint8).reshape(len(names))
            self._pending = [BudgetExhausted(str(k), int(s), str(label), str(reason),
                                             float(spent), float(budget), str(unit))
                             for k, s, label, reason, spent, budget, unit in state["pending"]]
            self.retired = {str(k) for k in state["retired"]}
            self._groups = [self._restore_group(g) for g in state["groups"]]
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            if isinstance(exc, InvalidParameterError):
                raise
            raise InvalidParameterError(f"malformed key table state: {exc!r}") from None
        self._retire_due = bool(((self._flags & _RETIRING) == _RETIRING).any())
        monitor = self._monitor
        if monitor is None:
            self._flags &= _clear(_WATCHING)
        elif (not self._open and monitor.horizon is not None and self.next_step is not None
              and self.next_step >= monitor.horizon):
            self._flags &= _clear(_WATCHING)  # expired
        watched = np.flatnonzero(self._flags & _WATCHING)
        if watched.size:
            if self.next_step is None:
                raise InvalidParameterError("malformed key table state: no step closed")
            window = (self.next_step - 1) // self._window if self._open else 0
            assert self._monitors is not None  # a key is watched only with a monitor
            self._monitors.restart(self._noise, watched.astype(np.int64), self._monitor_lanes(
                [names[i] for i in watched.tolist()], window))
        self._rebudget()

    def _restore_group(self, state: dict[str, Any]) -> TreeGroup | BltGroup:
        rows = np.array(state["rows"], dtype=_ROW).reshape(-1)
        keys = self._index.names[rows].tolist()
        start = int(state["start"])
        lanes = self._lanes(keys, "counter", self.spec.counter_digest, start)
        initial = state["initial"]
        if isinstance(self._counter, BltCounterSpec) != (state.get("kind") == "blt"):
            raise InvalidParameterError("malformed key table state: a group of another counter")
        if isinstance(self._counter, BltCounterSpec):
            return BltGroup(self._counter, start, int(state["code"]), rows, keys, lanes,
                            None if initial is None else np.array(initial, dtype=np.float64),
                            float(state["initial_var"]), state["counter"])
        group = TreeGroup(start, int(state["code"]), rows, keys, lanes,
                          None if initial is None else np.array(initial, dtype=np.float64),
                          float(state["initial_var"]))
        group.restore(state)
        return group

    def _rebudget(self) -> None:
        """Re-check every stage under today's budget (KeyStatistics._restore, per stage).

        The keys of a stage whose spend is now above the budget are exhausted; the admitted
        ones get a :class:`BudgetExhausted` status at the next step and are then retired.
        """
        flags = self._flags
        live = (flags & _EXHAUSTED) == 0
        stages = flags & PAID
        exhausted: list[IntArray] = []
        for code in np.unique(stages[live]).tolist():
            ledger = self._stages.ledger(code)
            if not (ledger.remaining < 0 or ledger.spent_delta > self.spec.delta_budget):
                continue
            rows = np.flatnonzero(live & (stages == code))
            exhausted.append(rows)
            flags[rows] = (flags[rows] & _clear(_WATCHING)) | np.uint8(_EXHAUSTED)
            admitted = self._index.names[rows[(flags[rows] & _ADMITTED) != 0]].tolist()
            reason = (f"the configured budget {ledger.budget:g} {ledger.unit} is below what "
                      f"this key has already spent ({ledger.spent:g})")
            assert self.next_step is not None
            self._pending.extend(self._stages.statuses(admitted, self.next_step,
                                                       "budget change", reason, code))
            self._retire_due |= bool(admitted)
        if exhausted:
            gone = np.concatenate(exhausted)
            if self._monitors is not None:
                self._monitors.keep(~np.isin(self._monitors.rows, gone))
            for group in self._groups:
                mask = ~np.isin(group.rows, gone)
                if not mask.all():
                    group.keep(mask)
            self._groups = [group for group in self._groups if group.keys]


def _checked_increments(increments: npt.ArrayLike, size: int) -> IntArray:
    counts = np.asarray(increments)
    if counts.shape != (size,):
        raise InvalidParameterError(
            f"increments must be a vector of one count per key ({size}), got shape "
            f"{counts.shape}")
    if size and counts.dtype.kind not in "iu":
        raise InvalidParameterError(
            f"increments must be integers >= 0, got dtype {counts.dtype}")
    if size and counts.min() < 0:  # the error never shows the value (it is data)
        raise InvalidParameterError("increments must be integers >= 0, got a negative one")
    return counts.astype(np.int64, copy=False)
