"""Exact discrete Laplace draws per second: bulk (vectorized) against the scalar samplers.

In one process, on one core (BLAS and OpenSSL are single-threaded here), interleaved:

* ``bulk``: :func:`dpstream.core.bulk_noise.laplace` over ``--draws`` lanes at once (the lanes
  are made beforehand, as the columnar shard keeps them), at the tree counter's scale
  (levels 21 / epsilon 0.7 = 30) and the monitor's query scale (4 / 0.1 = 40);
* ``scalar-v2``: :func:`dpstream.core.bulk_noise.laplace_one`, the same draws one at a time;
* ``scalar-v1``: the per-release sampler used before (CKS Algorithm 2 on a BLAKE2b stream per
  draw), the issue's "about 75k/s today".

Usage::

    python bench/noise_speed.py                  # 5 repeats, 2M bulk draws
    python bench/noise_speed.py --repeats 3 --draws 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from fractions import Fraction
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from dpstream.core import bulk_noise  # noqa: E402
from dpstream.core.noise import TAG_TREE, NoiseKey, discrete_laplace  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--draws", type=int, default=2_000_000)
    parser.add_argument("--scalar-draws", type=int, default=20_000)
    args = parser.parse_args()
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
    (RESULTS / "issue9-noise.json").write_text(json.dumps(
        {"draws": args.draws, "scalar_draws": args.scalar_draws, "repeats": args.repeats,
         "summary": summary}, indent=2))
    for name, values in summary.items():
        print(f"{name:32s} {values}")


if __name__ == "__main__":
    main()
