"""The bulk noise: the keyed block PRF and the exact vectorized discrete Laplace and Gaussian.

Exactness is tested on every path: the thresholds against high-precision decimals, the
vectorized draws against the scalar reference, the law by chi-square (with a power check),
and the rare paths (a tie ``u = L_k``, the tail ``u < L_K``, a Bernoulli trial the float
screen does not decide) by forcing them.
"""

from __future__ import annotations

import math
from decimal import Decimal, getcontext
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from dpstream.core.noise import bulk as bulk_noise
from dpstream.core.noise import bulk_gaussian
from dpstream.core.noise.bulk import lanes_array, laplace, laplace_one
from dpstream.core.noise.bulk_gaussian import gaussian, gaussian_one
from dpstream.core.noise.coordinates import (
    TAG_BLT,
    TAG_INITIAL,
    TAG_MONITOR_QUERY,
    TAG_TREE,
    JoinedNames,
)
from dpstream.core.noise.keys import NOISE_SCHEME, NoiseKey
from dpstream.core.noise.samplers import discrete_gaussian_variance
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


@pytest.mark.parametrize("scale", [Fraction(1), Fraction(3, 2), Fraction(30), Fraction(10**4)])
def test_the_float_guess_decides_only_what_the_thresholds_decide(scale: Fraction) -> None:
    """Where ``_decided`` says decided, G = #{k : L_k > u} exactly; ties and the tail never are.

    The words sit on every threshold and one either side of it, at both ends of the range and
    at the float guess's blind spots (u below 2^11, whose top 53 bits are 0; u = 2^64 - 1).
    """
    _, descending = bulk_noise._thresholds(scale)
    top = (1 << 64) - 1
    words = {0, 1, (1 << 11) - 1, 1 << 11, (1 << 53) + 1, top - 1, top}
    for threshold in descending[::max(1, len(descending) // 200)] + descending[-1:]:
        words.update({threshold - 1, threshold, min(threshold + 1, top)})
    uniform = np.random.default_rng(7).integers(0, 2**63, 2000, dtype=np.uint64) * 2
    words.update(uniform.tolist())
    u = np.array(sorted(words), dtype=np.uint64)
    g, ok = bulk_noise._decided(u, scale)
    table = np.array(descending, dtype=np.uint64)
    exact = (table[None, :] > u[:, None]).sum(axis=1)  # #{k : L_k > u}, by definition
    tie = np.isin(u, table)
    assert np.array_equal(g[ok], exact[ok])
    assert not (ok & (tie | (exact == len(descending)))).any()
    assert bulk_noise._decided(uniform, scale)[1].mean() > 0.99  # nearly every uniform word
    assert not ok[u == top].any()  # G = 0, left to the exact slow path


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


@pytest.mark.parametrize("names", [
    [f"item-{i:07d}" for i in range(50)],  # one length: the joined bytes read in place
    ["é" * 6, "ab" * 3 + "é" * 3, "x" * 12],  # one byte length, other character counts
    ["a\0b", "\0cd", "ef\0"],  # NUL inside every name: encoded one by one, one length
    ["\0", "", "\0\0", "a"],  # NULs and empty names of several lengths
    ["", ""], [""], ["\ud800" * 4, "k" * 12],  # empty names; a lone surrogate (3 bytes)
])
def test_bulk_lanes_of_joined_names_equal_the_one_by_one_lanes(names: list[str]) -> None:
    words = KEY.lane_words(("inst",), names, ("counter", "d1", 7))
    assert np.array_equal(words, lanes_array(
        [KEY.lane("inst", name, "counter", "d1", 7) for name in names]))


@pytest.mark.parametrize("names", [
    [f"item-{i:07d}" for i in range(50)], ["é" * 6, "x", "", ",", "キー"], ["\ud800k", "a"],
    ["a\0b", "c"], ['q"', "r"], ["s\\", "t"], ["\n"], []])
def test_joined_names_give_the_lanes_of_their_names(names: list[str]) -> None:
    joined = JoinedNames(names)
    assert joined == tuple(names) and isinstance(joined, tuple)
    plain = names and not any(c in '"\\' or ord(c) < 0x20 or 0xD800 <= ord(c) < 0xE000
                              for n in names for c in n)
    if plain:  # the body of their JSON list, which is their bytes in quotes
        assert joined.joined == ",".join(f'"{n}"' for n in names).encode()
    else:
        assert joined.joined is None
    assert np.array_equal(KEY.lane_words(("inst",), joined, ("counter", "d1", 7)),
                          KEY.lane_words(("inst",), list(names), ("counter", "d1", 7)))
    with pytest.raises(InvalidParameterError, match="must be a str"):
        JoinedNames(["a", 3])  # type: ignore[list-item]


def test_bulk_lanes_refuse_a_name_that_is_not_a_str() -> None:
    with pytest.raises(InvalidParameterError, match="must be a str, got b'k'"):
        KEY.lane_words(("i",), ["a", b"k"], ())  # type: ignore[list-item]


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


# --- the vectorized exact discrete Gaussian (noise scheme 4) ------------------------------------

BLT_SIGMA2 = Fraction(2**80) / (2 * Fraction(1, 100))  # sigma_G^2 >= 2^80 / (2 rho), rho = 0.01
SMALL_SIGMA2 = [Fraction(1, 4), Fraction(1), Fraction(5, 2), Fraction(50), Fraction(1000003, 7)]
TINY_SIGMA2 = [Fraction(1, 100), Fraction(1, 2**600)]  # the acceptance is mostly decided exactly
_T_WIDE = int(2**63 / 181.9)  # t near 2^55.5 that rejects about 0.5 % of step 1's words
HUGE_SIGMA2 = [BLT_SIGMA2, Fraction(2**101 + 1, 3), Fraction((_T_WIDE - 1) ** 2 + 1)]


def _blt_sigma2() -> Fraction:
    from dpstream.core.counting.blt_counter import BltCounterSpec

    return BltCounterSpec(rho=0.01).sigma2_grid


def _coordinates(n: int) -> tuple[list[bytes], np.ndarray, np.ndarray, np.ndarray]:
    lanes = [KEY.lane("gauss", "key", i % 97) for i in range(n)]
    epoch = np.arange(n, dtype=np.int64) % 5
    height = np.arange(n, dtype=np.int64) % 3
    index = np.arange(n, dtype=np.int64) * 104729 + 2**40
    return lanes, epoch, height, index


@pytest.mark.parametrize("sigma2", SMALL_SIGMA2 + HUGE_SIGMA2 + ["blt"] + TINY_SIGMA2,
                         ids=lambda s: str(s)[:12])
def test_gaussian_vectorized_draws_equal_the_scalar_reference(sigma2: Fraction | str) -> None:
    """Same bits, same result: the bulk draw at a lane and coordinates is gaussian_one's."""
    sigma2 = _blt_sigma2() if sigma2 == "blt" else sigma2
    assert isinstance(sigma2, Fraction)
    lanes, epoch, height, index = _coordinates(500)
    bulk = gaussian(KEY, lanes_array(lanes), sigma2, TAG_BLT, epoch, height, index)
    assert bulk.dtype == np.int64
    scalar = [gaussian_one(KEY, lane, sigma2, TAG_BLT, int(e), int(h), int(i))
              for lane, e, h, i in zip(lanes, epoch, height, index, strict=True)]
    assert bulk.tolist() == scalar
    assert all(type(value) is int for value in scalar)


def test_gaussian_round_words_are_the_documented_prf() -> None:
    """An independent computation of the module doc's words: AES under the Gaussian key at the
    sub-lane XOR pack(round, group), the sub-lane being the draw's block."""
    import hashlib

    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    secret = hashlib.sha256(b"dpstream-test-key-41").digest()  # NoiseKey.for_tests(41)
    block_key, gauss_key = (hashlib.blake2b(b"", key=secret, digest_size=32, person=p).digest()
                            for p in (b"dpstream-aes2", b"dpstream-gauss4"))

    def aes(key: bytes, first: int, second: int) -> tuple[int, int]:
        out = Cipher(algorithms.AES(key), modes.ECB()).encryptor().update(
            first.to_bytes(8, "little") + second.to_bytes(8, "little"))
        return int.from_bytes(out[:8], "little"), int.from_bytes(out[8:], "little")

    lane = KEY.lane("doc", "k")
    lane0, lane1 = int.from_bytes(lane[:8], "little"), int.from_bytes(lane[8:], "little")
    tag, epoch, height, index = TAG_BLT, 3, 2, 2**50 + 7
    s0, s1 = aes(block_key, lane0 ^ (tag | height << 8 | epoch << 32), lane1 ^ index)
    assert bulk_noise._block_one(KEY, lane, tag, epoch, height, index) == (s0, s1)
    for r in (0, 1, 5, 2**40):
        expected = aes(gauss_key, s0 ^ (r << 8), s1) + aes(gauss_key, s0 ^ (r << 8 | 1), s1)
        assert bulk_gaussian._round_words_one(KEY, s0, s1, r) == expected
        sub = np.array([[s0, s1]], dtype=np.uint64)
        assert bulk_gaussian._round_words(KEY, sub, r)[0].tolist() == list(expected)


@pytest.mark.parametrize("sigma2", [Fraction(5, 2), BLT_SIGMA2], ids=["small", "blt"])
def test_gaussian_draws_do_not_depend_on_the_batch(sigma2: Fraction) -> None:
    """Replay-safe: a draw is the same alone, in a batch of 10,000, shuffled, or in a subset."""
    n = 10_000
    lanes = lanes_array([KEY.lane("batch", f"k{i}") for i in range(n)])
    index = np.arange(n, dtype=np.int64) % 17
    epoch = np.arange(n, dtype=np.int64) // 17
    values = gaussian(KEY, lanes, sigma2, TAG_BLT, epoch, 0, index)
    order = np.random.default_rng(9).permutation(n)
    shuffled = gaussian(KEY, lanes[order], sigma2, TAG_BLT, epoch[order], 0, index[order])
    assert shuffled.tolist() == values[order].tolist()
    subset = order[:313]
    assert gaussian(KEY, lanes[subset], sigma2, TAG_BLT, epoch[subset], 0,
                    index[subset]).tolist() == values[subset].tolist()
    for row in order[:20].tolist():
        alone = gaussian(KEY, lanes[row:row + 1], sigma2, TAG_BLT, int(epoch[row]), 0,
                         int(index[row]))
        assert alone.tolist() == [values[row]]
    other_key = gaussian(NoiseKey.for_tests(42), lanes, sigma2, TAG_BLT, epoch, 0, index)
    other_tag = gaussian(KEY, lanes, sigma2, TAG_INITIAL, epoch, 0, index)
    for other in (other_key, other_tag):
        assert np.mean(other == values) < 0.2  # P(equal) is about 1/(2 sqrt(pi) sigma) only
    assert len(np.unique(values)) > 3


def _gaussian_pmf(sigma2: Fraction, support: np.ndarray) -> np.ndarray:
    s2 = float(sigma2)
    wide = np.arange(-int(40 * math.sqrt(s2)) - 10, int(40 * math.sqrt(s2)) + 11)
    total = np.exp(-(wide.astype(float) ** 2) / (2 * s2)).sum()
    return np.exp(-(support.astype(float) ** 2) / (2 * s2)) / total


def _gaussian_chi_square_p(draws: np.ndarray, assumed: Fraction) -> float:
    """Chi-square p-value of the draws against N_Z(0, assumed); bins below 5 expected pooled."""
    n = draws.size
    bound = int(6 * math.sqrt(float(assumed))) + 2
    support = np.arange(-bound, bound + 1)
    expected = _gaussian_pmf(assumed, support) * n
    inside = (draws >= -bound) & (draws <= bound)
    observed = np.bincount(draws[inside] + bound, minlength=support.size).astype(float)
    keep = expected >= 5
    observed_kept, expected_kept = observed[keep], expected[keep]
    observed_rest, expected_rest = n - observed_kept.sum(), n - expected_kept.sum()
    observed_all = np.append(observed_kept, observed_rest)
    expected_all = np.append(expected_kept, expected_rest)
    return float(stats.chisquare(observed_all, expected_all).pvalue)


@pytest.mark.statistical
@pytest.mark.parametrize("sigma2", [Fraction(1, 4), Fraction(2), Fraction(7, 3), Fraction(50)],
                         ids=str)
def test_gaussian_chi_square_law_with_power(sigma2: Fraction) -> None:
    n = 200_000
    lanes = lanes_array([KEY.lane("gchi", str(sigma2), i) for i in range(1000)])
    draws = gaussian(KEY, np.repeat(lanes, n // 1000, axis=0), sigma2, TAG_BLT, 0, 0,
                     np.tile(np.arange(n // 1000, dtype=np.int64), 1000))
    assert _gaussian_chi_square_p(draws, sigma2) > 1e-4
    assert _gaussian_chi_square_p(draws, sigma2 * Fraction(21, 20)) < 1e-6  # power: 5 % off
    assert _gaussian_chi_square_p(draws, sigma2 * Fraction(20, 21)) < 1e-6
    variance = discrete_gaussian_variance(sigma2)
    assert abs(draws.mean()) < 5 * math.sqrt(variance / n)
    assert abs(np.mean(draws.astype(float) ** 2) - variance) < 5 * variance * math.sqrt(3 / n)


@pytest.mark.statistical
def test_gaussian_huge_sigma_mean_variance_tails_and_low_bits() -> None:
    """BLT-size sigma (about 2^43.6): the draw / sigma is standard normal (discreteness is far
    below any test), and the low-order bits are uniform (an exact U of 63-bit words)."""
    sigma2 = _blt_sigma2()
    sigma = math.sqrt(float(sigma2))
    n = 200_000
    lanes = lanes_array([KEY.lane("huge", i) for i in range(n)])
    draws = gaussian(KEY, lanes, sigma2, TAG_BLT, 0, 0, 7)
    z = draws.astype(float) / sigma
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert abs(np.mean(z**2) - 1) < 5 * math.sqrt(2 / n)
    for cut in (1.0, 2.0, 3.0, 4.0):
        p = 2 * stats.norm.sf(cut)
        assert stats.binomtest(int(np.sum(np.abs(z) > cut)), n, p).pvalue > 1e-4
    assert stats.kstest(z, "norm").pvalue > 1e-4
    assert stats.kstest(z, "norm", args=(0, 1.05)).pvalue < 1e-6  # power: a 5 % wrong sigma
    low = np.bincount((draws % 1024).astype(np.int64), minlength=1024)
    assert stats.chisquare(low).pvalue > 1e-4
    assert 0 < np.sum(draws % 2 == 0) < n


def _force_exact_trials(monkeypatch: pytest.MonkeyPatch) -> list[Fraction]:
    """Make the float screen decide nothing: every D and acceptance trial goes exact."""
    monkeypatch.setattr(bulk_gaussian, "_MARGIN", 1.0)
    monkeypatch.setattr(bulk_gaussian, "_SLACK", 1.0)
    calls: list[Fraction] = []
    original = bulk_gaussian._bernoulli_exact

    def spy(gamma: Fraction, w: int, stream):  # type: ignore[no-untyped-def]
        calls.append(gamma)
        return original(gamma, w, stream)

    monkeypatch.setattr(bulk_gaussian, "_bernoulli_exact", spy)
    return calls


@pytest.mark.parametrize("sigma2", [Fraction(1, 4), Fraction(5, 2), Fraction(1000003, 7),
                                    BLT_SIGMA2], ids=str)
def test_gaussian_with_every_trial_resolved_exactly_gives_the_same_draws(
        monkeypatch: pytest.MonkeyPatch, sigma2: Fraction) -> None:
    """The screen only saves work: with no trial decided by floats the draws are unchanged."""
    n = 300 if sigma2 < 1000 else 60
    lanes, epoch, height, index = _coordinates(n)
    words = lanes_array(lanes)
    screened = gaussian(KEY, words, sigma2, TAG_BLT, epoch, height, index).tolist()
    calls = _force_exact_trials(monkeypatch)
    forced = gaussian(KEY, words, sigma2, TAG_BLT, epoch, height, index).tolist()
    from_bulk = len(calls)
    assert from_bulk >= 2 * n  # at least one D and one acceptance trial per draw, all exact
    assert forced == screened
    assert [gaussian_one(KEY, lane, sigma2, TAG_BLT, int(e), int(h), int(i))
            for lane, e, h, i in zip(lanes, epoch, height, index, strict=True)] == screened
    assert len(calls) == 2 * from_bulk  # the reference made the very same exact trials


@pytest.mark.statistical
def test_gaussian_law_with_every_trial_resolved_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    sigma2 = Fraction(2)
    calls = _force_exact_trials(monkeypatch)
    n = 10_000
    lanes = lanes_array([KEY.lane("forced-law", i) for i in range(n)])
    draws = gaussian(KEY, lanes, sigma2, TAG_BLT, 0, 0, 0)
    assert len(calls) > 2 * n
    assert _gaussian_chi_square_p(draws, sigma2) > 1e-4
    assert _gaussian_chi_square_p(draws, sigma2 * Fraction(5, 4)) < 1e-6  # power at this n


def test_gaussian_ties_and_tails_of_v_take_the_exact_scalar_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Words forced onto a threshold of V (a tie) or below the table (the tail)."""
    _, descending = bulk_noise._thresholds(Fraction(1))
    forced_v = [descending[0], descending[2], 0, 5, descending[-1]]
    real_bulk, real_one = bulk_gaussian._round_words, bulk_gaussian._round_words_one

    def bulk_words(noise, sub, r):  # type: ignore[no-untyped-def]
        words = real_bulk(noise, sub, r).copy()
        if r == 0:
            words[:, 2] = [forced_v[int(s) % 5] for s in sub[:, 1] % np.uint64(5)]
        return words

    def one_words(noise, s0, s1, r):  # type: ignore[no-untyped-def]
        w0, w1, w2, w3 = real_one(noise, s0, s1, r)
        return w0, w1, forced_v[s1 % 5] if r == 0 else w2, w3

    monkeypatch.setattr(bulk_gaussian, "_round_words", bulk_words)
    monkeypatch.setattr(bulk_gaussian, "_round_words_one", one_words)
    resolved: list[int] = []
    original = bulk_noise._resolve_word

    def spy(rng, u, scale):  # type: ignore[no-untyped-def]
        resolved.append(u)
        return original(rng, u, scale)

    monkeypatch.setattr(bulk_gaussian, "_resolve_word", spy)
    sigma2 = Fraction(9)  # t = 4: a tail V >= 34 gives X >= 136, almost always rejected
    lanes, epoch, height, index = _coordinates(400)
    bulk = gaussian(KEY, lanes_array(lanes), sigma2, TAG_BLT, epoch, height, index)
    from_bulk = len(resolved)
    scalar = [gaussian_one(KEY, lane, sigma2, TAG_BLT, int(e), int(h), int(i))
              for lane, e, h, i in zip(lanes, epoch, height, index, strict=True)]
    assert bulk.tolist() == scalar
    assert from_bulk > 100 and {0, int(descending[-1]), int(descending[0])} <= set(resolved)


def test_gaussian_refuses_a_platform_exp_less_accurate_than_assumed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dpstream.errors import DpstreamError

    lanes = lanes_array([KEY.lane("exp")])
    monkeypatch.setattr(bulk_gaussian, "_exp_checked", False)
    bulk_gaussian._check_exp()  # the real ones pass
    for broken in (lambda x: np.exp(x) * (1 + 2.0**-36),
                   lambda x: np.exp(np.maximum(x, -700).astype(np.float32)).astype(np.float64),
                   lambda x: np.exp(x) + 2.0**-60):
        monkeypatch.setattr(bulk_gaussian, "_exp_checked", False)
        monkeypatch.setattr(bulk_gaussian, "_vector_exp", broken)
        with pytest.raises(DpstreamError, match="not within 2\\^-40"):
            gaussian(KEY, lanes, Fraction(2), TAG_BLT, 0, 0, 0)
    monkeypatch.setattr(bulk_gaussian, "_vector_exp", np.exp)
    monkeypatch.setattr(bulk_gaussian, "_exp_checked", False)
    monkeypatch.setattr(bulk_gaussian, "_scalar_exp", lambda x: math.exp(x) * (1 - 2.0**-38))
    with pytest.raises(DpstreamError, match="math.exp"):
        gaussian_one(KEY, KEY.lane("exp"), Fraction(2), TAG_BLT, 0, 0, 0)
    monkeypatch.setattr(bulk_gaussian, "_scalar_exp", math.exp)
    monkeypatch.setattr(bulk_gaussian, "_exp_checked", False)
    assert gaussian_one(KEY, KEY.lane("exp"), Fraction(2), TAG_BLT, 0, 0, 0) == \
        int(gaussian(KEY, lanes, Fraction(2), TAG_BLT, 0, 0, 0)[0])


def test_gaussian_range_and_parameters() -> None:
    lanes = lanes_array([KEY.lane("range")])
    limit = Fraction(2**112)  # t = 2^56 + 1: beyond the int64 range of the bulk sampler
    with pytest.raises(InvalidParameterError, match="too large for int64"):
        gaussian(KEY, lanes, limit, TAG_BLT, 0, 0, 0)
    assert gaussian(KEY, lanes, limit - 1, TAG_BLT, 0, 0, 0).shape == (1,)  # t = 2^56
    wide = gaussian_one(KEY, KEY.lane("range"), Fraction(2**200), TAG_BLT, 0, 0, 0)
    assert type(wide) is int and wide == gaussian_one(KEY, KEY.lane("range"),
                                                      Fraction(2**200), TAG_BLT, 0, 0, 0)
    assert abs(wide) < 40 * 2**100
    for bad in (Fraction(0), Fraction(-1), 1.5, True):
        with pytest.raises(InvalidParameterError, match="variance"):
            gaussian_one(KEY, KEY.lane("range"), bad, TAG_BLT, 0, 0, 0)  # type: ignore[arg-type]
        with pytest.raises(InvalidParameterError, match="variance"):
            gaussian(KEY, lanes, bad, TAG_BLT, 0, 0, 0)  # type: ignore[arg-type]
    assert gaussian(KEY, lanes[:0], Fraction(2), TAG_BLT, 0, 0, 0).shape == (0,)
    assert gaussian_one(KEY, KEY.lane("range"), 3, TAG_BLT, 0, 0, 0) == gaussian_one(
        KEY, KEY.lane("range"), Fraction(3), TAG_BLT, 0, 0, 0)


def test_noise_scheme_4_refuses_a_scheme_3_store() -> None:
    assert NOISE_SCHEME == "dpstream-noise/4"
    state = binding("instance", "mechanisms", KEY)
    state["noise_scheme"] = "dpstream-noise/3"
    with pytest.raises(RecoveryMismatchError, match="noise derivation"):
        check_binding(state, "instance", "mechanisms", KEY)
