"""A NoiseKey stand-in for tests that checks which coordinates a mechanism draws from."""

from dpstream.core.noise import NoiseKey


class RecordingKey:
    """A NoiseKey stand-in that records every coordinate tuple asked for."""

    def __init__(self, seed: int = 0) -> None:
        self.inner = NoiseKey.for_tests(seed)
        self.calls: list[tuple[object, ...]] = []

    def stream(self, *coordinates):
        self.calls.append(coordinates)
        return self.inner.stream(*coordinates)

    def fingerprint(self) -> str:
        return self.inner.fingerprint()
