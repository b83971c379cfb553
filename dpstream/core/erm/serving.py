"""Which released model to serve: a public rule over the released models' public metadata.

An ERM flow releases several models per stream (paper 004's schedules: a continual stream's
``base`` and ``update`` models and Algorithm 2's ``multi-resolution`` levels, a sliding-window
stream's ``window`` model, an ``independent`` model per block). A consumer needs one of them.
:func:`serving_choice` names it.

**The rule** (reproducible by any consumer from the published ``dpstream.model/1`` records):

1. A model *covers* the blocks of every range in its ``depends_on`` (its own range and its
   centre chain's: a continual ``update`` covers its base too, a sliding ``window`` model its
   whole chain). Only the models whose covered blocks *end at the latest step any released
   model covers* are eligible: the freshest data.
2. Among those, the model covering the **most blocks** (the union of its ranges: a continual
   ``update`` skips the blocks between its saved centre and its own block, and does not
   count them). Coverage is nominal: with ``release.max_history = H`` a model trained on
   the blocks of its ranges among the last H only (public: the configuration says H).
3. Ties: the **smaller noise standard deviation** (``noise.std``, an analytic figure of the
   mechanism, never of the data; it is comparable between the models of one stream, which
   is all this rule compares: a stream's models all come from one learner, a fixed setting
   of the flow instance. The figure means the std of each weight's noise under output
   perturbation and the std of ``b / n̄`` under objective perturbation, so it is *not*
   comparable across learners); then the **later release step**; then the fixed role order
   :data:`ROLE_ORDER` (unknown roles after it, alphabetically); then the smaller level
   (``None`` first); then the later first block, then the stream's name (which only make
   the order total).

The order of the candidates never matters: the rule is a total order on the candidates'
fields (two candidates equal on all of them are equal). Give it one stream's candidates.

**Privacy.** None is spent. The inputs are the released models' metadata only: which role
and level were released at which step over which blocks (fixed by the public schedule and
the public ledger: a stream stops at a public step, ``role = "exhausted"``), and the noise
standard deviation, a public function of the configuration, the public normaliser and the
schedule's noise level (:mod:`dpstream.core.erm.output_noise`,
:class:`~dpstream.core.erm.model.PrivateModel`'s ``noise_std``). No data value, no count and
no random number is read: the choice is post-processing of differentially private releases
(Dwork-Roth 2014, Proposition 2.1), and a stream's serving records are the same for any two
neighbouring inputs whose releases are identical (the neighbouring-stream tests check it
through the whole flow).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from dpstream.errors import InvalidParameterError

__all__ = ["ROLE_ORDER", "ServingCandidate", "serving_choice", "still_eligible"]

ROLE_ORDER: Final[tuple[str, ...]] = ("base", "update", "window", "multi-resolution",
                                      "independent")
"""The last tie-break: earlier roles first (a continual base before an update of the same
blocks, noise and step; neither ever ties in practice). Roles not listed come after these,
alphabetically."""


def _covered(depends_on: Sequence[tuple[int, int]]) -> tuple[int, int, int]:
    """``(first, last, blocks)``: the span of the ranges and the size of their union."""
    if not depends_on:
        raise InvalidParameterError("a released model depends on at least its own range")
    ranges = sorted((int(a), int(b)) for a, b in depends_on)
    for a, b in ranges:
        if a < 0 or b < a:
            raise InvalidParameterError(f"a block range must be 0 <= first <= last, got {a}..{b}")
    blocks, reach = 0, -1
    for a, b in ranges:  # the union's size: count each block once
        if b > reach:
            blocks += b - max(a, reach + 1) + 1
            reach = b
    return ranges[0][0], max(b for _, b in ranges), blocks


@dataclass(frozen=True)
class ServingCandidate:
    """The public metadata of one released model (one ``dpstream.model/1`` record with weights).

    Attributes:
        stream: the model stream.
        step: the step at which the model was released.
        role: ``base``, ``update``, ``window``, ``multi-resolution``, ``independent``, ...
        level: the record's level (``None`` where it has none).
        first_step: the first block the model covers (its ``depends_on`` ranges' first).
        last_step: the last block it covers.
        blocks: how many distinct blocks its ``depends_on`` ranges cover.
        noise_std: each weight's noise standard deviation (the record's ``noise.std``).
    """

    stream: str
    step: int
    role: str
    level: int | None
    first_step: int
    last_step: int
    blocks: int
    noise_std: float

    def __post_init__(self) -> None:
        if not 0 <= self.first_step <= self.last_step or not 1 <= self.blocks <= (
                self.last_step - self.first_step + 1):
            raise InvalidParameterError(
                f"a serving candidate covers 1..{self.last_step - self.first_step + 1} blocks "
                f"of {self.first_step}..{self.last_step}, got {self.blocks}")
        if not self.noise_std >= 0.0:  # also refuses NaN
            raise InvalidParameterError("a serving candidate's noise_std must be >= 0")

    @classmethod
    def of(cls, stream: str, step: int, role: str, level: int | None,
           depends_on: Sequence[tuple[int, int]], noise_std: float) -> ServingCandidate:
        """The candidate of a model released at ``step`` whose data are ``depends_on``."""
        first, last, blocks = _covered(depends_on)
        return cls(stream, int(step), role, level, first, last, blocks, float(noise_std))


def _role_rank(role: str) -> tuple[int, str]:
    return (ROLE_ORDER.index(role), "") if role in ROLE_ORDER else (len(ROLE_ORDER), role)


def _preference(c: ServingCandidate
                ) -> tuple[int, float, int, tuple[int, str], int, int, str]:
    """Smaller is preferred (among candidates that end at the latest covered block).

    The last two keys (the later first block, then the stream's name) only make the order
    total, so that no input order can matter; one stream's schedule never releases two
    models that agree on everything before them.
    """
    return (-c.blocks, c.noise_std, -c.step, _role_rank(c.role),
            -1 if c.level is None else c.level, -c.first_step, c.stream)


def serving_choice(candidates: Iterable[ServingCandidate]) -> ServingCandidate | None:
    """The model to serve among ``candidates`` (one stream's released models), or None if none.

    See the module docstring for the rule; it reads only the candidates' public fields and
    does not depend on their order.
    """
    eligible = still_eligible(candidates)
    return min(eligible, key=_preference) if eligible else None


def still_eligible(candidates: Iterable[ServingCandidate]) -> list[ServingCandidate]:
    """The candidates whose covered blocks end at the latest covered block (rule 1), in order.

    A later choice, after more releases, can pick none of the others: releases only ever
    move the latest covered block forward. A stream keeps just these between steps.
    """
    pool = list(candidates)
    if not pool:
        return []
    latest = max(c.last_step for c in pool)
    return [c for c in pool if c.last_step == latest]
