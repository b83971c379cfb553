"""Which shard a name lives on: a fixed hash every kind and every process agrees on.

A key's (counters) or a histogram's or model stream's (pmwg, erm) shard is the CRC-32 of its
UTF-8 bytes modulo the number of shards: the same in every process and on every worker, unlike
Python's salted ``hash``, so a restart or another worker finds every name on the same shard
(recovery stores are per shard).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["shard_of", "shards_of"]

IntArray = npt.NDArray[np.int64]


def shard_of(key: str, shards: int) -> int:
    """Return the shard of ``key`` (stable across processes, unlike ``hash``)."""
    return zlib.crc32(key.encode()) % shards


def shards_of(keys: Sequence[str], shards: int) -> IntArray:
    """:func:`shard_of` of every key, as an int64 array (C-speed maps, no Python loop)."""
    crcs = np.fromiter(map(zlib.crc32, map(str.encode, keys)), dtype=np.int64, count=len(keys))
    return crcs % shards
