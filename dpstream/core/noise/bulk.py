"""Exact discrete noise for many releases at once, from a keyed block PRF.

The counters flow draws the noise of every release of a step together: one tree node per
admitted key, one query noise per watched key. This module gives those draws in bulk, each
still a pure function of the secret key and the release's coordinates (so a replay after a
crash reproduces every value, whatever other keys exist and in whatever order), and each
exactly distributed.

**The PRF.** A mechanism instance (one key's counter, one key's monitor in one window, one
initial count) has a *lane*, ``NoiseKey.lane(*prefix)``: a 128-bit pseudorandom function of its
coordinates (``(instance, key, "counter", digest, start_step)``, ...) under the secret; since
noise scheme 3 it is ECBC-MAC with AES under keys derived from the secret, so that the lanes of
a million keys are a few bulk AES calls (``NoiseKey.lane_words``; the construction and its
security argument are in :meth:`~dpstream.core.noise.keys.NoiseKey.lane`).
A draw of that mechanism at numeric coordinates ``(tag, epoch, height, index)`` (see the
``TAG_*`` constants of :mod:`dpstream.core.noise.coordinates`) is the 128-bit block

    AES-256_K( lane XOR pack(tag, height, epoch, index) )

where ``K`` is derived from the secret and ``pack`` puts ``tag + 2^8 height + 2^32 epoch`` in
the first 64-bit little-endian word and ``index`` in the second (``tag < 2^8``,
``height < 2^24``, ``epoch < 2^32``, ``index < 2^64``: injective). Within one lane distinct
coordinates give distinct AES inputs; across lanes, lanes are pseudorandom and secret, so two
AES inputs coincide with probability ``2^-128`` per pair. Without such a collision the outputs
are those of a pseudorandom permutation on distinct inputs: computationally independent
uniform 128-bit words (the PRP/PRF switching term is ``q^2 / 2^129``). This is the same
computational trade-off as the scalar BLAKE2b streams of :mod:`dpstream.core.noise.keys`; AES is
used because OpenSSL encrypts about 70 million blocks a second on one core.

**Exact discrete Laplace from two words** (``scale = t/s``, ``p = exp(-s/t)``). If ``G1``,
``G2`` are independent with ``P(G >= k) = p^k`` (geometric), then ``X = G1 - G2`` has
``P(X = x) = (1-p)/(1+p) p^|x|``: exactly the discrete Laplace of scale ``t/s``. With ``U``
uniform on ``[0, 1)``, ``G = #{k >= 1 : U < p^k}`` is geometric. The two 64-bit words ``u`` of
the block are the first 64 bits of two such ``U``: ``U in [u, u + 1) / 2^64``, the rest of its
bits not drawn yet. With ``L_k = floor(2^64 p^k)`` (computed exactly, from rigorous integer
bounds on ``exp``; :func:`_thresholds`):

* if ``u < L_k`` then ``U < (u + 1)/2^64 <= L_k/2^64 <= p^k``: the comparison is decided;
* if ``u > L_k`` then ``U >= u/2^64 >= (L_k + 1)/2^64 > p^k``: decided;
* if ``u = L_k`` the comparison is *undecided*: more bits of ``U`` are drawn (from the scalar
  BLAKE2b stream at the same lane and coordinates, :func:`_resolve`) and compared with ever
  more bits of ``p^k`` (:func:`_exp_neg_bounds`) until it is decided; this happens with
  probability 1 and, per comparison, probability ``2^-64`` of needing it at all;
* the table stops at ``K`` with ``p^K < 2^-48``; if ``u < L_K`` then ``U < p^K``, i.e.
  ``G >= K``, and by memorylessness ``G - K`` is a fresh geometric, drawn exactly from the
  scalar stream with CKS 2020 Algorithm 1's Bernoulli(exp(-s/t)) trials.

Every comparison is thus decided exactly as ``U`` itself would decide it, so ``G`` has exactly
the geometric law and ``X`` exactly the discrete Laplace law: no floating point is involved,
only integers. The vectorized path (:func:`laplace`) decides all but the rare undecided or
tail draws with one ``searchsorted`` per word; :func:`laplace_one` is the same computation for
one draw, in plain Python (the reference the vectorized one is tested against).

The discrete Gaussian drawn from the same lanes is :mod:`dpstream.core.noise.bulk_gaussian`.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Final

import numpy as np
import numpy.typing as npt

from dpstream.core.noise.keys import LANE_BYTES, NoiseKey
from dpstream.core.noise.samplers import RandomIntegers, bernoulli_exp
from dpstream.errors import InvalidParameterError

__all__ = [
    "lanes_array",
    "laplace",
    "laplace_one",
]

IntArray = npt.NDArray[np.int64]
WordArray = npt.NDArray[np.uint64]
Index = int | npt.NDArray[np.integer]
_WORD: Final = 64
_TAIL_BITS: Final = 48
"""The threshold table stops at the first ``K`` with ``p^K < 2^-48``."""
_MAX_TABLE: Final = 1 << 16
"""At most this many thresholds (scales above about 1900 use the exact tail more often)."""
_GUARD_BITS: Final = 24
_RESOLVE: Final = "dpstream-noise/2 resolve"


def _exp_neg_bounds(gamma: Fraction, bits: int) -> tuple[int, int]:
    """Return integers ``lo <= 2^bits exp(-gamma) <= hi`` for a rational ``gamma >= 0``.

    ``gamma`` is halved ``r`` times to ``x <= 1/2``; ``exp(-x)`` lies between two consecutive
    partial sums of its alternating Taylor series (the terms decrease for ``x < 1``), which are
    exact rationals, rounded outwards to ``W`` fixed-point bits; squaring ``r`` times with
    floor (lower bound) and ceiling (upper bound) keeps both bounds valid, as every quantity is
    positive. ``W`` carries guard bits, so ``hi - lo`` is a few units at most.
    """
    if gamma < 0:
        raise InvalidParameterError(f"gamma must be >= 0, got {gamma}")
    r = 0
    x = gamma
    while x > Fraction(1, 2):
        x /= 2
        r += 1
    work = bits + 2 * r + _GUARD_BITS
    total = Fraction(1)
    term = Fraction(1)
    n = 0
    eps = Fraction(1, 1 << (work + 2))
    while True:
        n += 1
        term = term * x / n
        previous = total
        total = total - term if n % 2 else total + term
        if term < eps:
            break
    low, high = min(previous, total), max(previous, total)
    scale = 1 << work
    lo = (low.numerator * scale) // low.denominator
    hi = -((-high.numerator * scale) // high.denominator)
    for _ in range(r):
        lo = (lo * lo) >> work
        hi = -((-hi * hi) >> work)
    shift = work - bits
    return lo >> shift, -((-hi) >> shift)


@functools.lru_cache(maxsize=64)
def _thresholds(scale: Fraction) -> tuple[WordArray, tuple[int, ...]]:
    """Return ``(ascending, descending)``: the thresholds ``L_k = floor(2^64 p^k)``, k = 1..K.

    ``descending[k - 1] = L_k`` (a tuple of Python ints, for the scalar path) and
    ``ascending = L_K, ..., L_1`` as uint64 (for ``searchsorted``). ``p = exp(-1/scale)``;
    each ``L_k`` is computed from rigorous bounds at 128 bits (more where they straddle an
    integer), so it is exact.
    """
    gamma = 1 / scale
    bits = 2 * _WORD
    lo_p, hi_p = _exp_neg_bounds(gamma, bits)
    table: list[int] = []
    lo, hi = 1 << bits, 1 << bits
    limit = 1 << (_WORD - _TAIL_BITS)  # L_k < 2^16 means p^k < 2^-48 (roughly): stop
    while len(table) < _MAX_TABLE:
        lo = (lo * lo_p) >> bits
        hi = -((-hi * hi_p) >> bits)
        k = len(table) + 1
        floor_lo, floor_hi = lo >> _WORD, hi >> _WORD
        if floor_lo != floor_hi:  # the bounds straddle an integer: compute p^k afresh
            extra = bits
            while floor_lo != floor_hi:
                extra += _WORD
                lo_k, hi_k = _exp_neg_bounds(k * gamma, extra)
                floor_lo, floor_hi = lo_k >> (extra - _WORD), hi_k >> (extra - _WORD)
        table.append(floor_lo)
        if floor_lo < limit:
            break
    ascending = np.array(table[::-1], dtype=np.uint64)
    ascending.setflags(write=False)
    return ascending, tuple(table)


def lanes_array(lanes: Sequence[bytes]) -> WordArray:
    """Return the lanes as an ``(n, 2)`` array of little-endian uint64 words."""
    if any(len(lane) != LANE_BYTES for lane in lanes):
        raise InvalidParameterError(f"a lane is {LANE_BYTES} bytes")
    data = b"".join(lanes)
    return np.frombuffer(data, dtype="<u8").reshape(len(lanes), 2).astype(np.uint64)


def _check_range(name: str, value: Index, bound: int) -> None:
    if isinstance(value, np.ndarray):
        if value.size == 0:
            return
        low, high = int(np.min(value)), int(np.max(value))
    else:
        low = high = int(value)
    if low < 0 or high >= bound:
        raise InvalidParameterError(f"noise coordinate {name} must be in [0, {bound}), got "
                                    f"{low if low < 0 else high}")


def _blocks(noise: NoiseKey, lanes: WordArray, tag: int, epoch: Index, height: Index,
            index: Index) -> WordArray:
    """The PRF blocks of every lane at its coordinates, as ``(n, 2)`` uint64 words."""
    _check_range("tag", tag, 1 << 8)
    _check_range("height", height, 1 << 24)
    _check_range("epoch", epoch, 1 << 32)
    _check_range("index", index, 1 << 64)
    n = lanes.shape[0]
    first = (np.asarray(epoch, dtype=np.uint64) << np.uint64(32)) | (
        np.asarray(height, dtype=np.uint64) << np.uint64(8)) | np.uint64(tag)
    second = np.asarray(index, dtype=np.uint64)
    if first.ndim == second.ndim == 0:  # one coordinate block for all: XORed as flat words
        block = np.array([first, second], dtype=np.uint64).tobytes()
        words = np.ascontiguousarray(lanes, dtype=np.uint64).reshape(-1) ^ np.frombuffer(
            block * n, dtype=np.uint64)
    else:
        words = np.empty((n, 2), dtype=np.uint64)
        np.bitwise_xor(lanes[:, 0], first, out=words[:, 0])
        np.bitwise_xor(lanes[:, 1], second, out=words[:, 1])
    data = words.astype("<u8", copy=False).reshape(-1).view(np.uint8)
    out = noise.encrypt_blocks(data.data)  # a memoryview, read in place: no copy
    return np.frombuffer(out, dtype="<u8").reshape(n, 2).astype(np.uint64, copy=False)


def _block_one(noise: NoiseKey, lane: bytes, tag: int, epoch: int, height: int,
               index: int) -> tuple[int, int]:
    """The PRF block of one draw, as two Python ints (the scalar reference of :func:`_blocks`)."""
    for name, value, bound in (("tag", tag, 1 << 8), ("height", height, 1 << 24),
                               ("epoch", epoch, 1 << 32), ("index", index, 1 << 64)):
        _check_range(name, value, bound)
    lane0 = int.from_bytes(lane[:8], "little")
    lane1 = int.from_bytes(lane[8:], "little")
    first = lane0 ^ (tag | (height << 8) | (epoch << 32))
    second = lane1 ^ index
    out = noise.encrypt_blocks(first.to_bytes(8, "little") + second.to_bytes(8, "little"))
    return int.from_bytes(out[:8], "little"), int.from_bytes(out[8:], "little")


def _exact_geometric(rng: RandomIntegers, gamma: Fraction) -> int:
    """A geometric count of Bernoulli(exp(-gamma)) successes (CKS 2020, Algorithm 1)."""
    count = 0
    while bernoulli_exp(rng, gamma):
        count += 1
    return count


def _resolve(noise: NoiseKey, lane: bytes, coordinates: tuple[int, int, int, int], which: int,
             u: int, scale: Fraction) -> int:
    """The geometric ``G`` of word ``u`` when the table does not decide it (see module doc).

    The extra bits of ``U`` and the tail's trials come from the scalar BLAKE2b stream at the
    lane and the draw's coordinates, independent of the block's words.
    """
    return _resolve_word(noise.stream(_RESOLVE, lane.hex(), *coordinates, which), u, scale)


def _resolve_word(rng: RandomIntegers, u: int, scale: Fraction) -> int:
    """:func:`_resolve` with the further bits of ``U`` and the tail's trials from ``rng``."""
    _, descending = _thresholds(scale)
    gamma = 1 / scale
    decided = sum(1 for threshold in descending if threshold > u)
    if decided == len(descending):  # u < L_K: G >= K, and G - K is a fresh geometric
        return decided + _exact_geometric(rng, gamma)
    count = decided
    prefix, bits = u, _WORD
    k = decided + 1
    while k <= len(descending) and descending[k - 1] == u:  # U < p^k undecided for these k
        while True:
            lo, hi = _exp_neg_bounds(k * gamma, bits)
            if prefix + 1 <= lo:
                count += 1
                break
            if prefix >= hi:
                return count  # U >= p^k, hence >= p^j for every larger j
            prefix = (prefix << _WORD) | rng.randbelow(1 << _WORD)
            bits += _WORD
        k += 1
    return count


def laplace(noise: NoiseKey, lanes: WordArray, scale: Fraction, tag: int, epoch: Index,
            height: Index, index: Index) -> IntArray:
    """Exact discrete Laplace draws, ``P(x) ∝ exp(-|x|/scale)``, one per lane (see module doc).

    Args:
        noise: the secret key.
        lanes: ``(n, 2)`` uint64, from :func:`lanes_array`.
        scale: the exact scale ``t/s > 0``.
        tag: the draws' kind (a ``TAG_*`` of :mod:`dpstream.core.noise.coordinates`).
        epoch: the draws' epoch coordinate (a scalar or a length-n array).
        height: the draws' height coordinate (a scalar or a length-n array).
        index: the draws' index coordinate (a scalar or a length-n array).
    """
    scale = _positive_scale(scale)
    _, descending = _thresholds(scale)
    words = _blocks(noise, lanes, tag, epoch, height, index)
    u = words.reshape(-1)  # both words of every draw, as one flat array
    geometric, ok = _decided(u, scale)
    for j in np.flatnonzero(~ok).tolist():  # a wrong guess, a tie or the tail: rare
        row, which = divmod(j, 2)
        coordinates = (tag, _at(epoch, row), _at(height, row), _at(index, row))
        geometric[j] = _geometric_one(noise, _lane_bytes(lanes, row), coordinates, which,
                                      int(u[j]), scale, descending)
    pairs = geometric.reshape(-1, 2)
    result: IntArray = pairs[:, 0] - pairs[:, 1]
    return result


def _decided(u: WordArray, scale: Fraction) -> tuple[IntArray, npt.NDArray[np.bool_]]:
    """``G = #{k : L_k > u}`` of every word ``u`` where the thresholds decide it, and where.

    A floating-point guess ``g`` of ``floor(ln(u / 2^64) / ln p)`` is checked exactly against
    the integer thresholds: ``L_g > u > L_{g+1}`` (``L_0 = 2^64``) decides ``G = g``. The
    table is :func:`_bounds`: both its ends are ``2^64 - 1``, so every word the check cannot
    place fails it and goes to the exact slow path: a tie (``u = L_k``), the tail (``u <
    L_K``, guessed ``K`` or more), a wrong guess, and ``u = 2^64 - 1`` (``G = 0``, which the
    slow path finds as exactly).
    """
    bounds, slope, offset = _bounds(scale)
    size = bounds.shape[0] - 2
    # u's top 53 bits, exact as a float (a signed conversion: numpy's unsigned one is slow)
    guess = (u >> np.uint64(11)).view(np.int64).astype(np.float64)
    with np.errstate(divide="ignore"):
        np.log(guess, out=guess)  # u < 2^11: -inf, hence a guess of +inf, clipped to the tail
    guess *= slope
    guess += offset
    np.minimum(guess, size, out=guess)
    g = guess.astype(np.int64)
    ok = u < bounds[g]
    ok &= u > bounds[1:][g]
    return g, ok


def laplace_one(noise: NoiseKey, lane: bytes, scale: Fraction, tag: int, epoch: int,
                height: int, index: int) -> int:
    """One exact discrete Laplace draw; equals :func:`laplace`'s at the same lane and coordinates.

    Plain Python (``bisect`` on the same thresholds): the readable reference.
    """
    scale = _positive_scale(scale)
    _, descending = _thresholds(scale)
    first, second = _block_one(noise, lane, tag, epoch, height, index)
    coordinates = (tag, epoch, height, index)
    return (_geometric_one(noise, lane, coordinates, 0, first, scale, descending)
            - _geometric_one(noise, lane, coordinates, 1, second, scale, descending))


def _geometric_one(noise: NoiseKey, lane: bytes, coordinates: tuple[int, int, int, int],
                   which: int, u: int, scale: Fraction, descending: tuple[int, ...]) -> int:
    """The geometric ``G`` of word ``u``: ``#{k : L_k > u}`` if decided, else :func:`_resolve`."""
    count = bisect.bisect_left(_negated(scale), -u)  # #{k : L_k > u}
    if count == len(descending) or descending[count] == u:  # the tail, or a tie
        return _resolve(noise, lane, coordinates, which, u, scale)
    return count


@functools.lru_cache(maxsize=64)
def _negated(scale: Fraction) -> list[int]:
    """``-L_1 < -L_2 < ...``: the thresholds negated, ascending, for ``bisect``."""
    return [-threshold for threshold in _thresholds(scale)[1]]


@functools.lru_cache(maxsize=64)
def _bounds(scale: Fraction) -> tuple[WordArray, float, float]:
    """The thresholds ``[2^64 - 1, L_1, ..., L_K, 2^64 - 1]`` indexed by ``k``, and the guess.

    The guess of ``G`` from a word ``u`` is ``ln(floor(u / 2^11)) * slope + offset``, about
    ``ln(u / 2^64) / ln p`` with ``ln p = -1/scale`` (floating point: it is only a guess,
    checked against the thresholds by :func:`_decided`).
    """
    _, descending = _thresholds(scale)
    bounds = np.array([(1 << _WORD) - 1, *descending, (1 << _WORD) - 1], dtype=np.uint64)
    bounds.setflags(write=False)
    ln_p = -float(1 / scale)
    return bounds, 1 / ln_p, -_LN_2_53 / ln_p


_LN_2_53: Final = 53 * math.log(2)


def _positive_scale(scale: Fraction) -> Fraction:
    if not isinstance(scale, Fraction) or scale <= 0:
        raise InvalidParameterError(f"discrete Laplace scale must be a Fraction > 0, got {scale}")
    return scale


def _at(value: Index, row: int) -> int:
    return int(value[row]) if isinstance(value, np.ndarray) else int(value)


def _lane_bytes(lanes: WordArray, row: int) -> bytes:
    lane: bytes = lanes[row].astype("<u8").tobytes()
    return lane
