"""The key table's ledgers: one real ledger per stage, the set of charges its keys paid.

Every mechanism a key runs is paid for on its
:class:`~dpstream.core.accounting.ledger.PrivacyLedger` before it produces anything (the
threshold monitor, AboveThreshold of Dwork & Roth 2014, Algorithm 1; the initial count; the
continual counter). A key's spend is a function of
which charges it paid, so every key that paid the same ones -- a *stage*, a bit set of
:data:`MONITOR_PAID`, :data:`INITIAL_PAID` and :data:`COUNTER_PAID` -- has the same ledger:
:class:`StageLedgers` keeps one per stage under today's budget, checks a charge for all the
keys of a stage at once (check-then-commit: :meth:`StageLedgers.refusal` tries it on a copy),
and gives the spend, budget and delta every release and status of the stage carries. By basic
composition (pure) or zCDP addition the stage's spend is the sum of its charges, which is
what a per-key ledger would hold after paying them one by one.

No noise is drawn; the state is a cache (recomputed from the spec on restore).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Final

import numpy as np
import numpy.typing as npt

from dpstream.core._checks import fraction_text
from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger, exact
from dpstream.core.counting.outputs import BudgetExhausted, ReleaseColumns
from dpstream.core.counting.statistics_spec import StatisticsSpec
from dpstream.errors import BudgetExhaustedError

__all__ = ["COUNTER_PAID", "INITIAL_PAID", "MONITOR_PAID", "PAID", "StageLedgers"]

FloatArray = npt.NDArray[np.float64]

MONITOR_PAID: Final = 1
INITIAL_PAID: Final = 2
COUNTER_PAID: Final = 4
PAID: Final = MONITOR_PAID | INITIAL_PAID | COUNTER_PAID
"""Every charge bit (a stage is a subset of them)."""


class StageLedgers:
    """The ledgers of a key table's stages, under ``spec``'s budget (see the module doc)."""

    def __init__(self, spec: StatisticsSpec) -> None:
        self.spec = spec
        self._ledgers: dict[int, PrivacyLedger] = {}
        self._refusals: dict[tuple[int, int], str | None] = {}

    def charges(self) -> list[tuple[int, PrivacyCharge]]:
        """Every charge of the spec with its bit, in the order a key pays them."""
        charges = []
        if self.spec.monitor is not None:
            charges.append((MONITOR_PAID, self.spec.monitor.charge))
        if self.spec.initial is not None:
            charges.append((INITIAL_PAID, self.spec.initial))
        charges.append((COUNTER_PAID, self.spec.counter.charge))
        return charges

    def ledger(self, code: int) -> PrivacyLedger:
        """The ledger of every key that paid the charges of ``code``, under today's budget."""
        ledger = self._ledgers.get(code)
        if ledger is None:
            spec = self.spec
            fresh = PrivacyLedger(spec.accounting, spec.budget, spec.delta_budget)
            paid = [charge for bit, charge in self.charges() if code & bit]
            state = fresh.to_state()
            state["spent"] = fraction_text(sum((fresh.cost_of(c) for c in paid), Fraction(0)))
            state["spent_delta"] = fraction_text(sum((exact(c.delta) for c in paid),
                                                     Fraction(0)))
            ledger = self._ledgers[code] = PrivacyLedger.from_state(state)
        return ledger

    def refusal(self, code: int, bit: int, charge: PrivacyCharge) -> str | None:
        """None if the keys at stage ``code`` can pay ``charge``, else the ledger's refusal."""
        if (code, bit) not in self._refusals:
            trial = PrivacyLedger.from_state(self.ledger(code).to_state())
            try:
                trial.charge(charge)
                reason: str | None = None
            except BudgetExhaustedError as exc:
                reason = str(exc)
            self._refusals[code, bit] = reason
        return self._refusals[code, bit]

    def statuses(self, names: Sequence[str], step: int, label: str, reason: str,
                 code: int) -> list[BudgetExhausted]:
        """The statuses of ``names`` refused ``label`` at stage ``code``."""
        ledger = self.ledger(code)
        return [BudgetExhausted(k, step, label, reason, ledger.spent, ledger.budget, ledger.unit)
                for k in names]

    def columns(self, step: int, keys: Sequence[str], values: FloatArray, variance: float,
                code: int, periodic: bool) -> ReleaseColumns:
        """The releases of ``keys`` at stage ``code``: their ledger's spend and delta."""
        ledger = self.ledger(code)
        return ReleaseColumns(step, keys, values, math.sqrt(variance), self.spec.counter.mechanism,
                              ledger.spent, ledger.budget, ledger.unit,
                              ledger.spent_delta + self.spec.admission_delta, periodic)
