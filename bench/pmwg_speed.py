#!/usr/bin/env python
"""PMWG per-query cost and histogram ingest rate on one core (issue 7).

**Per-query cost.** The real :class:`dpstream.core.pmwg.mechanism.Pmwg` (practical mode, pure DP) on
universes of ``N = 2^16`` and ``2^20`` cells (attributes ``a`` 4 values, ``b`` 8, ``c`` 8, ``x``
``N / 256`` buckets), for these query kinds:

* ``box1``: a predicate with 1 attribute fixed (``b = b0``, ``N / 8`` cells);
* ``box2``: 2 attributes fixed (``a = a0`` and ``x`` in its first quarter, ``N / 16`` cells);
* ``part``: one part of a marginal (``{"kind": "marginal", "attrs": ["c"], "where": [a = a0]}``,
  ``N / 32`` cells each);
* ``dense``: a dense weights query (``N`` random weights in ``[0, 1]``, weight 1 on cell 0).

Every kind is timed on two fresh mechanisms, each answer timed alone (``perf_counter_ns``
around ``Pmwg.answer``; compilation and the true counts are prepared beforehand):

* *easy*: hard-query cap 1000 (``xi_n = 889``) on a database that is exactly uniform, so
  ``f(D) = f(y)`` and the NSG answers "below threshold" (the answer is ``f(y)``, public data);
  the same queries are asked again and again;
* *hard*: hard-query cap ``10^5`` (so the budget lasts) on a database whose events are all
  in cell 0, which every query contains: ``f(D) = 1`` is far from ``f(y)``; every hard answer
  includes the NSG's numeric answer and the multiplicative-weights update on the support.

Answers are grouped by the kind PMWG actually returned. Baseline in the same run, on the same
queries: a dense numpy pass with the query's dense weight vector ``w`` (built beforehand):
``w @ y`` (easy), and ``w @ y`` then ``y *= exp(eta w); y /= y.sum()`` (hard). The first query
after ``t`` grows also pays the uniform update (one dense pass over ``N``): timed separately.

**Ingest.** Events per second into the count histogram, one worker, 5 attributes (``country``
16 values, ``device`` 4, ``browser`` 8, ``age`` 10 buckets, ``amount`` 16 buckets: 81,920
cells), batches of 10,000 events:

* ``dicts -> cells -> bincount``: decoded event dicts -> ``Universe.cells`` ->
  ``counts += np.bincount(cells, minlength=N)``;
* ``dicts -> cells -> add.at``: the same with ``np.add.at(counts, cells, 1)``;
* ``JSON bytes -> orjson.loads -> cells -> bincount``: the full decode path, one
  ``orjson.loads`` per event;
* the same with the batch's messages joined into one JSON array and decoded by one
  ``orjson.loads`` call (the join is timed too);
* ``orjson.loads`` alone (the decode share of the full path);
* baseline ``plain Python loop``: each decoded record mapped by dict look-ups and ``bisect``
  to its cell index, ``counts[i] += 1`` on a Python list.

Usage::

    python bench/pmwg_speed.py            # full run (about 40 s)
    python bench/pmwg_speed.py --quick    # smoke run (< 1 min), writes nothing

Results go to ``bench/results/issue7-pmwg-speed.json``; tables to stdout.
"""

from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy: multi-threaded BLAS is erratic here

import argparse  # noqa: E402
import bisect  # noqa: E402
import datetime as _dt  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import orjson  # noqa: E402

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from dpstream.core.noise.keys import NoiseKey  # noqa: E402
from dpstream.core.pmwg.mechanism import Pmwg  # noqa: E402
from dpstream.core.pmwg.query_compiler import QueryCompiler  # noqa: E402
from dpstream.core.pmwg.spec import PmwgSpec  # noqa: E402
from dpstream.core.pmwg.universe import Universe  # noqa: E402

RESULTS_DIR = _ROOT / "bench" / "results"
SCHEMA = "dpstream.query/1"
ALPHA = 0.05
KINDS = ("box1", "box2", "part", "dense")
BATCH = 10_000


# --- per-query cost -----------------------------------------------------------------------


def query_universe(bits: int) -> Universe:
    return Universe.from_spec([
        {"name": "a", "values": [f"a{j}" for j in range(4)]},
        {"name": "b", "values": [f"b{j}" for j in range(8)]},
        {"name": "c", "values": [f"c{j}" for j in range(8)]},
        {"name": "x", "edges": list(range((1 << bits) // 256 + 1))},
    ])


def queries_of(kind: str, universe: Universe, compiler: QueryCompiler, count: int,
               rng: np.random.Generator) -> list[Any]:
    """``count`` compiled queries of ``kind``, each containing cell 0."""
    quarter = universe.shape[3] // 4
    if kind == "box1":
        q = compiler.compile({"schema": SCHEMA, "kind": "count",
                              "where": [{"attr": "b", "eq": "b0"}]})
        return q * count
    if kind == "box2":
        q = compiler.compile({"schema": SCHEMA, "kind": "count",
                              "where": [{"attr": "a", "eq": "a0"},
                                        {"attr": "x", "range": [0, quarter]}]})
        return q * count
    if kind == "part":
        parts = compiler.compile({"schema": SCHEMA, "kind": "marginal", "attrs": ["c"],
                                  "where": [{"attr": "a", "eq": "a0"}]})
        return [parts[0]] * count  # the part that holds cell 0
    distinct = []
    for _ in range(4):  # a few distinct dense vectors, reused
        w = rng.random(universe.size)
        w[0] = 1.0
        distinct.append(compiler.compile({"schema": SCHEMA, "kind": "weights",
                                          "weights": w.tolist()})[0])
    return [distinct[i % len(distinct)] for i in range(count)]


def pmwg(n: int, cells: int, cap: int, seed: int) -> Pmwg:
    spec = PmwgSpec(epsilon=1.0, delta=0.0, alpha=ALPHA, beta=0.05, n=n, universe_size=cells,
                    mode="practical", hard_query_cap=cap)
    return Pmwg(spec, NoiseKey.for_tests(seed), ("bench", "speed"))


def summary(samples_ns: list[int]) -> dict[str, Any]:
    if not samples_ns:
        return {"count": 0}
    ms = np.array(samples_ns, dtype=np.float64) / 1e6
    return {"count": int(ms.size), "median_ms": float(np.median(ms)),
            "p90_ms": float(np.percentile(ms, 90)), "mean_ms": float(ms.mean())}


def time_pmwg(bits: int, kind: str, easy_n: int, hard_n: int) -> dict[str, Any]:
    universe = query_universe(bits)
    compiler = QueryCompiler(universe, max_dense=8)
    cells = universe.size
    rng = np.random.default_rng(bits)
    t = cells * 16  # the uniform database: 16 events per cell
    uniform = np.full(cells, 16, dtype=np.int64)
    spike = np.zeros(cells, dtype=np.int64)
    spike[0] = t
    by_kind: dict[str, list[int]] = {"easy": [], "hard": [], "bottom": []}
    base_easy: list[int] = []
    base_hard: list[int] = []
    runs = {"easy": (1000, uniform, easy_n), "hard": (100_000, spike, hard_n)}
    for setting, (cap, counts, n_q) in runs.items():
        queries = queries_of(kind, universe, compiler, n_q, rng)
        mech = pmwg(t, cells, cap, seed=bits * 10 + len(setting))
        mech.answer(queries[0], counts, t)  # opens the first round
        gc.collect()
        gc.disable()
        try:
            for q in queries:
                start = time.perf_counter_ns()
                a = mech.answer(q, counts, t)
                by_kind[a.kind].append(time.perf_counter_ns() - start)
        finally:
            gc.enable()
        # the dense numpy baseline on the same queries
        y = np.full(cells, 1.0 / cells)
        dense = {id(q): q.dense_weights() for q in queries}
        eta = ALPHA / 6
        gc.disable()
        try:
            for q in queries[: min(len(queries), 400)]:
                w = dense[id(q)]
                start = time.perf_counter_ns()
                f_y = float(w @ y)
                if setting == "hard":
                    y *= np.exp(eta * w)
                    y /= y.sum()
                elapsed = time.perf_counter_ns() - start
                (base_hard if setting == "hard" else base_easy).append(elapsed)
                assert math.isfinite(f_y)
        finally:
            gc.enable()
    # the uniform update: the first query after t grows (one dense pass over N)
    growth: list[int] = []
    mech = pmwg(t, cells, 1000, seed=bits * 10 + 7)
    q0 = queries_of("box1", universe, compiler, 1, rng)[0]
    mech.answer(q0, uniform, t)
    for step in range(1, 21):  # one more event per cell each time
        t_now = t + step * cells
        counts = np.full(cells, 16 + step, dtype=np.int64)
        start = time.perf_counter_ns()
        mech.answer(q0, counts, t_now)
        growth.append(time.perf_counter_ns() - start)
    support = queries_of(kind, universe, compiler, 1, rng)[0].support_size
    return {"bits": bits, "kind": kind, "support": support,
            "pmwg": {k: summary(v) for k, v in by_kind.items()},
            "baseline": {"easy": summary(base_easy), "hard": summary(base_hard)},
            "first_query_after_growth": summary(growth)}


# --- ingest -------------------------------------------------------------------------------

INGEST_SPEC: list[dict[str, Any]] = [
    {"name": "country", "values": [f"c{j:02d}" for j in range(16)]},
    {"name": "device", "values": ["ios", "android", "web", "tv"]},
    {"name": "browser", "values": [f"b{j}" for j in range(8)]},
    {"name": "age", "edges": [0, 13, 18, 25, 30, 35, 45, 55, 65, 80, 120]},
    {"name": "amount", "edges": [float(2**k) for k in range(-1, 16)]},
]


def ingest_records(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    spec = INGEST_SPEC
    cols = []
    for attr in spec[:3]:
        values = attr["values"]
        p = 1.0 / np.arange(1, len(values) + 1)
        idx = rng.choice(len(values), size=count, p=p / p.sum())
        cols.append([values[i] for i in idx])
    cols.append(rng.integers(0, 120, size=count).tolist())
    cols.append(np.round(rng.uniform(0.5, 2.0**15, size=count), 2).tolist())
    names = [a["name"] for a in spec]
    return [dict(zip(names, row, strict=True)) for row in zip(*cols, strict=True)]


def plain_loop_mapper(universe: Universe) -> Any:
    """The baseline: per record, dict look-ups and bisect into the cell index."""
    index = [{v: i for i, v in enumerate(a["values"])} for a in INGEST_SPEC[:3]]
    edges = [a["edges"] for a in INGEST_SPEC[3:]]
    strides = [math.prod(universe.shape[i + 1:]) for i in range(len(universe.shape))]
    sizes = universe.shape

    def run(batch: list[dict[str, Any]], counts: list[int]) -> None:
        i0, i1, i2 = index
        e3, e4 = edges
        s0, s1, s2, s3, _ = strides
        n3, n4 = sizes[3], sizes[4]
        for r in batch:
            b3 = min(bisect.bisect_right(e3, r["age"]) - 1, n3 - 1)
            b4 = min(bisect.bisect_right(e4, r["amount"]) - 1, n4 - 1)
            counts[i0[r["country"]] * s0 + i1[r["device"]] * s1 + i2[r["browser"]] * s2
                   + b3 * s3 + b4] += 1

    return run


def time_ingest(events: int, repeats: int) -> dict[str, Any]:
    universe = Universe.from_spec(INGEST_SPEC)
    records = ingest_records(events)
    raw = [orjson.dumps(r) for r in records]
    batches = [records[i:i + BATCH] for i in range(0, events, BATCH)]
    raw_batches = [raw[i:i + BATCH] for i in range(0, events, BATCH)]
    n = universe.size
    expected = None
    mapper = plain_loop_mapper(universe)

    def dicts_bincount() -> np.ndarray:
        counts = np.zeros(n, dtype=np.int64)
        for batch in batches:
            cells, bad = universe.cells(batch)
            counts += np.bincount(cells, minlength=n)
        return counts

    def dicts_add_at() -> np.ndarray:
        counts = np.zeros(n, dtype=np.int64)
        for batch in batches:
            cells, bad = universe.cells(batch)
            np.add.at(counts, cells, 1)
        return counts

    def json_bincount() -> np.ndarray:
        counts = np.zeros(n, dtype=np.int64)
        loads = orjson.loads
        for batch in raw_batches:
            cells, bad = universe.cells(list(map(loads, batch)))
            counts += np.bincount(cells, minlength=n)
        return counts

    def json_joined_bincount() -> np.ndarray:
        counts = np.zeros(n, dtype=np.int64)
        loads = orjson.loads
        for batch in raw_batches:
            cells, bad = universe.cells(loads(b"[" + b",".join(batch) + b"]"))
            counts += np.bincount(cells, minlength=n)
        return counts

    def json_only() -> np.ndarray:
        loads = orjson.loads
        for batch in raw_batches:
            list(map(loads, batch))
        return np.zeros(0)

    def plain_loop() -> np.ndarray:
        counts = [0] * n
        for batch in batches:
            mapper(batch, counts)
        return np.array(counts, dtype=np.int64)

    paths = {"dicts -> cells -> bincount": dicts_bincount,
             "dicts -> cells -> add.at": dicts_add_at,
             "JSON bytes -> orjson.loads -> cells -> bincount": json_bincount,
             "JSON bytes -> one orjson.loads per batch (joined) -> cells -> bincount":
                 json_joined_bincount,
             "JSON bytes -> orjson.loads only (decode share)": json_only,
             "baseline: plain Python loop (dicts)": plain_loop}
    rates: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(repeats):  # interleaved repeats, so drift hits every path alike
        for name, fn in paths.items():
            gc.collect()
            start = time.perf_counter()
            counts = fn()
            elapsed = time.perf_counter() - start
            rates[name].append(events / elapsed)
            if counts.size:
                if expected is None:
                    expected = counts
                assert np.array_equal(counts, expected), name
    assert expected is not None and int(expected.sum()) == events
    return {"events": events, "batch": BATCH, "cells": n, "repeats": repeats,
            "paths": {k: {"median_events_per_second": statistics.median(v), "runs": v}
                      for k, v in rates.items()}}


# --- report -------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> str:
    lines = ["### PMWG per-query cost (ms, one core; median / p90)\n",
             "| N | query | support | PMWG easy | PMWG hard | dense numpy easy (`w @ y`) | "
             "dense numpy hard (+ `y *= exp`, normalise) | first query after t grows |",
             "|---|---|---|---|---|---|---|---|"]

    def cell(s: dict[str, Any]) -> str:
        if not s.get("count"):
            return "-"
        return f"{s['median_ms']:.3f} / {s['p90_ms']:.3f} (n={s['count']})"

    for r in results["per_query"]:
        lines.append(f"| 2^{r['bits']} | {r['kind']} | {r['support']:,} | "
                     f"{cell(r['pmwg']['easy'])} | {cell(r['pmwg']['hard'])} | "
                     f"{cell(r['baseline']['easy'])} | {cell(r['baseline']['hard'])} | "
                     f"{cell(r['first_query_after_growth'])} |")
    ing = results["ingest"]
    lines += ["", f"### Ingest ({ing['events']:,} events, batches of {ing['batch']:,}, "
              f"{ing['cells']:,} cells, 5 attributes, one worker; median of "
              f"{ing['repeats']} interleaved runs)\n",
              "| path | events/s | runs (M events/s) |", "|---|---|---|"]
    for name, v in ing["paths"].items():
        runs = ", ".join(f"{x / 1e6:.2f}" for x in v["runs"])
        lines.append(f"| {name} | {v['median_events_per_second'] / 1e6:.2f} M | {runs} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run, writes nothing")
    parser.add_argument("--out", default=str(RESULTS_DIR / "issue7-pmwg-speed.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    easy_n, hard_n = (200, 60) if args.quick else (2000, 400)
    results: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "numpy": np.__version__,
                    "cpus": os.cpu_count(), "platform": platform.platform(),
                    "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")},
        "per_query": [], "load_average_before": os.getloadavg()}
    for bits in (16, 20):
        for kind in KINDS:
            n_e, n_h = (easy_n, hard_n) if kind != "dense" else (easy_n // 4, hard_n // 2)
            r = time_pmwg(bits, kind, n_e, n_h)
            results["per_query"].append(r)
            print(f"  2^{bits} {kind}: easy {r['pmwg']['easy'].get('median_ms', float('nan')):.3f}"
                  f" ms, hard {r['pmwg']['hard'].get('median_ms', float('nan')):.3f} ms",
                  file=sys.stderr)
    events = 200_000 if args.quick else 1_000_000
    results["ingest"] = time_ingest(events, 1 if args.quick else 5)
    results["seconds"] = time.perf_counter() - started
    results["load_average_after"] = os.getloadavg()
    text = report(results)
    print(text)
    print(f"total {results['seconds']:.0f} s", file=sys.stderr)
    if not args.quick:
        results["markdown"] = text
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
