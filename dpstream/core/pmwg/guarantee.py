"""What the paper's accuracy theorems promise for a PMWG configuration (start-up report).

**Paper.** Cummings, Krehbiel, Lai, Tantipongpipat, *Differential Privacy for Growing
Databases* (NeurIPS 2018): Algorithm 1 (PMWG), Theorem 11 and its privacy sum (B.1),
Theorem 12 (B.2), Theorem 5, Lemma 14, the generalised noise (B.5) with Theorems 16 and 19,
Lemma 18 and its sum ``tau``; the sparse vector subroutines Algorithm 2 (NATG) and
Algorithm 3 (NSG) with Theorems 20-26 (appendices B and C); Theorem 4 (zCDP composition,
Bun & Steinke 2016) in the main body.

**The report.** :func:`accuracy_guarantee` checks the preconditions of the accuracy theorem
that applies to the spec's noise function (Theorem 5 with (B.4) for ``p = 1/2, delta = 0``;
Theorem 16 with (B.6) for other ``p``; Theorem 19 with (B.11), Theorem 8 at ``p = 1/2``, for
``delta > 0``; all with ``kappa = 1``) and returns a :class:`Guarantee`: the smallest alpha
the theorem supports, the query budget at ``t = n`` and ``2n``, the noise at ``t = n`` and
the privacy cost. A violated precondition is reported, not refused: **privacy never depends
on it** (PMWG's privacy cost is computed from the noise actually used, see
:mod:`dpstream.core.pmwg.spec`), only the theorem's accuracy does.

**At the user level** (``spec.sensitivity = m > 1``) the noise function is the event level's
at ``epsilon / m`` (:mod:`dpstream.core.pmwg.spec`: ``xi`` is linear in ``epsilon`` and every
mode's ``c`` is divided by ``m``), and the accuracy theorems depend on the privacy parameter
only through ``xi``: every theorem is therefore evaluated at ``epsilon / m`` (alpha_min, the
query budget, the paper's ``c`` the modes are compared with, Theorem 8's ``epsilon <= 1``),
and the noise reported is the scaled one (``m`` times the event level's). The theorems speak
of the **bounded** database (each person's first ``max_rows`` rows); what bounding drops is a
bias they do not cover, and the report says so. No noise and no state:
a deterministic function of public parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

from dpstream.core.accounting.ledger import exact
from dpstream.core.pmwg.sparse_vector import _pow2, dlap_variance

if TYPE_CHECKING:
    from dpstream.core.pmwg.spec import PmwgSpec

__all__ = ["Guarantee", "Precondition", "accuracy_guarantee"]

_HALF: Final = 0.5


@dataclass(frozen=True)
class Precondition:
    """One precondition of an accuracy theorem and whether this configuration meets it."""

    source: str
    condition: str
    value: str
    holds: bool


@dataclass(frozen=True)
class Guarantee:
    """What the paper's theorems say about a configuration (for start-up logs).

    Privacy never depends on these preconditions (it is computed); accuracy does.

    Attributes:
        theorem: the accuracy theorem that applies to this noise function.
        preconditions: every precondition with its verdict.
        alpha_min: the smallest alpha the theorem supports at this ``n, eps, N, beta``
            (kappa = 1).
        accuracy_guaranteed: all preconditions hold and the mode uses a ``xi`` at least the
            theorem's.
        query_budget: ``(t, log of kappa sum_{tau=n}^t exp(...))`` at ``t = n`` and ``2n``:
            the theorem's query budget (natural log; kappa = 1).
        hard_query_bound_at_n: Algorithm 1's hard-query cap at ``t = n``.
        xi_n: the noise function at ``t = n``.
        answer_std_at_n: std of a hard answer's noise at ``t = n`` (fraction units).
        first_beta_term: ``exp(-alpha xi_n / 24)``, the first term of (B.2).
        worst_case_cost: the committed (or, in practical mode, allowed) cost, in ``unit``.
        budget: the ledger's budget, in ``unit``.
        unit: ``"epsilon"`` or ``"rho"``.
        epsilon_reported: the (eps, delta)-DP epsilon of ``worst_case_cost``.
        notes: free-text remarks.

    """

    theorem: str
    preconditions: tuple[Precondition, ...]
    alpha_min: float
    accuracy_guaranteed: bool
    query_budget: tuple[tuple[int, float], ...]
    hard_query_bound_at_n: int
    xi_n: float
    answer_std_at_n: float
    first_beta_term: float
    worst_case_cost: float
    budget: float
    unit: str
    epsilon_reported: float
    notes: tuple[str, ...]

    def lines(self) -> list[str]:
        """Return the report as log lines."""
        out = [
            f"PMWG accuracy theorem: {self.theorem}; guaranteed: {self.accuracy_guaranteed}",
            f"privacy: worst case {self.worst_case_cost:.6g} of {self.budget:.6g} {self.unit} "
            f"(epsilon {self.epsilon_reported:.6g})",
            f"xi_n = {self.xi_n:.6g}; hard-answer noise std at n = {self.answer_std_at_n:.6g}; "
            f"exp(-alpha xi_n / 24) = {self.first_beta_term:.6g}",
            f"alpha_min (kappa=1) = {self.alpha_min:.6g}; hard-query bound at n = "
            f"{self.hard_query_bound_at_n}",
        ]
        out += [f"query budget at t={t}: exp({lb:.6g})" for t, lb in self.query_budget]
        out += [
            f"[{'ok' if c.holds else 'VIOLATED'}] {c.source}: {c.condition} ({c.value})"
            for c in self.preconditions
        ]
        out += list(self.notes)
        return out


def _log_sum_exp(values: npt.NDArray[np.float64]) -> float:
    top = float(np.max(values))
    return top + math.log(float(np.sum(np.exp(values - top))))


def accuracy_guarantee(spec: PmwgSpec) -> Guarantee:
    """Check the accuracy theorems' preconditions and report what follows.

    Theorem 5 with (B.4) for ``p = 1/2, delta = 0``; Theorem 16 with (B.6) for other
    ``p``; Theorem 19 with (B.11) (Theorem 8 at ``p = 1/2``) for ``delta > 0``; all with
    ``kappa = 1``. A violated precondition is reported, not refused: privacy does not
    depend on it, but the theorem then does not guarantee accuracy.
    """
    rows = int(spec.sensitivity)  # m rows a person may add: the theorems run at epsilon / m
    eps, alpha, beta = float(spec.epsilon) / rows, float(spec.alpha), float(spec.beta)
    n, cells, p, q = int(spec.n), int(spec.universe_size), float(spec.p), spec.q
    log_nn = math.log(cells * n)
    pre: list[Precondition] = []
    if spec.accounting == "pure" and p == _HALF:
        theorem = "Theorem 5 (B.4)"
        alpha_min = (8262 * log_nn * math.log(192 * n / beta) / (n * eps)) ** (1 / 3)
        exponent_scale = alpha**3 * eps * math.sqrt(n) / (8262 * log_nn)
        src = "Theorem 5"
        pre.append(Precondition(src, "n >= 21", str(n), n >= 21))
    else:
        if spec.accounting == "pure":
            theorem = "Theorem 16 (B.6)"
            alpha_min = (6426 * log_nn * math.log(144 * n / beta)
                         / (q * q * n * eps)) ** (1 / 3)
            exponent_scale = alpha**3 * q * q * eps * n**q / (6048 * log_nn)
            src = "Theorem 16"
        else:
            log_d = math.log(1.0 / float(spec.delta))
            theorem = "Theorem 19 (B.11)" + (" = Theorem 8" if p == 0.5 else "")
            alpha_min = (1224 * math.sqrt(log_nn) * math.log(144 * n / beta)
                         * math.sqrt(log_d) / (q * n * eps)) ** 0.5
            exponent_scale = (alpha**2 * q * eps * n**q
                              / (1152 * math.sqrt(log_nn) * math.sqrt(log_d)))
            src = "Theorem 19"
            pre.append(Precondition(src, "delta in (0, 1/e)", repr(spec.delta),
                                    0 < float(spec.delta) < math.exp(-1)))
            if p == _HALF:
                pre.append(Precondition("Theorem 8", "epsilon <= 1", repr(eps), eps <= 1))
        pre.append(Precondition(src, "n >= 17", str(n), n >= 17))
        pre.append(Precondition(src, "p in [1/4, 1)", repr(p), 0.25 <= p < 1))
        pre.append(Precondition(src, "beta in (0, 2^-7.5)", repr(beta),
                                beta < 2.0**-7.5))
    pre.insert(0, Precondition(src, "N >= 3", str(cells), cells >= 3))
    pre.append(Precondition(src, f"alpha >= {alpha_min:.6g} (kappa = 1)", repr(alpha),
                            alpha >= alpha_min))
    notes: list[str] = []
    if rows != 1:
        notes.append(f"user level: one person adds at most {rows} rows (Delta_t = {rows}/t); "
                     f"the theorems are evaluated at epsilon / {rows} = {eps:.6g} and speak of "
                     "the bounded database (rows beyond the cap are dropped: a bias they do "
                     "not cover)")
    paper_c = spec.paper_coefficient
    if spec.mode == "paper":
        covered = True
    elif spec.mode == "solved":
        covered = spec.xi_coefficient >= paper_c
        notes.append(
            "mode 'solved': xi is "
            f"{spec.xi_coefficient / paper_c:.4g} x the paper's; (B.2) is decreasing in "
            "xi, so the theorem's accuracy " + ("carries over" if covered else
                                               "does NOT carry over"))
    else:
        covered = False
        notes.append("mode 'practical': xi is sized for the hard_query_cap, not by the "
                     "theorem; accuracy is not guaranteed by it")
    if spec.threshold is not None and spec.threshold_value != 2 * exact(alpha) / 3:
        covered = False
        notes.append("threshold differs from Algorithm 1's 2 alpha / 3: the accuracy "
                     "theorems do not apply")
    all_hold = all(c.holds for c in pre)
    if not all_hold:
        notes.append("a precondition is violated: accuracy is not guaranteed by the "
                     "theorem (privacy is unaffected)")
    budgets: list[tuple[int, float]] = []
    for t in (n, 2 * n):
        # the exponent grows with tau: beyond 2^22 terms, the last 2^22 give a lower bound
        tau = np.arange(max(n, t - (1 << 22) + 1), t + 1, dtype=np.float64)
        budgets.append((t, _log_sum_exp(exponent_scale * np.power(tau, p))))
    xi_n = spec.xi(n)
    g = _pow2(spec.grid_exponent(n))
    std = math.sqrt(dlap_variance(Fraction(8) / g)) * float(g) / xi_n
    cost = spec.worst_case_cost()
    return Guarantee(
        theorem=theorem,
        preconditions=tuple(pre),
        alpha_min=alpha_min,
        accuracy_guaranteed=all_hold and covered,
        query_budget=tuple(budgets),
        hard_query_bound_at_n=spec.hard_query_bound(n),
        xi_n=xi_n,
        answer_std_at_n=std,
        first_beta_term=math.exp(-alpha * xi_n / 24),
        worst_case_cost=cost,
        budget=spec.budget,
        unit=spec.unit,
        epsilon_reported=spec.reported_epsilon(cost),
        notes=tuple(notes),
    )
