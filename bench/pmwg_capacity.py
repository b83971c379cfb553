#!/usr/bin/env python
"""Query capacity of PMWG against independent noise and a continual noisy histogram (issue 7).

**Capacity.** A method's capacity is the largest number ``Q`` of queries such that, when an
adaptive analyst asks ``Q`` queries spread evenly over the growth of the database, at least
95% of the answers are within ``alpha = 0.05`` of the true fraction (a bottom answer is
wrong). Every method has the same total budget: ``epsilon = 1`` (pure, ``delta = 0``), or the
``rho`` of ``(epsilon = 1, delta = 1e-6)`` under zCDP (the same ``rho`` PMWG's ledger gets,
``PmwgSpec.budget``). ``Q`` is found by doubling, then bisection on the number of queries per
checkpoint; each evaluation is one full simulation.

**Database.** There are ``K`` checkpoints ``t_k``, spaced linearly from ``n0 = 10^6`` to
``10 n0 = 10^7`` events, and the database at ``t_k`` is the first ``t_k`` events.

* *Universe*: four attributes, ``a`` (4 values), ``b`` (8), ``c`` (8) and ``x``, bucketed
  into ``N / 256`` equal buckets of ``[0, 1)``. So ``N = 2^12``, ``2^16`` or ``2^20``.
* *Laws*: the first ``n0`` events come from a skewed law ``A``. The events between
  ``t_(k-1)`` and ``t_k`` come from ``(1 - k/(K-1)) A + k/(K-1) B``, so the distribution
  drifts as the database grows. ``A`` and ``B`` are each built the same way:
  * on ``(a, b, c)``: ``0.7 x`` a product of Zipf(1.2) marginals (random value orders) plus
    ``0.3 x`` a Zipf(1.2) law over the 256 combinations (heavy hitters);
  * given the combination, ``x`` has a normal density (random centre, width 0.05-0.2).
* *Resolution*: the laws depend on the seed only, so the databases at different ``N`` are the
  same data at different resolutions of ``x``.
* The count histograms at the checkpoints are computed once (multinomial draws per segment,
  cumulated). Methods only evaluate queries on them.

**Analyst.** It is seeded, with the same seed for every method at a given ``Q``, but
adaptive: its follow-ups depend on the answers it gets. Per checkpoint it asks ``Q / K``
scalar count queries, in actions drawn with these shares of the scalar queries:

* 20% *explore*: a 1-attribute marginal over ``a``, ``b`` or ``c``
  (``{"kind": "marginal", "attrs": [...]}``, 4 or 8 parts).
* 20% *drill*: restricted to the largest part of the last explore answer (2 attributes
  fixed), either the marginal over another of ``a``, ``b``, ``c``, or the four quarters of
  ``x``.
* 15% *fresh*: a count with 1 or 2 attributes fixed, by ``eq``, by ``in`` of 2-3 values, or
  by an ``x`` ``range`` of 1, 2, 4 or 8 sixteenths of its domain.
* 30% *repeat*: an earlier scalar query asked again (now, at a later ``t``).
* 15% *near-repeat*: an earlier query with one condition slightly changed: a neighbouring
  value, one value added to or removed from an ``in``, or a range end moved by a sixteenth.

``x`` ranges are whole sixteenths, so the analyst asks the same questions, with the same
answers, at every ``N``; only the supports grow (in proportion to ``N``). Every marginal part
is one query, for every method. The uniform-answer row answers ``|support| / N`` without
looking at the data. It shows how much of the workload a data-independent answer already gets
right (about 69%).

**Methods.**

a. *Independent noise per query*: each query's count gets its own discrete Laplace noise at
   ``epsilon / Q`` (pure), or Gaussian at ``rho / Q`` (zCDP). Capacity is computed exactly:
   ``P(|Z| <= floor(alpha t))`` averaged over the checkpoints (discrete Laplace:
   ``1 - 2 q^(m+1) / (1 + q)``, ``q = exp(-epsilon/Q)``; discrete Gaussian by the normal
   ``erf((m + 1/2) / (sigma sqrt 2))``, ``sigma^2 = Q / (2 rho)``, which is exact to far below
   the 1e-3 that matters at these ``sigma``), and checked once by simulation. *Simulation
   noise*: numpy's Generator, discrete Laplace as the difference of two geometric variables
   (exact in distribution up to the float ``q``), and a rounded Gaussian in place of the
   discrete Gaussian. This simulates the distribution for accuracy only; it is not the
   production sampler. A second row charges each *marginal* once (its parts are disjoint:
   one event moves one part, so by parallel composition a whole marginal costs what one
   count costs), the strongest form of this baseline.
b. *Continual noisy histogram* (the paper's footnote 2): one continual counter per cell
   (parallel composition over cells: one event touches one cell's counter), answer =
   sum of the query's noisy cell counts / t. Pure: :class:`TreeCounter` (binary tree,
   Honaker-combined, epsilon = 1); zCDP: :class:`BltCounter` (rho). Per-cell std from their
   ``analytic_std``; a query's error is the sum of ``|support|`` independent cell errors,
   simulated as a normal of variance ``|support| sigma^2`` (CLT; the analytic fraction is
   reported too). Two release granularities: one step per checkpoint (horizon 64: the
   histogram is released exactly when queries come, the most favourable case) and ``2^20``
   equal steps over ``[0, 10 n0]`` (a release every ~10 events: queries at any time).
   The histogram answers any number of queries at the same accuracy: its capacity is
   unbounded if >= 95% of the answers are within alpha, else 0.
c. *PMWG*: the real :class:`dpstream.core.pmwg.mechanism.Pmwg`, with exact noise.
   * Modes: ``paper``, ``solved``, and ``practical`` over a sweep of ``hard_query_cap``. The
     NSG ``threshold`` is swept too: Algorithm 1's ``2 alpha / 3``, 0.04 and 0.045.
   * Accounting: ``pure``, and ``zcdp`` with delta 1e-6.
   * The public size passed is the checkpoint's ``t_k``. The benchmark knows it; in a flow it
     is a privately released size.

**Regime** (PMWG against the histogram). The same database and analyst are used at smaller
scales (``n0 = 10^5, 3 x 10^5``) and across ``N``.

* The histogram's error grows like ``sqrt(|support|) sigma / t``, and ``|support|`` is
  proportional to ``N``.
* PMWG's answers do not depend on ``N``: the same queries, and hard-answer noise independent
  of ``N``.
* Histogram fractions at ``N`` above the simulated universe (``2^24``, and ``2^28``, which is
  beyond dpstream's limit) come from the ``2^16`` database, with every support scaled by the
  ``N`` ratio.

Usage::

    python bench/pmwg_capacity.py            # full run (<= 20 min on 2 shared vCPUs)
    python bench/pmwg_capacity.py --quick    # smoke run (< 2 min), writes nothing
    python bench/pmwg_capacity.py --probe 65536   # one zCDP PMWG run at Q = 3.3M (~5 min)

Progress goes to stderr, markdown tables to stdout; the full run writes
``bench/results/issue7-pmwg-capacity.json``.
"""

from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy: multi-threaded BLAS is erratic here

import argparse  # noqa: E402
import concurrent.futures as cf  # noqa: E402
import datetime as _dt  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from dpstream.core.counting import blt_counter as blt  # noqa: E402
from dpstream.core.counting import tree_counter as tree  # noqa: E402
from dpstream.core.noise.keys import NoiseKey  # noqa: E402
from dpstream.core.pmwg.guarantee import accuracy_guarantee  # noqa: E402
from dpstream.core.pmwg.mechanism import Pmwg  # noqa: E402
from dpstream.core.pmwg.queries import WEIGHT_UNIT  # noqa: E402
from dpstream.core.pmwg.query_compiler import QueryCompiler  # noqa: E402
from dpstream.core.pmwg.spec import PmwgSpec  # noqa: E402
from dpstream.core.pmwg.universe import Universe  # noqa: E402
from dpstream.errors import InvalidParameterError  # noqa: E402

RESULTS_DIR = _ROOT / "bench" / "results"
ALPHA = 0.05
EPSILON = 1.0
DELTA = 1e-6
TARGET = 0.95
BETA = 0.05
GROWTH = 10
SCHEMA = "dpstream.query/1"
NAMES = ("a", "b", "c", "x")  # x is bucketed
SHARES = {"explore": 0.20, "drill": 0.20, "fresh": 0.15, "repeat": 0.30, "near": 0.15}
FINE_STEPS = 2**20
EARLY_STOP_FROM = 5000
"""Runs of at least this many queries stop at the first checkpoint where they have failed."""


def rho_budget() -> float:
    """The rho of (epsilon=1, delta=1e-6) exactly as PMWG's ledger gets it."""
    return PmwgSpec(epsilon=EPSILON, delta=DELTA, alpha=ALPHA, beta=BETA, n=10**6,
                    universe_size=2, accounting="zcdp", mode="practical",
                    hard_query_cap=1).budget


# --- the database -------------------------------------------------------------------------

CAT_SIZES = (4, 8, 8)  # a, b, c; x gets N / 256 buckets
COMBOS = 256


def buckets(bits: int) -> int:
    return (1 << bits) // COMBOS


def universe_spec(bits: int) -> list[dict[str, Any]]:
    spec: list[dict[str, Any]] = [{"name": n, "values": [f"{n}{j}" for j in range(size)]}
                                  for n, size in zip(NAMES[:3], CAT_SIZES, strict=True)]
    spec.append({"name": "x", "edges": list(range(buckets(bits) + 1))})
    return spec


def _zipf(size: int, s: float, rng: np.random.Generator) -> np.ndarray:
    w = 1.0 / np.arange(1, size + 1, dtype=np.float64) ** s
    w = w[rng.permutation(size)]
    return w / w.sum()


def _law(bits: int, rng: np.random.Generator) -> np.ndarray:
    """A skewed law over the cells: categorical part (a, b, c) times a smooth density of x.

    The categorical part is ``0.7`` a product of Zipf(1.2) marginals plus ``0.3`` a Zipf(1.2)
    law over the 256 combinations; given the combination, ``x`` in ``[0, 1)`` has a normal
    density (random centre, width 0.05-0.2) cut into ``N / 256`` equal buckets. So the law of
    a query that selects whole ``N / 4096``-wide groups of buckets does not depend on ``N``.
    """
    marg = [_zipf(size, 1.2, rng) for size in CAT_SIZES]
    cats = 0.7 * np.einsum("i,j,k->ijk", *marg).ravel() + 0.3 * _zipf(COMBOS, 1.2, rng)
    n_b = buckets(bits)
    edges = np.linspace(0.0, 1.0, n_b + 1)
    centres = rng.uniform(0.05, 0.95, COMBOS)
    widths = rng.uniform(0.05, 0.2, COMBOS)
    erf = np.frompyfunc(math.erf, 1, 1)
    law = np.empty((COMBOS, n_b))
    for g in range(COMBOS):
        c = erf((edges - centres[g]) / (widths[g] * math.sqrt(2))).astype(np.float64)
        law[g] = np.diff(c) / (c[-1] - c[0])
    p = (cats[:, None] * law).ravel()
    return p / p.sum()


@dataclass
class Database:
    bits: int
    n0: int
    checkpoints: int
    ts: np.ndarray
    hists: np.ndarray  # (K, N) int64, cumulative

    @property
    def size(self) -> int:
        return 1 << self.bits


def make_database(bits: int, n0: int, checkpoints: int, seed: int = 7) -> Database:
    """Checkpoint histograms of a database drifting from law A to law B.

    The laws depend on the seed only (same random centres, weights and orders for every N),
    so the databases at different N are the same data at different resolutions of x.
    """
    rng = np.random.default_rng(seed)
    law_a = _law(bits, np.random.default_rng([seed, 1]))
    law_b = _law(bits, np.random.default_rng([seed, 2]))
    ts = np.linspace(n0, GROWTH * n0, checkpoints).round().astype(np.int64)
    hists = np.empty((checkpoints, 1 << bits), dtype=np.int64)
    current = rng.multinomial(int(ts[0]), law_a).astype(np.int64)
    hists[0] = current
    for k in range(1, checkpoints):
        lam = k / (checkpoints - 1)
        p = (1 - lam) * law_a + lam * law_b
        current = current + rng.multinomial(int(ts[k] - ts[k - 1]), p / p.sum())
        hists[k] = current
    assert int(hists[-1].sum()) == int(ts[-1])
    return Database(bits, n0, checkpoints, ts, hists)


_DBS: dict[tuple[int, int, int], Database] = {}
_CTX: dict[int, Context] = {}


def database(bits: int, n0: int, checkpoints: int) -> Database:
    key = (bits, n0, checkpoints)
    if key not in _DBS:
        _DBS[key] = make_database(bits, n0, checkpoints)
    return _DBS[key]


# --- queries and the analyst --------------------------------------------------------------

Cond = tuple[int, tuple[int, ...]]
"""(attribute position, codes): sorted codes for a, b, c; (lo, hi) buckets for x (hi excl.)."""
X = 3
COARSE = 16  # x ranges are whole sixteenths of [0, 1): the same query at every N


class Context:
    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.unit = buckets(bits) // COARSE  # buckets per sixteenth
        self.universe = Universe.from_spec(universe_spec(bits))
        self.compiler = QueryCompiler(self.universe, max_entries=1 << 18)

    def cond_json(self, cond: Cond) -> dict[str, Any]:
        pos, codes = cond
        name = NAMES[pos]
        if pos == X:
            return {"attr": "x", "range": [codes[0], codes[1]]}
        if len(codes) == 1:
            return {"attr": name, "eq": f"{name}{codes[0]}"}
        return {"attr": name, "in": [f"{name}{c}" for c in codes]}

    def count(self, conds: tuple[Cond, ...]) -> Any:
        obj = {"schema": SCHEMA, "kind": "count",
               "where": [self.cond_json(c) for c in conds]}
        return self.compiler.compile(obj)[0]

    def marginal(self, attr: int, where: tuple[Cond, ...]) -> list[Any]:
        obj: dict[str, Any] = {"schema": SCHEMA, "kind": "marginal", "attrs": [NAMES[attr]]}
        if where:
            obj["where"] = [self.cond_json(c) for c in where]
        return self.compiler.compile(obj)


def context(bits: int) -> Context:
    if bits not in _CTX:
        _CTX[bits] = Context(bits)
    return _CTX[bits]


class Analyst:
    """The adaptive analyst: explore, drill into the largest answer, fresh and repeated queries.

    Queries are built from conditions on a, b, c (values) and x (ranges of whole sixteenths
    of its domain), so the analyst asks the same questions at every N.
    """

    def __init__(self, ctx: Context, seed: int) -> None:
        self.ctx = ctx
        self.unit = ctx.unit
        self.rng = random.Random(seed)
        self.notebook: list[tuple[Cond, ...]] = []
        self.last_explore: tuple[int, list[float | None]] | None = None
        explore_size = sum(CAT_SIZES) / 3
        drill_size = (explore_size * 2 + 4) / 3
        sizes = {"explore": explore_size, "drill": drill_size}
        weights = {k: v / sizes.get(k, 1.0) for k, v in SHARES.items()}
        total = sum(weights.values())
        self.actions = list(weights)
        self.cum = [float(c) for c in np.cumsum([weights[k] / total for k in self.actions])]

    def _x_range(self, lo16: int, hi16: int) -> Cond:
        return (X, (lo16 * self.unit, hi16 * self.unit))

    def _fresh_cond(self, pos: int) -> Cond:
        rng = self.rng
        if pos == X:
            width = rng.choice((1, 2, 4, 8))
            lo = rng.randrange(0, COARSE - width + 1)
            return self._x_range(lo, lo + width)
        size = CAT_SIZES[pos]
        if rng.random() < 0.6:
            return (pos, (rng.randrange(size),))
        return (pos, tuple(sorted(rng.sample(range(size), rng.randint(2, min(3, size - 1))))))

    def _fresh(self) -> tuple[Cond, ...]:
        positions = sorted(self.rng.sample(range(4), self.rng.choice((1, 2))))
        return tuple(self._fresh_cond(p) for p in positions)

    def _near(self, conds: tuple[Cond, ...]) -> tuple[Cond, ...]:
        rng = self.rng
        i = rng.randrange(len(conds))
        pos, codes = conds[i]
        if pos == X:
            lo, hi = codes[0] // self.unit, codes[1] // self.unit
            if rng.random() < 0.5:
                lo = min(max(0, lo + rng.choice((-1, 1))), hi - 1)
            else:
                hi = max(min(COARSE, hi + rng.choice((-1, 1))), lo + 1)
            new = self._x_range(lo, hi)
        else:
            size = CAT_SIZES[pos]
            if len(codes) == 1:
                new = (pos, ((codes[0] + rng.choice((-1, 1))) % size,))
            elif len(codes) > 2 and rng.random() < 0.5:
                drop = rng.randrange(len(codes))
                new = (pos, codes[:drop] + codes[drop + 1:])
            else:
                rest = [c for c in range(size) if c not in codes]
                new = (pos, tuple(sorted((*codes, rng.choice(rest))))) if rest else (pos, codes)
        return conds[:i] + (new,) + conds[i + 1:]

    def next(self, room: int) -> tuple[str, list[tuple[Cond, ...]], list[Any], int | None]:
        """Return (action, conditions, compiled queries, explored attribute), <= room queries."""
        r = self.rng.random()
        action = next((a for a, c in zip(self.actions, self.cum, strict=True) if r <= c),
                      self.actions[-1])
        if action in ("repeat", "near") and not self.notebook:
            action = "fresh"
        if action == "drill" and self.last_explore is None:
            action = "explore"
        ctx = self.ctx
        if action == "explore":
            attr = self.rng.randrange(3)
            queries = ctx.marginal(attr, ())[:room]
            conds = [((attr, (j,)),) for j in range(len(queries))]
            return action, conds, queries, attr
        if action == "drill":
            assert self.last_explore is not None
            a, answers = self.last_explore
            best = max(range(len(answers)),
                       key=lambda j: -math.inf if answers[j] is None else answers[j])
            where: tuple[Cond, ...] = ((a, (best,)),)
            attr = self.rng.choice([p for p in range(4) if p != a])
            if attr == X:  # the four quarters of x's domain
                conds = [tuple(sorted((*where, self._x_range(4 * j, 4 * j + 4))))
                         for j in range(4)][:room]
                return action, conds, [ctx.count(c) for c in conds], None
            queries = ctx.marginal(attr, where)[:room]
            conds = [tuple(sorted((*where, (attr, (j,))))) for j in range(len(queries))]
            return action, conds, queries, None
        if action == "fresh":
            c = self._fresh()
        elif action == "repeat":
            c = self.rng.choice(self.notebook)
        else:
            c = self._near(self.rng.choice(self.notebook))
        return action, [c], [ctx.count(c)], None

    def observe(self, action: str, conds: list[tuple[Cond, ...]],
                answers: list[float | None], attr: int | None) -> None:
        if action != "repeat":
            self.notebook.extend(conds)
        if action == "explore" and attr is not None and len(answers) == CAT_SIZES[attr]:
            self.last_explore = (attr, answers)


# --- methods ------------------------------------------------------------------------------


class Method:
    name = "method"
    halted = False

    def answer(self, query: Any, k: int, truth: float) -> float | None:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return {}


class Independent(Method):
    """Independent noise per query: discrete Laplace at eps/Q, or Gaussian at rho/Q."""

    def __init__(self, db: Database, accounting: str, releases: int, seed: int) -> None:
        self.ts = db.ts
        self.accounting = accounting
        self.rng = np.random.default_rng([seed, 11])
        if accounting == "pure":
            self.q = math.exp(-EPSILON / releases)
        else:
            self.sigma = math.sqrt(releases / (2 * rho_budget()))

    def answer(self, query: Any, k: int, truth: float) -> float | None:
        if self.accounting == "pure":  # discrete Laplace = difference of two geometrics
            z = int(self.rng.geometric(1 - self.q)) - int(self.rng.geometric(1 - self.q))
        else:  # rounded Gaussian standing in for the discrete Gaussian (sigma >> 1)
            z = round(float(self.rng.normal(0.0, self.sigma)))
        return truth + z / int(self.ts[k])


class NoisyHistogram(Method):
    """Per-cell continual counters; a query's error is the sum over its support."""

    def __init__(self, db: Database, cell_std: np.ndarray, seed: int,
                 support_scale: int = 1) -> None:
        self.ts = db.ts
        self.cell_std = cell_std
        self.scale = support_scale
        self.rng = np.random.default_rng([seed, 13])
        self.analytic = 0.0
        self.count = 0

    def answer(self, query: Any, k: int, truth: float) -> float | None:
        t = int(self.ts[k])
        std = math.sqrt(query.support_size * self.scale) * float(self.cell_std[k]) / t
        self.count += 1
        self.analytic += 1.0 if std == 0 else math.erf(ALPHA / (std * math.sqrt(2)))
        return truth + float(self.rng.normal(0.0, std)) if std > 0 else truth

    def stats(self) -> dict[str, Any]:
        return {"analytic_fraction": self.analytic / max(1, self.count)}


class UniformAnswer(Method):
    """Data-independent answer |support| / N (what the uniform public histogram says)."""

    def __init__(self, db: Database) -> None:
        self.n = db.size

    def answer(self, query: Any, k: int, truth: float) -> float | None:
        return query.support_size / self.n


class PmwgMethod(Method):
    def __init__(self, db: Database, spec: PmwgSpec, seed: int) -> None:
        self.db = db
        self.pm = Pmwg(spec, NoiseKey.for_tests(seed), ("bench", "capacity"))
        self.kinds = {"easy": 0, "hard": 0, "bottom": 0}
        self.wrong_kind = {"easy": 0, "hard": 0, "bottom": 0}
        self.reason: str | None = None
        self.first_bottom_t: int | None = None
        self.hard_by_tenth = [0] * 10  # hard answers in each tenth of the checkpoints
        self.asked_by_tenth = [0] * 10

    def answer(self, query: Any, k: int, truth: float) -> float | None:
        t = int(self.db.ts[k])
        a = self.pm.answer(query, self.db.hists[k], t)
        self.kinds[a.kind] += 1
        tenth = k * 10 // self.db.checkpoints
        self.asked_by_tenth[tenth] += 1
        if a.kind == "hard":
            self.hard_by_tenth[tenth] += 1
        if a.kind == "bottom":
            self.halted = True
            self.reason = a.reason
            self.first_bottom_t = t
        if a.value is None or abs(a.value - truth) > ALPHA:
            self.wrong_kind[a.kind] += 1
        return a.value

    def stats(self) -> dict[str, Any]:
        return {"kinds": dict(self.kinds), "wrong_by_kind": dict(self.wrong_kind),
                "spent": self.pm.ledger.spent, "halt_reason": self.reason,
                "first_bottom_t": self.first_bottom_t, "hard_queries": self.pm.hard_queries,
                "hard_by_tenth": self.hard_by_tenth, "asked_by_tenth": self.asked_by_tenth}


# --- the simulation -----------------------------------------------------------------------


@dataclass
class SimResult:
    queries: int
    correct: int
    wrong: int
    stopped_early: bool
    releases: int
    actions: dict[str, int] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        return self.correct / self.queries if self.queries else 0.0


def simulate(method: Method, db: Database, per_checkpoint: int, seed: int,
             stop_when_failed: bool = False) -> SimResult:
    """Ask ``per_checkpoint`` queries at every checkpoint; count answers within alpha."""
    ctx = context(db.bits)
    analyst = Analyst(ctx, seed)
    total = per_checkpoint * db.checkpoints
    allowed_wrong = math.floor((1 - TARGET) * total + 1e-9)
    correct = wrong = releases = 0
    actions = dict.fromkeys(SHARES, 0)
    scale = WEIGHT_UNIT
    for k in range(db.checkpoints):
        hist, t = db.hists[k], int(db.ts[k])
        room = per_checkpoint
        while room > 0:
            if method.halted:  # every later answer is bottom: wrong, no need to ask
                wrong += room
                room = 0
                break
            action, conds, queries, attr = analyst.next(room)
            answers: list[float | None] = []
            for q in queries:
                truth = q.weighted_count(hist) / (scale * t)
                a = method.answer(q, k, truth)
                answers.append(a)
                if a is not None and abs(a - truth) <= ALPHA:
                    correct += 1
                else:
                    wrong += 1
            releases += 1 if action in ("explore", "drill") else len(queries)
            actions[action] += len(queries)
            analyst.observe(action, conds, answers, attr)
            room -= len(queries)
        if stop_when_failed and total >= EARLY_STOP_FROM and wrong > allowed_wrong:
            done = correct + wrong
            return SimResult(total, correct, wrong + (total - done), True, releases, actions,
                             method.stats())
    return SimResult(total, correct, wrong, False, releases, actions, method.stats())


# --- capacity search ----------------------------------------------------------------------


def search(evaluate: Any, m_start: int, m_max: int, rel: float) -> dict[str, Any]:
    """Find the largest passing ``m`` (queries per checkpoint); evaluate(m) -> SimResult.

    From ``m_start``: double while it passes (up to ``m_max``), or halve while it fails
    (down to 1); then bisect between the last pass and the first fail until they are within
    a relative ``rel``.
    """
    trail: list[dict[str, Any]] = []

    def ok(m: int) -> bool:
        started = time.perf_counter()
        res = evaluate(m)
        passed = res.fraction >= TARGET and not res.stopped_early
        trail.append({"per_checkpoint": m, "queries": res.queries, "fraction": res.fraction,
                      "passed": passed, "stopped_early": res.stopped_early,
                      "seconds": time.perf_counter() - started, "stats": res.stats})
        return passed

    if ok(m_start):
        lo, hi = m_start, m_start * 2
        while hi <= m_max and ok(hi):
            lo, hi = hi, hi * 2
        if hi > m_max:
            return {"capacity_per_checkpoint": lo, "lower_bound": True, "trail": trail,
                    "note": f"passes at the search limit ({lo}/checkpoint)"}
    else:
        # the fraction need not be monotone in Q (small Q: the learning phase's hard answers
        # weigh more; large Q: the budget runs out), so look above m_start first
        up = m_start * 2
        while up <= m_max and not ok(up):
            up *= 2
        if up <= m_max:
            lo, hi = up, up * 2
            while hi <= m_max and ok(hi):
                lo, hi = hi, hi * 2
            if hi > m_max:
                return {"capacity_per_checkpoint": lo, "lower_bound": True, "trail": trail,
                        "note": f"passes at the search limit ({lo}/checkpoint), fails at "
                                f"{m_start}/checkpoint"}
        else:
            hi = m_start
            lo = m_start // 2
            while lo >= 1 and not ok(lo):
                hi, lo = lo, lo // 2
            if lo < 1:
                return {"capacity_per_checkpoint": 0, "lower_bound": False, "trail": trail,
                        "note": f"fails at every m from 1 to {m_max}/checkpoint tried"}
    while hi - lo > max(1, int(lo * rel)):
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return {"capacity_per_checkpoint": lo, "lower_bound": False, "trail": trail,
            "note": f"passes at {lo}/checkpoint, fails at {hi}"}


# --- analytic baselines -------------------------------------------------------------------


def independent_fraction(ts: np.ndarray, releases: float, accounting: str) -> float:
    m = np.floor(ALPHA * ts.astype(np.float64))
    if accounting == "pure":
        q = math.exp(-EPSILON / releases)
        miss = 2 * np.exp((m + 1) * math.log(q)) / (1 + q)
    else:
        sigma = math.sqrt(releases / (2 * rho_budget()))
        miss = np.array([math.erfc((x + 0.5) / (sigma * math.sqrt(2))) for x in m])
    return float(np.mean(1 - miss))


def independent_capacity(ts: np.ndarray, accounting: str) -> int:
    """Largest Q (releases) with independent_fraction >= 0.95 (exact bisection on integers)."""
    lo, hi = 1, 2
    while independent_fraction(ts, hi, accounting) >= TARGET:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if independent_fraction(ts, mid, accounting) >= TARGET:
            lo = mid
        else:
            hi = mid
    return lo


def histogram_cell_std(db: Database, accounting: str, granularity: str) -> np.ndarray:
    """Per-cell counter std at every checkpoint (TreeCounter for pure, BltCounter for zCDP)."""
    if granularity == "checkpoint":
        horizon, steps = 64, list(range(db.checkpoints))
    else:
        horizon = FINE_STEPS
        t_max = int(db.ts[-1])
        steps = [max(0, -(-int(t) * FINE_STEPS // t_max) - 1) for t in db.ts]
    if accounting == "pure":
        spec_t = tree.TreeCounterSpec(epsilon=EPSILON, horizon=horizon)
        return np.array([tree.analytic_std(spec_t, s) for s in steps])
    spec_b = blt.BltCounterSpec(rho=rho_budget(), horizon=horizon)
    return np.array([blt.analytic_std(spec_b, s) for s in steps])


# --- tasks (run in worker processes) ------------------------------------------------------


def pmwg_spec(db: Database, accounting: str, mode: str, cap: int | None,
              threshold: float | None = None) -> PmwgSpec:
    return PmwgSpec(epsilon=EPSILON, delta=0.0 if accounting == "pure" else DELTA,
                    alpha=ALPHA, beta=BETA, n=int(db.ts[0]), universe_size=db.size,
                    accounting=accounting, mode=mode,  # type: ignore[arg-type]
                    hard_query_cap=cap if mode == "practical" else None, threshold=threshold)


def task_pmwg(args: dict[str, Any]) -> dict[str, Any]:
    db = database(args["bits"], args["n0"], args["checkpoints"])
    started = time.perf_counter()
    try:
        spec = pmwg_spec(db, args["accounting"], args["mode"], args.get("cap"),
                         args.get("threshold"))
    except InvalidParameterError as exc:
        print(f"  pmwg {args['accounting']} {args['mode']}: refused: {exc}", file=sys.stderr)
        return {**args, "error": str(exc), "capacity": 0, "lower_bound": False}
    guarantee = accuracy_guarantee(spec)

    def evaluate(m: int) -> SimResult:
        method = PmwgMethod(db, spec, seed=1000 + m)
        return simulate(method, db, m, seed=m, stop_when_failed=True)

    found = search(evaluate, args["m_start"], args["m_max"], args["rel"])
    out = {**args, **found, "capacity": found["capacity_per_checkpoint"] * db.checkpoints,
           "xi_n": spec.xi(int(db.ts[0])), "answer_std_at_n": guarantee.answer_std_at_n,
           "threshold_value": float(spec.threshold_value),
           "worst_case_cost": spec.worst_case_cost(), "budget": spec.budget,
           "seconds": time.perf_counter() - started}
    print(f"  pmwg {args['accounting']:5s} {args['mode']:9s} cap={args.get('cap')} "
          f"T={args.get('threshold')} N=2^{db.bits} n0={db.n0:.0e}: capacity "
          f"{out['capacity']}{'+' if found['lower_bound'] else ''} ({out['seconds']:.0f} s)",
          file=sys.stderr)
    return out


def task_baselines(args: dict[str, Any]) -> dict[str, Any]:
    """Independent noise (analytic + simulation), the histogram and the uniform answer."""
    db = database(args["bits"], args["n0"], args["checkpoints"])
    started = time.perf_counter()
    out: dict[str, Any] = {**args}
    ts = db.ts
    for acc in ("pure", "zcdp"):
        cap_spread = independent_capacity(ts, acc)
        entry: dict[str, Any] = {"capacity_spread": cap_spread,
                                 "capacity_all_at_n0": independent_capacity(ts[:1], acc)}
        m = max(1, cap_spread // db.checkpoints)
        if args["simulate_independent"] and acc == "pure":
            sims = []
            for mm in (m, int(m * 1.25)):
                q = mm * db.checkpoints
                res = simulate(Independent(db, acc, q, seed=mm), db, mm, seed=mm)
                sims.append({"queries": q, "simulated_fraction": res.fraction,
                             "analytic_fraction": independent_fraction(ts, q, acc),
                             "queries_per_release": res.queries / res.releases})
            entry["simulation"] = sims
            qpr = sims[0]["queries_per_release"]
        else:  # the workload's share of marginal parts, from the uniform answer's run
            res = simulate(UniformAnswer(db), db, min(m, 2000), seed=min(m, 2000))
            qpr = res.queries / res.releases
        entry["queries_per_release"] = qpr
        entry["capacity_spread_marginal_once"] = int(cap_spread * qpr)
        out[f"independent_{acc}"] = entry
    m = args["hist_per_checkpoint"]
    hist: dict[str, Any] = {}
    for acc in ("pure", "zcdp"):
        for gran in ("checkpoint", "fine"):
            std = histogram_cell_std(db, acc, gran)
            for target in args["hist_bits"]:
                method = NoisyHistogram(db, std, seed=m, support_scale=1 << (target - db.bits))
                res = simulate(method, db, m, seed=m)
                hist[f"{acc}/{gran}/{target}"] = {
                    "accounting": acc, "granularity": gran, "bits": target,
                    "scaled_from": db.bits, "queries": res.queries, "fraction": res.fraction,
                    "analytic_fraction": res.stats["analytic_fraction"],
                    "cell_std_max": float(std.max()), "cell_std_first": float(std[0]),
                    "passes": res.fraction >= TARGET}
    out["histogram"] = hist
    res = simulate(UniformAnswer(db), db, m, seed=m)
    out["uniform"] = {"queries": res.queries, "fraction": res.fraction, "actions": res.actions}
    out["seconds"] = time.perf_counter() - started
    print(f"  baselines N=2^{db.bits} n0={db.n0:.0e}: indep pure "
          f"{out['independent_pure']['capacity_spread']}, uniform {res.fraction:.3f} "
          f"({out['seconds']:.0f} s)", file=sys.stderr)
    return out


def task_probe(args: dict[str, Any]) -> dict[str, Any]:
    """One PMWG simulation at a fixed (large) Q: no search, every query answered."""
    db = database(args["bits"], args["n0"], args["checkpoints"])
    spec = pmwg_spec(db, args["accounting"], "practical", args["cap"], args.get("threshold"))
    started = time.perf_counter()
    res = simulate(PmwgMethod(db, spec, seed=1000 + args["per_checkpoint"]), db,
                   args["per_checkpoint"], seed=args["per_checkpoint"])
    out = {**args, "queries": res.queries, "fraction": res.fraction, "stats": res.stats,
           "budget": spec.budget, "seconds": time.perf_counter() - started}
    print(f"  probe {args['accounting']} cap={args['cap']} Q={res.queries:,}: "
          f"{res.fraction:.4f} within alpha, spent {res.stats['spent']:.3g} of "
          f"{spec.budget:.3g} ({out['seconds']:.0f} s)", file=sys.stderr)
    return out


def _run(task: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    kind, args = task
    if kind == "probe":
        return task_probe(args)
    return task_pmwg(args) if kind == "pmwg" else task_baselines(args)


# --- plan, run, report --------------------------------------------------------------------


def plan(quick: bool) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
    """The tasks, heaviest first, and the run's settings."""
    if quick:
        cfg: dict[str, Any] = {
            "checkpoints": 20, "rel": 0.5, "m_max": 1024, "hist_per_checkpoint": 100,
            "main": {12: {"pure": [(2000, None), (4000, None), (3000, 0.04)],
                          "zcdp": [(20000, None)]}},
            "modes_bits": [12], "regime": {10**5: {12: [200]}},
            "baselines": {(12, 10**6): [12], (12, 10**5): [12, 16, 20, 24]}}
    else:
        cfg = {
            "checkpoints": 50, "rel": 0.125, "m_max": 8192, "hist_per_checkpoint": 400,
            "main": {
                20: {"pure": [(3000, None), (3000, 0.04)]},
                12: {"pure": [(1000, None), (2000, None), (3000, None), (4000, None),
                              (6000, None), (2000, 0.04), (3000, 0.04), (4000, 0.04),
                              (2000, 0.045), (3000, 0.045), (4000, 0.045)],
                     "zcdp": [(20000, None), (80000, None)]},
                16: {"pure": [(3000, None), (4000, None), (3000, 0.04), (3000, 0.045)],
                     "zcdp": [(20000, None)]},
            },
            "modes_bits": [12, 16],
            "regime": {10**5: {12: [100, 200, 400], 16: [100, 200, 400], 20: [200, 400]},
                       3 * 10**5: {12: [300, 600, 1200]}},
            "baselines": {(12, 10**6): [12], (16, 10**6): [16, 20, 24, 28],
                          (20, 10**6): [20], (12, 10**5): [12],
                          (16, 10**5): [16, 20, 24, 28], (20, 10**5): [20],
                          (12, 3 * 10**5): [12], (16, 3 * 10**5): [16, 20, 24, 28]}}
    k = cfg["checkpoints"]
    base = {"checkpoints": k, "rel": cfg["rel"]}
    tasks: list[tuple[str, dict[str, Any]]] = []
    for bits, by_acc in cfg["main"].items():
        for acc, settings in by_acc.items():
            for cap, thr in settings:
                tasks.append(("pmwg", {**base, "bits": bits, "n0": 10**6, "accounting": acc,
                                       "mode": "practical", "cap": cap, "threshold": thr,
                                       "m_start": 256 if not quick else 64,
                                       "m_max": cfg["m_max"],
                                       "group": "main"}))
    for n0, by_bits in cfg["regime"].items():
        for bits, caps in by_bits.items():
            for cap in caps:
                tasks.append(("pmwg", {**base, "bits": bits, "n0": n0, "accounting": "pure",
                                       "mode": "practical", "cap": cap, "threshold": None,
                                       "m_start": 16, "m_max": cfg["m_max"],
                                       "group": "regime"}))
    for bits in cfg["modes_bits"]:
        for acc in ("pure", "zcdp"):
            for mode in ("paper", "solved"):
                tasks.append(("pmwg", {**base, "bits": bits, "n0": 10**6, "accounting": acc,
                                       "mode": mode, "cap": None, "threshold": None,
                                       "m_start": 4, "m_max": cfg["m_max"], "group": "modes"}))
    for (bits, n0), targets in cfg["baselines"].items():
        tasks.append(("baselines", {"bits": bits, "n0": n0, "checkpoints": k,
                                    "hist_bits": targets,
                                    "hist_per_checkpoint": cfg["hist_per_checkpoint"],
                                    "simulate_independent": n0 == 10**6 and bits == 12}))
    cfg["baselines"] = [list(key) + [v] for key, v in cfg["baselines"].items()]
    cfg["main"] = {str(b): v for b, v in cfg["main"].items()}
    cfg["regime"] = {str(n): {str(b): c for b, c in v.items()} for n, v in cfg["regime"].items()}
    return tasks, cfg


def fmt_cap(entry: dict[str, Any]) -> str:
    if "error" in entry:
        return "refused"
    c = entry["capacity"]
    return f"≥ {c:,}" if entry["lower_bound"] else (f"{c:,}" if c else "0")


def _pmwg_label(r: dict[str, Any]) -> str:
    if r["mode"] != "practical":
        return r["mode"]
    thr = r.get("threshold")
    return f"practical, cap {r['cap']}" + (f", T = {thr}" if thr else "")


def _pmwg_note(r: dict[str, Any]) -> str:
    if "error" in r:
        return r["error"][:120]
    passed = [t for t in r["trail"] if t["passed"]]
    failed = [t for t in r["trail"] if not t["passed"]]
    parts = [f"xi_n {r['xi_n']:.3g}, hard-answer std {r['answer_std_at_n']:.2g}"]
    if passed:
        best = max(passed, key=lambda t: t["queries"])
        st = best["stats"]
        late = st["hard_by_tenth"][-1] / max(1, st["asked_by_tenth"][-1])
        parts.append(f"at Q = {best['queries']:,}: {best['fraction']:.4f} within alpha, "
                     f"{st['kinds']['hard']:,} hard ({st['wrong_by_kind']['hard']} wrong), "
                     f"{st['wrong_by_kind']['easy']} easy wrong, spent {st['spent']:.3g} of "
                     f"{r['budget']:.3g}, hard share in the last tenth {late:.2%}")
    if failed:
        worst = min(failed, key=lambda t: t["queries"])
        st = worst["stats"]
        why = (f"halted ({st['halt_reason']}) at t = {st['first_bottom_t']:,}"
               if st["halt_reason"] else f"{worst['fraction']:.3f} within alpha")
        parts.append(f"fails at Q = {worst['queries']:,}: {why}")
    return "; ".join(parts)


def report(results: dict[str, Any]) -> str:
    k = results["settings"]["checkpoints"]
    lines: list[str] = []
    base = {(r["bits"], r["n0"]): r for r in results["baselines"]}
    pm = results["pmwg"]
    lines.append(f"### Capacity, n0 = 10^6 -> 10^7 ({k} checkpoints), alpha = {ALPHA}, "
                 f"target {TARGET:.0%}, epsilon = 1 / rho = {results['settings']['rho']:.5f}\n")
    lines.append("| N | method | accounting | capacity Q | / independent (spread) | notes |")
    lines.append("|---|---|---|---|---|---|")
    for bits in sorted({r["bits"] for r in pm if r["n0"] == 10**6}):
        n_txt = f"2^{bits}"
        b = base.get((bits, 10**6))
        for acc in ("pure", "zcdp"):
            ref = None
            if b is not None:
                ind = b[f"independent_{acc}"]
                ref = ind["capacity_spread"]
                name = "Laplace" if acc == "pure" else "Gaussian"
                sim = ""
                if "simulation" in ind:
                    sim = "; simulated " + ", ".join(
                        f"{s['simulated_fraction']:.4f} at Q = {s['queries']:,} (analytic "
                        f"{s['analytic_fraction']:.4f})" for s in ind["simulation"])
                lines.append(f"| {n_txt} | independent {name} per query, spread | {acc} | "
                             f"{ref:,} | 1.00 | all at t = n0: "
                             f"{ind['capacity_all_at_n0']:,}{sim} |")
                lines.append(
                    f"| {n_txt} | independent {name}, each marginal charged once | {acc} | "
                    f"{ind['capacity_spread_marginal_once']:,} | "
                    f"{ind['capacity_spread_marginal_once'] / ref:.2f} | "
                    f"{ind['queries_per_release']:.2f} queries per release |")
                for gran in ("checkpoint", "fine"):
                    h = b["histogram"][f"{acc}/{gran}/{bits}"]
                    lines.append(
                        f"| {n_txt} | noisy histogram ({gran} steps) | {acc} | "
                        f"{'unbounded' if h['passes'] else '0'} | "
                        f"{'∞' if h['passes'] else '0'} | {h['fraction']:.4f} within alpha "
                        f"(analytic {h['analytic_fraction']:.4f}); cell std max "
                        f"{h['cell_std_max']:.1f} |")
            rows = [r for r in pm if r["bits"] == bits and r["n0"] == 10**6
                    and r["accounting"] == acc]
            order = {"paper": 0, "solved": 1, "practical": 2}
            for r in sorted(rows, key=lambda r: (order[r["mode"]], r.get("threshold") or 0,
                                                 r.get("cap") or 0)):
                ratio = f"{r['capacity'] / ref:.2f}" if ref else "-"
                lines.append(f"| {n_txt} | PMWG {_pmwg_label(r)} | {acc} | {fmt_cap(r)} | "
                             f"{ratio} | {_pmwg_note(r)} |")
    lines.append("\n### Regime: noisy histogram (pure, fraction within alpha) against PMWG "
                 "(practical, pure; best cap, Algorithm 1's threshold)\n")
    lines.append("Histogram fractions at N above the simulated universe scale every "
                 "query's support by the N ratio (the queries are the same at every N).\n")
    lines.append("| n0 -> 10 n0 | alpha eps n0 | N | histogram, checkpoint steps | "
                 "histogram, 2^20 steps | zCDP histogram (BLT), 2^20 steps | "
                 "PMWG capacity (cap) | independent Laplace | PMWG / independent | "
                 "uniform answer |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for n0 in sorted({key[1] for key in base}):
        here = {bits: b for (bits, nn), b in base.items() if nn == n0}
        targets = sorted({h["bits"] for b in here.values() for h in b["histogram"].values()})
        rows_h: dict[int, dict[str, Any]] = {}
        src: dict[int, int] = {}
        for t in targets:  # the universe itself if simulated, else the largest below
            src[t] = t if t in here else max(
                b for b in here if b < t
                and any(h["bits"] == t for h in here[b]["histogram"].values()))
            rows_h[t] = {f"{h['accounting']}/{h['granularity']}": h
                         for h in here[src[t]]["histogram"].values() if h["bits"] == t}
        any_base = next(b for (bits, nn), b in base.items() if nn == n0)
        for t in sorted(rows_h):
            pms = [r for r in pm if r["n0"] == n0 and r["accounting"] == "pure"
                   and r["mode"] == "practical" and not r.get("threshold")
                   and r["bits"] == t]
            approx = ""
            if not pms:  # not run at this N: the best at any N (the same queries)
                pms = [r for r in pm if r["n0"] == n0 and r["accounting"] == "pure"
                       and r["mode"] == "practical" and not r.get("threshold")]
                if pms:
                    top = max(pms, key=lambda r: r["capacity"])["bits"]
                    approx = f" at 2^{top}"
            best = max(pms, key=lambda r: r["capacity"]) if pms else None
            pm_txt = f"{fmt_cap(best)} (cap {best['cap']}{approx})" if best else "not run"
            hc, hf = rows_h[t]["pure/checkpoint"], rows_h[t]["pure/fine"]
            hz = rows_h[t]["zcdp/fine"]
            tag = "" if src[t] == t else f" (scaled from 2^{src[t]})"
            ind = any_base["independent_pure"]["capacity_spread"]
            ratio = f"{best['capacity'] / ind:.2f}" if best else "-"
            lines.append(
                f"| {n0:.0e} | {ALPHA * EPSILON * n0:,.0f} | 2^{t}{tag} | "
                f"{hc['fraction']:.4f} | {hf['fraction']:.4f} | {hz['fraction']:.4f} | "
                f"{pm_txt} | {ind:,} | {ratio} | {any_base['uniform']['fraction']:.3f} |")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "numpy": np.__version__,
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}


def probe(args: argparse.Namespace) -> None:
    k = 50
    database(12, 10**6, k)
    tasks = [("probe", {"bits": 12, "n0": 10**6, "checkpoints": k, "accounting": "zcdp",
                        "cap": int(c), "per_checkpoint": args.probe})
             for c in args.probe_caps.split(",")]
    ctx = multiprocessing.get_context("fork")
    with cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        runs = list(pool.map(_run, tasks))
    ind = independent_capacity(database(12, 10**6, k).ts, "zcdp")
    out = {"machine": machine(), "independent_gaussian_capacity": ind, "runs": runs}
    Path(RESULTS_DIR / "issue7-pmwg-zcdp-probe.json").write_text(
        json.dumps(out, indent=1, default=float))
    for r in runs:
        st = r["stats"]
        print(f"| zcdp, cap {r['cap']} | {r['queries']:,} | {r['fraction']:.4f} | "
              f"{st['kinds']['hard']:,} | {st['spent']:.3g} of {r['budget']:.3g} | "
              f"{st['hard_by_tenth'][-1] / max(1, st['asked_by_tenth'][-1]):.3%} | "
              f"{r['seconds']:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run, writes nothing")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "issue7-pmwg-capacity.json"))
    parser.add_argument("--probe", type=int, metavar="M",
                        help="instead: one zCDP PMWG run with M queries per checkpoint "
                             "(N = 2^12, n0 = 10^6), for each --probe-caps; writes "
                             "issue7-pmwg-zcdp-probe.json")
    parser.add_argument("--probe-caps", default="20000,80000")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.probe:
        probe(args)
        return
    tasks, cfg = plan(args.quick)
    # build every database before forking, so the workers share them
    for _, a in tasks:
        database(a["bits"], a["n0"], a["checkpoints"])
    print(f"databases ready ({time.perf_counter() - started:.0f} s); {len(tasks)} tasks",
          file=sys.stderr)
    results: dict[str, Any] = {"settings": {**cfg, "alpha": ALPHA, "epsilon": EPSILON,
                                            "delta": DELTA, "rho": rho_budget(),
                                            "target": TARGET, "shares": SHARES},
                               "machine": machine(), "pmwg": [], "baselines": []}
    ctx = multiprocessing.get_context("fork")
    with cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        for (kind, _), out in zip(tasks, pool.map(_run, tasks), strict=True):
            results["pmwg" if kind == "pmwg" else "baselines"].append(out)
    results["seconds"] = time.perf_counter() - started
    if not args.quick:  # written before the report, so a report bug loses nothing
        Path(args.out).write_text(json.dumps(results, indent=1, default=float))
    text = report(results)
    print(text)
    print(f"total {results['seconds']:.0f} s", file=sys.stderr)
    if not args.quick:
        results["markdown"] = text
        Path(args.out).write_text(json.dumps(results, indent=1, default=float))
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
