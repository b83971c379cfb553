"""KeyIndex: the key table's key -> row index, against a dict (the behaviour it replaces)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.core.counting import key_index
from dpstream.core.counting.key_index import KeyIndex

KEYS = st.text(min_size=0, max_size=6)


def expected_rows(names: list[str], queries: list[str]) -> list[int]:
    where = {k: i for i, k in enumerate(names)}
    return [where.get(q, -1) for q in queries]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(KEYS, max_size=40), max_size=8), st.lists(KEYS, max_size=60),
       st.integers(0, 7), st.booleans())
def test_appends_rebuilds_and_lookups_agree_with_a_dict(batches: list[list[str]],
                                                        queries: list[str],
                                                        drop_every: int,
                                                        as_tuples: bool) -> None:
    names: list[str] = []
    index = KeyIndex()
    for batch in batches:
        fresh = list(dict.fromkeys(k for k in batch if k not in set(names)))
        names.extend(fresh)
        index.append(tuple(fresh) if as_tuples else fresh)  # a tuple may be kept as it is
        assert list(index) == names and len(index) == len(names)
        if drop_every and len(names) > drop_every:  # remove some rows, keep the order
            names = [k for i, k in enumerate(names) if i % drop_every]
            index.rebuild(names)
        assert len(index) == len(names)
        assert list(index) == names
        assert index.rows(names).tolist() == list(range(len(names)))
    probe = queries + names[::3]
    assert index.rows(probe).tolist() == expected_rows(names, probe)
    for q in probe[:10]:
        assert (q in index) == (q in names)


def test_every_key_in_one_slot_chain_is_still_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hash that sends every key to the same slot only costs probes: rows stay exact."""
    monkeypatch.setattr(key_index, "_hashes",
                        lambda keys: np.full(len(keys), 12345, dtype=np.uint64))
    names = [f"k{i}" for i in range(300)]
    index = KeyIndex(names[:100])
    index.append(names[100:])
    queries = ["k7", "absent", "k299", "k0", "k1000", *names[::-1]]
    assert index.rows(queries).tolist() == expected_rows(names, queries)


def test_lookups_do_not_depend_on_string_identity() -> None:
    """Keys decoded afresh (new str objects) find their rows: equality, not identity."""
    names = [f"key-{i}" for i in range(1000)]
    index = KeyIndex(names)
    fresh = ["".join(["key-", str(i)]) for i in range(999, -1, -1)]
    assert index.rows(fresh).tolist() == list(range(999, -1, -1))


def test_non_string_is_not_contained() -> None:
    index = KeyIndex(["1"])
    assert 1 not in index and None not in index and "1" in index


def test_the_index_costs_at_most_36_bytes_a_key_at_a_million_keys() -> None:
    """The slots (int64 row and tag, at most half full) and the row references; a dict: ~70."""
    names = [f"k{i}" for i in range(1_000_000)]
    index = KeyIndex(names)
    assert index.nbytes / len(names) <= 36
    index2 = KeyIndex()
    for start in range(0, len(names), 62_500):  # grown by appends
        index2.append(names[start:start + 62_500])
    assert index2.nbytes / len(names) <= 36
    assert index2.rows(names[::99_999]).tolist() == list(range(0, 1_000_000, 99_999))


def test_keys_that_share_slot_and_tag_are_still_told_apart(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """With every hash equal (same first slot, same tag), only the string comparison decides:
    each key still finds its own row, and an absent key finds none."""
    monkeypatch.setattr(key_index, "_hashes",
                        lambda keys: np.full(len(keys), 12345, dtype=np.uint64))
    names = [f"key-{i}" for i in range(40)]
    index = KeyIndex(names[:25])
    index.append(names[25:])
    fresh = ["".join(["key-", str(i)]) for i in (39, 0, 17, 25)] + ["key-40", "other"]
    assert index.rows(fresh).tolist() == [39, 0, 17, 25, -1, -1]
    index.rebuild(names[::-1])
    assert index.rows(["key-0", "key-39", "nope"]).tolist() == [39, 0, -1]
