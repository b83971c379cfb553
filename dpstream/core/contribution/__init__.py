"""Contribution bounding for user-level privacy: people as keyed hashes, the caps, the bounder."""

from dpstream.core.contribution.bounder import ContributionBounder
from dpstream.core.contribution.people import (
    PEOPLE_BOUND,
    PersonHasher,
    collision_delta,
    person_shards,
)
from dpstream.core.contribution.rules import BoundingRule

__all__ = ["PEOPLE_BOUND", "BoundingRule", "ContributionBounder", "PersonHasher",
           "collision_delta", "person_shards"]
