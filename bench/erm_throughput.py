"""Throughput of the ERM flow (d = 64) against a non-private baseline, in the same run.

The real dataflow (decode JSON -> steps -> model-stream shards -> release schedule -> encode)
is fed prepared in-memory batches of raw JSON events (three input partitions, as Kafka
delivers them), one worker, output counted. Two kinds of run, interleaved and repeated:

* ``dp``: the flow as shipped (continual release: Algorithm 4 with Algorithm 2's bases; every
  model solved to its certificate, rounded to its grid and noised exactly);
* ``baseline``: the same pipeline and the same schedule, with the private trainer replaced by
  the plain L-BFGS fit of the same objective (no certificate, no grid, no noise): what the flow
  would cost without privacy.

Every run is its own child process (peak memory per run). Usage::

    OPENBLAS_NUM_THREADS=1 python bench/erm_throughput.py               # 3 repeats
    OPENBLAS_NUM_THREADS=1 python bench/erm_throughput.py --repeats 1 --events 200000
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
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
D = 64


def workload(events: int, steps: int, partitions: int = 3, seed: int = 0
             ) -> list[list[tuple[int, bytes, int, str, int, int]]]:
    """Batches of raw labelled events (d = 64 features) spread evenly over one-second steps."""
    from dpstream.messages import TIMESTAMP_LOG_APPEND_TIME

    rng = random.Random(seed)
    w = [rng.gauss(0, 1) for _ in range(D)]
    per_partition = events // steps // partitions
    offsets = [0] * partitions
    batches = []
    for step in range(steps):
        for p in range(partitions):
            rows = []
            for j in range(per_partition):
                ts = ORIGIN + step + j / per_partition
                x = [round(rng.gauss(0, 1), 4) for _ in range(D)]
                label = "yes" if sum(a * b for a, b in zip(w, x, strict=True)) > 0 else "no"
                body = json.dumps({"features": x, "label": label, "ts": round(ts, 6)})
                rows.append((p, body.encode(), offsets[p], "events", math.floor(ts * 1000),
                             TIMESTAMP_LOG_APPEND_TIME))
                offsets[p] += 1
            batches += [rows[i:i + BATCH] for i in range(0, len(rows), BATCH)]
    return batches


def config(block_size: int) -> Any:
    from dpstream.platform import parse_config

    return parse_config({
        "flow": {"kind": "erm", "name": "bench", "origin": "2026-09-21T14:13:20Z",
                 "step": "1s", "shards": 1},
        "privacy": {"accounting": "pure", "epsilon": 1.0},
        "model": {"classes": ["no", "yes"], "dimension": D, "clip_norm": 12.0,
                  "regularization": 0.01},
        "release": {"algorithm": "continual", "block_size": block_size, "base_blocks": 4},
        "metrics": {"port": 0},
    })


def plain_train() -> Any:
    """The baseline's trainer: the same objective, plain L-BFGS, released as is."""
    from fractions import Fraction

    import numpy as np
    from scipy.optimize import minimize

    from dpstream.core.erm.model import PrivateModel

    def train(spec: Any, block: Any, *, normalizer: float, center: Any, level: Any,
              rng: Any) -> Any:
        rows, columns = spec.rows, spec.columns
        c = np.zeros((rows, columns)) if center is None else np.asarray(center)
        z, y = block.z, block.y
        sign = np.where(y == 1, 1.0, -1.0)
        lam = float(spec.regularization)

        def objective(flat: Any) -> tuple[float, Any]:
            w = flat.reshape(rows, columns)
            margin = sign * (z @ w[0])
            loss = np.logaddexp(0.0, -margin).sum() / normalizer
            g = -(sign / (1.0 + np.exp(margin))) @ z / normalizer
            diff = w - c
            return (loss + 0.5 * lam * float((diff * diff).sum()),
                    (g[None, :] + lam * diff).ravel())

        res = minimize(objective, c.ravel(), jac=True, method="L-BFGS-B",
                       options={"gtol": 1e-8})
        params = res.x.reshape(rows, columns)
        return PrivateModel(params=params, grid=Fraction(1), noise_std=0.0,
                            cost=level.cost_at(spec, spec.sensitivity(normalizer)),
                            sensitivity=spec.sensitivity(normalizer),
                            normalizer=normalizer, size=int(y.shape[0]))

    return train


def run_once(kind: str, events: int, steps: int) -> dict[str, Any]:
    """One measured run in this process (called in a child)."""
    import gc
    import resource

    from bytewax.outputs import DynamicSink, StatelessSinkPartition
    from bytewax.testing import run_main

    from dpstream.core.noise.keys import NoiseKey
    from dpstream.io.memory import MemorySource
    from dpstream.platform import build_flow

    cfg = config(block_size=events // steps)
    counted = [0]

    class Count(StatelessSinkPartition[Any]):
        def write_batch(self, items: list[Any]) -> None:
            counted[0] += len(items)

    class CountSink(DynamicSink[Any]):
        def build(self, step_id: str, worker_index: int, worker_count: int) -> Count:
            return Count()

    batches = workload(events, steps)
    gc.freeze()
    options = {"train": plain_train()} if kind == "baseline" else {}
    flow = build_flow(cfg, NoiseKey.for_tests(0), instance="bench", partitions=3,
                      source=MemorySource(batches), sink=CountSink(), **options)
    started, cpu0 = time.perf_counter(), time.process_time()
    run_main(flow)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu0
    return {"kind": kind, "events": events, "steps": steps, "d": D, "seconds": wall,
            "cpu_seconds": cpu, "events_per_second": events / wall, "models": counted[0],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def spawn(kind: str, events: int, steps: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", kind, "--events", str(events),
           "--steps", str(steps)]
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=600_000)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", choices=("dp", "baseline"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_once(args.one, args.events, args.steps)))
        return
    runs: dict[str, list[dict[str, Any]]] = {"dp": [], "baseline": []}
    for r in range(args.repeats):
        for kind in ("dp", "baseline") if r % 2 == 0 else ("baseline", "dp"):
            result = spawn(kind, args.events, args.steps)
            runs[kind].append(result)
            print(f"{kind:8s} {result['events_per_second']:>10,.0f} events/s  "
                  f"{result['models']} models  {result['peak_rss_mib']:.0f} MiB peak",
                  flush=True)
    median = {k: statistics.median(r["events_per_second"] for r in v) for k, v in runs.items()}
    ratio = median["dp"] / median["baseline"]
    lines = ["# ERM flow throughput (issue 8)", "",
             f"In-memory path, one worker, d = {D}, {args.events:,} events over {args.steps} "
             f"one-second steps (b0 = {args.events // args.steps:,} per block), continual "
             f"release (Algorithm 4 + 2), {args.repeats} interleaved repeats; medians.", "",
             "| run | events/s | peak RSS MiB |", "|---|---|---|"]
    for kind, rs in runs.items():
        lines.append(f"| {kind} | {median[kind]:,.0f} | "
                     f"{statistics.median(r['peak_rss_mib'] for r in rs):.0f} |")
    lines += ["", f"DP / baseline = {ratio:.2f}; target >= 50,000 events/s per worker."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "issue8-erm-throughput.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "issue8-erm-throughput.json").write_text(json.dumps(runs, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
