"""The bounding stage of user-level privacy (issue 24): people hashed, capped, routed on.

What is kept of a person's events depends on that person's events alone, in the order
(step, partition, offset): so batching, the interleaving of partitions, the number of workers
and a restart keep the same events and publish the same records; a person never gets past
the caps; the id never reaches state, snapshots, metrics or logs; a period's state is dropped
when the next period starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import random
from collections import Counter, defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bytewax.testing import TestingSink, TestingSource, run_main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from support.flows import run_in_memory
from support.messages import raw
from support.stage import HandStage, interleave
from support.stage import drive as drive_stage

from dpstream.core.contribution.people import PersonHasher
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError, RecoveryMismatchError
from dpstream.kinds.counters.events import PartitionClock
from dpstream.kinds.counters.shard import ShardState
from dpstream.metrics import FlowMetrics
from dpstream.platform import KINDS, build_flow, parse_config
from dpstream.stream.bounding import BoundingShard, person_clocks
from dpstream.stream.clock import PassThrough, PersonEvents, ShardUpdate, bad_person

ORIGIN = 1_790_000_000  # 2026-09-21T14:13:20Z
NOISE = NoiseKey.for_tests(24)
KEYS = [f"k{i}" for i in range(50)]
SECRET_ID = "person-7f3a-alice@example.org"


def config(mode: str = "declared", steps: int | None = 12, shards: int = 3,
           period: str | None = None, max_keys: int = 2, max_per_key: int = 3,
           **extra: dict[str, Any]) -> Any:
    """A counters flow at the user level (1-second steps, bounded at ``steps`` if given)."""
    tables: dict[str, Any] = {
        "flow": {"name": "u", "origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": shards,
                 **({} if steps is None else {"end": _iso(ORIGIN + steps)})},
        "contribution": {"unit": "user", "user_field": "user", "max_keys": max_keys,
                         "max_per_key": max_per_key,
                         **({} if period is None else {"period": period})},
        "metrics": {"port": 0},
    }
    if mode == "declared":
        tables["admission"] = {"mode": "declared", "keys": KEYS}
    else:
        tables["admission"] = {"mode": "open"}
        tables["monitor"] = {"epsilon": 0.3, "horizon": 100}
        tables["counter"] = {"epsilon": 0.5}
    for name, table in extra.items():
        tables.setdefault(name, {}).update(table)
    return parse_config(tables)


def _iso(seconds: float) -> str:
    import time
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def event(partition: int, offset: int, key: str, user: str | None, ts: float) -> Any:
    body: dict[str, Any] = {"key": key, "ts": ts}
    if user is not None:
        body["user"] = user
    return raw(partition, json.dumps(body).encode(), offset, ts)


def stream(people: int = 30, steps: int = 12, partitions: int = 3, seed: int = 0,
           heavy: tuple[str, int, int] | None = None) -> list[Any]:
    """Events of ``people`` people with heavy-tailed counts over Zipf-like keys.

    ``heavy``: also one person ``(id, events, keys)`` with that many events over that many
    keys in turn (each key gets ``events / keys``). The events are
    spread over the partitions at random; each partition's broker times are non-decreasing.
    """
    rng = random.Random(seed)
    raw_events = []
    for p in range(people):
        for _ in range(min(60, int(rng.paretovariate(1.2)))):
            key = KEYS[min(len(KEYS) - 1, int(rng.paretovariate(1.0)) - 1)]
            raw_events.append((ORIGIN + rng.random() * (steps - 0.01), key, f"user-{p}"))
    if heavy is not None:
        name, count, spread = heavy
        raw_events += [(ORIGIN + rng.random() * (steps - 0.01), KEYS[i % spread], name)
                       for i in range(count)]
    raw_events.sort()
    offsets = [0] * partitions
    out = []
    for ts, key, user in raw_events:
        p = rng.randrange(partitions)
        out.append(event(p, offsets[p], key, user, ts))
        offsets[p] += 1
    return out


def published(cfg: Any, items: list[Any], **kwargs: Any) -> list[str]:
    """The flow's records, canonically (sorted)."""
    return sorted(map(repr, run_in_memory(cfg, items, NOISE, instance="u-1", partitions=3,
                                          **kwargs)))


# -- the core of the stage, without a dataflow ----------------------------------------------


class Stage(HandStage):
    """The clocks and the person shards of a counters flow, driven by hand (no Bytewax).

    Collects what the person shards send to each kind shard: ``sent[(kind shard, step)]``,
    the buckets (summed) and each kind shard's last frontier from each person shard.
    """

    carried = HandStage.carried + ("sent", "frontiers")

    def __init__(self, cfg: Any, partitions: int = 3,
                 states: dict[str, Any] | None = None) -> None:
        super().__init__(cfg, NOISE, partitions=partitions, states=states)
        self.sent: dict[tuple[int, int], Counter[Any]] = defaultdict(Counter)
        self.frontiers: dict[tuple[int, int], int | None] = {}

    def take(self, out: list[Any]) -> None:
        for key, update in out:
            assert key == str(update.shard)
            for step, bucket in update.increments.items():
                assert update.frontier is not None and step < update.frontier
                self.sent[update.shard, step].update(_named(self.cfg, update.shard, bucket))
            self.frontiers[update.shard, update.partition] = update.frontier

    def per_key(self) -> Counter[Any]:
        """Kept events per key over every step."""
        total: Counter[Any] = Counter()
        for bucket in self.sent.values():
            total.update(bucket)
        return total


def _named(cfg: Any, shard: int, bucket: Any) -> dict[Any, int]:
    """A kind shard's bucket as ``{key: events}`` (declared buckets come by row)."""
    if isinstance(bucket, dict):
        return dict(bucket)
    if hasattr(bucket, "events"):  # the counters' route_bounded: events and people by name
        return dict(bucket.events)
    layout = cfg.declared_layout
    return bucket.named(layout.keys_of(shard))


def drive(cfg: Any, items: list[Any], batch: int = 1000, seed: int | None = None,
          restart_after: int | None = None) -> Stage:
    """Feed ``items`` per partition in batches (round-robin, or shuffled with ``seed``)."""
    return drive_stage(lambda states: Stage(cfg, states=states), items, batch, seed,
                       restart_after)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.sampled_from([1, 3, 17, 1000]), st.integers(0, 10**6),
       st.sampled_from(["declared", "open"]), st.integers(0, 40))
def test_batching_interleaving_and_restarts_keep_the_same_events(seed, batch, order, mode,
                                                                 cut):
    cfg = config(mode)
    items = stream(people=15, seed=seed, heavy=("whale", 40, 5))
    reference = drive(cfg, items)
    assert reference.kept and reference.dropped  # the caps bind (the whale's 40 events)
    for other in (drive(cfg, items, batch=batch, seed=order),
                  drive(cfg, items, batch=batch, restart_after=cut)):
        assert dict(other.sent) == dict(reference.sent)
        assert (other.kept, other.dropped) == (reference.kept, reference.dropped)
    # every person shard passed every step to every kind shard
    assert set(reference.frontiers.values()) == {12}
    assert len(reference.frontiers) == cfg.shards * cfg.shards


def test_a_person_never_contributes_beyond_the_caps_and_changes_no_one_else():
    """100 events over 50 keys (or 4): at most L0 keys, Linf events each; others unchanged."""
    cfg = config("open", max_keys=2, max_per_key=3)
    wide = drive(config("open", max_keys=2, max_per_key=2),
                 stream(people=0, heavy=(SECRET_ID, 100, 50)))  # 2 events on each of 50 keys
    assert sorted(wide.per_key().values()) == [2, 2]  # L0 = 2 keys of 2 events
    assert (wide.kept, wide.dropped) == (4, 96)
    deep = drive(cfg, stream(people=0, heavy=(SECRET_ID, 100, 4)))  # 25 events on 4 keys
    assert sorted(deep.per_key().values()) == [3, 3]  # L0 = 2 keys, Linf = 3 events each
    assert (deep.kept, deep.dropped) == (6, 94)
    others = stream(people=25, seed=5)
    without = drive(cfg, others).per_key()
    heavy = stream(people=0, seed=6, heavy=(SECRET_ID, 100, 10))
    merged = sorted(others + heavy, key=lambda item: item[4])
    offsets: Counter[int] = Counter()
    renumbered = []
    for item in merged:  # offsets renumbered per partition, in broker-time order
        renumbered.append((item[0], item[1], offsets[item[0]], *item[3:]))
        offsets[item[0]] += 1
    with_person = drive(cfg, renumbered).per_key()
    difference = with_person - without
    assert not (without - with_person)  # nobody else lost an event
    assert len(difference) <= 2 and max(difference.values()) <= 3
    assert sum(difference.values()) == 6


def test_period_boundaries_drop_the_bounding_state():
    """New people every period: the snapshot after 200 periods is as small as after 10."""
    cfg = config("open", steps=400, period="2s")
    sizes = {}
    rng = random.Random(3)
    stage = Stage(cfg, partitions=1)
    offset = 0
    for step in range(400):
        batch = []
        for j in range(20):
            ts = ORIGIN + step + j / 25
            batch.append(event(0, offset, KEYS[rng.randrange(5)], f"p{step // 2}-{j}", ts))
            offset += 1
        stage.feed(batch)
        if step + 1 in (20, 400):
            sizes[step + 1] = sum(len(pickle.dumps(s.to_state())) for s in stage.shards.values())
            held = sum(s.bounder.people for s in stage.shards.values())
            assert held <= 40  # at most one period's people (20 per step, 2 steps)
    assert stage.kept
    assert sizes[400] <= sizes[20] * 1.1


def test_a_record_without_a_person_is_a_dead_letter_with_the_reason():
    cfg = config("open")
    good = [event(0, i, "k1", f"p{i}", ORIGIN + i / 10) for i in range(5)]
    bad = [raw(0, json.dumps({"key": "k1", "ts": ORIGIN + 0.6}).encode(), 5, ORIGIN + 0.6),
           raw(0, json.dumps({"key": "k1", "ts": ORIGIN + 0.7, "user": ""}).encode(), 6,
               ORIGIN + 0.7),
           raw(0, json.dumps({"key": "k1", "ts": ORIGIN + 0.8, "user": 17}).encode(), 7,
               ORIGIN + 0.8)]
    stage = Stage(cfg, partitions=1)
    stage.feed(good)  # the fast path: every record decodes
    stage.feed(bad + [event(0, 8, "k2", "p9", ORIGIN + 0.9)])  # record by record
    assert [(d.offset, d.reason) for d in stage.dead] == [
        (i, bad_person("user")) for i in (5, 6, 7)]
    assert bad_person("user") == "field 'user' missing or not a non-empty string"
    stage.end()
    assert stage.per_key() == Counter({"k1": 5, "k2": 1})


def test_the_clock_sends_hashes_never_ids_to_the_person_shards():
    cfg = config("open")
    stage = Stage(cfg, partitions=1)
    updates, _ = stage.clocks[0].process(0, [event(0, 0, "k1", SECRET_ID, ORIGIN + 0.5)])
    buckets = [b for u in updates for b in u.increments.values()]
    assert len(updates) == cfg.shards and len(buckets) == 1
    events = buckets[0]
    assert isinstance(events, PersonEvents) and events.people.dtype == np.dtype("V16")
    assert SECRET_ID.encode() not in pickle.dumps(updates)
    assert list(events.offsets) == [0] and list(events.partitions) == [0]


def test_a_snapshot_of_another_instance_or_under_other_caps_is_refused():
    cfg = config("open")
    stage = drive(cfg, stream(people=5))
    state = stage.shards[0].to_state()
    digest = KINDS["counters"].binding(cfg).mechanisms_digest
    with pytest.raises(RecoveryMismatchError):
        BoundingShard(KINDS["counters"].clock(cfg, {})(None), cfg, digest, NOISE, "other",
                      3, state)
    other = config("open", max_keys=3)  # other caps: the kinds' digests bind them too
    with pytest.raises(InvalidParameterError, match="caps|mechanism"):
        BoundingShard(KINDS["counters"].clock(other, {})(None), other,
                      KINDS["counters"].binding(other).mechanisms_digest, NOISE, "u-1", 3,
                      state)


@pytest.mark.flow
def test_the_event_level_flow_has_no_bounding_stage():
    cfg = parse_config({"flow": {"origin": "2026-09-21T14:13:20Z"},
                        "admission": {"mode": "declared", "keys": ["a"]}})
    clock = KINDS["counters"].clock(cfg, {})(None)
    assert clock.hasher is None and not cfg.contribution.user_level
    flow = build_flow(cfg, NOISE, instance="e", partitions=1, source=TestingSource([]),
                      sink=TestingSink([]))
    assert not any("bounding" in step.step_id for step in flow.substeps)
    user = build_flow(config("open"), NOISE, instance="e", partitions=1,
                      source=TestingSource([]), sink=TestingSink([]))
    assert any("bounding" in step.step_id for step in user.substeps)


# -- through the dataflow --------------------------------------------------------------------


@pytest.mark.flow
def test_one_and_two_workers_batching_and_partition_order_publish_the_same_records():
    cfg = config("declared")
    items = stream(people=30, seed=11)
    one = published(cfg, items, batch=1000)
    assert len([r for r in one if "'releases'" in r]) == 12 * len(KEYS)
    assert published(cfg, items, workers=2, batch=7) == one
    assert published(cfg, interleave(items, 1), batch=3) == one
    assert published(cfg, interleave(items, 2), workers=2, batch=50) == one


@pytest.mark.flow
def test_without_flow_end_the_end_of_input_closes_through_the_trusted_clock():
    cfg = config("declared", steps=None)
    items = stream(people=30, seed=14)
    one = published(cfg, items, batch=1000)
    steps = {json.loads(value)["step"] for role, _, value in
             run_in_memory(cfg, items, NOISE, instance="u-1", partitions=3)
             if role == "releases"}
    assert steps and max(steps) >= 9  # every partition's clock passed step 9 at least
    assert published(cfg, interleave(items, 4), workers=2, batch=13) == one


@pytest.mark.flow
def test_the_open_universe_flow_too():
    cfg = config("open")
    items = stream(people=30, seed=12, heavy=("whale", 400, 50))
    one = published(cfg, items, batch=1000)
    assert published(cfg, interleave(items, 3), workers=2, batch=11) == one


@pytest.mark.flow
def test_a_restart_mid_run_publishes_the_same_records(tmp_path):
    from bytewax.recovery import RecoveryConfig, init_db_dir

    cfg = config("declared")
    items = stream(people=30, seed=13)
    whole = published(cfg, items, batch=10)
    init_db_dir(tmp_path, 1)
    recovery = RecoveryConfig(tmp_path)
    crashing = items[:len(items) // 2] + [TestingSource.ABORT()] + items[len(items) // 2:]
    first: list[Any] = []
    run_main(build_flow(cfg, NOISE, instance="u-1", partitions=3,
                        source=TestingSource(crashing, 10), sink=TestingSink(first)),
             epoch_interval=timedelta(0), recovery_config=recovery)
    assert first and len(first) < len(whole)
    second: list[Any] = []
    run_main(build_flow(cfg, NOISE, instance="u-1", partitions=3,
                        source=TestingSource(crashing, 10), sink=TestingSink(second)),
             epoch_interval=timedelta(0), recovery_config=recovery)
    assert sorted(map(repr, first + second)) == whole
    store = b"".join(path.read_bytes() for path in Path(tmp_path).iterdir() if path.is_file())
    assert b"bounding.shards" in store  # the person shards' snapshots are in the store
    assert SECRET_ID.encode() not in store


class _Recording(ShardState):
    """The real counters shard, recording the buckets it merges (what the caps let through)."""

    merged: Counter[str] = Counter()

    def merge(self, step: int, bucket: Any) -> None:
        events = bucket.events if hasattr(bucket, "events") else bucket  # route_bounded's
        assert isinstance(events, dict)
        _Recording.merged.update(events)
        super().merge(step, bucket)


@pytest.mark.flow
def test_through_the_flow_the_caps_hold_and_the_id_appears_nowhere(tmp_path, caplog):
    from bytewax.recovery import RecoveryConfig, init_db_dir

    cfg = config("open", max_keys=2, max_per_key=3)
    items = stream(people=0, heavy=(SECRET_ID, 100, 4))  # 25 events on each of 4 keys
    items.append(raw(1, json.dumps({"key": "k1", "ts": ORIGIN + 11.5}).encode(), 10**6,
                     ORIGIN + 11.5))  # no person: a dead letter
    metrics = FlowMetrics("u", exact_counts=True)
    _Recording.merged = Counter()
    init_db_dir(tmp_path, 1)
    sink: list[Any] = []
    caplog.set_level(logging.DEBUG)
    run_main(build_flow(cfg, NOISE, instance="u-1", partitions=3,
                        source=TestingSource(items, 9), sink=TestingSink(sink), metrics=metrics,
                        shard_class=_Recording),
             epoch_interval=timedelta(0), recovery_config=RecoveryConfig(tmp_path))
    assert len(_Recording.merged) == 2 and set(_Recording.merged.values()) == {3}
    text = generate_latest(metrics.registry).decode()
    assert 'dpstream_bounding_events_total{flow="u",outcome="kept"} 6.0' in text
    assert 'dpstream_bounding_events_total{flow="u",outcome="dropped"} 94.0' in text
    dead = [json.loads(value) for role, _, value in sink if role == "dead_letters"]
    assert [d["reason"] for d in dead] == [bad_person("user")]
    store = b"".join(path.read_bytes() for path in Path(tmp_path).iterdir() if path.is_file())
    published_bytes = b"".join(value for role, _, value in sink if role != "dead_letters")
    for where in (store, text.encode(), caplog.text.encode(), published_bytes):
        assert SECRET_ID.encode() not in where


@pytest.mark.flow
def test_exact_counts_off_no_bounding_metric():
    metrics = FlowMetrics("u", exact_counts=False)
    run_in_memory(config("open"), stream(people=5), NOISE, instance="u-1", partitions=3,
                  metrics=metrics)
    assert "dpstream_bounding" not in generate_latest(metrics.registry).decode()


# -- the clock's contract with a kind's decoder ------------------------------------------------


def _clock(cfg: Any, cls: type = PartitionClock) -> Any:
    """A user-level clock of class ``cls`` (a counters clock, or a subclass of it)."""
    from dpstream.kinds.counters.kind import event_rules

    hasher = PersonHasher(NOISE.lane("u-1", cfg.name, "people"))
    return person_clocks(lambda state: cls(event_rules(cfg), state), hasher, cfg.shards)(None)


def _people_by_offset(updates: list[Any]) -> dict[int, bytes]:
    """The person hash each routed event carries, by offset."""
    out = {}
    for update in updates:
        for bucket in update.increments.values():
            for offset, person in zip(bucket.offsets.tolist(), bucket.people.tolist(),
                                      strict=True):
                out[offset] = person
    return out


class _Fragile(PartitionClock):
    """The counters clock, raising on a batch with a "boom" record, or with a "pair" record
    among others (records that decode alone but not together)."""

    def decode(self, partition, messages, dead):
        values = [v or b"" for v in messages.values]
        if any(b"boom" in v for v in values):
            raise RecursionError("deep")
        if len(values) > 1 and any(b"pair" in v for v in values):
            raise RuntimeError("not together")
        return super().decode(partition, messages, dead)


@pytest.mark.parametrize("odd", ["boom", "pair"])
def test_people_stay_aligned_when_a_batch_is_decoded_again(odd):
    cfg = config("open")
    clock = _clock(cfg, _Fragile)
    people = [f"p{i}" for i in range(6)]
    batch = [event(0, i, "k1" if i != 3 else odd, person, ORIGIN + i / 10)
             for i, person in enumerate(people)]
    updates, dead = clock.process(0, batch)
    hasher = PersonHasher(NOISE.lane("u-1", cfg.name, "people"))
    expected = {i: hasher.hash_one(person) for i, person in enumerate(people)}
    if odd == "boom":
        assert [d.offset for d in dead] == [3] and dead[0].reason.startswith("undecodable")
        del expected[3]
    else:
        assert not dead
    assert _people_by_offset(updates) == expected


class _Questions(PartitionClock):
    """The counters clock, with partition 1 as an input of no person (like PMWG's questions,
    routed with the kind's ``route``, as such a kind does)."""

    route_bounded = None

    def carries_people(self, partition):
        return partition != 1


class _Forgetful(PartitionClock):
    """The counters clock with a decoder that never names people (a bug at the user level)."""

    def decode(self, partition, messages, dead):
        plain = PartitionClock(dataclasses.replace(self.rules, user_field=None))
        return plain.decode(partition, messages, dead)


def test_a_public_input_passes_unbounded_and_a_decoder_that_names_no_one_is_refused():
    cfg = config("open", max_keys=1, max_per_key=1)
    clock = _clock(cfg, _Questions)
    digest = KINDS["counters"].binding(cfg).mechanisms_digest
    from dpstream.kinds.counters.kind import event_rules

    router = _Questions(event_rules(cfg))
    shards = {s: BoundingShard(router, cfg, digest, NOISE, "u-1", 2) for s in range(cfg.shards)}
    updates = []
    for partition in (0, 1):  # the same person's 10 events on each partition, in step 0
        batch = [event(partition, i, f"k{i % 3}", SECRET_ID, ORIGIN + i / 20) for i in range(10)]
        mine, _ = clock.process(partition, batch)
        public = [(u.shard, b) for u in mine for b in u.increments.values()
                  if isinstance(b, PassThrough)]
        assert bool(public) == (partition == 1)  # partition 1's go to person shard 1 % 3
        assert all(shard == 1 for shard, _ in public)
        updates += mine
    updates += [ShardUpdate(s, p, 5, {}) for s in shards for p in (0, 1)]  # steps 0-4 close
    totals: Counter[str] = Counter()
    for update in updates:
        for _, out in shards[update.shard].update(update):
            for bucket in out.increments.values():
                totals.update(bucket.events if hasattr(bucket, "events") else bucket)
    # partition 0: one event kept (L0 = Linf = 1); partition 1: all 10, unbounded
    assert sum(totals.values()) == 11
    with pytest.raises(RuntimeError, match="decoded_people"):
        _clock(cfg, _Forgetful).process(0, [event(0, 0, "k1", "p", ORIGIN)])
