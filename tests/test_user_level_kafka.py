"""User-level privacy (``[contribution] unit = "user"``) through the real parts: the embedded
Kafka-protocol broker, ``dpstream run``, a two-process Bytewax cluster, kill -9 and a real
Prometheus.

A user-level counters flow (caps ``max_keys = 3``, ``max_per_key = 2``) reads people whose
events spread over many keys, steps and input partitions, most of them beyond the caps:

* one process (``dpstream run``, the reference) and a two-process cluster on the same input and
  flow instance publish the same records, byte for byte; records without the user field are
  dead letters with the reason; every release carries ``privacy.unit = "user"`` and the
  ``privacy.person`` block the client decodes (the configuration's per-person totals); no raw
  person id appears in any output record but the dead letters' originals, nor in the logs;
* a run killed with SIGKILL mid-stream and resumed from its recovery store publishes exactly
  the reference's release records (a replayed copy is byte-identical); while it tails, a real
  Prometheus scrapes ``dpstream_bounding_events_total`` (exact operator data), whose kept and
  dropped counts equal those of the bounding rule computed here in plain Python, and no series
  names a person;
* a user-level ERM flow publishes the same models through one worker and two, with the
  person block, its own missing-user dead letter, and no person in its outputs.

The embedded broker ignores LogAppendTime: the flows use the producer clock and the test
writes a tick at each step's start on every input partition (a step closes when the next
step's tick is read), as tests/test_multiprocess.py does.
"""

from __future__ import annotations

import base64
import json
import random
import re
import secrets
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from support.configs import counters, erm, write
from test_multiprocess import (
    ENV,
    INPUT_PARTITIONS,
    KINDS,
    ORIGIN,
    SHARDS,
    Process,
    Stamped,
    cleanup,  # noqa: F401  (the fixture)
    committed_epoch,
    ended,
    finish,
    produce_steps,
    recovery_stores,
    stamp,
    start_cluster,
)

from dpstream.client import DeadLetter, Model, Release, Serving, decode
from dpstream.io.broker import free_port
from dpstream.io.topics import Record, ensure_topics, read_all
from dpstream.platform import parse_config
from dpstream.stream.clock import bad_person

pytestmark = [pytest.mark.integration]

KEYS = [f"k{i:02d}" for i in range(12)]
PEOPLE = [f"person-{i:03d}" for i in range(30)]
STEPS = 16
HALF = 8
"""The kill test's tailing run reads steps 0..HALF-1; steps 0..HALF-2 close (the tick of step
HALF is not written before the kill)."""
MAX_KEYS, MAX_PER_KEY = 3, 2
CONTRIBUTION = {"unit": "user", "user_field": "user", "max_keys": MAX_KEYS,
                "max_per_key": MAX_PER_KEY}
UNBOUNDED = [b'{"key":"k00","ts":%d.5}', b'{"key":"k01","user":"","ts":%d.5}',
             b'{"key":"k02","user":7,"ts":%d.5}']
"""Records of step 2 on partition 1 without a usable person (a dead letter each)."""
RUN_TIMEOUT = 150.0


def counters_tables(name: str, bootstrap: str, topics: dict[str, str], *, tail: bool,
                    metrics_port: int = 0) -> dict[str, Any]:
    return counters(bootstrap, topics, name=name, origin=ORIGIN, steps=STEPS, keys=KEYS,
                    flow={"shards": SHARDS, "heartbeat": "off", "lateness": "0s"},
                    kafka={"batch_size": 50, "startup_timeout": "20s", "tail": tail},
                    privacy={"accounting": "pure", "budget": 1.0},
                    counter={"epsilon": 0.9, "horizon": 64},
                    contribution=CONTRIBUTION,
                    metrics={"port": metrics_port, "exact_counts": True})


def people_events() -> dict[int, list[Stamped]]:
    """Each active person: 1-6 keys a step, 1-4 events a key, on random partitions.

    Heavy people (every fifth) touch up to 6 keys with up to 4 events each: far beyond the caps
    (3 keys, 2 events a key), so the bounding drops many events. The events of one step are
    in time order on each partition.
    """
    rng = random.Random(24)
    per_step: dict[int, list[tuple[int, float, bytes]]] = defaultdict(list)
    for step in range(STEPS):
        for p, person in enumerate(PEOPLE):
            if rng.random() < 0.3:
                continue
            heavy = p % 5 == 0
            for key in rng.sample(KEYS, rng.randint(1, 6 if heavy else 2)):
                for _ in range(rng.randint(1, 4 if heavy else 2)):
                    ts = ORIGIN + step + rng.random() * 0.998
                    body = json.dumps({"key": key, "user": person, "ts": ts}).encode()
                    per_step[step].append((rng.randrange(INPUT_PARTITIONS), ts, body))
    events: dict[int, list[Stamped]] = defaultdict(list)
    for step in range(STEPS):
        for partition, ts, body in sorted(per_step[step], key=lambda e: (e[0], e[1])):
            events[partition].append((step, (None, body, int(ts * 1000))))
        if step == 2:
            for bad in UNBOUNDED:
                events[1].append((step, (None, bad % (ORIGIN + step), (ORIGIN + step) * 1000
                                         + 999)))
    return events


def bounded_counts(events: dict[int, list[Stamped]], steps: range) -> tuple[int, int]:
    """(kept, dropped) by the bounding rule, in plain Python, over the closed ``steps``.

    The offsets are those :func:`produce_steps` gives: on each partition, step by step, a tick
    and then the step's records. Within a step a person's events are decided in
    (partition, offset) order: an event is kept iff its key is already one of the person's
    keys (lifetime period) with fewer than ``max_per_key`` kept, or the person has fewer than
    ``max_keys`` keys (the key is added).
    """
    placed: dict[int, list[tuple[int, int, str, str]]] = defaultdict(list)
    for partition in range(INPUT_PARTITIONS):
        offset = 0
        for step in range(STEPS):
            offset += 1  # the step's tick
            for s, (_, value, _) in events.get(partition, []):
                if s != step:
                    continue
                body = json.loads(value)
                if isinstance(body.get("user"), str) and body["user"]:
                    placed[step].append((partition, offset, body["user"], body["key"]))
                offset += 1
    held: dict[str, dict[str, int]] = defaultdict(dict)
    kept = dropped = 0
    for step in steps:
        for _, _, person, key in sorted(placed[step]):
            keys = held[person]
            if key in keys and keys[key] < MAX_PER_KEY or key not in keys and len(keys) < MAX_KEYS:
                keys[key] = keys.get(key, 0) + 1
                kept += 1
            else:
                dropped += 1
    return kept, dropped


def make_topics(bootstrap: str, roles: dict[str, int]) -> dict[str, str]:
    tag = secrets.token_hex(4)
    topics = {role: f"ul-{role}-{tag}" for role in roles}
    ensure_topics(bootstrap, {topics[role]: n for role, n in roles.items()})
    return topics


COUNTER_TOPICS = {"events": INPUT_PARTITIONS, "releases": 1, "alerts": 1, "dead": 1}


def dpstream_run(config: Path, log: Path, instance: str, *args: str) -> Process:
    """``dpstream run`` as a user starts it, bound to the flow instance ``instance``."""
    with log.open("wb") as sink:
        popen = subprocess.Popen(
            [sys.executable, "-m", "dpstream.cli", "run", "--config", str(config), *args],
            stdout=sink, stderr=subprocess.STDOUT,
            env=dict(ENV, DPSTREAM_INSTANCE_ID=instance))
    return Process(popen, log)


def outputs(bootstrap: str, topics: dict[str, str], roles: tuple[str, ...]
            ) -> dict[str, list[Record]]:
    return {role: read_all(bootstrap, topics[role], timeout=30, idle=1.5) for role in roles}


def without_people(text: str) -> None:
    """No raw person id in ``text`` (records, logs)."""
    assert not re.search(r"person-\d{3}", text), re.search(r".{80}person-\d{3}.{80}", text)


@pytest.fixture(scope="module")
def reference(broker, tmp_path_factory) -> dict[str, Any]:
    """The user-level counters flow, uninterrupted, through one ``dpstream run`` process."""
    root = tmp_path_factory.mktemp("user-level-reference")
    topics = make_topics(broker.bootstrap, COUNTER_TOPICS)
    events = people_events()
    produce_steps(broker.bootstrap, topics, events, range(STEPS))
    instance = secrets.token_hex(16)
    tables = counters_tables("ul-counters", broker.bootstrap, topics, tail=False)
    config = write(root / "one.toml", tables)
    [out] = finish([dpstream_run(config, root / "one.log", instance, "--recovery-dir",
                                 str(root / "recovery"))], RUN_TIMEOUT)
    return {"topics": topics, "events": events, "instance": instance, "log": out,
            "tables": tables, "outputs": outputs(broker.bootstrap, topics,
                                                 ("releases", "alerts", "dead"))}


def test_one_process_releases_every_key_and_step_with_the_person_block(reference):
    records = reference["outputs"]["releases"]
    decoded = [decode(r.value) for r in records]
    assert all(isinstance(r, Release) for r in decoded)
    assert sorted((r.key, r.step) for r in decoded) == sorted(  # type: ignore[union-attr]
        (k, s) for k in KEYS for s in range(STEPS))
    person = parse_config(reference["tables"]).person_privacy()
    assert person is not None
    for release in decoded:
        privacy = release.privacy  # type: ignore[union-attr]
        assert privacy.unit == "user" and privacy.person is not None
        assert privacy.person.period == "lifetime"
        assert [tuple(c) for c in privacy.person.caps] == [("max_keys", MAX_KEYS),
                                                          ("max_per_key", MAX_PER_KEY)]
        assert privacy.person.epsilon == pytest.approx(person.epsilon, rel=1e-12)
        assert privacy.person.delta == pytest.approx(person.delta, rel=1e-12)
    # no person in any published record, nor in the log
    for role in ("releases", "alerts"):
        without_people(b"\n".join(r.value for r in reference["outputs"][role]).decode())
    without_people(reference["log"])


def test_records_without_a_person_are_dead_letters_with_the_reason(reference):
    dead = [decode(r.value) for r in reference["outputs"]["dead"]]
    assert all(isinstance(d, DeadLetter) for d in dead)
    assert [(d.reason, base64.b64decode(d.original_base64))  # type: ignore[union-attr]
            for d in dead] == [(bad_person("user"), bad % (ORIGIN + 2)) for bad in UNBOUNDED]
    assert bad_person("user") == "field 'user' missing or not a non-empty string"


def test_a_two_process_cluster_publishes_what_one_process_publishes(reference, broker, tmp_path,
                                                                    cleanup):  # noqa: F811
    bootstrap = broker.bootstrap
    topics = {**make_topics(bootstrap, {"releases": 1, "alerts": 1, "dead": 1}),
              "events": reference["topics"]["events"]}
    config = write(tmp_path / "two.toml",
                   counters_tables("ul-counters", bootstrap, topics, tail=False))
    cluster = start_cluster(KINDS["counters"], config, recovery_stores(tmp_path / "stores", 2),
                            tmp_path / "two", reference["instance"])
    cleanup.extend(cluster)
    outs = finish(cluster, RUN_TIMEOUT)
    assert all(f"flow instance {reference['instance']} (new" in out for out in outs)
    assert all(ended(out)["events"] > 0 for out in outs), "both processes read input"
    got = outputs(bootstrap, topics, ("releases", "alerts", "dead"))
    for role in ("releases", "alerts", "dead"):
        assert sorted(r.value for r in got[role]) == sorted(
            r.value for r in reference["outputs"][role]), role
    for out in outs:
        without_people(out)


def test_kill_minus_nine_and_resume_publishes_the_uninterrupted_records(
        reference, broker, tmp_path, prometheus_factory, cleanup):  # noqa: F811
    bootstrap = broker.bootstrap
    topics = make_topics(bootstrap, COUNTER_TOPICS)
    events = reference["events"]
    produce_steps(bootstrap, topics, events, range(HALF))
    args = ("--recovery-dir", str(tmp_path / "recovery"), "--snapshot-interval", "0.2")
    port = free_port()
    tailing = write(tmp_path / "tail.toml", counters_tables(
        "ul-counters", bootstrap, topics, tail=True, metrics_port=port))
    first = dpstream_run(tailing, tmp_path / "tail.log", reference["instance"], *args)
    cleanup.append(first)
    closed = range(HALF - 1)  # the tick of step HALF is not there yet
    kept, dropped = bounded_counts(events, closed)
    assert kept > 0 and dropped > kept // 4  # the caps bite: a real test of the bounding
    prom = prometheus_factory([f"127.0.0.1:{port}"])

    def outcome(result: list[tuple[dict[str, str], float]], which: str) -> float | None:
        values = [v for labels, v in result if labels.get("outcome") == which]
        return values[0] if values else None

    query = 'dpstream_bounding_events_total{flow="ul-counters"}'
    try:
        prom.wait_for(query, lambda r: (outcome(r, "kept"), outcome(r, "dropped"))
                      == (kept, dropped), timeout=90)
    except Exception:
        pytest.fail(f"bounding counts {prom.query(query)} != {(kept, dropped)}:\n"
                    + first.output()[-3000:])
    for labels, _ in prom.query('{__name__=~"dpstream_.*"}'):
        without_people(json.dumps(labels))
    assert {tuple(sorted(labels)) for labels, _ in prom.query(query)} == {
        ("__name__", "flow", "instance", "job", "outcome")}
    seen = len(read_all(bootstrap, topics["releases"], timeout=5, idle=0.5))
    time.sleep(0.5)  # a snapshot or two after the closed steps' releases
    assert committed_epoch([tmp_path / "recovery"]) > 0, "the resume must restore a snapshot"
    assert first.popen.poll() is None, first.output()[-3000:]
    first.popen.send_signal(signal.SIGKILL)
    first.popen.wait(10)
    assert 0 < seen < len(reference["outputs"]["releases"]), "the kill must land mid-stream"

    produce_steps(bootstrap, topics, events, range(HALF, STEPS))
    bounded = write(tmp_path / "end.toml", counters_tables("ul-counters", bootstrap, topics,
                                                           tail=False))
    [out] = finish([dpstream_run(bounded, tmp_path / "end.log", reference["instance"], *args)],
                   RUN_TIMEOUT)
    assert f"flow instance {reference['instance']} (resumed" in out
    released = read_all(bootstrap, topics["releases"], timeout=30, idle=1.5)
    grouped: dict[tuple[str, int], set[bytes]] = defaultdict(set)
    for record in released:
        body = json.loads(record.value)
        grouped[body["key"], body["step"]].add(record.value)
    assert all(len(values) == 1 for values in grouped.values())  # replays are identical
    assert {v for values in grouped.values() for v in values} == {
        r.value for r in reference["outputs"]["releases"]}
    print(f"kill -9 after {seen} releases; {len(released) - len(grouped)} replayed, identical")


# --- ERM at the user level: one worker and two -----------------------------------------------

ERM_D = 3
ERM_STEPS = 6


def erm_events() -> dict[int, list[Stamped]]:
    """12 people; each step 10 rows a partition, a person's rows over several partitions and
    both streams; one row of step 1 without a person (a dead letter)."""
    rng = random.Random(31)
    events: dict[int, list[Stamped]] = defaultdict(list)
    for step in range(ERM_STEPS):
        for partition in range(INPUT_PARTITIONS):
            for i, ts in enumerate(sorted(ORIGIN + step + rng.random() * 0.998
                                          for _ in range(10))):
                x = [rng.gauss(0, 1) for _ in range(ERM_D)]
                body: dict[str, Any] = {
                    "features": x, "label": "yes" if x[0] > 0 else "no", "s": rng.choice("ab"),
                    "user": f"person-{rng.randrange(12):03d}"}
                if (step, partition, i) == (1, 3, 0):
                    del body["user"]
                events[partition].append((step, stamp(body, ts)))
    return events


def test_user_level_erm_through_the_broker_with_one_and_two_workers(
        broker, tmp_path, cleanup):  # noqa: F811
    bootstrap = broker.bootstrap
    inputs = make_topics(bootstrap, {"events": INPUT_PARTITIONS})
    events = erm_events()
    produce_steps(bootstrap, inputs, events, range(ERM_STEPS))
    instance = secrets.token_hex(16)
    published = []
    for workers in (1, 2):
        topics = {**make_topics(bootstrap, {"models": 1, "dead": 1}), **inputs}
        tables = erm(bootstrap, topics, name="ul-erm", origin=ORIGIN, steps=ERM_STEPS,
                     flow={"lateness": "0s", "shards": 4, "heartbeat": "off"},
                     kafka={"batch_size": 50, "startup_timeout": "20s", "tail": False},
                     privacy={"epsilon": 2.0}, metrics={"port": 0},
                     model={"dimension": ERM_D, "clip_norm": 1.5},
                     release={"block_size": 20},
                     contribution={"unit": "user", "user_field": "user",
                                   "max_rows_per_block": 2, "max_blocks": 3})
        config = write(tmp_path / f"erm-{workers}.toml", tables)
        run = dpstream_run(config, tmp_path / f"erm-{workers}.log", instance, "--recovery-dir",
                           str(tmp_path / f"erm-store-{workers}"), "--workers", str(workers))
        cleanup.append(run)
        [out] = finish([run], RUN_TIMEOUT)
        without_people(out)
        got = outputs(bootstrap, topics, ("models", "dead"))
        published.append(got)
        records = [decode(r.value) for r in got["models"]]
        models = [m for m in records if isinstance(m, Model)]
        servings = [m for m in records if isinstance(m, Serving)]  # the model to serve
        assert models and servings and len(models) + len(servings) == len(records)
        for model in models:
            privacy = model.privacy  # type: ignore[union-attr]
            assert privacy.unit == "user" and privacy.person is not None
            assert [tuple(c) for c in privacy.person.caps] == [("max_rows_per_block", 2),
                                                              ("max_blocks", 3)]
        without_people(b"\n".join(r.value for r in got["models"]).decode())
        dead = [decode(r.value) for r in got["dead"]]
        assert [d.reason for d in dead] == [bad_person("user")]  # type: ignore[union-attr]
    one, two = published
    assert sorted(r.value for r in one["models"]) == sorted(r.value for r in two["models"])
