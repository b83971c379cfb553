"""People as keyed 128-bit hashes: what user-level bounding holds instead of a person's id.

At the user level (issue 24) a flow must know which events belong to one person, but a raw
person id (an e-mail address, an account number) must never enter state, snapshots, logs,
metrics or error messages. :class:`PersonHasher` replaces every id, as soon as it is decoded,
by a **keyed** hash: BLAKE2b in keyed mode (RFC 7693; a pseudorandom function under its key)
with a 16-byte digest, under its own personalisation. The key is the flow's ``people`` lane,
``noise.lane(instance, flow_name, "people")`` (:meth:`dpstream.core.noise.keys.NoiseKey.lane`),
so it is secret, differs between flow instances (two instances' states cannot be joined on a
person) and is never stored: whoever lacks the noise key cannot recompute the hash of a
guessed id, so the hashes in a recovery store do not reveal who is in it by dictionary search.

A hash is returned as a NumPy ``V16`` item: its 16 digest bytes, which order (compared as
bytes, as :func:`numpy.sort` does) exactly as the 128-bit big-endian integer they spell. The
bounding state sorts people by it (:mod:`dpstream.core.contribution.bounder`), and
:func:`person_shards` routes a person by it to one shard of the bounding operator, so that all
of a person's events meet in one place whatever partition they came from.

**Collisions cost privacy, and are counted in delta.** Two people whose hashes collide share
one set of caps: removing one of them can change which of the other's events are kept, so a
collision breaks the argument that a person's presence changes only that person's kept events.
For neighbouring streams ``D`` (with person ``p``) and ``D'`` (without), with ``n`` other
people, let ``G`` be the event that ``h(p)`` differs from each of the ``n`` other hashes. For a
truly random function ``h`` into ``2^128`` values, ``P[not G] <= n 2^-128`` (a union bound over
the ``n`` others; the ids cannot be chosen to collide, because ``h`` is unknown without the key).
On ``G`` every other person's kept events are the same in ``D`` and ``D'`` and ``p``'s are
within the caps, so a mechanism that is ``(epsilon, delta)``-DP for one person's bounded
contribution satisfies ``P[M(D) in S] <= P[M(D) in S, G] + P[not G] <= e^epsilon P[M(D') in S]
+ delta + n 2^-128`` (and symmetrically): the user-level guarantee is ``(epsilon, delta +
n 2^-128)``. Keyed BLAKE2b stands in for the random function up to its PRF advantage (a
computational term, as for all of dpstream's noise, which the same key drives).
:func:`collision_delta` states the term; :data:`PEOPLE_BOUND` is a public bound on ``n`` that
needs no count of the data: a stream cannot hold more people than events, and no stream holds
``2^64`` events, so ``collision_delta(PEOPLE_BOUND) = 2^-64`` (about ``5.4e-20``) covers every
flow. The kinds add it to the delta they report at the user level.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from dpstream.core._checks import integer_at_least
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError

__all__ = ["HASH_BYTES", "PEOPLE_BOUND", "PersonHasher", "collision_delta", "person_shards"]

HASH_BYTES: Final = 16
"""The width of a person's hash (128 bits)."""
PEOPLE_BOUND: Final = 2**64
"""A public bound on the number of people a stream can hold (no stream holds 2^64 events)."""
_PERSON: Final = b"dpstream-person1"  # BLAKE2b personalisation (domain separation), 16 bytes
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
    """Keyed BLAKE2b-128 of person ids: the only form in which a person enters a flow's state.

    Args:
        key: the secret hashing key (the flow's ``people`` lane: at least 16 bytes).
    """

    __slots__ = ("_base",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) < _MIN_KEY_BYTES:
            raise InvalidParameterError(
                f"the person hashing key must be at least {_MIN_KEY_BYTES} bytes")
        self._base = hashlib.blake2b(key=key[:64], digest_size=HASH_BYTES, person=_PERSON)

    @classmethod
    def for_flow(cls, noise: NoiseKey, instance: str, flow_name: str) -> PersonHasher:
        """The hasher of a flow: keyed by its lane ``noise.lane(instance, flow_name, "people")``."""
        return cls(noise.lane(instance, flow_name, "people"))

    def __repr__(self) -> str:
        return "PersonHasher(<secret key>)"

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("a PersonHasher holds a secret key and is never pickled")

    def hash_one(self, person: str) -> bytes:
        """The 16-byte keyed hash of one person id."""
        h = self._base.copy()
        h.update(person.encode("utf-8", "surrogatepass"))
        return h.digest()

    def hash_many(self, people: Sequence[str]) -> PersonHashes:
        """The keyed hashes of ``people``, as a ``V16`` array aligned with them.

        Each distinct id is hashed once (a step's events repeat their people), then the hashes
        are spread back to the events.
        """
        n = len(people)
        if n == 0:
            return np.empty(0, dtype=f"V{HASH_BYTES}")
        distinct: dict[str, bytes] = dict.fromkeys(people, b"")
        digest = self.hash_one
        for person in distinct:
            distinct[person] = digest(person)
        if len(distinct) == n:  # all distinct: the values are in the events' order
            joined = b"".join(distinct.values())
        else:
            joined = b"".join(map(distinct.__getitem__, people))
        return np.frombuffer(joined, dtype=f"V{HASH_BYTES}").copy()


def person_shards(hashes: PersonHashes, shards: int) -> npt.NDArray[np.int64]:
    """The shard of each person: the hash's first 8 bytes, as a big-endian integer, mod shards.

    A function of the person's hash alone, so every event of a person goes to one shard.
    """
    count = integer_at_least("shards", shards, 1)
    words = hash_words(hashes)
    return (words[:, 0] % np.uint64(count)).astype(np.int64)


def hash_words(hashes: PersonHashes) -> npt.NDArray[np.uint64]:
    """The hashes as an ``(n, 2)`` array of native uint64 words (high word first)."""
    array = np.ascontiguousarray(hashes)
    if array.ndim != 1 or array.dtype.kind != "V" or array.dtype.itemsize != HASH_BYTES:
        raise InvalidParameterError(
            f"person hashes must be a 1-d array of {HASH_BYTES}-byte items (V{HASH_BYTES})")
    return array.view(">u8").reshape(-1, 2).astype(np.uint64)
