"""BBScheduler (Algorithm 4): rerun a static black box at geometrically spaced epochs.

**Stated as OpenDP states a measurement**

* input domain: a growing database (count histograms, public size ``t >= n``) and a stream of
  linear queries; input metric: add or remove one event (``d_in = 1``).
* function: Algorithm 4 of paper 003: at each epoch start ``ceil((1 + gamma)^i n)`` reached,
  one run of the static black box at ``epsilon_i``; queries are answered from the latest
  synopsis.
* output measure: pure epsilon-DP (``delta = 0``) or rho-zCDP reported as
  ``(epsilon, delta)``-DP (``delta > 0``); privacy map: ``1 ↦ sum_i epsilon_i <= epsilon``
  over the epochs run (basic composition, Theorem 27) resp.
  ``1 ↦ sum_i epsilon_i^2 / 2 <= rho = epsilon^2 / (9 log(1/delta))`` (BS16, Proposition
  1.4, and Theorem 27's proof). The ledger charges ``epoch_charge(i) =
  PrivacyCharge(epsilon=epsilon_i)`` per epoch run, ``epsilon_i`` rounded down for ``delta = 0``.

Both schedulers come from Cummings, Krehbiel, Lai, Tantipongpipat 2018, "Differential Privacy
for Growing Databases", Section 4 and appendix D. The database grows by one row per unit of its
public size ``t`` (``t = n, n + 1, ...``); a stream of linear queries must be answered at every
``t`` using a static ``(p, g)``-black box ``M`` (Definition 4;
:mod:`dpstream.core.pmwg.blackboxes`).

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

**Readings of the paper** for Algorithm 4 (where the extracted text is ambiguous or
inconsistent; numbered as in the whole section, see also :mod:`dpstream.core.pmwg.bb_improver`
and :mod:`dpstream.core.pmwg.runner`):

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

**Exact, replay-safe noise and state** are the runner's (:mod:`dpstream.core.pmwg.runner`):
a run draws at ``(*coordinates, "bbscheduler", black_box.name, epoch, ...)``; the pure
ledger's charges ``epsilon_i`` are exact rationals rounded *down* to a float, so no partial
sum ever exceeds ``epsilon``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from dpstream.core._checks import integer_at_least, positive_finite
from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger, exact, zcdp_to_approx_dp
from dpstream.core.pmwg.blackboxes import BlackBox, Synopsis
from dpstream.core.pmwg.runner import _check_probability, _check_t, _Runner
from dpstream.errors import InvalidParameterError

__all__ = ["BBScheduler", "BBSchedulerSpec"]


def _float_at_most(value: Fraction) -> float:
    """Return the largest float ``f <= value`` (as float) whose decimal ``exact(f) <= value``."""
    f = float(value)
    while exact(f) > value:
        f = math.nextafter(f, 0.0)
    return f


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
