"""Tests of ERMG (dpstream.core.erm.ermg): BBImprover (paper 003, Algorithm 5) over output
perturbation, paper 003 Theorem 31."""

from __future__ import annotations

import math
import pickle
from fractions import Fraction

import numpy as np
import pytest
from support.recording import RecordingKey

from dpstream.core.accounting.ledger import exact, zcdp_to_approx_dp
from dpstream.core.erm.ermg import Ermg, ErmgSpec, ErmSynopsis, OutputPerturbation
from dpstream.core.erm.model import PrivateModel
from dpstream.core.erm.output_noise import NoiseLevel, private_erm
from dpstream.core.erm.solver import solve
from dpstream.core.erm.spec import Block, ErmSpec
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError

COORDS = ("instance-1", "flow", "erm", "default")
KEY = NoiseKey.for_tests(8)


def model_spec(accounting: str = "pure") -> ErmSpec:
    return ErmSpec(classes=("no", "yes"), dimension=2, clip_norm=2.0, regularization=0.2,
                   accounting=accounting)


def toy_block(rows: int, seed: int, spec: ErmSpec | None = None) -> Block:
    spec = spec or model_spec()
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 2))
    y = (x[:, 0] + 0.5 * x[:, 1] + 0.3 * rng.normal(size=rows) > 0).astype(np.int64)
    return Block(spec.features(x), y)


class FakeTrain:
    def __init__(self) -> None:
        self.calls: list[tuple[int, float, bool, Fraction]] = []

    def __call__(self, spec, block, *, normalizer, center, level, rng):
        sensitivity = spec.sensitivity(normalizer)
        cost = level.cost_at(spec, sensitivity)
        self.calls.append((block.size, normalizer, center is None, cost))
        draw = rng.randbelow(1 << 20) / float(1 << 20)
        return PrivateModel(params=np.full((spec.rows, spec.columns), draw),
                            grid=Fraction(1, 1 << 20), noise_std=1.0, cost=cost,
                            sensitivity=sensitivity, normalizer=normalizer, size=block.size)


def spec(**kw) -> ErmgSpec:
    args = {"epsilon": 1.0, "delta": 1e-6, "block_size": 10, "beta": 0.05, "first_blocks": 3,
            "c": 0.1}
    args.update(kw)
    return ErmgSpec(**args)


def test_delta_zero_and_bad_parameters_are_refused():
    with pytest.raises(InvalidParameterError, match="needs delta > 0"):
        spec(delta=0.0)
    with pytest.raises(InvalidParameterError, match="epsilon must be finite and > 0"):
        spec(epsilon=-1.0)
    with pytest.raises(InvalidParameterError, match="first_blocks must be an integer >= 1"):
        spec(first_blocks=0)
    with pytest.raises(InvalidParameterError, match="block_size must be an integer >= 1"):
        spec(block_size=0)
    with pytest.raises(InvalidParameterError, match="converts to epsilon"):
        spec(epsilon=500.0)  # beyond what rho = eps^2/(18 log(1/delta)) converts to
    with pytest.raises(InvalidParameterError, match="accounting 'pure'"):
        Ermg(spec(), model_spec("zcdp"), KEY, COORDS)
    assert spec().budget() == 1 and "ERMG" in spec().describe()


def test_the_black_box_declares_its_constants():
    box = OutputPerturbation(model_spec())
    p = 3  # one row of d + 1 = 3 parameters
    assert (box.p, box.p_prime, box.p_double_prime) == (1.0, 1.0, 0.0)
    assert box.g == pytest.approx(1.0 * p**1.5 * (1 + math.log(2 * p)) * (1 + 2**-10) / 0.2)
    ermg = Ermg(spec(), model_spec(), KEY, COORDS)
    assert ermg.improver_spec.g == box.g and ermg.improver_spec.n == 30
    with pytest.raises(InvalidParameterError, match="takes a Block"):
        box.run(np.zeros(3, dtype=np.int64), 10, 0.1, 1.0, 0.01, lambda *c: KEY.stream(*c))
    with pytest.raises(InvalidParameterError, match="answers no linear query"):
        ErmSynopsis(FakeTrain()(model_spec(), toy_block(3, 0), normalizer=10.0, center=None,
                                level=_level(), rng=KEY.stream("x"))).answer(np.ones(3))


def _level():
    return NoiseLevel(reference_sensitivity=Fraction(1), reference_cost=Fraction(1))


def test_runs_at_every_block_from_first_blocks_on_all_data_at_epsilon_t():
    train = FakeTrain()
    key = RecordingKey(2)
    s = spec()
    ermg = Ermg(s, model_spec(), key, COORDS, train=train)
    improver = ermg.improver_spec
    total_rows = 0
    for step in range(12):
        rows = 0 if step == 5 else 4  # an empty block still advances t
        total_rows += rows
        out = ermg.add_block(step, toy_block(rows, step))
        t = (step + 1) * 10
        if step < 2:
            assert out == [] and not train.calls
            continue
        (release,) = out
        eps_t = exact(improver.run_epsilon(t))
        assert (release.role, release.level, release.first_step, release.last_step) == (
            "ermg", None, 0, step)
        assert release.depends_on == ((0, step),) and release.cost == eps_t
        assert train.calls[-1] == (total_rows, float(t), True, eps_t)  # all data, normaliser t
        assert key.calls[-1][:5] == (*COORDS, "ermg")  # then the specs' digest
        assert key.calls[-1][-4:] == ("bbimprover", "erm-output-perturbation", t, "noise")
    assert len(train.calls) == 10 and len(set(key.calls)) == len(key.calls)
    with pytest.raises(InvalidParameterError, match="expected step 12, got 14"):
        ermg.add_block(14, toy_block(2, 0))


def test_the_ledger_never_exceeds_its_budget_and_blocks_report_their_rho():
    s = spec(block_size=1, first_blocks=1)
    ermg = Ermg(s, model_spec(), KEY, COORDS, train=FakeTrain())
    budget = ermg.improver_spec.budget
    spends = []
    for step in range(600):
        ermg.add_block(step, toy_block(1, step))
        assert ermg.ledger.spent <= budget
        spends.append(ermg.max_block_spend())
    assert spends == sorted(spends) and spends[-1] <= s.budget()
    # the oldest block was in every run: its rho is the ledger's, exactly
    assert ermg.block_rho(0) == Fraction(ermg.ledger.to_state()["spent"])
    expected_0 = sum(exact(ermg.improver_spec.run_epsilon(t)) ** 2 / 2 for t in range(1, 601))
    assert ermg.block_rho(0) == expected_0
    # a later block only paid for the runs from its step on
    late = sum(exact(ermg.improver_spec.run_epsilon(t)) ** 2 / 2 for t in range(500, 601))
    assert ermg.block_rho(499) == late < ermg.block_rho(0)
    assert float(ermg.block_spend(0)) == pytest.approx(
        zcdp_to_approx_dp(float(ermg.block_rho(0)), 1e-6))
    assert ermg.block_spend(0) <= s.budget()


def test_state_round_trip_continues_identically():
    s = spec(first_blocks=2)
    ermg = Ermg(s, model_spec(), KEY, COORDS, train=FakeTrain())
    for step in range(5):
        ermg.add_block(step, toy_block(3, step))
    state = pickle.loads(pickle.dumps(ermg.to_state()))
    restored = Ermg.from_state(state, s, model_spec(), KEY, COORDS, train=FakeTrain())
    assert restored.ledger == ermg.ledger and restored.blocks_seen == 5
    for step in range(5, 9):
        block = toy_block(3, step)
        a, b = ermg.add_block(step, block), restored.add_block(step, block)
        assert [(r.step, r.cost, r.depends_on) for r in a] == [(r.step, r.cost, r.depends_on)
                                                                for r in b]
        assert all(np.array_equal(x.model.params, y.model.params)
                   for x, y in zip(a, b, strict=True))
    assert restored.ledger == ermg.ledger and restored.block_rho(1) == ermg.block_rho(1)
    with pytest.raises(InvalidParameterError, match="made with specs"):
        Ermg.from_state(state, spec(first_blocks=3), model_spec(), KEY, COORDS)
    with pytest.raises(InvalidParameterError, match="malformed"):
        Ermg.from_state({"version": 1, "kind": "ermg"}, s, model_spec(), KEY, COORDS)


def test_accuracy_improves_with_t_on_a_toy_stream():
    # The real output perturbation at t = 100 and t = 900 (the runs in between are independent
    # of these, so a fake trains them to save time). The release minus the non-private
    # minimiser is the noise (plus rounding below 2^-12 Delta), whose scale is
    # Delta/eps_t ~ t^-(1/2 - c): the expected error ratio is 9^-0.4 = 0.415. Over 20 keys the
    # mean of ||noise|| (3 coordinates; observed coefficient of variation ~0.55) has a
    # coefficient of variation ~0.12, so the ratio of the two means is 0.415 +- 0.07: the
    # threshold 0.7 is 4 standard deviations away, and a schedule that did not improve
    # (ratio ~1) would fail it.
    model = model_spec()
    s = spec(epsilon=100.0, block_size=100, first_blocks=1, c=0.1)
    blocks = [toy_block(100, 100 + i, model) for i in range(9)]
    fits = {step: solve(model, Block.concat(blocks[: step + 1], model.columns),
                        float((step + 1) * 100), None, precision=1e-9).params
            for step in (0, 8)}
    fake = FakeTrain()

    def train(spec_, block, *, normalizer, center, level, rng):
        chosen = private_erm if normalizer in (100.0, 900.0) else fake
        return chosen(spec_, block, normalizer=normalizer, center=center, level=level, rng=rng)

    errors: dict[int, list[float]] = {0: [], 8: []}
    stds: dict[int, float] = {}
    for seed in range(20):
        ermg = Ermg(s, model, NoiseKey.for_tests(seed), COORDS, train=train)
        for step, block in enumerate(blocks):
            (release,) = ermg.add_block(step, block)
            if step in errors:
                errors[step].append(float(np.linalg.norm(release.model.params - fits[step])))
                stds[step] = release.model.noise_std
        assert ermg.ledger.spent <= ermg.improver_spec.budget
    assert stds[8] / stds[0] == pytest.approx(9 ** -0.4, rel=0.02)  # t^-(1/2 - c)
    assert np.mean(errors[8]) < 0.7 * np.mean(errors[0])
    assert ermg.accuracy(900) < ermg.accuracy(100)
