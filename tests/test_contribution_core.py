"""Contribution bounding's core: the keyed person hash, the rule, and the bounder's decisions.

The bounder is checked against a plain-Python reference (the rule as the issue states it: per
person and period, events in (partition, offset) order, a group's event kept while the group
holds fewer than max_per_group, a new group added while the person holds fewer than max_groups)
on random streams, and for the properties the privacy argument rests on: the decisions do not
depend on the order events are given within a step, on a snapshot and restore between steps, or
on any other person's events.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Hashable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.config import ContributionConfig
from dpstream.core.contribution import (
    PEOPLE_BOUND,
    BoundingRule,
    ContributionBounder,
    PersonHasher,
    collision_delta,
    person_shards,
)
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError

KEY = bytes(range(32))
Event = tuple[bytes, Hashable, int, int]  # (person hash, group, partition, offset)
Step = tuple[int, list[Event]]


def person(hi: int, lo: int) -> bytes:
    """A person's hash spelled from two words: a small hi space forces shared high words."""
    return hi.to_bytes(8, "big") + lo.to_bytes(8, "big")


def reference(rule: BoundingRule, steps: list[Step]) -> list[tuple[list[bool], list[bool]]]:
    """The rule, one event at a time (what the vectorised bounder must reproduce)."""
    held: dict[bytes, dict[Hashable, int]] = {}
    period: int | None = None
    out = []
    for step, events in steps:
        if rule.period_of(step) != period:
            held, period = {}, rule.period_of(step)
        keep = [False] * len(events)
        first = [False] * len(events)
        for i in sorted(range(len(events)), key=lambda i: (events[i][2], events[i][3])):
            who, key, _, _ = events[i]
            group = key if rule.grouping == "key" else step if rule.grouping == "step" else 0
            groups = held.setdefault(who, {})
            if group in groups:
                if groups[group] < rule.max_per_group:
                    groups[group] += 1
                    keep[i] = True
            elif len(groups) < rule.max_groups:
                groups[group] = 1
                keep[i] = first[i] = True
        out.append((keep, first))
    return out


def run(bounder: ContributionBounder, step: int, events: list[Event]
        ) -> tuple[list[bool], list[bool]]:
    people = np.frombuffer(b"".join(e[0] for e in events), dtype="V16")
    keep, first = bounder.keep(step, people, [e[1] for e in events],
                               np.array([e[2] for e in events], np.int64),
                               np.array([e[3] for e in events], np.int64))
    assert keep.dtype == np.bool_ and first.dtype == np.bool_
    assert keep.shape == first.shape == (len(events),)
    return keep.tolist(), first.tolist()


@st.composite
def rules(draw: st.DrawFn) -> BoundingRule:
    grouping = draw(st.sampled_from(["key", "step", "one"]))
    groups = 1 if grouping == "one" else draw(st.integers(1, 4))
    period = draw(st.one_of(st.none(), st.integers(1, 4)))
    return BoundingRule(grouping, groups, draw(st.integers(1, 3)), period)


@st.composite
def streams(draw: st.DrawFn) -> list[Step]:
    """Steps in increasing order; people from a small pool (some sharing a high word)."""
    pool = [person(draw(st.integers(0, 2)), draw(st.integers(0, 3)))
            for _ in range(draw(st.integers(1, 7)))]
    keys: list[Hashable] = ["a", "b", "c", 1, 2, "é"]
    steps: list[Step] = []
    step = draw(st.integers(0, 3))
    next_offset = [0, 0, 0]
    for _ in range(draw(st.integers(1, 6))):
        events: list[Event] = []
        for _ in range(draw(st.integers(0, 14))):
            partition = draw(st.integers(0, 2))
            next_offset[partition] += draw(st.integers(1, 3))
            events.append((draw(st.sampled_from(pool)), draw(st.sampled_from(keys)), partition,
                           next_offset[partition]))
        events = draw(st.permutations(events))
        steps.append((step, events))
        step += draw(st.integers(1, 3))
    return steps


def decisions(rule: BoundingRule, steps: list[Step]) -> list[tuple[list[bool], list[bool]]]:
    bounder = ContributionBounder(rule)
    return [run(bounder, step, events) for step, events in steps]


@settings(max_examples=400, deadline=None)
@given(rules(), streams())
def test_decisions_equal_the_plain_python_rule(rule: BoundingRule, steps: list[Step]) -> None:
    assert decisions(rule, steps) == reference(rule, steps)


@settings(max_examples=200, deadline=None)
@given(rules(), streams(), st.randoms(use_true_random=False))
def test_the_order_within_a_step_decides_nothing(rule: BoundingRule, steps: list[Step],
                                                 rnd: random.Random) -> None:
    expected = decisions(rule, steps)
    shuffled, back = [], []
    for step, events in steps:
        order = list(range(len(events)))
        rnd.shuffle(order)
        shuffled.append((step, [events[i] for i in order]))
        back.append(order)
    got = decisions(rule, shuffled)
    for (keep, first), (keep2, first2), order in zip(expected, got, back, strict=True):
        assert [keep[i] for i in order] == keep2 and [first[i] for i in order] == first2


@settings(max_examples=200, deadline=None)
@given(rules(), streams(), st.integers(0, 6))
def test_a_snapshot_and_restore_between_steps_decides_nothing(rule: BoundingRule,
                                                              steps: list[Step],
                                                              cut: int) -> None:
    expected = decisions(rule, steps)
    bounder = ContributionBounder(rule)
    got = []
    for i, (step, events) in enumerate(steps):
        if i == cut:
            state = pickle.loads(pickle.dumps(bounder.to_state()))
            bounder = ContributionBounder(rule, state)
            again = bounder.to_state()
            assert pickle.dumps(again) == pickle.dumps(state)  # the round trip is exact
        got.append(run(bounder, step, events))
    assert got == expected


@settings(max_examples=300, deadline=None)
@given(rules(), streams(), st.integers(0, 6))
def test_removing_one_person_changes_no_one_elses_decisions(rule: BoundingRule,
                                                            steps: list[Step],
                                                            which: int) -> None:
    people = sorted({e[0] for _, events in steps for e in events})
    if not people:
        return
    gone = people[which % len(people)]
    with_all = decisions(rule, steps)
    without = decisions(rule, [(s, [e for e in events if e[0] != gone]) for s, events in steps])
    for (step_events, (keep, first), (keep2, first2)) in zip(
            [events for _, events in steps], with_all, without, strict=True):
        others = [i for i, e in enumerate(step_events) if e[0] != gone]
        assert [keep[i] for i in others] == keep2
        assert [first[i] for i in others] == first2


def test_caps_are_respected_exactly_for_a_heavy_person() -> None:
    """One person with 1000 events over 50 keys keeps exactly max_keys x max_per_key."""
    rng = np.random.default_rng(7)
    rule = BoundingRule("key", 3, 5)
    bounder = ContributionBounder(rule)
    heavy, light = person(5, 5), person(6, 6)
    events: list[Event] = [(heavy, f"k{int(k)}", 0, i) for i, k in
                           enumerate(rng.integers(0, 50, 1000))]
    events.append((light, "k0", 1, 0))
    keep, first = run(bounder, 0, events)
    kept_keys: dict[Hashable, int] = {}
    for (_who, key, _, _), kept in zip(events[:-1], keep[:-1], strict=True):
        if kept:
            kept_keys[key] = kept_keys.get(key, 0) + 1
    assert len(kept_keys) == 3 and sum(kept_keys.values()) == 15  # every key had >= 5 events
    assert kept_keys == dict.fromkeys(kept_keys, 5)
    # the three keys are the first three distinct keys in offset order
    assert list(kept_keys) == list(dict.fromkeys(e[1] for e in events[:-1]))[:3]
    assert sum(first[:-1]) == 3 and keep[-1] and first[-1]
    # a later step of the same (lifetime) period adds nothing for the full person
    keep2, first2 = run(bounder, 1, [(heavy, "k999", 0, 1000), (heavy, events[0][1], 0, 1001)])
    assert keep2 == [False, False] and first2 == [False, False]


@pytest.mark.parametrize("grouping", ["key", "step", "one"])
def test_caps_above_255_count_in_sixteen_bits(grouping: str) -> None:
    rule = BoundingRule(grouping, 1 if grouping == "one" else 300, 300)
    bounder = ContributionBounder(rule)
    who = person(3, 4)
    for step in range(3):
        events: list[Event] = [(who, "k", 0, 1000 * step + i) for i in range(280)]
        keep, _ = run(bounder, step, events)
        total = 280 * (step + 1)
        if grouping == "step":  # a new block every step: 280 of each
            assert sum(keep) == 280
        else:  # one key / one group: 300 in all
            assert sum(keep) == min(280, max(0, 300 - 280 * step))
        assert total >= sum(keep)
    assert bounder.nbytes == 16 + {"key": 300 * 6, "step": 2 + 8 + 2, "one": 2}[grouping]


def test_step_and_one_groupings_count_blocks_and_rows() -> None:
    who = person(1, 2)
    steps = ContributionBounder(BoundingRule("step", 2, 3))
    assert run(steps, 0, [(who, None, 0, i) for i in range(5)])[0] == [True] * 3 + [False] * 2
    assert run(steps, 1, [(who, None, 0, 10)])[0] == [True]
    assert run(steps, 2, [(who, None, 0, 11)])[0] == [False]  # two blocks used
    one = ContributionBounder(BoundingRule("one", 1, 4))
    assert run(one, 0, [(who, None, 0, i) for i in range(3)])[0] == [True] * 3
    keep, first = run(one, 5, [(who, None, 0, i) for i in range(3, 6)])
    assert keep == [True, False, False] and first == [False] * 3


def test_first_counts_distinct_people_per_key() -> None:
    rng = np.random.default_rng(3)
    bounder = ContributionBounder(BoundingRule("key", 2, 3))
    seen: dict[str, set[bytes]] = {}
    for step in range(4):
        events: list[Event] = [(person(int(p), 0), f"k{int(k)}", 0, i) for i, (p, k) in
                               enumerate(zip(rng.integers(0, 30, 200), rng.integers(0, 6, 200),
                                             strict=True))]
        keep, first = run(bounder, step, events)
        for (who, key, _, _), kept, is_first in zip(events, keep, first, strict=True):
            assert not is_first or kept
            if kept:
                assert is_first == (who not in seen.setdefault(str(key), set()))
                seen[str(key)].add(who)


def test_a_new_period_resets_and_the_state_does_not_grow_with_periods() -> None:
    rule = BoundingRule("key", 2, 1, period_steps=3)
    bounder = ContributionBounder(rule)
    who = person(9, 9)
    sizes = []
    for step in range(0, 30):
        events: list[Event] = [(person(step % 3, i), "a", 0, i) for i in range(50)]
        events.append((who, "a", 1, 0))
        keep, _ = run(bounder, step, events)
        assert keep[-1] == (step % 3 == 0)  # once per period: max_per_key = 1
        assert bounder.period == step // 3
        sizes.append((bounder.people, bounder.nbytes, len(bounder.to_state()["keys"])))
    # within a period the people seen accumulate; each new period starts from nothing
    assert sizes[0][0] == 51 and sizes[2][0] == 151 and sizes[3][0] == 51
    assert max(sizes) == sizes[2] == sizes[-1]
    assert sizes[-1][1] == 151 * (16 + 5 * 2)  # uint8 counts: the cap is below 256


def test_state_holds_hashes_never_ids_and_refuses_other_caps() -> None:
    hasher = PersonHasher(KEY)
    ids = ["alice@example.org", "bob@example.org"]
    rule = BoundingRule("key", 2, 2)
    bounder = ContributionBounder(rule)
    bounder.keep(2, hasher.hash_many(ids), ["x", "y"], [0, 0], [0, 1])
    blob = pickle.dumps(bounder.to_state())
    assert all(i.encode() not in blob for i in ids)
    with pytest.raises(InvalidParameterError, match="caps"):
        ContributionBounder(BoundingRule("key", 2, 3), bounder.to_state())
    with pytest.raises(InvalidParameterError, match="increasing order"):
        bounder.keep(1, hasher.hash_many(ids), ["x", "y"], [0, 0], [0, 1])
    with pytest.raises(InvalidParameterError, match="one group per event"):
        bounder.keep(3, hasher.hash_many(ids), ["x"], [0, 0], [4, 5])


def test_the_hasher_is_keyed_deterministic_and_sixteen_bytes() -> None:
    ids = ["u1", "u2", "u1", "", "ü", "u2"]
    one, again = PersonHasher(KEY).hash_many(ids), PersonHasher(KEY).hash_many(ids)
    other = PersonHasher(bytes(range(1, 33))).hash_many(ids)
    assert one.dtype == np.dtype("V16") and one.shape == (6,)
    assert one.tobytes() == again.tobytes()
    assert one[0] == one[2] and one[1] == one[5] and len({h.tobytes() for h in one}) == 4
    assert not set(h.tobytes() for h in one) & set(h.tobytes() for h in other)
    hasher = PersonHasher(KEY)
    assert [hasher.hash_one(i) for i in ids] == [h.tobytes() for h in one]
    assert "secret" in repr(hasher) and KEY.hex() not in repr(hasher)
    with pytest.raises(TypeError):
        pickle.dumps(hasher)
    with pytest.raises(InvalidParameterError):
        PersonHasher(b"short")
    assert PersonHasher(KEY).hash_many([]).shape == (0,)


def test_a_flows_hasher_is_keyed_by_its_people_lane() -> None:
    noise = NoiseKey(bytes(range(32)))
    ids = ["u1", "u2"]
    flow = PersonHasher.for_flow(noise, "instance-a", "flow").hash_many(ids)
    lane = PersonHasher(noise.lane("instance-a", "flow", "people")).hash_many(ids)
    assert flow.tobytes() == lane.tobytes()
    other = PersonHasher.for_flow(noise, "instance-b", "flow").hash_many(ids)
    assert not set(flow.tobytes()[i:i + 16] for i in (0, 16)) & \
        set(other.tobytes()[i:i + 16] for i in (0, 16))


def test_v16_sorts_as_the_big_endian_integer_and_shards_by_it() -> None:
    hashes = PersonHasher(KEY).hash_many([f"p{i}" for i in range(500)])
    as_int = [int.from_bytes(h.tobytes(), "big") for h in hashes]
    assert [int.from_bytes(h.tobytes(), "big") for h in np.sort(hashes)] == sorted(as_int)
    shards = person_shards(hashes, 7)
    assert shards.dtype == np.int64
    assert shards.tolist() == [(v >> 64) % 7 for v in as_int]
    assert set(shards.tolist()) == set(range(7))


def test_collision_delta_is_people_times_two_to_the_minus_128() -> None:
    assert collision_delta(0) == 0.0
    assert collision_delta(1) >= 2.0**-128
    assert collision_delta(PEOPLE_BOUND) >= 2.0**-64
    assert collision_delta(PEOPLE_BOUND) < 5.43e-20
    with pytest.raises(InvalidParameterError):
        collision_delta(-1)


def test_rules_come_from_the_contribution_table() -> None:
    def table(**caps: int) -> ContributionConfig:
        return ContributionConfig("user", "uid", 4, tuple(caps.items()))

    assert BoundingRule.from_contribution(table(max_keys=8, max_per_key=2)) == \
        BoundingRule("key", 8, 2, 4)
    assert BoundingRule.from_contribution(table(max_rows=5)) == BoundingRule("one", 1, 5, 4)
    assert BoundingRule.from_contribution(table(max_blocks=3, max_rows_per_block=7)) == \
        BoundingRule("step", 3, 7, 4)
    with pytest.raises(InvalidParameterError):
        BoundingRule.from_contribution(ContributionConfig())
    with pytest.raises(InvalidParameterError):
        BoundingRule("one", 2, 1)
    with pytest.raises(InvalidParameterError):
        BoundingRule("key", 1, 70_000)


def test_integer_group_arrays_are_interned_like_lists() -> None:
    rng = np.random.default_rng(11)
    rule = BoundingRule("key", 3, 2)
    a, b = ContributionBounder(rule), ContributionBounder(rule)
    hashes = PersonHasher(KEY).hash_many([f"p{int(i)}" for i in rng.integers(0, 40, 400)])
    for step in range(3):
        keys = rng.integers(0, 9, 400)
        offsets = np.arange(400) + 400 * step
        got_a = a.keep(step, hashes, keys, np.zeros(400, np.int64), offsets)
        got_b = b.keep(step, hashes, keys.tolist(), np.zeros(400, np.int64), offsets)
        assert all((x == y).all() for x, y in zip(got_a, got_b, strict=True))


@settings(max_examples=200, deadline=None)
@given(rules(), streams(), st.integers(0, 6))
def test_the_delta_merges_and_chunked_lookups_decide_nothing(rule: BoundingRule,
                                                             steps: list[Step],
                                                             cut: int) -> None:
    """With a delta merged after every few new people, tiny comparison chunks, and (for odd
    cuts) the lexsort that replaces the composite sort when it would overflow."""
    from unittest import mock

    from dpstream.core.contribution import bounder as module

    with mock.patch.object(module, "_DELTA_MIN", 2), \
            mock.patch.object(module, "_DELTA_GROWTH", 1), \
            mock.patch.object(module, "_CHUNK", 3), \
            mock.patch.object(module, "_COMPOSITE_LIMIT", 2 if cut % 2 else 1 << 62):
        bounder = ContributionBounder(rule)
        got = []
        for i, (step, events) in enumerate(steps):
            if i == cut:
                bounder = ContributionBounder(rule, bounder.to_state())
            got.append(run(bounder, step, events))
            held = {e[0] for s, evs in steps[:i + 1] for e in evs
                    if rule.period_of(s) == rule.period_of(step)}
            assert bounder.people == len(held)
    assert got == reference(rule, steps)


@pytest.mark.parametrize("grouping", ["key", "step", "one"])
def test_a_larger_skewed_stream_matches_the_reference(grouping: str) -> None:
    """20 k events a step from 1.5 k people (Zipf: a few heavy people), 4 partitions
    interleaved, over 6 steps across two periods, against the plain-Python rule."""
    rng = np.random.default_rng(24)
    rule = BoundingRule(grouping, 1 if grouping == "one" else 5, 3, period_steps=4)
    pool = [person(int(rng.integers(0, 40)), i) for i in range(1500)]  # shared high words
    steps: list[Step] = []
    for step in (0, 1, 3, 4, 5, 9):
        who = (rng.zipf(1.5, 20_000) - 1) % len(pool)
        key = (rng.zipf(1.3, 20_000) - 1) % 300
        partition = rng.integers(0, 4, 20_000)
        events: list[Event] = [(pool[w], f"k{k}" if k % 2 else int(k), int(p), step * 10**6 + i)
                               for i, (w, k, p) in enumerate(zip(who.tolist(), key.tolist(),
                                                                 partition.tolist(),
                                                                 strict=True))]
        steps.append((step, events))
    expected = reference(rule, steps)
    assert decisions(rule, steps) == expected
    kept = sum(sum(keep) for keep, _ in expected)
    assert 0 < kept < sum(len(events) for _, events in steps)  # the caps bind, not everything


def test_a_hash_depends_on_its_id_alone_never_on_the_batch() -> None:
    """Batch-independent (any mix of lengths, short and long headers), keyed, collision-free."""
    rng = np.random.default_rng(24)
    ids = [f"user-{i}" for i in range(3000)] + ["", "\0", "a\0", "a", "ü" * 7, "ü" * 8,
                                               "x" * 14, "x" * 15, "y" * 254, "y" * 255,
                                               "z" * 600, "\udc80", "p@example.org" * 3]
    hasher = PersonHasher(KEY)
    alone = [hasher.hash_one(i) for i in ids]
    together = hasher.hash_many(ids)
    assert [h.tobytes() for h in together] == alone
    for _ in range(5):  # shuffled, cut at random: each id's hash is the same
        order = rng.permutation(len(ids))
        cut = int(rng.integers(1, len(ids)))
        parts = [order[:cut], order[cut:]]
        for part in parts:
            hashes = hasher.hash_many([ids[i] for i in part.tolist()])
            assert [h.tobytes() for h in hashes] == [alone[i] for i in part.tolist()]
    assert len(set(alone)) == len(ids)  # 128 bits: no collision among distinct ids
    other = PersonHasher(bytes(range(1, 33))).hash_many(ids)
    assert not {h.tobytes() for h in other} & set(alone)  # another key: other hashes
    with pytest.raises(InvalidParameterError, match="must be a str") as caught:
        hasher.hash_many(["fine", 12345])  # type: ignore[list-item]
    assert "12345" not in str(caught.value)


def test_ids_of_one_length_hash_as_in_a_mixed_batch() -> None:
    """A batch of ids of one byte length (hashed from one row copy) gives each id the hash
    it has in a batch of mixed lengths (the general path), for lengths of one and several
    blocks and non-ASCII ids; and the shard of a power-of-two count (read from one byte) is
    the first word modulo the count, as for any other count."""
    hasher = PersonHasher(KEY)
    for length in (1, 13, 14, 15, 30, 254):
        same = [f"{i:0{length}d}"[-length:] for i in range(200)]
        mixed = hasher.hash_many([*same, "ab", "x" * 300])[:200]
        assert [h.tobytes() for h in hasher.hash_many(same)] == [h.tobytes() for h in mixed]
    accents = [f"é{i:03d}" for i in range(100)] + ["\udc80é"]  # 5 bytes each
    assert ([h.tobytes() for h in hasher.hash_many(accents)]
            == [h.tobytes() for h in hasher.hash_many([*accents, "a"])[:-1]])
    hashes = hasher.hash_many([f"user-{i}" for i in range(4000)])
    first = hashes.view(">u8").reshape(-1, 2)[:, 0].astype(np.uint64)
    for shards in (1, 2, 3, 16, 100, 128, 256, 512):
        expected = (first % np.uint64(shards)).astype(np.int64)
        assert np.array_equal(person_shards(hashes, shards), expected)
        assert np.array_equal(person_shards(hashes[1::3], shards), expected[1::3])


@pytest.mark.statistical
def test_person_hashes_do_not_collide_on_many_ids() -> None:
    """200,000 ids of one to three blocks: 2^-128 a pair makes any collision a bug.

    The expected number of colliding pairs of a random function is ``n^2 / 2^129`` (about
    ``6e-29`` here), and the high words alone (64 bits) collide with probability about
    ``n^2 / 2^65 = 1.1e-9``: both must be none. The shard spread is a power check that the
    output is not degenerate: each of 16 shards gets 12,500 ids on average, with a binomial
    standard deviation of ``sqrt(200000 (1/16)(15/16)) = 108``; 6 standard deviations (650)
    bound every shard with probability above ``1 - 16 * 2e-9``.
    """
    n = 200_000
    ids = [f"{i}:" + "x" * (i % 40) for i in range(n)]
    hashes = PersonHasher(KEY).hash_many(ids)
    assert np.unique(hashes).size == n
    words = hashes.view(">u8").reshape(-1, 2)
    assert np.unique(words[:, 0]).size == n
    counts = np.bincount(person_shards(hashes, 16), minlength=16)
    assert np.abs(counts - n / 16).max() < 650


def test_integer_keys_in_columns_decide_as_keys_in_a_list() -> None:
    """Integer keys as an array (dense and sparse interning) keep what the same keys as a
    list keep, across steps, a period boundary, restores and keys given both ways to one
    bounder."""
    rng = np.random.default_rng(7)
    hasher = PersonHasher(KEY)
    rule = BoundingRule("key", 3, 2, period_steps=3)
    steps = []
    for step in range(7):
        n = 400
        people = hasher.hash_many([f"p{i}" for i in rng.integers(0, 60, n).tolist()])
        keys = rng.integers(0, 50, n) * (1 if step % 3 else 40_000)  # dense, then sparse
        if step == 5:
            keys = keys - 20  # negative keys: the dict walk
        steps.append((step, people, keys, rng.permutation(n)))
    as_array, as_list = ContributionBounder(rule), ContributionBounder(rule)
    kept_steps = []
    for step, people, keys, offsets in steps:
        mixed = keys if step % 2 == 0 else keys.tolist()  # both ways into one bounder
        kept_a, first_a = as_array.keep(step, people, mixed, np.zeros(keys.size), offsets)
        kept_l, first_l = as_list.keep(step, people, keys.tolist(), np.zeros(keys.size),
                                       offsets)
        assert kept_a.tolist() == kept_l.tolist() and first_a.tolist() == first_l.tolist()
        assert int(kept_a.sum()) < keys.size  # the caps bite: the comparison has power
        kept_steps.append(int(kept_a.sum()))
        state = as_array.to_state()
        assert sorted(state["keys"]) == sorted(set(keys.tolist()) | set(state["keys"]))
        assert len(set(state["keys"])) == len(state["keys"])  # one id a key
        if step in (1, 5):  # else the same bounder takes array and list keys in turn
            as_array = ContributionBounder(rule, state)
    assert kept_steps[0] > 0 and kept_steps[3] > 0 and kept_steps[6] > 0  # each period keeps


def test_a_state_of_the_previous_hash_is_refused() -> None:
    """Version 1 states held BLAKE2b hashes; under the new hash their people would get fresh
    caps, so such a state is refused rather than resumed."""
    rule = BoundingRule("key", 2, 2)
    bounder = ContributionBounder(rule)
    bounder.keep(0, PersonHasher(KEY).hash_many(["a", "b"]), ["x", "y"], [0, 0], [0, 1])
    state = {**bounder.to_state(), "version": 1}
    with pytest.raises(InvalidParameterError, match="version 2"):
        ContributionBounder(rule, state)


@pytest.mark.parametrize("width", [8, 6])
def test_eight_wide_rows_and_one_event_steps_match_the_reference(width: int) -> None:
    """The word-at-a-time row reads (eight groups a person: the counters' default L0) and the
    one-event-a-person steps, against the plain-Python rule: 400 people over steps that
    alternate one event a person (the sort-free path) and Zipf-heavy people (the general
    path), in one period and across a boundary, with a restore in between; the caps bind."""
    rng = np.random.default_rng(8)
    rule = BoundingRule("key", width, 2, period_steps=5)
    pool = [person(int(rng.integers(0, 30)), i) for i in range(400)]
    steps: list[Step] = []
    for step in range(9):
        if step % 2 == 0:  # every person once, in a shuffled order
            who = rng.permutation(len(pool))
        else:
            who = (rng.zipf(1.4, 3000) - 1) % len(pool)
        key = rng.integers(0, 12, who.size)
        partition = rng.integers(0, 3, who.size)
        events: list[Event] = [(pool[w], int(k), int(p), step * 10**6 + i)
                               for i, (w, k, p) in enumerate(zip(
                                   who.tolist(), key.tolist(), partition.tolist(), strict=True))]
        steps.append((step, events))
    expected = reference(rule, steps)
    bounder = ContributionBounder(rule)
    got = []
    for i, (step, events) in enumerate(steps):
        if i == 4:
            bounder = ContributionBounder(rule, bounder.to_state())
        got.append(run(bounder, step, events))
    assert got == expected
    kept = [sum(keep) for keep, _ in expected]
    assert all(k > 0 for k in kept)
    assert sum(kept) < sum(len(events) for _, events in steps)  # the caps bind
    full = sum(1 for keep, _ in expected[2:5] for k in keep if not k)  # rows fill up to width
    assert full > 0


def test_a_repeated_partition_and_offset_is_decided_in_input_order() -> None:
    """Offsets that went back (a re-created topic) never stop the flow: ties keep input order."""
    hasher = PersonHasher(KEY)
    one = hasher.hash_many(["carol"] * 3)
    bounder = ContributionBounder(BoundingRule("key", 1, 1))
    keep, first = bounder.keep(0, one, ["b", "a", "a"], [0, 0, 0], [7, 7, 3])
    # (0, 3) first, then the two events at (0, 7) in the order given: "b" before the second "a"
    assert keep.tolist() == [False, False, True] and first.tolist() == [False, False, True]
    again = ContributionBounder(BoundingRule("key", 1, 1))
    keep, _ = again.keep(0, one, ["b", "a", "b"], [0, 0, 0], [7, 7, 9])
    assert keep.tolist() == [True, False, False]  # "b" at (0, 7) given first: it is kept
