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
from collections.abc import Iterable, Mapping
from datetime import datetime
from itertools import repeat
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import orjson

from dpstream.core.key_statistics import Alert, BudgetExhausted, Release
from dpstream.core.ledger import zcdp_to_approx_dp
from dpstream.messages import DeadLetter, Encoded, step_window

if TYPE_CHECKING:
    from dpstream.core.key_table import ReleaseColumns, StepOutputs

__all__ = [
    "ALERT_SCHEMA",
    "DEAD_LETTER_SCHEMA",
    "DeadLetter",
    "EncodedBatch",
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



class EncodedBatch(list[Encoded]):
    """The encoded records of one closed step of one shard: a list of ``(role, key, value)``.

    A sink that gets one writes every triple it holds, in order (see
    :class:`~dpstream.io.kafka.KafkaOutput`); :func:`flatten` turns a mixed stream of triples
    and batches back into triples.
    """

    __slots__ = ()


def flatten(item: Encoded | EncodedBatch) -> list[Encoded]:
    """The triples of a stream item: a batch's, or the single triple itself."""
    return item if isinstance(item, EncodedBatch) else [item]


_KEY_MARK: Final = "\x00dpstream-key\x00"  # JSON-escaped in the template, so never ambiguous
_VALUE_MARK: Final = "\x00dpstream-value\x00"
_NUMPY: Final = orjson.OPT_SERIALIZE_NUMPY


class RecordEncoder:
    """Turns core outputs into ``(topic_role, key_bytes, value_bytes)`` triples.

    :meth:`encode` encodes one output; :meth:`encode_step` a whole closed step at once, byte
    for byte as :meth:`encode` would, with every field a release column shares (schema, flow,
    mechanism, step, window, std, privacy) encoded once per column: per release only the
    key's bytes and the value are formatted.
    """

    def __init__(self, flow: str, origin: datetime, step_seconds: float,
                 conversion_delta: float = 1e-6) -> None:
        self.flow, self.origin, self.step_seconds = flow, origin, step_seconds
        self.conversion_delta = conversion_delta

    def window(self, step: int) -> dict[str, str]:
        """The event-time window [start, end) of a global step."""
        return step_window(self.origin, self.step_seconds, step)

    def _release_body(self, key: object, step: int, value: object, std: float, mechanism: str,
                      spent: float, budget: float, unit: str, delta: float) -> dict[str, Any]:
        privacy: dict[str, object] = {"unit": "event", "accounting": unit, "spent": spent,
                                      "budget": budget, "delta": delta}
        if unit == "rho" and self.conversion_delta > 0:
            privacy["approx_dp"] = {  # rho-zCDP => (eps, delta)-DP, BS16 Prop. 1.3
                "epsilon": zcdp_to_approx_dp(spent, self.conversion_delta),
                "delta": self.conversion_delta + delta}
        return {"schema": RELEASE_SCHEMA, "flow": self.flow, "mechanism": mechanism,
                "key": key, "step": step, "window": self.window(step), "value": value,
                "std": std, "privacy": privacy}

    def _alert_body(self, key: object, step: int, threshold: int,
                    epsilon: float) -> dict[str, Any]:
        return {"schema": ALERT_SCHEMA, "flow": self.flow, "key": key, "step": step,
                "window": self.window(step), "threshold": threshold, "epsilon": epsilon}

    def encode(self, item: Release | Alert | BudgetExhausted) -> tuple[str, bytes, bytes]:
        """Encode one output; the first element names the topic role."""
        if isinstance(item, Release):
            return "releases", item.key.encode(), orjson.dumps(self._release_body(
                item.key, item.step, item.value, item.std, item.mechanism, item.spent,
                item.budget, item.unit, item.delta), option=_NUMPY)
        if isinstance(item, Alert):
            return "alerts", item.key.encode(), orjson.dumps(self._alert_body(
                item.key, item.step, item.threshold, item.epsilon), option=_NUMPY)
        return "releases", item.key.encode(), orjson.dumps({
            "schema": STATUS_SCHEMA, "flow": self.flow, "status": "budget_exhausted",
            "key": item.key, "step": item.step, "window": self.window(item.step),
            "refused": item.label, "reason": item.reason, "spent": item.spent,
            "budget": item.budget, "accounting": item.unit,
        })

    def encode_item(self, item: Any) -> Encoded | EncodedBatch:
        """Encode a stream item: a closed step's outputs as a batch, else one output."""
        if isinstance(item, (Release, Alert, BudgetExhausted)):
            return self.encode(item)
        return self.encode_step(item)

    def encode_step(self, outputs: StepOutputs) -> EncodedBatch:
        """Encode a closed step's outputs, in their order, exactly as :meth:`encode` would.

        Statuses (rare) go through :meth:`encode`. Alerts that share their step, threshold
        and epsilon, and each release column, are encoded in bulk: the fields they share
        make one template (encoded once, by the same code as :meth:`encode`), the values are
        formatted by one ``orjson`` call over the float64 column (the same shortest
        round-trip text ``orjson`` writes for a Python float), and so are the keys: when
        ``orjson`` escaped nothing (no backslash in its output) each key's JSON is its UTF-8
        bytes in quotes, which are also the record's Kafka key. Per record only the key and
        the value are formatted into the template. If anything is unusual the records are
        encoded one by one (the same bytes, slower).
        """
        batch = EncodedBatch(map(self.encode, outputs.statuses))
        batch.extend(self.encode_alerts(outputs.alerts))
        for columns in outputs.releases:
            batch.extend(self.encode_columns(columns))
        return batch

    def encode_alerts(self, alerts: list[Alert]) -> list[Encoded]:
        """The records of alerts, in their order (in bulk when they share all but the key)."""
        if len(alerts) > 1:
            first = alerts[0]
            shared = (first.step, first.threshold, first.epsilon)
            if all((a.step, a.threshold, a.epsilon) == shared for a in alerts):
                body = self._alert_body(_KEY_MARK, *shared)
                records = _bulk("alerts", body, [a.key for a in alerts], None)
                if records is not None:
                    return records
        return list(map(self.encode, alerts))

    def encode_columns(self, columns: ReleaseColumns) -> list[Encoded]:
        """The records of the releases of one :class:`ReleaseColumns`, in its key order."""
        keys = columns.keys
        if not len(keys):
            return []
        values = np.asarray(columns.values, dtype=np.float64)
        if values.shape != (len(keys),):
            raise ValueError(f"a release column has {len(keys)} keys and values of shape "
                             f"{values.shape}")
        c = columns
        body = self._release_body(_KEY_MARK, c.step, _VALUE_MARK, c.std, c.mechanism, c.spent,
                                  c.budget, c.unit, c.delta)
        records = _bulk("releases", body, keys, values)
        if records is None:
            return [self.encode(release) for release in _releases(c)]
        return records

    def encode_dead_letter(self, letter: DeadLetter) -> tuple[str, bytes | None, bytes]:
        """Encode a dead letter for the dead-letter topic."""
        return encode_dead_letter(self.flow, letter)


def _bulk(role: str, body: dict[str, Any], keys: list[str], values: np.ndarray | None
          ) -> list[Encoded] | None:
    """Records whose JSON is ``body`` with each key (and value) in place of the markers.

    ``body`` holds :data:`_KEY_MARK` as the key and, if ``values`` is given,
    :data:`_VALUE_MARK` as the value. None if the bulk path cannot be used (a marker also
    elsewhere in ``body``, a key ``orjson`` refuses): encode one by one then.
    """
    text = orjson.dumps(body, option=_NUMPY)
    key_mark, value_mark = orjson.dumps(_KEY_MARK), orjson.dumps(_VALUE_MARK)
    if text.count(key_mark) != 1 or text.count(value_mark) != (values is not None):
        return None  # a marker inside another field (e.g. the flow's name)
    head, tail = text.replace(b"%", b"%%").split(key_mark)
    if values is not None and value_mark not in tail:
        return None  # the templates put the key first
    try:
        keys_json = orjson.dumps(keys)
    except (orjson.JSONEncodeError, TypeError):  # e.g. a lone surrogate: as encode fails
        return None
    if b"\\" in keys_json:  # some key needed escaping: its JSON differs from its bytes
        names = [key.encode() for key in keys]
        quoted: list[bytes] = list(map(orjson.dumps, keys))
        template = head + b"%s" + tail
    else:
        names = quoted = keys_json[2:-2].split(b'","')
        template = head + b'"%s"' + tail
    if values is None:
        records = list(map(template.__mod__, quoted))
    else:
        texts = orjson.dumps(np.ascontiguousarray(values), option=_NUMPY)[1:-1].split(b",")
        template = template.replace(value_mark, b"%s")
        records = list(map(template.__mod__, zip(quoted, texts, strict=True)))
    return list(zip(repeat(role), names, records))


def _releases(c: ReleaseColumns) -> Iterable[Release]:
    """The releases of a column, one object each (the slow path)."""
    values = np.asarray(c.values, dtype=np.float64).tolist()
    for key, value in zip(c.keys, values, strict=True):
        yield Release(key, c.step, value, c.std, c.mechanism, c.spent, c.budget, c.unit,
                      c.delta)


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
