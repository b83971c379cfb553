"""The PMWG kind at the user level: one person's ``max_rows`` rows are the unit.

The sensitivities the docstrings derive (``dpstream/core/pmwg/worst_case.py``,
``dpstream/kinds/pmwg/config.py``) are checked as exact fractions against what the code
computes and charges (the style of ``test_privacy_maps.py``); the scaled noise is checked
statistically (derived tolerances with a power check); the decoder's person field and dead
letters, the per-person report, the records' optional fields and the digests are checked;
and a user-level flow answers questions in memory.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from support.messages import raw

from dpstream import schemas
from dpstream.core.accounting.ledger import PrivacyLedger, exact
from dpstream.core.contribution.people import PEOPLE_BOUND, collision_delta
from dpstream.core.counting.admission_bounds import difference_tail
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.pmwg.blackboxes import NoisyHistogram
from dpstream.core.pmwg.guarantee import accuracy_guarantee
from dpstream.core.pmwg.mechanism import Pmwg
from dpstream.core.pmwg.sparse_vector import GRID_BITS, NumericSparse, dlap_variance
from dpstream.core.pmwg.spec import PmwgSpec
from dpstream.core.pmwg.worst_case import SIGMA, SUM_SLACK, float_at_least
from dpstream.errors import InvalidParameterError
from dpstream.kinds.pmwg.config import parse_config
from dpstream.kinds.pmwg.events import PmwgClock
from dpstream.kinds.pmwg.records import AnswerEncoder
from dpstream.kinds.pmwg.shard import AnswerRecord
from dpstream.messages import RawBatch

KEY = NoiseKey.for_tests(24)
COORDS = ("instance", "flow", "h")
ORIGIN = 1_790_000_000  # 2026-09-21T14:13:20Z
UNIVERSE = [{"name": "country", "values": ["de", "fr", "uk"]},
            {"name": "age", "edges": [0, 18, 40, 120]}]


def spec(m: int, accounting: str = "pure", mode: str = "solved", **more: Any) -> PmwgSpec:
    return PmwgSpec(epsilon=1.0, delta=1e-6 if accounting == "zcdp" else 0.0, alpha=0.05,
                    beta=0.05, n=10**5, universe_size=2**12, accounting=accounting,  # type: ignore[arg-type]
                    mode=mode, sensitivity=m, **more)  # type: ignore[arg-type]


def spent(ledger: PrivacyLedger) -> Fraction:
    return Fraction(ledger.to_state()["spent"])


# --- the privacy maps, exactly ----------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("t", [10**5, 10**5 + 7, 3 * 10**6])
def test_one_persons_sensitivity_is_m_over_t_in_every_nsg_bound(m: int, t: int) -> None:
    # A person adds at most m rows; f(D_t) = sum w_i count_i / t moves by Delta_t = m / t
    # (weights in [0, 1], t public). The round's bound S_t = xi_t Delta_t (1 + 1e-12) + g_t
    # with the grid g_t = 2^(floor(log2(xi_t Delta_t)) - 32), exactly.
    s = spec(m)
    xi_delta = Fraction(s.xi(t)) * m / t
    exponent = s.grid_exponent(t)
    g = Fraction(2) ** exponent
    assert xi_delta / 2**(GRID_BITS + 1) < g <= xi_delta / 2**GRID_BITS
    assert s.sensitivity_bound(t) == xi_delta * (1 + Fraction(1, 10**12)) + g


@pytest.mark.parametrize("accounting", ["pure", "zcdp"])
@pytest.mark.parametrize("mode", ["paper", "solved"])
@pytest.mark.parametrize("m", [2, 5])
def test_the_worst_case_is_charged_for_one_person_and_the_noise_grows_by_m(
        accounting: str, mode: str, m: int) -> None:
    one, person = spec(1, accounting, mode), spec(m, accounting, mode)
    # xi is m times smaller: the noise (scales 4/xi, 8/xi in fraction units) m times larger
    assert person.xi_coefficient * m == pytest.approx(one.xi_coefficient, rel=1e-12)
    assert person.xi_coefficient * m <= one.xi_coefficient * (1 + 1e-15)
    pm = Pmwg(person, KEY, COORDS)
    charged = spent(pm.ledger)
    assert charged == exact(person.worst_case_cost())
    # (B.1) resp. tau / 2 evaluated at xi_t Delta_t = (c m) t^(p-1), times SIGMA (1 + 1e-9)
    bound = person.paper_sum() if accounting == "pure" else person.paper_sum() / 2
    factor = SIGMA if accounting == "pure" else SIGMA * SIGMA
    assert float(charged) == pytest.approx(bound * factor * (1 + SUM_SLACK), rel=1e-12)
    c_m = Fraction(person.xi_coefficient) * m
    sum_factor = person._sum_factor()
    exact_bound = (c_m * Fraction(sum_factor) if accounting == "pure"
                   else c_m * c_m * Fraction(sum_factor) / 2)
    assert charged >= exact_bound  # the charge covers the person's m rows
    assert charged <= exact(person.budget)
    # the charge is the configured one: the same as one event's at the event level
    if mode == "solved":
        assert float(charged) == pytest.approx(one.worst_case_cost(), rel=1e-12)


@pytest.mark.parametrize("accounting", ["pure", "zcdp"])
@pytest.mark.parametrize("m", [1, 4, 100])
def test_a_practical_round_charges_its_person_level_bound(accounting: str, m: int) -> None:
    s = spec(m, accounting, "practical", hard_query_cap=20)
    n = int(s.n)
    bound = s.sensitivity_bound(n)
    assert bound == Fraction(s.xi(n)) * m / n * (1 + Fraction(1, 10**12)) \
        + Fraction(2) ** s.grid_exponent(n)
    charge = s.round_charge(n)
    expected = bound * Fraction(9, 8) if accounting == "pure" \
        else (bound * bound + (bound / 8) ** 2) / 2
    value = charge.epsilon if accounting == "pure" else charge.rho
    assert value == float_at_least(expected)
    # twenty rounds started at n fit the budget: the cap is the configured one, per person
    assert 20 * exact(value) <= exact(s.budget)
    assert 21 * exact(value) > exact(s.budget) * Fraction(20, 21)


def test_the_sensitivity_is_validated_and_bound_into_the_digest() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidParameterError, match="sensitivity"):
            spec(bad)  # type: ignore[arg-type]
    digests = {spec(m).digest for m in (1, 2, 3)}
    assert len(digests) == 3  # a resumed state with other caps is refused
    state = Pmwg(spec(2), KEY, COORDS).to_state()
    with pytest.raises(InvalidParameterError, match="other parameters"):
        Pmwg(spec(3), KEY, COORDS, state)
    # m = 1 is the event level, digest included (the golden records pin the rest)
    assert spec(1).digest == PmwgSpec(
        epsilon=1.0, delta=0.0, alpha=0.05, beta=0.05, n=10**5, universe_size=2**12,
        mode="solved").digest


@pytest.mark.parametrize("epsilon", [0.25, 1.0])
@pytest.mark.parametrize("m", [1, 7])
def test_the_noisy_histogram_pays_for_l1_sensitivity_m(epsilon: float, m: int) -> None:
    # m rows move the count vector by at most m in L1; a discrete Laplace pmf ratio under
    # integer shifts d_i is exp(sum |d_i| / scale) <= exp(m / scale) = exp(epsilon)
    box = NoisyHistogram(16, m)
    scale = NoisyHistogram.noise_scale(epsilon, m)
    assert scale == m / exact(epsilon)
    assert Fraction(m) / scale == exact(epsilon)
    assert box.g == pytest.approx(m * NoisyHistogram(16).g, rel=1e-15)
    assert box.error_bound(1000, epsilon, 0.1, 0.05) == pytest.approx(
        m * NoisyHistogram(16).error_bound(1000, epsilon, 0.1, 0.05), rel=1e-15)
    assert (box.name == "noisy-histogram") == (m == 1)  # other noise coordinates per cap


def test_the_accuracy_report_is_the_theorem_at_epsilon_over_m() -> None:
    one = accuracy_guarantee(spec(1, mode="paper"))
    four = accuracy_guarantee(spec(4, mode="paper"))
    at_quarter = accuracy_guarantee(PmwgSpec(
        epsilon=0.25, delta=0.0, alpha=0.05, beta=0.05, n=10**5, universe_size=2**12,
        mode="paper"))
    assert four.alpha_min == pytest.approx(at_quarter.alpha_min, rel=1e-12)
    for (t4, log4), (tq, logq) in zip(four.query_budget, at_quarter.query_budget, strict=True):
        assert t4 == tq and log4 == pytest.approx(logq, rel=1e-12)
    assert four.xi_n == pytest.approx(at_quarter.xi_n, rel=1e-12)
    assert four.answer_std_at_n == pytest.approx(4 * one.answer_std_at_n, rel=1e-9)
    assert four.alpha_min > one.alpha_min
    assert any("epsilon / 4" in note for note in four.notes)
    assert not any("user level" in note for note in one.notes)


# --- the scaled noise, statistically --------------------------------------------------------

@pytest.mark.statistical
def test_a_hard_answers_noise_has_the_derived_std_at_the_user_level() -> None:
    # The numeric answer of a round halted at t is (round(xi f'/g) + K_a) g / xi with
    # K_a ~ DLap(8/g): its noise std in fraction units is sqrt(Var DLap(8/g)) g / xi_t, which
    # at m = 4 is 4 times the event level's (xi is 4 times smaller, g follows xi m / t).
    m, t = 4, 10**5
    s = spec(m)
    xi = s.xi(t)
    exponent = s.grid_exponent(t)
    g = Fraction(2) ** exponent
    derived = math.sqrt(dlap_variance(Fraction(8) / g)) * float(g) / xi
    event_level = spec(1)
    unscaled = (math.sqrt(dlap_variance(Fraction(8) / Fraction(2) ** event_level.grid_exponent(t)))
                * 2.0**event_level.grid_exponent(t) / event_level.xi(t))
    assert derived == pytest.approx(m * unscaled, rel=1e-9)
    samples = 4000
    value = Fraction(xi) * Fraction(1, 3)  # xi f'(D_t), f' = 1/3
    noise = np.empty(samples)
    for i in range(samples):
        nsg = NumericSparse(KEY, ("user-level-answer", i))
        nsg.start_round(exponent)
        released = nsg.answer(value, exponent)
        noise[i] = float(released - value) / xi
    variance = float(np.mean(noise**2))  # the noise has mean 0 (rounding error <= g/2 ~ 0)
    # The sample second moment of a Laplace variable has sd sigma^2 sqrt((mu4 - sigma^4)/n)
    # = sigma^2 sqrt(5 / n) (kurtosis 6): Z = 5 gives a relative tolerance of 5 sqrt(5/4000)
    tolerance = 5 * math.sqrt(5 / samples)  # = 0.177
    assert abs(variance / derived**2 - 1) <= tolerance, (variance, derived**2)
    # power: noise not scaled (m = 1), or scaled by 2 or 3 only, lands far outside
    for wrong in (1, 2, 3):
        assert abs((wrong / m) ** 2 - 1) > 2 * tolerance


@pytest.mark.statistical
def test_a_query_halts_as_often_as_the_scaled_sparse_vector_says() -> None:
    # A query whose value is a fraction d below the threshold compares, in eta-units,
    # z = -xi_t d with K_nu - K_eta (DLap(4/g), DLap(2/g)): it halts with the exact
    # probability difference_tail(g, round(xi_t d / g)). At m = 4, xi_t is 4 times smaller,
    # so the same fraction is 4 times fewer noise scales away: it halts far more often.
    m, t = 4, 10**5
    person, one = spec(m), spec(1)
    exponent = person.grid_exponent(t)
    g = Fraction(2) ** exponent
    d = Fraction(6) / Fraction(person.xi(t))  # 6 eta-units at m = 4 ...
    value = -Fraction(person.xi(t)) * d
    expected = difference_tail(float(g), int(value / -g))
    unscaled = difference_tail(float(g), int(Fraction(one.xi(t)) * d / g))  # ... 24 at m = 1
    samples = 10_000
    halts = 0
    for i in range(samples):
        nsg = NumericSparse(KEY, ("user-level-halt", i))
        nsg.start_round(exponent)
        halts += nsg.compare(value, 1)
    rate = halts / samples
    # binomial sd sqrt(p (1 - p) / n) = 0.0035 at p = 0.140: Z = 5, a tolerance of 0.017
    tolerance = 5 * math.sqrt(expected * (1 - expected) / samples)
    assert abs(rate - expected) <= tolerance, (rate, expected, tolerance)
    # power: the event level's noise (no scaling by m) halts with probability 0.0017
    assert abs(unscaled - expected) > 3 * tolerance


# --- the configuration, the report and the records ------------------------------------------

def raw_config(contribution: dict[str, Any] | None = None, accounting: str = "pure",
               **histogram: Any) -> dict[str, Any]:
    h = {"name": "h", "universe": UNIVERSE, "epsilon": 0.9, "size_epsilon": 0.5,
         "size_rho": 0.01, "size_horizon": 64, "alpha": 0.1, "n": 500, "mode": "practical",
         "hard_queries": 4}
    h.update(histogram)
    if accounting == "pure":
        h.pop("size_rho")
    else:
        h.pop("size_epsilon")
    out: dict[str, Any] = {
        "flow": {"kind": "pmwg", "name": "p", "origin": "2026-09-21T14:13:20Z", "step": "1s",
                 "shards": 2},
        "privacy": {"accounting": accounting, "budget": 4.0 if accounting == "pure" else 1.0},
        "metrics": {"port": 0},
        "histograms": [h, {"name": "g", "mechanism": "histogram", "epsilon": 0.09,
                           "size_epsilon": 0.5, "size_rho": 0.01, "size_horizon": 64,
                           "n": 1000, "universe": UNIVERSE[:1]}],
    }
    out["histograms"][1].pop("size_rho" if accounting == "pure" else "size_epsilon")
    if accounting == "zcdp":  # Algorithm 4 under zCDP needs a larger start for g = 4 g_1
        out["histograms"][1]["n"] = 200_000
    if contribution is not None:
        out["contribution"] = contribution
    return out


USER = {"unit": "user", "user_field": "user", "max_rows": 4}


def test_each_histogram_is_scaled_by_max_rows_and_the_person_pays_the_sum() -> None:
    event, user = parse_config(raw_config()), parse_config(raw_config(USER))
    for e, u in zip(event.histograms, user.histograms, strict=True):
        assert u.rows == 4 and e.rows == 1
        assert getattr(u.size, "sensitivity", None) == 4
        assert u.size_cost == e.size_cost  # the charge is unchanged: it covers one person
        # the tree's node noise DLap(levels m / epsilon): m rows move one leaf-to-root path
        # of each tree by at most m per node, L1 levels m, so epsilon covers the person
        assert u.size.noise_scale(0) == 4 * e.size.noise_scale(0)  # type: ignore[union-attr]
        assert u.size.noise_scale(0) == Fraction(u.size.levels(0) * 4) / exact(  # type: ignore[union-attr]
            u.size.epsilon)  # type: ignore[union-attr]
        assert [c.epsilon for c in u.charges] == pytest.approx([c.epsilon for c in e.charges])
    assert user.histograms[0].pmwg.sensitivity == 4  # type: ignore[union-attr]
    assert user.histograms[1].box().sensitivity == 4
    # a person's rows are in both histograms: the per-person total is the sum of both
    total = sum(exact(c.epsilon) for h in user.histograms for c in h.charges)
    per_person = user.per_person()
    # the delta is the bounding's hash collision: 2^-64 at its public bound of 2^64 people
    assert exact(per_person["epsilon"]) == total
    assert per_person["delta"] == collision_delta(PEOPLE_BOUND) == pytest.approx(2.0**-64)
    assert event.per_person() == {"epsilon": per_person["epsilon"], "delta": 0.0}
    # every output's noise grows by the cap (the tree's discrete Laplace std is ~linear in
    # its scale: within 2 %; PMWG's answer exactly as xi is divided by 4)
    e_std, u_std = event.noise_std(), user.noise_std()
    assert set(u_std) == {"h.size", "h.answer", "g.size", "g.answer"}
    for name in ("h.size", "h.answer", "g.size"):
        assert u_std[name] == pytest.approx(4 * e_std[name], rel=0.02), name
    # the noisy histogram's scheduler re-plans its epochs for g = 4 g_1 (another gamma and
    # epsilon_0): its first release's cell noise is DLap(4 / epsilon_0) over n
    scheduler = user.histograms[1].scheduler
    assert scheduler is not None and scheduler.g == pytest.approx(
        4 * event.histograms[1].scheduler.g)  # type: ignore[union-attr]
    scale = Fraction(4) / exact(scheduler.epoch_epsilon(0))
    assert u_std["g.answer"] == pytest.approx(math.sqrt(dlap_variance(scale)) / 1000, rel=1e-12)
    assert u_std["g.answer"] > 2 * e_std["g.answer"]


def test_zcdp_reports_rho_and_its_epsilon_per_person() -> None:
    user = parse_config(raw_config(USER, "zcdp"))
    total = user.per_person()
    ledger = user.ledger()
    for h in user.histograms:
        for charge in h.charges:
            ledger.charge(charge)
    assert total["rho"] == float(ledger.spent)
    assert total["epsilon"] == float(ledger.epsilon_spent(user.delta))
    assert total["delta"] == user.delta + collision_delta(PEOPLE_BOUND)
    assert user.noise_std()["h.size"] > 0


def test_describe_states_the_unit_the_caps_the_period_and_the_noise() -> None:
    text = parse_config(raw_config({**USER, "period": "1d"})).describe()
    assert "privacy unit: one person (field 'user'), per period of 86400 steps" in text
    assert "max_rows = 4" in text
    assert "per-person budget 4 epsilon" in text
    assert "each noise is scaled by 4" in text
    assert "hash-collision delta" in text
    assert "noise std at the caps: h.size" in text
    assert "k^2" not in text  # pure: k times epsilon, as the shared line says
    zcdp_text = parse_config(raw_config({**USER, "period": "1d"}, "zcdp")).describe()
    assert "k^2 times the per-period rho" in zcdp_text
    event_text = parse_config(raw_config()).describe()
    assert "privacy unit: one event" in event_text and "person" not in event_text


def test_the_contribution_is_bound_into_the_digests() -> None:
    event = parse_config(raw_config())
    digests = {parse_config(raw_config(c)).mechanisms_digest for c in (
        USER, {**USER, "max_rows": 3}, {**USER, "period": "1h"}, {**USER, "user_field": "u"})}
    assert len(digests) == 4 and event.mechanisms_digest not in digests
    assert [h.digest for h in parse_config(raw_config()).histograms] == [
        h.digest for h in event.histograms]


def encoded_answer(contribution: dict[str, Any] | None, accounting: str = "pure"
                   ) -> dict[str, Any]:
    config = parse_config(raw_config(contribution, accounting))
    record = AnswerRecord("h", "pmwg", "q1", 3, 600, "easy", 0.25, None, None, 0.5, 1.4, 0)
    topic, key, value = AnswerEncoder(config, "p-1").encode(record)
    assert topic == "answers" and key == b"h"
    body = json.loads(value)
    assert body["schema"] == schemas.ANSWER_SCHEMA
    return dict(body["privacy"])


def test_answers_carry_the_person_terms_only_at_the_user_level() -> None:
    event = encoded_answer(None)
    assert event == {"unit": "event", "accounting": "pure", "spent": 0.5, "budget": 1.4}
    user = encoded_answer({**USER, "period": "2s"})
    assert user["unit"] == "user"
    config = parse_config(raw_config(USER))
    total = config.per_person()
    assert user["person"] == {"period": "2 steps", "caps": [["max_rows", 4]],
                              "epsilon": total["epsilon"], "delta": total["delta"]}
    zcdp = encoded_answer(USER, "zcdp")
    assert zcdp["person"]["period"] == "lifetime" and zcdp["person"]["rho"] > 0
    assert zcdp["person"]["delta"] == 1e-6 + collision_delta(PEOPLE_BOUND)


# --- the decoder --------------------------------------------------------------------------

def batch(values: list[bytes], partition: int = 0) -> RawBatch:
    return RawBatch.of([raw(partition, v, i, ORIGIN + 0.5) for i, v in enumerate(values)])


def event(user: Any = "alice", country: str = "de", **more: Any) -> bytes:
    body = {"country": country, "age": 30, "ts": ORIGIN + 0.5, **more}
    if user is not None:
        body["user"] = user
    return json.dumps(body).encode()


def test_an_event_without_a_person_is_a_dead_letter_naming_the_field_only() -> None:
    config = parse_config(raw_config(USER))
    clock = PmwgClock(config, {"events": 0, "queries": 2})
    dead: list[Any] = []
    values = [event("alice"), event(None), event(""), event(17), event(["alice"]),
              event("bob", "fr"), event("carol", "xx"), event("secret-id-42", age=500)]
    payloads, times, refs = clock.decode(0, batch(values), dead)
    assert [d.reason for d in dead] == ["field 'user' missing or not a non-empty string"] * 4 \
        + [d.reason for d in dead[4:]]
    assert len(dead) == 6 and [d.offset for d in dead] == [1, 2, 3, 4, 6, 7]
    assert not any("secret-id-42" in d.reason or "alice" in d.reason for d in dead)
    assert clock.decoded_people == ["alice", "bob"]
    assert list(refs) == [0, 5] and len(times) == 2
    # the payloads are the cells themselves (one per histogram): routable later, anywhere
    assert isinstance(payloads, np.ndarray) and payloads.shape == (2, 2)
    other = PmwgClock(config, {"events": 0, "queries": 2})
    assert other.route(payloads, 0) == clock.route(payloads, 0)


def test_the_event_level_decoder_is_unchanged_and_routes_the_same_counts() -> None:
    event_config, user_config = parse_config(raw_config()), parse_config(raw_config(USER))
    values = [event(f"u{i % 3}", ["de", "fr", "uk"][i % 3]) for i in range(12)]
    e_clock = PmwgClock(event_config, {"events": 0, "queries": 2})
    u_clock = PmwgClock(user_config, {"events": 0, "queries": 2})
    dead: list[Any] = []
    e_payloads, _, _ = e_clock.decode(0, batch(values), dead)
    u_payloads, _, _ = u_clock.decode(0, batch(values), dead)
    assert not dead
    assert e_payloads == list(range(12)) and e_clock.decoded_people == []
    assert e_clock.route(e_payloads, 5) == u_clock.route(u_payloads, 5)
    assert e_clock.route([], 5) == u_clock.route(u_payloads[:0], 5)


def test_questions_name_no_person() -> None:
    config = parse_config(raw_config(USER))
    clock = PmwgClock(config, {"events": 0, "queries": 2})
    clock.decode(0, batch([event("alice")]), [])
    question = json.dumps({"id": "q", "histogram": "h",
                           "query": {"schema": "dpstream.query/1", "kind": "count"}}).encode()
    payloads, _, _ = clock.decode(2, batch([question], 2), [])
    assert len(payloads) == 1 and clock.decoded_people == []


# --- a user-level PMWG flow in memory -----------------------------------------------------

FLOW_NOISE = NoiseKey.for_tests(2424)
FLOW_PARTITIONS = {"events": 2, "queries": 1}  # the questions are input partition 2
STEPS = 8
MAX_ROWS = 3
DE = {"kind": "count", "where": [{"attr": "country", "eq": "de"}]}


def flow_config(max_rows: int = MAX_ROWS, **histogram: Any) -> Any:
    from dpstream.platform import parse_config as parse_flow
    # a test's budgets: large enough that a few dozen people give accurate answers
    h = {"name": "h", "universe": UNIVERSE, "epsilon": 200.0, "size_epsilon": 60.0,
         "size_horizon": 16, "alpha": 0.1, "n": 40, "mode": "practical", "hard_queries": 4,
         **histogram}
    return parse_flow({
        "flow": {"kind": "pmwg", "name": "pu", "origin": "2026-09-21T14:13:20Z", "step": "1s",
                 "shards": 2, "end": "2026-09-21T14:13:28Z"},
        "privacy": {"accounting": "pure", "budget": 261.0},
        "contribution": {"unit": "user", "user_field": "user", "max_rows": max_rows},
        "metrics": {"port": 0},
        "histograms": [h],
    })


def flow_stream(people: int = 60, heavy: int = 40, seed: int = 7
                ) -> tuple[list[Any], dict[str, int], list[tuple[int, int]]]:
    """People with 1..12 events each (one with ``heavy``), a question every step.

    Returns the records, each person's events and, per step, the kept rows (each person's
    first ``MAX_ROWS``) and the kept 'de' rows up to that step.
    """
    import random
    rng = random.Random(seed)
    rows: list[tuple[float, str, str]] = []
    for p in range(people):
        count = heavy if p == 0 else rng.randint(1, 12)
        rows += [(ORIGIN + rng.random() * (STEPS - 0.1), f"person-{p}",
                  rng.choice(["de", "de", "fr", "uk"])) for _ in range(count)]
    rows.sort()
    items, offsets = [], [0, 0, 0]
    events: dict[str, int] = {}
    kept = [[0, 0] for _ in range(STEPS)]
    placed = []
    for ts, user, country in rows:
        part = rng.randrange(2)
        placed.append((int(ts - ORIGIN), part, offsets[part], user, country))
        items.append(raw(part, json.dumps({"country": country, "age": 33, "ts": ts,
                                           "user": user}).encode(), offsets[part], ts))
        offsets[part] += 1
    for step, _, _, user, country in sorted(placed):  # the bounder's order
        events[user] = events.get(user, 0) + 1
        if events[user] <= MAX_ROWS:
            for later in range(step, STEPS):
                kept[later][0] += 1
                kept[later][1] += country == "de"
    for step in range(STEPS):
        ts = ORIGIN + step + 0.95
        body = json.dumps({"id": f"q{step}", "histogram": "h",
                           "query": {"schema": "dpstream.query/1", **DE}}).encode()
        items.append(raw(2, body, offsets[2], ts, topic="queries"))
        offsets[2] += 1
    items.sort(key=lambda m: m[4])
    return items, events, [(rows, de) for rows, de in kept]


def run_flow(cfg: Any, items: list[Any], **kwargs: Any) -> list[Any]:
    from support.flows import run_in_memory
    return run_in_memory(cfg, items, FLOW_NOISE, instance="pu-1", partitions=FLOW_PARTITIONS,
                         **kwargs)


def flow_answers(sink: list[Any]) -> dict[str, dict[str, Any]]:
    return {json.loads(v)["id"]: json.loads(v) for role, _k, v in sink if role == "answers"}


@pytest.mark.flow
def test_a_user_level_flow_answers_every_question_on_the_bounded_database() -> None:
    cfg = flow_config()
    items, events, kept_by_step = flow_stream()
    out = flow_answers(run_flow(cfg, items))
    assert sorted(out) == [f"q{s}" for s in range(STEPS)]
    kept = sum(min(n, MAX_ROWS) for n in events.values())
    assert kept == kept_by_step[-1][0]
    total = sum(events.values())
    last = out[f"q{STEPS - 1}"]
    # The public size counts the kept rows: the tree's worst-step std at max_rows = 3 and
    # size_epsilon = 60 (noise_std) bounds its error; 6 std + 1 (the floor) is a false-alarm
    # rate below 1e-8 per check. Power: without bounding t would be near the total, which
    # lies far outside (the heavy person alone adds 37 rows beyond the cap).
    std = cfg.noise_std()["h.size"]
    tolerance = 6 * std + 1
    assert abs(last["t"] - kept) <= tolerance, (last["t"], kept, tolerance)
    assert total - kept > 3 * tolerance
    assert last["privacy"]["unit"] == "user"
    assert last["privacy"]["person"]["caps"] == [["max_rows", MAX_ROWS]]
    assert last["privacy"]["person"]["period"] == "lifetime"
    # The answers are about the bounded database. PMWG answers de / t (t public): a hard
    # answer is de / t + DLap(8/xi_t) (fraction units, xi_t = c t^p at max_rows = 3), an easy
    # one f(y) with |de/t - f(y)| < T + (nu - eta) (NSG noise of scales 4/xi_t and 2/xi_t);
    # ten noise scales bound each noise but with probability e^-10; and
    # |de/t - de/kept| <= |t - kept| / t.
    spec = cfg.histograms[0].pmwg
    assert spec is not None
    hard = 0
    for step, (rows, de) in enumerate(kept_by_step):
        answer = out[f"q{step}"]
        t = answer["t"]
        assert abs(t - rows) <= tolerance, (step, t, rows)
        if answer["kind"] not in ("easy", "hard"):
            assert answer["kind"] == "bottom"  # the hard-query budget ran out (practical)
            continue
        hard += answer["kind"] == "hard"
        xi = spec.xi(t)
        slack = 10 * (8 if answer["kind"] == "hard" else 6) / xi + abs(t - rows) / t
        bound = slack + (0 if answer["kind"] == "hard" else float(spec.threshold_value))
        assert abs(answer["value"] - de / rows) <= bound, (step, answer, de / rows, bound)
        if answer["kind"] == "hard":
            assert bound < 0.15  # a meaningful check: 'de' is about half of the rows
    assert hard >= 3
    for answer in out.values():
        assert answer["privacy"]["unit"] == "user" and "person" in answer["privacy"]


@pytest.mark.flow
def test_removing_a_heavy_person_moves_the_public_size_by_at_most_max_rows() -> None:
    # Coupled noise (the same key and instance): the size counter's estimate is linear in
    # its node counts, so removing one person moves each estimate by exactly the change of
    # the kept rows, at most max_rows; t = max(previous t, floor(estimate)) then moves by at
    # most max_rows + 1. Power: with the heavy person's 40 rows unbounded t would move by 40.
    cfg = flow_config()
    items, events, _ = flow_stream()
    heavy_user = b'"user": "person-0"'
    without = [m for m in items if heavy_user not in (m[1] or b"")]
    assert len(items) - len(without) == events["person-0"] == 40
    with_heavy, no_heavy = flow_answers(run_flow(cfg, items)), flow_answers(run_flow(cfg,
                                                                                     without))
    assert sorted(with_heavy) == sorted(no_heavy)
    moves = [with_heavy[q]["t"] - no_heavy[q]["t"] for q in with_heavy]
    assert all(0 <= d <= MAX_ROWS + 1 for d in moves), moves
    assert max(moves) >= 1  # the person is there: their kept rows are counted
    assert events["person-0"] > 3 * (MAX_ROWS + 1)


@pytest.mark.flow
def test_the_user_level_flow_is_the_same_with_two_workers_and_other_batches() -> None:
    cfg = flow_config()
    items, _, _ = flow_stream(people=30, seed=3)
    one = sorted(map(repr, run_flow(cfg, items)))
    assert one == sorted(map(repr, run_flow(cfg, items, workers=2, batch=7)))


@pytest.mark.flow
def test_user_level_dead_letters_name_the_field_and_never_the_id() -> None:
    cfg = flow_config()
    items, _, _ = flow_stream(people=10)
    t = ORIGIN + 2.5
    items += [raw(0, json.dumps({"country": "de", "age": 3, "ts": t}).encode(), 10_000, t),
              raw(1, json.dumps({"country": "de", "age": 3, "ts": t, "user": ""}).encode(),
                  10_000, t),
              raw(1, json.dumps({"country": "xx", "age": 3, "ts": t,
                                 "user": "secret-person-9"}).encode(), 10_001, t)]
    items.sort(key=lambda m: m[4])
    sink = run_flow(cfg, items)
    dead = [json.loads(v) for role, _k, v in sink if role == "dead_letters"]
    reasons = sorted(d["reason"] for d in dead)
    assert reasons.count("field 'user' missing or not a non-empty string") == 2
    assert len(dead) == 3 and all("secret-person-9" not in r for r in reasons)
    assert len(flow_answers(sink)) == STEPS


def test_a_snapshot_refuses_other_caps() -> None:
    from dpstream.kinds.pmwg.shard import PmwgShard
    shard = PmwgShard(flow_config(), FLOW_NOISE, "pu-1", 2)
    shard.bind(0)
    state = shard.to_state()
    PmwgShard(flow_config(), FLOW_NOISE, "pu-1", 2, state)  # the same caps resume
    with pytest.raises(Exception, match="other mechanism parameters"):
        PmwgShard(flow_config(max_rows=2), FLOW_NOISE, "pu-1", 2, state)


@pytest.mark.flow
def test_a_user_level_crash_and_resume_reproduces_every_answer(tmp_path: Any) -> None:
    from bytewax.recovery import RecoveryConfig, init_db_dir
    from bytewax.testing import TestingSink, TestingSource, run_main

    from dpstream.platform import build_flow
    init_db_dir(tmp_path, 1)
    cfg = flow_config()
    items, _, _ = flow_stream(people=30, seed=5)
    whole = flow_answers(run_flow(cfg, items))
    crashing = items[: len(items) // 2] + [TestingSource.ABORT()] + items[len(items) // 2:]
    sink: list[Any] = []
    for _ in range(2):
        flow = build_flow(cfg, FLOW_NOISE, instance="pu-1", partitions=FLOW_PARTITIONS,
                          source=TestingSource(crashing, 20), sink=TestingSink(sink))
        run_main(flow, epoch_interval=timedelta(0), recovery_config=RecoveryConfig(tmp_path))
    copies: dict[str, set[bytes]] = {}
    for role, _k, v in sink:
        if role == "answers":
            copies.setdefault(json.loads(v)["id"], set()).add(v)
    assert all(len(c) == 1 for c in copies.values())  # replays are byte-identical
    assert {q: json.loads(next(iter(c))) for q, c in copies.items()} == whole
