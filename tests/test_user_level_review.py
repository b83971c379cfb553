"""Findings of the privacy review of the user-level work (issue 24), as tests.

Each test pins one property a privacy engineer signs off on; a test for a defect that is still
open carries ``pytest.mark.xfail(strict=True, reason=...)`` naming what is wrong and where.

* The bounder against a sequential reference: per person, in (step, partition, offset) order,
  an event is kept iff its group is one of the person's groups this period with fewer than
  ``max_per_group`` kept, or the person has fewer than ``max_groups`` groups. The vectorised
  bounder must agree on ``keep`` and ``first`` whatever the order of the step's events, the
  type of the group keys and a snapshot and restore between steps (pitfalls 11 and 17).
* A resumed store must be refused when the privacy unit changes: the caps, the period, and the
  field that names the person (a store made with ``user_field = "user"`` resumed with
  ``"account"`` would give every person fresh caps inside the same period). Found open for
  the counters (the field was not in their mechanisms digest); fixed.
* Under zCDP the k-periods statement is ``k^2 rho`` (group privacy over k per-period units
  that feed the same continual mechanisms), never ``k`` times: check-config must not claim
  the pure-DP factor for a zCDP flow. Found open in the counters' check-config (it
  printed only the shared "k times" line; PMWG and ERM add the zCDP line); fixed.
* A counters person field that is the key or the time field passed check-config and then
  failed at start-up (the clock's decoder cannot map two fields to one name): now refused as
  a configuration error.
"""

from __future__ import annotations

import copy
import pickle
import random
from collections.abc import Hashable
from typing import Any

import numpy as np
import pytest

from dpstream.core.contribution.bounder import ContributionBounder
from dpstream.core.contribution.people import PersonHasher
from dpstream.core.contribution.rules import BoundingRule
from dpstream.errors import ConfigError
from dpstream.kinds.counters.kind import KIND as COUNTERS
from dpstream.kinds.counters.kind import parse_config

Event = tuple[int, str, Hashable, int, int]  # (step, person, group, partition, offset)


def _reference(rule: BoundingRule, events: list[Event]
               ) -> tuple[dict[Event, bool], dict[Event, bool]]:
    """The rule, one event at a time, in (step, partition, offset) order."""
    held: dict[str, dict[Hashable, int]] = {}
    period: int | None = None
    keep: dict[Event, bool] = {}
    first: dict[Event, bool] = {}
    for event in sorted(events, key=lambda e: (e[0], e[3], e[4])):
        step, person, group, _, _ = event
        if rule.period_of(step) != period:
            held, period = {}, rule.period_of(step)
        group = {"key": group, "step": step, "one": 0}[rule.grouping]
        mine = held.setdefault(person, {})
        kept = is_first = False
        if group in mine:
            kept = mine[group] < rule.max_per_group
            mine[group] += kept
        elif len(mine) < rule.max_groups:
            mine[group], kept, is_first = 1, True, True
        keep[event], first[event] = kept, is_first
    return keep, first


def _bounded(rule: BoundingRule, events: list[Event], rng: random.Random
             ) -> tuple[dict[Event, bool], dict[Event, bool]]:
    """The bounder, a step per call, the step's events shuffled, restored between steps."""
    hasher = PersonHasher(b"review-key-" * 3)
    bounder = ContributionBounder(rule)
    keep: dict[Event, bool] = {}
    first: dict[Event, bool] = {}
    for step in sorted({e[0] for e in events}):
        mine = [e for e in events if e[0] == step]
        rng.shuffle(mine)
        groups: Any = [e[2] for e in mine]
        if all(isinstance(g, int) for g in groups) and rng.random() < 0.5:
            groups = np.array(groups, dtype=np.int64)  # declared positions come as arrays
        kept, firsts = bounder.keep(step, hasher.hash_many([e[1] for e in mine]), groups,
                                    [e[3] for e in mine], [e[4] for e in mine])
        for event, k, f in zip(mine, kept.tolist(), firsts.tolist(), strict=True):
            keep[event], first[event] = k, f
        if rng.random() < 0.5:  # a restart between two steps
            bounder = ContributionBounder(rule, pickle.loads(pickle.dumps(bounder.to_state())))
    return keep, first


@pytest.mark.parametrize("grouping", ["key", "step", "one"])
def test_the_bounder_keeps_what_the_sequential_rule_keeps(grouping: str) -> None:
    rng = random.Random(24)
    kept_somewhere = dropped_somewhere = 0
    for _ in range(120):
        rule = BoundingRule(grouping, 1 if grouping == "one" else rng.randint(1, 4),  # type: ignore[arg-type]
                            rng.randint(1, 4), rng.choice([None, 1, 2, 3]))
        used: set[tuple[int, int]] = set()
        events: list[Event] = []
        for _ in range(rng.randint(1, 150)):
            partition = rng.randint(0, 3)
            offset = rng.randint(0, 10**6)
            if (partition, offset) in used:
                continue
            used.add((partition, offset))
            group: Hashable = (rng.randint(0, 6) if rng.random() < 0.6
                               else f"k{rng.randint(0, 6)}")
            events.append((rng.randint(0, 8), f"person-{rng.randint(0, 12)}", group,
                           partition, offset))
        want = _reference(rule, events)
        assert _bounded(rule, events, rng) == want, rule
        kept_somewhere += sum(want[0].values())
        dropped_somewhere += len(events) - sum(want[0].values())
    # power: the caps bind (a bounder that kept everything, or nothing, fails above)
    assert kept_somewhere > 0 and dropped_somewhere > 0


def _counters_raw(accounting: str = "pure", period: str = "lifetime",
                  user_field: str = "user") -> dict[str, Any]:
    return {"flow": {"origin": "2026-11-20T00:00:00Z", "step": "1s"},
            "privacy": {"accounting": accounting, "budget": 1.0, "delta": 1e-6},
            "contribution": {"unit": "user", "user_field": user_field, "period": period,
                             "max_keys": 4, "max_per_key": 3}}


def test_a_counters_resume_under_another_person_field_is_refused() -> None:
    raw = _counters_raw()
    other = copy.deepcopy(raw)
    other["contribution"]["user_field"] = "account"
    same = COUNTERS.binding(parse_config(raw)).mechanisms_digest
    changed = COUNTERS.binding(parse_config(other)).mechanisms_digest
    assert same != changed


def test_a_counters_resume_under_other_caps_or_period_is_refused() -> None:
    base = COUNTERS.binding(parse_config(_counters_raw())).mechanisms_digest
    caps = copy.deepcopy(_counters_raw())
    caps["contribution"]["max_keys"] = 5
    period = _counters_raw(period="10s")
    assert len({base, COUNTERS.binding(parse_config(caps)).mechanisms_digest,
                COUNTERS.binding(parse_config(period)).mechanisms_digest}) == 3


def test_zcdp_counters_do_not_claim_k_times_rho_over_k_periods() -> None:
    text = parse_config(_counters_raw("zcdp", period="10s")).describe()
    assert "k^2 times the per-period rho" in text
    pure = parse_config(_counters_raw("pure", period="10s")).describe()
    assert "k times" in pure and "k^2" not in pure  # pure: k times epsilon
    lifetime = parse_config(_counters_raw("zcdp")).describe()
    assert "k periods" not in lifetime  # one unit per person: nothing to multiply


@pytest.mark.parametrize("field", ["key", "ts"])
def test_a_person_field_that_is_the_key_or_time_field_is_a_configuration_error(
        field: str) -> None:
    # it passed check-config, then the counters' clock could not be built (msgspec refuses
    # two struct fields renamed to one name): the flow failed at start-up instead
    with pytest.raises(ConfigError, match="must name its own field"):
        parse_config(_counters_raw(user_field=field))
    config = parse_config(_counters_raw(user_field="user"))
    assert COUNTERS.clock(config, {})(None) is not None  # the usual field builds its clock


def test_a_user_level_clock_without_the_platform_refuses_to_route_unbounded() -> None:
    """A user-level clock built outside the platform (no person hasher) fails closed."""
    from dpstream.kinds.counters.events import PartitionClock
    from dpstream.kinds.counters.kind import event_rules
    from dpstream.messages import TIMESTAMP_LOG_APPEND_TIME
    from dpstream.platform import parse_config

    config = parse_config({"flow": {"kind": "counters", "step": "1s"},
                           "contribution": {"unit": "user", "user_field": "user",
                                            "max_keys": 1, "max_per_key": 1}})
    clock = PartitionClock(event_rules(config))
    record = b'{"key": "a", "ts": 5.0, "user": "alice"}'
    with pytest.raises(RuntimeError, match="no person hasher") as caught:
        clock.process(0, [(0, record, 0, "events", 5000.0, TIMESTAMP_LOG_APPEND_TIME)])
    assert "alice" not in str(caught.value)
