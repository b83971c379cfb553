"""Multi-limb integers against Python ints; a BLT group against independent BltCounter objects."""

import pickle
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.core.counting import wide_int
from dpstream.core.counting.blt_columns import BltColumns, BltGroup
from dpstream.core.counting.blt_counter import BltCounter, BltCounterSpec
from dpstream.core.counting.blt_parameters import _parameters
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError

KEY = NoiseKey.for_tests(11)
BOUND = 1 << 128  # the proved bound on the buffers (blt_columns docstring)


def edge_ints(max_bits=160):
    """Integers >= 0 with many edge cases: powers of two, all ones, float ties near 2^53."""
    bits = st.integers(0, max_bits)
    return st.one_of(
        st.integers(0, (1 << max_bits) - 1),
        bits.map(lambda b: 1 << b),
        bits.map(lambda b: (1 << b) - 1),
        st.tuples(st.integers(54, max_bits), st.integers(0, 3)).map(  # ties and near ties
            lambda t: ((1 << 53) + (2 * (t[1] >> 1) + 1)) << (t[0] - 54) | (t[1] & 1)),
        st.integers(0, 1 << 20),
    )


# --- wide_int ------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(values=st.lists(edge_ints(), min_size=1, max_size=20))
def test_limbs_roundtrip_and_float_conversion_is_pythons(values):
    limbs = wide_int.from_ints(values)
    assert limbs.dtype == np.uint64 and (limbs < (1 << 32)).all()
    assert wide_int.to_ints(limbs) == values
    assert wide_int.to_ints(limbs.astype(np.uint32)) == values
    assert [f.hex() for f in wide_int.to_float(limbs).tolist()] == [
        float(v).hex() for v in values]
    wider = wide_int.from_ints(values, width=limbs.shape[0] + 2)
    assert wide_int.to_ints(wide_int.trim(wider)) == values
    assert wide_int.trim(wider).shape[0] == limbs.shape[0]


@settings(max_examples=300, deadline=None)
@given(values=st.lists(edge_ints(), min_size=1, max_size=20),
       c=st.one_of(st.integers(0, (1 << 48) - 1), st.just((1 << 48) - 1),
                   st.integers(0, (1 << 96) - 1)),
       bits=st.sampled_from([1, 16, 31, 32, 33, 47, 48, 64, 100]))
def test_mul_round_shift_is_the_counters_round_half_up(values, c, bits):
    got = wide_int.to_ints(wide_int.mul_round_shift(wide_int.from_ints(values), c, bits))
    assert got == [(v * c + (1 << (bits - 1))) >> bits for v in values]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_sums_and_shifts_are_exact(data):
    n = data.draw(st.integers(1, 12))
    terms = [data.draw(st.lists(edge_ints(), min_size=n, max_size=n))
             for _ in range(data.draw(st.integers(1, 6)))]
    got = wide_int.add(*(wide_int.from_ints(t) for t in terms))
    assert wide_int.to_ints(got) == [sum(col) for col in zip(*terms, strict=True)]
    x = data.draw(st.lists(st.integers(0, (1 << 63) - 1), min_size=n, max_size=n))
    bits = data.draw(st.integers(0, 100))
    shifted = wide_int.shift_left(wide_int.from_uint64(np.array(x, dtype=np.int64)), bits)
    assert wide_int.to_ints(shifted) == [v << bits for v in x]


@settings(max_examples=400, deadline=None)
@given(pairs=st.lists(st.tuples(st.one_of(edge_ints(130), st.integers(0, 1 << 64)),
                                st.one_of(st.integers(-(1 << 63), (1 << 63) - 1),
                                          st.integers(-1000, 1000))),
                      min_size=1, max_size=20))
def test_signed_to_float_is_pythons_float_of_the_sum(pairs):
    a = wide_int.from_ints([p[0] for p in pairs])
    z = np.array([p[1] for p in pairs], dtype=np.int64)
    got = wide_int.signed_to_float(a, z)
    assert [f.hex() for f in got.tolist()] == [float(v + w).hex() for v, w in pairs]


def test_extreme_values_at_the_bound():
    """The largest buffers the bound allows: (2^63 - 1) G per step over 2^24 steps."""
    top = [BOUND - 1, (1 << 127) + 12345, ((1 << 63) - 1) << 40, 0, 1]
    limbs = wide_int.from_ints(top)
    assert limbs.shape[0] == 4
    for c in (1, (1 << 48) - 1, 281474976710655 // 3):
        assert wide_int.to_ints(wide_int.mul_round_shift(limbs, c, 48)) == [
            (v * c + (1 << 47)) >> 48 for v in top]
    z = np.array([-(1 << 63), (1 << 63) - 1, -1, -(1 << 63), (1 << 63) - 1], dtype=np.int64)
    assert wide_int.signed_to_float(limbs, z).tolist() == [
        float(v + int(w)) for v, w in zip(top, z.tolist(), strict=True)]
    assert wide_int.to_ints(wide_int.add(limbs, limbs)) == [2 * v for v in top]


def test_a_carry_out_of_the_top_is_refused_not_wrapped():
    acc = np.array([[1 << 32], [(1 << 32) - 1]], dtype=np.uint64)  # not normalized: carries out
    with pytest.raises(ArithmeticError):
        wide_int._normalize(acc)
    with pytest.raises(ValueError):
        wide_int.from_ints([-1])
    with pytest.raises(ValueError):
        wide_int.from_ints([1 << 64], width=2)


# --- a BLT group against BltCounter objects ---------------------------------------------------


def counters_and_group(spec, names, start=3):
    coords = [("inst", k, "counter", "digest", start) for k in names]
    counters = [BltCounter(spec, KEY, c) for c in coords]
    lanes = KEY.lane_words(("inst",), names, ("counter", "digest", start))
    return counters, lanes, BltColumns(spec, len(names))


def grid_ints(columns):
    per_buffer = [wide_int.to_ints(g) for g in columns.grid]
    return [list(v) for v in zip(*per_buffer, strict=True)]


def increments(rng, n, big):
    choices = [0, 0, 1, 2, 7, 1000]
    if big:
        choices += [rng.randint(0, 1 << 40), rng.randint(0, (1 << 63) - 1), (1 << 63) - 1]
    return [rng.choice(choices) for _ in range(n)]


def compare(counters, lanes, columns, rng, steps, big, restore_every=None):
    for t in range(steps):
        x = increments(rng, len(counters), big)
        expected = [c.step(v) for c, v in zip(counters, x, strict=True)]
        values, std = columns.step(KEY, lanes, np.array(x, dtype=np.int64))
        assert [v.hex() for v in values.tolist()] == [e.value.hex() for e in expected], t
        assert {e.std for e in expected} == {std}
        assert columns.steps_done == counters[0].steps_done
        assert grid_ints(columns) == [[int(b) for b in c.to_state()["grid_buffers"]]
                                      for c in counters]
        states = [c.to_state() for c in counters]
        assert columns.inverse.T.tolist() == [s["inverse_buffers"] for s in states]
        assert columns.partial.tolist() == [s["partial"] for s in states]
        if restore_every and t % restore_every == restore_every - 1:
            columns = BltColumns(columns.spec, 0, pickle.loads(pickle.dumps(
                columns.to_state())))
    return columns


@pytest.mark.parametrize("horizon", [16, 32, 2**20])
def test_a_group_is_its_counters_bit_for_bit_across_epochs_and_restores(horizon):
    rng = random.Random(horizon)
    spec = BltCounterSpec(rho=0.5, horizon=horizon)
    names = [f"key-{i}" for i in range(25)]
    counters, lanes, columns = counters_and_group(spec, names)
    columns = compare(counters, lanes, columns, rng, 45, big=True, restore_every=6)
    if horizon <= 32:
        assert columns.epoch >= 1 and columns.base is not None
    assert max(g.shape[0] for g in columns.grid) <= 4  # the proved bound: 128 bits


def test_small_counts_keep_the_buffers_narrow():
    rng = random.Random(5)
    spec = BltCounterSpec(rho=1.0, horizon=2**20)
    names = [f"k{i}" for i in range(40)]
    counters, lanes, columns = counters_and_group(spec, names)
    columns = compare(counters, lanes, columns, rng, 30, big=False)
    widths = [g.shape[0] for g in columns.grid]
    assert widths[0] == 2 and max(widths) <= 3 and all(g.dtype == np.uint32
                                                       for g in columns.grid)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), horizon=st.sampled_from([16, 64, 2**20]),
       n=st.integers(1, 6), steps=st.integers(1, 40), big=st.booleans(),
       rho=st.sampled_from([0.01, 0.5, 4.0]))
def test_property_group_equals_counters(seed, horizon, n, steps, big, rho):
    spec = BltCounterSpec(rho=rho, horizon=horizon)
    counters, lanes, columns = counters_and_group(spec, [f"n{i}" for i in range(n)])
    compare(counters, lanes, columns, random.Random(seed), steps, big, restore_every=5)


def test_keep_and_the_group_wrapper():
    rng = random.Random(9)
    spec = BltCounterSpec(rho=0.5, horizon=16)
    names = [f"g{i}" for i in range(10)]
    counters, lanes, _ = counters_and_group(spec, names, start=0)
    group = BltGroup(spec, 0, 5, np.arange(10, dtype=np.int32), list(names), lanes,
                     np.arange(10, dtype=np.float64), 2.5)
    for t in range(30):
        if t == 12:
            mask = np.array([i % 3 != 0 for i in range(len(counters))])
            group.keep(mask)
            counters = [c for c, m in zip(counters, mask.tolist(), strict=True) if m]
        inc = np.array(increments(rng, 10, True), dtype=np.int64)
        value, variance = group.step(KEY, inc)
        expected = [c.step(int(v)) for c, v in zip(counters, inc[group.rows].tolist(),
                                                    strict=True)]
        assert value.tolist() == [float(i) + e.value for i, e in zip(
            group.initial.tolist(), expected, strict=True)]
        assert variance == 2.5 + expected[0].std ** 2
    state = group.to_state()
    again = BltGroup(spec, state["start"], state["code"], state["rows"], group.keys,
                     group.lanes, state["initial"], state["initial_var"], state["counter"])
    assert again.counter.to_state()["epoch"] == group.counter.epoch


def test_a_state_of_another_spec_is_refused():
    spec = BltCounterSpec(rho=0.5, horizon=16)
    columns = BltColumns(spec, 3)
    state = columns.to_state()
    with pytest.raises(InvalidParameterError):
        BltColumns(BltCounterSpec(rho=0.5, horizon=32), 0, state)
    with pytest.raises(InvalidParameterError):
        BltColumns(spec, 0, {**state, "grid": state["grid"][:2]})
    assert _parameters(16).buffers == len(state["grid"])
