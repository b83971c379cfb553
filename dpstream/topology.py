"""Input topology checks: a resume must find the partitions the recovery store read.

A flow's recovery store holds, for every input partition, the offset the next read resumes
at (the ``kafka_in`` step's state, keyed by the partition's number in its topic), and the
step clock and the step barrier count the partitions of every input topic one after the
other. When a topic is deleted and re-created, re-partitioned, or truncated behind the
flow's back, a resume used to go ahead without a word and the flow stalled or read the new
topic from positions that no longer mean anything. Now, at start-up (:func:`check_topology`):

* **a partition count that differs** from the store's (partitions added, or stored partitions
  that vanished) stops the flow with one line naming the topic, both counts and the stored
  offsets: the step barrier and the clocks' partition numbering would no longer match the
  snapshots, and records of an added partition for steps already closed could not be counted
  (start a new flow instance, with a new recovery directory, or restore the topic);
* **a stored offset past a partition's end** (a re-created or truncated topic with the same
  partition count) is a warning naming ``topic[partition]``, the stored offset and the end: the
  input reads that partition from its start (``auto.offset.reset = earliest``), so nothing of
  the new topic is skipped; records are placed by their own timestamps as always.

While the flow runs, :class:`~dpstream.io.kafka.KafkaInput` reports the same anomalies when
they happen (a partition whose offsets go backwards, a partition the broker no longer
knows). Each anomaly is logged once and counted in ``dpstream_topology_anomalies_total{topic,
reason}`` (reasons in :data:`REASONS`), which the ``DpstreamTopologyChanged`` alert watches.

The end of a partition is taken from the broker's high watermark, which some brokers (the
embedded Tansu) under-report; a stored offset beyond it is confirmed by reading the record just
before it, so such a broker causes no false alarm.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from dpstream.errors import ConfigError

__all__ = ["REASONS", "Anomaly", "check_topology", "describe", "enforce", "rewinds",
           "store_is_complete",
           "stored_offsets"]

log = logging.getLogger("dpstream")

REASONS: Final = ("partition_count_changed", "partition_vanished", "offset_past_end",
                  "offsets_went_back")
"""The ``reason`` label values of ``dpstream_topology_anomalies_total``."""


@dataclass(frozen=True)
class Anomaly:
    """One topology anomaly of an input partition (or of a whole topic)."""

    topic: str
    reason: str
    text: str
    fatal: bool
    partition: int | None = None
    offset: int | None = None
    """The stored offset (``offset_past_end``)."""


def store_is_complete(recovery_dir: str | Path) -> bool:
    """Whether the directory holds every partition file of its Bytewax recovery store.

    A cluster may keep its store on a volume per process, each with some of the partition
    files; only a complete store tells how many input partitions were read.
    """
    indexes, counts = set(), set()
    for path in Path(recovery_dir).glob("part-*.sqlite3"):
        try:
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
                for index, count in db.execute("SELECT part_index, part_count FROM parts"):
                    indexes.add(index)
                    counts.add(count)
        except sqlite3.Error:
            return False
    return len(counts) == 1 and indexes == set(range(counts.pop()))


def stored_offsets(recovery_dir: str | Path, step_ids: Mapping[str, str]
                   ) -> dict[str, dict[int, int]]:
    """The resume offset of every input partition the recovery store holds, by topic.

    Args:
        recovery_dir: the Bytewax recovery directory (its ``part-*.sqlite3`` files).
        step_ids: the input step's full id (``<flow>.kafka_in``) -> the topic it reads now.

    Returns:
        ``{topic: {partition: offset}}`` from the newest snapshot of each partition (empty for
        a new store). The store is opened read-only.
    """
    found: dict[str, dict[int, tuple[int, int]]] = {}
    directory = Path(recovery_dir)
    if not directory.is_dir():
        return {}
    marks = ",".join("?" * len(step_ids))
    for path in sorted(directory.glob("part-*.sqlite3")):
        try:
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
                rows = db.execute(
                    f"SELECT step_id, state_key, snap_epoch, ser_change FROM snaps "  # noqa: S608
                    f"WHERE step_id IN ({marks})", list(step_ids)).fetchall()
        except sqlite3.Error:
            continue
        for step_id, key, epoch, blob in rows:
            try:
                partition = int(key)
                offset = pickle.loads(blob) if blob is not None else None  # noqa: S301
            except (ValueError, pickle.UnpicklingError, EOFError):
                continue
            topic = step_ids[step_id]
            known = found.setdefault(topic, {}).get(partition)
            if known is None or epoch > known[0]:
                if isinstance(offset, int):
                    found[topic][partition] = (epoch, offset)
                else:  # a deleted state (None): the partition is gone from the store
                    found[topic].pop(partition, None)
    return {topic: {p: offset for p, (_e, offset) in parts.items()}
            for topic, parts in found.items() if parts}


def _offsets_text(offsets: Mapping[int, int], topic: str) -> str:
    shown = ", ".join(f"{topic}[{p}] at offset {o}" for p, o in sorted(offsets.items())[:8])
    return shown + (f" and {len(offsets) - 8} more" if len(offsets) > 8 else "")


def check_topology(stored: Mapping[str, Mapping[int, int]], counts: Mapping[str, int],
                   past_end: Callable[[str, int, int], int | None], *,
                   complete: bool = True) -> list[Anomaly]:
    """Compare the store's partitions and offsets with the input topics as they are now.

    Args:
        stored: :func:`stored_offsets`' answer.
        complete: the store holds every input partition's state (:func:`store_is_complete`);
            otherwise only vanished partitions show a changed count.
        counts: each input topic's partition count now.
        past_end: ``(topic, partition, offset) ->`` the partition's end if ``offset`` lies
            beyond it, else None.

    Returns:
        The anomalies, fatal ones (partition counts) first.
    """
    anomalies: list[Anomaly] = []
    for topic, count in counts.items():
        offsets = stored.get(topic)
        if not offsets:
            continue  # a new store (or a topic it never read)
        had = max(offsets) + 1
        vanished = {p: o for p, o in offsets.items() if p >= count}
        if vanished or (complete and had < count):
            reason = "partition_vanished" if vanished else "partition_count_changed"
            anomalies.append(Anomaly(topic, reason, (
                f"input topic {topic!r} has {count} partition(s) but the recovery store read "
                f"{had} ({_offsets_text(offsets, topic)})"
                + (f"; {', '.join(f'{topic}[{p}]' for p in sorted(vanished))} vanished"
                   if vanished else f"; {topic}[{had}]..{topic}[{count - 1}] are new")
                + ": the topic was re-created or re-partitioned. A resume cannot continue on "
                "another partition count (the step barrier and the snapshots count partitions). "
                "Restore the topic's partitions, or start a new flow instance with a new "
                "recovery directory (its privacy spend adds to this one's)"), fatal=True))
    if any(a.fatal for a in anomalies):
        return anomalies
    for topic, count in counts.items():
        for partition, offset in sorted(stored.get(topic, {}).items()):
            if partition >= count or offset < 0:  # < 0: a start position, nothing read yet
                continue
            end = past_end(topic, partition, offset)
            if end is not None:
                anomalies.append(Anomaly(topic, "offset_past_end", (
                    f"{topic}[{partition}]: the recovery store resumes at offset {offset} but "
                    f"the partition ends at offset {end} (the topic was re-created or "
                    "truncated): reading it from its start; records already read under the old "
                    "topic are not read again, the new topic's records are placed by their own "
                    "timestamps (late ones become dead letters)"), fatal=False,
                    partition=partition, offset=offset))
    return anomalies


def rewinds(anomalies: list[Anomaly]) -> dict[str, dict[int, int]]:
    """``{topic: {partition: stored offset}}`` of the partitions to read from their start."""
    out: dict[str, dict[int, int]] = {}
    for a in anomalies:
        if a.reason == "offset_past_end" and a.partition is not None and a.offset is not None:
            out.setdefault(a.topic, {})[a.partition] = a.offset
    return out


def describe(anomalies: list[Anomaly]) -> str:
    """The fatal anomalies as one line (for the start-up error)."""
    return "; ".join(a.text for a in anomalies if a.fatal)


def enforce(anomalies: list[Anomaly], observe: Callable[[str, str], None]) -> None:
    """Count and log every anomaly; stop with a :class:`ConfigError` on a fatal one."""
    for anomaly in anomalies:
        observe(anomaly.topic, anomaly.reason)
        if not anomaly.fatal:
            log.warning("%s", anomaly.text)
    fatal = describe(anomalies)
    if fatal:
        raise ConfigError(fatal)
