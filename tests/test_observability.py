"""The monitoring material of deploy/ against real flows: one real Prometheus, configured by
the shipped ``deploy/prometheus/prometheus.yml`` (its targets and intervals swapped for the
test's) with the shipped recording and alerting rules, scrapes a running flow of each kind --
counters, pmwg and erm, each a ``dpstream run`` process tailing the real broker -- while a
producer thread feeds them events stamped now (with a malformed record each, so dead letters
exist) and asks the PMWG flow questions until its budget turns the answers bottom.

What is checked, precisely:

* **Dashboard**: every target of every panel of ``deploy/grafana/dashboards/dpstream.json``,
  with ``$flow`` replaced by the variable's "All" value and ``$__rate_interval`` by
  ``RATE_INTERVAL``, evaluated as an instant query, returns at least one series without error.
* **Recording rules**: every recorded series exists, including the burn rate and the projected
  exhaustion (the PMWG and ERM flows burn budget).
* **Alerting rules**, as loaded by Prometheus (``/api/v1/rules``): a quiet alert's expression
  returns nothing, so "returns data" cannot be the test. Instead (1) the whole expression
  evaluates without error, and (2) every vector selector in it -- a metric name with its label
  matchers, without range or offset -- selects at least one series: no alert watches a series
  the flows do not export, or a label value they never use.
* **End to end**: ``DpstreamBudgetExhausted`` fires for the PMWG flow whose answers turned
  bottom, and ``DpstreamRefusedCharges`` (a counters alert) does not, although those bottoms
  are counted as refusals.
* **No user data in labels**: no label value holds a key or a question id.

The three flows run at once against one Prometheus scraping every second; the whole module
takes about half a minute.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support import cli_flows
from support.cli_flows import finish, iso
from support.prometheus import PrometheusServer

from dpstream.io.broker import free_port
from dpstream.io.topics import ensure_topics

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).parent.parent
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "dpstream.json"
RATE_INTERVAL = "20s"
"""What ``$__rate_interval`` stands for: Grafana's max(4 x scrape interval, query step +
scrape interval) for a 6-hour view, at the test's 1-second scrapes."""
READY_TIMEOUT = 90.0
"""Seconds the flows get until every query has data (normally about 20)."""
ENV = dict(os.environ, PYTHONUNBUFFERED="1",
           DPSTREAM_NOISE_KEY="8d0c5b7e3f1a29c4d6e8a0b2c4d6e8f0a1b3c5d7e9f1a2b4c6d8e0f1a3b5c7d9")
KEYS = [f"user-{i:02d}" for i in range(10)]
QUESTION_PREFIX = "obsq-"
STREAM_FIELD_VALUES = ("alpha", "beta")
TICK_SECONDS = 0.25

COMMON = """
[flow]
kind = "{kind}"
name = "{name}"
step = "1s"
origin = "{origin}"
lateness = "1s"     # a record stamped just before a tick may reach its partition just after
clock = "producer"  # the embedded broker ignores LogAppendTime; these producers are trusted
heartbeat = "off"   # the producer thread writes events and ticks to every partition itself
shards = 2
[kafka]
brokers = ["{bootstrap}"]
input_topic = "{events}"
dead_letter_topic = "{dead}"
tail = true
batch_size = 200
startup_timeout = "10s"
"""
METRICS = """
[metrics]
port = {port}
exact_counts = true  # the dashboard's input panels show them (off by default)
"""
COUNTERS = """
releases_topic = "{releases}"
alerts_topic = "{alerts}"
[privacy]
accounting = "pure"
budget = 1.0
[counter]
epsilon = 0.9
horizon = 4096
[admission]
mode = "declared"
keys = {keys}
"""
PMWG = """
queries_topic = "{queries}"
answers_topic = "{answers}"
[privacy]
accounting = "pure"
budget = 4.0
[[histograms]]
name = "sessions"
mechanism = "pmwg"
mode = "practical"
hard_queries = 3
epsilon = 0.9
size_epsilon = 2.0
size_horizon = 1024
alpha = 0.1
n = 200
universe = [
  {{ name = "country", values = ["de", "fr", "uk"] }},
  {{ name = "age", edges = [0, 18, 40, 120] }},
]
[[histograms]]
name = "countries"
mechanism = "histogram"
epsilon = 0.09
size_epsilon = 0.5
size_horizon = 1024
n = 400
universe = [{{ name = "country", values = ["de", "fr", "uk"] }}]
"""
ERM = """
models_topic = "{models}"
[events]
time_field = "ts"
[privacy]
accounting = "pure"
epsilon = 1.0
[model]
classes = ["no", "yes"]
dimension = 4
clip_norm = 3.0
regularization = 0.05
streams = {streams}
stream_field = "s"
[release]
algorithm = "continual"
block_size = 100
base_blocks = 2
"""
QUESTIONS = [  # one a step, in turn, to "sessions" (hard while PMWG is far off, each a paid
    {"kind": "count", "where": [{"attr": "country", "eq": "de"}]},  # round); "countries"
    {"kind": "count", "where": [{"attr": "country", "eq": "fr"},     # gets a free marginal
                                {"attr": "age", "range": [18, 120]}]},
    {"kind": "count", "where": [{"attr": "age", "range": [0, 18]}]},
    {"kind": "count", "where": [{"attr": "country", "eq": "uk"}]},
]
MARGINAL = {"kind": "marginal", "attrs": ["country"]}


# -- the flows ---------------------------------------------------------------------------------


@dataclass
class Flow:
    """One running ``dpstream run`` process, its topics and its metrics port."""

    kind: str
    name: str
    topics: dict[str, str]
    port: int
    proc: subprocess.Popen | None = None


def make_flow(kind: str, bootstrap: str, workdir: Path, origin: int) -> Flow:
    """Create the flow's topics, write its configuration and start it."""
    tag = uuid.uuid4().hex[:8]
    roles = {"counters": ("events", "releases", "alerts", "dead"),
             "pmwg": ("events", "queries", "answers", "dead"),
             "erm": ("events", "models", "dead")}[kind]
    topics = {role: f"obs-{kind}-{role}-{tag}" for role in roles}
    ensure_topics(bootstrap, {name: 2 if role == "events" else 1
                              for role, name in topics.items()})
    flow = Flow(kind, f"obs-{kind}", topics, free_port())
    text = COMMON.format(kind=kind, name=flow.name, origin=iso(origin), bootstrap=bootstrap,
                         **topics)
    text += {"counters": COUNTERS, "pmwg": PMWG, "erm": ERM}[kind].format(
        keys=json.dumps(KEYS), streams=json.dumps(list(STREAM_FIELD_VALUES)), **topics)
    text += METRICS.format(port=flow.port)
    config = workdir / f"{kind}.toml"
    config.write_text(text)
    flow.proc = cli_flows.start_flow(config, ENV)
    return flow


@dataclass
class Feeder:
    """Writes events stamped now, then a heartbeat tick, to every input partition of every
    flow, every tick, and a few questions a step to the PMWG flow; one malformed record per
    flow at the start, and one undecodable record (nested too deep) to the counters flow."""

    bootstrap: str
    flows: dict[str, Flow]
    stop: threading.Event = field(default_factory=threading.Event)
    failure: list[BaseException] = field(default_factory=list)
    questions: int = 0

    def run(self) -> None:
        from kafka import KafkaProducer

        rng = random.Random(11)
        producer = KafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=5, acks="all")
        try:
            self._malformed(producer)
            tick = 0
            while not self.stop.is_set():
                ms = int(time.time() * 1000)
                for kind, flow in self.flows.items():
                    for partition in (0, 1):
                        for body in self._events(kind, rng, ms / 1000):
                            producer.send(flow.topics["events"], body, partition=partition,
                                          timestamp_ms=ms)
                        # under the producer clock only ticks close steps
                        producer.send(flow.topics["events"], b'{"dpstream.tick":1}',
                                      partition=partition, timestamp_ms=ms)
                self._queries(producer, ms, ask=tick % 4 == 0)
                producer.flush(10)
                tick += 1
                self.stop.wait(TICK_SECONDS)
        except BaseException as exc:  # surfaced by the fixture
            self.failure.append(exc)
        finally:
            producer.close(5)

    def _malformed(self, producer: Any) -> None:
        ms = int(time.time() * 1000)
        for flow in self.flows.values():
            producer.send(flow.topics["events"], b'{"broken', partition=0, timestamp_ms=ms)
        # an undecodable record (msgspec's RecursionError): DpstreamUndecodableRecords' series
        nested = b'{"key":"k","ts":%.3f,"x":%s}' % (ms / 1000, b"[" * 1000 + b"]" * 1000)
        producer.send(self.flows["counters"].topics["events"], nested, partition=1,
                      timestamp_ms=ms)

    @staticmethod
    def _events(kind: str, rng: random.Random, ts: float) -> list[bytes]:
        if kind == "counters":
            return [json.dumps({"key": rng.choice(KEYS), "ts": ts}).encode() for _ in range(10)]
        if kind == "pmwg":  # skewed to "de": the uniform start of PMWG is far off, hard
            return [json.dumps({"country": rng.choices(["de", "fr", "uk"], [6, 3, 1])[0],
                                "age": rng.uniform(0, 100), "ts": ts}).encode()
                    for _ in range(40)]
        rows = []
        for _ in range(30):
            x = [rng.gauss(0, 1) for _ in range(4)]
            label = "yes" if 2 * x[0] - 1.5 * x[1] + x[2] + rng.gauss(0, 0.5) > 0 else "no"
            rows.append(json.dumps({"features": x, "label": label,
                                    "s": rng.choice(STREAM_FIELD_VALUES), "ts": ts}).encode())
        return rows

    def _queries(self, producer: Any, ms: int, ask: bool) -> None:
        topic = self.flows["pmwg"].topics["queries"]
        if ask:
            asked = ((QUESTIONS[self.questions // 2 % len(QUESTIONS)], "sessions"),
                     (MARGINAL, "countries"))
            for query, histogram in asked:
                self.questions += 1
                body = {"id": f"{QUESTION_PREFIX}{self.questions}", "histogram": histogram,
                        "query": {"schema": "dpstream.query/1", **query}}
                producer.send(topic, json.dumps(body).encode(), partition=0, timestamp_ms=ms)
        producer.send(topic, b'{"dpstream.tick":1}', partition=0, timestamp_ms=ms)


# -- what is evaluated -------------------------------------------------------------------------


def panel_queries() -> list[tuple[str, str]]:
    """``[(panel title and refId, expr)]`` of every dashboard target, variables substituted."""
    board = json.loads(DASHBOARD.read_text())
    [variable] = [v for v in board["templating"]["list"] if v["name"] == "flow"]
    out = []
    for panel in board["panels"]:
        for inner in panel.get("panels", []) if panel["type"] == "row" else [panel]:
            for target in inner["targets"]:
                expr = (target["expr"].replace("$flow", variable["allValue"])
                        .replace("$__rate_interval", RATE_INTERVAL))
                out.append((f"{inner['title']} [{target['refId']}]", expr))
    return out


SELECTOR = re.compile(r"(?<![\w:])((?:[a-z_]+:)*(?:dpstream_\w+|up)(?::\w+)*)(\{[^}]*\})?")
"""A vector selector: a metric (or recorded series) name and its optional label matchers."""


def selectors(expr: str) -> set[str]:
    """The vector selectors of ``expr`` (names the rules and dashboards use; see SELECTOR)."""
    return {name + (matchers or "") for name, matchers in SELECTOR.findall(expr)}


def loaded_rules(prom: PrometheusServer, kind: str) -> list[dict[str, Any]]:
    """The rules of ``kind`` (record, alert) as Prometheus loaded and last evaluated them."""
    groups = prom.api("rules", type=kind)["groups"]
    return [rule for group in groups for rule in group["rules"]]


def shipped_names(kind: str) -> set[str]:
    """The rule names in deploy/prometheus/ (``record`` or ``alert``)."""
    file = {"record": "dpstream-recording.yml", "alert": "dpstream-alerts.yml"}[kind]
    return set(re.findall(rf"- {kind}: (\S+)", (PROMETHEUS_DIR / file).read_text()))


def recorded_names(prom: PrometheusServer) -> list[str]:
    return [rule["name"] for rule in loaded_rules(prom, "record")]


def alerting_rules(prom: PrometheusServer) -> dict[str, str]:
    """``{alert name: expression}`` as Prometheus loaded them."""
    return {rule["name"]: rule["query"] for rule in loaded_rules(prom, "alert")}


def empty(prom: PrometheusServer, exprs: list[str]) -> list[str]:
    """The expressions that return nothing or fail."""
    out = []
    for expr in exprs:
        try:
            if not prom.query(expr):
                out.append(expr)
        except RuntimeError as exc:
            out.append(f"{expr}: {exc}")
    return out


SCENARIO = ['dpstream_budget_exhausted{flow="obs-pmwg",mechanism="pmwg"} == 1',
            'ALERTS{alertname="DpstreamBudgetExhausted",alertstate="firing"}',
            'flow_mechanism_unit:dpstream_privacy_exhaustion_seconds:deriv1h'
            '{flow="obs-pmwg",mechanism="pmwg"} == 0']
"""What the feeder drives the flows to: the PMWG histogram exhausted, and paged.

The recorded projection is waited for too: a rule evaluation after the exhaustion was scraped
must have run (the raw gauge can show the exhaustion one evaluation before the rule does)."""


def everything(prom: PrometheusServer) -> list[str]:
    """Every query that must return data: the panels', the recorded series, each selector of
    every alert, and the scenario's end state."""
    exprs = [*SCENARIO, *(expr for _title, expr in panel_queries())]
    exprs += recorded_names(prom)
    for expr in alerting_rules(prom).values():
        exprs += sorted(selectors(expr))
    return exprs


# -- the stack ---------------------------------------------------------------------------------


@dataclass
class Stack:
    prom: PrometheusServer
    flows: dict[str, Flow]
    feeder: Feeder


def start_prometheus(workdir: Path, targets: list[str]) -> PrometheusServer:
    """Prometheus with the shipped config and rules, scraping ``targets`` every second."""
    server = PrometheusServer(targets, scrape_interval="1s", workdir=workdir)
    text = (PROMETHEUS_DIR / "prometheus.yml").read_text()
    shipped = {'targets: ["127.0.0.1:9464"]': f"targets: {json.dumps(targets)}",
               "scrape_interval: 15s": "scrape_interval: 1s",
               "evaluation_interval: 15s": "evaluation_interval: 1s"}
    for old, new in shipped.items():
        assert old in text, f"deploy/prometheus/prometheus.yml no longer holds {old!r}"
        text = text.replace(old, new)
    server.config_text = text
    for rules in ("dpstream-recording.yml", "dpstream-alerts.yml"):
        shutil.copy(PROMETHEUS_DIR / rules, workdir / rules)
    return server.start()


def wait_for_data(stack: Stack) -> None:
    """Until every query has data, or READY_TIMEOUT passed (the tests then say which not)."""
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        check_running(stack)
        if not empty(stack.prom, everything(stack.prom)):
            return
        time.sleep(1.0)


def check_running(stack: Stack) -> None:
    assert not stack.feeder.failure, f"the producer thread failed: {stack.feeder.failure[0]!r}"
    for flow in stack.flows.values():
        assert flow.proc is not None
        if flow.proc.poll() is not None:
            out = flow.proc.stdout.read().decode(errors="replace") if flow.proc.stdout else ""
            pytest.fail(f"the {flow.kind} flow exited ({flow.proc.returncode}):\n{out[-3000:]}")


@pytest.fixture(scope="module")
def stack(broker, tmp_path_factory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("observability")
    origin = int(time.time()) - 2
    flows = {kind: make_flow(kind, broker.bootstrap, workdir, origin)
             for kind in ("counters", "pmwg", "erm")}
    feeder = Feeder(broker.bootstrap, flows)
    feeding = threading.Thread(target=feeder.run, name="observability-feed", daemon=True)
    feeding.start()
    prom = None
    try:
        prom_dir = workdir / "prometheus"
        prom_dir.mkdir()
        prom = start_prometheus(prom_dir, [f"127.0.0.1:{f.port}" for f in flows.values()])
        built = Stack(prom, flows, feeder)
        wait_for_data(built)
        yield built
    finally:
        feeder.stop.set()
        feeding.join(20)
        if prom is not None:
            prom.stop()
        running = [f.proc for f in flows.values() if f.proc is not None and f.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        for proc in running:  # a flow that exited early failed the test already
            assert "stopped" in finish(proc, timeout=30)


# -- the tests ---------------------------------------------------------------------------------


def test_prometheus_scrapes_every_flow(stack):
    health = stack.prom.targets_health()
    assert len(health) == 3 and all(h == "up" for _url, h, _err in health), health
    kinds = {labels["kind"] for labels, _ in stack.prom.query("dpstream_flow_info")}
    assert kinds == {"counters", "pmwg", "erm"}


def test_every_panel_query_returns_data(stack):
    queries = panel_queries()
    assert len(queries) >= 25
    missing = [(title, expr) for title, expr in queries if empty(stack.prom, [expr])]
    assert not missing, "panels without data:\n" + "\n".join(f"{t}: {e}" for t, e in missing)


def test_every_recorded_series_exists_and_the_budget_burns(stack):
    names = recorded_names(stack.prom)
    assert set(names) == shipped_names("record")
    assert not empty(stack.prom, names)
    for rule in loaded_rules(stack.prom, "record"):
        assert rule["health"] == "ok", rule
    burn = {labels["mechanism"]: value for labels, value in stack.prom.query(
        'flow_mechanism_unit:dpstream_privacy_spent:deriv1h{flow="obs-pmwg"}')}
    assert burn["pmwg"] > 0  # hard-query rounds paid as the questions came
    projected = {labels["mechanism"]: value for labels, value in stack.prom.query(
        'flow_mechanism_unit:dpstream_privacy_exhaustion_seconds:deriv1h{flow="obs-pmwg"}')}
    assert projected["pmwg"] == 0  # exhausted: its answers are bottom by now
    counters = stack.prom.query(
        'flow_mechanism_unit:dpstream_privacy_spent:deriv1h{flow="obs-counters"}')
    assert counters and all(value == 0 for _labels, value in counters)  # committed up front


def test_every_alert_expression_runs_and_watches_existing_series(stack):
    rules = alerting_rules(stack.prom)
    assert set(rules) == shipped_names("alert")
    for rule in loaded_rules(stack.prom, "alert"):
        assert rule["health"] == "ok", rule  # Prometheus' own evaluations went through
    for name, expr in rules.items():
        stack.prom.query(expr)  # raises on an error; an empty result is a quiet alert
        watched = selectors(expr)
        assert watched, f"{name}: no selector found in {expr}"
        missing = empty(stack.prom, sorted(watched))
        assert not missing, f"{name} watches series that do not exist: {missing}"


def test_pmwg_exhaustion_pages_and_is_not_a_refused_counter_charge(stack):
    bottoms = stack.prom.query('sum(dpstream_bottom_answers_total{flow="obs-pmwg"})')
    assert bottoms and bottoms[0][1] > 0, "the PMWG flow never answered bottom"
    firing = stack.prom.wait_for(
        'ALERTS{alertname="DpstreamBudgetExhausted",alertstate="firing"}', timeout=30)
    assert {(labels["flow"], labels["mechanism"]) for labels, _ in firing} == {
        ("obs-pmwg", "pmwg")}
    refused = stack.prom.query('sum(dpstream_refused_releases_total{flow="obs-pmwg"})')
    assert refused and refused[0][1] > 0
    assert not stack.prom.query('ALERTS{alertname="DpstreamRefusedCharges"}')


def test_no_label_carries_user_data(stack):
    questions = [f"{QUESTION_PREFIX}{i}" for i in range(1, stack.feeder.questions + 1)]
    forbidden = [*KEYS, *questions]  # model stream names are configured, public labels
    for labels, _ in stack.prom.query('{__name__=~"dpstream_.*"}'):
        for value in labels.values():
            assert not any(word in value for word in forbidden), labels
