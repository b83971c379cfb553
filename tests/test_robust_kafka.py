"""Issue 22, item 1, through Kafka: the 1,000-level record and a quarantined record.

A bounded `dpstream run` against the embedded broker reads a partition holding the record of
the issue (which made the flow crash-loop) and a record the operator quarantines with
``--skip-record``: the flow exits 0 with both as dead letters (their reasons), publishes the
other records' releases, and records the skip in the instance manifest.
"""

from __future__ import annotations

import json

import pytest
from test_operations import assert_clean, event, make_topics, now_origin, start, write_config

from dpstream.instance import MANIFEST_NAME
from dpstream.io.topics import produce, read_all

pytestmark = [pytest.mark.integration]

NESTED = b'{"key":"k","ts":1,"x":' + b"[" * 1000 + b"]" * 1000 + b"}"


def test_the_nested_record_is_a_dead_letter_and_a_quarantined_one_is_skipped(
        broker, topic_factory, tmp_path):
    topics = make_topics(topic_factory, partitions=1)
    origin = now_origin()
    produce(broker.bootstrap, topics["events"], [
        event("a", origin + 0.5), (None, NESTED, (origin + 1) * 1000),
        event("b", origin + 1.5), event("c", origin + 2.2), event("a", origin + 2.5)])
    config = write_config(tmp_path / "c.toml", broker.bootstrap, topics, origin=origin,
                          tail=False, steps=3)
    store = tmp_path / "recovery"
    proc = start(config, "--recovery-dir", str(store), "--skip-record",
                 f"{topics['events']}:0:3")
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    assert_clean(out)
    assert "quarantined by the operator become dead letters" in out, out[-3000:]
    dead = [json.loads(r.value) for r in read_all(broker.bootstrap, topics["dead"], expect=2,
                                                    timeout=30)]
    assert sorted((d["source"]["offset"], d["reason"]) for d in dead) == [
        (1, "undecodable record (RecursionError)"), (3, "quarantined by the operator")]
    releases = [json.loads(r.value) for r in read_all(broker.bootstrap, topics["releases"],
                                                      timeout=30, idle=1)]
    assert {r["step"] for r in releases} == {0, 1, 2}
    recorded = json.loads((store / MANIFEST_NAME).read_text())["skipped_records"]
    assert [(r["topic"], r["partition"], r["offset"]) for r in recorded] == [
        (topics["events"], 0, 3)]
