"""The query compiler: parse PMWG's JSON queries once and cache the compiled linear queries.

PMWG (Cummings, Krehbiel, Lai, Tantipongpipat 2018, "Differential Privacy for
Growing Databases", Algorithm 1 and appendix B) answers *linear queries*
(:mod:`dpstream.core.pmwg.queries`), written in the JSON language of
:mod:`dpstream.core.pmwg.query_parser`. A flow answers the same queries
again and again, so compiling them once matters.

:class:`QueryCompiler` caches compiled queries by a canonical form of the
query JSON (an LRU of ``max_entries`` entries; a marginal is one entry). A
dense weights query is keyed by a SHA-256 of its rounded units, which needs a
parse of the list on every call (cheap next to building it); it holds 16 bytes

The cache is an optimisation only: a cached query is the very same object a fresh parse
would build, so answers (and their noise) do not depend on it. It holds compiled public
queries, no data and no noise.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Final

from dpstream.core.pmwg.queries import LinearQuery, _WeightQuery
from dpstream.core.pmwg.query_parser import parse_query
from dpstream.core.pmwg.universe import Universe
from dpstream.errors import InvalidParameterError

__all__ = ["QueryCompiler"]

_CANONICAL_DEPTH: Final = 32


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
