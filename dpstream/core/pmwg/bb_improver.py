"""BBImprover (Algorithm 5): rerun a static black box at every observed database size.

**Stated as OpenDP states a measurement**

* input domain: a growing database (count histograms, public size ``t >= n``) and a stream of
  linear queries; input metric: add or remove one event (``d_in = 1``).
* function: Algorithm 5 of paper 003: at every observed ``t >= n``, one run of the static
  black box at ``epsilon_t``; queries are answered from the latest synopsis.
* output measure: rho-zCDP, reported as ``(epsilon, delta)``-DP (BS16, Proposition 1.3);
  privacy map: ``1 ↦ sum_t epsilon_t^2 / 2 <= epsilon^2 / (18 log(1/delta))`` over the
  ``t`` run (Theorem 29, D.2). The ledger (``zcdp``, that budget) charges
  ``run_charge(t) = PrivacyCharge(epsilon=epsilon_t)``, i.e. ``epsilon_t^2 / 2``, per run.

Both schedulers come from Cummings, Krehbiel, Lai, Tantipongpipat 2018, "Differential Privacy
for Growing Databases", Section 4 and appendix D. The database grows by one row per unit of its
public size ``t`` (``t = n, n + 1, ...``); a stream of linear queries must be answered at every
``t`` using a static ``(p, g)``-black box ``M`` (Definition 4;
:mod:`dpstream.core.pmwg.blackboxes`).

**BBImprover** (Algorithm 5, Theorem 29) reruns ``M`` at every ``t >= n``
with ``epsilon_t = sqrt(c) / (3 sqrt(log(1/delta))) epsilon / t^(1/2 + c)``,
``beta_t = beta / (2 t^2)`` and
``alpha_t = g (1 / (epsilon_t t))^p log^p''(t) log^p'(1/beta_t)``.
*Privacy* (D.2): ``sum_{t >= n} epsilon_t^2 <= epsilon^2 / (9 log(1/delta))``
(this needs ``n >= 2c``, checked), which gives the privacy map above.
BBImprover requires ``delta > 0``: Theorem 29 is ``(epsilon, delta)``-DP
only, and the paper gives no pure version. In a flow, ``t`` grows in jumps,
so the box runs at each *observed* ``t``. The sum over the ``t`` actually run
is a sub-sum of a series of positive terms, so skipping some ``t`` only
lowers the privacy cost. Each run keeps its own ``epsilon_t``: nothing
skipped is "caught up".

**Readings of the paper** for Algorithm 5 (numbered as in the whole section, see also
:mod:`dpstream.core.pmwg.bb_scheduler` and :mod:`dpstream.core.pmwg.runner`):

4. *BBImprover's alpha_t.* Algorithm 5 prints
   ``g (1/(epsilon_i t))^p log^p''(n) log^p'(1/beta)``. Theorem 29's proof
   uses ``g (1/(epsilon_t t))^p log^p''(t) log^p'(1/beta_t)``: the black
   box's guarantee at size ``t`` and confidence ``beta_t``. We use the
   proof's form.
5. *delta = 0 for BBImprover* is refused (see above).

**Exact, replay-safe noise and state** are the runner's (:mod:`dpstream.core.pmwg.runner`):
a run draws at ``(*coordinates, "bbimprover", black_box.name, t, ...)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from dpstream.core._checks import integer_at_least, positive_finite
from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger, zcdp_to_approx_dp
from dpstream.core.pmwg.blackboxes import BlackBox, Synopsis
from dpstream.core.pmwg.runner import _check_nonnegative, _check_probability, _check_t, _Runner
from dpstream.errors import InvalidParameterError

__all__ = ["BBImprover", "BBImproverSpec"]


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
