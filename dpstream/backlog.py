"""The backlog a ``flow.origin`` in the past implies, and how long closing it takes.

A new flow instance starts at step 0, ``flow.origin``. Once the input partitions have passed
"now", every step from the origin to now can close at once: with the origin 14 hours back and
1 s steps, 50,400 steps, each stepping every declared key (a release per key and step), or
every histogram (PMWG) and model stream (ERM). The shards close such a backlog in chunks that
are written out as they close (:mod:`dpstream.stream.barrier`), so releases start at once,
but the releases are current only when the backlog is done. :func:`estimate` says how big it
is and how long it takes; ``dpstream check-config`` prints it and ``dpstream run`` logs it when
it starts a new flow instance.

**The rate is measured, not guessed.** :func:`estimate` closes steps of the configured
mechanisms in this process, with a throwaway noise key, no events and one shard's share of
the declared keys (at most :data:`SAMPLE_KEYS` of them), for about
:data:`MEASURE_SECONDS`, and encodes their records as the flow does. The estimate is that
rate over every shard on one worker: more workers close shards in parallel, and the Kafka
writes (not measured) add their own time. In an open key universe the keys are not known in
advance: steps without a live key close at no cost, so only the steps are given.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass
from typing import Any, Final

from dpstream.core.noise.keys import NoiseKey

__all__ = ["BacklogEstimate", "estimate"]

MEASURE_SECONDS: Final = 0.3
"""About how long :func:`estimate` measures the configured mechanisms."""
MEASURE_STEPS: Final = 400
"""The most steps it closes to measure."""
SAMPLE_KEYS: Final = 20_000
"""The most declared keys of one shard it measures with (the rate is scaled up beyond)."""
_INSTANCE: Final = "0" * 32  # a throwaway instance for the measurement
_UNITS: Final = {"declared keys": "key-steps", "histograms": "histogram-steps",
                 "model streams": "stream-steps"}


@dataclass(frozen=True)
class BacklogEstimate:
    """The backlog at the start of a new flow instance.

    Attributes:
        steps: steps from ``flow.origin`` to now (closable at once when the input is current).
        members: what each step steps: declared keys, histograms or model streams (None: an
            open key universe, unknown in advance).
        what: what the members are (``declared keys``, ``histograms``, ``model streams``).
        seconds_per_step: the measured time one step of every member takes on one worker
            (None: not measured).
        measured: how it was measured.
    """

    steps: int
    members: int | None
    what: str
    seconds_per_step: float | None = None
    measured: str = ""

    @property
    def member_steps(self) -> int | None:
        """``steps * members``: releases (counters), histogram or model-stream steps."""
        return None if self.members is None else self.steps * self.members

    @property
    def seconds(self) -> float | None:
        """The estimated time to close the backlog on one worker."""
        if self.seconds_per_step is None:
            return None
        return self.steps * self.seconds_per_step

    def describe(self) -> str:
        """One line: ``backlog at start: N steps x K declared keys = M, about T at ...``."""
        if self.steps <= 0:
            return "backlog at start: none (flow.origin is not in the past)"
        text = f"backlog at start: {self.steps:,} steps from flow.origin to now"
        if self.members is None:
            return (text + " (open key universe: steps without a live key close at no cost; "
                    "each admitted key adds one release a step)")
        text += f" x {self.members:,} {self.what} = {self.member_steps:,} to close"
        seconds = self.seconds
        if seconds is not None and self.seconds_per_step:
            rate = (self.members or 1) / self.seconds_per_step
            unit = _UNITS.get(self.what, "steps")
            text += (f"; about {_duration(seconds)} on one worker at the measured "
                     f"{_number(rate)} {unit}/s ({self.measured}; Kafka writes not "
                     "included). Releases start at once, in chunks; they are current when "
                     "it is done")
        return text


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _duration(seconds: float) -> str:
    if seconds < 1:
        return "under a second"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86_400:.1f} days"


def steps_since_origin(config: Any, now: float | None = None) -> int:
    """Steps from ``flow.origin`` to ``now`` (Unix seconds; default: the clock).

    Or to ``flow.end``, if that comes first: steps from its step on never close.
    """
    now = time.time() if now is None else now
    end = getattr(config, "end", None)
    if end is not None:
        now = min(now, end.timestamp())
    return max(0, int(math.floor((now - config.origin.timestamp()) / config.step_seconds)))


def estimate(config: Any, *, now: float | None = None, measure: bool = True
             ) -> BacklogEstimate:
    """The backlog a new instance of ``config``'s flow starts with (see the module docstring).

    Args:
        config: a validated flow configuration (any kind).
        now: the time to count steps to (Unix seconds; default: the clock).
        measure: measure the configured mechanisms' rate (about :data:`MEASURE_SECONDS`).
    """
    steps = steps_since_origin(config, now)
    kind = config.kind
    if kind == "counters":
        layout = config.declared_layout
        keys = None if layout is None else sum(len(layout.keys_of(s)) for s in layout)
        found = BacklogEstimate(steps, keys, "declared keys")
        if measure and keys and steps:
            return _measured(found, *_counters_step_seconds(config))
        return found
    if kind == "pmwg":
        found = BacklogEstimate(steps, len(config.histograms), "histograms")
    elif kind == "erm":
        found = BacklogEstimate(steps, len(config.streams), "model streams")
    else:
        return BacklogEstimate(steps, None, "")
    if measure and steps:
        return _measured(found, *_mechanism_step_seconds(config))
    return found


def _measured(found: BacklogEstimate, seconds: float | None, how: str) -> BacklogEstimate:
    return BacklogEstimate(found.steps, found.members, found.what, seconds, how)


def _timed(close_one: Any) -> tuple[float, int]:
    """Close steps with ``close_one(step)`` for about MEASURE_SECONDS; (seconds, steps)."""
    close_one(0)  # warm up: the ciphers, first allocations
    start = time.perf_counter()
    steps = 0
    while steps < MEASURE_STEPS and (steps < 3 or time.perf_counter() - start < MEASURE_SECONDS):
        steps += 1
        close_one(steps)
    return time.perf_counter() - start, steps


def _counters_step_seconds(config: Any) -> tuple[float | None, str]:
    """Seconds per step of every declared key (one worker), from one shard's share."""
    from dpstream.kinds.counters.kind import statistics_spec
    from dpstream.kinds.counters.records import RecordEncoder
    from dpstream.kinds.counters.shard import ShardState

    layout = config.declared_layout
    shards = [len(layout.keys_of(s)) for s in range(config.shards)]
    largest = max(shards)
    sample = min(largest, SAMPLE_KEYS)
    keys = [f"k{i}" for i in range(sample)]
    noise = NoiseKey(secrets.token_bytes(32))
    shard = ShardState(statistics_spec(config, _INSTANCE), 1, {0: keys}, noise,
                       release_every=config.release_every)
    shard.bind(0)
    encoder = RecordEncoder(config.name, config.origin, config.step_seconds,
                            config.privacy.delta, instance=_INSTANCE)

    def close_one(step: int) -> None:
        list(encoder.encode_step(shard.close(step, None)))

    seconds, steps = _timed(close_one)
    per_step = seconds / steps  # one step of the largest shard (or SAMPLE_KEYS of its keys)
    # each shard at that cost, scaled by its keys beyond the sample (the keys are hashed
    # evenly over the shards: a smaller shard costs about as much, an upper bound)
    total = sum(per_step * max(1.0, n / sample) for n in shards if n)
    mechanism = config.privacy.counter.mechanism
    return total, f"{steps} steps of {sample:,} keys of {mechanism} measured in this process"


def _mechanism_step_seconds(config: Any) -> tuple[float | None, str]:
    """Seconds per step of every histogram or model stream (one worker)."""
    noise = NoiseKey(secrets.token_bytes(32))
    if config.kind == "pmwg":
        from dpstream.kinds.pmwg.shard import PmwgShard as Shard
    else:
        from dpstream.kinds.erm.shard import ErmShard as Shard  # type: ignore[assignment]
    shards = []
    for index in range(config.shards):
        shard = Shard(config, noise, _INSTANCE, 1)
        shard.bind(index)
        if shard.members:
            shards.append(shard)
    if not shards:
        return None, "nothing to measure"

    def close_one(step: int) -> None:
        for shard in shards:
            shard.close(step, None)

    try:
        seconds, steps = _timed(close_one)
    except Exception as exc:  # noqa: BLE001 - an estimate must never stop a start
        return None, f"not measured ({type(exc).__name__})"
    return seconds / steps, f"{steps} steps of every member measured"
