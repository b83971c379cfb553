"""Each flow kind as a two-process Bytewax cluster, against the real embedded broker (issue 10).

A flow of each kind (counters, pmwg, erm) runs as two ``python -m bytewax.run MODULE -i 0/1 -a
"127.0.0.1:PA;127.0.0.1:PB"`` processes, each with its own recovery directory holding one of
the two recovery partitions (Bytewax resumes when the processes *together* hold every
partition: the layout of a StatefulSet with a volume per pod), all of them bound to one flow
instance by ``DPSTREAM_INSTANCE_ID``. The tests check that

* the two processes publish exactly what one process publishes on the same input with the same
  noise key and flow instance (every record of the output and dead-letter topics, byte for
  byte), and that both processes did part of the work (each reads input partitions and holds
  shards: the shard counts and names below are chosen for Bytewax's key routing);
* a kill -9 of one process mid-run (its peer then fails too), and a restart of both from
  their recovery stores, loses nothing and re-noises nothing: every output record of the
  uninterrupted run is there, and a replayed record is a byte-identical copy (each process
  serves its metrics on ``metrics.port`` + its process id meanwhile);
* one recovery directory shared by both processes needs no explicit id: process 0 makes the
  instance, the other waits for its manifest.

The first tests check those binding rules of :func:`dpstream.instance.bind_instance` without a
broker (a given id recorded and enforced; a process other than 0 never makes an instance of its
own; processes creating one manifest at once agree on it).

The embedded broker ignores LogAppendTime, so the flows use ``clock = "producer"`` and the
tests stamp every record themselves. Process logs go to files (a pipe nobody reads could
block a process).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaProducer
from support.cli_flows import iso
from support.configs import Tables, counters, erm, pmwg, write
from support.flows import TopicWatch, scrape

from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import ConfigError, RecoveryMismatchError
from dpstream.instance import MANIFEST_NAME, bind_instance
from dpstream.io.broker import free_port
from dpstream.io.topics import Record, ensure_topics, read_all
from dpstream.kinds.counters.kind import statistics_spec
from dpstream.messages import TICK
from dpstream.platform import parse_config

ORIGIN = 1_790_000_000  # 2026-09-21T14:13:20Z: every event time is in the past
NOISE_KEY = "9a0c2e4f6b8d1a3c5e7f9b0d2c4e6a8f1b3d5c7e9a0b2d4f6c8e0a1b3c5d7e9f"
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith(("DPSTREAM_", "BYTEWAX_"))},
       "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1", "DPSTREAM_NOISE_KEY": NOISE_KEY,
       "DPSTREAM_PROGRESS_SECONDS": "0", "RUST_BACKTRACE": "0"}
"""The processes' environment: none of the caller's dpstream or Bytewax settings."""
INPUT_PARTITIONS = 6
"""Bytewax routes a key to ``hash(key) % workers``: of the input partitions "0".."5" and the
shards "0".."7", two workers give "4" and "5" to process 0 and the others to process 1."""
SHARDS = 8
SNAPSHOT_SECONDS = 1
KILL_SNAPSHOT_SECONDS = 2
"""The tailing run of the kill test snapshots every 2 s: it is killed right after a snapshot,
so the outputs that follow are most likely replayed by the restart."""
RUN_TIMEOUT = 120.0


# --- the instance binding of a cluster (no broker) ------------------------------------------


def counters_config(shards: int = 4) -> Any:
    return parse_config({
        "flow": {"origin": iso(ORIGIN), "step": "1s", "shards": shards},
        "privacy": {"budget": 1.0}, "counter": {"epsilon": 0.7},
        "admission": {"mode": "declared", "keys": ["a"]}, "metrics": {"port": 0}})


def bind(directory: Path | None, **kwargs: Any) -> Any:
    config = counters_config()
    return bind_instance(config, statistics_spec(config), NoiseKey.for_tests(1), directory,
                         **kwargs)


def test_a_given_instance_id_is_recorded_and_must_match_on_resume(tmp_path):
    given = secrets.token_hex(16)
    made = bind(tmp_path / "p0", instance_id=given)
    assert made.id == given and made.durable and not made.resumed
    assert json.loads((tmp_path / "p0" / MANIFEST_NAME).read_text())["instance"] == given
    # another process's own directory, given the same id: the same instance
    assert bind(tmp_path / "p1", instance_id=given, process=1).id == given
    assert bind(tmp_path / "p0", instance_id=given).resumed
    other = secrets.token_hex(16)
    with pytest.raises(RecoveryMismatchError) as info:
        bind(tmp_path / "p0", instance_id=other)
    assert given in str(info.value) and other in str(info.value)
    assert not list((tmp_path / "p0").glob("*.tmp"))


@pytest.mark.parametrize("bad", ["", "x" * 32, "A" * 32, "0" * 31, "0" * 33, "my-flow"])
def test_a_malformed_instance_id_is_refused(tmp_path, bad):
    with pytest.raises(ConfigError, match="32 lowercase hex digits"):
        bind(tmp_path, instance_id=bad)
    assert not (tmp_path / MANIFEST_NAME).exists()


def test_an_instance_id_needs_a_recovery_store():
    with pytest.raises(ConfigError, match="durable flow instance"):
        bind(None, ephemeral=True, instance_id=secrets.token_hex(16))


def test_a_process_other_than_0_never_makes_an_instance_of_its_own(tmp_path):
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        bind(tmp_path / "p1", process=1, wait_seconds=0.3)
    assert time.monotonic() - started >= 0.3
    assert "process 1" in str(info.value) and "DPSTREAM_INSTANCE_ID" in str(info.value)
    assert not (tmp_path / "p1" / MANIFEST_NAME).exists()


def test_a_process_other_than_0_binds_the_instance_process_0_makes_in_a_shared_directory(
        tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    follower: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: follower.update(
        instance=bind(shared, process=1, wait_seconds=30)))
    thread.start()
    time.sleep(0.3)  # the follower is waiting: nothing there yet
    assert thread.is_alive()
    leader = bind(shared)
    thread.join(30)
    assert follower["instance"].id == leader.id


def test_processes_making_one_instance_at_once_agree_on_it(tmp_path):
    """Processes given one id and sharing a directory: one creates the manifest, all bind it
    (a rename-based write would let each process keep the id it made)."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    gate = threading.Barrier(8)
    ids: list[str] = []

    def make() -> None:
        gate.wait()
        ids.append(bind(shared).id)

    threads = [threading.Thread(target=make) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(ids) == 8 and len(set(ids)) == 1
    assert json.loads((shared / MANIFEST_NAME).read_text())["instance"] == ids[0]
    assert sorted(p.name for p in shared.iterdir()) == [MANIFEST_NAME]


# --- the flow kinds, as the tests run them ----------------------------------------------------

Stamped = tuple[int, tuple[bytes | None, bytes, int]]  # (step, (key, value, timestamp ms))


def stamp(body: dict[str, Any], ts: float) -> tuple[None, bytes, int]:
    return None, json.dumps({**body, "ts": ts}).encode(), int(ts * 1000)


@dataclass
class Kind:
    """What the tests need to know of one flow kind."""

    name: str
    module: str
    config: Callable[..., Tables]
    """Its configuration: ``config(name, bootstrap, topics, tail, metrics_port, steps)``."""
    outputs: tuple[str, ...]
    """Its output topics' roles; the first is the one whose records the kill test watches."""
    count: str
    """What the ``input ended:`` line counts for the kind's outputs (``releases``...)."""
    identity: Callable[[dict[str, Any]], tuple[Any, ...]]
    """What identifies one output record of a flow instance (replays repeat it)."""
    events: Callable[[], dict[int, list[Stamped]]]
    """The input by partition, each record with its step: the events topic's partitions
    0..5, and ``QUERIES`` for the queries topic's one partition."""
    steps: int
    kill_first: int
    """Steps the tailing first run of the kill test gets before its kill."""
    victim: int
    """The process killed with SIGKILL."""
    extra_topics: dict[str, int] = field(default_factory=dict)
    """Input topics besides the events topic, with their partition counts."""

    @property
    def inputs(self) -> tuple[str, ...]:
        """The roles of its input topics."""
        return ("events", *self.extra_topics)


COUNTER_KEYS = [f"k{i:02d}" for i in range(20)]

# every kind: the embedded broker ignores LogAppendTime, so the producer clock (these producers
# are trusted), and the tests write the ticks (produce_steps), so no heartbeat
SHARED_KAFKA = {"batch_size": 50, "startup_timeout": "20s"}


def counters_flow(name: str, bootstrap: str, topics: dict[str, str], tail: bool,
                    metrics_port: int, steps: int) -> Tables:
    return counters(bootstrap, topics, name=name, origin=ORIGIN, steps=steps, keys=COUNTER_KEYS,
                    flow={"kind": "counters", "shards": SHARDS, "heartbeat": "off"},
                    kafka=SHARED_KAFKA | {"tail": tail}, privacy={"accounting": "pure"},
                    metrics={"port": metrics_port, "exact_counts": True})


def counters_events(steps: int = 60) -> dict[int, list[Stamped]]:
    """0-3 events per key and step, round robin over the partitions; two malformed records
    on partition 4 (read by process 0)."""
    rng = random.Random(7)
    events: dict[int, list[Stamped]] = defaultdict(list)
    i = 0
    for step in range(steps):
        for key in COUNTER_KEYS:
            for _ in range(rng.randint(0, 3)):
                ts = ORIGIN + step + rng.random() * 0.999
                events[i % INPUT_PARTITIONS].append((step, stamp({"key": key}, ts)))
                i += 1
    for n, step in enumerate((5, 30)):
        events[4].insert(next(j for j, (s, _) in enumerate(events[4]) if s == step),
                         (step, (None, b'{"broken' + str(n).encode(), (ORIGIN + step) * 1000)))
    return events


HISTOGRAMS = ("sessions", "logins")  # crc32 % 8: shards 3 (process 1) and 4 (process 0)
COUNTRIES = ["de", "fr", "us"]
DEVICES = ["ios", "web"]

def pmwg_flow(name: str, bootstrap: str, topics: dict[str, str], tail: bool,
                metrics_port: int, steps: int) -> Tables:
    histograms = [{
        "name": histogram, "mechanism": "pmwg", "mode": "practical", "hard_queries": 4,
        "epsilon": 0.8, "size_epsilon": 0.2, "size_horizon": 1024, "alpha": 0.2, "n": 100,
        "universe": [{"name": "country", "values": COUNTRIES},
                     {"name": "device", "values": DEVICES},
                     {"name": "age", "edges": [0, 30, 60, 120]}]} for histogram in HISTOGRAMS]
    return pmwg(bootstrap, topics, histograms, name=name, origin=ORIGIN, steps=steps,
                flow={"lateness": "0s", "shards": SHARDS, "heartbeat": "off"},
                kafka=SHARED_KAFKA | {"tail": tail}, privacy={"budget": 2.0},
                metrics={"port": metrics_port, "exact_counts": True})

QUERIES = -1  # the partition number the tests give the queries topic's one partition
QUESTIONS = [{"kind": "count", "where": [{"attr": "country", "eq": "de"}]},
             {"kind": "marginal", "attrs": ["device"]},
             {"kind": "count", "where": [{"attr": "age", "range": [30, 120]}]},
             {"kind": "weights", "sparse": {"0": 1.0, "7": 0.5}}]


def pmwg_events(steps: int = 16) -> dict[int, list[Stamped]]:
    """20 events per partition and step (steps >= 1); a question to each histogram every step
    (it moves the queries partition's clock), and one to an unknown histogram (a dead letter)."""
    rng = random.Random(11)
    events: dict[int, list[Stamped]] = defaultdict(list)
    for step in range(1, steps):
        for partition in range(INPUT_PARTITIONS):
            for ts in sorted(ORIGIN + step + rng.random() * 0.999 for _ in range(20)):
                body = {"country": rng.choice(COUNTRIES), "device": rng.choice(DEVICES),
                        "age": rng.randrange(0, 120)}
                events[partition].append((step, stamp(body, ts)))
    for step in range(steps):
        for h, histogram in enumerate(HISTOGRAMS):
            question = {"id": f"s{step:02d}-{histogram}", "histogram": histogram,
                        "query": {"schema": "dpstream.query/1",
                                  **QUESTIONS[(step + h) % len(QUESTIONS)]}}
            events[QUERIES].append((step, (histogram.encode(), json.dumps(question).encode(),
                                           (ORIGIN + step) * 1000 + 500)))
        if step == 6:
            lost = {"id": "lost-1", "histogram": "nope", "query": {"kind": "count"}}
            events[QUERIES].append((step, (b"nope", json.dumps(lost).encode(),
                                           (ORIGIN + step) * 1000 + 600)))
    return events


ERM_STREAMS = ("left", "right")  # crc32 % 8: shards 0 (process 1) and 4 (process 0)
ERM_D = 4

def erm_flow(name: str, bootstrap: str, topics: dict[str, str], tail: bool,
               metrics_port: int, steps: int) -> Tables:
    return erm(bootstrap, topics, name=name, origin=ORIGIN, steps=steps,
               flow={"lateness": "0s", "shards": SHARDS, "heartbeat": "off"},
               kafka=SHARED_KAFKA | {"tail": tail}, privacy={"epsilon": 2.0},
               metrics={"port": metrics_port, "exact_counts": True},
               model={"dimension": ERM_D, "clip_norm": 1.5, "streams": list(ERM_STREAMS)},
               release={"block_size": 40})


def erm_events(steps: int = 8) -> dict[int, list[Stamped]]:
    """15 labelled rows per partition and step (about 45 per model stream and step); one
    label outside the classes on partition 5 (a dead letter read by process 0)."""
    rng = random.Random(5)
    weights = [1.5, -1.0, 0.8, 0.0]
    events: dict[int, list[Stamped]] = defaultdict(list)
    for step in range(steps):
        for partition in range(INPUT_PARTITIONS):
            times = sorted(ORIGIN + step + rng.random() * 0.999 for _ in range(15))
            for i, ts in enumerate(times):
                x = [rng.gauss(0, 1) for _ in range(ERM_D)]
                score = sum(w * v for w, v in zip(weights, x, strict=True)) + rng.gauss(0, .5)
                body = {"features": x, "label": "yes" if score > 0 else "no",
                        "s": rng.choice(ERM_STREAMS)}
                if (partition, step, i) == (5, 2, 0):
                    body["label"] = "maybe"
                events[partition].append((step, stamp(body, ts)))
    return events


def model_identity(body: dict[str, Any]) -> tuple[Any, ...]:
    return (body["schema"], body["stream"], body["step"], body.get("role"),  # serving records
            str(body.get("level")))  # have no role: their coordinate is (stream, step)


KINDS = {
    "counters": Kind(
        name="counters", module="dpstream.flows.counters:flow", config=counters_flow,
        outputs=("releases", "alerts", "dead"), count="releases",
        identity=lambda b: (b["schema"], b["key"], b["step"]), events=counters_events,
        steps=60, kill_first=30, victim=0),
    "pmwg": Kind(
        name="pmwg", module="dpstream.flows.pmwg:flow", config=pmwg_flow,
        outputs=("answers", "dead"), count="answers", identity=lambda b: (b["id"],),
        events=pmwg_events, steps=16, kill_first=8, victim=1, extra_topics={"queries": 1}),
    "erm": Kind(
        name="erm", module="dpstream.flows.erm:flow", config=erm_flow,
        outputs=("models", "dead"), count="releases", identity=model_identity,
        events=erm_events, steps=8, kill_first=4, victim=0),
}


def make_topics(bootstrap: str, kind: Kind, inputs: dict[str, str] | None = None
                ) -> dict[str, str]:
    """Fresh output topics (one partition each) and, unless ``inputs`` names those of an
    earlier run (read again), fresh input topics."""
    tag = uuid.uuid4().hex[:8]
    partitions = {"events": INPUT_PARTITIONS, **kind.extra_topics}
    fresh = kind.outputs if inputs is not None else (*kind.outputs, *kind.inputs)
    topics = {role: f"mp-{kind.name}-{role}-{tag}" for role in fresh}
    ensure_topics(bootstrap, {topic: partitions.get(role, 1) for role, topic in topics.items()})
    return {**topics, **(inputs or {})}


def input_topics(kind: Kind, topics: dict[str, str]) -> dict[str, str]:
    """The input topics among ``topics``."""
    return {role: topics[role] for role in kind.inputs}


def write_config(path: Path, kind: Kind, bootstrap: str, topics: dict[str, str], *,
                 tail: bool, metrics_port: int = 0) -> Path:
    return write(path, kind.config(f"mp-{kind.name}", bootstrap, topics, tail, metrics_port,
                                   kind.steps))


def produce_steps(bootstrap: str, topics: dict[str, str], events: dict[int, list[Stamped]],
                  steps: range) -> None:
    """Write the records of ``steps`` to their partitions (one producer: fast), each step's
    after a tick stamped at the step's start on every input partition (under the producer
    clock only ticks close steps: a step closes once the next step's tick is read, as the
    events' own times closed it before; the topics' contents do not depend on how the steps
    are split into calls), and wait until the broker acknowledged every one."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    partitions = list(range(INPUT_PARTITIONS)) + ([QUERIES] if "queries" in topics else [])
    try:
        sent = []
        for partition in partitions:
            topic, number = ((topics["queries"], 0) if partition == QUERIES
                             else (topics["events"], partition))
            stamped = events.get(partition, [])
            for step in steps:
                sent.append(producer.send(topic, value=TICK, key=b"dpstream.tick",
                                          partition=number, timestamp_ms=(ORIGIN + step) * 1000))
                sent += [producer.send(topic, value=value, key=key, partition=number,
                                       timestamp_ms=ts)
                         for s, (key, value, ts) in stamped if s == step]
        producer.flush(30)
        for future in sent:
            future.get(30)  # raises if the broker refused a record
    finally:
        producer.close(10)


# --- running bytewax.run processes ----------------------------------------------------------


def recovery_store(store: Path, partitions: int) -> Path:
    """A private recovery directory holding ``partitions`` empty recovery partitions."""
    from bytewax.recovery import init_db_dir

    store.mkdir(mode=0o700, parents=True)
    init_db_dir(store, partitions)
    return store


def recovery_stores(root: Path, processes: int) -> list[Path]:
    """One recovery directory per process, each holding one of ``processes`` partitions."""
    scratch = recovery_store(root / "init", processes)
    stores = []
    for i in range(processes):
        store = root / f"process-{i}"
        store.mkdir(mode=0o700)
        (scratch / f"part-{i}.sqlite3").rename(store / f"part-{i}.sqlite3")
        stores.append(store)
    scratch.rmdir()
    return stores


def _query(stores: list[Path], sql: str) -> list[list[tuple[Any, ...]]]:
    """The rows ``sql`` selects in each recovery partition of ``stores`` (read-only)."""
    rows = []
    for part in sorted({p for store in stores for p in store.glob("part-*.sqlite3")}):
        with contextlib.closing(sqlite3.connect(f"file:{part}?mode=ro", uri=True,
                                                timeout=5)) as db:
            rows.append(db.execute(sql).fetchall())
    return rows


def committed_epoch(stores: list[Path]) -> int:
    """The epoch every recovery partition has committed (0 before the first snapshot)."""
    return min(rows[0][0] or 0
               for rows in _query(stores, "SELECT MAX(commit_epoch) FROM commits"))


def resume_epochs(stores: list[Path]) -> set[int]:
    """The epochs the executions after the first resumed from, as the partitions record them."""
    return {row[0] for rows in _query(stores, "SELECT resume_epoch FROM exs WHERE ex_num > 0")
            for row in rows}


@dataclass
class Process:
    """One ``python -m bytewax.run`` process, logging to a file."""

    popen: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_cluster(kind: Kind, config: Path, stores: list[Path], logs: Path,
                  instance: str | None, snapshot_seconds: int = SNAPSHOT_SECONDS
                  ) -> list[Process]:
    """``bytewax.run`` processes of ``kind``'s flow, one per store (a cluster if several),
    given the flow instance's id unless ``instance`` is None."""
    addresses = ";".join(f"127.0.0.1:{free_port()}" for _ in stores)
    processes = []
    for i, store in enumerate(stores):
        cluster = ["-i", str(i), "-a", addresses] if len(stores) > 1 else []
        log = logs.with_name(f"{logs.name}-{i}.log")
        with log.open("wb") as sink:
            popen = subprocess.Popen(
                [sys.executable, "-m", "bytewax.run", kind.module, "-r", str(store),
                 "-s", str(snapshot_seconds), "-b", "0", *cluster],
                cwd=store.parent, stdout=sink, stderr=subprocess.STDOUT,
                env=dict(ENV, DPSTREAM_CONFIG=str(config), DPSTREAM_RECOVERY_DIR=str(store),
                         **({"DPSTREAM_INSTANCE_ID": instance} if instance else {})))
        processes.append(Process(popen, log))
    return processes


def finish(processes: list[Process], timeout: float = RUN_TIMEOUT) -> list[str]:
    """Wait for every process of a bounded run: each must exit 0, cleanly."""
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.popen.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        stop_all(processes)
        pytest.fail(f"the flow did not finish within {timeout:g} s:\n"
                    + "\n".join(p.output()[-2000:] for p in processes))
    outputs = [p.output() for p in processes]
    for process, text in zip(processes, outputs, strict=True):
        assert process.popen.returncode == 0, text[-3000:]
        assert "Traceback" not in text and "panicked" not in text, text[-3000:]
        assert "input ended:" in text, text[-3000:]
    return outputs


def stop_all(processes: list[Process]) -> None:
    for process in processes:
        if process.popen.poll() is None:
            process.popen.kill()
            process.popen.wait(10)


@pytest.fixture
def cleanup() -> Iterator[list[Process]]:
    """Processes a test started; any still running at its end are killed."""
    started: list[Process] = []
    yield started
    stop_all(started)


def ended(output: str) -> dict[str, int]:
    """The counts of a process's ``input ended:`` line (``events``, ``releases``...)."""
    [line] = [ln for ln in output.splitlines() if "input ended:" in ln]
    counted = line.split("input ended:")[1]
    return {name: int(n) for n, name in re.findall(r"(\d+) ([a-z]+)", counted)}


# --- reading the outputs ------------------------------------------------------------------------


def contents(bootstrap: str, topics: dict[str, str], kind: Kind,
             expect: dict[str, int] | None = None) -> dict[str, list[Record]]:
    """Every record of each output topic (``expect``: counts to wait for), read concurrently
    (each read ends after 1.5 s without a record)."""
    expect = expect or {}
    with ThreadPoolExecutor(len(kind.outputs)) as pool:
        reads = {role: pool.submit(read_all, bootstrap, topics[role], expect=expect.get(role),
                                   timeout=30, idle=1.5)
                 for role in kind.outputs}
        return {role: read.result() for role, read in reads.items()}


def canonical(records: list[Record], source: str | None = None) -> list[tuple[bytes, bytes]]:
    """(key, value) of each record, sorted; ``source``: the input topic named in dead letters
    is replaced by it (runs over copies of one input compare equal)."""
    pairs = []
    for r in records:
        value = r.value
        if source is not None:
            body = json.loads(value)
            if body.get("schema") == "dpstream.dead_letter/1":
                body["source"]["topic"] = source
                value = json.dumps(body, sort_keys=True).encode()
        pairs.append((r.key or b"", value))
    return sorted(pairs)


def by_identity(kind: Kind, records: list[Record]) -> dict[tuple[Any, ...], set[bytes]]:
    grouped: dict[tuple[Any, ...], set[bytes]] = defaultdict(set)
    for record in records:
        grouped[kind.identity(json.loads(record.value))].add(record.value)
    return grouped


@dataclass
class Reference:
    """One kind's input and its single-process, uninterrupted run."""

    kind: Kind
    instance: str
    events: dict[int, list[Stamped]]
    topics: dict[str, str]
    outputs: dict[str, list[Record]]
    counts: dict[str, int]
    """The counts of the run's ``input ended:`` line (``events``, ``releases``...)."""


@pytest.fixture(scope="module", params=sorted(KINDS))
def reference(request, broker, tmp_path_factory) -> Reference:
    """The kind's input on the broker, run by one ``bytewax.run`` process (one worker)."""
    kind = KINDS[request.param]
    root = tmp_path_factory.mktemp(f"reference-{kind.name}")
    bootstrap = broker.bootstrap
    topics = make_topics(bootstrap, kind)
    events = kind.events()
    produce_steps(bootstrap, topics, events, range(kind.steps))
    instance = secrets.token_hex(16)
    config = write_config(root / "one.toml", kind, bootstrap, topics, tail=False)
    store = recovery_store(root / "recovery", 1)
    [out] = finish(start_cluster(kind, config, [store], root / "one", instance))
    outputs = contents(bootstrap, topics, kind)
    main = outputs[kind.outputs[0]]
    assert main, f"the reference {kind.name} run published nothing:\n{out[-3000:]}"
    grouped = by_identity(kind, main)
    assert len(grouped) == len(main)  # uninterrupted: every record once
    assert outputs["dead"], "the input's malformed record must be a dead letter"
    return Reference(kind, instance, events, topics, outputs, ended(out))


# --- two processes publish what one does --------------------------------------------------------


@pytest.mark.integration
def test_two_processes_publish_what_one_process_publishes(reference, broker, tmp_path,
                                                          cleanup):
    kind, bootstrap = reference.kind, broker.bootstrap
    topics = make_topics(bootstrap, kind, input_topics(kind, reference.topics))
    config = write_config(tmp_path / "two.toml", kind, bootstrap, topics, tail=False)
    stores = recovery_stores(tmp_path / "recovery", 2)
    cluster = start_cluster(kind, config, stores, tmp_path / "two", reference.instance)
    cleanup.extend(cluster)
    outs = finish(cluster)
    counts = [ended(out) for out in outs]
    outputs = contents(bootstrap, topics, kind,
                       {role: len(reference.outputs[role]) for role in kind.outputs})
    for role in kind.outputs:
        assert canonical(outputs[role]) == canonical(reference.outputs[role]), role
    # both processes read input partitions and published from shards of their own
    for name in ("events", kind.count):
        assert all(c.get(name, 0) > 0 for c in counts), (name, counts)
        assert sum(c[name] for c in counts) == reference.counts[name], (name, counts)
    assert all(f"flow instance {reference.instance} (new" in out for out in outs)


# --- kill -9 of one process, restart of both ------------------------------------------------------


def wait_for(condition: Callable[[], bool], what: str, processes: list[Process],
             timeout: float = 60) -> None:
    """Poll ``condition`` until it holds; fail (with the logs) if a process exits first."""
    deadline = time.monotonic() + timeout
    while not condition():
        for process in processes:
            if process.popen.poll() is not None:
                pytest.fail(f"a process exited while waiting for {what}:\n"
                            + process.output()[-3000:])
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:g} s")
        time.sleep(0.05)


def metrics_ports() -> int:
    """A free port whose successor is free too (process i serves on port + i)."""
    for _ in range(20):
        port = free_port()
        with contextlib.suppress(OSError), socket.socket() as probe:
            probe.bind(("127.0.0.1", port + 1))
            return port
    raise AssertionError("no two consecutive free ports")


@pytest.fixture
def watches() -> Iterator[list[TopicWatch]]:
    opened: list[TopicWatch] = []
    yield opened
    for watch in opened:
        watch.close()


@pytest.mark.integration
@pytest.mark.slow
def test_kill_minus_nine_of_one_process_and_a_restart_of_both_loses_and_renoises_nothing(
        reference, broker, tmp_path, cleanup, watches):
    kind, bootstrap = reference.kind, broker.bootstrap
    topics = make_topics(bootstrap, kind)
    stores = recovery_stores(tmp_path / "recovery", 2)
    produce_steps(bootstrap, topics, reference.events, range(kind.kill_first))

    # the first run tails (it never ends by itself). Once the first part of the input is out
    # and a snapshot follows, the next steps arrive and a process is killed right after their
    # outputs appear: before the next snapshot, so the restart replays them
    port = metrics_ports()
    tailing = write_config(tmp_path / "tail.toml", kind, bootstrap, topics, tail=True,
                           metrics_port=port)
    cluster = start_cluster(kind, tailing, stores, tmp_path / "tail", reference.instance,
                            snapshot_seconds=KILL_SNAPSHOT_SECONDS)
    cleanup.extend(cluster)
    watch = TopicWatch(bootstrap, topics[kind.outputs[0]])
    watches.append(watch)
    wait_for(lambda: watch.count() > 0, "first outputs", cluster)
    # each process serves its metrics on metrics.port + its process id
    events = [scrape(port + i).get(f'dpstream_events_total{{flow="mp-{kind.name}"}}', 0.0)
              for i in range(2)]
    assert all(scrape(port + i).get(f'dpstream_up{{flow="mp-{kind.name}"}}') == 1
               for i in range(2))
    assert sum(events) > 0, events
    settled = watch.settled()
    before = committed_epoch(stores)
    wait_for(lambda: committed_epoch(stores) > before, "a snapshot after the outputs", cluster)
    snapshot = committed_epoch(stores)
    produce_steps(bootstrap, topics, reference.events,
                  range(kind.kill_first, kind.kill_first + 2))
    wait_for(lambda: watch.count() > settled, "outputs of the next steps", cluster)
    victim, survivor = cluster[kind.victim], cluster[1 - kind.victim]
    victim.popen.send_signal(signal.SIGKILL)
    killed_at = watch.count()
    victim.popen.wait(10)
    try:  # the survivor loses its peer: Timely fails it (exit 1, a panic)
        survivor.popen.wait(30)
    except subprocess.TimeoutExpired:
        survivor.popen.kill()  # as Kubernetes would, after the grace period
        survivor.popen.wait(10)
    assert killed_at < len(reference.outputs[kind.outputs[0]]), "the kill must land mid-run"

    # the rest of the input arrives; both processes restart from their stores and run to the end
    produce_steps(bootstrap, topics, reference.events, range(kind.kill_first + 2, kind.steps))
    bounded = write_config(tmp_path / "bounded.toml", kind, bootstrap, topics, tail=False)
    restarted = start_cluster(kind, bounded, stores, tmp_path / "restart", reference.instance)
    cleanup.extend(restarted)
    outs = finish(restarted)
    assert all(f"flow instance {reference.instance} (resumed" in out for out in outs)
    resumed = resume_epochs(stores)
    assert resumed and min(resumed) >= snapshot, resumed  # from a snapshot, not the start
    replayed = sum(ended(out).get("events", 0) for out in outs)
    assert replayed < reference.counts["events"]  # the snapshotted input is not read again

    outputs = contents(bootstrap, topics, kind)
    main = outputs[kind.outputs[0]]
    grouped = by_identity(kind, main)
    conflicting = {k: v for k, v in grouped.items() if len(v) != 1}
    assert not conflicting  # a replayed record is a byte-identical copy: no re-noising
    for role in kind.outputs:  # nothing lost, nothing else (replays de-duplicated)
        assert sorted(set(canonical(outputs[role], source="-"))) == canonical(
            reference.outputs[role], source="-"), role
    print(f"{kind.name}: killed process {kind.victim} after {killed_at} of "
          f"{len(reference.outputs[kind.outputs[0]])} records; resumed from epoch "
          f"{min(resumed)}; {len(main) - len(grouped)} replayed duplicate(s), all "
          f"identical; {replayed} of {reference.counts['events']} events read again")


# --- a shared recovery directory --------------------------------------------------------------


@pytest.mark.integration
def test_processes_sharing_a_recovery_directory_bind_the_instance_process_0_makes(
        broker, tmp_path, cleanup):
    """No DPSTREAM_INSTANCE_ID: process 0 makes a new flow instance in the directory both
    processes use, process 1 waits for its manifest and binds it; one process given a copy of
    the manifest then publishes the very same records."""
    kind, bootstrap = KINDS["counters"], broker.bootstrap
    topics = make_topics(bootstrap, kind)
    produce_steps(bootstrap, topics, kind.events(), range(kind.steps))
    shared = recovery_store(tmp_path / "shared", 2)
    config = write_config(tmp_path / "two.toml", kind, bootstrap, topics, tail=False)
    cluster = start_cluster(kind, config, [shared, shared], tmp_path / "two", None)
    cleanup.extend(cluster)
    outs = finish(cluster)
    bound = [re.findall(r"flow instance ([0-9a-f]{32}) \((new|resumed)", out) for out in outs]
    assert bound[0] and bound[1] and bound[0][0][0] == bound[1][0][0], bound
    assert [b[0][1] for b in bound] == ["new", "resumed"]  # process 0 made it
    two = contents(bootstrap, topics, kind)
    assert two["releases"]

    single = recovery_store(tmp_path / "single", 1)
    shutil.copy2(shared / MANIFEST_NAME, single / MANIFEST_NAME)
    topics_one = make_topics(bootstrap, kind, input_topics(kind, topics))
    config_one = write_config(tmp_path / "one.toml", kind, bootstrap, topics_one, tail=False)
    [out] = finish(start_cluster(kind, config_one, [single], tmp_path / "one", None))
    assert f"flow instance {bound[0][0][0]} (resumed" in out
    one = contents(bootstrap, topics_one, kind, {role: len(two[role]) for role in kind.outputs})
    for role in kind.outputs:
        assert canonical(one[role]) == canonical(two[role]), role
