"""Decoding the records a flow publishes, with the schema checks.

The records are the Structs of :mod:`dpstream.schemas` (each defined there once, with the
rules for changing a schema). Every record is a JSON object whose ``schema`` field names its
type and the type's major version, ``<name>/<major>`` (``dpstream.release/1``). Within a
major version fields are only ever *added*; a change a reader could misread gets a new major
version. So :func:`decode`

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
from typing import Final

import msgspec

from dpstream.errors import DpstreamError
from dpstream.schemas import SUPPORTED_SCHEMAS, Record

__all__ = [
    "RecordError",
    "SchemaVersionError",
    "UnknownRecordError",
    "decode",
]

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
