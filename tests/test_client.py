"""The consumer library (``dpstream.client``): typed records, schema checks, the latest value per
key and replay de-duplication, on records of a real flow run and of the real encoders, read back
from the real broker."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from pathlib import Path

import numpy as np
import orjson
import pytest
from support.configs import counters, write

from dpstream.client import (
    Alert,
    Answer,
    DeadLetter,
    LatestValues,
    Model,
    ReadStats,
    RecordConsumer,
    Release,
    SchemaVersionError,
    Serving,
    Status,
    UnknownRecordError,
    decode,
)
from dpstream.client.render import live_table, record_row
from dpstream.core.counting import outputs as core
from dpstream.core.erm.model import PrivateModel
from dpstream.core.erm.serving import ServingCandidate
from dpstream.errors import DpstreamError
from dpstream.estimator import ReleasedClassifier, SchemaError
from dpstream.io.topics import produce, read_all
from dpstream.kinds.counters.records import RecordEncoder
from dpstream.kinds.erm.records import ModelEncoder
from dpstream.kinds.erm.shard import ModelRecord, ServingRecord
from dpstream.kinds.pmwg.records import AnswerEncoder
from dpstream.kinds.pmwg.shard import AnswerRecord
from dpstream.messages import DeadLetter as RawDeadLetter
from dpstream.platform import load_config

ROOT = Path(__file__).parent.parent
ORIGIN = datetime(2026, 9, 21, 14, 13, 20, tzinfo=UTC)
ENV = dict(os.environ, PYTHONUNBUFFERED="1",
           DPSTREAM_NOISE_KEY="5e6f9d1c2b3a48577b0c1d2e3f405162738495a6b7c8d9eafb0c1d2e3f405162")
HOT, COLD = ["hot-a", "hot-b", "hot-c"], "cold"
INSTANCE = "0123456789abcdef0123456789abcdef"  # the flow instance of the real runs below
STEPS = 12


# -- records from the real encoders --------------------------------------------------------------


def counters_values(flow: str = "it") -> dict[str, bytes]:
    """One record of each counters kind, encoded by the flow's own encoder."""
    pure = RecordEncoder(flow, ORIGIN, 1.0, instance=INSTANCE)
    return {
        "release": pure.encode(core.Release("k1", 4, 17.5, 2.25, "tree-laplace", 0.9, 1.0,
                                            "epsilon", 3e-7))[2],
        "zcdp": pure.encode(core.Release("k1", 5, 19.0, 1.5, "blt-gaussian", 0.5, 0.5, "rho",
                                         0.0))[2],
        "alert": pure.encode(core.Alert("k2", 3, 13, 0.1))[2],
        "status": pure.encode(core.BudgetExhausted("k3", 7, "counter", "budget of 1 epsilon "
                                                   "exhausted", 1.0, 1.0, "epsilon"))[2],
        "dead": pure.encode_dead_letter(RawDeadLetter("invalid JSON", b'{"broken', "events",
                                                      2, 41))[2],
    }


def pmwg_values() -> dict[str, bytes]:
    config = load_config(ROOT / "deploy" / "pmwg.example.toml")
    name = config.histograms[0].name
    encode = AnswerEncoder(config).encode
    return {
        "hard": encode(AnswerRecord(name, "pmwg", "q1", 5, 1000, "hard", 0.25, None, None, 0.3,
                                    1.0, 3))[2],
        "marginal": encode(AnswerRecord(name, "pmwg", "q2", 5, 1000, "marginal", [0.2, None],
                                        ["easy", "bottom"], "budget exhausted", 0.3, 1.0, 3))[2],
    }


def erm_values() -> dict[str, bytes]:
    config = load_config(ROOT / "deploy" / "erm.example.toml")
    stream = next(iter(config.streams))
    params = np.linspace(-1, 1, config.model.dimension + 1)[None, :]
    model = PrivateModel(params, Fraction(1, 1024), 0.1, Fraction(1, 2), Fraction(1, 100),
                         1024.0, 1000)
    encode = ModelEncoder(config).encode
    return {
        "model": encode(ModelRecord(stream, config.algorithm, 7, "update", 2, 4, 7,
                                    ((0, 3), (4, 7)), model, 0.25, 0.75, 2.0, None))[2],
        "exhausted": encode(ModelRecord(stream, config.algorithm, 9, "exhausted", None, 9, 9, (),
                                        None, 0.0, 2.0, 2.0, None, reason="budget spent"))[2],
    }


def test_every_record_the_flows_publish_decodes_to_its_typed_record_and_back():
    values = {**counters_values(), **pmwg_values(), **erm_values()}
    types = {"release": Release, "zcdp": Release, "alert": Alert, "status": Status,
             "dead": DeadLetter, "hard": Answer, "marginal": Answer, "model": Model,
             "exhausted": Model}
    for name, value in values.items():
        record = decode(value)
        assert type(record) is types[name], name
        body = orjson.loads(value)
        assert record.to_dict() == body, name  # every field, with the topic's names (and nulls)
        assert record.schema == body["schema"]

    release = decode(values["release"])
    assert isinstance(release, Release)
    assert (release.key, release.step, release.value, release.std) == ("k1", 4, 17.5, 2.25)
    assert release.window.end == ORIGIN + timedelta(seconds=5)  # [start, end) of step 4
    assert release.privacy.remaining == pytest.approx(0.1)
    assert release.interval() == pytest.approx((17.5 - 1.96 * 2.25, 17.5 + 1.96 * 2.25))
    assert release.privacy.approx_dp is None
    zcdp = decode(values["zcdp"])
    assert isinstance(zcdp, Release) and zcdp.privacy.approx_dp is not None
    assert zcdp.privacy.approx_dp.epsilon > 0 and zcdp.privacy.accounting == "rho"

    marginal = decode(values["marginal"])
    assert isinstance(marginal, Answer)
    assert marginal.value == (0.2, None) and marginal.kinds == ("easy", "bottom")

    model = decode(values["model"])
    assert isinstance(model, Model) and model.has_weights
    assert (model.window.first_step, model.window.last_step) == (4, 7)
    classifier = ReleasedClassifier.from_record(model)
    rows = np.eye(classifier.n_features_in_)
    assert set(classifier.predict(rows)) <= set(model.classes)
    exhausted = decode(values["exhausted"])
    assert isinstance(exhausted, Model) and not exhausted.has_weights
    assert exhausted.reason == "budget spent"

    hash(release), hash(model)  # immutable values: usable as keys and in sets


def release_body(**changes) -> dict:
    body = orjson.loads(counters_values()["release"])
    body.update(changes)
    return body


@pytest.mark.parametrize(("value", "reason"), [
    (b"", "empty"),
    (b"{not json", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"key": "k1", "value": 3}', "no schema"),
    (b'{"schema": "someone.else/1"}', "unknown schema"),
    (b'{"schema": "dpstream.release/01"}', "unknown schema"),
    (orjson.dumps(release_body(value="12")), "malformed dpstream.release/1"),
    (orjson.dumps(release_body(window={"start": "yesterday", "end": "today"})),
     "malformed dpstream.release/1"),
    (orjson.dumps({k: v for k, v in release_body().items() if k != "std"}),
     "malformed dpstream.release/1"),
])
def test_what_is_not_a_usable_record_is_an_unknown_record_with_a_countable_reason(value, reason):
    with pytest.raises(UnknownRecordError) as caught:
        decode(value)
    assert caught.value.reason == reason


def test_a_known_record_type_at_another_major_version_is_a_version_error():
    with pytest.raises(SchemaVersionError) as caught:
        decode(orjson.dumps(release_body(schema="dpstream.release/2")))
    assert caught.value.schema == "dpstream.release/2"
    assert caught.value.supported == "dpstream.release/1"
    assert "dpstream.release/2" in str(caught.value) and "upgrade" in str(caught.value)


def test_errors_never_carry_a_key_or_a_value():
    secret = "user-4711@example.org"
    bad = orjson.dumps(release_body(key=secret, value="31337.5", std=[secret]))
    with pytest.raises(UnknownRecordError) as caught:
        decode(bad)
    assert secret not in str(caught.value) and "31337" not in str(caught.value)


def test_fields_added_within_a_major_version_are_ignored():
    record = decode(orjson.dumps(release_body(since=3, privacy={
        **release_body()["privacy"], "new_field": [1, 2]})))
    assert isinstance(record, Release) and record.value == 17.5


# -- the latest value per key --------------------------------------------------------------------


def make_release(key: str, step: int, value: float, flow: str = "it") -> Release:
    encoder = RecordEncoder(flow, ORIGIN, 1.0, instance=INSTANCE)
    record = decode(encoder.encode(core.Release(key, step, value, 1.0, "tree-laplace", 0.9, 1.0,
                                                "epsilon", 0.0))[2])
    assert isinstance(record, Release)
    return record


def test_latest_values_keep_the_highest_step_and_recognise_replays_and_conflicts():
    latest = LatestValues()
    assert [latest.add(make_release("a", s, 10.0 * s)) for s in range(3)] == [True] * 3
    assert latest.add(make_release("b", 0, 5.0))
    assert latest.release("it", "a") == make_release("a", 2, 20.0)
    # a replay publishes the open epoch again: identical copies of older and current steps
    assert not latest.add(make_release("a", 1, 10.0))
    assert not latest.add(make_release("a", 2, 20.0))
    assert (latest.counts.stale, latest.counts.duplicates, latest.counts.conflicts) == (0, 2, 0)
    # a different value for a coordinate already held: kept out, counted as a conflict
    assert not latest.add(make_release("a", 2, 21.0))
    assert latest.counts.conflicts == 1 and latest.release("it", "a").value == 20.0
    # flows are separate namespaces
    assert latest.add(make_release("a", 0, 1.0, flow="other"))
    assert [r.key for r in latest.releases("it")] == ["a", "b"]
    assert latest.flows() == ["it", "other"]
    assert latest.keys("it") == [("it", "a"), ("it", "b")]


def test_latest_values_of_alerts_statuses_answers_models_and_dead_letters():
    latest = LatestValues()
    values = {**counters_values(), **pmwg_values(), **erm_values()}
    records = {name: decode(value) for name, value in values.items()}
    assert all(latest.add(record) for record in records.values())
    assert latest.alert("it", "k2") == records["alert"]
    assert latest.status("it", "k3") == records["status"]
    histogram = records["hard"].histogram
    assert latest.answer("sessions", histogram) == records["marginal"]  # the last of its step
    assert not latest.add(records["hard"])  # a replayed answer of the same step
    assert latest.counts.duplicates == 1
    stream = records["model"].stream
    assert latest.model("churn", stream, "update", 2) == records["model"]
    assert latest.model("churn", stream, "exhausted") == records["exhausted"]
    assert len(latest.models()) == 2
    assert latest.dead_letters == {"invalid JSON": 1}


def served_records(flow: str = "churn", instance: str | None = None):
    """Two steps of one stream, from the ERM encoder: a model at each step, then the serving
    record naming it; the second model has the same role and level as the first."""
    config = load_config(ROOT / "deploy" / "erm.example.toml")
    config = dataclasses.replace(config, name=flow)
    stream = next(iter(config.streams))
    encode = ModelEncoder(config, instance or "").encode
    out = []
    for step, shift in ((3, 0.0), (4, 0.5)):
        params = np.linspace(-1, 1, config.model.dimension + 1)[None, :] + shift
        model = PrivateModel(params, Fraction(1, 1024), 0.1, Fraction(1, 2), Fraction(1, 100),
                             1024.0, 1000)
        record = ModelRecord(stream, config.algorithm, step, "update", None, step, step,
                             ((step, step), (0, 1)), model, 0.25, 0.75, 2.0, None)
        choice = ServingCandidate.of(stream, step, "update", None, record.depends_on, 0.1)
        out.append(decode(encode(record)[2]))
        out.append(decode(encode(ServingRecord(stream, config.algorithm, step, choice))[2]))
    return stream, out


def test_the_serving_record_names_the_model_to_use_even_when_a_newer_one_arrives_first():
    stream, (model3, serving3, model4, serving4) = served_records()
    assert isinstance(serving3, Serving) and serving3.model is not None
    latest = LatestValues()
    assert latest.served("churn", stream) is None  # nothing yet
    latest.add(model3)
    latest.add(serving3)
    assert latest.served("churn", stream) == model3
    latest.add(model4)  # the next model of the same role and level, before its serving record
    assert latest.model("churn", stream, "update") == model4
    assert latest.served("churn", stream) == model3  # still what the serving record names
    clf = ReleasedClassifier.latest(latest, stream=stream)
    assert clf is not None and clf.record["step"] == 3
    latest.add(serving4)
    assert latest.served("churn", stream) == model4
    assert not latest.add(serving4) and latest.counts.duplicates == 1  # a replayed copy
    assert latest.servings() == [serving4] and latest.flows() == ["churn"]
    # from the records alone, in publication order, and with a second flow
    assert ReleasedClassifier.latest([model3, serving3, model4, serving4],
                                     stream=stream).record["step"] == 4
    _, other = served_records("other")
    with pytest.raises(SchemaError, match="several flows"):
        ReleasedClassifier.latest([model3, serving3, *other], stream=stream)
    assert ReleasedClassifier.latest([model3, serving3, *other], stream=stream,
                                     flow="other").record["flow"] == "other"
    # a consumer that missed the named model (started reading later) has nothing to serve
    assert ReleasedClassifier.latest([serving4], stream=stream) is None
    assert ReleasedClassifier.latest([model4, serving4], stream="no such stream") is None
    # shown by `dpstream tail`
    assert "use update of step 4 (3 blocks, data steps 0..4)" in record_row(serving4)
    rows = live_table(latest, ReadStats(), "t")
    assert "serving" in rows and "use update of step 4" in rows


def test_a_model_clipped_in_l1_is_applied_in_l1():
    record = {"schema": "dpstream.model/1", "classes": [0, 1], "role": "update",
              "coef": [[1.0, 1.0]], "intercept": [0.0],
              "features": {"dimension": 2, "clip_norm": 1.0, "norm": "l1"}}
    clf = ReleasedClassifier.from_record(record)
    l2 = ReleasedClassifier.from_record({**record, "features": {"dimension": 2,
                                                                 "clip_norm": 1.0}})
    x = np.array([[3.0, 4.0]])  # L1 norm 7 -> scaled by 1/7; L2 norm 5 -> by 1/5
    assert clf.norm == "l1" and l2.norm == "l2"
    assert clf.decision_function(x) == pytest.approx([1.0])
    assert l2.decision_function(x) == pytest.approx([7 / 5])
    with pytest.raises(SchemaError, match="norm"):
        ReleasedClassifier.from_record({**record, "features": {"dimension": 2,
                                                               "clip_norm": 1.0,
                                                               "norm": "linf"}})


# -- against the real broker ---------------------------------------------------------------------


def write_flow_config(path: Path, broker, topics: dict[str, str], name: str = "it", *,
                      budget: float = 10.0, tail: bool = False, metrics_port: int = 0) -> Path:
    """An open-universe counters flow: the hot keys are admitted at step 0, the cold one never.

    Every admitted key is charged 10 epsilon (monitor 4, initial count 2, counter 4).
    """
    return write(path, counters(
        broker.bootstrap, topics, name=name, origin=ORIGIN.timestamp(), steps=STEPS,
        kafka={"tail": tail, "startup_timeout": None},
        privacy={"accounting": "pure", "budget": budget, "delta": 1e-3},
        counter={"epsilon": 4.0, "horizon": 64}, monitor={"epsilon": 4.0, "horizon": 8},
        admission={"mode": "open", "initial_epsilon": 2.0, "keys": None},
        metrics={"port": metrics_port}))


def flow_topics(topic_factory) -> dict[str, str]:
    return {role: topic_factory(1, role) for role in ("events", "releases", "alerts", "dead")}


def produce_events(broker, topic: str) -> None:
    """STEPS steps of events: 40 per step for each hot key, 1 for the cold key."""
    start = ORIGIN.timestamp()
    events = []
    for step in range(STEPS):
        for key in HOT:
            for i in range(40):
                events.append((key, start + step + 0.01 * i))
        events.append((COLD, start + step + 0.5))  # 1 per step: below the monitor's threshold
    events.sort(key=lambda e: e[1])
    produce(broker.bootstrap, topic,
            [(None, json.dumps({"key": k, "ts": ts}).encode(), int(ts * 1000))
             for k, ts in events])


def run_real_flow(broker, topic_factory, tmp_path: Path, name: str = "it") -> dict[str, str]:
    """Run the counters flow over STEPS steps of events to the end; return its topics."""
    topics = flow_topics(topic_factory)
    produce_events(broker, topics["events"])
    config = write_flow_config(tmp_path / f"{name}.toml", broker, topics, name)
    # a fixed flow instance with the fixed noise key: the noise, and so which keys the monitor
    # admits, is the same in every run (an ephemeral run's random instance would redraw it,
    # and the cold key would now and then be admitted)
    out = subprocess.run([sys.executable, "-m", "dpstream.cli", "run", "--config", str(config),
                          "--recovery-dir", str(tmp_path / f"{name}-recovery")],
                         env={**ENV, "DPSTREAM_INSTANCE_ID": INSTANCE},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return topics



@pytest.mark.integration
def test_consumer_reads_a_real_flow_and_keeps_the_latest_value_of_every_key(
        broker, topic_factory, tmp_path):
    topics = run_real_flow(broker, topic_factory, tmp_path)
    published = read_all(broker.bootstrap, topics["releases"], expect=STEPS * len(HOT))
    assert len(published) == STEPS * len(HOT)

    with RecordConsumer(broker.bootstrap, [topics["releases"], topics["alerts"]], flow="it",
                        from_beginning=True) as consumer:
        received = list(consumer.received(idle=1.5, timeout=30))
        assert consumer.stats.read == consumer.stats.decoded == len(published) + len(HOT)
        assert not consumer.stats.skipped
        releases = [r.record for r in received if isinstance(r.record, Release)]
        assert [r.value for r in received if r.topic == topics["releases"]] == \
            [p.value for p in published]  # every record as published, in order
        alerts = consumer.latest.alerts("it")
        assert [a.key for a in alerts] == HOT  # admitted at their monitor's alert...
        assert all(a.step == 0 and a.threshold > 1 for a in alerts)
        assert COLD not in {r.key for r in releases}  # ...the cold key never
        for key in HOT:
            latest = consumer.latest.release("it", key)
            assert latest is not None and latest.step == STEPS - 1
            assert latest == max((r for r in releases if r.key == key), key=lambda r: r.step)
            assert latest.value == pytest.approx(40 * STEPS, abs=8 * latest.std)
            assert latest.privacy.spent <= latest.privacy.budget == 10.0
        assert consumer.latest.counts.duplicates == consumer.latest.counts.stale == 0

        # A restart replays the open epoch: byte-identical copies of steps already published.
        replayed = published[-2 * len(HOT):]
        produce(broker.bootstrap, topics["releases"], [(r.key, r.value) for r in replayed])
        again = list(consumer.received(idle=1.0, timeout=20, only_new=False))
        assert [r.value for r in again] == [r.value for r in replayed]
        assert not any(r.new for r in again)
        counts = consumer.latest.counts
        # (the older step's copies too: the store compares every coordinate it remembers)
        assert (counts.stale, counts.duplicates, counts.conflicts) == (0, 2 * len(HOT), 0)
        assert list(consumer.received(idle=0.5, timeout=5)) == []  # nothing new to iterate

        # A different value at a coordinate already published is a conflict, never the latest.
        body = orjson.loads(published[-1].value)
        forged = orjson.dumps({**body, "value": body["value"] + 100})
        produce(broker.bootstrap, topics["releases"], [(published[-1].key, forged)])
        assert list(consumer.received(idle=1.0, timeout=20)) == []
        assert consumer.latest.counts.conflicts == 1
        assert consumer.latest.release("it", body["key"]).value == body["value"]


@pytest.mark.integration
def test_consumer_counts_and_skips_what_it_cannot_use_and_stops_on_a_newer_version(
        broker, topic_factory):
    topic = topic_factory(1, "mixed")
    good = counters_values()
    other_flow = counters_values(flow="other")["release"]
    newer = orjson.dumps(release_body(schema="dpstream.release/2"))
    values = [good["release"], b"not json", b"[]", b'{"schema": "x/1"}', other_flow, newer,
              good["alert"], orjson.dumps(release_body(step="late")), good["status"]]
    produce(broker.bootstrap, topic, [(None, v) for v in values])

    with RecordConsumer(broker.bootstrap, topic, flow="it", from_beginning=True,
                        strict_versions=False) as consumer:
        records = [r.record for r in consumer.received(idle=1.0, timeout=20)]
        assert [type(r) for r in records] == [Release, Alert, Status]
        assert consumer.stats.read == len(values)
        assert consumer.stats.other_flows == 1
        assert consumer.stats.skipped == {"not JSON": 1, "not a JSON object": 1,
                                          "unknown schema": 1, "malformed dpstream.release/1": 1,
                                          "unsupported dpstream.release/2": 1}
        assert "5 skipped" in consumer.stats.describe()

    with RecordConsumer(broker.bootstrap, topic, flow="it", from_beginning=True) as strict:
        seen = []
        with pytest.raises(SchemaVersionError, match="dpstream.release/2"):
            for item in strict.received(timeout=20):
                seen.append(item.record)
        assert [type(r) for r in seen] == [Release]


@pytest.mark.integration
def test_consumer_starts_at_the_end_unless_asked_for_the_beginning(broker, topic_factory):
    topic = topic_factory(1, "live")
    old = [make_release("k", step, float(step)) for step in range(4)]
    for record in old:  # one produce (one batch) each: see the end-offset note in consumer.py
        produce(broker.bootstrap, topic, [(b"k", orjson.dumps(record.to_dict()))])
    with RecordConsumer(broker.bootstrap, topic) as consumer:
        new = [make_release("k", step, float(step)) for step in range(4, 7)]
        produce(broker.bootstrap, topic, [(b"k", orjson.dumps(r.to_dict())) for r in new])
        assert [r.record for r in consumer.received(max_records=3, timeout=20)] == new
        assert consumer.stats.read == 3
    with RecordConsumer(broker.bootstrap, topic, from_beginning=True) as everything:
        assert list(everything.received(max_records=7, timeout=20, only_new=False)) != []
        assert everything.stats.read == 7


@pytest.mark.integration
def test_consumer_names_a_missing_topic_and_an_unreachable_broker(broker):
    with pytest.raises(DpstreamError, match="'no-such-topic'"):
        RecordConsumer(broker.bootstrap, ["no-such-topic"])
    with pytest.raises(DpstreamError, match="cannot reach a Kafka broker"):
        RecordConsumer("127.0.0.1:1", ["releases"], bootstrap_timeout_ms=1000)
    with pytest.raises(ValueError, match="unknown kafka-python consumer setting"):
        RecordConsumer(broker.bootstrap, ["releases"], no_such_setting=1)
