"""Privacy ledgers: the one place that decides whether a release may go out.

A mechanism describes its cost as data (a frozen :class:`PrivacyCharge`,
after Google dp_accounting's ``DpEvent``); the ledger first checks the whole
charge against the budget and only then commits it (check-then-commit), so a
refused charge leaves no trace. Sums are kept as exact fractions (see :func:`exact`)
so the ledger never drifts and its state is a small
serialisable dict that lives in the operator's snapshot.

Two accountings:

* ``pure``: basic composition of pure epsilon-DP (sum of epsilons), plus an
  additive delta where a mechanism needs one.
* ``zcdp``: rho-zero-concentrated DP (Bun & Steinke 2016) composes by adding
  rho; a pure epsilon-DP charge counts as rho = epsilon^2 / 2 (BS16,
  Proposition 1.4). For reporting, rho-zCDP gives (rho + 2 sqrt(rho ln(1/delta)),
  delta)-DP (BS16, Proposition 1.3).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final, Literal

from dpstream.core._checks import fraction_text
from dpstream.errors import BudgetExhaustedError, InvalidParameterError

__all__ = ["Accounting", "PrivacyCharge", "PrivacyLedger", "approx_dp", "exact",
           "zcdp_to_approx_dp"]

Accounting = Literal["pure", "zcdp"]
_ACCOUNTINGS: Final = ("pure", "zcdp")


@functools.lru_cache(maxsize=1024)
def exact(value: float | int | Fraction) -> Fraction:
    """Return the exact rational a privacy parameter stands for: its shortest decimal form.

    ``0.1`` means 1/10, not the binary float just above it. Mechanisms compute their
    noise scales from this same value, so what the ledger charges is exactly what the
    noise pays for (ten charges of 0.1 fill a budget of 1.0 exactly).
    """
    if isinstance(value, Fraction):
        return value
    if isinstance(value, int):
        return Fraction(value)
    return Fraction(repr(float(value)))


def _check_nonnegative(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise InvalidParameterError(f"{name} must be finite and >= 0, got {value!r}")


@dataclass(frozen=True)
class PrivacyCharge:
    """The cost of one mechanism (or one release), as data.

    Attributes:
        epsilon: pure-DP epsilon (0 if none).
        rho: zCDP rho (0 if none).
        delta: additive delta (0 if none).
        label: what is being paid for, for status records and metrics.
    """

    epsilon: float = 0.0
    rho: float = 0.0
    delta: float = 0.0
    label: str = ""

    def __post_init__(self) -> None:
        _check_nonnegative("epsilon", self.epsilon)
        _check_nonnegative("rho", self.rho)
        _check_nonnegative("delta", self.delta)
        if self.delta >= 1:
            raise InvalidParameterError(f"delta must be < 1, got {self.delta!r}")


def zcdp_to_approx_dp(rho: float, delta: float) -> float:
    """Return epsilon such that rho-zCDP implies (epsilon, delta)-DP (BS16, Prop. 1.3)."""
    if rho == 0:
        return 0.0
    if not 0 < delta < 1:
        raise InvalidParameterError(f"delta must be in (0, 1), got {delta!r}")
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def approx_dp(rho: float, conversion_delta: float, extra_delta: float = 0.0
              ) -> tuple[float, float]:
    """The (epsilon, delta) a release reports for a rho-zCDP spend (BS16, Prop. 1.3).

    ``conversion_delta`` is the delta the conversion is made at (``privacy.delta``);
    ``extra_delta`` is the additive delta spent besides (the open universe's admission delta
    and any delta the ledger committed). Releases and ``check-config`` both call this, so the
    pair ``check-config`` prints is the pair every release carries.
    """
    return zcdp_to_approx_dp(rho, conversion_delta), conversion_delta + extra_delta


class PrivacyLedger:
    """A budget and what has been spent of it, with check-then-commit charging.

    Args:
        accounting: ``"pure"`` or ``"zcdp"``.
        budget: the total epsilon (pure) or rho (zcdp) this ledger may spend.
        delta_budget: the total additive delta it may spend.
    """

    __slots__ = ("accounting", "_budget", "_delta_budget", "_spent", "_spent_delta", "releases")

    def __init__(self, accounting: Accounting, budget: float, delta_budget: float = 0.0) -> None:
        if accounting not in _ACCOUNTINGS:
            raise InvalidParameterError(
                f"accounting must be one of {_ACCOUNTINGS}, got {accounting!r}"
            )
        if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
            raise InvalidParameterError(f"budget must be finite and > 0, got {budget!r}")
        _check_nonnegative("delta_budget", delta_budget)
        self.accounting: Accounting = accounting
        self._budget = exact(budget)
        self._delta_budget = exact(delta_budget)
        self._spent = Fraction(0)
        self._spent_delta = Fraction(0)
        self.releases = 0

    # -- the privacy map (deterministic, exact) --
    def cost_of(self, charge: PrivacyCharge) -> Fraction:
        """Return what ``charge`` costs in this ledger's unit (epsilon or rho), exactly."""
        return _cost(self.accounting, charge.epsilon, charge.rho)

    def can_afford(self, charge: PrivacyCharge) -> bool:
        """Return whether ``charge`` fits in what remains (nothing is committed)."""
        return (
            self._spent + self.cost_of(charge) <= self._budget
            and self._spent_delta + exact(charge.delta) <= self._delta_budget
        )

    def charge(self, charge: PrivacyCharge) -> None:
        """Commit ``charge`` if it fits; otherwise raise and change nothing.

        Raises:
            BudgetExhaustedError: the charge would exceed the budget.
        """
        if not self.can_afford(charge):
            raise BudgetExhaustedError(
                f"refused {charge.label or 'charge'}: it costs {float(self.cost_of(charge)):.6g} "
                f"(delta {charge.delta:.3g}) of {self.unit}, but only {self.remaining:.6g} "
                f"(delta {float(self._delta_budget - self._spent_delta):.3g}) "
                f"of {float(self._budget):.6g} remains"
            )
        self._spent += self.cost_of(charge)
        self._spent_delta += exact(charge.delta)

    def rebudget(self, configured: PrivacyLedger) -> None:
        """Adopt the budget of ``configured`` (a configuration change); spending is kept."""
        if configured.accounting != self.accounting:
            raise InvalidParameterError(
                f"cannot change accounting from {self.accounting!r} to {configured.accounting!r} "
                "for a ledger that has already spent"
            )
        self._budget = configured._budget
        self._delta_budget = configured._delta_budget

    def record_release(self) -> None:
        """Count one release paid for by an earlier charge (continual mechanisms)."""
        self.releases += 1

    # -- reporting --
    @property
    def unit(self) -> str:
        """``"epsilon"`` or ``"rho"``."""
        return "epsilon" if self.accounting == "pure" else "rho"

    @property
    def budget(self) -> float:
        """The budget, in :attr:`unit`."""
        return float(self._budget)

    @property
    def spent(self) -> float:
        """What has been spent, in :attr:`unit`."""
        return float(self._spent)

    @property
    def spent_delta(self) -> float:
        """The additive delta spent."""
        return float(self._spent_delta)

    @property
    def remaining(self) -> float:
        """What remains, in :attr:`unit`."""
        return float(self._budget - self._spent)

    def epsilon_spent(self, delta: float) -> float:
        """Return the epsilon spent: exact for ``pure``, converted at ``delta`` for ``zcdp``."""
        if self.accounting == "pure":
            return self.spent
        return zcdp_to_approx_dp(self.spent, delta)

    # -- serialisation (kept inside the operator's snapshot) --
    def to_state(self) -> dict[str, Any]:
        """Return a JSON- and pickle-safe dict of the ledger."""
        return {
            "accounting": self.accounting,
            "budget": fraction_text(self._budget),
            "delta_budget": fraction_text(self._delta_budget),
            "spent": fraction_text(self._spent),
            "spent_delta": fraction_text(self._spent_delta),
            "releases": self.releases,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PrivacyLedger:
        """Rebuild a ledger from :meth:`to_state`."""
        ledger = cls(state["accounting"], float(Fraction(state["budget"])))
        ledger._budget = Fraction(state["budget"])
        ledger._delta_budget = Fraction(state["delta_budget"])
        ledger._spent = Fraction(state["spent"])
        ledger._spent_delta = Fraction(state["spent_delta"])
        ledger.releases = int(state["releases"])
        return ledger

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PrivacyLedger) and self.to_state() == other.to_state()

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger({self.accounting}, spent={self.spent:.6g}/{self.budget:.6g} "
            f"{self.unit}, delta={self.spent_delta:.3g})"
        )


@functools.lru_cache(maxsize=1024)
def _cost(accounting: Accounting, epsilon: float, rho: float) -> Fraction:
    if accounting == "pure":
        if rho:
            raise InvalidParameterError(
                "a pure-DP ledger cannot pay a zCDP charge (rho > 0); use accounting 'zcdp'"
            )
        return exact(epsilon)
    return exact(rho) + exact(epsilon) ** 2 / 2


