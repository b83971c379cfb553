"""Contribution bounding: which of a person's events a flow keeps, decided by that person alone.

**What is kept.** Per person and per period
(:class:`~dpstream.core.contribution.rules.BoundingRule`), a person's events fall into groups
(counters: keys; ERM: steps; PMWG: one group). Taking the person's events in a fixed order,
an event is kept iff its group is already one of the person's groups this period and that group
holds fewer than ``max_per_group`` kept events, or the person has fewer than ``max_groups``
groups (the event's group is then added). So per period a person
keeps events in at most ``max_groups`` groups and at most ``max_per_group`` in each: the L0 and
Linf bounds the kinds' sensitivities are multiplied by.

**The order.** Steps in increasing order (a step is one call of :meth:`ContributionBounder.keep`,
given *all* the accepted events of that closed step), and within a step by ``(partition,
offset)``: a total order on the input's events that depends on their coordinates alone, not on
how they were batched, interleaved, split across workers or replayed after a restart. The
decisions are therefore a function of the input's contents (pitfall 11): the same events in any
order within the step, or with a snapshot and restore between any two steps, are kept alike.

**Why one person's presence changes nobody else's kept events (pitfall 17).** The decision for
an event of person ``p`` reads only ``p``'s state (``p``'s groups and counts in this period,
built from ``p``'s earlier events) and ``p``'s events of this step before it in the order above.
Nothing of another person enters: people are told apart by their 128-bit keyed hashes
(:mod:`dpstream.core.contribution.people`), so adding or removing every event of one person
leaves every other person's kept events unchanged, except when two people's hashes collide; that
probability is at most ``n 2^-128`` for ``n`` other people and is added to delta
(:func:`~dpstream.core.contribution.people.collision_delta`). The group keys are interned per
period into small integers (a dict, exact, dropped with the period); an id says only which keys
are equal, so the order in which keys were interned (which does depend on other people) decides
nothing.

**Computed in columns.** :meth:`ContributionBounder.keep` is vectorised over the step: the
events' ranks in ``(partition, offset)`` order; people as dense ids (sorted by hash); one sort by
``(person, group, rank)`` gives each event its rank among the person's events of its group, so
an event is kept iff that rank is below the group's allowance: ``max_per_group`` minus the
group's kept count so far this period for a group the person already has; ``max_per_group`` for
a new group that is admitted, ``0`` for one that is not. A new group is admitted iff the
person's groups so far plus the new group's rank among the person's new groups of this step
(ordered by their first event) is below ``max_groups``: exactly the sequential rule above (a new
group is added at its first event, whose keep is certain, and once the person is full no group
is added). A step in which every person has one event (the usual step) takes a path with no
sort: each event is its own pair, at rank 0, kept iff its allowance is positive. There is no
Python loop per event (the interning of keys excepted: a dict lookup
per event for keys of any type; integer keys, such as declared positions, are interned in
columns, with Python work per key new in the period only).

**The state** holds, per person seen this period, in columns sorted by hash: the hash (two
uint64 words, 16 bytes), and what the caps need, counted in uint8 when the cap is at most 255
(else uint16): ``key``: the person's group ids (int32) and kept counts, ``max_groups`` of each
(``16 + 5 max_groups`` bytes: 56 at ``max_groups = 8``; 64 with caps above 255); ``step``:
groups used, the last step with a kept event and its kept count (26 bytes); ``one``: the kept
count (17 bytes). People new in a step are merged into a small sorted *delta* (one sort-merge
per step, at the cost of the delta's size), and the delta into the main columns when it outgrows
``max(2^16, 64 sqrt(main))``: a step moves O(delta) rows rather than all the people held, a
merge (O(main) rows) comes once per ``64 sqrt(main)`` new people or more, and no column has
spare capacity (the bytes above are exact). A step in a later period drops the whole state first
(the period's people, counts and key ids): the state does not grow with the number of periods.
The state holds no person id (only keyed hashes) but does hold per-person counts: keep the
recovery store secret.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from dpstream.core._checks import integer_at_least
from dpstream.core.contribution.people import HASH_BYTES, PersonHashes, hash_words
from dpstream.core.contribution.rules import BoundingRule
from dpstream.errors import InvalidParameterError

__all__ = ["ContributionBounder"]

_STATE_KIND: Final = "contribution-bounder"
_STATE_VERSION: Final = 2
"""Version 2: people hashed by the AES CBC-MAC of :mod:`~dpstream.core.contribution.people`
(version 1 held BLAKE2b hashes: resuming one would give every person fresh caps: refused)."""
_NO_GROUP: Final = -1
_CHUNK: Final = 1 << 22
"""Cells of a (pairs x max_groups) comparison done at once (bounds the scratch memory)."""
_COMPOSITE_LIMIT: Final = 1 << 62
_DENSE_LIMIT: Final = 1 << 20
"""Integer keys below this are interned through a dense table (key -> id) per period."""
_DELTA_MIN: Final = 1 << 16
_DELTA_GROWTH: Final = 64
"""The delta is merged into the main columns past ``max(_DELTA_MIN, _DELTA_GROWTH sqrt(main))``
people: a step costs O(delta) moves, a merge O(main), once per ~sqrt(main) new people."""

Bools = npt.NDArray[np.bool_]
Ints = npt.NDArray[np.int64]
Words = npt.NDArray[np.uint64]
Columns = dict[str, npt.NDArray[Any]]


class _Sorted:
    """People's hashes (two uint64 words) and their columns, sorted by hash, exactly sized."""

    __slots__ = ("hi", "lo", "columns")

    def __init__(self, hi: Words, lo: Words, columns: Columns) -> None:
        self.hi, self.lo, self.columns = hi, lo, columns

    @property
    def size(self) -> int:
        return int(self.hi.size)

    @property
    def nbytes(self) -> int:
        return int(self.hi.nbytes + self.lo.nbytes
                   + sum(column.nbytes for column in self.columns.values()))

    def insert(self, at: Ints, hi: Words, lo: Words, columns: Columns) -> None:
        """Insert sorted people at their positions (one column at a time: a small peak)."""
        if not at.size:
            return
        if not self.size:  # into nothing: the people as given (all at 0, in their order)
            self.hi, self.lo = hi.copy(), lo.copy()
            self.columns = {name: np.ascontiguousarray(columns[name]) for name in self.columns}
            return
        self.hi = np.insert(self.hi, at, hi)
        self.lo = np.insert(self.lo, at, lo)
        for name in list(self.columns):
            self.columns[name] = np.insert(self.columns[name], at, columns[name], axis=0)


class ContributionBounder:
    """Keeps, per person and period, at most the rule's caps of that person's events.

    Args:
        rule: the caps and what a group is.
        state: a :meth:`to_state` snapshot to resume from (made under the same rule).
    """

    def __init__(self, rule: BoundingRule, state: dict[str, Any] | None = None) -> None:
        self.rule = rule
        self._last_step: int | None = None
        self._reset(None)
        if state is not None:
            self._restore(state)

    # -- the state --
    def _reset(self, period: int | None) -> None:
        """Drop every person of the old period (and its key ids)."""
        self._period = period
        self._main = self._segment(0)
        self._delta = self._segment(0)
        self._keys: dict[Hashable, int] = {}  # key -> id (the dense keys may be in _dense only)
        self._dense: npt.NDArray[np.int32] | None = None  # small integer keys -> id (or -1)
        self._key_count = 0  # ids given this period: 0 .. _key_count - 1

    def _segment(self, count: int) -> _Sorted:
        return _Sorted(np.zeros(count, np.uint64), np.zeros(count, np.uint64),
                       self._empty_columns(count))

    def _empty_columns(self, count: int) -> Columns:
        grouping, width = self.rule.grouping, self.rule.max_groups
        counts = _counter(self.rule.max_per_group)
        if grouping == "key":
            return {"groups": np.full((count, width), _NO_GROUP, np.int32),
                    "counts": np.zeros((count, width), counts)}
        if grouping == "step":
            return {"used": np.zeros(count, _counter(width)),
                    "last": np.full(count, -1, np.int64), "count": np.zeros(count, counts)}
        return {"count": np.zeros(count, counts)}

    def _compact(self) -> None:
        """Merge the delta into the main columns."""
        delta = self._delta
        if delta.size and not self._main.size:  # nothing to merge into: the delta is all
            self._main, self._delta = delta, self._segment(0)
        elif delta.size:
            at, _found = _locate(self._main.hi, self._main.lo, delta.hi, delta.lo)
            self._main.insert(at, delta.hi, delta.lo, delta.columns)
            self._delta = self._segment(0)

    @property
    def people(self) -> int:
        """The number of people held (seen this period)."""
        return self._main.size + self._delta.size

    @property
    def period(self) -> int | None:
        """The period the state is of (None before the first step)."""
        return self._period

    @property
    def last_step(self) -> int | None:
        """The last step given to :meth:`keep` (None before the first)."""
        return self._last_step

    @property
    def nbytes(self) -> int:
        """Bytes of the per-person columns (the period's key ids excluded: per key, not person)."""
        return self._main.nbytes + self._delta.nbytes

    def to_state(self) -> dict[str, Any]:
        """Plain data to resume from: the rule, the period, the columns and the key ids.

        It holds keyed hashes, never a person id, but it holds per-person counts: the recovery
        store that keeps it is secret.
        """
        self._compact()
        main = self._main
        people = np.stack([main.hi, main.lo], axis=1).astype(">u8").tobytes()
        return {"kind": _STATE_KIND, "version": _STATE_VERSION, "rule": self.rule.to_dict(),
                "period": self._period, "last_step": self._last_step, "people": people,
                "columns": {name: column.copy() for name, column in main.columns.items()},
                "keys": self._key_list()}

    def _restore(self, state: dict[str, Any]) -> None:
        if state.get("kind") != _STATE_KIND or state.get("version") != _STATE_VERSION:
            raise InvalidParameterError(
                f"not a contribution bounder state of version {_STATE_VERSION}: kind "
                f"{state.get('kind')!r}, version {state.get('version')!r}")
        if state.get("rule") != self.rule.to_dict():
            raise InvalidParameterError(
                f"the bounding state was made with the caps {state.get('rule')!r}, but these "
                f"are {self.rule.to_dict()!r} (caps cannot change within a flow instance)")
        try:
            words = np.frombuffer(state["people"], dtype=">u8").reshape(-1, 2).astype(np.uint64)
            count = words.shape[0]
            template = self._empty_columns(count)
            columns = {name: np.array(state["columns"][name], dtype=empty.dtype).reshape(
                empty.shape) for name, empty in template.items()}
            keys = list(state["keys"])
            period = None if state["period"] is None else int(state["period"])
            last = None if state["last_step"] is None else int(state["last_step"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidParameterError(
                f"malformed contribution bounder state: {type(exc).__name__}") from None
        hi, lo = words[:, 0].copy(), words[:, 1].copy()
        if count > 1 and not bool(((hi[1:] > hi[:-1]) | ((hi[1:] == hi[:-1])
                                                          & (lo[1:] > lo[:-1]))).all()):
            raise InvalidParameterError(
                "malformed contribution bounder state: people not sorted or repeated")
        if len(set(keys)) != len(keys):
            raise InvalidParameterError("malformed contribution bounder state: a key twice")
        self._period, self._last_step = period, last
        self._main, self._delta = _Sorted(hi, lo, columns), self._segment(0)
        self._keys = {key: i for i, key in enumerate(keys)}
        self._dense = None
        self._key_count = len(keys)

    # -- the decisions --
    def keep(self, step: int, people: PersonHashes, groups: Sequence[Hashable] | None,
             partitions: npt.ArrayLike, offsets: npt.ArrayLike) -> tuple[Bools, Bools]:
        """Decide which of one closed step's events are kept.

        Args:
            step: the step (steps are given in increasing order; a step in a later period
                drops the previous period's state first). Give all of a step's events in one
                call: the order within a step is ``(partition, offset)`` only within a call.
            people: each event's person, as a keyed hash (``V16``).
            groups: each event's group for grouping ``key`` (hashable keys: strings or ints);
                ignored otherwise.
            partitions: each event's input partition.
            offsets: each event's offset in its partition (``(partition, offset)`` unique).

        Returns:
            ``(keep, first)``, aligned with the events: ``keep[i]`` whether event ``i`` is kept;
            ``first[i]`` whether it is kept and is its person's first kept event of its group
            in this period (a count of distinct people per group).
        """
        step = integer_at_least("step", step, 0)
        if self._last_step is not None and step < self._last_step:
            raise InvalidParameterError(
                f"steps must be given in increasing order: step {step} after step "
                f"{self._last_step}")
        words = hash_words(people)
        n = words.shape[0]
        partition = np.asarray(partitions, dtype=np.int64).reshape(-1)
        offset = np.asarray(offsets, dtype=np.int64).reshape(-1)
        if partition.size != n or offset.size != n:
            raise InvalidParameterError(
                f"people, partitions and offsets must have one entry per event: {n}, "
                f"{partition.size} and {offset.size}")
        grouping = self.rule.grouping
        if grouping == "key" and (groups is None or len(groups) != n):
            raise InvalidParameterError(
                f"grouping 'key' needs one group per event: {n} events, "
                f"{'no' if groups is None else len(groups)} groups")
        rank = _ranks(partition, offset)
        period = self.rule.period_of(step)
        if period != self._period:
            self._reset(period)
        self._last_step = step
        if n == 0:
            return np.zeros(0, np.bool_), np.zeros(0, np.bool_)
        pid, uhi, ulo = _dense_people(words[:, 0], words[:, 1])
        local, where = self._gather(uhi, ulo)
        if uhi.size == n:  # one event a person (the usual step): the pairs are the people
            return self._keep_single(step, local, where, uhi, ulo, pid, groups, rank)
        if grouping == "key":
            assert groups is not None
            order, sorted_pair, pair_person, pair_group = _by_pair(
                pid, self._intern(groups), self._key_count, rank)
        else:
            order = np.argsort(pid * n + rank)
            sorted_pair = pid[order]
            pair_person = np.arange(uhi.size, dtype=np.int64)
            pair_group = np.zeros(uhi.size, np.int64)
        starts = np.flatnonzero(np.concatenate(([True], sorted_pair[1:] != sorted_pair[:-1])))
        sizes = np.diff(np.append(starts, n))
        rank_in_pair = np.arange(n, dtype=np.int64) - starts[sorted_pair]
        first_rank = rank[order][starts]
        allowance, new_group, slot = self._allowances(step, local, pair_person, pair_group,
                                                      first_rank, n)
        kept_sorted = rank_in_pair < allowance[sorted_pair]
        first_sorted = kept_sorted & (rank_in_pair == 0) & new_group[sorted_pair]
        kept_per_pair = np.minimum(sizes, np.maximum(allowance, 0))
        self._record(step, local, pair_person, pair_group, allowance, new_group, slot,
                     kept_per_pair)
        self._scatter(local, where, uhi, ulo)
        keep = np.empty(n, np.bool_)
        keep[order] = kept_sorted
        first = np.empty(n, np.bool_)
        first[order] = first_sorted
        return keep, first

    def _keep_single(self, step: int, local: Columns, where: tuple[Ints, Ints, Ints],
                     uhi: Words, ulo: Words, pid: Ints, groups: Sequence[Hashable] | None,
                     rank: Ints) -> tuple[Bools, Bools]:
        """:meth:`keep` of a step where every person has exactly one event.

        The same rule with nothing to sort: each person's one event is its own (person,
        group) pair, with rank 0 in its pair and among the person's new groups, so it is
        kept iff its pair's allowance is positive (the general path's ``rank_in_pair <
        allowance`` at rank 0), and it is a first iff it is kept and its group is new.
        Pairs are indexed by the person's dense id.
        """
        m = uhi.size
        pair_group = np.zeros(m, np.int64)
        if self.rule.grouping == "key":
            assert groups is not None
            pair_group[pid] = self._intern(groups)
        first_rank = np.empty(m, np.int64)
        first_rank[pid] = rank
        allowance, new_group, slot = self._allowances(
            step, local, np.arange(m, dtype=np.int64), pair_group, first_rank, m,
            identity=True)
        kept_pair = allowance > 0
        self._record(step, local, np.arange(m, dtype=np.int64), pair_group, allowance,
                     new_group, slot, kept_pair.astype(np.int64))
        self._scatter(local, where, uhi, ulo)
        keep = kept_pair[pid]
        return keep, keep & new_group[pid]

    def _gather(self, uhi: Words, ulo: Words) -> tuple[Columns, tuple[Ints, Ints, Ints]]:
        """The step's people's columns (empty for people new this period), and where they are.

        Returns the columns, one row per person of the step, and, per person, the row in the
        main columns, the row in the delta (-1: not there) and the delta's insertion position.
        """
        at_main, in_main = _locate(self._main.hi, self._main.lo, uhi, ulo)
        at_delta, in_delta = _locate(self._delta.hi, self._delta.lo, uhi, ulo)
        main_row = np.where(in_main, at_main, -1)
        delta_row = np.where(in_delta, at_delta, -1)
        where = (main_row, delta_row, at_delta)
        for segment, held in ((self._main, in_main), (self._delta, in_delta)):
            if segment.size and bool(held.all()):  # all in one segment: one read a column
                row = main_row if segment is self._main else delta_row
                return {name: column[row] for name, column in segment.columns.items()}, where
        local = self._empty_columns(uhi.size)
        for segment, row in ((self._main, main_row), (self._delta, delta_row)):
            found = np.flatnonzero(row >= 0)
            if found.size:
                for name, column in segment.columns.items():
                    local[name][found] = column[row[found]]
        return local, where

    def _scatter(self, local: Columns, where: tuple[Ints, Ints, Ints], uhi: Words,
                 ulo: Words) -> None:
        """Write the step's people back; the new ones into the delta (then maybe compact)."""
        main_row, delta_row, at_delta = where
        for segment, row in ((self._main, main_row), (self._delta, delta_row)):
            found = np.flatnonzero(row >= 0)
            if found.size == row.size:  # all in this segment: one write a column
                for name, column in segment.columns.items():
                    column[row] = local[name]
                return
            if found.size:
                for name, column in segment.columns.items():
                    column[row[found]] = local[name][found]
        fresh = np.flatnonzero((main_row < 0) & (delta_row < 0))
        self._delta.insert(at_delta[fresh], uhi[fresh], ulo[fresh],
                           {name: column[fresh] for name, column in local.items()})
        if self._delta.size > max(_DELTA_MIN, _DELTA_GROWTH * math.isqrt(self._main.size)):
            self._compact()

    def _key_list(self) -> list[Hashable]:
        """The period's keys in the order of their ids (the snapshot's ``keys``)."""
        keys = np.empty(self._key_count, dtype=object)
        if self._dense is not None:  # the dense keys, placed in columns (Python ints out)
            dense = np.flatnonzero(self._dense >= 0)
            keys[self._dense[dense]] = dense
        out: list[Hashable] = keys.tolist()
        for key, i in self._keys.items():
            out[i] = key
        return out

    def _id_of(self, key: Hashable) -> int:
        """The period's id of one key, a new one if the key is new (Python, per key)."""
        found = self._keys.get(key)
        if found is not None:
            return found
        dense = self._dense
        if dense is not None and isinstance(key, int) and 0 <= key < dense.size:
            if dense[key] < 0:
                dense[key] = self._key_count
                self._key_count += 1
            return int(dense[key])
        found = self._keys[key] = self._key_count
        self._key_count += 1
        return found

    def _intern(self, groups: Sequence[Hashable]) -> Ints:
        """The period's exact integer id of each event's group key (new keys get new ids).

        The ids are exact: a key has one id in a period, whichever way it came (the dense
        table of small integer keys, or the dict of the others, both dropped with the period).
        """
        if isinstance(groups, np.ndarray) and groups.dtype.kind in "iub":
            return self._intern_integers(groups)
        table = self._keys
        if self._dense is None:  # every key of the period is in the dict
            for key in dict.fromkeys(groups):  # the distinct keys, in order of first appearance
                if key not in table:
                    table[key] = self._key_count
                    self._key_count += 1
            return np.fromiter(map(table.__getitem__, groups), np.int64, len(groups))
        ids = {key: self._id_of(key) for key in dict.fromkeys(groups)}  # first appearance
        return np.fromiter(map(ids.__getitem__, groups), np.int64, len(groups))

    def _intern_integers(self, groups: npt.NDArray[Any]) -> Ints:
        """:meth:`_intern` of integer keys without a Python step per event or known key.

        Keys in ``[0, 2^20)`` (declared positions, small codes) are looked up in a dense
        table (key -> id, -1: not yet interned; at most 4 MiB, per key, never per person);
        only the keys not found are made distinct (one sort of those), and the keys new this
        period get the next ids in increasing order: no Python work per event or per key.
        Other integers take the per-key path over the step's distinct keys.
        """
        values = groups.astype(np.int64).reshape(-1)
        if not values.size or int(values.min()) < 0 or int(values.max()) >= _DENSE_LIMIT:
            distinct, inverse = np.unique(values, return_inverse=True)
            ids = np.array([self._id_of(k) for k in distinct.tolist()], dtype=np.int64)
            return ids[inverse.reshape(-1)]
        top = int(values.max()) + 1
        dense = self._dense
        if dense is None or dense.size < top:
            size = max(top, 2 * dense.size if dense is not None else 0, 1 << 10)
            grown = np.full(min(size, _DENSE_LIMIT), -1, np.int32)
            if dense is not None:
                grown[:dense.size] = dense
            known = [(k, i) for k, i in self._keys.items()  # small keys the dict holds
                     if isinstance(k, int) and 0 <= k < grown.size]
            if known:
                at, ids = np.array(known, dtype=np.int64).T
                grown[at] = ids
            dense = self._dense = grown
        out = dense[values].astype(np.int64)
        missing = np.flatnonzero(out < 0)
        if missing.size and dense.size <= 16 * missing.size:  # the new keys by a bitmap
            absent = values[missing]
            marks = np.zeros(dense.size, np.bool_)
            marks[absent] = True
            distinct = np.flatnonzero(marks)  # increasing, as np.unique gives them
            dense[distinct] = np.arange(self._key_count, self._key_count + distinct.size,
                                        dtype=np.int32)
            self._key_count += distinct.size
            out[missing] = dense[absent]
        elif missing.size:
            distinct, inverse = np.unique(values[missing], return_inverse=True)
            new = np.arange(self._key_count, self._key_count + distinct.size, dtype=np.int64)
            self._key_count += distinct.size
            dense[distinct] = new
            out[missing] = new[inverse.reshape(-1)]
        return out

    def _allowances(self, step: int, local: Columns, pair_person: Ints, pair_group: Ints,
                    first_rank: Ints, n: int, identity: bool = False
                    ) -> tuple[Ints, Bools, Ints]:
        """How many events each (person, group) pair of the step may keep.

        Also whether the group is new to the person this period, and (grouping ``key``) the
        group's slot in the person's row (its slot so far, or the one a new group takes).
        ``identity``: pair ``i`` is person ``i`` (``pair_person`` is ``0 .. m - 1``: the
        rows are read in place).
        """
        rule = self.rule
        cap = rule.max_per_group
        pairs = pair_person.size
        if rule.grouping == "one":
            kept_before = local["count"][pair_person].astype(np.int64)
            return cap - kept_before, kept_before == 0, np.zeros(pairs, np.int64)
        if rule.grouping == "step":
            existing = local["last"][pair_person] == step
            kept_before = np.where(existing, local["count"][pair_person], 0)
            admitted = local["used"][pair_person].astype(np.int64) < rule.max_groups
            allowance = np.where(existing, cap - kept_before, np.where(admitted, cap, 0))
            return allowance, ~existing, np.zeros(pairs, np.int64)
        # grouping "key": is the pair's group one of the person's groups, in which slot?
        table = local["groups"]
        width = rule.max_groups
        slot = np.full(pairs, -1, np.int64)
        used = _row_counts(table != _NO_GROUP)
        chunk_pairs = max(1, _CHUNK // width)
        for begin in range(0, pairs, chunk_pairs):
            chunk = slice(begin, begin + chunk_pairs)
            rows = table[chunk] if identity else table[pair_person[chunk]]
            slot[chunk] = _match_slots(rows == pair_group[chunk, None])
        existing = slot >= 0
        kept_before = np.zeros(pairs, np.int64)
        hits = np.flatnonzero(existing)
        kept_before[hits] = local["counts"][pair_person[hits], slot[hits]]
        if identity:  # one pair a person: a new group is the person's only one, rank 0
            slot = np.where(existing, slot, used)
            allowance = np.where(existing, cap - kept_before, np.where(used < width, cap, 0))
            return allowance, ~existing, slot
        # new groups, per person in the order of their first event
        fresh = np.flatnonzero(~existing)
        fresh_person = pair_person[fresh]  # nondecreasing: pairs come by (person, group)
        if bool((fresh_person[1:] != fresh_person[:-1]).all()):
            order = fresh  # one new group a person (the usual step): already in order
        else:
            order = fresh[np.argsort(fresh_person * n + first_rank[fresh], kind="stable")]
        person = pair_person[order]
        begins = np.concatenate(([True], person[1:] != person[:-1]))
        index = np.arange(order.size, dtype=np.int64)
        new_rank = index - np.maximum.accumulate(np.where(begins, index, 0))
        slot[order] = used[person] + new_rank
        admitted = np.zeros(pairs, np.bool_)
        admitted[order] = slot[order] < width
        allowance = np.where(existing, cap - kept_before, np.where(admitted, cap, 0))
        return allowance, ~existing, slot

    def _record(self, step: int, local: Columns, pair_person: Ints, pair_group: Ints,
                allowance: Ints, new_group: Bools, slot: Ints, kept: Ints) -> None:
        """Add the step's kept events to the step's people's columns."""
        grouping = self.rule.grouping
        if grouping == "one":
            local["count"][pair_person] += kept.astype(local["count"].dtype)
        elif grouping == "step":
            old = ~new_group
            local["count"][pair_person[old]] += kept[old].astype(local["count"].dtype)
            start = new_group & (allowance > 0)
            person = pair_person[start]
            local["used"][person] += local["used"].dtype.type(1)
            local["last"][person] = step
            local["count"][person] = kept[start]
        else:
            held = np.flatnonzero(~new_group)
            local["counts"][pair_person[held], slot[held]] += kept[held].astype(
                local["counts"].dtype)
            added = np.flatnonzero(new_group & (allowance > 0))
            local["groups"][pair_person[added], slot[added]] = pair_group[added]
            local["counts"][pair_person[added], slot[added]] = kept[added]


def _counter(cap: int) -> type[np.unsignedinteger[Any]]:
    """The narrowest column that counts up to ``cap`` (uint8 up to 255, else uint16)."""
    return np.uint8 if cap <= np.iinfo(np.uint8).max else np.uint16


_BYTE_SUM: Final = np.uint64(0x0101010101010101)
_BYTE_INDEX: Final = np.uint64(0x0001020304050607)
_TOP_BYTE: Final = np.uint64(56)


def _row_counts(marks: Bools) -> Ints:
    """The number of true cells of each row (exact; eight-wide rows as one word each).

    A C-ordered row of eight bools read as one little-endian uint64 ``x`` has byte ``j`` equal
    to cell ``j`` (0 or 1); the top byte of ``x * 0x0101010101010101`` (mod 2^64) is the sum
    of the eight bytes (each partial sum is at most 8: no carry reaches it).
    """
    if marks.shape[1] == 8 and marks.flags.c_contiguous:
        words = marks.view("<u8").reshape(-1)
        return ((words * _BYTE_SUM) >> _TOP_BYTE).astype(np.int64)
    counts = np.zeros(marks.shape[0], np.int64)
    for column in marks.T:
        counts += column
    return counts


def _match_slots(match: Bools) -> Ints:
    """Per row, the index of its one true cell, or -1 when none (at most one true a row).

    Eight-wide rows as one little-endian uint64 ``x = 2^(8j)`` (cell ``j`` true) or 0: the
    top byte of ``x * 0x0001020304050607`` is ``j`` (byte ``7 - j`` of the factor), exactly
    when one cell is true, which holds here: a group is at most once in a person's row.
    """
    if match.shape[1] == 8 and match.flags.c_contiguous:
        words = match.view("<u8").reshape(-1)
        index = ((words * _BYTE_INDEX) >> _TOP_BYTE).astype(np.int64)
        return np.where(words != 0, index, -1)
    hit = match.any(axis=1)
    return np.where(hit, match.argmax(axis=1), -1)


def _ranks(partition: Ints, offset: Ints) -> Ints:
    """Each event's rank in ``(partition, offset)`` order; a repeated pair keeps its input order.

    A pair repeats only when a partition's offsets went back (a topic re-created or truncated
    while a step was open: the source reads on and says so). ``np.lexsort`` is stable, so the
    repeated events are ranked in the order they were given, which is the order the partition
    delivered them (the stage merges one partition's batches in order): still a function of
    the input alone, and one record can never stop the flow (pitfall 16).
    """
    n = partition.size
    later = (partition[1:] > partition[:-1]) | ((partition[1:] == partition[:-1])
                                                 & (offset[1:] > offset[:-1]))
    if bool(later.all()):
        return np.arange(n, dtype=np.int64)
    order = np.lexsort((offset, partition))
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n, dtype=np.int64)
    return rank


def _dense_people(hi: Words, lo: Words) -> tuple[Ints, Words, Words]:
    """Dense person ids (in hash order) of the events, and the distinct hashes' words."""
    order = np.argsort(hi)
    hs, ls = hi[order], lo[order]
    same = hs[1:] == hs[:-1]
    if bool((same & (ls[1:] != ls[:-1])).any()):  # two people share the high word: rare
        order = np.lexsort((lo, hi))
        hs, ls = hi[order], lo[order]
        same = (hs[1:] == hs[:-1]) & (ls[1:] == ls[:-1])
    begins = np.concatenate(([True], ~same))
    pid = np.empty(hi.size, np.int64)
    pid[order] = np.cumsum(begins) - 1
    return pid, hs[begins], ls[begins]


def _locate(hi: Words, lo: Words, qhi: Words, qlo: Words) -> tuple[Ints, Bools]:
    """Where each queried hash is (or would be inserted) in columns sorted by (hi, lo)."""
    size = hi.size
    left = np.searchsorted(hi, qhi, side="left").astype(np.int64)
    if not size:
        return left, np.zeros(qhi.size, np.bool_)
    at = np.minimum(left, size - 1)
    equal = (hi[at] == qhi) & (left < size)
    many = equal & (left + 1 < size) & (hi[np.minimum(left + 1, size - 1)] == qhi)
    stored = lo[at]  # the one stored hash of this high word, where ``equal`` and not ``many``
    found = equal & (stored == qlo)
    position = left + (equal & (stored < qlo))
    for i in np.flatnonzero(many).tolist():  # shared high words: rare (set apart from above)
        begin = int(left[i])
        end = int(np.searchsorted(hi, qhi[i], side="right"))
        spot = begin + int(np.searchsorted(lo[begin:end], qlo[i]))
        position[i] = spot
        found[i] = spot < end and lo[spot] == qlo[i]
    return position, found


def _by_pair(pid: Ints, gid: Ints, groups: int, rank: Ints) -> tuple[Ints, Ints, Ints, Ints]:
    """The events in (person, group, rank) order, their pairs' dense ids, each pair's parts.

    One sort of the composite ``(pid groups + gid) n + rank`` when it fits in 62 bits (ranks
    are distinct, so no two events tie), else a lexsort of the three.
    """
    n = pid.size
    span = (int(pid.max()) + 1) * max(groups, 1)
    if span * n < _COMPOSITE_LIMIT:
        composite = (pid * groups + gid) * n + rank
        order = np.argsort(composite)
        pair_key = composite[order] // n
        p = pair_key // max(groups, 1)
        g = pair_key - p * groups
    else:
        order = np.lexsort((rank, gid, pid))
        p, g = pid[order], gid[order]
    begins = np.concatenate(([True], (p[1:] != p[:-1]) | (g[1:] != g[:-1])))
    sorted_pair = np.cumsum(begins) - 1
    return order, sorted_pair, p[begins], g[begins]


assert HASH_BYTES == 16  # two uint64 words a person
