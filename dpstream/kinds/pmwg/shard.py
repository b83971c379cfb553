"""One shard of the PMWG flow's histograms: each step's events added, then its questions answered.

:class:`PmwgShard` is a :class:`~dpstream.stream.barrier.MechanismShard` over the histograms
of its shard. Each histogram keeps its true counts, its public size ``t`` (from a continual
size counter) and its mechanism (PMWG, or BBScheduler over a noisy histogram); closing a step
adds the step's events, steps the size counter, then answers the step's questions in
(partition, offset) order as :class:`AnswerRecord` objects (see :mod:`dpstream.kinds.pmwg.kind`).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from dpstream.core.accounting.ledger import PrivacyLedger
from dpstream.core.counting.blt_counter import BltCounter
from dpstream.core.counting.tree_counter import TreeCounter, TreeCounterSpec
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.pmwg.bb_scheduler import BBScheduler
from dpstream.core.pmwg.blackboxes import HistogramSynopsis
from dpstream.core.pmwg.mechanism import Answer, Pmwg
from dpstream.core.pmwg.queries import LinearQuery
from dpstream.core.pmwg.query_compiler import QueryCompiler
from dpstream.core.pmwg.query_parser import QueryError
from dpstream.errors import InvalidParameterError
from dpstream.kinds.pmwg.config import HistogramConfig
from dpstream.stream.barrier import MechanismShard

__all__ = ["AnswerRecord", "PmwgShard"]

_SIZE_FLOOR_SLACK: Final = 1e-9  # see _Histogram.add


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
        box = config.box()  # at L1 sensitivity max_rows at the user level
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
