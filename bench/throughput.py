"""Throughput of the counters flow against a non-private baseline, in the same run.

Two paths, each measured for the DP flow and for the baseline:

* ``memory``: the real dataflow (parse -> steps -> shards -> encode) fed from prepared
  in-memory batches of raw JSON events (one input partition per batch, as Kafka delivers
  them), one worker, output counted.
* ``kafka``: the real dataflow reading a topic of the embedded Kafka-protocol broker to its
  end and writing every record to Kafka topics, one worker.

The baseline is the same pipeline with every key's statistics replaced by plain, exact
counts (no monitor, no noise, no ledger): what the flow would cost without privacy.

Every run is its own child process (so peak memory is per run), DP and baseline runs are
interleaved, and each is repeated; the medians are compared. Usage::

    python bench/throughput.py                 # both paths, 5 repeats
    python bench/throughput.py --paths memory --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ORIGIN = 1_790_000_000
BATCH = 10_000
INSTANCE = "bench"  # the flow instance id (first noise coordinate)


def workload(events: int, keys: int, steps: int, partitions: int = 3,
             seed: int = 0) -> list[list[tuple[int, bytes, int, str, int, int]]]:
    """Batches of raw events: ``events`` spread evenly over ``steps`` one-second steps.

    Each raw message carries a broker timestamp (LogAppendTime) equal to the event time,
    truncated to the millisecond so that it stays in the event's step: every event is
    counted at its own time, as a broker stamping it on arrival would.
    """
    from dpstream.stream.events import TIMESTAMP_LOG_APPEND_TIME

    rng = random.Random(seed)
    names = [f"item-{i:05d}" for i in range(keys)]
    per_step = events // steps
    per_partition = per_step // partitions
    offsets = [0] * partitions
    batches = []
    for step in range(steps):
        for p in range(partitions):
            rows = []
            for j in range(per_partition):
                ts = ORIGIN + step + j / per_partition
                rows.append((p, b'{"key":"%s","ts":%.6f}' % (names[rng.randrange(keys)].encode(),
                                                             ts), offsets[p], "events",
                             math.floor(ts * 1000), TIMESTAMP_LOG_APPEND_TIME))
                offsets[p] += 1
            batches += [rows[i:i + BATCH] for i in range(0, len(rows), BATCH)]
    return batches


def config(bootstrap: str | None = None, topics: dict[str, str] | None = None) -> Any:
    from dpstream.config import parse_config

    raw: dict[str, Any] = {
        "flow": {"name": "bench", "origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 16},
        "privacy": {"accounting": "pure", "budget": 1.0, "delta": 1e-6},
        "counter": {"epsilon": 0.7, "horizon": 1 << 20},
        "monitor": {"epsilon": 0.1, "horizon": 3600},
        "admission": {"mode": "open", "initial_epsilon": 0.2},
        "metrics": {"port": 0},
    }
    if bootstrap:
        assert topics is not None
        # the embedded broker (Tansu) ignores LogAppendTime: trust the bench's own producer,
        # which stamps every record with its event time (see prepare_kafka)
        raw["flow"]["clock"] = "producer"
        raw["kafka"] = {"brokers": [bootstrap], "input_topic": topics["events"],
                        "releases_topic": topics["releases"], "alerts_topic": topics["alerts"],
                        "dead_letter_topic": topics["dead"], "tail": False, "batch_size": BATCH}
    return parse_config(raw)


def baseline_shard_class() -> type:
    """ShardState whose keys release exact counts: the non-private baseline."""
    from dpstream.core.key_statistics import Release
    from dpstream.stream.shard import ShardState

    class PlainCount:
        expired = False  # never forgotten (not admitted in time) ...
        retired = False  # ... nor retired (budget exhausted): counted for ever

        def __init__(self, key: str, step: int) -> None:
            self.key, self.next_step, self.total = key, step, 0

        def step(self, increment: int) -> list[Release]:
            step, self.next_step = self.next_step, self.next_step + 1
            self.total += increment
            return [Release(self.key, step, float(self.total), 0.0, "plain", 0.0, 0.0, "none",
                            0.0)]

        def to_state(self) -> dict[str, int]:
            return {"next_step": self.next_step, "total": self.total}

    class PlainShard(ShardState):
        def _new_key(self, key: str, step: int) -> Any:
            return PlainCount(key, step)

    return PlainShard


def run_once(path: str, kind: str, events: int, keys: int, steps: int,
             bootstrap: str | None, topics: dict[str, str] | None) -> dict[str, Any]:
    """One measured run in this process (called in a child)."""
    import gc

    from bytewax.outputs import DynamicSink, StatelessSinkPartition
    from bytewax.testing import run_main

    from dpstream.core.noise import NoiseKey
    from dpstream.io.memory import MemorySource
    from dpstream.platform import build_flow
    from dpstream.stream.shard import ShardState

    shard_class = baseline_shard_class() if kind == "baseline" else ShardState
    cfg = config(bootstrap, topics)
    counted = [0]

    class Count(StatelessSinkPartition[Any]):
        def write_batch(self, items: list[Any]) -> None:
            counted[0] += len(items)

    class CountSink(DynamicSink[Any]):
        def build(self, step_id: str, worker_index: int, worker_count: int) -> Count:
            return Count()

    if path == "memory":
        batches = workload(events, keys, steps)
        gc.freeze()  # the prepared input is the harness's, not the flow's, memory
        flow = build_flow(cfg, NoiseKey.for_tests(0), instance=INSTANCE, partitions=3,
                          source=MemorySource(batches), sink=CountSink(),
                          shard_class=shard_class)
    else:
        flow = build_flow(cfg, NoiseKey.for_tests(0), instance=INSTANCE,
                          shard_class=shard_class)
    rss_before = _proc_status_mib("VmRSS")
    _reset_peak_rss()
    started, cpu0 = time.perf_counter(), time.process_time()
    run_main(flow)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu0
    growth = _proc_status_mib("VmHWM") - rss_before
    return {"path": path, "kind": kind, "events": events, "keys": keys, "steps": steps,
            "seconds": wall, "cpu_seconds": cpu, "events_per_second": events / wall,
            "outputs": counted[0] if path == "memory" else None,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "flow_memory_growth_mib": growth}


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
    topics = json.loads(args.topics) if args.topics else None
    result = run_once(args.one, args.kind, args.events, args.keys, args.steps, args.bootstrap,
                      topics)
    print(json.dumps(result))


def spawn(path: str, kind: str, events: int, keys: int, steps: int,
          bootstrap: str | None = None, topics: dict[str, str] | None = None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", path, "--kind", kind, "--events", str(events),
           "--keys", str(keys), "--steps", str(steps)]
    if bootstrap:
        cmd += ["--bootstrap", bootstrap, "--topics", json.dumps(topics)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                         env=dict(os.environ, PYTHONHASHSEED="0"))
    if out.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def prepare_kafka(events: int, keys: int, steps: int) -> tuple[Any, dict[str, dict[str, str]]]:
    """Start the broker, load the input topic once, make output topics for every run."""
    from confluent_kafka import Producer

    from dpstream.io.broker import EmbeddedBroker
    from dpstream.io.topics import ensure_topics

    broker = EmbeddedBroker().start()
    ensure_topics(broker.bootstrap, {"events": 3})
    producer = Producer({"bootstrap.servers": broker.bootstrap, "linger.ms": 50,
                         "batch.num.messages": 10000, "queue.buffering.max.messages": 1000000})
    for batch in workload(events, keys, steps):
        for p, value, _, _, stamp_ms, _ in batch:  # the record's timestamp is the event time
            while True:
                try:
                    producer.produce("events", value, partition=p, timestamp=stamp_ms)
                    break
                except BufferError:
                    producer.poll(0.05)
        producer.poll(0)
    producer.flush(60)
    return broker, {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", default="memory,kafka")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--events", type=int, default=4_000_000)
    parser.add_argument("--kafka-events", type=int, default=2_000_000)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--topics", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        child(args)
        return

    from dpstream.io.topics import ensure_topics

    results: dict[str, Any] = {"runs": [], "summary": {}}
    for path in args.paths.split(","):
        events = args.events if path == "memory" else args.kafka_events
        broker = None
        if path == "kafka":
            print(f"loading {events} events into the embedded broker ...", file=sys.stderr)
            broker, _ = prepare_kafka(events, args.keys, args.steps)
        try:
            for repeat in range(args.repeats):
                for kind in ("dp", "baseline") if repeat % 2 == 0 else ("baseline", "dp"):
                    topics = None
                    if broker is not None:
                        tag = f"{kind}{repeat}"
                        topics = {"events": "events", "releases": f"releases-{tag}",
                                  "alerts": f"alerts-{tag}", "dead": f"dead-{tag}"}
                        ensure_topics(broker.bootstrap, {topics["releases"]: 1,
                                                         topics["alerts"]: 1, topics["dead"]: 1})
                    run = spawn(path, kind, events, args.keys, args.steps,
                                broker.bootstrap if broker else None, topics)
                    run["repeat"] = repeat
                    results["runs"].append(run)
                    print(f"{path:6s} {kind:8s} #{repeat}: {run['events_per_second'] / 1e6:.3f} M "
                          f"events/s ({run['seconds']:.2f} s, flow memory +"
                          f"{run['flow_memory_growth_mib']:.0f} MiB)", file=sys.stderr)
        finally:
            if broker is not None:
                broker.stop()
        runs = [r for r in results["runs"] if r["path"] == path]
        dp = [r["events_per_second"] for r in runs if r["kind"] == "dp"]
        base = [r["events_per_second"] for r in runs if r["kind"] == "baseline"]
        paired = [d / b for d, b in zip(dp, base, strict=True)]
        results["summary"][path] = {
            "events": events, "keys": args.keys, "steps": args.steps,
            "dp_median_events_per_second": statistics.median(dp),
            "baseline_median_events_per_second": statistics.median(base),
            "dp_over_baseline_median_ratio": statistics.median(dp) / statistics.median(base),
            "dp_over_baseline_paired_ratios": paired,
            "dp_best_events_per_second": max(dp),
            "dp_peak_rss_mib_max": max(r["peak_rss_mib"] for r in runs if r["kind"] == "dp"),
            "baseline_peak_rss_mib_max": max(r["peak_rss_mib"] for r in runs
                                             if r["kind"] == "baseline"),
            "dp_flow_memory_growth_mib_median": statistics.median(
                r["flow_memory_growth_mib"] for r in runs if r["kind"] == "dp"),
            "baseline_flow_memory_growth_mib_median": statistics.median(
                r["flow_memory_growth_mib"] for r in runs if r["kind"] == "baseline"),
        }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "throughput.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results["summary"], indent=2))


if __name__ == "__main__":
    main()
