"""The versioned JSON records dpstream publishes (documented in README.md).

* ``dpstream.release/1`` — one private count for one key and time step.
* ``dpstream.alert/1`` — a key's threshold monitor fired.
* ``dpstream.status/1`` — budget exhaustion (on the releases topic, so its consumers see it).
* ``dpstream.dead_letter/1`` — a record that could not be used, with the reason and the original
  bytes (base64; at most :data:`MAX_ORIGINAL_BYTES` of them, with the full size and a SHA-256
  digest, so a huge bad record never makes a dead letter the broker refuses). Dead letters hold
  raw data: give the dead-letter topic to operators only, never to the audience of the releases.

**Delivery is at least once.** Records are written before the snapshot that covers them is
committed, and a restart replays the open epoch, so a record may appear twice; a replay
reproduces it byte for byte (same noise). Consumers de-duplicate releases and statuses on
``(flow, key, step, schema)``, alerts on ``(flow, key, step)`` and dead letters on
``source``; :func:`identity` gives that identity for any record.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final

import orjson

from dpstream.core.key_statistics import Alert, BudgetExhausted, Release
from dpstream.core.ledger import zcdp_to_approx_dp
from dpstream.messages import DeadLetter, step_window

__all__ = [
    "ALERT_SCHEMA",
    "DEAD_LETTER_SCHEMA",
    "DeadLetter",
    "MAX_ORIGINAL_BYTES",
    "RELEASE_SCHEMA",
    "RecordEncoder",
    "encode_dead_letter",
    "STATUS_SCHEMA",
    "identity",
]

RELEASE_SCHEMA: Final = "dpstream.release/1"
ALERT_SCHEMA: Final = "dpstream.alert/1"
STATUS_SCHEMA: Final = "dpstream.status/1"
DEAD_LETTER_SCHEMA: Final = "dpstream.dead_letter/1"
MAX_ORIGINAL_BYTES: Final = 64 * 1024
"""The most of a bad record's bytes a dead letter carries (base64 makes it 4/3 larger)."""



class RecordEncoder:
    """Turns core outputs into ``(topic_role, key_bytes, value_bytes)`` triples."""

    def __init__(self, flow: str, origin: datetime, step_seconds: float,
                 conversion_delta: float = 1e-6) -> None:
        self.flow, self.origin, self.step_seconds = flow, origin, step_seconds
        self.conversion_delta = conversion_delta

    def window(self, step: int) -> dict[str, str]:
        """The event-time window [start, end) of a global step."""
        return step_window(self.origin, self.step_seconds, step)

    def encode(self, item: Release | Alert | BudgetExhausted) -> tuple[str, bytes, bytes]:
        """Encode one output; the first element names the topic role."""
        if isinstance(item, Release):
            privacy: dict[str, object] = {"unit": "event", "accounting": item.unit,
                                          "spent": item.spent, "budget": item.budget,
                                          "delta": item.delta}
            if item.unit == "rho" and self.conversion_delta > 0:
                privacy["approx_dp"] = {  # rho-zCDP => (eps, delta)-DP, BS16 Prop. 1.3
                    "epsilon": zcdp_to_approx_dp(item.spent, self.conversion_delta),
                    "delta": self.conversion_delta + item.delta}
            return "releases", item.key.encode(), orjson.dumps({
                "schema": RELEASE_SCHEMA, "flow": self.flow, "mechanism": item.mechanism,
                "key": item.key, "step": item.step, "window": self.window(item.step),
                "value": item.value, "std": item.std, "privacy": privacy,
            })
        if isinstance(item, Alert):
            return "alerts", item.key.encode(), orjson.dumps({
                "schema": ALERT_SCHEMA, "flow": self.flow, "key": item.key, "step": item.step,
                "window": self.window(item.step), "threshold": item.threshold,
                "epsilon": item.epsilon,
            })
        return "releases", item.key.encode(), orjson.dumps({
            "schema": STATUS_SCHEMA, "flow": self.flow, "status": "budget_exhausted",
            "key": item.key, "step": item.step, "window": self.window(item.step),
            "refused": item.label, "reason": item.reason, "spent": item.spent,
            "budget": item.budget, "accounting": item.unit,
        })

    def encode_dead_letter(self, letter: DeadLetter) -> tuple[str, bytes | None, bytes]:
        """Encode a dead letter for the dead-letter topic."""
        return encode_dead_letter(self.flow, letter)


def encode_dead_letter(flow: str, letter: DeadLetter) -> tuple[str, bytes | None, bytes]:
    """Encode a dead letter of flow ``flow`` for the dead-letter topic (every flow kind)."""
    return "dead_letters", None, orjson.dumps({
        "schema": DEAD_LETTER_SCHEMA, "flow": flow, "reason": letter.reason,
        "source": {"topic": letter.topic, "partition": letter.partition,
                   "offset": letter.offset},
        "original_base64": base64.b64encode(letter.original[:MAX_ORIGINAL_BYTES]).decode(),
        "original_size": len(letter.original),
        "original_sha256": hashlib.sha256(letter.original).hexdigest(),
        "original_truncated": len(letter.original) > MAX_ORIGINAL_BYTES,
    })


def identity(body: Mapping[str, Any]) -> tuple[Any, ...]:
    """What identifies a published record, for consumers that de-duplicate.

    Delivery is at least once; a replayed record is byte-identical to the first copy, so
    keeping the first record of each identity loses nothing.
    """
    schema = body.get("schema")
    if schema == DEAD_LETTER_SCHEMA:
        source = body.get("source") or {}
        return (schema, body.get("flow"), source.get("topic"), source.get("partition"),
                source.get("offset"))
    if schema in (RELEASE_SCHEMA, ALERT_SCHEMA, STATUS_SCHEMA):
        return (schema, body.get("flow"), body.get("key"), body.get("step"))
    raise ValueError(f"not a dpstream record: schema {schema!r}")
