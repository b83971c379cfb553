"""The ERM flow end to end against a real Kafka-protocol broker, as a user runs it.

``dpstream run`` runs an erm flow (two model streams, continual release) in a child process
over labelled events produced to a two-partition topic; the models it publishes are read back
from the models topic, checked field by field and turned into classifiers with
:class:`dpstream.estimator.ReleasedClassifier`. A tailing flow is killed with SIGKILL right
after its first models appear, resumed from its recovery store on a bounded input and
compared, record for record and byte for byte, with an uninterrupted run of the same flow
instance.

The embedded broker ignores LogAppendTime, so the flows use ``clock = "producer"`` and the
tests stamp every record themselves (at its event time). Under the producer clock only tick
records close steps: the tailing run writes none of its own (``heartbeat = "off"``), the test
writes them as the input arrives, and bounded runs end at ``flow.end``.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import signal
import subprocess
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import cli_flows
from support.cli_flows import finish, iso
from support.configs import erm, write
from support.flows import TopicWatch

from dpstream.estimator import ReleasedClassifier
from dpstream.io.topics import Record, ensure_topics, produce, read_all
from dpstream.messages import TICK
from dpstream.schemas import MODEL_SCHEMA

pytestmark = [pytest.mark.integration]

ENV = dict(os.environ, PYTHONUNBUFFERED="1",
           DPSTREAM_NOISE_KEY="3c1f0e5d7a9b2c4d6e8f0a1b3c5d7e9f1a2b4c6d8e0f1a3b5c7d9e1f2a4b6c8d")
ORIGIN = 1_790_000_000  # 2026-09-21T14:13:20Z, in the past: every event time is too
STEPS = 10
D = 8
STREAMS = ("a", "b")
CLASSES = ["no", "yes"]
PER_PARTITION = 400  # events per partition and step: ~400 per model stream and step (2 b0)
EPSILON = 4.0
"""Per component (Algorithm 2's bases and Algorithm 4's updates: 2 epsilon per event). Every
continual model carries the same real noise (std 0.21 per parameter here); with these
settings and ~2 b0 events per block the latest model of a stream scored 0.92 +- 0.02 on fresh
data over 600 noise keys (minimum 0.71, 1st percentile 0.83), against a majority rate of 0.54
and the 0.59 the test asks for. Each ephemeral run is a new flow instance with fresh noise, so
the margin must hold for any noise draw, not for one."""
CLIP_NORM = 1.5
TRUE_W = np.array([2.0, -1.5, 1.0, 0.8, -0.6, 0.0, 0.0, 0.0])
BIAS = 0.3
SECRET = "secret-label-4711"  # the malformed event's label: no dead-letter reason may echo it



def write_config(path: Path, bootstrap: str, topics: dict[str, str], *, name: str, tail: bool,
                 batch_size: int = 500) -> Path:
    # a bounded run closes every step before flow.end; the test writes the ticks that close
    # the steps (tick()): no heartbeat
    return write(path, erm(
        bootstrap, topics, name=name, origin=ORIGIN, steps=STEPS,
        flow={"lateness": "0s", "heartbeat": "off"},
        kafka={"tail": tail, "batch_size": batch_size, "startup_timeout": "10s"},
        privacy={"epsilon": EPSILON},
        model={"dimension": D, "clip_norm": CLIP_NORM}, release={"block_size": 200}))


def make_topics(bootstrap: str, stem: str) -> dict[str, str]:
    tag = uuid.uuid4().hex[:8]
    topics = {"events": f"{stem}-events-{tag}", "models": f"{stem}-models-{tag}",
              "dead": f"{stem}-dead-{tag}"}
    ensure_topics(bootstrap, {topics["events"]: 2, topics["models"]: 1, topics["dead"]: 1})
    return topics


def start_flow(config: Path, *args: str) -> subprocess.Popen:
    return cli_flows.start_flow(config, ENV, *args)


# --- data -----------------------------------------------------------------------------------


def sample(rng: random.Random) -> tuple[list[float], str]:
    """One labelled row: a noisy logistic-ish rule on the first five of eight features."""
    x = [rng.gauss(0, 1) for _ in range(D)]
    score = float(np.dot(TRUE_W, x)) + BIAS + rng.gauss(0, 0.5)
    return x, CLASSES[score > 0]


def fresh_data(rows: int = 4000, seed: int = 12345) -> tuple[np.ndarray, np.ndarray]:
    """Rows the flow never saw, from the same distribution."""
    rng = random.Random(seed)
    pairs = [sample(rng) for _ in range(rows)]
    return np.array([x for x, _ in pairs]), np.array([y for _, y in pairs])


Stamped = tuple[int, tuple[bytes | None, bytes, int]]  # (step, (key, value, timestamp ms))


def labelled_events(seed: int, steps: int = STEPS, bad_step: int | None = None
                    ) -> dict[int, list[Stamped]]:
    """Events per partition for steps ``0..steps-1``, in time order, stamped at their event
    time; with ``bad_step``, one malformed event (a label outside the classes) on partition 0."""
    rng = random.Random(seed)
    events: dict[int, list[Stamped]] = defaultdict(list)
    for step in range(steps):
        for partition in (0, 1):
            times = sorted(ORIGIN + step + rng.random() * 0.999 for _ in range(PER_PARTITION))
            for i, ts in enumerate(times):
                x, y = sample(rng)
                body = {"features": x, "label": y, "s": rng.choice(STREAMS), "ts": ts}
                if partition == 0 and step == bad_step and i == PER_PARTITION // 2:
                    body["label"] = SECRET
                events[partition].append((step, (None, json.dumps(body).encode(),
                                                 int(ts * 1000))))
    return events


def produce_steps(bootstrap: str, topic: str, events: dict[int, list[Stamped]],
                  steps: range) -> None:
    for partition, stamped in events.items():
        produce(bootstrap, topic, [m for step, m in stamped if step in steps],
                partition=partition)


def tick(bootstrap: str, topic: str, seconds: float) -> None:
    """A heartbeat tick stamped ``seconds`` to both partitions (what a ticking flow writes)."""
    for partition in (0, 1):
        produce(bootstrap, topic, [(b"dpstream.tick", TICK, int(seconds * 1000))],
                partition=partition)


def malformed(events: dict[int, list[Stamped]]) -> tuple[int, bytes]:
    """The offset (on partition 0) and bytes of the malformed event."""
    [(offset, value)] = [(i, m[1]) for i, (_, m) in enumerate(events[0])
                         if SECRET.encode() in m[1]]
    return offset, value


# --- the models topic -----------------------------------------------------------------------


def window(first: int, last: int) -> dict[str, Any]:
    return {"first_step": first, "last_step": last, "start": iso(ORIGIN + first),
            "end": iso(ORIGIN + last + 1)}


def identity(body: dict[str, Any]) -> tuple[str, int, str, str]:
    """What identifies one model of a flow instance: (stream, step, role, level)."""
    return body["stream"], body["step"], body["role"], str(body["level"])


def check_model(record: Record, *, flow: str) -> dict[str, Any]:
    """Every field of a dpstream.model/1 record that carries a model, strictly."""
    body = json.loads(record.value)
    assert body["schema"] == MODEL_SCHEMA and body["flow"] == flow, body
    assert body["stream"] in STREAMS and record.key == body["stream"].encode()
    assert body["algorithm"] == "continual"
    assert isinstance(body["role"], str) and body["role"] and body["role"] != "exhausted", body
    assert body["level"] is None or (isinstance(body["level"], int) and body["level"] >= 0)
    step = body["step"]
    assert isinstance(step, int) and 0 <= step < STEPS
    assert body["released"] == window(step, step)
    first, last = body["window"]["first_step"], body["window"]["last_step"]
    assert 0 <= first <= last <= step, body["window"]
    assert body["window"] == window(first, last)
    depends = body["depends_on"]
    assert depends and all(len(pair) == 2 and 0 <= pair[0] <= pair[1] <= step
                           for pair in depends), depends
    assert tuple(depends[0]) == (first, last)  # its own data range first, then its centres'
    assert body["classes"] == CLASSES
    assert np.asarray(body["coef"]).shape == (1, D) and len(body["intercept"]) == 1
    assert np.isfinite(body["coef"]).all() and np.isfinite(body["intercept"]).all()
    assert body["features"] == {"dimension": D, "clip_norm": CLIP_NORM}
    assert body["noise"]["std"] > 0
    assert re.fullmatch(r"[1-9][0-9]*/[1-9][0-9]*", body["noise"]["grid"]), body["noise"]
    assert body["holdout"] is None  # no [holdout]: nothing is ever scored on the stream
    privacy = body["privacy"]
    assert set(privacy) == {"unit", "accounting", "cost", "spent", "budget"}, privacy
    assert privacy["unit"] == "event" and privacy["accounting"] == "pure"
    assert privacy["budget"] == pytest.approx(2 * EPSILON)  # Algorithm 2's bases + Alg. 4
    assert 0 < privacy["cost"] <= privacy["spent"] + 1e-12
    assert privacy["spent"] <= privacy["budget"] + 1e-12
    return body


def models_by_identity(records: list[Record], flow: str) -> dict[tuple, set[bytes]]:
    grouped: dict[tuple, set[bytes]] = defaultdict(set)
    for record in records:
        grouped[identity(check_model(record, flow=flow))].add(record.value)
    return grouped


def check_release_pattern(bodies: list[dict[str, Any]]) -> None:
    """Both streams publish at every step from the first base (B = 2 blocks: step 1) on, and
    a stream's spending only grows."""
    per_stream: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for body in bodies:
        per_stream[body["stream"]].append(body)
    assert set(per_stream) == set(STREAMS)
    for ms in per_stream.values():
        steps = {m["step"] for m in ms}
        assert steps == set(range(1, STEPS)), sorted(steps)
        spent = [m["privacy"]["spent"] for m in sorted(ms, key=lambda m: m["step"])]
        assert spent == sorted(spent)


def check_dead_letter(bootstrap: str, topics: dict[str, str], events: dict[int, list[Stamped]],
                      *, flow: str, ticks_before: int = 0) -> bytes:
    """The one malformed event is the one dead letter; its reason names no value.

    ``ticks_before``: tick records written to partition 0 before it (they shift its offset).
    """
    letters = {r.value for r in read_all(bootstrap, topics["dead"], timeout=10, idle=1)}
    assert len(letters) == 1, letters
    raw = next(iter(letters))
    letter = json.loads(raw)
    offset, value = malformed(events)
    offset += ticks_before
    assert letter["schema"] == "dpstream.dead_letter/1" and letter["flow"] == flow
    assert letter["source"] == {"topic": topics["events"], "partition": 0, "offset": offset}
    assert base64.b64decode(letter["original_base64"]) == value
    reason = letter["reason"]
    assert reason == "field 'label' must be one of the configured classes", reason
    assert SECRET not in reason and not re.search(r"[0-9]", reason)  # echoes no value
    return raw


# --- a bounded run, read back -----------------------------------------------------------------


@pytest.mark.slow
def test_a_bounded_run_publishes_valid_models_of_both_streams_that_classify(broker, tmp_path):
    started = time.monotonic()
    bootstrap = broker.bootstrap
    topics = make_topics(bootstrap, "erm-live")
    events = labelled_events(seed=1, bad_step=5)
    produce_steps(bootstrap, topics["events"], events, range(STEPS))
    config = write_config(tmp_path / "live.toml", bootstrap, topics, name="erm-live",
                          tail=False)
    out = finish(start_flow(config))
    assert "input ended" in out, out[-3000:]

    records = read_all(bootstrap, topics["models"], timeout=30, idle=2)
    grouped = models_by_identity(records, flow="erm-live")
    assert len(records) == len(grouped)  # one run, no replay: every model once
    bodies = [json.loads(next(iter(values))) for values in grouped.values()]
    check_release_pattern(bodies)
    # the models are usable: each stream's latest continual model (its base or an update
    # centred on it: one per step, built on every block so far) through the estimator
    X, y = fresh_data()
    majority = max(float(np.mean(y == c)) for c in CLASSES)
    scores = {}
    for stream in STREAMS:
        latest = max((b for b in bodies
                      if b["stream"] == stream and b["role"] in ("base", "update")),
                     key=lambda b: b["step"])
        assert latest["step"] == STEPS - 1
        raw = next(r.value for r in records if json.loads(r.value) == latest)
        clf = ReleasedClassifier.from_record(raw)
        assert list(clf.classes_) == CLASSES and clf.n_features_in_ == D
        assert clf.predict_proba(X).shape == (len(X), 2)
        scores[stream] = clf.score(X, y)
        assert scores[stream] > majority + 0.05, (stream, scores, majority, latest)
    check_dead_letter(bootstrap, topics, events, flow="erm-live")
    print(f"{len(records)} models; accuracy {scores} vs majority {majority:.3f}; "
          f"{time.monotonic() - started:.1f} s")


# --- kill -9 and resume on a bounded input ----------------------------------------------------

KILL_AFTER = 6  # the first run is killed once the models of step KILL_AFTER - 2 are out


@pytest.mark.slow
def test_kill_minus_nine_and_resume_gives_the_models_of_an_uninterrupted_run(broker,
                                                                             tmp_path):
    started = time.monotonic()
    bootstrap = broker.bootstrap
    topics = make_topics(bootstrap, "erm-kill")
    events = labelled_events(seed=2, bad_step=3)
    produce_steps(bootstrap, topics["events"], events, range(3))
    tick(bootstrap, topics["events"], ORIGIN + 2)

    # B, first run: tails while the input arrives step by step (a step closes once a tick
    # stamped at the next step's start follows its events in both partitions); killed right
    # after new models appear, which is most likely before the epoch that wrote them is
    # snapshotted
    recovery_b = tmp_path / "recovery-b"
    args_b = ("--recovery-dir", str(recovery_b), "--snapshot-interval", "1")
    tailing = write_config(tmp_path / "b-tail.toml", bootstrap, topics, name="erm-kill",
                           tail=True, batch_size=50)
    proc = start_flow(tailing, *args_b)
    seen, produced = 0, 3
    with TopicWatch(bootstrap, topics["models"]) as watch:
        while True:
            deadline = time.monotonic() + 60
            while (now := watch.count()) == seen:
                assert time.monotonic() < deadline, f"no new model after step {produced - 1}"
                assert proc.poll() is None, \
                    proc.communicate()[0].decode(errors="replace")[-3000:]
            seen = now
            if produced == KILL_AFTER:
                break
            produce_steps(bootstrap, topics["events"], events, range(produced, produced + 1))
            tick(bootstrap, topics["events"], ORIGIN + produced)
            produced += 1
        proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    manifest = (recovery_b / "dpstream-instance.json").read_bytes()
    # the schedules keep their blocks in private segment files next to the recovery store
    # (the snapshots hold cursors into them): the resume below cuts off what the killed
    # process appended after its last snapshot
    segments = sorted((recovery_b / "history").rglob("segment-*.blocks"))
    assert segments and all(p.stat().st_mode & 0o077 == 0 for p in segments)

    # the rest of the input arrives; B resumes from its recovery store and reads to the end
    produce_steps(bootstrap, topics["events"], events, range(produced, STEPS))
    bounded = write_config(tmp_path / "b-end.toml", bootstrap, topics, name="erm-kill",
                           tail=False, batch_size=50)
    out = finish(start_flow(bounded, *args_b))
    assert "resumed" in out
    assert (recovery_b / "dpstream-instance.json").read_bytes() == manifest
    records_b = read_all(bootstrap, topics["models"], timeout=30, idle=2)
    grouped_b = models_by_identity(records_b, flow="erm-kill")
    conflicting = {key: values for key, values in grouped_b.items() if len(values) != 1}
    assert not conflicting  # replayed models are byte-identical copies: nothing re-noised
    assert 0 < seen < len(grouped_b)  # killed mid-stream
    check_release_pattern([json.loads(next(iter(v))) for v in grouped_b.values()])

    # A: the same flow instance (B's manifest, not its state), uninterrupted, into new topics
    tag = uuid.uuid4().hex[:8]
    topics_a = dict(topics, models=f"erm-kill-models-a-{tag}", dead=f"erm-kill-dead-a-{tag}")
    ensure_topics(bootstrap, {topics_a["models"]: 1, topics_a["dead"]: 1})
    recovery_a = tmp_path / "recovery-a"
    recovery_a.mkdir(mode=0o700)
    (recovery_a / "dpstream-instance.json").write_bytes(manifest)
    (recovery_a / "dpstream-instance.json").chmod(0o600)
    config_a = write_config(tmp_path / "a.toml", bootstrap, topics_a, name="erm-kill",
                            tail=False, batch_size=50)
    finish(start_flow(config_a, "--recovery-dir", str(recovery_a)))
    records_a = read_all(bootstrap, topics_a["models"], expect=len(grouped_b), timeout=30)
    grouped_a = models_by_identity(records_a, flow="erm-kill")
    assert len(records_a) == len(grouped_a)  # uninterrupted: every model once
    assert grouped_a == grouped_b  # model for model, byte for byte

    # the dead letters agree too (the malformed event), replays de-duplicated
    # (one tick, after steps 0..2, precedes the malformed event of step 3)
    dead_b = check_dead_letter(bootstrap, topics, events, flow="erm-kill", ticks_before=1)
    dead_a = check_dead_letter(bootstrap, topics_a, events, flow="erm-kill", ticks_before=1)
    assert dead_a == dead_b
    duplicates = len(records_b) - len(grouped_b)
    print(f"kill -9 after {seen} of {len(grouped_b)} models; {duplicates} replayed "
          f"duplicate(s), all identical; {time.monotonic() - started:.1f} s")
