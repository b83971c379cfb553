"""The ERM kind's encoder: models as ``dpstream.model/1`` records (:class:`dpstream.schemas.Model`).

Each record is keyed by its model stream and carries the model's window, its privacy cost
and the per-event budget (the fields, order and change rules are defined in
:mod:`dpstream.schemas`).
"""

from __future__ import annotations

from typing import Any

from dpstream import schemas
from dpstream.core._checks import fraction_text
from dpstream.kinds.erm.config import ErmConfig
from dpstream.kinds.erm.shard import ModelRecord
from dpstream.messages import Encoded

__all__ = ["ModelEncoder"]


class ModelEncoder:
    """Encodes models as ``dpstream.model/1`` records (keyed by model stream)."""

    def __init__(self, config: ErmConfig, instance: str = "") -> None:
        self.config, self.instance = config, instance
        self.unit = "event"
        self.person: schemas.PersonLevel | None = None
        cost = config.person_cost()
        if cost is not None:  # unit = "user": what a person may cost in all, per period
            c = config.contribution
            zcdp = cost.accounting != "pure"  # the delta has the hash-collision term
            self.unit = "user"
            self.person = schemas.PersonLevel(
                period="lifetime" if c.period_steps is None else f"{c.period_steps} steps",
                caps=c.caps, epsilon=cost.epsilon(config.delta),
                delta=cost.delta(config.delta), rho=float(cost.total) if zcdp else None)

    def _window(self, first: int, last: int) -> schemas.Window:
        return schemas.Window.of_steps(self.config.origin, self.config.step_seconds, first, last,
                                       steps=True)

    def encode(self, m: ModelRecord) -> Encoded:
        """One model record on the models topic."""
        config = self.config
        if config.algorithm == "ermg":  # BBImprover charges rho; spent and budget are the
            accounting, delta = "approx_dp", config.delta  # epsilon of (eps, delta)
        else:
            accounting, delta = config.accounting, None
        privacy = schemas.Privacy(unit=self.unit, accounting=accounting, cost=m.cost,
                                  spent=m.spent, budget=m.budget, delta=delta, person=self.person)
        shared: dict[str, Any] = dict(
            flow=config.name, instance=self.instance, stream=m.stream,
            algorithm=config.algorithm, role=m.role, level=m.level, step=m.step,
            released=self._window(m.step, m.step),
            window=self._window(m.first_step, m.last_step),
            depends_on=tuple(tuple(pair) for pair in m.depends_on),
            classes=tuple(config.model.classes), privacy=privacy)
        if m.model is None:
            record = schemas.Model(**shared, reason=m.reason)
        else:
            coef, intercept = config.model.linear_model(m.model.params)
            record = schemas.Model(
                **shared, coef=coef.tolist(), intercept=intercept.tolist(),
                features=schemas.ModelFeatures(dimension=config.model.dimension,
                                               clip_norm=float(config.model.clip_norm),
                                               norm=("l1" if config.model.learner == "objective"
                                                     else "l2")),
                noise=schemas.ModelNoise(std=float(m.model.noise_std),
                                         grid=fraction_text(m.model.grid)),
                holdout=(None if m.accuracy is None else schemas.ModelHoldout(
                    accuracy=m.accuracy, rows=config.holdout.rows)))  # type: ignore[union-attr]
        return "models", m.stream.encode(), schemas.encode(record)
