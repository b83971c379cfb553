"""The objective learner: certified objective perturbation with exact noise (issue 25).

Unit tests (fast) of the budget split, the exact noise vector, replay, the L1 feature map, the
solver's linear term and the refusals; statistical tests (marked) of the noise law, of an
empirical privacy lower bound with its power check, and of accuracy against output
perturbation; the schedules with ``learner = "objective"`` (their ledgers charge what output
perturbation's would).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy as np
import pytest

from dpstream.core.erm import objective
from dpstream.core.erm.objective import (
    JACOBIAN_CAP,
    OUTPUT_SHARE,
    _linear_noise,
    objective_budget,
    objective_perturbation,
)
from dpstream.core.erm.output_noise import NoiseLevel
from dpstream.core.erm.solver import CertificationError, Solution, _Objective, solve
from dpstream.core.erm.spec import Block, ErmSpec
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import discrete_laplace
from dpstream.errors import InvalidParameterError

KEY = NoiseKey.for_tests(25)


def spec_of(classes=("no", "yes"), dimension=4, regularization=0.05, **kw) -> ErmSpec:
    return ErmSpec(classes=tuple(classes), dimension=dimension, clip_norm=2.0,
                   regularization=regularization, learner="objective", **kw)


def data(spec: ErmSpec, m: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, Block]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, spec.dimension))
    k = len(spec.classes)
    y = np.asarray([spec.classes[int(v)] for v in
                    np.clip(np.floor((x[:, 0] + 2.0) * k / 4.0), 0, k - 1)], dtype=object)
    return x, y, spec.block(x, list(y))


# -- the split of the cost --


@pytest.mark.parametrize("classes", [("no", "yes"), ("a", "b", "c", "d")])
@pytest.mark.parametrize("normalizer", [1.0, 60.0, 1024.0, 2.0**20])
@pytest.mark.parametrize("regularization", [1e-6, 0.05, 3.0])
@pytest.mark.parametrize(("cost", "rows"), [(Fraction(1), 1), (Fraction(1, 7), 1),
                                            (Fraction(3, 2), 4)])
def test_the_split_sums_exactly_to_the_per_row_budget(classes, normalizer, regularization,
                                                      cost, rows):
    spec = spec_of(classes, regularization=regularization, unit_rows=rows)
    b = objective_budget(spec, normalizer, cost)
    e = cost / rows
    assert b.per_row == e
    assert b.linear + b.jacobian + b.output == e  # exact Fractions
    assert b.output == e * OUTPUT_SHARE
    assert 0 < b.jacobian <= e * JACOBIAN_CAP and b.linear > 0
    # the Jacobian charge is an upper bound on the true rank * ln(1 + c_l / (n Lambda))
    rank, c_l = (1, 0.25) if spec.binary else (len(classes) - 1, 0.5)
    true = rank * math.log1p(c_l / (normalizer * b.regularization))
    assert float(b.jacobian) >= true * (1 - 1e-15)
    assert float(b.jacobian) <= true * (1 + 1e-9) + 1e-300
    # Lambda is lambda unless the cap forced it up, and then barely above what the cap needs
    assert b.regularization >= regularization
    if b.regularization > regularization:
        below = b.regularization / (1 + 2.0**-27)
        assert rank * math.log1p(c_l / (normalizer * below)) > float(e * JACOBIAN_CAP)
    # the output noise's constants: t = D1 / eps_out, beta (L1 + gamma p) = eps_b
    p = spec.parameter_count
    assert b.output_scale * b.output == b.l1_sensitivity
    assert b.beta * ((1 if spec.binary else 2) + b.gamma * p) == b.linear
    assert b.noise_scale == 1 / (b.beta * b.gamma)
    assert b.gamma.numerator == 1 and b.gamma.denominator == 1 << ((p - 1).bit_length() + 20)


def test_lambda_is_raised_only_when_the_jacobian_would_exceed_half_the_budget():
    spec = spec_of(regularization=1e-4)
    small = objective_budget(spec, 100.0, Fraction(1))  # 1/(4 * 100 * 1e-4) = 25: raised
    assert small.regularization > 1e-4 and small.jacobian <= Fraction(1, 2)
    large = objective_budget(spec, 1e6, Fraction(1))  # 1/(4 * 100) : ln(1.0025) < 1/2
    assert large.regularization == 1e-4


def test_the_model_reports_the_cost_and_public_constants():
    spec = spec_of()
    _, _, block = data(spec, 200)
    model = objective_perturbation(spec, block, normalizer=256.0, center=None,
                                   cost=Fraction(3, 4), rng=KEY.stream("cost"))
    b = objective_budget(spec, 256.0, Fraction(3, 4))
    assert model.cost == Fraction(3, 4)
    assert model.grid == b.grid and model.sensitivity == 2 * b.distance
    assert model.size == 200 and model.normalizer == 256.0
    # noise_std: gamma * std(k) / n, with Var k = 2 q / (1 - q)^2, q = exp(-1/scale)
    q = math.exp(-1 / float(b.noise_scale))
    assert model.noise_std == pytest.approx(
        float(b.gamma) * math.sqrt(2 * q) / (1 - q) / 256.0, rel=1e-6)
    assert model.params.shape == (1, spec.columns)
    assert model.params.reshape(-1).tolist() == [float(k * b.grid) for k in model.integers]


# -- the noise vector --


def test_the_noise_is_exactly_gamma_times_k_plus_one_half():
    spec = spec_of(dimension=40)
    b = objective_budget(spec, 512.0, Fraction(1))
    p = spec.parameter_count
    noise = _linear_noise(KEY.stream("lin"), b, p)
    again = KEY.stream("lin")
    ks = [discrete_laplace(again, b.noise_scale) for _ in range(p)]
    assert len(set(ks)) > p // 4  # a real spread of values
    for value, k in zip(noise, ks, strict=True):
        assert type(value) is float
        assert Fraction(value) == b.gamma * (k + Fraction(1, 2))  # exact, no rounding


def test_replay_is_byte_identical_and_coordinates_differ():
    spec = spec_of(classes=("a", "b", "c"))
    _, _, block = data(spec, 300, seed=3)

    def release(*coordinates):
        return objective_perturbation(spec, block, normalizer=300.0, center=None,
                                      cost=Fraction(1), rng=KEY.stream(*coordinates))

    first, replay, other = release("x", 1), release("x", 1), release("x", 2)
    assert first.integers == replay.integers
    assert first.params.tobytes() == replay.params.tobytes()
    assert first.to_state() == replay.to_state()
    assert first.integers != other.integers


def test_a_draw_outside_the_exact_range_releases_nothing(monkeypatch):
    spec = spec_of()
    _, _, block = data(spec, 50)
    monkeypatch.setattr(objective, "discrete_laplace", lambda rng, scale: 1 << 60)
    with pytest.raises(CertificationError, match="nothing was released"):
        objective_perturbation(spec, block, normalizer=64.0, center=None, cost=Fraction(1),
                               rng=KEY.stream("big"))


def test_certification_failure_raises(monkeypatch):
    spec = spec_of()
    _, _, block = data(spec, 50)

    def uncertified(*args, **kwargs):
        return Solution(np.zeros((1, spec.columns)), 1.0, 1.0, 5, False)

    monkeypatch.setattr(objective, "solve", uncertified)
    with pytest.raises(CertificationError, match="nothing\nwas released|nothing was released"):
        objective_perturbation(spec, block, normalizer=64.0, center=None, cost=Fraction(1),
                               rng=KEY.stream("uncertified"))


# -- refusals --


def test_zcdp_and_unknown_learners_are_refused():
    with pytest.raises(InvalidParameterError, match="pure epsilon-DP only"):
        ErmSpec(("a", "b"), 3, 1.0, 0.1, accounting="zcdp", learner="objective")
    with pytest.raises(InvalidParameterError, match="learner must be one of"):
        ErmSpec(("a", "b"), 3, 1.0, 0.1, learner="gradient")  # type: ignore[arg-type]
    output = ErmSpec(("a", "b"), 3, 1.0, 0.1)
    with pytest.raises(InvalidParameterError, match="learner 'objective'"):
        objective_budget(output, 10.0, Fraction(1))


def test_a_row_outside_the_l1_ball_is_refused():
    spec = spec_of()
    z = np.zeros((1, spec.columns))
    z[0, :2] = 0.6  # L2 norm 0.85 <= 1, L1 norm 1.2 > 1
    with pytest.raises(InvalidParameterError, match="L1 norm"):
        objective_perturbation(spec, Block(z, np.array([1])), normalizer=10.0, center=None,
                               cost=Fraction(1), rng=KEY.stream("l1"))


def test_the_learner_is_bound_into_the_spec_dict_only_when_not_output():
    output = ErmSpec(("a", "b"), 3, 1.0, 0.1)
    assert "learner" not in output.to_dict()
    assert output.to_dict() == dataclasses.replace(output, learner="output").to_dict()
    assert spec_of().to_dict()["learner"] == "objective"


# -- the L1 feature map --


@pytest.mark.parametrize("intercept", [True, False])
def test_the_feature_map_clips_to_the_l1_ball_exactly(intercept):
    spec = spec_of(dimension=30, intercept=intercept)
    rng = np.random.default_rng(11)
    x = np.concatenate([
        rng.normal(size=(200, 30)) * 10.0 ** rng.integers(-300, 300, size=(200, 1)),
        rng.normal(size=(50, 30)) * 0.01,  # inside the ball: not clipped
        np.full((1, 30), 1e308), np.zeros((1, 30)),
    ])
    z = spec.features(x)
    for row in z.tolist():
        assert sum(abs(Fraction(v)) for v in row) <= 1  # exact L1 norm of the stored floats
    inside = x[200:250]
    half = 0.5 if intercept else 1.0
    np.testing.assert_allclose(z[200:250, :30], inside / 2.0 * half, rtol=1e-9)
    if intercept:
        assert np.all(z[:, 30] == (1 - 2.0**-32) * 0.5)
    # the inverse map: params @ z = coef @ x_clipped + intercept
    w = rng.normal(size=(1, spec.columns))
    coef, b0 = spec.linear_model(w)
    norms = np.abs(x[:200]).sum(axis=1)
    clipped = x[:200] * np.minimum(1.0, 2.0 / norms)[:, None]
    np.testing.assert_allclose(z[:200] @ w[0], clipped @ coef[0] + b0[0], rtol=1e-9, atol=1e-12)


def test_the_output_learner_keeps_its_l2_map():
    output = ErmSpec(("a", "b"), 3, 2.0, 0.1)
    x = np.array([[3.0, 0.0, 4.0]])
    assert np.linalg.norm(output.features(x)) == pytest.approx(1.0, rel=1e-9)
    l1 = dataclasses.replace(output, learner="objective").features(x)
    assert np.abs(l1).sum() == pytest.approx(1.0, rel=1e-9)


# -- the solver's linear term --


@pytest.mark.parametrize("classes", [("no", "yes"), ("a", "b", "c")])
def test_the_linear_term_gradient_matches_finite_differences(classes):
    spec = spec_of(classes, dimension=3)
    _, _, block = data(spec, 40, seed=5)
    rng = np.random.default_rng(1)
    shape = (spec.rows, spec.columns)
    b = rng.normal(size=shape) * 3.0
    c = rng.normal(size=shape) * 0.1
    plain = _Objective(spec, block, 40.0, c)
    with_b = _Objective(spec, block, 40.0, c, b)
    w = rng.normal(size=spec.parameter_count)
    value, grad, prob = with_b.value_and_gradient(w)
    value0, grad0, prob0 = plain.value_and_gradient(w)
    assert value == pytest.approx(value0 + float(b.reshape(-1) @ w) / 40.0, rel=1e-12)
    np.testing.assert_allclose(grad, grad0 + b.reshape(-1) / 40.0, rtol=1e-12, atol=1e-15)
    h = 1e-6
    for j in range(spec.parameter_count):
        e = np.zeros_like(w)
        e[j] = h
        fd = (with_b.value_and_gradient(w + e)[0] - with_b.value_and_gradient(w - e)[0]) / (2 * h)
        assert fd == pytest.approx(grad[j], abs=1e-7)
    v = rng.normal(size=spec.parameter_count)  # the Hessian does not see the linear term
    np.testing.assert_array_equal(with_b.hessian_product(prob, v), plain.hessian_product(prob0, v))


def test_the_solver_certifies_the_minimiser_of_j_b():
    spec = spec_of(dimension=3)
    _, _, block = data(spec, 80, seed=9)
    b = np.array([[0.3, -2.0, 1.0, 0.5]])
    sol = solve(spec, block, 80.0, None, precision=1e-9, linear=b)
    assert sol.certified and sol.certified_distance <= 1e-9
    grad, _ = _Objective(spec, block, 80.0, np.zeros((1, 4)), b).gradient(sol.params.reshape(-1))
    assert float(np.linalg.norm(grad)) <= 0.05 * 1e-9
    # an empty block: the minimiser of (lambda/2)||w - c||^2 + <b, w>/n is c - b/(n lambda)
    c = np.array([[0.1, 0.2, 0.3, 0.4]])
    empty = solve(spec, Block.empty(4), 80.0, c, precision=1e-12, linear=b)
    np.testing.assert_allclose(empty.params, c - b / (80.0 * 0.05), atol=1e-12)
    # without the term, every byte is as before
    assert solve(spec, block, 80.0, None, precision=1e-9).params.tobytes() == solve(
        spec, block, 80.0, None, precision=1e-9, linear=None).params.tobytes()


def test_the_default_trainer_dispatches_on_the_learner_at_the_output_cost():
    from dpstream.core.erm.schedules.releases import _default_train

    spec = spec_of()
    _, _, block = data(spec, 100)
    level = NoiseLevel(spec.sensitivity(64.0), Fraction(1, 2))
    model = _default_train(spec, block, normalizer=128.0, center=None, level=level,
                           rng=KEY.stream("dispatch"))
    assert model.cost == level.cost_at(spec, spec.sensitivity(128.0)) == Fraction(1, 4)
    assert model.grid == objective_budget(spec, 128.0, Fraction(1, 4)).grid
