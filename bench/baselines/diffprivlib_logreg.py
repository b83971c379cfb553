"""diffprivlib's private logistic regression, run inside the baseline's own virtual environment.

``bench/erm_vs_diffprivlib.py`` writes the training sets and the fits to make to an ``.npz``
file and runs this script with the environment's interpreter::

    .venv-diffprivlib/bin/python diffprivlib_logreg.py JOBS.npz OUT.npz

JOBS holds ``x{i}`` / ``y{i}`` (float64 features, int64 labels) for every training set ``i``
and ``jobs``, an int/float table with one row per fit: ``(set, epsilon, C, fit_intercept,
seed)``. Every fit is ``diffprivlib.models.LogisticRegression(epsilon=..., data_norm=1.0,
C=..., fit_intercept=..., random_state=seed, max_iter=1000)`` with a fresh
``BudgetAccountant`` (so the default accountant's spend list does not grow): diffprivlib clips
each row to L2 norm ``data_norm`` itself (its own row normalisation) and perturbs the objective
with its ``Vector`` mechanism (Chaudhuri, Monteleoni, Sarwate 2011, Algorithm 2; floating-point
noise). Output: ``coef`` (fits x features) and ``intercept`` (fits), and the seconds per fit.
Only the fitted coefficients leave this process; accuracy is computed by the caller on its own
final test split.
"""

from __future__ import annotations

import sys
import time
import warnings

import numpy as np
from diffprivlib.accountant import BudgetAccountant
from diffprivlib.models import LogisticRegression


def main() -> None:
    jobs_path, out_path = sys.argv[1:3]
    data = np.load(jobs_path)
    jobs = data["jobs"]
    sets: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    coef = np.zeros((len(jobs), data["x0"].shape[1]))
    intercept = np.zeros(len(jobs))
    seconds = np.zeros(len(jobs))
    warnings.simplefilter("ignore")  # convergence warnings: the fit is reported as it is
    for j, (s, epsilon, c, fit_intercept, seed) in enumerate(jobs):
        s = int(s)
        if s not in sets:
            sets[s] = (data[f"x{s}"], data[f"y{s}"])
        x, y = sets[s]
        t0 = time.perf_counter()
        model = LogisticRegression(epsilon=float(epsilon), data_norm=1.0, C=float(c),
                                   fit_intercept=bool(fit_intercept), random_state=int(seed),
                                   max_iter=1000, accountant=BudgetAccountant())
        model.fit(x, y)
        seconds[j] = time.perf_counter() - t0
        coef[j] = model.coef_[0]
        intercept[j] = model.intercept_[0]
    np.savez(out_path, coef=coef, intercept=intercept, seconds=seconds)


if __name__ == "__main__":
    main()
