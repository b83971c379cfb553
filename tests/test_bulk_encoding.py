"""Bulk release encoding: a closed step's records, byte for byte as one encode() per output."""

from __future__ import annotations

import math
import pickle
from datetime import UTC, datetime

import numpy as np
import orjson
import pytest
from bytewax.testing import TestingSink, TestingSource, run_main
from hypothesis import given, settings
from hypothesis import strategies as st
from support.messages import message

from dpstream.core.counting.outputs import (
    Alert,
    AlertColumns,
    BudgetExhausted,
    ReleaseColumns,
    StepOutputs,
)
from dpstream.core.noise.keys import NoiseKey
from dpstream.io.kafka import _OutputPartition
from dpstream.kinds.counters.metrics import register_metrics as counters_series
from dpstream.kinds.counters.records import RecordEncoder
from dpstream.platform import build_flow, parse_config
from dpstream.stream.encoded import EncodedBatch, EncodedColumn, flatten

ORIGIN = datetime(2026, 9, 21, 14, 13, 20, tzinfo=UTC)
AWKWARD_VALUES = [0.0, -0.0, 1e16, 1e-7, 123456.789, 1e300, -5e-324, 2.0**53 + 1, 0.1]

keys = st.text(st.characters(exclude_categories=("Cs",)), max_size=12) | st.sampled_from(
    ['a"b', "c\\d", "\\", '"', "é", "キー", "😀", "\x00", "\n\t", "%s", "%", "\u2028", ""])
values = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(AWKWARD_VALUES)
plain = st.floats(min_value=0, max_value=1e9, allow_nan=False)


@st.composite
def columns(draw, step):
    names = draw(st.lists(keys, max_size=8, unique=True))
    return ReleaseColumns(
        step=step, keys=names, values=np.array([draw(values) for _ in names], dtype=np.float64),
        std=draw(plain | st.sampled_from([0.0, 1e16, 1e-7])),
        mechanism=draw(st.sampled_from(["tree-laplace", "blt-gaussian", "x%sy", 'q"'])),
        spent=draw(plain), budget=draw(plain), unit=draw(st.sampled_from(["epsilon", "rho"])),
        delta=draw(st.sampled_from([0.0, 1e-6, 2.5e-7])), periodic=draw(st.booleans()))


@st.composite
def step_outputs(draw):
    step = draw(st.integers(0, 10**9))
    statuses = [BudgetExhausted(k, step, "tree counter", "refused", 1.0, 0.5, "epsilon")
                for k in draw(st.lists(keys, max_size=2))]
    alerts = [Alert(k, step, 100, 0.1) for k in draw(st.lists(keys, max_size=2))]
    return StepOutputs(step=step, statuses=statuses, alerts=alerts,
                       releases=draw(st.lists(columns(step), max_size=3)))


flows = st.sampled_from(["bench", "100%", "a\"b\\c", "\x00dpstream-key\x00", "ü"])


instances = st.sampled_from(["", "0123456789abcdef0123456789abcdef", "\x00dpstream-value\x00"])


@settings(max_examples=300, deadline=None)
@given(step_outputs(), flows, st.sampled_from([1.0, 60.0, 0.25]),
       st.sampled_from([0.0, 1e-6]), instances)
def test_encode_step_is_byte_identical_to_encoding_each_output(outputs, flow, seconds, delta,
                                                                instance):
    encoder = RecordEncoder(flow, ORIGIN, seconds, delta, instance=instance)
    batch = encoder.encode_step(outputs)
    assert isinstance(batch, EncodedBatch)
    assert batch == [encoder.encode(o) for o in outputs]
    assert all(type(v) is bytes and type(k) is bytes for _, k, v in batch)
    assert all(orjson.loads(v)["instance"] == instance for _, _, v in batch)


def test_the_values_are_formatted_as_orjson_formats_python_floats():
    encoder = RecordEncoder("f", ORIGIN, 1.0)
    column = ReleaseColumns(3, [str(v) for v in AWKWARD_VALUES], np.array(AWKWARD_VALUES), 1.5,
                            "tree-laplace", 1.0, 1.0, "epsilon", 1e-6)
    out = StepOutputs(3, [], [], [column])
    bodies = [orjson.loads(v) for _, _, v in encoder.encode_step(out)]
    assert [b["value"] for b in bodies] == AWKWARD_VALUES
    assert [str(b["value"]) for b in bodies] == [b["key"] for b in bodies]
    assert encoder.encode_step(out) == [encoder.encode(o) for o in out]


def test_a_key_that_cannot_be_encoded_fails_as_encode_does():
    encoder = RecordEncoder("f", ORIGIN, 1.0)
    out = StepOutputs(0, [], [], [ReleaseColumns(0, ["ok", "\ud800"], np.array([1.0, 2.0]),
                                                 1.0, "tree-laplace", 1.0, 1.0, "epsilon", 0.0)])
    with pytest.raises(UnicodeEncodeError):
        encoder.encode(out[1])
    with pytest.raises(UnicodeEncodeError):
        encoder.encode_step(out)


def test_empty_steps_and_columns_encode_to_nothing():
    encoder = RecordEncoder("f", ORIGIN, 1.0)
    empty = ReleaseColumns(0, [], np.zeros(0), 1.0, "tree-laplace", 1.0, 1.0, "epsilon", 0.0)
    assert encoder.encode_step(StepOutputs(0, [], [], [empty])) == []
    assert encoder.encode_step(StepOutputs(0)) == []


@settings(max_examples=300, deadline=None)
@given(st.lists(keys | st.text(max_size=6), max_size=8, unique=True))
def test_key_texts_from_joined_bytes_are_orjson_s(names):
    """Keys read from JoinedNames' bytes: the same texts as orjson's, refused as it refuses."""
    from dpstream.core.noise.coordinates import JoinedNames
    from dpstream.kinds.counters import records

    joined = JoinedNames(names)
    expected = records._key_texts(list(names))
    got = records._key_texts(joined)
    if joined.joined is None or expected is None:  # a NUL, or an escape or a surrogate
        assert got is None or expected is not None and got.texts() == expected.texts()
    else:
        assert got is not None and got.texts() == expected.texts()
        assert got.data == expected.data  # the quoted, comma-separated text EncodedColumn reads
    if got is not None:
        assert [t.decode("utf-8", "surrogatepass") for t in got.texts()] == names


def test_key_texts_are_kept_for_tuples_only_and_for_a_bounded_number_of_them():
    from dpstream.core.noise.coordinates import JoinedNames
    from dpstream.kinds.counters import records

    encoder = RecordEncoder("f", ORIGIN, 1.0)

    def column(keys, step):
        return ReleaseColumns(step, keys, np.arange(len(keys), dtype=np.float64) + 0.5, 1.0,
                              "tree-laplace", 0.5, 1.0, "epsilon", 0.0)

    def one_by_one(c):
        return [encoder.encode(r) for r in c]

    joined = JoinedNames(["j1", "j2"])  # a declared shard's keys: a tuple subclass
    assert encoder.encode_step(StepOutputs(0, [], [], [column(joined, 0)])) == \
        one_by_one(column(joined, 0))
    assert id(joined) in encoder._key_cache
    shared = ("a", "bb", "c")
    for step in range(3):  # a group's tuple, every step: kept, the same bytes as one by one
        assert encoder.encode_step(StepOutputs(step, [], [], [column(shared, step)])) == \
            one_by_one(column(shared, step))
    assert id(shared) in encoder._key_cache
    mutable = ["x", "y"]
    encoder.encode_step(StepOutputs(0, [], [], [column(mutable, 0)]))
    mutable[0] = "z"  # a list may change: never kept
    assert encoder.encode_step(StepOutputs(1, [], [], [column(mutable, 1)])) == \
        one_by_one(column(mutable, 1))
    tuples = [(f"k{i}",) for i in range(records._KEY_CACHE + 5)]
    for keys in tuples:
        encoder.encode_step(StepOutputs(0, [], [], [column(keys, 0)]))
    assert len(encoder._key_cache) == records._KEY_CACHE  # the oldest are dropped
    assert id(tuples[-1]) in encoder._key_cache and id(shared) not in encoder._key_cache


def test_encode_item_takes_outputs_and_steps_and_flatten_undoes_batches():
    encoder = RecordEncoder("f", ORIGIN, 1.0)
    alert = Alert("k", 2, 10, 0.1)
    out = StepOutputs(2, [], [alert], [])
    assert encoder.encode_item(alert) == encoder.encode(alert)
    assert encoder.encode_item(out) == [encoder.encode(alert)]
    triple = ("dead_letters", None, b"{}")
    assert flatten(triple) == [triple]
    assert flatten(encoder.encode_item(out)) == [encoder.encode(alert)]


class FakeProducer:
    """Records what is produced; ``outcomes`` says which deliveries fail (in order)."""

    def __init__(self, outcomes=(), full_every=0):
        self.sent, self.outcomes, self.full_every, self.calls = [], list(outcomes), full_every, 0

    def produce(self, topic, value, key, on_delivery):
        self.calls += 1
        if self.full_every and self.calls % self.full_every == 0:
            raise BufferError("queue full")
        self.sent.append((topic, key, value))
        error = self.outcomes.pop(0) if self.outcomes else None
        on_delivery(error, FakeMessage(key, value))

    def poll(self, timeout):
        return 0

    def __len__(self):
        return 0

    def flush(self, timeout):
        return 0


class FakeMessage:
    def __init__(self, key, value):
        self._key, self._value = key, value

    def key(self):
        return self._key

    def value(self):
        return self._value


def sink_with(producer):
    observed = []
    sink = _OutputPartition({}, {"releases": "r", "alerts": "a", "dead_letters": "d"},
                            lambda pending, delivered, retried: observed.append(
                                (pending, delivered, retried)))
    sink.producer = producer
    return sink, observed


def test_the_kafka_sink_sends_batches_and_single_records_in_order():
    producer = FakeProducer(full_every=3)  # a full local queue is waited out, never skipped
    sink, observed = sink_with(producer)
    batch = EncodedBatch([("releases", b"k1", b"1"), ("alerts", b"k2", b"2")])
    sink.write_batch([("dead_letters", None, b"0"), batch, ("releases", b"k3", b"3")])
    assert producer.sent == [("d", None, b"0"), ("r", b"k1", b"1"), ("a", b"k2", b"2"),
                             ("r", b"k3", b"3")]
    assert observed == [(0, {"dead_letters": 1, "releases": 2, "alerts": 1}, 0)]


def test_the_kafka_sink_resends_what_failed_and_stops_on_a_permanent_refusal():
    from confluent_kafka import KafkaError

    from dpstream.io.kafka import OutputError

    timeout = KafkaError(KafkaError._MSG_TIMED_OUT)
    producer = FakeProducer([None, timeout, None, None])
    sink, observed = sink_with(producer)
    sink.write_batch([EncodedBatch([("releases", b"k1", b"1"), ("alerts", b"k2", b"2"),
                                    ("releases", b"k3", b"3")])])
    assert producer.sent == [("r", b"k1", b"1"), ("a", b"k2", b"2"), ("r", b"k3", b"3"),
                             ("a", b"k2", b"2")]
    assert observed[-1] == (0, {"releases": 2, "alerts": 1}, 1)
    too_large = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    sink, _ = sink_with(FakeProducer([None, too_large]))
    with pytest.raises(OutputError, match="refused a releases record for good"):
        sink.write_batch([EncodedBatch([("alerts", b"k", b"1"), ("releases", b"x", b"22")])])


@pytest.mark.flow
def test_an_in_memory_sink_gets_records_unless_it_asks_for_batches():
    config = parse_config({"flow": {"name": "t", "origin": "2026-09-21T14:13:20Z", "step": "1s",
                                    "shards": 2},
                           "admission": {"mode": "declared", "keys": ["a", "b", "c"]},
                           "metrics": {"port": 0}})
    origin = 1_790_000_000
    items = [message(0, k, origin + t + 0.5, i) for i, (t, k) in
             enumerate((t, k) for t in range(5) for k in "abc")]
    items.append((0, b"{broken", len(items), "events", (origin + 5) * 1000, 2))
    runs = []
    for batches in (False, True):
        sink: list = []
        run_main(build_flow(config, NoiseKey.for_tests(1), instance="t-1", partitions=1,
                            source=TestingSource(items, 4), sink=TestingSink(sink),
                            sink_batches=batches))
        runs.append(sink)
    records, batched = runs
    assert all(type(item) is tuple for item in records)
    assert any(isinstance(item, EncodedBatch) for item in batched)
    assert sorted(records, key=repr) == sorted(
        [t for item in batched for t in flatten(item)], key=repr)
    roles = [role for role, _, _ in records]
    # steps 0..5 (the bad record's broker time is in step 5): every declared key each step
    assert roles.count("releases") == 3 * 6 and roles.count("dead_letters") == 1


@settings(max_examples=100, deadline=None)
@given(st.lists(keys, max_size=6), st.integers(0, 10**6), flows,
       st.sampled_from([(100, 0.1), (7, 2.5)]), st.booleans())
def test_alerts_are_encoded_in_bulk_byte_for_byte(names, step, flow, monitor, mixed):
    encoder = RecordEncoder(flow, ORIGIN, 1.0)
    alerts = [Alert(k, step, *monitor) for k in names]
    if mixed and alerts:  # alerts that do not share their fields: one by one
        alerts.append(Alert("other", step + 1, *monitor))
    out = StepOutputs(step, [], alerts, [])
    assert encoder.encode_step(out) == [encoder.encode(a) for a in alerts]
    columns = AlertColumns(step, list(names), *monitor)  # as the key table makes them
    assert list(columns) == alerts[:len(names)]
    assert encoder.encode_step(StepOutputs(step, [], columns, [])) == [
        encoder.encode(a) for a in alerts[:len(names)]]


def test_metrics_count_closed_steps_without_materializing_them():
    from prometheus_client import CollectorRegistry

    from dpstream.metrics import FlowMetrics

    def samples(metrics):
        return sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                      for m in metrics.registry.collect() for s in m.samples
                      if s.name.startswith("dpstream_") and not s.name.endswith("_created"))

    columns = [ReleaseColumns(4, ["a", "b"], np.array([1.0, 2.0]), 1.0, "tree-laplace", 0.7,
                              1.0, "epsilon", 0.0),
               ReleaseColumns(4, ["c"], np.array([3.0]), 1.0, "tree-laplace", 0.9, 1.0,
                              "epsilon", 0.0, periodic=False),
               ReleaseColumns(4, [], np.zeros(0), 1.0, "tree-laplace", 5.0, 1.0, "epsilon", 0.0)]
    out = StepOutputs(4, [BudgetExhausted("z", 4, "tree counter", "no", 1.0, 1.0, "epsilon")],
                      [Alert("c", 4, 10, 0.1)], columns)
    whole, each = (FlowMetrics("m", CollectorRegistry(), clock=lambda: 0.0) for _ in range(2))
    for m in (whole, each):
        m.set_budget("tree-laplace", "epsilon", 1.0)
    counters_series(whole).observe_outputs([out], "tree-laplace")
    counters_series(each).observe_outputs(list(out), "tree-laplace")
    assert samples(whole) == samples(each)
    assert ("dpstream_releases_total", (("flow", "m"), ("mechanism", "tree-laplace")), 3.0) in \
        samples(whole)


# Bulk columns: numpy assembly, byte for byte ------------------------------------------------

EXPONENTS = [1e300, -1e300, 5e-324, -5e-324, 1.5e-7, -2.5e16, 1e16, 1e-7, 2.0**53 + 1,
             1.7976931348623157e308, 2.2250738585072014e-308, 123456789012345.6]
NOT_FINITE = [math.nan, math.inf, -math.inf]
COUNTS = [float(v) for v in range(-20, 41)]
QUARTERS = [v / 4 for v in range(-80, 161)]
fixed_width = st.integers(0, 10**7 - 1).map(lambda i: f"item-{i:07d}")
unicode_keys = st.text(st.sampled_from("aZ09-_ é ü キー 😀 , : / %"), max_size=6)
escaped_keys = st.sampled_from(['a"b', "c\\d", "\n", "\x00", "\u2028", "tab\t"])
any_values = (st.floats() | st.sampled_from(EXPONENTS + NOT_FINITE + [0.0, -0.0])
              | st.sampled_from(COUNTS) | st.sampled_from(QUARTERS))


def release_column(names, values, step=7, unit="epsilon"):
    return ReleaseColumns(step, list(names), np.array(values, dtype=np.float64), 1.5,
                          "tree-laplace", 0.35, 1.0, unit, 0.0)


def encoded_per_release(encoder, column):
    return [encoder.encode(release) for release in column]


@st.composite
def big_columns(draw, key_kind):
    names = draw(st.lists(key_kind, min_size=1, max_size=80, unique=True))
    values = [draw(any_values) for _ in names]
    return release_column(names, values, draw(st.integers(0, 10**9)),
                          draw(st.sampled_from(["epsilon", "rho"])))


@settings(max_examples=150, deadline=None)
@given(big_columns(fixed_width | unicode_keys | st.text(max_size=12)), flows)
def test_bulk_columns_are_byte_identical_for_any_keys_and_values(column, flow):
    encoder = RecordEncoder(flow, ORIGIN, 1.0)
    batch = encoder.encode_step(StepOutputs(column.step, [], [], [column]))
    assert batch == encoded_per_release(encoder, column)
    assert all(type(k) is bytes and type(v) is bytes for _, k, v in batch)


@settings(max_examples=60, deadline=None)
@given(big_columns(fixed_width), big_columns(unicode_keys))
def test_fixed_width_and_unicode_keys_are_encoded_in_bulk(fixed, varied):
    encoder = RecordEncoder("bench", ORIGIN, 60.0)
    for column in (fixed, varied):
        encoded = encoder.encode_columns(column)
        assert isinstance(encoded, EncodedColumn)
        assert list(encoded) == encoded_per_release(encoder, column)
        assert [key for _, key, _ in encoded] == [k.encode() for k in column.keys]


@settings(max_examples=60, deadline=None)
@given(st.lists(fixed_width | escaped_keys, min_size=1, max_size=20, unique=True), flows)
def test_keys_needing_escapes_fall_back_to_one_by_one(names, flow):
    encoder = RecordEncoder(flow, ORIGIN, 1.0)
    column = release_column(names, [float(i) for i in range(len(names))])
    encoded = encoder.encode_columns(column)
    if any(k in ('a"b', "c\\d", "\n", "\x00", "tab\t") for k in names):
        assert not isinstance(encoded, EncodedColumn)
    assert list(encoded) == encoded_per_release(encoder, column)


def test_every_kind_of_value_is_formatted_as_encode_formats_it():
    values = EXPONENTS + NOT_FINITE + [0.0, -0.0, 0.1, 3.25, -0.5, -20.0, 40.0, 1e22, 1e21,
                                       123456.789, -1e-5]
    encoder = RecordEncoder("f", ORIGIN, 1.0)
    column = release_column([f"k{i:03d}" for i in range(len(values))], values)
    encoded = encoder.encode_columns(column)
    assert isinstance(encoded, EncodedColumn)
    assert list(encoded) == encoded_per_release(encoder, column)
    texts = [orjson.loads(v)["value"] for _, _, v in encoded]
    assert texts[len(EXPONENTS):len(EXPONENTS) + 3] == [None, None, None]  # as encode: null


@pytest.mark.parametrize("names", [["only"], [""], ["", "a"], ["😀"], [",", ",,"]])
def test_single_records_and_odd_keys(names):
    encoder = RecordEncoder("f", ORIGIN, 1.0)
    column = release_column(names, [-0.0] * len(names))
    encoded = encoder.encode_columns(column)
    assert isinstance(encoded, EncodedColumn) and len(encoded) == len(names)
    assert list(encoded) == encoded_per_release(encoder, column)
    assert encoded[0] == encoded_per_release(encoder, column)[0]


def test_a_column_is_built_at_encoding_into_one_buffer_in_any_order_read_in_its_own():
    encoder = RecordEncoder("bench", ORIGIN, 1.0)
    values = [float(v) for v in np.random.default_rng(1).integers(-20, 41, 500)]
    column = release_column([f"item-{i:07d}" for i in range(500)], values)
    encoded = encoder.encode_columns(column)
    assert isinstance(encoded, EncodedColumn)
    expected = encoded_per_release(encoder, column)
    records = encoded.records
    assert type(records.data) is bytes  # built now, not when read
    spans = sorted(zip(records.starts.tolist(), records.ends.tolist(), strict=True))
    assert [start for start, _ in spans] == [0] + [end for _, end in spans[:-1]]  # back to
    assert spans[-1][1] == len(records.data)  # back, nothing else in the buffer
    assert [records.text(i) for i in range(500)] == [v for _, _, v in expected]
    assert encoded[-1] == expected[-1] and encoded[10:13] == expected[10:13]
    assert list(encoded) == expected


def test_an_encoded_batch_is_a_sequence_of_triples():
    encoder = RecordEncoder("f", ORIGIN, 1.0)
    column = release_column(["a", "bb", "ccc"], [1.0, -2.5, 1e300])
    status = ("releases", b"z", b"{}")
    batch = EncodedBatch([status])
    batch.extend(encoder.encode_columns(column))
    batch.append(("alerts", b"k", b"[]"))
    expected = [status, *encoded_per_release(encoder, column), ("alerts", b"k", b"[]")]
    assert len(batch) == 5 and list(batch) == expected
    assert batch == expected and expected == batch and batch == EncodedBatch(expected)
    assert batch != expected[:-1] and expected[:-1] != batch and batch != tuple(expected)
    assert batch != [*expected[:-1], ("alerts", b"k", b"{}")]
    assert [batch[i] for i in range(-5, 5)] == expected * 2
    assert batch[1:4] == expected[1:4] and batch[::-2] == expected[::-2]
    with pytest.raises(IndexError):
        batch[5]
    with pytest.raises(IndexError):
        batch[-6]
    copied = pickle.loads(pickle.dumps(batch))
    assert isinstance(copied, EncodedBatch) and copied == batch
    assert flatten(batch) == expected and type(flatten(batch)) is list
    doubled = EncodedBatch(batch)
    doubled.extend(batch)
    assert doubled == expected * 2 and batch == expected  # the parts are not shared lists
    assert repr(EncodedBatch([status])) == f"EncodedBatch({[status]!r})"
    assert EncodedBatch() == [] and not EncodedBatch()


def test_the_kafka_sink_sends_bulk_columns_in_order():
    encoder = RecordEncoder("f", ORIGIN, 1.0)
    columns = [release_column([f"item-{i:07d}" for i in range(40)], QUARTERS[:40]),
               release_column(["é", "キー"], [1.0, -0.0])]
    out = StepOutputs(7, [BudgetExhausted("z", 7, "tree counter", "refused", 1.0, 0.5,
                                          "epsilon")],
                      [Alert("a", 7, 10, 0.1), Alert("b", 7, 10, 0.1)], columns)
    batch = encoder.encode_step(out)
    producer = FakeProducer()
    sink, observed = sink_with(producer)
    sink.write_batch([batch, ("dead_letters", None, b"0")])
    topics = {"releases": "r", "alerts": "a", "dead_letters": "d"}
    expected = [*encoded_per_release(encoder, out), ("dead_letters", None, b"0")]
    assert producer.sent == [(topics[role], key, value) for role, key, value in expected]
    assert observed == [(0, {"releases": 43, "alerts": 2, "dead_letters": 1}, 0)]
