"""Tests of the ERM release schedules (dpstream.core.erm.schedules): paper 004's Algorithms 2, 4,
5 (with Example 1's chain), 6, 8, the sampled sliding window and the independent baseline.

Most tests use a fake trainer that records what it is asked and returns a model whose cost is
the noise level's (the schedule checks it); the accounting and the chains are data-independent,
so that is all they need. The last tests run the real output perturbation of
dpstream.core.erm.output_noise.
"""

from __future__ import annotations

import copy
import pickle
from collections import Counter, defaultdict
from fractions import Fraction

import numpy as np
import pytest
from support.fakes import FakeTrain
from support.recording import RecordingKey

from dpstream.core.erm.model import PrivateModel
from dpstream.core.erm.output_noise import private_erm
from dpstream.core.erm.sampling import amplified_epsilon
from dpstream.core.erm.schedules.releases import Release
from dpstream.core.erm.schedules.schedule import ReleaseSchedule
from dpstream.core.erm.schedules.spec import ScheduleSpec, sampling_rate_at_most
from dpstream.core.erm.spec import Block, ErmSpec
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import BudgetExhaustedError, InvalidParameterError

COORDS = ("instance-1", "flow", "erm", "stream-a")
KEY = NoiseKey.for_tests(4)
EPS = Fraction(1)


def erm_spec(accounting: str = "pure", classes: tuple = (0, 1), d: int = 2) -> ErmSpec:
    return ErmSpec(classes=classes, dimension=d, clip_norm=1.0, regularization=0.5,
                   accounting=accounting)


def a_block(rows: int, seed: int, spec: ErmSpec | None = None) -> Block:
    spec = spec or erm_spec()
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, spec.dimension))
    y = (x[:, 0] > 0).astype(np.int64) if rows else np.empty(0, dtype=np.int64)
    return Block(spec.features(x) if rows else np.empty((0, spec.columns)), y)


def schedule(algorithm: str, *, eps: float = 1.0, b0: int = 10, base: int = 1, window: int = 7,
             sampling: bool = False, accounting: str = "pure", key=KEY, train=None,
             erm: ErmSpec | None = None) -> ReleaseSchedule:
    spec = ScheduleSpec(algorithm=algorithm, epsilon=eps, block_size=b0, base_blocks=base,
                        window_blocks=window, sampling=sampling, accounting=accounting)
    return ReleaseSchedule(spec, erm or erm_spec(accounting), key, COORDS,
                           train=FakeTrain() if train is None else train)


def feed(s: ReleaseSchedule, steps: range, rows: int = 3) -> dict[int, list[Release]]:
    return {step: s.add_block(step, a_block(rows, step)) for step in steps}


# --- the spec ------------------------------------------------------------------------------


def test_spec_validation_messages():
    with pytest.raises(InvalidParameterError, match="algorithm must be one of"):
        ScheduleSpec(algorithm="nope", epsilon=1.0, block_size=10)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="epsilon must be finite and > 0"):
        ScheduleSpec(algorithm="continual", epsilon=0.0, block_size=10)
    with pytest.raises(InvalidParameterError, match="block_size must be an integer >= 1"):
        ScheduleSpec(algorithm="continual", epsilon=1.0, block_size=0)
    with pytest.raises(InvalidParameterError, match="base_blocks must be a power of two"):
        ScheduleSpec(algorithm="multi-resolution", epsilon=1.0, block_size=10, base_blocks=6)
    for bad in (1, 2, 4, 8, 14):
        with pytest.raises(InvalidParameterError, match=r"window_blocks must be 2\^k - 1"):
            ScheduleSpec(algorithm="sliding-window", epsilon=1.0, block_size=10,
                         window_blocks=bad)
    with pytest.raises(InvalidParameterError, match="sampling is refused under zCDP"):
        ScheduleSpec(algorithm="continual", epsilon=1.0, block_size=10, sampling=True,
                     accounting="zcdp")
    with pytest.raises(InvalidParameterError, match="independent baseline has no sampled"):
        ScheduleSpec(algorithm="independent", epsilon=1.0, block_size=10, sampling=True)
    # parameters another algorithm does not use are not held against it
    ScheduleSpec(algorithm="sliding-window", epsilon=1.0, block_size=10, base_blocks=6,
                 window_blocks=15)


def test_budget_and_reference_costs():
    def spec(algorithm, accounting="pure"):
        return ScheduleSpec(algorithm=algorithm, epsilon=0.3, block_size=10,
                            accounting=accounting)
    third = Fraction(3, 10)
    assert spec("continual").budget() == 2 * third
    assert spec("multi-resolution").budget() == third == spec("sliding-window").budget()
    assert spec("multi-resolution").reference_costs() == {"multi-resolution": third / 2}
    assert spec("multi-resolution", "zcdp").reference_costs() == {
        "multi-resolution": third * 3 / 4}
    assert spec("sliding-window").reference_costs() == {"base": third / 3, "update": third / 6}
    assert spec("sliding-window", "zcdp").reference_costs() == {"base": third / 3,
                                                               "update": third / 4}
    assert spec("independent", "zcdp").reference_costs() == {"independent": third}
    assert "2^k x 1 blocks" in spec("multi-resolution").describe()
    assert spec("continual").to_dict()["accounting"] == "pure"


def test_accountings_must_agree():
    spec = ScheduleSpec(algorithm="continual", epsilon=1.0, block_size=10)
    with pytest.raises(InvalidParameterError, match="accounting 'pure' differs .* 'zcdp'"):
        ReleaseSchedule(spec, erm_spec("zcdp"), KEY, COORDS)


def test_steps_must_be_consecutive_and_blocks_well_formed():
    s = schedule("independent")
    with pytest.raises(InvalidParameterError, match="expected step 0, got 1"):
        s.add_block(1, a_block(2, 0))
    with pytest.raises(InvalidParameterError, match=r"\(m, 3\) array"):
        s.add_block(0, Block(np.zeros((2, 5)), np.zeros(2, dtype=np.int64)))
    s.add_block(0, a_block(2, 0))
    with pytest.raises(InvalidParameterError, match="expected step 1, got 0"):
        s.add_block(0, a_block(2, 0))


# --- Example 1 and the sliding-window chain ---------------------------------------------------

EXAMPLE_1 = {  # step: (released chain, models trained at that step)
    6: (((0, 0), (1, 2), (3, 6)), {(3, 6), (1, 2), (0, 0)}),
    7: (((7, 7), (1, 2), (3, 6)), {(7, 7)}),
    8: (((2, 2), (7, 8), (3, 6)), {(7, 8), (2, 2)}),
    9: (((9, 9), (7, 8), (3, 6)), {(9, 9)}),
    10: (((4, 4), (5, 6), (7, 10)), {(7, 10), (5, 6), (4, 4)}),
}


def test_example_1_chains_and_what_is_trained_at_each_step():
    train = FakeTrain()
    s = schedule("sliding-window", window=7, train=train)
    for step in range(11):
        before = len(train.calls)
        out = s.add_block(step, a_block(3, step))
        if step < 6:  # nothing before the first full window
            assert out == [] and s.trained == () and len(train.calls) == 0
            continue
        chain, trained = EXAMPLE_1[step]
        assert len(out) == 1
        release = out[0]
        assert release.role == "window" and release.step == step
        assert release.depends_on == chain
        assert (release.first_step, release.last_step) == chain[0]
        assert {(c.first_step, c.last_step) for c in s.trained} == trained
        assert len(train.calls) - before == len(trained)  # each model once
        # every model of the chain is kept and centred on the next one
        models = s.models
        for i in range(1, len(chain)):
            key, centre = chain[i - 1:], chain[i:]
            assert key in models and centre in models
        for c in s.trained:
            call = train.calls[before + list(s.trained).index(c)]
            assert call.normalizer == 10.0 * (c.last_step - c.first_step + 1)
            if c.centre:
                np.testing.assert_array_equal(call.center, models[c.centre].params)
            else:
                assert call.center is None and c.role == "base" and c.level == 2
        assert release.model is models[chain]


def test_example_1_costs():
    s = schedule("sliding-window", window=7)
    feed(s, range(7))
    costs = {(c.first_step, c.last_step): c.cost for c in s.trained}
    assert costs == {(3, 6): EPS / 3, (1, 2): EPS / 12, (0, 0): EPS / 6}
    assert [s.block_spend(i) for i in range(7)] == [EPS / 6, EPS / 12, EPS / 12] + [EPS / 3] * 4
    s.add_block(7, a_block(3, 7))
    assert [c.cost for c in s.trained] == [EPS / 6]
    assert s.block_spend(7) == EPS / 6


@pytest.mark.parametrize("w", [3, 7, 15, 31])
def test_window_chains_tile_the_window_with_distinct_sizes(w):
    s = schedule("sliding-window", window=w)
    k = (w + 1).bit_length() - 1
    for t in range(w, w + 6 * (w + 1)):
        chain = s.window_chain(t)
        sizes = [b - a + 1 for a, b in chain]
        assert sizes == [1 << i for i in range(k - 1, -1, -1)]  # base, then each size once
        covered = sorted(x for a, b in chain for x in range(a, b + 1))
        assert covered == list(range(t - w, t))  # the buckets tile the window exactly
        base = chain[0]
        assert base[1] - base[0] + 1 == 1 << (k - 1)
        # larger buckets sit next to the base on each side
        left = sorted((a, b) for a, b in chain[1:] if b < base[0])
        right = sorted((a, b) for a, b in chain[1:] if a > base[1])
        assert [b - a for a, b in left] == sorted(b - a for a, b in left)
        assert [b - a for a, b in right] == sorted((b - a for a, b in right), reverse=True)
    with pytest.raises(InvalidParameterError, match="first window is complete"):
        s.window_chain(w - 1)



@pytest.mark.parametrize("algorithm", ["multi-resolution", "continual", "independent"])
def test_window_chain_is_refused_by_the_other_schedules(algorithm):
    s = schedule(algorithm, base=2)
    feed(s, range(8))
    with pytest.raises(InvalidParameterError, match="window_chain is for the sliding-window"):
        s.window_chain(8)

def test_window_15_each_model_is_trained_once_and_releases_are_chain_ends():
    s = schedule("sliding-window", window=15)
    identities: Counter = Counter()
    sides: dict[tuple[int, int], set[str]] = defaultdict(set)
    for step in range(160):
        out = s.add_block(step, a_block(2, step))
        t = step + 1
        for c in s.trained:
            identities[c.depends_on] += 1
        if t < 15:
            assert out == []
            continue
        chain = s.window_chain(t)
        assert out[0].depends_on == tuple(reversed(chain))  # from the end up to the base
        base = chain[0]
        for a, b in chain[1:]:
            sides[(a, b)].add("left" if b < base[0] else "right")
        # what was trained now is exactly what is new in the chain
        new = [c.depends_on for c in s.trained]
        assert all(identities[key] == 1 for key in new)
    assert max(identities.values()) == 1  # every (bucket, centre chain) trained exactly once
    # a bucket range is trained at most twice: once as a right bucket, once as a left one
    per_range = Counter((key[0]) for key in identities)
    assert max(per_range.values()) <= 2


# --- accounting: the theorems' sums ----------------------------------------------------------


def mr_expected(s: int, t: int, big_b: int, c0: Fraction, ratio: int) -> Fraction:
    """Algorithm 2's spend of block s after t blocks: levels whose aligned set has closed."""
    total = Fraction(0)
    k = 0
    while (big_b << k) <= t:
        size = big_b << k
        if (s // size + 1) * size <= t:
            total += c0 / ratio**k
        k += 1
    return total


@pytest.mark.parametrize("big_b", [1, 2, 4])
def test_multi_resolution_exact_series_theorem_1(big_b):
    s = schedule("multi-resolution", base=big_b)
    t_end = 256
    for step in range(t_end):
        out = s.add_block(step, a_block(1, step))
        t = step + 1
        levels = [r.level for r in out]
        assert levels == [k for k in range(12) if t % (big_b << k) == 0]
        for r in out:
            assert (r.first_step, r.last_step) == (t - (big_b << r.level), t - 1)
            assert r.cost == EPS / (2 << r.level) and r.role == "multi-resolution"
            assert r.depends_on == ((r.first_step, r.last_step),)
    for block in range(t_end):
        assert s.block_spend(block) == mr_expected(block, t_end, big_b, EPS / 2, 2)
        assert s.block_spend(block) < EPS  # Theorem 1
    # the first block after 2^K B blocks: eps/2 + eps/4 + ... + eps/2^(K+1)
    k_top = (t_end // big_b).bit_length() - 1
    assert s.block_spend(0) == EPS * (1 - Fraction(1, 2 ** (k_top + 1)))
    assert s.max_block_spend() == s.block_spend(0)


def alg4_spend(s: ReleaseSchedule, trained_log: list) -> dict[int, Fraction]:
    per_block: dict[int, Fraction] = defaultdict(Fraction)
    for c in trained_log:
        if c.role == "update":
            for b in range(c.first_step, c.last_step + 1):
                per_block[b] += c.cost
    return per_block


@pytest.mark.parametrize("big_b", [1, 2])
def test_continual_theorem_4_and_two_epsilon_with_algorithm_2(big_b):
    s = schedule("continual", base=big_b)
    log = []
    t_end = 300
    for step in range(t_end):
        out = s.add_block(step, a_block(1, step))
        log.extend(s.trained)
        t = step + 1
        if t < big_b:
            assert out == []
            continue
        continual = [r for r in out if r.role in ("base", "update")]
        assert len(continual) == 1  # one continual model per block from the first base on
        r = continual[0]
        q = t // big_b
        if t % big_b == 0 and q & (q - 1) == 0:  # a base: Algorithm 2's top level
            assert r.role == "base" and r.depends_on == ((0, t - 1),)
            assert r.cost == EPS / 2 / q
        else:
            t_g = big_b << (q.bit_length() - 1)
            i = t - t_g
            if i & (i - 1) == 0:  # line 8: D[t_g:t] centred at f_g, cost eps/(2 * 2^j)
                assert r.depends_on == ((t_g, t - 1), (0, t_g - 1))
                assert r.level == i.bit_length() - 1
                assert r.cost == EPS / 2 / i
            else:  # line 11: the last block centred at f_c
                saved = 1 << (i.bit_length() - 1)
                assert r.depends_on == ((t - 1, t - 1), (t_g, t_g + saved - 1), (0, t_g - 1))
                assert r.level is None and r.cost == EPS / 2
    update = alg4_spend(s, log)
    assert max(update.values()) < EPS  # Theorem 4: Algorithm 4's own updates
    for block in range(t_end):
        mr = mr_expected(block, t_end, big_b, EPS / 2, 2)
        assert s.block_spend(block) == mr + update.get(block, Fraction(0))
        assert s.block_spend(block) < 2 * EPS  # with Algorithm 2: 2 eps
    # the block right after a base pays eps/2 + eps/4 + ... for the updates until the next base
    t_g = 128 if big_b == 1 else 256
    if t_g + 1 < t_end:
        # updates at t_g + 2^j up to t_end, below the next base (t_g + t_g)
        j_top = min((t_end - t_g).bit_length() - 1, t_g.bit_length() - 2)
        assert update[t_g] == sum(EPS / 2 / (1 << j) for j in range(j_top + 1))


@pytest.mark.parametrize("w", [3, 7, 15])
def test_sliding_window_theorem_7_over_a_long_run(w):
    s = schedule("sliding-window", window=w)
    k = (w + 1).bit_length() - 1
    bound = EPS / 3 + 2 * sum(EPS / 6 / (1 << i) for i in range(k - 1))  # Theorem 7's split
    assert bound < EPS
    finals = {}
    for step in range(240):
        s.add_block(step, a_block(1, step))
        oldest = step - w + 1  # its last step in the window: its spend is final
        if oldest >= 0:
            finals[oldest] = s.block_spend(oldest)
    assert max(finals.values()) <= bound < EPS
    assert s.max_block_spend() <= bound
    if w == 7:  # in steady state every block pays eps/3 + eps/4 exactly (worked out by hand)
        assert {finals[b] for b in range(11, 200)} == {EPS * 7 / 12}
    with pytest.raises(InvalidParameterError, match="retired"):
        s.block_spend(0)
    assert list(s.kept_steps) == list(range(240 - w, 240))  # the current window


def test_independent_baseline_pays_epsilon_once_per_block():
    s = schedule("independent")
    for step in range(20):
        out = s.add_block(step, a_block(2, step))
        assert [(r.role, r.first_step, r.last_step, r.cost) for r in out] == [
            ("independent", step, step, EPS)]
        assert s.block_spend(step) == EPS
    assert s.max_block_spend() == EPS and list(s.kept_steps) == [19]
    with pytest.raises(InvalidParameterError, match="block 18 was retired"):
        s.block_spend(18)


# --- zCDP ------------------------------------------------------------------------------------


def test_zcdp_multi_resolution_series():
    s = schedule("multi-resolution", base=1, accounting="zcdp", eps=0.5)
    rho = Fraction(1, 2)
    for step in range(128):
        for r in s.add_block(step, a_block(1, step)):
            assert r.cost == rho * 3 / 4 / 4**r.level
    for block in (0, 1, 5, 77):
        assert s.block_spend(block) == mr_expected(block, 128, 1, rho * 3 / 4, 4)
    assert s.block_spend(0) == rho * (1 - Fraction(1, 4**8)) < rho


def test_zcdp_continual_sliding_and_independent_stay_within_rho():
    rho = Fraction(1, 2)
    cont = schedule("continual", base=2, accounting="zcdp", eps=0.5)
    log = []
    for step in range(200):
        cont.add_block(step, a_block(1, step))
        log.extend(cont.trained)
    assert max(alg4_spend(cont, log).values()) < rho
    assert cont.max_block_spend() < 2 * rho
    assert {c.cost for c in log if c.role == "update" and c.level is None} == {rho * 3 / 4}
    for w in (7, 15):
        win = schedule("sliding-window", window=w, accounting="zcdp", eps=0.5)
        for step in range(100):
            win.add_block(step, a_block(1, step))
            for c in win.trained:
                size = c.last_step - c.first_step + 1
                expected = rho / 3 if c.role == "base" else rho / 4 / size**2
                assert c.cost == expected
        assert win.max_block_spend() < rho
    ind = schedule("independent", accounting="zcdp", eps=0.5)
    feed(ind, range(5))
    assert ind.max_block_spend() == rho


# --- sampling (Algorithms 6, 8, sampled sliding window) --------------------------------------


def test_sampling_rate_hits_the_paper_sequence():
    half = Fraction(1, 2)
    assert sampling_rate_at_most(half, half) == 1
    for k in range(1, 12):
        target = half / (1 << k)
        rate = sampling_rate_at_most(half, target)
        amplified = amplified_epsilon(half, rate)
        assert amplified <= target
        assert amplified >= target * (1 - Fraction(1, 10**6))  # the paper's rate, not 1/2^k
        # ln(1 + q(e^a - 1)) is concave in q: rate 1/2^k would cost more than a/2^k
        assert rate < Fraction(1, 1 << k)
        assert amplified_epsilon(half, Fraction(1, 1 << k)) > target


def test_sampled_multi_resolution_theorem_b1():
    train = FakeTrain()
    s = schedule("multi-resolution", base=2, sampling=True, train=train, b0=4)
    for step in range(64):
        before = len(train.calls)
        out = s.add_block(step, a_block(8, step))
        for r, call in zip(out, train.calls[before:], strict=True):
            size = r.last_step - r.first_step + 1
            assert call.normalizer == size * 4.0  # the full nominal size, not the sample's
            assert call.cost == EPS / 2  # noise calibrated to the full size
            if r.level == 0:
                assert r.rate is None and r.cost == EPS / 2 and call.size == 8 * size
            else:
                assert r.rate == sampling_rate_at_most(EPS / 2, EPS / 2 / (1 << r.level))
                assert r.cost <= EPS / 2 / (1 << r.level)
                assert call.size < 8 * size  # sampled
    assert s.max_block_spend() < EPS


def test_sampled_continual_theorem_b3_and_sliding_window():
    cont = schedule("continual", base=1, sampling=True)
    log = []
    for step in range(130):
        cont.add_block(step, a_block(4, step))
        log.extend(cont.trained)
    updates = [c for c in log if c.role == "update" and c.level]
    assert updates and all(c.rate is not None and c.cost <= EPS / 2 / (1 << c.level)
                           for c in updates)
    assert all(c.rate is None for c in log if c.role == "multi-resolution")  # Algorithm 2
    assert max(alg4_spend(cont, log).values()) < EPS
    assert cont.max_block_spend() < 2 * EPS
    win = schedule("sliding-window", window=15, sampling=True)
    for step in range(80):
        win.add_block(step, a_block(4, step))
        for c in win.trained:
            size = c.last_step - c.first_step + 1
            if c.role == "base":
                assert c.rate is None and c.cost == EPS / 3
            elif size == 1:
                assert c.rate is None and c.cost == EPS / 6
            else:
                assert c.rate is not None and c.cost <= EPS / 6 / size
    assert win.max_block_spend() < EPS


# --- empty blocks, the ledger's self-check ---------------------------------------------------


def test_empty_blocks_advance_the_schedule_and_are_charged():
    train = FakeTrain()
    s = schedule("continual", base=2, train=train)
    for step in range(12):
        rows = 0 if step % 3 else 2
        out = s.add_block(step, a_block(rows, step))
        if step >= 1:
            assert any(r.role in ("base", "update") for r in out)
    assert any(c.size == 0 for c in train.calls)
    assert s.block_spend(1) > 0 and s.block_spend(2) > 0
    win = schedule("sliding-window", window=3)
    out = [win.add_block(step, a_block(0, step)) for step in range(6)]
    assert [len(o) for o in out] == [0, 0, 1, 1, 1, 1]


def test_a_step_over_budget_is_refused_and_changes_nothing():
    s = schedule("multi-resolution", base=1)
    feed(s, range(3))
    state = copy.deepcopy(s.to_state())
    s._spend[0] = EPS - Fraction(1, 10**9)  # as if the theorem's sum had failed
    with pytest.raises(BudgetExhaustedError, match="refused step 3: block 0 would spend"):
        s.add_block(3, a_block(2, 3))
    assert s.blocks_seen == 3 and s.block_spend(0) == EPS - Fraction(1, 10**9)
    s._spend[0] = Fraction(state["spend"][0])
    after = s.to_state()
    assert after["spend"] == state["spend"] and after["t"] == 3
    assert len(after["blocks"]) == 3 and after["max_spend"] == state["max_spend"]
    s.add_block(3, a_block(2, 3))


def test_a_trainer_that_misreports_its_cost_is_refused_before_anything_is_committed():
    def bad(spec, block, **kw):
        model = FakeTrain()(spec, block, **kw)
        return PrivateModel(params=model.params, grid=model.grid, noise_std=1.0,
                            cost=model.cost / 2, sensitivity=model.sensitivity,
                            normalizer=model.normalizer, size=model.size)
    s = schedule("independent", train=bad)
    with pytest.raises(InvalidParameterError, match="reported cost"):
        s.add_block(0, a_block(2, 0))
    assert s.blocks_seen == 0 and s.max_block_spend() == 0


# --- noise coordinates, replay, state ---------------------------------------------------------


def test_every_computation_draws_from_its_own_coordinates():
    key = RecordingKey(3)
    s = schedule("sliding-window", window=7, sampling=True, key=key)
    feed(s, range(30))
    noise = [c for c in key.calls if c[-1] == "noise"]
    sample = [c for c in key.calls if c[-1] == "sample"]
    assert len(noise) == len(set(noise)) and sample and len(sample) == len(set(sample))
    assert all(c[:4] == COORDS and c[4] == "erm-release" for c in key.calls)
    assert {c[:-1] for c in sample} <= {c[:-1] for c in noise}
    # the binding digest differs with the parameters (pitfall 13)
    other = RecordingKey(3)
    feed(schedule("sliding-window", window=7, sampling=True, key=other, eps=0.5), range(7))
    assert {c[5] for c in other.calls} != {c[5] for c in key.calls}


def same(a: list[Release], b: list[Release]) -> bool:
    return len(a) == len(b) and all(
        (x.step, x.role, x.level, x.first_step, x.last_step, x.depends_on, x.cost, x.rate)
        == (y.step, y.role, y.level, y.first_step, y.last_step, y.depends_on, y.cost, y.rate)
        and np.array_equal(x.model.params, y.model.params) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("algorithm, extra", [
    ("multi-resolution", {"base": 2}), ("multi-resolution", {"sampling": True}),
    ("continual", {"base": 2}), ("continual", {"sampling": True}),
    ("sliding-window", {"window": 7}), ("sliding-window", {"window": 15, "sampling": True}),
    ("independent", {}), ("continual", {"accounting": "zcdp"}),
])
def test_replay_is_identical_and_snapshot_restore_continues_identically(algorithm, extra):
    first, second = schedule(algorithm, **extra), schedule(algorithm, **extra)
    a, b = feed(first, range(23)), feed(second, range(23))
    assert all(same(a[i], b[i]) for i in range(23))  # same key, same releases
    other = feed(schedule(algorithm, key=NoiseKey.for_tests(99), **extra), range(23))
    assert any(not same(a[i], other[i]) for i in range(23) if a[i])  # another key: other noise
    state = pickle.loads(pickle.dumps(first.to_state()))
    spec = first.spec
    restored = ReleaseSchedule.from_state(state, spec, first.erm, KEY, COORDS, train=FakeTrain())
    assert restored.max_block_spend() == first.max_block_spend()
    for step in range(23, 41):
        block = a_block(3, step)
        assert same(first.add_block(step, block), restored.add_block(step, block))
        assert first.max_block_spend() == restored.max_block_spend()
    assert first.to_state()["spend"] == restored.to_state()["spend"]


def test_state_is_bound_to_its_specs():
    s = schedule("continual", base=2)
    feed(s, range(5))
    state = s.to_state()
    other = ScheduleSpec(algorithm="continual", epsilon=0.5, block_size=10, base_blocks=2)
    with pytest.raises(InvalidParameterError, match="made with schedule"):
        ReleaseSchedule.from_state(state, other, erm_spec(), KEY, COORDS)
    with pytest.raises(InvalidParameterError, match="made with model"):
        ReleaseSchedule.from_state(state, s.spec, erm_spec(d=3), KEY, COORDS)
    broken = dict(state, t=99)
    with pytest.raises(InvalidParameterError, match="inconsistent steps"):
        ReleaseSchedule.from_state(broken, s.spec, erm_spec(), KEY, COORDS)
    with pytest.raises(InvalidParameterError, match="malformed"):
        ReleaseSchedule.from_state({"version": 1, "kind": "erm-release"}, s.spec, erm_spec(),
                                   KEY, COORDS)


# --- with the real trainer (dpstream.core.erm.output_noise.private_erm)
# ------------------------------------


@pytest.mark.parametrize("algorithm, extra", [
    ("continual", {"base": 2}), ("sliding-window", {"window": 3}),
    ("multi-resolution", {"sampling": True}), ("independent", {"accounting": "zcdp"}),
])
def test_the_real_output_perturbation_runs_under_every_schedule(algorithm, extra):
    accounting = extra.get("accounting", "pure")
    model = erm_spec(accounting, classes=("a", "b", "c"))
    spec = ScheduleSpec(algorithm=algorithm, epsilon=1.0, block_size=40,
                        base_blocks=extra.get("base", 1), window_blocks=extra.get("window", 3),
                        sampling=extra.get("sampling", False), accounting=accounting)
    s = ReleaseSchedule(spec, model, KEY, COORDS)
    twin = ReleaseSchedule(spec, model, KEY, COORDS)
    released = 0
    for step in range(7):
        rows = 0 if step == 4 else 40
        block = a_block(rows, step, model)
        out = s.add_block(step, block)
        assert same(out, twin.add_block(step, block))
        for r in out:
            released += 1
            assert r.model.params.shape == (3, model.columns)
            assert np.all(np.isfinite(r.model.params)) and r.model.noise_std > 0
            assert r.model.cost * (1 if r.rate is None else 0) in (0, r.cost)
    assert released and s.max_block_spend() <= spec.budget()


def test_updates_use_their_own_regularization_and_the_accounting_is_unchanged():
    """Algorithm 3's λ (centred computations) is its own; costs stay the paper's fractions."""
    erm = ErmSpec(classes=(0, 1), dimension=2, clip_norm=1.0, regularization=0.01)
    asked = []

    def train(spec, block, *, normalizer, center, level, rng):
        asked.append((center is not None, float(spec.regularization)))
        return private_erm(spec, block, normalizer=normalizer, center=center,
                                      level=level, rng=rng)

    plain = ScheduleSpec(algorithm="continual", epsilon=1.0, block_size=8, base_blocks=2)
    split = ScheduleSpec(algorithm="continual", epsilon=1.0, block_size=8, base_blocks=2,
                         update_regularization=2.0)
    spends = []
    for spec in (plain, split):
        schedule = ReleaseSchedule(spec, erm, NoiseKey.for_tests(1), ("t",), train=train)
        rng = np.random.default_rng(0)
        for step in range(9):
            z = erm.features(rng.normal(size=(8, 2)))
            schedule.add_block(step, Block(z, rng.integers(0, 2, size=8)))
        spends.append([schedule.block_spend(s) for s in range(9)])
    assert spends[0] == spends[1]  # the same fractions of epsilon
    assert {lam for centred, lam in asked if centred} == {0.01, 2.0}
    assert {lam for centred, lam in asked if not centred} == {0.01}
    with pytest.raises(InvalidParameterError, match="update_regularization"):
        ScheduleSpec(algorithm="continual", epsilon=1.0, block_size=8,
                     update_regularization=-1.0)
