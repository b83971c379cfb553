"""The secret noise key and the keyed pseudorandom functions drawn from it.

Every draw of noise in dpstream is a pure function of a secret :class:`NoiseKey` and the
*coordinates* of its release (:mod:`dpstream.core.noise.coordinates`), so that noise is
**replay-safe**: re-running a release after a crash reproduces exactly the same noise, a replayed
release is byte-identical to the first and cannot be averaged against it. Three keyed PRFs are
derived from the one secret, each under its own BLAKE2b personalisation:

* :meth:`NoiseKey.stream`: BLAKE2b in keyed mode, used in counter mode, at the encoded
  coordinates: the uniform integers of the exact samplers (:mod:`dpstream.core.noise.samplers`);
* :meth:`NoiseKey.lane` / :meth:`NoiseKey.lane_words`: a 128-bit lane per mechanism instance,
  ECBC-MAC with AES-256 (scheme 3; the construction and its security argument are in
  :meth:`NoiseKey.lane`);
* :meth:`NoiseKey.encrypt_blocks` / :meth:`NoiseKey.encrypt_gaussian_blocks`: AES-256 block
  PRFs at a lane and a draw's numeric coordinates (:mod:`dpstream.core.noise.bulk`).

Whoever holds the key can subtract the noise: it must stay secret and is never logged
(``repr`` hides it) nor pickled (a snapshot holds no key and no lane).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import secrets
import stat
import threading
from collections.abc import Iterable
from typing import Any, Final

from dpstream.core.noise.coordinates import (
    Coordinate,
    _name_bytes,
    _unit,
    _units_matrix,
    check_coordinates,
    encode_coordinates,
)
from dpstream.core.noise.samplers import RandomIntegers
from dpstream.errors import InvalidParameterError, NoiseKeyError

__all__ = [
    "LANE_BYTES",
    "NOISE_KEY_ENV",
    "NOISE_KEY_FILE_ENV",
    "NOISE_SCHEME",
    "NoiseKey",
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

        The rounds of :func:`dpstream.core.noise.bulk_gaussian.gaussian` take their words here:
        the key is BLAKE2b of the secret under its own personalisation, independent of the key
        of :meth:`encrypt_blocks` and of the lane keys, so these blocks are a separate PRF
        domain.
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

