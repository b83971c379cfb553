"""The PMWG flow kind with in-memory input and output: answers, order, workers, recovery."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from datetime import timedelta

import pytest
from bytewax.recovery import RecoveryConfig, init_db_dir
from bytewax.testing import TestingSink, TestingSource, run_main
from prometheus_client import CollectorRegistry
from support.flows import run_in_memory
from support.messages import raw

from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import ConfigError
from dpstream.kinds.pmwg.shard import PmwgShard
from dpstream.metrics import FlowMetrics
from dpstream.platform import build_flow, parse_config

ORIGIN = 1_790_000_000  # 2026-09-21T14:13:20Z
KEY = NoiseKey.for_tests(5)
PARTITIONS = {"events": 2, "queries": 1}  # the queries topic's partition is input partition 2
UNIVERSE = [{"name": "country", "values": ["de", "fr", "uk"]},
            {"name": "age", "edges": [0, 18, 40, 120]}]


def config(**histogram):
    h = {"name": "h", "universe": UNIVERSE, "epsilon": 0.9, "size_epsilon": 2.0,
         "size_horizon": 64, "alpha": 0.1, "n": 500, "mode": "practical", "hard_queries": 4}
    h.update(histogram)
    return parse_config({
        "flow": {"kind": "pmwg", "name": "p", "origin": "2026-09-21T14:13:20Z", "step": "1s",
                 "shards": 4},
        "privacy": {"accounting": "pure", "budget": 4.0},
        "metrics": {"port": 0},
        "histograms": [h, {"name": "g", "mechanism": "histogram", "epsilon": 0.09,
                           "size_epsilon": 0.5, "size_horizon": 64, "n": 1000,
                           "universe": UNIVERSE[:1]}],
    })


def question(qid, query, histogram="h"):
    return json.dumps({"id": qid, "histogram": histogram,
                       "query": {"schema": "dpstream.query/1", **query}}).encode()


DE = {"kind": "count", "where": [{"attr": "country", "eq": "de"}]}
ADULT_FR = {"kind": "count", "where": [{"attr": "country", "eq": "fr"},
                                       {"attr": "age", "range": [18, 120]}]}


def stream(steps=12, rate=300, seed=0):
    """Events on partitions 0-1 (country skewed to 'de'), questions on partition 2."""
    rng = random.Random(seed)
    items, offsets, truth = [], [0, 0, 0], defaultdict(int)
    for step in range(steps):
        for _ in range(rate):
            p = rng.randrange(2)
            country = rng.choices(["de", "fr", "uk"], [5, 3, 2])[0]
            ts = ORIGIN + step + rng.random() * 0.9
            body = json.dumps({"country": country, "age": rng.uniform(0, 100), "ts": ts})
            items.append(raw(p, body.encode(), offsets[p], ts, topic="events"))
            offsets[p] += 1
            truth[(step, country)] += 1
        for i, query in enumerate([DE, ADULT_FR, {"kind": "marginal", "attrs": ["country"]}]):
            ts = ORIGIN + step + 0.95
            items.append(raw(2, question(f"s{step}-{i}", query), offsets[2], ts,
                             topic="queries"))
            offsets[2] += 1
        items.append(raw(2, question(f"g{step}", DE, "g"), offsets[2], ORIGIN + step + 0.95,
                         topic="queries"))
        offsets[2] += 1
    items.sort(key=lambda m: m[4])
    return items, truth


def run(cfg, items, workers=1, batch=100, metrics=None):
    return run_in_memory(cfg, items, KEY, instance="p-1", partitions=PARTITIONS, workers=workers,
                         batch=batch, metrics=metrics)


def answers(sink):
    return {json.loads(v)["id"]: json.loads(v) for role, _k, v in sink if role == "answers"}


@pytest.mark.flow
def test_every_question_is_answered_once_with_its_step_and_accurate_values():
    items, truth = stream()
    out = answers(run(config(), items))
    assert len(out) == 12 * 4
    for qid, a in out.items():
        assert a["schema"] == "dpstream.answer/1" and a["flow"] == "p"
        step = int(qid[1:].split("-")[0])
        assert a["step"] == step  # answered in the step of its broker time
        total = sum(n for (s, _c), n in truth.items() if s <= step)
        de = sum(n for (s, c), n in truth.items() if s <= step and c == "de")
        if a["kind"] == "waiting":
            assert a["t"] < (500 if qid.startswith("s") else 1000)
            continue
        if qid.startswith("g"):  # BBScheduler's noisy histogram
            assert a["mechanism"] == "histogram" and a["kind"] == "easy"
            assert abs(a["value"] - de / total) < 0.2
        elif qid.endswith("-0") and a["kind"] in ("easy", "hard"):
            assert abs(a["value"] - de / total) < 0.15
        elif qid.endswith("-2"):
            assert a["kind"] == "marginal" and len(a["value"]) == 3 and len(a["kinds"]) == 3
        assert 0 < a["privacy"]["spent"] <= a["privacy"]["budget"]
    kinds = {a["kind"] for a in out.values()}
    assert {"easy", "hard"} <= kinds


@pytest.mark.flow
def test_answers_do_not_depend_on_batching_interleaving_or_workers():
    items, _ = stream(steps=8)
    first = answers(run(config(), items))
    assert answers(run(config(), items, batch=7)) == first
    # the same records, but every question delivered before the events of its step: the
    # database a question sees is defined by the steps, not by arrival order
    questions_first = sorted(items, key=lambda m: (m[4] // 1000, m[0] != 2, m[4]))
    assert answers(run(config(), questions_first, batch=13)) == first
    assert answers(run(config(), items, workers=2)) == first


@pytest.mark.flow
def test_a_replay_is_byte_identical_and_the_noise_key_and_instance_matter():
    items, _ = stream(steps=6)
    one = run(config(), items)
    assert one == run(config(), items)
    other = []
    flow = build_flow(config(), NoiseKey.for_tests(6), instance="p-1", partitions=PARTITIONS,
                      source=TestingSource(items, 100), sink=TestingSink(other))
    run_main(flow)
    hard = [qid for qid, a in answers(one).items() if a["kind"] == "hard"]
    assert hard and any(answers(other)[q]["value"] != answers(one)[q]["value"] for q in hard)


@pytest.mark.flow
def test_bad_records_become_dead_letters_and_bad_questions_error_answers():
    items, _ = stream(steps=3)
    t = ORIGIN + 2.96
    items += [
        raw(0, b'{"country": "xx", "age": 3, "ts": %f}' % t, 10_000, t, topic="events"),
        raw(0, b'{"country": "de", "age": 300, "ts": %f}' % t, 10_001, t, topic="events"),
        raw(1, b"not json", 10_000, t, topic="events"),
        raw(2, b'{"id": "u", "histogram": "nope", "query": {}}', 10_000, t, topic="queries"),
        raw(2, b'{"histogram": "h", "query": {}}', 10_001, t, topic="queries"),
        raw(2, b'{"id": "v", "histogram": ["h"], "query": {}}', 10_004, t, topic="queries"),
        raw(2, question("bad", {"kind": "count", "where": [{"attr": "city", "eq": "x"}]}),
            10_002, t, topic="queries"),
        raw(2, question("old", {"schema": "dpstream.query/9", "kind": "count"}), 10_003, t,
            topic="queries"),
    ]
    items.sort(key=lambda m: m[4])
    sink = run(config(), items)
    dead = [json.loads(v) for role, _k, v in sink if role == "dead_letters"]
    reasons = sorted(d["reason"] for d in dead)
    assert len(dead) == 6  # an unhashable histogram name once crashed the flow
    assert any("'xx' is not one of the declared values" in r for r in reasons)
    assert any("age" in r and "300" in r for r in reasons)
    assert "invalid JSON" in reasons
    assert any("must name a configured histogram" in r for r in reasons)
    assert any("field 'id'" in r for r in reasons)
    queries_letter = next(d for d in dead if "configured histogram" in d["reason"])
    assert queries_letter["source"] == {"topic": "queries", "partition": 0, "offset": 10_000}
    out = answers(sink)
    assert out["bad"]["kind"] == "error" and "city" in out["bad"]["reason"]
    assert out["old"]["kind"] == "error" and out["old"]["value"] is None


@pytest.mark.flow
def test_a_crash_and_resume_reproduces_every_answer(tmp_path):
    init_db_dir(tmp_path, 1)
    items, _ = stream(steps=10)
    whole = answers(run(config(), items))
    crashing = items[: len(items) // 2] + [TestingSource.ABORT()] + items[len(items) // 2:]
    sink: list = []
    for _ in range(2):
        flow = build_flow(config(), KEY, instance="p-1", partitions=PARTITIONS,
                          source=TestingSource(crashing, 50), sink=TestingSink(sink))
        run_main(flow, epoch_interval=timedelta(0), recovery_config=RecoveryConfig(tmp_path))
    by_id = defaultdict(set)
    for role, _k, v in sink:
        if role == "answers":
            by_id[json.loads(v)["id"]].add(v)
    assert all(len(copies) == 1 for copies in by_id.values())  # replays are byte-identical
    assert {q: json.loads(next(iter(c))) for q, c in by_id.items()} == whole


def test_a_snapshot_refuses_other_histogram_parameters():
    shard = PmwgShard(config(), KEY, "p-1", 3)
    shard.bind(0)
    state = shard.to_state()
    with pytest.raises(Exception, match="other mechanism parameters"):
        PmwgShard(config(alpha=0.2), KEY, "p-1", 3, state)
    with pytest.raises(Exception, match="another noise key"):
        PmwgShard(config(), NoiseKey.for_tests(9), "p-1", 3, state)


@pytest.mark.flow
def test_metrics_count_answers_per_histogram_never_per_query():
    metrics = FlowMetrics("p", CollectorRegistry())
    items, _ = stream(steps=6)
    run(config(), items, metrics=metrics)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in metrics.registry.collect() for s in family.samples}
    answered = sum(v for (name, _l), v in samples.items() if name == "dpstream_answers_total")
    assert answered == 6 * 4
    for (_name, labels), _v in samples.items():
        assert "id" not in dict(labels) and "query" not in dict(labels)
    spent = {dict(labels)["histogram"]: v for (name, labels), v in samples.items()
             if name == "dpstream_histogram_privacy_spent"}
    assert set(spent) == {"h", "g"} and all(v > 0 for v in spent.values())


@pytest.mark.parametrize("change, message", [
    ({"privacy": {"budget": 0.5}}, "cannot pay for every histogram"),
    ({"flow": {"origin": None}}, "flow.origin is required"),
    ({"histograms": [{"name": "h", "universe": [{"name": "a", "values": []}]}]}, "universe"),
    ({"histograms": [{"name": "h", "mechanism": "histogram", "alpha": 0.1,
                      "universe": UNIVERSE}]}, "PMWG setting"),
    ({"histograms": []}, "at least one"),
])
def test_configuration_errors_are_precise(change, message):
    raw_config = {
        "flow": {"kind": "pmwg", "origin": "2026-09-21T14:13:20Z"},
        "privacy": {"budget": 1.0},
        "histograms": [{"name": "h", "universe": UNIVERSE, "hard_queries": 5}],
    }
    for table, value in change.items():
        if isinstance(value, dict):
            raw_config[table].update(value)
            raw_config[table] = {k: v for k, v in raw_config[table].items() if v is not None}
        else:
            raw_config[table] = value
    with pytest.raises(ConfigError, match=message):
        parse_config(raw_config)


def test_the_example_configuration_loads_and_reports_its_guarantees():
    from dpstream.platform import load_config

    cfg = load_config("deploy/pmwg.example.toml")
    text = cfg.describe()
    assert cfg.kind == "pmwg" and "histogram 'sessions'" in text and "Theorem 27" in text
    assert "VIOLATED" not in text  # issue 22 item 9: the example passes its own check


def test_check_config_says_which_mechanism_suits_the_universe():
    from dpstream.kinds.pmwg.config import which_mechanism

    assert "'histogram'" in which_mechanism(2**10, 10**6, 1.0, 0.05)  # sqrt(N) << alpha eps t
    assert "'pmwg'" in which_mechanism(2**40, 10**6, 1.0, 0.05)
    assert "which mechanism" in config().describe()
