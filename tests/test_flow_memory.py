"""The counters dataflow with in-memory input and output: 1 and 2 workers, both key universes."""

from __future__ import annotations

import json
import random
from collections import Counter, defaultdict

import pytest
from bytewax.testing import TestingSink, TestingSource, run_main
from support.flows import run_in_memory
from support.messages import message, raw

from dpstream.core.noise.keys import NoiseKey
from dpstream.metrics import FlowMetrics
from dpstream.platform import build_flow, parse_config

ORIGIN = 1_790_000_000  # 2026-09-21, an arbitrary whole second
KEY = NoiseKey.for_tests(3)


def config(mode="declared", accounting="pure", **extra):
    raw = {
        "flow": {"name": "t", "origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 4},
        "privacy": {"accounting": accounting, "budget": 1.0, "delta": 1e-6},
        "metrics": {"port": 0},
    }
    if mode == "declared":
        raw["admission"] = {"mode": "declared", "keys": ["a", "b", "c"]}
    else:
        raw["admission"] = {"mode": "open"}
        raw["monitor"] = {"epsilon": 0.2, "horizon": 100}
        raw["counter"] = {"epsilon": 0.5} if accounting == "pure" else {"rho": 0.5}
    for table, values in extra.items():
        raw.setdefault(table, {}).update(values)
    return parse_config(raw)


def events(steps, rates, partitions=2, seed=0):
    """Events for keys at given per-step rates, spread over partitions in time order."""
    rng = random.Random(seed)
    out, truth, offsets = [], defaultdict(Counter), Counter()
    for step in range(steps):
        batch = []
        for key, rate in rates.items():
            n = rng.randint(rate // 2, rate) if rate else 0
            truth[key][step] += n
            batch += [(key, ORIGIN + step + rng.random() * 0.99) for _ in range(n)]
        batch.sort(key=lambda e: e[1])
        for key, ts in batch:
            p = rng.randrange(partitions)
            out.append(message(p, key, ts, offsets[p]))
            offsets[p] += 1
    return out, truth


def run(cfg, items, partitions=2, workers=1, metrics=None):
    return run_in_memory(cfg, items, KEY, instance="t-1", partitions=partitions, workers=workers,
                         batch=500, metrics=metrics)


def by_role(sink):
    roles = defaultdict(list)
    for role, _key, value in sink:
        roles[role].append(json.loads(value))
    return roles


def test_declared_keys_release_every_step_near_the_truth():
    items, truth = events(40, {"a": 30, "b": 5, "c": 0})
    out = by_role(run(config(), items))
    releases = out["releases"]
    seen = {(r["key"], r["step"]) for r in releases}
    assert seen == {(k, s) for k in "abc" for s in range(40)}  # zero steps still release
    assert len(releases) == len(seen)  # exactly one value per coordinate
    for r in releases:
        true_prefix = sum(truth[r["key"]][s] for s in range(r["step"] + 1))
        # noise is fixed by the test key; one Laplace exceeds 6 sd w.p. exp(-6*sqrt(2)) = 2e-4
        assert abs(r["value"] - true_prefix) <= 6 * r["std"]
        assert r["schema"] == "dpstream.release/1" and r["mechanism"] == "tree-laplace"
        assert r["privacy"]["spent"] <= r["privacy"]["budget"]
        assert r["window"]["start"].endswith("Z")
    assert not out["alerts"] and not out["dead_letters"]


def test_two_workers_give_the_same_releases_as_one():
    items, _ = events(30, {"a": 20, "b": 3, "c": 1})
    one = sorted(run(config(), items, workers=1))
    two = sorted(run(config(), items, workers=2))
    assert one == two


def test_open_universe_admits_popular_keys_and_hides_rare_ones():
    cfg = config(mode="open")
    threshold = cfg.privacy.monitor.threshold
    items, truth = events(30, {"hot": 4 * threshold, "rare": 0}, seed=1)
    items.append(message(0, "rare", ORIGIN + 29.5, 10**6))
    out = by_role(run(cfg, items))
    assert [a["key"] for a in out["alerts"]] == ["hot"]
    admitted = out["alerts"][0]["step"]
    steps = sorted(r["step"] for r in out["releases"] if r["key"] == "hot")
    assert steps == list(range(admitted, 30))
    everything = json.dumps(out)
    assert "rare" not in everything  # a single-event key leaves no trace on any output


def test_bad_records_go_to_dead_letters_with_reasons():
    items, _ = events(5, {"a": 5})
    bad = [b"not json", b"[1,2]", b'{"ts": 1}', b'{"key": "a"}', b'{"key": "a", "ts": "soon"}',
           json.dumps({"key": "zzz", "ts": ORIGIN + 1}).encode(),
           json.dumps({"key": "a", "ts": ORIGIN - 100}).encode(),
           json.dumps({"key": "a", "ts": ORIGIN + 0.5}).encode()]
    offset = 10_000
    for value in bad:  # the last one's broker time went back to step 0, closed by then: late
        items.append(raw(0, value, offset, ORIGIN + (0.5 if value is bad[-1] else 4.9)))
        offset += 1
    metrics = FlowMetrics("t")
    out = by_role(run(config(), items, metrics=metrics))
    reasons = [d["reason"] for d in out["dead_letters"]]
    assert len(reasons) == len(bad)
    for expected in ("invalid JSON", "not a JSON object", "field 'key' missing",
                     "field 'ts' missing", "key is not in admission.keys", "before flow.origin",
                     "late:"):
        assert any(expected in r for r in reasons), (expected, reasons)
    import base64
    assert {base64.b64decode(d["original_base64"]) for d in out["dead_letters"]} == set(bad)
    assert all(d["source"]["partition"] == 0 for d in out["dead_letters"])
    dead_total = sum(s.value for m in metrics.registry.collect() for s in m.samples
                     if s.name == "dpstream_dead_letters_total")
    assert dead_total == len(bad)


def test_zcdp_flow_uses_the_blt_counter():
    cfg = config(accounting="zcdp", privacy={"budget": 1.0}, counter={"rho": 0.5})
    items, truth = events(20, {"a": 10, "b": 10, "c": 10})
    releases = by_role(run(cfg, items))["releases"]
    assert {r["mechanism"] for r in releases} == {"blt-gaussian"}
    approx = releases[0]["privacy"]["approx_dp"]  # 0.5-zCDP at delta 1e-6 (BS16 Prop. 1.3)
    assert approx["epsilon"] == pytest.approx(0.5 + 2 * (0.5 * 13.815510557964274) ** 0.5)
    assert approx["delta"] == pytest.approx(1e-6)
    assert len(releases) == 60
    for r in releases:
        true_prefix = sum(truth[r["key"]][s] for s in range(r["step"] + 1))
        assert abs(r["value"] - true_prefix) <= 6 * r["std"]


def test_resume_under_a_raised_budget_continues_without_statuses(tmp_path):
    """The budget may change under a running instance; the mechanisms may not."""
    from datetime import timedelta

    from bytewax.recovery import RecoveryConfig, init_db_dir

    init_db_dir(tmp_path, 1)
    recovery = RecoveryConfig(tmp_path)
    items, _ = events(10, {"a": 5, "b": 5, "c": 5})
    whole = by_role(run(config(), items))["releases"]
    sink: list = []
    crashing = items[:60] + [TestingSource.ABORT()] + items[60:]  # a crash, not an EOF
    flow = build_flow(config(), KEY, instance="t-1", partitions=2,
                      source=TestingSource(crashing, 10), sink=TestingSink(sink))
    run_main(flow, epoch_interval=timedelta(0), recovery_config=recovery)
    assert sink and len(sink) < len(whole)
    sink2: list = []
    raised = config(privacy={"budget": 2.0}, counter={"epsilon": 0.7})  # the same counter
    flow2 = build_flow(raised, KEY, instance="t-1", partitions=2,
                       source=TestingSource(crashing, 10), sink=TestingSink(sink2))
    run_main(flow2, epoch_interval=timedelta(0), recovery_config=recovery)
    out = by_role(sink + sink2)["releases"]
    assert all(r["schema"] == "dpstream.release/1" for r in out)
    values = {(r["key"], r["step"]): r["value"] for r in out}
    assert values == {(r["key"], r["step"]): r["value"] for r in whole}  # same noise, same data


@pytest.mark.parametrize("accounting", ["pure", "zcdp"])
def test_same_key_same_releases_across_runs(accounting):
    """Replay safety at the flow level: rerunning the same input gives byte-identical output."""
    cfg = config(accounting=accounting, counter={"rho": 0.5} if accounting == "zcdp" else {})
    items, _ = events(15, {"a": 10, "b": 2})
    assert run(cfg, items) == run(cfg, items)
