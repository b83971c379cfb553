"""Exact non-negative multi-limb integers as numpy columns (one integer per column).

The BLT counter (:mod:`dpstream.core.counting.blt_counter`; Dvijotham, McMahan, Pillutla, Steinke
and
Thakurta 2024, with the integer grid of its module docstring) keeps its buffers as exact
integers in grid units ``G = 2^40``: they grow like ``G x / (1 - theta)`` and their products
with the 48-bit dyadic numerators reach ``2^170`` and more, far beyond int64. This module does
that arithmetic for a million counters at once, exactly, with numpy only.

**Representation.** An array of ``n`` integers is an ``(L, n)`` array of 32-bit *limbs*,
least significant first: integer ``i`` is ``sum_k a[k, i] 2^(32 k)``. Storage may be uint32;
every function computes in uint64 and returns *normalized* uint64 limbs (each ``< 2^32``).
Why 32-bit limbs: the product of a limb and a 32-bit limb of a constant is below ``2^64``, so
it is exact in uint64 (``(2^32 - 1)^2 < 2^64``); a 48-bit constant is two such limbs (the high
one below ``2^16``). Every result is allocated wide enough for its exact value (a product of
``L`` limbs by a ``c``-limb constant has ``L + c`` limbs, a sum one limb more than its widest
term): nothing can wrap, and the final carry of every normalization is checked anyway
(:class:`ArithmeticError` rather than a silent wrap). Widths only grow as values need them;
:func:`trim` drops the all-zero top limbs of a column set.

**Accumulation bound.** A multiplication adds, into each limb position, at most two halves
(below ``2^32``) per constant limb and the rounding bit: at most ``(2 c + 1) 2^32 < 2^35`` for
``c <= 3`` constant limbs, far from ``2^64``; the carry propagation then adds carries below
``2^4``.

**Floats.** :func:`to_float` and :func:`signed_to_float` return the float64 nearest to the
exact integer, ties to even, i.e. exactly Python's ``float(int)``: values of at most 62 bits
are converted by the hardware's (correctly rounded) int64 conversion; longer ones are first
*rounded to odd* on 62 bits (the top 62 bits, with the lowest bit set if any lower bit is set),
which the int64 conversion then rounds correctly to 53 bits (round-to-odd on ``p + 2`` bits or
more followed by round-to-nearest on ``p`` bits is round-to-nearest; Boldo and Melquiond,
"Emulation of FMA and correctly rounded sums: proved algorithms using rounding to odd", 2008),
and scaled back by an exact power of two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "LIMB_BITS",
    "add",
    "from_ints",
    "from_uint64",
    "mul_round_shift",
    "shift_left",
    "signed_to_float",
    "to_float",
    "to_ints",
    "trim",
]

LIMB_BITS: Final = 32
_MASK: Final = np.uint64((1 << LIMB_BITS) - 1)
_U32: Final = np.uint64(LIMB_BITS)

Limbs = npt.NDArray[np.uint64]
AnyLimbs = npt.NDArray[np.uint64] | npt.NDArray[np.uint32]
FloatArray = npt.NDArray[np.float64]


def from_ints(values: Sequence[int], width: int | None = None) -> Limbs:
    """Python ints ``>= 0`` as limbs (``width`` limbs, or as few as the largest needs)."""
    values = [int(v) for v in values]
    if any(v < 0 for v in values):
        raise ValueError("wide_int holds integers >= 0 only")
    need = max([1, *((v.bit_length() + LIMB_BITS - 1) // LIMB_BITS for v in values)])
    if width is None:
        width = need
    elif width < need:
        raise ValueError(f"a value needs {need} limbs, more than {width}")
    out = np.zeros((width, len(values)), dtype=np.uint64)
    mask = (1 << LIMB_BITS) - 1
    for k in range(width):
        out[k] = [(v >> (LIMB_BITS * k)) & mask for v in values]
    return out


def to_ints(limbs: AnyLimbs) -> list[int]:
    """The Python ints of a limb array (exact; for tests and snapshots)."""
    rows = [[int(v) for v in row] for row in np.asarray(limbs).tolist()]
    if not rows:
        return []
    result = [0] * len(rows[0])
    for k in reversed(range(len(rows))):
        result = [(r << LIMB_BITS) | v for r, v in zip(result, rows[k], strict=True)]
    return result


def from_uint64(x: npt.NDArray[np.integer]) -> Limbs:
    """Non-negative 64-bit integers (int64 ``>= 0`` or uint64) as two limbs."""
    u = np.asarray(x).astype(np.uint64, copy=False)
    out = np.empty((2, u.shape[0]), dtype=np.uint64)
    np.bitwise_and(u, _MASK, out=out[0])
    np.right_shift(u, _U32, out=out[1])
    return out


def _normalize(acc: Limbs, wrap: bool = False) -> Limbs:
    """Propagate the carries of ``acc`` (rows below ``2^63``) in place: every limb ``< 2^32``.

    The final carry must be zero (the caller sized ``acc`` for the exact value) unless
    ``wrap`` (two's complement arithmetic modulo ``2^(32 L)``, where it is dropped).
    """
    carry: Limbs | None = None
    for k in range(acc.shape[0]):
        row = acc[k]
        if carry is not None:
            row += carry
        carry = row >> _U32
        row &= _MASK
    if not wrap and carry is not None and carry.any():
        raise ArithmeticError("wide_int overflow: a result did not fit its limbs")
    return acc


def trim(a: AnyLimbs) -> AnyLimbs:
    """``a`` without its top limbs that are zero for every integer (at least one limb kept)."""
    width = a.shape[0]
    while width > 1 and not a[width - 1].any():
        width -= 1
    return a[:width]


def shift_left(a: AnyLimbs, bits: int) -> Limbs:
    """``a * 2^bits`` (exact: the result has the limbs it needs)."""
    q, r = divmod(bits, LIMB_BITS)
    width, n = a.shape
    u = np.asarray(a).astype(np.uint64, copy=False)
    out = np.zeros((width + q + (1 if r else 0), n), dtype=np.uint64)
    if r == 0:
        out[q:q + width] = u
    else:
        out[q:q + width] = (u << np.uint64(r)) & _MASK
        out[q + 1:q + width + 1] |= u >> np.uint64(LIMB_BITS - r)
    return out


def _shift_right(a: Limbs, bits: int) -> Limbs:
    """``floor(a / 2^bits)`` of normalized limbs."""
    q, r = divmod(bits, LIMB_BITS)
    width, n = a.shape
    if q >= width:
        return np.zeros((1, n), dtype=np.uint64)
    if r == 0:
        return a[q:].copy()
    out = a[q:] >> np.uint64(r)
    out[:-1] |= (a[q + 1:] << np.uint64(LIMB_BITS - r)) & _MASK
    return out


def _constant_limbs(c: int) -> list[int]:
    if c < 0:
        raise ValueError("wide_int constants are >= 0")
    out = []
    while c:
        out.append(c & int(_MASK))
        c >>= LIMB_BITS
    return out or [0]


def mul_round_shift(a: AnyLimbs, c: int, bits: int) -> Limbs:
    """``round(a c / 2^bits)`` with halves rounded up, i.e. ``(a c + 2^(bits-1)) >> bits``.

    ``c`` is a Python int ``>= 0`` of at most 96 bits and ``bits >= 1``: the exact rule of
    ``blt_counter._round_shift(c * b, bits)``.
    """
    if bits < 1:
        raise ValueError("bits must be >= 1")
    climbs = _constant_limbs(c)
    if len(climbs) > 3:
        raise ValueError("constants have at most 96 bits")
    width, n = a.shape
    u = np.asarray(a).astype(np.uint64, copy=False)
    acc = np.zeros((max(width + len(climbs), (bits - 1) // LIMB_BITS + 1), n), dtype=np.uint64)
    for k, ck in enumerate(climbs):
        if ck == 0:
            continue
        p = u * np.uint64(ck)  # < 2^64: a 32-bit limb times a 32-bit constant limb
        acc[k:k + width] += p & _MASK
        acc[k + 1:k + width + 1] += p >> _U32
    acc[(bits - 1) // LIMB_BITS] += np.uint64(1 << ((bits - 1) % LIMB_BITS))  # + 2^(bits-1)
    return _shift_right(_normalize(acc), bits)


def add(*terms: AnyLimbs) -> Limbs:
    """The exact sum of limb arrays (same ``n``; widths may differ)."""
    width = max(t.shape[0] for t in terms)
    acc = np.zeros((width + 1, terms[0].shape[1]), dtype=np.uint64)  # k terms: k 2^(32 w)
    for t in terms:
        acc[:t.shape[0]] += t
    return _normalize(acc)


def _bit_length(a: Limbs) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The bit length of every integer and the index of its top non-zero limb (0 for 0)."""
    width = a.shape[0]
    nonzero = a != 0
    top = (width - 1 - np.argmax(nonzero[::-1], axis=0)).astype(np.int64)
    top_limb = np.take_along_axis(a, top[None, :], axis=0)[0]
    _, exponent = np.frexp(top_limb.astype(np.float64))  # exact: limbs < 2^32
    length = LIMB_BITS * top + exponent.astype(np.int64)
    length[top_limb == 0] = 0
    return length, top


def to_float(a: AnyLimbs) -> FloatArray:
    """The nearest float64 to every integer, ties to even (Python's ``float(int)``)."""
    u = np.asarray(a).astype(np.uint64, copy=False)
    width, n = u.shape
    if width == 1:
        exact: FloatArray = u[0].astype(np.float64)  # limbs < 2^32: exact
        return exact
    length, _ = _bit_length(u)
    low = u[0] | (u[1] << _U32)  # the integer itself where it has at most 62 bits
    result: FloatArray = low.view(np.int64).astype(np.float64)
    big = np.flatnonzero(length > 62)
    if big.size:
        sub = u[:, big]
        shift = length[big] - 62
        q, r = shift // LIMB_BITS, (shift % LIMB_BITS).astype(np.uint64)
        padded = np.concatenate([sub, np.zeros((2, big.size), dtype=np.uint64)])
        lo = np.take_along_axis(padded, q[None, :], axis=0)[0]
        mid = np.take_along_axis(padded, (q + 1)[None, :], axis=0)[0]
        hi = np.take_along_axis(padded, (q + 2)[None, :], axis=0)[0]
        word = lo | (mid << _U32)
        # a >> shift: 62 bits, from the 96 bits at limb q (hi << (64 - r), written so
        # that no shift count reaches 64)
        window = (word >> r) | ((hi << (np.uint64(63) - r)) << np.uint64(1))
        below = np.logical_or.accumulate(sub != 0, axis=0)  # any limb in 0..k is non-zero
        below = np.concatenate([np.zeros((1, big.size), dtype=bool), below])
        sticky = np.take_along_axis(below, q[None, :], axis=0)[0]  # a limb under q
        sticky |= (lo & ((np.uint64(1) << r) - np.uint64(1))) != 0  # a bit of limb q under r
        window |= sticky.astype(np.uint64)  # rounded to odd on 62 bits
        result[big] = np.ldexp(window.view(np.int64).astype(np.float64), shift)
    return result


def signed_to_float(a: AnyLimbs, z: npt.NDArray[np.int64]) -> FloatArray:
    """The nearest float64 to every ``a + z`` (``a >= 0`` limbs, ``z`` any int64), ties to even.

    The sum is formed in two's complement on one limb more than ``a`` (at least three):
    ``|a + z| < 2^(32 L) + 2^63 <= 2^(32 (L + 1) - 1)``, so its sign is its top bit.
    """
    u = np.asarray(a).astype(np.uint64, copy=False)
    width, n = u.shape
    total = max(width, 2) + 1
    acc = np.zeros((total, n), dtype=np.uint64)
    acc[:width] = u
    zu = np.asarray(z, dtype=np.int64).view(np.uint64)
    acc[0] += zu & _MASK
    acc[1] += zu >> _U32
    negative_z = np.asarray(z) < 0
    if negative_z.any():
        acc[2:] += np.where(negative_z, _MASK, np.uint64(0))  # sign extension
    _normalize(acc, wrap=True)
    negative = (acc[total - 1] >> np.uint64(LIMB_BITS - 1)) != 0
    if negative.any():
        cols = np.flatnonzero(negative)
        neg = (~acc[:, cols]) & _MASK
        neg[0] += np.uint64(1)
        acc[:, cols] = _normalize(neg, wrap=True)
    result = to_float(acc)
    np.negative(result, out=result, where=negative)
    return result

