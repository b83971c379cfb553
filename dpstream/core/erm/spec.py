"""The private ERM problem: its specification, feature map, sensitivity and data blocks.

Private regularized ERM (logistic regression) by output perturbation is the static building block
of Watson et al., "Continual and Sliding Window Release for Private ERM" (paper 004; the schedules
live in :mod:`dpstream.core.erm.schedules`): **Algorithm 1** (PSGD, output perturbation, Wu et al.
2017), **Algorithm 3** (PBERM, centred at an earlier released model) and **Algorithm 7** (PBERM on
``2^j b0`` events normalised by ``2^j b0``). This module states the problem they solve
(:class:`ErmSpec`) and holds its data (:class:`Block`); the certified solver is
:mod:`dpstream.core.erm.solver`, the exact grid :mod:`dpstream.core.erm.grid`, the noise
:mod:`dpstream.core.erm.output_noise`, the subsampling :mod:`dpstream.core.erm.sampling` and the
released model :mod:`dpstream.core.erm.model`.

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

**The privacy unit's rows** (``unit_rows``, ``r``; 1 at the event level). At ``unit = "user"``
the contribution stage keeps at most ``r = max_rows_per_block`` rows of one person in one block,
so neighbouring blocks differ by up to ``r`` rows added or removed. Removing them one at a time
changes ``J`` by one term each time, with the normaliser fixed, so by the bound above and the
triangle inequality the minimisers are at most ``r L / (lambda n̄)`` apart:
:meth:`ErmSpec.sensitivity` returns that, and everything calibrated on it (the grid, the
certified precision, the noise level and its cost) then covers one person's ``r`` rows of a
block, so each configured per-block charge is what one person's bounded rows cost there
(:mod:`dpstream.core.erm.contribution` sums a person's blocks). ``unit_rows`` is bound into
:meth:`ErmSpec.to_dict` only when it is not 1, so event-level snapshots and noise keep their
bytes.

**What is not taken from the paper** (see also :mod:`~dpstream.core.erm.output_noise`
and :mod:`~dpstream.core.erm.sampling`). (a) Its experiments (Fig. 4) use the Lipschitz constant
``(k - 1)/(2 m k) ||X||_F`` of the cross-entropy (after Yedida et al. 2021). That number depends
on the private feature matrix ``X`` and bounds the gradient of the *average* loss, not of one
event's loss; calibrating noise with it leaks ``||X||_F`` and under-noises by about ``sqrt(m)``.
We use the per-event constants above, which hold for every possible event.

**The objective learner's feature map** (``learner = "objective"``; see
:mod:`dpstream.core.erm.objective`). Objective perturbation with L1-calibrated noise needs the
per-row gradient bounded in L1 (Kifer, Smith, Thakurta 2012, general norms): rows are clipped
to the **L1** ball of radius ``R`` instead, ``z = x min(1, R/||x||_1) / R``, then
``z = [z, 1] / 2`` with an intercept, so ``||z||_1 <= 1`` and hence ``||z||_2 <= 1``: every
constant above (Lipschitz, smoothness, the solver's certificate) still holds, and the gradient
``(sigmoid(s) - y) z`` resp. ``(p - e_y) z^T`` has L1 norm at most ``1`` resp.
``||p - e_y||_1 <= 2``. The map computes the L1 norm with ``d`` rounded additions (relative
error below ``d 2^-53``) and scales by ``(1 - 2^-32)/max(||x||_1, R)`` (two more roundings), so
the stored floats' exact L1 norm is at most ``(1 - 2^-32)(1 + (2d + 4) 2^-53) <= 1`` for
``d <= 2^19`` (tested with exact fractions). The output learner keeps the L2 map above, byte
for byte; ``learner`` is bound into :meth:`ErmSpec.to_dict` only when it is not ``"output"``,
and then with the objective mechanism's version and constants
(:func:`learner_binding`, next to ``ErmSpec``), so a changed mechanism never redraws
the same noise (pitfall 13).
The objective learner is pure epsilon only: under zCDP the spec is refused.

**State.** A spec is frozen public configuration (:meth:`ErmSpec.to_dict`); a :class:`Block`
holds raw events, which are private: its :meth:`Block.to_state` belongs in the secret recovery
store only. Nothing here draws noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from dpstream.core._checks import integer_at_least, positive_finite
from dpstream.core.accounting.ledger import Accounting, exact
from dpstream.core.erm.grid import PRECISION_BITS, _grid_constants
from dpstream.errors import InvalidParameterError

__all__ = [
    "Block",
    "ErmSpec",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
_ACCOUNTINGS: Final = ("pure", "zcdp")
Learner = Literal["output", "objective"]
LEARNERS: Final = ("output", "objective")
OBJECTIVE_MAX_PARAMETERS: Final = 1 << 30
"""The most parameters ``p`` the objective learner takes: its noise-only refusal stays below
``2^-60`` a release up to there (:mod:`~dpstream.core.erm.objective`, *Floating point*)."""

# -- the objective learner's constants (dpstream.core.erm.objective; they live here, with
# their binding into to_dict, so that a change of one changes the noise: pitfall 13) --
OUTPUT_SHARE: Final = Fraction(1, 100)
"""The share of the per-row budget spent on the output noise that covers the solver."""
JACOBIAN_CAP: Final = Fraction(1, 2)
"""The most of the per-row budget the Jacobian term may take (``Lambda`` is raised otherwise)."""
SOLVER_BITS: Final = 20
"""``tau = 2^-SOLVER_BITS s / (n̄ Lambda)``, ``s = max(1, S sqrt(p) 2^-WIDE_BITS)``."""
WIDE_BITS: Final = 21
"""Above ``S sqrt(p) = 2^WIDE_BITS`` the certified precision widens with the noise."""
LATTICE_BITS: Final = 20
"""``gamma = 2^(v - ceil(log2 p) - LATTICE_BITS)`` (``v``: :mod:`~dpstream.core.erm.objective`)."""
LINEAR_BITS: Final = 27
"""The check ``||b||_inf sqrt(p) <= 2^LINEAR_BITS s`` before solving (the objective learner)."""
RAISE_STEP_BITS: Final = 30
"""``Lambda`` is raised from ``(1 + 2^-RAISE_STEP_BITS)`` times the analytic threshold in steps
of that factor."""
VERSION: Final = 6
"""The mechanism's version, bound into the noise with its constants (:func:`learner_binding`).
Bump it on every change of what a release draws or computes from its noise (pitfall 13)."""


def learner_binding() -> dict[str, object]:
    """The objective mechanism's version and constants: bound into ``ErmSpec.to_dict()``.

    Two releases that draw the same uniform integers must compute the same thing from them
    (pitfall 13): any change of a constant below, or of a rule they name, changes the binding
    and so the noise stream (bump :data:`VERSION` for a change of a rule).
    """
    return {
        "version": VERSION,
        "output_share": str(OUTPUT_SHARE),
        "jacobian_cap": str(JACOBIAN_CAP),
        "solver_bits": SOLVER_BITS,
        "wide_bits": WIDE_BITS,
        "lattice_bits": LATTICE_BITS,
        "linear_bits": LINEAR_BITS,
        "raise_step_bits": RAISE_STEP_BITS,
    }


_SQRT2_UP: Final = Fraction(math.isqrt(2 << 80) + 1, 1 << 40)  # > sqrt(2)
_FEATURE_SHRINK: Final = 1.0 - 2.0**-32  # ||z|| <= 1 survives the rounding of the map
_INV_SQRT2: Final = 1.0 / math.sqrt(2.0)


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
        unit_rows: ``r >= 1``, the most rows the privacy unit may have in one block (1: one
            event; ``max_rows_per_block`` at ``unit = "user"``); the sensitivity scales with it.
        learner: ``"output"`` (output perturbation, :mod:`~dpstream.core.erm.output_noise`;
            L2 feature clipping) or ``"objective"`` (certified objective perturbation,
            :mod:`~dpstream.core.erm.objective`; L1 feature clipping, pure accounting only).

    """

    classes: tuple[int | str, ...]
    dimension: int
    clip_norm: float
    regularization: float
    intercept: bool = True
    accounting: Accounting = "pure"
    unit_rows: int = 1
    learner: Learner = "output"

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
        integer_at_least("unit_rows", self.unit_rows, 1)
        if self.learner not in LEARNERS:
            raise InvalidParameterError(
                f"learner must be one of {LEARNERS}, got {self.learner!r}"
            )
        if self.learner == "objective" and self.accounting != "pure":
            raise InvalidParameterError(
                "learner 'objective' (objective perturbation) is pure epsilon-DP only: with "
                f"accounting {self.accounting!r} use learner 'output'"
            )
        if self.learner == "objective" and self.parameter_count > OBJECTIVE_MAX_PARAMETERS:
            raise InvalidParameterError(
                f"learner 'objective' supports at most {OBJECTIVE_MAX_PARAMETERS} parameters "
                f"(classes x columns), got {self.parameter_count}: use learner 'output'"
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
        (computed with a scaling that cannot overflow, and shrunk by ``1 - 2^-32``). With
        ``learner = "objective"``: clipped to L1 norm ``R``, the intercept row divided by 2,
        ``||z||_1 <= 1`` (module docstring).

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
        l1 = self.learner == "objective"
        if l1:  # L1 norm in [1, d] (or 0)
            unit_norm = np.sum(np.abs(unit), axis=1)
        else:
            unit_norm = np.sqrt(np.einsum("ij,ij->i", unit, unit))
        with np.errstate(over="ignore", divide="ignore"):
            limit = float(self.clip_norm) / safe  # R / max|x|; may overflow to inf (z -> 0)
        factor = _FEATURE_SHRINK / np.maximum(unit_norm, limit)
        if self.intercept:
            half = 0.5 if l1 else _INV_SQRT2
            factor *= half
            out[:, d] = _FEATURE_SHRINK * half
        np.multiply(unit, factor[:, None], out=out[:, :d])
        return out

    def linear_model(self, params: object) -> tuple[FloatArray, FloatArray]:
        """Return ``(coef, intercept)`` for raw rows clipped to ``clip_norm``.

        The inverse of :meth:`features` on the parameters: for every row ``x`` with
        ``x_c = x·min(1, R/||x||)`` (the L1 norm for the objective learner),
        ``params @ features(x) = coef @ x_c + intercept`` (up to float rounding).
        Post-processing of a released model: what a consumer scores with.
        """
        w = np.atleast_2d(np.asarray(params, dtype=np.float64))
        d, scale = self.dimension, _FEATURE_SHRINK / float(self.clip_norm)
        if self.intercept:
            half = 0.5 if self.learner == "objective" else _INV_SQRT2
            return w[:, :d] * (scale * half), w[:, d] * (_FEATURE_SHRINK * half)
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
        """Return ``r L / (lambda n̄)`` (add/remove ``r = unit_rows`` rows), an exact upper bound.

        ``lambda`` and ``n̄`` are taken as the exact values of the floats the solver uses;
        ``sqrt(2)`` is replaced by a rational just above it. ``r = 1`` at the event level.
        """
        n = self._check_normalizer(normalizer)
        lip = Fraction(1) if self.binary else _SQRT2_UP
        return int(self.unit_rows) * lip / (Fraction(float(self.regularization)) * Fraction(n))

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
        } | ({} if self.unit_rows == 1 else {"unit_rows": int(self.unit_rows)}) | (
            {} if self.learner == "output" else self._learner_binding())

    def _learner_binding(self) -> dict[str, Any]:
        """``learner`` and, for ``"objective"``, its version and constants (pitfall 13)."""
        return {"learner": self.learner, "objective": learner_binding()}


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
