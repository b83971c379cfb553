"""Neighbouring PEOPLE through the whole flow (issue 24; pitfall 17).

The user-level sibling of the one-event tests (test_neighbours, test_pmwg_neighbours,
test_erm_neighbours): two input streams differ in ALL the events of one person, the target,
placed adversarially: spread over many keys (histogram cells, blocks), steps and partitions,
far more events than the caps, on both sides of a period boundary, holding the first and the
last event of the input, and (coupled runs) as the person whose keyed hash is the smallest or
the largest of all. Every kind (counters: declared keys under the tree / pure epsilon and the
BLT / zCDP, an open universe with admission under both; PMWG; ERM) runs under both periods
(a lifetime, and a duration of a few steps), through the real Bytewax dataflow
(:func:`harness.run_flow`). What must hold:

* **coupled runs** (same noise key): every record that is not about the target's kept keys
  (the keys the bounding rule, :func:`harness.reference_kept`, keeps the target's events on)
  is byte-identical, so removing a person changes which events of no one else are kept; the
  target's keys' records have the same structure, and their values move by exactly the
  target's kept contribution (declared counters) or within the stated sensitivity (the cap
  times the periods the person was active in so far; PMWG's public size);
* **over 300 noise draws a world** (and separate pilot keys that fix the statistic's
  threshold halfway between the two worlds' medians, so that the threshold owes nothing to the
  draws it is tested on), the frequency of an output event about the target's keys gives a
  Clopper-Pearson lower bound on the privacy loss (alpha = 1e-3 per interval: a correct flow
  exceeds its claim with probability < 2e-3 per test) that stays below the per-person claim
  derived here from the configuration, and stated by every record (``privacy.person``): at
  the user level every configured per-key / per-histogram / per-block parameter is what one
  person's bounded contribution costs there, so a person costs (counters) L0 times the
  per-key charges (epsilon, or rho converted at privacy.delta), (PMWG) the histogram's size
  and PMWG epsilon, (ERM) max_blocks times the per-block budget, per period, times the
  periods k the person is active in (k^2 for a counter's rho: the counters are cumulative).
  PMWG and ERM draw with 300 noise keys, a run of each world per key; the counters batch
  the noise keys: one run holds 10 replicas of each world on keys and people of their own
  (every key's noise is its own draw, every person is bounded alone, and the coupled tests
  check that a person moves nothing outside their kept keys), so 30 noise keys give the 300
  draws;
* **power**: the same statistic with the bounding turned off in the test only (the rule
  patched to caps far above the person's events, while the configuration, the noise and the
  records still claim the small caps) gives a bound above the claim, in the same scenarios:
  the target's events far exceed the caps precisely so that an unbounded flow is caught;
* **metrics**: the kept and dropped counts exist only as exact operator data, equal to the
  rule applied to every person; no label names a person (nor does any record).

Measured (2 cores, another suite running): the file takes ~2 minutes; every bound of a
correct flow was at most 0.02, every bounding-off bound 2.7-3.7 against claims of 1-3.2.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics as stats
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from harness import (
    ORIGIN,
    PERSON_FIELD,
    Item,
    Placed,
    Record,
    epsilon_lower_bound,
    kafka_view,
    make_config,
    placed_events,
    reference_kept,
    run_flow,
    without_person,
)

from dpstream.config import FlowConfig
from dpstream.core.accounting.ledger import zcdp_to_approx_dp
from dpstream.core.noise.keys import NoiseKey

pytestmark = [pytest.mark.privacy]

TARGET = "target-person"
STEPS = 8
PERIODS = {"lifetime": None, "4s": 4}
PILOT = range(70_000, 70_012)
KEYS_STAT = range(71_000, 71_300)
KEYS_POWER = range(72_000, 72_120)


def contribution(period: str, **caps: int) -> dict[str, Any]:
    return {"unit": "user", "user_field": PERSON_FIELD, "period": period, **caps}


def periods_active(kept: Sequence[Placed], period_steps: int | None,
                   through: int | None = None) -> int:
    """In how many periods the person has kept events (through step ``through``)."""
    if period_steps is None:
        return 1 if kept else 0
    return len({e.step // period_steps for e in kept if through is None or e.step <= through})


# -- counters -----------------------------------------------------------------------------------

COUNTER_KEYS = [f"k{i}" for i in range(8)]
COUNTER_CAPS = {"max_keys": 2, "max_per_key": 2}
COUNTER_MODES = [("declared", "pure"), ("declared", "zcdp"), ("open", "pure"), ("open", "zcdp")]
PER_KEY = 200  # the target's events on each of its keys (the caps keep 2 a key, 2 keys a period)


def counters_config(mode: str, accounting: str, period: str) -> FlowConfig:
    tables: dict[str, dict[str, Any]] = {"contribution": contribution(period, **COUNTER_CAPS),
                                         "flow": {"shards": 2}}
    if mode == "declared":
        tables["admission"] = {"keys": COUNTER_KEYS}
    return make_config(mode, accounting, **tables)


def counters_background(mode: str, seed: int = 0) -> list[Item]:
    """40 people over every step and partition, some of them above the caps too; in the open
    universe also 400 distinct people on 'k0' (steps 2-4) and on 'k1' (steps 5-7), so that
    both keys are admitted on the number of distinct people."""
    rng = random.Random(seed)
    items = []
    for p in range(40):
        person = f"p{p:02d}"
        keys = rng.sample(COUNTER_KEYS, rng.randint(1, 4))
        for _ in range(rng.randint(1, 9)):
            t = rng.randrange(STEPS) + 0.05 + 0.9 * rng.random()
            items.append(Item(rng.randrange(3), {"key": rng.choice(keys), "ts": ORIGIN + t,
                                                 PERSON_FIELD: person}, t))
    for t in range(STEPS):  # every partition hears of every step
        for partition in range(3):
            items.append(Item(partition, {"key": "k7", "ts": ORIGIN + t + 0.5,
                                          PERSON_FIELD: f"clock-{t}-{partition}"}, t + 0.5))
    if mode == "open":
        for key, first in (("k0", 2), ("k1", 5)):
            for i in range(400):
                t = first + (i % 3) + 0.1 + 0.8 * (i / 400)
                items.append(Item(i % 3, {"key": key, "ts": ORIGIN + t,
                                          PERSON_FIELD: f"{key}-crowd-{i}"}, t))
    return items


def counters_target(person: str = TARGET, per_key: int = PER_KEY) -> list[Item]:
    """The target: ``per_key`` events on each of k0..k5 over every step and partition, the
    first event of the input (k0, partition 0), the last (k5, partition 2), and events on both
    sides of the period boundary of a 4-step period (steps 3|4)."""
    items = [Item(0, {"key": "k0", "ts": ORIGIN, PERSON_FIELD: person}, 0.0),
             Item(2, {"key": "k5", "ts": ORIGIN + STEPS - 0.001, PERSON_FIELD: person},
                  STEPS - 0.001)]
    for edge in (4,):  # the last instant of a period, the first of the next
        for key, t in (("k1", edge - 0.001), ("k2", edge + 0.0)):
            items.append(Item(edge % 3, {"key": key, "ts": ORIGIN + t, PERSON_FIELD: person}, t))
    for i, key in enumerate(COUNTER_KEYS[:6]):
        for j in range(per_key):
            t = (i * 5 + j) % STEPS + 0.02 + 0.96 * j / per_key
            items.append(Item((i + j) % 3, {"key": key, "ts": ORIGIN + t, PERSON_FIELD: person},
                              t))
    return items


def counters_worlds(mode: str, person: str = TARGET) -> tuple[list[Item], list[Item]]:
    everyone = counters_background(mode) + counters_target(person)
    return without_person(everyone, person), everyone


def counters_kept(config: FlowConfig, items: Sequence[Item], person: str = TARGET
                  ) -> list[Placed]:
    c = config.contribution
    events = placed_events(kafka_view(items), lambda body: body["key"])[person]
    return reference_kept(events, "key", c.cap("max_keys"), c.cap("max_per_key"),
                          c.period_steps)


def per_key_claim(config: FlowConfig) -> tuple[float, float]:
    """(epsilon, rho) of one key as configured: the admission, monitor and counter charges."""
    charges = config.per_key_charges()  # type: ignore[attr-defined]
    epsilon = sum(float(c.epsilon or 0) for c in charges)
    rho = sum(float(c.rho or 0) for c in charges)
    return epsilon, rho


def counters_claim(config: FlowConfig, periods: int) -> float:
    """The per-person epsilon: L0 keys a period, each costing its configured charge.

    A person active in k periods: pure epsilon adds (k L0 keys' charges at most); a key's
    counter is cumulative across periods, so under zCDP a key the person reaches in every
    period sees k times the sensitivity and costs k^2 its rho (group privacy): k^2 L0 rho at
    most (as the PMWG and ERM kinds state for their cumulative mechanisms).
    """
    epsilon, rho = per_key_claim(config)
    l0 = config.contribution.cap("max_keys")
    if config.privacy.accounting == "pure":
        return periods * l0 * epsilon
    return zcdp_to_approx_dp(periods**2 * l0 * (rho + epsilon**2 / 2), config.privacy.delta)


def about(records: Sequence[Record], keys: set[str]) -> list[Record]:
    return [r for r in records if r[1].get("key") in keys]


def canonical(records: Sequence[Record], keys: set[str]) -> list[str]:
    """The records not about ``keys`` (dead letters included), canonically encoded."""
    return sorted(json.dumps(r, sort_keys=True) for r in records if r[1].get("key") not in keys)


def values(records: Sequence[Record], key: str) -> dict[int, float]:
    return {b["step"]: b["value"] for role, b in records
            if role == "releases" and b.get("key") == key}


def masked(records: Sequence[Record]) -> list[str]:
    return sorted(json.dumps([role, {k: v for k, v in b.items() if k != "value"}],
                             sort_keys=True) for role, b in records)


def run_counters(config: FlowConfig, items: Sequence[Item], noise: NoiseKey, **kw: Any
                 ) -> list[Record]:
    return run_flow(config, kafka_view(items), noise, partitions=3, **kw)


def check_coupled_counters(config: FlowConfig, mode: str, worlds: tuple[list, list],
                           person: str, seeds: Sequence[int], **kw: Any) -> int:
    """The coupled checks of the module docstring; returns the runs whose monitors agreed."""
    kept = counters_kept(config, worlds[1], person)
    keys = {e.group for e in kept}
    assert kept and len(keys) >= 2, "the target must be kept on several keys"
    period = config.contribution.period_steps
    linf = config.contribution.cap("max_per_key")
    agreed = 0
    for seed in seeds:
        noise = NoiseKey.for_tests(seed)
        r0, r1 = (run_counters(config, w, noise, instance=f"c{seed}", **kw) for w in worlds)
        assert canonical(r0, keys) == canonical(r1, keys)  # no one else's events moved
        assert person not in json.dumps(r1)  # no raw id anywhere in the output
        a0, a1 = about(r0, keys), about(r1, keys)
        alerts = [sorted((b["key"], b["step"]) for role, b in a if role == "alerts")
                  for a in (a0, a1)]
        if mode == "open" and alerts[0] != alerts[1]:
            continue  # the monitor decided differently: the epsilon tests cover this
        agreed += 1
        assert masked(a0) == masked(a1)
        for key in keys:
            v0, v1 = values(r0, key), values(r1, key)
            assert v0.keys() == v1.keys()
            for step, value in v0.items():
                moved = v1[step] - value
                exact = sum(1 for e in kept if e.group == key and e.step <= step)
                sensitivity = linf * periods_active(kept, period, step)
                assert exact <= sensitivity
                if mode == "declared":  # the cumulative count moves by the kept events
                    assert moved == pytest.approx(exact, abs=1e-6), (key, step)
                else:  # the open universe counts from admission: at most the kept events
                    assert -1e-6 <= moved <= exact + 1e-6, (key, step)
    return agreed


@pytest.mark.flow
@pytest.mark.parametrize("period", list(PERIODS))
@pytest.mark.parametrize(("mode", "accounting"), COUNTER_MODES)
def test_counters_one_person_changes_only_their_kept_keys(mode, accounting, period):
    config = counters_config(mode, accounting, period)
    agreed = check_coupled_counters(config, mode, counters_worlds(mode), TARGET, range(4))
    assert agreed >= 2
    if mode == "open":  # the crowd's keys were admitted: their records were compared
        r = run_counters(config, counters_background(mode), NoiseKey.for_tests(0))
        assert {"k0", "k1"} <= {b.get("key") for _role, b in r}


def hash_extreme_person(config: FlowConfig, noise: NoiseKey, instance: str, people: list[str],
                        largest: bool) -> str:
    """Of candidate names, the one whose keyed hash is below (or above) every person's."""
    import numpy as np

    from dpstream.core.contribution.people import PersonHasher

    hasher = PersonHasher(noise.lane(instance, config.name, "people"))
    candidates = [f"{TARGET}-{i}" for i in range(4096)]  # beat ~80 others
    def as_int(h: Any) -> int:
        return int.from_bytes(bytes(h), "big")
    others = [as_int(h) for h in hasher.hash_many(people)]
    mine = [as_int(h) for h in hasher.hash_many(candidates)]
    pick = int(np.argmax(mine)) if largest else int(np.argmin(mine))
    assert (mine[pick] > max(others)) if largest else (mine[pick] < min(others))
    return candidates[pick]


@pytest.mark.flow
@pytest.mark.parametrize("largest", [False, True], ids=["smallest hash", "largest hash"])
@pytest.mark.parametrize("period", list(PERIODS))
def test_counters_first_and_last_person_by_hash(largest, period):
    """The target as the first (or last) person of the bounding's order and of its shard."""
    config = counters_config("declared", "pure", period)
    base = counters_background("declared")
    people = sorted({i.body[PERSON_FIELD] for i in base})
    noise = NoiseKey.for_tests(5)
    person = hash_extreme_person(config, noise, "c5", people, largest)
    everyone = base + counters_target(person)
    worlds = (without_person(everyone, person), everyone)
    assert check_coupled_counters(config, "declared", worlds, person, [5]) == 1


@pytest.mark.flow
@pytest.mark.parametrize("period", list(PERIODS))
def test_the_coupled_check_catches_bounding_off(monkeypatch, period):
    """With the bounding off, the target's keys beyond its kept ones move too: the records not
    about the kept keys differ, which is what the coupled tests above assert never happens."""
    bounding_off(monkeypatch)
    config = counters_config("declared", "pure", period)
    worlds = counters_worlds("declared")
    keys = {e.group for e in counters_kept(config, worlds[1])}  # what the caps would keep
    noise = NoiseKey.for_tests(0)
    r0, r1 = (run_counters(config, w, noise) for w in worlds)
    assert canonical(r0, keys) != canonical(r1, keys)


@pytest.mark.flow
def test_counters_two_workers_and_small_batches_publish_the_same():
    config = counters_config("declared", "zcdp", "4s")
    _, items = counters_worlds("declared")
    noise = NoiseKey.for_tests(9)
    expected = sorted(map(repr, run_counters(config, items, noise, batch=64)))
    assert sorted(map(repr, run_counters(config, items, noise, batch=5, workers=2))) == expected


def person_terms(records: Sequence[Record]) -> dict[str, Any]:
    """The user-level terms every record states (``privacy.person``): one value for all."""
    stated = [b["privacy"] for _role, b in records if "privacy" in b]  # not alerts
    terms = {json.dumps(p["person"], sort_keys=True) for p in stated}
    assert len(terms) == 1, terms
    assert all(p["unit"] == "user" for p in stated)
    return dict(json.loads(terms.pop()))


def check_stated(records: Sequence[Record], config: FlowConfig, per_period: float) -> None:
    """The records state the caps, the period and the per-period claim derived here."""
    terms = person_terms(records)
    caps = terms["caps"]  # a mapping, or (name, value) pairs: the same terms
    assert dict(caps) == dict(config.contribution.caps)
    period = config.contribution.period_steps
    assert terms["period"] == ("lifetime" if period is None else f"{period} steps")
    assert terms["epsilon"] == pytest.approx(per_period, rel=1e-9), (terms, per_period)


# -- the statistical tests, shared by the kinds ---------------------------------------------------

Statistic = Callable[[list[Record]], "float | None"]


Sample = Callable[[NoiseKey, str], "tuple[list[float | None], list[float | None]]"]


def one_each(run: Callable[[Sequence[Item], NoiseKey, str], list[Record]],
             worlds: tuple[list[Item], list[Item]], statistic: Statistic) -> Sample:
    """A sample of one run of each world under a noise key."""
    def sample(noise: NoiseKey, instance: str) -> tuple[list[float | None], list[float | None]]:
        return ([statistic(run(worlds[0], noise, instance))],
                [statistic(run(worlds[1], noise, instance))])
    return sample


def frequencies(sample: Sample, keys: range, pilot_keys: range = PILOT
                ) -> tuple[float, list[int], list[int]]:
    """The threshold from the pilot keys, then how often ``statistic >= threshold`` per world.

    The threshold is halfway between the two worlds' medians on ``pilot_keys`` (apart from
    ``keys``): where the two distributions differ most for a location shift of symmetric noise.
    A draw whose statistic is None (the key was not released) is not counted.
    """
    pilot: list[list[float]] = [[], []]
    for s in pilot_keys:
        for world, drawn in enumerate(sample(NoiseKey.for_tests(s), f"p{s}")):
            pilot[world] += [v for v in drawn if v is not None]
    assert min(map(len, pilot)) >= len(pilot_keys) // 2, "the statistic is rarely defined"
    threshold = sum(stats.median(p) for p in pilot) / 2
    hits, totals = [0, 0], [0, 0]
    for s in keys:
        for world, drawn in enumerate(sample(NoiseKey.for_tests(s), f"k{s}")):
            present = [v for v in drawn if v is not None]
            totals[world] += len(present)
            hits[world] += sum(v >= threshold for v in present)
    return threshold, hits, totals


def check_empirical_epsilon(label: str, sample: Sample, keys: range, claim: float,
                            pilot_keys: range = PILOT, *, bounded: bool = True,
                            least_draws: int = 0) -> None:
    """The statistical tests' body: the epsilon lower bound from how often ``sample``'s
    statistic passes the threshold (:func:`frequencies`) in each world, at most ``claim``
    with the bounding on (``bounded``), above it with the bounding off (the power check).
    ``least_draws``: the fewest draws a world must have released."""
    threshold, hits, totals = frequencies(sample, keys, pilot_keys)
    assert min(totals) >= least_draws, totals
    bound = epsilon_lower_bound(hits[0], totals[0], hits[1], totals[1])
    print(f"\n{label}: {hits}/{totals} above {threshold:.2f}: bound {bound:.3f}, "
          f"claim {claim:.3f}")
    if bounded:
        assert bound <= claim, (hits, totals, bound, claim)
    else:
        assert bound > claim, (hits, totals, bound, claim)


Run = Callable[[Sequence[Item], NoiseKey, str], list[Record]]
Case = tuple[FlowConfig, tuple[list[Item], list[Item]], Run, float]


def statistical_case(config: FlowConfig, worlds: tuple[list[Item], list[Item]],
                     kept: Sequence[Placed], claim: Callable[[FlowConfig, int], float],
                     run_kind: Callable[..., list[Record]]) -> Case:
    """A kind's statistical tests' configuration, worlds, runner (``run_kind`` in batches of
    256) and claim, for the periods the target's ``kept`` events are in."""
    def run(items: Sequence[Item], noise: NoiseKey, instance: str) -> list[Record]:
        return run_kind(config, items, noise, instance=instance, batch=256)

    return config, worlds, run, claim(config, periods_active(kept,
                                                             config.contribution.period_steps))


OFF_GROUPS, OFF_PER_GROUP = 64, 4096
"""Caps far above any person's events here (8 keys, 4 blocks; at most 804 rows, 300 a block,
200 a key): the bounding keeps everything. (Not 65 535 groups: the bounder's columns are as
wide as max_groups, which would only make these tests slow.)"""


def bounding_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn the bounding off in this test only: the rule gets caps far above the person's
    events (:data:`OFF_GROUPS`, :data:`OFF_PER_GROUP`), while the configuration (and so every
    mechanism's noise and every record's claim) keeps the small caps."""
    from dpstream.core.contribution import rules

    original = rules.BoundingRule.from_contribution

    def unbounded(contribution: Any) -> Any:
        rule = original(contribution)
        groups = 1 if rule.grouping == "one" else OFF_GROUPS  # one histogram: one group
        return dataclasses.replace(rule, max_groups=groups, max_per_group=OFF_PER_GROUP)

    monkeypatch.setattr(rules.BoundingRule, "from_contribution", staticmethod(unbounded))


REPLICAS = 10  # copies of both worlds in one run: 30 noise keys give 300 draws a world
KEYS_REPLICATED = range(71_000, 71_000 + 300 // REPLICAS)
PILOT_REPLICATED = range(70_000, 70_002)


def prefixed(items: Sequence[Item], prefix: str) -> list[Item]:
    """A copy of ``items`` on keys and people of their own (``prefix`` + name)."""
    return [dataclasses.replace(i, body={**i.body, "key": prefix + i.body["key"],
                                         PERSON_FIELD: prefix + i.body[PERSON_FIELD]})
            for i in items]


def counters_batch(mode: str, accounting: str, period: str
                   ) -> tuple[FlowConfig, list[Item], list[str], int]:
    """Both worlds, :data:`REPLICAS` times each, in one input: replica ``r`` of the world
    without the target on keys ``a<r>.k*`` and people ``a<r>.*``, of the world with it on
    ``b<r>.*``. Every key's noise is its own draw (the coordinates name the key) and every
    person is bounded alone, so each replica is the scenario run under fresh noise: the
    coupled tests check that a person moves nothing outside their kept keys. Returns the
    configuration, the input, the statistic's key (the target's first kept key) and the
    periods the target is active in."""
    worlds = counters_worlds(mode)
    plain = counters_config(mode, accounting, period)
    kept = counters_kept(plain, worlds[1])
    key = kept[0].group if mode == "declared" else next(
        e.group for e in kept if e.group in ("k0", "k1"))  # an admitted key
    items: list[Item] = []
    keys: list[str] = []
    for r in range(REPLICAS):
        for world, prefix in enumerate((f"a{r}.", f"b{r}.")):
            items += prefixed(worlds[world], prefix)
            keys += [prefix + k for k in COUNTER_KEYS]
    config = plain
    if mode == "declared":
        config = make_config(mode, accounting, admission={"keys": keys},
                             contribution=contribution(period, **COUNTER_CAPS),
                             flow={"shards": 2})
    return config, items, [key], periods_active(kept, config.contribution.period_steps)


def counters_sample(config: FlowConfig, items: list[Item], key: str) -> Sample:
    def sample(noise: NoiseKey, instance: str) -> tuple[list[float | None], list[float | None]]:
        records = run_counters(config, items, noise, instance=instance, batch=1024)
        return tuple([values(records, f"{w}{r}.{key}").get(STEPS - 1)  # type: ignore[return-value]
                      for r in range(REPLICAS)] for w in "ab")
    return sample


@pytest.mark.statistical
@pytest.mark.parametrize("period", list(PERIODS))
@pytest.mark.parametrize(("mode", "accounting"), COUNTER_MODES)
def test_counters_empirical_epsilon_of_a_person_stays_below_the_claim(mode, accounting, period):
    """The value of the target's first kept key at the last step (cumulative: every kept
    event of the key is in it) against a threshold, over 300 draws a world."""
    config, items, (key,), active = counters_batch(mode, accounting, period)
    claim = counters_claim(config, active)
    check_stated(run_counters(config, items, NoiseKey.for_tests(1), batch=1024), config,
                 counters_claim(config, 1))
    check_empirical_epsilon(f"{mode}/{accounting}/{period}", counters_sample(config, items, key),
                            KEYS_REPLICATED, claim, PILOT_REPLICATED,
                            least_draws=150)  # enough draws released the key


@pytest.mark.statistical
@pytest.mark.parametrize("period", list(PERIODS))
def test_counters_power_bounding_off_is_caught(monkeypatch, period):
    """The tree under pure epsilon (a claim 300 draws can reach): with the bounding off, the
    target's 200 events a key move the statistic by ~200 against a noise std of ~32 (the tree
    at Linf = 2): the bound (~3.6, the most 300 draws can show) exceeds the claim (1.6, or 3.2
    for a person active in both periods)."""
    bounding_off(monkeypatch)
    config, items, (key,), active = counters_batch("declared", "pure", period)
    records = run_counters(config, items, NoiseKey.for_tests(3), batch=1024)
    moved = [values(records, f"b{r}.{key}")[STEPS - 1] - values(records, f"a{r}.{key}")[STEPS - 1]
             for r in range(REPLICAS)]
    assert stats.median(moved) > 100, moved  # the patch took: far more than the caps moved it
    check_empirical_epsilon(f"bounding off/{period}", counters_sample(config, items, key),
                            KEYS_REPLICATED, counters_claim(config, active), PILOT_REPLICATED,
                            bounded=False)


# -- PMWG -----------------------------------------------------------------------------------------

PMWG_STEPS = 8  # the size counter's horizon
PMWG_CAPS = {"max_rows": 3}
PMWG_PARTITIONS = {"events": 2, "queries": 1}
QUESTION = {"schema": "dpstream.query/1", "kind": "count",
            "where": [{"attr": "country", "eq": "fr"}]}
COUNTRIES = ["de", "fr", "uk"]


def pmwg_config(period: str) -> FlowConfig:
    from dpstream.platform import parse_config

    return parse_config({
        "flow": {"kind": "pmwg", "name": "n", "origin": "2026-09-21T14:13:20Z", "step": "1s",
                 "shards": 2},
        "privacy": {"accounting": "pure", "budget": 1.0},
        "metrics": {"port": 0},
        "contribution": contribution(period, **PMWG_CAPS),
        "histograms": [{"name": "h", "universe": [{"name": "country", "values": COUNTRIES}],
                        "epsilon": 0.6, "size_epsilon": 0.4, "size_horizon": PMWG_STEPS,
                        "alpha": 0.1, "n": 40, "mode": "practical", "hard_queries": 3}],
    })


def pmwg_worlds(rows_per_step: int = 100, person: str = TARGET
                ) -> tuple[list[Item], list[Item]]:
    """30 people with 1-10 rows each (some above the cap), a row of someone new in every step
    and partition, two questions a step (partition 2); the target: ``rows_per_step`` 'fr' rows
    in every step over both partitions, the first event of the input, the last event, and rows
    on both sides of the period boundary (steps 3|4)."""
    rng = random.Random(1)
    items = []
    for p in range(30):
        for _ in range(rng.randint(1, 10)):
            t = rng.randrange(PMWG_STEPS) + 0.05 + 0.8 * rng.random()
            items.append(Item(rng.randrange(2), {"country": rng.choice(COUNTRIES),
                                                 "ts": ORIGIN + t, PERSON_FIELD: f"p{p}"}, t))
    for step in range(PMWG_STEPS):
        for partition in range(2):
            t = step + 0.5
            items.append(Item(partition, {"country": "de", "ts": ORIGIN + t,
                                          PERSON_FIELD: f"clock-{step}-{partition}"}, t))
        for i in range(2):
            items.append(Item(2, {"id": f"q{step}-{i}", "histogram": "h", "query": QUESTION},
                              step + 0.9, topic="queries"))
    target = [0.0, PMWG_STEPS - 0.001, 3.999, 4.0]
    target += [step + 0.01 + 0.98 * j / rows_per_step for step in range(PMWG_STEPS)
               for j in range(rows_per_step)]
    for j, t in enumerate(target):
        items.append(Item(j % 2, {"country": "fr", "ts": ORIGIN + t, PERSON_FIELD: person}, t))
    return without_person(items, person), items


def pmwg_kept(config: FlowConfig, items: Sequence[Item], person: str = TARGET
              ) -> list[Placed]:
    c = config.contribution
    events = placed_events(kafka_view(items), lambda body: "h")[person]
    return reference_kept(events, "one", 1, c.cap("max_rows"), c.period_steps)


def pmwg_claim(config: FlowConfig, periods: int) -> float:
    """A person adds at most max_rows rows to the histogram a period: the size counter and
    PMWG are charged their configured epsilon for that (their noise scaled by max_rows)."""
    h = config.histograms[0]  # type: ignore[attr-defined]
    return periods * (float(h.size.epsilon) + float(h.pmwg.epsilon))


def run_pmwg(config: FlowConfig, items: Sequence[Item], noise: NoiseKey, **kw: Any
             ) -> list[Record]:
    return run_flow(config, kafka_view(items), noise, partitions=PMWG_PARTITIONS, **kw)


NOISY_ANSWER = ("t", "kind", "value", "reason", "hard_queries", "privacy")


WHO = ["spread", "smallest hash", "largest hash"]


def chosen_person(who: str, config: FlowConfig, noise: NoiseKey, instance: str,
                  worlds: tuple[list[Item], list[Item]]) -> str:
    """The target, or a name whose keyed hash is below (above) every other person's."""
    if who == "spread":
        return TARGET
    people = sorted({i.body[PERSON_FIELD] for i in worlds[0] if PERSON_FIELD in i.body})
    return hash_extreme_person(config, noise, instance, people, who == "largest hash")


@pytest.mark.flow
@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("period", list(PERIODS))
def test_pmwg_one_person_moves_the_size_within_the_cap(period, who):
    """Same questions answered in the same steps and order; the public size moves by at most
    max_rows a period the target was active in so far (the size counter adds the same noisy
    nodes in both worlds); where the hard/easy decisions agree, nothing else differs."""
    config = pmwg_config(period)
    moved_somewhere = False
    for seed in range(4) if who == "spread" else [204]:
        noise = NoiseKey.for_tests(200 + seed)
        person = chosen_person(who, config, noise, f"m{seed}", pmwg_worlds())
        worlds = pmwg_worlds(person=person)
        kept = pmwg_kept(config, worlds[1], person)
        assert len(kept) == PMWG_CAPS["max_rows"] * (1 if period == "lifetime" else 2)
        r0, r1 = (run_pmwg(config, w, noise, instance=f"m{seed}") for w in worlds)
        assert person not in json.dumps(r1)
        a0 = [b for role, b in r0 if role == "answers"]
        a1 = [b for role, b in r1 if role == "answers"]
        assert [(b["id"], b["step"]) for b in a0] == [(b["id"], b["step"]) for b in a1]
        assert [r for r in r0 if r[0] != "answers"] == [r for r in r1 if r[0] != "answers"]
        for x, y in zip(a0, a1, strict=True):
            cap = PMWG_CAPS["max_rows"] * periods_active(kept, config.contribution.period_steps,
                                                         x["step"])
            assert 0 <= y["t"] - x["t"] <= cap, (x["step"], x["t"], y["t"])
            moved_somewhere |= y["t"] != x["t"]
            same = {k: v for k, v in x.items() if k not in NOISY_ANSWER}
            assert same == {k: v for k, v in y.items() if k not in NOISY_ANSWER}
            assert x["privacy"]["unit"] == y["privacy"]["unit"] == "user"
    assert moved_somewhere  # the target's kept rows do count


def pmwg_case(period: str) -> Case:
    config, worlds = pmwg_config(period), pmwg_worlds()
    return statistical_case(config, worlds, pmwg_kept(config, worlds[1]), pmwg_claim, run_pmwg)


def pmwg_statistic(records: list[Record]) -> float | None:
    """The public size t of the last step's first answer."""
    last = [b["t"] for role, b in records if role == "answers" and b["step"] == PMWG_STEPS - 1]
    return float(last[0]) if last else None


@pytest.mark.statistical
@pytest.mark.parametrize("period", list(PERIODS))
def test_pmwg_empirical_epsilon_of_a_person_stays_below_the_claim(period):
    config, worlds, run, claim = pmwg_case(period)
    check_stated([r for r in run(worlds[1], NoiseKey.for_tests(1), "s") if r[0] == "answers"],
                 config, pmwg_claim(config, 1))
    check_empirical_epsilon(f"pmwg/{period}", one_each(run, worlds, pmwg_statistic), KEYS_STAT,
                            claim)


@pytest.mark.statistical
@pytest.mark.parametrize("period", list(PERIODS))
def test_pmwg_power_bounding_off_is_caught(monkeypatch, period):
    """With the bounding off the target's 800 rows move t by ~800 against the size counter's
    noise (scaled for max_rows = 3): the bound exceeds the claim (1 or 2)."""
    bounding_off(monkeypatch)
    config, worlds, run, claim = pmwg_case(period)
    noise = NoiseKey.for_tests(3)
    r0, r1 = (run_pmwg(config, w, noise, batch=256) for w in worlds)
    moved = pmwg_statistic(r1) - pmwg_statistic(r0)  # type: ignore[operator]
    assert moved > 400, moved  # the patch took
    check_empirical_epsilon(f"pmwg bounding off/{period}",
                            one_each(run, worlds, pmwg_statistic), KEYS_POWER, claim,
                            bounded=False)


# -- ERM ------------------------------------------------------------------------------------------

ERM_STEPS = 4
ERM_CAPS = {"max_rows_per_block": 2, "max_blocks": 2}
ERM_PERIODS = {"lifetime": None, "2s": 2}
D = 3


def erm_config(period: str) -> FlowConfig:
    """Algorithms 2 + 4 over one stream, a block a step (b0 = 6), pure epsilon 0.25 a level:
    a block's contribution costs at most 0.5 over every model it trains. The strong
    regularisation (lambda = 30) keeps the minimiser near 0, where the logistic loss is nearly
    linear: k rows then move it k times as far as one row does (a weak one would saturate,
    and no number of rows could show the bounding is off)."""
    from dpstream.platform import parse_config

    return parse_config({
        "flow": {"kind": "erm", "name": "nb", "origin": "2026-09-21T14:13:20Z", "step": "1s",
                 "shards": 2},
        "privacy": {"accounting": "pure", "epsilon": 0.25},
        "metrics": {"port": 0},
        "contribution": contribution(period, **ERM_CAPS),
        "model": {"classes": ["no", "yes"], "dimension": D, "clip_norm": 2.0,
                  "regularization": 30.0, "streams": ["a"],
                  "learner": "output"},  # the objective learner: test_erm_objective_neighbours
        "release": {"algorithm": "continual", "block_size": 6, "base_blocks": 1,
                    "window_blocks": 3, "sampling": False},
    })


def erm_worlds(rows_per_block: int = 300, person: str = TARGET
               ) -> tuple[list[Item], list[Item]]:
    """6 rows a step of 6 other people each step (someone new on each partition every step),
    and the target: ``rows_per_block`` rows with features far above the clip norm in every
    block over both partitions, the first and the last event of the input, rows on both sides
    of each period boundary."""
    rng = random.Random(3)
    items = []
    for step in range(ERM_STEPS):
        for i in range(6):
            x = [rng.gauss(0, 1.2) for _ in range(D)]
            label = "yes" if 1.5 * x[0] - x[1] + 0.5 * x[2] + rng.gauss(0, 0.7) > 0 else "no"
            t = step + 0.05 + 0.9 * rng.random()
            items.append(Item(i % 2, {"features": x, "label": label, "ts": ORIGIN + t,
                                      PERSON_FIELD: f"p{step}-{i}"}, t))
    times = [0.0, ERM_STEPS - 0.001, 1.999, 2.0]
    times += [step + 0.01 + 0.98 * j / rows_per_block for step in range(ERM_STEPS)
              for j in range(rows_per_block)]
    for j, t in enumerate(times):
        items.append(Item(j % 2, {"features": [40.0, 40.0, 40.0], "label": "no",
                                  "ts": ORIGIN + t, PERSON_FIELD: person}, t))
    return without_person(items, person), items


def erm_kept(config: FlowConfig, items: Sequence[Item], person: str = TARGET
             ) -> list[Placed]:
    c = config.contribution
    events = placed_events(kafka_view(items), lambda body: None)[person]
    return reference_kept(events, "step", c.cap("max_blocks"), c.cap("max_rows_per_block"),
                          c.period_steps)


def erm_claim(config: FlowConfig, periods: int) -> float:
    """A person's rows in one block (at most max_rows_per_block, the per-block sensitivity the
    noise is scaled for) cost at most the schedule's per-block budget over every model that
    block trains; a person reaches at most max_blocks blocks a period."""
    per_block = float(config.schedule.budget())  # type: ignore[attr-defined]
    return periods * config.contribution.cap("max_blocks") * per_block


def run_erm(config: FlowConfig, items: Sequence[Item], noise: NoiseKey, **kw: Any
            ) -> list[Record]:
    return run_flow(config, kafka_view(items), noise, partitions=2, **kw)


NOISY_MODEL = ("coef", "intercept", "holdout")


def is_model(record: Record) -> bool:
    """A model record (the models topic also carries ``dpstream.serving/1`` records)."""
    return record[0] == "models" and record[1]["schema"].startswith("dpstream.model/")


def depends_on(body: dict[str, Any], steps: set[int]) -> bool:
    return any(first <= s <= last for first, last in body["depends_on"] for s in steps)


@pytest.mark.flow
@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("period", list(ERM_PERIODS))
def test_erm_one_person_moves_only_the_models_of_their_kept_blocks(period, who):
    """The same models at the same steps with the same fields but the weights; the weights of
    a model whose dependency chain holds none of the target's kept blocks byte-identical."""
    config = erm_config(period)
    for seed in range(3) if who == "spread" else [303]:
        noise = NoiseKey.for_tests(300 + seed)
        person = chosen_person(who, config, noise, f"e{seed}", erm_worlds())
        worlds = erm_worlds(person=person)
        kept = erm_kept(config, worlds[1], person)
        blocks = {e.step for e in kept}
        assert len(kept) == 2 * len(blocks) and blocks == (
            {0, 1} if period == "lifetime" else {0, 1, 2, 3})
        r0, r1 = (run_erm(config, w, noise, instance=f"e{seed}") for w in worlds)
        assert person not in json.dumps(r1)
        # everything but the models, the serving records (public metadata) included, is equal
        assert [r for r in r0 if not is_model(r)] == [r for r in r1 if not is_model(r)]
        m0 = [b for role, b in r0 if is_model((role, b))]
        m1 = [b for role, b in r1 if is_model((role, b))]
        assert len(m0) == len(m1) > 0
        moved = 0
        for x, y in zip(m0, m1, strict=True):
            assert {k: v for k, v in x.items() if k not in NOISY_MODEL} == \
                {k: v for k, v in y.items() if k not in NOISY_MODEL}
            assert x["privacy"]["unit"] == "user"
            if not depends_on(x, blocks):
                assert x == y
            moved += x != y
        assert moved > 0  # the target's kept rows do train


def erm_case(period: str) -> Case:
    config, worlds = erm_config(period), erm_worlds()
    return statistical_case(config, worlds, erm_kept(config, worlds[1]), erm_claim, run_erm)


def erm_statistic(config: FlowConfig, worlds: tuple[list, list]) -> Statistic:
    """A linear likelihood-ratio direction over the released weights: the coupled difference
    of the two worlds' weights (the noise cancels) over each model's noise std, fixed on a
    pilot key apart from the tested ones."""
    noise = NoiseKey.for_tests(PILOT[0])
    r0, r1 = (run_erm(config, w, noise, instance="d") for w in worlds)

    def weights(body: dict[str, Any]) -> list[float]:
        return [v for row in body["coef"] for v in row] + list(body["intercept"])

    def key(body: dict[str, Any]) -> tuple:
        return (body["step"], body["role"], body["level"])

    direction = {}
    for x, y in zip((b for r, b in r0 if is_model((r, b))),
                    (b for r, b in r1 if is_model((r, b))), strict=True):
        diff = [b - a for a, b in zip(weights(x), weights(y), strict=True)]
        if any(diff):
            direction[key(x)] = [d / x["noise"]["std"] for d in diff]
    assert len(direction) >= 2, "the target should move several models"

    def value(records: list[Record]) -> float | None:
        found = {key(b): b for role, b in records if is_model((role, b))}
        return sum(sum(w * v for w, v in zip(direction[k], weights(found[k]), strict=True))
                   for k in direction)

    return value


@pytest.mark.statistical
@pytest.mark.parametrize("period", list(ERM_PERIODS))
def test_erm_empirical_epsilon_of_a_person_stays_below_the_claim(period):
    config, worlds, run, claim = erm_case(period)
    per_period = erm_claim(config, 1)
    assert float(config.person_cost().total) == pytest.approx(per_period)  # type: ignore[attr-defined]
    check_stated(run(worlds[1], NoiseKey.for_tests(1), "s"), config, per_period)
    check_empirical_epsilon(f"erm/{period}",
                            one_each(run, worlds, erm_statistic(config, worlds)), KEYS_STAT,
                            claim)


@pytest.mark.statistical
@pytest.mark.parametrize("period", list(ERM_PERIODS))
def test_erm_power_bounding_off_is_caught(monkeypatch, period):
    """With the bounding off the target's 300 extreme rows a block (150 times the cap) move
    the weights 150 times as far as the kept 2 rows do (measured: the coupled shift over the
    noise std sums to ~27 over the released coordinates against ~0.09 bounded): the bound
    exceeds the claim (1, or 2 for a person active in both periods)."""
    bounding_off(monkeypatch)
    config, worlds, run, claim = erm_case(period)
    check_empirical_epsilon(f"erm bounding off/{period}",
                            one_each(run, worlds, erm_statistic(config, worlds)), KEYS_STAT,
                            claim, bounded=False)


# -- metrics --------------------------------------------------------------------------------------


@pytest.mark.flow
@pytest.mark.parametrize("period", list(PERIODS))
def test_the_dropped_events_are_exact_operator_data_and_match_the_rule(period):
    """Without ``metrics.exact_counts`` no series counts kept or dropped events; with it, the
    counts are those of the bounding rule applied to every person (the oracle), and no label
    names a person."""
    from prometheus_client import CollectorRegistry

    from dpstream.metrics import FlowMetrics

    config = counters_config("declared", "pure", period)
    _, items = counters_worlds("declared")
    c = config.contribution
    everyone = placed_events(kafka_view(items), lambda body: body["key"])
    kept = sum(len(reference_kept(events, "key", c.cap("max_keys"), c.cap("max_per_key"),
                                  c.period_steps)) for events in everyone.values())
    total = sum(map(len, everyone.values()))
    for exact in (False, True):
        metrics = FlowMetrics("nb", CollectorRegistry(), exact_counts=exact)
        run_counters(config, items, NoiseKey.for_tests(2), metrics=metrics)
        samples = [s for family in metrics.registry.collect() for s in family.samples]
        assert not any(TARGET in repr(s.labels) for s in samples)
        bounding = {s.labels["outcome"]: s.value for s in samples
                    if s.name == "dpstream_bounding_events_total"}
        assert bounding == ({"kept": kept, "dropped": total - kept} if exact else {})
