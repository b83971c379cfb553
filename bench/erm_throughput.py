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

Issue 25 (``--kinds baseline,output,objective --window 8 --recovery --out
issue25-throughput``): the private flow with each learner named (``model.learner``:
``output`` is the output perturbation of issue 8, ``objective`` the certified objective
perturbation), with ``release.max_history`` blocks of history, and a recovery directory so
that the history goes to the shard's file store and Bytewax snapshots every
``--snapshot-interval`` seconds, as ``dpstream run`` does; the baseline gets the same
settings. ``dp`` is the flow with the configuration's default learner.
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
KINDS = ("dp", "output", "objective", "baseline")


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


def config(block_size: int, learner: str | None = None, window: int | None = None) -> Any:
    from dpstream.platform import parse_config

    model: dict[str, Any] = {"classes": ["no", "yes"], "dimension": D, "clip_norm": 12.0,
                             "regularization": 0.01}
    release: dict[str, Any] = {"algorithm": "continual", "block_size": block_size,
                               "base_blocks": 4}
    if learner is not None:
        model["learner"] = learner
    if window:
        release["max_history"] = window
    return parse_config({
        "flow": {"kind": "erm", "name": "bench", "origin": "2026-09-21T14:13:20Z",
                 "step": "1s", "shards": 1},
        "privacy": {"accounting": "pure", "epsilon": 1.0},
        "model": model, "release": release, "metrics": {"port": 0},
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


def run_once(kind: str, events: int, steps: int, window: int = 0, recovery: bool = False,
             snapshot_interval: float = 5.0) -> dict[str, Any]:
    """One measured run in this process (called in a child)."""
    import gc
    import resource
    import tempfile
    from datetime import timedelta

    from bytewax.outputs import DynamicSink, StatelessSinkPartition
    from bytewax.testing import run_main

    from dpstream.core.noise.keys import NoiseKey
    from dpstream.io.memory import MemorySource
    from dpstream.platform import build_flow

    learner = kind if kind in ("output", "objective") else None
    cfg = config(events // steps, learner, window)
    counted = [0]

    class Count(StatelessSinkPartition[Any]):
        def write_batch(self, items: list[Any]) -> None:
            counted[0] += len(items)

    class CountSink(DynamicSink[Any]):
        def build(self, step_id: str, worker_index: int, worker_count: int) -> Count:
            return Count()

    batches = workload(events, steps)
    gc.freeze()
    options: dict[str, Any] = {"train": plain_train()} if kind == "baseline" else {}
    kwargs: dict[str, Any] = {}
    if recovery:  # snapshots as `dpstream run` takes them; the shard's history files under it
        from bytewax.recovery import RecoveryConfig, init_db_dir

        directory = Path(tempfile.mkdtemp(prefix="dpstream-bench-recovery-"))
        init_db_dir(directory, 1)  # type: ignore[no-untyped-call]
        kwargs = {"epoch_interval": timedelta(seconds=snapshot_interval),
                  "recovery_config": RecoveryConfig(directory)}  # type: ignore[no-untyped-call]
        options["recovery_dir"] = str(directory)
    flow = build_flow(cfg, NoiseKey.for_tests(0), instance="bench", partitions=3,
                      source=MemorySource(batches), sink=CountSink(), **options)
    started, cpu0 = time.perf_counter(), time.process_time()
    run_main(flow, **kwargs)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu0
    if recovery:
        import shutil

        shutil.rmtree(directory)
    return {"kind": kind, "events": events, "steps": steps, "d": D, "seconds": wall,
            "window": window or None, "recovery": recovery,
            "cpu_seconds": cpu, "events_per_second": events / wall, "models": counted[0],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def spawn(kind: str, events: int, steps: int, extra: list[str] | None = None
          ) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", kind, "--events", str(events),
           "--steps", str(steps), *(extra or [])]
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
    parser.add_argument("--kinds", default="dp,baseline",
                        help="runs, interleaved: dp (the default learner), output, objective, "
                             "baseline")
    parser.add_argument("--window", type=int, default=0, help="release.max_history (0: none)")
    parser.add_argument("--recovery", action="store_true",
                        help="run with a recovery directory (snapshots, file history store)")
    parser.add_argument("--snapshot-interval", type=float, default=5.0)
    parser.add_argument("--out", default="issue8-erm-throughput")
    parser.add_argument("--render", action="store_true",
                        help="rewrite the summary from results/<out>.json (no new runs)")
    parser.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.render:
        render(json.loads((RESULTS / f"{args.out}.json").read_text()), args)
        return
    if args.one:
        print(json.dumps(run_once(args.one, args.events, args.steps, args.window,
                                  args.recovery, args.snapshot_interval)))
        return
    kinds = args.kinds.split(",")
    extra = ["--window", str(args.window), "--snapshot-interval", str(args.snapshot_interval),
             *(["--recovery"] if args.recovery else [])]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for r in range(args.repeats):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            result = spawn(kind, args.events, args.steps, extra)
            runs[kind].append(result)
            print(f"{kind:8s} {result['events_per_second']:>10,.0f} events/s  "
                  f"{result['models']} models  {result['peak_rss_mib']:.0f} MiB peak",
                  flush=True)
    render(runs, args)


def render(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    """The summary (medians; ratios to the baseline by wall clock and by CPU time)."""
    median = {k: statistics.median(r["events_per_second"] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["events"] / r["cpu_seconds"] for r in v)
           for k, v in runs.items()}
    settings = ""
    if args.window or args.recovery:
        settings = (f" release.max_history = {args.window or 'none'}"
                    + (f", with a recovery directory (snapshots every "
                       f"{args.snapshot_interval:g} s)" if args.recovery else "") + ";")
    lines = [f"# ERM flow throughput ({args.out.split('-')[0]})", "",
             f"In-memory path, one worker, d = {D}, {args.events:,} events over {args.steps} "
             f"one-second steps (b0 = {args.events // args.steps:,} per block), continual "
             f"release (Algorithm 4 + 2),{settings} {args.repeats} interleaved repeats; "
             "medians. Events per CPU second: the worker process's CPU time (less "
             "sensitive than the wall clock to the other load of a shared machine).", "",
             "| run | events/s (wall) | / baseline | events per CPU s | / baseline | "
             "peak RSS MiB | runs (events/s, wall) |", "|---|---|---|---|---|---|---|"]
    for kind, rs in runs.items():
        wall_ratio = cpu_ratio = "–"
        if "baseline" in runs:
            wall_ratio = f"{median[kind] / median['baseline']:.2f}"
            cpu_ratio = f"{cpu[kind] / cpu['baseline']:.2f}"
        each = ", ".join(f"{r['events_per_second']:,.0f}" for r in rs)
        lines.append(f"| {kind} | {median[kind]:,.0f} | {wall_ratio} | {cpu[kind]:,.0f} | "
                     f"{cpu_ratio} | {statistics.median(r['peak_rss_mib'] for r in rs):.0f} | "
                     f"{each} |")
    lines += ["", "Target >= 50,000 events/s per worker."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{args.out}.json").write_text(json.dumps(runs, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
