"""The numeric sparse vector for growing databases (NSG over NATG rounds), with exact noise.

**Stated as OpenDP states a measurement**

* input domain: the queries' values ``f'(D_t)`` on a growing database of public size ``t``;
  input metric: add or remove one event (``d_in = 1``), which moves every ``f'(D_t)`` by at
  most ``Delta_t = 1/t`` (one person's ``m`` rows at the user level: ``Delta_t = m/t``; the
  caller's grid and ``xi`` then carry the ``m``, :mod:`dpstream.core.pmwg.spec`).
* function: one NSG round (Algorithm 3 over Algorithm 2 of paper 003) on the grid
  ``g_t0``: ``K_eta ~ DLap(2/g)`` once, ``K_nu ~ DLap(4/g)`` per comparison, "below" until
  ``z + K_nu >= K_eta``, then the numeric answer with fresh ``K_a ~ DLap(8/g1)``.
* output measure: pure epsilon-DP; privacy map: ``1 ↦ eps_A + eps_L <= S_t0 + S_t1 / 8
  <= (9/8) S_t0``, ``S_t = xi_t Delta_t (1 + 10^-12) + g_t`` (Theorem 20 of paper 003, Dwork &
  Roth 2014, Theorem 3.23; derived below). The sparse vector charges nothing itself: PMWG
  charges its rounds (:meth:`~dpstream.core.pmwg.spec.PmwgSpec.round_charge`).

PMWG (:mod:`dpstream.core.pmwg.mechanism`) sends every query's two differences ``f'`` to
this sparse vector; it answers "below" (the query is easy) until one comparison halts the
round, then releases one noisy numeric answer and ends the round.

**Paper.** Cummings, Krehbiel, Lai, Tantipongpipat, *Differential Privacy for Growing
Databases* (NeurIPS 2018): Algorithm 1 (PMWG), Theorem 11 and its privacy sum (B.1),
Theorem 12 (B.2), Theorem 5, Lemma 14, the generalised noise (B.5) with Theorems 16 and 19,
Lemma 18 and its sum ``tau``; the sparse vector subroutines Algorithm 2 (NATG) and
Algorithm 3 (NSG) with Theorems 20-26 (appendices B and C); Theorem 4 (zCDP composition,
Bun & Steinke 2016) in the main body.

**NSG in eta-units, with exact noise.** NATG compares ``f'(D_t) + nu >= T + eta/xi_t``
with ``nu ~ Lap(4/xi_t)``, ``eta ~ Lap(2/xi_t)``. Multiplied by ``xi_t`` this is
``z_t + xi_t nu >= eta`` with ``z_t = xi_t (f'(D_t) - T)``: the noises have the *fixed*
scales 4 and 2 and ``z_t`` has sensitivity ``xi_t Delta_t <= xi_t0 Delta_t0`` for every
``t`` of a round started at ``t0``. Everything is done on an integer grid (pitfall 2):

* the grid at time ``t`` is ``g_t = 2^(floor(log2(xi_t Delta_t)) - 32)``, a power of two
  in ``(2^-33, 2^-32] xi_t Delta_t``. *Reading:* a fixed grid would add a fixed ``g`` to
  every round's sensitivity, and with the unbounded hard-query budget
  (``sum b_t ~ (log t)^2 / 2``) those terms sum to infinity; a grid proportional to
  ``xi_t Delta_t`` costs a relative ``2^-32`` instead.
* round start at ``t0`` (grid ``g = g_t0`` for the whole round): ``eta = K_eta g``,
  ``K_eta ~ DLap(2/g)`` (scale ``2 / g`` grid units), drawn **once per round**. *Reading:*
  Algorithm 2's pseudo-code redraws ``T_hat_t`` at the first query of each time step, but
  Theorem 20's proof uses a single ``eta`` with ``T_hat_t = T + eta / xi_t``; we implement
  the proof.
* a query at ``t``: ``z = round_half_up(xi_t (f'(D_t) - T) / g)`` computed **exactly**
  (``xi_t`` and ``f(y)`` as the exact rationals of their doubles, ``T`` the exact rational
  of the configured decimal, ``f(D_t)`` as ``Fraction(weighted_count, 2^16 t)``),
  ``K_nu ~ DLap(4/g)``; NATG halts iff ``z + K_nu >= K_eta``.
* on a halt at ``t1`` (grid ``g1 = g_t1``): the answer is
  ``a' = (round_half_up(xi_t1 f'(D_t1) / g1) + K_a) g1 / xi_t1`` with
  ``K_a ~ DLap(8/g1)``, fresh noise (never the noise that decided the halt, Lyu-Su-Li
  2017); then the round ends and the next query starts a new round (Algorithm 3).

*Privacy of one round* (Dwork & Roth Thm 3.23, the paper's Theorem 20, with integer
shifts). Rounding moves a value by at most half a grid step, so on neighbours every ``z``
of the round differs by at most ``s = (xi_t0 Delta_t0)(1 + 10^-12) + g`` in eta-units (the
``10^-12`` absorbs the float error of ``xi_t`` in the monotonicity of ``xi Delta``). Fix the
``K_nu`` of the queries before the halting one and let ``H(D)`` be the largest
``z + K_nu`` among them; the output "bottom ... bottom, halt" is the event
``H(D) < K_eta <= z_halt + K_nu,halt``. Shifting ``K_eta`` by ``H(D') - H(D)`` and
``K_nu,halt`` by at most ``2 s`` (integers, since everything lives on the grid) maps the
event for ``D`` onto the event for ``D'``; the discrete Laplace pmf changes by at most
``exp(|shift| / scale)`` under an integer shift, so the round's halting pattern costs
``eps_A = s/2 + 2s/4 = s``. The numeric answer is a discrete Laplace release of an integer
of sensitivity ``(xi_t1 Delta_t1 + g1) / g1`` grid steps at scale ``8 / g1``:
``eps_L = (xi_t1 Delta_t1 + g1) / 8``. A round that never halts costs ``eps_A`` only.
Writing ``S_t = xi_t Delta_t (1 + 10^-12) + g_t`` (so ``S_t <= sigma c t^(p-1)`` with
``sigma = (1 + 2^-50)(1 + 10^-12)(1 + 2^-32)``), a round costs at most
``S_t0 + S_t1 / 8``.

**Randomness** is exact (Canonne, Kamath, Steinke 2020 discrete Laplace) and replay-safe:
every draw is keyed by the caller's base coordinates (PMWG's are
``(*coordinates, "pmwg", spec.digest)``, the digest binding the noise to the mechanism's
parameters, pitfall 13): the threshold of round ``r`` comes from
``(*base, "natg", r, "threshold")``, the query noise of the ``k``-th PMWG query of the
round from ``(*base, "natg", r, k, "f'", which)`` (``which`` is 1 or 2 for
``f'_{2j-1}``, ``f'_{2j}``) and the numeric answer from ``(*base, "natg", r, "answer")``.
The same call sequence gives the same answers.

**State** (:meth:`NumericSparse.to_state`): the round and query counters, the open round's
grid exponent, whether a round is open and the number of halted rounds. No noise: the open
round's threshold is re-derived from the key.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Final

from dpstream.core.noise.coordinates import check_coordinates
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import RandomIntegers, discrete_laplace
from dpstream.errors import InvalidParameterError

__all__ = ["GRID_BITS", "NumericSparse", "dlap_variance"]

GRID_BITS: Final = 32
"""The NSG grid at time ``t`` is ``2^(floor(log2(xi_t / t)) - GRID_BITS)`` eta-units."""


def _round_half_up(x: Fraction) -> int:
    """Return ``floor(x + 1/2)`` exactly."""
    return (2 * x.numerator + x.denominator) // (2 * x.denominator)


def _floor_log2(x: Fraction) -> int:
    """Return ``floor(log2(x))`` exactly for ``x > 0``."""
    num, den = x.numerator, x.denominator
    k = num.bit_length() - den.bit_length()
    if k >= 0:
        return k if num >= den << k else k - 1
    return k if num << -k >= den else k - 1


def _pow2(exponent: int) -> Fraction:
    return Fraction(1 << exponent) if exponent >= 0 else Fraction(1, 1 << -exponent)



def dlap_variance(scale: Fraction | float) -> float:
    """Return the variance ``2 p / (1 - p)^2``, ``p = exp(-1/scale)``, of the discrete Laplace.

    Stable for the huge scales of the NSG grid (``1 - p`` via ``expm1``), where
    :func:`~dpstream.core.noise.samplers.discrete_laplace_variance` loses all precision.
    """
    x = 1.0 / float(scale)
    return 2.0 * math.exp(-x) / math.expm1(-x) ** 2


class NumericSparse:
    """Algorithm 3 (NSG) over Algorithm 2 (NATG) rounds, in eta-units, with exact noise.

    The caller opens a round with :meth:`start_round` (at public time ``t0``, with the
    grid exponent of ``t0``), asks :meth:`compare` for each ``f'`` (the exact eta-unit value
    ``xi_t (f'(D_t) - T)``), and after a halt releases :meth:`answer` (or, when the answer
    is not to be released, :meth:`close_unanswered`). See the module docstring for the
    privacy argument and the coordinates of every draw.

    Args:
        noise: the secret key.
        coordinates: the base coordinates; draws are at ``(*coordinates, "natg", ...)``.
        state: a dict from :meth:`to_state`, or ``None``.

    """

    __slots__ = (
        "_key", "_coordinates", "round_index", "query_index", "grid_exponent", "is_open",
        "halted_rounds", "_threshold",
    )

    def __init__(
        self,
        noise: NoiseKey,
        coordinates: tuple[str | int, ...],
        state: dict[str, Any] | None = None,
    ) -> None:
        self._key = noise
        self._coordinates = check_coordinates(coordinates)
        self.round_index = 0
        self.query_index = 0
        self.grid_exponent = 0
        self.is_open = False
        self.halted_rounds = 0
        self._threshold: int | None = None
        if state is not None:
            try:
                self.round_index = int(state["round_index"])
                self.query_index = int(state["query_index"])
                self.grid_exponent = int(state["grid_exponent"])
                self.is_open = bool(state["is_open"])
                self.halted_rounds = int(state["halted_rounds"])
            except (KeyError, TypeError, ValueError) as exc:
                raise InvalidParameterError(f"malformed NSG state: {exc!r}") from None

    def to_state(self) -> dict[str, Any]:
        """Return the round counters (no noise: the threshold is re-derived from the key)."""
        return {
            "round_index": self.round_index,
            "query_index": self.query_index,
            "grid_exponent": self.grid_exponent,
            "is_open": self.is_open,
            "halted_rounds": self.halted_rounds,
        }

    def _stream(self, *tail: str | int) -> RandomIntegers:
        return self._key.stream(*self._coordinates, "natg", *tail)

    @property
    def grid(self) -> Fraction:
        """The open round's grid step ``g`` (eta-units)."""
        return _pow2(self.grid_exponent)

    def _threshold_units(self) -> int:
        if self._threshold is None:
            rng = self._stream(self.round_index, "threshold")
            self._threshold = discrete_laplace(rng, Fraction(2) / self.grid)
        return self._threshold

    def start_round(self, grid_exponent: int) -> None:
        """Open round ``round_index`` on the grid ``2^grid_exponent`` and draw its threshold.

        Raises:
            InvalidParameterError: a round is already open.

        """
        if self.is_open:
            raise InvalidParameterError("an NSG round is already open")
        self.is_open = True
        self.query_index = 0
        self.grid_exponent = int(grid_exponent)
        self._threshold = None
        self._threshold_units()

    def compare(self, value: Fraction, which: int) -> bool:
        """Return whether NATG halts on ``f'`` with eta-unit value ``value`` (round stays open).

        ``value = xi_t (f'(D_t) - T)`` exactly; it is rounded half up to the round's grid and
        compared with fresh ``K_nu ~ DLap(4/g)`` drawn at
        ``("natg", round_index, query_index, "f'", which)``.

        Raises:
            InvalidParameterError: no round is open.

        """
        if not self.is_open:
            raise InvalidParameterError("no NSG round is open")
        g = self.grid
        z = _round_half_up(value / g)
        rng = self._stream(self.round_index, self.query_index, "f'", int(which))
        k_nu = discrete_laplace(rng, Fraction(4) / g)
        return z + k_nu >= self._threshold_units()

    def next_query(self) -> None:
        """Move to the next PMWG query of the open round."""
        self.query_index += 1

    def _close(self) -> None:
        self.is_open = False
        self.halted_rounds += 1
        self.round_index += 1
        self.query_index = 0
        self._threshold = None

    def answer(self, value: Fraction, grid_exponent: int) -> Fraction:
        """Release the halted round's numeric answer and close the round.

        Args:
            value: ``xi_t1 f'(D_t1)`` exactly (eta-units).
            grid_exponent: the grid exponent of the halting time ``t1``.

        Returns:
            ``(round_half_up(value / g1) + K_a) g1`` exactly, ``K_a ~ DLap(8 / g1)`` drawn
            at ``("natg", round_index, "answer")``.

        """
        if not self.is_open:
            raise InvalidParameterError("no NSG round is open")
        g1 = _pow2(int(grid_exponent))
        rng = self._stream(self.round_index, "answer")
        units = _round_half_up(value / g1) + discrete_laplace(rng, Fraction(8) / g1)
        self._close()
        return units * g1

    def close_unanswered(self) -> None:
        """Close a halted round whose numeric answer is not released."""
        if not self.is_open:
            raise InvalidParameterError("no NSG round is open")
        self._close()
