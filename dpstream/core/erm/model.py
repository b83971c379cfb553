"""A released private ERM model, its snapshot and its predictions (post-processing).

The output of :func:`~dpstream.core.erm.output_noise.private_erm` (Watson et al., "Continual and
Sliding Window Release for Private ERM", paper 004, Algorithms 1, 3 and 7): noisy integers on
the exact rational grid. Predictions from it are post-processing of a differentially private
release and cost nothing; nothing here is random.

**State.** :meth:`PrivateModel.to_state` holds the released integers, the grid and the cost as
exact strings (public once released) and ``size``, the number of events used, which is NOT
public: keep the snapshot in the secret recovery store.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final

import numpy as np

from dpstream.core._checks import fraction_text
from dpstream.core.erm.grid import _params_from_integers, round_to_grid
from dpstream.core.erm.solver import _softmax
from dpstream.core.erm.spec import ErmSpec, FloatArray, IntArray, _check_params
from dpstream.errors import InvalidParameterError

__all__ = [
    "PrivateModel",
    "decision_function",
    "predict",
    "predict_proba",
]

_STATE_VERSION: Final = 1


def _parse_fraction(text: object, name: str) -> Fraction:
    if not isinstance(text, str):
        raise InvalidParameterError(f"malformed ERM model state: {name} must be a 'num/den' string")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise InvalidParameterError(
            f"malformed ERM model state: {name} is not a fraction"
        ) from None


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
