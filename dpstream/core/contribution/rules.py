"""What one person may contribute: the bounding rule of a flow kind, from its caps.

Contribution bounding (issue 24) is the same algorithm for every kind; only what a *group* is
differs. A person's events, per period, fall into groups; the rule caps the number of groups a
person may touch (``max_groups``, an L0 bound) and the events a person may add to one group
(``max_per_group``, an Linf bound):

* counters (``grouping = "key"``): a group is a key; ``max_keys`` keys, ``max_per_key`` events
  each, so one person moves at most ``max_keys`` keys' counts by at most ``max_per_key`` each;
* PMWG (``grouping = "one"``): one group, the histogram; ``max_rows`` rows;
* ERM (``grouping = "step"``): a group is a step (a block of the stream); ``max_blocks`` blocks,
  ``max_rows_per_block`` rows each.

The caps are the sensitivities the kinds' accounting multiplies (group privacy, or their own
tighter bounds): the rule says only what is kept, :mod:`dpstream.core.contribution.bounder` keeps
it. ``period_steps`` is the period of the privacy unit in steps (None: a person's lifetime);
the caps hold per period, and the period of step ``s`` is ``s // period_steps``, a public
function of the step clock (no event can move a period's boundary).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, Protocol

from dpstream.core._checks import integer_at_least
from dpstream.errors import InvalidParameterError

__all__ = ["GROUPINGS", "MAX_CAP", "BoundingRule", "Contribution", "Grouping"]

Grouping = Literal["key", "step", "one"]
GROUPINGS: Final = ("key", "step", "one")
MAX_CAP: Final = 65_535
"""The largest ``max_per_group`` (the bounding state counts in 16-bit columns)."""


class Contribution(Protocol):
    """What a rule needs of the ``[contribution]`` table (the config layer's object)."""

    @property
    def user_level(self) -> bool:
        """Whether a person is the unit."""

    @property
    def period_steps(self) -> int | None:
        """The period in steps (None: lifetime)."""

    @property
    def caps(self) -> tuple[tuple[str, int], ...]:
        """The kind's caps as ``(name, value)`` pairs."""


_KINDS: Final[tuple[tuple[Grouping, str, str | None, str], ...]] = (
    ("key", "max_keys", "max_per_key", "counters"),
    ("one", "max_rows", None, "pmwg"),
    ("step", "max_blocks", "max_rows_per_block", "erm"),
)
"""(grouping, the cap on groups, the cap per group, the kind): "one" has one group, capped
by its only cap."""


@dataclass(frozen=True)
class BoundingRule:
    """How much of one person's events, per period, bounding keeps.

    Attributes:
        grouping: ``key`` (a group is a key), ``step`` (a group is a step) or ``one`` (one
            group).
        max_groups: the groups a person may contribute to per period (1 with ``one``).
        max_per_group: the events a person may contribute to one group per period.
        period_steps: the period in steps (None: lifetime).
    """

    grouping: Grouping
    max_groups: int
    max_per_group: int
    period_steps: int | None = None

    def __post_init__(self) -> None:
        if self.grouping not in GROUPINGS:
            raise InvalidParameterError(
                f"grouping must be one of {', '.join(GROUPINGS)}, got {self.grouping!r}")
        integer_at_least("max_groups", self.max_groups, 1)
        integer_at_least("max_per_group", self.max_per_group, 1)
        if self.max_per_group > MAX_CAP or self.max_groups > MAX_CAP:
            raise InvalidParameterError(
                f"max_groups and max_per_group must be <= {MAX_CAP}, got {self.max_groups} "
                f"and {self.max_per_group}")
        if self.grouping == "one" and self.max_groups != 1:
            raise InvalidParameterError(
                f"grouping 'one' has exactly one group: max_groups must be 1, got "
                f"{self.max_groups}")
        if self.period_steps is not None:
            integer_at_least("period_steps", self.period_steps, 1)

    @classmethod
    def from_contribution(cls, contribution: Contribution) -> BoundingRule:
        """The rule of a ``[contribution]`` table at the user level (its caps name the kind).

        Counters (``max_keys``, ``max_per_key``) give ``("key", max_keys, max_per_key)``; PMWG
        (``max_rows``) ``("one", 1, max_rows)``; ERM (``max_blocks``, ``max_rows_per_block``)
        ``("step", max_blocks, max_rows_per_block)``.
        """
        if not contribution.user_level:
            raise InvalidParameterError("a bounding rule needs unit = 'user'")
        caps = dict(contribution.caps)
        for grouping, groups, per_group, kind in _KINDS:
            if groups in caps:
                if per_group is None:
                    return cls(grouping, 1, caps[groups], contribution.period_steps)
                if per_group not in caps:
                    raise InvalidParameterError(f"the {kind} caps need {per_group}")
                return cls(grouping, caps[groups], caps[per_group], contribution.period_steps)
        raise InvalidParameterError(
            "the contribution caps name no kind (max_keys, max_rows or max_blocks expected)")

    def period_of(self, step: int) -> int:
        """The period of a step (0 for every step with a lifetime period)."""
        return 0 if self.period_steps is None else step // self.period_steps

    def to_dict(self) -> dict[str, object]:
        """Plain data (what a snapshot records to refuse a resume under other caps)."""
        return {"grouping": self.grouping, "max_groups": self.max_groups,
                "max_per_group": self.max_per_group, "period_steps": self.period_steps}
