"""A NoiseKey stand-in for tests that checks which coordinates a mechanism draws from."""

from dpstream.core.noise.coordinates import (
    TAG_BLT,
    TAG_INITIAL,
    TAG_MONITOR_QUERY,
    TAG_MONITOR_THRESHOLD,
    TAG_TREE,
)
from dpstream.core.noise.keys import NoiseKey

_MARKERS = ("dpstream-noise/2 resolve", "dpstream-noise/2 gaussian")


class RecordingKey:
    """A NoiseKey stand-in that records every draw, as its coordinates.

    Draws go through lanes (``lane(*prefix)``) and blocks at ``(tag, epoch, height, index)``
    (see dpstream.core.noise.bulk); each is recorded as the coordinate tuple it stands for:
    ``(*prefix, "tree", epoch, height, index)``, ``(*prefix, "monitor", "threshold")``,
    ``(*prefix, "monitor", "query", t)``, ``(*prefix, "blt", epoch, step)``, ``prefix`` (an
    initial count); other streams as asked for.
    """

    def __init__(self, seed: int = 0) -> None:
        self.inner = NoiseKey.for_tests(seed)
        self.calls: list[tuple[object, ...]] = []
        self._prefixes: dict[bytes, tuple[object, ...]] = {}

    def lane(self, *prefix):
        lane = self.inner.lane(*prefix)
        self._prefixes[lane] = prefix
        return lane

    def lanes(self, before, names, after):
        return [self.lane(*before, name, *after) for name in names]

    def lane_words(self, before, names, after):
        from dpstream.core.noise.bulk import lanes_array

        return lanes_array(self.lanes(before, names, after))

    def encrypt_blocks(self, data: bytes) -> bytes:
        for start in range(0, len(data), 16):
            self._record_block(data[start:start + 16])
        return self.inner.encrypt_blocks(data)

    def encrypt_gaussian_blocks(self, data: bytes) -> bytes:
        """A discrete Gaussian draw's rounds (its draw was recorded by its first block)."""
        return self.inner.encrypt_gaussian_blocks(data)

    def _record_block(self, block: bytes) -> None:
        first = int.from_bytes(block[:8], "little")
        second = int.from_bytes(block[8:], "little")
        for lane, prefix in self._prefixes.items():
            packed = first ^ int.from_bytes(lane[:8], "little")
            tag, height, epoch = packed & 0xFF, (packed >> 8) & 0xFFFFFF, packed >> 32
            if TAG_TREE <= tag <= TAG_INITIAL and epoch < 1 << 20 and height < 1 << 8:
                index = second ^ int.from_bytes(lane[8:], "little")
                if index < 1 << 40:
                    self.calls.append(self._name(prefix, tag, epoch, height, index))
                    return
        raise AssertionError("a block at no lane this key handed out")

    @staticmethod
    def _name(prefix, tag, epoch, height, index):
        if tag == TAG_TREE:
            return (*prefix, "tree", epoch, height, index)
        if tag == TAG_MONITOR_THRESHOLD:
            return (*prefix, "monitor", "threshold")
        if tag == TAG_MONITOR_QUERY:
            return (*prefix, "monitor", "query", index)
        if tag == TAG_BLT:
            return (*prefix, "blt", epoch, index)
        return prefix

    def stream(self, *coordinates):
        if coordinates and coordinates[0] == _MARKERS[1]:  # a Gaussian draw at a lane
            lane = bytes.fromhex(coordinates[1])
            tag, epoch, height, index = coordinates[2:6]
            self.calls.append(self._name(self._prefixes[lane], tag, epoch, height, index))
        elif not (coordinates and coordinates[0] == _MARKERS[0]):  # resolving is not a draw
            self.calls.append(coordinates)
        return self.inner.stream(*coordinates)

    def fingerprint(self) -> str:
        return self.inner.fingerprint()
