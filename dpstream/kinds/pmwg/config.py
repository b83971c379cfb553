"""The PMWG flow's configuration: its histograms, their mechanisms and the event budget.

:func:`parse_config` validates the kind's tables (``[privacy]`` and ``[[histograms]]``) on top
of the shared ones, and refuses a configuration whose histograms cost more per event than
``privacy.budget`` (an event is in every histogram, so their costs add). What the flow does
with it: :mod:`dpstream.kinds.pmwg.kind`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

from dpstream.config import FlowConfig, Section, build_spec, parse_common, positive
from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger
from dpstream.core.counting.blt_counter import BltCounterSpec
from dpstream.core.counting.tree_counter import TreeCounterSpec
from dpstream.core.noise.coordinates import parameter_digest
from dpstream.core.pmwg.attributes import UniverseError
from dpstream.core.pmwg.bb_scheduler import BBSchedulerSpec
from dpstream.core.pmwg.blackboxes import NoisyHistogram
from dpstream.core.pmwg.guarantee import accuracy_guarantee
from dpstream.core.pmwg.spec import PmwgSpec
from dpstream.core.pmwg.universe import Universe
from dpstream.errors import ConfigError

__all__ = ["HistogramConfig", "MECHANISMS", "PmwgConfig", "TOPICS", "parse_config",
           "which_mechanism"]

TOPICS: Final = {"input_topic": "events", "queries_topic": "queries",
                 "answers_topic": "answers", "dead_letter_topic": "dead-letters"}
MECHANISMS: Final = ("pmwg", "histogram")


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
        raw, source, kind_tables=frozenset({"privacy", "histograms"}), topics=TOPICS, caps=("max_rows",),
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
