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

**The query language** (``"schema": "dpstream.query/1"``, already-decoded JSON)::

    {"schema": "dpstream.query/1", "kind": "count", "where": [
        {"attr": "country", "eq": "de"},
        {"attr": "device", "in": ["ios", "android"]},
        {"attr": "age", "range": [18, 65]}]}
    {"schema": "dpstream.query/1", "kind": "marginal", "attrs": ["country", "device"],
     "where": [...]}
    {"schema": "dpstream.query/1", "kind": "weights", "weights": [0.0, 0.5, ...]}
    {"schema": "dpstream.query/1", "kind": "weights", "sparse": {"17": 0.25, "4096": 1.0}}

A *count* query has weight 1 on the cells that satisfy every condition of its
``where`` (none: every cell). ``eq`` / ``in`` select values of a categorical
attribute; ``range: [lo, hi]`` selects the buckets of a bucketed attribute
that lie inside ``[lo, hi]``, and ``lo < hi`` must both be bucket edges (so the
selection is exactly what was asked). A *marginal* expands into one count
query per combination of the values (buckets) of ``attrs``, in C order (first
listed attribute most significant), each restricted by ``where``; a
combination that ``where`` excludes gives a query with empty support (its
answer is 0). At most :data:`MAX_MARGINAL_CELLS` sub-queries. A *weights*
query gives every cell's weight, densely (a list of ``N`` numbers) or sparsely
(cell index as a decimal string -> weight, others 0). Anything else is a
:class:`QueryError` whose message gives the JSON path (``query.where[2].range[0]``),
what was wrong and what was expected; unknown keys are refused (a misspelt
``"wehre"`` must not silently count everything).

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
plain vector operations.

:class:`QueryCompiler` caches compiled queries by a canonical form of the
query JSON (an LRU of ``max_entries`` entries; a marginal is one entry). A
dense weights query is keyed by a SHA-256 of its rounded units, which needs a
parse of the list on every call (cheap next to building it); it holds 16 bytes
per cell, so at most ``max_dense`` of them are kept.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
import operator
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Final, NoReturn, TypeAlias

import numpy as np
import numpy.typing as npt

from dpstream.core.pmwg.universe import Attribute, Bucketed, Categorical, Universe, _show
from dpstream.errors import InvalidParameterError

__all__ = [
    "MAX_BOXES",
    "MAX_MARGINAL_CELLS",
    "QUERY_SCHEMA",
    "WEIGHT_BITS",
    "WEIGHT_UNIT",
    "LinearQuery",
    "QueryCompiler",
    "QueryError",
    "parse_query",
]

QUERY_SCHEMA: Final = "dpstream.query/1"
WEIGHT_BITS: Final = 16
WEIGHT_UNIT: Final = 1 << WEIGHT_BITS
"""Weights are integer multiples of ``1 / WEIGHT_UNIT``; a weight of 1 is ``WEIGHT_UNIT`` units."""
MAX_MARGINAL_CELLS: Final = 4096
"""The largest number of sub-queries one marginal may expand into."""
MAX_BOXES: Final = 8
"""A predicate is answered by slice views when it splits into at most this many boxes."""

_KINDS: Final = ("count", "marginal", "weights")
_KEYS: Final = {
    "count": ("schema", "kind", "where"),
    "marginal": ("schema", "kind", "attrs", "where"),
    "weights": ("schema", "kind", "weights", "sparse"),
}
_CONDITION_OPS: Final = ("eq", "in", "range")
_INT64_MAX: Final = 2**63 - 1
_EXACT_DOT_TOTAL: Final = _INT64_MAX // WEIGHT_UNIT
_CELL_KEY_RE: Final = re.compile(r"0|[1-9][0-9]{0,9}")
_CANONICAL_DEPTH: Final = 32
_MAX_LOG_FACTOR: Final = 700.0

FloatArray: TypeAlias = npt.NDArray[np.float64]
IntArray: TypeAlias = npt.NDArray[np.int64]
_Index: TypeAlias = tuple[Any, ...]
_Selection: TypeAlias = list[tuple[int, ...] | None]


class QueryError(InvalidParameterError):
    """A query is malformed or does not fit the universe; the message gives the JSON path."""


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
    one with :func:`parse_query` or :class:`QueryCompiler`, never directly.

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


# -- parsing ------------------------------------------------------------------------------------


def _fail(message: str) -> NoReturn:
    raise QueryError(message)


def _json_type(value: object) -> str:
    """Describe a decoded JSON value's type in JSON terms (for messages)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {_show(value)}"
    if isinstance(value, str):
        return f"the string {_show(value)}"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"a {type(value).__name__}"


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


def _listing(items: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(_show(item) for item in items[:limit])
    if len(items) > limit:
        shown += f", ... ({len(items)} in all)"
    return shown


def _fmt_edge(x: float) -> str:
    return str(int(x)) if x.is_integer() and abs(x) < 2**53 else repr(x)


def _key_path(key: object) -> str:
    if isinstance(key, str) and len(key) <= 40:
        return json.dumps(key)
    return _show(key)


class _Parser:
    """Validate one decoded query against a universe and compile it."""

    def __init__(self, universe: Universe) -> None:
        self.universe = universe

    def parse(self, obj: object) -> list[LinearQuery]:
        kind = self._header(obj)
        assert isinstance(obj, Mapping)
        if kind == "weights":
            return [self._weights(obj)]
        selection = self._where(obj)
        if kind == "count":
            return [_compile_selection(self.universe, selection)]
        return self._marginal(obj, selection)

    # -- header --
    def _header(self, obj: object) -> str:
        if not isinstance(obj, Mapping):
            _fail(f"query must be an object, got {_json_type(obj)}")
        if "schema" not in obj:
            _fail(f'query.schema is missing; expected "{QUERY_SCHEMA}"')
        schema = obj["schema"]
        if not (isinstance(schema, str) and schema == QUERY_SCHEMA):
            if isinstance(schema, str) and schema.startswith("dpstream.query/"):
                _fail(
                    f"query.schema {_show(schema)} is an unsupported version; "
                    f'expected "{QUERY_SCHEMA}"'
                )
            _fail(f'query.schema must be "{QUERY_SCHEMA}", got {_json_type(schema)}')
        if "kind" not in obj:
            _fail('query.kind is missing; expected one of "count", "marginal", "weights"')
        kind = obj["kind"]
        if not (isinstance(kind, str) and kind in _KINDS):
            _fail(
                f'query.kind must be one of "count", "marginal", "weights", got {_json_type(kind)}'
            )
        allowed = _KEYS[kind]
        for key in obj:
            if not (isinstance(key, str) and key in allowed):
                _fail(
                    f"query has unknown key {_show(key)}; allowed keys for kind "
                    f'"{kind}": {", ".join(allowed)}'
                )
        return kind

    # -- predicates --
    def _attribute(self, name: object, path: str) -> tuple[int, Attribute]:
        if not isinstance(name, str):
            _fail(f"{path} must be a string naming an attribute, got {_json_type(name)}")
        try:
            pos = self.universe.position(name)
        except KeyError:
            _fail(
                f"{path}: unknown attribute {_show(name)}; the universe has "
                f"{_listing(self.universe.names, 20)}"
            )
        return pos, self.universe.attributes[pos]

    def _where(self, obj: Mapping[Any, Any]) -> _Selection:
        selection: _Selection = [None] * len(self.universe.shape)
        if "where" not in obj:
            return selection
        raw = obj["where"]
        if not isinstance(raw, (list, tuple)):
            _fail(f"query.where must be a list of conditions, got {_json_type(raw)}")
        seen: dict[int, int] = {}
        for i, condition in enumerate(raw):
            here = f"query.where[{i}]"
            if not isinstance(condition, Mapping):
                _fail(
                    f'{here} must be an object like {{"attr": "country", "eq": "de"}}, '
                    f"got {_json_type(condition)}"
                )
            for key in condition:
                if not (isinstance(key, str) and key in ("attr", *_CONDITION_OPS)):
                    _fail(f"{here} has unknown key {_show(key)}; allowed keys: attr, eq, in, range")
            if "attr" not in condition:
                _fail(f"{here}.attr is missing; it names the attribute to restrict")
            pos, attr = self._attribute(condition["attr"], f"{here}.attr")
            if pos in seen:
                _fail(
                    f"{here}.attr: attribute {attr.name!r} is already restricted by "
                    f"query.where[{seen[pos]}]; give each attribute one condition"
                )
            seen[pos] = i
            ops = [op for op in _CONDITION_OPS if op in condition]
            if len(ops) != 1:
                got = " and ".join(f'"{op}"' for op in ops) if ops else "none"
                _fail(f'{here} must have exactly one of "eq", "in", "range", got {got}')
            op = ops[0]
            selection[pos] = self._condition(attr, op, condition[op], f"{here}.{op}")
        return selection

    def _condition(self, attr: Attribute, op: str, raw: object, path: str) -> tuple[int, ...]:
        if isinstance(attr, Bucketed):
            if op != "range":
                edges = _listing([_fmt_edge(e) for e in attr.edges], 12)
                _fail(
                    f"{path}: attribute {attr.name!r} is bucketed; select its buckets with "
                    f'"range": [lo, hi] (edges {edges})'
                )
            return self._range(attr, raw, path)
        if op == "range":
            _fail(
                f'{path}: attribute {attr.name!r} is categorical; select its values with "eq" '
                'or "in"'
            )
        if op == "eq":
            return (self._value(attr, raw, path),)
        if not isinstance(raw, (list, tuple)) or not raw:
            got = "[]" if isinstance(raw, (list, tuple)) else _json_type(raw)
            _fail(
                f"{path} must be a non-empty list of values of attribute {attr.name!r}, got {got}"
            )
        codes = {self._value(attr, value, f"{path}[{k}]") for k, value in enumerate(raw)}
        return tuple(sorted(codes))

    def _value(self, attr: Categorical, value: object, path: str) -> int:
        if not isinstance(value, str):
            _fail(
                f"{path} must be a string (a value of attribute {attr.name!r}), "
                f"got {_json_type(value)}"
            )
        try:
            return attr.code(value)
        except KeyError:
            _fail(
                f"{path}: {_show(value)} is not one of the values of attribute {attr.name!r} "
                f"({_listing(attr.values)})"
            )

    def _range(self, attr: Bucketed, raw: object, path: str) -> tuple[int, ...]:
        if not isinstance(raw, (list, tuple)) or len(raw) != 2:
            got = _show(raw) if isinstance(raw, (list, tuple)) else _json_type(raw)
            _fail(
                f"{path} must be a list [lo, hi] of two bucket edges of attribute "
                f"{attr.name!r}, got {got}"
            )
        edges = attr.edges
        positions: list[int] = []
        for k, end in enumerate(raw):
            here = f"{path}[{k}]"
            x = _as_float(end) if _is_number(end) else math.nan
            if not math.isfinite(x):
                _fail(
                    f"{here} must be a finite number (a bucket edge of attribute "
                    f"{attr.name!r}), got {_json_type(end)}"
                )
            b = bisect.bisect_left(edges, x)
            if b < len(edges) and edges[b] == x:
                positions.append(b)
                continue
            if b == 0:
                near = f"the nearest edge is the first, {_fmt_edge(edges[0])}"
            elif b == len(edges):
                near = f"the nearest edge is the last, {_fmt_edge(edges[-1])}"
            else:
                near = f"the nearest edges are {_fmt_edge(edges[b - 1])} and {_fmt_edge(edges[b])}"
            _fail(f"{here}: {_show(end)} is not a bucket edge of attribute {attr.name!r}; {near}")
        lo, hi = positions
        if lo >= hi:
            _fail(f"{path} must have lo < hi, got {_show(list(raw))}")
        return tuple(range(lo, hi))

    # -- marginals --
    def _marginal(self, obj: Mapping[Any, Any], selection: _Selection) -> list[LinearQuery]:
        if "attrs" not in obj:
            _fail("query.attrs is missing; a marginal needs the attributes to break down by")
        raw = obj["attrs"]
        if not isinstance(raw, (list, tuple)) or not raw:
            got = "[]" if isinstance(raw, (list, tuple)) else _json_type(raw)
            _fail(f"query.attrs must be a non-empty list of attribute names, got {got}")
        positions: list[int] = []
        seen: dict[int, int] = {}
        for k, name in enumerate(raw):
            pos, attr = self._attribute(name, f"query.attrs[{k}]")
            if pos in seen:
                _fail(
                    f"query.attrs[{k}]: attribute {attr.name!r} is listed twice "
                    f"(also query.attrs[{seen[pos]}])"
                )
            seen[pos] = k
            positions.append(pos)
        shape = self.universe.shape
        cells = math.prod(shape[p] for p in positions)
        if cells > MAX_MARGINAL_CELLS:
            dims = " x ".join(f"{self.universe.names[p]} ({shape[p]})" for p in positions)
            _fail(
                f"query.attrs: the marginal over {dims} has {cells} cells; at most "
                f"{MAX_MARGINAL_CELLS} sub-queries are allowed"
            )
        out: list[LinearQuery] = []
        for combo in itertools.product(*(range(shape[p]) for p in positions)):
            sub = list(selection)
            for p, code in zip(positions, combo, strict=True):
                current = sub[p]
                sub[p] = (code,) if current is None or code in current else ()
            out.append(_compile_selection(self.universe, sub))
        return out

    # -- explicit weights --
    def _weight(self, value: object, path: str) -> float:
        x = _as_float(value) if _is_number(value) else math.nan
        if not 0.0 <= x <= 1.0:
            _fail(f"{path} must be a number in [0, 1], got {_json_type(value)}")
        return x

    def _weights(self, obj: Mapping[Any, Any]) -> LinearQuery:
        n = self.universe.size
        has_dense, has_sparse = "weights" in obj, "sparse" in obj
        if has_dense == has_sparse:
            _fail(
                'query must have exactly one of "weights" (a list with one weight per cell) or '
                '"sparse" (an object mapping cell indices to weights), got '
                + ("both" if has_dense else "neither")
            )
        if has_dense:
            values = self._dense_values(obj["weights"], n)
            units = np.rint(values * WEIGHT_UNIT).astype(np.int64)
            indices = np.flatnonzero(units).astype(np.int64)
            return _compile_weights(n, indices, units[indices])
        raw = obj["sparse"]
        if not isinstance(raw, Mapping):
            _fail(
                "query.sparse must be an object mapping cell indices (decimal strings) to "
                f"weights, got {_json_type(raw)}"
            )
        cells: list[int] = []
        weights: list[float] = []
        for key, value in raw.items():
            path = f"query.sparse[{_key_path(key)}]"
            if not (isinstance(key, str) and _CELL_KEY_RE.fullmatch(key)):
                _fail(
                    f"{path}: the key must be a cell index, a decimal integer in [0, {n}) "
                    f"without sign or leading zeros, got {_json_type(key)}"
                )
            cell = int(key)
            if cell >= n:
                _fail(f"{path}: cell index {cell} is outside [0, {n})")
            cells.append(cell)
            weights.append(self._weight(value, path))
        sparse_units = np.rint(np.array(weights, dtype=np.float64) * WEIGHT_UNIT).astype(np.int64)
        sparse_cells = np.array(cells, dtype=np.int64)
        order = np.argsort(sparse_cells, kind="stable")
        sparse_cells, sparse_units = sparse_cells[order], sparse_units[order]
        keep = sparse_units > 0
        return _compile_weights(n, sparse_cells[keep], sparse_units[keep])

    def _dense_values(self, raw: object, n: int) -> FloatArray:
        values: FloatArray | None = None
        if isinstance(raw, np.ndarray) and raw.ndim == 1 and raw.dtype.kind in "iuf":
            if raw.shape[0] != n:
                _fail(
                    f"query.weights has {raw.shape[0]} entries; expected one per cell of the "
                    f"universe ({n})"
                )
            values = raw.astype(np.float64)
            items: Sequence[object] | npt.NDArray[Any] = raw
        elif isinstance(raw, (list, tuple)):
            if len(raw) != n:
                _fail(
                    f"query.weights has {len(raw)} entries; expected one per cell of the "
                    f"universe ({n})"
                )
            items = raw
            if set(map(type, raw)) <= {int, float}:
                try:
                    values = np.array(raw, dtype=np.float64)
                except OverflowError:
                    values = None
            if values is None:
                values = np.array(
                    [self._weight(v, f"query.weights[{i}]") for i, v in enumerate(raw)],
                    dtype=np.float64,
                )
        else:
            _fail(f"query.weights must be a list of {n} numbers in [0, 1], got {_json_type(raw)}")
        bad = ~((values >= 0.0) & (values <= 1.0))
        if bool(bad.any()):
            i = int(np.argmax(bad))
            item = items[i]
            shown = item.item() if isinstance(item, np.generic) else item
            _fail(f"query.weights[{i}] must be a number in [0, 1], got {_json_type(shown)}")
        return values


def parse_query(obj: object, universe: Universe) -> list[LinearQuery]:
    """Validate and compile one decoded query (no caching).

    Args:
        obj: the decoded JSON query (dicts, lists, strings, numbers).
        universe: the universe it is asked about.

    Returns:
        One :class:`LinearQuery` for a count or weights query; one per cell of
        the marginal, in C order of ``attrs``, for a marginal.

    Raises:
        QueryError: anything about ``obj`` is invalid; the message gives the
            JSON path (``query.where[2].range[0]``), what was wrong and what was
            expected. No other exception escapes for JSON-shaped input.

    """
    return _Parser(universe).parse(obj)


# -- the compiler and its cache ------------------------------------------------------------------


class _NotCanonical(Exception):
    """The value is not plain JSON data (or too deep); it is parsed without caching."""


def _canonical(value: object, depth: int = 0) -> str:
    """Return a canonical text of plain JSON data (sorted object keys)."""
    if depth > _CANONICAL_DEPTH:
        raise _NotCanonical
    if value is None:
        return "null"
    kind = type(value)
    if kind is bool:
        return "true" if value else "false"
    if kind is int:
        assert isinstance(value, int)
        if abs(value) > 2**64:
            raise _NotCanonical
        return str(value)
    if kind is float:
        return repr(value)
    if kind is str:
        return json.dumps(value)
    if kind is list or kind is tuple:
        assert isinstance(value, (list, tuple))
        return "[" + ",".join(_canonical(item, depth + 1) for item in value) + "]"
    if kind is dict:
        assert isinstance(value, dict)
        if not all(type(key) is str for key in value):
            raise _NotCanonical
        items = sorted(value.items())
        body = ",".join(json.dumps(k) + ":" + _canonical(v, depth + 1) for k, v in items)
        return "{" + body + "}"
    raise _NotCanonical


class QueryCompiler:
    """Compile queries for one universe, caching the compiled objects (LRU).

    The cache key of a count or marginal query is a canonical text of its JSON
    (sorted keys), so equal queries return the very same :class:`LinearQuery`
    objects. A weights query is parsed on every call (its list is needed to
    check and round it) and keyed by a SHA-256 of its rounded weights; dense
    ones hold ``16 N`` bytes each, so at most ``max_dense`` are kept.

    Args:
        universe: the universe every query is about.
        max_entries: the most cached queries (a marginal is one entry).
        max_dense: the most cached weights queries in dense form.

    Raises:
        InvalidParameterError: ``max_entries < 1`` or ``max_dense < 0``.

    """

    def __init__(self, universe: Universe, max_entries: int = 1024, max_dense: int = 4) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise InvalidParameterError(f"max_entries must be an integer >= 1, got {max_entries!r}")
        if isinstance(max_dense, bool) or not isinstance(max_dense, int) or max_dense < 0:
            raise InvalidParameterError(f"max_dense must be an integer >= 0, got {max_dense!r}")
        self.universe = universe
        self.max_entries = max_entries
        self.max_dense = max_dense
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, tuple[LinearQuery, ...]] = OrderedDict()
        self._dense: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every cached query."""
        self._entries.clear()
        self._dense.clear()

    def compile(self, obj: object) -> list[LinearQuery]:
        """Validate and compile a decoded query, or return the cached compilation.

        Returns:
            A new list of (possibly cached, shared, immutable) queries, as
            :func:`parse_query` returns.

        Raises:
            QueryError: the query is invalid (see :func:`parse_query`).

        """
        kind = obj.get("kind") if isinstance(obj, dict) else None
        if isinstance(kind, str) and kind == "weights":
            queries = tuple(parse_query(obj, self.universe))
            key = "weights|" + queries[0].key
            cached = self._lookup(key)
            if cached is not None:
                return list(cached)
            dense = isinstance(queries[0], _WeightQuery) and queries[0]._indices is None
            self._store(key, queries, dense)
            return list(queries)
        try:
            key = "json|" + _canonical(obj)
        except _NotCanonical:
            return parse_query(obj, self.universe)
        cached = self._lookup(key)
        if cached is not None:
            return list(cached)
        queries = tuple(parse_query(obj, self.universe))
        self._store(key, queries, False)
        return list(queries)

    def _lookup(self, key: str) -> tuple[LinearQuery, ...] | None:
        cached = self._entries.get(key)
        if cached is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        if key in self._dense:
            self._dense.move_to_end(key)
        return cached

    def _store(self, key: str, queries: tuple[LinearQuery, ...], dense: bool) -> None:
        if dense:
            if self.max_dense == 0:
                return
            self._dense[key] = None
            while len(self._dense) > self.max_dense:
                old, _ = self._dense.popitem(last=False)
                del self._entries[old]
        self._entries[key] = queries
        while len(self._entries) > self.max_entries:
            old, _ = self._entries.popitem(last=False)
            self._dense.pop(old, None)
