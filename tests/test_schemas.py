"""The record schemas (``dpstream.schemas``): one round trip per schema, and the producers' bytes.

Per schema: a record built from its Struct encodes and decodes back to itself; what the
flow's own encoder writes decodes to that Struct, and encoding the decoded record gives the
producer's bytes again, byte for byte (the field order on the topic is the Struct's). No
broker: the encoders are called directly.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta, timezone
from fractions import Fraction
from pathlib import Path

import msgspec
import numpy as np
import orjson
import pytest

from dpstream import schemas
from dpstream.client import SchemaVersionError, decode
from dpstream.core.counting import outputs as core
from dpstream.core.counting.outputs import ReleaseColumns, StepOutputs
from dpstream.core.erm.model import PrivateModel
from dpstream.core.erm.serving import ServingCandidate
from dpstream.kinds.counters.records import RecordEncoder
from dpstream.kinds.erm.config import Holdout
from dpstream.kinds.erm.records import ModelEncoder
from dpstream.kinds.erm.shard import ModelRecord, ServingRecord
from dpstream.kinds.pmwg.records import AnswerEncoder
from dpstream.kinds.pmwg.shard import AnswerRecord
from dpstream.messages import DeadLetter as RawDeadLetter
from dpstream.platform import load_config
from dpstream.stream.encoded import MAX_ORIGINAL_BYTES, encode_dead_letter

ROOT = Path(__file__).parent.parent
ORIGIN = datetime(2026, 9, 21, 14, 13, 20, tzinfo=UTC)
INSTANCE = "0123456789abcdef0123456789abcdef"
WINDOW = schemas.Window.of_steps(ORIGIN, 1.0, 4)
PRIVACY = schemas.Privacy(unit="event", accounting="epsilon", spent=0.25, budget=1.0,
                          delta=1e-9)

EXAMPLES: dict[str, list[schemas.Record]] = {
    schemas.RELEASE_SCHEMA: [
        schemas.Release(flow="f", instance=INSTANCE, mechanism="tree-laplace", key="k é",
                        step=4, window=WINDOW, value=17.5, std=2.25, privacy=PRIVACY),
        schemas.Release(flow="", mechanism="blt", key="", step=0, window=WINDOW, value=-1e+16,
                        std=5e-324, privacy=schemas.Privacy(
                            unit="event", accounting="rho", spent=0.5, budget=0.5, delta=0.0,
                            approx_dp=schemas.ApproxDp(epsilon=3.1, delta=1e-6))),
    ],
    schemas.ALERT_SCHEMA: [
        schemas.Alert(flow="f", instance=INSTANCE, key="日本", step=3, window=WINDOW,
                      threshold=13, epsilon=0.1),
    ],
    schemas.STATUS_SCHEMA: [
        schemas.Status(flow="f", instance=INSTANCE, status="budget_exhausted", key="k",
                       step=7, window=WINDOW, refused="counter", reason="spent", spent=1.0,
                       budget=1.0, accounting="epsilon"),
    ],
    schemas.ANSWER_SCHEMA: [
        schemas.Answer(flow="p", instance=INSTANCE, histogram="h", mechanism="pmwg", id="q1",
                       step=5, window=WINDOW, t=1000, kind="hard", value=0.25, reason=None,
                       hard_queries=3, privacy=schemas.Privacy(
                           unit="event", accounting="pure", spent=0.3, budget=1.0)),
        schemas.Answer(flow="p", histogram="h", mechanism="pmwg", id="q2", step=5,
                       window=WINDOW, t=1000, kind="marginal", value=(0.2, None),
                       reason="budget exhausted", hard_queries=3, privacy=PRIVACY,
                       kinds=("easy", "bottom")),
    ],
    schemas.MODEL_SCHEMA: [
        schemas.Model(flow="m", instance=INSTANCE, stream="s", algorithm="erm", role="update",
                      level=2, step=7, released=schemas.Window.of_steps(ORIGIN, 60.0, 7, 7,
                                                                       steps=True),
                      window=schemas.Window.of_steps(ORIGIN, 60.0, 4, 7, steps=True),
                      depends_on=((0, 3), (4, 7)), classes=(0, 1),
                      privacy=schemas.Privacy(unit="event", accounting="zcdp", cost=0.25,
                                              spent=0.75, budget=2.0),
                      coef=((0.5, -1.25),), intercept=(0.125,),
                      features=schemas.ModelFeatures(dimension=2, clip_norm=1.0),
                      noise=schemas.ModelNoise(std=0.1, grid="1/1024"),
                      holdout=schemas.ModelHoldout(accuracy=0.875, rows=400)),
        schemas.Model(flow="m", stream="s", algorithm="erm", role="update", level=None, step=7,
                      released=WINDOW, window=WINDOW, depends_on=(), classes=("a", "b"),
                      privacy=PRIVACY, coef=((0.5,),), intercept=(0.0,),
                      features=schemas.ModelFeatures(dimension=1, clip_norm=2.5),
                      noise=schemas.ModelNoise(std=0.1, grid="1/2"), holdout=None),
        schemas.Model(flow="m", stream="s", algorithm="erm", role="update", level=None, step=7,
                      released=WINDOW, window=WINDOW, depends_on=(), classes=("a", "b"),
                      privacy=PRIVACY, coef=((0.5,),), intercept=(0.0,),
                      features=schemas.ModelFeatures(dimension=1, clip_norm=2.5, norm="l1"),
                      noise=schemas.ModelNoise(std=0.1, grid="1/2"), holdout=None),
        schemas.Model(flow="m", stream="s", algorithm="ermg", role="exhausted", level=None,
                      step=9, released=WINDOW, window=WINDOW, depends_on=(), classes=(0, 1),
                      privacy=PRIVACY, reason="budget spent"),
    ],
    schemas.SERVING_SCHEMA: [
        schemas.Serving(flow="m", instance=INSTANCE, stream="s", algorithm="continual",
                        step=8, released=schemas.Window.of_steps(ORIGIN, 60.0, 8, 8,
                                                                 steps=True),
                        model=schemas.ServedModel(
                            role="update", level=None, step=8,
                            window=schemas.Window.of_steps(ORIGIN, 60.0, 0, 8, steps=True),
                            blocks=8, noise_std=0.125)),
        schemas.Serving(flow="m", stream="s", algorithm="sliding-window", step=0,
                        released=WINDOW, model=None),
    ],
    schemas.DEAD_LETTER_SCHEMA: [
        schemas.DeadLetter(flow="f", instance=INSTANCE, reason="invalid JSON",
                           source=schemas.DeadLetterSource(topic="events", partition=2,
                                                           offset=41),
                           original_base64="e2Jyb2tlbg==", original_size=7,
                           original_sha256="0" * 64, original_truncated=False),
        schemas.DeadLetter(flow="f", reason="", source=schemas.DeadLetterSource(
            topic=None, partition=None, offset=None), original_base64="", original_size=0,
            original_sha256="", original_truncated=True),
    ],
}


def test_every_schema_has_examples_and_a_supported_major_version() -> None:
    assert set(EXAMPLES) == {f"{name}/{major}"
                             for name, major in schemas.SUPPORTED_SCHEMAS.items()}
    for tag, records in EXAMPLES.items():
        assert all(record.schema == tag for record in records)


@pytest.mark.parametrize("tag", sorted(EXAMPLES))
def test_round_trip(tag: str) -> None:
    """encode -> decode -> the same record, and encode(decode(bytes)) -> the same bytes."""
    for record in EXAMPLES[tag]:
        value = schemas.encode(record)
        assert orjson.loads(value)["schema"] == tag
        assert next(iter(orjson.loads(value))) == "schema"  # the tag first
        back = decode(value)
        assert back == record and type(back) is type(record)
        assert schemas.encode(back) == value
        assert back.to_dict() == orjson.loads(value)  # to_dict is the topic's JSON
        # msgspec's own encoder agrees on everything but float formatting
        assert msgspec.json.decode(msgspec.json.encode(record), type=type(record)) == record


def test_unset_and_none_fields() -> None:
    """None is left out where the default is None; a required None and a set null are kept."""
    answer = orjson.loads(schemas.encode(EXAMPLES[schemas.ANSWER_SCHEMA][0]))
    assert answer["reason"] is None and "kinds" not in answer
    model, bare, l1, exhausted = (orjson.loads(schemas.encode(m))
                                  for m in EXAMPLES[schemas.MODEL_SCHEMA])
    assert "norm" not in model["features"] and l1["features"]["norm"] == "l1"
    served, none_yet = (orjson.loads(schemas.encode(m))
                        for m in EXAMPLES[schemas.SERVING_SCHEMA])
    assert served["model"]["level"] is None and none_yet["model"] is None  # always written
    assert model["holdout"] == {"accuracy": 0.875, "rows": 400}
    assert bare["holdout"] is None and bare["level"] is None and "reason" not in bare
    assert "holdout" not in exhausted and "coef" not in exhausted
    assert decode(schemas.encode(EXAMPLES[schemas.MODEL_SCHEMA][3])).holdout is msgspec.UNSET
    release = orjson.loads(schemas.encode(EXAMPLES[schemas.RELEASE_SCHEMA][1]))
    assert "instance" not in release and "cost" not in release["privacy"]


def test_the_change_rules_as_readers_see_them() -> None:
    """A minor version's added field is ignored; another major version is refused."""
    value = schemas.encode(EXAMPLES[schemas.RELEASE_SCHEMA][0])
    added = value[:-1] + b',"new_optional_field":{"x":[1,2]}}'
    assert decode(added) == EXAMPLES[schemas.RELEASE_SCHEMA][0]
    with pytest.raises(SchemaVersionError):
        decode(value.replace(b"dpstream.release/1", b"dpstream.release/2"))


def test_windows_are_written_as_the_flows_always_wrote_them() -> None:
    """ISO 8601 with ``Z`` for UTC, other offsets kept, microseconds only when not zero."""
    utc = schemas.Window.of_steps(ORIGIN, 0.25, 3)
    assert schemas.to_builtins(utc) == {"start": "2026-09-21T14:13:20.750000Z",
                                        "end": "2026-09-21T14:13:21Z"}
    east = ORIGIN.astimezone(timezone(timedelta(hours=5, minutes=30)))
    steps = schemas.to_builtins(schemas.Window.of_steps(east, 60.0, 1, 2, steps=True))
    assert steps == {"first_step": 1, "last_step": 2, "start": "2026-09-21T19:44:20+05:30",
                     "end": "2026-09-21T19:46:20+05:30"}


# -- the producers' own bytes ----------------------------------------------------------------


def _producer_values() -> dict[str, list[bytes]]:
    counters = RecordEncoder("it", ORIGIN, 1.0, instance=INSTANCE)
    zcdp = RecordEncoder("it", ORIGIN, 0.5, conversion_delta=1e-6)
    keys = ("a", "b", "ü", "")
    columns = ReleaseColumns(6, keys, np.array([1.5, -0.0, 1e16, 1e-7]), 2.0,
                             "blt-gaussian", 0.5, 0.5, "rho", 0.0)
    bulk = [v for _, _, v in zcdp.encode_step(StepOutputs(6, releases=[columns]))]
    pmwg = load_config(ROOT / "deploy" / "pmwg.example.toml")
    answer = AnswerEncoder(pmwg, INSTANCE).encode
    name = pmwg.histograms[0].name
    erm = load_config(ROOT / "deploy" / "erm.example.toml")
    stream = next(iter(erm.streams))
    params = np.linspace(-1, 1, erm.model.dimension + 1)[None, :]
    model = PrivateModel(params, Fraction(1, 1024), 0.1, Fraction(1, 2), Fraction(1, 100),
                         1024.0, 1000)
    models = ModelEncoder(erm, INSTANCE).encode
    holdout = Holdout("holdout.jsonl", np.zeros((400, erm.model.dimension)),
                      np.zeros(400, dtype=np.int64))
    scored = ModelEncoder(dataclasses.replace(erm, holdout=holdout), INSTANCE).encode
    return {
        schemas.RELEASE_SCHEMA: [
            counters.encode(core.Release("k1", 4, 17.5, 2.25, "tree-laplace", 0.9, 1.0,
                                         "epsilon", 3e-7))[2], *bulk],
        schemas.ALERT_SCHEMA: [counters.encode(core.Alert("k2", 3, 13, 0.1))[2]],
        schemas.STATUS_SCHEMA: [counters.encode(core.BudgetExhausted(
            "k3", 7, "counter", "budget of 1 epsilon exhausted", 1.0, 1.0, "epsilon"))[2]],
        schemas.ANSWER_SCHEMA: [
            answer(AnswerRecord(name, "pmwg", "q1", 5, 1000, "hard", 0.25, None, None, 0.3,
                                1.0, 3))[2],
            answer(AnswerRecord(name, "pmwg", "q2", 5, 1000, "marginal", [0.2, None],
                                ["easy", "bottom"], "budget exhausted", 0.3, 1.0, 3))[2]],
        schemas.MODEL_SCHEMA: [
            models(ModelRecord(stream, erm.algorithm, 7, "update", 2, 4, 7, ((0, 3), (4, 7)),
                               model, 0.25, 0.75, 2.0, None))[2],
            scored(ModelRecord(stream, erm.algorithm, 7, "update", 2, 4, 7, (), model, 0.25,
                               0.75, 2.0, 0.8125))[2],
            models(ModelRecord(stream, erm.algorithm, 9, "exhausted", None, 9, 9, (), None,
                               0.0, 2.0, 2.0, None, reason="budget spent"))[2]],
        schemas.SERVING_SCHEMA: [
            models(ServingRecord(stream, erm.algorithm, 8, ServingCandidate(
                stream, 8, "update", None, 0, 7, 7, 0.125)))[2],
            models(ServingRecord(stream, erm.algorithm, 0, None))[2]],
        schemas.DEAD_LETTER_SCHEMA: [
            encode_dead_letter("it", RawDeadLetter("invalid JSON", b'{"broken', "events", 2,
                                                   41), instance=INSTANCE)[2],
            encode_dead_letter("it", RawDeadLetter("too big", bytes(MAX_ORIGINAL_BYTES + 1)))[2]],
    }


@pytest.mark.parametrize("tag", sorted(EXAMPLES))
def test_producer_bytes_decode_and_encode_back_unchanged(tag: str) -> None:
    values = _producer_values()[tag]
    assert values
    for value in values:
        record = decode(value)
        assert record.schema == tag
        assert record.to_dict() == orjson.loads(value)
        assert schemas.encode(record) == value  # the Struct's field order is the topic's


def test_producer_fields_carry_what_was_encoded() -> None:
    values = _producer_values()
    release = decode(values[schemas.RELEASE_SCHEMA][0])
    assert isinstance(release, schemas.Release)
    assert (release.key, release.step, release.value, release.instance) == ("k1", 4, 17.5,
                                                                              INSTANCE)
    assert release.window == schemas.Window.of_steps(ORIGIN, 1.0, 4)
    assert [orjson.loads(v)["value"] for v in values[schemas.RELEASE_SCHEMA][1:]] == [
        1.5, -0.0, 1e16, 1e-7]
    assert b'"value":1e+16' in values[schemas.RELEASE_SCHEMA][3]  # orjson's float text
    letter = decode(values[schemas.DEAD_LETTER_SCHEMA][1])
    assert isinstance(letter, schemas.DeadLetter)
    assert letter.original_truncated and letter.original_size == MAX_ORIGINAL_BYTES + 1
    exhausted = decode(values[schemas.MODEL_SCHEMA][2])
    assert isinstance(exhausted, schemas.Model) and not exhausted.has_weights
    scored = decode(values[schemas.MODEL_SCHEMA][1])
    assert isinstance(scored, schemas.Model)
    assert isinstance(scored.holdout, schemas.ModelHoldout)
    assert scored.holdout.accuracy == 0.8125
    served = decode(values[schemas.SERVING_SCHEMA][0])
    assert isinstance(served, schemas.Serving) and served.model is not None
    assert (served.model.role, served.model.level, served.model.step, served.model.blocks,
            served.model.window.first_step, served.model.window.last_step) == (
        "update", None, 8, 7, 0, 7)
    assert (served.step, served.released.last_step, served.instance) == (8, 8, INSTANCE)
    assert decode(values[schemas.SERVING_SCHEMA][1]).model is None  # type: ignore[union-attr]


def test_identity() -> None:
    values = _producer_values()
    release = orjson.loads(values[schemas.RELEASE_SCHEMA][0])
    assert schemas.identity(release) == (schemas.RELEASE_SCHEMA, "it", INSTANCE, "k1", 4)
    letter = orjson.loads(values[schemas.DEAD_LETTER_SCHEMA][0])
    assert schemas.identity(letter) == (schemas.DEAD_LETTER_SCHEMA, "it", INSTANCE, "events",
                                        2, 41)
    with pytest.raises(ValueError, match="not a dpstream record"):
        schemas.identity(orjson.loads(values[schemas.ANSWER_SCHEMA][0]))
