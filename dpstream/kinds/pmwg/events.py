"""The PMWG flow's records in: events and questions decoded for the shared step clock.

:class:`PmwgClock` is the kind's :class:`~dpstream.stream.clock.StepClock`: an event on the
events topic becomes its cell in every histogram (a dead letter if it fits a universe of none),
a question on the queries topic becomes a pending question placed at its record timestamp,
and both are routed to the shard of their histogram. Placing records in steps, trusting
timestamps and detecting late records is the shared clock's job.

**At the user level** (``[contribution] unit = "user"``) an event must also name its person:
a non-empty string in ``contribution.user_field``, or it is a dead letter
(:func:`~dpstream.stream.clock.bad_person`). The decoder fills :attr:`PmwgClock.decoded_people`
aligned with the event payloads (the clock hashes them at once: the raw ids go no further),
and an event's payload is then its cells themselves (one int64 row, a cell per histogram)
rather than an index into the decoder's last batch, because the bounding stage routes the
kept payloads later, with :meth:`PmwgClock.route`. Questions name no person: they are the
analyst's, not the data's, and ``decoded_people`` is empty for a batch of questions. At the
event level nothing changes (the same payloads, the same work per record).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import orjson

from dpstream.kinds.pmwg.config import PmwgConfig
from dpstream.messages import DeadLetter, RawBatch, RawMessage
from dpstream.stream.clock import StepClock, bad_person, bad_time, event_seconds
from dpstream.stream.sharding import shard_of

__all__ = ["MAX_QUERY_ID", "PmwgClock"]

MAX_QUERY_ID: Final = 256


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
        contribution = config.contribution
        self.user_field = contribution.user_field if contribution.user_level else None
        self.decoded_people: list[str] = []
        """At the user level: the person of each event payload of the last decode."""

    def carries_people(self, partition: int) -> bool:
        """Events do; questions (the analyst's) pass the bounding stage unbounded."""
        return partition < self.first_query_partition

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
                       ) -> tuple[list[Any] | np.ndarray, np.ndarray | list[float], list[int]]:
        time_field = self.config.time_field
        user_field = self.user_field
        people: list[str] = []
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
            if user_field is not None:
                person = record.get(user_field)
                if not isinstance(person, str) or not person:
                    dead.append(self.dead_letter(bad_person(user_field), message))
                    continue
                people.append(person)
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
        if user_field is not None:  # self-contained payloads: the bounding stage routes later
            self.decoded_people = [people[j] for j in keep.tolist()]
            return (np.ascontiguousarray(self._cells.T), [times[j] for j in keep.tolist()],
                    [refs[j] for j in keep.tolist()])
        return (list(range(len(keep))), [times[j] for j in keep.tolist()],
                [refs[j] for j in keep.tolist()])

    def _decode_queries(self, messages: RawBatch, dead: list[DeadLetter]
                        ) -> tuple[list[Any], np.ndarray | list[float], list[int]]:
        payloads: list[Any] = []
        times: list[float] = []
        refs: list[int] = []
        if self.user_field is not None:
            self.decoded_people = []  # questions are the analyst's: no person, no bounding
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
        """Per shard and step: cell counts per histogram, and the questions asked.

        Event payloads are indexes into the last decoded batch (event level) or rows of
        cells, one per histogram (user level: what the bounding stage kept, followed by the
        step's questions, which it passes on unbounded).
        """
        per_shard: list[dict[int, Any]] = [{} for _ in range(self.config.shards)]
        if len(payloads) == 0:
            return per_shard
        step_array = (np.full(len(payloads), steps, dtype=np.int64) if isinstance(steps, int)
                      else np.asarray(steps, dtype=np.int64))
        if isinstance(payloads, list) and isinstance(payloads[-1], tuple):  # questions
            split = 0 if isinstance(payloads[0], tuple) else next(  # after the kept rows
                i for i, p in enumerate(payloads) if isinstance(p, tuple))
            for payload, step in zip(payloads[split:], step_array[split:].tolist(),
                                     strict=True):
                shard = self.shard_of[self.names[payload[3]]]
                bucket = per_shard[shard].setdefault(step, {"cells": {}, "queries": []})
                bucket["queries"].append(payload[1:])
            if split == 0:
                return per_shard
            payloads, step_array = payloads[:split], step_array[:split]
        rows = np.asarray(payloads, dtype=np.int64)
        by_histogram = rows.T if rows.ndim == 2 else self._cells[:, rows]
        for h, (name, shard) in enumerate(zip(self.names, self.shard_of, strict=True)):
            cells = by_histogram[h]
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
