"""PipelineDP's private count per key, run inside the baseline's own virtual environment.

``bench/contribution_accuracy.py`` writes the stream as columns (``people``, ``keys``: int32
arrays) to an ``.npz`` file and runs this script with the environment's interpreter::

    .venv-pipelinedp/bin/python pipelinedp_count.py STREAM.npz PARAMS.json OUT.npz

PARAMS: ``epsilon``, ``max_partitions_contributed`` (L0), ``max_contributions_per_partition``
(Linf), ``keys`` (the number of declared keys: partitions ``0 .. keys - 1``), ``seeds`` (one
run per seed), ``public`` (true: the declared keys are PipelineDP's public partitions, so
partition selection does not enter; false: private partition selection, ``delta`` is spent on
it) and ``delta``.

Every run is PipelineDP's ``DPEngine.aggregate`` on the whole stream with ``Metrics.COUNT``,
``NoiseKind.LAPLACE`` and a ``NaiveBudgetAccountant`` holding the whole (epsilon, delta): one
aggregation, so with public partitions the count gets all of epsilon; with private partition
selection the accountant splits it between the selection and the count (half each).
PipelineDP bounds contributions by sampling with ``np.random.choice`` (per (person, key) Linf
events, then per person L0 keys) and draws its
Laplace noise in the C++ library (``pydp``), so seeding numpy before a run fixes the sampling
and not the noise: each seed is run twice, at the configured epsilon and at ``epsilon = 1e9``
(noise of scale ~L0 Linf 1e-9), and the second run's rounded counts are the first run's
**bounded** counts exactly (same sample), which separates PipelineDP's bounding bias from its
noise. Output: ``released`` and ``bounded`` (seeds x keys, float64; NaN where private partition
selection dropped a key) and the seconds per run.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import pipeline_dp


def aggregate(rows: list[tuple[int, int]], params: dict, epsilon: float, delta: float,
              seed: int) -> dict[int, float]:
    """One PipelineDP count over ``rows`` of (person, key), numpy's sampling seeded."""
    np.random.seed(seed)
    accountant = pipeline_dp.NaiveBudgetAccountant(total_epsilon=epsilon, total_delta=delta)
    engine = pipeline_dp.DPEngine(accountant, pipeline_dp.LocalBackend())
    aggregate_params = pipeline_dp.AggregateParams(
        noise_kind=pipeline_dp.NoiseKind.LAPLACE, metrics=[pipeline_dp.Metrics.COUNT],
        max_partitions_contributed=params["max_partitions_contributed"],
        max_contributions_per_partition=params["max_contributions_per_partition"])
    extractors = pipeline_dp.DataExtractors(privacy_id_extractor=lambda row: row[0],
                                            partition_extractor=lambda row: row[1],
                                            value_extractor=lambda row: 0)
    public = list(range(params["keys"])) if params["public"] else None
    result = engine.aggregate(rows, aggregate_params, extractors, public_partitions=public)
    accountant.compute_budgets()
    return {int(key): float(metrics.count) for key, metrics in result}


def main() -> None:
    stream_path, params_path, out_path = sys.argv[1:4]
    params = json.loads(open(params_path).read())
    data = np.load(stream_path)
    rows = list(zip(data["people"].tolist(), data["keys"].tolist(), strict=True))
    keys = params["keys"]
    delta = params["delta"] if not params["public"] else 0.0
    seeds = params["seeds"]
    released = np.full((len(seeds), keys), np.nan)
    bounded = np.full((len(seeds), keys), np.nan)
    seconds = []
    for i, seed in enumerate(seeds):
        started = time.perf_counter()
        for key, value in aggregate(rows, params, params["epsilon"], delta, seed).items():
            released[i, key] = value
        seconds.append(time.perf_counter() - started)
        exact = aggregate(rows, params, 1e9, delta, seed)
        for key, value in exact.items():
            bounded[i, key] = round(value)
        print(f"pipeline-dp seed {seed}: {seconds[-1]:.1f} s", file=sys.stderr)
    np.savez(out_path, released=released, bounded=bounded, seconds=np.array(seconds))


if __name__ == "__main__":
    main()
