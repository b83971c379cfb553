"""Raw messages as the Kafka source delivers them, for tests: broker timestamps included."""

from __future__ import annotations

import json

from dpstream.kinds.counters.events import TIMESTAMP_LOG_APPEND_TIME, RawMessage


def message(partition: int, key: str, ts: float | str, offset: int, *,
            broker: float | None = None, kind: int = TIMESTAMP_LOG_APPEND_TIME,
            topic: str = "events") -> RawMessage:
    """An event ``{"key": key, "ts": ts}``; its broker time is ``broker`` (default: ``ts``)."""
    if broker is None:
        assert not isinstance(ts, str), "give the broker time of an ISO-stamped event"
        broker = ts
    return (partition, json.dumps({"key": key, "ts": ts}).encode(), offset, topic,
            round(broker * 1000), kind)


def raw(partition: int, value: bytes, offset: int, broker: float, *,
        kind: int = TIMESTAMP_LOG_APPEND_TIME, topic: str = "events") -> RawMessage:
    """Any record value (e.g. a malformed one) with a broker time."""
    return (partition, value, offset, topic, round(broker * 1000), kind)
