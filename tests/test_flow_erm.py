"""The ERM flow kind with in-memory input and output: models, order, workers, recovery."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from datetime import timedelta

import numpy as np
import pytest
from bytewax.recovery import RecoveryConfig, init_db_dir
from bytewax.testing import TestingSink, TestingSource, run_main
from prometheus_client import CollectorRegistry
from support.flows import run_in_memory
from support.messages import raw

from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import ConfigError
from dpstream.estimator import ReleasedClassifier, SchemaError
from dpstream.kinds.erm.shard import ErmShard
from dpstream.metrics import FlowMetrics
from dpstream.platform import build_flow, parse_config

ORIGIN = 1_790_000_000  # 2026-09-21T14:13:20Z
KEY = NoiseKey.for_tests(8)
D = 4
TRUE_W = np.array([2.0, -1.5, 1.0, 0.0])


def sample(rng: random.Random):
    x = [rng.gauss(0, 1) for _ in range(D)]
    score = float(np.dot(TRUE_W, x)) + 0.3
    return x, ("yes" if score + rng.gauss(0, 0.5) > 0 else "no")


def config(holdout=None, **release):
    raw_config = {
        "flow": {"kind": "erm", "name": "m", "origin": "2026-09-21T14:13:20Z", "step": "1s",
                 "shards": 4},
        "privacy": {"accounting": "pure", "epsilon": 1.0},
        "metrics": {"port": 0},
        "model": {"classes": ["no", "yes"], "dimension": D, "clip_norm": 3.0,
                  "regularization": 0.05, "streams": ["a", "b"], "stream_field": "s"},
        "release": {"algorithm": "continual", "block_size": 200, "base_blocks": 2,
                    **release},
    }
    if holdout is not None:
        raw_config["holdout"] = {"path": str(holdout)}
    return parse_config(raw_config)


def stream(steps=12, rate=240, seed=0, partitions=2):
    """Events for streams a and b over ``steps`` steps, on ``partitions`` partitions."""
    rng = random.Random(seed)
    items, offsets = [], [0] * partitions
    for step in range(steps):
        for _ in range(rate):
            p = rng.randrange(partitions)
            x, y = sample(rng)
            ts = ORIGIN + step + rng.random() * 0.9
            body = {"features": x, "label": y, "s": rng.choice("ab"), "ts": ts}
            items.append(raw(p, json.dumps(body).encode(), offsets[p], ts))
            offsets[p] += 1
    items.sort(key=lambda m: m[4])
    return items


def holdout_file(tmp_path, rows=400, seed=99):
    rng = random.Random(seed)
    path = tmp_path / "holdout.jsonl"
    lines = []
    for _ in range(rows):
        x, y = sample(rng)
        lines.append(json.dumps({"features": x, "label": y}))
    path.write_text("\n".join(lines))
    return path


def run(cfg, items, workers=1, batch=100, metrics=None, partitions=2):
    return run_in_memory(cfg, items, KEY, instance="m-1", partitions=partitions, workers=workers,
                         batch=batch, metrics=metrics)


def models(sink):
    """The model records (``dpstream.model/1``) of the models topic, in order."""
    return [b for b in (json.loads(v) for role, _k, v in sink if role == "models")
            if b["schema"] == "dpstream.model/1"]


def servings(sink):
    """The serving records (``dpstream.serving/1``) of the models topic, in order."""
    return [b for b in (json.loads(v) for role, _k, v in sink if role == "models")
            if b["schema"] == "dpstream.serving/1"]


def test_continual_release_publishes_usable_models_with_their_window_and_cost(tmp_path):
    cfg = config(holdout=holdout_file(tmp_path))
    out = models(run(cfg, stream()))
    assert out
    by_stream = defaultdict(list)
    for m in out:
        by_stream[m["stream"]].append(m)
        assert m["schema"] == "dpstream.model/1" and m["flow"] == "m"
        assert m["classes"] == ["no", "yes"]
        assert len(m["coef"]) == 1 and len(m["coef"][0]) == D and len(m["intercept"]) == 1
        assert m["window"]["first_step"] <= m["window"]["last_step"] <= m["step"]
        assert 0 < m["privacy"]["cost"] <= m["privacy"]["spent"] <= m["privacy"]["budget"]
        assert m["privacy"]["budget"] == pytest.approx(2.0)  # Algorithm 2 + Algorithm 4
        assert m["holdout"]["rows"] == 400
    assert set(by_stream) == {"a", "b"}
    for ms in by_stream.values():
        steps = [m["step"] for m in ms]
        assert steps == sorted(steps)
        assert min(steps) == 1  # the first base model at B = 2 blocks (steps 0 and 1)
        # a model is released at every step from the first base on
        assert set(range(1, 12)) <= set(steps)
    # the estimator built from a record predicts what the flow scored on the holdout
    rows = [json.loads(line) for line in (tmp_path / "holdout.jsonl").read_text().splitlines()]
    X = np.array([r["features"] for r in rows])
    y = np.array([r["label"] for r in rows])
    last = by_stream["a"][-1]
    clf = ReleasedClassifier.from_record(json.dumps(last))
    assert clf.score(X, y) == pytest.approx(last["holdout"]["accuracy"])
    assert clf.predict_proba(X).shape == (400, 2)
    majority = max(np.mean(y == "yes"), np.mean(y == "no"))
    # one block of ~120 events at epsilon/2 is a noisy update; over the stream the models
    # learned something (the median release beats the majority class by 10 points)
    accuracies = [m["holdout"]["accuracy"] for m in out]
    assert np.median(accuracies) > majority + 0.10


def test_models_do_not_depend_on_batching_interleaving_or_workers():
    items = stream(steps=8)
    first = run(config(), items)
    assert models(first)
    assert sorted(run(config(), items, batch=7)) == sorted(first)
    shuffled = sorted(items, key=lambda m: (m[4] // 1000, -m[0], m[4]))  # partitions swapped
    assert sorted(run(config(), shuffled, batch=13)) == sorted(first)
    assert sorted(run(config(), items, workers=2)) == sorted(first)


def test_a_replay_is_byte_identical_and_the_noise_key_matters():
    items = stream(steps=5)
    one = run(config(), items)
    assert one == run(config(), items)
    other: list = []
    flow = build_flow(config(), NoiseKey.for_tests(9), instance="m-1", partitions=2,
                      source=TestingSource(items, 100), sink=TestingSink(other))
    run_main(flow)
    assert len(models(other)) == len(models(one))
    assert [m["coef"] for m in models(other)] != [m["coef"] for m in models(one)]


def test_bad_records_become_dead_letters_and_name_no_value():
    items = stream(steps=3)
    t = ORIGIN + 2.5
    items += [
        raw(0, b'{"features": [1, 2], "label": "yes", "s": "a", "ts": %f}' % t, 10_000, t),
        raw(0, b'{"features": [1, 2, 3, "x"], "label": "yes", "s": "a", "ts": %f}' % t,
            10_001, t),
        raw(0, b'{"features": [1, 2, 3, 4], "label": "maybe", "s": "a", "ts": %f}' % t,
            10_002, t),
        raw(1, b'{"features": [1, 2, 3, 4], "label": "yes", "s": "zz", "ts": %f}' % t,
            10_000, t),
        raw(1, b'{"features": [1, 2, 3, 4], "label": "yes", "s": "a"}', 10_001, t),
        raw(1, b"not json", 10_002, t),
        raw(1, b'{"features": [1, 2, 3, 4], "label": "yes", "s": ["a"], "ts": %f}' % t,
            10_003, t),  # an unhashable stream name once crashed the flow
    ]
    items.sort(key=lambda m: m[4])
    sink = run(config(), items)
    dead = [json.loads(v) for role, _k, v in sink if role == "dead_letters"]
    reasons = sorted(d["reason"] for d in dead)
    assert len(dead) == 7
    assert sum("must be a list of 4 numbers" in r for r in reasons) == 2
    assert sum("configured model stream" in r for r in reasons) == 2
    assert any("configured classes" in r and "maybe" not in r for r in reasons)
    assert any("configured model stream" in r and "zz" not in r for r in reasons)
    assert any("ts" in r for r in reasons) and "invalid JSON" in reasons


def test_a_crash_and_resume_reproduces_every_model(tmp_path):
    init_db_dir(tmp_path, 1)
    items = stream(steps=10)
    first = run(config(), items)
    whole = models(first) + servings(first)  # the serving records too: the same on a replay
    crashing = items[: len(items) // 2] + [TestingSource.ABORT()] + items[len(items) // 2:]
    sink: list = []
    for _ in range(2):
        flow = build_flow(config(), KEY, instance="m-1", partitions=2,
                          source=TestingSource(crashing, 50), sink=TestingSink(sink))
        run_main(flow, epoch_interval=timedelta(0), recovery_config=RecoveryConfig(tmp_path))
    copies = defaultdict(set)
    for role, _k, v in sink:
        if role == "models":
            m = json.loads(v)
            copies[(m["schema"], m["stream"], m["step"], m.get("role"),
                    str(m.get("level")))].add(v)
    assert all(len(c) == 1 for c in copies.values())  # replays are byte-identical

    def order(m):
        return (m["schema"], m["stream"], m["step"], str(m.get("role")), str(m.get("level")))

    resumed = sorted((json.loads(next(iter(c))) for c in copies.values()), key=order)
    assert any(m["schema"] == "dpstream.serving/1" for m in resumed)
    assert resumed == sorted(whole, key=order)


def test_a_snapshot_refuses_other_model_parameters():
    shard = ErmShard(config(), KEY, "m-1", 2)
    shard.bind(0)
    state = shard.to_state()
    with pytest.raises(Exception, match="other mechanism parameters"):
        ErmShard(config(block_size=100), KEY, "m-1", 2, state)
    with pytest.raises(Exception, match="another noise key"):
        ErmShard(config(), NoiseKey.for_tests(11), "m-1", 2, state)


def test_metrics_count_models_per_stream_and_role_never_per_event():
    metrics = FlowMetrics("m", CollectorRegistry())
    run(config(), stream(steps=6), metrics=metrics)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in metrics.registry.collect() for s in family.samples}
    released = {dict(labels)["stream"]: v for (name, labels), v in samples.items()
                if name == "dpstream_models_released_total"}
    assert set(released) == {"a", "b"} and all(v > 0 for v in released.values())
    spent = [v for (name, _l), v in samples.items() if name == "dpstream_model_privacy_spent"]
    assert spent and all(0 < v <= 2.0 for v in spent)


@pytest.mark.parametrize("algorithm, extra, roles", [
    ("multi-resolution", {}, {"multi-resolution"}),
    ("independent", {}, {"independent"}),
    ("sliding-window", {"window_blocks": 3}, {"window"}),
    ("continual", {"sampling": True}, None),
    ("multi-resolution", {"sampling": True}, {"multi-resolution"}),
    ("sliding-window", {"window_blocks": 3, "sampling": True}, {"window"}),
])
def test_every_algorithm_runs_in_the_flow(algorithm, extra, roles):
    cfg = config(algorithm=algorithm, **extra)
    out = models(run(cfg, stream(steps=9, rate=120)))
    assert out
    if roles is not None:
        assert {m["role"] for m in out} <= roles | {"base"}
    for m in out:
        assert 0 < m["privacy"]["spent"] <= m["privacy"]["budget"]


def test_ermg_runs_in_the_flow():
    cfg = parse_config({
        "flow": {"kind": "erm", "name": "g", "origin": "2026-09-21T14:13:20Z", "step": "1s"},
        "privacy": {"epsilon": 1.0, "delta": 1e-6},
        "metrics": {"port": 0},
        "model": {"classes": ["no", "yes"], "dimension": D, "clip_norm": 3.0,
                  "regularization": 0.05},
        "release": {"algorithm": "ermg", "block_size": 100, "first_blocks": 2},
    })
    out = models(run(cfg, stream(steps=6, rate=100)))
    assert out and {m["stream"] for m in out} == {"default"}
    assert all(m["privacy"]["spent"] <= m["privacy"]["budget"] for m in out)
    assert {(m["privacy"]["accounting"], m["privacy"]["delta"]) for m in out} == {
        ("approx_dp", 1e-6)}


def test_zcdp_multinomial_models_predict_every_class():
    cfg = parse_config({
        "flow": {"kind": "erm", "name": "z", "origin": "2026-09-21T14:13:20Z", "step": "1s"},
        "privacy": {"accounting": "zcdp", "rho": 0.5},
        "metrics": {"port": 0},
        "model": {"classes": [0, 1, 2], "dimension": D, "clip_norm": 3.0,
                  "regularization": 0.05},
        "release": {"algorithm": "independent", "block_size": 200},
    })
    rng = random.Random(3)
    items = []
    for i in range(600):
        x = [rng.gauss(0, 1) for _ in range(D)]
        label = int(np.argmax([x[0], x[1], -x[0] - x[1]]))
        ts = ORIGIN + i // 200 + 0.5
        items.append(raw(0, json.dumps({"features": x, "label": label, "ts": ts}).encode(),
                         i, ts))
    out = models(run(cfg, items, partitions=1))
    assert out and len(out[-1]["coef"]) == 3 and out[-1]["privacy"]["accounting"] == "zcdp"
    clf = ReleasedClassifier.from_record(out[-1])
    X = np.array([json.loads(m[1])["features"] for m in items])
    y = np.array([json.loads(m[1])["label"] for m in items])
    assert clf.score(X, y) > 0.5 and set(clf.predict(X)) <= {0, 1, 2}


def test_the_estimator_is_scikit_learn_compatible():
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score
    from sklearn.utils.validation import check_is_fitted

    rng = np.random.default_rng(0)
    X = rng.normal(size=(50, 3))
    record = {"schema": "dpstream.model/1", "classes": ["a", "b", "c"], "role": "update",
              "coef": rng.normal(size=(3, 3)).tolist(), "intercept": [0.1, 0.0, -0.1],
              "features": {"dimension": 3, "clip_norm": 100.0}}
    clf = ReleasedClassifier.from_record(record)
    check_is_fitted(clf)
    reference = LogisticRegression()
    reference.classes_ = np.array(["a", "b", "c"])
    reference.coef_ = np.array(record["coef"])
    reference.intercept_ = np.array(record["intercept"])
    assert (clf.predict(X) == reference.predict(X)).all()
    np.testing.assert_allclose(clf.predict_proba(X), reference.predict_proba(X), rtol=1e-9)
    assert accuracy_score(reference.predict(X), clf.predict(X)) == 1.0
    with pytest.raises(SchemaError, match="already fitted"):
        clf.fit(X, None)
    with pytest.raises(SchemaError, match="carries no model"):
        ReleasedClassifier.from_record({"schema": "dpstream.model/1", "role": "exhausted",
                                        "reason": "spent"})
    with pytest.raises(SchemaError, match="not a dpstream.model/1"):
        ReleasedClassifier.from_record(b'{"schema": "dpstream.answer/1"}')


@pytest.mark.parametrize("section, change, message", [
    ("release", {"algorithm": "boosting"}, "release.algorithm must be one of"),
    ("release", {"algorithm": "sliding-window", "window_blocks": 6}, "window"),
    ("release", {"base_blocks": 3}, "base_blocks"),
    ("model", {"classes": ["x"]}, "at least two labels"),
    ("model", {"stream_field": None}, "stream_field must name"),
    ("model", {"regularization": -1.0}, "regularization"),
    ("model", {"dimension": None}, "dimension"),
    ("holdout", {"path": "/nonexistent/holdout.jsonl"}, "cannot read"),
])
def test_configuration_errors_are_precise(section, change, message):
    raw_config = {
        "flow": {"kind": "erm", "origin": "2026-09-21T14:13:20Z"},
        "model": {"classes": ["no", "yes"], "dimension": 4, "streams": ["a", "b"],
                  "stream_field": "s"},
        "release": {}, "holdout": {},
    }
    raw_config[section].update(change)
    raw_config[section] = {k: v for k, v in raw_config[section].items() if v is not None}
    if not raw_config["holdout"]:
        del raw_config["holdout"]
    with pytest.raises(ConfigError, match=message):
        parse_config(raw_config)


def test_sampling_is_refused_under_zcdp():
    with pytest.raises(ConfigError, match="(?i)sampl"):
        parse_config({
            "flow": {"kind": "erm", "origin": "2026-09-21T14:13:20Z"},
            "privacy": {"accounting": "zcdp", "rho": 0.5},
            "model": {"classes": [0, 1], "dimension": 2},
            "release": {"sampling": True},
        })


def test_the_example_configuration_loads_and_reports_its_guarantee():
    from dpstream.platform import load_config

    cfg = load_config("deploy/erm.example.toml")
    text = cfg.describe()
    assert cfg.kind == "erm" and "continual" in text and "2" in text


# -- the model to serve ---------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm, extra", [
    ("continual", {}), ("sliding-window", {"window_blocks": 3}), ("multi-resolution", {}),
    ("independent", {}),
])
def test_every_step_has_one_serving_record_per_stream_naming_a_released_model(algorithm,
                                                                              extra):
    cfg = config(algorithm=algorithm, **extra)
    sink = run(cfg, stream(steps=9, rate=120))
    released = models(sink)
    position = {(m["stream"], m["role"], m["level"], m["step"]): i
                for i, m in enumerate(json.loads(v) for role, _k, v in sink
                                      if role == "models") if "role" in m}
    served = servings(sink)
    per_stream = defaultdict(list)
    for i, body in enumerate(json.loads(v) for role, _k, v in sink if role == "models"):
        if body["schema"] != "dpstream.serving/1":
            continue
        per_stream[body["stream"]].append(body["step"])
        named = body["model"]
        if named is None:  # none yet: no model of the stream released by this step
            assert not [m for m in released
                        if m["stream"] == body["stream"] and m["step"] <= body["step"]]
            continue
        key = (body["stream"], named["role"], named["level"], named["step"])
        assert key in position and position[key] < i  # released, and published before it
        model = next(m for m in released if (m["stream"], m["role"], m["level"],
                                              m["step"]) == key)
        assert named["noise_std"] == model["noise"]["std"]
        spans = model["depends_on"]
        assert named["window"]["first_step"] == min(a for a, _ in spans)
        assert named["window"]["last_step"] == max(b for _, b in spans)
    assert served and set(per_stream) == {"a", "b"}
    last = max(b["step"] for b in served)
    for steps in per_stream.values():
        assert steps == list(range(last + 1))  # every step, exactly once, in order
    final = {b["stream"]: b["model"] for b in served if b["step"] == last}
    for name, named in final.items():
        newest = max(b for m in released if m["stream"] == name for _, b in m["depends_on"])
        assert named is not None and named["window"]["last_step"] == newest, (name, named)
        if algorithm == "continual":
            assert named["window"]["first_step"] == 0  # the model of all the data so far


def test_released_classifier_latest_predicts_like_the_served_model_itself(monkeypatch):
    """From a real run's records: the classifier the serving record names scores raw rows
    exactly as the core scores the model's own parameters on the flow's own feature map."""
    from dpstream.client import ReleasedClassifier as ClientClassifier
    from dpstream.client import decode
    from dpstream.core.erm.model import predict, predict_proba
    from dpstream.kinds.erm.records import ModelEncoder
    from dpstream.kinds.erm.shard import ModelRecord

    seen = {}
    encode = ModelEncoder.encode

    def spy(self, m):  # keep each released model's own parameters (a spy: it encodes as ever)
        if isinstance(m, ModelRecord) and m.model is not None:
            seen[(m.stream, m.role, m.level, m.step)] = m.model.params
        return encode(self, m)

    monkeypatch.setattr(ModelEncoder, "encode", spy)
    cfg = config()
    sink = run(cfg, stream(steps=8, rate=120))
    records = [decode(v) for role, _k, v in sink if role == "models"]
    assert ClientClassifier is ReleasedClassifier
    for name in ("a", "b"):
        clf = ReleasedClassifier.latest(records, stream=name)
        assert clf is not None
        key = (name, clf.record["role"], clf.record["level"], clf.record["step"])
        params = seen[key]
        rng = np.random.default_rng(7)
        X = np.vstack([rng.normal(size=(200, D)), 50 * rng.normal(size=(20, D))])  # some clipped
        z = cfg.model.features(X)
        own = np.asarray(cfg.model.classes)[predict(cfg.model, params, z)]
        assert (clf.predict(X) == own).all()
        np.testing.assert_allclose(clf.predict_proba(X), predict_proba(cfg.model, params, z),
                                   rtol=1e-9, atol=1e-12)
    # before any serving record that names a model: nothing to serve
    first = [r for r in records if getattr(r, "model", 0) is None]
    assert first and ReleasedClassifier.latest(first, stream="a") is None
