"""The counters' encoder: releases, alerts and statuses as their JSON records.

The records are ``dpstream.release/1``, ``dpstream.alert/1`` and ``dpstream.status/1``
(:class:`dpstream.schemas.Release`, :class:`~dpstream.schemas.Alert`,
:class:`~dpstream.schemas.Status`: their fields, order and change rules are defined there).
:meth:`RecordEncoder.encode` builds one record's Struct and encodes it; the bulk encoder
(:meth:`RecordEncoder.encode_step`) builds one Struct per column, with markers in place of the
key and the value, and derives the column's byte template from it, so the template's fields
come from the one definition too.

**Delivery is at least once.** Records are written before the snapshot that covers them is
committed, and a restart replays the open epoch, so a record may appear twice; a replay
reproduces it byte for byte (same noise). Consumers de-duplicate releases and statuses on
``(flow, instance, key, step, schema)``, alerts on ``(flow, instance, key, step)`` and dead
letters on ``(flow, instance, source)``; :func:`dpstream.schemas.identity` gives that
identity for any record.

**Every record names its flow instance** (``instance``, the 32 hex digits of
:mod:`dpstream.instance`: random at the instance's creation, or given by the operator, so it
tells nothing about the data). Two instances of one ``flow.name`` (a reprocessing, a second
deployment) publish the same coordinates with independent noise; the field tells them apart.
In the bulk encoders it is part of the constant template every record of a column shares, so
it costs no per-record work.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterable, Sequence
from datetime import datetime
from itertools import accumulate, pairwise, repeat
from typing import TYPE_CHECKING, Any, Final, NamedTuple, cast

import numpy as np
import orjson

from dpstream import schemas
from dpstream.core.accounting.ledger import approx_dp
from dpstream.core.counting.outputs import Alert, AlertColumns, BudgetExhausted, Release
from dpstream.core.counting.statistics_spec import person_privacy
from dpstream.core.noise.coordinates import JoinedNames
from dpstream.messages import DeadLetter, Encoded
from dpstream.stream.encoded import EncodedBatch, EncodedColumn, Texts, encode_dead_letter

if TYPE_CHECKING:
    import numpy.typing as npt

    from dpstream.config import ContributionConfig
    from dpstream.core.counting.key_table import FloatArray, IntArray
    from dpstream.core.counting.outputs import ReleaseColumns, StepOutputs

    ByteArray = npt.NDArray[np.uint8]

__all__ = ["RecordEncoder"]


_KEY_CACHE: Final = 64
"""How many key tuples' texts a :class:`RecordEncoder` keeps (a group's keys are a tuple)."""
_KEY_MARK: Final = "\x00dpstream-key\x00"  # JSON-escaped in the template, so never ambiguous
_VALUE_MARK: Final = "\x00dpstream-value\x00"
_NUMPY: Final = orjson.OPT_SERIALIZE_NUMPY
_QUOTE: Final = ord('"')
_COMMA: Final = ord(",")


class RecordEncoder:
    """Turns core outputs into ``(topic_role, key_bytes, value_bytes)`` triples.

    :meth:`encode` encodes one output; :meth:`encode_step` a whole closed step at once, byte
    for byte as :meth:`encode` would, with every field a release column shares (schema, flow,
    mechanism, step, window, std, privacy) encoded once per column, and the keys and values
    of a column formatted by one ``orjson`` call each and put into the records with numpy.
    """

    def __init__(self, flow: str, origin: datetime, step_seconds: float,
                 conversion_delta: float = 1e-6, *, instance: str = "",
                 contribution: ContributionConfig | None = None) -> None:
        self.flow, self.origin, self.step_seconds = flow, origin, step_seconds
        self.instance = instance
        self.conversion_delta = conversion_delta
        # user level: releases carry ``privacy.unit = "user"`` and ``privacy.person``
        self.contribution = (contribution if contribution is not None
                             and contribution.user_level else None)
        # the keys' JSON of the latest key tuples, by identity (each tuple kept alive here);
        # the workers of a process share the encoder, so the cache has a lock
        self._key_cache: dict[int, tuple[tuple[str, ...], bytes | None]] = {}
        self._key_lock = threading.Lock()

    def _keys_texts(self, keys: Sequence[str]) -> Texts | None:
        """:func:`_key_texts`, the keys' JSON remembered for the last :data:`_KEY_CACHE` tuples.

        A counter group releases the same tuple of keys at every step; a tuple never changes,
        and the cache holds a reference to it, so its identity cannot be reused by another.
        Only the JSON text is kept (a :class:`~dpstream.core.noise.coordinates.JoinedNames` tuple
        holds it already); where each key lies in it is found again at each use, in bulk. Lists
        (and any other sequence) are encoded afresh every time.
        """
        if not isinstance(keys, tuple):
            return _key_texts(keys)
        cache = self._key_cache
        with self._key_lock:
            hit = cache.pop(id(keys), None)
            if hit is not None:
                cache[id(keys)] = hit  # the most recent last
        text = _keys_json(keys) if hit is None else hit[1]
        if hit is None:
            with self._key_lock:
                cache[id(keys)] = (keys, text)
                while len(cache) > _KEY_CACHE:
                    del cache[next(iter(cache))]
        return None if text is None else _quoted_texts(text, len(keys))

    def _window(self, step: int) -> schemas.Window:
        return schemas.Window.of_steps(self.origin, self.step_seconds, step)

    def _release(self, key: str, step: int, value: float, std: float, mechanism: str,
                 spent: float, budget: float, unit: str, delta: float) -> schemas.Release:
        approx = None
        if unit == "rho" and self.conversion_delta > 0:
            epsilon, total_delta = approx_dp(spent, self.conversion_delta, delta)
            approx = schemas.ApproxDp(epsilon=epsilon, delta=total_delta)
        person = None if self.contribution is None else self._person(spent, unit, delta)
        privacy = schemas.Privacy(unit="event" if person is None else "user", accounting=unit,
                                  spent=spent, budget=budget, delta=delta, approx_dp=approx,
                                  person=person)
        return schemas.Release(flow=self.flow, instance=self.instance, mechanism=mechanism,
                               key=key, step=step, window=self._window(step), value=value,
                               std=std, privacy=privacy)

    def _person(self, spent: float, unit: str, delta: float) -> schemas.PersonLevel:
        """A person's total for a release whose key spent ``spent`` (``L0`` keys' worth).

        A function of the release's public ``spent`` and ``delta`` and of the configuration
        (:func:`~dpstream.core.counting.statistics_spec.person_privacy`), so the same for every
        release of a column: part of the bulk encoder's template.
        """
        c = self.contribution
        assert c is not None
        total = person_privacy("zcdp" if unit == "rho" else "pure", spent, delta,
                               c.cap("max_keys"), self.conversion_delta)
        period = "lifetime" if c.period_steps is None else f"{c.period_steps} steps"
        return schemas.PersonLevel(period=period, caps=c.caps, epsilon=total.epsilon,
                                   delta=total.delta, rho=total.rho)

    def _alert(self, key: str, step: int, threshold: int, epsilon: float) -> schemas.Alert:
        return schemas.Alert(flow=self.flow, instance=self.instance, key=key, step=step,
                             window=self._window(step), threshold=threshold, epsilon=epsilon)

    def encode(self, item: Release | Alert | BudgetExhausted) -> tuple[str, bytes, bytes]:
        """Encode one output; the first element names the topic role."""
        if isinstance(item, Release):
            return "releases", item.key.encode(), schemas.encode(self._release(
                item.key, item.step, item.value, item.std, item.mechanism, item.spent,
                item.budget, item.unit, item.delta))
        if isinstance(item, Alert):
            return "alerts", item.key.encode(), schemas.encode(self._alert(
                item.key, item.step, item.threshold, item.epsilon))
        return "releases", item.key.encode(), schemas.encode(schemas.Status(
            flow=self.flow, instance=self.instance, status="budget_exhausted",
            key=item.key, step=item.step, window=self._window(item.step),
            refused=item.label, reason=item.reason, spent=item.spent,
            budget=item.budget, accounting=item.unit))

    def encode_item(self, item: Any) -> Encoded | EncodedBatch:
        """Encode a stream item: a closed step's outputs as a batch, else one output."""
        if isinstance(item, (Release, Alert, BudgetExhausted)):
            return self.encode(item)
        return self.encode_step(item)

    def encode_step(self, outputs: StepOutputs) -> EncodedBatch:
        """Encode a closed step's outputs, in their order, exactly as :meth:`encode` would.

        Statuses (rare) go through :meth:`encode`. Alerts that share their step, threshold
        and epsilon, and each release column, are encoded in bulk into an
        :class:`EncodedColumn` (see :func:`_bulk`): the same ``orjson`` texts as
        :meth:`encode` writes, put together with numpy. If anything is unusual the records
        are encoded one by one (the same bytes, slower).
        """
        batch = EncodedBatch(map(self.encode, outputs.statuses))
        batch.extend(self.encode_alerts(outputs.alerts))
        for columns in outputs.releases:
            batch.extend(self.encode_columns(columns))
        return batch

    def encode_alerts(self, alerts: Sequence[Alert]) -> Sequence[Encoded]:
        """The records of alerts, in their order (in bulk when they share all but the key)."""
        if len(alerts) > 1:
            if isinstance(alerts, AlertColumns):  # shared by construction: no Alert made
                shared = (alerts.step, alerts.threshold, alerts.epsilon)
                keys = list(alerts.keys)
            else:
                first = alerts[0]
                shared = (first.step, first.threshold, first.epsilon)
                keys = [a.key for a in alerts]
                if not all((a.step, a.threshold, a.epsilon) == shared for a in alerts):
                    keys = []
            if keys:
                records = _bulk("alerts", self._alert(_KEY_MARK, *shared), keys, None,
                                _key_texts(keys))
                if records is not None:
                    return records
        return list(map(self.encode, alerts))

    def encode_columns(self, columns: ReleaseColumns) -> Sequence[Encoded]:
        """The records of the releases of one :class:`ReleaseColumns`, in its key order."""
        keys = columns.keys
        if not len(keys):
            return []
        values = np.asarray(columns.values, dtype=np.float64)
        if values.shape != (len(keys),):
            raise ValueError(f"a release column has {len(keys)} keys and values of shape "
                             f"{values.shape}")
        c = columns
        body = self._release(_KEY_MARK, c.step, cast(float, _VALUE_MARK), c.std, c.mechanism,
                             c.spent, c.budget, c.unit, c.delta)
        records = _bulk("releases", body, keys, values, self._keys_texts(keys))
        if records is None:
            return [self.encode(release) for release in _releases(c)]
        return records

    def encode_dead_letter(self, letter: DeadLetter) -> tuple[str, bytes | None, bytes]:
        """Encode a dead letter for the dead-letter topic."""
        return encode_dead_letter(self.flow, letter, instance=self.instance)


def _bulk(role: str, body: schemas.Record, keys: Sequence[str], values: FloatArray | None,
          key_texts: Texts | None) -> EncodedColumn | list[Encoded] | None:
    """Records whose JSON is ``body``'s with each key (and value) in place of the markers.

    ``body`` is the column's record (a :mod:`dpstream.schemas` Struct) with :data:`_KEY_MARK`
    as the key and, if ``values`` is given, :data:`_VALUE_MARK` as the value. The bytes are
    those :meth:`RecordEncoder.encode` writes:

    * ``body`` is encoded once by :func:`dpstream.schemas.encode`, as
      :meth:`~RecordEncoder.encode` encodes a record, and cut at the markers' JSON into the
      constant pieces of every record (the template: its fields and their order are the
      Struct's);
    * all keys are encoded by one ``orjson.dumps(keys)``: when it escaped nothing (no
      backslash), each key's JSON is its UTF-8 bytes (the Kafka key) in quotes, which go into
      the template, and every ``"`` is a delimiter, found with numpy;
    * all values are formatted by one ``orjson.dumps`` of the float64 column, the same
      shortest round-trip text ``orjson`` writes for a Python float (``null`` for NaN and
      infinities), delimited by its commas, found with numpy;
    * :func:`_assemble` puts pieces and texts together, in bulk.

    ``orjson`` writes a dict as its fields' texts one after the other, with nothing between
    them that depends on the other fields, so a record is exactly the template with the key's
    and the value's own texts in place of the markers'.

    ``key_texts`` is what :func:`_key_texts` makes of ``keys`` (the caller's, possibly kept
    from an earlier step); None for keys that need escaping, which take :func:`_escaped`
    (the same template, one record at a time).
    None if the bulk path cannot be used (a marker also elsewhere in ``body``, a key that
    ``orjson`` refuses): encode one by one then.
    """
    marks = [orjson.dumps(_KEY_MARK)] + ([] if values is None else [orjson.dumps(_VALUE_MARK)])
    pieces = _cut(schemas.encode(body), marks)
    if pieces is None:
        return None
    if key_texts is None:
        return _escaped(role, pieces, keys, values)
    pieces[0] += b'"'  # the key's quotes
    pieces[1] = b'"' + pieces[1]
    fields = [key_texts] if values is None else [key_texts, _value_texts(values)]
    return EncodedColumn(role, key_texts, _assemble(pieces, fields))


def _escaped(role: str, pieces: list[bytes], keys: Sequence[str], values: FloatArray | None
             ) -> list[Encoded] | None:
    """The records of a column with keys that need escaping: the template, record by record.

    Each key's JSON is its own ``orjson`` text and its Kafka key its UTF-8 bytes; the values'
    texts come from one ``orjson`` text of the column, as in :func:`_bulk`. None if ``orjson``
    refuses a key (e.g. a lone surrogate, which :meth:`RecordEncoder.encode` refuses too).
    """
    try:
        quoted = list(map(orjson.dumps, keys))
        names = [key.encode() for key in keys]
    except (orjson.JSONEncodeError, TypeError, UnicodeEncodeError):
        return None
    template = b"%s".join(piece.replace(b"%", b"%%") for piece in pieces)
    if values is None:
        records = list(map(template.__mod__, quoted))
    else:
        texts = _value_texts(values).texts()
        records = list(map(template.__mod__, zip(quoted, texts, strict=True)))
    return list(zip(repeat(role), names, records))


def _cut(text: bytes, marks: list[bytes]) -> list[bytes] | None:
    """``text`` cut at each of ``marks``; None unless each occurs once, in this order."""
    if any(text.count(mark) != 1 for mark in marks):
        return None  # a marker inside another field (e.g. the flow's name)
    pieces = []
    for mark in marks:
        before, found, text = text.partition(mark)
        if not found:
            return None
        pieces.append(before)
    return [*pieces, text]


def _key_texts(keys: Sequence[str]) -> Texts | None:
    """Each key's UTF-8 bytes, found in one ``orjson`` text of all the keys.

    None if some key needs escaping in JSON (its JSON is not its bytes in quotes) or is
    refused by ``orjson`` (e.g. a lone surrogate, which :meth:`RecordEncoder.encode` refuses
    too).
    """
    text = _keys_json(keys)
    return None if text is None else _quoted_texts(text, len(keys))


def _keys_json(keys: Sequence[str]) -> bytes | None:
    """The keys' JSON strings, ``"a","b",...``, if each is the key's bytes in quotes.

    :class:`~dpstream.core.noise.coordinates.JoinedNames` made that text when the keys were declared
    (or
    found that it does not exist); otherwise one ``orjson`` call makes it. None if a key
    needs escaping or is refused.
    """
    if isinstance(keys, JoinedNames):
        return keys.joined
    if type(keys) not in (list, tuple):  # orjson takes lists and tuples, no subclasses
        keys = list(keys)
    try:
        text = orjson.dumps(keys)[1:-1]  # a copy: orjson's buffer is many times the text
    except (orjson.JSONEncodeError, TypeError):
        return None
    return None if b"\\" in text else text


def _quoted_texts(text: bytes, count: int) -> Texts | None:
    """The ``count`` strings of ``text`` (``"a","b",...``, no escapes), between their quotes."""
    chars = np.frombuffer(text, np.uint8)
    width = _common_width(chars, count)
    if width is not None:
        starts = np.arange(1, len(text), width + 3)
        return Texts(text, starts, starts + width)
    quotes = np.flatnonzero(chars == _QUOTE)
    if len(quotes) != 2 * count:
        return None  # a key that is not a string
    return Texts(text, quotes[0::2] + 1, quotes[1::2])


def _common_width(chars: ByteArray, count: int) -> int | None:
    """The length all ``count`` strings of ``chars`` (``"a","b",...``) share, if they do.

    Then their ``2 * count`` quotes are where that length puts them, which a strided look
    confirms (no scan): there are no other quotes.
    """
    if not count:
        return None
    stride, rest = divmod(len(chars) + 1, count)
    if rest or stride < 3:
        return None
    if (chars[::stride] == _QUOTE).all() and (chars[stride - 2::stride] == _QUOTE).all():
        return stride - 3
    return None


def _value_texts(values: FloatArray) -> Texts:
    """Each value's JSON, from one ``orjson`` text of the column (``v0,v1,...``)."""
    text = orjson.dumps(np.ascontiguousarray(values), option=_NUMPY)[1:-1]  # a copy, as above
    commas = np.flatnonzero(np.frombuffer(text, np.uint8) == _COMMA)
    starts, ends = np.empty((2, len(values)), np.int64)
    starts[0], starts[1:] = 0, commas + 1
    ends[:-1], ends[-1] = commas, len(text)
    return Texts(text, starts, ends)


def _assemble(pieces: list[bytes], fields: list[Texts]) -> Texts:
    """Record ``i``: ``pieces[0] + fields[0].text(i) + pieces[1] + ... + pieces[-1]``, in bulk.

    Records whose fields have the same lengths share a layout. The records of one layout lie
    back to back in one block of the buffer, a fixed-width uint8 matrix: each row holds the
    layout's template (the pieces, with room for the fields), and each field's texts are
    copied into its columns. The blocks lie back to back, the commonest layout's first; the
    returned starts and ends list the records in the column's order.

    The buffer is made by repeating the commonest layout's template (the fastest fill there
    is), so only the other blocks need their template copied in; it is filled in place
    through an :class:`io.BytesIO`, which hands its buffer over as the ``bytes`` returned
    (CPython does not copy it).
    """
    widths = [field.lengths() for field in fields]
    sizes = sum(widths[1:], widths[0] + sum(map(len, pieces)))
    order, bounds = _by_layout(widths)
    placed = sizes[order]  # the records' sizes, in the buffer's order
    offsets = np.cumsum(placed) - placed
    starts = np.empty_like(offsets)
    starts[order] = offsets
    blocks = [_block(pieces, widths, int(order[first]), first, end, int(offsets[first]))
              for first, end in pairwise(bounds)]
    size = int(offsets[-1] + placed[-1])
    first = blocks[0].template
    stream = io.BytesIO(first * -(-size // len(first)))  # its only reference: no copy
    view = stream.getbuffer()
    _fill(np.frombuffer(view, np.uint8), blocks, pieces,
          [(field.data, field.starts[order]) for field in fields])
    view.release()  # the array on it is gone: the stream can hand its buffer over
    stream.truncate(size)
    return Texts(stream.getvalue(), starts, starts + sizes)


def _by_layout(widths: list[IntArray]) -> tuple[IntArray, list[int]]:
    """The records by layout (the same width in every field), the commonest layout first.

    Their positions in the column (in order within a layout), and the bounds of each
    layout's run in them.
    """
    layouts = widths[0]
    for width in widths[1:]:
        layouts = layouts * (int(width.max()) + 1) + width
    layouts = layouts.astype(np.min_scalar_type(layouts.max()))  # a radix sort if small
    order = np.argsort(layouts, kind="stable")
    bounds = [0, *(np.flatnonzero(np.diff(layouts[order])) + 1).tolist(), len(order)]
    runs = sorted(pairwise(bounds), key=lambda run: run[0] - run[1])  # the longest first
    return (np.concatenate([order[first:end] for first, end in runs]),
            list(accumulate((end - first for first, end in runs), initial=0)))


class _Block(NamedTuple):
    """The records of one layout: positions ``first:end`` in the buffer's order."""

    first: int
    end: int
    base: int
    """Where in the buffer they start."""
    lengths: list[int]
    """The length of each of their fields."""
    template: bytes
    """One of them with zeros for its fields."""


def _block(pieces: list[bytes], widths: list[IntArray], record: int, first: int, end: int,
           base: int) -> _Block:
    """The block of the records ``first:end`` in the buffer's order, laid out as ``record``."""
    lengths = [int(width[record]) for width in widths]
    room = [piece + bytes(n) for piece, n in zip(pieces, lengths, strict=False)]
    return _Block(first, end, base, lengths, b"".join(room) + pieces[-1])


def _fill(buffer: ByteArray, blocks: list[_Block], pieces: list[bytes],
          fields: list[tuple[bytes, IntArray]]) -> None:
    """Write the records into ``buffer``, which holds the first block's templates already.

    ``fields``: each field's texts, and where each record's text starts in them (the records
    in the buffer's order). A field's texts are copied as items of their length: numpy copies
    an item per row far faster than a row of single bytes.
    """
    items: dict[tuple[int, int], np.ndarray[Any, Any]] = {}  # by (field, length)
    for block in blocks:
        rows, width = block.end - block.first, len(block.template)
        matrix = buffer[block.base:block.base + rows * width]
        if block is not blocks[0]:
            matrix.reshape(rows, width)[:] = np.frombuffer(block.template, np.uint8)
        column = len(pieces[0])
        for i, ((data, starts), length, piece) in enumerate(
                zip(fields, block.lengths, pieces[1:], strict=False)):
            if length:
                if (i, length) not in items:
                    items[i, length] = _as_items(data, length)
                target = np.ndarray((rows,), items[i, length].dtype, matrix, column, (width,))
                target[...] = items[i, length][starts[block.first:block.end]]
            column += length + len(piece)


def _as_items(data: bytes, length: int) -> np.ndarray[Any, Any]:
    """Item ``j`` is ``data[j:j + length]`` (a view: one void item per position)."""
    return np.ndarray((len(data) - length + 1,), f"V{length}", data, 0, (1,))


def _releases(c: ReleaseColumns) -> Iterable[Release]:
    """The releases of a column, one object each (the slow path)."""
    values = np.asarray(c.values, dtype=np.float64).tolist()
    for key, value in zip(c.keys, values, strict=True):
        yield Release(key, c.step, value, c.std, c.mechanism, c.spent, c.budget, c.unit,
                      c.delta)
