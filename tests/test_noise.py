"""Exact samplers (CKS 2020) and the replay-safe PRF randomness."""

import base64
import math
import pickle
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import (
    bernoulli_exp,
    discrete_gaussian,
    discrete_gaussian_variance,
    discrete_laplace,
    discrete_laplace_variance,
)
from dpstream.errors import InvalidParameterError, NoiseKeyError

KEY = NoiseKey.for_tests(7)


def draws(sampler, param, n, tag):
    return np.array([sampler(KEY.stream(tag, i), param) for i in range(n)])


def laplace_pmf(x, scale):
    p = math.exp(-1 / scale)
    return (1 - p) / (1 + p) * np.exp(-np.abs(x) / scale)


def gaussian_pmf(x, sigma2):
    support = np.arange(-int(40 * math.sqrt(sigma2)) - 2, int(40 * math.sqrt(sigma2)) + 3)
    norm = np.exp(-(support**2) / (2 * sigma2)).sum()
    return np.exp(-(np.asarray(x) ** 2) / (2 * sigma2)) / norm


def chi_square_pvalue(samples, pmf, lo, hi):
    """Pearson chi-square against the exact pmf, with the tails pooled into two bins."""
    n = len(samples)
    inner = np.arange(lo, hi + 1)
    observed = [np.sum(samples < lo)] + [np.sum(samples == v) for v in inner] + [
        np.sum(samples > hi)]
    p_inner = pmf(inner)
    p_low = pmf(np.arange(lo - 2000, lo)).sum()
    p_high = pmf(np.arange(hi + 1, hi + 2001)).sum()
    expected = n * np.concatenate([[p_low], p_inner, [p_high]])
    keep = expected >= 5  # Pearson's rule; merged bins below are negligible here
    obs = np.array(observed)[keep]
    exp = expected[keep] * obs.sum() / expected[keep].sum()
    return stats.chisquare(obs, exp).pvalue


# --- determinism and key handling --------------------------------------------------------

def test_same_coordinates_same_noise_and_different_coordinates_differ():
    a = [discrete_laplace(KEY.stream("flow", "k", 1), Fraction(3)) for _ in range(3)]
    assert len(set(a)) == 1
    others = {discrete_laplace(KEY.stream("flow", "k", i), Fraction(30)) for i in range(50)}
    assert len(others) > 20
    assert (discrete_laplace(NoiseKey.for_tests(8).stream("flow", "k", 1), Fraction(1000))
            != discrete_laplace(KEY.stream("flow", "k", 1), Fraction(1000)))


def test_coordinate_encoding_is_injective():
    # ("ab", "c") and ("a", "bc") must not share a stream; neither may 1 and "1".
    s1, s2 = KEY.stream("ab", "c"), KEY.stream("a", "bc")
    assert [s1.randbelow(2**60) for _ in range(3)] != [s2.randbelow(2**60) for _ in range(3)]
    s3, s4 = KEY.stream(1), KEY.stream("1")
    assert s3.randbelow(2**60) != s4.randbelow(2**60)


def test_key_is_never_pickled_or_shown():
    with pytest.raises(TypeError):
        pickle.dumps(KEY)
    assert KEY._key.hex() not in repr(KEY)


def test_key_parsing_and_errors(tmp_path):
    raw = bytes(range(32))
    assert NoiseKey.parse(raw.hex(), source="t").fingerprint() == NoiseKey(raw).fingerprint()
    (tmp_path / "k").write_text(raw.hex() + "\n")
    (tmp_path / "k").chmod(0o600)  # a key file must be private to its owner (see below)
    assert NoiseKey.from_environment({"DPSTREAM_NOISE_KEY_FILE": str(tmp_path / "k")})
    with pytest.raises(NoiseKeyError, match="no noise key"):
        NoiseKey.from_environment({})
    with pytest.raises(NoiseKeyError, match="64 hex") as info:
        NoiseKey.from_environment({"DPSTREAM_NOISE_KEY": "abc123"})
    assert "abc123" not in str(info.value)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602, 0o660])
def test_a_key_file_others_can_access_is_refused(tmp_path, mode):
    path = tmp_path / "k"
    path.write_text(bytes(range(32)).hex())
    path.chmod(mode)
    with pytest.raises(NoiseKeyError) as info:
        NoiseKey.from_environment({"DPSTREAM_NOISE_KEY_FILE": str(path)})
    message = str(info.value)
    assert str(path) in message and f"mode {mode:04o}" in message
    assert f"chmod 600 {path}" in message
    assert bytes(range(32)).hex() not in message
    for private in (0o600, 0o400):
        path.chmod(private)
        assert NoiseKey.from_file(path).fingerprint() == NoiseKey(bytes(range(32))).fingerprint()


def test_a_missing_key_file_is_named():
    with pytest.raises(NoiseKeyError, match="cannot read the noise key file /nonexistent/k"):
        NoiseKey.from_file("/nonexistent/k")


@pytest.mark.parametrize(("raw", "why"), [
    (bytes(32), "all 32 bytes equal"),
    (b"\xff" * 32, "all 32 bytes equal"),
    (bytes.fromhex("11" * 32), "all 32 bytes equal"),
    (bytes(range(7)) * 4 + bytes(4), "only 7 distinct byte values"),
    (b"ab" * 16, "only 2 distinct byte values"),
], ids=["zero", "ff", "hex-11", "seven-values", "ab"])
def test_obviously_weak_keys_are_refused(raw, why):
    with pytest.raises(NoiseKeyError, match=why):
        NoiseKey(raw)
    for text, source in ((raw.hex(), "$DPSTREAM_NOISE_KEY"),
                         (base64.b64encode(raw).decode(), "$DPSTREAM_NOISE_KEY")):
        with pytest.raises(NoiseKeyError, match=why) as info:
            NoiseKey.from_environment({"DPSTREAM_NOISE_KEY": text})
        assert source in str(info.value) and text not in str(info.value)


def test_eight_distinct_byte_values_are_enough():
    assert NoiseKey(bytes(range(8)) * 4)  # the crude check only catches obvious mistakes


@pytest.mark.parametrize("raw", [bytes(range(16)), bytes(range(31)), bytes(range(33)), b""])
def test_a_key_of_the_wrong_length_is_refused(raw):
    with pytest.raises(NoiseKeyError, match="exactly 32 bytes"):
        NoiseKey(raw)
    with pytest.raises(NoiseKeyError, match="64 hex"):
        NoiseKey.parse(raw.hex(), source="t")


def test_generated_keys_pass_the_weak_key_check():
    assert len({NoiseKey.generate().fingerprint() for _ in range(200)}) == 200


def test_randbelow_is_uniform_over_a_non_power_of_two():
    rng = KEY.stream("uniform")
    counts = np.bincount([rng.randbelow(6) for _ in range(60_000)], minlength=6)
    assert stats.chisquare(counts).pvalue > 1e-4


def test_parameters_are_validated():
    with pytest.raises(InvalidParameterError, match="scale must be > 0"):
        discrete_laplace(KEY.stream(0), Fraction(0))
    with pytest.raises(InvalidParameterError, match="variance must be > 0"):
        discrete_gaussian(KEY.stream(0), Fraction(-1))
    with pytest.raises(InvalidParameterError):
        KEY.stream(1.5)


# --- statistical tests of the samplers ------------------------------------------------------
# Each chi-square test rejects a correct sampler with probability 1e-4 (the p-value threshold);
# all draws are deterministic given the test key, so the suite is reproducible.

@pytest.mark.statistical
def test_bernoulli_exp_probability():
    n = 40_000
    for gamma in (Fraction(1, 3), Fraction(5, 2)):
        hits = sum(bernoulli_exp(KEY.stream("bexp", str(gamma), i), gamma) for i in range(n))
        p = math.exp(-float(gamma))
        # normal approximation: |hits - np| <= 4.5 sigma fails with prob ~7e-6
        assert abs(hits - n * p) <= 4.5 * math.sqrt(n * p * (1 - p))


@pytest.mark.statistical
@pytest.mark.parametrize("scale", [Fraction(1, 2), Fraction(3), Fraction(21)])
def test_discrete_laplace_matches_its_pmf(scale):
    samples = draws(discrete_laplace, scale, 30_000, f"lap{scale}")
    spread = int(4 * float(scale)) + 2
    assert chi_square_pvalue(samples, lambda x: laplace_pmf(x, float(scale)), -spread,
                             spread) > 1e-4
    # variance: the sample variance of n draws has relative sd ~ sqrt((kurtosis-1)/n)
    # (kurtosis 6 for Laplace) -> 1.3% at n=30000; 5 sd = 6.5%.
    assert samples.var() == pytest.approx(discrete_laplace_variance(scale), rel=0.065)


@pytest.mark.statistical
@pytest.mark.parametrize("sigma2", [Fraction(1, 4), Fraction(2), Fraction(30)])
def test_discrete_gaussian_matches_its_pmf(sigma2):
    samples = draws(discrete_gaussian, sigma2, 30_000, f"gau{sigma2}")
    spread = int(4 * math.sqrt(sigma2)) + 1
    assert chi_square_pvalue(samples, lambda x: gaussian_pmf(x, float(sigma2)), -spread,
                             spread) > 1e-4
    # relative sd of the sample variance ~ sqrt(2/n) = 0.8%; 5 sd = 4%.
    assert samples.var() == pytest.approx(discrete_gaussian_variance(sigma2), rel=0.04)


@pytest.mark.statistical
def test_chi_square_has_power_against_a_wrong_scale():
    """The same test rejects samples drawn at a 10% larger scale: it can fail."""
    samples = draws(discrete_laplace, Fraction(33, 10), 30_000, "power")
    assert chi_square_pvalue(samples, lambda x: laplace_pmf(x, 3.0), -14, 14) < 1e-4


def test_gaussian_variance_small_sigma():
    assert discrete_gaussian_variance(Fraction(1, 100)) < 0.01
    assert discrete_gaussian_variance(200) == 200


def test_coordinates_have_an_explicit_version_independent_encoding():
    """Issue 5, item 7: type tags, 4-byte length prefixes, UTF-8; never ``repr``.

    U+1FAE8 (shaking face) was added in Unicode 15: Python 3.11 and 3.12 print it differently
    in ``repr``, so a repr-based encoding gave such a key other noise after an upgrade.
    """
    from dpstream.core.noise.coordinates import encode_coordinates

    coords = ("i", "k\U0001FAE8", 300, -1)
    assert encode_coordinates(coords) == (
        b"dpstream-coordinates/1"
        b"s\x00\x00\x00\x01i"
        b"s\x00\x00\x00\x05k\xf0\x9f\xab\xa8"
        b"i\x00\x00\x00\x02\x01,"
        b"i\x00\x00\x00\x01\xff")
    assert repr(coords).encode() not in encode_coordinates(coords)
    # pinned: the noise of these coordinates under a test key, on every Python version
    assert NoiseKey.for_tests(0).stream(*coords[:3]).randbelow(2**64) == 7053173971785022196
    lone_surrogate = encode_coordinates(("\ud800",))
    assert lone_surrogate.endswith(b"\xed\xa0\x80")  # every str has exactly one encoding
