"""The columnar BLT counters (issue 9): state bytes per key and close-step speed.

What is measured, in one process on one core:

* **bytes per key** of a :class:`~dpstream.core.counting.key_table.KeyTable` with a zCDP spec and a
BLT
  counter at ``--keys`` keys (declared universe, no monitor; horizon 2^20, ``d = 5`` buffers,
  and 2^16, ``d = 4``) after ``--steps`` closes with one event per key per step (issue 9's
  sparse workload): the numpy columns only (table: prefix, flags, monitor columns; groups:
  rows, lanes, initial counts, limb arrays of the integer buffers, inverse buffers, partial
  sums, epoch base), ``sum(a.nbytes) / keys``. The key strings and the key index are listed
  apart. ``tracemalloc`` gives the retained memory of the whole table (strings and index
  included) beside it;
* **limb widths**: how many 32-bit limbs each integer buffer needs in steady state
  (``B_j ~ G x / (1 - theta_j)``) for ``x`` events per key per step, from the proved rule of
  :mod:`dpstream.core.counting.blt_columns`;
* **close-step speed** (key-steps/s) of one :class:`~dpstream.core.counting.blt_columns.BltColumns`
  group of 100k and 1M keys, exact noise included (``bulk_gaussian.gaussian``), and the exact
  sampler's rate alone; against the reference engine (one ``KeyStatistics`` with a
  ``BltCounter`` per key, driven as ``ReferenceShardState.close`` drives it) on 20k keys.

Usage::

    python bench/blt_table.py                   # 1M keys, ~3 min
    python bench/blt_table.py --keys 100000 --quick   # smoke run, writes nothing
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the reference engine

import numpy as np  # noqa: E402
from support.key_statistics import KeyStatistics  # noqa: E402

from dpstream.core.counting.blt_columns import BltColumns  # noqa: E402
from dpstream.core.counting.blt_counter import BltCounterSpec  # noqa: E402
from dpstream.core.counting.blt_parameters import GRID_BITS, _parameters  # noqa: E402
from dpstream.core.counting.key_table import KeyTable  # noqa: E402
from dpstream.core.counting.statistics_spec import StatisticsSpec  # noqa: E402
from dpstream.core.noise import bulk_gaussian  # noqa: E402
from dpstream.core.noise.coordinates import TAG_BLT  # noqa: E402
from dpstream.core.noise.keys import NoiseKey  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KEY = NoiseKey.for_tests(0)


def spec_for(horizon: int, mode: str = "declared") -> StatisticsSpec:
    return StatisticsSpec(flow="bench", mode=mode, accounting="zcdp", budget=1.0,  # type: ignore[arg-type]
                          delta_budget=1e-6, counter=BltCounterSpec(rho=0.5, horizon=horizon),
                          monitor=None, instance="bench")


def table_bytes(table: KeyTable) -> dict[str, float]:
    keys = table.live
    own = [table._prefix, table._flags, table._watched, table._mlanes, table._rho]
    parts = {"table (prefix, flags, monitor)": sum(a.nbytes for a in own)}
    rows = lanes = initial = grid = inverse = partial = base = 0
    for g in table._groups:
        rows += g.rows.nbytes
        lanes += g.lanes.nbytes
        initial += 0 if g.initial is None else g.initial.nbytes
        c = g.counter  # type: ignore[union-attr]
        grid += sum(a.nbytes for a in c.grid)
        inverse += c.inverse.nbytes
        partial += c.partial.nbytes
        base += 0 if c.base is None else c.base.nbytes
    parts.update({"group rows": rows, "counter lanes": lanes, "initial counts": initial,
                  "integer buffers (limbs)": grid, "inverse buffers": inverse,
                  "partial sums": partial, "epoch base": base})
    out = {name: value / keys for name, value in parts.items()}
    out["columns total"] = sum(parts.values()) / keys
    out["key index, keys by row included (separate)"] = table._index.nbytes / keys
    out["key strings (separate)"] = sum(map(sys.getsizeof, table._index.names.tolist())) / keys
    widths = [g.counter.grid for g in table._groups]  # type: ignore[union-attr]
    out["limbs per buffer"] = [a.shape[0] for a in widths[0]] if widths else []  # type: ignore[assignment]
    return out


def memory(keys: int, steps: int, horizon: int) -> dict[str, Any]:
    names = [f"user-{i:07d}" for i in range(keys)]
    spec = spec_for(horizon)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    table = KeyTable(spec, KEY, names)
    ones = np.ones(keys, dtype=np.int64)
    for step in range(steps):
        table.close(step, names, ones)
    gc.collect()
    retained, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    result: dict[str, Any] = {"keys": keys, "steps": steps, "horizon": horizon,
                              "buffers": _parameters(horizon).buffers,
                              "bytes_per_key": table_bytes(table),
                              "tracemalloc_retained_per_key": (retained - before) / keys,
                              "tracemalloc_peak_per_key": (peak - before) / keys}
    del table
    return result


def steady_state_limbs(horizon: int, events: int) -> list[int]:
    """Limbs each buffer needs at steady state with ``events`` per key per step."""
    p = _parameters(horizon)
    widths = []
    for t in p.theta_num:
        theta = t / (1 << p.precision_bits)
        steps = min(horizon, 1.0 / (1.0 - theta))
        bound = int(events * (1 << GRID_BITS) * steps) + horizon
        widths.append(max(1, (bound.bit_length() + 31) // 32))
    return widths


def group_speed(keys: int, horizon: int, repeats: int) -> dict[str, float]:
    spec = BltCounterSpec(rho=0.5, horizon=horizon)
    columns = BltColumns(spec, keys)
    lanes = KEY.lane_words(("bench",), [f"u{i}" for i in range(keys)], ("counter", "d", 0))
    rng = np.random.default_rng(1)
    for _ in range(3):  # warm up the buffers (2 limbs, as in the steady state)
        columns.step(KEY, lanes, rng.integers(0, 3, keys))
    times = []
    for _ in range(repeats):
        x = rng.integers(0, 3, keys)
        started = time.perf_counter()
        columns.step(KEY, lanes, x)  # the arithmetic and the exact noise
        times.append(time.perf_counter() - started)
    return {"keys": keys, "key_steps_per_s": keys / statistics.median(times),
            "step_seconds": statistics.median(times),
            "limbs": [g.shape[0] for g in columns.grid]}


def noise_rate(draws: int) -> float:
    spec = BltCounterSpec(rho=0.5, horizon=2**20)
    lanes = KEY.lane_words(("bench",), [f"u{i}" for i in range(draws)], ("counter", "d", 0))
    started = time.perf_counter()
    bulk_gaussian.gaussian(KEY, lanes, spec.sigma2_grid, TAG_BLT, 0, 0, 5)
    return draws / (time.perf_counter() - started)


def reference_speed(keys: int, horizon: int, steps: int) -> float:
    spec = spec_for(horizon)
    names = [f"user-{i:07d}" for i in range(keys)]
    stats = {k: KeyStatistics(spec, k, 0, KEY) for k in names}
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        for key in sorted(stats):  # ReferenceShardState.close, one event per key
            stats[key].step(1)
        times.append(time.perf_counter() - started)
    return keys / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reference-keys", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    out: dict[str, Any] = {"keys": args.keys, "steps": args.steps}
    out["memory"] = [memory(args.keys, args.steps, h) for h in (2**20, 2**16)]
    out["memory_after_an_epoch"] = memory(args.keys, 17, 16)  # + the base column
    out["steady_state_limbs"] = {
        str(h): {str(x): steady_state_limbs(h, x) for x in (1, 10, 1000, 10**6)}
        for h in (2**16, 2**20)}
    sizes = sorted({100_000, args.keys})
    out["group_speed"] = [group_speed(n, 2**20, args.repeats) for n in sizes]
    out["exact_noise_draws_per_s"] = noise_rate(max(sizes))
    out["reference_key_steps_per_s"] = reference_speed(args.reference_keys, 2**20,
                                                       args.repeats)
    text = json.dumps(out, indent=2)
    print(text)
    if args.quick:
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "issue9-blt-table.json").write_text(text + "\n")
    (RESULTS / "issue9-blt-table.md").write_text(report(out))


def report(out: dict[str, Any]) -> str:
    lines = ["# Issue 9: the columnar BLT counter (`bench/blt_table.py`)", ""]
    lines.append(f"{out['keys']:,} declared keys, zCDP, BLT counter (rho 0.5), no monitor; "
                 "one event per key per step. Bytes are numpy column bytes per key "
                 "(`sum(a.nbytes) / keys`); the key strings and the key index are listed apart.")
    lines.append("")
    for m in [*out["memory"], out["memory_after_an_epoch"]]:
        b = m["bytes_per_key"]
        lines.append(f"## horizon {m['horizon']} (d = {m['buffers']}), after {m['steps']} "
                     f"steps; limbs per buffer {b['limbs per buffer']}")
        lines.append("")
        lines.append("| part | bytes/key |")
        lines.append("|---|---|")
        for name, value in b.items():
            if name != "limbs per buffer":
                lines.append(f"| {name} | {value:.1f} |")
        lines.append(f"| tracemalloc retained, whole table | "
                     f"{m['tracemalloc_retained_per_key']:.1f} |")
        lines.append(f"| tracemalloc peak | {m['tracemalloc_peak_per_key']:.1f} |")
        lines.append("")
    lines.append("## Steady-state limbs per integer buffer (events per key per step)")
    lines.append("")
    for h, rows in out["steady_state_limbs"].items():
        lines.append(f"* horizon {h}: " + "; ".join(f"x = {x}: {w}" for x, w in rows.items()))
    lines.append("")
    lines.append("## Close-step speed (key-steps/s)")
    lines.append("")
    lines.append("| engine | keys | key-steps/s (exact noise included) |")
    lines.append("|---|---|---|")
    for g in out["group_speed"]:
        lines.append(f"| BltColumns group | {g['keys']:,} | {g['key_steps_per_s']:,.0f} |")
    lines.append(f"| reference (KeyStatistics + BltCounter per key) | 20,000 | "
                 f"{out['reference_key_steps_per_s']:,.0f} |")
    lines.append("")
    lanes = max(g["keys"] for g in out["group_speed"])
    lines.append(f"The exact discrete Gaussian alone (`bulk_gaussian.gaussian`, {lanes:,} "
                 f"lanes): {out['exact_noise_draws_per_s']:,.0f} draws/s; the reference draws "
                 "one at a time (`gaussian_one`).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
