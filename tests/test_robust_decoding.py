"""No record can stop a flow (issue 22, item 1; privacy-pitfalls.md item 16).

Every kind's decoding turns *any* exception into a dead letter naming the exception's type
(never its text): the shared guard in :meth:`StepClock.process` for every kind, the counters'
own decoder for the exceptions msgspec raises besides ``DecodeError``, and PMWG's query
compiler in the shard. Hypothesis fuzzes each decoder (counters events, PMWG events and
queries, ERM rows) with random bytes, deep nesting, huge numbers, NaN/Infinity, invalid UTF-8,
lone surrogates and duplicate keys: every record is accepted or a dead letter, never an
exception. Finally a real Bytewax run with the 1,000-level record of the issue: one dead
letter, and the flow publishes every other release.
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from typing import Any

import numpy as np
import orjson
import pytest
from bytewax.testing import TestingSink, TestingSource, run_main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.messages import message, raw

from dpstream.core.counting.outputs import Release
from dpstream.core.noise.keys import NoiseKey
from dpstream.kinds.counters.events import EventRules, PartitionClock
from dpstream.kinds.counters.records import RecordEncoder, _keys_json
from dpstream.messages import DeadLetter, RawBatch
from dpstream.platform import build_flow, parse_config
from dpstream.stream.clock import StepClock

ORIGIN = 1_790_000_000  # 2026-09-21T14:13:20Z
KEY = NoiseKey.for_tests(22)
NESTED = b'{"key":"k","ts":1,"x":' + b"[" * 1000 + b"]" * 1000 + b"}"
"""The record of issue 22: 2 KB that made msgspec raise RecursionError."""
FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def counters_config(**flow: Any) -> Any:
    return parse_config({
        "flow": {"name": "t", "origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 2,
                 **flow},
        "privacy": {"accounting": "pure", "budget": 1.0, "delta": 1e-6},
        "admission": {"mode": "declared", "keys": ["a", "b", "k"]},
        "metrics": {"port": 0},
    })


def counters_clock() -> PartitionClock:
    """The counters' clock of the open universe (keys from the records)."""
    from datetime import UTC, datetime

    rules = EventRules("key", "ts", datetime.fromtimestamp(ORIGIN, UTC), 1.0, 5.0, 2)
    return PartitionClock(rules)


def batch(values: list[bytes | None], broker: float = ORIGIN + 1.5,
          topic: str = "events", partition: int = 0) -> RawBatch:
    return RawBatch.of([raw(partition, v, i, broker, topic=topic)  # type: ignore[arg-type]
                        for i, v in enumerate(values)])


def good(key: str = "a", ts: float = ORIGIN + 1.2) -> bytes:
    return json.dumps({"key": key, "ts": ts}).encode()


# -- the regression: the 1,000-level record ---------------------------------------------------


def test_a_deeply_nested_record_is_a_dead_letter_not_a_crash():
    clock = counters_clock()
    updates, dead = clock.process(0, batch([good(), NESTED, good("b")]))
    assert [letter.offset for letter in dead] == [1]
    assert dead[0].reason == "undecodable record (RecursionError)"
    assert dead[0].original == NESTED
    assert clock.events == 2
    assert sum(sum(b.values()) for u in updates for b in u.increments.values()) == 2


def test_invalid_utf8_in_a_batch_is_a_dead_letter():
    clock = counters_clock()
    _, dead = clock.process(0, batch([good(), b'{"key":"k\xff","ts":1}']))
    assert [(d.offset, d.reason) for d in dead] == [(1, "invalid JSON")]
    assert clock.events == 1


class _Fragile(StepClock):
    """A kind whose decoder raises on one record (a bug), and on nothing else."""

    def decode(self, partition, messages, dead):
        times, refs = [], []
        for i, (_, value, _, _, _, _) in enumerate(messages):
            if value == b"boom":
                raise ValueError(f"secret value {value!r}")  # text that quotes the record
            if value == b"bad":
                dead.append(self.dead_letter("explained", messages[i]))
                continue
            times.append(float(value))  # type: ignore[arg-type]
            refs.append(i)
        return [("p", i) for i in refs], times, refs

    def route(self, payloads, steps):
        return [{0: list(payloads)} if payloads else {}, {}]


def _fragile() -> _Fragile:
    rules = counters_config()  # any ClockRules
    return _Fragile(rules)


@pytest.mark.parametrize("split", [None, 1, 2, 3])
def test_the_clock_guard_dead_letters_exactly_the_raising_records_whatever_the_batching(split):
    values = [str(ORIGIN + 1.1).encode(), b"boom", b"bad", str(ORIGIN + 1.3).encode()]
    messages = [raw(0, v, i, ORIGIN + 1.5) for i, v in enumerate(values)]
    clock = _fragile()
    chunks = [messages] if split is None else [messages[:split], messages[split:]]
    dead: list[DeadLetter] = []
    accepted = []
    for chunk in chunks:
        updates, letters = clock.process(0, chunk)
        dead += letters
        accepted += [p for u in updates for b in u.increments.values() for p in b]
    assert [(d.offset, d.reason) for d in dead] == [
        (1, "undecodable record (ValueError)"), (2, "explained")]
    assert "secret" not in dead[0].reason
    assert len(accepted) == 2
    assert clock.events == 2 and clock.dead_letters == 2


class _Quarrelsome(_Fragile):
    """Raises when ``b"x"`` and ``b"y"`` are decoded in one batch (a bug of a kind)."""

    def decode(self, partition, messages, dead):
        values = {m[1] for m in messages}
        if {b"x", b"y"} <= values:
            raise RuntimeError("x and y together")
        times, refs = [], []
        for i, (_, value, _, _, _, _) in enumerate(messages):
            times.append(ORIGIN + (1.1 if value == b"x" else 1.2 if value == b"y" else 1.3))
            refs.append(i)
        return [("p", messages[i][2]) for i in refs], times, refs


@pytest.mark.parametrize("split", [None, 1, 2])
def test_records_that_fail_only_together_are_accepted_whatever_the_batching(split):
    messages = [raw(0, v, i, ORIGIN + 1.5) for i, v in enumerate([b"x", b"z", b"y"])]
    clock = _Quarrelsome(counters_config())
    chunks = [messages] if split is None else [messages[:split], messages[split:]]
    accepted, dead = [], []
    for chunk in chunks:
        updates, letters = clock.process(0, chunk)
        dead += letters
        accepted += [p for u in updates for b in u.increments.values() for p in b]
    assert dead == []  # each record decodes alone: none is lost to its batch-mates
    assert sorted(accepted) == [("p", 0), ("p", 1), ("p", 2)]


# -- fuzzing every kind's decoder -------------------------------------------------------------

_json_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(), st.text(max_size=8))
_json_values = st.recursive(
    _json_leaves, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=12)


def _nested(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + close * depth


SPECIAL: list[bytes | None] = [
    NESTED, b'{"key":"k","ts":' + _nested(3000) + b"}", _nested(1200),
    b'{"key":"k","ts":' + b'{"a":' * 900 + b"1" + b"}" * 900 + b"}",
    b'{"key":"k","ts":NaN}', b'{"key":"k","ts":Infinity}', b'{"key":"k","ts":-Infinity}',
    b'{"key":"k","ts":1e400}', b'{"key":"k","ts":' + b"9" * 400 + b"}",
    b'{"key":"k","ts":-' + b"9" * 5000 + b"}", b'{"key":' + b"1" * 5000 + b',"ts":1}',
    b'{"key":"k\xff\xfe","ts":1}', b'\xff\xfe{"key":"k"}', b'{"key":"\\ud800","ts":1}',
    b'{"key":"\\udfff\\ud800","ts":1}', b'{"key":"a","key":"b","ts":1,"ts":"x"}',
    b'{"key":"k","ts":"9999-12-31T23:59:59-23:59"}', b'{"key":"k","ts":"0001-01-01T00:00+23:59"}',
    b'{"key":"k","ts":"' + b"9" * 300 + b'"}', b"", b"\n", b"null", b"[]", b'"x"', b"1e999",
    b'{"key":"\\u0000","ts":1}', b'{"dpstream.tick":1}', b'{"key":"k","ts":1}\n{"key":"k","ts":1}',
    b'{"features":' + _nested(1000) + b',"label":"yes","ts":1}',
    b'{"features":[1e308,1e308,-1e308,1e308],"label":"yes","ts":1}',
    b'{"features":[' + b"9" * 400 + b',0,0,0],"label":"yes","ts":1}',
    b'{"features":[[1],[2],[3],[4]],"label":"yes","ts":1}',
    b'{"features":[1,2,3,4],"label":' + _nested(1000) + b',"ts":1}',
    b'{"features":[1,2,3,4],"label":"yes","s":["a"],"ts":1}',
    b'{"country":' + _nested(1000) + b',"age":3,"ts":1}',
    b'{"country":"de","age":1e400,"ts":1}', b'{"country":"de","age":NaN,"ts":1}',
    b'{"country":["de"],"age":{"x":1},"ts":1}', None,
]
"""Records made to break a parser (the repr of a strategy over them would be 40 kB)."""
_SPECIAL = st.sampled_from(range(len(SPECIAL))).map(SPECIAL.__getitem__)


def _dumps(value: Any) -> bytes:
    """JSON as a producer may write it: integers of any size, NaN and Infinity included."""
    return json.dumps(value).encode()


def _structured(value: Any, extra: dict[str, Any]) -> bytes:
    body = dict(extra)
    body["x"] = value
    return _dumps(body)


_records = st.one_of(
    st.binary(max_size=64),
    _SPECIAL,
    _json_values.map(_dumps),
    st.builds(_structured, _json_values, st.fixed_dictionaries(
        {"key": st.one_of(st.text(max_size=6), _json_values),
         "ts": st.one_of(st.floats(), st.integers(), st.text(max_size=30), _json_values)})),
    st.builds(_structured, _json_values, st.fixed_dictionaries(
        {"features": st.one_of(st.lists(st.one_of(st.floats(), st.integers(), _json_values),
                                        min_size=4, max_size=4), _json_values),
         "label": st.one_of(st.sampled_from(["yes", "no", 1, True]), _json_values),
         "s": st.one_of(st.sampled_from(["a", "b"]), _json_values),
         "ts": st.one_of(st.floats(), st.just(ORIGIN + 1.2), st.text(max_size=30))})),
    st.builds(_structured, _json_values, st.fixed_dictionaries(
        {"country": st.one_of(st.sampled_from(["de", "fr", "uk"]), _json_values),
         "age": st.one_of(st.floats(), st.integers(), _json_values),
         "ts": st.one_of(st.floats(), st.just(ORIGIN + 1.2), st.text(max_size=30))})),
    # text as the producer may send it: lone surrogates escaped, or raw bytes of any kind
    st.text().map(lambda s: json.dumps({"key": s, "ts": ORIGIN + 1}).encode()),
    st.text().map(lambda s: s.encode("utf-8", "surrogatepass")),
)
_batches = st.builds(  # every batch holds at least one of the records made to break a parser
    lambda records, special: records + special,
    st.lists(_records, max_size=6), st.lists(_SPECIAL, min_size=1, max_size=2)).flatmap(
    st.permutations)


def _check(clock: StepClock, partition: int, values: list[bytes | None],
           topic: str = "events") -> tuple[list[Any], list[DeadLetter]]:
    """Every record is accepted or a dead letter (reason free of exception text)."""
    before, ticks = clock.events, clock.ticks
    updates, dead = clock.process(partition, batch(values, topic=topic, partition=partition))
    assert clock.events - before + len(dead) + clock.ticks - ticks == len(values)
    for letter in dead:
        assert isinstance(letter.reason, str) and letter.reason
        assert letter.offset is not None
    return updates, dead


def _accepted_keys(updates) -> list[str]:
    return [key for u in updates for bucket in u.increments.values() for key in bucket]


@FUZZ
@given(_batches)
def test_fuzz_counters_events_open_universe(values):
    clock = counters_clock()
    updates, _ = _check(clock, 0, values)
    keys = _accepted_keys(updates)
    encoder = RecordEncoder("t", counters_config().origin, 1.0)
    for key in keys:  # every key a record got in can be published
        _, _, body = encoder.encode(Release(key, 1, 2.0, 1.0, "tree", 0.5, 1.0, "epsilon", 0.0))
        assert orjson.loads(body)["key"] == key
    text = _keys_json(keys)
    if text is not None:
        assert orjson.loads(b"[" + text + b"]") == keys


@FUZZ
@given(_batches)
def test_fuzz_counters_events_declared_universe(values):
    from dpstream.platform import flow_kind

    cfg = counters_config()
    clock = flow_kind("counters").clock(cfg, {"events": 0})(None)
    _check(clock, 0, values)


def pmwg_config() -> Any:
    universe = [{"name": "country", "values": ["de", "fr", "uk"]},
                {"name": "age", "edges": [0, 18, 40, 120]}]
    return parse_config({
        "flow": {"kind": "pmwg", "name": "p", "origin": "2026-09-21T14:13:20Z", "step": "1s",
                 "shards": 2},
        "privacy": {"accounting": "pure", "budget": 4.0},
        "metrics": {"port": 0},
        "histograms": [{"name": "h", "universe": universe, "epsilon": 0.9,
                        "size_epsilon": 2.0, "size_horizon": 64, "alpha": 0.1, "n": 5,
                        "mode": "practical", "hard_queries": 4}],
    })


@FUZZ
@given(_batches, _batches)
def test_fuzz_pmwg_events_and_queries(events, queries):
    from dpstream.platform import flow_kind

    clock = flow_kind("pmwg").clock(pmwg_config(), {"events": 0, "queries": 1})(None)
    _check(clock, 0, events)
    _check(clock, 1, queries, topic="queries")


_queries = st.one_of(
    _json_values,
    st.fixed_dictionaries({"schema": st.just("dpstream.query/1"),
                           "kind": st.sampled_from(["count", "marginal", "mean", "x"]),
                           "where": _json_values, "attrs": _json_values}),
    st.just({"schema": "dpstream.query/1", "kind": "count",
             "where": [{"not": {"not": None}}]}),
    st.integers(min_value=1, max_value=500).map(lambda depth: orjson.loads(
        '{"schema":"dpstream.query/1","kind":"count","where":'
        + '[{"not":' * depth + '{"attr":"country","eq":"de"}' + "}]" * depth + "}")),
    st.integers(min_value=1, max_value=500).map(lambda depth: orjson.loads(
        '{"schema":"dpstream.query/1","kind":"count","where":'
        + '[{"or":' * depth + '[{"attr":"country","eq":"de"}]' + "}]" * depth + "}")),
)


@FUZZ
@given(st.lists(_queries, min_size=1, max_size=4))
def test_fuzz_pmwg_questions_are_answered_or_refused_never_raise(queries):
    from dpstream.kinds.pmwg.records import AnswerEncoder
    from dpstream.kinds.pmwg.shard import _Histogram

    cfg = pmwg_config()
    histogram = _Histogram(cfg.histograms[0], KEY, ("i", "p", "h"), None)
    histogram.add({0: 10, 3: 4})
    encoder = AnswerEncoder(cfg)
    for i, query in enumerate(queries):
        answer = histogram.answer(f"q{i}", query, 0)
        encoder.encode(answer)


def test_a_question_nested_past_the_recursion_limit_is_an_error_answer():
    from dpstream.kinds.pmwg.shard import _Histogram

    cfg = pmwg_config()
    histogram = _Histogram(cfg.histograms[0], KEY, ("i", "p", "h"), None)
    deep = orjson.loads('{"schema":"dpstream.query/1","kind":"count","where":'  # as deep as
                        + '[{"not":' * 500 + '{"attr":"country","eq":"de"}'  # orjson reads
                        + "}]" * 500 + "}")
    answer = histogram.answer("q", deep, 0)
    assert answer.kind == "error"


def test_a_question_the_compiler_cannot_read_is_an_error_answer_naming_only_the_type(
        monkeypatch):
    from dpstream.core.pmwg.query_compiler import QueryCompiler
    from dpstream.kinds.pmwg.shard import _Histogram

    def broken(self, query):
        raise RecursionError(f"deep in {query!r}")

    monkeypatch.setattr(QueryCompiler, "compile", broken)
    histogram = _Histogram(pmwg_config().histograms[0], KEY, ("i", "p", "h"), None)
    answer = histogram.answer("q", {"kind": "count", "secret": 7}, 0)
    assert (answer.kind, answer.reason) == (
        "error", "the question could not be read (RecursionError)")


def erm_config() -> Any:
    return parse_config({
        "flow": {"kind": "erm", "name": "m", "origin": "2026-09-21T14:13:20Z", "step": "1s",
                 "shards": 2},
        "privacy": {"accounting": "pure", "epsilon": 1.0},
        "metrics": {"port": 0},
        "model": {"classes": ["no", "yes"], "dimension": 4, "clip_norm": 3.0,
                  "regularization": 0.05, "streams": ["a", "b"], "stream_field": "s"},
        "release": {"algorithm": "continual", "block_size": 200, "base_blocks": 2},
    })


@FUZZ
@given(_batches)
def test_fuzz_erm_rows(values):
    from dpstream.platform import flow_kind

    clock = flow_kind("erm").clock(erm_config(), {"events": 0})(None)
    _check(clock, 0, values)


# -- end to end: a real Bytewax run -----------------------------------------------------------


@pytest.mark.flow
def test_the_nested_record_in_a_bytewax_run_is_one_dead_letter_and_the_flow_completes():
    cfg = counters_config()
    items = []
    offsets: Counter[int] = Counter()
    for step in range(6):
        for i in range(10):
            p = i % 2
            items.append(message(p, "a" if i < 6 else "b", ORIGIN + step + 0.05 * i, offsets[p]))
            offsets[p] += 1
            if step == 2 and i == 4:  # the poison record, amid partition 0's events
                items.append(raw(0, NESTED, offsets[0], ORIGIN + step + 0.05 * i))
                offsets[0] += 1
    sink: list = []
    flow = build_flow(cfg, KEY, instance="t-1", partitions=2, source=TestingSource(items, 7),
                      sink=TestingSink(sink))
    run_main(flow)
    dead = [json.loads(v) for role, _, v in sink if role == "dead_letters"]
    assert len(dead) == 1
    assert dead[0]["reason"] == "undecodable record (RecursionError)"
    assert base64.b64decode(dead[0]["original_base64"]) == NESTED
    releases = [json.loads(v) for role, _, v in sink if role == "releases"]
    assert {(r["key"], r["step"]) for r in releases} == {
        (k, s) for k in ("a", "b", "k") for s in range(6)}
    assert np.isfinite([r["value"] for r in releases]).all()


def _poison_run(exact: bool) -> tuple[Any, list[str]]:
    """The nested record amid good ones, through a flow with metrics: (registry, warnings)."""
    import logging

    from prometheus_client import CollectorRegistry

    from dpstream.metrics import FlowMetrics

    items = []
    for step in range(4):
        for p in (0, 1):
            items.append(message(p, "a", ORIGIN + step + 0.1, 3 * step))
            if step == 1:
                items.append(raw(p, NESTED, 3 * step + 1, ORIGIN + step + 0.2))
                items.append(raw(p, NESTED, 3 * step + 2, ORIGIN + step + 0.3))
    registry = CollectorRegistry()
    metrics = FlowMetrics("t", registry, exact_counts=exact)
    flow = build_flow(counters_config(), KEY, instance="t-1", partitions=2,
                      source=TestingSource(items, 7), sink=TestingSink([]), metrics=metrics)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.WARNING)
    logging.getLogger("dpstream").addHandler(handler)
    try:
        run_main(flow)
    finally:
        logging.getLogger("dpstream").removeHandler(handler)
    return registry, [r.getMessage() for r in records if "undecodable" in r.getMessage()]


@pytest.mark.flow
def test_an_undecodable_record_logs_one_warning_per_partition_naming_its_offset():
    registry, lines = _poison_run(exact=True)
    assert registry.get_sample_value(
        "dpstream_dead_letters_total",
        {"flow": "t", "reason": "undecodable record (RecursionError)"}) == 4
    # the second record of each partition is within the minute: not logged (counted)
    assert sorted(lines) == sorted(
        f"input events[{p}] offset 4: undecodable record (RecursionError) -> dead letter (if "
        "a record still crashes the flow, quarantine it with dpstream run --skip-record)"
        for p in (0, 1))


@pytest.mark.flow
def test_without_exact_counts_an_undecodable_record_logs_one_line_without_where_or_how_many():
    registry, lines = _poison_run(exact=False)
    assert registry.get_sample_value(
        "dpstream_dead_letters_total",
        {"flow": "t", "reason": "undecodable record (RecursionError)"}) is None
    [line] = lines
    assert "offset" not in line and "events[" not in line and "RecursionError" in line
    assert "metrics.exact_counts = true" in line and "dead-letter topic" in line


# -- the one-by-one fallback keeps each record's own payload -----------------------------------


def _together_raises(kind_clock: type[StepClock]) -> type[StepClock]:
    """The kind's clock whose decoder raises on any batch of two records or more (a bug).

    Every record decodes alone, so :meth:`StepClock._decode_guarded` finds no record to
    blame, decodes the batch again, fails again and falls back to decoding each record on
    its own: the path where a payload must not point into state the next decode replaces.
    """

    class Together(kind_clock):  # type: ignore[misc, valid-type]
        def decode(self, partition, messages, dead):
            if len(messages) > 1:
                raise RuntimeError("records that fail only together")
            return super().decode(partition, messages, dead)

    return Together


def _pmwg_event(country: str, age: int) -> bytes:
    return _dumps({"country": country, "age": age, "ts": ORIGIN + 1.2})


PMWG_EVENTS = [_pmwg_event(c, a) for c, a in
               [("de", 5), ("fr", 30), ("uk", 50), ("de", 5), ("fr", 70), ("uk", 10)]]


def _pmwg_cells(updates) -> dict[int, dict[str, dict[int, int]]]:
    return {u.shard: {step: bucket["cells"] for step, bucket in u.increments.items()}
            for u in updates if u.increments}


def test_pmwg_events_decoded_one_by_one_count_each_in_its_own_cell():
    """Event level: a batch that decodes only record by record counts each event in its cell.

    The reference is the same batch through the unmodified decoder (one batch decode); the
    events cover five distinct cells, so counting every event as the last one's cell (the
    bug: payloads indexing a cell table each single decode overwrote) cannot pass.
    """
    from dpstream.kinds.pmwg.events import PmwgClock

    bases = {"events": 0, "queries": 1}
    reference = PmwgClock(pmwg_config(), bases).process(0, batch(PMWG_EVENTS))
    fallback = _together_raises(PmwgClock)(pmwg_config(), bases).process(0, batch(PMWG_EVENTS))
    assert reference[1] == fallback[1] == []
    expected = _pmwg_cells(reference[0])
    cells = next(iter(next(iter(expected.values())).values()))["h"]
    assert sum(cells.values()) == len(PMWG_EVENTS) and len(cells) == 5  # the test's power
    assert _pmwg_cells(fallback[0]) == expected


def _erm_rows(updates) -> list[tuple[str, int, list[float], int, list[int]]]:
    rows = []
    for u in updates:
        for step, bucket in u.increments.items():
            for stream, parts in bucket.items():
                for z, y, order in parts:
                    rows += [(stream, step, z[i].tolist(), int(y[i]), order[i].tolist())
                             for i in range(len(y))]
    return sorted(rows, key=lambda r: (r[4], r[0]))


def test_erm_rows_decoded_one_by_one_keep_their_own_features_labels_and_order():
    """Event level: the one-by-one fallback gives each row its own features, label, stream."""
    from dpstream.kinds.erm.events import ErmClock

    values = [_dumps({"features": [i, -i, 0.5 * i, 1], "label": "yes" if i % 2 else "no",
                      "s": "ab"[i % 2], "ts": ORIGIN + 1.2}) for i in range(5)]
    reference = ErmClock(erm_config()).process(0, batch(values))
    fallback = _together_raises(ErmClock)(erm_config()).process(0, batch(values))
    assert reference[1] == fallback[1] == []
    expected = _erm_rows(reference[0])
    assert len(expected) == 5 and len({tuple(r[2]) for r in expected}) == 5  # the test's power
    assert _erm_rows(fallback[0]) == expected


def test_counters_keys_decoded_one_by_one_are_each_records_own():
    """The counters' payloads are the keys themselves (or positions): no shared table."""
    values = [good(k) for k in ["a", "b", "b", "k"]]
    reference = counters_clock().process(0, batch(values))
    fallback = _together_raises(PartitionClock)(
        counters_clock().rules).process(0, batch(values))
    assert reference[1] == fallback[1] == []
    assert [u.increments for u in fallback[0]] == [u.increments for u in reference[0]]
    assert sorted(_accepted_keys(fallback[0])) == ["a", "b", "k"]
