"""The operator can skip a record that still crashes a flow (issue 22, item 1).

A record that crashes the flow on every replay (a bug: simulated here by a kind that raises on
one key after decoding) is named at the next start as TOPIC:PARTITION:OFFSET; it becomes a dead
letter "quarantined by the operator", deterministically (a replay skips it identically), the
skip is recorded in the instance manifest, append-only, and logged at start.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from bytewax.testing import TestingSink, TestingSource, run_main
from support.messages import message

from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import ConfigError
from dpstream.instance import MANIFEST_NAME, bind_instance
from dpstream.kinds.counters.events import PartitionClock
from dpstream.kinds.counters.kind import statistics_spec
from dpstream.messages import RawBatch
from dpstream.platform import build_flow, parse_config
from dpstream.stream.quarantine import QUARANTINED, Quarantine, SkippedRecord, parse_skipped

ORIGIN = 1_790_000_000
KEY = NoiseKey.for_tests(16)
NOISE_KEY = "9a0c2e4f6b8d1a3c5e7f9b0d2c4e6a8f1b3d5c7e9a0b2d4f6c8e0a1b3c5d7e9f"


def config():
    return parse_config({
        "flow": {"name": "q", "origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 2},
        "privacy": {"accounting": "pure", "budget": 1.0, "delta": 1e-6},
        "admission": {"mode": "declared", "keys": ["a", "b", "boom"]},
        "metrics": {"port": 0}})


def items():
    out, offsets = [], [0, 0]
    for step in range(5):
        for i in range(8):
            p = i % 2
            key = "boom" if (step, i) == (2, 3) else "ab"[i % 2]
            out.append(message(p, key, ORIGIN + step + 0.1 * i, offsets[p]))
            offsets[p] += 1
    return out


POISON = ("events", 1, 9)  # (step 2, i 3): partition 1, its tenth record


@pytest.fixture
def crashing_route(monkeypatch):
    """A bug after decoding: the counters' routing raises on the declared key "boom"."""
    route = PartitionClock.route

    def broken(self, payloads, steps):
        boom = int(self.rules.declared.positions(["boom"])[0])
        if boom in list(payloads):
            raise RuntimeError("a bug")
        return route(self, payloads, steps)

    monkeypatch.setattr(PartitionClock, "route", broken)


def run(skip=()):
    sink: list = []
    flow = build_flow(config(), KEY, instance="q-1", partitions=2,
                      source=TestingSource(items(), 5), sink=TestingSink(sink),
                      skip_records=skip)
    run_main(flow)
    return sink


def test_the_poison_record_is_where_we_think_it_is():
    [poison] = [m for m in items() if b"boom" in m[1]]
    assert (poison[3], poison[0], poison[2]) == POISON


@pytest.mark.flow
def test_a_record_that_crashes_the_flow_on_every_run_can_be_skipped(crashing_route, caplog):
    from bytewax.errors import BytewaxRuntimeError

    with pytest.raises(BytewaxRuntimeError) as crash:  # today's flow: dies on every run
        run()
    assert "a bug" in repr(crash.value.__cause__)
    assert re.search(r"events\[1\], offsets \d+ to 9\b", caplog.text)  # where to look
    assert "--skip-record events:1:OFFSET" in caplog.text
    out = run([POISON])
    dead = [json.loads(v) for role, _, v in out if role == "dead_letters"]
    assert [(d["reason"], d["source"]["partition"], d["source"]["offset"]) for d in dead] == [
        (QUARANTINED, 1, 9)]
    assert out == run([SkippedRecord(*POISON)])  # a replay skips it identically
    releases = [json.loads(v) for role, _, v in out if role == "releases"]
    assert {(r["key"], r["step"]) for r in releases} == {
        (k, s) for k in ("a", "b", "boom") for s in range(5)}


def test_quarantine_splits_only_the_named_records_of_the_named_topic_partition():
    batch = RawBatch.of([(3, b"x", o, "queries", 1000, 2) for o in range(5)])
    quarantine = Quarantine(frozenset({SkippedRecord("queries", 1, 2),
                                       SkippedRecord("queries", 0, 3),
                                       SkippedRecord("events", 1, 4)}),
                            {"events": 0, "queries": 2})
    kept, dead = quarantine.split(batch)  # flow partition 3 = queries partition 1
    assert kept.offsets == [0, 1, 3, 4]
    assert [(d.topic, d.partition, d.offset, d.reason) for d in dead] == [
        ("queries", 1, 2, QUARANTINED)]


def test_names_of_records_to_skip_are_parsed_or_refused():
    assert parse_skipped(["events:0:17", "b.t-x:3:0, events:0:17  q:1:2"]) == [
        SkippedRecord("b.t-x", 3, 0), SkippedRecord("events", 0, 17),
        SkippedRecord("q", 1, 2)]
    assert parse_skipped([""]) == []
    for bad in ("events:0", "events:-1:2", "events:0:x", "ev ents:0:1:2", "a/b:0:1"):
        with pytest.raises(ConfigError, match="TOPIC:PARTITION:OFFSET"):
            parse_skipped([bad])


def test_the_manifest_records_skips_append_only(tmp_path):
    cfg = config()
    spec, store = statistics_spec(cfg), tmp_path / "store"
    first = bind_instance(cfg, spec, KEY, store, skip_records=[SkippedRecord("events", 1, 9)])
    assert first.skipped == first.newly_skipped == (SkippedRecord("events", 1, 9),)
    again = bind_instance(cfg, spec, KEY, store)  # not named again: still skipped
    assert again.resumed and again.id == first.id
    assert again.skipped == (SkippedRecord("events", 1, 9),) and again.newly_skipped == ()
    more = bind_instance(cfg, spec, KEY, store, skip_records=[
        SkippedRecord("events", 0, 2), SkippedRecord("events", 1, 9)])
    assert more.skipped == (SkippedRecord("events", 0, 2), SkippedRecord("events", 1, 9))
    assert more.newly_skipped == (SkippedRecord("events", 0, 2),)
    recorded = json.loads((store / MANIFEST_NAME).read_text())["skipped_records"]
    assert [(r["topic"], r["partition"], r["offset"]) for r in recorded] == [
        ("events", 1, 9), ("events", 0, 2)]
    assert all(r["since"].endswith("Z") for r in recorded)
    assert oct((store / MANIFEST_NAME).stat().st_mode & 0o777) == "0o600"
    ephemeral = bind_instance(cfg, spec, KEY, None, ephemeral=True,
                              skip_records=[SkippedRecord("events", 0, 1)])
    assert ephemeral.skipped == (SkippedRecord("events", 0, 1),)


CONFIG = """\
[flow]
name = "q"
origin = "2026-09-21T14:13:20Z"
step = "1s"

[kafka]
brokers = ["127.0.0.1:9"]
input_topic = "events"
startup_timeout = "1s"

[admission]
mode = "declared"
keys = ["a"]

[privacy]
budget = 1.0

[metrics]
port = 0
"""
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith(("DPSTREAM_", "BYTEWAX_"))},
       "PYTHONUNBUFFERED": "1", "DPSTREAM_NOISE_KEY": NOISE_KEY, "RUST_BACKTRACE": "0",
       "DPSTREAM_PROGRESS_SECONDS": "0"}


def dpstream_run(tmp_path: Path, *args: str, env: dict[str, str] | None = None
                 ) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "flow.toml"
    path.write_text(CONFIG)
    return subprocess.run([sys.executable, "-m", "dpstream.cli", "run", "--config", str(path),
                           *args], env=env or ENV, capture_output=True, text=True, timeout=60)


@pytest.mark.flow
def test_dpstream_run_records_and_logs_the_skips_before_the_flow_starts(tmp_path):
    store = tmp_path / "store"
    out = dpstream_run(tmp_path, "--recovery-dir", str(store), "--skip-record", "events:0:5",
                       env={**ENV, "DPSTREAM_SKIP_RECORDS": "events:1:7"})
    text = out.stdout + out.stderr
    assert out.returncode == 2  # no broker here: the flow stops after start-up
    assert "2 record(s) quarantined by the operator" in text, text
    assert "events:0:5, events:1:7 (new now: events:0:5, events:1:7)" in text, text
    recorded = json.loads((store / MANIFEST_NAME).read_text())["skipped_records"]
    assert {(r["topic"], r["partition"], r["offset"]) for r in recorded} == {
        ("events", 0, 5), ("events", 1, 7)}
    again = dpstream_run(tmp_path, "--recovery-dir", str(store))
    assert "2 record(s) quarantined by the operator" in again.stderr + again.stdout
    assert "new now" not in again.stderr + again.stdout


@pytest.mark.flow
def test_a_skip_of_another_topic_or_of_a_malformed_name_is_refused_in_one_line(tmp_path):
    for bad, message_part in (("queries:0:1", "not an input topic of this flow (events)"),
                              ("events:1", "TOPIC:PARTITION:OFFSET")):
        out = dpstream_run(tmp_path, "--ephemeral", "--skip-record", bad)
        assert out.returncode == 2
        assert out.stderr.strip().count("\n") == 0 and message_part in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
