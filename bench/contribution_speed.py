"""Throughput of user-level counters against the event-level flow on the same events (issue 24).

The target: ``[contribution] unit = "user"`` at 1 M people and 100 k keys runs at >= 0.7x the
event-level flow's events per second. The method is ``bench/throughput.py``'s memory path:

* the workload: ``--people`` people (1,000,000), each with **one event per step** over
  ``--steps`` one-second steps (3), the event's key drawn uniformly from ``--keys`` declared
  keys (100,000; about ``people / keys`` events a key a step); a person's events go to input
  partition ``person mod 3`` (a topic keyed by person), spread evenly over the second. Every
  record is raw JSON ``{"key": ..., "user": ..., "ts": ...}`` with a broker timestamp
  (LogAppendTime) equal to its event time, in ``RawBatch``es of 10,000 records of one
  partition, as the Kafka source hands them over. The very same batches feed both flows; the
  event-level flow ignores the ``user`` field.
* both flows are the real dataflow (``build_flow``, one worker, the declared universe, pure
  accounting, the binary tree counter, 16 shards, ``sink_batches=True``, the sink counting
  records); the user-level one adds ``[contribution] unit = "user"``, ``max_keys`` (L0 = 8)
  and ``max_per_key`` (Linf = 2): the person-keyed hashing in the step clock, the bounding
  operator (one per person shard) and the re-routing to the key shards. With at most
  ``steps`` events a person nothing is dropped, so both flows count the same events and the
  ratio is the cost of the bounding stage itself.
* every run is its own child process (peak memory per run); user-level and event-level runs
  alternate and are repeated (``--repeats``), and the medians are compared. The run is timed
  from the first record to the end of the input; the flow is built (configuration, declared
  layout) before the timer starts. Memory growth is the child's peak RSS during the run minus
  its RSS before (the prepared input excluded), as in ``bench/throughput.py``.

Usage::

    python bench/contribution_speed.py                       # results/issue24-speed.{md,json}
    python bench/contribution_speed.py --people 100000 --keys 10000 --repeats 1   # quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import throughput  # noqa: E402  (the bench's shared measuring helpers)

RESULTS = HERE / "results"
ORIGIN = throughput.ORIGIN
ORIGIN_ISO = throughput.ORIGIN_ISO
PARTITIONS = throughput.PARTITIONS
SHARDS = throughput.SHARDS
BATCH = throughput.BATCH
INSTANCE = "bench"
MAX_KEYS = 8
MAX_PER_KEY = 2


def workload(people: int, keys: int, steps: int, seed: int = 24) -> list[Any]:
    """One event per person per step, uniform keys, as ``RawBatch``es (module docstring)."""
    rng = np.random.default_rng(seed)
    names = [name.encode() for name in throughput.key_names(keys)]
    users = [f"user-{i:08d}".encode() for i in range(people)]
    offsets = [0] * PARTITIONS
    batches = []
    for step in range(steps):
        chosen = rng.integers(0, keys, size=people)
        for p in range(PARTITIONS):
            mine = np.arange(p, people, PARTITIONS)
            n = mine.size
            times = ORIGIN + step + np.arange(n) / n
            values = [b'{"key":"%s","user":"%s","ts":%.6f}' % (names[k], users[u], t)
                      for k, u, t in zip(chosen[mine].tolist(), mine.tolist(), times.tolist(),
                                         strict=True)]
            batches += throughput.raw_batches(p, values, offsets[p], np.floor(times * 1000))
            offsets[p] += n
    return batches


def config(unit: str, keys: int) -> Any:
    """``bench/throughput.py``'s declared configuration, with ``[contribution]`` at ``user``."""
    from dpstream.platform import parse_config

    raw: dict[str, Any] = {
        "flow": {"name": "bench", "origin": ORIGIN_ISO, "step": "1s", "shards": SHARDS},
        "privacy": {"accounting": "pure", "budget": 1.0, "delta": 1e-6},
        "counter": {"epsilon": 0.7, "horizon": 1 << 20},
        "admission": {"mode": "declared", "keys": throughput.key_names(keys)},
        "metrics": {"port": 0},
    }
    if unit == "user":
        raw["contribution"] = {"unit": "user", "user_field": "user", "max_keys": MAX_KEYS,
                               "max_per_key": MAX_PER_KEY}
    return parse_config(raw)


def run_once(unit: str, people: int, keys: int, steps: int) -> dict[str, Any]:
    """One measured run in this process (called in a child)."""
    import gc

    from bytewax.outputs import DynamicSink, StatelessSinkPartition
    from bytewax.testing import run_main

    from dpstream.core.noise.keys import NoiseKey
    from dpstream.io.memory import MemorySource
    from dpstream.platform import build_flow
    from dpstream.stream.encoded import EncodedBatch

    counted = {"records": 0}

    class Count(StatelessSinkPartition[Any]):
        def write_batch(self, items: list[Any]) -> None:
            for item in items:
                counted["records"] += len(item) if isinstance(item, EncodedBatch) else 1

    class CountSink(DynamicSink[Any]):
        def build(self, step_id: str, worker_index: int, worker_count: int) -> Count:
            return Count()

    batches = workload(people, keys, steps)
    cfg = config(unit, keys)
    flow = build_flow(cfg, NoiseKey.for_tests(0), instance=INSTANCE, partitions=PARTITIONS,
                      source=MemorySource(batches), sink=CountSink(), sink_batches=True)
    gc.collect()
    gc.freeze()  # the prepared input and the configuration are the harness's, not the flow's
    rss_before = throughput._proc_status_mib("VmRSS")
    throughput._reset_peak_rss()
    started, cpu0 = time.perf_counter(), time.process_time()
    run_main(flow)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu0
    peak = throughput._proc_status_mib("VmHWM")
    events = people * steps
    return {"unit": unit, "people": people, "keys": keys, "steps": steps, "events": events,
            "seconds": wall, "cpu_seconds": cpu, "events_per_second": events / wall,
            "events_per_cpu_second": events / cpu,
            "outputs": counted["records"], "flow_memory_growth_mib": peak - rss_before,
            "flow_memory_growth_bytes_per_person": (peak - rss_before) * 2**20 / people}


def hashing_cost(people: int, steps: int) -> dict[str, float]:
    """The person hashing alone (``PersonHasher.hash_many`` over the workload's ids in the
    clock's batches of 10,000), nanoseconds an event: a floor under the user level's extra
    cost per event, whatever the rest of the stage does."""
    from dpstream.core.contribution.people import PersonHasher

    hasher = PersonHasher(b"bench-person-key-0123456789abcdef")
    ids = [f"user-{i:08d}" for i in range(people)]
    best = math.inf
    for _ in range(3):
        started = time.perf_counter()
        for i in range(0, people, BATCH):
            hasher.hash_many(ids[i:i + BATCH])
        best = min(best, time.perf_counter() - started)
    return {"hash_ns_per_event": best / people * 1e9}


def spawn(unit: str, people: int, keys: int, steps: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", unit, "--people", str(people), "--keys",
           str(keys), "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                         env=dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1"))
    if out.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the user-level and event-level runs, and their ratio."""
    user = [r for r in runs if r["unit"] == "user"]
    event = [r for r in runs if r["unit"] == "event"]

    def med(rows: list[dict[str, Any]], field: str) -> float:
        return float(statistics.median(r[field] for r in rows))

    ratio = med(user, "events_per_second") / med(event, "events_per_second")
    return {"people": runs[0]["people"], "keys": runs[0]["keys"], "steps": runs[0]["steps"],
            "events": runs[0]["events"], "repeats": len(user),
            "user_median_events_per_second": med(user, "events_per_second"),
            "event_median_events_per_second": med(event, "events_per_second"),
            "user_over_event_median_ratio": ratio,
            "user_over_event_paired_ratios": [u["events_per_second"] / e["events_per_second"]
                                              for u, e in zip(user, event, strict=True)],
            "target": 0.7, "met": ratio >= 0.7,
            "user_cpu_ns_per_event": 1e9 / med(user, "events_per_cpu_second"),
            "event_cpu_ns_per_event": 1e9 / med(event, "events_per_cpu_second"),
            "user_over_event_cpu_ratio": (med(user, "events_per_cpu_second")
                                          / med(event, "events_per_cpu_second")),
            "user_outputs": user[0]["outputs"], "event_outputs": event[0]["outputs"],
            "user_memory_growth_mib_median": med(user, "flow_memory_growth_mib"),
            "event_memory_growth_mib_median": med(event, "flow_memory_growth_mib"),
            "user_memory_growth_bytes_per_person_median":
                med(user, "flow_memory_growth_bytes_per_person")}


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        "# User-level counters against the event-level flow on the same events (issue 24)", "",
        f"`python bench/contribution_speed.py {' '.join(results['command'])}` on {m['when']}: "
        f"{m['cpus']} vCPUs (shared), Python {m['python']}, bytewax {m['bytewax']}, numpy "
        f"{m['numpy']}; load average at the end {m['load_average'][0]:.2f}.", "",
        "One event per person per step, uniform keys, 3 input partitions keyed by person, 16 "
        f"shards, one worker; user level: L0 = {MAX_KEYS}, Linf = {MAX_PER_KEY} (nothing is "
        "dropped: the ratio is the bounding stage's cost). Medians of the repeats; the two "
        "units' children alternate. Memory growth: the child's peak RSS during the run minus "
        "its RSS before. *Per CPU second*: the ratio of events per second of the process's CPU "
        "time (less sensitive to the other load of a shared machine than the wall-clock "
        "ratio, which is the headline).", "",
        "| people × steps (events) | keys | user level | event level | user / event "
        "(target ≥ 0.7) | paired ratios | per CPU second: user / event "
        "| memory growth: user / event | outputs: user / event |",
        "|---|---|---|---|---|---|---|---|---|"]
    for s in results["summary"]:
        lines.append(
            f"| {s['people']:,} × {s['steps']} ({s['events']:,}) | {s['keys']:,} "
            f"| {s['user_median_events_per_second'] / 1e3:.0f}k events/s "
            f"| {s['event_median_events_per_second'] / 1e3:.0f}k events/s "
            f"| **{s['user_over_event_median_ratio']:.2f}** ({'met' if s['met'] else 'missed'}) "
            f"| {', '.join(f'{x:.2f}' for x in s['user_over_event_paired_ratios'])} "
            f"| {s['user_over_event_cpu_ratio']:.2f} "
            f"| {s['user_memory_growth_mib_median']:.0f} MiB "
            f"(≈{s['user_memory_growth_bytes_per_person_median']:.0f} B a person) / "
            f"{s['event_memory_growth_mib_median']:.0f} MiB "
            f"| {s['user_outputs']:,} / {s['event_outputs']:,} |")
    for s in results["summary"]:
        event_ns = s["event_cpu_ns_per_event"]
        rest = s["user_cpu_ns_per_event"] - event_ns - s["hash_ns_per_event"]
        lines += ["", f"Person hashing alone (the keyed 128-bit CBC-MAC per id, "
                  f"`PersonHasher.hash_many` in batches of {BATCH:,}, best of 3 in the parent): "
                  f"**{s['hash_ns_per_event']:.0f} ns an event**, against "
                  f"{s['event_cpu_ns_per_event']:.0f} ns of CPU an event for the whole "
                  "event-level flow; with nothing but the hashing added, the ratio could be at "
                  f"most {s['ratio_bound_if_only_hashing_added']:.2f}. The user level's other "
                  "extra work (the bounding operator, the re-routing, the second barrier) "
                  f"costs about {rest:.0f} ns an event (CPU time: the user level's "
                  f"{s['user_cpu_ns_per_event']:.0f} ns an event less the event level's "
                  f"{event_ns:.0f} and the hashing's): with free hashing the ratio would be "
                  f"about {event_ns / (event_ns + rest):.2f}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--people", default="1000000", help="comma-separated people counts")
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="issue24-speed")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        from dpstream.runner import keep_freed_memory

        keep_freed_memory()  # as `dpstream run` does (both units alike)
        print(json.dumps(run_once(args.one, int(args.people), args.keys, args.steps)))
        return
    results: dict[str, Any] = {"command": sys.argv[1:], "runs": [], "summary": []}
    for people in (int(p) for p in args.people.split(",")):
        runs = []
        for repeat in range(args.repeats):
            for unit in ("user", "event") if repeat % 2 == 0 else ("event", "user"):
                run = spawn(unit, people, args.keys, args.steps)
                run["repeat"] = repeat
                runs.append(run)
                print(f"{people:>9,d} people x {args.steps} {unit:5s} #{repeat}: "
                      f"{run['events_per_second'] / 1e3:.0f}k events/s ({run['seconds']:.2f} s, "
                      f"memory +{run['flow_memory_growth_mib']:.0f} MiB, {run['outputs']} "
                      "outputs)", file=sys.stderr)
        results["runs"] += runs
        summary = summarize(runs)
        summary.update(hashing_cost(people, args.steps))
        event_ns = summary["event_cpu_ns_per_event"]
        summary["hash_share_of_event_level_ns"] = summary["hash_ns_per_event"] / event_ns
        summary["ratio_bound_if_only_hashing_added"] = event_ns / (
            event_ns + summary["hash_ns_per_event"])
        results["summary"].append(summary)
    results["machine"] = throughput.machine()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=2))
    text = markdown(results)
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
