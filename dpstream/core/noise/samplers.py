"""Exact integer noise from replay-safe, cryptographic randomness.

All noise in dpstream is drawn here. Two ideas meet in this module:

* **Exact samplers** (Canonne, Kamath, Steinke 2020, "The Discrete Gaussian for
  Differential Privacy", Algorithms 1-3). They use only uniform integers and
  rational arithmetic, so the output distribution is exactly the discrete
  Laplace / discrete Gaussian; there is no floating-point inverse CDF whose
  holes could reveal the true value (Mironov 2012).
* **Replay-safe randomness.** The uniform integers come from a pseudorandom
  function keyed by a secret :class:`NoiseKey` and evaluated at the
  *coordinates* of the release (flow, mechanism, key, epoch, tree node, ...).
  BLAKE2b in keyed mode is the PRF, used in counter mode. Re-running a release
  after a crash therefore reproduces exactly the same noise, so a replayed
  release is byte-identical to the first and cannot be averaged against it.
  Whoever holds the key can subtract the noise: it must stay secret and is
  never logged (``repr`` hides it).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import os
import secrets
import stat
import threading
from collections.abc import Iterable
from fractions import Fraction
from typing import Any, Final, Protocol

from dpstream.errors import InvalidParameterError, NoiseKeyError

__all__ = [
    "NOISE_SCHEME",
    "TAG_BLT",
    "TAG_INITIAL",
    "TAG_MONITOR_QUERY",
    "TAG_MONITOR_THRESHOLD",
    "TAG_TREE",
    "check_coordinates",
    "encode_coordinates",
    "JoinedNames",
    "NOISE_KEY_ENV",
    "NOISE_KEY_FILE_ENV",
    "NoiseKey",
    "RandomIntegers",
    "bernoulli_exp",
    "discrete_gaussian",
    "discrete_gaussian_variance",
    "discrete_laplace",
    "discrete_laplace_variance",
]

NOISE_KEY_ENV: Final = "DPSTREAM_NOISE_KEY"
NOISE_KEY_FILE_ENV: Final = "DPSTREAM_NOISE_KEY_FILE"
_KEY_BYTES: Final = 32
_MIN_DISTINCT_BYTES: Final = 8
"""A key with fewer distinct byte values is refused. 32 random bytes have fewer than 8 with
probability below 1e-40, so a generated key is never refused."""
_PRIVATE_MODE_MASK: Final = 0o077
"""Permission bits of group and others; a key file must have none of them."""
_BLOCK_BYTES: Final = 64
_PERSON: Final = b"dpstream-noise1"  # domain separation, at most 16 bytes

Coordinate = str | int

NOISE_SCHEME: Final = "dpstream-noise/4"
"""How noise is derived from the key (recorded in snapshots: a resume across schemes would
re-noise replayed releases, so it is refused). Scheme 2 added lanes and the AES block PRF of
:mod:`dpstream.core.noise.bulk` for the counters' mechanisms; scheme 3 derives the lanes with
AES (ECBC-MAC, :meth:`NoiseKey.lane`) so that a million keys' lanes are a few bulk calls.
Scheme 4 draws the discrete Gaussian (BLT counter, zCDP initial count) from AES words at a
per-draw sub-lane under its own derived key (:meth:`NoiseKey.encrypt_gaussian_blocks`), so that
it is vectorized, instead of from a BLAKE2b stream per draw."""
_LANE_CBC_PERSON: Final = b"dpstream-lcbc3"
_LANE_FINAL_PERSON: Final = b"dpstream-lfin3"
_BLOCK_KEY_PERSON: Final = b"dpstream-aes2"
_GAUSSIAN_KEY_PERSON: Final = b"dpstream-gauss4"
LANE_BYTES: Final = 16
_LANE_VERSION_BLOCK: Final = b"dpstream-lane/3".ljust(16, b"\0")

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


class RandomIntegers(Protocol):
    """A source of exactly uniform integers (what the samplers need)."""

    def randbelow(self, n: int) -> int:
        """Return an integer drawn uniformly from ``[0, n)``."""
        ...


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
    """A coordinate's unit of the lane message (see :meth:`NoiseKey.lane`).

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
    :meth:`NoiseKey.lane_words` takes the names' bytes from it, and the record encoder
    (:mod:`dpstream.kinds.counters.records`) the keys' JSON texts.

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


class _PrfStream:
    """Uniform integers from BLAKE2b keyed by a per-release subkey, in counter mode."""

    __slots__ = ("_subkey", "_counter", "_bits", "_nbits")

    def __init__(self, subkey: bytes) -> None:
        self._subkey = subkey
        self._counter = 0
        self._bits = 0
        self._nbits = 0

    def _refill(self) -> None:
        block = hashlib.blake2b(
            self._counter.to_bytes(8, "big"), key=self._subkey, digest_size=_BLOCK_BYTES
        ).digest()
        self._counter += 1
        self._bits = (self._bits << (8 * _BLOCK_BYTES)) | int.from_bytes(block, "big")
        self._nbits += 8 * _BLOCK_BYTES

    def randbits(self, k: int) -> int:
        while self._nbits < k:
            self._refill()
        self._nbits -= k
        value = self._bits >> self._nbits
        self._bits &= (1 << self._nbits) - 1
        return value

    def randbelow(self, n: int) -> int:
        if n <= 0:
            raise InvalidParameterError(f"randbelow needs n > 0, got {n}")
        k = n.bit_length()
        while True:  # rejection sampling: exactly uniform (randbits inlined: a hot path)
            while self._nbits < k:
                self._refill()
            self._nbits -= k
            r = self._bits >> self._nbits
            self._bits &= (1 << self._nbits) - 1
            if r < n:
                return r


def _weakness(key: bytes) -> str | None:
    """Say why ``key`` is obviously not a secret, or return None.

    A crude low-entropy check: all bytes equal (``bytes(32)``, hex ``"11" * 32``) or fewer
    than :data:`_MIN_DISTINCT_BYTES` distinct byte values. It only catches obvious mistakes
    (a placeholder, a zeroed buffer, a repeated pattern); a key that passes may still be
    guessable, so make keys with :meth:`NoiseKey.generate` or ``dpstream keygen``.
    """
    distinct = len(set(key))
    if distinct == 1:
        return (f"has all {len(key)} bytes equal (such as an all-zero key): it is not secret. "
                "Make a real one with `dpstream keygen --out PATH` (the key itself is not shown)")
    if distinct < _MIN_DISTINCT_BYTES:
        return (f"has only {distinct} distinct byte values in {len(key)} bytes (at least "
                f"{_MIN_DISTINCT_BYTES} required): it looks like a pattern, not a random secret. "
                "Make a real one with `dpstream keygen --out PATH` (the key itself is not shown)")
    return None


class NoiseKey:
    """The secret from which all noise is derived.

    Load it with :meth:`from_environment` in production (``DPSTREAM_NOISE_KEY``
    as 64 hex characters or base64 of 32 bytes, or ``DPSTREAM_NOISE_KEY_FILE``
    naming a file that holds it, readable by its owner only). :meth:`generate`
    makes a fresh key from the operating system's CSPRNG. A key built from fixed
    bytes is for tests only.

    Keys that are obviously not secret are refused (see :func:`_weakness`): all
    bytes equal (``bytes(32)``, ``"11" * 32``) or fewer than
    :data:`_MIN_DISTINCT_BYTES` distinct byte values. That check only catches
    obvious mistakes; it says nothing about how the key was made.
    """

    __slots__ = ("_key", "_block_key", "_gaussian_key", "_lane_keys", "_local")

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) != _KEY_BYTES:
            raise NoiseKeyError(f"a noise key is exactly {_KEY_BYTES} bytes")
        weakness = _weakness(key)
        if weakness is not None:
            raise NoiseKeyError(f"the noise key {weakness}")
        self._key = key
        self._block_key = hashlib.blake2b(b"", key=key, digest_size=32,
                                          person=_BLOCK_KEY_PERSON).digest()
        self._gaussian_key = hashlib.blake2b(b"", key=key, digest_size=32,
                                             person=_GAUSSIAN_KEY_PERSON).digest()
        self._lane_keys = tuple(hashlib.blake2b(b"", key=key, digest_size=32,
                                                person=person).digest()
                                for person in (_LANE_CBC_PERSON, _LANE_FINAL_PERSON))
        self._local = threading.local()  # one AES encryptor per thread (Bytewax workers)

    @classmethod
    def generate(cls) -> NoiseKey:
        """Return a fresh random key from the OS CSPRNG."""
        return cls(secrets.token_bytes(_KEY_BYTES))

    @classmethod
    def for_tests(cls, seed: int) -> NoiseKey:
        """Return a deterministic key; never use it for real data."""
        return cls(hashlib.sha256(f"dpstream-test-key-{seed}".encode()).digest())

    @classmethod
    def parse(cls, text: str, *, source: str) -> NoiseKey:
        """Parse 64 hex characters or base64 of 32 bytes; ``source`` names where it came from."""
        text = text.strip()
        try:
            if len(text) == 2 * _KEY_BYTES:
                raw = bytes.fromhex(text)
            else:
                raw = base64.b64decode(text, validate=True)
        except (ValueError, binascii.Error):
            raw = b""
        if len(raw) != _KEY_BYTES:
            raise NoiseKeyError(
                f"the noise key in {source} must be 64 hex characters or base64 of "
                f"{_KEY_BYTES} bytes (the key itself is not shown)"
            )
        weakness = _weakness(raw)
        if weakness is not None:
            raise NoiseKeyError(f"the noise key in {source} {weakness}")
        return cls(raw)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> NoiseKey:
        """Read a key from a file (hex or base64 text) that only its owner can read or write.

        Raises:
            NoiseKeyError: the file cannot be read, is readable or writable by its group or
                others (``mode & 0o077``; the message gives the ``chmod`` that fixes it), or
                does not hold a valid, non-weak key.
        """
        try:
            with open(path, "rb") as handle:
                # the mode of the file actually opened (a symlink's target), not of a path
                # that could be swapped between a check and the read
                mode = stat.S_IMODE(os.fstat(handle.fileno()).st_mode)
                if mode & _PRIVATE_MODE_MASK and os.name == "posix":
                    raise NoiseKeyError(
                        f"the noise key file {path} has mode {mode:04o}: it is readable or "
                        "writable by its group or by others, and whoever reads the key can "
                        f"subtract the noise. Restrict it with `chmod 600 {path}` (and keep "
                        "it owned by the user that runs the flow), or make a new one with "
                        "`dpstream keygen --out PATH`")
                data = handle.read()
        except OSError as exc:
            raise NoiseKeyError(f"cannot read the noise key file {path}: {exc.strerror}") from None
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError:
            raise NoiseKeyError(
                f"the noise key in file {path} must be 64 hex characters or base64 of "
                f"{_KEY_BYTES} bytes (the key itself is not shown)"
            ) from None
        return cls.parse(text, source=f"file {path}")

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> NoiseKey:
        """Load the key from ``DPSTREAM_NOISE_KEY`` or ``DPSTREAM_NOISE_KEY_FILE``.

        The file must be private to its owner (see :meth:`from_file`); either way the key is
        refused if it is obviously weak.
        """
        env = os.environ if environ is None else environ
        if env.get(NOISE_KEY_ENV):
            return cls.parse(env[NOISE_KEY_ENV], source=f"${NOISE_KEY_ENV}")
        if env.get(NOISE_KEY_FILE_ENV):
            return cls.from_file(env[NOISE_KEY_FILE_ENV])
        raise NoiseKeyError(
            f"no noise key: set {NOISE_KEY_FILE_ENV} to a file holding it, readable by its "
            f"owner only (make one with `dpstream keygen --out PATH`), or {NOISE_KEY_ENV} "
            "to 64 hex characters"
        )

    def fingerprint(self) -> str:
        """Return a short non-secret identifier of the key (safe to log)."""
        return hashlib.blake2b(self._key, digest_size=4, person=b"dpstream-fp").hexdigest()

    def stream(self, *coordinates: Coordinate) -> RandomIntegers:
        """Return the uniform integers for the release at ``coordinates``.

        The same key and coordinates always give the same integers; different
        coordinates give computationally independent ones.
        """
        subkey = hashlib.blake2b(
            encode_coordinates(coordinates), key=self._key, digest_size=32, person=_PERSON
        ).digest()
        return _PrfStream(subkey)

    def lane(self, *prefix: Coordinate) -> bytes:
        """Return the 16-byte lane of the mechanism instance at coordinates ``prefix``.

        Each draw of that mechanism is one block of :meth:`encrypt_blocks` at the lane and the
        draw's numeric coordinates (:mod:`dpstream.core.noise.bulk`). Lanes are secret-derived:
        keep them in memory, never in a snapshot.

        **Derivation (scheme 3).** The lane is ECBC-MAC (CBC-MAC under AES-256 key ``K1``,
        its last state encrypted once more under an independent key ``K2``; Black and Rogaway,
        "CBC MACs for arbitrary-length messages: the three-key constructions", 2000, after
        Petrank and Rackoff) of the message ``V || unit(c_1) || ... || unit(c_n)``: ``V`` is
        one version block, and ``unit(c)`` is the coordinate's type tag, 4-byte big-endian
        length and bytes (as in :func:`encode_coordinates`) zero-padded to whole 16-byte
        blocks. The units parse back uniquely (the length says where the padding starts), so
        distinct prefixes give distinct messages, and ECBC is a pseudorandom function on
        messages of any number of whole blocks (advantage ``O(q^2 l^2 / 2^128)`` for ``q``
        lanes of at most ``l`` blocks). ``K1`` and ``K2`` are BLAKE2b of the secret under
        their own personalisations, distinct from the draws' AES key. Because a coordinate
        starts a fresh block, the CBC state after a common head is shared by many keys:
        :meth:`lanes` computes it once and runs the rest over all names in bulk.
        """
        return self._ecbc(_LANE_VERSION_BLOCK + b"".join(map(_unit, check_coordinates(prefix))))

    def lanes(self, before: tuple[Coordinate, ...], names: Iterable[str],
              after: tuple[Coordinate, ...]) -> list[bytes]:
        """Return ``[self.lane(*before, name, *after) for name in names]``, in bulk."""
        data = self.lane_words(before, names, after).tobytes()
        return [data[i:i + LANE_BYTES] for i in range(0, len(data), LANE_BYTES)]

    def lane_words(self, before: tuple[Coordinate, ...], names: Iterable[str],
                   after: tuple[Coordinate, ...]) -> Any:
        """:meth:`lanes` as an ``(n, 2)`` array of little-endian uint64 words.

        The CBC state after ``V || units(before)`` is computed once; the names are encoded
        together (:func:`_name_bytes`), grouped by their number of blocks, and each group is
        chained through its own blocks and the units of ``after`` with one AES call per block
        position, on all its names at once.
        """
        import numpy as np  # the core's one array library; only the bulk path needs it

        names = names if isinstance(names, tuple) else tuple(names)  # JoinedNames kept
        tail = b"".join(map(_unit, check_coordinates(after)))
        head = self._cbc(_LANE_VERSION_BLOCK + b"".join(map(_unit, check_coordinates(before))),
                         bytes(16))
        out = np.empty(len(names), dtype="V16")  # a lane per name, as one 16-byte item
        if not names:
            return out.view("<u8").reshape(-1, 2).astype(np.uint64)
        data, starts, lengths = _name_bytes(names)
        sizes = (lengths + 5 + 15) // 16  # tag, 4 length bytes, the bytes, zero padding
        encrypt, finish = self._lane_encryptor(0).update, self._lane_encryptor(1).update
        tail_blocks = [tail[j:j + 16] for j in range(0, len(tail), 16)]
        smallest, largest = int(sizes.min()), int(sizes.max())
        for size in [smallest] if smallest == largest else np.unique(sizes).tolist():
            every = smallest == largest
            rows = np.arange(len(names)) if every else np.flatnonzero(sizes == size)
            # block j of every name as one contiguous array (16-byte items: copies in C
            # loops, XORs on flat native words: bytewise, whatever the byte order), so no
            # operation works row by row
            blocks = _units_matrix(data, starts, lengths, rows, size).view("V16")
            state = np.bitwise_xor(np.ascontiguousarray(blocks[:, 0]).view(np.uint64),
                                   np.frombuffer(head * rows.size, dtype=np.uint64))
            for j in range(1, size):
                np.bitwise_xor(np.frombuffer(encrypt(state.view(np.uint8)), dtype=np.uint64),
                               np.ascontiguousarray(blocks[:, j]).view(np.uint64), out=state)
            for block in tail_blocks:
                np.bitwise_xor(np.frombuffer(encrypt(state.view(np.uint8)), dtype=np.uint64),
                               np.frombuffer(block * rows.size, dtype=np.uint64), out=state)
            lanes = np.frombuffer(finish(encrypt(state.view(np.uint8))), dtype="V16")
            if every:
                return lanes.view("<u8").reshape(-1, 2).astype(np.uint64)
            out[rows] = lanes
        return out.view("<u8").reshape(-1, 2).astype(np.uint64)

    def _lane_encryptor(self, which: int) -> Any:
        """The thread's AES-256 ECB encryptor under lane key ``which`` (0: K1, 1: K2)."""
        cached = getattr(self._local, "lane_encryptors", None)
        if cached is None:
            from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

            cached = tuple(Cipher(algorithms.AES(k), modes.ECB()).encryptor()
                           for k in self._lane_keys)
            self._local.lane_encryptors = cached
        return cached[which]

    def _cbc(self, message: bytes, state: bytes) -> bytes:
        """The CBC-MAC state under K1 after ``message`` (whole blocks), from ``state``."""
        encrypt = self._lane_encryptor(0).update
        for j in range(0, len(message), 16):
            block = int.from_bytes(state, "little") ^ int.from_bytes(message[j:j + 16], "little")
            state = encrypt(block.to_bytes(16, "little"))
        return state

    def _ecbc(self, message: bytes) -> bytes:
        """ECBC-MAC of ``message`` (whole blocks): CBC under K1, then AES under K2."""
        final: bytes = self._lane_encryptor(1).update(self._cbc(message, bytes(16)))
        return final

    def prepare(self) -> None:
        """Set up this thread's AES encryptors now (the import and the key schedules).

        A flow calls it while it is built, so the first closed step does not pay for it
        (about 15 ms). Nothing drawn depends on it.
        """
        self._lane_encryptor(0)
        self.encrypt_blocks(bytes(16))
        self.encrypt_gaussian_blocks(bytes(16))

    def encrypt_blocks(self, data: bytes | memoryview) -> bytes:
        """Encrypt ``data``, whole 16-byte blocks, with AES-256 (ECB) under a derived key.

        This is the block PRF of :mod:`dpstream.core.noise.bulk`; the AES key is BLAKE2b of
        the secret (never the secret itself).

        ``cryptography`` (OpenSSL, AES-NI) is imported here only: it encrypts about 70M blocks
        a second on one core, where no numpy cipher comes near and :mod:`hashlib` has no bulk
        call.
        """
        return self._ecb("encryptor", self._block_key, data)

    def encrypt_gaussian_blocks(self, data: bytes) -> bytes:
        """Encrypt whole 16-byte blocks with AES-256 (ECB) under the discrete Gaussian's key.

        The rounds of :func:`dpstream.core.noise.bulk.gaussian` take their words here: the key
        is BLAKE2b of the secret under its own personalisation, independent of the key of
        :meth:`encrypt_blocks` and of the lane keys, so these blocks are a separate PRF domain.
        """
        return self._ecb("gaussian_encryptor", self._gaussian_key, data)

    def _ecb(self, name: str, key: bytes, data: bytes | memoryview) -> bytes:
        """AES-256-ECB of whole blocks under ``key``, with this thread's encryptor ``name``."""
        encryptor = getattr(self._local, name, None)
        if encryptor is None:  # ECB keeps no state between blocks: one encryptor serves all
            from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

            encryptor = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
            setattr(self._local, name, encryptor)
        if len(data) % 16:
            raise InvalidParameterError("the block PRF takes whole 16-byte blocks")
        encrypted: bytes = encryptor.update(data)
        return encrypted

    def __repr__(self) -> str:
        return f"NoiseKey(fingerprint={self.fingerprint()})"

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("a NoiseKey is never pickled: it must not reach the recovery store")


# --- CKS 2020 exact samplers -------------------------------------------------


def _bernoulli(rng: RandomIntegers, num: int, den: int) -> bool:
    """Return True with probability num/den exactly (0 <= num <= den)."""
    return rng.randbelow(den) < num


def bernoulli_exp(rng: RandomIntegers, gamma: Fraction) -> bool:
    """Return True with probability exp(-gamma), gamma >= 0 rational.

    CKS 2020, Algorithm 1 (for gamma in [0, 1]) and its extension to gamma > 1
    by repeated Bernoulli(exp(-1)) trials.
    """
    if gamma < 0:
        raise InvalidParameterError(f"gamma must be >= 0, got {gamma}")
    num, den = gamma.numerator, gamma.denominator
    whole = num // den
    for _ in range(whole):
        if not _bernoulli_exp_unit(rng, 1, 1):
            return False
    return _bernoulli_exp_unit(rng, num - whole * den, den)


def _bernoulli_exp_unit(rng: RandomIntegers, num: int, den: int) -> bool:
    """CKS 2020 Algorithm 1: Bernoulli(exp(-num/den)) for num/den in [0, 1]."""
    k = 1
    while _bernoulli(rng, num, den * k):
        k += 1
    return k % 2 == 1


def discrete_laplace(rng: RandomIntegers, scale: Fraction) -> int:
    """Draw from the discrete Laplace distribution, P(x) proportional to exp(-|x|/scale).

    CKS 2020, Algorithm 2, with scale = t/s for integers s, t.
    """
    if scale <= 0:
        raise InvalidParameterError(f"discrete Laplace scale must be > 0, got {scale}")
    t, s = scale.numerator, scale.denominator
    while True:
        u = rng.randbelow(t)
        if not _bernoulli_exp_unit(rng, u, t):
            continue
        v = 0
        while _bernoulli_exp_unit(rng, 1, 1):
            v += 1
        y = (u + t * v) // s
        negative = rng.randbelow(2) == 1
        if negative and y == 0:
            continue
        return -y if negative else y


def discrete_gaussian(rng: RandomIntegers, sigma2: Fraction) -> int:
    """Draw from the discrete Gaussian N_Z(0, sigma2), P(x) proportional to exp(-x^2/(2 sigma2)).

    CKS 2020, Algorithm 3: discrete Laplace proposals with scale t = floor(sigma)+1,
    accepted with probability exp(-(|y| - sigma2/t)^2 / (2 sigma2)).
    """
    if sigma2 <= 0:
        raise InvalidParameterError(f"discrete Gaussian variance must be > 0, got {sigma2}")
    t = math.isqrt(sigma2.numerator // sigma2.denominator) + 1
    scale = Fraction(t)
    while True:
        y = discrete_laplace(rng, scale)
        gamma = (abs(y) - sigma2 / t) ** 2 / (2 * sigma2)
        if bernoulli_exp(rng, gamma):
            return y


def discrete_laplace_variance(scale: Fraction | float) -> float:
    """Return the exact variance 2p/(1-p)^2, p = exp(-1/scale), of the discrete Laplace."""
    p = math.exp(-1.0 / float(scale))
    return 2.0 * p / (1.0 - p) ** 2


def discrete_gaussian_variance(sigma2: Fraction | float) -> float:
    """Return the variance of N_Z(0, sigma2) (at most sigma2; CKS 2020, Proposition 19).

    For sigma2 >= 100 it equals sigma2 to double precision; below that it is
    summed over the support.
    """
    s2 = float(sigma2)
    if s2 >= 100.0:
        return s2
    bound = int(40 * math.sqrt(s2)) + 2
    weights = [math.exp(-(x * x) / (2 * s2)) for x in range(-bound, bound + 1)]
    total = sum(weights)
    return sum(w * x * x for w, x in zip(weights, range(-bound, bound + 1), strict=True)) / total
