"""Private multiplicative weights for growing databases (PMWG), on exact-noise sparse vector.

PMWG answers an adaptively chosen stream of linear queries on a database that grows over
time, under pure epsilon-DP or, for the ``delta > 0`` version, zCDP (event level: neighbouring
streams differ by one event).

**Paper.** Cummings, Krehbiel, Lai, Tantipongpipat, *Differential Privacy for Growing
Databases* (NeurIPS 2018): Algorithm 1 (PMWG), Theorem 11 and its privacy sum (B.1),
Theorem 12 (B.2), Theorem 5, Lemma 14, the generalised noise (B.5) with Theorems 16 and 19,
Lemma 18 and its sum ``tau``; the sparse vector subroutines Algorithm 2 (NATG) and
Algorithm 3 (NSG) with Theorems 20-26 (appendices B and C); Theorem 4 (zCDP composition,
Bun & Steinke 2016) in the main body.

**The mechanism (Algorithm 1).** A public histogram ``y`` over the ``N`` cells starts
uniform at time ``n``. A query ``f`` (weights ``w_i`` in ``[0, 1]``) is answered at the
public database size ``t``: PMWG sends ``f' = f - f(y)`` and ``f(y) - f`` to NSG with
threshold ``T = 2 alpha / 3``. If NSG says neither is above the threshold the query is
*easy* and the answer is ``f(y)``, computed from public data alone. Otherwise it is *hard*:
the answer is NSG's noisy numeric answer, the hard-query counter grows, and ``y`` takes a
multiplicative-weights step with learning rate ``alpha/6`` towards the answer. When data
arrived since the last query (``t' < t``) ``y`` is first mixed with the uniform
distribution: ``y <- (t'/t) y + ((t - t')/t) (1/N)`` (Lemma 6 bounds what this costs the
potential argument). Once ``sum h_tau > 36/alpha^2 (log N + sum_{tau=n+1}^t b_tau)``,
``b_tau = log N/tau + log(tau-1)/tau + log(tau/(tau-1))`` (Corollary 7), Algorithm 1
"returns bottom"; we read that as **halting the algorithm**: that query and every later one
is answered ``None`` (bottom) for good, which is what Theorem 11's proof needs (it assumes
the check holds at every time).

**Time and sensitivity.** The caller passes the true count histogram and a **public size**
``t >= n``, non-decreasing between calls (in the flow: a privately released, monotone
estimate of the database size, paid for elsewhere; it must never be the true size, whose
changes would then be published by the uniform update and the noise scale). The query value is
``f(D_t) = weighted_count(counts) / (2^16 t)`` exactly (weights are multiples of
``2^-16``). Adding or removing one event changes ``weighted_count`` by at most ``2^16``,
so ``f(D_t)`` has sensitivity ``Delta_t = 1/t``, and ``f(y)`` is public: that is all the
proofs use (privacy does not need ``t`` to equal the true size; accuracy does, as ``f(D_t)``
is then the fraction the theorems speak of). ``xi_t = c t^p`` is non-decreasing and
``xi_t Delta_t = c t^(p-1)`` is non-increasing, the assumptions of Theorem 20.

**Noise functions.** ``delta = 0`` (``accounting="pure"``): Algorithm 1's
``xi_t = alpha^2 n^(1/2) eps t^(1/2) / (162 log(Nn))`` at ``p = 1/2``, otherwise (B.5)'s
``alpha^2 (1-p)^2 n^(1-p) eps t^p / (126 log(Nn))``. ``delta > 0`` (``"zcdp"``):
``alpha (1-p) n^(1-p) eps t^p / (24 log^(1/2)(Nn) log^(1/2)(1/delta))``, which at
``p = 1/2`` is Algorithm 1's ``48``. *Reading:* at ``p = 1/2`` and ``delta = 0``, (B.5)
gives ``126 / (1/2)^2 = 504`` where Algorithm 1 gives ``162``: Algorithm 1's constant comes
from Theorem 5's sharper integral for ``p = 1/2`` (valid for ``n >= 21``), (B.5)'s from
Lemma 14's general bound. We use 162 at ``p = 1/2`` and (B.5) otherwise. In every mode the
privacy cost is **computed** from the ``xi`` actually used (below), never assumed; a
``"paper"`` spec whose computed cost exceeds the budget is refused. Mode ``"solved"``
solves ``c`` so that the computed worst case equals the budget; mode ``"practical"`` sizes
``c`` for ``hard_query_cap`` rounds and accounts as a privacy filter.

**NSG in eta-units, with exact noise.** NATG compares ``f'(D_t) + nu >= T + eta/xi_t``
with ``nu ~ Lap(4/xi_t)``, ``eta ~ Lap(2/xi_t)``. Multiplied by ``xi_t`` this is
``z_t + xi_t nu >= eta`` with ``z_t = xi_t (f'(D_t) - T)``: the noises have the *fixed*
scales 4 and 2 and ``z_t`` has sensitivity ``xi_t Delta_t <= xi_t0 Delta_t0`` for every
``t`` of a round started at ``t0``. Everything is done on an integer grid (pitfall 2):

* the grid at time ``t`` is ``g_t = 2^(floor(log2(xi_t Delta_t)) - 32)``, a power of two
  in ``(2^-33, 2^-32] xi_t Delta_t``. *Reading:* a fixed grid would add a fixed ``g`` to
  every round's sensitivity, and with the unbounded hard-query budget
  (``sum b_t ~ (log t)^2 / 2``) those terms sum to infinity; a grid proportional to
  ``xi_t Delta_t`` costs a relative ``2^-32`` instead.
* round start at ``t0`` (grid ``g = g_t0`` for the whole round): ``eta = K_eta g``,
  ``K_eta ~ DLap(2/g)`` (scale ``2 / g`` grid units), drawn **once per round**. *Reading:*
  Algorithm 2's pseudo-code redraws ``T_hat_t`` at the first query of each time step, but
  Theorem 20's proof uses a single ``eta`` with ``T_hat_t = T + eta / xi_t``; we implement
  the proof.
* a query at ``t``: ``z = round_half_up(xi_t (f'(D_t) - T) / g)`` computed **exactly**
  (``xi_t`` and ``f(y)`` as the exact rationals of their doubles, ``T`` the exact rational
  of the configured decimal, ``f(D_t)`` as ``Fraction(weighted_count, 2^16 t)``),
  ``K_nu ~ DLap(4/g)``; NATG halts iff ``z + K_nu >= K_eta``.
* on a halt at ``t1`` (grid ``g1 = g_t1``): the answer is
  ``a' = (round_half_up(xi_t1 f'(D_t1) / g1) + K_a) g1 / xi_t1`` with
  ``K_a ~ DLap(8/g1)``, fresh noise (never the noise that decided the halt, Lyu-Su-Li
  2017); then the round ends and the next query starts a new round (Algorithm 3).

*Privacy of one round* (Dwork & Roth Thm 3.23, the paper's Theorem 20, with integer
shifts). Rounding moves a value by at most half a grid step, so on neighbours every ``z``
of the round differs by at most ``s = (xi_t0 Delta_t0)(1 + 10^-12) + g`` in eta-units (the
``10^-12`` absorbs the float error of ``xi_t`` in the monotonicity of ``xi Delta``). Fix the
``K_nu`` of the queries before the halting one and let ``H(D)`` be the largest
``z + K_nu`` among them; the output "bottom ... bottom, halt" is the event
``H(D) < K_eta <= z_halt + K_nu,halt``. Shifting ``K_eta`` by ``H(D') - H(D)`` and
``K_nu,halt`` by at most ``2 s`` (integers, since everything lives on the grid) maps the
event for ``D`` onto the event for ``D'``; the discrete Laplace pmf changes by at most
``exp(|shift| / scale)`` under an integer shift, so the round's halting pattern costs
``eps_A = s/2 + 2s/4 = s``. The numeric answer is a discrete Laplace release of an integer
of sensitivity ``(xi_t1 Delta_t1 + g1) / g1`` grid steps at scale ``8 / g1``:
``eps_L = (xi_t1 Delta_t1 + g1) / 8``. A round that never halts costs ``eps_A`` only.
Writing ``S_t = xi_t Delta_t (1 + 10^-12) + g_t`` (so ``S_t <= sigma c t^(p-1)`` with
``sigma = (1 + 2^-50)(1 + 10^-12)(1 + 2^-32)``), a round costs at most
``S_t0 + S_t1 / 8``.

**The double-halt issue.** Algorithm 1 sends both ``f'_{2j-1} = f - f(y)`` and
``f'_{2j} = f(y) - f`` to NSG. Noise can make the first halt its round; the second then
starts a new round and can halt it too: two halted rounds for one hard query, whereas
(B.1) pays once per hard query (it sets NSG's number of halts at ``t`` to ``h_t``), so
(B.1) would undercount. Here, when ``f'_{2j-1}`` halts, ``f'_{2j}`` is **not asked**:
Algorithm 1 never uses ``a'_{2j}`` then (the query is hard and its answer is built from
``a'_{2j-1}``), and the next query starts a fresh round exactly as NSG does after any halt.
*Claim:* every hard query halts exactly one round and every halted round belongs to exactly
one hard query. *Proof:* a query asks ``f'_{2j-1}`` and, only if that did not halt,
``f'_{2j}``, all in the round open at that moment (opened by its first ``f'`` if none is);
a round ends only by a halt; so a query halts at most one round, and it halts one iff it is
hard (Algorithm 1's definition of hard). Hence the number of NATG halts at time ``t`` is
exactly ``h_t`` and Theorem 24's sum, and with it (B.1), holds for this implementation.
:attr:`Pmwg.halted_rounds` counts the halts actually made (tests assert it equals
:attr:`Pmwg.hard_queries`).

**Accounting** (recorded in a :class:`~dpstream.core.accounting.ledger.PrivacyLedger`, which is
part of
the state; :attr:`Answer.spent` is its total).

* *pure, modes paper/solved.* Theorem 24's telescoping: round ``j``'s ATG part starts no
  earlier than round ``j-1``'s halt, so over a run
  ``eps <= S_n + sum_{halted rounds} (S_t1 + S_t1/8)``; the released hard queries satisfy
  ``H(t) <= C(t) = 36/alpha^2 (log N + sum_{n<tau<=t} b_tau)`` at every ``t`` (the cap is
  the floor of ``(1 - 10^-12) C(t)``), and since ``S`` is non-increasing, Abel summation
  gives ``sum_k S_(t_k) <= sum_t (C(t) - C(t-1)) S_t`` (Theorem 11's "set
  ``h_t = 36/alpha^2 b_t``", ``b_n = log N``). This is a bound on the privacy loss of
  *every* transcript (pure DP composes pointwise), so the run is eps-DP with
  ``eps = sigma (B.1)``, (B.1) being ``(1 + 81/(2 alpha^2) log N) c n^(p-1)
  + 81/(2 alpha^2) sum_{t>n} b_t c t^(p-1)`` (``81/2 = 36 * 9/8``). The sum is evaluated as an
  exact float sum of its terms up to ``max(10^7, n + 10^6)`` plus an analytic **upper**
  bound of the tail (integrals of decreasing majorants:
  ``int_T^inf t^(-1-q) = T^-q / q``,
  ``int_T^inf log t t^(-1-q) = T^-q (log T / q + 1 / q^2)``,
  ``log(t/(t-1)) t^-q <= (t-1)^(-1-q)``, with ``q = 1 - p``), inflated by ``10^-9`` for
  float error. That worst case is committed to the ledger when the mechanism starts.
  The round that exceeds the hard-query cap releases no numeric answer and starts no round,
  so it costs nothing beyond its ATG part, already counted.
* *zcdp, modes paper/solved.* Each round is an ATG part (``S_t0``-DP, fixed when the
  round starts) and, once it has halted at ``t1``, a Laplace part (``S_t1/8``-DP, fixed
  before its noise is drawn); an ``eps``-DP part is ``eps^2/2``-zCDP (BS16, Prop. 1.4) and
  the parts compose adaptively (Rényi filter, Feldman & Zrnic 2021, Thm 3.1, at every
  order). Telescoping as above gives the paper's
  ``tau = (1 + 585/(16 alpha^2) log N) (xi_n Delta_n)^2
  + 585/(16 alpha^2) sum_{t>n} b_t (xi_t Delta_t)^2`` (``585/16 = 36 (1 + 1/64)``), with
  ``sigma^2`` and the same numerics; ``rho = tau / 2`` is committed, and
  ``(rho + 2 sqrt(rho log(1/delta)), delta)`` reported (== Theorem 4).
* *practical mode: a privacy filter.* Each round is charged **when it starts**, at public
  time ``t0``, for both parts bounded from ``t0`` (``S_t1 <= S_t0``): pure
  ``eps = S_t0 + S_t0/8``, zcdp ``rho = (S_t0^2 + (S_t0/8)^2) / 2``. Every charge is fixed
  before the part it pays for runs, so basic composition with adaptively chosen epsilons
  and a stopping rule is valid (privacy filters, Rogers, Roth, Ullman, Vadhan 2016; for
  pure DP basic composition is a valid filter) and likewise for zCDP (Feldman & Zrnic
  2021, Thm 3.1). A round the ledger cannot pay ends the mechanism ("privacy budget
  exhausted", for good). ``c`` is chosen so that ``hard_query_cap`` rounds started at time
  ``n`` exactly fit the budget; Algorithm 1's hard-query cap is kept as well.

**Randomness** is exact (Canonne, Kamath, Steinke 2020 discrete Laplace) and replay-safe:
with ``base = (*coordinates, "pmwg", spec.digest)`` (the digest binds the noise to the
mechanism's parameters, pitfall 13) the threshold of round ``r`` comes from
``(*base, "natg", r, "threshold")``, the query noise of the ``k``-th PMWG query of the
round from ``(*base, "natg", r, k, "f'", which)`` (``which`` is 1 or 2 for
``f'_{2j-1}``, ``f'_{2j}``) and the numeric answer from ``(*base, "natg", r, "answer")``.
The same call sequence gives the same answers.

**Public histogram in O(support) per query.** ``y = z / Z`` with ``z`` unnormalised
(float64) and a tracked mass ``Z``. An easy query costs one ``weighted_sum`` and one
``weighted_count``; a hard query one ``multiply`` on the query's support:
``exp(-alpha/6 (1 - w_i)) = exp(-alpha/6) exp(alpha/6 w_i)`` and the constant cancels in the
normalisation, so ``r = f`` is ``multiply(z, -alpha/6)`` and ``r = 1 - f`` is
``multiply(z, +alpha/6)``, and ``Z`` moves by the returned change (each step changes ``Z``
by a factor in ``[e^-1/6, e^1/6]``, so tracking it loses no precision). The uniform update
is the only dense pass, done lazily at the first query after ``t`` grows; it recomputes
``Z``. ``z`` is rescaled whenever ``Z`` leaves ``[1e-200, 1e200]``.

**State** (:meth:`Pmwg.to_state`): the histogram (bytes), its mass, the time of the last
query, the hard-query count and the running sum of ``b_tau``, the NSG round counters, the
halt reason and the ledger. Every field is a function of released outputs (the kind of each
answer is released): the state holds no true counts and no noise (the open round's
threshold is re-derived from the key).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final, Literal, Protocol

import numpy as np
import numpy.typing as npt

from dpstream.core._checks import is_integer
from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger, exact, zcdp_to_approx_dp
from dpstream.core.noise.coordinates import check_coordinates, encode_coordinates
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import RandomIntegers, discrete_laplace
from dpstream.errors import InvalidParameterError

__all__ = [
    "WEIGHT_UNIT",
    "Answer",
    "Guarantee",
    "LinearQueryLike",
    "NumericSparse",
    "Pmwg",
    "PmwgSpec",
    "Precondition",
    "dlap_variance",
    "hard_query_increment",
]

WEIGHT_UNIT: Final = 2**16
"""Query weights are integers ``units_i`` in ``[0, WEIGHT_UNIT]``; ``w_i = units_i / 2^16``."""
GRID_BITS: Final = 32
"""The NSG grid at time ``t`` is ``2^(floor(log2(xi_t / t)) - GRID_BITS)`` eta-units."""
T_MAX: Final = 2**48
"""The largest public size accepted (float ``xi_t`` is monotone far beyond it)."""
_XI_FLOAT_SLACK: Final = Fraction(1, 10**12)
"""Relative slack on ``xi_t Delta_t`` covering the float error of ``xi_t`` (<= 2^-50)."""
_SIGMA: Final = (1 + 2.0**-50) * (1 + 1e-12) * (1 + 2.0**-GRID_BITS)
"""``S_t <= _SIGMA c t^(p-1)``: float error of ``xi_t``, its slack, and the grid."""
_SUM_SLACK: Final = 1e-9
"""Relative inflation of numerically evaluated privacy sums (float summation error)."""
_CAP_MARGIN: Final = 1e-12
"""The hard-query cap is ``floor((1 - 1e-12) bound)``: never above the real bound."""
_EXACT_TERMS_TO: Final = 10**7
_CHUNK: Final = 1 << 20
_MASS_RANGE: Final = (1e-200, 1e200)
_STATE_VERSION: Final = 1
_HALF: Final = 0.5

Accounting = Literal["pure", "zcdp"]
Mode = Literal["paper", "solved", "practical"]
Kind = Literal["easy", "hard", "bottom"]
_MODES: Final = ("paper", "solved", "practical")
_ACCOUNTINGS: Final = ("pure", "zcdp")

HARD_BUDGET_EXCEEDED: Final = "hard-query budget exceeded"
PRIVACY_BUDGET_EXHAUSTED: Final = "privacy budget exhausted"


class LinearQueryLike(Protocol):
    """What PMWG needs of a linear query (implemented by ``dpstream.core.pmwg.queries``).

    ``support_size`` and ``key`` are read-only here so that frozen dataclasses and
    properties satisfy the protocol as well as plain attributes.
    """

    @property
    def support_size(self) -> int:
        """The number of cells with a nonzero weight."""
        ...

    @property
    def key(self) -> str:
        """A stable identifier of the query."""
        ...

    def weighted_count(self, counts: npt.NDArray[Any]) -> int:
        """Return ``sum units_i counts_i`` exactly, ``units_i = round(w_i 2^16)`` in [0, 2^16]."""
        ...

    def weighted_sum(self, values: npt.NDArray[Any]) -> float:
        """Return ``sum (units_i / 2^16) values_i``."""
        ...

    def multiply(self, values: npt.NDArray[Any], log_factor: float) -> float:
        """In place ``values_i *= exp(log_factor units_i / 2^16)`` on the support.

        Returns:
            The change of ``sum values_i`` over the support.

        """
        ...


# --- small exact helpers ------------------------------------------------------------------


def _round_half_up(x: Fraction) -> int:
    """Return ``floor(x + 1/2)`` exactly."""
    return (2 * x.numerator + x.denominator) // (2 * x.denominator)


def _floor_log2(x: Fraction) -> int:
    """Return ``floor(log2(x))`` exactly for ``x > 0``."""
    num, den = x.numerator, x.denominator
    k = num.bit_length() - den.bit_length()
    if k >= 0:
        return k if num >= den << k else k - 1
    return k if num << -k >= den else k - 1


def _pow2(exponent: int) -> Fraction:
    return Fraction(1 << exponent) if exponent >= 0 else Fraction(1, 1 << -exponent)


def _float_at_least(x: Fraction) -> float:
    """Return a float ``f`` with ``exact(f) >= x`` (what the ledger charges is never less)."""
    f = float(x)
    while exact(f) < x:
        f = math.nextafter(f, math.inf)
    return f


def dlap_variance(scale: Fraction | float) -> float:
    """Return the variance ``2 p / (1 - p)^2``, ``p = exp(-1/scale)``, of the discrete Laplace.

    Stable for the huge scales of the NSG grid (``1 - p`` via ``expm1``), where
    :func:`~dpstream.core.noise.samplers.discrete_laplace_variance` loses all precision.
    """
    x = 1.0 / float(scale)
    return 2.0 * math.exp(-x) / math.expm1(-x) ** 2


def _fsum2(hi: float, lo: float, x: float) -> tuple[float, float]:
    """Add ``x`` to the double-double ``hi + lo`` (exact error term via fsum)."""
    new_hi = math.fsum((hi, lo, x))
    new_lo = math.fsum((hi, lo, x, -new_hi))
    return new_hi, new_lo


def hard_query_increment(universe_size: int, after: int, upto: int) -> float:
    """Return ``sum_{tau=after+1}^{upto} b_tau`` of Algorithm 1 (0 if ``upto <= after``).

    ``b_tau = log N / tau + log(tau - 1) / tau + log(tau / (tau - 1))``; the last part
    telescopes to ``log(upto / after)``, the rest is summed with numpy in chunks of
    ``2^20`` terms (pairwise summation, relative error far below ``1e-12``).

    Raises:
        InvalidParameterError: ``after < 2``.

    """
    if upto <= after:
        return 0.0
    if after < 2:
        raise InvalidParameterError(f"after must be >= 2, got {after}")
    log_n = math.log(universe_size)
    parts: list[float] = []
    lo = after + 1
    while lo <= upto:
        hi = min(upto, lo + _CHUNK - 1)
        tau = np.arange(lo, hi + 1, dtype=np.float64)
        parts.append(float(np.sum((log_n + np.log(tau - 1.0)) / tau)))
        lo = hi + 1
    parts.append(math.log1p((upto - after) / after))
    return math.fsum(parts)


@functools.lru_cache(maxsize=64)
def _weighted_b_sum(n: int, universe_size: int, q: float) -> float:
    """Return an upper bound of ``sum_{t=n+1}^inf b_t t^-q`` (``q > 0``).

    Terms up to ``T = max(10^7, n + 10^6)`` are summed exactly (float); the tail is bounded
    by integrals of decreasing majorants (see the module docstring).
    """
    log_n = math.log(universe_size)
    end = max(_EXACT_TERMS_TO, n + 10**6)
    parts: list[float] = []
    lo = n + 1
    while lo <= end:
        hi = min(end, lo + _CHUNK - 1)
        t = np.arange(lo, hi + 1, dtype=np.float64)
        b = (log_n + np.log(t - 1.0)) / t + np.log1p(1.0 / (t - 1.0))
        parts.append(float(np.sum(b * np.power(t, -q))))
        lo = hi + 1
    big = float(end)
    tail = (
        math.pow(big, -q) * (log_n / q + math.log(big) / q + 1.0 / (q * q))
        + math.pow(big - 1.0, -q) / q
    )
    parts.append(tail)
    return math.fsum(parts)


def _paper_coefficient(
    accounting: str, epsilon: float, delta: float, alpha: float, n: int, cells: int, p: float
) -> float:
    """Return ``c`` of Algorithm 1 / (B.5), ``xi_t = c t^p``."""
    log_nn = math.log(cells * n)
    q = 1.0 - p
    if accounting == "pure":
        if p == _HALF:
            return alpha**2 * math.sqrt(n) * epsilon / (162.0 * log_nn)
        return alpha**2 * q**2 * math.pow(n, q) * epsilon / (126.0 * log_nn)
    return (
        alpha * q * math.pow(n, q) * epsilon
        / (24.0 * math.sqrt(log_nn) * math.sqrt(math.log(1.0 / delta)))
    )


def _check_real(name: str, value: object) -> float:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)):
        raise InvalidParameterError(f"{name} must be a finite number, got {value!r}")
    return float(value)


# --- the guarantee report ------------------------------------------------------------------


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


# --- the spec -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PmwgSpec:
    """Parameters of PMWG, validated at construction.

    Attributes:
        epsilon: the privacy budget (pure epsilon; for ``zcdp`` the epsilon of the
            ``(epsilon, delta)`` target).
        delta: 0 for ``pure``; in ``(0, 1)`` for ``zcdp``.
        alpha: the accuracy target, in ``(0, 1)``.
        beta: the failure probability target, in ``(0, 1)`` (only reported).
        n: the initial database size (Algorithm 1 starts at ``t = n``), an integer >= 2.
        universe_size: the number of cells ``N``, an integer >= 2.
        accounting: ``"pure"`` (delta = 0) or ``"zcdp"`` (delta > 0, reported via Thm 4).
        p: the noise exponent of (B.5), ``xi_t = c t^p``, in ``[0, 1)``.
        mode: ``"paper"`` (the paper's ``c``), ``"solved"`` (``c`` solved so the computed
            worst case equals the budget) or ``"practical"`` (a filter sized for
            ``hard_query_cap`` rounds at time ``n``).
        hard_query_cap: practical mode only: the number of rounds started at ``n`` that
            the budget pays for.
        threshold: the NSG threshold ``T`` (fraction units); ``None`` means ``2 alpha / 3``.

    """

    epsilon: float
    delta: float
    alpha: float
    beta: float
    n: int
    universe_size: int
    accounting: Accounting = "pure"
    p: float = 0.5
    mode: Mode = "paper"
    hard_query_cap: int | None = None
    threshold: float | None = None

    def __post_init__(self) -> None:
        eps = _check_real("epsilon", self.epsilon)
        if eps <= 0:
            raise InvalidParameterError(f"epsilon must be finite and > 0, got {self.epsilon!r}")
        if self.accounting not in _ACCOUNTINGS:
            raise InvalidParameterError(
                f"accounting must be one of {_ACCOUNTINGS}, got {self.accounting!r}")
        delta = _check_real("delta", self.delta)
        if self.accounting == "pure" and delta != 0:
            raise InvalidParameterError(
                f"delta must be 0 with accounting 'pure', got {self.delta!r} "
                "(use accounting 'zcdp' for delta > 0)")
        if self.accounting == "zcdp" and not 0 < delta < 1:
            raise InvalidParameterError(
                f"delta must be in (0, 1) with accounting 'zcdp', got {self.delta!r}")
        for name in ("alpha", "beta"):
            value = _check_real(name, getattr(self, name))
            if not 0 < value < 1:
                raise InvalidParameterError(
                    f"{name} must be in (0, 1), got {getattr(self, name)!r}")
        if not is_integer(self.n) or self.n < 2:
            raise InvalidParameterError(f"n must be an integer >= 2, got {self.n!r}")
        if self.n > T_MAX:
            raise InvalidParameterError(f"n must be <= 2^48, got {self.n!r}")
        if not is_integer(self.universe_size) or self.universe_size < 2:
            raise InvalidParameterError(
                f"universe_size must be an integer >= 2, got {self.universe_size!r}")
        p = _check_real("p", self.p)
        if not 0 <= p < 1:
            raise InvalidParameterError(f"p must be in [0, 1), got {self.p!r}")
        if self.mode not in _MODES:
            raise InvalidParameterError(f"mode must be one of {_MODES}, got {self.mode!r}")
        cap = self.hard_query_cap
        if self.mode == "practical":
            if not is_integer(cap) or cap is None or cap < 1:
                raise InvalidParameterError(
                    f"hard_query_cap must be an integer >= 1 in mode 'practical', got {cap!r}")
        elif cap is not None:
            raise InvalidParameterError(
                f"hard_query_cap is only used in mode 'practical', got {cap!r} with mode "
                f"{self.mode!r}")
        if self.threshold is not None:
            thr = _check_real("threshold", self.threshold)
            if not 0 < thr <= 1:
                raise InvalidParameterError(
                    f"threshold must be in (0, 1], got {self.threshold!r}")
        # the privacy map is computed now: a paper spec that does not fit fails at start-up
        coefficient = self.xi_coefficient
        if not (math.isfinite(coefficient) and coefficient > 0):
            raise InvalidParameterError(
                f"the noise coefficient c must be finite and > 0, got {coefficient!r}")
        if self.mode != "practical":
            ledger = self.new_ledger()
            if not ledger.can_afford(self.worst_case_charge()):
                raise InvalidParameterError(
                    f"PMWG's computed worst-case privacy cost {self.worst_case_cost():.6g} "
                    f"{ledger.unit} exceeds the budget {ledger.budget:.6g} with the paper's "
                    f"noise function (n={self.n}, N={self.universe_size}, p={self.p}); the "
                    "paper's constants fit for n >= 21 and N >= 3: use mode 'solved'")

    # -- derived constants --
    @property
    def q(self) -> float:
        """``1 - p``: ``xi_t Delta_t = c t^-q``."""
        return 1.0 - float(self.p)

    @functools.cached_property
    def threshold_value(self) -> Fraction:
        """The exact NSG threshold ``T`` (default ``2 alpha / 3``, alpha as its decimal)."""
        if self.threshold is None:
            return 2 * exact(self.alpha) / 3
        return exact(self.threshold)

    @functools.cached_property
    def budget(self) -> float:
        """The ledger's budget: epsilon (pure) or the rho whose Theorem-4 epsilon fits."""
        if self.accounting == "pure":
            return float(self.epsilon)
        log_inv = math.log(1.0 / float(self.delta))
        eps = float(self.epsilon)
        rho = eps * eps / (math.sqrt(log_inv + eps) + math.sqrt(log_inv)) ** 2
        rho *= 1.0 - 1e-12
        while zcdp_to_approx_dp(float(exact(rho)), float(self.delta)) > eps:
            rho = math.nextafter(rho, 0.0)
        return rho

    @property
    def unit(self) -> str:
        """``"epsilon"`` (pure) or ``"rho"`` (zcdp)."""
        return "epsilon" if self.accounting == "pure" else "rho"

    def new_ledger(self) -> PrivacyLedger:
        """Return an empty ledger with this spec's budget."""
        return PrivacyLedger(self.accounting, self.budget)

    @functools.cached_property
    def paper_coefficient(self) -> float:
        """The paper's ``c`` (Algorithm 1 at p = 1/2 with delta = 0, (B.5) otherwise)."""
        return _paper_coefficient(self.accounting, float(self.epsilon), float(self.delta),
                                  float(self.alpha), int(self.n), int(self.universe_size),
                                  float(self.p))

    def _sum_factor(self) -> float:
        """Return ``K(c) / c`` (pure) or ``tau(c) / c^2`` (zcdp) with the upper-bounded sum."""
        alpha, n, q = float(self.alpha), int(self.n), self.q
        cells = int(self.universe_size)
        log_n = math.log(cells)
        if self.accounting == "pure":
            k = 81.0 / (2.0 * alpha * alpha)
            return math.pow(n, -q) * (1.0 + k * log_n) + k * _weighted_b_sum(n, cells, q)
        k2 = 585.0 / (16.0 * alpha * alpha)
        return math.pow(n, -2 * q) * (1.0 + k2 * log_n) + k2 * _weighted_b_sum(n, cells, 2 * q)

    def _cost_of_coefficient(self, c: float) -> float:
        """Return the worst-case cost (ledger units) of coefficient ``c`` (paper/solved)."""
        factor = self._sum_factor()
        if self.accounting == "pure":
            return c * factor * _SIGMA * (1.0 + _SUM_SLACK)
        return c * c * factor * _SIGMA * _SIGMA * (1.0 + _SUM_SLACK) / 2.0

    def _fits(self, cost: float) -> bool:
        """Whether ``cost`` (rounded up as it will be charged) fits the ledger's budget."""
        return exact(_float_at_least(Fraction(cost))) <= exact(self.budget)

    def _round_cost(self, s: Fraction) -> Fraction:
        if self.accounting == "pure":
            return s * Fraction(9, 8)
        return (s * s + (s / 8) ** 2) / 2

    @functools.cached_property
    def xi_coefficient(self) -> float:
        """The coefficient ``c`` of ``xi_t = c t^p`` actually used."""
        if self.mode == "paper":
            return self.paper_coefficient
        budget = self.budget
        if self.mode == "solved":
            factor = self._sum_factor() * (1.0 + _SUM_SLACK)
            if self.accounting == "pure":
                c = budget / (factor * _SIGMA)
            else:
                c = math.sqrt(2.0 * budget / factor) / _SIGMA
            while not self._fits(self._cost_of_coefficient(c)):
                c = math.nextafter(c, 0.0)
            return c
        cap = int(self.hard_query_cap or 1)
        n = int(self.n)
        # cap rounds at n: cap * round_cost(S_n) <= budget, S_n ~ c n^-q (1 + slack)
        per_round = budget / cap
        if self.accounting == "pure":
            s_target = per_round * 8.0 / 9.0
        else:
            s_target = math.sqrt(per_round * 128.0 / 65.0)
        c = s_target / (math.pow(n, -self.q) * _SIGMA)
        ledger_budget = exact(budget)
        while cap * exact(_float_at_least(self._round_cost(self._s_exact(n, c)))) \
                > ledger_budget:
            c = math.nextafter(c, 0.0)
        return c

    # -- the noise function and the grid --
    def _xi(self, t: int, c: float) -> float:
        if float(self.p) == _HALF:
            return c * math.sqrt(t)
        return c * math.pow(t, float(self.p))

    def _check_t(self, t: object) -> int:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) \
                or t < self.n:
            raise InvalidParameterError(f"t must be an integer >= n = {self.n}, got {t!r}")
        if t > T_MAX:
            raise InvalidParameterError(f"t must be <= 2^48, got {t!r}")
        return int(t)

    def xi(self, t: int) -> float:
        """Return the noise function ``xi_t = c t^p`` (``t >= n``)."""
        return self._xi(self._check_t(t), self.xi_coefficient)

    def grid_exponent(self, t: int) -> int:
        """Return ``e`` with the NSG grid at time ``t`` being ``g_t = 2^e`` eta-units."""
        t = self._check_t(t)
        return _floor_log2(Fraction(self.xi(t)) / t) - GRID_BITS

    def _s_exact(self, t: int, c: float) -> Fraction:
        ratio = Fraction(self._xi(t, c)) / t
        return ratio * (1 + _XI_FLOAT_SLACK) + _pow2(_floor_log2(ratio) - GRID_BITS)

    def sensitivity_bound(self, t: int) -> Fraction:
        """Return ``S_t = xi_t Delta_t (1 + 1e-12) + g_t``, exactly (eta-units).

        It bounds how much any NSG comparison of a round started at ``t`` (and the
        numeric answer of a round halted at ``t``) moves on neighbouring databases.
        """
        return self._s_exact(self._check_t(t), self.xi_coefficient)

    def round_charge(self, t0: int) -> PrivacyCharge:
        """Return the practical-mode charge of a round starting at ``t0`` (both parts)."""
        cost = _float_at_least(self._round_cost(self.sensitivity_bound(t0)))
        if self.accounting == "pure":
            return PrivacyCharge(epsilon=cost, label="PMWG round")
        return PrivacyCharge(rho=cost, label="PMWG round")

    # -- the worst case --
    def paper_sum(self) -> float:
        """Return (B.1) (pure) or ``tau`` (zcdp) for this spec's ``xi``, evaluated numerically.

        No grid term or float slack: this is the paper's quantity, with the infinite sum as
        exact terms plus an analytic upper bound of the tail.
        """
        c = self.xi_coefficient
        factor = self._sum_factor()
        return c * factor if self.accounting == "pure" else c * c * factor

    def worst_case_cost(self) -> float:
        """Return the worst-case privacy cost in ledger units (epsilon or rho).

        Modes paper/solved: ``sigma (1 + 1e-9)`` times (B.1) (pure) or ``tau / 2`` (zcdp),
        rounded up. Practical: the budget (the filter never lets more through).
        """
        if self.mode == "practical":
            return self.budget
        return _float_at_least(Fraction(self._cost_of_coefficient(self.xi_coefficient)))

    def worst_case_charge(self) -> PrivacyCharge:
        """Return the charge committed when the mechanism starts (modes paper/solved)."""
        cost = self.worst_case_cost()
        if self.accounting == "pure":
            return PrivacyCharge(epsilon=cost, label="PMWG worst case")
        return PrivacyCharge(rho=cost, label="PMWG worst case")

    def reported_epsilon(self, cost: float) -> float:
        """Return the epsilon of ``(epsilon, delta)``-DP that ``cost`` (ledger units) gives."""
        if self.accounting == "pure":
            return cost
        return zcdp_to_approx_dp(cost, float(self.delta))

    def hard_query_bound(self, t: int) -> int:
        """Return the cap ``floor((1 - 1e-12) 36/alpha^2 (log N + sum_{n<tau<=t} b_tau))``."""
        t = self._check_t(t)
        total = math.log(int(self.universe_size)) + hard_query_increment(
            int(self.universe_size), int(self.n), t)
        return self._cap_of(total)

    def _cap_of(self, log_n_plus_b: float) -> int:
        alpha = float(self.alpha)
        return math.floor((1.0 - _CAP_MARGIN) * 36.0 / (alpha * alpha) * log_n_plus_b)

    @functools.cached_property
    def digest(self) -> str:
        """A short digest of every parameter (part of the noise coordinates)."""
        fields: tuple[str | int, ...] = (
            "pmwg", str(exact(self.epsilon)), str(exact(self.delta)), str(exact(self.alpha)),
            str(exact(self.beta)), int(self.n), int(self.universe_size), self.accounting,
            str(exact(self.p)), self.mode,
            -1 if self.hard_query_cap is None else int(self.hard_query_cap),
            str(self.threshold_value), self.xi_coefficient.hex(),
        )
        return hashlib.blake2b(encode_coordinates(fields), digest_size=8,
                               person=b"dpstream-params").hexdigest()

    # -- the guarantee report --
    def guarantee(self) -> Guarantee:
        """Check the accuracy theorems' preconditions and report what follows.

        Theorem 5 with (B.4) for ``p = 1/2, delta = 0``; Theorem 16 with (B.6) for other
        ``p``; Theorem 19 with (B.11) (Theorem 8 at ``p = 1/2``) for ``delta > 0``; all with
        ``kappa = 1``. A violated precondition is reported, not refused: privacy does not
        depend on it, but the theorem then does not guarantee accuracy.
        """
        eps, alpha, beta = float(self.epsilon), float(self.alpha), float(self.beta)
        n, cells, p, q = int(self.n), int(self.universe_size), float(self.p), self.q
        log_nn = math.log(cells * n)
        pre: list[Precondition] = []
        if self.accounting == "pure" and p == _HALF:
            theorem = "Theorem 5 (B.4)"
            alpha_min = (8262 * log_nn * math.log(192 * n / beta) / (n * eps)) ** (1 / 3)
            exponent_scale = alpha**3 * eps * math.sqrt(n) / (8262 * log_nn)
            src = "Theorem 5"
            pre.append(Precondition(src, "n >= 21", str(n), n >= 21))
        else:
            if self.accounting == "pure":
                theorem = "Theorem 16 (B.6)"
                alpha_min = (6426 * log_nn * math.log(144 * n / beta)
                             / (q * q * n * eps)) ** (1 / 3)
                exponent_scale = alpha**3 * q * q * eps * n**q / (6048 * log_nn)
                src = "Theorem 16"
            else:
                log_d = math.log(1.0 / float(self.delta))
                theorem = "Theorem 19 (B.11)" + (" = Theorem 8" if p == 0.5 else "")
                alpha_min = (1224 * math.sqrt(log_nn) * math.log(144 * n / beta)
                             * math.sqrt(log_d) / (q * n * eps)) ** 0.5
                exponent_scale = (alpha**2 * q * eps * n**q
                                  / (1152 * math.sqrt(log_nn) * math.sqrt(log_d)))
                src = "Theorem 19"
                pre.append(Precondition(src, "delta in (0, 1/e)", repr(self.delta),
                                        0 < float(self.delta) < math.exp(-1)))
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
        paper_c = self.paper_coefficient
        if self.mode == "paper":
            covered = True
        elif self.mode == "solved":
            covered = self.xi_coefficient >= paper_c
            notes.append(
                "mode 'solved': xi is "
                f"{self.xi_coefficient / paper_c:.4g} x the paper's; (B.2) is decreasing in "
                "xi, so the theorem's accuracy " + ("carries over" if covered else
                                                   "does NOT carry over"))
        else:
            covered = False
            notes.append("mode 'practical': xi is sized for the hard_query_cap, not by the "
                         "theorem; accuracy is not guaranteed by it")
        if self.threshold is not None and self.threshold_value != 2 * exact(alpha) / 3:
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
        xi_n = self.xi(n)
        g = _pow2(self.grid_exponent(n))
        std = math.sqrt(dlap_variance(Fraction(8) / g)) * float(g) / xi_n
        cost = self.worst_case_cost()
        return Guarantee(
            theorem=theorem,
            preconditions=tuple(pre),
            alpha_min=alpha_min,
            accuracy_guaranteed=all_hold and covered,
            query_budget=tuple(budgets),
            hard_query_bound_at_n=self.hard_query_bound(n),
            xi_n=xi_n,
            answer_std_at_n=std,
            first_beta_term=math.exp(-alpha * xi_n / 24),
            worst_case_cost=cost,
            budget=self.budget,
            unit=self.unit,
            epsilon_reported=self.reported_epsilon(cost),
            notes=tuple(notes),
        )


# --- NSG ---------------------------------------------------------------------------------


class NumericSparse:
    """Algorithm 3 (NSG) over Algorithm 2 (NATG) rounds, in eta-units, with exact noise.

    The caller opens a round with :meth:`start_round` (at public time ``t0``, with the
    grid exponent of ``t0``), asks :meth:`compare` for each ``f'`` (the exact eta-unit value
    ``xi_t (f'(D_t) - T)``), and after a halt releases :meth:`answer` (or, when the answer
    is not to be released, :meth:`close_unanswered`). See the module docstring for the
    privacy argument and the coordinates of every draw.

    Args:
        noise: the secret key.
        coordinates: the base coordinates; draws are at ``(*coordinates, "natg", ...)``.
        state: a dict from :meth:`to_state`, or ``None``.

    """

    __slots__ = (
        "_key", "_coordinates", "round_index", "query_index", "grid_exponent", "is_open",
        "halted_rounds", "_threshold",
    )

    def __init__(
        self,
        noise: NoiseKey,
        coordinates: tuple[str | int, ...],
        state: dict[str, Any] | None = None,
    ) -> None:
        self._key = noise
        self._coordinates = check_coordinates(coordinates)
        self.round_index = 0
        self.query_index = 0
        self.grid_exponent = 0
        self.is_open = False
        self.halted_rounds = 0
        self._threshold: int | None = None
        if state is not None:
            try:
                self.round_index = int(state["round_index"])
                self.query_index = int(state["query_index"])
                self.grid_exponent = int(state["grid_exponent"])
                self.is_open = bool(state["is_open"])
                self.halted_rounds = int(state["halted_rounds"])
            except (KeyError, TypeError, ValueError) as exc:
                raise InvalidParameterError(f"malformed NSG state: {exc!r}") from None

    def to_state(self) -> dict[str, Any]:
        """Return the round counters (no noise: the threshold is re-derived from the key)."""
        return {
            "round_index": self.round_index,
            "query_index": self.query_index,
            "grid_exponent": self.grid_exponent,
            "is_open": self.is_open,
            "halted_rounds": self.halted_rounds,
        }

    def _stream(self, *tail: str | int) -> RandomIntegers:
        return self._key.stream(*self._coordinates, "natg", *tail)

    @property
    def grid(self) -> Fraction:
        """The open round's grid step ``g`` (eta-units)."""
        return _pow2(self.grid_exponent)

    def _threshold_units(self) -> int:
        if self._threshold is None:
            rng = self._stream(self.round_index, "threshold")
            self._threshold = discrete_laplace(rng, Fraction(2) / self.grid)
        return self._threshold

    def start_round(self, grid_exponent: int) -> None:
        """Open round ``round_index`` on the grid ``2^grid_exponent`` and draw its threshold.

        Raises:
            InvalidParameterError: a round is already open.

        """
        if self.is_open:
            raise InvalidParameterError("an NSG round is already open")
        self.is_open = True
        self.query_index = 0
        self.grid_exponent = int(grid_exponent)
        self._threshold = None
        self._threshold_units()

    def compare(self, value: Fraction, which: int) -> bool:
        """Return whether NATG halts on ``f'`` with eta-unit value ``value`` (round stays open).

        ``value = xi_t (f'(D_t) - T)`` exactly; it is rounded half up to the round's grid and
        compared with fresh ``K_nu ~ DLap(4/g)`` drawn at
        ``("natg", round_index, query_index, "f'", which)``.

        Raises:
            InvalidParameterError: no round is open.

        """
        if not self.is_open:
            raise InvalidParameterError("no NSG round is open")
        g = self.grid
        z = _round_half_up(value / g)
        rng = self._stream(self.round_index, self.query_index, "f'", int(which))
        k_nu = discrete_laplace(rng, Fraction(4) / g)
        return z + k_nu >= self._threshold_units()

    def next_query(self) -> None:
        """Move to the next PMWG query of the open round."""
        self.query_index += 1

    def _close(self) -> None:
        self.is_open = False
        self.halted_rounds += 1
        self.round_index += 1
        self.query_index = 0
        self._threshold = None

    def answer(self, value: Fraction, grid_exponent: int) -> Fraction:
        """Release the halted round's numeric answer and close the round.

        Args:
            value: ``xi_t1 f'(D_t1)`` exactly (eta-units).
            grid_exponent: the grid exponent of the halting time ``t1``.

        Returns:
            ``(round_half_up(value / g1) + K_a) g1`` exactly, ``K_a ~ DLap(8 / g1)`` drawn
            at ``("natg", round_index, "answer")``.

        """
        if not self.is_open:
            raise InvalidParameterError("no NSG round is open")
        g1 = _pow2(int(grid_exponent))
        rng = self._stream(self.round_index, "answer")
        units = _round_half_up(value / g1) + discrete_laplace(rng, Fraction(8) / g1)
        self._close()
        return units * g1

    def close_unanswered(self) -> None:
        """Close a halted round whose numeric answer is not released."""
        if not self.is_open:
            raise InvalidParameterError("no NSG round is open")
        self._close()


# --- PMWG ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """One PMWG answer.

    Attributes:
        value: the answer (a fraction of the database), or ``None`` for bottom.
        kind: ``"easy"`` (``f(y)``), ``"hard"`` (NSG's noisy answer) or ``"bottom"``.
        reason: why bottom (``"hard-query budget exceeded"`` or ``"privacy budget
            exhausted"``), else ``None``.
        t: the public size the query was answered at.
        spent: the ledger's total after this answer (epsilon or rho).
        hard_queries: the number of hard queries so far (including one that hit the cap).
        noise_std: for a hard answer, the std of its noise (fraction units); else ``None``.

    """

    value: float | None
    kind: Kind
    reason: str | None
    t: int
    spent: float
    hard_queries: int
    noise_std: float | None = None


class Pmwg:
    """PMWG (Algorithm 1) on NSG, answering linear queries on a growing database.

    Args:
        spec: the parameters.
        noise: the secret key all noise is derived from.
        coordinates: the release's coordinates (flow instance, mechanism, key, ...); draws
            are at ``(*coordinates, "pmwg", spec.digest, "natg", ...)``.
        state: a dict from :meth:`to_state` to resume from, or ``None`` to start (which
            commits the worst-case charge in modes paper/solved).

    Raises:
        InvalidParameterError: bad coordinates, or a malformed or mismatched state.

    """

    __slots__ = (
        "spec", "_key", "_coordinates", "_nsg", "ledger", "_z", "_mass", "_t_last",
        "hard_queries", "_b_t", "_b_hi", "_b_lo", "halted", "_ask_both", "queries",
        "_rate", "_threshold",
    )

    def __init__(
        self,
        spec: PmwgSpec,
        noise: NoiseKey,
        coordinates: tuple[str | int, ...],
        state: dict[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        self._key = noise
        self._coordinates = check_coordinates(coordinates)
        base = (*self._coordinates, "pmwg", spec.digest)
        cells = int(spec.universe_size)
        self._rate = float(spec.alpha) / 6.0
        self._threshold = spec.threshold_value
        self._ask_both = False  # tests only: Algorithm 1 read literally (double halts)
        if state is None:
            self._nsg = NumericSparse(noise, base)
            self.ledger = spec.new_ledger()
            if spec.mode != "practical":
                self.ledger.charge(spec.worst_case_charge())
            self._z: npt.NDArray[np.float64] = np.ones(cells, dtype=np.float64)
            self._mass = float(cells)
            self._t_last = int(spec.n)
            self.hard_queries = 0
            self._b_t = int(spec.n)
            self._b_hi = 0.0
            self._b_lo = 0.0
            self.halted: str | None = None
            self.queries = 0
        else:
            self._load(state, base)

    # -- state --
    def to_state(self) -> dict[str, Any]:
        """Return the state as plain, pickle-safe data (the histogram as float64 bytes).

        Every field is a function of released outputs: no true counts, no noise.
        """
        return {
            "version": _STATE_VERSION,
            "digest": self.spec.digest,
            "histogram": self._z.astype("<f8").tobytes(),
            "mass": self._mass,
            "t_last": self._t_last,
            "hard_queries": self.hard_queries,
            "b_sum": [self._b_t, self._b_hi, self._b_lo],
            "halted": self.halted,
            "queries": self.queries,
            "nsg": self._nsg.to_state(),
            "ledger": self.ledger.to_state(),
        }

    def _load(self, state: dict[str, Any], base: tuple[str | int, ...]) -> None:
        try:
            if state["version"] != _STATE_VERSION:
                raise InvalidParameterError(f"unknown PMWG state version {state['version']!r}")
            if state["digest"] != self.spec.digest:
                raise InvalidParameterError(
                    "PMWG state was made with other parameters (digest "
                    f"{state['digest']!r}, the spec's is {self.spec.digest!r})")
            z = np.frombuffer(bytes(state["histogram"]), dtype="<f8").astype(np.float64)
            if z.shape != (int(self.spec.universe_size),):
                raise InvalidParameterError(
                    f"PMWG state holds {z.size} cells, the spec has {self.spec.universe_size}")
            self._z = z
            self._mass = float(state["mass"])
            self._t_last = int(state["t_last"])
            self.hard_queries = int(state["hard_queries"])
            b_t, b_hi, b_lo = state["b_sum"]
            self._b_t, self._b_hi, self._b_lo = int(b_t), float(b_hi), float(b_lo)
            halted = state["halted"]
            self.halted = None if halted is None else str(halted)
            self.queries = int(state["queries"])
            self._nsg = NumericSparse(self._key, base, state["nsg"])
            self.ledger = PrivacyLedger.from_state(state["ledger"])
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidParameterError):
                raise
            raise InvalidParameterError(f"malformed PMWG state: {exc!r}") from None

    # -- read-only views --
    @property
    def halted_rounds(self) -> int:
        """The number of NATG rounds that halted (equals :attr:`hard_queries`)."""
        return self._nsg.halted_rounds

    @property
    def rounds_started(self) -> int:
        """The number of NATG rounds started so far."""
        return self._nsg.round_index + (1 if self._nsg.is_open else 0)

    def histogram(self) -> npt.NDArray[np.float64]:
        """Return a copy of the public histogram ``y`` (normalised)."""
        return self._z / float(np.sum(self._z))

    @property
    def mass(self) -> float:
        """The tracked mass ``Z`` of the unnormalised histogram."""
        return self._mass

    # -- helpers --
    def _bottom(self, t: int) -> Answer:
        return Answer(None, "bottom", self.halted, t, self.ledger.spent, self.hard_queries)

    def _halt(self, reason: str, t: int) -> Answer:
        self.halted = reason
        return self._bottom(t)

    def _uniform_update(self, t: int) -> None:
        """Mix ``y`` with uniform for the data that arrived in ``(t_last, t]`` (dense pass)."""
        z = self._z
        total = float(np.sum(z))
        t_last = self._t_last
        z *= t_last / (t * total)
        z += (t - t_last) / (t * z.size)
        self._mass = float(np.sum(z))
        self._t_last = t

    def _rescale_if_needed(self) -> None:
        lo, hi = _MASS_RANGE
        if not lo <= self._mass <= hi:
            self._z /= self._mass
            self._mass = float(np.sum(self._z))

    def _cap(self, t: int) -> int:
        if t > self._b_t:
            inc = hard_query_increment(int(self.spec.universe_size), self._b_t, t)
            self._b_hi, self._b_lo = _fsum2(self._b_hi, self._b_lo, inc)
            self._b_t = t
        log_n = math.log(int(self.spec.universe_size))
        return self.spec._cap_of(math.fsum((log_n, self._b_hi, self._b_lo)))

    def _check_counts(self, counts: object) -> npt.NDArray[Any]:
        cells = int(self.spec.universe_size)
        if not isinstance(counts, np.ndarray) or counts.shape != (cells,) \
                or not np.issubdtype(counts.dtype, np.integer):
            shape = getattr(counts, "shape", None)
            dtype = getattr(counts, "dtype", type(counts).__name__)
            raise InvalidParameterError(
                f"counts must be an integer numpy array of shape ({cells},), got shape "
                f"{shape} and dtype {dtype}")
        return counts

    def _ensure_round(self, t: int) -> bool:
        """Open an NSG round at ``t`` if none is open; False if it cannot be paid."""
        if self._nsg.is_open:
            return True
        if self.spec.mode == "practical":
            charge = self.spec.round_charge(t)
            if not self.ledger.can_afford(charge):
                return False
            self.ledger.charge(charge)
        self._nsg.start_round(self.spec.grid_exponent(t))
        return True

    def _ask_second_too(self, xi_q: Fraction, diff: Fraction, t: int, exponent: int) -> None:
        """Tests only: Algorithm 1 read literally, ``f'_{2j}`` is sent to NSG after a halt.

        It starts a new round, which can halt too: a second halted round for one hard query
        (the double-halt issue of the module docstring). Its answer is never used.
        """
        nsg = self._nsg
        if not self._ensure_round(t):
            return
        if nsg.compare(xi_q * (-diff - self._threshold), 2):
            nsg.answer(xi_q * -diff, exponent)
        else:
            nsg.next_query()

    # -- the mechanism --
    def answer(self, query: LinearQueryLike, counts: npt.NDArray[Any], t: int) -> Answer:
        """Answer ``query`` on the database ``counts`` of public size ``t`` (Algorithm 1).

        Args:
            query: the linear query.
            counts: the true count histogram (integers, ``N`` cells); secret.
            t: the public database size, ``>= n`` and non-decreasing between calls.

        Returns:
            The answer; ``None`` (bottom) for good once a budget is exceeded.

        Raises:
            InvalidParameterError: ``t`` is not a valid public size, or ``counts`` has the
                wrong shape or dtype (nothing about the data is in the message).

        """
        t = self.spec._check_t(t)
        if t < self._t_last:
            raise InvalidParameterError(
                f"t must be non-decreasing: got {t} after {self._t_last}")
        counts = self._check_counts(counts)
        self.queries += 1
        if self.halted is not None:
            self._t_last = max(self._t_last, t)
            return self._bottom(t)
        if t > self._t_last:
            self._uniform_update(t)
        nsg = self._nsg
        if not self._ensure_round(t):  # practical mode: a round is paid when it starts
            return self._halt(PRIVACY_BUDGET_EXHAUSTED, t)
        f_y = query.weighted_sum(self._z) / self._mass
        f_d = Fraction(int(query.weighted_count(counts)), WEIGHT_UNIT * t)
        xi = self.spec.xi(t)
        xi_q = Fraction(xi)
        f_y_q = Fraction(f_y)
        diff = f_d - f_y_q  # f'_{2j-1}(D_t); f'_{2j} = -diff
        which = 0
        if nsg.compare(xi_q * (diff - self._threshold), 1):
            which = 1
        elif nsg.compare(xi_q * (-diff - self._threshold), 2):
            which = 2
        if which == 0:
            nsg.next_query()
            return Answer(f_y, "easy", None, t, self.ledger.spent, self.hard_queries)
        # hard: h_t += 1, then Algorithm 1's check (before releasing a numeric answer)
        self.hard_queries += 1
        if self.hard_queries > self._cap(t):
            nsg.close_unanswered()
            return self._halt(HARD_BUDGET_EXCEEDED, t)
        exponent = self.spec.grid_exponent(t)
        signed = diff if which == 1 else -diff
        noisy = nsg.answer(xi_q * signed, exponent)  # eta-units
        if which == 1 and self._ask_both:
            self._ask_second_too(xi_q, diff, t, exponent)
        a_prime = noisy / xi_q
        value = float(f_y_q + a_prime) if which == 1 else float(f_y_q - a_prime)
        g1 = _pow2(exponent)
        std = math.sqrt(dlap_variance(Fraction(8) / g1)) * float(g1) / xi
        # multiplicative weights, learning rate alpha/6
        if value < f_y:
            change = query.multiply(self._z, -self._rate)  # r = f
        else:
            change = query.multiply(self._z, self._rate)  # r = 1 - f, constant dropped
        self._mass += change
        self._rescale_if_needed()
        return Answer(value, "hard", None, t, self.ledger.spent, self.hard_queries, std)

    def __repr__(self) -> str:
        return (
            f"Pmwg(mode={self.spec.mode!r}, accounting={self.spec.accounting!r}, "
            f"hard_queries={self.hard_queries}, halted={self.halted!r})"
        )
