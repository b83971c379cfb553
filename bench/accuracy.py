#!/usr/bin/env python
"""Accuracy benchmark: measured worst-step error of the real counters vs. the analytic values.

For each mechanism

* ``tree-laplace``  -- :class:`~dpstream.core.counting.tree_counter.TreeCounter`, epsilon = 1,
* ``blt-gaussian``  -- :class:`~dpstream.core.counting.blt_counter.BltCounter`,  rho = 0.5,

and each stream length ``T`` in {2^16, 2^20} (the counter's horizon is ``T``), the
script runs ``K`` independent trials of the real counter class: ``.step`` is called
for every step ``0 .. T-1`` on a fixed synthetic stream (Poisson(3) increments from
a seeded numpy generator, so the true prefix counts are known). Trials differ only
in their noise coordinates ``("bench", mechanism, T, trial)`` under one
:class:`~dpstream.core.noise.keys.NoiseKey`. The error ``e_t = value_t - prefix_t`` is
recorded at every step.

Statistics (``sigma_t = analytic_std(spec, t)``, ``z_t = e_t / sigma_t``):

* **worst step (direct).** ``S`` = steps with ``sigma_t >= 0.99 max_t sigma_t``.
  Per trial ``m_k = mean_{t in S} z_t^2``; the variance ratio ``r = mean_k m_k``
  with a 95% Student-t interval from the spread of ``m_k`` across trials.
  Empirical worst-step std = ``sqrt(r) * max_t sigma_t``.
* **worst step (structural, tree only).** In the tree the error at a step is the
  sum of the errors of the (independent, disjoint) maximal completed nodes, one
  per set bit of ``t + 1``. The error of the completed left node of height ``h``
  covering ``[k 2^h, (k+1) 2^h)`` (``k`` even) is observable as
  ``e((k+1) 2^h) - e(k 2^h)`` (``e(x)`` = error after ``x`` steps, ``e(0) = 0``),
  so every level's variance is measured from all its ``T / 2^(h+1)`` nodes and the
  worst step's variance is their sum over its bits. Same data, far more power
  than the direct estimate, whose ``S`` is a single step for the tree.
* **pooled over all steps:** ``mean z_t^2`` (should be 1) and ``mean z_t``
  (bias, should be 0), each with a 95% t-interval across trials.

Verdicts: "within 10%" passes if ``|sqrt(r) - 1| <= 0.10`` (point estimate); the
table also says whether the whole 95% interval of ``sqrt(r)`` lies in
``[0.9, 1.1]``. "No worse than the figure" compares the analytic worst-step std
with the issue's figure plus half a unit of its last digit (only for T = 2^20,
where the issue gives figures).

Usage::

    python bench/accuracy.py            # full run (~10-25 min on 2 shared cores)
    python bench/accuracy.py --quick    # smoke run, 2^16 only, < 1 min, writes nothing

Progress goes to stderr; the table to stdout; the full run writes
``bench/results/accuracy.json`` and ``bench/results/accuracy.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as _dt
import functools
import json
import math
import multiprocessing
import os
import pickle
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from dpstream.core.counting import blt_counter as blt  # noqa: E402
from dpstream.core.counting import tree_counter as tree  # noqa: E402
from dpstream.core.noise.keys import NoiseKey  # noqa: E402

RESULTS_DIR = _ROOT / "bench" / "results"
TREE = "tree-laplace"
BLT = "blt-gaussian"
MECHANISMS = (TREE, BLT)
EPSILON = 1.0
RHO = 0.5
POISSON_MEAN = 3.0

# The figures at T = 2^20 (value, half a unit of the last digit given, as printed).
FIGURES: dict[tuple[str, int], tuple[float, float, str]] = {
    (TREE, 2**20): (98.0, 0.5, "≈98"),
    (BLT, 2**20): (5.8, 0.05, "5.4–5.8"),
}
CONTEXT_FIGURES: dict[tuple[str, int], dict[str, tuple[float, float, str]]] = {
    (TREE, 2**20): {"plain_tree_worst_std": (133.0, 0.5, "≈133")},
    (BLT, 2**20): {
        "plain_tree_zcdp_worst_std": (20.5, 0.05, "≈20.5"),
        "factorization_lower_bound": (5.1, 0.05, "≈5.1"),
    },
}


def log(msg: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    print(f"[{stamp}] {msg}", file=sys.stderr, flush=True)


def fmt_T(T: int) -> str:
    return f"2^{T.bit_length() - 1}"


def fmt_duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


# --- specs, analytic values, the stream -------------------------------------------------------


def make_spec(mech: str, T: int) -> Any:
    if mech == TREE:
        return tree.TreeCounterSpec(EPSILON, T)
    return blt.BltCounterSpec(RHO, T)


def make_counter(mech: str, T: int, key: NoiseKey, coords: tuple[str | int, ...]) -> Any:
    if mech == TREE:
        return tree.TreeCounter(make_spec(mech, T), key, coords)
    return blt.BltCounter(make_spec(mech, T), key, coords)


@functools.lru_cache(maxsize=8)
def analytic_stds(mech: str, T: int) -> np.ndarray:
    """``analytic_std(spec, t)`` for every ``t < T``, from the library's own function."""
    spec = make_spec(mech, T)
    fn = tree.analytic_std if mech == TREE else blt.analytic_std
    out = np.fromiter((fn(spec, t) for t in range(T)), dtype=np.float64, count=T)
    out.setflags(write=False)
    return out


def analytic_worst(mech: str, T: int) -> float:
    spec = make_spec(mech, T)
    return float(tree.worst_step_std(spec, T) if mech == TREE else blt.worst_step_std(spec, T))


@functools.lru_cache(maxsize=4)
def stream(T: int, seed: int) -> tuple[list[int], np.ndarray]:
    """The synthetic increments (Python ints) and their true prefix counts."""
    inc = np.random.default_rng(seed).poisson(POISSON_MEAN, size=T).astype(np.int64)
    prefix = np.cumsum(inc)
    prefix.setflags(write=False)
    return inc.tolist(), prefix


def worst_set(mech: str, T: int, threshold: float) -> np.ndarray:
    sig = analytic_stds(mech, T)
    return np.flatnonzero(sig >= threshold * sig.max())


# --- one trial (runs in a worker process) -----------------------------------------------------


def run_trial(
    mech: str, T: int, trial: int, key_seed: int, stream_seed: int, threshold: float
) -> dict[str, Any]:
    log(f"  start {mech} T={fmt_T(T)} trial {trial} (pid {os.getpid()})")
    key = NoiseKey.for_tests(key_seed)
    counter = make_counter(mech, T, key, ("bench", mech, T, trial))
    increments, prefix = stream(T, stream_seed)
    sig = analytic_stds(mech, T)
    worst_idx = int(np.argmax(sig))
    checkpoints = {worst_idx, T - 2, T - 1}
    state_sizes: dict[int, tuple[int, int]] = {}

    values = np.empty(T, dtype=np.float64)
    stds = np.empty(T, dtype=np.float64)
    step = counter.step
    t0, c0 = time.perf_counter(), time.process_time()
    for t, x in enumerate(increments):
        est = step(x)
        values[t] = est.value
        stds[t] = est.std
        if t in checkpoints:
            state = counter.to_state()
            state_sizes[t] = (len(json.dumps(state)), len(pickle.dumps(state)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if counter.steps_done != T:
        raise RuntimeError(f"counter did {counter.steps_done} steps, expected {T}")

    err = values - prefix  # e_t, float64
    z = err / sig
    s_idx = worst_set(mech, T, threshold)
    wide_idx = worst_set(mech, T, 0.95)
    out: dict[str, Any] = {
        "mech": mech,
        "T": T,
        "trial": trial,
        "wall_s": wall,
        "cpu_s": cpu,
        "us_per_step_wall": wall / T * 1e6,
        "us_per_step_cpu": cpu / T * 1e6,
        "m_worst": float(np.mean(z[s_idx] ** 2)),
        "m_near_worst_95": float(np.mean(z[wide_idx] ** 2)),
        "z_at_worst": float(z[worst_idx]),
        "pooled_sq": float(np.mean(z * z)),
        "pooled_mean": float(np.mean(z)),
        "max_abs_z": float(np.max(np.abs(z))),
        "max_abs_err": float(np.max(np.abs(err))),
        "std_mismatch": float(np.max(np.abs(stds / sig - 1.0))),
        "state_json_bytes": max(s[0] for s in state_sizes.values()),
        "state_pickle_bytes": max(s[1] for s in state_sizes.values()),
        "state_json_bytes_end": state_sizes[T - 1][0],
    }
    if mech == TREE:
        out.update(tree_levels(err, T, worst_idx))
    return out


def tree_levels(err: np.ndarray, T: int, worst_idx: int) -> dict[str, Any]:
    """Per-height mean squared error of completed left nodes (see the module docstring)."""
    m = T.bit_length() - 1
    sq_means = []
    for h in range(m + 1):
        xs = np.arange(1 << h, T + 1, 1 << (h + 1), dtype=np.int64)  # (k+1) 2^h, k even
        prev = xs - (1 << h)  # k 2^h
        after = err[xs - 1]
        before = np.where(prev > 0, err[np.maximum(prev, 1) - 1], 0.0)
        d = after - before
        sq_means.append(float(np.mean(d * d)))
    x_star = worst_idx + 1
    structural = sum(sq_means[h] for h in range(m + 1) if (x_star >> h) & 1)
    return {"level_sq_means": sq_means, "structural_worst_var": structural}


# --- statistics --------------------------------------------------------------------------------


def t_quantile(df: int, p: float = 0.975) -> float:
    try:
        from scipy.stats import t as student_t

        return float(student_t.ppf(p, df))
    except ImportError:  # Cornish-Fisher expansion around the normal quantile
        from statistics import NormalDist

        zq = NormalDist().inv_cdf(p)
        return (
            zq
            + (zq**3 + zq) / (4 * df)
            + (5 * zq**5 + 16 * zq**3 + 3 * zq) / (96 * df**2)
            + (3 * zq**7 + 19 * zq**5 + 17 * zq**3 - 15 * zq) / (384 * df**3)
        )


def mean_ci(samples: list[float]) -> tuple[float, float, float, float]:
    """Return (mean, lo, hi, standard error) with a 95% Student-t interval."""
    a = np.asarray(samples, dtype=np.float64)
    mean = float(a.mean())
    if len(a) < 2:
        return mean, math.nan, math.nan, math.nan
    se = float(a.std(ddof=1) / math.sqrt(len(a)))
    half = t_quantile(len(a) - 1) * se
    return mean, mean - half, mean + half, se


def ratio_summary(samples: list[float], worst: float) -> dict[str, Any]:
    """Summarise per-trial variance ratios into a worst-step std with its interval."""
    r, lo, hi, se = mean_ci(samples)
    sr = math.sqrt(max(r, 0.0))
    slo = math.sqrt(max(lo, 0.0)) if math.isfinite(lo) else math.nan
    shi = math.sqrt(max(hi, 0.0)) if math.isfinite(hi) else math.nan
    return {
        "variance_ratio": r,
        "variance_ratio_ci95": [lo, hi],
        "variance_ratio_se": se,
        "std_ratio": sr,
        "std_ratio_ci95": [slo, shi],
        "empirical_worst_std": sr * worst,
        "empirical_worst_std_ci95": [slo * worst, shi * worst],
        "rel_deviation": abs(sr - 1.0),
        "within_10pct": abs(sr - 1.0) <= 0.10,
        "ci_within_10pct": bool(slo >= 0.9 and shi <= 1.1),
    }


def summarise(mech: str, T: int, trials: list[dict[str, Any]], threshold: float) -> dict[str, Any]:
    trials = sorted(trials, key=lambda d: d["trial"])
    spec = make_spec(mech, T)
    worst = analytic_worst(mech, T)
    sig = analytic_stds(mech, T)
    s_idx = worst_set(mech, T, threshold)
    res: dict[str, Any] = {
        "mechanism": mech,
        "T": T,
        "params": {"epsilon": EPSILON} if mech == TREE else {"rho": RHO},
        "trials": len(trials),
        "analytic_worst_std": worst,
        "analytic_worst_step": int(np.argmax(sig)),
        "analytic_max_over_steps_matches_worst_step_std": bool(
            abs(float(sig.max()) - worst) <= 1e-9 * worst
        ),
        "worst_set": {
            "threshold": threshold,
            "size": int(len(s_idx)),
            "first_step": int(s_idx[0]),
            "last_step": int(s_idx[-1]),
        },
        "direct": ratio_summary([d["m_worst"] for d in trials], worst),
        "near_worst_95": ratio_summary([d["m_near_worst_95"] for d in trials], worst),
    }
    res["near_worst_95"]["set_size"] = int(len(worst_set(mech, T, 0.95)))
    sq, sq_lo, sq_hi, _ = mean_ci([d["pooled_sq"] for d in trials])
    mu, mu_lo, mu_hi, _ = mean_ci([d["pooled_mean"] for d in trials])
    res["pooled_all_steps"] = {
        "mean_z_sq": sq,
        "mean_z_sq_ci95": [sq_lo, sq_hi],
        "mean_z": mu,
        "mean_z_ci95": [mu_lo, mu_hi],
    }
    res["z_at_worst_step"] = [d["z_at_worst"] for d in trials]
    res["max_abs_z"] = max(d["max_abs_z"] for d in trials)
    res["max_abs_err"] = max(d["max_abs_err"] for d in trials)
    res["reported_std_vs_analytic_max_rel_diff"] = max(d["std_mismatch"] for d in trials)

    if mech == TREE:
        res["structural"] = ratio_summary(
            [d["structural_worst_var"] / worst**2 for d in trials], worst
        )
        levels = np.array([d["level_sq_means"] for d in trials])  # trials x (m+1)
        expected = [tree.analytic_std(spec, (1 << h) - 1) ** 2 for h in range(levels.shape[1])]
        res["structural"]["level_variance_ratio"] = [
            float(v) for v in levels.mean(axis=0) / np.array(expected)
        ]

    fig = FIGURES.get((mech, T))
    if fig is not None:
        value, tol, text = fig
        res["figure"] = {
            "text": text,
            "limit": value + tol,
            "analytic_no_worse": worst <= value + tol,
            "empirical_point_no_worse": res["direct"]["empirical_worst_std"] <= value + tol,
        }
    else:
        res["figure"] = None

    context: dict[str, Any] = {}
    if mech == TREE:
        context["plain_tree_worst_std"] = tree.plain_tree_worst_std(spec, T)
        context["combining_gain"] = context["plain_tree_worst_std"] / worst
    else:
        context["plain_tree_zcdp_worst_std"] = blt.plain_tree_zcdp_worst_std(RHO, T)
        context["factorization_lower_bound"] = blt.factorization_lower_bound(RHO, T)
        context["ratio_to_lower_bound"] = worst / context["factorization_lower_bound"]
        context["buffers"] = spec.buffers
        context["noise_std"] = spec.noise_std
    for name, (value, tol, text) in CONTEXT_FIGURES.get((mech, T), {}).items():
        context[f"{name}_issue_figure"] = text
        context[f"{name}_matches_issue"] = abs(context[name] - value) <= tol
    res["context"] = context

    res["time_us_per_step_wall_median"] = float(np.median([d["us_per_step_wall"] for d in trials]))
    res["time_us_per_step_cpu_median"] = float(np.median([d["us_per_step_cpu"] for d in trials]))
    res["state_json_bytes_max"] = max(d["state_json_bytes"] for d in trials)
    res["state_pickle_bytes_max"] = max(d["state_pickle_bytes"] for d in trials)
    res["state_json_bytes_end"] = max(d["state_json_bytes_end"] for d in trials)
    res["per_trial"] = [{k: v for k, v in d.items() if k not in ("mech", "T")} for d in trials]
    return res


# --- the report --------------------------------------------------------------------------------


def yes_no(flag: bool | None) -> str:
    return "n/a" if flag is None else ("PASS" if flag else "FAIL")


def fmt_ci(pair: list[float], digits: int) -> str:
    lo, hi = pair
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "[n/a]"
    return f"[{lo:.{digits}f}, {hi:.{digits}f}]"


def render(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# dpstream accuracy benchmark",
        "",
        f"{meta['started']} · {meta['mode']} run · wall {fmt_duration(meta['wall_s'])} · "
        f"{meta['workers']} worker processes · load average at start/end "
        f"{meta['loadavg_start'][0]:.2f}/{meta['loadavg_end'][0]:.2f} · "
        f"python {meta['python']} · numpy {meta['numpy']}",
        "",
        "Worst-step std: analytic (library) vs. measured on the real counters. "
        "`direct` = mean (e_t/σ_t)² over S = {t : σ_t ≥ "
        f"{meta['threshold']}·max σ}}, "
        "`structural` (tree) = per-level node variances summed over the worst step's bits. "
        "CIs are 95% Student-t across trials. ±10% verdict = point estimate; "
        "'CI⊂±10%' = whole interval within.",
        "",
        "| mechanism | T | K | \\|S\\| | analytic worst | measured worst (direct) [95% CI] | "
        "dev | ±10% | CI⊂±10% | measured worst (structural) [95% CI] | dev | ±10% | CI⊂±10% | "
        "issue figure | analytic ≤ figure |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        d = r["direct"]
        dg = 2 if r["analytic_worst_std"] > 20 else 3
        s = r.get("structural")
        fig = r["figure"]
        lines.append(
            f"| {r['mechanism']} | {fmt_T(r['T'])} | {r['trials']} | {r['worst_set']['size']} | "
            f"{r['analytic_worst_std']:.{dg}f} | "
            f"{d['empirical_worst_std']:.{dg}f} {fmt_ci(d['empirical_worst_std_ci95'], dg)} | "
            f"{100 * d['rel_deviation']:.1f}% | {yes_no(d['within_10pct'])} | "
            f"{'yes' if d['ci_within_10pct'] else 'no'} | "
            + (
                f"{s['empirical_worst_std']:.{dg}f} {fmt_ci(s['empirical_worst_std_ci95'], dg)} | "
                f"{100 * s['rel_deviation']:.1f}% | {yes_no(s['within_10pct'])} | "
                f"{'yes' if s['ci_within_10pct'] else 'no'} | "
                if s
                else "— | — | — | — | "
            )
            + (
                f"{fig['text']} (≤ {fig['limit']:g}) | {yes_no(fig['analytic_no_worse'])} |"
                if fig
                else "— | n/a |"
            )
        )
    lines += [
        "",
        "Calibration over all steps and context:",
        "",
        "| mechanism | T | mean (e/σ)² all steps [95% CI] | mean e/σ [95% CI] | "
        "near-worst (σ ≥ 0.95 max): n, std ratio [CI] | reported std = analytic | "
        "context (analytic) | µs/step wall (cpu) | state bytes json/pickle (max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p = r["pooled_all_steps"]
        nw = r["near_worst_95"]
        c = r["context"]
        if r["mechanism"] == TREE:
            ctx = f"plain tree {c['plain_tree_worst_std']:.2f} (gain ×{c['combining_gain']:.3f})"
        else:
            ctx = (
                f"plain tree zCDP {c['plain_tree_zcdp_worst_std']:.2f}, "
                f"lower bound {c['factorization_lower_bound']:.3f} "
                f"(BLT/LB {c['ratio_to_lower_bound']:.3f}, d={c['buffers']})"
            )
        lines.append(
            f"| {r['mechanism']} | {fmt_T(r['T'])} | {p['mean_z_sq']:.4f} "
            f"{fmt_ci(p['mean_z_sq_ci95'], 4)} | "
            f"{p['mean_z']:+.4f} {fmt_ci(p['mean_z_ci95'], 4)} | "
            f"{nw['set_size']}, {nw['std_ratio']:.3f} {fmt_ci(nw['std_ratio_ci95'], 3)} | "
            f"max rel diff {r['reported_std_vs_analytic_max_rel_diff']:.1e} | {ctx} | "
            f"{r['time_us_per_step_wall_median']:.1f} ({r['time_us_per_step_cpu_median']:.1f}) | "
            f"{r['state_json_bytes_max']}/{r['state_pickle_bytes_max']} |"
        )
    lines.append("")
    return "\n".join(lines)


# --- driver ------------------------------------------------------------------------------------


def calibrate(steps: int = 3000) -> dict[str, float]:
    """Time ``steps`` real steps of each mechanism (µs per step, this process)."""
    out = {}
    key = NoiseKey.for_tests(12345)
    for mech in MECHANISMS:
        c = make_counter(mech, 2**20, key, ("bench-calibration", mech))
        for _ in range(200):  # warm the library's caches first
            c.step(3)
        t0 = time.perf_counter()
        for _ in range(steps):
            c.step(3)
        out[mech] = (time.perf_counter() - t0) / steps * 1e6
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: small K, T = 2^16 only")
    ap.add_argument("--trials", type=int, default=None, help="K for every T and mechanism")
    ap.add_argument("--trials-16", type=int, default=None, help="K at T = 2^16 (both mechanisms)")
    ap.add_argument("--trials-20", type=int, default=None, help="K at T = 2^20 (both mechanisms)")
    for mech in ("tree", "blt"):
        for e in (16, 20):
            ap.add_argument(
                f"--{mech}-trials-{e}",
                type=int,
                default=None,
                help=f"override K for {mech} at T = 2^{e}",
            )
    ap.add_argument("--sizes", default=None, help="comma-separated log2 T values (default 16,20)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (at most 2)")
    ap.add_argument("--threshold", type=float, default=0.99, help="worst-set threshold on σ_t")
    ap.add_argument("--key-seed", type=int, default=20240601, help="NoiseKey.for_tests seed")
    ap.add_argument("--stream-seed", type=int, default=7, help="seed of the Poisson increments")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write accuracy.json/.md (default: yes for a full run, no for --quick)",
    )
    args = ap.parse_args(argv)
    if not 1 <= args.workers <= 2:
        ap.error("--workers must be 1 or 2 (the machine is shared)")
    if args.write is None:
        args.write = not args.quick
    return args


def plan(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    sizes = [16] if args.quick else [16, 20]
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    default = {16: 4 if args.quick else 48, 20: 2 if args.quick else 8}
    # the tree at 2^16 is cheap and its worst set is a single step: give it twice the trials
    tree_bonus = {16: 1 if args.quick else 2, 20: 1}
    jobs = []
    for e in sizes:
        common = getattr(args, f"trials_{e}", None)
        if common is None:
            common = args.trials
        for mech, short in ((TREE, "tree"), (BLT, "blt")):
            k = getattr(args, f"{short}_trials_{e}", None) if e in (16, 20) else None
            if k is None:
                base = common if common is not None else default.get(e, 2)
                k = base * (tree_bonus.get(e, 1) if mech == TREE and common is None else 1)
            if k > 0:
                jobs.append((mech, 1 << e, k))
    return jobs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = _dt.datetime.now().astimezone()
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    jobs = plan(args)
    log(
        f"plan: {', '.join(f'{m} T={fmt_T(T)} K={k}' for m, T, k in jobs)}; "
        f"{args.workers} workers; load average {load_start[0]:.2f}"
    )

    cal = calibrate()
    log("calibration (µs/step, this process): " + ", ".join(f"{m} {v:.1f}" for m, v in cal.items()))
    total_units = sum(T * k * cal[m] for m, T, k in jobs) / 1e6
    log(
        f"projected: {total_units:.0f} core-seconds of steps -> about "
        f"{fmt_duration(total_units / args.workers)} wall on {args.workers} idle cores"
    )

    log("precomputing analytic σ_t for every step (inherited by the forked workers) ...")
    for mech, T, _ in jobs:
        analytic_stds(mech, T)
        stream(T, args.stream_seed)
    log(f"... done ({fmt_duration(time.perf_counter() - t_start)})")

    # longest tasks first: better balance across the two workers
    tasks = [(m, T, k) for m, T, kk in jobs for k in range(kk)]
    tasks.sort(key=lambda x: -x[1] * cal[x[0]])
    units = {(m, T, k): T * cal[m] / 1e6 for m, T, k in tasks}
    done_units = 0.0
    total_units = sum(units.values())
    results: dict[tuple[str, int], list[dict[str, Any]]] = {(m, T): [] for m, T, _ in jobs}

    try:
        ctx = multiprocessing.get_context("fork")
    except ValueError:
        ctx = None
    t_pool = time.perf_counter()
    with cf.ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx) as pool:
        futures = {
            pool.submit(run_trial, m, T, k, args.key_seed, args.stream_seed, args.threshold): (
                m,
                T,
                k,
            )
            for m, T, k in tasks
        }
        for n, fut in enumerate(cf.as_completed(futures), 1):
            m, T, k = futures[fut]
            res = fut.result()
            results[(m, T)].append(res)
            done_units += units[(m, T, k)]
            elapsed = time.perf_counter() - t_pool
            eta = elapsed * (total_units - done_units) / max(done_units, 1e-9)
            log(
                f"done {n}/{len(tasks)}: {m} T={fmt_T(T)} trial {k}: "
                f"{res['wall_s']:.1f}s ({res['us_per_step_wall']:.1f} µs/step wall, "
                f"{res['us_per_step_cpu']:.1f} cpu), worst-set mean z² {res['m_worst']:.3f}, "
                f"all-steps mean z² {res['pooled_sq']:.3f}; elapsed {fmt_duration(elapsed)}, "
                f"ETA {fmt_duration(eta)}"
            )

    summaries = [summarise(m, T, results[(m, T)], args.threshold) for m, T, _ in jobs]
    summaries.sort(key=lambda r: (MECHANISMS.index(r["mechanism"]), r["T"]))
    meta = {
        "started": started.isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "wall_s": time.perf_counter() - t_start,
        "workers": args.workers,
        "threshold": args.threshold,
        "key_seed": args.key_seed,
        "stream_seed": args.stream_seed,
        "increments": f"Poisson({POISSON_MEAN:g}) from numpy default_rng(stream_seed)",
        "noise_coordinates": "('bench', mechanism, T, trial) under NoiseKey.for_tests(key_seed)",
        "calibration_us_per_step": cal,
        "loadavg_start": list(load_start),
        "loadavg_end": list(os.getloadavg()),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
    }
    table = render(summaries, meta)
    print(table)
    if args.write:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "accuracy.json").write_text(
            json.dumps({"meta": meta, "results": summaries}, indent=2, allow_nan=True) + "\n"
        )
        (args.out_dir / "accuracy.md").write_text(table)
        log(f"wrote {args.out_dir / 'accuracy.json'} and {args.out_dir / 'accuracy.md'}")
    log(f"total wall time {fmt_duration(meta['wall_s'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
