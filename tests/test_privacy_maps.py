"""The privacy maps the core mechanisms' docstrings state are the charges the code makes.

Every core mechanism's module docstring states it as OpenDP states a measurement: input
domain and metric, function, output measure and privacy map ``d_in -> d_out``. Here, for each
mechanism, the documented map at ``d_in = 1`` is computed from the formula (exact fractions
wherever the code is exact) and compared with what the mechanism actually commits to its
ledger, so the documentation is tested.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from support.fakes import DenseQuery, FakeTrain

from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger, exact
from dpstream.core.counting.blt_counter import _RHO_RESERVE, BltCounterSpec
from dpstream.core.counting.blt_parameters import _parameters
from dpstream.core.counting.stage_ledgers import PAID, StageLedgers
from dpstream.core.counting.statistics_spec import StatisticsSpec
from dpstream.core.counting.threshold_monitor import ThresholdMonitorSpec
from dpstream.core.counting.tree_counter import TreeCounterSpec
from dpstream.core.erm.ermg import Ermg, ErmgSpec
from dpstream.core.erm.output_noise import NoiseLevel
from dpstream.core.erm.sampling import amplified_epsilon
from dpstream.core.erm.schedules.schedule import ReleaseSchedule
from dpstream.core.erm.schedules.spec import ScheduleSpec
from dpstream.core.erm.spec import Block, ErmSpec
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import discrete_laplace_variance
from dpstream.core.pmwg.bb_improver import BBImproverSpec
from dpstream.core.pmwg.bb_scheduler import BBScheduler, BBSchedulerSpec
from dpstream.core.pmwg.blackboxes import NoisyHistogram
from dpstream.core.pmwg.mechanism import Pmwg
from dpstream.core.pmwg.spec import PmwgSpec
from dpstream.core.pmwg.worst_case import SIGMA, SUM_SLACK

KEY = NoiseKey.for_tests(23)
COORDS = ("instance", "flow", "key")


def spent(ledger: PrivacyLedger) -> Fraction:
    """What a ledger committed, exactly."""
    return Fraction(ledger.to_state()["spent"])


def paid(accounting: str, *charges: PrivacyCharge) -> Fraction:
    ledger = PrivacyLedger(accounting, 10**6)
    for charge in charges:
        ledger.charge(charge)
    return spent(ledger)


# --- counting -------------------------------------------------------------------------------


@pytest.mark.parametrize("epsilon", [0.1, 0.7, 3.0])
def test_tree_counter_map_is_epsilon_and_each_node_pays_its_share(epsilon: float) -> None:
    spec = TreeCounterSpec(epsilon=epsilon, horizon=16)
    eps = exact(epsilon)
    assert paid("pure", spec.charge) == eps
    assert paid("zcdp", spec.charge) == eps * eps / 2  # BS16 Proposition 1.4
    for epoch in range(4):
        # one event moves m_j + 1 nodes by one: L1 sensitivity (m_j + 1) at that scale
        levels = (16 << epoch).bit_length()
        assert spec.levels(epoch) == levels
        assert Fraction(levels) / spec.noise_scale(epoch) == eps


@pytest.mark.parametrize(("rho", "horizon"), [(0.05, 2**10), (0.5, 2**16), (2.0, 2**20)])
def test_blt_counter_map_is_rho_with_the_discreteness_reserve(rho: float, horizon: int) -> None:
    spec = BltCounterSpec(rho=rho, horizon=horizon)
    assert paid("zcdp", spec.charge) == exact(rho)
    with pytest.raises(Exception, match="pure-DP ledger cannot pay a zCDP charge"):
        paid("pure", spec.charge)
    # one epoch costs Delta_G^2 / (2 sigma_G^2) <= rho (1 - 10^-12), sigma_G^2 the ceiling
    delta2 = _parameters(horizon).delta2
    sigma2 = spec.sigma2_grid
    assert sigma2.denominator == 1
    epoch_cost = delta2 / (2 * sigma2)
    assert epoch_cost <= exact(rho) * (1 - _RHO_RESERVE)
    assert delta2 / (2 * (sigma2 - 1)) > exact(rho) * (1 - _RHO_RESERVE)  # the smallest sigma


@pytest.mark.parametrize("epsilon", [0.2, 1.0])
def test_threshold_monitor_map_is_epsilon_for_the_whole_run(epsilon: float) -> None:
    spec = ThresholdMonitorSpec(epsilon=epsilon, threshold=5, horizon=100)
    eps = exact(epsilon)
    assert paid("pure", spec.charge) == eps
    # Dwork & Roth Thm 3.23: threshold noise 2/eps, query noise 4/eps, sensitivity 1
    assert 1 / spec.threshold_scale + 2 / spec.query_scale == eps


def _statistics(accounting: str) -> StatisticsSpec:
    if accounting == "pure":
        counter: TreeCounterSpec | BltCounterSpec = TreeCounterSpec(epsilon=0.5, horizon=64)
        initial = PrivacyCharge(epsilon=0.3, label="initial count")
    else:
        counter = BltCounterSpec(rho=0.125, horizon=2**10)
        initial = PrivacyCharge(rho=0.01, label="initial count")
    return StatisticsSpec(
        flow="f", mode="open", accounting=accounting,
        budget=5.0, delta_budget=1e-6, counter=counter,
        monitor=ThresholdMonitorSpec(epsilon=0.2, threshold=20, horizon=32),
        initial=initial, admission_delta=1e-9)


def test_statistics_spec_map_is_the_sum_of_the_key_charges() -> None:
    pure = StageLedgers(_statistics("pure")).ledger(PAID)
    assert spent(pure) == Fraction(2, 10) + Fraction(3, 10) + Fraction(5, 10)
    zcdp = StageLedgers(_statistics("zcdp")).ledger(PAID)
    # the monitor's epsilon counts as epsilon^2 / 2, the rho charges add
    assert spent(zcdp) == Fraction(2, 10) ** 2 / 2 + Fraction(1, 100) + Fraction(1, 8)
    assert zcdp.spent_delta == 0  # the admission delta is added to what releases report


# --- PMWG -----------------------------------------------------------------------------------


def _practical(accounting: str) -> PmwgSpec:
    return PmwgSpec(epsilon=2.0, delta=0.0 if accounting == "pure" else 1e-6, alpha=0.1,
                    beta=0.05, n=1000, universe_size=64, accounting=accounting,
                    mode="practical", hard_query_cap=50)


@pytest.mark.parametrize("accounting", ["pure", "zcdp"])
def test_sparse_vector_round_map_is_what_pmwg_charges_at_the_round_start(accounting: str
                                                                          ) -> None:
    spec = _practical(accounting)
    pm = Pmwg(spec, KEY, COORDS)
    counts = np.zeros(64, dtype=np.int64)
    counts[0] = 1000
    pm.answer(DenseQuery([1.0] + [0.0] * 63), counts, 1000)  # the first query opens a round
    s = spec.sensitivity_bound(1000)
    expected = s * Fraction(9, 8) if accounting == "pure" else (s * s + (s / 8) ** 2) / 2
    charged = spent(pm.ledger)
    assert expected <= charged <= expected * (1 + Fraction(1, 10**15))  # rounded up to a float


@pytest.mark.parametrize(("accounting", "delta"), [("pure", 0.0), ("zcdp", 1e-6)])
def test_pmwg_worst_case_map_is_charged_once_at_start(accounting: str, delta: float) -> None:
    spec = PmwgSpec(epsilon=1.0, delta=delta, alpha=0.05, beta=0.05, n=10**6,
                    universe_size=2**16, accounting=accounting)
    pm = Pmwg(spec, KEY, COORDS)
    charged = spent(pm.ledger)
    assert charged == exact(spec.worst_case_cost())
    # (B.1) (pure) or tau / 2 (zCDP), times SIGMA (1 + 10^-9) resp. its square
    bound = spec.paper_sum() if accounting == "pure" else spec.paper_sum() / 2
    factor = SIGMA if accounting == "pure" else SIGMA * SIGMA
    assert float(charged) == pytest.approx(bound * factor * (1 + SUM_SLACK), rel=1e-12)
    assert charged >= Fraction(bound)
    assert charged <= exact(spec.budget)


@pytest.mark.parametrize("epsilon", [0.25, 1.0])
def test_noisy_histogram_map_is_one_over_its_scale(epsilon: float) -> None:
    # L1 sensitivity 1 at discrete Laplace scale 1/epsilon
    assert 1 / NoisyHistogram.noise_scale(epsilon) == exact(epsilon)


def test_bb_scheduler_map_is_the_sum_of_its_epoch_epsilons() -> None:
    box = NoisyHistogram(4)
    spec = BBSchedulerSpec.for_black_box(box, epsilon=1.0, beta=0.05, n=1000)
    gamma, eps = spec.gamma_exact, exact(spec.epsilon)
    sched = BBScheduler(spec, box, KEY, COORDS)
    expected = Fraction(0)
    for epoch in range(5):
        t = spec.epoch_start(epoch)
        counts = np.array([t - 3 * (t // 4)] + [t // 4] * 3, dtype=np.int64)
        sched.observe(counts, t)
        formula = gamma * gamma * (epoch + 1) / (1 + gamma) ** (epoch + 2) * eps
        charge = exact(spec.epoch_epsilon(epoch))
        assert charge <= formula < charge * (1 + Fraction(1, 2**50))  # rounded down
        expected += charge
        assert spent(sched.ledger) == expected <= eps
    zcdp = BBSchedulerSpec(epsilon=0.9, beta=0.05, n=10**5, p=1.0, g=1.0, delta=1e-6)
    e1 = exact(zcdp.epoch_epsilon(1))
    assert zcdp.new_ledger().cost_of(zcdp.epoch_charge(1)) == e1 * e1 / 2
    assert zcdp.budget == pytest.approx(0.81 / (9 * math.log(1e6)), rel=1e-15)


def test_bb_improver_map_is_the_sum_of_squared_run_epsilons_over_two() -> None:
    spec = BBImproverSpec(epsilon=1.0, delta=1e-6, beta=0.05, n=100, c=0.1, p=1.0,
                          p_prime=1.0, p_double_prime=0.0, g=1.0)
    ledger = spec.new_ledger()
    total = Fraction(0)
    for t in range(100, 400, 7):
        eps_t = spec.run_epsilon(t)
        formula = math.sqrt(0.1) / (3 * math.sqrt(math.log(1e6))) / t ** 0.6
        assert eps_t == pytest.approx(formula, rel=1e-13)
        assert ledger.cost_of(spec.run_charge(t)) == exact(eps_t) ** 2 / 2
        ledger.charge(spec.run_charge(t))
        total += exact(eps_t) ** 2 / 2
    assert spent(ledger) == total <= exact(spec.budget)
    assert spec.budget == pytest.approx(1 / (18 * math.log(1e6)), rel=1e-15)


# --- ERM ------------------------------------------------------------------------------------


def _erm(accounting: str) -> ErmSpec:
    return ErmSpec(classes=(0, 1), dimension=2, clip_norm=1.0, regularization=0.5,
                   accounting=accounting)


@pytest.mark.parametrize("accounting", ["pure", "zcdp"])
def test_output_noise_map_scales_with_the_sensitivity(accounting: str) -> None:
    spec = _erm(accounting)
    ref, cost = spec.sensitivity(100.0), Fraction(1, 2)
    level = NoiseLevel(reference_sensitivity=ref, reference_cost=cost)
    for normalizer in (100.0, 200.0, 800.0, 3000.0):
        delta = spec.sensitivity(normalizer)
        got = level.cost_at(spec, delta)
        if accounting == "pure":
            assert got == cost * delta / ref
            assert got == spec.grid_l1_sensitivity / level.integer_scale(spec, delta)
        else:
            assert got == cost * (delta / ref) ** 2
            d2 = spec.grid_l2_sensitivity
            assert got == (1 + Fraction(1, 10**12)) * d2 * d2 / (
                2 * level.integer_variance(spec, delta))


def _block(rows: int, seed: int, spec: ErmSpec) -> Block:
    x = np.random.default_rng(seed).normal(size=(rows, spec.dimension))
    return Block(spec.features(x), (x[:, 0] > 0).astype(np.int64))


def test_ermg_map_is_the_sum_of_its_runs_squared_epsilons_over_two() -> None:
    erm = ErmSpec(classes=("no", "yes"), dimension=2, clip_norm=2.0, regularization=0.2,
                  accounting="pure")
    spec = ErmgSpec(epsilon=1.0, delta=1e-6, block_size=10, beta=0.05, first_blocks=3, c=0.1)
    train = FakeTrain()
    ermg = Ermg(spec, erm, KEY, COORDS, train=train)
    improver = ermg.improver_spec
    expected = Fraction(0)
    for step in range(8):
        ermg.add_block(step, _block(4, step, erm))
        t = (step + 1) * 10
        if t >= 30:
            eps_t = exact(improver.run_epsilon(t))
            assert train.calls[-1].cost == eps_t  # the box's noise costs exactly epsilon_t
            expected += eps_t * eps_t / 2
    assert ermg.block_rho(0) == expected == spent(ermg.ledger)
    assert ermg.block_rho(5) == sum(
        (exact(improver.run_epsilon(10 * (s + 1))) ** 2 / 2 for s in range(5, 8)), Fraction(0))


@pytest.mark.parametrize("accounting", ["pure", "zcdp"])
def test_schedule_map_is_the_block_sum_of_its_computations(accounting: str) -> None:
    erm = _erm(accounting)
    spec = ScheduleSpec(algorithm="multi-resolution", epsilon=1.0, block_size=10,
                        base_blocks=1, accounting=accounting)
    s = ReleaseSchedule(spec, erm, KEY, COORDS, train=FakeTrain())
    for step in range(4):
        s.add_block(step, _block(3, step, erm))
    # block 0 is in the level-0, 1 and 2 computations: references (B b0, eps/2) resp. 3 rho/4
    share = Fraction(1, 2) if accounting == "pure" else Fraction(3, 4)
    ratio = Fraction(1, 2) if accounting == "pure" else Fraction(1, 4)
    assert s.block_spend(0) == share * (1 + ratio + ratio * ratio)
    assert s.max_block_spend() <= spec.budget()
    independent = ScheduleSpec(algorithm="independent", epsilon=0.7, block_size=10,
                               accounting=accounting)
    ind = ReleaseSchedule(independent, erm, KEY, COORDS, train=FakeTrain())
    ind.add_block(0, _block(3, 0, erm))
    assert ind.block_spend(0) == exact(0.7) == independent.budget()


def test_sampled_schedule_charges_the_amplified_cost() -> None:
    erm = _erm("pure")
    spec = ScheduleSpec(algorithm="multi-resolution", epsilon=1.0, block_size=10,
                        base_blocks=1, sampling=True)
    s = ReleaseSchedule(spec, erm, KEY, COORDS, train=FakeTrain())
    releases = [r for step in range(2) for r in s.add_block(step, _block(3, step, erm))]
    level1 = next(r for r in releases if r.level == 1)
    # level 1 is sampled at its rate q: its charge is ln(1 + q (e^(eps/2) - 1)) <= eps/4
    assert level1.cost <= Fraction(1, 4)
    assert s.block_spend(0) == Fraction(1, 2) + level1.cost
    assert s.block_spend(1) == Fraction(1, 2) + level1.cost
    assert level1.rate is not None and 0 < level1.rate < 1
    assert level1.cost == amplified_epsilon(Fraction(1, 2), level1.rate)


# --- the samplers' exactness ---------------------------------------------------------------


@pytest.mark.parametrize("scale", [Fraction(1, 2), Fraction(3), Fraction(40)])
def test_discrete_laplace_pmf_stated_is_a_distribution_with_the_reported_variance(
        scale: Fraction) -> None:
    inv = 1 / float(scale)
    norm = math.expm1(inv) / (math.exp(inv) + 1)
    ys = range(-int(80 * scale) - 50, int(80 * scale) + 51)
    pmf = [norm * math.exp(-abs(y) * inv) for y in ys]
    assert math.fsum(pmf) == pytest.approx(1.0, abs=1e-12)
    variance = math.fsum(y * y * p for y, p in zip(ys, pmf, strict=True))
    assert variance == pytest.approx(discrete_laplace_variance(scale), rel=1e-9)
