"""The step clock: partitions' frontiers, closing steps, zero steps, end of input, snapshots."""

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st
from support.messages import message, raw

from dpstream.config import parse_config
from dpstream.core.key_statistics import Release
from dpstream.core.noise import NoiseKey
from dpstream.kinds.counters import event_rules, statistics_spec
from dpstream.stream.events import TIMESTAMP_CREATE_TIME, PartitionClock, ShardUpdate
from dpstream.stream.shard import ShardState

KEY = NoiseKey.for_tests(5)
ORIGIN = 1_790_000_000
CONFIG = parse_config({"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 1},
                       "admission": {"mode": "declared", "keys": ["a", "b"]},
                       "metrics": {"port": 0}})


def shard(partitions=2, state=None):
    return ShardState(statistics_spec(CONFIG, "i"), partitions, {0: ["a", "b"]}, KEY, state)


def test_steps_close_only_when_every_partition_has_passed():
    s = shard()
    assert s.update(ShardUpdate(0, 0, 5, {0: {"a": 3}})) == []  # partition 1 unheard
    out = s.update(ShardUpdate(0, 1, 2, {1: {"b": 1}}))
    assert sorted((r.key, r.step) for r in out) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert s.next_step == 2


def test_end_of_input_closes_through_each_partitions_last_step_and_later_records_are_late():
    clock = PartitionClock(event_rules(CONFIG))
    s = shard(partitions=2)  # partition 1 never has a record
    updates, _ = clock.process(0, [message(0, "a", ORIGIN + 3.5, 0)])
    assert s.update(updates[0]) == []
    assert s.update(clock.end_of_input()[0]) == []  # partition 1 still unheard
    out = s.end_of_input()  # the whole input ended: partition 1 had nothing
    assert sorted({r.step for r in out}) == [0, 1, 2, 3]
    updates, dead = clock.process(0, [message(0, "a", ORIGIN + 2.5, 1, broker=ORIGIN + 3.6)])
    assert [d.reason.split(" (")[0] for d in dead] == [
        "late: the record's step is already closed in this partition"]


def test_late_means_broker_time_went_backwards_and_order_within_a_partition_decides():
    clock = PartitionClock(event_rules(CONFIG))
    msgs = [message(0, "a", ORIGIN + t, i) for i, t in enumerate([0.5, 3.2, 1.1, 3.9, 2.99, 4.0])]
    updates, dead = clock.process(0, msgs)
    assert [d.offset for d in dead] == [2, 4]  # broker time went back to closed steps 1 and 2
    assert all(d.reason.startswith("late: the record's step is already closed") for d in dead)
    assert updates[0].increments == {0: {"a": 1}, 3: {"a": 2}, 4: {"a": 1}}
    assert updates[0].frontier == 4


def test_a_record_is_placed_by_its_own_times_alone():
    """Event time clamped into [broker - lateness, broker]: no record moves another."""
    rules = event_rules(parse_config({
        "flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 1,
                 "lateness": "2s"},
        "admission": {"mode": "declared", "keys": ["a", "b"]}, "metrics": {"port": 0}}))
    msgs = [message(0, "a", ORIGIN + 10**7, 0, broker=ORIGIN + 5.5),  # far future: at broker
            message(0, "b", ORIGIN + 4.2, 1, broker=ORIGIN + 5.6),  # within lateness: own time
            message(0, "b", ORIGIN - 10**6 + 0.5, 2, broker=ORIGIN + 5.7),  # before origin
            message(0, "a", ORIGIN + 0.1, 3, broker=ORIGIN + 6.0),  # too old: broker - 2 s
            message(0, "b", ORIGIN + 5.9, 4, broker=ORIGIN + 6.1)]
    updates, dead = PartitionClock(rules).process(0, msgs)
    assert [(d.offset, d.reason) for d in dead] == [(2, "event time before flow.origin")]
    assert updates[0].increments == {5: {"a": 1, "b": 1}, 4: {"a": 1, "b": 1}}
    assert updates[0].frontier == 4  # max broker time 6.1 - lateness 2 s


def test_the_broker_clock_trusts_only_broker_timestamps():
    producer_set = [message(0, "a", ORIGIN + 1.5, 0, kind=TIMESTAMP_CREATE_TIME),
                    message(0, "a", ORIGIN + 1.5, 1, kind=0)]
    updates, dead = PartitionClock(event_rules(CONFIG)).process(0, producer_set)
    assert [d.reason.split(" (")[0] for d in dead] == [
        "the record's timestamp is producer-set", "the record has no broker timestamp"]
    assert updates[0].frontier is None and updates[0].increments == {}
    trusting = parse_config({"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s",
                                      "shards": 1, "clock": "producer"},
                             "admission": {"mode": "declared", "keys": ["a"]},
                             "metrics": {"port": 0}})
    updates, dead = PartitionClock(event_rules(trusting)).process(0, producer_set)
    assert [d.offset for d in dead] == [1] and updates[0].increments == {1: {"a": 1}}


def test_batch_and_record_paths_agree():
    """The fast batch decoder and the per-record decoder give the same result."""
    good = [message(0, "a", ORIGIN + t / 3, t) for t in range(30)]
    bad = good[:10] + [raw(0, b"{broken", 10, ORIGIN + 3.3)] + good[10:]
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
        msg = message(p, key, ORIGIN + step + 0.5, i)
        updates, _ = clocks[p].process(p, [msg])
        stream.append(updates[0])
    cut = data.draw(st.integers(0, len(stream)))
    whole = shard()
    ends = [clock.end_of_input()[0] for clock in clocks if clock.watermark is not None]
    expected = [o for u in stream + ends for o in whole.update(u)] + whole.end_of_input()
    first = shard()
    head = [o for u in stream[:cut] for o in first.update(u)]
    resumed = shard(state=pickle.loads(pickle.dumps(first.to_state())))
    tail = [o for u in stream[cut:] + ends for o in resumed.update(u)] + resumed.end_of_input()
    assert head + tail == expected
    assert all(isinstance(o, Release) for o in expected)


def test_timestamps_beyond_year_9999_are_dead_letters_not_overflowed_steps():
    trusting = parse_config({"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s",
                                      "shards": 1, "clock": "producer"},
                             "admission": {"mode": "declared", "keys": ["a"]},
                             "metrics": {"port": 0}})
    clock = PartitionClock(event_rules(trusting))
    msgs = [message(0, "a", ts, i, kind=TIMESTAMP_CREATE_TIME)
            for i, ts in enumerate([ORIGIN + 1.5, 1e300, ORIGIN + 2.5])]
    updates, dead = clock.process(0, msgs)
    assert [(d.offset, d.reason) for d in dead] == [
        (1, "the record's timestamp is after the year 9999")]
    assert updates[0].increments == {1: {"a": 1}, 2: {"a": 1}} and updates[0].frontier == 2


def test_iso_times_without_a_zone_are_utc_on_every_machine():
    clock = PartitionClock(event_rules(parse_config({
        "flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 1, "lateness": "5s"},
        "admission": {"mode": "declared", "keys": ["a"]}, "metrics": {"port": 0}})))
    msgs = [message(0, "a", t, i, broker=ORIGIN + 3)
            for i, t in enumerate(["2026-09-21T14:13:21.5", "2026-09-21T14:13:22.5Z"])]
    updates, dead = clock.process(0, msgs)
    assert dead == [] and updates[0].increments == {1: {"a": 1}, 2: {"a": 1}}
