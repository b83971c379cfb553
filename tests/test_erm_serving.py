"""The serving rule (:mod:`dpstream.core.erm.serving`): which released model to serve.

Unit cases pin each clause of the rule; property tests (hypothesis) check, over arbitrary
candidate sets, that the choice is one of the candidates, that it does not depend on their
order, that it depends only on the public fields the rule names, and that it is the best
candidate by the rule stated independently here. The last tests run the rule on the release
schedules themselves (the core, no dataflow): what each algorithm's stream serves.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.core.erm.serving import ROLE_ORDER, ServingCandidate, serving_choice
from dpstream.core.erm.spec import Block
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError
from dpstream.kinds.erm.shard import ModelRecord, ServingRecord, _Stream
from dpstream.platform import parse_config

STEPS = 12


def cand(step: int, role: str, level: int | None, depends_on, std: float = 1.0,
         stream: str = "a") -> ServingCandidate:
    return ServingCandidate.of(stream, step, role, level, depends_on, std)


# -- the clauses ---------------------------------------------------------------------------------


def test_no_candidates_serve_nothing():
    assert serving_choice([]) is None


def test_coverage_counts_the_union_of_the_depends_on_ranges():
    # a continual update at t = 7 (base 0..3, saved centre 4..5, own block 6): block 6 is
    # covered, but the centre chain skips nothing here; at t = 8 the update skips block 6
    c = cand(8, "update", None, [(7, 7), (4, 5), (0, 3)])
    assert (c.first_step, c.last_step, c.blocks) == (0, 7, 7)
    overlapping = cand(3, "window", None, [(3, 3), (1, 2), (0, 2)])
    assert (overlapping.first_step, overlapping.last_step, overlapping.blocks) == (0, 3, 4)


def test_only_models_ending_at_the_latest_block_are_eligible():
    old_big = cand(7, "base", 3, [(0, 7)])
    fresh_small = cand(8, "independent", None, [(8, 8)])
    assert serving_choice([old_big, fresh_small]) == fresh_small


def test_most_blocks_wins_then_smaller_noise_then_later_step_then_role():
    level0 = cand(7, "multi-resolution", 0, [(7, 7)], std=0.1)
    level3 = cand(7, "multi-resolution", 3, [(0, 7)], std=0.5)
    assert serving_choice([level0, level3]) == level3  # more blocks beats less noise
    quiet = cand(7, "update", 0, [(7, 7), (0, 6)], std=0.4)
    assert serving_choice([level3, quiet]) == quiet  # same blocks: smaller noise
    later = replace(level3, step=9)
    assert serving_choice([level3, later]) == later  # same blocks and noise: later release
    base = replace(level3, role="base")
    assert serving_choice([level3, base]) == base  # then the fixed role order
    assert ROLE_ORDER.index("base") < ROLE_ORDER.index("multi-resolution")
    unknown = replace(level3, role="zeta")
    assert serving_choice([unknown, level3]) == level3  # unknown roles after the known ones


@pytest.mark.parametrize("bad", [
    {"depends_on": []}, {"depends_on": [(3, 2)]}, {"depends_on": [(-1, 2)]},
    {"std": float("nan")}, {"std": -1.0},
])
def test_malformed_candidates_are_refused(bad):
    args = {"depends_on": [(0, 3)], "std": 1.0} | bad
    with pytest.raises(InvalidParameterError):
        cand(3, "base", 0, args["depends_on"], args["std"])


# -- properties ----------------------------------------------------------------------------------

ROLES = st.sampled_from([*ROLE_ORDER, "other"])


@st.composite
def candidates(draw: st.DrawFn) -> ServingCandidate:
    ranges = draw(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 6)), min_size=1,
                           max_size=4))
    depends_on = [(a, a + n) for a, n in ranges]
    last = max(b for _, b in depends_on)
    step = last + draw(st.integers(0, 2))
    std = draw(st.sampled_from([0.0, 0.25, 0.5, 1.0, 3.0]))
    level = draw(st.none() | st.integers(0, 4))
    return cand(step, draw(ROLES), level, depends_on, std)


def reference_choice(pool: list[ServingCandidate]) -> ServingCandidate:
    """The rule as the module docstring states it, written out clause by clause."""
    latest = max(c.last_step for c in pool)
    best = [c for c in pool if c.last_step == latest]
    most = max(c.blocks for c in best)
    best = [c for c in best if c.blocks == most]
    quiet = min(c.noise_std for c in best)
    best = [c for c in best if c.noise_std == quiet]
    newest = max(c.step for c in best)
    best = [c for c in best if c.step == newest]
    rank = {r: i for i, r in enumerate(ROLE_ORDER)}
    best.sort(key=lambda c: (rank.get(c.role, len(ROLE_ORDER)), c.role,
                             -1 if c.level is None else c.level, -c.first_step, c.stream))
    return best[0]


@settings(max_examples=300, deadline=None)
@given(st.lists(candidates(), min_size=1, max_size=8), st.randoms(use_true_random=False))
def test_the_choice_is_a_candidate_order_free_and_the_stated_rule(pool, rnd):
    chosen = serving_choice(pool)
    assert chosen in pool
    shuffled = list(pool)
    rnd.shuffle(shuffled)
    assert serving_choice(shuffled) == chosen
    assert serving_choice(reversed(pool)) == chosen
    assert chosen == reference_choice(pool)
    # adding a candidate that covers an older last block never changes the choice
    older = cand(chosen.step, "base", 0, [(0, max(0, chosen.last_step - 1))], 0.0)
    if older.last_step < chosen.last_step:
        assert serving_choice([*pool, older]) == chosen


def test_a_rule_that_ignores_the_latest_block_clause_fails_the_reference():
    """Power of the property test: a plausible wrong rule (most blocks overall) disagrees."""
    pool = [cand(7, "base", 3, [(0, 7)]), cand(8, "update", None, [(8, 8), (0, 3)])]
    wrong = max(pool, key=lambda c: c.blocks)
    assert wrong != reference_choice(pool) == serving_choice(pool)


# -- on the schedules (core and shard, no dataflow) ---------------------------------------------


def erm_config(algorithm: str):
    return parse_config({
        "flow": {"kind": "erm", "name": "sv", "origin": "2026-09-21T14:13:20Z", "step": "1s"},
        "privacy": {"accounting": "pure", "epsilon": 1.0},
        "model": {"classes": ["no", "yes"], "dimension": 3, "clip_norm": 2.0,
                  "regularization": 0.5, "streams": ["a", "b"], "stream_field": "s"},
        "release": {"algorithm": algorithm, "block_size": 16, "base_blocks": 2,
                    "window_blocks": 3},
    })


def block(cfg, step: int) -> Block:
    g = np.random.default_rng(step)
    z = cfg.model.features(g.normal(size=(20, cfg.model.dimension)))
    return Block(z, g.integers(0, len(cfg.model.classes), size=20))


def streams(cfg, key: int = 3) -> list[_Stream]:
    return [_Stream(cfg, name, NoiseKey.for_tests(key), ("i", "sv", "erm", name), None)
            for name in cfg.streams]


def shard_outputs(algorithm: str):
    cfg = erm_config(algorithm)
    out = []
    members = streams(cfg)
    for step in range(STEPS):
        for s in members:
            out.extend(s.step(step, block(cfg, step)))
    return cfg, out


@pytest.mark.parametrize("algorithm", ["continual", "sliding-window", "multi-resolution",
                                       "independent"])
def test_each_step_serves_the_freshest_widest_released_model(algorithm):
    cfg, out = shard_outputs(algorithm)
    released: list[ModelRecord] = []
    by_step: dict[tuple[str, int], list[ServingRecord]] = {}
    for r in out:
        if isinstance(r, ModelRecord):
            released.append(r)
        else:
            by_step.setdefault((r.stream, r.step), []).append(r)
    assert released
    for name in cfg.streams:
        for step in range(STEPS):
            (record,) = by_step[(name, step)]
            mine = [m for m in released if m.stream == name and m.step <= step
                    and m.model is not None]
            if not mine:
                assert record.choice is None
                continue
            c = record.choice
            assert c is not None
            named = [m for m in mine if (m.role, m.level, m.step) == (c.role, c.level, c.step)]
            assert len(named) == 1
            assert c.noise_std == named[0].model.noise_std
            pool = [ServingCandidate.of(m.stream, m.step, m.role, m.level, m.depends_on,
                                        m.model.noise_std) for m in mine]
            assert c == serving_choice(pool)
            if algorithm == "continual" and step >= cfg.schedule.base_blocks - 1:
                assert c.first_step == 0 and c.last_step == step  # all the data so far
            if algorithm == "sliding-window" and c.step == step:
                assert c.blocks == cfg.schedule.window_blocks


def test_a_snapshot_resumes_to_the_same_serving_records():
    cfg = erm_config("continual")
    first = streams(cfg, 4)
    for step in range(5):
        for s in first:
            s.step(step, block(cfg, step))
    resumed = [_Stream(cfg, s.name, NoiseKey.for_tests(4), ("i", "sv", "erm", s.name),
                       s.to_state()) for s in first]
    for step in range(5, 9):
        for s, r in zip(first, resumed, strict=True):
            a = [x for x in s.step(step, block(cfg, step)) if isinstance(x, ServingRecord)]
            b = [x for x in r.step(step, block(cfg, step)) if isinstance(x, ServingRecord)]
            assert a == b and len(a) == 1 and a[0].choice is not None


def test_after_the_budget_is_spent_the_stream_keeps_serving_its_last_model(monkeypatch):
    """A refused charge (the ledger's BudgetExhaustedError, as a resume under a lowered budget
    would raise it) is announced as before; the serving records go on naming the last model."""
    from dpstream.core.erm.schedules.schedule import ReleaseSchedule
    from dpstream.errors import BudgetExhaustedError

    cfg = erm_config("continual")
    (s, _) = streams(cfg)
    for step in range(4):
        s.step(step, block(cfg, step))
    before = s.step(4, block(cfg, 4))[-1]
    assert isinstance(before, ServingRecord) and before.choice is not None

    def refuse(self, step, data):
        raise BudgetExhaustedError("refused")

    monkeypatch.setattr(ReleaseSchedule, "add_block", refuse)
    exhausted = s.step(5, block(cfg, 5))
    assert [type(r) for r in exhausted] == [ModelRecord, ServingRecord]
    assert exhausted[0].role == "exhausted" and exhausted[1].choice == before.choice
    later = s.step(6, block(cfg, 6))
    assert len(later) == 1 and later[0].choice == before.choice and later[0].step == 6
