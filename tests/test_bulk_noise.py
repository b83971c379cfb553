"""The bulk noise: the keyed block PRF and the exact vectorized discrete Laplace.

Exactness is tested on every path: the thresholds against high-precision decimals, the
vectorized draws against the scalar reference, the law by chi-square (with a power check),
and the rare paths (a tie ``u = L_k``, the tail ``u < L_K``) by forcing them.
"""

from __future__ import annotations

import math
from decimal import Decimal, getcontext
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from dpstream.core import bulk_noise
from dpstream.core.bulk_noise import gaussian, gaussian_one, lanes_array, laplace, laplace_one
from dpstream.core.noise import NOISE_SCHEME, TAG_MONITOR_QUERY, TAG_TREE, NoiseKey
from dpstream.errors import InvalidParameterError, RecoveryMismatchError
from dpstream.stream.barrier import binding, check_binding

KEY = NoiseKey.for_tests(41)
getcontext().prec = 80


def _exp_decimal(gamma: Fraction) -> Decimal:
    return (-(Decimal(gamma.numerator) / Decimal(gamma.denominator))).exp()


@pytest.mark.parametrize("gamma", [Fraction(0), Fraction(1, 30), Fraction(7, 3), Fraction(1),
                                   Fraction(45, 2), Fraction(123456, 1000)])
@pytest.mark.parametrize("bits", [64, 130, 300])
def test_exp_bounds_bracket_the_true_value_tightly(gamma: Fraction, bits: int) -> None:
    lo, hi = bulk_noise._exp_neg_bounds(gamma, bits)
    getcontext().prec = 120
    true = _exp_decimal(gamma) * (Decimal(2) ** bits)
    assert Decimal(lo) <= true <= Decimal(hi)
    assert hi - lo <= 4


@pytest.mark.parametrize("scale", [Fraction(30), Fraction(7, 3), Fraction(2, 5), Fraction(1000)])
def test_thresholds_are_the_exact_floors(scale: Fraction) -> None:
    ascending, descending = bulk_noise._thresholds(scale)
    getcontext().prec = 80
    p = _exp_decimal(1 / scale)
    for k in list(range(1, min(40, len(descending)) + 1)) + [len(descending) // 2 or 1,
                                                              len(descending)]:
        assert descending[k - 1] == int((p**k * Decimal(2) ** 64).to_integral_value("ROUND_FLOOR"))
    assert list(ascending[::-1]) == list(descending)
    assert descending[-1] < 2**16 <= descending[-2] or len(descending) == bulk_noise._MAX_TABLE
    assert all(a >= b for a, b in zip(descending, descending[1:], strict=False))


@pytest.mark.parametrize("scale", [Fraction(30), Fraction(7, 3), Fraction(2, 5), Fraction(2500)])
def test_vectorized_draws_equal_the_scalar_reference(scale: Fraction) -> None:
    lanes = [KEY.lane("flow", "key", i % 37) for i in range(600)]
    index = np.arange(600, dtype=np.int64) * 7919
    epoch = np.arange(600, dtype=np.int64) % 3
    bulk = laplace(KEY, lanes_array(lanes), scale, TAG_TREE, epoch, 2, index)
    scalar = [laplace_one(KEY, lane, scale, TAG_TREE, int(e), 2, int(i))
              for lane, e, i in zip(lanes, epoch, index, strict=True)]
    assert bulk.tolist() == scalar


def test_each_value_depends_only_on_its_lane_and_coordinates() -> None:
    """Replay-safe: a draw does not depend on which other draws are made, nor their order."""
    lanes = lanes_array([KEY.lane("i", f"k{i}") for i in range(500)])
    index = np.arange(500, dtype=np.int64)
    values = laplace(KEY, lanes, Fraction(20), TAG_MONITOR_QUERY, 0, 0, index)
    order = np.random.default_rng(3).permutation(500)
    again = laplace(KEY, lanes[order], Fraction(20), TAG_MONITOR_QUERY, 0, 0, index[order])
    assert again.tolist() == values[order].tolist()
    assert laplace(KEY, lanes[:7], Fraction(20), TAG_MONITOR_QUERY, 0, 0, index[:7]).tolist() \
        == values[:7].tolist()
    other_key = laplace(NoiseKey.for_tests(42), lanes, Fraction(20), TAG_MONITOR_QUERY, 0, 0,
                        index)
    other_tag = laplace(KEY, lanes, Fraction(20), TAG_TREE, 0, 0, index)
    other_height = laplace(KEY, lanes, Fraction(20), TAG_MONITOR_QUERY, 0, 1, index)
    for other in (other_key, other_tag, other_height):
        assert np.mean(other == values) < 0.05  # P(equal) is about 1/(2 * 20 * ...) only


def test_lanes_bind_the_prefix_injectively() -> None:
    assert KEY.lane("ab", "c") != KEY.lane("a", "bc")
    assert KEY.lane(1) != KEY.lane("1")
    assert KEY.lane("x") == KEY.lane("x") != NoiseKey.for_tests(1).lane("x")
    assert len(KEY.lane("x")) == 16


def _laplace_pmf(scale: Fraction, support: np.ndarray) -> np.ndarray:
    p = math.exp(-float(1 / scale))
    return (1 - p) / (1 + p) * p ** np.abs(support)


@pytest.mark.statistical
@pytest.mark.parametrize("scale", [Fraction(3, 2), Fraction(30)])
def test_chi_square_law_with_power(scale: Fraction) -> None:
    n = 400_000
    lanes = lanes_array([KEY.lane("chi", str(scale), i) for i in range(1000)])
    draws = laplace(KEY, np.repeat(lanes, n // 1000, axis=0), scale, TAG_TREE, 0, 0,
                    np.tile(np.arange(n // 1000, dtype=np.int64), 1000))

    def p_value(assumed: Fraction) -> float:
        bound = int(6 * float(assumed)) + 2
        support = np.arange(-bound, bound + 1)
        expected = _laplace_pmf(assumed, support) * n
        observed = np.array([np.sum(draws == x) for x in support], dtype=float)
        tails = n - observed.sum(), n - expected.sum()
        observed = np.append(observed, tails[0])
        expected = np.append(expected, tails[1])
        return float(stats.chisquare(observed, expected).pvalue)

    assert p_value(scale) > 1e-4
    assert p_value(scale * Fraction(21, 20)) < 1e-6  # power: a 5 % wrong scale is caught
    variance = 2 * math.exp(-float(1 / scale)) / (1 - math.exp(-float(1 / scale))) ** 2
    assert abs(draws.mean()) < 5 * math.sqrt(variance / n)


@pytest.mark.statistical
def test_a_tie_is_resolved_with_the_exact_conditional_probability() -> None:
    """u = L_k: G = k with probability frac(2^64 p^k), decided from further bits."""
    scale = Fraction(30)
    _, descending = bulk_noise._thresholds(scale)
    getcontext().prec = 80
    p = _exp_decimal(1 / scale)
    k = next(k for k in range(1, 200)
             if 0.3 < float(p**k * Decimal(2) ** 64 - descending[k - 1]) < 0.7)
    fraction = float(p**k * Decimal(2) ** 64 - descending[k - 1])
    trials = 4000
    hits = 0
    for i in range(trials):
        lane = KEY.lane("tie", i)
        g = bulk_noise._geometric_one(KEY, lane, (TAG_TREE, 0, 0, i), 0, descending[k - 1],
                                      scale, descending)
        assert g in (k - 1, k)
        hits += g == k
    assert stats.binomtest(hits, trials, fraction).pvalue > 1e-4
    assert stats.binomtest(hits, trials, min(fraction + 0.06, 1)).pvalue < 1e-4  # power


@pytest.mark.statistical
def test_the_tail_continues_with_a_fresh_geometric() -> None:
    """u < L_K: G = K + G' with G' geometric (memorylessness), drawn exactly."""
    scale = Fraction(3, 2)
    _, descending = bulk_noise._thresholds(scale)
    size = len(descending)
    trials = 3000
    extra = np.array([bulk_noise._geometric_one(KEY, KEY.lane("tail", i), (TAG_TREE, 0, 0, i),
                                                1, 0, scale, descending) - size
                      for i in range(trials)])
    assert extra.min() >= 0
    p = math.exp(-float(1 / scale))
    support = np.arange(0, 12)
    expected = (1 - p) * p**support * trials
    observed = np.array([np.sum(extra == x) for x in support], dtype=float)
    observed = np.append(observed, trials - observed.sum())
    expected = np.append(expected, trials - expected.sum())
    assert stats.chisquare(observed, expected).pvalue > 1e-4


def test_the_vectorized_path_sends_ties_and_tails_to_the_exact_resolution(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks forced onto a threshold and below the table are decided by the slow path."""
    scale = Fraction(30)
    _, descending = bulk_noise._thresholds(scale)
    forced = np.array([[descending[4], 5], [0, descending[0] + 1], [descending[-1], 0]],
                      dtype=np.uint64)
    monkeypatch.setattr(bulk_noise, "_blocks", lambda *args: forced)
    calls: list[int] = []
    original = bulk_noise._geometric_one

    def spy(*args: object) -> int:
        calls.append(args[4])  # type: ignore[arg-type]
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(bulk_noise, "_geometric_one", spy)
    lane_list = [KEY.lane("forced", i) for i in range(3)]
    drawn = bulk_noise.laplace(KEY, lanes_array(lane_list), scale, TAG_TREE, 0, 0,
                               np.arange(3, dtype=np.int64))
    assert {int(descending[4]), 0, int(descending[-1])} <= set(calls)  # tie, tails: slow path
    expected = [original(KEY, lane, (TAG_TREE, 0, 0, i), 0, int(forced[i, 0]), scale, descending)
                - original(KEY, lane, (TAG_TREE, 0, 0, i), 1, int(forced[i, 1]), scale,
                           descending) for i, lane in enumerate(lane_list)]
    assert drawn.tolist() == expected


def test_coordinates_out_of_range_are_refused() -> None:
    lanes = lanes_array([KEY.lane("x")])
    with pytest.raises(InvalidParameterError, match="index"):
        laplace(KEY, lanes, Fraction(3), TAG_TREE, 0, 0, np.array([-1]))
    with pytest.raises(InvalidParameterError, match="epoch"):
        laplace_one(KEY, KEY.lane("x"), Fraction(3), TAG_TREE, 1 << 32, 0, 0)
    with pytest.raises(InvalidParameterError, match="scale"):
        laplace_one(KEY, KEY.lane("x"), Fraction(0), TAG_TREE, 0, 0, 0)
    with pytest.raises(InvalidParameterError, match="16 bytes"):
        lanes_array([b"short"])


@pytest.mark.statistical
def test_gaussian_bulk_equals_scalar_and_has_the_right_variance() -> None:
    lanes = [KEY.lane("g", i) for i in range(3000)]
    sigma2 = Fraction(25, 2)
    bulk = gaussian(KEY, lanes_array(lanes), sigma2, TAG_TREE, 0, 0, 5)
    assert bulk[:50].tolist() == [gaussian_one(KEY, lane, sigma2, TAG_TREE, 0, 0, 5)
                                  for lane in lanes[:50]]
    variance = float(np.var(bulk))
    assert abs(variance - 12.5) < 5 * 12.5 * math.sqrt(2 / 3000)


def test_a_snapshot_of_another_noise_scheme_is_refused() -> None:
    state = binding("instance", "mechanisms", KEY)
    assert state["noise_scheme"] == NOISE_SCHEME
    check_binding(state, "instance", "mechanisms", KEY)
    old = {k: v for k, v in state.items() if k != "noise_scheme"}
    with pytest.raises(RecoveryMismatchError, match="noise derivation"):
        check_binding(old, "instance", "mechanisms", KEY)


def test_bulk_lanes_equal_the_one_by_one_lanes() -> None:
    names = ["a", "", "é\ud800", "x" * 300, 'q"\\']
    assert KEY.lanes(("inst",), names, ("counter", "d1", 7)) == [
        KEY.lane("inst", name, "counter", "d1", 7) for name in names]
    assert KEY.lanes((), ["k"], ()) == [KEY.lane("k")]
    with pytest.raises(InvalidParameterError):
        KEY.lanes(("i",), [3], ())  # type: ignore[list-item]


def test_bulk_lanes_across_block_boundaries_and_as_words() -> None:
    names = ["k" * n for n in range(45)] + ["é" * n for n in range(1, 14)] + ["a\0", "a"]
    lanes = KEY.lanes(("inst", 3), names, ("monitor", "d" * 40, 2**40))
    assert lanes == [KEY.lane("inst", 3, name, "monitor", "d" * 40, 2**40) for name in names]
    assert len(set(lanes)) == len(names)  # zero padding never merges "a" and "a\0"
    words = KEY.lane_words(("inst", 3), names, ("monitor", "d" * 40, 2**40))
    assert words.dtype == np.uint64 and words.shape == (len(names), 2)
    assert np.array_equal(words, lanes_array(lanes))
    assert KEY.lane_words(("i",), [], ("j",)).shape == (0, 2)


def test_lane_is_the_documented_ecbc_mac() -> None:
    """An independent computation of NoiseKey.lane's docstring: ECBC-MAC over padded units."""
    import hashlib

    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    secret = hashlib.sha256(b"dpstream-test-key-41").digest()  # NoiseKey.for_tests(41)
    k1, k2 = (hashlib.blake2b(b"", key=secret, digest_size=32, person=p).digest()
              for p in (b"dpstream-lcbc3", b"dpstream-lfin3"))

    def aes(key: bytes, block: bytes) -> bytes:
        return Cipher(algorithms.AES(key), modes.ECB()).encryptor().update(block)

    def unit(c: str | int) -> bytes:
        data = (c.encode() if isinstance(c, str)
                else c.to_bytes((c.bit_length() + 8) // 8, "big", signed=True))
        u = (b"s" if isinstance(c, str) else b"i") + len(data).to_bytes(4, "big") + data
        return u + bytes(-len(u) % 16)

    message = b"dpstream-lane/3\0" + b"".join(map(unit, ("inst", "some key", "tree", -5)))
    state = bytes(16)
    for j in range(0, len(message), 16):
        state = aes(k1, bytes(a ^ b for a, b in zip(state, message[j:j + 16], strict=True)))
    assert KEY.lane("inst", "some key", "tree", -5) == aes(k2, state)


def test_lane_bits_are_balanced() -> None:
    words = KEY.lane_words(("inst",), [f"key-{i}" for i in range(20_000)], ("counter", "d", 0))
    bits = np.unpackbits(words.view(np.uint8))
    n = bits.size  # 2.56 M fair bits: the mean is 1/2 within 5 standard deviations
    assert abs(bits.mean() - 0.5) < 5 * 0.5 / math.sqrt(n)
