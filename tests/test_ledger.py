"""The privacy ledger: exact composition, check-then-commit, serialisation."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger, zcdp_to_approx_dp
from dpstream.errors import BudgetExhaustedError, InvalidParameterError


def test_pure_composition_is_exact_and_refuses_overspend():
    ledger = PrivacyLedger("pure", 1.0)
    for _ in range(10):
        ledger.charge(PrivacyCharge(epsilon=0.1))
    # in floating point ten 0.1s make 0.9999999999999999; the ledger's sum is exactly 1
    assert ledger.spent == 1.0 and ledger.remaining == 0.0
    with pytest.raises(BudgetExhaustedError, match="refused"):
        ledger.charge(PrivacyCharge(epsilon=0.1, label="one more"))
    assert ledger.spent <= 1.0  # the refused charge left no trace


def test_refused_charge_changes_nothing():
    ledger = PrivacyLedger("pure", 1.0, delta_budget=1e-6)
    ledger.charge(PrivacyCharge(epsilon=0.5))
    before = ledger.to_state()
    with pytest.raises(BudgetExhaustedError):
        ledger.charge(PrivacyCharge(epsilon=0.1, delta=1e-5))  # epsilon fits, delta does not
    assert ledger.to_state() == before


def test_zcdp_converts_pure_charges_and_reports_epsilon():
    ledger = PrivacyLedger("zcdp", 0.5)
    ledger.charge(PrivacyCharge(epsilon=0.2))  # 0.02 rho (BS16 Prop. 1.4)
    ledger.charge(PrivacyCharge(rho=0.3))
    assert ledger.spent == 0.32
    assert ledger.epsilon_spent(1e-6) == pytest.approx(0.32 + 2 * math.sqrt(0.32 * math.log(1e6)))
    assert zcdp_to_approx_dp(0.5, 1e-5) == pytest.approx(0.5 + 2 * math.sqrt(0.5 * math.log(1e5)))


def test_pure_ledger_rejects_zcdp_charges_and_bad_parameters():
    with pytest.raises(InvalidParameterError, match="zcdp"):
        PrivacyLedger("pure", 1).charge(PrivacyCharge(rho=0.1))
    with pytest.raises(InvalidParameterError, match="budget must be finite and > 0, got -1"):
        PrivacyLedger("pure", -1)
    with pytest.raises(InvalidParameterError, match="epsilon must be finite"):
        PrivacyCharge(epsilon=float("nan"))
    with pytest.raises(InvalidParameterError, match="accounting"):
        PrivacyLedger("renyi", 1)  # type: ignore[arg-type]


@given(st.lists(st.floats(min_value=0, max_value=0.3, allow_nan=False), max_size=30),
       st.sampled_from(["pure", "zcdp"]))
def test_never_exceeds_budget_and_round_trips(charges, accounting):
    ledger = PrivacyLedger(accounting, 1.0)
    for value in charges:
        charge = PrivacyCharge(epsilon=value) if accounting == "pure" else PrivacyCharge(rho=value)
        if ledger.can_afford(charge):
            ledger.charge(charge)
        else:
            with pytest.raises(BudgetExhaustedError):
                ledger.charge(charge)
        assert ledger.spent <= ledger.budget
        assert PrivacyLedger.from_state(ledger.to_state()) == ledger
