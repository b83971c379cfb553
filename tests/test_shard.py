"""The step clock: partitions' frontiers, closing steps, zero steps, end of input, snapshots."""

import json
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.config import parse_config
from dpstream.core.key_statistics import Release
from dpstream.core.noise import NoiseKey
from dpstream.pipeline import event_rules, statistics_spec
from dpstream.stream.events import PartitionClock, ShardUpdate
from dpstream.stream.shard import ShardState

KEY = NoiseKey.for_tests(5)
ORIGIN = 1_790_000_000
CONFIG = parse_config({"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 1},
                       "admission": {"mode": "declared", "keys": ["a", "b"]},
                       "metrics": {"port": 0}})


def shard(partitions=2, state=None):
    return ShardState(statistics_spec(CONFIG), partitions, {0: ["a", "b"]}, KEY, state)


def test_steps_close_only_when_every_partition_has_passed():
    s = shard()
    assert s.update(ShardUpdate(0, 0, 5, 5, {0: {"a": 3}})) == []  # partition 1 unheard
    out = s.update(ShardUpdate(0, 1, 2, 2, {1: {"b": 1}}))
    assert sorted((r.key, r.step) for r in out) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert s.next_step == 2


def test_end_of_input_closes_through_the_last_step():
    s = shard(partitions=1)
    s.update(ShardUpdate(0, 0, 0, 3, {3: {"a": 1}}))
    out = s.end_of_input()
    assert sorted({r.step for r in out}) == [0, 1, 2, 3]


def test_late_events_are_dead_letters_and_order_within_a_partition_decides():
    clock = PartitionClock(event_rules(CONFIG))
    msgs = [(0, json.dumps({"key": "a", "ts": ORIGIN + t}).encode(), i, "e")
            for i, t in enumerate([0.5, 3.2, 1.1, 3.9, 2.99, 4.0])]
    updates, dead = clock.process(0, msgs)
    assert [d.offset for d in dead] == [2, 4]  # steps 1 and 2 were closed once step 3 was seen
    assert updates[0].increments == {0: {"a": 1}, 3: {"a": 2}, 4: {"a": 1}}
    assert updates[0].frontier == 4


def test_batch_and_record_paths_agree():
    """The fast batch decoder and the per-record decoder give the same result."""
    good = [(0, json.dumps({"key": "a", "ts": ORIGIN + t / 3}).encode(), t, "e")
            for t in range(30)]
    bad = good[:10] + [(0, b"{broken", 10, "e")] + good[10:]
    u1, d1 = PartitionClock(event_rules(CONFIG)).process(0, good)
    u2, d2 = PartitionClock(event_rules(CONFIG)).process(0, bad)
    assert u1 == u2 and d1 == [] and [d.reason for d in d2] == ["invalid JSON"]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 8), st.sampled_from("ab")),
                min_size=1, max_size=60), st.data())
def test_shard_snapshot_restore_gives_identical_releases(events, data):
    clocks = [PartitionClock(event_rules(CONFIG)) for _ in range(2)]
    stream = []
    for i, (p, step, key) in enumerate(sorted(events, key=lambda e: e[1])):
        msg = (p, json.dumps({"key": key, "ts": ORIGIN + step + 0.5}).encode(), i, "e")
        updates, _ = clocks[p].process(p, [msg])
        stream.append(updates[0])
    cut = data.draw(st.integers(0, len(stream)))
    whole = shard()
    expected = [o for u in stream for o in whole.update(u)] + whole.end_of_input()
    first = shard()
    head = [o for u in stream[:cut] for o in first.update(u)]
    resumed = shard(state=pickle.loads(pickle.dumps(first.to_state())))
    tail = [o for u in stream[cut:] for o in resumed.update(u)] + resumed.end_of_input()
    assert head + tail == expected
    assert all(isinstance(o, Release) for o in expected)


def test_times_beyond_year_9999_are_dead_letters_not_overflowed_steps():
    clock = PartitionClock(event_rules(CONFIG))
    msgs = [(0, json.dumps({"key": "a", "ts": ts}).encode(), i, "e")
            for i, ts in enumerate([ORIGIN + 1.5, 1e300, ORIGIN + 2.5])]
    updates, dead = clock.process(0, msgs)
    assert [(d.offset, d.reason) for d in dead] == [(1, "field 'ts' is after the year 9999")]
    assert updates[0].increments == {1: {"a": 1}, 2: {"a": 1}} and updates[0].frontier == 2


def test_iso_times_without_a_zone_are_utc_on_every_machine():
    clock = PartitionClock(event_rules(CONFIG))
    msgs = [(0, json.dumps({"key": "a", "ts": t}).encode(), i, "e")
            for i, t in enumerate(["2026-09-21T14:13:21.5", "2026-09-21T14:13:22.5Z"])]
    updates, dead = clock.process(0, msgs)
    assert dead == [] and updates[0].increments == {1: {"a": 1}, 2: {"a": 1}}
