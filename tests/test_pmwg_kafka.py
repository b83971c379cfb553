"""The PMWG flow end to end against a real Kafka-protocol broker, asked through the query client.

``dpstream run`` runs a pmwg flow in a child process. A running flow is fed events and ticks
by a producer thread and asked questions with :class:`dpstream.query_client.QueryClient` and
with ``dpstream query``; a bounded flow is killed with SIGKILL, resumed from its recovery store
and compared with an uninterrupted run of the same flow instance, answer for answer.

The embedded broker ignores LogAppendTime, so the flows use ``clock = "producer"`` and the
tests stamp every record themselves (events, questions and ticks alike).
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaProducer
from support import cli_flows
from support.cli_flows import finish, iso
from support.configs import pmwg, write

from dpstream import schemas
from dpstream.errors import DpstreamError
from dpstream.io.broker import free_port
from dpstream.io.topics import ensure_topics, produce, read_all
from dpstream.query_client import (
    QueryClient,
    describe_answer,
    kafka_python_settings,
)
from dpstream.schemas import ANSWER_SCHEMA

pytestmark = [pytest.mark.integration]

ENV = dict(os.environ, PYTHONUNBUFFERED="1",
           DPSTREAM_NOISE_KEY="e1098da29203cd508e2ef1034614174145e6467de7da4de724d821e4584a7dd6")
COUNTRIES = {"de": 5, "fr": 3, "us": 2}  # value -> weight of the synthetic distribution
DEVICES = {"ios": 6, "web": 4}
AGES = [(0, 30, 3), (30, 60, 5), (60, 120, 2)]  # bucket [lo, hi) -> weight
HISTOGRAM = "sessions"
ANSWER_KEYS = {"schema", "flow", "instance", "histogram", "mechanism", "id", "step", "window",
               "t", "kind", "value", "reason", "hard_queries", "privacy"}
BOTTOM_REASONS = {"privacy budget exhausted", "hard-query budget exceeded"}
TOLERANCE = 0.2
"""On fractions. Hard answers carry Laplace noise of std ~0.32 / sqrt(t / 200) (check-config:
'hard-answer noise std at n = 0.318' with these settings), i.e. <= 0.04 at the t >= 8000 the
live test waits for: 0.2 is about 5 std (a Laplace tail of ~1e-3 per answer). Easy answers are
within the threshold 2 alpha / 3 = 0.133 plus sparse-vector noise of the truth (w.h.p.)."""



def write_config(path: Path, bootstrap: str, topics: dict[str, str], *, origin: int,
                 name: str, tail: bool, lateness: str = "0s", batch_size: int = 500,
                 end: int | None = None) -> Path:
    """``end``: flow.end (Unix seconds), which a bounded run (tail false) needs."""
    histogram = {"name": HISTOGRAM, "mechanism": "pmwg", "mode": "practical", "hard_queries": 4,
                 "epsilon": 0.8, "size_epsilon": 0.2, "size_horizon": 1024, "alpha": 0.2,
                 "n": 200, "universe": [{"name": "country", "values": ["de", "fr", "us"]},
                                        {"name": "device", "values": ["ios", "web"]},
                                        {"name": "age", "edges": [0, 30, 60, 120]}]}
    # the tests write the ticks (the only records that close steps) themselves: no heartbeat
    return write(path, pmwg(
        bootstrap, topics, [histogram], name=name, origin=origin,
        flow={"lateness": lateness, "heartbeat": "off", "end": None if end is None else iso(end)},
        kafka={"tail": tail, "batch_size": batch_size, "startup_timeout": "10s"}))


def make_topics(bootstrap: str, stem: str) -> dict[str, str]:
    tag = uuid.uuid4().hex[:8]
    topics = {"events": f"{stem}-events-{tag}", "queries": f"{stem}-queries-{tag}",
              "answers": f"{stem}-answers-{tag}", "dead": f"{stem}-dead-{tag}"}
    ensure_topics(bootstrap, {topics["events"]: 2, topics["queries"]: 1, topics["answers"]: 1,
                              topics["dead"]: 1})
    return topics


def start_flow(config: Path, *args: str) -> subprocess.Popen:
    return cli_flows.start_flow(config, ENV, *args)


def random_event(rng: random.Random) -> dict[str, Any]:
    lo, hi, _ = rng.choices(AGES, [w for _, _, w in AGES])[0]
    return {"country": rng.choices(list(COUNTRIES), list(COUNTRIES.values()))[0],
            "device": rng.choices(list(DEVICES), list(DEVICES.values()))[0],
            "age": rng.randrange(lo, hi)}


def check_structure(answer: dict[str, Any], *, flow: str, origin: int, qid: str) -> None:
    """Every field of a dpstream.answer/1 record, strictly."""
    keys = ANSWER_KEYS | ({"kinds"} if answer.get("kind") == "marginal" else set())
    assert set(answer) == keys, answer
    assert answer["schema"] == ANSWER_SCHEMA and answer["flow"] == flow
    assert answer["histogram"] == HISTOGRAM and answer["mechanism"] == "pmwg"
    assert answer["id"] == qid
    step = answer["step"]
    assert isinstance(step, int) and step >= 0
    assert answer["window"] == {"start": iso(origin + step), "end": iso(origin + step + 1)}
    assert isinstance(answer["t"], int) and answer["t"] >= 0
    # hard_queries = 4 sizes the noise for 4 rounds started at n; later rounds cost less
    assert isinstance(answer["hard_queries"], int) and answer["hard_queries"] >= 0
    privacy = answer["privacy"]
    assert set(privacy) == {"unit", "accounting", "spent", "budget"}, privacy
    assert privacy["unit"] == "event" and privacy["accounting"] == "pure"
    assert privacy["budget"] == pytest.approx(1.0)  # size counter 0.2 + mechanism 0.8
    assert 0.2 - 1e-9 <= privacy["spent"] <= privacy["budget"] + 1e-9
    kind, value, reason = answer["kind"], answer["value"], answer["reason"]
    if kind in ("easy", "hard"):
        assert isinstance(value, float) and reason is None and answer["t"] >= 200, answer
    elif kind == "bottom":
        assert value is None and reason in BOTTOM_REASONS, answer
    elif kind == "waiting":
        assert value is None and answer["t"] < 200 and "has not reached n = 200" in reason
    elif kind == "error":
        assert value is None and isinstance(reason, str) and reason, answer
    elif kind == "marginal":
        assert isinstance(value, list) and len(value) == len(answer["kinds"]), answer
        for part, part_kind in zip(value, answer["kinds"], strict=True):
            assert part_kind in ("easy", "hard", "bottom"), answer
            assert (part is None) == (part_kind == "bottom"), answer
    else:
        pytest.fail(f"unknown answer kind {kind!r}: {answer}")


# --- a live flow, fed continuously --------------------------------------------------------


@dataclass
class LiveFlow:
    """A tailing pmwg flow and the producer thread that keeps its steps closing."""

    bootstrap: str
    topics: dict[str, str]
    config: Path
    origin: int
    name: str
    proc: subprocess.Popen
    events: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (ms, event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    failure: list[BaseException] = field(default_factory=list)

    def pump(self, per_partition: int = 150, interval: float = 0.2) -> None:
        """Every ``interval`` s: events stamped now on both events partitions, then a tick on
        every input partition (only ticks close steps under the producer clock, and a step
        closes only when every input partition moved past it)."""
        rng = random.Random(7)
        producer = KafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=5, acks="all")
        try:
            while not self.stop.is_set():
                ms = int(time.time() * 1000)
                for partition in (0, 1):
                    for _ in range(per_partition):
                        event = random_event(rng)
                        with self.lock:
                            self.events.append((ms, event))
                        producer.send(self.topics["events"],
                                      json.dumps({**event, "ts": ms / 1000}).encode(),
                                      partition=partition, timestamp_ms=ms)
                producer.send(self.topics["queries"], b'{"dpstream.tick":1}', partition=0,
                              timestamp_ms=ms)
                for partition in (0, 1):
                    producer.send(self.topics["events"], b'{"dpstream.tick":1}',
                                  partition=partition, timestamp_ms=ms)
                producer.flush(10)
                self.stop.wait(interval)
        except BaseException as exc:  # surfaced by the tests
            self.failure.append(exc)
        finally:
            producer.close(5)

    def step_now(self) -> int:
        return (int(time.time() * 1000) - self.origin * 1000) // 1000

    def database(self, step: int) -> list[dict[str, Any]]:
        """The events of every step up to ``step`` (what the flow answered against)."""
        limit = (self.origin + step + 1) * 1000
        with self.lock:
            return [e for ms, e in self.events if ms < limit]

    def check_running(self) -> None:
        assert not self.failure, f"the producer thread failed: {self.failure[0]!r}"
        if self.proc.poll() is not None:
            out = self.proc.stdout.read().decode(errors="replace") if self.proc.stdout else ""
            pytest.fail(f"the flow exited ({self.proc.returncode}):\n{out[-3000:]}")


def warm_up(flow: LiveFlow, size: int = 8000, timeout: float = 60) -> None:
    """Wait until the flow answers at a public size ``t >= size`` (the noise is small then)."""
    deadline = time.monotonic() + timeout
    with QueryClient(flow.bootstrap, queries_topic=flow.topics["queries"],
                     answers_topic=flow.topics["answers"], flow=flow.name) as client:
        while True:
            flow.check_running()
            try:
                answer = client.ask(HISTOGRAM, {"kind": "count"}, timeout=10)
            except DpstreamError:
                flow.check_running()
                raise
            if answer["kind"] != "waiting" and answer["t"] >= size:
                return
            assert time.monotonic() < deadline, f"t stays small: {answer}"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def live(broker, tmp_path_factory) -> Iterator[LiveFlow]:
    topics = make_topics(broker.bootstrap, "pmwg-live")
    origin = int(time.time()) - 3
    name = "pmwg-live"
    # lateness 1 s: a question stamped just before a tick of the producer thread may reach
    # the partition just after it; without slack it could land in an already closed step
    config = write_config(tmp_path_factory.mktemp("live") / "live.toml", broker.bootstrap,
                          topics, origin=origin, name=name, tail=True, lateness="1s")
    flow = LiveFlow(broker.bootstrap, topics, config, origin, name, start_flow(config))
    pumping = threading.Thread(target=flow.pump, name="pmwg-pump", daemon=True)
    pumping.start()
    try:
        warm_up(flow)
        yield flow
    finally:
        flow.stop.set()
        pumping.join(20)
        if flow.proc.poll() is None:
            flow.proc.send_signal(signal.SIGTERM)
        out = finish(flow.proc, timeout=30)
        assert "stopped" in out


def true_fraction(events: list[dict[str, Any]], where: list[dict[str, Any]]) -> float:
    def matches(event: dict[str, Any]) -> bool:
        for condition in where:
            value = event[condition["attr"]]
            if "eq" in condition and value != condition["eq"]:
                return False
            if "in" in condition and value not in condition["in"]:
                return False
            if "range" in condition and not condition["range"][0] <= value < \
                    condition["range"][1]:
                return False
        return True

    return sum(map(matches, events)) / len(events)


@pytest.mark.slow
def test_a_running_flow_answers_questions_asked_through_the_client(live, broker):
    started = time.monotonic()
    with QueryClient(live.bootstrap, queries_topic=live.topics["queries"],
                     answers_topic=live.topics["answers"], flow=live.name) as client:
        answers: list[dict[str, Any]] = []

        def ask(query: dict[str, Any]) -> dict[str, Any]:
            live.check_running()
            before = live.step_now()
            qid = client.submit(HISTOGRAM, query)
            after = live.step_now()
            try:
                answer = client.answer(qid, timeout=30)
            except DpstreamError:
                live.check_running()  # a dead flow says why
                raise
            check_structure(answer, flow=live.name, origin=live.origin, qid=qid)
            # answered at the step holding the question's (producer) timestamp
            assert before <= answer["step"] <= after, (before, answer["step"], after)
            answers.append(answer)
            return answer

        # "everything" is easy: f(y) = 1 for the all-ones query whatever y is
        everything = ask({"kind": "count"})
        assert everything["kind"] == "easy" and everything["value"] == pytest.approx(1.0)
        assert everything["t"] >= 8000  # the fixture waited for it

        checked = 0
        for query in (
            {"kind": "count", "where": [{"attr": "country", "eq": "de"}]},
            {"kind": "marginal", "attrs": ["country"]},
            {"schema": "dpstream.query/1", "kind": "count",
             "where": [{"attr": "device", "in": ["ios"]}, {"attr": "age", "range": [0, 60]}]},
            {"kind": "count", "where": [{"attr": "country", "in": ["fr", "us"]}]},
        ):
            answer = ask(query)
            database = live.database(answer["step"])
            # the public size is a noisy, monotone estimate of the true size
            assert abs(answer["t"] - len(database)) <= 0.15 * len(database), \
                (answer["t"], len(database))
            if answer["kind"] == "marginal":
                assert len(answer["value"]) == 3
                parts = [[{"attr": "country", "eq": c}] for c in ("de", "fr", "us")]
                pairs = list(zip(answer["value"], answer["kinds"], parts, strict=True))
            else:
                pairs = [(answer["value"], answer["kind"], query.get("where", []))]
            for value, kind, where in pairs:
                if kind in ("easy", "hard"):
                    truth = true_fraction(database, where)
                    assert abs(value - truth) <= TOLERANCE, (value, truth, answer)
                    checked += 1
        assert checked >= 1, answers  # not everything was bottom

        bad = ask({"kind": "count", "wehre": [{"attr": "country", "eq": "de"}]})
        assert bad["kind"] == "error" and "wehre" in bad["reason"]
        outside = ask({"kind": "count", "where": [{"attr": "country", "eq": "xx"}]})
        assert outside["kind"] == "error" and "xx" in outside["reason"]

        # spending and hard queries only grow, answer after answer
        spent = [a["privacy"]["spent"] for a in answers]
        hard = [a["hard_queries"] for a in answers]
        assert spent == sorted(spent) and hard == sorted(hard)

        # a histogram the flow does not have: no answer, a dead letter that says why
        lost = "lost-" + uuid.uuid4().hex[:8]
        client.submit("nope", {"kind": "count"}, query_id=lost)
        with pytest.raises(DpstreamError, match=rf"no answer for query {lost} within 5 s: is "
                           r"the flow running, and are steps closing \(heartbeat/clock\)\?"):
            client.answer(lost, timeout=5)
    dead = [json.loads(r.value) for r in read_all(broker.bootstrap, live.topics["dead"],
                                                  timeout=20, idle=1)]
    [letter] = [d for d in dead if lost.encode() in base64.b64decode(d["original_base64"])]
    assert letter["schema"] == "dpstream.dead_letter/1" and letter["flow"] == live.name
    assert letter["reason"] == ("field 'histogram' must name a configured histogram "
                                f"({HISTOGRAM})")
    assert letter["source"]["topic"] == live.topics["queries"]
    assert letter["source"]["partition"] == 0
    assert json.loads(base64.b64decode(letter["original_base64"])) == {
        "id": lost, "histogram": "nope",
        "query": {"kind": "count", "schema": "dpstream.query/1"}}
    assert len(dead) == 1  # nothing else was refused: events, ticks and questions all fit
    print(f"{len(answers)} answers in {time.monotonic() - started:.1f} s; kinds "
          f"{[a['kind'] for a in answers]}; last t = {answers[-1]['t']}")


def run_cli(*args: str, stdin: str | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dpstream.cli", "query", *args], env=ENV,
                          capture_output=True, text=True, input=stdin, timeout=timeout)


ANSWER_LINE = re.compile(r"^(?P<id>\S+): (\d\.\d{4} \((easy|hard), t = \d+, spent [0-9.e-]+ "
                         r"of 1 epsilon\)|\u22a5 (privacy budget exhausted|hard-query budget "
                         r"exceeded))$")


def test_dpstream_query_asks_a_running_flow(live):
    config = str(live.config)
    de = json.dumps({"kind": "count", "where": [{"attr": "country", "eq": "de"}]})
    out = run_cli("--config", config, "--histogram", HISTOGRAM, de, "--id", "cli-1")
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert ANSWER_LINE.match(line) and line.startswith("cli-1: "), line

    # --json prints the record; the only histogram is the default; the query from stdin
    out = run_cli("--config", config, "--json", "--id", "cli-2", "-", stdin=de)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    check_structure(answer, flow=live.name, origin=live.origin, qid="cli-2")
    assert answer["kind"] in ("easy", "hard", "bottom")

    # a query the flow refuses: exit 1, the reason on stderr
    out = run_cli("--config", config, '{"kind": "count", "wehre": []}', "--id", "cli-3")
    assert out.returncode == 1 and not out.stdout
    assert "query cli-3 was refused by the flow" in out.stderr and "wehre" in out.stderr

    # no answer in time: exit 1 and the hint
    out = run_cli("--config", config, de, "--id", "cli-4", "--timeout", "0.2")
    assert out.returncode == 1
    assert "no answer for query cli-4 within 0.2 s: is the flow running" in out.stderr

    # refused locally: not a histogram of the flow, not JSON, not an object
    out = run_cli("--config", config, "--histogram", "nope", de)
    assert out.returncode == 1 and "'nope' is not a histogram of flow 'pmwg-live'" in out.stderr
    out = run_cli("--config", config, "{kind: count}")
    assert out.returncode == 1 and "not valid JSON" in out.stderr
    out = run_cli("--config", config, "[1]")
    assert out.returncode == 1 and "must be a JSON object" in out.stderr


def test_dpstream_query_refuses_a_config_that_is_not_pmwg(tmp_path):
    path = tmp_path / "counters.toml"
    path.write_text("""
[flow]
origin = "2026-09-21T14:13:20Z"
[kafka]
brokers = ["127.0.0.1:9"]
[privacy]
budget = 1.0
[admission]
mode = "declared"
keys = ["a"]
""")
    out = run_cli("--config", str(path), '{"kind": "count"}')
    assert out.returncode == 1
    assert "configures a 'counters' flow: `dpstream query` asks a PMWG flow" in out.stderr


# --- the client alone ---------------------------------------------------------------------


def test_the_client_keeps_the_first_answer_and_reads_only_new_ones(broker):
    topics = make_topics(broker.bootstrap, "pmwg-client")

    def answer(qid: str, value: float, flow: str = "f1", schema: str = ANSWER_SCHEMA) -> bytes:
        record = schemas.Answer(
            flow=flow, instance="", histogram=HISTOGRAM, mechanism="pmw", id=qid, step=3,
            window=schemas.Window.of_steps(datetime(2026, 1, 1, tzinfo=UTC), 1.0, 3), t=0,
            kind="easy", value=value, reason=None, hard_queries=0,
            privacy=schemas.Privacy(unit="event", accounting="pure", spent=0.0, budget=1.0))
        return schemas.encode(record).replace(ANSWER_SCHEMA.encode(), schema.encode())

    produce(broker.bootstrap, topics["answers"], [(None, answer("old", 0.5))])
    with QueryClient([broker.bootstrap], queries_topic=topics["queries"],
                     answers_topic=topics["answers"], flow="f1") as client:
        qid = client.submit(HISTOGRAM, {"kind": "count"})
        assert re.fullmatch(r"[0-9a-f]{32}", qid)
        assert client.submit(HISTOGRAM, {"kind": "count"}, query_id="old") == "old"
        produce(broker.bootstrap, topics["answers"], [
            (None, b"not json"), (None, b'{"schema": "dpstream.release/1", "id": "x"}'),
            (None, answer(qid, 0.1, flow="f2")),                  # another flow
            (None, answer(qid, 0.2, schema="dpstream.other/1")),  # another schema
            (None, answer(qid, 0.3)), (None, answer(qid, 0.4)),   # the first one wins
            (None, answer("old", 0.6))])
        assert client.answer(qid, timeout=10)["value"] == 0.3
        assert client.answer(qid, timeout=0)["value"] == 0.3  # asked again: the same record
        assert client.answer("old", timeout=10)["value"] == 0.6  # written before: not seen
        with pytest.raises(DpstreamError, match="no answer for query never within 0.5 s"):
            client.answer("never", timeout=0.5)
        for bad, message in [
            (dict(histogram=HISTOGRAM, query={}, query_id=""), "query_id must be a non-empty"),
            (dict(histogram=HISTOGRAM, query={}, query_id="x" * 257), "at most 256"),
            (dict(histogram="", query={}), "histogram must name"),
            (dict(histogram="a b", query={}), "histogram must name"),
            (dict(histogram=HISTOGRAM, query=[1]), "query must be a JSON object"),
            (dict(histogram=HISTOGRAM, query={"weights": [float("nan")]}),
             "JSON-serialisable"),
        ]:
            with pytest.raises(ValueError, match=message):
                client.submit(**bad)
    sent = read_all(broker.bootstrap, topics["queries"], expect=2, timeout=10)
    assert [json.loads(r.value) for r in sent] == [
        {"id": qid, "histogram": HISTOGRAM, "query": {"kind": "count",
                                                       "schema": "dpstream.query/1"}},
        {"id": "old", "histogram": HISTOGRAM, "query": {"kind": "count",
                                                         "schema": "dpstream.query/1"}}]
    assert {r.key for r in sent} == {HISTOGRAM.encode()}  # one histogram: one partition
    with pytest.raises(DpstreamError, match="answers topic 'missing-topic' does not exist"):
        QueryClient(broker.bootstrap, answers_topic="missing-topic")
    with pytest.raises(ValueError, match="unknown kafka-python setting"):
        QueryClient(broker.bootstrap, answers_topic=topics["answers"], colour="blue")


def test_an_unreachable_broker_is_a_clear_error():
    where = f"127.0.0.1:{free_port()}"
    with pytest.raises(DpstreamError, match=f"cannot reach a Kafka broker at {where}"):
        QueryClient(where, bootstrap_timeout_ms=500)


def test_librdkafka_settings_are_translated_for_kafka_python():
    assert kafka_python_settings({
        "bootstrap.servers": "b:9092", "security.protocol": "sasl_ssl",
        "sasl.mechanisms": "scram-sha-512", "sasl.username": "u", "sasl.password": "p",
        "ssl.ca.location": "/ca.pem", "ssl.endpoint.identification.algorithm": "none",
        "linger.ms": "5"}) == {
        "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "u", "sasl_plain_password": "p", "ssl_cafile": "/ca.pem",
        "ssl_check_hostname": False}


def test_describe_answer_lines():
    base = {"id": "q1", "t": 1204312, "reason": None,
            "privacy": {"accounting": "pure", "spent": 0.41, "budget": 1.0}}
    assert describe_answer({**base, "kind": "hard", "value": 0.214312}) == \
        "q1: 0.2143 (hard, t = 1204312, spent 0.41 of 1 epsilon)"
    assert describe_answer({**base, "kind": "bottom", "value": None,
                            "reason": "privacy budget exhausted"}) == \
        "q1: \u22a5 privacy budget exhausted"
    assert describe_answer({**base, "kind": "marginal", "value": [0.5, None],
                            "kinds": ["easy", "bottom"],
                            "reason": "privacy budget exhausted"}) == \
        ("q1: [0.5000, \u22a5] (marginal: easy, bottom; t = 1204312, spent 0.41 of 1 epsilon)"
         "; privacy budget exhausted")
    zcdp = {**base, "kind": "easy", "value": 0.5,
            "privacy": {"accounting": "zcdp", "spent": 0.01, "budget": 0.02,
                        "approx_dp": {"epsilon": 0.7, "delta": 1e-6}}}
    assert describe_answer(zcdp) == ("q1: 0.5000 (easy, t = 1204312, spent 0.01 of 0.02 rho "
                                     "(epsilon 0.7 at delta 1e-06))")


# --- kill -9 and resume on a bounded input ------------------------------------------------

ORIGIN = 1_790_000_000
STEPS = 24
KILL_AFTER = 12  # the first run is killed once steps < 12 are in and step 10 is answered


def bounded_input(seed: int = 3) -> tuple[dict[int, list], list[tuple[int, str, str, dict]]]:
    """Events per partition (steps 1..STEPS-1) and questions (steps 0..STEPS-1), stamped."""
    rng = random.Random(seed)
    events: dict[int, list] = defaultdict(list)
    for step in range(1, STEPS):
        for partition in (0, 1):
            times = sorted(ORIGIN + step + rng.random() * 0.999 for _ in range(150))
            events[partition] += [(step, (None, json.dumps({**random_event(rng), "ts": ts})
                                          .encode(), int(ts * 1000))) for ts in times]
    menu = [{"kind": "count", "where": [{"attr": "country", "eq": "de"}]},
            {"kind": "marginal", "attrs": ["device"]},
            {"kind": "count", "where": [{"attr": "age", "range": [30, 120]}]},
            {"kind": "weights", "sparse": {"0": 1.0, "7": 0.5}},
            {"kind": "marginal", "attrs": ["country", "device"],
             "where": [{"attr": "age", "range": [0, 60]}]},
            {"kind": "count", "where": [{"attr": "device", "eq": "web"}]}]
    queries = []
    for step in range(STEPS):
        queries.append((step, f"s{step:02d}-a", HISTOGRAM, menu[step % len(menu)]))
        if step % 5 == 2:
            queries.append((step, f"s{step:02d}-b", HISTOGRAM, menu[(step + 3) % len(menu)]))
    queries.append((7, "bad-1", HISTOGRAM, {"kind": "count", "where": [{"attr": "colour"}]}))
    queries.append((9, "lost-1", "nope", {"kind": "count"}))  # a dead letter
    queries.sort(key=lambda q: q[0])
    return events, queries


def produce_steps(bootstrap: str, topics: dict[str, str], events: dict[int, list],
                  queries: list, steps: range) -> None:
    for partition, stamped in events.items():
        produce(bootstrap, topics["events"],
                [m for step, m in stamped if step in steps], partition=partition)
    produce(bootstrap, topics["queries"], [
        (histogram.encode(), json.dumps({"id": qid, "histogram": histogram,
                                         "query": {"schema": "dpstream.query/1", **query}})
         .encode(), (ORIGIN + step) * 1000 + 500)
        for step, qid, histogram, query in queries if step in steps], partition=0)
    # a tick at the last step's start on every partition: it closes the steps before it, as
    # the events' own times did before only ticks moved the producer clock
    tick = [(b"dpstream.tick", b'{"dpstream.tick":1}', (ORIGIN + steps[-1]) * 1000)]
    for topic, partitions in ((topics["events"], (0, 1)), (topics["queries"], (0,))):
        for partition in partitions:
            produce(bootstrap, topic, tick, partition=partition)


def answers_by_id(records) -> dict[str, set[bytes]]:
    grouped: dict[str, set[bytes]] = defaultdict(set)
    for record in records:
        body = json.loads(record.value)
        assert body["schema"] == ANSWER_SCHEMA, body
        grouped[body["id"]].add(record.value)
    return grouped


@pytest.mark.slow
def test_kill_minus_nine_and_resume_gives_the_answers_of_an_uninterrupted_run(broker,
                                                                              tmp_path):
    started = time.monotonic()
    bootstrap = broker.bootstrap
    topics = make_topics(bootstrap, "pmwg-kill")
    events, queries = bounded_input()
    answered = {qid for _, qid, histogram, _ in queries if histogram == HISTOGRAM}
    step_of = {qid: step for step, qid, _, _ in queries}
    produce_steps(bootstrap, topics, events, queries, range(3))

    def count_answers() -> int:
        return len(read_all(bootstrap, topics["answers"], timeout=5, idle=0.1))

    # B, first run: tails while the input arrives step by step; killed right after a step's
    # answer appears, which is most likely before the epoch that wrote it is snapshotted
    recovery_b = tmp_path / "recovery-b"
    args_b = ("--recovery-dir", str(recovery_b), "--snapshot-interval", "1")
    tailing = write_config(tmp_path / "b-tail.toml", bootstrap, topics, origin=ORIGIN,
                           name="kill", tail=True, batch_size=20)
    proc = start_flow(tailing, *args_b)
    seen, produced = 0, 3
    while produced <= KILL_AFTER:
        deadline = time.monotonic() + 60
        while (now := count_answers()) == seen:
            assert time.monotonic() < deadline, f"no new answer after step {produced - 1}"
            assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")[-3000:]
            time.sleep(0.05)
        seen = now
        if produced == KILL_AFTER:
            break
        produce_steps(bootstrap, topics, events, queries, range(produced, produced + 1))
        produced += 1
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert 0 < seen < len(answered)
    manifest = (recovery_b / "dpstream-instance.json").read_bytes()

    # the rest of the input arrives; B resumes from its recovery store and reads to the end
    produce_steps(bootstrap, topics, events, queries, range(produced, STEPS))
    bounded = write_config(tmp_path / "b-end.toml", bootstrap, topics, origin=ORIGIN,
                           name="kill", tail=False, batch_size=20, end=ORIGIN + STEPS)
    out = finish(start_flow(bounded, *args_b))
    assert "resumed" in out
    assert (recovery_b / "dpstream-instance.json").read_bytes() == manifest
    records_b = read_all(bootstrap, topics["answers"], timeout=30, idle=2)
    grouped_b = answers_by_id(records_b)
    conflicting = {qid: values for qid, values in grouped_b.items() if len(values) != 1}
    assert not conflicting  # replayed answers are byte-identical copies: nothing re-noised
    assert set(grouped_b) == answered  # every question answered, nothing lost
    kinds = {}
    for qid, (value,) in grouped_b.items():
        body = json.loads(value)
        check_structure(body, flow="kill", origin=ORIGIN, qid=qid)
        assert body["step"] == step_of[qid]
        kinds[qid] = body["kind"]
    assert kinds["bad-1"] == "error"
    assert any(k in ("easy", "hard", "marginal") for k in kinds.values()), kinds

    # A: the same flow instance (B's manifest, not its state), uninterrupted, into new topics
    topics_a = dict(topics, answers=f"pmwg-kill-answers-a-{uuid.uuid4().hex[:8]}",
                    dead=f"pmwg-kill-dead-a-{uuid.uuid4().hex[:8]}")
    ensure_topics(bootstrap, {topics_a["answers"]: 1, topics_a["dead"]: 1})
    recovery_a = tmp_path / "recovery-a"
    recovery_a.mkdir(mode=0o700)
    (recovery_a / "dpstream-instance.json").write_bytes(manifest)
    (recovery_a / "dpstream-instance.json").chmod(0o600)
    config_a = write_config(tmp_path / "a.toml", bootstrap, topics_a, origin=ORIGIN,
                            name="kill", tail=False, batch_size=20, end=ORIGIN + STEPS)
    finish(start_flow(config_a, "--recovery-dir", str(recovery_a)))
    records_a = read_all(bootstrap, topics_a["answers"], expect=len(answered), timeout=30)
    grouped_a = answers_by_id(records_a)
    assert len(records_a) == len(answered) == len(grouped_a)
    assert grouped_a == grouped_b  # value for value, byte for byte

    # the dead letters agree too (the unknown histogram), replays de-duplicated
    def letters(topic: str) -> set[bytes]:
        return {r.value for r in read_all(bootstrap, topic, timeout=10, idle=1)}

    dead_b, dead_a = letters(topics["dead"]), letters(topics_a["dead"])
    assert dead_a == dead_b and len(dead_a) == 1
    assert json.loads(dead_a.pop())["reason"].startswith("field 'histogram' must name")
    duplicates = len(records_b) - len(grouped_b)
    print(f"kill -9 after {seen} of {len(answered)} answers; {duplicates} replayed "
          f"duplicate(s), all identical; kinds {sorted(kinds.values())}; "
          f"{time.monotonic() - started:.1f} s")
