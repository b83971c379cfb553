"""The exact rational grid on which a certified ERM minimiser is rounded before noise.

Output perturbation in Watson et al., "Continual and Sliding Window Release for Private ERM"
(paper 004, Algorithms 1, 3 and 7) adds integer noise (:mod:`dpstream.core.erm.output_noise`)
to integers, never to a real vector.

**The grid** (pitfall 2: integer noise on a real vector would leave its fractional part visible).
The certified minimiser is rounded *exactly* to integers ``r_j = round(w_j / g)`` (the float's
exact binary value, integer arithmetic, ``|r_j - w_j/g| <= 1/2``) on the rational grid
``g = c_g Delta`` with ``c_g = 1 / (2^12 ceil(sqrt(p)))`` (:data:`GRID_BITS`), ``p`` the
parameter count. For neighbours, ``r - r'`` is at most ``(1 + 2^-19) Delta / g`` in L2 before
rounding and each coordinate moves by less than one unit more, so on the grid::

    L1:  ||r - r'||_1 <= D1 = floor(sqrt(p) (1 + 2^-19) 2^12 ceil(sqrt(p))) + p
    L2:  ||r - r'||_2 <= D2 = ceil(sqrt(p)) (2^12 (1 + 2^-19) + 1)

Both are constants of ``p`` (``Delta`` cancels) and exact (``D1`` by integer square root). They
exceed the ideal ``sqrt(p) Delta / g`` resp. ``Delta / g`` by less than ``2^-12 + 2^-19`` resp.
``2^-12 + 2^-19`` relatively: the rounding costs under ``2.5 10^-4`` of epsilon (pure) and
``5 10^-4`` of rho (zCDP).

**Noise and state.** Nothing here is random; rounding uses the floats' exact binary values and
integer arithmetic, so it is replay-safe. The module holds no state.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Final

import numpy as np

from dpstream.errors import InvalidParameterError

if TYPE_CHECKING:
    import numpy.typing as npt

    FloatArray = npt.NDArray[np.float64]

__all__ = [
    "GRID_BITS",
    "PRECISION_BITS",
    "round_to_grid",
]

PRECISION_BITS: Final = 20
"""The solver's certified precision is ``tau = Delta 2^-PRECISION_BITS``."""
GRID_BITS: Final = 12
"""The grid is ``g = Delta / (2^GRID_BITS ceil(sqrt(p)))``."""
_SLACK: Final = 1 + Fraction(2, 1 << PRECISION_BITS)  # (Delta + 2 tau) / Delta


def _ceil_sqrt(n: int) -> int:
    """Return ``ceil(sqrt(n))`` for an integer ``n >= 1``."""
    return math.isqrt(n - 1) + 1


@functools.lru_cache(maxsize=256)
def _grid_constants(p: int) -> tuple[Fraction, int, Fraction]:
    """Return ``(c_g, D1, D2)`` for ``p`` parameters (see the module docstring)."""
    s = _ceil_sqrt(p)
    c_g = Fraction(1, (1 << GRID_BITS) * s)
    # D1 = floor(sqrt(p) * a / b) + p with a/b = (1 + 2^-19) 2^12 s, exactly:
    # floor(sqrt(p) a / b) = floor(sqrt(p a^2) / b) = isqrt(p a^2) // b.
    a = ((1 << (PRECISION_BITS - 1)) + 1) * s
    b = 1 << (PRECISION_BITS - 1 - GRID_BITS)
    d1 = math.isqrt(p * a * a) // b + p
    d2 = s * ((1 << GRID_BITS) * _SLACK + 1)
    return c_g, d1, d2


@functools.lru_cache(maxsize=256)
def rows_l1_factor(p: int, rows: int) -> Fraction:
    """Return ``kappa_r >= 1``: ``rows`` single rows' L1 bounds, summed, over ``D1``.

    On the grid of a sensitivity ``Delta`` that covers ``rows = r`` rows (``unit_rows``), one
    row moves the minimiser by at most ``Delta/r`` and the solver's two outputs by
    ``2 tau = 2^-19 Delta`` more, so the rounded integers move by less than
    ``sqrt(p) 2^12 s (1/r + 2^-19) + p`` in L1 (``s = ceil(sqrt(p))``; rounding adds less
    than one unit a coordinate), and ``j`` rows by at most ``j`` times that. ``r`` times the
    one-row bound is at most ``kappa_r D1`` with::

        kappa_r = (ceil_up(sqrt(p) 2^12 s (1 + r 2^-19)) + r p) / D1

    (exactly 1 for ``r = 1``; about ``1 + r 2^-12`` otherwise): what the ERM kind needs where
    a bound must be linear in the rows (Poisson sampling, several model streams;
    :mod:`dpstream.core.erm.contribution`).
    """
    if rows == 1:
        return Fraction(1)
    s = _ceil_sqrt(p)
    d1 = _grid_constants(p)[1]
    x = (1 << GRID_BITS) * s * (1 + Fraction(rows, 1 << (PRECISION_BITS - 1)))
    root_up = Fraction(math.isqrt(p * x.numerator ** 2) + 1, x.denominator)  # >= sqrt(p) x
    return (root_up + rows * p) / d1


def round_to_grid(params: FloatArray, grid: Fraction) -> list[int]:
    """Return ``round(w_j / grid)`` for every coordinate, exactly (row-major order).

    Each float is read as its exact binary value ``n / 2^k`` and divided by the rational grid
    ``a / b`` in integer arithmetic: ``r = floor(n b / (2^k a) + 1/2)``, so ``|r - w/g| <= 1/2``.
    """
    if grid <= 0:
        raise InvalidParameterError(f"grid must be > 0, got {grid}")
    a, b = grid.numerator, grid.denominator
    out = []
    for value in np.asarray(params, dtype=np.float64).reshape(-1).tolist():
        if not math.isfinite(value):
            raise InvalidParameterError("parameters to round must be finite")
        num, den = value.as_integer_ratio()
        out.append((2 * num * b + den * a) // (2 * den * a))
    return out


def _params_from_integers(
    integers: Sequence[int], grid: Fraction, shape: tuple[int, int]
) -> FloatArray:
    """Return ``grid * integers`` as float64 (each correctly rounded), read-only."""
    a, b = grid.numerator, grid.denominator
    try:
        arr = np.array([(k * a) / b for k in integers], dtype=np.float64).reshape(shape)
    except OverflowError:
        raise InvalidParameterError("released parameters out of the float range") from None
    arr.setflags(write=False)
    return arr
