"""Where every key lives: its shard, and in the declared universe its row in that shard.

A key's shard is a fixed hash of its UTF-8 bytes (:func:`~dpstream.stream.sharding.shard_of`,
the same in every process and on every worker). In the declared universe the whole key
universe is known at start-up, so :class:`DeclaredLayout` also fixes each declared key's
*position*: the declared keys sorted by shard, then by name within a shard. A shard's keys
in that order are exactly the order in which its key table starts them (sorted, at the first
close), so the step clock can hand a shard its events as row numbers
(:class:`RowCounts`) and neither the shard nor its table has to look a key string up again.
One :class:`~dpstream.core.counting.key_index.KeyIndex` over the positions serves both as the
clock's
check that a key is declared and as the lookup from key to position.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from dpstream.core.counting.key_index import KeyIndex
from dpstream.core.noise.coordinates import JoinedNames
from dpstream.stream.sharding import shards_of

__all__ = ["DeclaredLayout", "PeopleCounts", "RowCounts"]

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class RowCounts:
    """One shard's events of one step, by row: ``counts[i]`` events of the key at ``rows[i]``.

    ``rows`` are positions in the shard's sorted declared keys (:meth:`DeclaredLayout.keys_of`),
    distinct and ascending; ``counts`` are >= 1. At the user level ``people[i]`` is the number
    of people counted for the first time at that row (the bounding stage's ``first`` flags);
    None at the event level.
    """

    rows: npt.NDArray[np.int32]
    counts: IntArray
    people: IntArray | None = None

    def __len__(self) -> int:
        return int(self.rows.size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RowCounts):
            return NotImplemented
        return bool(np.array_equal(self.rows, other.rows)
                    and np.array_equal(self.counts, other.counts)
                    and (self.people is None if other.people is None
                         else self.people is not None
                         and np.array_equal(self.people, other.people)))

    __hash__ = None  # type: ignore[assignment]  # mutable arrays: unhashable

    def named(self, keys: Sequence[str]) -> dict[str, int]:
        """The same events by key name (``keys``: the shard's sorted declared keys)."""
        return dict(zip(map(keys.__getitem__, self.rows.tolist()), self.counts.tolist(),
                        strict=True))

    def named_people(self, keys: Sequence[str]) -> PeopleCounts:
        """The same events and people by key name (user level)."""
        people = {} if self.people is None else {
            keys[row]: n for row, n in zip(self.rows.tolist(), self.people.tolist(), strict=True)
            if n}
        return PeopleCounts(self.named(keys), people)


@dataclass(frozen=True)
class PeopleCounts:
    """One shard's kept events of one step at the user level, by key name.

    ``events[key]``: the key's kept events (>= 1); ``people[key]``: the people counted for the
    first time at the key in this step (each person once per key and period: the bounding
    stage's ``first`` flags), present only where >= 1. Buckets add up (:meth:`add`); the
    dicts are the bucket's own (copy before sharing: :meth:`copy`).
    """

    events: dict[str, int]
    people: dict[str, int]

    def __len__(self) -> int:
        return len(self.events)

    def copy(self) -> PeopleCounts:
        """A bucket with dicts of its own."""
        return PeopleCounts(dict(self.events), dict(self.people))

    def add(self, other: PeopleCounts) -> None:
        """Add ``other``'s events and people to this bucket, in place."""
        for target, more in ((self.events, other.events), (self.people, other.people)):
            if target.keys().isdisjoint(more.keys()):
                target.update(more)
            else:
                for key, n in more.items():
                    target[key] = target.get(key, 0) + n

    def to_state(self) -> dict[str, dict[str, int]]:
        """Plain data (a snapshot's pending bucket)."""
        return {"events": dict(self.events), "people": dict(self.people)}

    @staticmethod
    def from_state(state: dict[str, Any]) -> PeopleCounts:
        """The bucket of :meth:`to_state`."""
        return PeopleCounts({str(k): int(n) for k, n in state["events"].items()},
                            {str(k): int(n) for k, n in state["people"].items()})


class DeclaredLayout(Mapping[int, tuple[str, ...]]):
    """The declared keys by shard, each shard's sorted: a mapping ``shard -> keys``.

    A shard's keys are a :class:`~dpstream.core.noise.coordinates.JoinedNames` tuple, which holds
    also their UTF-8 bytes joined (about 14 bytes a key of 12 characters), so the lanes of the
    shard's counters are derived without reading a million string objects again. Being a
    tuple subclass with an attribute, the garbage collector tracks it: a full collection
    traverses it, about 17 ms more at a million keys (measured), and full collections are
    rare in a flow.

    Args:
        keys: the declared keys (distinct), in any order.
        shards: how many shards the flow has.

    Attributes:
        index: key -> position (shard by shard, sorted within a shard); -1 if not declared.
        bounds: shard ``s`` holds positions ``bounds[s] .. bounds[s + 1] - 1``.
    """

    def __init__(self, keys: Sequence[str], shards: int) -> None:
        ordered = sorted(keys)
        owner = shards_of(ordered, shards)
        by_shard = np.argsort(owner, kind="stable")  # shard-major, still sorted within
        names = np.empty(len(ordered), dtype=object)
        names[:] = ordered
        names = names[by_shard]
        self.shards = shards
        self.index = KeyIndex(names)
        self.bounds: IntArray = np.searchsorted(owner[by_shard], np.arange(shards + 1))
        # each shard's keys with their bytes joined now, for the lanes of its counters
        self._by_shard = {s: JoinedNames(names[self.bounds[s]:self.bounds[s + 1]].tolist())
                          for s in range(shards) if self.bounds[s + 1] > self.bounds[s]}

    # -- the Mapping of declared keys by shard --
    def __getitem__(self, shard: int) -> tuple[str, ...]:
        return self._by_shard[shard]

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_shard)

    def __len__(self) -> int:
        return len(self._by_shard)

    def keys_of(self, shard: int) -> tuple[str, ...]:
        """The declared keys of ``shard``, sorted."""
        return self._by_shard.get(shard, ())

    def positions(self, keys: Sequence[str]) -> IntArray:
        """The position of every key, -1 for a key that is not declared."""
        return self.index.rows(keys)

    def route(self, positions: IntArray,
              first: npt.NDArray[np.bool_] | None = None) -> list[RowCounts | None]:
        """Count events by position; one :class:`RowCounts` per shard (None: no event).

        ``first`` (user level): the events that count a person for the first time at their
        key; the buckets then also count those per row (``RowCounts.people``).
        """
        people = None
        total = int(self.bounds[-1])
        if 0 < total <= 2 * positions.size:  # many events a position: counted by bincount
            all_counts = np.bincount(positions, minlength=total)  # (the same counts, no sort)
            distinct = np.flatnonzero(all_counts)
            counts = all_counts[distinct]
            if first is not None:
                people = np.bincount(positions[first], minlength=total)[distinct]
        elif first is None:
            distinct, counts = np.unique(positions, return_counts=True)
        else:
            distinct, slot, counts = np.unique(positions, return_inverse=True,
                                               return_counts=True)
            people = np.bincount(slot.reshape(-1), weights=first.astype(np.int64),
                                 minlength=distinct.size).astype(np.int64)
        cuts = np.searchsorted(distinct, self.bounds).tolist()
        out: list[RowCounts | None] = []
        for shard in range(self.shards):
            lo, hi = cuts[shard], cuts[shard + 1]
            out.append(None if hi == lo else RowCounts(
                (distinct[lo:hi] - self.bounds[shard]).astype(np.int32),
                counts[lo:hi], None if people is None else people[lo:hi]))
        return out
