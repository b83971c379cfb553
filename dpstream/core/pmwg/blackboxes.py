"""Static black boxes for the black-box schedulers: the interface and the noisy histogram.

**Stated as OpenDP states a measurement**

(:class:`NoisyHistogram`)

* input domain: ``int64`` count histograms over ``N`` cells with a public size ``n``; input
  metric: add or remove one event, ``d_in = ||counts - counts'||_1`` (``d_in = 1``).
* function: ``counts + Z``, ``Z_i ~ DLap(1 / epsilon)`` iid and exact; the synopsis
  ``(counts + Z) / n`` is post-processing.
* output measure: pure epsilon-DP; privacy map: ``d_in ↦ epsilon d_in`` (Laplace mechanism
  of L1 sensitivity 1, Dwork & Roth 2014, Theorem 3.6; a replaced row is ``d_in = 2``). The
  box charges nothing: its scheduler charges the ``epsilon`` it runs it at.

A *black box* in the sense of Cummings, Krehbiel, Lai, Tantipongpipat 2018,
"Differential Privacy for Growing Databases" (Definition 4 of the main body,
and its ``(p, p', p'', g)`` form in appendix D.2) is a static algorithm
``M(x_n, epsilon, alpha, beta, n)`` that is ``(epsilon, 0)``-DP and, with
probability at least ``1 - beta``, answers every query of its class within
``alpha`` of the truth whenever ``alpha >= g (log(1/beta) / (epsilon n))^p``
(appendix D.2: ``g (1/(epsilon n))^p log^p''(n) log^p'(1/beta)``). The
schedulers (:mod:`dpstream.core.pmwg.bb_scheduler`, Algorithm 4, and
:mod:`dpstream.core.pmwg.bb_improver`, Algorithm 5) rerun such a box as the
database grows. This module defines the interface (:class:`BlackBox`,
:class:`Synopsis`) and the box production uses, :class:`NoisyHistogram`.
(MWEM and SmallDB, the paper's other examples, are test oracles kept with the
tests: a second, pre-checked black box for the schedulers.)

**Data and neighbours.** A database is an ``int64`` count histogram
``counts`` over a universe of ``N`` cells, and ``n`` is its public size (the
paper's database ``x_n`` has ``n`` rows; the schedulers pass their public time
``t``). Queries are linear: a weight vector ``w`` in ``[0, 1]^N`` whose value
is ``w . counts / n``. dpstream's privacy unit is one event, so neighbouring
inputs have ``counts`` differing by one in a single cell, with the same public
``n``. Every query then moves by at most ``1/n``. Privacy holds whatever
``counts`` holds; the accuracy bounds (``error_bound``) assume
``counts.sum() == n``.

**NoisyHistogram** (the Laplace histogram). Every cell gets independent
discrete Laplace noise of scale ``1/epsilon``. One event changes one cell by
one, and each cell alone is ``epsilon``-DP, so by parallel composition the
whole histogram is ``epsilon``-DP. (Under the paper's fixed-size neighbours
that *replace* a row, two cells move and the same noise gives
``2 epsilon``-DP.) The synopsis is ``noisy / n``. *Accuracy*: a query's error is
``|w . Z| / n <= sum_i |Z_i| / n``. For ``Z ~ DLap(b)``,
``E exp(|Z| / (2b)) = (1 + sqrt(q))^2 / (1 + q) <= 2`` with ``q = exp(-1/b)``.
By Chernoff, ``P(sum_i |Z_i| >= x) <= 2^N exp(-x / (2b))``, so with
probability ``1 - beta`` every query in ``[0, 1]^N`` is within
``2 (N ln 2 + ln(1/beta)) / (epsilon n)``. That is Definition 4 with ``p = 1``
and ``g = 2 (1 + N ln 2)`` whenever ``ln(1/beta) >= 1``:
``2 (N ln 2 + L) <= 2 (1 + N ln 2) L`` for ``L >= 1``. Definition 4
lets ``g`` depend on the domain (here ``N``), never on ``beta``. The
schedulers pass ``beta_i <= beta / (1 + beta)`` (BBScheduler) or
``beta / (2 t^2)`` (BBImprover), which is ``<= 1/e`` whenever their
``beta <= 1/(e - 1) ~ 0.58``. In the
``(p, p', p'', g)`` form it is ``p' = 1, p'' = 0``.

**A person's rows** (``sensitivity = m``, the user level's ``max_rows``). When the protected
unit is a person who adds at most ``m`` rows, neighbouring histograms differ by at most ``m``
in L1 (``m`` cells, each by at most ``m``, in all ``m``). The box then draws
``DLap(m / epsilon)`` per cell: the Laplace mechanism at L1 sensitivity ``m`` and scale
``m / epsilon`` is ``epsilon``-DP (Dwork & Roth 2014, Theorem 3.6; the discrete Laplace pmf
ratio at an integer shift ``d`` is ``exp(-|d| epsilon / m)``, and the shifts of the cells sum
to at most ``m``), so the scheduler's ``epsilon_i`` now pays for one person. Its error is
``m`` times the event level's, which is Definition 4 with ``g = 2 m (1 + N ln 2)``: the
scheduler's ``gamma`` and accuracy follow from ``g``. Its name carries ``m`` (so its noise
coordinates differ from the event level's, pitfall 13); ``m = 1`` is the event-level box.

**Exact sampling.** All noise comes from the exact samplers of
:mod:`dpstream.core.noise.samplers` (Canonne, Kamath, Steinke 2020): the
noisy histogram draws one discrete Laplace per cell. Floating point appears
only in post-processing of released values (the synopsis).

**Replay safety.** A run draws only from ``rng_for(*coordinates)``; the
schedulers bind that to the secret key and to the run's coordinates, so a
replay reproduces the same synopsis.

**Synopses.** A box outputs a :class:`HistogramSynopsis`: a dense
vector ``y`` over the ``N`` cells, answering ``w . y``. Its state is the
vector as a list of floats. It is released data and can be stored in the
clear.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any, Final, Protocol, TypeAlias, runtime_checkable

import numpy as np
import numpy.typing as npt

from dpstream.core._checks import integer_at_least, positive_finite
from dpstream.core.accounting.ledger import exact
from dpstream.core.noise.samplers import RandomIntegers, discrete_laplace
from dpstream.errors import InvalidParameterError

__all__ = [
    "BlackBox",
    "HistogramSynopsis",
    "NoisyHistogram",
    "PrecheckedBlackBox",
    "RngFor",
    "Synopsis",
    "synopsis_from_state",
]

FloatArray: TypeAlias = npt.NDArray[np.float64]
IntArray: TypeAlias = npt.NDArray[np.int64]
RngFor: TypeAlias = Callable[..., RandomIntegers]
"""``rng_for(*coordinates)``: replay-safe uniform integers for a run's sub-coordinates."""

_SYNOPSIS_KIND: Final = "histogram"
_SYNOPSIS_VERSION: Final = 1


class Synopsis(Protocol):
    """What a black box releases: answers linear queries without touching the data."""

    def answer(self, weights: npt.NDArray[Any]) -> float:
        """Return the value of the linear query ``weights`` (in ``[0, 1]^N``)."""
        ...

    def to_state(self) -> dict[str, Any]:
        """Return JSON-safe data that :func:`synopsis_from_state` turns back into it."""
        ...


class BlackBox(Protocol):
    """A static ``(epsilon, 0)``-DP algorithm with a ``(p, p', p'', g)`` accuracy guarantee.

    Attributes:
        name: a short stable name (part of the noise coordinates and of the state).
        p: the exponent ``p`` of Definition 4.
        p_prime: ``p'`` (the power of ``log(1/beta)`` in appendix D.2's form).
        p_double_prime: ``p''`` (the power of ``log n`` in appendix D.2's form).
        g: the domain-dependent factor ``g`` of Definition 4.

    """

    name: str
    p: float
    p_prime: float
    p_double_prime: float
    g: float

    def run(
        self,
        counts: npt.NDArray[np.int64],
        n: int,
        epsilon: float,
        alpha: float,
        beta: float,
        rng_for: RngFor,
    ) -> Synopsis:
        """Run once on ``counts`` (public size ``n``) at ``epsilon``-DP; return a synopsis."""
        ...


@runtime_checkable
class PrecheckedBlackBox(Protocol):
    """A black box that can refuse a run's parameters before any data is seen."""

    def check_run(self, n: int, epsilon: float, alpha: float, beta: float) -> None:
        """Raise :class:`InvalidParameterError` if a run with these parameters is refused."""
        ...


# --- shared checks ------------------------------------------------------------------


def _check_counts(counts: object, size: int) -> IntArray:
    if not isinstance(counts, np.ndarray) or counts.ndim != 1 or counts.dtype.kind not in "iu":
        raise InvalidParameterError(
            "counts must be a 1-D numpy array of integers, got "
            + (f"an array of dtype {counts.dtype} and shape {counts.shape}"
               if isinstance(counts, np.ndarray) else f"a {type(counts).__name__}")
        )
    if counts.shape[0] != size:
        raise InvalidParameterError(
            f"counts must have one cell per universe element (N = {size}), "
            f"got {counts.shape[0]} cells"
        )
    if counts.size and int(counts.min()) < 0:
        # the values are data: never shown
        raise InvalidParameterError("counts must be >= 0, got a negative cell")
    return counts.astype(np.int64, copy=False)


def _check_beta(beta: object) -> float:
    if not (isinstance(beta, (int, float)) and not isinstance(beta, bool)
            and math.isfinite(beta) and 0 < beta < 1):
        raise InvalidParameterError(f"beta must be in (0, 1), got {beta!r}")
    return float(beta)


def _check_run(n: object, epsilon: object, alpha: object, beta: object) -> tuple[int, float]:
    size = integer_at_least("n", n, 1)
    eps = positive_finite("epsilon", epsilon)
    positive_finite("alpha", alpha)
    _check_beta(beta)
    return size, eps


def _check_weights(weights: object, size: int) -> FloatArray:
    if not isinstance(weights, np.ndarray) or weights.ndim != 1:
        raise InvalidParameterError(
            f"weights must be a 1-D numpy array of {size} numbers in [0, 1], got "
            + (f"shape {weights.shape}" if isinstance(weights, np.ndarray)
               else f"a {type(weights).__name__}")
        )
    if weights.shape[0] != size:
        raise InvalidParameterError(
            f"weights must have one entry per universe element (N = {size}), "
            f"got {weights.shape[0]}"
        )
    if weights.dtype.kind not in "iuf":
        raise InvalidParameterError(f"weights must be numbers, got dtype {weights.dtype}")
    w = weights.astype(np.float64, copy=False)
    if not bool(np.all(np.isfinite(w))) or (w.size and (w.min() < 0.0 or w.max() > 1.0)):
        raise InvalidParameterError("weights must be finite and in [0, 1]")
    return w


# --- the synopsis -------------------------------------------------------------------


class HistogramSynopsis:
    """A released vector ``y`` over the ``N`` cells; a linear query ``w`` gets ``w . y``.

    Args:
        values: the released cell values (already normalised by the database size).

    Raises:
        InvalidParameterError: ``values`` is not a non-empty 1-D array of finite numbers.

    """

    __slots__ = ("_values",)

    def __init__(self, values: npt.NDArray[Any]) -> None:
        if not isinstance(values, np.ndarray) or values.ndim != 1 or values.size == 0:
            raise InvalidParameterError("synopsis values must be a non-empty 1-D numpy array")
        v = np.array(values, dtype=np.float64)
        if not bool(np.all(np.isfinite(v))):
            raise InvalidParameterError("synopsis values must be finite")
        v.setflags(write=False)
        self._values: FloatArray = v

    @property
    def values(self) -> FloatArray:
        """The released cell values (read-only)."""
        return self._values

    @property
    def size(self) -> int:
        """The universe size ``N``."""
        return int(self._values.shape[0])

    def answer(self, weights: npt.NDArray[Any]) -> float:
        """Return ``weights . values`` for a weight vector in ``[0, 1]^N``.

        Raises:
            InvalidParameterError: ``weights`` has the wrong shape or leaves ``[0, 1]``.

        """
        w = _check_weights(weights, self.size)
        return float(w @ self._values)

    def to_state(self) -> dict[str, Any]:
        """Return the synopsis as JSON-safe data (floats round-trip exactly)."""
        return {
            "kind": _SYNOPSIS_KIND,
            "version": _SYNOPSIS_VERSION,
            "values": [float(v) for v in self._values],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> HistogramSynopsis:
        """Rebuild a synopsis from :meth:`to_state`.

        Raises:
            InvalidParameterError: ``state`` is malformed.

        """
        try:
            if state["kind"] != _SYNOPSIS_KIND or state["version"] != _SYNOPSIS_VERSION:
                raise InvalidParameterError(
                    f"unknown synopsis kind/version {state['kind']!r}/{state['version']!r}"
                )
            values = np.array([float(v) for v in state["values"]], dtype=np.float64)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidParameterError):
                raise
            raise InvalidParameterError(f"malformed synopsis state: {exc!r}") from None
        return cls(values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HistogramSynopsis) and bool(
            np.array_equal(self._values, other._values)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"HistogramSynopsis(N={self.size})"


def synopsis_from_state(state: dict[str, Any]) -> Synopsis:
    """Load any synopsis this module's black boxes release, from its ``to_state()`` dict.

    Raises:
        InvalidParameterError: unknown kind or malformed state.

    """
    kind = state.get("kind") if isinstance(state, dict) else None
    if kind == _SYNOPSIS_KIND:
        return HistogramSynopsis.from_state(state)
    raise InvalidParameterError(f"unknown synopsis kind {kind!r}")


# --- NoisyHistogram -----------------------------------------------------------------


class NoisyHistogram:
    """The ``epsilon``-DP Laplace histogram: every cell plus exact ``DLap(m/epsilon)`` noise.

    ``(p, p', p'', g) = (1, 1, 0, 2 m (1 + N ln 2))`` for ``beta <= 1/e`` (module docstring).

    Args:
        universe_size: the number of cells ``N``.
        sensitivity: ``m``, the rows one protected unit may add (1: one event).

    Raises:
        InvalidParameterError: ``universe_size`` is not an integer >= 1.

    """

    __slots__ = ("name", "p", "p_prime", "p_double_prime", "g", "universe_size", "sensitivity")

    def __init__(self, universe_size: int, sensitivity: int = 1) -> None:
        self.universe_size = integer_at_least("universe_size", universe_size, 1)
        self.sensitivity = integer_at_least("sensitivity", sensitivity, 1)
        self.name = "noisy-histogram" if self.sensitivity == 1 \
            else f"noisy-histogram-m{self.sensitivity}"
        self.p = 1.0
        self.p_prime = 1.0
        self.p_double_prime = 0.0
        self.g = 2.0 * (1.0 + self.universe_size * math.log(2.0))
        if self.sensitivity != 1:
            self.g *= self.sensitivity

    @staticmethod
    def noise_scale(epsilon: float, sensitivity: int = 1) -> Fraction:
        """Return the exact discrete Laplace scale ``m / epsilon`` of every cell."""
        return Fraction(sensitivity) / exact(positive_finite("epsilon", epsilon))

    def error_bound(self, n: int, epsilon: float, alpha: float, beta: float) -> float:
        """Return ``2 m (N ln 2 + ln(1/beta)) / (epsilon n)``; ``alpha`` is not used.

        With probability at least ``1 - beta`` every query in ``[0, 1]^N`` is
        answered within this bound (Chernoff bound of the module docstring).
        """
        size, eps = _check_run(n, epsilon, alpha, beta)
        bound = 2.0 * (self.universe_size * math.log(2.0) + math.log(1.0 / beta)) / (eps * size)
        return bound if self.sensitivity == 1 else bound * self.sensitivity

    def run(
        self,
        counts: npt.NDArray[np.int64],
        n: int,
        epsilon: float,
        alpha: float,
        beta: float,
        rng_for: RngFor,
    ) -> HistogramSynopsis:
        """Release ``(counts + DLap(m/epsilon)) / n`` cell by cell, all from ``rng_for("cells")``.

        Raises:
            InvalidParameterError: bad counts or parameters.

        """
        cells = _check_counts(counts, self.universe_size)
        size, _ = _check_run(n, epsilon, alpha, beta)
        scale = self.noise_scale(epsilon, self.sensitivity)
        rng = rng_for("cells")
        noisy = [c + discrete_laplace(rng, scale) for c in cells.tolist()]
        return HistogramSynopsis(np.array(noisy, dtype=np.float64) / size)

    def __repr__(self) -> str:
        return f"NoisyHistogram(N={self.universe_size})"
