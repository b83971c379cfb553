"""The ERM kind's events: a feature vector, a label, an event time and a model stream per record.

:class:`ErmClock` is the kind's :class:`~dpstream.stream.clock.StepClock`: it decodes events
into feature rows (clipped, mapped), label indices and their stream, and routes each step's
rows to the shard of their model stream. Placing records in steps, trusting timestamps and
detecting late records is the shared clock's job (:mod:`dpstream.stream.clock`).

At ``contribution.unit = "user"`` a record must also name its person in
``contribution.user_field`` (a non-empty string; else a dead letter, :func:`bad_person`), the
decoder fills :attr:`~dpstream.stream.clock.StepClock.decoded_people` aligned with its
payloads (the shared clock hashes them at once; the raw ids go no further), and each payload
carries its own row (a record of :func:`user_row`: features, label, stream, partition and
offset), because the contribution stage routes the kept payloads from another operator. At the
event level the payloads stay indexes into the batch's arrays, as before.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson

from dpstream.kinds.erm.config import ErmConfig, _class_indices, _feature_matrix, _not_numbers
from dpstream.messages import DeadLetter, RawBatch
from dpstream.stream.clock import StepClock, bad_person, bad_time, event_seconds
from dpstream.stream.sharding import shard_of

__all__ = ["ErmClock", "user_row"]


def user_row(columns: int) -> np.dtype[np.void]:
    """The payload of one row at ``unit = "user"``: features, label, stream, (partition, offset)."""
    return np.dtype([("z", np.float64, (columns,)), ("y", np.int64), ("stream", np.int64),
                     ("order", np.int64, (2,))])


class ErmClock(StepClock):
    """Decodes events into feature rows (clipped, mapped), label indices and their stream."""

    def __init__(self, config: ErmConfig, state: dict[str, Any] | None = None) -> None:
        super().__init__(config, state)
        self.config = config
        self.stream_index = {s: i for i, s in enumerate(config.streams)}
        self.shard_of = [shard_of(s, config.shards) for s in config.streams]
        self._z = np.empty((0, config.model.columns))
        self._y = np.empty(0, dtype=np.int64)
        self._streams = np.empty(0, dtype=np.int64)
        self._order = np.empty((0, 2), dtype=np.int64)
        self._user_row = user_row(config.model.columns)

    def decode(self, partition: int, messages: RawBatch, dead: list[DeadLetter]
               ) -> tuple[list[Any] | np.ndarray, list[float], list[int]]:
        """Events with usable features, label, stream and time; the rest are dead letters."""
        config = self.config
        time_field, stream_field = config.time_field, config.stream_field
        features_field, label_field = config.features_field, config.label_field
        d, classes = config.model.dimension, _class_indices(config.model.classes)
        stream_index, loads, dead_letter = self.stream_index, orjson.loads, self.dead_letter
        rows: list[list[float]] = []
        labels: list[int] = []
        streams: list[int] = []
        order: list[tuple[int, int | None]] = []  # (partition, offset) of each row
        times: list[float] = []
        refs: list[int] = []
        user_field = config.contribution.user_field if config.contribution.user_level else None
        people: list[str] = []
        for i, message in enumerate(messages):  # the hot loop: checks inlined, cheapest first
            try:
                record = loads(message[1]) if message[1] is not None else None
            except orjson.JSONDecodeError:
                dead.append(dead_letter("invalid JSON", message))
                continue
            if type(record) is not dict:
                dead.append(dead_letter("not a JSON object", message))
                continue
            x = record.get(features_field)
            if type(x) is not list or len(x) != d:
                dead.append(dead_letter(_not_numbers(config), message))
                continue
            label = record.get(label_field)
            index = classes.get((type(label).__name__, label)) if type(label) in (str, int) \
                else None
            if index is None:
                dead.append(dead_letter(
                    f"field {label_field!r} must be one of the configured classes", message))
                continue
            ts = record.get(time_field)
            ts = float(ts) if type(ts) is float or type(ts) is int else event_seconds(ts)
            if ts is None or not math.isfinite(ts):
                dead.append(dead_letter(bad_time(time_field), message))
                continue
            stream = 0
            if stream_field is not None:
                value = record.get(stream_field)
                found = stream_index.get(value) if type(value) is str else None
                if found is None:
                    dead.append(dead_letter(
                        f"field {stream_field!r} must name a configured model stream",
                        message))
                    continue
                stream = found
            if user_field is not None:
                person = record.get(user_field)
                if type(person) is not str or not person:
                    dead.append(dead_letter(bad_person(user_field), message))
                    continue
                people.append(person)
            rows.append(x)
            labels.append(index)
            streams.append(stream)
            order.append((partition, message[2]))
            times.append(ts)
            refs.append(i)
        matrix, problems = _feature_matrix(rows, config)
        keep = np.ones(len(rows), dtype=bool)
        for j, problem in sorted(problems.items()):
            dead.append(self.dead_letter(problem, messages[refs[j]]))
            keep[j] = False
        count = int(keep.sum())
        self._z = (config.model.features(matrix[keep]) if count
                   else np.empty((0, config.model.columns)))
        self._y = np.asarray(labels, dtype=np.int64)[keep]
        self._streams = np.asarray(streams, dtype=np.int64)[keep]
        self._order = np.asarray(order, dtype=np.int64).reshape(len(rows), 2)[keep]
        kept = np.flatnonzero(keep).tolist()
        if user_field is None:
            return list(range(count)), [times[j] for j in kept], [refs[j] for j in kept]
        self.decoded_people = [people[j] for j in kept]
        payloads = np.empty(count, dtype=self._user_row)
        payloads["z"], payloads["y"] = self._z, self._y
        payloads["stream"], payloads["order"] = self._streams, self._order
        return payloads, [times[j] for j in kept], [refs[j] for j in kept]

    def route(self, payloads: list[Any] | np.ndarray, steps: int | list[int]
              ) -> list[dict[int, Any]]:
        """Per shard and step: each stream's rows (features, labels, partition and offset)."""
        per_shard: list[dict[int, Any]] = [{} for _ in range(self.config.shards)]
        if not len(payloads):
            return per_shard
        if self.config.contribution.user_level:  # self-contained rows (module docstring)
            data = np.asarray(payloads if isinstance(payloads, np.ndarray)
                              else np.array(payloads, dtype=self._user_row))
            z, y, streams, order = data["z"], data["y"], data["stream"], data["order"]
            rows = np.arange(len(data))
        else:
            z, y, order = self._z, self._y, self._order
            rows = np.asarray(payloads, dtype=np.int64)
            streams = self._streams[rows]
        step_array = (np.full(len(rows), steps, dtype=np.int64) if isinstance(steps, int)
                      else np.asarray(steps, dtype=np.int64))
        for step in np.unique(step_array).tolist():
            in_step = step_array == step
            for stream in np.unique(streams[in_step]).tolist():
                pick = rows[in_step & (streams == stream)]
                name = self.config.streams[stream]
                bucket = per_shard[self.shard_of[stream]].setdefault(step, {})
                bucket[name] = [(z[pick], y[pick], order[pick])]
        return per_shard
