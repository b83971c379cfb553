"""The BLT counters of many keys as columns: one group, stepped together.

**Stated as OpenDP states a measurement**

Not a mechanism of its own: ``n`` keys' copies of the measurement of
:mod:`dpstream.core.counting.blt_counter` (same input domain, metric, function and privacy map
``d_in ↦ rho d_in^2`` per key), each on its own key's events. It charges nothing; the key
table's stage ledgers charge ``BltCounterSpec.charge`` per key.

:class:`BltColumns` is the columnar equivalent of ``n`` independent
:class:`~dpstream.core.counting.blt_counter.BltCounter` objects that started at the same step (the
buffered linear Toeplitz mechanism of Dvijotham, McMahan, Pillutla, Steinke and Thakurta 2024,
"Efficient and Near-Optimal Noise Generation for Streaming Differential Privacy", on the
integer grid of :mod:`dpstream.core.counting.blt_counter`, whose module docstring has the
factorization,
the grid argument and the privacy proof; nothing here changes them). With the same noise key
and lanes it returns exactly what those counters return, bit for bit:

* they share the epoch and the step in it (public: the group's start step and the clock), so
  one bulk call draws the step's discrete Gaussian noise of every key at its lane's
  ``(TAG_BLT, epoch, 0, step_in_epoch)`` (:func:`dpstream.core.noise.bulk_gaussian.gaussian`, the
  same values as the counter's ``gaussian_one``) and the standard deviation is one Python float;
* the integer buffers ``B_j`` are exact multi-limb integers
(:mod:`dpstream.core.counting.wide_int`),
  one ``(L_j, n)`` uint32 limb array per buffer, updated by the counter's exact rule
  ``Y = x G + sum_j round(W_j B_j / 2^P)``, ``B_j <- round(T_j B_j / 2^P) + x G``
  (round half up), and ``Y + Z`` is converted to float64 with Python's ``float(int)``
  rounding (:func:`~dpstream.core.counting.wide_int.signed_to_float`);
* the post-processing (``C^{-1}`` in feedback form, the prefix sum, the epoch's base) runs
  on float64 columns with the counter's IEEE operations in the counter's order.

**Width of the buffers (proved bound, adaptive storage).** The buffers are never negative:
they start at 0, and ``T_j > 0``, ``x >= 0`` and rounding half up of a non-negative value
is non-negative. Rounding adds at most ``1/2``, so within an epoch
``B_j <= sum_k theta_j^k (x_{t-k} G + 1/2) <= G X + s/2`` with ``X`` the epoch's sum of
increments and ``s <= horizon <= 2^24`` its steps, and also
``B_j <= (max_t x_t G + 1/2) / (1 - theta_j)``. The shard's increments are int64, so
``B_j < 2^24 (2^63 2^40 + 1) < 2^128``: four 32-bit limbs always suffice. Storing four
for every buffer would cost 16 bytes each; instead each buffer's limb array holds only the
limbs its largest value needs in the group (``wide_int.trim`` after every step; every result
is computed one limb wider than its exact value can need, so it never wraps, and a carry out
of the top would raise). With small counts the low-theta buffers need 2 limbs (8 bytes a key)
and the high-theta ones 3 (12 bytes).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from dpstream.core.counting import wide_int
from dpstream.core.counting.blt_counter import BltCounterSpec, _variance
from dpstream.core.counting.blt_parameters import GRID_BITS, _parameters
from dpstream.core.noise import bulk_gaussian
from dpstream.core.noise.coordinates import TAG_BLT
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError

__all__ = ["BltColumns", "BltGroup", "CounterGroup"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
WordArray = npt.NDArray[np.uint64]
RowArray = npt.NDArray[np.int32]
Grid = npt.NDArray[np.uint32]

_GRID_FLOAT: Final = float(1 << GRID_BITS)
_STATE_VERSION: Final = 1


def _zero_grid(d: int, n: int) -> list[Grid]:
    return [np.zeros((1, n), dtype=np.uint32) for _ in range(d)]


class BltColumns:
    """The BLT counters of ``n`` keys at the same step (see the module docstring).

    Args:
        spec: the counters' specification.
        n: how many counters.
        state: a :meth:`to_state` snapshot to resume from (then ``n`` is the snapshot's).
    """

    __slots__ = ("spec", "_p", "_sigma2", "epoch", "step_in_epoch", "grid", "inverse",
                 "partial", "base")

    def __init__(self, spec: BltCounterSpec, n: int,
                 state: dict[str, Any] | None = None) -> None:
        self.spec = spec
        self._p = _parameters(spec.horizon)
        self._sigma2 = spec.sigma2_grid
        d = self._p.buffers
        self.epoch = 0
        self.step_in_epoch = 0
        self.grid: list[Grid] = _zero_grid(d, n)  # B_j, one (L_j, n) limb array per buffer
        self.inverse: FloatArray = np.zeros((d, n))  # the C^{-1} buffers
        self.partial: FloatArray = np.zeros(n)
        self.base: FloatArray | None = None  # the finished epochs' estimate (None: 0.0)
        if state is not None:
            self._restore(state)

    def __len__(self) -> int:
        return int(self.partial.shape[0])

    @property
    def steps_done(self) -> int:
        """How many steps the counters have processed."""
        return self.epoch * self.spec.horizon + self.step_in_epoch

    def step(self, noise: NoiseKey, lanes: WordArray,
             increments: IntArray) -> tuple[FloatArray, float]:
        """``BltCounter.step`` of every counter: the estimates (a new array) and their std.

        ``lanes[i]`` is counter ``i``'s lane (``noise.lane(*coordinates)`` as two words) and
        ``increments[i]`` its increment (int64 ``>= 0``, checked by the caller).
        """
        p = self._p
        bits = p.precision_bits
        x = np.asarray(increments, dtype=np.int64)
        # _grid_step: Y = x G + sum_j round(W_j B_j / 2^P); B_j <- round(T_j B_j / 2^P) + x G
        xg = wide_int.trim(wide_int.shift_left(wide_int.from_uint64(x), GRID_BITS))
        terms = [xg]
        for j, b in enumerate(self.grid):
            terms.append(wide_int.mul_round_shift(b, p.omega_num[j], bits))
            updated = wide_int.add(wide_int.mul_round_shift(b, p.theta_num[j], bits), xg)
            self.grid[j] = wide_int.trim(updated).astype(np.uint32)
        y = wide_int.add(*terms)
        z = bulk_gaussian.gaussian(noise, lanes, self._sigma2, TAG_BLT, self.epoch, 0,
                                   self.step_in_epoch)
        w = wide_int.signed_to_float(y, z)
        w /= _GRID_FLOAT  # float(released) / G
        # _inverse_step: u = w - sum_j omega_j b_j; b_j <- theta_j b_j + u (in this order)
        u = w
        inverse = self.inverse
        for j in range(p.buffers):
            u -= p.omega[j] * inverse[j]
        for j in range(p.buffers):
            row = inverse[j]
            row *= p.theta[j]
            row += u
        self.partial += u
        value: FloatArray = (0.0 if self.base is None else self.base) + self.partial
        std = math.sqrt(_variance(self.spec, self.epoch, self.step_in_epoch))
        self.step_in_epoch += 1
        if self.step_in_epoch == self.spec.horizon:  # _next_epoch
            n, d = len(self), p.buffers
            self.base = value.copy()
            self.epoch += 1
            self.step_in_epoch = 0
            self.grid = _zero_grid(d, n)
            self.inverse = np.zeros((d, n))
            self.partial = np.zeros(n)
        return value, std

    def keep(self, mask: npt.NDArray[np.bool_]) -> None:
        """Keep only the counters where ``mask`` is True."""
        self.grid = [wide_int.trim(g[:, mask]).astype(np.uint32, copy=False) for g in self.grid]
        self.inverse = self.inverse[:, mask]
        self.partial = self.partial[mask]
        if self.base is not None:
            self.base = self.base[mask]

    @property
    def nbytes(self) -> int:
        """The bytes of the counters' columns."""
        total = sum(g.nbytes for g in self.grid) + self.inverse.nbytes + self.partial.nbytes
        return total + (0 if self.base is None else self.base.nbytes)

    # -- state --
    def to_state(self) -> dict[str, Any]:
        """Plain data (numpy arrays and ints; holds true-count buffers: keep it secret)."""
        return {
            "version": _STATE_VERSION, "horizon": self.spec.horizon,
            "parameters": self._p.digest, "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "grid": [g.copy() for g in self.grid], "inverse": self.inverse.copy(),
            "partial": self.partial.copy(),
            "base": None if self.base is None else self.base.copy(),
        }

    def _restore(self, state: dict[str, Any]) -> None:
        if (state.get("version") != _STATE_VERSION or state.get("horizon") != self.spec.horizon
                or state.get("parameters") != self._p.digest):
            raise InvalidParameterError(
                "this BLT group's state was made with other counter parameters")
        d = self._p.buffers
        try:
            epoch, s = int(state["epoch"]), int(state["step_in_epoch"])
            partial = np.array(state["partial"], dtype=np.float64).reshape(-1)
            n = partial.shape[0]
            grid = [np.array(g, dtype=np.uint32).reshape(-1, n) for g in state["grid"]]
            inverse = np.array(state["inverse"], dtype=np.float64).reshape(d, n)
            base = state["base"]
            base = None if base is None else np.array(base, dtype=np.float64).reshape(n)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidParameterError(f"malformed BLT group state: {exc!r}") from None
        if epoch < 0 or not 0 <= s < self.spec.horizon or len(grid) != d or any(
                g.shape[0] < 1 for g in grid):
            raise InvalidParameterError(
                f"malformed BLT group state: epoch {epoch}, step {s}, {len(grid)} buffers "
                f"(expected {d})")
        self.epoch, self.step_in_epoch = epoch, s
        self.grid, self.inverse, self.partial, self.base = grid, inverse, partial, base


class CounterGroup:
    """What every counter group of a key table has: the keys whose counter started at ``start``.

    The key table's tree-counter group and :class:`BltGroup` extend it with their counters.
    """

    __slots__ = ("start", "code", "rows", "keys", "lanes", "initial", "initial_var")

    def __init__(self, start: int, code: int, rows: RowArray, keys: Sequence[str],
                 lanes: WordArray, initial: FloatArray | None, initial_var: float) -> None:
        self.start = start  # the counter's start step (part of its lane)
        self.code = code  # the charges its keys paid (their ledger stage)
        self.rows = rows  # the keys' rows in the table
        # their names, shared by every release of the group: a tuple, so never mutated (an
        # encoder may keep what it made of them by the tuple's identity)
        self.keys = keys if isinstance(keys, tuple) else tuple(keys)
        self.lanes = lanes
        self.initial = initial  # the initial counts (open universe), else None (0.0)
        self.initial_var = initial_var

    def keep(self, mask: npt.NDArray[np.bool_]) -> None:
        """Keep only the keys where ``mask`` is True (a new key tuple: the old one is shared).

        A subclass keeps its counters' columns too.
        """
        self.rows = self.rows[mask]
        self.keys = tuple(itertools.compress(self.keys, mask.tolist()))
        self.lanes = self.lanes[mask]
        if self.initial is not None:
            self.initial = self.initial[mask]

    def shared_state(self) -> dict[str, Any]:
        """The state fields every group has (never the lanes: they derive from the key)."""
        return {"start": self.start, "code": self.code, "rows": self.rows.copy(),
                "initial": None if self.initial is None else self.initial.copy(),
                "initial_var": self.initial_var}


class BltGroup(CounterGroup):
    """A key table's group of BLT counters: the keys whose counter started at ``start``.

    The same fields and methods as the key table's tree-counter group (rows, keys, lanes,
    initial counts, ledger stage; :meth:`keep`, :meth:`to_state`), the counters being a
    :class:`BltColumns`.
    """

    __slots__ = ("counter",)

    def __init__(self, spec: BltCounterSpec, start: int, code: int, rows: RowArray,
                 keys: Sequence[str], lanes: WordArray, initial: FloatArray | None,
                 initial_var: float, counter: dict[str, Any] | None = None) -> None:
        super().__init__(start, code, rows, keys, lanes, initial, initial_var)
        self.counter = BltColumns(spec, len(keys), counter)
        if len(self.counter) != len(keys):
            raise InvalidParameterError("malformed BLT group state: the sizes differ")

    def keep(self, mask: npt.NDArray[np.bool_]) -> None:
        """Keep only the keys where ``mask`` is True (a new key list: the old one is shared)."""
        super().keep(mask)
        self.counter.keep(mask)

    def step(self, noise: NoiseKey, inc: IntArray) -> tuple[FloatArray, float]:
        """One step of every counter (``inc`` is the table's increments by row).

        Returns the released values and their variance, as ``KeyStatistics`` forms them:
        ``initial_value + estimate.value`` and ``initial_var + estimate.std**2``.
        """
        value, std = self.counter.step(noise, self.lanes, inc[self.rows])
        if self.initial is not None:
            value = self.initial + value
        return value, self.initial_var + std**2

    def to_state(self) -> dict[str, Any]:
        """Plain data (the key table's group state; never the lanes)."""
        return {"kind": "blt", **self.shared_state(), "counter": self.counter.to_state()}
