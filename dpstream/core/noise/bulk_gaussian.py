"""Exact discrete Gaussian noise for many releases at once, from a keyed block PRF.

The BLT counter's noise (and the zCDP initial counts) of every release of a step, drawn together. As
for the discrete Laplace of :mod:`dpstream.core.noise.bulk`, each draw is a pure function of the
secret key, its lane and its coordinates (replay-safe: a replay after a crash reproduces every
value, whatever other keys exist and in whatever order), and each is exactly distributed.

**Exact discrete Gaussian** ``N_Z(0, sigma2)``, ``sigma2 > 0`` rational (CKS 2020, Algorithms 2
and 3). With ``t = floor(sigma) + 1`` a draw runs *rounds* until one succeeds and returns that
round's value. Round ``r`` reads four 64-bit words ``w0 .. w3`` (see "Words" below):

1. ``a = w0 >> 1`` (63 bits): the round fails if ``a >= 2^63 - (2^63 mod t)``, else
   ``U = a mod t``, uniform on ``{0, ..., t - 1}``; the sign ``B`` is the low bit of ``w0``;
2. ``D ~ Bernoulli(exp(-U/t))`` from ``w1``; the round fails if ``D = 0``;
3. ``V``, geometric with ``P(V >= k) = e^-k`` (the number of Bernoulli(exp(-1)) successes
   before the first failure), from ``w2`` with the thresholds of scale 1, decided exactly as
   for the discrete Laplace of :mod:`dpstream.core.noise.bulk` (a tie, or the tail
   ``V >= K = 34``, by :func:`_resolve_word`);
4. ``X = U + t V``; the round fails if ``B = 1`` and ``X = 0``, else ``Y = (-1)^B X``;
5. ``A ~ Bernoulli(exp(-(X - sigma2/t)^2 / (2 sigma2)))`` from ``w3``: the round succeeds with
   ``Y`` if ``A = 1``, else fails.

Steps 1-4 are Algorithm 2 for the discrete Laplace of scale ``t``: given the step-1 and step-2
successes, ``P(U = u) ∝ e^(-u/t)``, so ``X = U + t V`` has ``P(X = x) ∝ e^(-x/t)`` and the sign
step makes ``P(Y = y) ∝ e^(-|y|/t)``. Step 5 is Algorithm 3's rejection:
``e^(-|y|/t) e^(-(|y| - sigma2/t)^2 / (2 sigma2)) = e^(-y^2 / (2 sigma2)) e^(-sigma2 / (2 t^2))``,
so the value of a round, given that it succeeds, has exactly the law ``N_Z(0, sigma2)``. Every
failure restarts with a fresh round (this merges the nested loops of Algorithms 2 and 3: each
restart of either is a fresh independent attempt, so the first successful round has the law of
one round conditioned on success); step 1's rejection of ``a`` is one more independent failure
event, after which ``U`` is exactly uniform. Rounds read disjoint words, so they are independent.

**Bernoulli(exp(-gamma)) from a word.** A word ``w`` is the first 64 bits of a uniform
``U' in [0, 1)`` and the trial succeeds iff ``U' < exp(-gamma)``. Its top 53 bits
``w53 = w >> 11`` give ``U' in [w53, w53 + 1) / 2^53``. With ``e`` the platform's
``exp(-gamma_f)`` (``gamma_f`` a float value of ``gamma``) and, computed in float64,

    lo = e (1 - 2^-30) - 2^-64,    hi = e (1 + 2^-30) + 2^-64,

the trial is *decided* when ``(w53 + 1) / 2^53 <= lo`` (then ``U' < exp(-gamma)``: success) or
``w53 / 2^53 >= hi`` (then ``U' >= exp(-gamma)``: failure); both sides are exact floats (``w53``
is an integer below ``2^53``; ``lo`` and ``hi`` are kept multiplied by ``2^53``, an exact
scaling), so these comparisons are exact. They are sound when ``lo <= exp(-gamma) <= hi``,
which follows from

(a) ``|gamma_f - gamma| <= 2^-34``, and
(b) ``|exp_f(x) - e^x| <= 2^-40 e^x + 2^-70`` for every float64 ``x <= 0``, for ``np.exp`` (on
    arrays) and ``math.exp``:

then ``exp(-gamma)`` is within relative ``2^-33.8`` plus absolute ``2^-69.9`` of ``e``, and the
two roundings of each bound (``2^-52`` relative; a subnormal ``e`` is absorbed by the absolute
term) stay far inside the margin ``2^-30`` / ``2^-64``. For (a): with ``gamma = U/t``,
``gamma_f = fl(fl(U) fl(1/t))`` has relative error below ``2^-50`` and ``gamma < 1``. For step 5
the vectorized path computes ``gamma_f = fl(fl(fl(X) - c)^2 h)``, ``c = fl(sigma2/t)``,
``h = fl(1/(2 sigma2))``: every rounding is at most ``2^-52`` relative, and bounding
``|X - sigma2/t| <= X + sigma2/t`` gives ``|gamma_f - gamma| <= 2^-49 M`` with
``M = (X + sigma2/t)^2 / (2 sigma2)``. The trial is screened only where ``fl(M) <= 2^14``, so
the error is at most about ``2^-35`` (this holds for all of the table at once when
``(t K + sigma2/t)^2 / (2 sigma2) <= 2^14``, checked exactly; otherwise ``fl(M)`` is checked per
draw). The scalar path computes ``gamma_f`` as the correctly rounded quotient of exact integers
(error ``<= 2^-53 gamma``) and screens only ``gamma_f <= 2^19``. (b) is an assumption about the
platform (numpy's and libm's exp claim a few ulp, about ``2^-51``); on first use
:func:`_check_exp` compares both with the exact integer bounds of :func:`_exp_neg_bounds` at
220 points and raises :class:`~dpstream.errors.DpstreamError` if either is off by more than (b)
allows.

A trial the bounds do not decide (probability about ``2^-29``, or ``M > 2^14``) is resolved
exactly, as a tie of the thresholds is: ``U'`` gets 64 more bits at a time from the scalar
BLAKE2b stream at the draw's sub-lane, round and word (:func:`_bernoulli_exact`), compared with
:func:`_exp_neg_bounds` of the exact rational ``gamma`` until decided. Every trial is thus
decided exactly as ``U'`` itself would decide it: ``D``, ``V`` and ``A`` have exactly their
laws, the draws exactly ``N_Z(0, sigma2)``, and the outcome of a trial does not depend on
which path decided it.

**Words.** A draw at ``(lane, tag, epoch, height, index)`` has the *sub-lane* ``S``: the PRF
block of :mod:`dpstream.core.noise.bulk` at those coordinates. Round ``r`` reads the words of
the two blocks

    AES-256_KG( S XOR pack(r, g) ),    g = 0, 1

(``w0, w1`` from ``g = 0``, ``w2, w3`` from ``g = 1``), where ``KG`` is the Gaussian key
(:meth:`~dpstream.core.noise.keys.NoiseKey.encrypt_gaussian_blocks`: BLAKE2b of the secret under
its own personalisation, independent of the block key) and ``pack`` puts ``2^8 r + g`` in the first
64-bit little-endian word (``r < 2^56``: injective). One draw's inputs are distinct. Two draws'
sub-lanes are AES outputs at distinct inputs (distinct coordinates of a lane, or two lanes barring
the ``2^-128`` collision of :mod:`dpstream.core.noise.bulk`), hence distinct and pseudorandom, so
``S XOR c`` and ``S' XOR c'`` meet only if ``S XOR S' = c XOR c'``: probability at most
``R^2 2^-128`` for two draws of at most ``R`` rounds each. Barring that, the words are outputs of a
PRP under an independent key on distinct inputs: computationally independent uniform words
(switching term ``q^2 / 2^129``), independent of ``S`` as well, and no input under ``KG`` can meet
an input under the block key (the Laplace draws', the sub-lanes'). A draw is therefore a pure
function of the key, its lane and its coordinates, whatever else is in the batch and in any order.

:func:`gaussian` runs the rounds of all pending draws at once and hands a draw whose round has
an undecided trial (or a tie or tail of ``V``, or ``fl(M) > 2^14``) to the scalar round
:func:`_round_one` on the same words (and the last few draws of a batch to scalar rounds
altogether); :func:`gaussian_one` is the readable reference, the same rounds on the same words
one draw at a time, so the two agree bit for bit.

**Range.** :func:`gaussian` returns int64; it needs ``t <= 2^56`` (``sigma2 < 2^112``; the BLT
counter's ``sigma_G`` is about ``2^50.8`` at ``rho = 10^-6`` and horizon ``2^24`` and reaches
``2^56`` only below ``rho`` of about ``7 10^-10``) and raises
:class:`~dpstream.errors.InvalidParameterError` beyond. There every vectorized quantity fits:
``X < K t < 2^62``, and a value from the scalar round is checked to fit int64 (one that does not
would need ``gamma > 2^12``, probability below ``e^-4000``). :func:`gaussian_one` returns a
Python int for any ``sigma2``; for ``t > 2^56`` it runs Algorithm 3
(:func:`~dpstream.core.noise.samplers.discrete_gaussian`) on the scalar BLAKE2b stream at the
sub-lane.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Final

import numpy as np
import numpy.typing as npt

from dpstream.core.noise.bulk import (
    _WORD,
    Index,
    IntArray,
    WordArray,
    _block_one,
    _blocks,
    _decided,
    _exp_neg_bounds,
    _negated,
    _resolve_word,
    _thresholds,
)
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import RandomIntegers, discrete_gaussian
from dpstream.errors import DpstreamError, InvalidParameterError

__all__ = [
    "gaussian",
    "gaussian_one",
]

_GAUSSIAN_RESOLVE: Final = "dpstream-noise/4 gaussian resolve"
"""The scalar stream of an undecided trial of a Gaussian round: ``(sub-lane, round, word)``."""
_GAUSSIAN_WIDE: Final = "dpstream-noise/4 gaussian wide"
"""The scalar stream of :func:`gaussian_one` beyond the word range (``t > 2^56``)."""
_MAX_T: Final = 1 << 56
"""The largest ``t = floor(sigma) + 1`` drawn from the round words (and by :func:`gaussian`)."""
_MAX_ROUNDS: Final = 1 << 56
_ROUND_WORDS: Final = 4
_MARGIN: float = 2.0**-30
"""Relative margin of the float screen of Bernoulli(exp(-gamma)) (module doc, (a) and (b))."""
_SLACK: float = 2.0**-64
"""Absolute margin of the float screen."""
_M_LIMIT: Final = 2.0**14
"""The acceptance trial is screened only where ``(X + sigma2/t)^2 / (2 sigma2) <= 2^14``."""
_SCALAR_GAMMA_LIMIT: Final = 2.0**19
"""The scalar path screens only ``gamma_f <= 2^19`` (its ``gamma_f`` is within ``2^-53 gamma``)."""
_EXP_RELATIVE: Final = Fraction(1, 1 << 40)
_EXP_ABSOLUTE: Final = Fraction(1, 1 << 70)
_CHUNK: Final = 1 << 16
"""Draws per vectorized batch (keeps the working arrays in cache)."""
_SCALAR_TAIL: Final = 4
"""When at most this many draws of a batch are left, their rounds run in plain Python."""
_ONE: Final = Fraction(1)
"""The scale of ``V``'s thresholds: ``L_k = floor(2^64 e^-k)``."""
_TWO_53: Final = 2.0**53
_vector_exp: Callable[[npt.NDArray[np.float64]], npt.NDArray[np.float64]] = np.exp
"""The platform exp the vectorized screen uses (a module attribute so a test can replace it)."""
_scalar_exp: Callable[[float], float] = math.exp
"""The platform exp the scalar screen uses."""
_exp_checked = False


@dataclass(frozen=True)
class _GaussianParameters:
    """What the rounds of ``N_Z(0, sigma2)`` need, computed once per ``sigma2``."""

    sigma2: Fraction
    t: int
    """``floor(sigma) + 1``, the discrete Laplace proposal's scale."""
    limit: int
    """Step 1 accepts ``a < limit = 2^63 - (2^63 mod t)``."""
    inverse_t: float
    """``fl(1/t)``."""
    centre: float
    """``fl(sigma2/t)``."""
    inverse_two_sigma2: float
    """``fl(1/(2 sigma2))``; ``inf`` for ``sigma2 < 2^-500`` (nothing is screened then)."""
    screen_all: bool
    """Whether ``(t K + sigma2/t)^2 / (2 sigma2) <= 2^14`` (exactly): no per-draw check of M."""


@functools.lru_cache(maxsize=64)
def _gaussian_parameters(sigma2: Fraction) -> _GaussianParameters:
    t = math.isqrt(sigma2.numerator // sigma2.denominator) + 1  # floor(sqrt(s)) = isqrt(floor(s))
    limit = (1 << 63) - (1 << 63) % t
    if t > _MAX_T:  # gaussian_one's wide path: no words, no floats
        return _GaussianParameters(sigma2, t, limit, math.nan, math.nan, math.nan, False)
    centre = sigma2 / t
    inverse = 1 / (2 * sigma2)
    size = len(_thresholds(_ONE)[1])
    screen_all = (t * size + centre) ** 2 * inverse <= Fraction(_M_LIMIT)
    small = sigma2 < Fraction(1, 1 << 500)  # 1/(2 sigma2) near overflow: screen nothing
    return _GaussianParameters(sigma2, t, limit, 1 / t, float(centre),
                               math.inf if small else float(inverse), screen_all and not small)


def _positive_variance(sigma2: Fraction | int) -> Fraction:
    if isinstance(sigma2, bool) or not isinstance(sigma2, Fraction | int) or sigma2 <= 0:
        raise InvalidParameterError(
            f"discrete Gaussian variance must be a Fraction > 0, got {sigma2!r}")
    return Fraction(sigma2)


def _exp_check_points() -> list[float]:
    """About 220 points ``gamma >= 0`` at which :func:`_check_exp` tests ``exp(-gamma)``."""
    golden = (math.sqrt(5) - 1) / 2
    points = [0.0, 2.0**-60, 2.0**-30, 1e-300, 5e-324, 0.5, 1.0, 2.0, 1 / 3, 10.0, 33.0, 49.75]
    points += [50.0 * ((k * golden) % 1.0) for k in range(1, 201)]  # full-mantissa points
    points += [60.0, 100.0, 500.0, 708.5, 744.4, 745.2, 800.0, 1e4, 2.0**19, 1e300]
    return points


def _exp_within_assumption(gamma: float, values: Sequence[float]) -> bool:
    """Whether each ``e`` of ``values`` is within ``2^-40 exp(-gamma) + 2^-70`` of ``exp(-gamma)``.

    Checked exactly, by sufficient conditions from the integer bounds
    ``lo <= 2^96 exp(-gamma) <= hi``; beyond ``gamma = 50``, ``exp(-gamma) < 2^-72`` and
    ``0 <= e <= 2^-71`` suffices.
    """
    if not all(math.isfinite(e) and e >= 0 for e in values):
        return False
    if gamma > 50:
        return all(e <= 2.0**-71 for e in values)
    bits = 96
    lo, hi = _exp_neg_bounds(Fraction(gamma), bits)
    absolute = _EXP_ABSOLUTE * (1 << bits)
    low, high = hi * (1 - _EXP_RELATIVE) - absolute, lo * (1 + _EXP_RELATIVE) + absolute
    return all(low <= Fraction(e) * (1 << bits) <= high for e in values)


def _check_exp() -> None:
    """Check assumption (b) of the module doc for ``np.exp`` and ``math.exp``, once.

    Raises:
        DpstreamError: the platform's exp is less accurate than the float screen assumes.
    """
    global _exp_checked
    if _exp_checked:
        return
    points = _exp_check_points()
    vector = _vector_exp(-np.array(points, dtype=np.float64)).tolist()  # numpy's array loop
    for gamma, from_numpy in zip(points, vector, strict=True):
        from_math = _scalar_exp(-gamma)
        if not _exp_within_assumption(gamma, (from_numpy, from_math)):
            raise DpstreamError(
                f"exp(-{gamma!r}) is {from_numpy!r} by numpy and {from_math!r} by math.exp: "
                "one is not within 2^-40 relative (+ 2^-70) of the exact value, the accuracy "
                "the exact discrete Gaussian's float screen assumes "
                "(dpstream.core.noise.bulk), so it refuses to run on this platform")
    _exp_checked = True


def _screen_one(e: float, w: int) -> bool | None:
    """Decide ``U' < exp(-gamma)`` from ``w``'s top 53 bits and ``e = exp_f(-gamma_f)``, or None."""
    w53 = w >> 11
    if w53 + 1 <= e * ((1 - _MARGIN) * _TWO_53) - _SLACK * _TWO_53:
        return True
    if w53 >= e * ((1 + _MARGIN) * _TWO_53) + _SLACK * _TWO_53:
        return False
    return None


def _screen(e: npt.NDArray[np.float64],
            w: WordArray) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """:func:`_screen_one` for arrays: ``(decided success, decided failure)``."""
    w53 = (w >> np.uint64(11)).astype(np.float64)  # an integer below 2^53: exact
    success = w53 + 1.0 <= e * ((1 - _MARGIN) * _TWO_53) - _SLACK * _TWO_53
    failure = w53 >= e * ((1 + _MARGIN) * _TWO_53) + _SLACK * _TWO_53
    return success, failure


def _bernoulli_exact(gamma: Fraction, w: int, stream: Callable[[], RandomIntegers]) -> bool:
    """Decide ``U' < exp(-gamma)`` exactly: ``U'`` starts with ``w``, then 64 bits at a time.

    ``exp(-gamma) <= 2^-floor(gamma)`` (as ``e > 2``) decides a huge ``gamma`` without its
    bounds, which would take long to compute.
    """
    prefix, bits = w, _WORD
    whole = gamma.numerator // gamma.denominator
    rng: RandomIntegers | None = None
    while True:
        if whole >= bits:  # exp(-gamma) <= 2^-bits
            if prefix >= 1:  # U' >= 2^-bits >= exp(-gamma)
                return False
        else:
            lo, hi = _exp_neg_bounds(gamma, bits)
            if prefix + 1 <= lo:  # U' < (prefix + 1) / 2^bits <= exp(-gamma)
                return True
            if prefix >= hi:  # U' >= prefix / 2^bits >= exp(-gamma)
                return False
        rng = rng if rng is not None else stream()
        prefix = (prefix << _WORD) | rng.randbelow(1 << _WORD)
        bits += _WORD


def _bernoulli_word(gamma_f: float | None, gamma: Callable[[], Fraction], w: int,
                    stream: Callable[[], RandomIntegers]) -> bool:
    """One Bernoulli(exp(-gamma)) trial from word ``w``.

    The float screen if ``gamma_f`` (within ``2^-34`` of gamma) is given, else (or if it does
    not decide) the exact comparison.
    """
    if gamma_f is not None:
        verdict = _screen_one(_scalar_exp(-gamma_f), w)
        if verdict is not None:
            return verdict
    return _bernoulli_exact(gamma(), w, stream)


def _round_words(noise: NoiseKey, sub: WordArray, r: int) -> WordArray:
    """The words ``w0 .. w3`` of round ``r`` of every draw, as ``(n, 4)`` uint64 (module doc)."""
    if r >= _MAX_ROUNDS:
        raise DpstreamError("a discrete Gaussian draw ran out of rounds")  # probability 0
    n = sub.shape[0]
    blocks = np.empty((n, 2, 2), dtype=np.uint64)
    for group in (0, 1):
        np.bitwise_xor(sub[:, 0], np.uint64((r << 8) | group), out=blocks[:, group, 0])
        blocks[:, group, 1] = sub[:, 1]
    out = noise.encrypt_gaussian_blocks(blocks.astype("<u8", copy=False).tobytes())
    return np.frombuffer(out, dtype="<u8").reshape(n, _ROUND_WORDS).astype(np.uint64, copy=False)


def _round_words_one(noise: NoiseKey, s0: int, s1: int, r: int) -> tuple[int, int, int, int]:
    """The words of round ``r`` of the draw with sub-lane ``(s0, s1)`` (:func:`_round_words`)."""
    if r >= _MAX_ROUNDS:
        raise DpstreamError("a discrete Gaussian draw ran out of rounds")  # probability 0
    data = b"".join((s0 ^ ((r << 8) | group)).to_bytes(8, "little") + s1.to_bytes(8, "little")
                    for group in (0, 1))
    out = noise.encrypt_gaussian_blocks(data)
    w0, w1, w2, w3 = (int.from_bytes(out[i:i + 8], "little") for i in range(0, 32, 8))
    return w0, w1, w2, w3


def _round_one(noise: NoiseKey, sub: bytes, g: _GaussianParameters, r: int,
               words: tuple[int, int, int, int]) -> int | None:
    """Round ``r`` of one draw (module doc, steps 1-5): its value, or None if it fails.

    An undecided trial reads the scalar stream at ``(sub-lane, r, word)``.
    """
    w0, w1, w2, w3 = words
    t = g.t

    def stream(word: int) -> Callable[[], RandomIntegers]:
        return functools.partial(noise.stream, _GAUSSIAN_RESOLVE, sub.hex(), r, word)

    a, sign = w0 >> 1, w0 & 1  # 1. U uniform on {0, ..., t - 1}, by rejection; the sign
    if a >= g.limit:
        return None
    u = a % t
    if not _bernoulli_word(u / t, lambda: Fraction(u, t), w1, stream(1)):  # 2. D
        return None
    _, descending = _thresholds(_ONE)  # 3. V: #{k : L_k > w2}, ties and the tail exactly
    v = bisect.bisect_left(_negated(_ONE), -w2)
    if v == len(descending) or descending[v] == w2:
        v = _resolve_word(stream(2)(), w2, _ONE)
    x = u + t * v  # 4. the discrete Laplace magnitude; B = 1 with X = 0 fails
    if sign and x == 0:
        return None
    p, q = g.sigma2.numerator, g.sigma2.denominator  # 5. gamma = (x - s/t)^2 / (2 s), s = p/q
    numerator, denominator = (x * t * q - p) ** 2, 2 * p * q * t * t
    gamma_f = numerator / denominator if numerator <= denominator << 19 else None
    if not _bernoulli_word(gamma_f, lambda: Fraction(numerator, denominator), w3, stream(3)):
        return None
    return -x if sign else x


def _round_bulk(words: WordArray, g: _GaussianParameters
                ) -> tuple[IntArray, npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """Round steps 1-5 for many draws: ``(values, done, undecided)``.

    ``done``: the round succeeded with ``values``; ``undecided``: some trial it needs was not
    decided by the screen (or ``V`` is a tie or in the tail), so :func:`_round_one` runs it;
    neither: the round failed.
    """
    w0, w1, w2, w3 = (np.ascontiguousarray(words[:, j]) for j in range(_ROUND_WORDS))
    t = g.t
    a = w0 >> np.uint64(1)
    sign = (w0 & np.uint64(1)).astype(bool)
    accepted = a < np.uint64(g.limit) if g.limit < 1 << 63 else np.ones(a.shape, dtype=bool)
    u = a & np.uint64(t - 1) if t & (t - 1) == 0 else a % np.uint64(t)
    d_yes, d_no = _screen(_vector_exp(u.astype(np.float64) * -g.inverse_t), w1)
    v, v_ok = _decided(np.ascontiguousarray(w2), _ONE)  # V = #{k : L_k > w2}, scale 1
    x = u.view(np.int64) + np.int64(t) * v  # < K t <= 2^62 where v_ok
    zero = sign & (x == 0)
    xf = x.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        gamma = np.square(xf - g.centre) * g.inverse_two_sigma2
        a_yes, a_no = _screen(_vector_exp(-gamma), w3)
        if g.screen_all:
            m_ok = np.ones(x.shape, dtype=bool)
        else:
            m_ok = np.square(xf + g.centre) * g.inverse_two_sigma2 <= _M_LIMIT
    done = accepted & d_yes & v_ok & ~zero & m_ok & a_yes
    undecided = accepted & ~d_no & (~d_yes | ~v_ok | (~zero & (~m_ok | ~(a_yes | a_no))))
    values = np.where(sign, -x, x)
    return values, done, undecided


def _sub_bytes(words: WordArray) -> bytes:
    data: bytes = words.astype("<u8").tobytes()
    return data


def _gaussian_chunk(noise: NoiseKey, sub: WordArray, g: _GaussianParameters) -> IntArray:
    """The draws of the sub-lanes ``sub`` (``(n, 2)`` uint64): rounds until every one is done."""
    out = np.empty(sub.shape[0], dtype=np.int64)
    pending = np.arange(sub.shape[0])
    r = 0
    while pending.size:
        if pending.size <= _SCALAR_TAIL:  # a few draws left: scalar rounds are cheaper
            for row, (s0, s1) in zip(pending.tolist(), sub.tolist(), strict=True):
                out[row] = _fit_int64(_rounds_one(noise, s0, s1, g, r), g)
            break
        words = _round_words(noise, sub, r)
        values, done, undecided = _round_bulk(words, g)
        for row in np.flatnonzero(undecided).tolist():  # rare: the exact scalar round
            w0, w1, w2, w3 = (int(w) for w in words[row])
            value = _round_one(noise, _sub_bytes(sub[row]), g, r, (w0, w1, w2, w3))
            if value is not None:
                values[row], done[row] = _fit_int64(value, g), True
        out[pending[done]] = values[done]
        pending, sub = pending[~done], sub[~done]
        r += 1
    return out


def _fit_int64(value: int, g: _GaussianParameters) -> int:
    if not -(1 << 63) <= value < 1 << 63:  # probability below e^-4000 (module doc, "Range")
        # the draw itself stays out of the message: with its release it would give the count
        raise InvalidParameterError("a discrete Gaussian draw does not fit int64 "
                                    f"(sigma2 = {g.sigma2}); gaussian_one returns Python ints")
    return value


def _rounds_one(noise: NoiseKey, s0: int, s1: int, g: _GaussianParameters, r: int) -> int:
    """The value of the draw with sub-lane ``(s0, s1)``: its rounds from ``r`` on, one by one."""
    sub = s0.to_bytes(8, "little") + s1.to_bytes(8, "little")
    while True:
        value = _round_one(noise, sub, g, r, _round_words_one(noise, s0, s1, r))
        if value is not None:
            return value
        r += 1


def gaussian_one(noise: NoiseKey, lane: bytes, sigma2: Fraction, tag: int, epoch: int,
                 height: int, index: int) -> int:
    """One exact draw of N_Z(0, sigma2); equals :func:`gaussian`'s at the same lane and coordinates.

    Plain Python, one round at a time on the same words (module doc): the readable reference.
    Any ``sigma2 > 0``: beyond ``t = 2^56`` it runs CKS Algorithm 3 on the scalar stream at the
    sub-lane (where :func:`gaussian` refuses).
    """
    g = _gaussian_parameters(_positive_variance(sigma2))
    s0, s1 = _block_one(noise, lane, tag, epoch, height, index)
    if g.t > _MAX_T:
        sub = s0.to_bytes(8, "little") + s1.to_bytes(8, "little")
        return discrete_gaussian(noise.stream(_GAUSSIAN_WIDE, sub.hex()), g.sigma2)
    _check_exp()
    return _rounds_one(noise, s0, s1, g, 0)


def gaussian(noise: NoiseKey, lanes: WordArray, sigma2: Fraction, tag: int, epoch: Index,
             height: Index, index: Index) -> IntArray:
    """Exact discrete Gaussian draws N_Z(0, sigma2), one per lane, vectorized (see module doc).

    Args:
        noise: the secret key.
        lanes: ``(n, 2)`` uint64, from :func:`~dpstream.core.noise.bulk.lanes_array`.
        sigma2: the exact variance parameter, a Fraction > 0 with ``floor(sqrt(sigma2)) < 2^56``.
        tag: the draws' kind (a ``TAG_*`` of :mod:`dpstream.core.noise.coordinates`).
        epoch: the draws' epoch coordinate (a scalar or a length-n array).
        height: the draws' height coordinate (a scalar or a length-n array).
        index: the draws' index coordinate (a scalar or a length-n array).

    Raises:
        InvalidParameterError: a bad coordinate or variance, or ``sigma2 >= 2^112`` (its draws
            would not fit int64 for certain; :func:`gaussian_one` takes any ``sigma2``).
    """
    g = _gaussian_parameters(_positive_variance(sigma2))
    if g.t > _MAX_T:
        raise InvalidParameterError(
            f"sigma2 = {float(g.sigma2):.3g} is too large for int64 discrete Gaussian draws "
            "(the vectorized sampler needs floor(sigma) < 2^56); gaussian_one draws any sigma2 "
            "as a Python int")
    sub = _blocks(noise, lanes, tag, epoch, height, index)
    _check_exp()
    out = np.empty(sub.shape[0], dtype=np.int64)
    for start in range(0, sub.shape[0], _CHUNK):
        out[start:start + _CHUNK] = _gaussian_chunk(noise, sub[start:start + _CHUNK], g)
    return out
