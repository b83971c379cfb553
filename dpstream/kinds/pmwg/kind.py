"""The PMWG flow kind: adaptive linear queries answered privately over a growing database.

Two input topics feed the shared step clock: the **events** topic (the growing database:
JSON objects with the universe's attributes and an event time) and the **queries** topic (the
analyst: ``{"id": ..., "histogram": ..., "query": {dpstream.query/1}}``, placed at its broker
time). Each configured histogram (``[[histograms]]``) is one mechanism instance, on the shard
of its name (histograms are spread over workers like keys). When a step closes:

1. the step's events are added to the histogram's true counts;
2. the **public size** ``t`` is stepped: a continual counter (binary tree, or BLT under
   zCDP; ``size_epsilon`` / ``size_rho``) releases the number of events, and
   ``t = max(previous t, floor(estimate + 1e-9))``. The exact size would reveal whether one event is
   in the database (add/remove neighbours), so PMWG runs on this public, monotone size: the
   paper's proofs only need ``Δ_t = 1/t`` for the queries, which holds for
   ``f(D) = Σ w_i count_i / t`` with a public ``t``;
3. the step's queries are answered **in a fixed order** (input partition, then offset), each
   against the database of all steps up to this one — never against whatever Bytewax happened
   to interleave, so a replay reproduces every answer byte for byte (same noise coordinates).

Mechanisms: ``pmwg`` (:mod:`dpstream.core.pmwg.mechanism`, Algorithm 1 of the paper) and
``histogram`` (BBScheduler, Algorithm 4, over a noisy-histogram black box;
:mod:`dpstream.core.pmwg.bb_scheduler`): which to use is a matter of ``N`` against ``α·ε·t``
(docs/pmwg.md, "PMWG or a noisy histogram?").

Privacy: the unit is one event. An event is in every histogram's database, so the flow's
cost per event is the sum over histograms of each one's size counter and mechanism cost;
start-up refuses a configuration whose sum exceeds ``privacy.budget``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import bytewax.operators as op
import numpy as np
import orjson
from bytewax.dataflow import Stream

from dpstream import schemas
from dpstream.config import FlowConfig, Section, build_spec, parse_common, positive
from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger, approx_dp
from dpstream.core.counting.blt_counter import BltCounter, BltCounterSpec
from dpstream.core.counting.tree_counter import TreeCounter, TreeCounterSpec
from dpstream.core.noise.coordinates import parameter_digest
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.pmwg.attributes import UniverseError
from dpstream.core.pmwg.bb_scheduler import BBScheduler, BBSchedulerSpec
from dpstream.core.pmwg.blackboxes import HistogramSynopsis, NoisyHistogram
from dpstream.core.pmwg.guarantee import accuracy_guarantee
from dpstream.core.pmwg.mechanism import Answer, Pmwg
from dpstream.core.pmwg.queries import LinearQuery
from dpstream.core.pmwg.query_compiler import QueryCompiler
from dpstream.core.pmwg.query_parser import QueryError
from dpstream.core.pmwg.spec import PmwgSpec
from dpstream.core.pmwg.universe import Universe
from dpstream.errors import ConfigError, InvalidParameterError
from dpstream.kind import ClockFactory, FlowKind, FlowParts
from dpstream.kinds.pmwg.metrics import register_metrics
from dpstream.messages import DeadLetter, Encoded, RawBatch, RawMessage
from dpstream.metrics import FlowMetrics
from dpstream.stream.barrier import MechanismShard
from dpstream.stream.clock import ShardUpdate, StepClock, bad_time, event_seconds
from dpstream.stream.operators import stepped_shards
from dpstream.stream.sharding import shard_of

__all__ = ["HistogramConfig", "KIND", "PmwgConfig"]

_SIZE_FLOOR_SLACK: Final = 1e-9  # see _Histogram.add
TOPICS: Final = {"input_topic": "events", "queries_topic": "queries",
                 "answers_topic": "answers", "dead_letter_topic": "dead-letters"}
MAX_QUERY_ID: Final = 256
MECHANISMS: Final = ("pmwg", "histogram")


# -- configuration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HistogramConfig:
    """One histogram: its universe, its mechanism and its share of the budget."""

    name: str
    mechanism: str
    universe: Universe
    size: TreeCounterSpec | BltCounterSpec
    n: int
    """The starting size: questions wait until the public size reaches it."""
    pmwg: PmwgSpec | None = None
    """PMWG's parameters (with ``mechanism = "pmwg"``)."""
    scheduler: BBSchedulerSpec | None = None
    """BBScheduler's parameters (with ``mechanism = "histogram"``)."""

    @property
    def size_cost(self) -> float:
        """What the size counter costs, in the ledger unit (epsilon, or rho under zCDP)."""
        s = self.size
        return float(s.epsilon if isinstance(s, TreeCounterSpec) else s.rho)

    @property
    def charges(self) -> list[PrivacyCharge]:
        """What one event can cost in this histogram (size counter, then the mechanism)."""
        if self.scheduler is not None:
            unit = "epsilon" if self.scheduler.accounting == "pure" else "rho"
            return [self.size.charge, PrivacyCharge(label="BBScheduler (noisy histogram)",
                                                    **{unit: self.scheduler.budget})]
        assert self.pmwg is not None
        return [self.size.charge, self.pmwg.worst_case_charge()]

    @property
    def digest(self) -> str:
        """The parameters a flow instance binds (universe, size counter, mechanism)."""
        s = self.size
        size = (f"tree:{s.epsilon!r}:{s.horizon}" if isinstance(s, TreeCounterSpec)
                else f"blt:{s.rho!r}:{s.horizon}")
        mechanism = (self.pmwg.digest if self.pmwg is not None
                     else repr(sorted(self.scheduler.to_dict().items())))  # type: ignore[union-attr]
        return parameter_digest(self.name, self.mechanism, self.universe.digest(), size,
                                mechanism)


@dataclass(frozen=True, kw_only=True)
class PmwgConfig(FlowConfig):
    """The whole configuration of a PMWG flow."""

    accounting: str
    budget: float
    delta: float
    histograms: tuple[HistogramConfig, ...]

    @property
    def mechanisms_digest(self) -> str:
        """One digest of every histogram's parameters (what a resume must not change)."""
        return parameter_digest(self.accounting, *(h.digest for h in self.histograms))

    def ledger(self) -> PrivacyLedger:
        """A ledger of one event's cost over all histograms (checked at start-up)."""
        return PrivacyLedger(self.accounting, self.budget,  # type: ignore[arg-type]
                             self.delta)

    def describe(self) -> str:
        """A human summary of the privacy guarantee and of each histogram's guarantees."""
        ledger = self.ledger()
        for h in self.histograms:
            for charge in h.charges:
                ledger.charge(charge)
        lines = [f"flow {self.name!r} (pmwg): one step = {self.step_seconds:g} s from "
                 f"{self.origin.isoformat()}",
                 self.describe_clock(),
                 f"privacy unit: one event; accounting {self.accounting}; per-event budget "
                 f"{ledger.budget:g} {ledger.unit}, committed at most {ledger.spent:.6g} "
                 f"{ledger.unit} over {len(self.histograms)} histogram(s)"]
        if self.accounting == "zcdp":
            lines.append(f"as (epsilon, delta): ({ledger.epsilon_spent(self.delta):.4g}, "
                         f"{self.delta:g})")
        for h in self.histograms:
            lines.append(f"histogram {h.name!r}: {h.mechanism}, N = {h.universe.size} cells "
                         f"({' x '.join(str(d) for d in h.universe.shape)}), size counter "
                         f"{h.size_cost:g}"
                         f" {ledger.unit}")
            lines.append("  " + which_mechanism(h.universe.size, h.n,
                                                h.pmwg.epsilon if h.pmwg is not None
                                                else h.scheduler.epsilon,  # type: ignore

                                                h.pmwg.alpha if h.pmwg else 0.05))
            if h.pmwg is not None:
                lines.extend("  " + line for line in accuracy_guarantee(h.pmwg).lines())
            elif h.scheduler is not None:
                lines.append(f"  BBScheduler over a noisy histogram: gamma = "
                             f"{h.scheduler.gamma:.4g}, every answer within "
                             f"{h.scheduler.accuracy(h.n):.4g} with probability "
                             f"{1 - h.scheduler.beta:g} (Theorem 27), first release at t = "
                             f"{h.n}")
        return "\n".join(lines)


def which_mechanism(universe_size: int, n: int, epsilon: float, alpha: float) -> str:
    """Which mechanism suits a histogram (docs/pmwg.md, "PMWG or a noisy histogram?").

    A noisy histogram answers every question, with an error that grows like the square root
    of the cells a question covers: at most ``sqrt(N)`` noise standard deviations of
    ``sqrt(2)/epsilon`` events over ``t``. When that is far below ``alpha`` at the starting
    size (``sqrt(N) * sqrt(2) / epsilon << alpha * n``) it wins outright; otherwise PMWG, whose
    error does not grow with ``N``, answers more questions for the same budget.
    """
    histogram_error = math.sqrt(universe_size) * math.sqrt(2.0) / (epsilon * n)
    ratio = histogram_error / alpha
    verdict = ("the noisy histogram ('histogram') answers everything within alpha"
               if ratio < 0.25 else
               "PMWG ('pmwg'): a noisy histogram's error would exceed alpha on large queries"
               if ratio > 1 else "either: compare both with bench/pmwg_capacity.py")
    return (f"which mechanism: sqrt(N) sqrt(2) / (epsilon n) = {histogram_error:.3g} against "
            f"alpha = {alpha:g} -> {verdict}")


def _histogram(section: Section, accounting: str, delta: float) -> HistogramConfig:
    name = section.get("name", None, str)
    if not name or not all(c.isalnum() or c in "_.-" for c in name) or len(name) > 64:
        raise ConfigError(f"{section.where('name')} must be 1-64 characters of "
                          f"[A-Za-z0-9_.-], got {name!r}")
    mechanism = section.get("mechanism", "pmwg", str)
    if mechanism not in MECHANISMS:
        raise ConfigError(f"{section.where('mechanism')} must be one of "
                          f"{', '.join(MECHANISMS)}, got {mechanism!r}")
    try:
        universe = Universe.from_spec(section.get("universe", None, list),
                                      section.where("universe"))
    except UniverseError as exc:
        raise ConfigError(str(exc)) from None
    horizon = section.get("size_horizon", 2**20, int)
    if accounting == "pure":
        size: Any = build_spec(TreeCounterSpec, section.where("size_epsilon"),
                               epsilon=positive(section.get("size_epsilon", 0.1, float),
                                                section.where("size_epsilon")),
                               horizon=horizon)
    else:
        size = build_spec(BltCounterSpec, section.where("size_rho"),
                          rho=positive(section.get("size_rho", 0.005, float),
                                       section.where("size_rho")), horizon=horizon)
    section.used.update({"size_epsilon", "size_rho"})
    where = f"[histograms] {name!r}"
    epsilon = positive(section.get("epsilon", 0.9, float), section.where("epsilon"))
    beta = section.get("beta", 0.05, float)
    n = section.get("n", 1000, int)
    pure_delta = delta if accounting == "zcdp" else 0.0
    if mechanism == "histogram":
        for unused in ("alpha", "p", "mode", "hard_queries", "threshold"):
            if unused in section.data:
                raise ConfigError(f"{section.where(unused)} is a PMWG setting; mechanism = "
                                  "'histogram' does not use it")
        section.finish()
        scheduler = build_spec(BBSchedulerSpec.for_black_box, where,
                               black_box=NoisyHistogram(universe.size), epsilon=epsilon,
                               beta=beta, n=n, delta=pure_delta)
        return HistogramConfig(name, mechanism, universe, size, n, scheduler=scheduler)
    pmwg = build_spec(
        PmwgSpec, where, epsilon=epsilon, delta=pure_delta,
        alpha=section.get("alpha", 0.05, float), beta=beta, n=n, universe_size=universe.size,
        p=section.get("p", 0.5, float), accounting=accounting,
        mode=section.get("mode", "practical", str),
        hard_query_cap=section.get("hard_queries", None, int),
        threshold=section.get("threshold", None, float))
    section.finish()
    return HistogramConfig(name, mechanism, universe, size, n, pmwg=pmwg)


def parse_config(raw: dict[str, Any], source: str = "<dict>") -> PmwgConfig:
    """Validate a PMWG configuration (as read from TOML)."""
    fields, tables = parse_common(
        raw, source, kind_tables=frozenset({"privacy", "histograms"}), topics=TOPICS,
        origin_required=("for a pmwg flow: every histogram's size counter steps from step 0, "
                         "which starts at the origin (set it near the deployment time, e.g. "
                         "origin = '2026-11-20T00:00:00Z')"))
    tables["events"].finish()
    privacy = tables["privacy"]
    accounting = privacy.get("accounting", "pure", str)
    if accounting not in ("pure", "zcdp"):
        raise ConfigError(f"privacy.accounting must be 'pure' or 'zcdp', got {accounting!r}")
    budget = positive(privacy.get("budget", 1.0, float), "privacy.budget")
    delta = privacy.get("delta", 1e-6, float)
    if not 0 <= delta < 1 or (accounting == "zcdp" and delta == 0):
        raise ConfigError(f"privacy.delta must be in [0, 1) (and > 0 with zcdp), got {delta!r}")
    privacy.finish()
    entries = raw.get("histograms")
    if not isinstance(entries, list) or not entries:
        raise ConfigError("a pmwg flow needs at least one [[histograms]] table "
                          "(name, universe, epsilon, alpha, n, ...)")
    histograms = tuple(_histogram(Section(entry, f"histograms[{i}]"), accounting, delta)
                       for i, entry in enumerate(entries))
    names = [h.name for h in histograms]
    if len(set(names)) != len(names):
        raise ConfigError(f"histogram names must differ, got {names}")
    config = PmwgConfig(accounting=accounting, budget=budget, delta=delta,
                        histograms=histograms, **fields)
    ledger = config.ledger()
    for h in histograms:
        for charge in h.charges:
            if not ledger.can_afford(charge):
                raise ConfigError(
                    f"privacy.budget = {budget:g} {ledger.unit} per event cannot pay for every "
                    f"histogram: {h.name!r} needs {float(ledger.cost_of(charge)):.6g} for "
                    f"{charge.label} with {float(ledger.remaining):.6g} left (an event is in "
                    "every histogram, so their costs add); raise the budget or lower the "
                    "histograms' epsilon / size_epsilon")
            ledger.charge(charge)
    return config


# -- records in: the clock's decoding ------------------------------------------------------


class PmwgClock(StepClock):
    """Decodes events into one cell per histogram, and queries into pending questions."""

    def __init__(self, config: PmwgConfig, bases: Mapping[str, int],
                 state: dict[str, Any] | None = None) -> None:
        super().__init__(config, state)
        self.config = config
        self.queries_topic = config.kafka.topic("queries_topic")
        self.bases = bases
        self.first_query_partition = bases.get(self.queries_topic, 1 << 30)
        self.shard_of = [shard_of(h.name, config.shards) for h in config.histograms]
        self.names = {h.name: i for i, h in enumerate(config.histograms)}
        self._cells: np.ndarray = np.empty((len(config.histograms), 0), dtype=np.int64)

    def dead_letter(self, reason: str, message: RawMessage) -> DeadLetter:
        """Dead letters name the Kafka partition of their topic."""
        partition, raw, offset, topic, _, _ = message
        return DeadLetter(reason, raw or b"", topic, partition - self.bases.get(topic or "", 0),
                          offset)

    def decode(self, partition: int, messages: RawBatch, dead: list[DeadLetter]
               ) -> tuple[list[Any] | np.ndarray, np.ndarray | list[float], range | list[int]]:
        """Events: their cells in every histogram; queries: id, histogram and body."""
        if partition >= self.first_query_partition:
            return self._decode_queries(messages, dead)
        return self._decode_events(messages, dead)

    def _decode_events(self, messages: RawBatch, dead: list[DeadLetter]
                       ) -> tuple[list[Any], np.ndarray | list[float], list[int]]:
        time_field = self.config.time_field
        records: list[dict[str, Any]] = []
        times: list[float] = []
        refs: list[int] = []
        for i, message in enumerate(messages):
            try:
                record = orjson.loads(message[1]) if message[1] is not None else None
            except orjson.JSONDecodeError:
                dead.append(self.dead_letter("invalid JSON", message))
                continue
            if not isinstance(record, dict):
                dead.append(self.dead_letter("not a JSON object", message))
                continue
            ts = event_seconds(record.get(time_field))
            if ts is None:
                dead.append(self.dead_letter(bad_time(time_field), message))
                continue
            records.append(record)
            times.append(ts)
            refs.append(i)
        fits = np.ones(len(records), dtype=bool)
        columns = []
        reasons: dict[int, str] = {}
        for h in self.config.histograms:
            cells, failures = h.universe.cells(records)
            full = np.full(len(records), -1, dtype=np.int64)
            bad = np.zeros(len(records), dtype=bool)
            for j, reason in failures:
                bad[j] = True
                reasons.setdefault(j, f"histogram {h.name!r}: {reason}")
            full[~bad] = cells
            fits &= ~bad
            columns.append(full)
        for j in np.flatnonzero(~fits).tolist():
            dead.append(self.dead_letter(
                f"the event does not fit the universe of {reasons[j]}", messages[refs[j]]))
        keep = np.flatnonzero(fits)
        self._cells = (np.stack(columns)[:, keep] if columns
                       else np.empty((0, len(keep)), dtype=np.int64))
        return (list(range(len(keep))), [times[j] for j in keep.tolist()],
                [refs[j] for j in keep.tolist()])

    def _decode_queries(self, messages: RawBatch, dead: list[DeadLetter]
                        ) -> tuple[list[Any], np.ndarray | list[float], list[int]]:
        payloads: list[Any] = []
        times: list[float] = []
        refs: list[int] = []
        for i, message in enumerate(messages):
            partition, raw, offset, _, broker_ms, _ = message
            try:
                body: Any = orjson.loads(raw) if raw is not None else None
            except orjson.JSONDecodeError:
                dead.append(self.dead_letter("invalid JSON", message))
                continue
            reason = _query_envelope_problem(body, self.names)
            if reason is not None:
                dead.append(self.dead_letter(reason, message))
                continue
            payloads.append(("q", partition, offset, body["histogram"], body["id"],
                             body["query"]))
            times.append(broker_ms / 1000.0)  # asked at its record timestamp (broker or producer)
            refs.append(i)
        return payloads, times, refs

    def route(self, payloads: list[Any] | np.ndarray, steps: int | list[int]
              ) -> list[dict[int, Any]]:
        """Per shard and step: cell counts per histogram, and the questions asked."""
        per_shard: list[dict[int, Any]] = [{} for _ in range(self.config.shards)]
        if not payloads:
            return per_shard
        step_array = (np.full(len(payloads), steps, dtype=np.int64) if isinstance(steps, int)
                      else np.asarray(steps, dtype=np.int64))
        if isinstance(payloads[0], tuple):  # questions
            for payload, step in zip(payloads, step_array.tolist(), strict=True):
                shard = self.shard_of[self.names[payload[3]]]
                bucket = per_shard[shard].setdefault(step, {"cells": {}, "queries": []})
                bucket["queries"].append(payload[1:])
            return per_shard
        rows = np.asarray(payloads, dtype=np.int64)
        for h, (name, shard) in enumerate(zip(self.names, self.shard_of, strict=True)):
            cells = self._cells[h, rows]
            for step in np.unique(step_array).tolist():
                values, counts = np.unique(cells[step_array == step], return_counts=True)
                bucket = per_shard[shard].setdefault(step, {"cells": {}, "queries": []})
                bucket["cells"][name] = dict(zip(values.tolist(), counts.tolist(),
                                                 strict=True))
        return per_shard


def _query_envelope_problem(body: Any, names: dict[str, int]) -> str | None:
    """Why a record cannot be a question at all (a dead letter), or None."""
    if not isinstance(body, dict):
        return "not a JSON object"
    qid = body.get("id")
    if not isinstance(qid, str) or not qid or len(qid) > MAX_QUERY_ID:
        return f"field 'id' missing or not a non-empty string of at most {MAX_QUERY_ID} characters"
    histogram = body.get("histogram")
    if not isinstance(histogram, str) or histogram not in names:  # a list is unhashable
        return f"field 'histogram' must name a configured histogram ({', '.join(names)})"
    if not isinstance(body.get("query"), dict):
        return "field 'query' missing or not a JSON object (dpstream.query/1)"
    return None


# -- steps: the shard ------------------------------------------------------------------------


@dataclass(frozen=True)
class AnswerRecord:
    """One published answer (before encoding)."""

    histogram: str
    mechanism: str
    query_id: str
    step: int
    t: int
    kind: str
    value: float | list[float | None] | None
    kinds: list[str] | None
    reason: str | None
    spent: float
    budget: float
    hard_queries: int


class _ScheduledHistogram:
    """The ``histogram`` mechanism: BBScheduler (Algorithm 4) re-releasing a noisy histogram.

    Every question is answered from the current epoch's noisy histogram (post-processing:
    any number of questions, no further cost); the histogram is re-released when the public
    size reaches the next epoch start ``(1 + gamma)^i n``.
    """

    def __init__(self, config: HistogramConfig, noise: NoiseKey, coords: tuple[Any, ...],
                 state: dict[str, Any] | None) -> None:
        assert config.scheduler is not None
        box = NoisyHistogram(config.universe.size)
        coords = (*coords, "bbscheduler")
        self.scheduler = (BBScheduler(config.scheduler, box, noise, coords) if state is None
                          else BBScheduler.from_state(state, config.scheduler, box, noise,
                                                      coords))
        self.hard_queries = 0

    @property
    def ledger(self) -> PrivacyLedger:
        """What the scheduler has spent."""
        return self.scheduler.ledger

    def to_state(self) -> dict[str, Any]:
        return self.scheduler.to_state()

    def answer(self, query: LinearQuery, counts: np.ndarray, t: int) -> Answer:
        """Observe a new size (maybe a new epoch's release), then answer from the synopsis."""
        if self.scheduler.last_t != t:
            self.scheduler.observe(counts, t)
        synopsis = self.scheduler.synopsis
        if isinstance(synopsis, HistogramSynopsis):  # the fast path: over the support only
            value = query.weighted_sum(np.asarray(synopsis.values, dtype=np.float64))
        else:
            value = self.scheduler.answer(query.dense_weights(), t)
        return Answer(value, "easy", None, t, self.ledger.spent, 0)


def _mechanism(config: HistogramConfig, noise: NoiseKey, coords: tuple[Any, ...],
               state: dict[str, Any] | None) -> Any:
    if config.scheduler is not None:
        return _ScheduledHistogram(config, noise, coords, state)
    assert config.pmwg is not None  # a histogram without a scheduler runs PMWG
    return Pmwg(config.pmwg, noise, (*coords, "pmwg"), state)


class _Histogram:
    """One histogram's true counts, public size, size counter and mechanism."""

    def __init__(self, config: HistogramConfig, noise: NoiseKey, coords: tuple[Any, ...],
                 state: dict[str, Any] | None) -> None:
        self.config = config
        size_coords = (*coords, "size")
        counter_class: Any = TreeCounter if isinstance(config.size, TreeCounterSpec) \
            else BltCounter
        self.compiler = QueryCompiler(config.universe)
        if state is None:
            self.counts = np.zeros(config.universe.size, dtype=np.int64)
            self.t = 0
            self.size = counter_class(config.size, noise, size_coords)
            self.mechanism = _mechanism(config, noise, coords, None)
        else:
            self.counts = np.frombuffer(zlib.decompress(state["counts"]),
                                        dtype=np.int64).copy()
            self.t = state["t"]
            self.size = counter_class(config.size, noise, size_coords, state["size"])
            self.mechanism = _mechanism(config, noise, coords, state["mechanism"])

    def to_state(self) -> dict[str, Any]:
        return {"counts": zlib.compress(self.counts.tobytes(), 1), "t": self.t,
                "size": self.size.to_state(), "mechanism": self.mechanism.to_state()}

    def add(self, cells: dict[int, int] | None) -> None:
        """Add a step's events and step the size counter (every step, events or not)."""
        increment = 0
        if cells:
            index = np.fromiter(cells.keys(), dtype=np.int64, count=len(cells))
            amounts = np.fromiter(cells.values(), dtype=np.int64, count=len(cells))
            np.add.at(self.counts, index, amounts)
            increment = int(amounts.sum())
        estimate = self.size.step(increment)
        # the tree's Honaker combination is float arithmetic: an estimate that is exactly an
        # integer k may come out as k - 1e-14, and floor would then put one event more
        # two sizes apart; the slack keeps t a function of the released estimate alone
        # (post-processing) that moves by at most 1 per event (tests/privacy)
        self.t = max(self.t, math.floor(estimate.value + _SIZE_FLOOR_SLACK))

    def answer(self, query_id: str, query: Any, step: int) -> AnswerRecord:
        """Answer one question (all parts of a marginal in order) against the database."""
        h = self.config
        try:
            parts = self.compiler.compile(query)
        except QueryError as exc:
            return self._record(query_id, step, "error", None, None, str(exc))
        except Exception as exc:  # never a crash for a question (pitfall 16); the type only
            return self._record(query_id, step, "error", None, None,
                                f"the question could not be read ({type(exc).__name__})")
        if self.t < h.n:
            return self._record(query_id, step, "waiting", None, None,
                                f"the public database size t = {self.t} has not reached "
                                f"n = {h.n}")
        try:
            answers = [self.mechanism.answer(part, self.counts, self.t) for part in parts]
        except InvalidParameterError as exc:  # never a crash for a question (withholding the
            return self._record(query_id, step, "error", None, None,  # parts is free)
                                f"the question could not be answered: {exc}")
        if len(answers) == 1 and query.get("kind") != "marginal":
            a = answers[0]
            return self._record(query_id, step, a.kind, a.value, None, a.reason)
        reasons = sorted({a.reason for a in answers if a.reason})
        return self._record(query_id, step, "marginal", [a.value for a in answers],
                            [a.kind for a in answers], "; ".join(reasons) or None)

    def _record(self, query_id: str, step: int, kind: str, value: Any, kinds: Any,
                reason: str | None) -> AnswerRecord:
        ledger = self.mechanism.ledger
        size_cost = self.config.size_cost
        return AnswerRecord(self.config.name, self.config.mechanism, query_id, step, self.t,
                            kind, value, kinds, reason, size_cost + ledger.spent,
                            size_cost + ledger.budget, self.mechanism.hard_queries)


class PmwgShard(MechanismShard):
    """The histograms of one shard: add each step's events, then answer its questions."""

    members_key = "histograms"
    mechanism = "pmwg"

    def names(self) -> list[str]:
        """The configured histograms."""
        return [h.name for h in self.config.histograms]

    def build(self, name: str, coordinates: tuple[Any, ...],
              state: dict[str, Any] | None) -> _Histogram:
        """A histogram and its mechanism (new, or from its snapshot)."""
        config = next(h for h in self.config.histograms if h.name == name)
        return _Histogram(config, self.noise, coordinates, state)

    def merge(self, step: int, bucket: dict[str, Any]) -> None:
        """Add one partition's cells and questions for ``step``."""
        pending = self.pending.setdefault(step, {"cells": {}, "queries": []})
        for name, cells in bucket["cells"].items():
            into = pending["cells"].setdefault(name, {})
            for cell, n in cells.items():
                into[cell] = into.get(cell, 0) + n
        pending["queries"].extend(bucket["queries"])

    def close(self, step: int, bucket: dict[str, Any] | None) -> list[AnswerRecord]:
        """Add the step's events, then answer its questions in (partition, offset) order."""
        bucket = bucket or {"cells": {}, "queries": []}
        for name in sorted(self.members):
            self.members[name].add(bucket["cells"].get(name))
        out = []
        for _, _, name, query_id, query in sorted(bucket["queries"],
                                                  key=lambda q: (q[0], q[1])):
            out.append(self.members[name].answer(query_id, query, step))
        return out


# -- records out -----------------------------------------------------------------------------


class AnswerEncoder:
    """Encodes answers as ``dpstream.answer/1`` records (keyed by histogram)."""

    def __init__(self, config: PmwgConfig, instance: str = "") -> None:
        self.config, self.instance = config, instance

    def encode(self, a: AnswerRecord) -> Encoded:
        """One answer record on the answers topic."""
        config = self.config
        approx = None
        if config.accounting == "zcdp":
            epsilon, delta = approx_dp(a.spent, config.delta)  # as check-config prints
            approx = schemas.ApproxDp(epsilon=epsilon, delta=delta)
        record = schemas.Answer(
            flow=config.name, instance=self.instance, histogram=a.histogram,
            mechanism=a.mechanism, id=a.query_id, step=a.step,
            window=schemas.Window.of_steps(config.origin, config.step_seconds, a.step),
            t=a.t, kind=a.kind, value=_clamp(a.value), reason=a.reason,
            hard_queries=a.hard_queries,
            privacy=schemas.Privacy(unit="event", accounting=config.accounting, spent=a.spent,
                                    budget=a.budget, approx_dp=approx),
            kinds=None if a.kinds is None else tuple(a.kinds))
        return "answers", a.histogram.encode(), schemas.encode(record)


def _clamp(value: Any) -> Any:
    """Answers are fractions: clamping into [0, 1] is post-processing (free, never worse)."""
    if isinstance(value, list):
        return tuple(_clamp(v) for v in value)
    return None if value is None else min(1.0, max(0.0, float(value)))




# -- the kind --------------------------------------------------------------------------------


def _declare_budgets(metrics: FlowMetrics, config: PmwgConfig) -> None:
    """Publish the flow's kind and each histogram's budget (size counter + mechanism)."""
    metrics.set_kind("pmwg")
    unit = "epsilon" if config.accounting == "pure" else "rho"
    for h in config.histograms:
        spec: PmwgSpec | BBSchedulerSpec | None = h.pmwg if h.pmwg is not None else h.scheduler
        assert spec is not None
        metrics.set_budget(h.mechanism, unit, h.size_cost + spec.new_ledger().budget, h.name)


class PmwgKind:
    """The PMWG flow kind (see the module docstring)."""

    name: Final[str] = "pmwg"
    inputs: Final[tuple[str, ...]] = ("input_topic", "queries_topic")
    outputs: Final[Mapping[str, str]] = {"answers": "answers_topic",
                                         "dead_letters": "dead_letter_topic"}
    topics: Final[Mapping[str, str]] = TOPICS

    def parse_config(self, raw: dict[str, Any], source: str) -> PmwgConfig:
        """Validate a PMWG configuration."""
        return parse_config(raw, source)

    def binding(self, config: PmwgConfig) -> PmwgConfig:
        """What a flow instance binds (the histograms' digest)."""
        return config

    def clock(self, config: PmwgConfig, bases: Mapping[str, int]) -> ClockFactory:
        """The clock factory: events and queries partitions, numbered by ``bases``."""
        return lambda state: PmwgClock(config, bases, state)

    def wire(self, parts: FlowParts[PmwgConfig], updates: Stream[tuple[str, ShardUpdate]]
             ) -> Stream[Encoded]:
        """Histogram shards answering questions step by step, encoded as answer records."""
        config = parts.config
        metrics = parts.metrics
        if metrics is not None:
            _declare_budgets(metrics, config)
        answers = stepped_shards(
            "histograms", updates,
            lambda state: PmwgShard(config, parts.noise, parts.instance, parts.partitions,
                                    state),
            metrics, register_metrics(metrics).observe_answers if metrics is not None else None)
        return op.map("encode", answers, AnswerEncoder(config, parts.instance).encode)


KIND: Final[FlowKind[PmwgConfig, PmwgConfig, Encoded]] = PmwgKind()
