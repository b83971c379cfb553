"""The declared layout: every declared key's shard and row, and the clock's routing by row."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.messages import message

from dpstream.core.counting.key_table import KeyTable
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError
from dpstream.kinds.counters.events import PartitionClock
from dpstream.kinds.counters.kind import event_rules, statistics_spec
from dpstream.kinds.counters.layout import DeclaredLayout, RowCounts
from dpstream.platform import parse_config
from dpstream.stream.sharding import shard_of

ORIGIN = 1_790_000_000
keys_strategy = st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=40, unique=True)


@settings(max_examples=60, deadline=None)
@given(keys=keys_strategy, shards=st.integers(1, 7))
def test_each_shard_holds_its_keys_sorted_and_a_position_is_a_row(keys, shards):
    layout = DeclaredLayout(keys, shards)
    expected = {s: tuple(sorted(k for k in keys if shard_of(k, shards) == s))
                for s in range(shards)}
    assert dict(layout) == {s: ks for s, ks in expected.items() if ks}
    assert all(layout.keys_of(s) == expected[s] for s in range(shards))
    positions = layout.positions(keys)
    for key, position in zip(keys, positions.tolist(), strict=True):
        shard = shard_of(key, shards)
        assert layout.bounds[shard] <= position < layout.bounds[shard + 1]
        assert layout.keys_of(shard)[position - layout.bounds[shard]] == key
    assert (layout.positions(["\x00not-declared", *keys[:1]]) == [-1, positions[0]]).all()


@settings(max_examples=60, deadline=None)
@given(keys=keys_strategy, shards=st.integers(1, 7), data=st.data())
def test_route_counts_the_events_of_each_shard_by_row(keys, shards, data):
    layout = DeclaredLayout(keys, shards)
    events = data.draw(st.lists(st.sampled_from(keys), max_size=80))
    buckets = layout.route(layout.positions(events))
    assert len(buckets) == shards
    got: Counter[str] = Counter()
    for shard, bucket in enumerate(buckets):
        if bucket is None:
            continue
        assert bucket.rows.dtype == np.int32 and (np.diff(bucket.rows) > 0).all()
        assert (bucket.counts >= 1).all()
        named = bucket.named(layout.keys_of(shard))
        assert all(shard_of(k, shards) == shard for k in named)
        got.update(named)
    assert got == Counter(events)


def test_the_clock_routes_declared_events_by_row_and_drops_undeclared_ones():
    config = parse_config({"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s",
                                    "shards": 4},
                           "admission": {"mode": "declared", "keys": ["a", "b", "c", "d", "e"]},
                           "metrics": {"port": 0}})
    events = ["a", "c", "zz", "a", "e", "d", "a"]
    msgs = [message(0, k, ORIGIN + 0.5 + i / 20, i) for i, k in enumerate(events)]
    updates, dead = PartitionClock(event_rules(config)).process(0, msgs)
    assert [(d.offset, d.reason) for d in dead] == [(2, "key is not in admission.keys")]
    layout = config.declared_layout
    named: Counter[str] = Counter()
    for update in updates:
        for step, bucket in update.increments.items():
            assert step == 0 and isinstance(bucket, RowCounts)
            named.update(bucket.named(layout.keys_of(update.shard)))
    assert named == Counter(k for k in events if k != "zz")
    kept = [m for m in msgs if b"zz" not in m[1]]
    fast, _ = PartitionClock(event_rules(config)).process(0, kept)
    assert [u.increments for u in fast] == [u.increments for u in updates]  # batch = per record


def test_close_declared_refuses_positions_outside_the_list_and_the_open_universe():
    declared = parse_config({"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s"},
                             "admission": {"mode": "declared", "keys": ["a", "b"]},
                             "metrics": {"port": 0}})
    table = KeyTable(statistics_spec(declared, "i"), NoiseKey.for_tests(1), ["a", "b"])
    for bad in ([2], [-1]):
        with pytest.raises(InvalidParameterError, match="outside the declared keys"):
            table.close_declared(0, np.array(bad), np.array([1]))
    with pytest.raises(InvalidParameterError, match="increments must be integers >= 0"):
        table.close_declared(0, np.array([0]), np.array([-1]))
    opened = parse_config({"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s"},
                           "metrics": {"port": 0}})
    table = KeyTable(statistics_spec(opened, "i"), NoiseKey.for_tests(1))
    with pytest.raises(InvalidParameterError, match="declared universe"):
        table.close_declared(0, np.array([0]), np.array([1]))
