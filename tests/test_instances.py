"""Issue 22 item 7: every record names its flow instance, and consumers tell instances apart.

Two instances of one ``flow.name`` (a reprocessing, a second deployment) publish the same
coordinates with independent noise. Before the ``instance`` field, a consumer could not tell
them apart: the client classed most of the differing copies as "stale" and counted a handful
as conflicts, depending on the order of arrival.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest
from bytewax.testing import TestingSink, TestingSource, run_main
from support.messages import message, raw

from dpstream.client import LatestValues, Release, decode
from dpstream.core.counting import outputs as core
from dpstream.core.noise.keys import NoiseKey
from dpstream.kinds.counters.metrics import register_metrics as counters_series
from dpstream.kinds.counters.records import RecordEncoder
from dpstream.kinds.erm.records import ModelEncoder
from dpstream.kinds.erm.shard import ModelRecord
from dpstream.kinds.pmwg.records import AnswerEncoder
from dpstream.kinds.pmwg.shard import AnswerRecord
from dpstream.platform import build_flow, load_config, parse_config

ROOT = Path(__file__).parent.parent
ORIGIN = datetime(2026, 9, 21, 14, 13, 20, tzinfo=UTC)
A, B = "a" * 32, "b" * 32
KEYS = ("k1", "k2", "k3")
STEPS = 6


def config():
    return parse_config({"flow": {"name": "twice", "origin": "2026-09-21T14:13:20Z",
                                  "step": "1s", "shards": 2},
                         "admission": {"mode": "declared", "keys": list(KEYS)},
                         "metrics": {"port": 0}})


def run(instance: str) -> list[tuple[str, bytes | None, bytes]]:
    """A real Bytewax run of the counters flow as flow instance ``instance``."""
    origin = ORIGIN.timestamp()
    items = [message(0, k, origin + t + 0.5, i) for i, (t, k) in
             enumerate((t, k) for t in range(STEPS) for k in KEYS)]
    items.append(raw(0, b"{broken", len(items), origin + STEPS - 1))
    sink: list = []
    run_main(build_flow(config(), NoiseKey.for_tests(1), instance=instance, partitions=1,
                        source=TestingSource(items, 4), sink=TestingSink(sink)))
    return sink


@pytest.mark.flow
def test_every_record_of_a_flow_run_names_its_instance():
    records = run(A)
    roles = {role for role, _, _ in records}
    assert roles == {"releases", "dead_letters"}
    assert all(orjson.loads(value)["instance"] == A for _, _, value in records)
    assert all(decode(value).instance == A for _, _, value in records)


def test_every_record_type_of_every_kind_names_its_instance():
    encoder = RecordEncoder("f", ORIGIN, 1.0, instance=A)
    values = [
        encoder.encode(core.Release("k", 4, 1.5, 2.0, "tree-laplace", 0.9, 1.0, "epsilon",
                                    0.0))[2],
        encoder.encode(core.Alert("k", 3, 13, 0.1))[2],
        encoder.encode(core.BudgetExhausted("k", 7, "counter", "spent", 1.0, 1.0,
                                            "epsilon"))[2],
    ]
    pmwg = load_config(ROOT / "deploy" / "pmwg.example.toml")
    values.append(AnswerEncoder(pmwg, A).encode(AnswerRecord(
        pmwg.histograms[0].name, "pmwg", "q1", 5, 1000, "hard", 0.25, None, None, 0.3, 1.0,
        3))[2])
    erm = load_config(ROOT / "deploy" / "erm.example.toml")
    values.append(ModelEncoder(erm, A).encode(ModelRecord(
        next(iter(erm.streams)), erm.algorithm, 9, "exhausted", None, 9, 9, (), None, 0.0, 2.0,
        2.0, None, reason="budget spent"))[2])
    schemas = set()
    for value in values:
        body = orjson.loads(value)
        schemas.add(body["schema"])
        assert body["instance"] == A, body["schema"]
        assert decode(value).instance == A
    assert schemas == {"dpstream.release/1", "dpstream.alert/1", "dpstream.status/1",
                       "dpstream.answer/1", "dpstream.model/1"}


def release(step: int, value: float, instance: str | None = A) -> Release:
    body = {"schema": "dpstream.release/1", "flow": "f", "mechanism": "tree-laplace",
            "key": "k", "step": step,
            "window": {"start": "2026-09-21T14:13:20Z", "end": "2026-09-21T14:13:21Z"},
            "value": value, "std": 1.0,
            "privacy": {"unit": "event", "accounting": "epsilon", "spent": 1.0,
                        "budget": 1.0}}
    if instance is not None:
        body["instance"] = instance
    record = decode(orjson.dumps(body))
    assert isinstance(record, Release)
    return record


@pytest.mark.parametrize("instance", [A, None])
def test_a_coordinate_with_two_values_is_a_conflict_whatever_the_order(instance):
    latest = LatestValues()
    assert latest.add(release(5, 1.0, instance))
    assert latest.add(release(6, 2.0, instance))
    # the other value of step 5 arrives after step 6: a conflict, not a stale copy
    assert not latest.add(release(5, 9.0, instance))
    assert (latest.counts.conflicts, latest.counts.stale) == (1, 0)
    assert not latest.add(release(5, 1.0, instance))  # the first value again: a replay
    assert latest.counts.duplicates == 1
    # a first copy of an older step (it arrived late) is stale, and checked from then on
    assert not latest.add(release(4, 3.0, instance))
    assert latest.counts.stale == 1
    assert not latest.add(release(4, 3.5, instance))
    assert latest.counts.conflicts == 2
    assert latest.release("f", "k").value == 2.0


def test_values_whose_python_hashes_collide_are_a_conflict():
    assert hash(-1.0) == hash(-2.0)  # CPython: why the store compares digests, not hash()
    latest = LatestValues()
    assert latest.add(release(5, -1.0))
    assert not latest.add(release(5, -2.0))
    assert (latest.counts.conflicts, latest.counts.duplicates) == (1, 0)


def test_copies_older_than_the_history_are_counted_as_unchecked():
    latest = LatestValues(history=3)
    for step in range(10):
        assert latest.add(release(step, float(step)))
    assert not latest.add(release(6, 99.0))  # within the history: compared
    assert latest.counts.conflicts == 1
    assert not latest.add(release(2, 99.0))  # beyond it: neither compared nor kept
    assert latest.counts.unchecked == 1


@pytest.mark.flow
def test_two_instances_of_one_flow_name_are_two_series_not_conflicts():
    first, second = run(A), run(B)
    latest = LatestValues()
    # interleaved, the second instance's copies after and before the first's
    for one, two in zip(first, reversed(second), strict=True):
        latest.add(decode(one[2]))
        latest.add(decode(two[2]))
    assert latest.counts.conflicts == 0 and latest.counts.duplicates == 0
    assert latest.counts.stale == (STEPS - 1) * len(KEYS)  # the second's, in reverse order
    assert latest.instances() == {"twice": [A, B]}
    a, b = (latest.release("twice", "k1", instance) for instance in (A, B))
    assert a is not None and b is not None and a.step == b.step == STEPS - 1
    assert a.value != b.value  # independent noise: the same coordinate, two values
    assert latest.release("twice", "k1") in (a, b)
    assert len(latest.releases("twice")) == len(KEYS)


@pytest.mark.integration
def test_tail_filters_by_instance_and_shows_instances_and_conflicts(broker, topic_factory):
    from dpstream.io.topics import produce

    topic = topic_factory(partitions=2)
    first, second = run(A), run(B)
    releases = [(key, value) for role, key, value in first + second if role == "releases"]
    produce(broker.bootstrap, topic, releases)
    base = [sys.executable, "-m", "dpstream.cli", "tail", "--brokers", broker.bootstrap,
            "--topic", topic, "--from-beginning", "--json", "--timeout", "8"]
    both = subprocess.run(base, capture_output=True, timeout=60, text=True)
    assert both.returncode == 0, both.stderr
    assert len(both.stdout.splitlines()) == len(releases)
    assert "flow 'twice' has 2 instances (aaaaaaaa, bbbbbbbb)" in both.stderr
    assert "0 conflicts" in both.stderr
    rows = subprocess.run([arg for arg in base if arg != "--json"], capture_output=True,
                          timeout=60, text=True)  # the table, a row per record
    assert "k1@aaaaaaaa" in rows.stdout and "k1@bbbbbbbb" in rows.stdout, rows.stdout[-2000:]
    one = subprocess.run([*base, "--instance", B[:8]], capture_output=True, timeout=60,
                         text=True)
    assert one.returncode == 0, one.stderr
    shown = [orjson.loads(line) for line in one.stdout.splitlines()]
    assert len(shown) == len(releases) // 2 and {r["instance"] for r in shown} == {B}
    assert f"{len(releases) // 2} of other flow instances" in one.stderr
    assert "has 2 instances" not in one.stderr

    # one instance publishing a coordinate twice with different values: tail says so
    bad = orjson.loads(releases[-1][1])
    bad["value"] += 1.0
    produce(broker.bootstrap, topic, [(releases[-1][0], orjson.dumps(bad))])
    again = subprocess.run([*base, "--instance", B], capture_output=True, timeout=60,
                           text=True)
    assert "1 CONFLICTING copies" in again.stderr


@pytest.mark.integration
def test_budget_keeps_only_the_processes_of_one_instance(prometheus_factory):
    from prometheus_client import start_http_server

    from dpstream.client import budget_from_metrics, budget_from_prometheus
    from dpstream.core.counting.outputs import Release as CoreRelease
    from dpstream.io.broker import free_port
    from dpstream.metrics import FlowMetrics

    urls, servers = [], []
    for instance, spent in ((A, 0.25), (B, 0.75)):
        metrics = FlowMetrics("twice")
        metrics.set_instance(instance)
        metrics.set_budget("tree-laplace", "epsilon", 1.0)
        counters_series(metrics).observe_outputs([CoreRelease(
            "k", 0, 1.0, 1.0, "tree-laplace", spent, 1.0, "epsilon", 0.0)], "tree-laplace")
        port = free_port()
        servers.append(start_http_server(port, addr="127.0.0.1", registry=metrics.registry))
        urls.append(f"127.0.0.1:{port}")
    try:
        both = budget_from_metrics(urls)
        assert [row.spent for row in both] == [0.75]  # the largest spend of the two
        only_a = budget_from_metrics(urls, instance=A[:8])
        assert [row.spent for row in only_a] == [0.25]
        assert budget_from_metrics(urls, instance="c" * 8) == []
        prom = prometheus_factory(urls)
        prom.wait_for('dpstream_flow_instance_info', lambda r: len(r) == 2, timeout=60)
        prom.wait_for('dpstream_privacy_spent', lambda r: len(r) == 2, timeout=60)
        assert [row.spent for row in budget_from_prometheus(prom.url)] == [0.75]
        only_b = budget_from_prometheus(prom.url, instance=B)
        assert [row.spent for row in only_b] == [0.75]
        only_a = budget_from_prometheus(prom.url, instance=A[:8], flow="twice")
        assert [row.spent for row in only_a] == [0.25]
    finally:
        for server, thread in servers:
            server.shutdown()
            thread.join()
