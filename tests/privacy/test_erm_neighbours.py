"""Neighbouring streams through the ERM flow: one event more or less in one block.

The flow's stream layer (:class:`ErmClock` and :class:`ErmShard`, exactly what the dataflow
runs, encoded by :class:`ModelEncoder`; a last test checks the real dataflow publishes the
same records) is driven with two input streams that differ in ONE event (added or removed),
placed adversarially: in the first block (it feeds every cumulative model), in a block of an
Algorithm 2/4 base, at the edge of a sliding window, in the last block, with features far
above ``clip_norm`` and each label, with an event time far from its broker time. What must
hold:

* **coupled runs** (same noise key): the same models are released at the same steps with the
  same roles, levels, windows, ``depends_on``, costs, noise and privacy fields; only the
  weights may differ, and only those of models whose dependency chain holds the event's
  block. Block boundaries are public: many events added early move no later window (the
  paper's count-based "dynamic time steps" would). Where an event sits inside its step
  (partition, offset, batching, interleaving) changes no byte of the output;
* **the weights move by at most what was charged**: with the same noise key the noise
  cancels, so the integer (grid) difference of a model's released parameters between the
  neighbours is the difference of the rounded minimisers, and must lie within the L1 (pure)
  or L2 (zCDP) grid sensitivity the core charged for that computation
  (``PrivateModel.sensitivity`` on ``PrivateModel.grid``), plus, for a model regularised
  toward a centre that itself moved, that centre's movement (the minimiser is 1-Lipschitz in
  its centre: post-processing of an earlier release, which paid for itself);
* **over many noise keys**, the frequency of an output event of the whole flow (a linear
  statistic of the three released models an early event moves, above a threshold fixed on
  separate keys) gives a Clopper-Pearson lower bound on the privacy loss that stays below the
  per-event budget the records claim; a power check runs the same statistic against the core
  with its noise scaled down 100-fold (the records still claim the same budget) and the bound
  exceeds the claim. Likewise the grid check above is run against a core that solves with the
  private count as normaliser, and must catch it (blocks hold fewer events than the nominal
  ``b0``, which is what exposes that bug);
* **serving records** (``dpstream.serving/1``, one per stream and step, naming the model to
  serve): byte-identical between coupled neighbours, since the rule reads only the released
  models' public metadata (:mod:`dpstream.core.erm.serving`);
* **metrics and dead letters**: the model metrics of neighbours are identical but for the
  holdout accuracy, which is a function of the published models; no series counts events;
  a bad record's dead-letter reason echoes no value of the record, and a bad record changes no
  model.
"""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from bytewax.testing import TestingSink, TestingSource, run_main
from harness import epsilon_lower_bound
from prometheus_client import CollectorRegistry
from support.stage import batch_order

from dpstream.core.erm import output_noise as core_erm
from dpstream.core.erm.schedules.schedule import ReleaseSchedule
from dpstream.core.noise.keys import NoiseKey
from dpstream.kinds.erm.events import ErmClock
from dpstream.kinds.erm.metrics import register_metrics as erm_series
from dpstream.kinds.erm.records import ModelEncoder
from dpstream.kinds.erm.shard import ErmShard, ModelRecord, ServingRecord
from dpstream.messages import TIMESTAMP_LOG_APPEND_TIME
from dpstream.metrics import FlowMetrics
from dpstream.platform import build_flow, parse_config

pytestmark = [pytest.mark.privacy]

ORIGIN = 1_790_000_000  # 2026-09-21T14:13:20Z
ORIGIN_ISO = "2026-09-21T14:13:20Z"
D = 3
STEPS = 10
RATE = 12  # events per step over both streams
TRUE_W = np.array([1.5, -1.0, 0.5])
NOISY_FIELDS = ("coef", "intercept", "holdout")
EXTREME = [1.0e6, -4.0e5, 2.5e5]  # norm ~1.1e6, clip_norm 2


# -- configuration and input -------------------------------------------------------------------


def config(algorithm: str = "continual", *, accounting: str = "pure", epsilon: float = 1.0,
           classes: tuple = ("no", "yes"), streams: tuple[str, ...] = ("a", "b"),
           sampling: bool = False, block_size: int = 16, base_blocks: int = 2,
           window_blocks: int = 3, regularization: float = 0.5, holdout: str | None = None,
           clip_norm: float = 2.0, name: str = "nb", max_history: int | None = None,
           learner: str | None = "output", contribution: dict | None = None,
           release: dict | None = None):
    """The flow of these tests; ``learner`` "output" by default (the grid coupling below is
    its property; None: the configuration's default), ``release`` extra [release] settings."""
    model: dict[str, Any] = {"classes": list(classes), "dimension": D, "clip_norm": clip_norm,
                             "regularization": regularization, "streams": list(streams)}
    if learner is not None:
        model["learner"] = learner
    if len(streams) > 1:
        model["stream_field"] = "s"
    raw: dict[str, Any] = {
        "flow": {"kind": "erm", "name": name, "origin": ORIGIN_ISO, "step": "1s",
                 "shards": 2},
        "privacy": ({"accounting": "pure", "epsilon": epsilon} if accounting == "pure"
                    else {"accounting": "zcdp", "rho": epsilon}),
        "metrics": {"port": 0},
        "model": model,
        "release": {"algorithm": algorithm, "block_size": block_size,
                    "base_blocks": base_blocks, "window_blocks": window_blocks,
                    "sampling": sampling, **(release or {})},
    }
    if max_history is not None:
        raw["release"]["max_history"] = max_history
    if contribution is not None:
        raw["contribution"] = contribution
    if holdout is not None:
        raw["holdout"] = {"path": holdout}
    return parse_config(raw)


@dataclass(frozen=True)
class Event:
    """One input record before Kafka numbers it: partition, value, broker seconds."""

    partition: int
    body: dict[str, Any] | bytes
    broker: float  # seconds after ORIGIN


def label_of(x: list[float], classes: tuple, rng: random.Random) -> Any:
    if len(classes) == 2:
        score = float(np.dot(TRUE_W, x)) + 0.2 + rng.gauss(0, 0.7)
        return classes[int(score > 0)]
    scores = [x[0], x[1], -x[0] - x[1]]
    return classes[int(np.argmax(np.asarray(scores) + np.asarray(
        [rng.gauss(0, 0.5) for _ in range(3)])))]


def base_events(seed: int = 0, *, steps: int = STEPS, rate: int = RATE,
                classes: tuple = ("no", "yes"), streams: tuple[str, ...] = ("a", "b")
                ) -> list[Event]:
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        for _ in range(rate):
            x = [rng.gauss(0, 1.2) for _ in range(D)]
            t = step + 0.05 + 0.9 * rng.random()
            body = {"features": x, "label": label_of(x, classes, rng), "ts": ORIGIN + t}
            if len(streams) > 1:
                body["s"] = rng.choice(streams)
            out.append(Event(rng.randrange(2), body, t))
    return out


def extreme(step: int, label: Any, *, partition: int = 1, where: float = 0.5,
            stream: str | None = "a", features: list[float] | None = None,
            event_time: float | None = None) -> Event:
    """An event of ``stream`` in ``step`` with features far above the clip norm."""
    broker = step + where
    body: dict[str, Any] = {"features": list(features or EXTREME), "label": label,
                            "ts": ORIGIN + (broker if event_time is None else event_time)}
    if stream is not None:
        body["s"] = stream
    return Event(partition, body, broker)


def messages(events: list[Event]) -> list[tuple]:
    """Kafka's view: per partition in broker-time order, offsets from 0."""
    ordered = sorted(events, key=lambda e: (e.broker, e.partition))
    offsets: dict[int, int] = defaultdict(int)
    out = []
    for e in ordered:
        value = e.body if isinstance(e.body, bytes) else json.dumps(e.body).encode()
        out.append((e.partition, value, offsets[e.partition], "events",
                    round((ORIGIN + e.broker) * 1000), TIMESTAMP_LOG_APPEND_TIME))
        offsets[e.partition] += 1
    return out


def without(events: list[Event], step: int, stream: str = "a") -> list[Event]:
    """The stream minus the first event of ``stream`` in ``step`` (a removal neighbour)."""
    for i, e in enumerate(events):
        if (int(e.broker) == step and isinstance(e.body, dict)
                and e.body.get("s", stream) == stream):
            return events[:i] + events[i + 1:]
    raise AssertionError(f"no event of {stream!r} in step {step}")


# -- the driven stream layer -------------------------------------------------------------------


@dataclass
class Run:
    """What one run of the stream layer published, and every model it trained."""

    records: list[Any]  # ModelRecord, in publication order
    values: list[bytes]  # the encoded models topic values, in publication order
    dead: list[Any]
    trained: dict[str, dict[tuple, Any]] = field(default_factory=dict)  # stream -> chain -> model
    serving: list[bytes] = field(default_factory=list)  # the serving records, in order

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(v) for v in self.values]


class _Recorder:
    """Every model a schedule trains (released or a centre only), by schedule and identity."""

    def __init__(self) -> None:
        self.by_schedule: dict[int, dict[tuple, Any]] = defaultdict(dict)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        original = ReleaseSchedule.add_block
        recorder = self

        def add_block(schedule: ReleaseSchedule, step: int, block: Any) -> Any:
            out = original(schedule, step, block)
            seen = recorder.by_schedule[id(schedule)]
            for chain, model in schedule.models.items():
                if chain in seen:  # a model is trained once: a reused centre is the same one
                    assert np.array_equal(seen[chain].params, model.params)
                seen[chain] = model
            for r in out:
                seen[tuple(r.depends_on)] = r.model
            return out

        monkeypatch.setattr(ReleaseSchedule, "add_block", add_block)


def drive(cfg, events: list[Event] | list[tuple], noise: NoiseKey, *, instance: str = "nb-1",
          batch: int = 16, partitions: int = 2, interleave_seed: int | None = None,
          metrics: FlowMetrics | None = None, recorder: _Recorder | None = None) -> Run:
    """Run the flow's clocks and shards as the dataflow does; return what is published."""
    items = messages(events) if events and isinstance(events[0], Event) else list(events)
    if recorder is not None:
        recorder.by_schedule.clear()  # schedules of an earlier run are gone: ids are reused
    queues, order = batch_order(items, batch, interleave_seed)
    clocks = {p: ErmClock(cfg) for p in range(partitions)}
    shards: dict[int, ErmShard] = {}
    out: list[Any] = []
    dead: list[Any] = []

    def deliver(updates):
        for u in updates:
            shard = shards.get(u.shard)
            if shard is None:
                shard = shards[u.shard] = ErmShard(cfg, noise, instance, partitions)
            published = shard.update(u)
            if metrics is not None:
                erm_series(metrics).observe_models(published)
            out.extend(published)

    cursor = dict.fromkeys(queues, 0)
    for p in order:
        updates, letters = clocks[p].process(p, queues[p][cursor[p]])
        cursor[p] += 1
        dead.extend(letters)
        deliver(updates)
    for clock in clocks.values():
        if clock.watermark is not None:
            deliver(clock.end_of_input())
    for shard in shards.values():
        published = shard.end_of_input()
        if metrics is not None:
            erm_series(metrics).observe_models(published)
        out.extend(published)
    encoder = ModelEncoder(cfg, instance)
    models = [m for m in out if isinstance(m, ModelRecord)]
    run = Run(models, [encoder.encode(m)[2] for m in models], dead,
              serving=[encoder.encode(m)[2] for m in out if isinstance(m, ServingRecord)])
    if recorder is not None:
        for shard in shards.values():
            members = shard.members if hasattr(shard, "members") else shard.streams
            for name, s in members.items():
                run.trained[name] = dict(recorder.by_schedule.get(id(s.schedule), {}))
    return run


# -- what is compared ----------------------------------------------------------------------------


def structure(run: Run) -> dict[str, list[str]]:
    """Per model stream, in publication order: every published field but the weights."""
    per_stream: dict[str, list[str]] = defaultdict(list)
    for body in run.bodies():
        kept = {k: v for k, v in body.items() if k not in NOISY_FIELDS}
        per_stream[body["stream"]].append(json.dumps(kept, sort_keys=True))
    return dict(per_stream)


def depends_on_step(body: dict[str, Any], step: int) -> bool:
    return any(first <= step <= last for first, last in body["depends_on"])


def grid_integers(model: Any) -> np.ndarray:
    """The released integers on the model's grid (exact), checked against its params."""
    ints = np.asarray(model.integers, dtype=np.int64)
    assert np.array_equal(np.asarray(model.params).ravel(), ints * float(model.grid)) or \
        np.allclose(np.asarray(model.params).ravel() / float(model.grid), ints, rtol=0,
                    atol=1e-6)
    return ints


def claimed_grid_sensitivity(spec: Any, model: Any, moved_centre: float = 0.0) -> float:
    """The grid sensitivity the core charges for a computation (``ErmSpec.grid_l1_sensitivity``
    under pure ε, ``grid_l2_sensitivity`` under zCDP), widened by ``moved_centre`` (real units)
    when the model's centre itself moved between the neighbours: the minimiser is 1-Lipschitz
    in its centre, so the real distance is at most ``sensitivity + moved_centre`` before the
    rounding, which adds at most one unit per coordinate.
    """
    if not moved_centre:
        return float(spec.grid_l1_sensitivity if spec.accounting == "pure"
                     else spec.grid_l2_sensitivity)
    p = spec.parameter_count
    units = (float(model.sensitivity) + moved_centre) / float(model.grid) * (1 + 1e-12)
    if spec.accounting == "pure":
        return math.floor(math.sqrt(p) * units) + p
    return units + math.isqrt(p - 1) + 1


def grid_distance(diff: np.ndarray, accounting: str) -> float:
    return float(np.abs(diff).sum()) if accounting == "pure" else float(
        np.sqrt(np.square(diff.astype(np.float64)).sum()))


def assert_same_structure(a: Run, b: Run) -> None:
    """Same models, same steps and order per stream, every field equal but the weights."""
    assert structure(a) == structure(b)


def assert_untouched_models_identical(a: Run, b: Run, step: int, stream: str = "a") -> int:
    """Models that cannot see the event's block are byte-identical; returns how many can."""
    touched = 0
    for (xa, va), (_xb, vb) in _pairs(a, b):
        if xa["stream"] != stream or not depends_on_step(xa, step):
            assert va == vb, ("a model that does not depend on the event's block moved",
                              xa["stream"], xa["step"], xa["role"], xa["depends_on"])
        else:
            touched += 1
    return touched


def _pairs(a: Run, b: Run) -> list[tuple[tuple[dict, bytes], tuple[dict, bytes]]]:
    def key(body: dict) -> tuple:
        return (body["stream"], body["step"], body["role"], str(body["level"]),
                json.dumps(body["depends_on"]))

    left = sorted(((json.loads(v), v) for v in a.values), key=lambda x: key(x[0]))
    right = sorted(((json.loads(v), v) for v in b.values), key=lambda x: key(x[0]))
    assert [key(x) for x, _ in left] == [key(y) for y, _ in right]
    return list(zip(left, right, strict=True))


def assert_serving_names_released_models(cfg, run: Run) -> None:
    """One serving record per stream and step, each naming a model the run released."""
    released = {(x["stream"], x["role"], x["level"], x["step"]) for x in run.bodies()}
    seen: dict[str, list[int]] = defaultdict(list)
    for value in run.serving:
        body = json.loads(value)
        seen[body["stream"]].append(body["step"])
        named = body["model"]
        if named is not None:
            assert (body["stream"], named["role"], named["level"], named["step"]) in released
            assert named["step"] <= body["step"]
    steps = sorted(seen[cfg.streams[0]])
    assert steps == list(range(len(steps))) and len(steps) >= STEPS - 1, steps
    assert all(sorted(v) == steps for v in seen.values()) and set(seen) == set(cfg.streams)


def models_that_see_the_event(a: Run, b: Run, step: int, stream: str = "a"):
    """Yield ``(name, chain, a's models, b's models, grid difference)`` of every trained
    computation whose data hold ``step`` of ``stream``, after checking that both neighbours
    trained the same computations with the same public constants and that every other
    computation's model is identical."""
    assert set(a.trained) == set(b.trained)
    for name in a.trained:
        ta, tb = a.trained[name], b.trained[name]
        assert set(ta) == set(tb), "the neighbours trained different computations"
        for chain in sorted(ta, key=lambda c: (c[0][1], len(c))):
            ma, mb = ta[chain], tb[chain]
            assert ma.grid == mb.grid and ma.sensitivity == mb.sensitivity
            assert ma.cost == mb.cost and ma.noise_std == mb.noise_std
            diff = grid_integers(ma) - grid_integers(mb)
            if name != stream or not any(f <= step <= last for f, last in chain):
                assert not diff.any(), ("a model that cannot see the event moved", name, chain)
                continue
            yield name, chain, ta, tb, diff


def assert_weights_within_charged_sensitivity(cfg, a: Run, b: Run, step: int,
                                              stream: str = "a") -> int:
    """Every trained model's grid difference is within what its computation was charged.

    Returns how many models moved (the check is not vacuous).
    """
    spec = cfg.model
    accounting = cfg.accounting
    moved = 0
    for name, chain, ta, tb, diff in models_that_see_the_event(a, b, step, stream):
        ma = ta[chain]
        centre = tuple(chain[1:])
        if centre and any(f <= step <= last for f, last in centre):
            ca, cb = ta[centre], tb[centre]
            moved_centre = float(ca.grid) * float(np.sqrt(np.square(
                (grid_integers(ca) - grid_integers(cb)).astype(np.float64)).sum()))
            bound = claimed_grid_sensitivity(spec, ma, moved_centre)
        else:  # the computation's own claim: the event is in its data, its centre is fixed
            bound = claimed_grid_sensitivity(spec, ma)
        distance = grid_distance(diff, accounting)
        assert distance <= bound, (name, chain, diff.tolist(), distance, bound)
        moved += bool(diff.any())
    return moved


# -- coupled runs --------------------------------------------------------------------------------

ALGORITHMS = ["continual", "multi-resolution", "sliding-window", "independent"]
# (name, how the neighbour differs): added events of each label in the first block, in a block
# of an Algorithm 2/4 base (steps 2-3 are the level-0 base at step 3 and part of the level-1
# base [0, 3]; with B = 2), at a window edge (step 4: windows of 3 blocks drop it at step 7),
# in the last block, first or last in its step, with an event time far from its broker time;
# and removed events.
SCENARIOS = [
    ("first block, label 0, first in step", 0, lambda ev, c: ev + [extreme(0, c[0], where=0.01)]),
    ("first block, label 1, last in step", 0, lambda ev, c: ev + [extreme(0, c[1], where=0.99)]),
    ("base block, label 1, partition 0", 2, lambda ev, c: ev + [extreme(2, c[1], partition=0)]),
    ("window edge, label 0", 4, lambda ev, c: ev + [extreme(4, c[0], where=0.97)]),
    ("last block, label 1", STEPS - 1, lambda ev, c: ev + [extreme(STEPS - 1, c[1])]),
    ("future event time", 5, lambda ev, c: ev + [extreme(5, c[0], event_time=1.0e7)]),
    ("removed from the first block", 0, lambda ev, c: without(ev, 0)),
    ("removed from a base block", 3, lambda ev, c: without(ev, 3)),
]


@pytest.fixture
def recorder(monkeypatch):
    r = _Recorder()
    r.install(monkeypatch)
    return r


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_coupled_neighbours_differ_only_in_the_weights_and_within_the_charge(algorithm,
                                                                            recorder):
    cfg = config(algorithm)
    classes = tuple(cfg.model.classes)
    base = base_events()
    noise = NoiseKey.for_tests(21)
    a = drive(cfg, base, noise, recorder=recorder)
    assert a.records, "nothing was released"
    moved_any = served_moved = 0
    for name, step, neighbour in SCENARIOS:
        b = drive(cfg, neighbour(base, classes), noise, recorder=recorder)
        assert not a.dead and not b.dead, name
        assert_same_structure(a, b)
        assert a.serving == b.serving, name  # the choice reads public metadata only
        assert_serving_names_released_models(cfg, b)
        named = {(x["stream"], x["model"]["role"], x["model"]["level"], x["model"]["step"])
                 for x in map(json.loads, b.serving) if x["model"] is not None}
        served_moved += sum(va != vb for (xa, va), (_xb, vb) in _pairs(a, b)
                            if (xa["stream"], xa["role"], xa["level"], xa["step"]) in named)
        touched = assert_untouched_models_identical(a, b, step)
        moved_any += assert_weights_within_charged_sensitivity(cfg, a, b, step)
        if algorithm == "sliding-window":
            w = cfg.schedule.window_blocks
            for body in a.bodies():  # every window model sits inside its window
                assert all(body["step"] - w + 1 <= f <= last <= body["step"]
                           for f, last in body["depends_on"]), body["depends_on"]
            touching = sorted({x["step"] for (x, _), _ in _pairs(a, b)
                               if x["stream"] == "a" and depends_on_step(x, step)})
            # the window edge: the models of steps step..step+w-1 see it, no later one does
            assert touching == [s for s in range(max(step, w - 1), min(step + w, STEPS))], \
                (name, touching)
        elif algorithm in ("continual", "multi-resolution") and step == 0:
            assert touched >= 3, name  # the first block feeds every cumulative model
    assert moved_any, "the extreme events moved no model: the check would be vacuous"
    # not vacuous either: served models' weights do differ, the serving records do not
    assert served_moved, "no served model moved: identical serving records would prove nothing"


def test_a_bounded_history_forgets_the_blocks_before_its_last_h(recorder):
    """``release.max_history = 3``: an event of block 0 stays within every charge, and moves
    no model whose chain read only later blocks; without the bound the same models move.

    The base of ``t = 8`` blocks (step 7, nominal range 0..7) reads blocks 5..7 under the
    bound, and the updates of steps 8 and 9 are centred on it: none of them can see block 0.
    """
    bounded, unbounded = config("continual", max_history=3), config("continual")
    classes = tuple(bounded.model.classes)
    base = base_events()
    noise = NoiseKey.for_tests(21)
    forgotten = {("a", 7, "base", 2), ("a", 8, "update", 0), ("a", 9, "update", 1)}
    for name, step, neighbour in SCENARIOS[:2]:  # the extreme events of the first block
        moved = {}
        for cfg in (bounded, unbounded):
            a = drive(cfg, base, noise, recorder=recorder)
            b = drive(cfg, neighbour(base, classes), noise, recorder=recorder)
            assert not a.dead and not b.dead, name
            assert_same_structure(a, b)
            assert_weights_within_charged_sensitivity(cfg, a, b, step)
            moved[cfg is bounded] = {(x["stream"], x["step"], x["role"], x["level"])
                                     for (x, va), (_y, vb) in _pairs(a, b) if va != vb}
        assert forgotten <= moved[False], (name, sorted(moved[False]))  # the power check
        assert not forgotten & moved[True], (name, sorted(forgotten & moved[True]))
        assert moved[True] <= moved[False], name


def test_the_grid_check_catches_a_solver_normalised_by_the_private_count(monkeypatch,
                                                                       recorder):
    """Power of the check above: a core that solves with the private count as normaliser
    (and still charges the public one) moves models by more than it charged. Blocks hold
    about 6 events of a stream against a nominal ``b0 = 16``, which is what exposes it."""
    original = core_erm.solve

    def solve(spec, block, normalizer, center, **options):
        return original(spec, block, float(max(block.size, 1)), center, **options)

    monkeypatch.setattr(core_erm, "solve", solve)
    cfg = config("continual")
    base = base_events()
    noise = NoiseKey.for_tests(21)
    a = drive(cfg, base, noise, recorder=recorder)
    caught = 0
    for _name, step, neighbour in SCENARIOS:
        b = drive(cfg, neighbour(base, tuple(cfg.model.classes)), noise, recorder=recorder)
        try:
            assert_weights_within_charged_sensitivity(cfg, a, b, step)
        except AssertionError:
            caught += 1
    print(f"caught {caught} of {len(SCENARIOS)}")
    assert caught >= 2, caught


@pytest.mark.parametrize("classes, accounting, algorithm", [
    ((0, 1, 2), "zcdp", "continual"),
    ((0, 1, 2), "pure", "sliding-window"),
    (("no", "yes"), "zcdp", "sliding-window"),
])
def test_multinomial_and_zcdp_neighbours_every_label(classes, accounting, algorithm, recorder):
    cfg = config(algorithm, accounting=accounting, classes=classes, epsilon=0.5)
    base = base_events(classes=classes)
    noise = NoiseKey.for_tests(22)
    a = drive(cfg, base, noise, recorder=recorder)
    assert a.records
    moved = 0
    for label in classes:
        for step in (0, 4):
            b = drive(cfg, base + [extreme(step, label)], noise, recorder=recorder)
            assert_same_structure(a, b)
            assert a.serving == b.serving
            assert_untouched_models_identical(a, b, step)
            moved += assert_weights_within_charged_sensitivity(cfg, a, b, step)
    assert moved


@pytest.mark.parametrize("algorithm", ["continual", "multi-resolution", "sliding-window"])
def test_sampled_schedules_release_the_same_structure(algorithm):
    """With Poisson sampling (Algorithms 6, 8): which rows are sampled changes no structure."""
    cfg = config(algorithm, sampling=True)
    classes = tuple(cfg.model.classes)
    base = base_events()
    noise = NoiseKey.for_tests(23)
    a = drive(cfg, base, noise)
    assert a.records
    for _name, step, neighbour in [SCENARIOS[i] for i in (0, 2, 6)]:
        b = drive(cfg, neighbour(base, classes), noise)
        assert_same_structure(a, b)
        assert_untouched_models_identical(a, b, step)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_block_boundaries_are_public_many_early_events_move_no_window(algorithm):
    """Three nominal blocks' worth of extra events in step 0 move no later block.

    Cutting blocks by counts (the paper's "dynamic time steps") would shift every later
    window; here every window, release step and cost stays, and every model that does not
    depend on step 0 is byte-identical.
    """
    cfg = config(algorithm)
    base = base_events()
    rng = random.Random(5)
    crowd = [extreme(0, rng.choice(["no", "yes"]), partition=rng.randrange(2),
                     where=0.01 + 0.98 * rng.random(),
                     features=[rng.gauss(0, 1) for _ in range(D)])
             for _ in range(3 * cfg.schedule.block_size)]
    noise = NoiseKey.for_tests(24)
    a = drive(cfg, base, noise)
    b = drive(cfg, base + crowd, noise)
    assert_same_structure(a, b)
    touched = assert_untouched_models_identical(a, b, 0)
    later = [x for (x, _), _ in _pairs(a, b) if not depends_on_step(x, 0)]
    if algorithm in ("sliding-window", "independent", "multi-resolution"):
        assert later, "no model was left to show that later blocks did not move"
    del touched


@pytest.mark.parametrize("algorithm", ["continual", "sliding-window"])
def test_where_the_event_sits_inside_its_step_changes_nothing(algorithm):
    """Partition, offset, batching and interleaving are not information the models may use."""
    cfg = config(algorithm)
    base = base_events()
    noise = NoiseKey.for_tests(25)
    reference = drive(cfg, base + [extreme(3, "yes", partition=0, where=0.02)], noise)
    variants = {
        "last of partition 1": drive(cfg, base + [extreme(3, "yes", partition=1, where=0.98)],
                                     noise),
        "middle of partition 0": drive(cfg, base + [extreme(3, "yes", partition=0,
                                                            where=0.5)], noise),
        "batches of 5": drive(cfg, base + [extreme(3, "yes", partition=0, where=0.02)], noise,
                              batch=5),
        "shuffled partitions": drive(cfg, base + [extreme(3, "yes", partition=0, where=0.02)],
                                     noise, batch=3, interleave_seed=7),
    }
    for name, run in variants.items():
        assert sorted(run.values) == sorted(reference.values), name


def test_a_dead_lettered_record_changes_no_model():
    """A bad record (and an event before the origin) is a dead letter and nothing else."""
    cfg = config("continual")
    base = base_events()
    noise = NoiseKey.for_tests(26)
    a = drive(cfg, base, noise)
    bad = [Event(0, {"features": [1e6, 2.0], "label": "yes", "s": "a", "ts": ORIGIN + 2.5},
                 2.5),
           extreme(3, "yes", event_time=-1.0e6)]  # before flow.origin
    b = drive(cfg, base + bad, noise)
    assert len(b.dead) == 2 and not a.dead
    assert a.values == b.values


def test_noise_is_bound_to_the_instance_and_the_model_parameters():
    """Pitfall 13: on an empty block a model is its centre (0) plus noise, so its integers are
    the noise itself. Another flow instance, another flow name or a model that differs only
    in ``clip_norm`` (same grid, same noise scale, other minimisers) must draw other noise —
    else the difference of two releases would be the exact difference of their minimisers;
    a replay draws the same."""
    only_b = [e for e in base_events(steps=2) if e.body["s"] == "b"]

    def noise_of(cfg, instance="nb-1"):
        run = drive(cfg, only_b, NoiseKey.for_tests(41), instance=instance)
        first = next(r for r in run.records if r.stream == "a")
        assert first.model.size == 0
        return first.model.grid, grid_integers(first.model).tolist()

    reference = noise_of(config("independent"))
    assert noise_of(config("independent")) == reference
    variants = {"instance": noise_of(config("independent"), instance="nb-2"),
                "flow name": noise_of(config("independent", name="nb2")),
                "clip_norm": noise_of(config("independent", clip_norm=3.0))}
    for what, (grid, integers) in variants.items():
        assert grid == reference[0], what  # the same scale: only the coordinates differ
        assert integers != reference[1], what


# -- the grid sensitivity the core claims ---------------------------------------------------------


def test_the_grid_sensitivity_used_above_is_what_the_core_charges():
    """``D1``/``D2`` on ``g`` are the sensitivity ``Δ + 2τ`` in grid units, rounding included,
    and the noise of a computation is calibrated to them: ``D1 / t = cost``."""
    from dpstream.core.noise.samplers import discrete_laplace_variance

    for accounting in ("pure", "zcdp"):
        cfg = config("independent", accounting=accounting)
        spec = cfg.model
        p = spec.parameter_count
        run = drive(cfg, base_events(steps=1), NoiseKey.for_tests(27))
        model = run.records[0].model
        delta = spec.sensitivity(float(cfg.schedule.block_size))
        assert delta == Fraction(1) / (Fraction(0.5) * cfg.schedule.block_size)  # L/(λ b0)
        assert delta < model.sensitivity <= delta * (1 + Fraction(2, 2**20))  # Δ + 2τ
        assert model.grid == spec.grid(delta)
        units = model.sensitivity / model.grid
        if accounting == "pure":
            assert spec.grid_l1_sensitivity == math.isqrt(math.floor(p * units * units)) + p
            assert model.cost == Fraction(cfg.schedule.epsilon)
            scale = spec.grid_l1_sensitivity / model.cost
            assert model.noise_std == pytest.approx(
                math.sqrt(discrete_laplace_variance(scale)) * float(model.grid), rel=1e-12)
        else:
            assert spec.grid_l2_sensitivity >= units + math.sqrt(p)


# -- over many noise keys -------------------------------------------------------------------------

STAT_CONFIG = {"algorithm": "continual", "base_blocks": 1, "streams": ("a",),
               "regularization": 1.0, "block_size": 6}
STAT_STEPS = 3  # releases: base [0,0] @0; level-0 [1,1] and base [0,1] @1; [2,2] and an
#                 update of [2,2] centred on the base [0,1] @2. Block 0 feeds three of them.


def stat_worlds() -> tuple[list[Event], list[Event]]:
    base = base_events(seed=3, steps=STAT_STEPS, rate=6, streams=("a",))
    return base, base + [extreme(0, "no", stream=None, features=[40.0, 40.0, 40.0])]


def model_key(record: Any) -> tuple:
    return (record.step, record.role, record.level)


@dataclass(frozen=True)
class Statistic:
    """An output event of the whole flow: ``sum_m w_m . X_m >= threshold`` over the released
    integer vectors ``X_m`` of the models the event moves, ``w_m`` their coupled difference
    over their noise scale (a linear likelihood-ratio direction)."""

    weights: dict[tuple, np.ndarray]
    threshold: float

    def value(self, run: Run) -> float:
        found = {model_key(r): r for r in run.records}
        return float(sum(w @ grid_integers(found[k].model) for k, w in self.weights.items()))

    def __call__(self, run: Run) -> bool:
        return self.value(run) >= self.threshold


def pick_statistic(cfg, worlds, pilot_keys: range) -> Statistic:
    """Fixed on keys apart from the test's: the direction from one coupled run (the noise
    cancels, leaving the rounded minimisers' difference), the threshold halfway between the
    two worlds' medians (the noise is symmetric about the rounded minimiser)."""
    coupled = [drive(cfg, w, NoiseKey.for_tests(pilot_keys[0])) for w in worlds]
    weights = {}
    for ra, rb in zip(coupled[0].records, coupled[1].records, strict=True):
        diff = grid_integers(ra.model) - grid_integers(rb.model)
        if diff.any():
            scale = float(cfg.model.grid_l1_sensitivity / ra.model.cost)  # discrete Laplace t
            weights[model_key(ra)] = diff / scale
    assert len(weights) >= 2, "the event should move several models"
    direction = Statistic(weights, 0.0)
    medians = [float(np.median([direction.value(drive(cfg, items, NoiseKey.for_tests(s),
                                                      instance=f"p{s}"))
                                for s in pilot_keys]))
               for items in worlds]
    return Statistic(weights, sum(medians) / 2)


def frequencies(cfg, worlds, statistic: Statistic, keys: range) -> tuple[int, int]:
    """How often the output event happens in each world, over ``keys``."""
    hits = [0, 0]
    for s in keys:
        for world, items in enumerate(worlds):
            hits[world] += statistic(drive(cfg, items, NoiseKey.for_tests(s), instance=f"k{s}"))
    return hits[0], hits[1]


def claims(cfg, items) -> tuple[float, float]:
    """The records' per-event ``budget`` (the theorems' bound) and the last ``spent`` (the
    largest charge any block has had: the event's loss can be no more than its block's)."""
    bodies = drive(cfg, items, NoiseKey.for_tests(1)).bodies()
    budgets = {b["privacy"]["budget"] for b in bodies}
    assert len(budgets) == 1
    return budgets.pop(), bodies[-1]["privacy"]["spent"]


@pytest.mark.statistical
def test_empirical_epsilon_stays_below_the_claimed_budget():
    cfg = config(**STAT_CONFIG)
    worlds = stat_worlds()
    budget, spent = claims(cfg, worlds[0])
    assert budget == pytest.approx(2.0) and spent <= budget  # Algorithms 2 + 4
    statistic = pick_statistic(cfg, worlds, range(90_000, 90_040))
    keys = range(60_000, 60_600)
    k_a, k_b = frequencies(cfg, worlds, statistic, keys)
    bound = epsilon_lower_bound(k_a, len(keys), k_b, len(keys))
    print(f"\nbudget {budget}, spent {spent}: {k_a}/{len(keys)} vs {k_b}/{len(keys)}, "
          f"lower bound {bound:.3f}")
    assert bound <= spent <= budget, (k_a, k_b, bound)


@pytest.mark.statistical
def test_the_statistic_has_power_against_too_little_noise(monkeypatch):
    """The same statistic with the core's noise scaled down 100-fold, the records' claims
    unchanged: the bound must exceed the claim (else the test above could never fail)."""
    scale_down(monkeypatch, 100)
    cfg = config(**STAT_CONFIG)
    worlds = stat_worlds()
    budget, _spent = claims(cfg, worlds[0])
    statistic = pick_statistic(cfg, worlds, range(91_000, 91_015))
    keys = range(61_000, 61_120)
    k_a, k_b = frequencies(cfg, worlds, statistic, keys)
    bound = epsilon_lower_bound(k_a, len(keys), k_b, len(keys))
    print(f"\nunder-noised, budget {budget}: {k_a}/{len(keys)} vs {k_b}/{len(keys)}, "
          f"lower bound {bound:.3f}")
    assert bound > budget, (k_a, k_b, bound)


def scale_down(monkeypatch: pytest.MonkeyPatch, factor: int) -> None:
    """Make the core add ``factor`` times less noise than its records claim."""
    original_laplace = core_erm.discrete_laplace

    def laplace(rng, scale):
        return original_laplace(rng, Fraction(scale) / factor)

    monkeypatch.setattr(core_erm, "discrete_laplace", laplace)


# -- metrics and dead letters ---------------------------------------------------------------------


def samples(metrics: FlowMetrics) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in metrics.registry.collect() for s in family.samples}


def holdout_file(tmp_path) -> str:
    rng = random.Random(77)
    lines = []
    for _ in range(200):
        x = [rng.gauss(0, 1.2) for _ in range(D)]
        lines.append(json.dumps({"features": x, "label": label_of(x, ("no", "yes"), rng)}))
    path = tmp_path / "holdout.jsonl"
    path.write_text("\n".join(lines))
    return str(path)


@pytest.mark.parametrize("algorithm", ["continual", "sliding-window"])
def test_model_metrics_of_neighbours_are_public_or_functions_of_the_published_models(
        algorithm, tmp_path):
    cfg = config(algorithm, holdout=holdout_file(tmp_path))
    base = base_events()
    noise = NoiseKey.for_tests(31)
    seen = []
    for items in (base, base + [extreme(0, "no")]):
        metrics = FlowMetrics("nb", CollectorRegistry(), exact_counts=False)
        run = drive(cfg, items, noise, metrics=metrics)
        got = samples(metrics)
        assert not [k for k in got if k[0].startswith(("dpstream_events",
                                                       "dpstream_dead_letters"))]
        public = {"nb", *cfg.streams} | {b["role"] for b in run.bodies()}
        model_series = [k for k in got if k[0].startswith("dpstream_model")]
        assert model_series
        for (_name, labels) in model_series:  # flow, stream, role: nothing else
            assert {v for _k, v in labels} <= public, labels
        last = {}
        for body in run.bodies():
            last[body["stream"]] = body
        for stream, body in last.items():
            key = ("dpstream_model_holdout_accuracy", (("flow", "nb"), ("stream", stream)))
            assert got[key] == body["holdout"]["accuracy"]  # post-processing of a release
            key = ("dpstream_model_privacy_spent", (("flow", "nb"), ("stream", stream)))
            assert got[key] == body["privacy"]["spent"]
        seen.append({k: v for k, v in got.items()
                     if k[0] != "dpstream_model_holdout_accuracy"
                     and not k[0].endswith("_created")})
    assert seen[0] == seen[1]


SECRETS = ["31415.9265", "27182.818", "zzsecretzz", "qqlabelqq", "wwstreamww", "4242.125"]


def bad_records() -> list[Event]:
    t = 2.5
    body = {"s": "a", "ts": ORIGIN + t}
    return [
        Event(0, {**body, "features": [31415.9265, 2.0], "label": "yes"}, t),
        Event(0, {**body, "features": [27182.818, "zzsecretzz", 1.0], "label": "yes"}, t),
        Event(0, {**body, "features": [4242.125, 1.0, 2.0], "label": "qqlabelqq"}, t),
        Event(1, {**body, "features": [4242.125, [1.0], 2.0], "label": "no"}, t),
        Event(1, {"features": [4242.125, 1.0, 2.0], "label": "no", "s": "wwstreamww",
                  "ts": ORIGIN + t}, t),
        Event(1, {"features": [4242.125, 1.0, 2.0], "label": "no", "s": "a",
                  "ts": "4242.125"}, t),
        Event(1, b'{"features": [4242.125, NaN, 1], "label": "no", "s": "a"}', t),
        Event(1, b'{"features": [4242.125, 1e999, 1], "label": "no", "s": "a"}', t),
    ]


def test_dead_letter_reasons_name_no_value_of_the_record():
    cfg = config("continual")
    run = drive(cfg, base_events() + bad_records(), NoiseKey.for_tests(32))
    assert len(run.dead) == len(bad_records())
    for letter in run.dead:
        assert not any(s in letter.reason for s in SECRETS), letter.reason
        assert not any(s in letter.reason.split(":")[0] for s in SECRETS)  # metric label


# -- the real dataflow ----------------------------------------------------------------------------


def dataflow(cfg, events: list[Event], noise: NoiseKey, metrics: FlowMetrics | None = None,
             batch: int = 16) -> list[tuple[str, bytes | None, bytes]]:
    sink: list = []
    flow = build_flow(cfg, noise, instance="nb-1", partitions=2,
                      source=TestingSource(messages(events), batch), sink=TestingSink(sink),
                      metrics=metrics)
    run_main(flow)
    return sink


@pytest.mark.flow
def test_the_real_dataflow_publishes_what_the_driven_layer_produced():
    cfg = config("continual")
    base = base_events()
    noise = NoiseKey.for_tests(33)
    for events in (base, base + [extreme(0, "no")] + bad_records()):
        metrics = FlowMetrics("nb", CollectorRegistry(), exact_counts=True)
        sink = dataflow(cfg, events, noise, metrics)
        published = sorted(v for role, _k, v in sink if role == "models")
        driven = drive(cfg, events, noise)
        assert published == sorted(driven.values + driven.serving)
        dead = [json.loads(v) for role, _k, v in sink if role == "dead_letters"]
        assert len(dead) == len(driven.dead)
        for letter in dead:
            assert not any(s in letter["reason"] for s in SECRETS), letter["reason"]
        for (name, labels), _value in samples(metrics).items():
            if name.startswith("dpstream_dead_letters"):
                assert not any(s in v for _k, v in labels for s in SECRETS), labels
