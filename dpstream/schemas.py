"""The records dpstream publishes, each defined once, as :class:`msgspec.Struct` types.

The producers (the counters', PMWG's and ERM's encoders, dead letters) build these Structs
and write them with :func:`encode`; the readers (:mod:`dpstream.client`,
:mod:`dpstream.query_client`, ``dpstream tail``) decode the same Structs. This module imports
only msgspec, orjson and the standard library, so every layer may use it.

Every record is a JSON object whose ``schema`` field names its type and the type's major
version, ``<name>/<major>`` (``dpstream.release/1``): the Struct's tag.

**Rules for changing a schema** (read them before touching a Struct below):

* **A minor change keeps the tag.** It may only *add* a field that readers may ignore:
  optional (a default of None, or :data:`msgspec.UNSET` when the field is sometimes written
  as ``null`` and sometimes left out), with a meaning that no existing field's reading
  depends on. Readers of the same major version ignore fields they do not know (msgspec does
  by default; never set ``forbid_unknown_fields``), so old readers keep working and new
  readers see None on old records. ``instance`` was added to every ``/1`` schema this way.
* **Anything else is a major change:** removing or renaming a field, changing its type, its
  unit or what it means, making an optional field required, or changing which records carry
  it. A major change is published under a new tag (``dpstream.release/2``) as a new Struct,
  next to the old one; :data:`SUPPORTED_SCHEMAS` names the major version the readers of
  this dpstream understand, and a reader refuses (or, asked to, skips) another one. A flow
  keeps writing the old major version for at least one minor release of dpstream after the
  new one exists (the release notes say which), so consumers can upgrade first; then the
  old Struct is deleted.
* **Presence is public.** Whether a field is written, and every value but the noisy ones
  (``value``, a model's weights, an answer's value), must be a function of public things only:
  the configuration, the flow instance, the step, public ledger events (``role =
  "exhausted"``). A field left out for some data and written for other data publishes which
  one it is (privacy-pitfalls.md, item 12); so is a field whose type or precision depends on
  the data. Producers build records from public inputs and the noisy outputs; review any new
  optional field against this rule.
* **The field order is the order on the topic.** :func:`encode` writes the fields in the
  order they are declared here (the tag first) and the counters' bulk encoder derives its
  byte templates from it: moving a field changes the bytes every flow writes (a replay is no
  longer byte-identical to the first copy), so do not reorder fields, append new ones.
* **What is omitted:** a field whose value is :data:`msgspec.UNSET`, or None where its
  default is None, is left out of the record; a required field is always written (``null``
  if None). Floats are written by orjson (shortest round-trip text, ``1e+16``, ``null`` for
  NaN and infinities), times as ISO 8601 with ``Z`` for UTC.

The records are immutable (frozen) Structs: hashable, comparable; sequences are tuples,
times timezone-aware :class:`~datetime.datetime` values. Every Struct is keyword-only: build
them by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, Final

import msgspec
import orjson

__all__ = [
    "ALERT_SCHEMA",
    "ANSWER_SCHEMA",
    "DEAD_LETTER_SCHEMA",
    "MODEL_SCHEMA",
    "RELEASE_SCHEMA",
    "STATUS_SCHEMA",
    "SUPPORTED_SCHEMAS",
    "Alert",
    "Answer",
    "ApproxDp",
    "DeadLetter",
    "DeadLetterSource",
    "Model",
    "ModelFeatures",
    "ModelHoldout",
    "ModelNoise",
    "PersonLevel",
    "Privacy",
    "Record",
    "Release",
    "Status",
    "Window",
    "encode",
    "to_builtins",
]

RELEASE_SCHEMA: Final = "dpstream.release/1"
STATUS_SCHEMA: Final = "dpstream.status/1"
ALERT_SCHEMA: Final = "dpstream.alert/1"
ANSWER_SCHEMA: Final = "dpstream.answer/1"
MODEL_SCHEMA: Final = "dpstream.model/1"
DEAD_LETTER_SCHEMA: Final = "dpstream.dead_letter/1"

SUPPORTED_SCHEMAS: Final = {
    "dpstream.release": 1, "dpstream.status": 1, "dpstream.alert": 1,
    "dpstream.answer": 1, "dpstream.model": 1, "dpstream.dead_letter": 1,
}
"""The record types dpstream writes and reads, by name, with their current major version."""


class _Data(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Plain nested data of a record."""


class _Record(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True,
              tag_field="schema"):
    """A published record: its type is its ``schema`` tag."""

    @property
    def schema(self) -> str:
        """The record's ``schema`` field (``dpstream.release/1``)."""
        return str(self.__struct_config__.tag)

    def to_dict(self) -> dict[str, Any]:
        """The record as plain JSON data, with the topic's field names (times as ISO text).

        Optional fields that are unset are left out, as the flows leave them out.
        """
        data: dict[str, Any] = _ANY.decode(msgspec.json.encode(self))  # tuples -> lists
        return data


class Window(_Data, frozen=True, kw_only=True):
    """The event-time window ``[start, end)`` a record covers.

    ``first_step`` and ``last_step`` are set on models (the steps of the model's data).
    """

    first_step: int | None = None
    last_step: int | None = None
    start: datetime
    end: datetime

    @classmethod
    def of_steps(cls, origin: datetime, step_seconds: float, first: int,
                 last: int | None = None, *, steps: bool = False) -> Window:
        """The window of steps ``first..last`` (``last`` defaults to ``first``).

        ``steps``: also set ``first_step`` and ``last_step`` (as models do).
        """
        end_step = first if last is None else last
        start = origin + timedelta(seconds=first * step_seconds)
        end = origin + timedelta(seconds=(end_step + 1) * step_seconds)
        if steps:
            return cls(first_step=first, last_step=end_step, start=start, end=end)
        return cls(start=start, end=end)


class ApproxDp(_Data, frozen=True, kw_only=True):
    """The (ε, δ)-DP a zCDP spend implies (Bun–Steinke 2016, Prop. 1.3)."""

    epsilon: float
    delta: float


class PersonLevel(_Data, frozen=True, kw_only=True):
    """What one person's bounded contribution costs over the whole flow (``unit = "user"``).

    Written only at the user level (a function of the configuration: public).

    Attributes:
        period: ``lifetime``, or ``"N steps"``: the unit is a person's events within one
            period, and a person active in k periods is protected by group privacy over
            k units: k times this epsilon (pure), k^2 times this rho (zCDP).
        caps: the contribution caps, ``(name, value)`` pairs (counters: ``max_keys``,
            ``max_per_key``).
        epsilon: the person's total epsilon (zCDP: converted at the record's delta).
        delta: the person's total delta (with the hash-collision delta).
        rho: the person's total rho (zCDP only).
    """

    period: str
    caps: tuple[tuple[str, int], ...]
    epsilon: float
    delta: float
    rho: float | None = None


class Privacy(_Data, frozen=True, kw_only=True):
    """What a record has cost, per privacy unit.

    Attributes:
        unit: the privacy unit (``event``, or ``user``: one person's bounded contribution).
        accounting: the ledger's unit: ``epsilon`` or ``rho`` (releases); ``pure`` or ``zcdp``
            (answers, models); ``approx_dp`` (ERMG models: ε of (ε, δ)).
        cost: this record's own cost (models).
        spent: what the key (histogram, model stream) has spent so far.
        budget: what it may spend.
        delta: the δ of the guarantee, where there is one.
        approx_dp: the (ε, δ) a zCDP spend implies.
        person: at the user level only, what one person's contribution costs in all (the
            other figures are then per key, histogram or model stream, against one person).
    """

    unit: str
    accounting: str
    cost: float | None = None
    spent: float
    budget: float
    delta: float | None = None
    approx_dp: ApproxDp | None = None
    person: PersonLevel | None = None

    @property
    def remaining(self) -> float:
        """``budget - spent``."""
        return self.budget - self.spent


class Release(_Record, frozen=True, kw_only=True, tag=RELEASE_SCHEMA):
    """One private count: the key's events up to the end of ``step`` (``value`` ± ``std``)."""

    flow: str
    instance: str | None = None
    """The flow instance that published it (None from a dpstream before the field existed)."""
    mechanism: str
    key: str
    step: int
    window: Window
    value: float
    std: float
    privacy: Privacy

    def interval(self, z: float = 1.96) -> tuple[float, float]:
        """``value ∓ z·std`` (1.96: a 95 % interval when the noise is close to normal)."""
        return self.value - z * self.std, self.value + z * self.std


class Alert(_Record, frozen=True, kw_only=True, tag=ALERT_SCHEMA):
    """A key's threshold monitor fired at ``step`` (in the open universe: the key is admitted)."""

    flow: str
    instance: str | None = None
    """The flow instance that published it (None from a dpstream before the field existed)."""
    key: str
    step: int
    window: Window
    threshold: int
    epsilon: float


class Status(_Record, frozen=True, kw_only=True, tag=STATUS_SCHEMA):
    """A ledger refused a charge (``status = "budget_exhausted"``): the key stops releasing."""

    flow: str
    instance: str | None = None
    """The flow instance that published it (None from a dpstream before the field existed)."""
    status: str
    key: str
    step: int
    window: Window
    refused: str
    reason: str
    spent: float
    budget: float
    accounting: str


class Answer(_Record, frozen=True, kw_only=True, tag=ANSWER_SCHEMA):
    """A PMWG flow's answer to question ``id`` (a fraction in [0, 1], per part for marginals).

    ``kind`` is ``easy``, ``hard``, ``bottom`` (⊥, with its ``reason``), ``error``,
    ``waiting`` or ``marginal`` (then ``value`` and ``kinds`` have one entry per part).
    """

    flow: str
    instance: str | None = None
    """The flow instance that published it (None from a dpstream before the field existed)."""
    histogram: str
    mechanism: str
    id: str
    step: int
    window: Window
    t: int
    kind: str
    value: float | tuple[float | None, ...] | None
    reason: str | None
    hard_queries: int
    privacy: Privacy
    kinds: tuple[str, ...] | None = None


class ModelFeatures(_Data, frozen=True, kw_only=True):
    """The raw features a model expects: ``dimension`` numbers, rows clipped to ``clip_norm``.

    ``norm`` is the norm of that clipping: ``"l2"`` (output perturbation; omitted, the default)
    or ``"l1"`` (the objective learner).
    """

    dimension: int
    clip_norm: float
    norm: str = "l2"


class ModelNoise(_Data, frozen=True, kw_only=True):
    """Each weight's noise standard deviation and the exact grid it was released on."""

    std: float
    grid: str


class ModelHoldout(_Data, frozen=True, kw_only=True):
    """Accuracy on the flow's public holdout."""

    accuracy: float
    rows: int


class Model(_Record, frozen=True, kw_only=True, tag=MODEL_SCHEMA):
    """A private classifier an ERM flow released (or, without ``coef``, why a stream stopped).

    A model carries ``coef``, ``intercept``, ``features``, ``noise`` and ``holdout`` (None,
    written as ``null``, when the flow has no holdout); a stream's last record
    (``role = "exhausted"``) carries ``reason`` instead, and ``holdout`` is then unset.
    ``classifier()`` turns a model into a ready scikit-learn-compatible classifier.
    """

    flow: str
    instance: str | None = None
    """The flow instance that published it (None from a dpstream before the field existed)."""
    stream: str
    algorithm: str
    role: str
    level: int | None
    step: int
    released: Window
    window: Window
    depends_on: tuple[tuple[int, int], ...]
    classes: tuple[Any, ...]
    privacy: Privacy
    reason: str | None = None
    coef: tuple[tuple[float, ...], ...] | None = None
    intercept: tuple[float, ...] | None = None
    features: ModelFeatures | None = None
    noise: ModelNoise | None = None
    holdout: ModelHoldout | None | msgspec.UnsetType = msgspec.UNSET

    @property
    def has_weights(self) -> bool:
        """False for a status record (``role = "exhausted"``) that carries no model."""
        return self.coef is not None


class DeadLetterSource(_Data, frozen=True, kw_only=True):
    """Where a dead letter's original record was read."""

    topic: str | None
    partition: int | None
    offset: int | None


class DeadLetter(_Record, frozen=True, kw_only=True, tag=DEAD_LETTER_SCHEMA):
    """An input record a flow could not use, and why (raw input data: operators only)."""

    flow: str
    instance: str | None = None
    """The flow instance that published it (None from a dpstream before the field existed)."""
    reason: str
    source: DeadLetterSource
    original_base64: str
    original_size: int
    original_sha256: str
    original_truncated: bool


Record = Release | Status | Alert | Answer | Model | DeadLetter
"""Every record type dpstream publishes."""

_ANY: Final = msgspec.json.Decoder()
_NUMPY: Final = orjson.OPT_SERIALIZE_NUMPY


def _scalar(value: Any) -> Any:
    """A numpy scalar as its Python twin, which orjson writes the same way (``enc_hook``).

    Records carry float64 numbers (the bulk encoder casts its columns to float64): a narrower
    numpy float is refused, as orjson writes it by a shorter text of its own.
    """
    dtype = getattr(value, "dtype", None)
    if dtype is None or type(value).__module__ != "numpy" or dtype.kind not in "biuf" \
            or (dtype.kind == "f" and dtype.itemsize != 8):
        raise TypeError(f"a {type(value).__name__} is not a record's JSON data")
    return value.item()


def to_builtins(record: msgspec.Struct) -> dict[str, Any]:
    """The record as the dict the producers write: the tag first, then the fields in order.

    Nested Structs become dicts, tuples lists, datetimes ISO 8601 text (``Z`` for UTC), numpy
    scalars Python numbers. Unset fields, and None in fields whose default is None, are left
    out (see the rules at the top).
    """
    body: dict[str, Any] = msgspec.to_builtins(record, enc_hook=_scalar)
    return body


def encode(record: msgspec.Struct) -> bytes:
    """A record's JSON bytes, as every flow writes them (orjson's float texts)."""
    return orjson.dumps(msgspec.to_builtins(record, enc_hook=_scalar), option=_NUMPY)


def identity(body: Mapping[str, Any]) -> tuple[Any, ...]:
    """What identifies a published record (its decoded JSON), for consumers that de-duplicate.

    Delivery is at least once; a replayed record is byte-identical to the first copy, so
    keeping the first record of each identity loses nothing. Releases and statuses are
    identified by ``(schema, flow, instance, key, step)``, alerts the same way, dead letters
    by ``(schema, flow, instance, source)``.
    """
    schema = body.get("schema")
    if schema == DEAD_LETTER_SCHEMA:
        source = body.get("source") or {}
        return (schema, body.get("flow"), body.get("instance"), source.get("topic"),
                source.get("partition"), source.get("offset"))
    if schema in (RELEASE_SCHEMA, ALERT_SCHEMA, STATUS_SCHEMA):
        return (schema, body.get("flow"), body.get("instance"), body.get("key"),
                body.get("step"))
    raise ValueError(f"not a dpstream record: schema {schema!r}")
