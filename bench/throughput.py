"""Throughput of the counters flow against a non-private baseline, in the same run (issue 9).

The workload is the issue's: ``--keys`` keys, **one event per key per step**, ``--steps``
one-second steps, spread over 3 input partitions. Two paths, each measured for the DP flow
and for the baseline:

* ``memory``: the real dataflow (parse -> steps -> shards -> encode) fed from prepared
  in-memory batches of raw JSON events (one input partition per batch, as Kafka delivers
  them), one worker; the sink takes the encoded batches (``sink_batches=True``) and counts
  their records.
* ``kafka``: the real dataflow reading a topic of the embedded Kafka-protocol broker to its
  end and writing every record to Kafka topics, one worker.

The baseline is **the same pipeline**: the same clock, the same :class:`ShardState` and
operators, the same bulk encoder and sink; only the shard's key table is a plain exact
count (:class:`PlainTable`: no monitor, no noise, no ledger, every key released every step,
std 0). So DP / baseline is the cost of privacy itself.

Key universes (``--universes``): ``declared`` (the headline: every key is declared and
released from step 0) and ``open`` (keys come from the data and are released once their
threshold monitor fires; the bench's open configuration uses a low threshold, allowed by a
large ``privacy.delta`` and monitor epsilon, so that keys with one event per step are admitted
after about 6 steps: a benchmark setting, not a deployment one; give it ``--open-steps``
steps, e.g. 8). The baseline releases every key at every step in both.

Every run is its own child process (so peak memory is per run); DP and baseline runs are
interleaved and repeated, and the medians are compared. Memory growth is the child's peak
RSS during the run minus its RSS before (the prepared input excluded), in MiB and in bytes
per key; the state is also measured as the pickled size of every shard's snapshot. Usage::

    python bench/throughput.py --keys 100000,1000000 --steps 3 --repeats 3
    python bench/throughput.py --paths kafka --keys 100000 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ORIGIN = 1_790_000_000
ORIGIN_ISO = "2026-09-21T14:13:20Z"
BATCH = 10_000
PARTITIONS = 3
SHARDS = 16
INSTANCE = "bench"  # the flow instance id (first noise coordinate)
DICT_BASELINE = os.environ.get("DPSTREAM_BENCH_DICT_BASELINE") == "1"
"""Index the baseline's keys with a dict (see :class:`PlainTable`)."""


def key_names(keys: int) -> list[str]:
    """The bench's key names."""
    return [f"item-{i:07d}" for i in range(keys)]


def workload(keys: int, steps: int, partitions: int = PARTITIONS) -> list[Any]:
    """Batches of raw events: every key has one event in every one-second step.

    Key ``i`` goes to partition ``i % partitions``; within a step a partition's events are
    spread evenly over the second. Each raw message carries a broker timestamp
    (LogAppendTime) equal to the event time, truncated to the millisecond so that it stays in
    the event's step: every event is counted at its own time. Each batch is a ``RawBatch``
    (a partition's records as columns, as the Kafka source hands them over).
    """
    names = [name.encode() for name in key_names(keys)]
    offsets = [0] * partitions
    batches = []
    for step in range(steps):
        for p in range(partitions):
            mine = names[p::partitions]
            n = len(mine)
            times = [ORIGIN + step + j / n for j in range(n)]
            values = [b'{"key":"%s","ts":%.6f}' % pair for pair in zip(mine, times, strict=True)]
            batches += raw_batches(p, values, offsets[p], np.floor(np.array(times) * 1000))
            offsets[p] += n
    return batches


def raw_batches(partition: int, values: list[bytes], first_offset: int,
                stamps: np.ndarray) -> list[Any]:
    """One partition's consecutive records as ``RawBatch``es of ``BATCH`` records, their
    columns built directly (no tuple per record): the raw ``values``, offsets from
    ``first_offset`` on, the ``events`` role and the broker timestamps ``stamps`` (in ms,
    LogAppendTime)."""
    from dpstream.kinds.counters.events import TIMESTAMP_LOG_APPEND_TIME
    from dpstream.messages import RawBatch

    batches = []
    n = len(values)
    for i in range(0, n, BATCH):
        size = min(BATCH, n - i)
        batches.append(RawBatch(
            partition, values[i:i + size], list(range(first_offset + i, first_offset + i + size)),
            ["events"] * size, stamps[i:i + size].copy(),
            np.full(size, TIMESTAMP_LOG_APPEND_TIME, dtype=np.int64)))
    return batches


def config(universe: str, keys: int, bootstrap: str | None = None,
           topics: dict[str, str] | None = None, steps: int | None = None) -> Any:
    """The bench's counters configuration (``steps``: the Kafka path's flow.end).

    ``universe`` is ``declared`` or ``open`` (pure accounting, the binary tree counter), or
    ``declared-zcdp`` / ``open-zcdp`` (zCDP accounting, the BLT counter).
    """
    from dpstream.platform import parse_config

    mode, _, accounting = universe.partition("-")
    zcdp = accounting == "zcdp"
    raw: dict[str, Any] = {
        "flow": {"name": "bench", "origin": ORIGIN_ISO, "step": "1s", "shards": SHARDS},
        "privacy": {"accounting": "pure", "budget": 1.0, "delta": 1e-6},
        "counter": {"epsilon": 0.7, "horizon": 1 << 20},
        "metrics": {"port": 0},
    }
    if zcdp:
        raw["privacy"]["accounting"] = "zcdp"
        raw["counter"] = {"rho": 0.35, "horizon": 1 << 20}
    if mode == "declared":
        raw["admission"] = {"mode": "declared", "keys": key_names(keys)}
    else:  # a low threshold (a large delta and monitor epsilon): admitted after ~6 events
        raw["privacy"].update(budget=10.0, delta=0.9)
        raw["monitor"] = {"epsilon": 8.0, "horizon": 16, "threshold": 6}
        raw["admission"] = {"mode": "open", "initial_epsilon": 0.3}
        if zcdp:  # the monitor's epsilon costs epsilon^2 / 2 = 32 in rho
            raw["privacy"]["budget"] = 40.0
            raw["admission"] = {"mode": "open", "initial_rho": 0.15}
    if bootstrap:
        assert topics is not None
        # the embedded broker (Tansu) ignores LogAppendTime: trust the bench's own producer,
        # which stamps every record with its event time (see prepare_kafka)
        raw["flow"]["clock"] = "producer"
        assert steps is not None  # a bounded producer-clock run ends at flow.end
        raw["flow"]["end"] = datetime.fromtimestamp(ORIGIN + steps, UTC).isoformat()
        raw["kafka"] = {"brokers": [bootstrap], "input_topic": topics["events"],
                        "releases_topic": topics["releases"], "alerts_topic": topics["alerts"],
                        "dead_letter_topic": topics["dead"], "tail": False, "batch_size": BATCH}
    return parse_config(raw)


# -- the non-private baseline: the same shard with an exact-count table --------------------


class PlainTable:
    """A :class:`~dpstream.core.counting.key_table.KeyTable` that releases exact counts.

    Same interface and row order (new keys of a step sorted and appended; declared keys at
    the first close), the same key index (:class:`~dpstream.core.counting.key_index.KeyIndex`), one
    int64 count per key, and every live key released at every step (std 0, nothing spent):
    what the flow would cost without privacy. The names are a tuple: the garbage collector
    stops tracking it, where a long list would be traversed by every full collection.
    ``DPSTREAM_BENCH_DICT_BASELINE=1`` indexes the keys with a dict instead (faster, about 55
    bytes a key more), to measure what the index costs.
    """

    def __init__(self, spec: Any, noise: Any, declared: list[str] | None = None,
                 state: dict[str, Any] | None = None) -> None:
        from dpstream.core.counting.key_index import KeyIndex

        self._declared = None if declared is None else tuple(declared)
        self._names: tuple[str, ...] = ()
        self.keys: Any = {} if DICT_BASELINE else KeyIndex()
        self._counts = np.zeros(0, dtype=np.int64)
        self.retired: set[str] = set()
        if state is not None:
            self._names = tuple(state["names"])
            self._index_add(self._names)
            self._counts = np.array(state["counts"], dtype=np.int64)

    @staticmethod
    def supports(spec: Any) -> bool:
        """Every specification (nothing of it is used)."""
        return True

    @property
    def live(self) -> int:
        """The number of keys."""
        return len(self._names)

    def idle(self) -> bool:
        """No key in an open universe."""
        return not self._names and self._declared is None

    def close(self, step: int, keys: list[str], increments: np.ndarray) -> Any:
        """Add the increments, release every key's exact count."""
        if self._declared is not None and not self._names:  # the first close: sorted already
            self._add(sorted(self._declared))
        rows = self._rows(keys)
        missing = np.flatnonzero(rows < 0)
        if missing.size:
            self._add(sorted({keys[i] for i in missing.tolist()}))
            rows = self._rows(keys)
        self._counts[rows] += increments  # the keys of a bucket are distinct
        return self._release(step)

    def close_declared(self, step: int, positions: np.ndarray, increments: np.ndarray) -> Any:
        """:meth:`close` by declared position (the declared keys are the first rows)."""
        if not self._names:
            self._add(list(self._declared or ()))  # sorted already
        np.add.at(self._counts, positions, increments)
        return self._release(step)

    def _release(self, step: int) -> Any:
        """Every key's exact count, as the step's outputs."""
        from dpstream.core.counting.outputs import ReleaseColumns, StepOutputs

        out = StepOutputs(step)
        if self._names:
            out.releases.append(ReleaseColumns(
                step=step, keys=self._names, values=self._counts.astype(np.float64), std=0.0,
                mechanism="plain", spent=0.0, budget=0.0, unit="none", delta=0.0))
        return out

    def _rows(self, keys: list[str]) -> np.ndarray:
        if isinstance(self.keys, dict):
            return np.fromiter(map(self.keys.get, keys, repeat(-1)), dtype=np.int64,
                               count=len(keys))
        return self.keys.rows(keys)  # type: ignore[no-any-return]

    def _index_add(self, new: Sequence[str]) -> None:
        if isinstance(self.keys, dict):
            start = len(self.keys)
            self.keys.update(zip(new, range(start, start + len(new)), strict=True))
        else:
            self.keys.append(new)

    def _add(self, new: list[str]) -> None:
        self._index_add(new)
        self._names = self._names + tuple(new)  # earlier releases keep theirs
        self._counts = np.concatenate([self._counts, np.zeros(len(new), dtype=np.int64)])

    def to_state(self) -> dict[str, Any]:
        """The names and counts."""
        return {"names": list(self._names), "counts": self._counts.copy()}


def shard_classes(kind: str, shards: list[Any]) -> type:
    """The flow's ShardState (DP) or the baseline's; every shard built is kept in ``shards``."""
    from dpstream.kinds.counters.shard import ShardState

    class Kept(ShardState):
        if kind == "baseline":
            table_class = PlainTable

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            shards.append(self)

    return Kept


def run_once(path: str, kind: str, universe: str, keys: int, steps: int,
             bootstrap: str | None, topics: dict[str, str] | None) -> dict[str, Any]:
    """One measured run in this process (called in a child)."""
    import gc

    from bytewax.outputs import DynamicSink, StatelessSinkPartition
    from bytewax.testing import run_main

    from dpstream.core.noise.keys import NoiseKey
    from dpstream.io.memory import MemorySource
    from dpstream.platform import build_flow
    from dpstream.stream.encoded import EncodedBatch

    shards: list[Any] = []
    shard_class = shard_classes(kind, shards)
    cfg = config(universe, keys, bootstrap, topics, steps)
    counted = {"records": 0, "batches": 0}

    class Count(StatelessSinkPartition[Any]):
        def write_batch(self, items: list[Any]) -> None:
            for item in items:
                if isinstance(item, EncodedBatch):
                    counted["records"] += len(item)
                    counted["batches"] += 1
                else:
                    counted["records"] += 1

    class CountSink(DynamicSink[Any]):
        def build(self, step_id: str, worker_index: int, worker_count: int) -> Count:
            return Count()

    if path == "memory":
        batches = workload(keys, steps)
        flow = build_flow(cfg, NoiseKey.for_tests(0), instance=INSTANCE, partitions=PARTITIONS,
                          source=MemorySource(batches), sink=CountSink(), sink_batches=True,
                          shard_class=shard_class)
    else:
        flow = build_flow(cfg, NoiseKey.for_tests(0), instance=INSTANCE,
                          shard_class=shard_class)
    gc.collect()
    gc.freeze()  # the prepared input and the configuration are the harness's, not the flow's
    rss_before = _proc_status_mib("VmRSS")
    _reset_peak_rss()
    started, cpu0 = time.perf_counter(), time.process_time()
    run_main(flow)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu0
    peak = _proc_status_mib("VmHWM")
    rss_after = _proc_status_mib("VmRSS")
    state_bytes = sum(len(pickle.dumps(s.to_state(), protocol=5)) for s in shards)
    live = sum(_live(s) for s in shards)
    events = keys * steps
    return {"path": path, "kind": kind, "universe": universe, "keys": keys, "steps": steps,
            "events": events, "seconds": wall, "cpu_seconds": cpu,
            "key_steps_per_second": events / wall,
            "outputs": counted["records"] if path == "memory" else None,
            "output_batches": counted["batches"] if path == "memory" else None,
            "live_keys_at_end": live,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "flow_memory_growth_mib": peak - rss_before,
            "flow_memory_growth_bytes_per_key": (peak - rss_before) * 2**20 / keys,
            "retained_rss_growth_mib": rss_after - rss_before,
            "snapshot_bytes": state_bytes, "snapshot_bytes_per_key": state_bytes / keys}


def breakdown_once(kind: str, universe: str, keys: int, steps: int, trace: bool = False
                   ) -> dict[str, Any]:
    """Where a key-step's time goes: the flow's stages driven without Bytewax (one process).

    The same objects as the dataflow: each input batch through its partition's clock, each
    shard update merged and closed by the shard, each closed step encoded in bulk (and
    dropped). With ``trace``, the memory the flow's objects hold at the end is measured with
    :mod:`tracemalloc` from just after the input is prepared (so the configuration's key list,
    the clocks, the shards' tables, key strings and indexes are counted): the state per key,
    free of the allocator's fragmentation that RSS figures include (times are then slower).
    """
    import gc
    import tracemalloc
    from collections import defaultdict

    from dpstream.core.noise.keys import NoiseKey
    from dpstream.kinds.counters.events import PartitionClock
    from dpstream.kinds.counters.kind import event_rules, statistics_spec
    from dpstream.kinds.counters.records import RecordEncoder
    from dpstream.stream.clock import ShardUpdate

    batches = workload(keys, steps)
    if trace:
        gc.collect()
        tracemalloc.start()
    cfg = config(universe, keys)
    spec = statistics_spec(cfg, INSTANCE)
    declared = cfg.declared_layout  # as keyed_statistics gets it
    shard_class = shard_classes(kind, [])
    clocks = {p: PartitionClock(event_rules(cfg)) for p in range(PARTITIONS)}
    shards = {s: shard_class(spec, PARTITIONS, declared, NoiseKey.for_tests(0), None)
              for s in range(cfg.shards)}
    encoder = RecordEncoder(cfg.name, cfg.origin, cfg.step_seconds, cfg.privacy.delta)
    seconds: dict[str, float] = defaultdict(float)
    outputs = 0
    gc.collect()
    gc.freeze()

    def closed(updates: list[ShardUpdate]) -> None:
        nonlocal outputs
        clock = time.perf_counter
        for update in updates:
            shard = shards[update.shard]
            t0 = clock()
            if shard.shard is None:
                shard.bind(update.shard)
            for step, bucket in update.increments.items():
                shard.merge(step, bucket)
            t1 = clock()
            steps_out = shard.update_batches(ShardUpdate(update.shard, update.partition,
                                                         update.frontier, {}))
            t2 = clock()
            for out in steps_out:
                outputs += len(encoder.encode_step(out))
            t3 = clock()
            seconds["merge"] += t1 - t0
            seconds["close"] += t2 - t1
            seconds["encode"] += t3 - t2

    for batch in batches:
        p = batch.partition
        t0 = time.perf_counter()
        updates, _dead = clocks[p].process(p, batch)
        seconds["clock"] += time.perf_counter() - t0
        closed(updates)
    for clock in clocks.values():
        closed(clock.end_of_input())
    for s in shards.values():
        for out in s.end_of_input_batches():
            outputs += len(encoder.encode_step(out))
    key_steps = keys * steps
    per = {stage: value / key_steps * 1e9 for stage, value in seconds.items()}
    result = {"kind": kind, "universe": universe, "keys": keys, "steps": steps,
              "outputs": outputs, "ns_per_key_step": per,
              "total_ns_per_key_step": sum(per.values())}
    if trace:
        live = sum(_live(s) for s in shards.values())
        gc.collect()  # the encoded records were dropped: the flow's own objects remain
        held, _peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        result.update(state_bytes=held, state_bytes_per_key=held / keys, live_keys=live)
    return result


def _live(shard: Any) -> int:
    if shard.table is not None:
        return int(shard.table.live)
    return len(shard.keys)


def _proc_status_mib(field: str) -> float:
    """A memory figure of this process from /proc/self/status (Linux), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak_rss() -> None:
    """Reset VmHWM so that it measures the flow's run only (Linux clear_refs, value 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def child(args: argparse.Namespace) -> None:
    from dpstream.runner import keep_freed_memory

    keep_freed_memory()  # as `dpstream run` does (DP and baseline alike)
    topics = json.loads(args.topics) if args.topics else None
    if args.one in ("breakdown", "state"):
        result = breakdown_once(args.kind, args.universe, int(args.keys), args.steps,
                                trace=args.one == "state")
    else:
        result = run_once(args.one, args.kind, args.universe, int(args.keys), args.steps,
                          args.bootstrap, topics)
    print(json.dumps(result))


def spawn(path: str, kind: str, universe: str, keys: int, steps: int,
          bootstrap: str | None = None, topics: dict[str, str] | None = None
          ) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", path, "--kind", kind, "--universe", universe,
           "--keys", str(keys), "--steps", str(steps)]
    if bootstrap:
        cmd += ["--bootstrap", bootstrap, "--topics", json.dumps(topics)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                         env=dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1"))
    if out.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def prepare_kafka(keys: int, steps: int) -> Any:
    """Start the broker and load the input topic once (every run reads it to its end)."""
    from confluent_kafka import Producer

    from dpstream.io.broker import EmbeddedBroker
    from dpstream.io.topics import ensure_topics

    broker = EmbeddedBroker().start()
    ensure_topics(broker.bootstrap, {"events": PARTITIONS})
    producer = Producer({"bootstrap.servers": broker.bootstrap, "linger.ms": 50,
                         "batch.num.messages": 10000, "queue.buffering.max.messages": 1000000})
    for batch in workload(keys, steps):
        for p, value, _, _, stamp_ms, _ in batch:  # the record's timestamp is the event time
            while True:
                try:
                    producer.produce("events", value, partition=p, timestamp=stamp_ms)
                    break
                except BufferError:
                    producer.poll(0.05)
        producer.poll(0)
    producer.flush(120)
    return broker


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the DP and baseline runs of one (path, universe, keys, steps)."""
    dp = [r for r in runs if r["kind"] == "dp"]
    base = [r for r in runs if r["kind"] == "baseline"]

    def med(rows: list[dict[str, Any]], field: str) -> float:
        return float(statistics.median(r[field] for r in rows))

    return {
        "path": runs[0]["path"], "universe": runs[0]["universe"], "keys": runs[0]["keys"],
        "steps": runs[0]["steps"], "repeats": len(dp),
        "dp_median_key_steps_per_second": med(dp, "key_steps_per_second"),
        "baseline_median_key_steps_per_second": med(base, "key_steps_per_second"),
        "dp_over_baseline_median_ratio": (med(dp, "key_steps_per_second")
                                          / med(base, "key_steps_per_second")),
        "dp_over_baseline_paired_ratios": [d["key_steps_per_second"] / b["key_steps_per_second"]
                                           for d, b in zip(dp, base, strict=True)],
        "dp_outputs": dp[0]["outputs"], "baseline_outputs": base[0]["outputs"],
        "dp_live_keys_at_end": dp[0]["live_keys_at_end"],
        "dp_flow_memory_growth_mib_median": med(dp, "flow_memory_growth_mib"),
        "dp_flow_memory_growth_bytes_per_key_median": med(dp, "flow_memory_growth_bytes_per_key"),
        "baseline_flow_memory_growth_mib_median": med(base, "flow_memory_growth_mib"),
        "dp_retained_rss_growth_mib_median": med(dp, "retained_rss_growth_mib"),
        "baseline_retained_rss_growth_mib_median": med(base, "retained_rss_growth_mib"),
        "dp_snapshot_bytes_per_key": dp[0]["snapshot_bytes_per_key"],
        "baseline_snapshot_bytes_per_key": base[0]["snapshot_bytes_per_key"],
        "dp_peak_rss_mib_max": max(r["peak_rss_mib"] for r in dp),
    }


def markdown(summary: list[dict[str, Any]]) -> str:
    """The issue's table, re-measured."""
    lines = ["| path | universe | keys × steps | DP flow | non-private baseline | DP / baseline "
             "| DP memory growth (peak) | retained after the run: DP / baseline | DP snapshot |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(
            f"| {s['path']} | {s['universe']} | {s['keys']:,} × {s['steps']} "
            f"| {_rate(s['dp_median_key_steps_per_second'])} "
            f"| {_rate(s['baseline_median_key_steps_per_second'])} "
            f"| {s['dp_over_baseline_median_ratio']:.2f} "
            f"| {s['dp_flow_memory_growth_mib_median']:.0f} MiB "
            f"(≈{s['dp_flow_memory_growth_bytes_per_key_median']:.0f} B per key) "
            f"| {_per_key(s['dp_retained_rss_growth_mib_median'], s['keys'])} / "
            f"{_per_key(s['baseline_retained_rss_growth_mib_median'], s['keys'])} "
            f"| {s['dp_snapshot_bytes_per_key']:.0f} B per key |")
    return "\n".join(lines) + "\n"


def breakdown_table(rows: list[dict[str, Any]]) -> str:
    """Nanoseconds per key-step of each stage (no Bytewax)."""
    if not rows:
        return ""
    lines = ["", "| universe | keys × steps | flow | clock (parse, route) | shard merge "
             "| shard close (key table) | encode | total |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ns = r["ns_per_key_step"]
        lines.append(f"| {r['universe']} | {r['keys']:,} × {r['steps']} | {r['kind']} "
                     f"| {ns['clock']:.0f} ns | {ns['merge']:.0f} ns | {ns['close']:.0f} ns "
                     f"| {ns['encode']:.0f} ns | {r['total_ns_per_key_step']:.0f} ns |")
    return "\n".join(lines) + "\n"


def _per_key(mib: float, keys: int) -> str:
    return f"{mib:.0f} MiB (≈{mib * 2**20 / keys:.0f} B per key)"


def _rate(x: float) -> str:
    return f"{x / 1e6:.2f}M key-steps/s" if x >= 1e6 else f"{x / 1e3:.0f}k key-steps/s"


def measure(path: str, universe: str, keys: int, steps: int, repeats: int
            ) -> list[dict[str, Any]]:
    """Interleaved DP and baseline children of one configuration."""
    from dpstream.io.topics import ensure_topics

    broker = None
    if path == "kafka":
        print(f"loading {keys * steps} events into the embedded broker ...", file=sys.stderr)
        broker = prepare_kafka(keys, steps)
    runs = []
    try:
        for repeat in range(repeats):
            for kind in ("dp", "baseline") if repeat % 2 == 0 else ("baseline", "dp"):
                topics = None
                if broker is not None:
                    tag = f"{universe}-{kind}{repeat}"
                    topics = {"events": "events", "releases": f"releases-{tag}",
                              "alerts": f"alerts-{tag}", "dead": f"dead-{tag}"}
                    ensure_topics(broker.bootstrap, {topics["releases"]: 1,
                                                     topics["alerts"]: 1, topics["dead"]: 1})
                run = spawn(path, kind, universe, keys, steps,
                            broker.bootstrap if broker else None, topics)
                run["repeat"] = repeat
                runs.append(run)
                print(f"{path:6s} {universe:8s} {keys:>9,d} x {steps} {kind:8s} #{repeat}: "
                      f"{run['key_steps_per_second'] / 1e6:.3f} M key-steps/s "
                      f"({run['seconds']:.2f} s, flow memory +"
                      f"{run['flow_memory_growth_mib']:.0f} MiB, {run['outputs']} outputs)",
                      file=sys.stderr)
    finally:
        if broker is not None:
            broker.stop()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", default="memory",
                        help="memory, kafka and/or breakdown (the stages without Bytewax)")
    parser.add_argument("--universes", default="declared",
                        help="declared, open, declared-zcdp and/or open-zcdp (zCDP: BLT counter)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keys", default="100000,1000000",
                        help="comma-separated key counts (one event per key per step)")
    parser.add_argument("--kafka-keys", default="100000")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--open-steps", type=int, default=8,
                        help="steps of the open universe's runs (keys are admitted at ~6)")
    parser.add_argument("--out", default="issue9-throughput")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--universe", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--topics", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        child(args)
        return

    results: dict[str, Any] = {"command": sys.argv[1:], "runs": [], "summary": [],
                               "breakdown": []}
    for path in args.paths.split(","):
        sizes = args.kafka_keys if path == "kafka" else args.keys
        for keys in (int(k) for k in sizes.split(",")):
            for universe in args.universes.split(","):
                steps = args.open_steps if universe.startswith("open") else args.steps
                if path == "breakdown":
                    for kind in ("dp", "baseline"):
                        row = spawn("breakdown", kind, universe, keys, steps)
                        results["breakdown"].append(row)
                        print(f"breakdown {universe} {keys:,} x {steps} {kind}: " + ", ".join(
                            f"{k} {v:.0f}" for k, v in row["ns_per_key_step"].items())
                            + f" ns per key-step (total {row['total_ns_per_key_step']:.0f})",
                            file=sys.stderr)
                    continue
                runs = measure(path, universe, keys, steps, args.repeats)
                results["runs"] += runs
                results["summary"].append(summarize(runs))
    results["machine"] = machine()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=2))
    text = (header(results) + markdown(results["summary"])
            + breakdown_table(results["breakdown"]))
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


def machine() -> dict[str, Any]:
    """Where the figures were measured."""
    import platform
    from datetime import UTC, datetime
    from importlib.metadata import version

    return {"when": datetime.now(UTC).isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "bytewax": version("bytewax"), "numpy": version("numpy"),
            "orjson": version("orjson"), "load_average": os.getloadavg()}


def header(results: dict[str, Any]) -> str:
    """What the tables below measure."""
    m = results["machine"]
    return (
        "# Counters flow throughput: DP against the non-private baseline (issue 9)\n\n"
        f"`python bench/throughput.py {' '.join(results['command'])}` on {m['when']}: "
        f"{m['cpus']} vCPUs, Python {m['python']}, bytewax {m['bytewax']}, numpy {m['numpy']}, "
        f"orjson {m['orjson']}; load average at the end {m['load_average'][0]:.2f}.\n\n"
        "One event per key per step, 3 input partitions, 16 shards, one worker. Each figure "
        "is the median of the repeats; DP and baseline children alternate. The baseline is "
        "the same pipeline (clock, shard, operators, bulk encoder, sink) with an exact-count "
        "table instead of the DP key table (no monitor, noise or ledger; every key released "
        "every step). *Memory growth* is the child's peak RSS during the run minus its RSS "
        "before it (transient buffers included: a step's pending buckets and encoded "
        "records); *retained* is RSS after the run minus before (the keys' state, key strings "
        "and index included); *snapshot* is the pickled size of every shard's snapshot per "
        "key. In the "
        "open universe DP releases only admitted keys (the monitor fires after about 6 "
        "events), the baseline every key.\n\n")


if __name__ == "__main__":
    main()
