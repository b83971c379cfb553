"""Typed records of the topics a flow publishes, and the schema checks that decode them.

Every record dpstream publishes is a JSON object whose ``schema`` field names its type and the
type's major version, ``<name>/<major>`` (``dpstream.release/1``). Within a major version
fields are only ever *added*; a change a reader could misread gets a new major version. So
:func:`decode`

* accepts a known name at the known major version, ignoring fields it does not know (a
  newer dpstream may have added them),
* raises :class:`SchemaVersionError` for a known name at another major version (a reader
  built for ``/1`` must not guess at ``/2``), and
* raises :class:`UnknownRecordError` for anything else: bytes that are not JSON, JSON that is
  not an object, no ``schema``, a schema no dpstream publishes, or a known schema whose
  fields have the wrong types. The message names the schema and the field, never a value.

The records are immutable :class:`msgspec.Struct` values (hashable, comparable): sequences are
tuples and times are timezone-aware :class:`~datetime.datetime` values. ``to_dict()`` gives
the record back as plain JSON data with the field names of the topic.

Every record carries ``instance``, the id of the flow instance that published it (an additive
field of the ``/1`` schemas; None on records of a dpstream that did not write it). Two
instances of one flow name publish the same coordinates with independent noise: compare
records of one instance only (see :mod:`dpstream.client.latest`).
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

import msgspec

from dpstream.errors import DpstreamError

if TYPE_CHECKING:
    from dpstream.estimator import ReleasedClassifier

__all__ = [
    "Alert",
    "Answer",
    "ApproxDp",
    "DeadLetter",
    "DeadLetterSource",
    "Model",
    "ModelFeatures",
    "ModelHoldout",
    "ModelNoise",
    "Privacy",
    "Record",
    "RecordError",
    "Release",
    "SUPPORTED_SCHEMAS",
    "SchemaVersionError",
    "Status",
    "UnknownRecordError",
    "Window",
    "decode",
]

SUPPORTED_SCHEMAS: Final = {
    "dpstream.release": 1, "dpstream.status": 1, "dpstream.alert": 1,
    "dpstream.answer": 1, "dpstream.model": 1, "dpstream.dead_letter": 1,
}
"""The record types this client reads, by name, with the major version it understands."""

_SCHEMA: Final = re.compile(r"^([A-Za-z0-9_.-]{1,64})/(0|[1-9][0-9]{0,8})$")
_MESSAGE_LIMIT: Final = 200


class RecordError(DpstreamError):
    """A topic record this client cannot use.

    Attributes:
        reason: a short, stable description of the kind of problem (for counting skipped
            records), e.g. ``"not JSON"`` or ``"unsupported dpstream.release/2"``.
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class UnknownRecordError(RecordError):
    """Not a dpstream record, or a malformed one (skip it)."""


class SchemaVersionError(RecordError):
    """A known record type at a major version this client does not understand.

    Attributes:
        schema: the record's ``schema`` (``dpstream.release/2``).
        supported: the version this client reads (``dpstream.release/1``).
    """

    def __init__(self, schema: str, supported: str) -> None:
        super().__init__(
            f"a {schema} record: this dpstream reads {supported} (a new major version changes "
            "what fields mean); upgrade dpstream to read it, or skip such records "
            "(RecordConsumer(strict_versions=False), `dpstream tail --skip-unsupported`)",
            f"unsupported {schema}")
        self.schema, self.supported = schema, supported


class _Data(msgspec.Struct, frozen=True, omit_defaults=True):
    """Plain nested data of a record."""


class _Record(msgspec.Struct, frozen=True, omit_defaults=True, tag_field="schema"):
    """A published record: its type is its ``schema`` tag."""

    @property
    def schema(self) -> str:
        """The record's ``schema`` field (``dpstream.release/1``)."""
        return str(self.__struct_config__.tag)

    def to_dict(self) -> dict[str, Any]:
        """The record as plain JSON data, with the topic's field names (times as ISO text).

        Optional fields that are unset (None) are left out, as the flows leave them out.
        """
        data: dict[str, Any] = _ANY.decode(msgspec.json.encode(self))  # tuples -> lists
        return data


class Window(_Data, frozen=True):
    """The event-time window ``[start, end)`` a record covers.

    ``first_step`` and ``last_step`` are set on models (the steps of the model's data).
    """

    start: datetime
    end: datetime
    first_step: int | None = None
    last_step: int | None = None


class ApproxDp(_Data, frozen=True):
    """The (ε, δ)-DP a zCDP spend implies (Bun–Steinke 2016, Prop. 1.3)."""

    epsilon: float
    delta: float


class Privacy(_Data, frozen=True):
    """What a record has cost, per privacy unit.

    Attributes:
        unit: the privacy unit (``event``).
        accounting: the ledger's unit: ``epsilon`` or ``rho`` (releases); ``pure`` or ``zcdp``
            (answers, models); ``approx_dp`` (ERMG models: ε of (ε, δ)).
        spent: what the key (histogram, model stream) has spent so far.
        budget: what it may spend.
        delta: the δ of the guarantee, where there is one.
        approx_dp: the (ε, δ) a zCDP spend implies.
        cost: this record's own cost (models).
    """

    unit: str
    accounting: str
    spent: float
    budget: float
    delta: float | None = None
    approx_dp: ApproxDp | None = None
    cost: float | None = None

    @property
    def remaining(self) -> float:
        """``budget - spent``."""
        return self.budget - self.spent


class Release(_Record, frozen=True, tag="dpstream.release/1"):
    """One private count: the key's events up to the end of ``step`` (``value`` ± ``std``)."""

    flow: str
    mechanism: str
    key: str
    step: int
    window: Window
    value: float
    std: float
    privacy: Privacy
    instance: str | None = None
    """The flow instance that published it (None from a dpstream before the field existed)."""

    def interval(self, z: float = 1.96) -> tuple[float, float]:
        """``value ∓ z·std`` (1.96: a 95 % interval when the noise is close to normal)."""
        return self.value - z * self.std, self.value + z * self.std


class Status(_Record, frozen=True, tag="dpstream.status/1"):
    """A ledger refused a charge (``status = "budget_exhausted"``): the key stops releasing."""

    flow: str
    status: str
    key: str
    step: int
    window: Window
    refused: str
    reason: str
    spent: float
    budget: float
    accounting: str
    instance: str | None = None
    """The flow instance that published it (None from a dpstream before the field existed)."""


class Alert(_Record, frozen=True, tag="dpstream.alert/1"):
    """A key's threshold monitor fired at ``step`` (in the open universe: the key is admitted)."""

    flow: str
    key: str
    step: int
    window: Window
    threshold: int
    epsilon: float
    instance: str | None = None
    """The flow instance that published it (None from a dpstream before the field existed)."""


class Answer(_Record, frozen=True, tag="dpstream.answer/1"):
    """A PMWG flow's answer to question ``id`` (a fraction in [0, 1], per part for marginals).

    ``kind`` is ``easy``, ``hard``, ``bottom`` (⊥, with its ``reason``), ``error``,
    ``waiting`` or ``marginal`` (then ``value`` and ``kinds`` have one entry per part).
    """

    flow: str
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
    instance: str | None = None
    """The flow instance that published it (None from a dpstream before the field existed)."""


class ModelFeatures(_Data, frozen=True):
    """The raw features a model expects: ``dimension`` numbers, rows clipped to ``clip_norm``."""

    dimension: int
    clip_norm: float


class ModelNoise(_Data, frozen=True):
    """Each weight's noise standard deviation and the exact grid it was released on."""

    std: float
    grid: str


class ModelHoldout(_Data, frozen=True):
    """Accuracy on the flow's public holdout."""

    accuracy: float
    rows: int


class Model(_Record, frozen=True, tag="dpstream.model/1"):
    """A private classifier an ERM flow released (or, without ``coef``, why a stream stopped).

    ``classifier()`` turns it into a ready scikit-learn-compatible classifier.
    """

    flow: str
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
    holdout: ModelHoldout | None = None
    instance: str | None = None
    """The flow instance that published it (None from a dpstream before the field existed)."""

    @property
    def has_weights(self) -> bool:
        """False for a status record (``role = "exhausted"``) that carries no model."""
        return self.coef is not None

    def classifier(self) -> ReleasedClassifier:
        """The model as a :class:`~dpstream.estimator.ReleasedClassifier`.

        Raises:
            dpstream.estimator.SchemaError: the record carries no weights.
        """
        from dpstream.estimator import ReleasedClassifier

        return ReleasedClassifier.from_record(self.to_dict())


class DeadLetterSource(_Data, frozen=True):
    """Where a dead letter's original record was read."""

    topic: str | None
    partition: int | None
    offset: int | None


class DeadLetter(_Record, frozen=True, tag="dpstream.dead_letter/1"):
    """An input record a flow could not use, and why (raw input data: operators only)."""

    flow: str
    reason: str
    source: DeadLetterSource
    original_base64: str
    original_size: int
    original_sha256: str
    original_truncated: bool
    instance: str | None = None
    """The flow instance that published it (None from a dpstream before the field existed)."""


Record = Release | Status | Alert | Answer | Model | DeadLetter
"""Every record type :func:`decode` returns."""

_DECODER: Final = msgspec.json.Decoder(Record)
_ANY: Final = msgspec.json.Decoder()


def decode(value: bytes | str) -> Record:
    """Decode one record's value (the JSON bytes of a Kafka record).

    Raises:
        SchemaVersionError: a known record type at another major version.
        UnknownRecordError: anything else this client cannot use (see the module docstring).
    """
    try:
        record: Record = _DECODER.decode(value)
    except msgspec.DecodeError as exc:  # also ValidationError (its subclass)
        raise _classify(value, exc) from None
    return record


def _classify(value: bytes | str, problem: msgspec.DecodeError) -> RecordError:
    """The precise error for a value the typed decoder refused."""
    if not value:
        return UnknownRecordError("an empty record (a tombstone?)", "empty")
    try:
        body = _ANY.decode(value)
    except msgspec.DecodeError:
        return UnknownRecordError("a record that is not JSON", "not JSON")
    if not isinstance(body, dict):
        return UnknownRecordError(f"a JSON {type(body).__name__}, not an object",
                                  "not a JSON object")
    schema = body.get("schema")
    if not isinstance(schema, str):
        return UnknownRecordError("a JSON object without a 'schema' string: not a dpstream "
                                  "record", "no schema")
    match = _SCHEMA.match(schema)
    if match is None or match.group(1) not in SUPPORTED_SCHEMAS:
        shown = schema if match is not None else "<malformed>"
        return UnknownRecordError(f"a record of schema {shown!r}, which dpstream does not "
                                  "publish", "unknown schema")
    name, major = match.group(1), int(match.group(2))
    supported = f"{name}/{SUPPORTED_SCHEMAS[name]}"
    if major != SUPPORTED_SCHEMAS[name]:
        return SchemaVersionError(schema, supported)
    detail = str(problem)[:_MESSAGE_LIMIT]  # msgspec names the field and the types, no value
    return UnknownRecordError(f"a malformed {schema} record: {detail}", f"malformed {schema}")
