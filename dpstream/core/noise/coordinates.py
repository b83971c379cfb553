"""The coordinates of a release, and how they are encoded for the PRF.

Every draw of noise is a pure function of the secret :class:`~dpstream.core.noise.keys.NoiseKey`
and the *coordinates* of its release (flow, mechanism, key, epoch, tree node, ...). This module
says what a coordinate is (a str or an int), encodes a tuple of them injectively and
independently of the Python version (:func:`encode_coordinates`, the message of the scalar
BLAKE2b streams), and lays out names as the 16-byte-block *units* of the lane messages, one at a
time (:func:`_unit`) or a million at a time (:class:`JoinedNames`, :func:`_name_bytes`,
:func:`_units_matrix`; the lanes themselves are ECBC-MAC under the key,
:meth:`~dpstream.core.noise.keys.NoiseKey.lane`). The ``TAG_*`` constants name the kinds of draw of
the counters' mechanisms (the first numeric coordinate of a block of
:mod:`dpstream.core.noise.bulk`). Injectivity is the whole privacy argument here: two distinct
releases never share a message, so they never share noise, and a replayed release (the same
coordinates) always does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any, Final

from dpstream.errors import InvalidParameterError

__all__ = [
    "parameter_digest",
    "COORDINATES_VERSION",
    "Coordinate",
    "JoinedNames",
    "TAG_BLT",
    "TAG_INITIAL",
    "TAG_MONITOR_QUERY",
    "TAG_MONITOR_THRESHOLD",
    "TAG_TREE",
    "check_coordinates",
    "encode_coordinates",
]

Coordinate = str | int

TAG_TREE: Final = 1
"""A binary tree node: ``(epoch, height, index)``."""
TAG_BLT: Final = 2
"""A BLT step: ``(epoch, 0, step_in_epoch)``."""
TAG_MONITOR_THRESHOLD: Final = 3
"""A threshold monitor's threshold noise: ``(0, 0, 0)``."""
TAG_MONITOR_QUERY: Final = 4
"""A threshold monitor's query noise at its step ``t``: ``(0, 0, t)``."""
TAG_INITIAL: Final = 5
"""An initial count at admission: ``(0, 0, 0)``."""

def check_coordinates(coordinates: object) -> tuple[Coordinate, ...]:
    """Return ``coordinates`` if it is a tuple of str and int (not bool); raise otherwise."""
    if not isinstance(coordinates, tuple) or not all(
        type(c) is str or type(c) is int for c in coordinates
    ):
        raise InvalidParameterError(
            f"coordinates must be a tuple of str or int, got {coordinates!r}"
        )
    return coordinates


COORDINATES_VERSION: Final = b"dpstream-coordinates/1"
_STR_TAG: Final = b"s"
_QUOTE: Final = ord('"')
_BACKSLASH: Final = ord("\\")
_INT_TAG: Final = b"i"


def encode_coordinates(coordinates: tuple[Coordinate, ...]) -> bytes:
    """Encode coordinates explicitly and injectively (version ``dpstream-coordinates/1``).

    The encoding is the version tag followed by, for each coordinate, a one-byte type tag
    (``s`` for str, ``i`` for int), a 4-byte big-endian length and the bytes: UTF-8 for a
    string (lone surrogates kept with ``surrogatepass``, so every Python ``str`` has one
    encoding), the shortest signed big-endian two's complement for an integer. Nothing in it
    depends on the Python version (``repr`` of a string does: how a character prints changed
    when Unicode 15 was adopted), and type tags plus length prefixes make it injective: no two
    distinct tuples share an encoding, so ``("ab", "c")``, ``("a", "bc")``, ``(1,)`` and
    ``("1",)`` all differ.
    """
    parts = [COORDINATES_VERSION]
    parts.extend(map(_tagged, check_coordinates(coordinates)))
    return b"".join(parts)


def _tagged(coordinate: Coordinate) -> bytes:
    """One coordinate of :func:`encode_coordinates`: type tag, 4-byte length, bytes."""
    if isinstance(coordinate, str):
        tag, data = _STR_TAG, coordinate.encode("utf-8", "surrogatepass")
    else:
        tag = _INT_TAG
        data = coordinate.to_bytes((coordinate.bit_length() + 8) // 8, "big", signed=True)
    return tag + len(data).to_bytes(4, "big") + data


def _unit(coordinate: Coordinate) -> bytes:
    """A coordinate's unit of the lane message (see :meth:`.NoiseKey.lane`).

    The coordinate as :func:`encode_coordinates` writes it, zero-padded to 16-byte blocks.
    """
    unit = _tagged(coordinate)
    return unit + bytes(-len(unit) % 16)


class JoinedNames(tuple[str, ...]):
    """A tuple of key names that also holds their UTF-8 bytes, joined once.

    ``joined`` is the names as the body of a JSON list of strings, ``"a","b",...``, when that
    is their bytes in quotes (no name holds a quote, a backslash, a control character or a
    lone surrogate), else None. Made once for keys known in advance (a shard's declared keys,
    at start-up), it serves twice without reading the string objects again, which a table of
    a million keys has not touched since (a read from memory each, about 100 ns):
    :meth:`~dpstream.core.noise.keys.NoiseKey.lane_words` takes the names' bytes from it, and
    the record encoder (:mod:`dpstream.kinds.counters.records`) the keys' JSON texts.

    Raises:
        InvalidParameterError: a name is not a str.
    """

    joined: bytes | None

    def __new__(cls, names: Iterable[str] = ()) -> JoinedNames:
        """The tuple of ``names``, with their bytes joined."""
        import numpy as np

        self = super().__new__(cls, names)
        data = ('"' + _joined_text(self, '","') + '"').encode("utf-8", "surrogatepass")
        chars = np.frombuffer(data, dtype=np.uint8)
        plain = (int(np.count_nonzero(chars == _QUOTE)) == 2 * len(self)
                 and not (chars == _BACKSLASH).any() and not (chars < 0x20).any()
                 and not ((chars[:-1] == 0xED) & (chars[1:] >= 0xA0)).any())  # surrogates
        self.joined = (data if self else b"") if plain else None
        return self


def _joined_text(names: tuple[str, ...], separator: str) -> str:
    """The names joined with ``separator`` (one C call), refusing a name that is not a str."""
    try:
        return separator.join(names)
    except TypeError:
        bad = next(name for name in names if not isinstance(name, str))
        raise InvalidParameterError(f"a lane name must be a str, got {bad!r}") from None


def _name_bytes(names: tuple[str, ...]) -> tuple[bytes, Any, Any]:
    """The names' UTF-8 bytes (lone surrogates kept, as :func:`_tagged` keeps them).

    Returns ``(data, starts, lengths)``: name ``i`` is ``data[starts[i]:starts[i] +
    lengths[i]]``. The names are joined with NUL in one C call and cut where the NUL bytes
    are (UTF-8 writes byte 0 for U+0000 only), or read between the quotes of
    :class:`JoinedNames`; names that hold a NUL themselves are encoded one by one.

    Raises:
        InvalidParameterError: a name is not a str.
    """
    import numpy as np

    if isinstance(names, JoinedNames) and names.joined is not None:  # "a","b": no quote in
        quotes = np.flatnonzero(np.frombuffer(names.joined, dtype=np.uint8) == _QUOTE)
        return names.joined, quotes[0::2] + 1, quotes[1::2] - quotes[0::2] - 1  # a name
    text = _joined_text(names, "\0")
    if text.count("\0") == len(names) - 1:  # no name holds a NUL: the NULs are the cuts
        data = text.encode("utf-8", "surrogatepass") + b"\0"
        ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 0)
        starts = np.zeros(len(names), dtype=np.int64)
        starts[1:] = ends[:-1] + 1
        return data, starts, ends - starts
    encoded = [name.encode("utf-8", "surrogatepass") for name in names]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    starts = np.zeros(len(names), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return b"".join(encoded), starts, lengths


def _units_matrix(data: bytes, starts: Any, lengths: Any, rows: Any, size: int) -> Any:
    """The string units of the names at ``rows`` (all of ``size`` blocks), from :func:`_name_bytes`.

    An ``(len(rows), 16 size)`` uint8 matrix: tag, 4-byte big-endian length, the bytes, zero
    padding. Every part is copied as whole items (numpy copies an item per row far faster
    than a row of single bytes): the tag and length as 5-byte items, and the names of each
    byte length as items of that length, gathered from the joined bytes where they start.
    """
    import numpy as np

    every = rows.size == lengths.size  # then ``rows`` is 0..n-1
    mine, first = (lengths, starts) if every else (lengths[rows], starts[rows])
    width = 16 * size

    def field(length: int, offset: int) -> Any:
        return np.dtype({"names": ["f"], "formats": [f"V{length}"], "offsets": [offset],
                         "itemsize": width})

    units = np.zeros(rows.size, dtype=field(5, 0))
    heads = ((_STR_TAG[0] << 32) | mine).astype(">u8")  # the last 5 of 8 big-endian bytes
    units["f"] = np.ndarray((rows.size,), "V5", heads, 3, (8,))
    shortest, longest = int(mine.min()), int(mine.max())
    for length in [shortest] if shortest == longest else np.unique(mine).tolist():
        if length:
            items = np.ndarray((len(data) - length + 1,), f"V{length}", data, 0, (1,))
            names = units.view(field(length, 5))["f"]
            if shortest == longest:
                names[...] = items[first]
            else:
                same = np.flatnonzero(mine == length)
                names[same] = items[first[same]]
    return units.view(np.uint8).reshape(rows.size, width)


def parameter_digest(*fields: str | int) -> str:
    """A short digest of a mechanism's parameters, bound into its noise coordinates.

    BLAKE2b (8 bytes, personalised ``dpstream-params``) of the fields' explicit encoding
    (:func:`encode_coordinates`): every kind's mechanisms digest their parameters with it, so a
    resume under other parameters draws other noise and is refused (pitfall 13).
    """
    return hashlib.blake2b(encode_coordinates(fields), digest_size=8,
                           person=b"dpstream-params").hexdigest()
