"""People as keyed 128-bit hashes: what user-level bounding holds instead of a person's id.

At the user level (issue 24) a flow must know which events belong to one person, but a raw
person id (an e-mail address, an account number) must never enter state, snapshots, logs,
metrics or error messages. :class:`PersonHasher` replaces every id, as soon as it is decoded,
by a **keyed** 128-bit hash under a secret key: the flow's ``people`` lane,
``noise.lane(instance, flow_name, "people")`` (:meth:`dpstream.core.noise.keys.NoiseKey.lane`),
so it is secret, differs between flow instances (two instances' states cannot be joined on a
person) and is never stored: whoever lacks the noise key cannot recompute the hash of a
guessed id, so the hashes in a recovery store do not reveal who is in it by dictionary search.

**The function: CBC-MAC with AES-256 over a canonical, prefix-free encoding of the id.**
The hash of an id ``x`` is ``CBC_K(unit(x))``: CBC-MAC under AES-256 with key ``K`` (zero IV)
over the 16-byte blocks of ``unit(x)``, the last state being the hash. ``K`` is keyed BLAKE2b (a
PRF) under the hasher's key, with its own personalisation (``dpstream-pcbc1``): a key of this
hasher alone, independent of every other key derived from the noise key. ``unit(x)``, with ``b``
the UTF-8 bytes of ``x`` (lone surrogates kept) and ``L`` their length, is a length header, then
``b``, then zero padding to whole blocks; the header is the single byte ``L`` when ``L < 255``,
else the byte ``255`` and ``L`` as 8 big-endian bytes. So an id of at most 14 bytes is one
block.

*Batch-independent.* ``unit(x)`` is a function of ``x`` alone, never of the other ids hashed
with it (its own length in its first block, its own number of blocks), so the hash of an id
never depends on the batch it comes in; the batch is only grouped by number of blocks to run
the chains in bulk.

*Prefix-free, hence a PRF.* The header is in the first block and states ``L``, hence the
number of blocks: two encodings with the same first block have the same length, so neither is
a proper prefix of the other; and ``unit`` is injective (``L`` says where the padding starts).
CBC-MAC under a pseudorandom permutation is a pseudorandom function on a prefix-free message
space (Petrank and Rackoff, "CBC MAC for real-time data sources", 2000; Bellare, Kilian and
Rogaway, 1994): its advantage against a random function is at most ``O(q^2 l^2 / 2^128)`` for
``q`` ids of at most ``l`` blocks, plus AES-256's PRP advantage, a computational term as for
all of dpstream's noise, which the same key drives. (The final encryption under a second key
that ECBC adds is what makes CBC-MAC safe on messages that are *not* prefix-free; a prefix-free
encoding needs none, which saves an AES call an id.) So the hashes stand in for a random
function into ``2^128`` values, and the collision argument below holds as for any such
function.

*In columns.* The ids of a batch are encoded together (one UTF-8 encoding of their join),
grouped by their number of blocks, and each group is chained with one AES call per block
position over all its ids (``cryptography``, AES-NI): no Python work per id (headers of ids
of 255 bytes or more are written one by one; such ids are rare).

A hash is returned as a NumPy ``V16`` item: the 16 bytes of the final AES block, which order
(compared as bytes, as :func:`numpy.sort` does) exactly as the 128-bit big-endian integer they
spell. The bounding state sorts people by it (:mod:`dpstream.core.contribution.bounder`), and
:func:`person_shards` routes a person by it to one shard of the bounding operator, so that all
of a person's events meet in one place whatever partition they came from.

**Collisions cost privacy, and are counted in delta.** Two people whose hashes collide share
one set of caps: removing one of them can change which of the other's events are kept, so a
collision breaks the argument that a person's presence changes only that person's kept events.
For neighbouring streams ``D`` (with person ``p``) and ``D'`` (without), with ``n`` other
people, let ``G`` be the event that ``h(p)`` differs from each of the ``n`` other hashes. For a
truly random function ``h`` into ``2^128`` values, ``P[not G] <= n 2^-128`` (a union bound over
the ``n`` others, ``2^-128`` a pair; the ids cannot be chosen to collide, because ``h`` is
unknown without the key). On ``G`` every other person's kept events are the same in ``D`` and
``D'`` and ``p``'s are within the caps, so a mechanism that is ``(epsilon, delta)``-DP for one
person's bounded contribution satisfies ``P[M(D) in S] <= P[M(D) in S, G] + P[not G] <=
e^epsilon P[M(D') in S] + delta + n 2^-128`` (and symmetrically): the user-level guarantee is
``(epsilon, delta + n 2^-128)``. The keyed CBC-MAC stands in for the random function up to its
PRF advantage (above). :func:`collision_delta` states the term; :data:`PEOPLE_BOUND` is a
public bound on ``n`` that needs no count of the data: a stream cannot hold more people than
events, and no stream holds ``2^64`` events, so ``collision_delta(PEOPLE_BOUND) = 2^-64``
(about ``5.4e-20``) covers every flow. The kinds add it to the delta they report at the user
level.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from dpstream.core._checks import integer_at_least
from dpstream.core.noise.coordinates import _name_bytes
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError

__all__ = ["HASH_BYTES", "PEOPLE_BOUND", "PersonHasher", "collision_delta", "person_shards"]

HASH_BYTES: Final = 16
"""The width of a person's hash (128 bits)."""
PEOPLE_BOUND: Final = 2**64
"""A public bound on the number of people a stream can hold (no stream holds 2^64 events)."""
_CBC_PERSON: Final = b"dpstream-pcbc1"  # BLAKE2b personalisation of the AES key
_SHORT: Final = 255
"""Ids of fewer UTF-8 bytes have a one-byte header (their length); longer ones nine bytes."""
_BLOCK: Final = 16
_MIN_KEY_BYTES: Final = 16
PersonHashes = npt.NDArray[np.void]


def collision_delta(people: int) -> float:
    """The delta a hash collision may cost: ``people * 2^-128`` (see the module docstring).

    Args:
        people: a public upper bound on the number of *other* people in the stream (within
            the privacy unit's period); :data:`PEOPLE_BOUND` holds for every stream.

    Returns:
        The bound on the probability that the added or removed person's 128-bit keyed hash
        equals another person's, rounded up to a float (it is added to the reported delta).
    """
    count = integer_at_least("people", people, 0)
    return float(np.nextafter(count * 2.0**-128, np.inf)) if count else 0.0


class PersonHasher:
    """Keyed 128-bit CBC-MAC (AES-256, prefix-free encoding) of person ids.

    The only form in which a person enters a flow's state (the module docstring).

    Args:
        key: the secret hashing key (the flow's ``people`` lane: at least 16 bytes).
    """

    __slots__ = ("_key", "_local")

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) < _MIN_KEY_BYTES:
            raise InvalidParameterError(
                f"the person hashing key must be at least {_MIN_KEY_BYTES} bytes")
        self._key = hashlib.blake2b(b"aes-256 key", key=key[:64], digest_size=32,
                                    person=_CBC_PERSON).digest()
        self._local = threading.local()  # one AES encryptor per thread (Bytewax workers)

    @classmethod
    def for_flow(cls, noise: NoiseKey, instance: str, flow_name: str) -> PersonHasher:
        """The hasher of a flow: keyed by its lane ``noise.lane(instance, flow_name, "people")``."""
        return cls(noise.lane(instance, flow_name, "people"))

    def __repr__(self) -> str:
        return "PersonHasher(<secret key>)"

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("a PersonHasher holds a secret key and is never pickled")

    def _encrypt(self) -> Any:
        """The AES-256 ECB ``update`` under ``K`` of the calling thread."""
        update = getattr(self._local, "update", None)
        if update is None:
            from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

            update = Cipher(algorithms.AES(self._key), modes.ECB()).encryptor().update
            self._local.update = update
        return update

    def hash_one(self, person: str) -> bytes:
        """The 16-byte keyed hash of one person id."""
        return bytes(self.hash_many([person])[0].tobytes())

    def hash_many(self, people: Sequence[str]) -> PersonHashes:
        """The keyed hashes of ``people``, as a ``V16`` array aligned with them.

        Each id's hash is a function of that id alone (the module docstring); the ids are
        encoded together and chained in bulk, one AES call per number of blocks and block
        position. A repeated id is hashed again (cheaper than finding the repeats).

        Raises:
            InvalidParameterError: an id is not a str (its value is not named).
        """
        n = len(people)
        out = np.empty(n, dtype=f"V{HASH_BYTES}")
        if n == 0:
            return out
        try:
            joined = _joined_units(people)
            if isinstance(joined, np.ndarray):  # every id of one byte length: one chain
                return self._chain(joined, out.dtype).copy()
            data, starts, lengths = joined if joined is not None else _name_bytes(
                people if isinstance(people, tuple) else tuple(people))
        except InvalidParameterError:
            raise InvalidParameterError("a person id must be a str") from None
        heads = np.where(lengths < _SHORT, 1, 9)
        sizes = (heads + lengths + _BLOCK - 1) // _BLOCK
        smallest, largest = int(sizes.min()), int(sizes.max())
        for size in [smallest] if smallest == largest else np.unique(sizes).tolist():
            every = smallest == largest
            rows = np.arange(n) if every else np.flatnonzero(sizes == size)
            hashes = self._chain(_units(data, starts, lengths, rows, size), out.dtype)
            if every:
                return hashes.copy()
            out[rows] = hashes
        return out

    def _chain(self, units: npt.NDArray[np.uint8], dtype: np.dtype[Any]) -> PersonHashes:
        """CBC-MAC (zero IV) of each row of ``units`` (whole blocks), a read-only ``V16`` array."""
        encrypt = self._encrypt()
        blocks = units.view("V16")
        state = np.ascontiguousarray(blocks[:, 0]).view(np.uint64)  # the zero IV
        for j in range(1, blocks.shape[1]):
            np.bitwise_xor(np.frombuffer(encrypt(state.view(np.uint8)), dtype=np.uint64),
                           np.ascontiguousarray(blocks[:, j]).view(np.uint64), out=state)
        return np.frombuffer(encrypt(state.view(np.uint8)), dtype=dtype)


def _joined_units(people: Sequence[str]
                  ) -> npt.NDArray[np.uint8] | tuple[bytes, Any, Any] | None:
    """The ids' bytes from one join: ``unit(x)`` of every id when all have one length.

    The ids are joined with NUL and encoded once (lone surrogates kept, as in
    :func:`~dpstream.core.noise.coordinates._name_bytes`). If an id holds a NUL (the text has
    more than ``n - 1``) this returns None (the general path cuts them one by one). Else the
    ``n`` NUL bytes of the encoding with a NUL appended are exactly the ``n`` cuts (UTF-8 writes
    byte 0 for U+0000 only). If it is ``n`` rows of ``L + 1`` bytes (``0 < L < 255``) whose last
    byte is NUL, those are the ``n`` cuts, so every id is the first ``L`` bytes of its row:
    the ``(n, 16 size)`` matrix of ``unit(x)`` is returned, made by one row copy for the whole
    batch (the same bytes as :func:`_units` writes, without a search for the cuts or a gather
    per length). Otherwise ``(data, starts, lengths)`` as ``_name_bytes`` gives them.

    Raises:
        InvalidParameterError: an id is not a str.
    """
    n = len(people)
    try:
        text = "\0".join(people)
    except TypeError:
        raise InvalidParameterError("a person id must be a str") from None
    if text.count("\0") != n - 1:
        return None
    data = text.encode("utf-8", "surrogatepass") + b"\0"
    chars = np.frombuffer(data, np.uint8)
    length, extra = divmod(len(data), n)
    length -= 1
    if not extra and 0 < length < _SHORT:
        rows = chars.reshape(n, length + 1)
        if not rows[:, length].any():  # every row ends in NUL
            units = np.zeros((n, _BLOCK * ((length + _BLOCK) // _BLOCK)), np.uint8)
            units[:, 0] = length
            units[:, 1:1 + length] = rows[:, :length]
            return units
    ends = np.flatnonzero(chars == 0)
    starts = np.zeros(n, dtype=np.int64)
    starts[1:] = ends[:-1] + 1
    return data, starts, ends - starts


def _units(data: bytes, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64],
           rows: npt.NDArray[np.int64], size: int) -> npt.NDArray[np.uint8]:
    """``unit(x)`` of the ids at ``rows`` (all of ``size`` blocks), from their joined bytes.

    An ``(len(rows), 16 size)`` uint8 matrix. The bytes of the ids of each length are copied
    as whole items (numpy copies an item per row far faster than a row of single bytes).
    """
    width = _BLOCK * size
    mine, first = lengths[rows], starts[rows]
    units = np.zeros((rows.size, width), np.uint8)
    if int(mine[0]) >= _SHORT:  # long ids (never sharing a size with short ones): one by one
        for row, (begin, length) in enumerate(zip(first.tolist(), mine.tolist(), strict=True)):
            unit = bytes([_SHORT]) + length.to_bytes(8, "big") + data[begin:begin + length]
            units[row, :len(unit)] = np.frombuffer(unit, np.uint8)
        return units
    units[:, 0] = mine
    shortest, longest = int(mine.min()), int(mine.max())
    for length in [shortest] if shortest == longest else np.unique(mine).tolist():
        if length:
            items = np.ndarray((len(data) - length + 1,), f"V{length}", data, 0, (1,))
            field = np.dtype({"names": ["f"], "formats": [f"V{length}"], "offsets": [1],
                              "itemsize": width})
            names = units.view(field)[:, 0]["f"]
            if shortest == longest:
                names[...] = items[first]
            else:
                same = np.flatnonzero(mine == length)
                names[same] = items[first[same]]
    return units


def person_shards(hashes: PersonHashes, shards: int) -> npt.NDArray[np.int64]:
    """The shard of each person: the hash's first 8 bytes, as a big-endian integer, mod shards.

    A function of the person's hash alone, so every event of a person goes to one shard.
    """
    count = integer_at_least("shards", shards, 1)
    array = _checked(hashes)
    if count <= 256 and not count & (count - 1):  # a power of two: the first word's low bits,
        # which are its last (8th) byte's low bits in big-endian order: w mod 2^k = w & (2^k - 1)
        return (array.view(np.uint8).reshape(-1, HASH_BYTES)[:, 7] & (count - 1)).astype(np.int64)
    return (array.view(">u8")[0::2] % np.uint64(count)).astype(np.int64)  # the first words


def hash_words(hashes: PersonHashes) -> npt.NDArray[np.uint64]:
    """The hashes as an ``(n, 2)`` array of native uint64 words (high word first)."""
    return _checked(hashes).view(">u8").reshape(-1, 2).astype(np.uint64)


def _checked(hashes: PersonHashes) -> PersonHashes:
    """``hashes`` as a contiguous 1-d ``V16`` array (refusing anything else)."""
    array = np.ascontiguousarray(hashes)
    if array.ndim != 1 or array.dtype.kind != "V" or array.dtype.itemsize != HASH_BYTES:
        raise InvalidParameterError(
            f"person hashes must be a 1-d array of {HASH_BYTES}-byte items (V{HASH_BYTES})")
    return array
