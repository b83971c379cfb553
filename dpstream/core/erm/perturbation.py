"""Private regularized ERM (logistic regression) by output perturbation on an exact integer grid.

This is the static building block of the release schedules of Watson et al., "Continual and
Sliding Window Release for Private ERM" (paper 004; the schedules live in
:mod:`dpstream.core.erm.schedules`): **Algorithm 1** (PSGD, output perturbation, Wu et al. 2017),
**Algorithm 3** (PBERM: the same with the penalty centred at an earlier *released* model) and
**Algorithm 7** (PBERM on ``2^j b0`` events normalised by ``2^j b0``). All three are
:func:`private_erm`: solve the regularized problem to a certified precision, round the
minimiser onto a rational grid exactly, add exact integer noise.

**Objective.** An event is a feature vector ``x`` (``d`` numbers) and one of ``K >= 2`` public
classes. Its features are clipped to the L2 ball of radius ``R`` (``clip_norm``) and scaled,
``z = x_clipped / R``, then ``z = [z, 1] / sqrt(2)`` when an intercept is fitted, so
``||z|| <= 1`` (:meth:`ErmSpec.features`; the map shrinks by a further ``1 - 2^-32`` so that the
bound holds for the stored floats, whatever their rounding). With parameters ``w`` of shape
``(rows, columns)`` (one row for ``K = 2``, ``K`` rows otherwise), a public centre ``c`` (zero,
or an earlier *released* model: post-processing) and a public normaliser ``n̄``::

    J(w) = (1/n̄) sum_i l(w; z_i, y_i) + (lambda/2) ||w - c||^2

``l`` is the binary logistic loss ``log(1 + e^s) - y s``, ``s = w.z``, labels ``0/1`` (class
``classes[1]`` iff ``s > 0``), or the softmax cross-entropy ``logsumexp(W z) - (W z)_y``.
Gradients: ``(sigmoid(s) - y) z`` and ``(p - e_y) z^T``, so ``l`` is ``L``-Lipschitz in ``w``
with ``L = 1`` (binary) and ``L = sqrt(2)`` (multinomial: ``||p - e_y||^2 = (1 - p_y)^2 +
sum_{k != y} p_k^2 <= 2 (1 - p_y)^2 <= 2``). Hessians: ``sigmoid' z z^T <= 1/4`` and
``(diag(p) - p p^T) (x) z z^T``, whose largest eigenvalue is at most ``1/2`` (Böhning 1992), so
``l`` is ``1/4``- resp. ``1/2``-smooth. ``J`` is ``lambda``-strongly convex. *Convention:* the
paper writes ``lambda ||w - w_g||^2``; our ``lambda`` is twice the paper's.

**Sensitivity** (Chaudhuri, Monteleoni, Sarwate 2011, Lemma 7; Wu et al. 2017). Neighbouring
streams differ by one event added or removed, and ``n̄`` is *public* (blocks times the nominal
block size ``b0``), so adding an event ``e`` turns ``J`` into ``J' = J + l(.; e)/n̄``. With
``w* = argmin J`` and ``w' = argmin J'``, strong convexity of ``J`` gives
``lambda ||w' - w*||^2 <= <grad J(w') - grad J(w*), w' - w*> = <-grad l(w'; e)/n̄, w' - w*>``,
hence ``||w' - w*|| <= L / (lambda n̄) = Delta`` (:meth:`ErmSpec.sensitivity`, an exact rational
upper bound computed from the very floats the solver uses). Under replace-one the bound doubles,
``2 L / (lambda n̄)``: that is the paper's Lemma A.1 constant (:meth:`ErmSpec.replace_sensitivity`,
documented, not used by the flow). A *private* count in the normaliser would break this: one
event would rescale every other event's weight.

**What is not taken from the paper.** (a) Its experiments (Fig. 4) use the Lipschitz constant
``(k - 1)/(2 m k) ||X||_F`` of the cross-entropy (after Yedida et al. 2021). That number depends
on the private feature matrix ``X`` and bounds the gradient of the *average* loss, not of one
event's loss; calibrating noise with it leaks ``||X||_F`` and under-noises by about ``sqrt(m)``.
We use the per-event constants above, which hold for every possible event. (b) Algorithm 1 line 3
and Lemma A.2 add ``Lap(Delta/epsilon)`` to each coordinate with ``Delta`` an *L2* sensitivity.
The Laplace mechanism needs the *L1* sensitivity, up to ``sqrt(p)`` times larger, so that
calibration is not epsilon-DP. We charge ``sqrt(p)`` times the L2 bound (plus rounding) in L1.
(c) Algorithm 7 line 2 normalises by ``n``, the size of the data it is given, which in
Algorithm 8 (line 12) is the Poisson sample; we keep the public ``2^j b0`` (see *Poisson
subsampling* below).

**Certificate.** Output perturbation needs the exact minimiser. For any ``w``, strong convexity
gives ``||w - w*|| <= ||grad J(w)|| / lambda``. :func:`solve` runs L-BFGS-B (scipy, warm-started
at the centre), then Newton-CG steps with exact Hessian-vector products, each accepted only if it
shrinks ``||grad J||`` at least by the factor ``1 - lambda/beta`` that a plain gradient step
``w - grad J(w)/beta`` guarantees (``beta = smoothness m/n̄ + lambda``, the smoothness of ``J``;
``grad J(w+) = (I - A/beta) grad J(w)`` with ``lambda I <= A <= beta I``); otherwise it takes
that gradient step. So the loop provably terminates. It stops when the computed
``||grad J|| <= lambda tau / 2`` with ``tau = Delta 2^-20`` (:data:`PRECISION_BITS`). The other
half of ``lambda tau`` is the allowance for the floating-point error of evaluating the gradient:
that error is about ``u log2(m) m / n̄`` per coordinate for blocked summation (``u = 2^-53``;
rounding errors that behave randomly give ``u sqrt(m) / n̄``), the allowance is
``L 2^-21 / n̄``, so it covers the pessimistic estimate while ``sqrt(p) m log2(m)`` stays below
about ``4 10^9`` (``10^6`` events at ``p = 65`` with a 25-fold margin) and the typical error far
beyond. This is an error *model*, as in the design, not a proof. Then the computed ``w`` lies
within ``tau`` of ``w*`` and for neighbours ``||w(D) - w(D')|| <= Delta + 2 tau = (1 + 2^-19)
Delta``: that is the sensitivity charged. How ``w`` was found (iterations, warm start) does not
matter, only the certificate. scipy earns its place: L-BFGS-B's line search (Moré-Thuente) reaches
the neighbourhood of the optimum in a few dozen iterations whatever the conditioning, which a
hand-written method would have to replicate (more code to audit); privacy never depends on it,
since the certificate is checked afterwards. It is imported lazily, so the rest of the core
imports without scipy. If float64 cannot reach the certificate (gradient steps stop shrinking
the gradient: far beyond the sizes above), :func:`private_erm` raises
:class:`CertificationError` rather than release an uncertified model; :func:`solve` itself never
raises on data.

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

**Noise level: constant noise, decreasing cost.** The paper's schedules keep the *real* noise
scale fixed by a reference computation and let larger datasets cost less. A :class:`NoiseLevel`
``(Delta_ref, cost_ref)`` fixes, for pure DP, the real scale ``b = D1 g(Delta_ref) / cost_ref``;
a computation at sensitivity ``Delta`` then uses the integer discrete Laplace scale
``t = b / g(Delta)`` and costs ``epsilon = D1 / t = D1 g(Delta) / b = cost_ref g(Delta) /
g(Delta_ref) = cost_ref Delta / Delta_ref``, exactly, because ``g`` is proportional to
``Delta`` with a constant factor and every quantity is a Fraction. For zCDP the real variance is
``V = (1 + 10^-12) D2^2 g(Delta_ref)^2 / (2 cost_ref)``, the integer variance
``sigma^2 = V / g(Delta)^2`` and ``rho = (1 + 10^-12) D2^2 / (2 sigma^2) =
cost_ref (Delta / Delta_ref)^2``, exactly. The factor ``1 + 10^-12`` reserves room for the
discreteness term of CKS 2020 Theorem 14 (bounded as in :mod:`dpstream.core.counting.blt_counter`
and
checked for every computation; it is below ``10^-100`` of rho unless rho exceeds ``10^5``).

**Privacy of one release.** Pure: the released integers are ``r + Y`` with ``Y_j`` iid discrete
Laplace of scale ``t`` (``P(y) ~ exp(-|y|/t)``, CKS 2020 Algorithm 2); for neighbours the density
ratio is at most ``exp(||r - r'||_1 / t) <= exp(D1 / t) = e^epsilon``. zCDP: ``Y_j`` iid
``N_Z(0, sigma^2)`` (CKS 2020 Algorithm 3) on ``r`` with ``||r - r'||_2 <= D2`` is
``(D2^2 / (2 sigma^2) + discreteness)``-zCDP (CKS 2020, Theorem 14). The grid ``g`` depends only
on public quantities (the spec and ``n̄``), the float parameters ``g (r + Y)`` are
post-processing, and the paper's per-coordinate scales are reproduced only as cost fractions.

**Poisson subsampling** (:func:`poisson_sample`, :func:`amplified_epsilon`). Keeping each event
independently with probability ``q`` before an epsilon-DP mechanism gives
``ln(1 + q (e^epsilon - 1))``-DP under add/remove (Li, Qardaji, Su 2012; Balle, Barthe, Gaboardi
2018, Poisson subsampling). *Reading of Algorithms 6-8:* with ``q = (e^{epsilon/(2 2^k)} - 1) /
(e^{epsilon/2} - 1)`` and a base mechanism that is ``epsilon/2``-DP, the amplified cost is
exactly ``epsilon/(2 2^k)`` as the paper claims. But the base mechanism is ``epsilon/2``-DP at
noise ``4L/(lambda 2^k B epsilon)`` only if the sampled objective is normalised by the FULL
public size ``n̄ = 2^k B``: normalised by the sample size ``n' ~ q 2^k B`` (Algorithm 7 line 2)
its sensitivity is about ``2^k`` times larger, the base mechanism is only about
``2^{k-1} epsilon``-DP, ``ln(1 + q (e^{2^{k-1} epsilon} - 1))`` is far above
``epsilon/(2 2^k)``, and ``n'`` itself is private. So the claim holds with the public
normaliser and is false with the sample size; we use the public one (the sampled data term is
then about ``q`` times lighter, i.e. the model leans on its centre). Sampling is for pure DP only.

**Exactness and replay-safety.** All randomness comes from the ``rng`` passed in, which the
caller derives from ``NoiseKey.stream(*coordinates)`` for the release's coordinates:
:func:`private_erm` draws coordinate ``j``'s noise from that one stream in row-major order, and
:func:`poisson_sample` one uniform integer per row. Everything else is deterministic (the solver
is a fixed computation of its inputs), so a replayed release is byte-identical to the first.

**State.** :meth:`PrivateModel.to_state` holds the released integers, the grid and the cost as
exact strings (public once released) and ``size``, the number of events used, which is NOT
public: keep the snapshot in the secret recovery store. A :class:`Solution` holds the
non-private minimiser: never persist or publish it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from fractions import Fraction
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from dpstream.core._checks import fraction_text, integer_at_least, positive_finite
from dpstream.core.accounting.ledger import Accounting, exact
from dpstream.core.noise.samplers import (
    RandomIntegers,
    discrete_gaussian,
    discrete_gaussian_variance,
    discrete_laplace,
    discrete_laplace_variance,
)
from dpstream.errors import DpstreamError, InvalidParameterError

__all__ = [
    "GRID_BITS",
    "PRECISION_BITS",
    "Accounting",
    "Block",
    "CertificationError",
    "ErmSpec",
    "NoiseLevel",
    "PrivateModel",
    "Solution",
    "amplified_epsilon",
    "decision_function",
    "poisson_sample",
    "predict",
    "predict_proba",
    "private_erm",
    "round_to_grid",
    "sampling_rate",
    "solve",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

PRECISION_BITS: Final = 20
"""The solver's certified precision is ``tau = Delta 2^-PRECISION_BITS``."""
GRID_BITS: Final = 12
"""The grid is ``g = Delta / (2^GRID_BITS ceil(sqrt(p)))``."""
_ACCOUNTINGS: Final = ("pure", "zcdp")
_SLACK: Final = 1 + Fraction(2, 1 << PRECISION_BITS)  # (Delta + 2 tau) / Delta
_ZCDP_RESERVE: Final = Fraction(1, 10**12)  # share of rho kept for the CKS discreteness term
_SQRT2_UP: Final = Fraction(math.isqrt(2 << 80) + 1, 1 << 40)  # > sqrt(2)
_FEATURE_SHRINK: Final = 1.0 - 2.0**-32  # ||z|| <= 1 survives the rounding of the map
_INV_SQRT2: Final = 1.0 / math.sqrt(2.0)
_STATE_VERSION: Final = 1
_MAX_POLISH_STEPS: Final = 10_000
_MAX_NEWTON_FAILURES: Final = 5  # then only the guaranteed gradient steps
_LBFGS_MAX_ITERATIONS: Final = 2_000
_AMPLIFY_DIGITS: Final = 60  # decimal working precision of amplified_epsilon / sampling_rate
_COST_DENOMINATOR: Final = 10**18  # amplified costs are rounded up to this denominator
_RATE_DENOMINATOR: Final = 10**30  # sampling rates are rounded down to this denominator


class CertificationError(DpstreamError):
    """The solver could not certify its minimiser to the required precision in float64.

    Raised by :func:`private_erm` instead of releasing a model whose distance to the exact
    minimiser is not bounded (the sensitivity argument would not cover it). It only happens far
    outside the supported range (the module docstring's *Certificate*: blocks of many millions
    of events).
    """


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


def _parse_fraction(text: object, name: str) -> Fraction:
    if not isinstance(text, str):
        raise InvalidParameterError(f"malformed ERM model state: {name} must be a 'num/den' string")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise InvalidParameterError(
            f"malformed ERM model state: {name} is not a fraction"
        ) from None


def _as_fraction(name: str, value: object) -> Fraction:
    """Return ``value`` as a Fraction > 0 (Fraction, int, or float read as its decimal)."""
    if isinstance(value, bool) or not isinstance(value, (Fraction, int, float)):
        raise InvalidParameterError(f"{name} must be a Fraction > 0, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidParameterError(f"{name} must be finite and > 0, got {value!r}")
    x = exact(value)
    if x <= 0:
        raise InvalidParameterError(f"{name} must be > 0, got {value}")
    return x


# --- the specification ----------------------------------------------------------------------


@dataclass(frozen=True)
class ErmSpec:
    """A private logistic-regression problem: classes, features, clipping, penalty, accounting.

    Attributes:
        classes: ``K >= 2`` distinct public labels (int or str). ``K == 2``: binary logistic
            regression with one row of weights, decision ``w.z > 0`` meaning ``classes[1]``.
            ``K > 2``: multinomial softmax regression with ``K`` rows.
        dimension: the number ``d >= 1`` of raw features.
        clip_norm: ``R > 0``; feature vectors are clipped to L2 norm ``R`` and divided by ``R``.
        regularization: ``lambda > 0``, the strong convexity of the objective.
        intercept: whether a constant feature is appended (``columns = d + 1``).
        accounting: ``"pure"`` (epsilon, discrete Laplace) or ``"zcdp"`` (rho, discrete
            Gaussian).

    """

    classes: tuple[int | str, ...]
    dimension: int
    clip_norm: float
    regularization: float
    intercept: bool = True
    accounting: Accounting = "pure"

    def __post_init__(self) -> None:
        classes = self.classes
        if not isinstance(classes, tuple) or len(classes) < 2:
            raise InvalidParameterError(
                f"classes must be a tuple of at least 2 labels, got {classes!r}"
            )
        if not all(type(c) is int or type(c) is str for c in classes):
            raise InvalidParameterError(f"classes must be ints or strings, got {classes!r}")
        if len(set(classes)) != len(classes):
            raise InvalidParameterError(f"classes must be distinct, got {classes!r}")
        integer_at_least("dimension", self.dimension, 1)
        positive_finite("clip_norm", self.clip_norm)
        positive_finite("regularization", self.regularization)
        if not isinstance(self.intercept, bool):
            raise InvalidParameterError(f"intercept must be a bool, got {self.intercept!r}")
        if self.accounting not in _ACCOUNTINGS:
            raise InvalidParameterError(
                f"accounting must be one of {_ACCOUNTINGS}, got {self.accounting!r}"
            )
        object.__setattr__(self, "_index", {c: i for i, c in enumerate(classes)})

    # -- shape and constants --
    @property
    def binary(self) -> bool:
        """Whether this is binary logistic regression (``K == 2``)."""
        return len(self.classes) == 2

    @property
    def rows(self) -> int:
        """Rows of the parameter matrix: 1 (binary) or ``K``."""
        return 1 if self.binary else len(self.classes)

    @property
    def columns(self) -> int:
        """Columns of the parameter matrix (and of a feature row): ``d + 1`` or ``d``."""
        return int(self.dimension) + (1 if self.intercept else 0)

    @property
    def parameter_count(self) -> int:
        """The number ``p = rows * columns`` of parameters."""
        return self.rows * self.columns

    @property
    def lipschitz(self) -> float:
        """The loss's Lipschitz constant in ``w`` on ``||z|| <= 1``: 1 or ``sqrt(2)``."""
        return 1.0 if self.binary else math.sqrt(2.0)

    @property
    def smoothness(self) -> float:
        """The loss's smoothness on ``||z|| <= 1``: 1/4 (binary) or 1/2 (Böhning 1992)."""
        return 0.25 if self.binary else 0.5

    @property
    def grid_constant(self) -> Fraction:
        """``c_g = 1/(2^12 ceil(sqrt(p)))``: the grid is ``c_g`` times the sensitivity."""
        return _grid_constants(self.parameter_count)[0]

    @property
    def grid_l1_sensitivity(self) -> int:
        """``D1``, the L1 distance of neighbours' rounded integer vectors (an integer)."""
        return _grid_constants(self.parameter_count)[1]

    @property
    def grid_l2_sensitivity(self) -> Fraction:
        """``D2``, a rational bound on the L2 distance of neighbours' rounded integer vectors."""
        return _grid_constants(self.parameter_count)[2]

    # -- labels --
    def label_index(self, label: object) -> int:
        """Return the index of ``label`` in :attr:`classes`.

        Raises:
            InvalidParameterError: ``label`` is not one of the classes (the message does not
                show it: labels are data).

        """
        index: dict[object, int] = self.__dict__["_index"]
        if isinstance(label, (bool, np.bool_)):
            raise InvalidParameterError(
                f"a label must be one of the {len(self.classes)} classes, got a bool"
            )
        try:
            return index[label]
        except (KeyError, TypeError):
            raise InvalidParameterError(
                f"a label is not one of the {len(self.classes)} classes of this model "
                f"(got a {type(label).__name__})"
            ) from None

    def label_indices(self, labels: Sequence[object] | npt.NDArray[Any]) -> IntArray:
        """Return the class indices of ``labels`` as an int64 array (see :meth:`label_index`)."""
        return np.fromiter((self.label_index(v) for v in labels), dtype=np.int64, count=len(labels))

    # -- features --
    def check_features(self, x: object) -> str | None:
        """Say why ``x`` cannot be feature-mapped, or return None.

        ``x`` is one event's features (``d`` numbers) or a matrix with ``d`` columns. The reason
        never shows a value (features are data), so a caller can put it on a dead letter.
        """
        try:
            raw = np.asarray(x)
        except (TypeError, ValueError):
            return f"features must be {self.dimension} numbers"
        if raw.dtype.kind not in "iuf":
            return f"features must be {self.dimension} numbers"
        arr = raw.astype(np.float64, copy=False)
        if arr.ndim == 1:
            arr = arr[None, :]
        if arr.ndim != 2 or arr.shape[1] != self.dimension:
            return f"features must be {self.dimension} numbers per event"
        if not bool(np.isfinite(arr).all()):
            return "features must be finite (a value is NaN or infinite)"
        return None

    def features(self, x: object) -> FloatArray:
        """Return the feature map ``z`` of ``x`` (one event or ``m`` rows): ``(m, columns)``.

        Rows are clipped to L2 norm ``R`` and divided by ``R``; with an intercept a constant
        column is appended and the row divided by ``sqrt(2)``. Every row has ``||z|| <= 1``
        (computed with a scaling that cannot overflow, and shrunk by ``1 - 2^-32``).

        Raises:
            InvalidParameterError: :meth:`check_features` gives a reason (callers should check
                each event first and dead-letter the bad ones).

        """
        reason = self.check_features(x)
        if reason is not None:
            raise InvalidParameterError(reason)
        arr = np.asarray(x, dtype=np.float64)
        if arr.ndim == 1:
            arr = arr[None, :]
        m, d = arr.shape
        cols = self.columns
        out = np.empty((m, cols), dtype=np.float64)
        if m == 0:
            return out
        top = np.max(np.abs(arr), axis=1)
        safe = np.where(top > 0.0, top, 1.0)
        unit = arr / safe[:, None]  # entries in [-1, 1], norm in [1, sqrt(d)] (or 0)
        unit_norm = np.sqrt(np.einsum("ij,ij->i", unit, unit))
        with np.errstate(over="ignore", divide="ignore"):
            limit = float(self.clip_norm) / safe  # R / max|x|; may overflow to inf (z -> 0)
        factor = _FEATURE_SHRINK / np.maximum(unit_norm, limit)
        if self.intercept:
            factor *= _INV_SQRT2
            out[:, d] = _FEATURE_SHRINK * _INV_SQRT2
        np.multiply(unit, factor[:, None], out=out[:, :d])
        return out

    def linear_model(self, params: object) -> tuple[FloatArray, FloatArray]:
        """Return ``(coef, intercept)`` for raw rows clipped to ``clip_norm``.

        The inverse of :meth:`features` on the parameters: for every row ``x`` with
        ``x_c = x·min(1, R/||x||)``, ``params @ features(x) = coef @ x_c + intercept`` (up to
        float rounding). Post-processing of a released model: what a consumer scores with.
        """
        w = np.atleast_2d(np.asarray(params, dtype=np.float64))
        d, scale = self.dimension, _FEATURE_SHRINK / float(self.clip_norm)
        if self.intercept:
            return w[:, :d] * (scale * _INV_SQRT2), w[:, d] * (_FEATURE_SHRINK * _INV_SQRT2)
        return w * scale, np.zeros(w.shape[0])

    def block(self, x: object, labels: Sequence[object] | npt.NDArray[Any]) -> Block:
        """Return the :class:`Block` of events with features ``x`` and labels ``labels``."""
        z = self.features(x)
        y = self.label_indices(labels)
        if len(y) != z.shape[0]:
            raise InvalidParameterError("features and labels must have the same number of rows")
        return Block(z, y)

    # -- sensitivity --
    def _check_normalizer(self, normalizer: object) -> float:
        return positive_finite("normalizer", normalizer)

    def sensitivity(self, normalizer: float) -> Fraction:
        """Return ``L / (lambda n̄)`` (add/remove), an exact rational upper bound.

        ``lambda`` and ``n̄`` are taken as the exact values of the floats the solver uses;
        ``sqrt(2)`` is replaced by a rational just above it.
        """
        n = self._check_normalizer(normalizer)
        lip = Fraction(1) if self.binary else _SQRT2_UP
        return lip / (Fraction(float(self.regularization)) * Fraction(n))

    def replace_sensitivity(self, normalizer: float) -> Fraction:
        """Return ``2 L / (lambda n̄)``, the replace-one sensitivity (paper 004, Lemma A.1).

        Documented for comparison; the flow's neighbours are add/remove (:meth:`sensitivity`).
        """
        return 2 * self.sensitivity(normalizer)

    def precision(self, normalizer: float) -> Fraction:
        """Return ``tau = Delta 2^-20``, the certified distance of the solver's minimiser."""
        return self.sensitivity(normalizer) / (1 << PRECISION_BITS)

    def grid(self, sensitivity: Fraction) -> Fraction:
        """Return the grid step ``g = c_g Delta`` for sensitivity ``Delta``."""
        return _as_fraction("sensitivity", sensitivity) * self.grid_constant

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-safe description (binds snapshots and noise to this spec)."""
        return {
            "classes": list(self.classes),
            "dimension": int(self.dimension),
            "clip_norm": float(self.clip_norm),
            "regularization": float(self.regularization),
            "intercept": self.intercept,
            "accounting": self.accounting,
        }


# --- data -----------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Block:
    """The events of one or more consecutive blocks, already feature-mapped.

    Attributes:
        z: ``(m, columns)`` float64 features from :meth:`ErmSpec.features` (``||z_i|| <= 1``).
        y: ``(m,)`` int64 class indices in ``[0, K)``.

    """

    z: FloatArray
    y: IntArray

    def __post_init__(self) -> None:
        z = np.ascontiguousarray(self.z, dtype=np.float64)
        y = np.ascontiguousarray(self.y, dtype=np.int64)
        if z.ndim != 2 or y.ndim != 1 or z.shape[0] != y.shape[0]:
            raise InvalidParameterError(
                "a block needs features z of shape (m, columns) and labels y of shape (m,)"
            )
        object.__setattr__(self, "z", z)
        object.__setattr__(self, "y", y)

    @property
    def size(self) -> int:
        """The number ``m`` of events."""
        return int(self.z.shape[0])

    def to_state(self) -> dict[str, Any]:
        """Return the rows as plain data (copies): for a schedule's snapshot."""
        return {"z": np.array(self.z, dtype=np.float64), "y": np.array(self.y, dtype=np.int64)}

    @staticmethod
    def from_state(state: dict[str, Any], columns: int) -> Block:
        """Rebuild from :meth:`to_state` (``columns`` fixes the shape of an empty block)."""
        return Block(np.asarray(state["z"], dtype=np.float64).reshape(-1, columns),
                     np.asarray(state["y"], dtype=np.int64).reshape(-1))

    @staticmethod
    def empty(columns: int) -> Block:
        """Return a block of no events with ``columns`` feature columns."""
        return Block(np.empty((0, columns), dtype=np.float64), np.empty(0, dtype=np.int64))

    @staticmethod
    def concat(blocks: Sequence[Block], columns: int) -> Block:
        """Return the events of ``blocks`` in order, as one block with ``columns`` columns."""
        integer_at_least("columns", columns, 1)
        if any(b.z.shape[1] != columns for b in blocks):
            raise InvalidParameterError(f"every block must have {columns} feature columns")
        if not blocks:
            return Block.empty(columns)
        if len(blocks) == 1:
            return blocks[0]
        return Block(np.concatenate([b.z for b in blocks]), np.concatenate([b.y for b in blocks]))


def _check_block(spec: ErmSpec, block: Block) -> None:
    """Check that ``block`` fits ``spec``: columns, label range, ``||z_i|| <= 1`` and finite.

    These are contract checks on the caller (a block made by :meth:`ErmSpec.block` always
    passes); the Lipschitz bound, hence the privacy argument, needs them.
    """
    if not isinstance(block, Block):
        raise InvalidParameterError(f"block must be a Block, got {type(block).__name__}")
    if block.z.shape[1] != spec.columns:
        raise InvalidParameterError(
            f"block has {block.z.shape[1]} feature columns, the spec has {spec.columns}"
        )
    if block.size == 0:
        return
    if int(block.y.min()) < 0 or int(block.y.max()) >= len(spec.classes):
        raise InvalidParameterError(
            f"block labels must be class indices in [0, {len(spec.classes)})"
        )
    largest = float(np.max(np.einsum("ij,ij->i", block.z, block.z)))
    if not largest <= 1.0:  # also catches NaN
        raise InvalidParameterError(
            "block features must come from ErmSpec.features: a row has norm > 1 or is not finite"
        )


def _check_params(spec: ErmSpec, name: str, value: object) -> FloatArray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.shape != (spec.rows, spec.columns):
        raise InvalidParameterError(
            f"{name} must have shape ({spec.rows}, {spec.columns}), got {arr.shape}"
        )
    if not bool(np.isfinite(arr).all()):
        raise InvalidParameterError(f"{name} must be finite")
    return arr


# --- loss, gradient, Hessian ----------------------------------------------------------------


def _softmax(scores: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Return ``(softmax(scores), logsumexp(scores))`` row-wise, stably (max subtracted)."""
    top = scores.max(axis=1, keepdims=True)
    e = np.exp(scores - top)
    total = e.sum(axis=1, keepdims=True)
    lse: FloatArray = (top + np.log(total))[:, 0]
    prob: FloatArray = e / total
    return prob, lse


class _Objective:
    """``J`` and its derivatives on one block, vectorised (no per-row Python loop).

    Multinomial scores are kept as a ``(K, m)`` matrix so that the row-wise softmax reduces
    over the short leading axis (contiguous, fast).
    """

    __slots__ = ("z", "zt", "target", "inv_n", "lam", "center", "binary", "shape", "m")

    def __init__(self, spec: ErmSpec, block: Block, normalizer: float, center: FloatArray) -> None:
        self.z = block.z
        self.zt = block.z.T
        self.m = block.size
        self.binary = spec.binary
        self.shape = (spec.rows, spec.columns)
        if self.binary:
            self.target = block.y.astype(np.float64)
        else:
            onehot = np.zeros((spec.rows, self.m), dtype=np.float64)
            onehot[block.y, np.arange(self.m)] = 1.0
            self.target = onehot
        self.inv_n = 1.0 / normalizer
        self.lam = float(spec.regularization)
        self.center = center.reshape(-1)

    def _evaluate(self, w: FloatArray, value: bool) -> tuple[float, FloatArray, FloatArray]:
        diff = w - self.center
        loss = 0.0
        if self.binary:
            s = self.z @ w
            e = np.exp(-np.abs(s))
            if value:  # log(1 + e^s) - y s, stably
                loss = float(np.sum(np.maximum(s, 0.0)) + np.sum(np.log1p(e)) - self.target @ s)
            prob: FloatArray = np.where(s >= 0.0, 1.0, e) / (1.0 + e)
            grad = (self.zt @ (prob - self.target)) * self.inv_n + self.lam * diff
        else:
            scores = w.reshape(self.shape) @ self.zt  # (K, m)
            top = scores.max(axis=0)
            shifted = np.exp(scores - top)
            total = shifted.sum(axis=0)
            prob = shifted / total
            if value:  # logsumexp(s) - s_y
                loss = float(np.sum(top) + np.sum(np.log(total)) - np.sum(scores * self.target))
            grad = ((prob - self.target) @ self.z).reshape(-1) * self.inv_n + self.lam * diff
        value_j = loss * self.inv_n + 0.5 * self.lam * float(diff @ diff)
        return value_j, grad, prob

    def value_and_gradient(self, w: FloatArray) -> tuple[float, FloatArray, FloatArray]:
        """Return ``(J(w), grad J(w), probabilities)`` for a flat ``w``."""
        return self._evaluate(w, True)

    def gradient(self, w: FloatArray) -> tuple[FloatArray, FloatArray]:
        """Return ``(grad J(w), probabilities)`` for a flat ``w``."""
        _, grad, prob = self._evaluate(w, False)
        return grad, prob

    def hessian_product(self, prob: FloatArray, v: FloatArray) -> FloatArray:
        """Return ``H v`` at the point whose probabilities are ``prob``, for a flat ``v``."""
        if self.binary:
            u = (prob * (1.0 - prob)) * (self.z @ v)
            out: FloatArray = (self.zt @ u) * self.inv_n + self.lam * v
            return out
        u2 = v.reshape(self.shape) @ self.zt  # (K, m): V z_i
        t = prob * (u2 - np.sum(prob * u2, axis=0))
        out = (t @ self.z).reshape(-1) * self.inv_n + self.lam * v
        return out


def _conjugate_gradient(
    product: Callable[[FloatArray], FloatArray], b: FloatArray, tolerance: float, limit: int
) -> FloatArray | None:
    """Solve ``H x = b`` (``H`` symmetric positive definite) to ``||r|| <= tolerance``."""
    x = np.zeros_like(b)
    r = b.copy()
    d = r.copy()
    rs = float(r @ r)
    for _ in range(limit):
        if math.sqrt(rs) <= tolerance:
            break
        hd = product(d)
        curvature = float(d @ hd)
        if not curvature > 0.0:
            return None if not x.any() else x
        alpha = rs / curvature
        x += alpha * d
        r -= alpha * hd
        rs_new = float(r @ r)
        d = r + (rs_new / rs) * d
        rs = rs_new
    return x


@dataclass(frozen=True, eq=False)
class Solution:
    """The non-private minimiser of ``J`` and its certificate (never publish ``params``).

    Attributes:
        params: ``(rows, columns)`` float64 minimiser.
        gradient_norm: the computed ``||grad J(params)||``.
        certified_distance: a bound on ``||params - argmin J||``: ``gradient_norm / lambda``
            plus half the requested precision for the floating-point error of the gradient
            (0 for an empty block, whose minimiser is the centre exactly).
        iterations: L-BFGS-B iterations plus polishing steps.
        certified: whether the computed ``||grad J|| <= lambda precision / 2`` was reached
            (then ``certified_distance <= precision``).

    """

    params: FloatArray
    gradient_norm: float
    certified_distance: float
    iterations: int
    certified: bool = True


def solve(
    spec: ErmSpec,
    block: Block,
    normalizer: float,
    center: FloatArray | None,
    *,
    precision: float,
    initial: FloatArray | None = None,
) -> Solution:
    """Minimise ``J`` and certify that the result is within ``precision`` of the minimiser.

    L-BFGS-B (scipy) from ``initial`` (default: the centre, or 0), then Newton-CG steps
    guarded by the guaranteed contraction of gradient steps ``1/beta``, until the computed
    ``||grad J|| <= lambda precision / 2`` (see the module docstring). Never raises on data:
    if float64 cannot reach the certificate, the result has ``certified=False``.

    Args:
        spec: the problem.
        block: the events (from :meth:`ErmSpec.block`); may be empty.
        normalizer: the public normaliser ``n̄ > 0``.
        center: the public centre of the penalty (``None``: 0), shape ``(rows, columns)``.
        precision: the required ``||params - argmin J||`` bound, > 0.
        initial: a starting point (performance only). It must be public (a released model) or
            a function of this block's data alone, like the centre.

    Raises:
        InvalidParameterError: bad parameters or a block that does not fit the spec.

    """
    n = positive_finite("normalizer", normalizer)
    tol = positive_finite("precision", precision)
    _check_block(spec, block)
    c = (
        np.zeros((spec.rows, spec.columns))
        if center is None
        else _check_params(spec, "center", center)
    )
    if block.size == 0:  # J = (lambda/2)||w - c||^2: the centre, exactly
        return Solution(c.copy(), 0.0, 0.0, 0, True)
    start = c if initial is None else _check_params(spec, "initial", initial)
    objective = _Objective(spec, block, n, c)
    lam = objective.lam
    target = 0.5 * lam * tol
    beta = spec.smoothness * block.size / n + lam  # smoothness of J on ||z|| <= 1
    contraction = 1.0 - lam / beta

    from scipy.optimize import minimize  # type: ignore[import-untyped]  # lazy: see docstring

    def fun(w: FloatArray) -> tuple[float, FloatArray]:
        value, grad, _ = objective.value_and_gradient(w)
        return value, grad

    result = minimize(
        fun,
        start.reshape(-1).copy(),
        jac=True,
        method="L-BFGS-B",
        options={
            "maxiter": _LBFGS_MAX_ITERATIONS,
            "ftol": 1e-12,
            "gtol": target / math.sqrt(spec.parameter_count),
            "maxcor": 20,
        },
    )
    w = np.asarray(result.x, dtype=np.float64)
    if not bool(np.isfinite(w).all()):
        w = start.reshape(-1).copy()
    iterations = int(result.nit)
    grad, prob = objective.gradient(w)
    norm = float(np.linalg.norm(grad))
    cg_limit = min(spec.parameter_count, 250) + 10
    steps = 0
    newton_failures = 0
    while not norm <= target and steps < _MAX_POLISH_STEPS:
        steps += 1
        if newton_failures < _MAX_NEWTON_FAILURES:
            point = prob

            def product(v: FloatArray, point: FloatArray = point) -> FloatArray:
                return objective.hessian_product(point, v)

            direction = _conjugate_gradient(product, -grad, 1e-3 * norm, cg_limit)
            if direction is not None:
                trial = w + direction
                trial_grad, trial_prob = objective.gradient(trial)
                trial_norm = float(np.linalg.norm(trial_grad))
                if trial_norm <= contraction * norm:
                    w, grad, prob, norm = trial, trial_grad, trial_prob, trial_norm
                    continue
            newton_failures += 1
        trial = w - grad / beta  # contracts ||grad J|| by (1 - lambda/beta) in exact arithmetic
        trial_grad, trial_prob = objective.gradient(trial)
        trial_norm = float(np.linalg.norm(trial_grad))
        if not trial_norm < norm:
            break  # the float64 floor: no further progress is possible
        w, grad, prob, norm = trial, trial_grad, trial_prob, trial_norm
    certified = norm <= target
    distance = norm / lam + 0.5 * tol
    return Solution(
        w.reshape(spec.rows, spec.columns), norm, distance, iterations + steps, certified
    )


# --- exact noise on the grid ----------------------------------------------------------------


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


def _log(x: Fraction) -> float:
    """Return ``ln(x)`` for a Fraction ``x > 0`` without converting ``x`` to a float."""
    return math.log(x.numerator) - math.log(x.denominator)


def _discreteness_fits(p: int, sigma2: Fraction, rho: Fraction) -> bool:
    """Whether CKS 2020 Theorem 14's discreteness term fits in the reserved share of ``rho``.

    The term is bounded generously, as in :mod:`dpstream.core.counting.blt_counter`, by
    ``50 p exp(-pi^2 sigma^2) / (1 - exp(-pi^2 sigma^2))``; it must stay below the reserved
    ``10^-12 / (1 + 10^-12)`` of the charged rho. Logarithms throughout (no underflow).
    """
    if sigma2 >= 10**300:
        return True
    x = math.pi**2 * float(sigma2)
    if x < 1e-3:
        return False
    log_term = math.log(50.0 * p) - x - math.log(-math.expm1(-x))
    return log_term < _log(_ZCDP_RESERVE) + _log(rho) - _log(1 + _ZCDP_RESERVE)


@dataclass(frozen=True)
class NoiseLevel:
    """A real noise scale fixed by a reference computation.

    The noise whose cost at sensitivity ``reference_sensitivity`` is ``reference_cost``
    (epsilon for pure, rho for zCDP): a computation at sensitivity ``Delta`` keeps that real
    noise and costs ``reference_cost * Delta / Delta_ref`` (pure) or
    ``reference_cost * (Delta / Delta_ref)^2`` (zCDP), exactly.

    Attributes:
        reference_sensitivity: ``Delta_ref > 0`` (a Fraction; an int or float is read exactly
            as its decimal).
        reference_cost: the cost at ``Delta_ref``, > 0.

    """

    reference_sensitivity: Fraction
    reference_cost: Fraction

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "reference_sensitivity",
            _as_fraction("reference_sensitivity", self.reference_sensitivity),
        )
        object.__setattr__(
            self, "reference_cost", _as_fraction("reference_cost", self.reference_cost)
        )

    def real_scale(self, spec: ErmSpec) -> Fraction:
        """Pure: the discrete Laplace scale in parameter units, ``b = D1 g(Delta_ref)/cost``."""
        _require(spec, "pure")
        return (
            spec.grid_l1_sensitivity * spec.grid(self.reference_sensitivity) / self.reference_cost
        )

    def real_variance(self, spec: ErmSpec) -> Fraction:
        """zCDP: the noise variance parameter in parameter units squared, ``sigma^2 g^2``."""
        _require(spec, "zcdp")
        g = spec.grid(self.reference_sensitivity)
        d2 = spec.grid_l2_sensitivity
        return (1 + _ZCDP_RESERVE) * d2 * d2 * g * g / (2 * self.reference_cost)

    def integer_scale(self, spec: ErmSpec, sensitivity: Fraction) -> Fraction:
        """Pure: the discrete Laplace scale ``t = b / g(Delta)`` on the grid of ``Delta``."""
        return self.real_scale(spec) / spec.grid(sensitivity)

    def integer_variance(self, spec: ErmSpec, sensitivity: Fraction) -> Fraction:
        """zCDP: the discrete Gaussian ``sigma^2 = V / g(Delta)^2`` on the grid of ``Delta``."""
        g = spec.grid(sensitivity)
        return self.real_variance(spec) / (g * g)

    def cost_at(self, spec: ErmSpec, sensitivity: Fraction) -> Fraction:
        """Return the exact cost of one computation at ``sensitivity`` (``Delta``, before slack).

        Computed from the mechanism: ``D1 / t`` (pure) or ``(1 + 10^-12) D2^2 / (2 sigma^2)``
        (zCDP). It equals ``reference_cost * Delta/Delta_ref`` resp.
        ``reference_cost * (Delta/Delta_ref)^2`` exactly (module docstring).

        Raises:
            InvalidParameterError: bad sensitivity, or (zCDP) a cost so large that the discrete
                Gaussian's discreteness term would not fit in the reserve.

        """
        if spec.accounting == "pure":
            return spec.grid_l1_sensitivity / self.integer_scale(spec, sensitivity)
        sigma2 = self.integer_variance(spec, sensitivity)
        d2 = spec.grid_l2_sensitivity
        rho = (1 + _ZCDP_RESERVE) * d2 * d2 / (2 * sigma2)
        if not _discreteness_fits(spec.parameter_count, sigma2, rho):
            raise InvalidParameterError(
                f"rho = {float(rho):.6g} is too large for the discrete Gaussian on the ERM grid "
                f"(sigma^2 = {float(sigma2):.3g})"
            )
        return rho


def _require(spec: ErmSpec, accounting: str) -> None:
    if spec.accounting != accounting:
        raise InvalidParameterError(
            f"this needs accounting {accounting!r}, the spec has {spec.accounting!r}"
        )


@dataclass(frozen=True, eq=False)
class PrivateModel:
    """A released model: noisy integers on a rational grid, with what a consumer needs.

    Attributes:
        params: ``(rows, columns)`` float64 parameters ``grid * integers`` (read-only).
        grid: the grid step ``g``.
        noise_std: the standard deviation of each coordinate's noise, in parameter units.
        cost: the exact privacy cost (epsilon or rho) of the computation, before sampling.
        sensitivity: the L2 sensitivity charged, ``Delta + 2 tau``.
        normalizer: the public normaliser ``n̄``.
        size: the number of events used. NOT public: operator-side only.
        integers: the released integers, row-major (the exact release).

    """

    params: FloatArray
    grid: Fraction
    noise_std: float
    cost: Fraction
    sensitivity: Fraction
    normalizer: float
    size: int
    integers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        params = np.array(self.params, dtype=np.float64)
        if params.ndim != 2:
            raise InvalidParameterError("params must be a (rows, columns) matrix")
        if not self.integers:
            object.__setattr__(self, "integers", tuple(round_to_grid(params, self.grid)))
        if len(self.integers) != params.size:
            raise InvalidParameterError(
                f"{len(self.integers)} integers for {params.size} parameters"
            )
        params.setflags(write=False)
        object.__setattr__(self, "params", params)

    def to_state(self) -> dict[str, Any]:
        """Return an exact plain-data snapshot (integers as decimal strings, fractions "a/b").

        It holds ``size``, which is not public: keep it in the secret recovery store.
        """
        return {
            "version": _STATE_VERSION,
            "shape": [int(s) for s in self.params.shape],
            "grid": fraction_text(self.grid),
            "integers": [str(k) for k in self.integers],
            "noise_std": float(self.noise_std),
            "cost": fraction_text(self.cost),
            "sensitivity": fraction_text(self.sensitivity),
            "normalizer": float(self.normalizer),
            "size": int(self.size),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PrivateModel:
        """Rebuild a model from :meth:`to_state` (identical params, bit for bit).

        Raises:
            InvalidParameterError: the snapshot is malformed or of another version.

        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise InvalidParameterError(
                f"ERM model state must be a dict of version {_STATE_VERSION}"
            )
        try:
            rows, cols = (int(s) for s in state["shape"])
            integers = tuple(int(k) for k in state["integers"])
            noise_std = float(state["noise_std"])
            normalizer = float(state["normalizer"])
            size = int(state["size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidParameterError(f"malformed ERM model state: {exc!r}") from None
        grid = _parse_fraction(state.get("grid"), "grid")
        if grid <= 0 or rows < 1 or cols < 1 or len(integers) != rows * cols:
            raise InvalidParameterError("malformed ERM model state: grid or shape")
        return cls(
            params=_params_from_integers(integers, grid, (rows, cols)),
            grid=grid,
            noise_std=noise_std,
            cost=_parse_fraction(state.get("cost"), "cost"),
            sensitivity=_parse_fraction(state.get("sensitivity"), "sensitivity"),
            normalizer=normalizer,
            size=size,
            integers=integers,
        )


def _precision_float(tau: Fraction) -> float:
    """Return the largest float not above ``tau`` (so a certified distance <= it is <= tau)."""
    f = float(tau)
    while Fraction(f) > tau:
        f = math.nextafter(f, 0.0)
    return f


def private_erm(
    spec: ErmSpec,
    block: Block,
    *,
    normalizer: float,
    center: FloatArray | None,
    level: NoiseLevel,
    rng: RandomIntegers,
    initial: FloatArray | None = None,
) -> PrivateModel:
    """Release a private model: paper 004 Algorithm 1 (no centre), 3 and 7 (a centre).

    Solve ``J`` to the certified precision ``tau = Delta 2^-20``, round exactly onto the grid
    ``g = c_g Delta`` and add iid exact integer noise, coordinate ``j`` (row-major) drawn from
    ``rng`` in order: discrete Laplace of scale ``level.integer_scale`` (pure) or discrete
    Gaussian of variance ``level.integer_variance`` (zCDP). Derive ``rng`` from
    ``NoiseKey.stream(*coordinates)`` so that a replay is identical.

    Args:
        spec: the problem.
        block: the events (may be empty: the release is then the centre plus noise).
        normalizer: the public normaliser ``n̄`` (e.g. ``2^j b0``, never a private count).
        center: the penalty's centre: ``None`` (0) or a *released* model's params.
        level: the real noise scale; the cost is ``level.cost_at(spec, Delta)``.
        rng: the replay-safe uniform integers of this release.
        initial: optional warm start (public, or a function of this block only).

    Raises:
        InvalidParameterError: bad parameters, a block that does not fit the spec.
        CertificationError: float64 could not certify the minimiser (far outside the
            supported range); nothing is released.

    """
    if not isinstance(level, NoiseLevel):
        raise InvalidParameterError(f"level must be a NoiseLevel, got {type(level).__name__}")
    delta = spec.sensitivity(normalizer)
    cost = level.cost_at(spec, delta)  # validates the level before any work
    tau = delta / (1 << PRECISION_BITS)
    solution = solve(
        spec, block, normalizer, center, precision=_precision_float(tau), initial=initial
    )
    if not solution.certified:
        raise CertificationError(
            f"the ERM solver could not certify its minimiser to {float(tau):.3g} in float64 "
            f"(normalizer {normalizer!r}); nothing was released"
        )
    g = spec.grid(delta)
    rounded = round_to_grid(solution.params, g)
    if spec.accounting == "pure":
        scale = level.integer_scale(spec, delta)
        released = [r + discrete_laplace(rng, scale) for r in rounded]
        std = math.sqrt(discrete_laplace_variance(scale)) * float(g)
    else:
        sigma2 = level.integer_variance(spec, delta)
        released = [r + discrete_gaussian(rng, sigma2) for r in rounded]
        std = math.sqrt(discrete_gaussian_variance(sigma2)) * float(g)
    return PrivateModel(
        params=_params_from_integers(released, g, (spec.rows, spec.columns)),
        grid=g,
        noise_std=std,
        cost=cost,
        sensitivity=delta * _SLACK,
        normalizer=float(normalizer),
        size=block.size,
        integers=tuple(released),
    )


# --- Poisson subsampling --------------------------------------------------------------------


def _check_rate(rate: object) -> Fraction:
    if isinstance(rate, bool) or not isinstance(rate, (Fraction, int)) or not 0 <= rate <= 1:
        raise InvalidParameterError(f"rate must be a Fraction in [0, 1], got {rate!r}")
    return Fraction(rate)


def poisson_sample(rng: RandomIntegers, size: int, rate: Fraction) -> BoolArray:
    """Return a mask keeping each of ``size`` rows independently with probability ``rate``.

    Row ``i`` is kept iff ``rng.randbelow(den) < num`` for ``rate = num/den``: exactly
    Bernoulli(rate), one draw per row in order (none when ``rate`` is 0 or 1), so the same
    stream gives the same mask.
    """
    n = integer_at_least("size", size, 0)
    q = _check_rate(rate)
    if q == 0:
        return np.zeros(n, dtype=np.bool_)
    if q == 1:
        return np.ones(n, dtype=np.bool_)
    num, den = q.numerator, q.denominator
    randbelow = rng.randbelow
    return np.fromiter((randbelow(den) < num for _ in range(n)), dtype=np.bool_, count=n)


def _check_epsilon(epsilon: object) -> Fraction:
    if isinstance(epsilon, bool) or not isinstance(epsilon, (Fraction, int)) or epsilon <= 0:
        raise InvalidParameterError(f"epsilon must be a Fraction > 0, got {epsilon!r}")
    return Fraction(epsilon)


def _decimal_div(num: int, den: int) -> Decimal:
    """``num / den`` in the current decimal context (its rounding mode applies)."""
    return Decimal(num) / Decimal(den)


def amplified_epsilon(epsilon: Fraction, rate: Fraction) -> Fraction:
    """Return a rational upper bound on ``ln(1 + rate (e^epsilon - 1))``, never below it.

    The privacy of an epsilon-DP mechanism run on a Poisson subsample of rate ``rate`` under
    add/remove neighbours (Li, Qardaji, Su 2012; Balle, Barthe, Gaboardi 2018). Pure DP only.
    Computed with 60-digit decimals: ``exp`` and ``ln`` are correctly rounded (Python's
    ``decimal``), each result is stepped one unit up, every other operation rounds toward
    +infinity, and the result is rounded up to a denominator of ``10^18`` (and capped at
    ``epsilon``, which it never exceeds exactly). See the module docstring for why Algorithms
    6-8 need the full public normaliser for this to apply.
    """
    eps = _check_epsilon(epsilon)
    q = _check_rate(rate)
    if q == 0:
        return Fraction(0)
    if q == 1:
        return eps
    with localcontext() as ctx:
        ctx.prec = _AMPLIFY_DIGITS
        ctx.rounding = ROUND_CEILING
        eps_up = _decimal_div(eps.numerator, eps.denominator)
        growth = eps_up.exp().next_plus() - 1  # >= e^eps - 1
        x = growth * Decimal(q.numerator) / Decimal(q.denominator)
        value = (1 + x).ln().next_plus()
        bound = Fraction(value)
    up = -((-bound.numerator * _COST_DENOMINATOR) // bound.denominator)
    return min(Fraction(up, _COST_DENOMINATOR), eps)


def sampling_rate(epsilon: Fraction, target: Fraction) -> Fraction:
    """Return a rate ``q <= (e^target - 1) / (e^epsilon - 1)``, within ``10^-30`` of it.

    The Poisson rate that turns an ``epsilon``-DP mechanism into a ``target``-DP one
    (paper 004, Algorithms 6 and 8: ``epsilon/2`` and ``target = epsilon/(2 2^k)``). Rounded
    down, so :func:`amplified_epsilon` of it exceeds ``target`` by at most its own rounding.
    """
    eps = _check_epsilon(epsilon)
    tgt = _check_epsilon(target)
    if tgt >= eps:
        return Fraction(1)
    with localcontext() as ctx:
        ctx.prec = _AMPLIFY_DIGITS
        ctx.rounding = ROUND_FLOOR
        low = _decimal_div(tgt.numerator, tgt.denominator).exp().next_minus() - 1
        ctx.rounding = ROUND_CEILING
        high = _decimal_div(eps.numerator, eps.denominator).exp().next_plus() - 1
        ctx.rounding = ROUND_FLOOR
        ratio = Fraction(low / high)
    down = (ratio.numerator * _RATE_DENOMINATOR) // ratio.denominator
    return Fraction(max(down, 0), _RATE_DENOMINATOR)


# --- prediction (post-processing) -----------------------------------------------------------


def decision_function(spec: ErmSpec, params: FloatArray, z: FloatArray) -> FloatArray:
    """Return the ``(m, K)`` class scores of feature rows ``z`` (binary: ``[0, w.z]``)."""
    w = _check_params(spec, "params", params)
    zz = np.asarray(z, dtype=np.float64)
    if zz.ndim == 1:
        zz = zz[None, :]
    if zz.ndim != 2 or zz.shape[1] != spec.columns:
        raise InvalidParameterError(f"z must have {spec.columns} columns (from ErmSpec.features)")
    if spec.binary:
        out = np.zeros((zz.shape[0], 2), dtype=np.float64)
        out[:, 1] = zz @ w[0]
        return out
    scores: FloatArray = zz @ w.T
    return scores


def predict_proba(spec: ErmSpec, params: FloatArray, z: FloatArray) -> FloatArray:
    """Return the ``(m, K)`` class probabilities of feature rows ``z``."""
    prob, _ = _softmax(decision_function(spec, params, z))
    return prob


def predict(spec: ErmSpec, params: FloatArray, z: FloatArray) -> IntArray:
    """Return the predicted class indices (binary: 1 iff ``w.z > 0``; ties go to index 0)."""
    out: IntArray = np.argmax(decision_function(spec, params, z), axis=1).astype(np.int64)
    return out
