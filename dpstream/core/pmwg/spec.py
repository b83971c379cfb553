"""The parameters of PMWG: its noise function, NSG grid and worst-case privacy cost.

**Paper.** Cummings, Krehbiel, Lai, Tantipongpipat, *Differential Privacy for Growing
Databases* (NeurIPS 2018): Algorithm 1 (PMWG), Theorem 11 and its privacy sum (B.1),
Theorem 12 (B.2), Theorem 5, Lemma 14, the generalised noise (B.5) with Theorems 16 and 19,
Lemma 18 and its sum ``tau``; the sparse vector subroutines Algorithm 2 (NATG) and
Algorithm 3 (NSG) with Theorems 20-26 (appendices B and C); Theorem 4 (zCDP composition,
Bun & Steinke 2016) in the main body.

:class:`PmwgSpec` validates a configuration and derives everything public from it: the
noise function ``xi_t = c t^p``, the NSG grid, the per-round sensitivity bound ``S_t``, the
charges, the hard-query cap and the digest that binds the noise to the parameters. The
mechanism itself is :class:`~dpstream.core.pmwg.mechanism.Pmwg`.

**Time and sensitivity** (the public size ``t``, the query value's sensitivity ``1/t``, the
assumptions of Theorem 20) are stated once, in :mod:`dpstream.core.pmwg.mechanism`.

**One person, ``m`` rows** (``sensitivity = m``; the user level's ``max_rows``). A person
adds at most ``m`` rows, so a query value moves by ``Delta_t = m / t`` and everything below
holds with ``xi_t Delta_t = c m t^(p-1)``: ``S_t``, the grid ``g_t``, the round charge and
the worst case are computed with the factor ``m``, and every mode's ``c`` is ``m`` times
smaller than the event level's (the paper's ``c`` is its ``c`` at ``epsilon / m``, as
``xi`` is linear in ``epsilon``), so the configured ``epsilon`` (or ``rho``) is what one
**person** costs. The noise, in fraction units, is ``m`` times larger. ``m = 1`` is the event
level, bit for bit (the digest too).

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

*One round's cost.* Writing ``S_t = xi_t Delta_t (1 + 10^-12) + g_t`` (``g_t`` the NSG grid,
:mod:`dpstream.core.pmwg.sparse_vector`), a round started at ``t0`` and halted at ``t1``
costs at most ``S_t0 + S_t1 / 8`` (``S_t <= sigma c t^(p-1)`` with
``sigma = (1 + 2^-50)(1 + 10^-12)(1 + 2^-32)``).

**Accounting.** The worst-case privacy cost, the coefficient ``c`` of each mode and the
practical mode's round charge are derived in :mod:`dpstream.core.pmwg.worst_case` (Theorem
11's sum (B.1), Lemma 18's ``tau``, privacy filters for the practical mode).

**Randomness and state.** The spec draws no noise and holds no state; its :attr:`PmwgSpec.digest`
is part of every noise coordinate of the mechanism.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Final, Literal

import numpy as np

from dpstream.core._checks import is_integer
from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger, exact, zcdp_to_approx_dp
from dpstream.core.noise.coordinates import encode_coordinates
from dpstream.core.pmwg.hard_query_sums import hard_query_increment
from dpstream.core.pmwg.sparse_vector import GRID_BITS, _floor_log2, _pow2
from dpstream.core.pmwg.worst_case import (
    cost_of_coefficient,
    float_at_least,
    paper_coefficient,
    practical_coefficient,
    round_cost,
    solved_coefficient,
    sum_factor,
)
from dpstream.errors import InvalidParameterError

__all__ = ["Accounting", "Mode", "PmwgSpec"]

T_MAX: Final = 2**48
"""The largest public size accepted (float ``xi_t`` is monotone far beyond it)."""
_XI_FLOAT_SLACK: Final = Fraction(1, 10**12)
"""Relative slack on ``xi_t Delta_t`` covering the float error of ``xi_t`` (<= 2^-50)."""
_CAP_MARGIN: Final = 1e-12
"""The hard-query cap is ``floor((1 - 1e-12) bound)``: never above the real bound."""
_HALF: Final = 0.5

Accounting = Literal["pure", "zcdp"]
Mode = Literal["paper", "solved", "practical"]
_MODES: Final = ("paper", "solved", "practical")
_ACCOUNTINGS: Final = ("pure", "zcdp")


def _check_real(name: str, value: object) -> float:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)):
        raise InvalidParameterError(f"{name} must be a finite number, got {value!r}")
    return float(value)


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
        sensitivity: ``m``, the rows one protected unit may add (1: one event; at the user
            level ``max_rows``): ``Delta_t = m / t``.

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
    sensitivity: int = 1

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
        if not is_integer(self.sensitivity) or self.sensitivity < 1:
            raise InvalidParameterError(
                f"sensitivity must be an integer >= 1, got {self.sensitivity!r}")
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
        """The paper's ``c`` (Algorithm 1 at p = 1/2 with delta = 0, (B.5) otherwise).

        At ``sensitivity = m`` it is the paper's ``c`` at ``epsilon / m`` (group privacy over
        ``m`` rows), i.e. ``m`` times smaller (``xi`` is linear in ``epsilon``).
        """
        c = paper_coefficient(self.accounting, float(self.epsilon), float(self.delta),
                              float(self.alpha), int(self.n), int(self.universe_size),
                              float(self.p))
        return c if self.sensitivity == 1 else c / int(self.sensitivity)

    def _sum_factor(self) -> float:
        """Return :func:`~dpstream.core.pmwg.worst_case.sum_factor` for this spec."""
        return sum_factor(self.accounting, float(self.alpha), int(self.n),
                          int(self.universe_size), self.q)

    @functools.cached_property
    def xi_coefficient(self) -> float:
        """The coefficient ``c`` of ``xi_t = c t^p`` actually used."""
        if self.mode == "paper":
            return self.paper_coefficient
        if self.mode == "solved":
            return solved_coefficient(self.accounting, self.budget, self._sum_factor(),
                                      int(self.sensitivity))
        n = int(self.n)
        return practical_coefficient(self.accounting, self.budget,
                                     int(self.hard_query_cap or 1), n, self.q,
                                     lambda c: self._s_exact(n, c), int(self.sensitivity))

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
        """Return ``e`` with the NSG grid at time ``t`` being ``g_t = 2^e`` eta-units.

        ``g_t = 2^(floor(log2(xi_t Delta_t)) - 32)``, ``Delta_t = m / t``.
        """
        t = self._check_t(t)
        return _floor_log2(Fraction(self.xi(t)) * int(self.sensitivity) / t) - GRID_BITS

    def _s_exact(self, t: int, c: float) -> Fraction:
        ratio = Fraction(self._xi(t, c)) * int(self.sensitivity) / t
        return ratio * (1 + _XI_FLOAT_SLACK) + _pow2(_floor_log2(ratio) - GRID_BITS)

    def sensitivity_bound(self, t: int) -> Fraction:
        """Return ``S_t = xi_t Delta_t (1 + 1e-12) + g_t``, exactly (eta-units).

        ``Delta_t = m / t`` (``m = sensitivity``). It bounds how much any NSG comparison of
        a round started at ``t`` (and the numeric answer of a round halted at ``t``) moves
        on neighbouring databases.
        """
        return self._s_exact(self._check_t(t), self.xi_coefficient)

    def round_charge(self, t0: int) -> PrivacyCharge:
        """Return the practical-mode charge of a round starting at ``t0`` (both parts)."""
        cost = float_at_least(round_cost(self.accounting, self.sensitivity_bound(t0)))
        if self.accounting == "pure":
            return PrivacyCharge(epsilon=cost, label="PMWG round")
        return PrivacyCharge(rho=cost, label="PMWG round")

    # -- the worst case --
    def paper_sum(self) -> float:
        """Return (B.1) (pure) or ``tau`` (zcdp) for this spec's ``xi``, evaluated numerically.

        No grid term or float slack: this is the paper's quantity, with the infinite sum as
        exact terms plus an analytic upper bound of the tail. At ``sensitivity = m`` it is
        evaluated at ``c m`` (``xi_t Delta_t = c m t^(p-1)``).
        """
        c = self.xi_coefficient
        if self.sensitivity != 1:
            c *= int(self.sensitivity)
        factor = self._sum_factor()
        return c * factor if self.accounting == "pure" else c * c * factor

    def worst_case_cost(self) -> float:
        """Return the worst-case privacy cost in ledger units (epsilon or rho).

        Modes paper/solved: ``sigma (1 + 1e-9)`` times (B.1) (pure) or ``tau / 2`` (zcdp),
        rounded up. Practical: the budget (the filter never lets more through).
        """
        if self.mode == "practical":
            return self.budget
        return float_at_least(Fraction(
            cost_of_coefficient(self.accounting, self._sum_factor(), self.xi_coefficient,
                                int(self.sensitivity))))

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
        if self.sensitivity != 1:  # the user level's max_rows (the event level's digest kept)
            fields = (*fields, "sensitivity", int(self.sensitivity))
        return hashlib.blake2b(encode_coordinates(fields), digest_size=8,
                               person=b"dpstream-params").hexdigest()

    # -- the guarantee report --
