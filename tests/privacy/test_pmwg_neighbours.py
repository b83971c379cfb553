"""Neighbouring streams through the PMWG flow: one event more or less in the growing database.

The flow's stream layer (:class:`PmwgClock` and :class:`PmwgShard`, exactly what the dataflow
runs; a last test checks the real dataflow publishes the same records) is driven with two
input streams that differ in one event, placed adversarially: in the first step (it moves the
public size of every later step) or in the step of a question, in the cell the question asks
about. What must hold:

* **coupled runs** (same noise key): the same questions are answered in the same steps and
  order, with the same ids; the public size ``t`` moves by at most one (the size counter is a
  sum of the same noisy nodes), and nothing depends on the position of the event beyond its
  step: its arrival order inside the step and its partition do not change any answer;
* **over many noise keys**, the frequency of any event of the output (a question answered
  hard, a value above a cut, the public size above a cut) gives a Clopper-Pearson lower bound
  on the privacy loss that stays below the flow's claimed epsilon. A power check runs the
  same statistics against a size counter with almost no noise, whose loss the bound does see.
"""

from __future__ import annotations

import json
import random

import pytest
from bytewax.testing import TestingSink, TestingSource, run_main
from harness import epsilon_lower_bound

from dpstream.core.noise.keys import NoiseKey
from dpstream.kinds.pmwg.events import PmwgClock
from dpstream.kinds.pmwg.shard import PmwgShard
from dpstream.messages import TIMESTAMP_LOG_APPEND_TIME
from dpstream.platform import build_flow, parse_config

pytestmark = [pytest.mark.privacy]

ORIGIN = 1_790_000_000
BASES = {"events": 0, "queries": 2}
UNIVERSE = [{"name": "country", "values": ["de", "fr", "uk"]}]
QUESTION = {"schema": "dpstream.query/1", "kind": "count",
            "where": [{"attr": "country", "eq": "fr"}]}


def config(size_epsilon: float = 0.4, budget: float = 1.0):
    return parse_config({
        "flow": {"kind": "pmwg", "name": "n", "origin": "2026-09-21T14:13:20Z", "step": "1s",
                 "shards": 2},
        "privacy": {"accounting": "pure", "budget": budget},
        "metrics": {"port": 0},
        "histograms": [{"name": "h", "universe": UNIVERSE, "epsilon": 0.6,
                        "size_epsilon": size_epsilon, "size_horizon": 8, "alpha": 0.1,
                        "n": 60, "mode": "practical", "hard_queries": 3}],
    })


def claimed_epsilon(cfg) -> float:
    h = cfg.histograms[0]
    return h.size.epsilon + h.pmwg.epsilon


def message(partition, body, offset, ts, topic):
    return (partition, json.dumps(body).encode(), offset, topic, round(ts * 1000),
            TIMESTAMP_LOG_APPEND_TIME)


def base_stream(seed: int = 0) -> list:
    """6 steps of 30 events (2 partitions), and 2 questions per step on partition 2."""
    rng = random.Random(seed)
    items, offsets = [], [0, 0, 0]
    for step in range(6):
        for _ in range(30):
            p = rng.randrange(2)
            country = rng.choices(["de", "fr", "uk"], [5, 3, 2])[0]
            items.append(message(p, {"country": country, "ts": ORIGIN + step + 0.5},
                                 offsets[p], ORIGIN + step + 0.5, "events"))
            offsets[p] += 1
        for i in range(2):
            items.append(message(2, {"id": f"q{step}-{i}", "histogram": "h",
                                     "query": QUESTION}, offsets[2], ORIGIN + step + 0.9,
                                 "queries"))
            offsets[2] += 1
    return items


def with_extra(items: list, step: int, partition: int = 1, first: bool = True) -> list:
    """The stream plus one 'fr' event in ``step``, first or last in its partition's step."""
    extra_ts = ORIGIN + step + (0.1 if first else 0.85)
    out = [m for m in items]
    out.append(message(partition, {"country": "fr", "ts": extra_ts}, -1, extra_ts, "events"))
    out.sort(key=lambda m: (m[4], m[0]))
    offsets = [0, 0, 0]
    renumbered = []
    for m in out:  # offsets in arrival order per partition, as Kafka would assign them
        renumbered.append((m[0], m[1], offsets[m[0]], m[3], m[4], m[5]))
        offsets[m[0]] += 1
    return renumbered


def run_core(cfg, items: list, noise: NoiseKey, instance: str = "n-1",
             batch: int = 16) -> list[dict]:
    """Drive the flow's clock and shards as the dataflow does; return the answer bodies."""
    clocks: dict[int, PmwgClock] = {}
    shards: dict[int, PmwgShard] = {}
    out = []

    def deliver(updates):
        for u in updates:
            shard = shards.get(u.shard)
            if shard is None:
                shard = shards[u.shard] = PmwgShard(cfg, noise, instance, 3)
            out.extend(shard.update(u))

    by_partition: dict[int, list] = {}
    for m in items:
        by_partition.setdefault(m[0], []).append(m)
        if len(by_partition[m[0]]) == batch:
            clock = clocks.setdefault(m[0], PmwgClock(cfg, BASES))
            deliver(clock.process(m[0], by_partition.pop(m[0]))[0])
    for p, rest in by_partition.items():
        deliver(clocks.setdefault(p, PmwgClock(cfg, BASES)).process(p, rest)[0])
    for clock in clocks.values():
        deliver(clock.end_of_input())
    for shard in shards.values():
        out.extend(shard.end_of_input())
    return [{"id": a.query_id, "step": a.step, "t": a.t, "kind": a.kind, "value": a.value}
            for a in out]


@pytest.mark.parametrize("step", [0, 3, 5])
def test_one_event_more_changes_no_structure_and_the_size_by_at_most_one(step):
    cfg = config()
    base = base_stream()
    for seed in range(20):
        noise = NoiseKey.for_tests(100 + seed)
        a = run_core(cfg, base, noise)
        b = run_core(cfg, with_extra(base, step), noise)
        assert [(x["id"], x["step"]) for x in a] == [(x["id"], x["step"]) for x in b]
        for x, y in zip(a, b, strict=True):
            assert 0 <= y["t"] - x["t"] <= 1 if x["step"] >= step else y["t"] == x["t"]
            if x["step"] < step:  # before the event: nothing can differ
                assert x == y


def test_where_the_event_sits_inside_its_step_changes_nothing():
    """Partition and arrival order inside a step are not information the answers may use."""
    cfg = config()
    base = base_stream()
    noise = NoiseKey.for_tests(7)
    first = run_core(cfg, with_extra(base, 3, partition=0, first=True), noise)
    assert run_core(cfg, with_extra(base, 3, partition=1, first=False), noise) == first
    assert run_core(cfg, with_extra(base, 3, partition=1, first=True), noise, batch=5) == first


def frequencies(cfg, worlds, statistic, runs):
    hits, totals = [0, 0], [0, 0]
    for world, items in enumerate(worlds):
        for s in range(runs):
            records = run_core(cfg, items, NoiseKey.for_tests(5000 + s), instance=f"e{s}")
            value = statistic(records)
            if value is None:
                continue
            totals[world] += 1
            hits[world] += bool(value)
    return hits, totals


def statistics(truth_t: int):
    """Events of the output whose frequencies one event could move."""
    def t_above(records):
        last = [r for r in records if r["step"] == 5]
        return last[0]["t"] >= truth_t if last else None

    def hard_at(step):
        def hard(records):
            return any(r["kind"] == "hard" for r in records if r["step"] == step)
        return hard

    def value_above(records):
        values = [r["value"] for r in records if r["step"] == 5 and r["value"] is not None]
        return values[0] > 0.31 if values else None

    return {"t above the truth": t_above, "hard at step 2": hard_at(2),
            "hard at step 4": hard_at(4), "value above the cut": value_above}


@pytest.mark.statistical
def test_empirical_epsilon_stays_below_the_claim():
    """Over 300 noise keys per world: no output event's frequencies exceed the claim."""
    cfg = config()
    base = base_stream()
    worlds = (base, with_extra(base, 0))
    truth_t = 6 * 30 + 1
    for name, statistic in statistics(truth_t).items():
        hits, totals = frequencies(cfg, worlds, statistic, 300)
        bound = epsilon_lower_bound(hits[0], totals[0], hits[1], totals[1])
        assert bound <= claimed_epsilon(cfg), (name, hits, totals, bound)


@pytest.mark.statistical
def test_the_statistics_have_power_against_a_size_counter_without_noise():
    """With size_epsilon = 30 the public size nearly reveals the count: the bound sees it."""
    cfg = config(size_epsilon=30.0, budget=40.0)
    base = base_stream()
    worlds = (base, with_extra(base, 0))
    t_above = statistics(6 * 30 + 1)["t above the truth"]
    hits, totals = frequencies(cfg, worlds, t_above, 150)
    assert epsilon_lower_bound(hits[0], totals[0], hits[1], totals[1]) > 1.0, (hits, totals)


@pytest.mark.flow
def test_the_real_dataflow_publishes_what_the_harness_drives():
    cfg = config()
    items = with_extra(base_stream(), 2)
    noise = NoiseKey.for_tests(3)
    sink: list = []
    flow = build_flow(cfg, noise, instance="n-1", partitions={"events": 2, "queries": 1},
                      source=TestingSource(items, 16), sink=TestingSink(sink))
    run_main(flow)
    published = [json.loads(v) for role, _k, v in sink if role == "answers"]
    driven = run_core(cfg, items, noise)
    assert [{k: p[k] for k in ("id", "step", "t", "kind")} for p in published] == \
        [{k: d[k] for k in ("id", "step", "t", "kind")} for d in driven]


@pytest.mark.flow
@pytest.mark.parametrize("step", [0, 5])
def test_the_answer_metrics_are_functions_of_the_published_answers(step):
    """Neighbours may differ in the metrics only as their published answers differ."""
    from collections import Counter

    from prometheus_client import CollectorRegistry

    from dpstream.metrics import FlowMetrics

    cfg = config()
    for items in (base_stream(), with_extra(base_stream(), step)):
        metrics = FlowMetrics("n", CollectorRegistry(), exact_counts=False)
        sink: list = []
        flow = build_flow(cfg, NoiseKey.for_tests(11), instance="n-1",
                          partitions={"events": 2, "queries": 1},
                          source=TestingSource(items, 16), sink=TestingSink(sink),
                          metrics=metrics)
        run_main(flow)
        published = [json.loads(v) for role, _k, v in sink if role == "answers"]
        samples = [s for family in metrics.registry.collect() for s in family.samples]
        kinds = Counter({s.labels["kind"]: int(s.value) for s in samples
                         if s.name == "dpstream_answers_total"})
        assert kinds == Counter(a["kind"] for a in published)
        spent = [s.value for s in samples if s.name == "dpstream_histogram_privacy_spent"]
        assert spent == [published[-1]["privacy"]["spent"]]
        hard = [s.value for s in samples if s.name == "dpstream_hard_queries"]
        assert hard == [published[-1]["hard_queries"]]
        assert not [s for s in samples if s.name.startswith("dpstream_events")]
