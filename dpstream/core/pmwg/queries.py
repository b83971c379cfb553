"""Linear queries over a :class:`~dpstream.core.pmwg.universe.Universe`, compiled for PMWG.

PMWG (Cummings, Krehbiel, Lai, Tantipongpipat 2018, "Differential Privacy for
Growing Databases", Algorithm 1 and appendix B) answers *linear queries*: a
query ``f`` has a weight ``f^i in [0, 1]`` per cell ``i`` of the universe and its
value on a database with normalised histogram ``x_t`` is
``f(x_t) = sum_i f^i x_t^i``, a number in ``[0, 1]``. On a database of ``t``
events (``t x_t^i`` of them in cell ``i``) adding or removing one event changes
``sum_i f^i t x_t^i`` by one weight ``f^i <= 1``, so the query's sensitivity is
``Delta_t = 1/t`` (appendix B, Corollary 25), and the multiplicative-weights
update ``y^i <- y^i exp(eta f^i)`` touches only the cells where ``f^i > 0``.

**Weights live on a grid.** Every weight ``w`` is rounded to
``u = round(w 2^16)`` integer *units* in ``[0, 2^16]`` (:data:`WEIGHT_BITS`,
:data:`WEIGHT_UNIT`), round half to even, before anything else happens: *the
query actually answered is the rounded one*, ``f~^i = u_i / 2^16``. Its weights
are still in ``[0, 1]``, so adding or removing one event changes
``sum_i u_i count_i`` by one ``u_i <= 2^16``, i.e. ``sum_i f~^i count_i`` by at
most 1, and the sensitivity on a database of ``t`` events is still ``<= 1/t``:
rounding never costs privacy. It costs accuracy at most
``|f^i - f~^i| <= 2^-17`` per cell weight, hence
``|f(x) - f~(x)| <= 2^-17 sum_i x^i = 2^-17`` on the normalised answer.
Predicate (count and marginal) queries have exactly ``2^16`` units on their
support, so for them nothing is rounded. Integer units make
:meth:`LinearQuery.weighted_count`, the quantity the mechanism adds noise to,
an exact integer.

**Compiled forms.** A predicate query compiles to a few *boxes*: per
attribute, the selected codes are cut into contiguous runs; if the product of
the run counts is at most :data:`MAX_BOXES` every combination of runs is a box,
read as a basic-slicing *view* of the histogram reshaped to a merged shape
(adjacent unrestricted attributes are merged, and a single selected value is
folded into the next dimension, so a box on the first attribute is one
contiguous slice). No gather and no copy: sums run over strided views and
:meth:`LinearQuery.multiply` scales views in place. With more runs the query
is one outer-product gather (per-attribute index arrays). A weights query
keeps the sorted cell ``indices`` and their ``units`` of its support, or, when
the support exceeds a quarter of the universe, dense ``units`` and weights for

The JSON query language is parsed by :mod:`dpstream.core.pmwg.query_parser` and cached by
:mod:`dpstream.core.pmwg.query_compiler`. No noise and no state here: a compiled query is
public, immutable data.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any, Final, NoReturn, TypeAlias

import numpy as np
import numpy.typing as npt

from dpstream.core.pmwg.attributes import _show
from dpstream.core.pmwg.universe import Universe
from dpstream.errors import InvalidParameterError

__all__ = [
    "MAX_BOXES",
    "WEIGHT_BITS",
    "WEIGHT_UNIT",
    "LinearQuery",
]

WEIGHT_BITS: Final = 16
WEIGHT_UNIT: Final = 1 << WEIGHT_BITS
"""Weights are integer multiples of ``1 / WEIGHT_UNIT``; a weight of 1 is ``WEIGHT_UNIT`` units."""
MAX_BOXES: Final = 8
"""A predicate is answered by slice views when it splits into at most this many boxes."""

_INT64_MAX: Final = 2**63 - 1
_EXACT_DOT_TOTAL: Final = _INT64_MAX // WEIGHT_UNIT
_MAX_LOG_FACTOR: Final = 700.0

FloatArray: TypeAlias = npt.NDArray[np.float64]
IntArray: TypeAlias = npt.NDArray[np.int64]
_Index: TypeAlias = tuple[Any, ...]
_Selection: TypeAlias = list[tuple[int, ...] | None]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def _as_float(value: object) -> float:
    """Return a number as a float (``inf`` for ints beyond the float range)."""
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:
        return math.inf


# -- exact integer products ---------------------------------------------------------------------


def _exact_dot(counts: IntArray, units: IntArray) -> int:
    """Return ``sum(counts * units)`` exactly, as a Python int.

    The int64 dot is exact when the counts are non-negative and their sum is
    at most ``(2^63 - 1) / 2^16`` (every partial sum is then below ``2^63``);
    the sum itself cannot overflow when ``max * n < 2^63``. Otherwise the
    products are summed in Python integers.
    """
    n = int(counts.shape[0])
    if n == 0:
        return 0
    if int(counts.min()) >= 0 and int(counts.max()) <= _INT64_MAX // n:
        if int(counts.sum()) <= _EXACT_DOT_TOTAL:
            return int(np.dot(counts, units))
    return sum(map(operator.mul, counts.tolist(), units.tolist()))


# -- argument checks (cheap: O(1) per call) ----------------------------------------------------


def _check_array(array: object, n: int, dtype: type[np.generic], name: str) -> None:
    if not isinstance(array, np.ndarray) or array.dtype != dtype or array.shape != (n,):
        got = (
            f"{array.dtype}{list(array.shape)}"
            if isinstance(array, np.ndarray)
            else f"a {type(array).__name__}"
        )
        raise InvalidParameterError(
            f"{name} must be a numpy {np.dtype(dtype).name} array of shape ({n},), got {got}"
        )


def _check_writable(values: FloatArray, n: int) -> None:
    _check_array(values, n, np.float64, "values")
    if not (values.flags.c_contiguous and values.flags.writeable):
        raise InvalidParameterError(
            "values must be a writeable C-contiguous float64 array (it is updated in place)"
        )


def _check_log_factor(log_factor: float) -> float:
    x = _as_float(log_factor) if _is_number(log_factor) else math.nan
    if not abs(x) <= _MAX_LOG_FACTOR:
        raise InvalidParameterError(
            f"log_factor must be a finite number in [-{_MAX_LOG_FACTOR}, {_MAX_LOG_FACTOR}] "
            f"(a factor exp(log_factor) within float64 range), got {_show(log_factor)}"
        )
    return x


# -- compiled queries ---------------------------------------------------------------------------


class LinearQuery:
    """A compiled linear query: integer weights ``units_i`` in ``[0, 2^16]`` per cell.

    The query's weight on cell ``i`` is ``units_i / 2^16``. Immutable. Build
    one with :func:`~dpstream.core.pmwg.query_parser.parse_query` or
    :class:`~dpstream.core.pmwg.query_compiler.QueryCompiler`, never directly.

    Attributes:
        key: the canonical identity, for caches and logs (``count:country=0,2``
            or ``weights:<support>:<hash>``; never the raw weights).
        support_size: the number of cells with weight > 0.
        n_cells: the universe size ``N``; every array argument has shape ``(N,)``.

    """

    __slots__ = ("key", "support_size", "n_cells")

    key: str
    support_size: int
    n_cells: int

    def __init__(self, key: str, support_size: int, n_cells: int) -> None:
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "support_size", support_size)
        object.__setattr__(self, "n_cells", n_cells)

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"a compiled LinearQuery is immutable (cannot set {name!r})")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"a compiled LinearQuery is immutable (cannot delete {name!r})")

    def __repr__(self) -> str:
        return f"LinearQuery({self.key!r}, support_size={self.support_size})"

    def __getstate__(self) -> dict[str, object]:
        names = (name for cls in type(self).__mro__ for name in getattr(cls, "__slots__", ()))
        return {name: getattr(self, name) for name in names}

    def __setstate__(self, state: dict[str, object]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)

    def weighted_count(self, counts: IntArray) -> int:
        """Return ``sum_i units_i counts_i`` exactly, as a Python int.

        This is ``2^16 t f~(x_t)``, the quantity PMWG perturbs (Algorithm 1).

        Args:
            counts: the true event counts per cell, an int64 array of shape
                ``(N,)``, non-negative with a total below ``2^63``.

        Raises:
            InvalidParameterError: ``counts`` has the wrong type, dtype or shape.

        """
        raise NotImplementedError

    def weighted_sum(self, values: FloatArray) -> float:
        """Return ``sum_i (units_i / 2^16) values_i`` for a float64 array of shape ``(N,)``.

        On the public histogram ``y`` this is ``f~(y)``, the easy-query answer.

        Raises:
            InvalidParameterError: ``values`` has the wrong type, dtype or shape.

        """
        raise NotImplementedError

    def multiply(self, values: FloatArray, log_factor: float) -> float:
        """Multiply in place ``values_i *= exp(log_factor units_i / 2^16)`` on the support.

        This is the multiplicative-weights step of PMWG (Algorithm 1, "MW
        update") without the normalisation; cells outside the support are not
        touched.

        Args:
            values: the public histogram, a writeable C-contiguous float64
                array of shape ``(N,)``.
            log_factor: the finite exponent per unit weight (``-alpha/6`` or
                ``+alpha/6`` in Algorithm 1).

        Returns:
            The change of the total mass, ``sum(values after) - sum(values
            before)`` over the support (up to rounding), so the caller can keep
            the total without a dense pass.

        Raises:
            InvalidParameterError: bad ``values`` or a non-finite ``log_factor``.

        """
        raise NotImplementedError

    def dense_weights(self) -> FloatArray:
        """Return the rounded weights ``units / 2^16`` as a float64 array of shape ``(N,)``."""
        raise NotImplementedError


class _Box:
    """One box of a predicate: how to index the histogram reshaped to ``shape``."""

    __slots__ = ("shape", "index", "is_view")

    def __init__(self, shape: tuple[int, ...], index: _Index, is_view: bool) -> None:
        self.shape = shape
        self.index = index
        self.is_view = is_view  # basic slicing that yields an array view


class _BoxQuery(LinearQuery):
    """A predicate query: weight 1 (``2^16`` units) on a union of disjoint boxes."""

    __slots__ = ("_boxes",)

    _boxes: tuple[_Box, ...]

    def __init__(self, key: str, support_size: int, n_cells: int, boxes: tuple[_Box, ...]) -> None:
        super().__init__(key, support_size, n_cells)
        object.__setattr__(self, "_boxes", boxes)

    def weighted_count(self, counts: IntArray) -> int:  # noqa: D102 - see LinearQuery
        _check_array(counts, self.n_cells, np.int64, "counts")
        total = 0
        for box in self._boxes:
            total += int(counts.reshape(box.shape)[box.index].sum())
        return total * WEIGHT_UNIT

    def weighted_sum(self, values: FloatArray) -> float:  # noqa: D102 - see LinearQuery
        _check_array(values, self.n_cells, np.float64, "values")
        total = 0.0
        for box in self._boxes:
            total += float(values.reshape(box.shape)[box.index].sum())
        return total

    def multiply(self, values: FloatArray, log_factor: float) -> float:  # noqa: D102
        _check_writable(values, self.n_cells)
        x = _check_log_factor(log_factor)
        factor = math.exp(x)
        before = 0.0
        for box in self._boxes:
            grid = values.reshape(box.shape)
            if box.is_view:
                view = grid[box.index]
                before += float(view.sum())
                view *= factor
            else:
                part = grid[box.index]
                before += float(np.sum(part))
                grid[box.index] = part * factor
        return before * math.expm1(x)

    def dense_weights(self) -> FloatArray:  # noqa: D102 - see LinearQuery
        out = np.zeros(self.n_cells, dtype=np.float64)
        for box in self._boxes:
            out.reshape(box.shape)[box.index] = 1.0
        return out


class _WeightQuery(LinearQuery):
    """An explicit weights query: sparse (indices + units) or dense (units per cell)."""

    __slots__ = ("_indices", "_units", "_weights")

    _indices: IntArray | None  # None: dense, _units and _weights have shape (N,)
    _units: IntArray
    _weights: FloatArray

    def __init__(
        self,
        key: str,
        support_size: int,
        n_cells: int,
        indices: IntArray | None,
        units: IntArray,
    ) -> None:
        super().__init__(key, support_size, n_cells)
        weights = units.astype(np.float64) / WEIGHT_UNIT
        for array in (indices, units, weights):
            if array is not None:
                array.flags.writeable = False
        object.__setattr__(self, "_indices", indices)
        object.__setattr__(self, "_units", units)
        object.__setattr__(self, "_weights", weights)

    def weighted_count(self, counts: IntArray) -> int:  # noqa: D102 - see LinearQuery
        _check_array(counts, self.n_cells, np.int64, "counts")
        if self._indices is not None:
            counts = counts.take(self._indices)
        return _exact_dot(counts, self._units)

    def weighted_sum(self, values: FloatArray) -> float:  # noqa: D102 - see LinearQuery
        _check_array(values, self.n_cells, np.float64, "values")
        if self._indices is not None:
            values = values.take(self._indices)
        return float(np.dot(values, self._weights))

    def multiply(self, values: FloatArray, log_factor: float) -> float:  # noqa: D102
        _check_writable(values, self.n_cells)
        x = _check_log_factor(log_factor)
        indices = self._indices
        if indices is None:  # dense: factors are exactly 1.0 outside the support
            factors = np.multiply(self._weights, x)
            np.exp(factors, out=factors)
            before = float(values.sum())
            values *= factors
            return float(values.sum()) - before
        part = values.take(indices)
        growth = np.expm1(np.multiply(self._weights, x))
        delta = float(np.dot(part, growth))
        growth += 1.0
        part *= growth
        values[indices] = part
        return delta

    def dense_weights(self) -> FloatArray:  # noqa: D102 - see LinearQuery
        if self._indices is None:
            return self._weights.copy()
        out = np.zeros(self.n_cells, dtype=np.float64)
        out[self._indices] = self._weights
        return out


# -- predicate planning ---------------------------------------------------------------------------


def _runs(codes: tuple[int, ...]) -> list[tuple[int, int]]:
    """Cut sorted distinct codes into maximal contiguous runs ``[start, stop)``."""
    runs: list[tuple[int, int]] = []
    for code in codes:
        if runs and runs[-1][1] == code:
            runs[-1] = (runs[-1][0], code + 1)
        else:
            runs.append((code, code + 1))
    return runs


def _basic_box(shape: tuple[int, ...], combo: Sequence[tuple[int, int] | None]) -> _Box:
    """Return the view box of one run per restricted attribute (``None``: all values)."""
    groups: list[list[int]] = []  # [size, start, stop] of merged dimensions
    j, n = 0, len(shape)
    lead = 1
    while j < n and combo[j] is None:
        lead *= shape[j]
        j += 1
    if j > 0:
        groups.append([lead, 0, lead])
    while j < n:
        run = combo[j]
        assert run is not None
        size = shape[j]
        k = j + 1
        while k < n and combo[k] is None:
            size *= shape[k]
            k += 1
        inner = size // shape[j]
        groups.append([size, run[0] * inner, run[1] * inner])
        j = k
    # a single selected position folds into the next dimension: index = a * size_next + i
    merged: list[list[int]] = [groups[-1]]
    for size, start, stop in reversed(groups[:-1]):
        nxt = merged[-1]
        if stop - start == 1:
            merged[-1] = [size * nxt[0], start * nxt[0] + nxt[1], start * nxt[0] + nxt[2]]
        else:
            merged.append([size, start, stop])
    merged.reverse()
    index: list[object] = []
    for _size, start, stop in merged:
        index.append(start if stop - start == 1 else slice(start, stop))
    is_view = any(isinstance(i, slice) for i in index)
    return _Box(tuple(g[0] for g in merged), tuple(index), is_view)


def _gather_box(shape: tuple[int, ...], selection: _Selection) -> _Box:
    """Return an outer-product gather over the selection (index arrays where needed)."""
    dims: list[int] = []
    index: list[object] = []
    arrays: list[int] = []  # positions in index that hold index arrays
    previous_full = False
    for size, codes in zip(shape, selection, strict=True):
        if codes is None:
            if previous_full:
                dims[-1] *= size
            else:
                dims.append(size)
                index.append(slice(None))
            previous_full = True
            continue
        previous_full = False
        dims.append(size)
        runs = _runs(codes)
        if len(runs) == 1:
            index.append(slice(runs[0][0], runs[0][1]))
        else:
            arrays.append(len(index))
            index.append(np.array(codes, dtype=np.intp))
    for k, pos in enumerate(arrays):  # orthogonal shapes: the arrays broadcast to an outer product
        target = [1] * len(arrays)
        target[k] = -1
        array = np.asarray(index[pos]).reshape(target)
        array.flags.writeable = False  # compiled queries are shared: keep them immutable
        index[pos] = array
    return _Box(tuple(dims), tuple(index), is_view=False)


def _selection_key(universe: Universe, selection: _Selection) -> str:
    parts: list[str] = []
    for attr, codes in zip(universe.attributes, selection, strict=True):
        if codes is not None:
            runs = _runs(codes)
            text = ",".join(str(a) if b - a == 1 else f"{a}-{b - 1}" for a, b in runs)
            parts.append(f"{attr.name}={text}")
    return "count:" + (";".join(parts) if parts else "all")


def _compile_selection(universe: Universe, selection: _Selection) -> LinearQuery:
    """Compile per-attribute selected codes (``None``: every value) into a box query."""
    shape = universe.shape
    normal: _Selection = [
        None if codes is not None and len(codes) == size else codes
        for size, codes in zip(shape, selection, strict=True)
    ]
    if any(codes == () for codes in normal):
        return _BoxQuery("count:empty", 0, universe.size, ())
    support = math.prod(
        size if codes is None else len(codes) for size, codes in zip(shape, normal, strict=True)
    )
    runs: list[list[tuple[int, int] | None]] = [
        [None] if codes is None else list(_runs(codes)) for codes in normal
    ]
    if math.prod(len(r) for r in runs) <= MAX_BOXES:
        boxes = tuple(_basic_box(shape, combo) for combo in itertools.product(*runs))
    else:
        boxes = (_gather_box(shape, normal),)
    return _BoxQuery(_selection_key(universe, normal), support, universe.size, boxes)


def _compile_weights(n_cells: int, indices: IntArray, units: IntArray) -> LinearQuery:
    """Compile the support (sorted cell indices) and its units (all > 0) of a weights query."""
    digest = hashlib.sha256(indices.astype("<i8").tobytes())
    digest.update(units.astype("<i8").tobytes())
    support = int(indices.shape[0])
    key = f"weights:{support}:{digest.hexdigest()[:16]}"
    if 4 * support > n_cells:
        dense = np.zeros(n_cells, dtype=np.int64)
        dense[indices] = units
        return _WeightQuery(key, support, n_cells, None, dense)
    return _WeightQuery(
        key, support, n_cells, np.ascontiguousarray(indices, dtype=np.int64), units.copy()
    )
