"""Plain-text views of records and budgets: what ``dpstream tail`` and ``dpstream budget`` print.

One column layout serves every record type, so a stream of mixed records (appended one row
per record when the output is not a terminal) stays readable, and the live table (redrawn
in place on a terminal) shows the latest row per key:

    WHAT     KEY         VALUE     ± STD  STEP  WINDOW END            PRIVACY    NOTE
    release  page-007    21873.4    27.9    42  2026-11-20T23:40:43Z  1/1 ε      alert@3

``± STD`` is the analytic standard deviation of the value's noise (models: of each weight).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Final

from dpstream.client.budget import BudgetRow
from dpstream.client.consumer import ReadStats
from dpstream.client.latest import LatestValues
from dpstream.schemas import (
    Alert,
    Answer,
    Model,
    ModelHoldout,
    Privacy,
    Record,
    Release,
    Serving,
    Status,
)

__all__ = ["budget_table", "live_table", "record_row", "store_summary", "table_header"]

_UNITS: Final = {"epsilon": "ε", "pure": "ε", "rho": "ρ", "zcdp": "ρ", "approx_dp": "ε (ε,δ)"}
_KEY_WIDTH: Final = 20

Cells = tuple[str, str, str, str, str, str, str, str]
"""WHAT, KEY, VALUE, ± STD, STEP, WINDOW END, PRIVACY, NOTE."""

_HEADER: Final = ("WHAT", "KEY", "VALUE", "± STD", "STEP", "WINDOW END", "PRIVACY", "NOTE")


def _number(value: float | None, digits: int = 6) -> str:
    if value is None:
        return "\u22a5"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}"


def _time(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def _privacy(spent: float, budget: float, accounting: str) -> str:
    return f"{_number(spent, 3)}/{_number(budget, 3)} {_UNITS.get(accounting, accounting)}"


def _spend(privacy: Privacy) -> str:
    return _privacy(privacy.spent, privacy.budget, privacy.accounting)


def _cells(record: Record, key: str) -> Cells:
    """The row of one record."""
    if isinstance(record, Release):
        return ("release", key, _number(record.value), _number(record.std, 3), str(record.step),
                _time(record.window.end), _spend(record.privacy), "")
    if isinstance(record, Alert):
        return ("alert", key, "", "", str(record.step), _time(record.window.end),
                f"{_number(record.epsilon, 3)} ε", f"monitor fired (threshold {record.threshold})")
    if isinstance(record, Status):
        return ("status", key, "", "", str(record.step), _time(record.window.end),
                _privacy(record.spent, record.budget, record.accounting),
                f"{record.status}: refused {record.refused}")
    if isinstance(record, Answer):
        return ("answer", key, _answer_value(record), "", str(record.step),
                _time(record.window.end), _spend(record.privacy), _answer_note(record))
    if isinstance(record, Model):
        return ("model", key, "" if not isinstance(record.holdout, ModelHoldout) else
                f"acc {record.holdout.accuracy:.3f}",
                "" if record.noise is None else _number(record.noise.std, 3), str(record.step),
                _time(record.released.end), _spend(record.privacy), _model_note(record))
    if isinstance(record, Serving):
        served = record.model
        if served is None:
            return ("serving", key, "", "", str(record.step), _time(record.released.end), "",
                    "no model released yet")
        level = "" if served.level is None else f"/{served.level}"
        return ("serving", key, "", _number(served.noise_std, 3), str(record.step),
                _time(record.released.end), "",
                f"use {served.role}{level} of step {served.step} ({served.blocks} blocks, "
                f"data steps {served.window.first_step}..{served.window.last_step})")
    return ("dead", "", "", "", "", "", "", f"{record.reason} (from {record.source.topic}"
            f"[{record.source.partition}]@{record.source.offset})")


def _answer_value(answer: Answer) -> str:
    if isinstance(answer.value, tuple):
        return "[" + ", ".join(_number(v, 4) for v in answer.value) + "]"
    return _number(answer.value, 4)


def _answer_note(answer: Answer) -> str:
    note = f"{answer.kind} q={answer.id} t={answer.t} hard={answer.hard_queries}"
    return f"{note}: {answer.reason}" if answer.reason else note


def _model_note(model: Model) -> str:
    steps = f"data steps {model.window.first_step}..{model.window.last_step}"
    return f"{model.reason} ({steps})" if model.reason else steps


def record_key(record: Record, several_flows: bool = False) -> str:
    """What identifies the row's subject: the key, histogram, or model stream and role."""
    if isinstance(record, (Release, Alert, Status)):
        key = record.key
    elif isinstance(record, Answer):
        key = record.histogram
    elif isinstance(record, Model):
        key = f"{record.stream} {record.role}" + ("" if record.level is None
                                                  else f"/{record.level}")
    elif isinstance(record, Serving):
        key = record.stream
    else:
        key = ""
    return f"{record.flow}:{key}" if several_flows and key else key


def _line(cells: Sequence[str], key_width: int) -> str:
    what, key, value, std, step, end, privacy, note = cells
    return (f"{what:<8} {key:<{key_width}} {value:>12} {std:>8} {step:>7}  {end:<24} "
            f"{privacy:<14} {note}").rstrip()


def table_header(key_width: int = _KEY_WIDTH) -> str:
    """The column titles."""
    return _line(_HEADER, key_width)


def record_row(record: Record, key_width: int = _KEY_WIDTH, several_flows: bool = False,
               several_instances: bool = False) -> str:
    """One record as a row under :func:`table_header` (the append mode of ``tail``).

    ``several_instances``: mark the key with its flow instance (``key@5f0c9a1e``).
    """
    key = record_key(record, several_flows)
    if several_instances and key:
        key = f"{key}@{_short(record.instance)}"
    return _line(_cells(record, key), key_width)


def _short(instance: str | None) -> str:
    """A flow instance as shown: its first 8 hex digits (``?`` for records without one)."""
    return "?" if instance is None else instance[:8]


def _latest_rows(latest: LatestValues) -> list[Cells]:
    """One row per key (its release, marked with its alert and status), answer and model.

    A flow seen from several instances gets one row per key and instance (``key@abcd1234``):
    their values are independent releases, not versions of one.
    """
    several = len(latest.flows()) > 1
    instances = latest.instances()
    rows: list[Cells] = []
    for flow, key in latest.keys():
        shown = f"{flow}:{key}" if several else key
        found = instances.get(flow, [None])
        for instance in found:
            if len(found) > 1:
                release, alert, status = (latest.release(flow, key, instance),
                                          latest.alert(flow, key, instance),
                                          latest.status(flow, key, instance))
                if release is None and alert is None and status is None:
                    continue
                label = f"{shown}@{_short(instance)}"
            else:
                release, alert, status = (latest.release(flow, key), latest.alert(flow, key),
                                          latest.status(flow, key))
                label = shown
            notes = []
            if alert is not None:
                notes.append(f"alert@{alert.step}")
            if status is not None:
                notes.append(f"EXHAUSTED@{status.step} ({status.refused} refused)")
            what, _, value, std, step, end, privacy, _ = (
                _cells(release, label) if release is not None else ("key", label, *[""] * 6))
            rows.append((what, label, value, std, step, end, privacy, " ".join(notes)))
    others: list[Answer | Model | Serving] = [*latest.answers(), *latest.models(),
                                              *latest.servings()]
    for record in others:
        rows.append(_cells(record, record_key(record, several)))
    for reason, n in sorted(latest.dead_letters.items()):
        rows.append(("dead", "", str(n), "", "", "", "", reason))
    return rows


def store_summary(latest: LatestValues) -> str:
    """What the store dropped and flagged, and the flows seen from several instances.

    ``dropped 3 duplicates, 1 stale; 0 conflicts`` (conflicts are always shown: a correct
    flow instance never publishes one coordinate twice with different values).
    """
    counts = latest.counts
    text = f"dropped {counts.duplicates} duplicates, {counts.stale} stale"
    if counts.unchecked:
        text += f", {counts.unchecked} too old to check"
    if counts.conflicts:
        text += (f"; {counts.conflicts} CONFLICTING copies (one flow instance published a "
                 "coordinate twice with different values: report them to the operators)")
    else:
        text += "; 0 conflicts"
    for flow, found in latest.instances().items():
        if len(found) > 1:
            text += (f"; flow {flow!r} has {len(found)} instances ("
                     + ", ".join(map(_short, found))
                     + "): their releases are independent (--instance ID shows one)")
    return text


def live_table(latest: LatestValues, stats: ReadStats, title: str,
               height: int | None = None) -> str:
    """The latest value of every key as a table, cut to ``height`` lines (for a terminal)."""
    rows = _latest_rows(latest)
    width = max([_KEY_WIDTH, *(len(r[1]) for r in rows)])
    footer = f"{stats.describe()}; {store_summary(latest)}"
    lines = [f"{title}   {time.strftime('%H:%M:%S')}", table_header(width)]
    room = None if height is None else max(1, height - len(lines) - 2)
    if room is not None and len(rows) > room:
        shown, hidden = rows[:room - 1], len(rows) - room + 1
        lines += [_line(r, width) for r in shown]
        lines.append(f"... and {hidden} more rows (a taller terminal, or --json)")
    else:
        lines += [_line(r, width) for r in rows] or ["(waiting for records)"]
    lines += ["", footer]
    return "\n".join(lines)


# -- budget ----------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes = seconds / 60
    if minutes < 60:
        return f"{minutes:.0f}m"
    hours, minutes = divmod(int(minutes), 60)
    if hours < 48:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours}h" if days < 3650 else f"{days / 365.25:.0f} years"


def _exhaustion(row: BudgetRow, now: float, rate_hint: str) -> str:
    if row.stopped:
        return "STOPPED: something ran out of budget"
    if row.committed_up_front:
        return "never: committed up front"
    seconds = row.seconds_to_exhaustion
    if seconds is None:
        return "unknown" + (f" ({rate_hint})" if rate_hint and row.remaining else "")
    if seconds == 0:
        return "EXHAUSTED"
    if math.isinf(seconds):
        return "not spending"
    at = time.strftime("%Y-%m-%d %H:%M", time.gmtime(now + seconds))
    return f"in {_duration(seconds)} ({at}Z)"


def budget_table(rows: Sequence[BudgetRow], rate_hint: str = "", now: float | None = None
                 ) -> str:
    """The spend per mechanism as a table, with a note on the counters' up-front charge."""
    now = time.time() if now is None else now
    head = ("FLOW", "MECHANISM", "SCOPE", "SPENT", "BUDGET", "LEFT", "USED", "BURN/H",
            "EXHAUSTION")
    cells = [head]
    for row in rows:
        unit = _UNITS.get(row.unit or "", row.unit or "")
        used = ("" if not row.budget else f"{100 * row.spent / row.budget:.0f}%")
        rate = "?" if row.burn_rate is None else _number(row.burn_rate * 3600, 3)
        cells.append((row.flow, row.mechanism, row.scope or "",
                      f"{_number(row.spent, 4)} {unit}".strip(), _number(row.budget, 4)
                      if row.budget is not None else "?", _number(row.remaining, 4)
                      if row.remaining is not None else "?", used, rate,
                      _exhaustion(row, now, rate_hint)))
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in cells]
    if not rows:
        lines.append("(no privacy spend series: is this a dpstream flow's metrics endpoint?)")
    if any(row.committed_up_front for row in rows):
        lines.append("note: a counter charges a key's whole per-key budget with its first "
                     "release, so its spend is at the counter's share from the start and does "
                     "not grow: by design, not a warning.")
    return "\n".join(lines)
