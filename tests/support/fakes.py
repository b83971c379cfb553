"""Stand-ins the mechanism tests share: a dense linear query, an ERM trainer without a solver."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from dpstream.core.erm.model import PrivateModel
from dpstream.core.pmwg.queries import WEIGHT_UNIT


class DenseQuery:
    """A tiny dense implementation of the LinearQueryLike protocol (tests only)."""

    def __init__(self, weights, key: str = "q") -> None:
        self.units = np.round(np.asarray(weights, dtype=np.float64) * WEIGHT_UNIT).astype(np.int64)
        assert self.units.min() >= 0 and self.units.max() <= WEIGHT_UNIT
        self.support = np.flatnonzero(self.units)
        self.support_units = self.units[self.support]
        self.support_size = int(self.support.size)
        self.key = key

    def weighted_count(self, counts: np.ndarray) -> int:
        return int(np.dot(self.units, counts))

    def weighted_sum(self, values: np.ndarray) -> float:
        return float(np.dot(self.units, values)) / WEIGHT_UNIT

    def multiply(self, values: np.ndarray, log_factor: float) -> float:
        old = values[self.support]
        new = old * np.exp(log_factor * (self.support_units / WEIGHT_UNIT))
        values[self.support] = new
        return float(np.sum(new) - np.sum(old))


@dataclass
class Call:
    size: int
    normalizer: float
    center: np.ndarray | None
    cost: Fraction


class FakeTrain:
    """Records each call; returns a model at exactly the level's cost (no solver)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def __call__(self, spec, block, *, normalizer, center, level, rng):
        sensitivity = spec.sensitivity(normalizer)
        cost = level.cost_at(spec, sensitivity)
        draw = rng.randbelow(1 << 32) / float(1 << 32)
        base = np.zeros((spec.rows, spec.columns)) if center is None else np.array(center)
        params = np.round((base + draw + 0.001 * block.size) * (1 << 20)) / (1 << 20)  # on the grid
        self.calls.append(Call(block.size, normalizer, None if center is None
                               else np.array(center), cost))
        return PrivateModel(params=params, grid=Fraction(1, 1 << 20), noise_std=1.0, cost=cost,
                            sensitivity=sensitivity, normalizer=normalizer, size=block.size)
