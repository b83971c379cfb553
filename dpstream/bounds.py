"""``dpstream bounds``: choose a flow's contribution caps with numbers, from a sample.

At ``contribution.unit = "user"`` every kind bounds what one person contributes per period
(counters ``max_keys`` and ``max_per_key``, PMWG ``max_rows``, ERM ``max_rows_per_block`` and
``max_blocks``) and scales its noise by those caps. A small cap drops more of a heavy person's
events (bias); a large one adds noise to every output. This module measures both on a public
or synthetic sample, for a grid of candidate caps:

* **the fraction of events kept**, decided by the production bounder
  (:class:`dpstream.core.contribution.bounder.ContributionBounder`, built from the same
  :class:`~dpstream.core.contribution.rules.BoundingRule` the flow builds), fed the way the
  flow's bounding stage feeds it: the events of one closed step at a time, steps in
  increasing order, each person's events in the deterministic order (partition, offset); and
  the fraction of people who lost at least one event;
* **the noise std of each output** at those caps: the flow's configuration re-read with the
  candidate caps in its ``[contribution]`` table (every setting validated as at start-up),
  then that configuration's ``noise_std()``.

**Reading the sample.** A file of JSON lines in the flow's event format, one event a line
(blank lines are skipped). Each line is decoded by the flow kind's own decoder (its step
clock's), so a line the flow would dead-letter is skipped here for the same reason; a line
without the person field (a non-empty string) is skipped too. Skipped lines are counted per
reason with the first few line numbers; their contents are never shown.

**Placing events in steps and periods.** There is no broker here, so no broker time and no
heartbeat ticks: each event is placed by its own event time (the configuration's
``events.time_field``) in step ``floor((time - flow.origin) / flow.step)``, and in the period
of that step (``contribution.period``). An event before ``flow.origin``, or at or after
``flow.end`` when set, is skipped. The lines are one input partition, in file order: a line's
number is its offset, which orders a person's events within a step as the flow orders them
within a partition.

**People.** The person field is hashed as the flow hashes it
(:class:`~dpstream.core.contribution.people.PersonHasher`, a keyed 128-bit AES CBC-MAC), under
a fresh random key made for this run: which events are kept depends only on each person's
own events in their order, never on the hash values, so the key changes nothing but the (negligible,
< n^2 / 2^129 for n people) chance that two people collide. No person id is kept, printed or
logged; only the number of distinct people is reported.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any, BinaryIO, Final, cast

import msgspec
import numpy as np

from dpstream.config import FlowConfig, kind_name, read_config
from dpstream.core.contribution.bounder import ContributionBounder
from dpstream.core.contribution.people import PersonHasher
from dpstream.core.contribution.rules import BoundingRule
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import ConfigError, DpstreamError
from dpstream.messages import TIMESTAMP_CREATE_TIME, DeadLetter, RawBatch
from dpstream.platform import flow_kind, parse_config
from dpstream.stream.clock import MAX_SECONDS, bad_person

__all__ = ["KIND_CAPS", "DEFAULT_GRIDS", "BoundsReport", "Sample", "evaluate", "read_sample",
           "run_bounds"]

KIND_CAPS: Final[Mapping[str, tuple[str, ...]]] = {
    "counters": ("max_keys", "max_per_key"),
    "pmwg": ("max_rows",),
    "erm": ("max_rows_per_block", "max_blocks"),
}
"""The ``[contribution]`` caps each flow kind takes (what its ``parse_config`` requires)."""
_ALL_CAPS: Final = frozenset(c for caps in KIND_CAPS.values() for c in caps)

DEFAULT_GRIDS: Final[Mapping[str, tuple[int, ...]]] = {
    "max_keys": (1, 2, 4, 8, 16),
    "max_per_key": (1, 2, 5, 10, 20),
    "max_rows": (1, 2, 4, 8, 16, 32, 64),
    "max_rows_per_block": (1, 2, 4, 8, 16),
    "max_blocks": (1, 2, 4, 8, 16, 32),
}
"""The candidate caps tried when a cap's grid is not given (the configured cap is added)."""

BATCH_LINES: Final = 20_000
"""Lines decoded per batch."""
SHOWN_LINES: Final = 5
"""How many line numbers of each skip reason are shown."""
PROGRESS_SECONDS: Final = 2.0
"""How often progress is written to stderr once a run takes longer than this."""


def _person_decoder(user_field: str) -> msgspec.json.Decoder[Any]:
    """A decoder of the person field alone (other fields ignored; absent: None)."""
    person = msgspec.defstruct("Person", [("person", object, None)],
                               rename={"person": user_field}, gc=False)
    return msgspec.json.Decoder(person)


@dataclass
class Sample:
    """The events of a sample that the flow would accept, as columns.

    Attributes:
        steps: each event's step (int64), in file order.
        people: each event's keyed person hash (``V16``).
        groups: each event's contribution group, interned as int64 (grouping ``key``; zeros
            otherwise).
        offsets: each event's line number (int64): its offset in the one input partition.
        lines: the lines read (blank ones included).
        skipped: per reason, how many lines were skipped.
        first_skipped: per reason, the first :data:`SHOWN_LINES` line numbers.
    """

    steps: np.ndarray
    people: np.ndarray
    groups: np.ndarray
    offsets: np.ndarray
    lines: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    first_skipped: dict[str, list[int]] = field(default_factory=dict)

    @property
    def events(self) -> int:
        """The events accepted."""
        return int(self.steps.size)

    def skip(self, reason: str, line: int) -> None:
        """Count a skipped line."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        shown = self.first_skipped.setdefault(reason, [])
        if len(shown) < SHOWN_LINES:
            shown.append(line)


class _Progress:
    """Progress lines on stderr, only once a run has taken :data:`PROGRESS_SECONDS`."""

    def __init__(self, out: Callable[[str], None] | None) -> None:
        self.out = out
        self.started = self.last = time.monotonic()

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        if self.out is not None and now - self.last >= PROGRESS_SECONDS:
            self.last = now
            self.out(f"dpstream bounds: {message} ({now - self.started:.0f} s)")


def _batches(handle: BinaryIO, first_line: int = 1) -> Iterator[tuple[list[bytes], list[int]]]:
    """The non-blank lines of ``handle`` in batches, with their line numbers (from 1)."""
    values: list[bytes] = []
    numbers: list[int] = []
    for number, line in enumerate(handle, start=first_line):
        stripped = line.strip()
        if not stripped:
            continue
        values.append(stripped)
        numbers.append(number)
        if len(values) >= BATCH_LINES:
            yield values, numbers
            values, numbers = [], []
    if values:
        yield values, numbers


def read_sample(config: FlowConfig, handle: BinaryIO, *, grouping: str,
                size: int | None = None,
                progress: Callable[[str], None] | None = None) -> Sample:
    """Decode the sample in ``handle`` as the flow of ``config`` (a user-level one) would.

    Args:
        config: the flow's configuration at ``contribution.unit = "user"``.
        handle: the sample, JSON lines, opened in binary mode.
        grouping: the bounding rule's grouping (``key`` interns the groups).
        size: the file's size in bytes, for the progress lines.
        progress: where progress lines go (None: nowhere).
    """
    kind = flow_kind(config.kind)
    input_topic = config.kafka.topic("input_topic")
    bases = {config.kafka.topic(setting): i for i, setting in enumerate(kind.inputs)}
    clock = kind.clock(config, bases)(None)
    persons = _person_decoder(config.contribution.user_field)
    hasher = PersonHasher(NoiseKey.generate().lane("dpstream bounds", config.name, "people"))
    origin, step_seconds = config.origin_seconds, config.step_seconds
    end_step = config.end_step
    groups_of = getattr(clock, "contribution_groups", None)
    interned: dict[Any, int] = {}
    steps: list[np.ndarray] = []
    people: list[np.ndarray] = []
    groups: list[np.ndarray] = []
    offsets: list[np.ndarray] = []
    sample = Sample(np.empty(0, np.int64), np.empty(0, "V16"), np.empty(0, np.int64),
                    np.empty(0, np.int64))
    report = _Progress(progress)
    read = 0
    for values, numbers in _batches(handle):
        sample.lines = numbers[-1]
        read += sum(map(len, values)) + len(values)
        n = len(values)
        batch = RawBatch(0, list(values), list(numbers), [input_topic] * n,
                         np.zeros(n, np.float64), np.full(n, TIMESTAMP_CREATE_TIME, np.int64))
        dead: list[DeadLetter] = []
        # the kind's decoder, guarded as in the flow: any exception a line raises makes it a
        # dead letter (reason: the exception's type), never a crash
        payloads, times, refs = clock._decode_guarded(0, batch, dead)
        for letter in dead:
            sample.skip(letter.reason, int(letter.offset or 0))
        # the kind's decoder reads the person at the user level (decoded_people, 1:1 with the
        # payloads); a decoder that does not is read here with the same rule
        decoded = getattr(clock, "decoded_people", None)
        given = decoded if isinstance(decoded, list) and len(decoded) == len(refs) else None
        ok = np.ones(len(refs), dtype=bool)
        names: list[str] = []
        seconds = np.asarray(times, dtype=np.float64)
        for j, ref in enumerate(refs):
            line = numbers[ref]
            if given is not None:
                person = given[j]
            else:
                try:
                    person = persons.decode(values[ref]).person
                except Exception:  # the kind's decoder read the line: unlikely; never a crash
                    person = None
            reason = None
            if not isinstance(person, str) or not person:
                reason = bad_person(config.contribution.user_field)
            elif not (math.isfinite(seconds[j]) and seconds[j] <= MAX_SECONDS):
                reason = "event time after the year 9999"
            elif seconds[j] < origin:
                reason = "event time before flow.origin"
            if reason is None:
                step = math.floor((seconds[j] - origin) / step_seconds)
                if end_step is not None and step >= end_step:
                    reason = "event time at or after flow.end (its step never closes)"
            if reason is not None:
                ok[j] = False
                sample.skip(reason, line)
                continue
            names.append(person)
        keep = np.flatnonzero(ok)
        if keep.size:
            kept_refs = np.asarray(refs, dtype=np.int64)[keep]
            steps.append(np.floor((seconds[keep] - origin) / step_seconds).astype(np.int64))
            people.append(hasher.hash_many(names))
            offsets.append(np.asarray(numbers, dtype=np.int64)[kept_refs])
            if grouping == "key":
                chosen = (payloads[keep] if isinstance(payloads, np.ndarray)
                          else [payloads[i] for i in keep.tolist()])
                keys = groups_of(chosen) if groups_of is not None else chosen
                if isinstance(keys, np.ndarray):
                    keys = keys.tolist()
                groups.append(np.fromiter((interned.setdefault(k, len(interned)) for k in keys),
                                          dtype=np.int64, count=keep.size))
            else:
                groups.append(np.zeros(keep.size, dtype=np.int64))
        if size:
            report(f"read {sample.lines:,} lines ({min(read / size, 1.0):.0%})")
        else:
            report(f"read {sample.lines:,} lines")
    if steps:
        sample.steps = np.concatenate(steps)
        sample.people = np.concatenate(people)
        sample.groups = np.concatenate(groups)
        sample.offsets = np.concatenate(offsets)
    return sample


@dataclass(frozen=True)
class Row:
    """One candidate: its caps, what the bounder keeps and the noise at those caps."""

    caps: dict[str, int]
    kept: int
    events: int
    people_capped: int
    people: int
    noise_std: dict[str, float] | None

    @property
    def fraction_kept(self) -> float:
        """The fraction of the sample's events kept (1 for an empty sample)."""
        return self.kept / self.events if self.events else 1.0

    def to_dict(self) -> dict[str, Any]:
        """The row as JSON-ready data."""
        return {"caps": self.caps, "events_kept": self.kept,
                "fraction_kept": self.fraction_kept, "people_capped": self.people_capped,
                "fraction_people_capped": self.people_capped / self.people if self.people
                else 0.0, "noise_std": self.noise_std}


def evaluate(sample: Sample, rule: BoundingRule) -> tuple[int, int]:
    """Run the production bounder over the sample; return (events kept, people capped).

    The events are handed over one step at a time, steps in increasing order, as the flow's
    bounding stage does (the bounder orders each person's events by (partition, offset) and
    drops a period's state when the next period starts). A person is *capped* when at least
    one of their events was dropped.
    """
    if not sample.events:
        return 0, 0
    order = np.argsort(sample.steps, kind="stable")
    steps = sample.steps[order]
    people = sample.people[order]
    groups = sample.groups[order]
    offsets = sample.offsets[order]
    partitions = np.zeros(steps.size, dtype=np.int64)
    _, person_index = np.unique(people, return_inverse=True)
    capped = np.zeros(int(person_index.max()) + 1, dtype=bool)
    starts = np.flatnonzero(np.diff(steps, prepend=steps[0] - 1))
    ends = np.append(starts[1:], steps.size)
    bounder = ContributionBounder(rule)
    kept = 0
    for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True):
        # interned int64 ids: the bounder interns an integer array in bulk
        step_groups = cast("Sequence[Hashable]", groups[lo:hi]) if rule.grouping == "key" \
            else None
        keep, _first = bounder.keep(int(steps[lo]), people[lo:hi], step_groups,
                                    partitions[lo:hi], offsets[lo:hi])
        kept += int(np.count_nonzero(keep))
        capped[person_index[lo:hi][~np.asarray(keep, dtype=bool)]] = True
    return kept, int(np.count_nonzero(capped))


@dataclass
class BoundsReport:
    """What ``dpstream bounds`` found: the sample and one row per candidate."""

    flow: str
    kind: str
    contribution: str
    sample: Sample
    people: int
    rows: list[Row]

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (no person id, no line contents)."""
        s = self.sample
        steps = np.unique(s.steps)
        return {
            "flow": self.flow, "kind": self.kind, "contribution": self.contribution,
            "sample": {"lines": s.lines, "events": s.events, "people": self.people,
                       "steps": int(steps.size),
                       "first_step": int(steps[0]) if steps.size else None,
                       "last_step": int(steps[-1]) if steps.size else None,
                       "skipped": {reason: {"lines": count,
                                            "first_line_numbers": s.first_skipped[reason]}
                                   for reason, count in sorted(s.skipped.items())}},
            "rows": [row.to_dict() for row in self.rows],
        }

    def table(self) -> str:
        """The report as a text table."""
        s = self.sample
        steps = np.unique(s.steps)
        lines = [f"flow {self.flow!r} ({self.kind}); {self.contribution}",
                 f"sample: {s.lines:,} lines, {s.events:,} events of {self.people:,} people "
                 f"over {steps.size:,} steps"]
        for reason, count in sorted(s.skipped.items()):
            numbers = ", ".join(map(str, s.first_skipped[reason]))
            more = ", ..." if count > len(s.first_skipped[reason]) else ""
            lines.append(f"skipped {count:,} line(s): {reason} (line {numbers}{more})")
        if not self.rows:
            return "\n".join(lines)
        cap_names = list(self.rows[0].caps)
        outputs = sorted({name for row in self.rows for name in (row.noise_std or {})})
        header = [*cap_names, "events kept", "people capped",
                  *(f"noise std {name}" for name in outputs)]
        body = []
        for row in self.rows:
            capped = row.people_capped / row.people if row.people else 0.0
            stds = row.noise_std or {}
            body.append([*(str(row.caps[name]) for name in cap_names),
                         f"{row.fraction_kept:.1%}", f"{capped:.1%}",
                         *(f"{stds[name]:.4g}" if name in stds else "-" for name in outputs)])
        widths = [max(len(header[i]), *(len(r[i]) for r in body)) for i in range(len(header))]
        lines.append("")
        lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in body]
        if not outputs:
            lines.append("(noise std: this version's configuration does not report it)")
        lines.append("events kept: the fraction of the sample's events the production bounder "
                     "keeps at these caps; people capped: the fraction of people who lose at "
                     "least one event")
        return "\n".join(lines)


def _contribution_table(raw: Mapping[str, Any], user_field: str | None,
                        period: str | None) -> dict[str, Any]:
    """The ``[contribution]`` table to try caps in: the configuration's, at the user level."""
    given = raw.get("contribution", {})
    if not isinstance(given, dict):
        raise ConfigError(f"[contribution] must be a table, got {type(given).__name__}")
    table = {k: v for k, v in given.items() if k not in {"unit", *_ALL_CAPS}}
    table["unit"] = "user"
    if user_field is not None:
        table["user_field"] = user_field
    if period is not None:
        table["period"] = period
    if not table.get("user_field"):
        raise ConfigError("dpstream bounds needs the person field: set contribution.user_field "
                          "in the configuration or pass --user-field FIELD")
    return table


def run_bounds(config_path: str | os.PathLike[str] | None, sample_path: str,
               grids: Mapping[str, Sequence[int]], *, user_field: str | None = None,
               period: str | None = None,
               progress: Callable[[str], None] | None = None) -> BoundsReport:
    """Measure, per candidate caps, the events kept and the noise std (see the module doc).

    Args:
        config_path: the flow's TOML configuration (None: ``$DPSTREAM_CONFIG``).
        sample_path: the sample, JSON lines.
        grids: candidate values per cap name (caps not given take :data:`DEFAULT_GRIDS` and
            the configured value).
        user_field: the person field, if not the configuration's ``contribution.user_field``.
        period: ``contribution.period``, if not the configuration's.
        progress: where progress lines go (None: nowhere).

    Raises:
        ConfigError: a bad configuration or cap (the message names it).
        DpstreamError: the sample cannot be read.
    """
    raw, source = read_config(config_path, None, lambda name: flow_kind(name).topics)
    kind = flow_kind(kind_name(raw)).name
    caps = KIND_CAPS[kind]
    unknown = sorted(set(grids) - set(caps))
    if unknown:
        flag = "--" + unknown[0].replace("_", "-")
        raise ConfigError(f"{flag} does not apply to flow.kind = {kind!r} (it takes "
                          f"{', '.join('--' + c.replace('_', '-') for c in caps)})")
    table = _contribution_table(raw, user_field, period)
    configured = raw.get("contribution", {}) if isinstance(raw.get("contribution"), dict) \
        else {}
    candidates: dict[str, list[int]] = {}
    for name in caps:
        values = list(grids.get(name) or ())
        if not values:
            values = list(DEFAULT_GRIDS[name])
            if isinstance(configured.get(name), int) and configured[name] not in values:
                values.append(configured[name])
        candidates[name] = sorted(set(values))

    def config_at(point: Mapping[str, int]) -> FlowConfig:
        tried = copy.deepcopy(raw)
        tried["contribution"] = {**table, **point}
        try:
            return parse_config(tried, source)
        except ConfigError as exc:  # which candidate: a grid's larger caps may not validate
            caps_text = ", ".join(f"{name} = {value}" for name, value in point.items())
            raise ConfigError(f"at the candidate caps {caps_text}: {exc}") from None

    points = [dict(zip(caps, values, strict=True))
              for values in product(*(candidates[name] for name in caps))]
    configs = [config_at(point) for point in points]  # every candidate validated up front
    first = configs[0]
    rule = BoundingRule.from_contribution(first.contribution)
    path = Path(sample_path)
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            sample = read_sample(first, handle, grouping=rule.grouping, size=size,
                                 progress=progress)
    except OSError as exc:
        raise DpstreamError(f"cannot read the sample {sample_path}: {exc.strerror}") from None
    if not sample.events:
        reasons = "; ".join(f"{count:,} line(s): {reason} (line "
                            f"{', '.join(map(str, sample.first_skipped[reason]))}"
                            f"{', ...' if count > len(sample.first_skipped[reason]) else ''})"
                            for reason, count in sorted(sample.skipped.items()))
        raise DpstreamError(f"the sample {sample_path} holds no event the flow would accept, "
                            f"so there is nothing to bound ({sample.lines:,} lines"
                            f"{'; skipped ' + reasons if reasons else ''})")
    people = int(np.unique(sample.people).size)
    report = _Progress(progress)
    rows = []
    for i, (point, config) in enumerate(zip(points, configs, strict=True)):
        report(f"candidate {i + 1} of {len(points)}")
        kept, capped = evaluate(sample, BoundingRule.from_contribution(config.contribution))
        noise_std = getattr(config, "noise_std", None)
        stds = ({str(k): float(v) for k, v in noise_std().items()}
                if callable(noise_std) else None)
        rows.append(Row(point, kept, sample.events, capped, people, stds))
    contribution = first.contribution
    period_text = ("lifetime" if contribution.period_steps is None
                   else f"period {contribution.period_steps} steps")
    return BoundsReport(first.name, kind,
                        f"person field {contribution.user_field!r}, {period_text}", sample,
                        people, rows)


def print_progress(line: str) -> None:
    """Write a progress line to stderr."""
    print(line, file=sys.stderr, flush=True)
