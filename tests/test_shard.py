"""The step clock and the shard: frontiers, closing steps, engines, snapshots, release.every."""

import json
import pickle
import random

import pytest
from bytewax.testing import TestingSink, TestingSource, run_main
from hypothesis import given, settings
from hypothesis import strategies as st
from support.messages import message, raw
from support.reference_shard import ReferenceShardState

from dpstream.core.counting.outputs import Release, StepOutputs
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import ConfigError, InvalidParameterError
from dpstream.kinds.counters.events import TICK, TIMESTAMP_CREATE_TIME, PartitionClock, ShardUpdate
from dpstream.kinds.counters.kind import event_rules, statistics_spec
from dpstream.kinds.counters.records import RecordEncoder
from dpstream.kinds.counters.shard import REFERENCE_SNAPSHOT_REFUSED, ShardState
from dpstream.platform import build_flow, parse_config

KEY = NoiseKey.for_tests(5)
ORIGIN = 1_790_000_000
CONFIG = parse_config({"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 1},
                       "admission": {"mode": "declared", "keys": ["a", "b"]},
                       "metrics": {"port": 0}})


def by_name(update, config=CONFIG):
    """A clock update's increments by key name (the declared universe routes rows)."""
    keys = config.declared_layout.keys_of(update.shard)
    return {step: bucket.named(keys) for step, bucket in update.increments.items()}


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
    assert by_name(updates[0]) == {0: {"a": 1}, 3: {"a": 2}, 4: {"a": 1}}
    assert updates[0].frontier == 4


def test_a_record_is_placed_by_its_own_times_alone():
    """Event time clamped into [broker - lateness, broker]: no record moves another."""
    config = parse_config({
        "flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 1,
                 "lateness": "2s"},
        "admission": {"mode": "declared", "keys": ["a", "b"]}, "metrics": {"port": 0}})
    rules = event_rules(config)
    msgs = [message(0, "a", ORIGIN + 10**7, 0, broker=ORIGIN + 5.5),  # far future: at broker
            message(0, "b", ORIGIN + 4.2, 1, broker=ORIGIN + 5.6),  # within lateness: own time
            message(0, "b", ORIGIN - 10**6 + 0.5, 2, broker=ORIGIN + 5.7),  # before origin
            message(0, "a", ORIGIN + 0.1, 3, broker=ORIGIN + 6.0),  # too old: broker - 2 s
            message(0, "b", ORIGIN + 5.9, 4, broker=ORIGIN + 6.1)]
    updates, dead = PartitionClock(rules).process(0, msgs)
    assert [(d.offset, d.reason) for d in dead] == [(2, "event time before flow.origin")]
    assert by_name(updates[0], config) == {5: {"a": 1, "b": 1}, 4: {"a": 1, "b": 1}}
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
    assert [d.offset for d in dead] == [1] and by_name(updates[0], trusting) == {1: {"a": 1}}


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
    # under the producer clock only ticks move the watermark: one beyond 9999 moves nothing
    msgs += [raw(0, TICK, 3, 1e300, kind=TIMESTAMP_CREATE_TIME),
             raw(0, TICK, 4, ORIGIN + 2.5, kind=TIMESTAMP_CREATE_TIME)]
    updates, dead = clock.process(0, msgs)
    assert [(d.offset, d.reason) for d in dead] == [
        (1, "the record's timestamp is after the year 9999")]
    assert by_name(updates[0], trusting) == {1: {"a": 1}, 2: {"a": 1}}
    assert updates[0].frontier == 2 and clock.watermark == ORIGIN + 2.5


def test_iso_times_without_a_zone_are_utc_on_every_machine():
    config = parse_config({
        "flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 1, "lateness": "5s"},
        "admission": {"mode": "declared", "keys": ["a"]}, "metrics": {"port": 0}})
    clock = PartitionClock(event_rules(config))
    msgs = [message(0, "a", t, i, broker=ORIGIN + 3)
            for i, t in enumerate(["2026-09-21T14:13:21.5", "2026-09-21T14:13:22.5Z"])]
    updates, dead = clock.process(0, msgs)
    assert dead == [] and by_name(updates[0], config) == {1: {"a": 1}, 2: {"a": 1}}


# -- the engines: columnar table and per-key reference --------------------------------------

OPEN = parse_config({"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 1},
                     "privacy": {"delta": 0.5, "budget": 2.0},
                     "monitor": {"horizon": 6, "threshold": 14, "epsilon": 1.0},
                     "counter": {"horizon": 4, "epsilon": 0.7},
                     "admission": {"mode": "open", "initial_epsilon": 0.2},
                     "metrics": {"port": 0}})
ZCDP = parse_config({"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 1},
                     "privacy": {"accounting": "zcdp"}, "counter": {"horizon": 16},
                     "admission": {"mode": "declared", "keys": ["a", "b"]},
                     "metrics": {"port": 0}})


def updates_of(config, seed, steps=14, partitions=2):
    """A random stream of shard updates: hot, warm and rare keys over two partitions."""
    rng = random.Random(seed)
    clocks = [PartitionClock(event_rules(config)) for _ in range(partitions)]
    keys = ["a", "b"] if config.admission.mode == "declared" else \
        ["hot", "warm", "rare", "x\"y", "é"]
    rate = {"hot": 9, "warm": 3, "rare": 1, "a": 4, "b": 1}
    out, offsets = [], [0] * partitions
    for step in range(steps):
        for p in range(partitions):
            batch = []
            for key in keys:
                for _ in range(rng.randint(0, rate.get(key, 2))):
                    batch.append(message(p, key, ORIGIN + step + rng.random() * 0.9, offsets[p]))
                    offsets[p] += 1
            batch.sort(key=lambda m: m[4])
            if batch:
                updates, _ = clocks[p].process(p, batch)
                out.extend(updates)
    ends = [u for c in clocks if c.watermark is not None for u in c.end_of_input()]
    return out + ends


def canonical(outputs):
    return sorted(repr(o) for o in outputs)


def drive(make, updates, cut=None):
    s = make(None)
    out = []
    for i, u in enumerate(updates):
        if i == cut:
            s = make(pickle.loads(pickle.dumps(s.to_state())))
        out.extend(s.update(u))
    return out + list(s.end_of_input())


@pytest.mark.parametrize("config", [CONFIG, OPEN], ids=["declared", "open"])
@pytest.mark.parametrize("seed", range(4))
def test_the_table_publishes_exactly_what_the_reference_engine_publishes(config, seed):
    spec = statistics_spec(config, "i")
    declared = {0: list(config.admission.keys)} if config.admission.mode == "declared" else None
    updates = updates_of(config, seed)
    reference = drive(lambda st: ReferenceShardState(spec, 2, declared, KEY, st), updates)
    table = drive(lambda st: ShardState(spec, 2, declared, KEY, st), updates,
                  cut=len(updates) // 2)
    assert ShardState(spec, 2, declared, KEY).table_class.supports(spec)
    assert canonical(table) == canonical(reference)
    assert any(isinstance(o, Release) for o in reference)


def test_update_batches_keeps_each_closed_step_whole():
    spec = statistics_spec(OPEN, "i")
    updates = updates_of(OPEN, 7)
    flat, whole = ShardState(spec, 2, None, KEY), ShardState(spec, 2, None, KEY)
    expected = [o for u in updates for o in flat.update(u)] + list(flat.end_of_input())
    batches = [b for u in updates for b in whole.update_batches(u)] + \
        whole.end_of_input_batches()
    assert all(isinstance(b, StepOutputs) and any(b.count()) for b in batches)
    assert [b.step for b in batches] == sorted(b.step for b in batches)
    assert [o for b in batches for o in b] == expected
    assert whole.update(updates[0]) == []  # back to the flat path: nothing left to close


def test_a_reference_snapshot_is_refused_with_a_one_line_message():
    """Snapshots of the per-key engine (no "engine": "table") name the version that runs them."""
    spec = statistics_spec(OPEN, "i")
    updates = updates_of(OPEN, 3)
    old = ReferenceShardState(spec, 2, None, KEY)
    head = [o for u in updates[: len(updates) // 2] for o in old.update(u)]
    assert head  # the snapshot holds live keys
    state = pickle.loads(pickle.dumps(old.to_state()))
    assert "engine" not in state
    for snapshot in (state, {**state, "engine": "reference"}):
        with pytest.raises(InvalidParameterError) as refused:
            ShardState(spec, 2, None, KEY, snapshot)
        assert str(refused.value) == REFERENCE_SNAPSHOT_REFUSED
    assert "\n" not in REFERENCE_SNAPSHOT_REFUSED and "dpstream 0.1.0" in REFERENCE_SNAPSHOT_REFUSED
    with pytest.raises(Exception, match="another noise key"):  # the binding is checked first
        ShardState(spec, 2, None, NoiseKey.for_tests(6), state)


def test_zcdp_uses_the_table_engine_with_step_outputs_that_encode_the_same():
    spec = statistics_spec(ZCDP, "i")
    s = ShardState(spec, 2, {0: ["a", "b"]}, KEY)
    assert s.to_state()["engine"] == "table"  # the columnar BLT counters (blt_columns)
    old = ReferenceShardState(spec, 2, {0: ["a", "b"]}, KEY).to_state()
    with pytest.raises(InvalidParameterError, match="reference engine"):  # an older snapshot
        ShardState(spec, 2, {0: ["a", "b"]}, KEY, old)
    encoder = RecordEncoder("z", ZCDP.origin, 1.0, 1e-6)
    batches = [b for u in updates_of(ZCDP, 1) for b in s.update_batches(u)]
    assert batches and all(isinstance(b, StepOutputs) for b in batches)
    for b in batches:
        assert all(c.periodic for c in b.releases)
        assert encoder.encode_step(b) == [encoder.encode(o) for o in b]
    reference = drive(lambda st: ReferenceShardState(spec, 2, {0: ["a", "b"]}, KEY, st),
                      updates_of(ZCDP, 1))
    assert canonical(o for b in batches for o in b) == canonical(reference)


def test_a_shard_snapshot_holds_the_engine_and_plain_data():
    spec = statistics_spec(OPEN, "i")
    s = ShardState(spec, 2, None, KEY)
    for u in updates_of(OPEN, 2)[:10]:
        s.update(u)
    state = s.to_state()
    assert state["engine"] == "table" and "keys" not in state
    assert pickle.loads(pickle.dumps(state))["table"] is not None
    with pytest.raises(Exception, match="another noise key"):
        ShardState(spec, 2, None, NoiseKey.for_tests(6), state)


# -- release.every ---------------------------------------------------------------------------

def counters_config(mode="open", **extra):
    raw = {"flow": {"name": "e", "origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 2},
           "privacy": {"delta": 0.5, "budget": 2.0}, "counter": {"epsilon": 0.7},
           "metrics": {"port": 0}}
    if mode == "open":
        raw["monitor"] = {"horizon": 8, "threshold": 16, "epsilon": 1.0}
        raw["admission"] = {"initial_epsilon": 0.2}
    else:
        raw["admission"] = {"mode": "declared", "keys": ["hot", "warm", "cold"]}
    for table, values in extra.items():
        raw.setdefault(table, {}).update(values)
    return parse_config(raw)


@pytest.mark.parametrize("every, message", [
    (0, "release.every must be an integer >= 1"), (-2, "release.every must be an integer >= 1"),
    (1.5, "release.every must be an integer >= 1"), (True, "release.every must be an integer"),
    ("2", r"release.every must be an integer >= 1 \(publish the periodic releases of every "
          r"k-th step\), got '2'")])
def test_release_every_must_be_a_positive_integer(every, message):
    with pytest.raises(ConfigError, match=message):
        counters_config(release={"every": every})


def test_release_every_defaults_to_one_and_rejects_unknown_settings():
    assert counters_config().release_every == 1
    assert counters_config(release={"every": 7}).release_every == 7
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) in \[release\]: only_changed"):
        counters_config(release={"only_changed": True})
    assert "every 7 steps" in counters_config(release={"every": 7}).describe()


def run_flow(config, items):
    sink: list = []
    run_main(build_flow(config, KEY, instance="e-1", partitions=2,
                        source=TestingSource(items, 50), sink=TestingSink(sink)))
    return sink


@pytest.mark.flow
@pytest.mark.parametrize("mode", ["open", "declared"])
def test_release_every_k_publishes_the_k1_releases_of_every_kth_step_byte_for_byte(mode):
    rng = random.Random(5)
    items, offsets = [], [0, 0]
    rates = {"hot": 12, "warm": 4, "cold": 1}
    for step in range(20):
        batch = [(key, ORIGIN + step + rng.random() * 0.9) for key, r in rates.items()
                 for _ in range(rng.randint(0, r))]
        for key, ts in sorted(batch, key=lambda e: e[1]):
            p = rng.randrange(2)
            items.append(message(p, key, ts, offsets[p]))
            offsets[p] += 1
    every = run_flow(counters_config(mode), items)
    third = run_flow(counters_config(mode, release={"every": 3}), items)
    bodies = [(role, json.loads(value)) for role, _, value in every]
    admitted_at = {(b["key"], b["step"]) for role, b in bodies if role == "alerts"}
    assert (mode == "open") == bool(admitted_at)
    kept = [(role, key, value) for (role, key, value), (_, b) in zip(every, bodies, strict=True)
            if b.get("schema") != "dpstream.release/1" or (b["step"] + 1) % 3 == 0
            or (b["key"], b["step"]) in admitted_at]
    assert sorted(third) == sorted(kept)
    assert len(third) < len(every)
    steps = {json.loads(v)["step"] for r, _, v in third if r == "releases"}
    assert {s for s in steps if (s + 1) % 3} <= {s for _, s in admitted_at}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "ç", "key-3", "k4", "日本", "x" * 40]),
                          st.integers(0, 3)), max_size=60),
       st.integers(1, 7), st.booleans())
def test_route_counts_every_event_in_its_keys_shard_and_step(events, shards, one_step):
    """The vectorised route equals counting event by event with ``shard_of``."""
    from dpstream.stream.sharding import shard_of

    config = parse_config({"flow": {"name": "t", "origin": "2026-01-01T00:00:00Z",
                                    "step": "1s", "shards": shards},
                           "privacy": {"budget": 1.0}, "counter": {"epsilon": 0.5}})
    clock = PartitionClock(event_rules(config))
    keys = [key for key, _ in events]
    steps = 2 if one_step else [step for _, step in events]
    expected: list[dict] = [{} for _ in range(shards)]
    for i, key in enumerate(keys):
        step = steps if isinstance(steps, int) else steps[i]
        bucket = expected[shard_of(key, shards)].setdefault(step, {})
        bucket[key] = bucket.get(key, 0) + 1
    assert clock.route(keys, steps) == expected
