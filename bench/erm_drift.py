#!/usr/bin/env python
"""Sliding window against cumulative release on a drifting stream; cost per model (issue 8).

**Drift** (pure ε). A binary stream from river's concept generators (:mod:`erm_data`) with an
abrupt drift: ``Hyperplane`` (10 features, 5 % label noise; the two concepts are two random
hyperplanes) and ``SEA`` (3 features, thresholds 8 → 9.5, 10 % label noise). 40 blocks of
``b0 = 4096`` events (and of 1024 at ε = 1), the drift at block 20 (not a power of two, so no
base of Algorithm 4 starts at the drift). At every step the *current* model of each
schedule is evaluated on a fresh test sample of the concept of that step's block (the
*current* concept):

* *sliding window*: Algorithm 5, window 7 blocks (``ScheduleSpec("sliding-window")``, the
  released end of the chain); every event costs at most ε;
* *cumulative*: Algorithm 4 with Algorithm 2's bases, B = 4 blocks (``"continual"``; the base
  or update released at that step); every event costs at most 2ε (ε per component), so it is
  run at ε and at ε/2 (the sliding window's per-event budget);
* *independent blocks*: each block alone at ε (the baseline);
* non-private references: logistic regression on the last 7 blocks (the window) and on all
  blocks so far, and the majority rate of the current concept's test sample.

``λ`` for each schedule and ε is chosen on a *public replica* of the drift process: the same
generators with other seeds (hence other concepts), scored by the mean accuracy of the
schedule's releases over the whole replica stream. Features: Hyperplane ``x − 0.5``, SEA
``x/10 − 0.5`` (public domain constants); ``clip_norm`` is the largest norm of that public
domain (no clipping: the linear concepts are kept), core intercept on.

Sliding window and independent blocks at ε ∈ {1, 3}. Reported: mean accuracy before the
drift (steps 7–19), after it (20–39), and once the window has left the old concept (27–39),
medians over noise seeds. Target: the sliding window beats
the cumulative release after the drift.

**Cost per released model.** Wall time of :func:`~dpstream.core.erm.output_noise.private_erm`
(certified
solve + exact rounding + exact noise) for one block, against the block size and ``d``
(synthetic Gaussian features, binary labels from a random hyperplane with 10 % noise, pure ε
and zCDP), and the wall time per block and per trained model of the real schedules at
``d = 64``, ``b0 = 1024``. One process, ``OPENBLAS_NUM_THREADS=1``. Flow throughput is
measured with the flow, not here.

Usage::

    python bench/erm_drift.py              # drift + cost (~1.5 min on 2 vCPUs), writes results
    python bench/erm_drift.py --quick      # smoke run, writes nothing
    python bench/erm_drift.py --only cost  # or --only drift

Results: ``bench/results/issue8-erm-drift.{md,json}`` and ``issue8-erm-cost.{md,json}``.
"""

from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy: multi-threaded BLAS is erratic here

import argparse  # noqa: E402
import concurrent.futures as cf  # noqa: E402
import datetime as _dt  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from fractions import Fraction  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import erm_data as D  # noqa: E402

D._core()
from dpstream.core.erm.output_noise import NoiseLevel, private_erm  # noqa: E402
from dpstream.core.erm.schedules.spec import ScheduleSpec  # noqa: E402
from dpstream.core.erm.solver import solve  # noqa: E402
from dpstream.core.erm.spec import ErmSpec  # noqa: E402

B0 = 4096
"""The drift experiment's block size: large enough that a block's private model is not
swamped by noise (at 1024 the sliding window is noise-bound; the b0 = 1024 rows show it)."""
SMALL_B0 = 1024
BLOCKS = 40
DRIFT_BLOCK = 20
WINDOW = 7
BASE_BLOCKS = 4
EPSILONS = (1.0, 3.0)
"""The sliding window and the independent baseline run at these ε; the cumulative release at
these and at their halves (same per-event budget: Algorithm 4 with Algorithm 2 costs 2ε)."""
GRID = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
STREAMS = {
    # name: (loader, real seeds, public replica seeds, clip norm)
    "hyperplane": ("hyperplane_drift", (11, 12), (31, 32), 0.5 * math.sqrt(10)),
    "sea": ("sea_drift", (21, 22), (41, 42), 0.5 * math.sqrt(3)),
}
ROLES = {"continual": ("base", "update"), "sliding-window": ("window",),
         "independent": ("independent",)}
LABEL = {"continual": "cumulative (Alg. 4)", "sliding-window": "sliding window (Alg. 5)",
         "independent": "independent blocks"}

_CACHE: dict[tuple[str, bool, int], D.DriftStream] = {}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def stream(name: str, replica: bool, b0: int) -> D.DriftStream:
    key = (name, replica, b0)
    if key not in _CACHE:
        loader, seeds, replica_seeds, _ = STREAMS[name]
        _CACHE[key] = getattr(D, loader)(length=BLOCKS * b0, drift_at=DRIFT_BLOCK * b0,
                                         seeds=replica_seeds if replica else seeds)
    return _CACHE[key]


def spec_of(name: str, lam: float) -> ErmSpec:
    d = stream(name, False, SMALL_B0).stream.x.shape[1]
    return ErmSpec(classes=(0, 1), dimension=d, clip_norm=STREAMS[name][3], regularization=lam)


def run(name: str, algorithm: str, eps: float, lam: float, seed: int, replica: bool,
        tag: str, b0: int, update_lam: float | None = None) -> list[float | None]:
    """Accuracy of the schedule's current model at each step (None before its first)."""
    ds = stream(name, replica, b0)
    spec = spec_of(name, lam)
    evals = [D.Evaluator(t) for t in ds.tests]
    concept = ds.concept[::b0]
    acc: list[float | None] = [None] * BLOCKS

    def evaluate(step: int, r: Any) -> None:
        if r.role in ROLES[algorithm]:
            acc[step] = evals[int(concept[step])](spec, r.model.params)

    sspec = ScheduleSpec(algorithm=algorithm, epsilon=eps, block_size=b0,  # type: ignore[arg-type]
                         base_blocks=BASE_BLOCKS, window_blocks=WINDOW,
                         update_regularization=update_lam)
    D.run_schedule(sspec, spec, ds.stream, seed, evaluate, tag=tag)
    return acc


def window_mean(acc: list[float | None], lo: int, hi: int) -> float:
    vals = [a for a in acc[lo:hi] if a is not None]
    return float(np.mean(vals)) if vals else float("nan")


def drift_cell(args: tuple[str, str, float, int, int]) -> dict[str, Any]:
    name, algorithm, eps, b0, seeds = args
    t0 = time.perf_counter()
    scores = {lam: D.median(window_mean(run(name, algorithm, eps, lam, 1000 + r, True,
                                            f"tune-{r}", b0), 0, BLOCKS) for r in range(2))
              for lam in GRID}
    lam = D.choose(scores)
    update_scores: dict[float, float] = {}
    update_lam = None
    if algorithm in ("continual", "sliding-window"):  # the updates' own λ (Algorithm 3's)
        update_scores = {
            u: scores[lam] if u == lam else D.median(window_mean(run(
                name, algorithm, eps, lam, 1000 + r, True, f"tune-{r}", b0, u), 0, BLOCKS)
                for r in range(2))
            for u in GRID}
        update_lam = D.choose(update_scores)
    runs = [run(name, algorithm, eps, lam, s, False, "eval", b0, update_lam)
            for s in range(seeds)]
    per_step = [D.median(r[i] for r in runs) if runs[0][i] is not None else None
                for i in range(BLOCKS)]

    def summary(lo: int, hi: int) -> float:
        return D.median(window_mean(r, lo, hi) for r in runs)

    return {"stream": name, "algorithm": algorithm, "epsilon": eps, "block_size": b0,
            "lambda": lam, "update_lambda": update_lam,
            "budget_per_event": eps * (2 if algorithm == "continual" else 1),
            "tuning_scores": scores, "update_tuning_scores": update_scores,
            "per_step": per_step,
            "before": summary(WINDOW, DRIFT_BLOCK), "after": summary(DRIFT_BLOCK, BLOCKS),
            "after_window": summary(DRIFT_BLOCK + WINDOW, BLOCKS),
            "seconds": time.perf_counter() - t0}


def nonprivate_drift(name: str, b0: int = B0) -> dict[str, Any]:
    from sklearn.linear_model import LogisticRegression

    ds = stream(name, False, b0)
    concept = ds.concept[::b0]
    out: dict[str, list[float | None]] = {"window": [], "cumulative": [], "majority": []}
    for step in range(BLOCKS):
        test = ds.tests[int(concept[step])]
        top = int(np.bincount(test.y, minlength=2).argmax())
        out["majority"].append(float(np.mean(test.y == top)))
        for key, lo in (("window", max(0, step + 1 - WINDOW)), ("cumulative", 0)):
            if step + 1 < WINDOW:
                out[key].append(None)
                continue
            x = ds.stream.x[lo * b0:(step + 1) * b0]
            y = ds.stream.y[lo * b0:(step + 1) * b0]
            m = LogisticRegression(C=1.0, max_iter=2000).fit(x, y)
            out[key].append(float(m.score(test.x, test.y)))

    def mean(key: str, lo: int, hi: int) -> float:
        return window_mean(out[key], lo, hi)

    return {"stream": name, "block_size": b0, "per_step": out,
            **{f"{k}_{p}": mean(k, lo, hi) for k in out
               for p, (lo, hi) in (("before", (WINDOW, DRIFT_BLOCK)),
                                   ("after", (DRIFT_BLOCK, BLOCKS)),
                                   ("after_window", (DRIFT_BLOCK + WINDOW, BLOCKS)))}}


# --- cost -------------------------------------------------------------------------------


def synthetic(n: int, d: int, classes: int, seed: int) -> D.Split:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) / math.sqrt(d)
    w = rng.standard_normal((classes if classes > 2 else 1, d))
    s = x @ w.T
    y = (s[:, 0] > 0).astype(np.int64) if classes == 2 else np.argmax(s, axis=1)
    flip = rng.random(n) < 0.1
    y[flip] = rng.integers(0, classes, size=int(flip.sum()))
    return D.Split(x, y)


def time_model(n: int, d: int, classes: int, accounting: str, repeats: int) -> dict[str, Any]:
    split = synthetic(n, d, classes, 7)
    spec = ErmSpec(classes=tuple(range(classes)), dimension=d, clip_norm=1.0,
                   regularization=1e-2, accounting=accounting)  # type: ignore[arg-type]
    level = NoiseLevel(spec.sensitivity(float(n)), Fraction(1))
    times, solve_times = [], []
    for r in range(repeats):
        key = D.noise_key(r)
        t0 = time.perf_counter()
        block = spec.block(split.x, split.y)
        private_erm(spec, block, normalizer=float(n), center=None, level=level,
                    rng=key.stream("cost", n, d, r))
        times.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        solve(spec, block, float(n), None, precision=float(spec.precision(float(n))) * 0.999)
        solve_times.append(time.perf_counter() - t1)
    return {"n": n, "d": d, "classes": classes, "accounting": accounting,
            "parameters": spec.parameter_count, "ms_per_model": 1e3 * D.median(times),
            "ms_solve_only": 1e3 * D.median(solve_times)}


def time_schedule(algorithm: str, d: int, blocks: int) -> dict[str, Any]:
    split = synthetic(blocks * SMALL_B0, d, 2, 11)
    spec = ErmSpec(classes=(0, 1), dimension=d, clip_norm=1.0, regularization=1e-2)
    sspec = ScheduleSpec(algorithm=algorithm, epsilon=1.0,  # type: ignore[arg-type]
                         block_size=SMALL_B0,
                         base_blocks=BASE_BLOCKS, window_blocks=WINDOW)
    released = [0]

    def evaluate(step: int, r: Any) -> None:
        released[0] += 1

    out = D.run_schedule(sspec, spec, split, 0, evaluate, tag="cost")
    return {"algorithm": algorithm, "d": d, "block_size": SMALL_B0, "blocks": blocks,
            "models_trained": out["models"], "models_released": released[0],
            "ms_per_block": 1e3 * out["seconds"] / blocks,
            "ms_per_trained_model": 1e3 * out["seconds"] / max(1, out["models"])}


def cost(quick: bool) -> dict[str, Any]:
    sizes = (256, 1024) if quick else (256, 1024, 4096, 16384)
    dims = (8, 64) if quick else (8, 64, 256)
    rows = []
    for d in dims:
        for n in sizes:
            rows.append(time_model(n, d, 2, "pure", 3 if quick else 5))
            log(f"cost: binary d={d} n={n}: {rows[-1]['ms_per_model']:.1f} ms")
    for d, ns in ((64, sizes[:3]), (784, () if quick else (1024, 4096))):
        for n in ns:
            rows.append(time_model(n, d, 10, "zcdp", 3))
            log(f"cost: 10 classes d={d} n={n} zcdp: {rows[-1]['ms_per_model']:.1f} ms")
    sched = [time_schedule(a, 64, 16 if quick else 32)
             for a in ("continual", "sliding-window", "independent", "multi-resolution")]
    return {"models": rows, "schedules": sched}


# --- report -----------------------------------------------------------------------------


def drift_jobs(quick: bool, seeds: int) -> list[tuple[str, str, float, int, int]]:
    """(stream, algorithm, ε, b0, seeds): sliding and independent at ε, cumulative at ε and ε/2."""
    names = ("hyperplane",) if quick else tuple(STREAMS)
    eps_list = (1.0,) if quick else EPSILONS
    jobs = []
    for name in names:
        for b0, eps_here in ((B0, eps_list), (SMALL_B0, (1.0,))):
            if quick and b0 == SMALL_B0:
                continue
            for e in eps_here:
                jobs += [(name, "sliding-window", e, b0, seeds),
                         (name, "independent", e, b0, seeds),
                         (name, "continual", e, b0, seeds),
                         (name, "continual", e / 2, b0, seeds)]
    return jobs


def _lam(c: dict[str, Any]) -> str:
    """The λ of a row, and its updates' λ when tuned separately."""
    if c.get("update_lambda") is None:
        return f"{c['lambda']:g}"
    return f"{c['lambda']:g}, updates {c['update_lambda']:g}"


def drift_report(res: dict[str, Any]) -> str:
    P = D.pct
    lines = [
        "# Issue 8 — sliding window vs cumulative release on a drifting stream (pure ε)",
        "",
        f"Generated {res['generated']} by `python bench/erm_drift.py` ({res['seconds']:.0f} s;"
        f" {res['seeds']} noise seeds, medians). {BLOCKS} blocks, abrupt drift at block "
        f"{DRIFT_BLOCK}; sliding window w = {WINDOW} blocks (Algorithm 5); cumulative = "
        f"Algorithm 4 with Algorithm 2's bases, B = {BASE_BLOCKS} blocks. Test: a fresh sample "
        "of the current concept at every step. λ per row, tuned on a public replica stream "
        "(other generator seeds).",
        "",
        "Budget per event: sliding window ε, independent blocks ε, cumulative 2ε at ε per "
        "component — so the cumulative rows at ε/2 per component are the **same per-event "
        "budget** as the sliding window at ε.",
        "",
    ]
    cells = {(c["stream"], c["algorithm"], c["epsilon"], c["block_size"]): c
             for c in res["cells"]}
    npv = {c["stream"]: c for c in res["nonprivate"]}
    verdicts = []
    for name, note in res["notes"].items():
        lines += [f"## {name}", "", note, ""]
        for b0 in (B0, SMALL_B0):
            eps_here = sorted({c["epsilon"] for c in res["cells"] if c["stream"] == name
                               and c["block_size"] == b0 and c["algorithm"] != "continual"})
            if not eps_here:
                continue
            lines += [f"b0 = {b0}:", "",
                      "| method | ε per component | budget per event | λ | before drift "
                      f"({WINDOW}–{DRIFT_BLOCK - 1}) | after drift ({DRIFT_BLOCK}–{BLOCKS - 1}) | "
                      f"after the window left the old concept ({DRIFT_BLOCK + WINDOW}–"
                      f"{BLOCKS - 1}) |", "|---|---|---|---|---|---|---|"]
            for e in eps_here:
                rows = [("sliding-window", e), ("continual", e), ("continual", e / 2),
                        ("independent", e)]
                for alg, ee in rows:
                    c = cells.get((name, alg, ee, b0))
                    if c is None:
                        continue
                    lines.append(f"| {LABEL[alg]} | {ee:g} | {c['budget_per_event']:g} | "
                                 f"{_lam(c)} | {P(c['before'])} | {P(c['after'])} | "
                                 f"{P(c['after_window'])} |")
                s = cells.get((name, "sliding-window", e, b0))
                for label, ee in (("same ε per component", e), ("same budget per event", e / 2)):
                    c = cells.get((name, "continual", ee, b0))
                    if s and c:
                        verdicts.append((name, b0, e, label, s["after"] - c["after"],
                                         s["after_window"] - c["after_window"]))
            if b0 == B0 and name in npv:
                n = npv[name]
                lines += [f"| non-private, last {WINDOW} blocks | – | – | – | "
                          f"{P(n['window_before'])} | {P(n['window_after'])} | "
                          f"{P(n['window_after_window'])} |",
                          f"| non-private, all blocks so far | – | – | – | "
                          f"{P(n['cumulative_before'])} | {P(n['cumulative_after'])} | "
                          f"{P(n['cumulative_after_window'])} |",
                          f"| majority class of the current concept | – | – | – | "
                          f"{P(n['majority_before'])} | {P(n['majority_after'])} | "
                          f"{P(n['majority_after_window'])} |"]
            lines.append("")
        trio = [cells.get((name, a, 1.0, B0)) for a in ("sliding-window", "continual",
                                                         "independent")]
        half = cells.get((name, "continual", 0.5, B0))
        if all(trio) and name in npv:
            lines += [f"Per step, b0 = {B0}, ε = 1 (median over seeds; blocks ≥ {DRIFT_BLOCK} "
                      "are the new concept):", "",
                      "| step | sliding ε=1 | cumulative ε=1 | cumulative ε=0.5 | independent "
                      "ε=1 | non-private window |", "|---|---|---|---|---|---|"]
            for i in range(WINDOW - 1, BLOCKS):
                lines.append(
                    f"| {i} | {P(trio[0]['per_step'][i])} | {P(trio[1]['per_step'][i])} | "
                    f"{P(half['per_step'][i]) if half else '–'} | {P(trio[2]['per_step'][i])} | "
                    f"{P(npv[name]['per_step']['window'][i])} |")
            lines.append("")
    lines += ["## Verdict: sliding window minus cumulative, after the drift", "",
              "| stream | b0 | sliding ε | cumulative at | after drift (points) | after the "
              "window left the old concept | sliding beats cumulative |",
              "|---|---|---|---|---|---|---|"]
    for name, b0, e, label, a, b in verdicts:
        lines.append(f"| {name} | {b0} | {e:g} | {label} | {100 * a:+.1f} | {100 * b:+.1f} | "
                     f"{'yes' if a > 0 else '**no**'} |")
    return "\n".join(lines)


def cost_report(res: dict[str, Any]) -> str:
    lines = [
        "# Issue 8 — cost per released model",
        "",
        f"Generated {res['generated']} by `python bench/erm_drift.py --only cost` (one process,"
        " OPENBLAS_NUM_THREADS=1, 2 shared vCPUs; medians). One model = "
        "`private_erm`: certified solve (L-BFGS-B then guarded Newton-CG to "
        "||∇J|| <= λτ/2, τ = Δ·2^-20), exact rounding to the grid, exact noise per "
        "coordinate. λ = 0.01, synthetic Gaussian features, 10 % label noise.",
        "",
        "The solve is timed separately (same precision); the rest is the feature map, the "
        "exact rounding and the exact noise (about 20 µs per coordinate, discrete Laplace or "
        "Gaussian, pure Python).",
        "",
        "| classes | accounting | d | parameters | block size | ms per model | of which solve |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["cost"]["models"]:
        lines.append(f"| {r['classes']} | {r['accounting']} | {r['d']} | {r['parameters']} | "
                     f"{r['n']} | {r['ms_per_model']:.1f} | {r['ms_solve_only']:.1f} |")
    lines += ["", f"Schedules (binary, d = 64, b0 = {SMALL_B0}, ε = 1; wall time of "
              "`ReleaseSchedule.add_block`, including the per-block ledger):", "",
              "| algorithm | blocks | models trained | models released | ms per block | "
              "ms per trained model |", "|---|---|---|---|---|---|"]
    for s in res["cost"]["schedules"]:
        lines.append(f"| {s['algorithm']} | {s['blocks']} | {s['models_trained']} | "
                     f"{s['models_released']} | {s['ms_per_block']:.1f} | "
                     f"{s['ms_per_trained_model']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run, writes nothing")
    parser.add_argument("--only", choices=("drift", "cost"), default=None)
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    seeds = args.seeds or (3 if args.quick else 7)
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    if args.only in (None, "drift"):
        t0 = time.perf_counter()
        jobs = drift_jobs(args.quick, seeds)
        names = tuple(dict.fromkeys(j[0] for j in jobs))
        cells, npv = [], []
        with cf.ProcessPoolExecutor(max_workers=args.workers) as pool:
            np_futs = [pool.submit(nonprivate_drift, n) for n in names]
            futs = [pool.submit(drift_cell, j) for j in sorted(jobs, key=lambda j: -j[3])]
            for fut in cf.as_completed(futs):
                c = fut.result()
                cells.append(c)
                log(f"{c['stream']} b0={c['block_size']} {c['algorithm']} eps={c['epsilon']}: "
                    f"after drift "
                    f"{100 * c['after']:.1f}% (lambda {c['lambda']:g}, {c['seconds']:.0f}s)")
            npv = [f.result() for f in np_futs]
        res = {"generated": stamp, "machine": D.machine(), "seeds": seeds,
               "block_sizes": [B0, SMALL_B0], "blocks": BLOCKS, "drift_block": DRIFT_BLOCK,
               "window_blocks": WINDOW, "base_blocks": BASE_BLOCKS, "lambda_grid": list(GRID),
               "notes": {n: stream(n, False, B0).note for n in names},
               "replica_notes": {n: stream(n, True, B0).note for n in names},
               "cells": sorted(cells, key=lambda c: (c["stream"], c["block_size"],
                                                     c["epsilon"], c["algorithm"])),
               "nonprivate": npv, "seconds": time.perf_counter() - t0}
        md = drift_report(res)
        print(md)
        if not args.quick:
            paths = D.write_results("issue8-erm-drift", res, md)
            log("wrote " + ", ".join(str(p) for p in paths))
    if args.only in (None, "cost"):
        t0 = time.perf_counter()
        res = {"generated": stamp, "machine": D.machine(), "cost": cost(args.quick)}
        res["seconds"] = time.perf_counter() - t0
        md = cost_report(res)
        print(md)
        if not args.quick:
            paths = D.write_results("issue8-erm-cost", res, md)
            log("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
