"""The PMWG flow's configuration: its histograms, their mechanisms and the event budget.

:func:`parse_config` validates the kind's tables (``[privacy]`` and ``[[histograms]]``) on top
of the shared ones, and refuses a configuration whose histograms cost more per event than
``privacy.budget`` (an event is in every histogram, so their costs add). What the flow does
with it: :mod:`dpstream.kinds.pmwg.kind`.

**The user level** (``[contribution] unit = "user"``, cap ``max_rows = m`` per period). The
bounding stage keeps each person's first ``m`` rows of the period (in step, partition, offset
order) and drops the rest, so, per period, *one person adds at most m rows to the database*,
and every row is in **every** histogram (one event is one row of each: the decoder places it
in each universe, or nowhere). Each configured privacy parameter then means what one person
costs in that histogram:

* *the public size counter* counts rows: one person moves its increments by at most ``m`` in
  L1, so its spec gets ``sensitivity = m`` (tree: discrete Laplace scale ``m (levels) /
  epsilon``; BLT: ``sigma`` times ``m``) and still charges ``size_epsilon`` / ``size_rho``
  (the counters' module docstrings derive it); the public size ``t`` then moves by at most
  ``m`` per person, which nothing needs (``t`` is a post-processing of the counter);
* *PMWG*: a query value ``sum w_i count_i / t`` (``w_i`` in ``[0, 1]``, ``t`` public) moves
  by at most ``m / t``; :class:`~dpstream.core.pmwg.spec.PmwgSpec` with ``sensitivity = m``
  divides ``xi`` by ``m`` and computes every round's cost and the worst case with
  ``Delta_t = m / t`` (:mod:`dpstream.core.pmwg.worst_case`), so ``epsilon`` is one
  person's cost;
* *the noisy histogram* (``mechanism = "histogram"``): L1 sensitivity ``m``, each cell's noise
  ``DLap(m / epsilon_i)`` (:class:`~dpstream.core.pmwg.blackboxes.NoisyHistogram`), the
  scheduler's charges unchanged.

*Per person, in all.* A person's kept rows are in every histogram, and nothing else of theirs
enters the flow, so the flow is the adaptive composition of the histograms' mechanisms on
inputs that each move by at most one person's ``m`` rows: the per-person total is the **sum
over histograms** of (size counter + mechanism) — exactly what the flow ledger sums and
``privacy.budget`` caps, now per person (pure: ``epsilon``; zCDP: ``rho``, reported as
``(epsilon, delta)`` with ``privacy.delta``). The stage routes people by a keyed 128-bit hash;
two people who collide share one cap, which is accounted as a ``delta`` of at most
``people x 2^-128`` (the bounding core's ``collision_delta``; ``2^-64`` at its public bound of
``2^64`` people), added to the total's ``delta``. With
``period`` a whole number of steps the guarantee is per period (the stage forgets the caps when
a period closes). A person active in ``k`` periods has up to ``k m`` rows in the (cumulative)
database, all in the same mechanisms' inputs: that is group privacy over ``k`` per-period
neighbours, ``k epsilon`` under pure accounting
but ``k^2 rho`` under zCDP (Bun & Steinke 2016, Proposition 1.9; every zCDP cost here is
quadratic in the sensitivity, which grows to ``k m``); :meth:`PmwgConfig.describe` says so.
``m = 1`` at the event level: every spec, digest and noise draw is the event level's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

from dpstream.config import FlowConfig, Section, build_spec, parse_common, positive
from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger, approx_dp
from dpstream.core.contribution.people import PEOPLE_BOUND, collision_delta
from dpstream.core.counting import blt_counter, tree_counter
from dpstream.core.counting.blt_counter import BltCounterSpec
from dpstream.core.counting.tree_counter import TreeCounterSpec
from dpstream.core.noise.coordinates import parameter_digest
from dpstream.core.pmwg.attributes import UniverseError
from dpstream.core.pmwg.bb_scheduler import BBSchedulerSpec
from dpstream.core.pmwg.blackboxes import NoisyHistogram
from dpstream.core.pmwg.guarantee import accuracy_guarantee
from dpstream.core.pmwg.sparse_vector import dlap_variance
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
    rows: int = 1
    """The rows one protected unit may add per period (1: an event; ``max_rows``: a person)."""

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

    def box(self) -> NoisyHistogram:
        """The noisy-histogram black box (``mechanism = "histogram"``), at L1 sensitivity m."""
        return NoisyHistogram(self.universe.size, self.rows)

    def noise_std(self) -> dict[str, float]:
        """Each output's noise std at the configured cap (``rows``).

        ``size``: the public size counter's worst estimate std over its first epoch, in rows;
        ``answer``: PMWG's hard-answer noise std at ``t = n`` (fraction units) or the noisy
        histogram's per-cell noise std over ``n`` at its first release (fraction units).
        """
        s = self.size
        size = (tree_counter.worst_step_std(s, s.horizon) if isinstance(s, TreeCounterSpec)
                else blt_counter.worst_step_std(s, s.horizon))
        if self.pmwg is not None:
            answer = accuracy_guarantee(self.pmwg).answer_std_at_n
        else:
            assert self.scheduler is not None
            scale = NoisyHistogram.noise_scale(self.scheduler.epoch_epsilon(0), self.rows)
            answer = math.sqrt(dlap_variance(scale)) / self.n
        return {f"{self.name}.size": size, f"{self.name}.answer": answer}

    @property
    def digest(self) -> str:
        """The parameters a flow instance binds (universe, size counter, mechanism)."""
        s = self.size
        size = (f"tree:{s.epsilon!r}:{s.horizon}" if isinstance(s, TreeCounterSpec)
                else f"blt:{s.rho!r}:{s.horizon}")
        if self.rows != 1:  # the user level's cap scales every noise (the event level's kept)
            size += f":rows={self.rows}"
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

    def mechanisms_hint(self, recorded: object) -> str:
        """What explains a store's other mechanisms digest ``recorded``: nothing to add here."""
        return ""

    @property
    def mechanisms_digest(self) -> str:
        """One digest of every histogram's parameters (what a resume must not change).

        At the user level the contribution table (unit, user field, period, caps) is bound
        too: a store made with other caps or another period is refused.
        """
        if not self.contribution.user_level:
            return parameter_digest(self.accounting, *(h.digest for h in self.histograms))
        c = self.contribution
        caps = ",".join(f"{name}={value}" for name, value in c.caps)
        return parameter_digest(self.accounting, *(h.digest for h in self.histograms),
                                "contribution", c.unit, c.user_field,
                                -1 if c.period_steps is None else c.period_steps, caps)

    def per_person(self) -> dict[str, float]:
        """A person's total over every histogram, per period (the module docstring's bound).

        ``epsilon`` and ``delta`` (pure), or ``rho`` and the ``(epsilon, delta)`` it converts
        to at ``privacy.delta`` (zCDP, :func:`~dpstream.core.accounting.ledger.approx_dp`):
        the sum of every histogram's committed charges (size counter + mechanism; the
        practical mode's budget, which its filter never exceeds). ``delta`` includes the
        bounding's hash-collision delta ``collision_delta(PEOPLE_BOUND) = 2^-64`` (no stream
        holds 2^64 people). At the event level the same sums are one event's, with no
        collision term.
        """
        ledger = self.ledger()
        for h in self.histograms:
            for charge in h.charges:
                ledger.charge(charge)
        collision = (collision_delta(PEOPLE_BOUND) if self.contribution.user_level else 0.0)
        if self.accounting == "pure":
            return {"epsilon": float(ledger.spent), "delta": collision}
        epsilon, delta = approx_dp(float(ledger.spent), self.delta, collision)
        return {"rho": float(ledger.spent), "epsilon": epsilon, "delta": delta}

    def noise_std(self) -> dict[str, float]:
        """Each output's noise std at the configured caps.

        ``HISTOGRAM.size`` and ``HISTOGRAM.answer`` per histogram
        (:meth:`HistogramConfig.noise_std`).
        """
        out: dict[str, float] = {}
        for h in self.histograms:
            out.update(h.noise_std())
        return out

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
                 self.describe_clock()]
        if not self.contribution.user_level:
            lines.append(f"privacy unit: one event; accounting {self.accounting}; per-event "
                         f"budget {ledger.budget:g} {ledger.unit}, committed at most "
                         f"{ledger.spent:.6g} {ledger.unit} over {len(self.histograms)} "
                         "histogram(s)")
        else:
            rows = self.contribution.cap("max_rows")
            lines += [self.contribution.describe(),
                      f"accounting {self.accounting}; per-person budget {ledger.budget:g} "
                      f"{ledger.unit}, committed at most {ledger.spent:.6g} {ledger.unit} "
                      f"over {len(self.histograms)} histogram(s) (a person's {rows} rows are "
                      f"in every histogram: the costs add; each noise is scaled by {rows}), "
                      f"plus a hash-collision delta <= people x 2^-128 (<= "
                      f"{collision_delta(PEOPLE_BOUND):.2g})"]
            if self.accounting == "zcdp" and self.contribution.period_steps is not None:
                lines.append("under zCDP a person active in k periods is protected at k^2 "
                             "times the per-period rho (group privacy: k periods' rows move "
                             "the same cumulative database)")
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

                                                h.pmwg.alpha if h.pmwg else 0.05, h.rows))
            if h.pmwg is not None:
                lines.extend("  " + line for line in accuracy_guarantee(h.pmwg).lines())
            elif h.scheduler is not None:
                lines.append(f"  BBScheduler over a noisy histogram: gamma = "
                             f"{h.scheduler.gamma:.4g}, every answer within "
                             f"{h.scheduler.accuracy(h.n):.4g} with probability "
                             f"{1 - h.scheduler.beta:g} (Theorem 27), first release at t = "
                             f"{h.n}")
            if self.contribution.user_level:
                lines.append("  noise std at the caps: " + ", ".join(
                    f"{name} {std:.4g}" for name, std in h.noise_std().items()))
        return "\n".join(lines)


def which_mechanism(universe_size: int, n: int, epsilon: float, alpha: float,
                    rows: int = 1) -> str:
    """Which mechanism suits a histogram (docs/pmwg.md, "PMWG or a noisy histogram?").

    A noisy histogram answers every question, with an error that grows like the square root
    of the cells a question covers: at most ``sqrt(N)`` noise standard deviations of
    ``sqrt(2)/epsilon`` events over ``t``. When that is far below ``alpha`` at the starting
    size (``sqrt(N) * sqrt(2) / epsilon << alpha * n``) it wins outright; otherwise PMWG, whose
    error does not grow with ``N``, answers more questions for the same budget. At the user
    level both mechanisms' noise grows by ``rows`` (``max_rows``): the comparison is made at
    ``epsilon / rows``.
    """
    if rows != 1:
        epsilon /= rows
    histogram_error = math.sqrt(universe_size) * math.sqrt(2.0) / (epsilon * n)
    ratio = histogram_error / alpha
    verdict = ("the noisy histogram ('histogram') answers everything within alpha"
               if ratio < 0.25 else
               "PMWG ('pmwg'): a noisy histogram's error would exceed alpha on large queries"
               if ratio > 1 else "either: compare both with bench/pmwg_capacity.py")
    return (f"which mechanism: sqrt(N) sqrt(2) / (epsilon n) = {histogram_error:.3g} against "
            f"alpha = {alpha:g} -> {verdict}")


def _histogram(section: Section, accounting: str, delta: float, rows: int) -> HistogramConfig:
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
    scaled: dict[str, Any] = {} if rows == 1 else {"sensitivity": rows}  # max_rows per person
    if accounting == "pure":
        size: Any = build_spec(TreeCounterSpec, section.where("size_epsilon"),
                               epsilon=positive(section.get("size_epsilon", 0.1, float),
                                                section.where("size_epsilon")),
                               horizon=horizon, **scaled)
    else:
        size = build_spec(BltCounterSpec, section.where("size_rho"),
                          rho=positive(section.get("size_rho", 0.005, float),
                                       section.where("size_rho")), horizon=horizon, **scaled)
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
                               black_box=NoisyHistogram(universe.size, rows), epsilon=epsilon,
                               beta=beta, n=n, delta=pure_delta)
        return HistogramConfig(name, mechanism, universe, size, n, scheduler=scheduler,
                               rows=rows)
    pmwg = build_spec(
        PmwgSpec, where, epsilon=epsilon, delta=pure_delta,
        alpha=section.get("alpha", 0.05, float), beta=beta, n=n, universe_size=universe.size,
        p=section.get("p", 0.5, float), accounting=accounting,
        mode=section.get("mode", "practical", str),
        hard_query_cap=section.get("hard_queries", None, int),
        threshold=section.get("threshold", None, float), sensitivity=rows)
    section.finish()
    return HistogramConfig(name, mechanism, universe, size, n, pmwg=pmwg, rows=rows)


def parse_config(raw: dict[str, Any], source: str = "<dict>") -> PmwgConfig:
    """Validate a PMWG configuration (as read from TOML)."""
    fields, tables = parse_common(
        raw, source, kind_tables=frozenset({"privacy", "histograms"}), topics=TOPICS,
        caps=("max_rows",),
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
    rows = fields["contribution"].cap("max_rows")  # 1 at the event level
    histograms = tuple(_histogram(Section(entry, f"histograms[{i}]"), accounting, delta, rows)
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
