"""Exact discrete noise draws per second: bulk (vectorized) against the scalar samplers.

In one process, on one core (BLAS and OpenSSL are single-threaded here), interleaved.

Discrete Laplace (``--kind laplace``, the default; ``results/issue9-noise.json``):

* ``bulk``: :func:`dpstream.core.noise.bulk.laplace` over ``--draws`` lanes at once (the lanes
  are made beforehand, as the columnar shard keeps them), at the tree counter's scale
  (levels 21 / epsilon 0.7 = 30) and the monitor's query scale (4 / 0.1 = 40);
* ``scalar-v2``: :func:`dpstream.core.noise.bulk.laplace_one`, the same draws one at a time;
* ``scalar-v1``: the per-release sampler used before (CKS Algorithm 2 on a BLAKE2b stream per
  draw), the issue's "about 75k/s today".

Discrete Gaussian (``--kind gaussian``; ``results/issue9-noise-gaussian.{json,md}``), at
small sigma2 (2, 50: the zCDP initial count's range) and the BLT counter's sigma_G^2
(``BltCounterSpec(rho).sigma2_grid`` at rho = 0.5, 0.01 and 1e-6, horizon 2^20: sigma about
2^41 to 2^51):

* ``bulk``: :func:`dpstream.core.noise.bulk_gaussian.gaussian` (noise scheme 4: the vectorized
  exact sampler) over ``--draws`` lanes at once;
* ``scalar-v4``: :func:`dpstream.core.noise.bulk_gaussian.gaussian_one`, its scalar reference, the
  same draws one at a time (what the BLT counter and the initial count call per release);
* ``scalar-v3``: the sampler of noise scheme 3 (CKS Algorithm 3,
  :func:`dpstream.core.noise.samplers.discrete_gaussian`, on a BLAKE2b stream per draw).

Usage::

    python bench/noise_speed.py                  # 5 repeats, 2M bulk draws
    python bench/noise_speed.py --repeats 3 --draws 1000000
    python bench/noise_speed.py --kind gaussian --repeats 5 --draws 1000000
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from fractions import Fraction
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from dpstream.core.noise import bulk as bulk_noise  # noqa: E402
from dpstream.core.noise import bulk_gaussian  # noqa: E402
from dpstream.core.noise.coordinates import TAG_BLT, TAG_TREE  # noqa: E402
from dpstream.core.noise.keys import NoiseKey  # noqa: E402
from dpstream.core.noise.samplers import discrete_gaussian, discrete_laplace  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=("laplace", "gaussian"), default="laplace")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--draws", type=int, default=2_000_000)
    parser.add_argument("--scalar-draws", type=int, default=20_000)
    parser.add_argument("--out", default=None,
                        help="results name (default issue9-noise, or issue9-noise-gaussian)")
    args = parser.parse_args()
    if args.kind == "gaussian":
        gaussian_main(args)
        return
    key = NoiseKey.for_tests(0)
    lanes_bytes = [key.lane("bench", "key", i) for i in range(args.draws)]
    lanes = bulk_noise.lanes_array(lanes_bytes)
    index = np.arange(args.draws, dtype=np.int64)
    rates: dict[str, list[float]] = {}
    for scale in (Fraction(30), Fraction(40)):
        bulk_noise.laplace(key, lanes[:1000], scale, TAG_TREE, 0, 0, index[:1000])  # tables
        for _ in range(args.repeats):
            started = time.perf_counter()
            bulk_noise.laplace(key, lanes, scale, TAG_TREE, 0, 0, index)
            rates.setdefault(f"bulk scale {scale}", []).append(
                args.draws / (time.perf_counter() - started))
            started = time.perf_counter()
            for i in range(args.scalar_draws):
                bulk_noise.laplace_one(key, lanes_bytes[i], scale, TAG_TREE, 0, 0, i)
            rates.setdefault(f"scalar-v2 scale {scale}", []).append(
                args.scalar_draws / (time.perf_counter() - started))
            started = time.perf_counter()
            for i in range(args.scalar_draws):
                discrete_laplace(key.stream("bench", "key", i, "tree", 0, 0, i), scale)
            rates.setdefault(f"scalar-v1 scale {scale}", []).append(
                args.scalar_draws / (time.perf_counter() - started))
    summary = {name: {"median_draws_per_second": statistics.median(values),
                      "runs": values} for name, values in rates.items()}
    for scale in ("30", "40"):
        summary[f"bulk over scalar-v1, scale {scale}"] = {
            "ratio": summary[f"bulk scale {scale}"]["median_draws_per_second"]
            / summary[f"scalar-v1 scale {scale}"]["median_draws_per_second"]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out or 'issue9-noise'}.json").write_text(json.dumps(
        {"draws": args.draws, "scalar_draws": args.scalar_draws, "repeats": args.repeats,
         "summary": summary}, indent=2))
    for name, values in summary.items():
        print(f"{name:32s} {values}")


def _gaussian_cases() -> list[tuple[str, Fraction]]:
    from dpstream.core.counting.blt_counter import BltCounterSpec

    cases = [("sigma2 = 2", Fraction(2)), ("sigma2 = 50", Fraction(50))]
    for rho in (0.5, 0.01, 1e-6):
        sigma2 = BltCounterSpec(rho=rho, horizon=2**20).sigma2_grid
        cases.append((f"BLT rho = {rho:g} (sigma ≈ 2^{np.log2(float(sigma2)) / 2:.1f})", sigma2))
    return cases


def gaussian_main(args: argparse.Namespace) -> None:
    key = NoiseKey.for_tests(0)
    lanes_bytes = [key.lane("bench", "key", i) for i in range(args.draws)]
    lanes = bulk_noise.lanes_array(lanes_bytes)
    index = np.arange(args.draws, dtype=np.int64)
    cases = _gaussian_cases()
    rates: dict[str, dict[str, list[float]]] = {}
    for name, sigma2 in cases:
        bulk_gaussian.gaussian(key, lanes[:1000], sigma2, TAG_BLT, 0, 0, index[:1000])  # warm up
        rows = rates.setdefault(name, {})
        for _ in range(args.repeats):
            started = time.perf_counter()
            bulk_gaussian.gaussian(key, lanes, sigma2, TAG_BLT, 0, 0, index)
            rows.setdefault("bulk", []).append(args.draws / (time.perf_counter() - started))
            started = time.perf_counter()
            for i in range(args.scalar_draws):
                bulk_gaussian.gaussian_one(key, lanes_bytes[i], sigma2, TAG_BLT, 0, 0, i)
            rows.setdefault("scalar-v4", []).append(
                args.scalar_draws / (time.perf_counter() - started))
            started = time.perf_counter()
            for i in range(args.scalar_draws):
                discrete_gaussian(key.stream("bench", "key", i, "blt", 0, i), sigma2)
            rows.setdefault("scalar-v3", []).append(
                args.scalar_draws / (time.perf_counter() - started))
    summary: dict[str, dict[str, object]] = {}
    for (name, sigma2), rows in zip(cases, rates.values(), strict=True):
        medians = {kind: statistics.median(values) for kind, values in rows.items()}
        t = math.isqrt(sigma2.numerator // sigma2.denominator) + 1
        summary[name] = {"sigma2": str(sigma2), "t": t,
                         **{f"{kind} median draws/s": medians[kind] for kind in medians},
                         "bulk over scalar-v3": medians["bulk"] / medians["scalar-v3"],
                         "runs": rows}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    meta = {"command": "python bench/noise_speed.py " + " ".join(sys.argv[1:]),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "python": platform.python_version(), "numpy": np.__version__,
            "cpus": os.cpu_count(), "load_average_at_end": load}
    out = args.out or "issue9-noise-gaussian"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{out}.json").write_text(json.dumps(
        {**meta, "draws": args.draws, "scalar_draws": args.scalar_draws,
         "repeats": args.repeats, "summary": summary}, indent=2))
    lines = [
        "# Exact discrete Gaussian draws per second: vectorized against scalar (issue 9)", "",
        f"`{meta['command']}` on {meta['date']}: {meta['cpus']} vCPUs, Python "
        f"{meta['python']}, numpy {meta['numpy']}; load average at the end {load:.2f}.", "",
        f"One process, one core, interleaved; each figure is the median of {args.repeats} "
        f"repeats. *bulk*: `bulk_gaussian.gaussian` on {args.draws:,} lanes at once (noise scheme "
        "4, the vectorized exact CKS Algorithm 3); *scalar-v4*: `bulk_gaussian.gaussian_one`, its "
        f"plain-Python reference, on {args.scalar_draws:,} draws one at a time; *scalar-v3*: "
        "the scheme-3 sampler (`noise.discrete_gaussian` on a BLAKE2b stream per draw).", "",
        "| sigma2 | t = floor(sigma) + 1 | bulk | scalar-v4 | scalar-v3 | bulk / scalar-v3 |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in summary.items():
        lines.append(
            f"| {name} | {row['t']:,} | {row['bulk median draws/s'] / 1e6:.2f} M/s | "
            f"{row['scalar-v4 median draws/s'] / 1e3:.0f} k/s | "
            f"{row['scalar-v3 median draws/s'] / 1e3:.0f} k/s | "
            f"{row['bulk over scalar-v3']:.0f} |")
    (RESULTS / f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
