"""Black-box schedulers: rerun a static DP algorithm as the database grows.

The database grows by one row per unit of its public size ``t`` (``t = n,
n + 1, ...``). A stream of linear queries must be answered at every ``t``
using a static ``(p, g)``-black box ``M`` (Definition 4;
:mod:`dpstream.core.pmwg.blackboxes`). Both schedulers come from Cummings,
Krehbiel, Lai, Tantipongpipat 2018, "Differential Privacy for Growing
Databases", Section 4 and appendix D.

**BBScheduler** (Algorithm 4, Theorem 27, Lemma 28) reruns ``M`` at the
start of epochs that grow geometrically. Epoch ``i`` starts at
``t_i = (1 + gamma)^i n``. It runs ``M(x_{t_i}, epsilon_i, alpha_i, beta_i)``
and answers every query of the epoch from that synopsis:

* ``delta = 0``: ``gamma = g^(1/(2p+1)) (log(1/beta) / (epsilon n))^(p/(2p+1))``
  and ``epsilon_i = gamma^2 (i+1) / (1+gamma)^(i+2) epsilon``.
* ``delta > 0``: ``gamma = g^(1/(1.5p+1)) Z^(p/(1.5p+1))``, with
  ``Z = 3 sqrt(log(1/delta)) log(1/beta) / (epsilon n)``, and
  ``epsilon_i = (i+1) gamma^1.5 / (1+gamma)^(i+1.5) epsilon / (3 sqrt(log(1/delta)))``.
* ``beta_i = (beta / (1+beta))^(i+1)`` and
  ``alpha_i = g (log(1/beta_i) / (epsilon_i (1+gamma)^i n))^p``.

*Privacy.* For ``delta = 0``, basic composition (Theorem 3) gives
``sum_i epsilon_i = epsilon gamma^2/(1+gamma) sum_i (i+1)/(1+gamma)^(i+1) = epsilon``
in the limit; every partial sum is smaller. The ledger (``pure``) charges
``epsilon_i`` at each epoch start with budget ``epsilon``. For ``delta > 0``,
each ``epsilon_i``-DP run is ``epsilon_i^2 / 2``-zCDP (Bun & Steinke 2016,
Proposition 1.4), and zCDP adds up. The ledger (``zcdp``) charges
``rho_i = epsilon_i^2 / 2`` against the budget ``rho = epsilon^2 / (9 log(1/delta))``,
the proof's bound on ``sum_i epsilon_i^2 / 2``. It reports
``(rho + 2 sqrt(rho log(1/delta)), delta)``, which is Theorem 4's
``1/2 sum epsilon_i^2 + sqrt(2 sum epsilon_i^2 log(1/delta))``. At the full
budget that is ``epsilon^2/(9 log(1/delta)) + 2 epsilon / 3 <= epsilon``
exactly when ``epsilon <= 3 log(1/delta)``. Theorem 27 assumes
``epsilon < 1``, which suffices when ``log(1/delta) >= 1/3``. A spec whose
full budget converts to more than ``epsilon`` is refused. The ``epsilon_i``
are floats here; the budget leaves room to spare for their rounding, since
the sum uses at most ``5/27`` of it. *Accuracy* (D.1): a query at ``t`` in
epoch ``i`` is within ``alpha_i + gamma/(1+gamma)`` with probability
``1 - beta``, because ``sum_i beta_i = beta`` exactly. Lemma 28 bounds the drift of ``x_t`` over one
epoch, and :meth:`BBSchedulerSpec.accuracy` returns that sum.

**BBImprover** (Algorithm 5, Theorem 29) reruns ``M`` at every ``t >= n``
with ``epsilon_t = sqrt(c) / (3 sqrt(log(1/delta))) epsilon / t^(1/2 + c)``,
``beta_t = beta / (2 t^2)`` and
``alpha_t = g (1 / (epsilon_t t))^p log^p''(t) log^p'(1/beta_t)``.
*Privacy* (D.2): ``sum_{t >= n} epsilon_t^2 <= epsilon^2 / (9 log(1/delta))``
(this needs ``n >= 2c``, checked). The ledger (``zcdp``) charges
``epsilon_t^2 / 2`` per run with budget ``epsilon^2 / (18 log(1/delta))``.
BBImprover requires ``delta > 0``: Theorem 29 is ``(epsilon, delta)``-DP
only, and the paper gives no pure version. In a flow, ``t`` grows in jumps,
so the box runs at each *observed* ``t``. The sum over the ``t`` actually run
is a sub-sum of a series of positive terms, so skipping some ``t`` only
lowers the privacy cost. Each run keeps its own ``epsilon_t``: nothing
skipped is "caught up".

**Readings of the paper** (where the extracted text is ambiguous or
inconsistent):

1. *Epoch starts.* Algorithm 4's test ``t = (1+gamma)^(i+1) n`` rarely holds
   for an integer ``t``. We read it as "the first ``t >= (1+gamma)^(i+1) n``":
   epoch ``i`` starts at ``ceil((1+gamma)^i n)``. That is computed exactly,
   with ``gamma`` taken as the rational its float prints as (``exact``). If
   ``t`` jumps over several starts, only the last epoch reached runs. The
   skipped epochs are never charged; the one that runs uses its own
   ``epsilon_i``, ``beta_i`` and ``alpha_i``, on at least ``t_i`` rows.
   Answers until the next start drift by less than ``gamma/(1+gamma)``
   (Lemma 28).
2. *epsilon_i for delta > 0.* Algorithm 4 prints
   ``gamma^(1.5(i+1)) / (1+gamma)^(i+1.5)``. Theorem 27's proof uses
   ``(i+1) gamma^1.5 / (1+gamma)^(i+1.5)``. Only the proof's reading gives
   its closed form
   ``sum epsilon_i^2 = epsilon^2/(9 log(1/delta)) (1+gamma)(gamma^2+2gamma+2)/(gamma+2)^3``
   (at most ``10/27`` of ``epsilon^2/(9 log(1/delta))`` for ``gamma < 1``,
   within the claimed ``2``). It is also the only reading for which the
   proof's ``alpha_i`` is constant: the ``(i+1)`` cancels ``log(1/beta_i)``.
   The printed reading decays like ``gamma^(1.5 i)``, so ``alpha_i`` would
   blow up. We use the proof's reading.
3. *gamma for delta > 0.* Algorithm 4 prints ``log(1/beta) / (epsilon n)``
   inside ``gamma``. The proof sets ``gamma`` from
   ``Z = 3 sqrt(log(1/delta)) log((1+beta)/beta) / (epsilon n)``, which is
   what gives Theorem 27's ``sqrt(log(1/delta))`` rate. We use
   ``Z = 3 sqrt(log(1/delta)) log(1/beta) / (epsilon n)``: the proof's
   ``delta`` factor, and Algorithm 4's ``log(1/beta)`` (a constant factor
   apart). Privacy does not depend on ``gamma``.
4. *BBImprover's alpha_t.* Algorithm 5 prints
   ``g (1/(epsilon_i t))^p log^p''(n) log^p'(1/beta)``. Theorem 29's proof
   uses ``g (1/(epsilon_t t))^p log^p''(t) log^p'(1/beta_t)``: the black
   box's guarantee at size ``t`` and confidence ``beta_t``. We use the
   proof's form.
5. *delta = 0 for BBImprover* is refused (see above).
6. *The database size* ``t`` is public, as in the paper (``x_t`` has ``t``
   rows). It is passed to the black box as ``n``. Neighbouring inputs differ
   by one event (:mod:`dpstream.core.pmwg.blackboxes`).

**Exact, replay-safe noise.** The schedulers draw nothing themselves. A run
of the black box gets ``rng_for(*c) = key.stream(*coordinates, kind, box,
r, *c)``, where ``kind`` is ``"bbscheduler"`` or ``"bbimprover"``, ``box`` is
the black box's name and ``r`` is the epoch or ``t``. A replay after a crash
therefore reproduces the very same synopsis, and the black boxes sample
exactly (:mod:`dpstream.core.pmwg.blackboxes`). The pure ledger's charges are
exact: ``epsilon_i`` is computed as a rational and rounded *down* to a float
whose decimal value (what the ledger and the noise use) does not exceed it,
so no partial sum ever exceeds ``epsilon``. A run is first checked against
the ledger; the black box runs only if it fits, and the charge is committed
before the synopsis is returned. A run past the budget raises
:class:`~dpstream.errors.BudgetExhaustedError` and changes nothing.

**State** (:meth:`BBScheduler.to_state`): the spec, the black box's name,
the current epoch (or last run ``t``) and the ``t`` it ran at, the last
observed ``t``, the released synopsis and the ledger. It holds no true
counts and no key. It must still be bound to the same spec, black box and
key when it is loaded (:meth:`BBScheduler.from_state` checks the first two).
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Final, Generic, Self, TypeVar

import numpy as np
import numpy.typing as npt

from dpstream.core._checks import integer_at_least, positive_finite
from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger, exact, zcdp_to_approx_dp
from dpstream.core.noise.coordinates import check_coordinates
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import RandomIntegers
from dpstream.core.pmwg.blackboxes import (
    BlackBox,
    PrecheckedBlackBox,
    Synopsis,
    synopsis_from_state,
)
from dpstream.errors import BudgetExhaustedError, InvalidParameterError

__all__ = ["BBImprover", "BBImproverSpec", "BBScheduler", "BBSchedulerSpec"]

_STATE_VERSION: Final = 1
_SMALLEST_BETA: Final = sys.float_info.min
"""A ``beta_i`` that underflows is passed to the black box as the smallest normal float."""


# --- shared checks ------------------------------------------------------------------


def _check_probability(name: str, value: object, *, allow_zero: bool = False) -> float:
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (0 <= value < 1 if allow_zero else 0 < value < 1)
    ):
        return float(value)
    interval = "[0, 1)" if allow_zero else "(0, 1)"
    raise InvalidParameterError(f"{name} must be in {interval}, got {value!r}")


def _check_nonnegative(name: str, value: object) -> float:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0):
        raise InvalidParameterError(f"{name} must be finite and >= 0, got {value!r}")
    return float(value)


def _check_t(t: object) -> int:
    return integer_at_least("t", t, 0)


def _float_at_most(value: Fraction) -> float:
    """Return the largest float ``f <= value`` (as float) whose decimal ``exact(f) <= value``."""
    f = float(value)
    while exact(f) > value:
        f = math.nextafter(f, 0.0)
    return f


def _check_black_box(spec_values: dict[str, float], black_box: BlackBox) -> None:
    name = getattr(black_box, "name", None)
    if not isinstance(name, str) or not name:
        raise InvalidParameterError(f"the black box needs a non-empty str name, got {name!r}")
    for attr, value in spec_values.items():
        have = getattr(black_box, attr, None)
        if have != value:
            raise InvalidParameterError(
                f"the spec was made for {attr} = {value!r}, but black box {name!r} has "
                f"{attr} = {have!r}: build the spec with for_black_box()"
            )


# --- BBScheduler --------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _epoch_start(gamma: Fraction, n: int, epoch: int) -> int:
    start = n * (1 + gamma) ** epoch
    return -(-start.numerator // start.denominator)


@functools.lru_cache(maxsize=4096)
def _pure_epsilon(gamma: Fraction, epsilon: Fraction, epoch: int) -> Fraction:
    return gamma * gamma * (epoch + 1) / (1 + gamma) ** (epoch + 2) * epsilon


@dataclass(frozen=True)
class BBSchedulerSpec:
    """Parameters of a BBScheduler (Algorithm 4), validated at construction.

    Attributes:
        epsilon: the total privacy parameter.
        beta: the total failure probability of the accuracy guarantee, in ``(0, 1)``.
        n: the database size at which the first epoch starts (an integer >= 1).
        p: the black box's Definition-4 exponent.
        g: the black box's Definition-4 factor.
        delta: ``0`` for pure DP (basic composition), or in ``(0, 1)`` for
            ``(epsilon, delta)``-DP through zCDP (Theorem 4).

    Raises:
        InvalidParameterError: a parameter is out of range; ``gamma`` is not ``< 1``
            (``n`` too small for ``epsilon``, ``beta``, ``g``, ``p``); or, for
            ``delta > 0``, the zCDP budget does not convert to ``(epsilon, delta)``.

    """

    epsilon: float
    beta: float
    n: int
    p: float
    g: float
    delta: float = 0.0

    mechanism: ClassVar[str] = "bbscheduler"

    def __post_init__(self) -> None:
        positive_finite("epsilon", self.epsilon)
        _check_probability("beta", self.beta)
        integer_at_least("n", self.n, 1)
        positive_finite("p", self.p)
        positive_finite("g", self.g)
        _check_probability("delta", self.delta, allow_zero=True)
        gamma = self._gamma_float
        if not gamma < 1.0:
            need = self._z_factor * self.g ** (1.0 / self.p) / self.epsilon
            detail = f", delta = {self.delta!r}" if self.delta > 0 else ""
            raise InvalidParameterError(
                f"gamma = {gamma:.6g} is not < 1 (Algorithm 4 needs gamma in (0, 1)): "
                f"n = {self.n} is too small for epsilon = {self.epsilon!r}, "
                f"beta = {self.beta!r}{detail} and the black box's p = {self.p!r}, "
                f"g = {self.g:.6g}; it needs n > {need:.6g}"
            )
        if self.delta > 0 and self.guaranteed_epsilon > self.epsilon:
            raise InvalidParameterError(
                f"with delta = {self.delta!r}, the zCDP budget rho = epsilon^2 / "
                f"(9 log(1/delta)) = {self.budget:.6g} converts to epsilon = "
                f"{self.guaranteed_epsilon:.6g} > {self.epsilon!r} (Theorem 27 assumes "
                "epsilon < 1; the conversion needs epsilon <= 3 log(1/delta))"
            )

    @classmethod
    def for_black_box(
        cls, black_box: BlackBox, *, epsilon: float, beta: float, n: int, delta: float = 0.0
    ) -> BBSchedulerSpec:
        """Return the spec for ``black_box``'s ``p`` and ``g``."""
        return cls(epsilon=epsilon, beta=beta, n=n, p=black_box.p, g=black_box.g, delta=delta)

    # -- gamma and the schedule --
    @property
    def _log_inv_delta(self) -> float:
        return math.log(1.0 / self.delta)

    @property
    def _z_factor(self) -> float:
        """``log(1/beta)``, times ``3 sqrt(log(1/delta))`` when ``delta > 0`` (reading 3)."""
        factor = math.log(1.0 / self.beta)
        if self.delta > 0:
            factor *= 3.0 * math.sqrt(self._log_inv_delta)
        return factor

    @property
    def _gamma_float(self) -> float:
        z = self._z_factor / (self.epsilon * self.n)
        denom = 2.0 * self.p + 1.0 if self.delta == 0 else 1.5 * self.p + 1.0
        return float(self.g ** (1.0 / denom) * z ** (self.p / denom))

    @functools.cached_property
    def gamma_exact(self) -> Fraction:
        """``gamma`` as the exact rational that every schedule quantity uses."""
        return exact(self._gamma_float)

    @property
    def gamma(self) -> float:
        """The epoch growth factor ``gamma`` in ``(0, 1)``."""
        return float(self.gamma_exact)

    @property
    def accounting(self) -> str:
        """``"pure"`` for ``delta = 0``, else ``"zcdp"``."""
        return "pure" if self.delta == 0 else "zcdp"

    @property
    def budget(self) -> float:
        """The ledger's budget: ``epsilon`` (pure) or ``rho = epsilon^2 / (9 log(1/delta))``."""
        if self.delta == 0:
            return float(self.epsilon)
        return float(self.epsilon) ** 2 / (9.0 * self._log_inv_delta)

    @property
    def guaranteed_epsilon(self) -> float:
        """The epsilon of the whole, never-ending run once the budget is spent (Theorem 4)."""
        if self.delta == 0:
            return float(self.epsilon)
        return zcdp_to_approx_dp(self.budget, self.delta)

    def new_ledger(self) -> PrivacyLedger:
        """Return an empty ledger with this spec's accounting and budget."""
        return PrivacyLedger("pure" if self.delta == 0 else "zcdp", self.budget)

    def epoch_start(self, epoch: int) -> int:
        """Return ``t_i = ceil((1 + gamma)^i n)``, the first ``t`` of epoch ``i``."""
        i = integer_at_least("epoch", epoch, 0)
        return _epoch_start(self.gamma_exact, int(self.n), i)

    def epoch_of(self, t: int) -> int:
        """Return the epoch that contains database size ``t``, or ``-1`` for ``t < n``."""
        t = _check_t(t)
        if t < self.n:
            return -1
        guess = int((math.log(t) - math.log(self.n)) / math.log1p(self.gamma))
        i = max(0, guess - 1)
        while i > 0 and self.epoch_start(i) > t:
            i -= 1
        while self.epoch_start(i + 1) <= t:
            i += 1
        return i

    def epoch_epsilon(self, epoch: int) -> float:
        """Return ``epsilon_i``, the privacy parameter of epoch ``i``'s run.

        For ``delta = 0`` it is the exact rational of Algorithm 4 rounded down
        (see the module docstring). For ``delta > 0`` it is computed in floating
        point, in log space (reading 2).
        """
        i = integer_at_least("epoch", epoch, 0)
        if self.delta == 0:
            return _float_at_most(_pure_epsilon(self.gamma_exact, exact(self.epsilon), i))
        gamma = self.gamma
        log_eps = (
            math.log(i + 1) + 1.5 * math.log(gamma) - (i + 1.5) * math.log1p(gamma)
            + math.log(self.epsilon) - math.log(3.0 * math.sqrt(self._log_inv_delta))
        )
        return math.exp(log_eps)

    def epoch_log_inv_beta(self, epoch: int) -> float:
        """Return ``log(1/beta_i) = (i + 1) log((1 + beta) / beta)`` (no underflow)."""
        i = integer_at_least("epoch", epoch, 0)
        return (i + 1) * math.log((1.0 + self.beta) / self.beta)

    def epoch_beta(self, epoch: int) -> float:
        """Return ``beta_i = (beta / (1 + beta))^(i + 1)`` (0.0 once it underflows)."""
        i = integer_at_least("epoch", epoch, 0)
        return float((self.beta / (1.0 + self.beta)) ** (i + 1))

    def epoch_alpha(self, epoch: int) -> float:
        """Return ``alpha_i = g (log(1/beta_i) / (epsilon_i (1 + gamma)^i n))^p``."""
        eps = self.epoch_epsilon(epoch)
        if eps == 0.0:
            return math.inf
        log_ratio = (
            math.log(self.epoch_log_inv_beta(epoch)) - math.log(eps)
            - epoch * math.log1p(self.gamma) - math.log(self.n)
        )
        return float(self.g * math.exp(self.p * log_ratio))

    def epoch_charge(self, epoch: int) -> PrivacyCharge:
        """Return the ledger charge of epoch ``i``'s run (``epsilon_i``; zCDP ledgers square it)."""
        return PrivacyCharge(epsilon=self.epoch_epsilon(epoch), label=f"bbscheduler epoch {epoch}")

    def accuracy(self, t: int) -> float:
        """Return ``alpha_i + gamma / (1 + gamma)`` for the epoch ``i`` of ``t`` (Theorem 27, D.1).

        Raises:
            InvalidParameterError: ``t < n`` (no guarantee before the first epoch).

        """
        epoch = self.epoch_of(t)
        if epoch < 0:
            raise InvalidParameterError(
                f"no accuracy guarantee before the first epoch: t = {t} < n = {self.n}"
            )
        return self.epoch_alpha(epoch) + self.gamma / (1.0 + self.gamma)

    def to_dict(self) -> dict[str, Any]:
        """Return the parameters as JSON-safe data (for binding a state to its spec)."""
        return {
            "epsilon": float(self.epsilon),
            "beta": float(self.beta),
            "n": int(self.n),
            "p": float(self.p),
            "g": float(self.g),
            "delta": float(self.delta),
        }


# --- BBImprover ---------------------------------------------------------------------


@dataclass(frozen=True)
class BBImproverSpec:
    """Parameters of a BBImprover (Algorithm 5, Theorem 29), validated at construction.

    Attributes:
        epsilon: the total privacy parameter.
        delta: in ``(0, 1)``; ``0`` is refused (Theorem 29 is ``(epsilon, delta)``-DP only).
        beta: the total failure probability, in ``(0, 1)``.
        n: the first database size at which the black box runs (an integer >= 1).
        c: the schedule's exponent ``c > 0`` (accuracy improves with ``t`` when ``c < 1/4``);
            D.2's bound needs ``n >= 2c``.
        p: the black box's ``p``.
        p_prime: the black box's ``p'`` (power of ``log(1/beta)``).
        p_double_prime: the black box's ``p''`` (power of ``log n``).
        g: the black box's ``g``.

    Raises:
        InvalidParameterError: a parameter is out of range, ``delta = 0``, ``n < 2c``, or
            the zCDP budget does not convert to ``(epsilon, delta)``.

    """

    epsilon: float
    delta: float
    beta: float
    n: int
    c: float
    p: float
    p_prime: float
    p_double_prime: float
    g: float

    mechanism: ClassVar[str] = "bbimprover"

    def __post_init__(self) -> None:
        positive_finite("epsilon", self.epsilon)
        if isinstance(self.delta, (int, float)) and self.delta == 0:
            raise InvalidParameterError(
                "BBImprover needs delta > 0: the paper's Theorem 29 (Algorithm 5) is "
                "(epsilon, delta)-DP only, by CDP composition (Theorem 4), and gives no "
                "pure version; use BBScheduler for delta = 0"
            )
        _check_probability("delta", self.delta)
        _check_probability("beta", self.beta)
        integer_at_least("n", self.n, 1)
        positive_finite("c", self.c)
        positive_finite("p", self.p)
        _check_nonnegative("p_prime", self.p_prime)
        _check_nonnegative("p_double_prime", self.p_double_prime)
        positive_finite("g", self.g)
        if self.n < 2 * self.c:
            raise InvalidParameterError(
                f"n = {self.n} must be >= 2c = {2 * self.c!r}: the bound "
                "sum_{t >= n} t^-(1+2c) <= 1/(c n^(2c)) of Theorem 29's proof (D.2) needs it"
            )
        if self.guaranteed_epsilon > self.epsilon:
            raise InvalidParameterError(
                f"with delta = {self.delta!r}, the zCDP budget rho = epsilon^2 / "
                f"(18 log(1/delta)) = {self.budget:.6g} converts to epsilon = "
                f"{self.guaranteed_epsilon:.6g} > {self.epsilon!r} (Theorem 29 assumes "
                "epsilon < 1)"
            )

    @classmethod
    def for_black_box(
        cls, black_box: BlackBox, *, epsilon: float, delta: float, beta: float, n: int, c: float
    ) -> BBImproverSpec:
        """Return the spec for ``black_box``'s ``p``, ``p'``, ``p''`` and ``g``."""
        return cls(
            epsilon=epsilon, delta=delta, beta=beta, n=n, c=c, p=black_box.p,
            p_prime=black_box.p_prime, p_double_prime=black_box.p_double_prime, g=black_box.g,
        )

    @property
    def _log_inv_delta(self) -> float:
        return math.log(1.0 / self.delta)

    @property
    def budget(self) -> float:
        """The zCDP budget ``rho = epsilon^2 / (18 log(1/delta))`` (half D.2's bound)."""
        return float(self.epsilon) ** 2 / (18.0 * self._log_inv_delta)

    @property
    def guaranteed_epsilon(self) -> float:
        """The epsilon of the whole, never-ending run once the budget is spent (Theorem 4)."""
        return zcdp_to_approx_dp(self.budget, self.delta)

    def squared_sum_bound(self) -> float:
        """Return D.2's bound ``epsilon^2 / (9 log(1/delta) n^(2c))`` on ``sum_t epsilon_t^2``."""
        n_power = math.pow(self.n, 2.0 * self.c)
        return float(self.epsilon) ** 2 / (9.0 * self._log_inv_delta * n_power)

    def new_ledger(self) -> PrivacyLedger:
        """Return an empty ``zcdp`` ledger with this spec's budget."""
        return PrivacyLedger("zcdp", self.budget)

    def _check_run_t(self, t: int) -> int:
        t = _check_t(t)
        if t < self.n:
            raise InvalidParameterError(f"BBImprover runs from t = n = {self.n} on, got t = {t}")
        return t

    def run_epsilon(self, t: int) -> float:
        """Return ``epsilon_t = sqrt(c) / (3 sqrt(log(1/delta))) epsilon / t^(1/2 + c)``."""
        t = self._check_run_t(t)
        log_eps = (
            0.5 * math.log(self.c) - math.log(3.0 * math.sqrt(self._log_inv_delta))
            + math.log(self.epsilon) - (0.5 + self.c) * math.log(t)
        )
        return math.exp(log_eps)

    def run_beta(self, t: int) -> float:
        """Return ``beta_t = beta / (2 t^2)``."""
        t = self._check_run_t(t)
        return float(self.beta / (2.0 * float(t) ** 2))

    def accuracy(self, t: int) -> float:
        """Return ``alpha_t = g (1/(epsilon_t t))^p log^p''(t) log^p'(1/beta_t)`` (reading 4)."""
        t = self._check_run_t(t)
        eps = self.run_epsilon(t)
        log_inv_beta = math.log(2.0) + 2.0 * math.log(t) - math.log(self.beta)
        return float(
            self.g * math.exp(-self.p * (math.log(eps) + math.log(t)))
            * math.log(t) ** self.p_double_prime * log_inv_beta ** self.p_prime
        )

    def run_charge(self, t: int) -> PrivacyCharge:
        """Return the ledger charge of the run at ``t``: ``epsilon_t``, i.e. ``epsilon_t^2 / 2``."""
        return PrivacyCharge(epsilon=self.run_epsilon(t), label=f"bbimprover t={t}")

    def to_dict(self) -> dict[str, Any]:
        """Return the parameters as JSON-safe data (for binding a state to its spec)."""
        return {
            "epsilon": float(self.epsilon),
            "delta": float(self.delta),
            "beta": float(self.beta),
            "n": int(self.n),
            "c": float(self.c),
            "p": float(self.p),
            "p_prime": float(self.p_prime),
            "p_double_prime": float(self.p_double_prime),
            "g": float(self.g),
        }


# --- the runners --------------------------------------------------------------------


_SpecT = TypeVar("_SpecT", bound=BBSchedulerSpec | BBImproverSpec)


class _Runner(Generic[_SpecT]):
    """What both schedulers share: the ledger, the synopsis, the clock and the state.

    A subclass names its ``_kind`` and says which of the spec's values the black
    box must match (:meth:`_bound`) and the parameters of its first run
    (:meth:`_first_run`, checked up front by a
    :class:`~dpstream.core.pmwg.blackboxes.PrecheckedBlackBox`).
    """

    _kind: ClassVar[str] = ""

    def __init__(
        self,
        spec: _SpecT,
        black_box: BlackBox,
        noise: NoiseKey,
        coordinates: tuple[str | int, ...],
    ) -> None:
        self.spec: _SpecT = spec
        ledger = spec.new_ledger()
        _check_black_box(self._bound(), black_box)
        self.black_box = black_box
        self._key = noise
        self._coordinates = check_coordinates(coordinates)
        self._ledger = ledger
        self._round = -1  # the epoch (BBScheduler) or the t (BBImprover) of the last run
        self._run_t: int | None = None
        self._run_epsilon: float | None = None
        self._last_t: int | None = None
        self._synopsis: Synopsis | None = None
        if isinstance(black_box, PrecheckedBlackBox):
            black_box.check_run(*self._first_run())

    def _bound(self) -> dict[str, float]:
        """The spec's values the black box's attributes must equal."""
        raise NotImplementedError

    def _first_run(self) -> tuple[int, float, float, float]:
        """The ``(n, epsilon, alpha, beta)`` of the first run."""
        raise NotImplementedError

    # -- the run --
    def _advance(self, t: int) -> int:
        t = _check_t(t)
        if self._last_t is not None and t < self._last_t:
            raise InvalidParameterError(
                f"t must not decrease: got t = {t} after t = {self._last_t}"
            )
        return t

    def _run(
        self,
        counts: Any,
        t: int,
        round_: int,
        charge: PrivacyCharge,
        alpha: float,
        beta: float,
    ) -> Synopsis:
        if charge.epsilon == 0.0:
            raise BudgetExhaustedError(
                f"refused {charge.label}: its epsilon underflows a float; no further runs"
            )
        if not self._ledger.can_afford(charge):
            self._ledger.charge(charge)  # raises BudgetExhaustedError and changes nothing
        key, coordinates = self._key, self._coordinates
        prefix = (*coordinates, self._kind, self.black_box.name, round_)

        def rng_for(*sub: str | int) -> RandomIntegers:
            return key.stream(*prefix, *sub)

        synopsis = self.black_box.run(
            counts, t, charge.epsilon, alpha, max(beta, _SMALLEST_BETA), rng_for
        )
        self._ledger.charge(charge)  # checked above: commits
        self._ledger.record_release()
        self._round, self._run_t, self._run_epsilon = round_, t, charge.epsilon
        self._synopsis = synopsis
        self._last_t = t
        return synopsis

    # -- reporting --
    @property
    def ledger(self) -> PrivacyLedger:
        """The privacy ledger (what has been spent of the budget)."""
        return self._ledger

    @property
    def synopsis(self) -> Synopsis | None:
        """The current synopsis, or ``None`` before the first run."""
        return self._synopsis

    @property
    def run_t(self) -> int | None:
        """The database size at which the current synopsis was computed."""
        return self._run_t

    @property
    def run_epsilon(self) -> float | None:
        """The epsilon of the run that made the current synopsis (``None`` before the first)."""
        return self._run_epsilon

    @property
    def last_t(self) -> int | None:
        """The last database size observed."""
        return self._last_t

    def privacy_spent(self) -> tuple[float, float]:
        """Return ``(epsilon, delta)`` spent so far (Theorem 4's conversion when ``delta > 0``)."""
        delta = self.spec.delta
        if self._ledger.accounting == "pure":
            return self._ledger.spent, 0.0
        return self._ledger.epsilon_spent(delta), delta

    # -- state --
    def to_state(self) -> dict[str, Any]:
        """Return the state as JSON- and pickle-safe data (no key, no counts)."""
        return self._state(self.spec.to_dict())

    @classmethod
    def from_state(
        cls,
        state: dict[str, Any],
        spec: _SpecT,
        black_box: BlackBox,
        noise: NoiseKey,
        coordinates: tuple[str | int, ...],
    ) -> Self:
        """Rebuild from :meth:`to_state` with the same spec, black box and key.

        Raises:
            InvalidParameterError: the state is malformed or was made with another spec
                or black box.

        """
        runner = cls(spec, black_box, noise, coordinates)
        runner._load(state, spec.to_dict())
        return runner

    def _synopsis_from_state(self, state: dict[str, Any]) -> Synopsis:
        """Load a released synopsis; a runner whose black box releases another kind overrides it.

        ``_run`` passes its database (``counts``, a histogram for this module's black boxes)
        to the black box untouched, so a subclass may drive a black box over another kind of
        database (:mod:`dpstream.core.erm.ermg`).
        """
        return synopsis_from_state(state)

    def _state(self, spec: dict[str, Any]) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "kind": self._kind,
            "spec": spec,
            "black_box": self.black_box.name,
            "round": self._round,
            "run_t": self._run_t,
            "run_epsilon": self._run_epsilon,
            "last_t": self._last_t,
            "synopsis": None if self._synopsis is None else self._synopsis.to_state(),
            "ledger": self._ledger.to_state(),
        }

    def _load(self, state: dict[str, Any], spec: dict[str, Any]) -> None:
        try:
            if state["version"] != _STATE_VERSION or state["kind"] != self._kind:
                raise InvalidParameterError(
                    f"not a {self._kind} state of version {_STATE_VERSION}: "
                    f"kind {state['kind']!r}, version {state['version']!r}"
                )
            if state["spec"] != spec:
                raise InvalidParameterError(
                    f"{self._kind} state was made with spec {state['spec']!r}, "
                    f"but this one is {spec!r}"
                )
            if state["black_box"] != self.black_box.name:
                raise InvalidParameterError(
                    f"{self._kind} state was made with black box {state['black_box']!r}, "
                    f"not {self.black_box.name!r}"
                )
            ledger = PrivacyLedger.from_state(state["ledger"])
            fresh = self._ledger
            if ledger.accounting != fresh.accounting or ledger.to_state()["budget"] != \
                    fresh.to_state()["budget"]:
                raise InvalidParameterError(
                    f"{self._kind} state's ledger ({ledger!r}) does not match the spec's"
                )
            round_ = int(state["round"])
            run_t = None if state["run_t"] is None else int(state["run_t"])
            run_eps = None if state["run_epsilon"] is None else float(state["run_epsilon"])
            last_t = None if state["last_t"] is None else int(state["last_t"])
            synopsis = None if state["synopsis"] is None else self._synopsis_from_state(
                state["synopsis"]
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidParameterError):
                raise
            raise InvalidParameterError(f"malformed {self._kind} state: {exc!r}") from None
        if (synopsis is None) != (round_ < 0) or (synopsis is None) != (run_t is None):
            raise InvalidParameterError(
                f"malformed {self._kind} state: inconsistent round and synopsis"
            )
        self._ledger = ledger
        self._round, self._run_t, self._run_epsilon = round_, run_t, run_eps
        self._last_t, self._synopsis = last_t, synopsis


class BBScheduler(_Runner[BBSchedulerSpec]):
    """Algorithm 4: rerun a ``(p, g)``-black box at geometrically spaced epochs.

    Args:
        spec: the schedule (build it with :meth:`BBSchedulerSpec.for_black_box`).
        black_box: the static black box; its ``p`` and ``g`` must equal the spec's.
        noise: the secret key all noise is derived from.
        coordinates: the release's coordinates, e.g. ``(flow, mechanism, key)``; a run
            draws at ``(*coordinates, "bbscheduler", black_box.name, epoch, ...)``.

    Raises:
        InvalidParameterError: bad coordinates, a black box that does not match the
            spec, or one that refuses the first epoch's parameters up front
            (:class:`~dpstream.core.pmwg.blackboxes.PrecheckedBlackBox`; ``alpha_i`` is the
            same for every epoch, up to rounding).

    """

    _kind: ClassVar[str] = "bbscheduler"

    def _bound(self) -> dict[str, float]:
        return {"p": self.spec.p, "g": self.spec.g}

    def _first_run(self) -> tuple[int, float, float, float]:
        spec = self.spec
        return spec.n, spec.epoch_epsilon(0), spec.epoch_alpha(0), spec.epoch_beta(0)

    @property
    def epoch(self) -> int:
        """The current epoch (``-1`` before the first run)."""
        return self._round

    def observe(self, counts: npt.NDArray[np.int64], t: int) -> Synopsis | None:
        """Take the database at its new size ``t``; rerun the black box if an epoch starts.

        Call it at every new ``t`` (``t`` must not decrease). The epoch of
        ``t`` is the last ``i`` with ``t_i <= t``. If it is later than the
        current epoch, the black box runs once on ``counts`` with that epoch's
        ``epsilon_i``, ``alpha_i`` and ``beta_i``; epochs jumped over are
        skipped and never charged (reading 1).

        Returns:
            The new synopsis if the black box ran, otherwise ``None`` (the current
            epoch's synopsis stays in use).

        Raises:
            InvalidParameterError: ``t`` is not an integer, or decreased; bad counts.
            BudgetExhaustedError: the run does not fit in the ledger (nothing changes).

        """
        t = self._advance(t)
        epoch = self.spec.epoch_of(t)
        if epoch <= self._round:
            self._last_t = t
            return None
        return self._run(
            counts, t, epoch, self.spec.epoch_charge(epoch), self.spec.epoch_alpha(epoch),
            self.spec.epoch_beta(epoch),
        )

    def answer(self, weights: npt.NDArray[Any], t: int) -> float:
        """Answer the linear query ``weights`` at database size ``t`` from the epoch's synopsis.

        Raises:
            InvalidParameterError: no synopsis yet, ``t`` decreased, or ``t`` lies in a later
                epoch than the synopsis (call :meth:`observe` first); bad weights.

        """
        t = self._advance(t)
        if self._synopsis is None:
            raise InvalidParameterError(
                f"no synopsis yet: the first epoch starts at t = n = {self.spec.n}; "
                "call observe(counts, t) first"
            )
        epoch = self.spec.epoch_of(t)
        if epoch != self._round:
            raise InvalidParameterError(
                f"t = {t} lies in epoch {epoch}, but the synopsis is epoch {self._round}'s: "
                "call observe(counts, t) first"
            )
        return self._synopsis.answer(weights)

    def accuracy(self, t: int) -> float:
        """Return the error Theorem 27 promises at ``t``: ``alpha_i + gamma/(1+gamma)``."""
        return self.spec.accuracy(t)

    def __repr__(self) -> str:
        return (
            f"BBScheduler({self.black_box.name}, epoch={self._round}, gamma={self.spec.gamma:.4g}, "
            f"{self._ledger!r})"
        )


class BBImprover(_Runner[BBImproverSpec]):
    """Algorithm 5: rerun a ``(p, p', p'', g)``-black box at every observed ``t >= n``.

    Args:
        spec: the schedule (build it with :meth:`BBImproverSpec.for_black_box`).
        black_box: the static black box; its ``p``, ``p'``, ``p''`` and ``g`` must equal
            the spec's.
        noise: the secret key all noise is derived from.
        coordinates: the release's coordinates; a run draws at
            ``(*coordinates, "bbimprover", black_box.name, t, ...)``.

    Raises:
        InvalidParameterError: bad coordinates, a black box that does not match the spec,
            or one that refuses the first run's parameters up front.

    """

    _kind: ClassVar[str] = "bbimprover"

    def _bound(self) -> dict[str, float]:
        spec = self.spec
        return {
            "p": spec.p, "p_prime": spec.p_prime, "p_double_prime": spec.p_double_prime,
            "g": spec.g,
        }

    def _first_run(self) -> tuple[int, float, float, float]:
        spec = self.spec
        return spec.n, spec.run_epsilon(spec.n), spec.accuracy(spec.n), spec.run_beta(spec.n)

    def observe(self, counts: npt.NDArray[np.int64], t: int) -> Synopsis | None:
        """Take the database at its new size ``t``; rerun the black box if ``t >= n`` is new.

        Returns:
            The new synopsis, or ``None`` if ``t < n`` or ``t`` was already run.

        Raises:
            InvalidParameterError: ``t`` is not an integer, or decreased; bad counts.
            BudgetExhaustedError: the run does not fit in the ledger (nothing changes).

        """
        t = self._advance(t)
        if t < self.spec.n or t == self._run_t:
            self._last_t = t
            return None
        return self._run(
            counts, t, t, self.spec.run_charge(t), self.spec.accuracy(t), self.spec.run_beta(t)
        )

    def answer(self, weights: npt.NDArray[Any], t: int) -> float:
        """Answer the linear query ``weights`` at ``t`` from the synopsis computed at ``t``.

        Raises:
            InvalidParameterError: no synopsis for ``t`` (call :meth:`observe` first); bad
                weights.

        """
        t = _check_t(t)
        if self._synopsis is None or t != self._run_t:
            raise InvalidParameterError(
                f"no synopsis for t = {t} (the last run was at t = {self._run_t}): "
                "call observe(counts, t) first"
            )
        return self._synopsis.answer(weights)

    def accuracy(self, t: int) -> float:
        """Return ``alpha_t``, the error the black box's run at ``t`` promises (Theorem 29)."""
        return self.spec.accuracy(t)

    def __repr__(self) -> str:
        return f"BBImprover({self.black_box.name}, t={self._run_t}, {self._ledger!r})"
