"""The JSON query language of PMWG: validate a decoded query and compile it to linear queries.

PMWG (Cummings, Krehbiel, Lai, Tantipongpipat 2018, "Differential Privacy for
Growing Databases", Algorithm 1 and appendix B) answers *linear queries*
(:mod:`dpstream.core.pmwg.queries`); this module reads them from already-decoded JSON and
compiles them with that module's planners.

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

No noise and no state: parsing is a pure function of the query and the (public) universe.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final, NoReturn

import numpy as np
import numpy.typing as npt

from dpstream.core.pmwg.attributes import Attribute, Bucketed, Categorical, _show
from dpstream.core.pmwg.queries import (
    WEIGHT_UNIT,
    FloatArray,
    LinearQuery,
    _as_float,
    _compile_selection,
    _compile_weights,
    _is_number,
    _Selection,
)
from dpstream.core.pmwg.universe import Universe
from dpstream.errors import InvalidParameterError

__all__ = [
    "MAX_MARGINAL_CELLS",
    "QUERY_SCHEMA",
    "QueryError",
    "parse_query",
]

QUERY_SCHEMA: Final = "dpstream.query/1"
MAX_MARGINAL_CELLS: Final = 4096
"""The largest number of sub-queries one marginal may expand into."""

_KINDS: Final = ("count", "marginal", "weights")
_KEYS: Final = {
    "count": ("schema", "kind", "where"),
    "marginal": ("schema", "kind", "attrs", "where"),
    "weights": ("schema", "kind", "weights", "sparse"),
}
_CONDITION_OPS: Final = ("eq", "in", "range")
_CELL_KEY_RE: Final = re.compile(r"0|[1-9][0-9]{0,9}")


class QueryError(InvalidParameterError):
    """A query is malformed or does not fit the universe; the message gives the JSON path."""


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
