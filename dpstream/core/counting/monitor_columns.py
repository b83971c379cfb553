"""The threshold monitors of many keys as columns: one bulk test per step.

:class:`MonitorColumns` is the columnar equivalent of one
:class:`~dpstream.core.counting.threshold_monitor.ThresholdMonitor` per watched key of a key
table (AboveThreshold, Dwork & Roth 2014, Algorithm 1, with discrete Laplace noise; see that
module for the privacy argument, which nothing here changes). With the same noise key and lanes
it decides exactly what those monitors decide:

* line 1, the threshold noise ``rho ~ DLap(2 / epsilon)``, is drawn once per monitor when it
  starts (:meth:`MonitorColumns.start`), at each lane's ``(TAG_MONITOR_THRESHOLD, 0, 0, 0)``;
* lines 2-3 test every watched key at the same index ``t`` of its monitor (the global step in
  the declared universe, the step's index in its window in the open one), so the query noise
  ``nu_t ~ DLap(4 / epsilon)`` of all of them is one bulk draw at ``(TAG_MONITOR_QUERY, 0, 0,
  t)`` (:func:`dpstream.core.noise.bulk.laplace`, the same values as the monitor's
  ``laplace_one``), and a key is above when ``c_t + nu_t >= threshold + rho``.

The noise is exact and replay-safe (the lanes derive from the noise key and the key's
coordinates). **State:** none is stored: the rows are the table's flags, and the lanes and
``rho`` are recomputed on restore (:meth:`MonitorColumns.restart`).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from dpstream.core.counting.threshold_monitor import ThresholdMonitorSpec
from dpstream.core.noise import bulk as bulk_noise
from dpstream.core.noise.coordinates import TAG_MONITOR_QUERY, TAG_MONITOR_THRESHOLD
from dpstream.core.noise.keys import NoiseKey

__all__ = ["MonitorColumns"]

IntArray = npt.NDArray[np.int64]
WordArray = npt.NDArray[np.uint64]
BoolArray = npt.NDArray[np.bool_]


class MonitorColumns:
    """The live monitors of a key table: the watched rows (ascending), their lanes and rho."""

    __slots__ = ("spec", "rows", "lanes", "rho")

    def __init__(self, spec: ThresholdMonitorSpec) -> None:
        self.spec = spec
        self.rows: IntArray = np.zeros(0, dtype=np.int64)
        self.lanes: WordArray = np.zeros((0, 2), dtype=np.uint64)
        self.rho: IntArray = np.zeros(0, dtype=np.int64)

    def _threshold_noise(self, noise: NoiseKey, lanes: WordArray) -> IntArray:
        """Line 1 of AboveThreshold for the monitors of ``lanes``."""
        return bulk_noise.laplace(noise, lanes, self.spec.threshold_scale,
                                  TAG_MONITOR_THRESHOLD, 0, 0, 0)

    def start(self, noise: NoiseKey, rows: IntArray, lanes: WordArray) -> None:
        """Start the monitors of ``rows`` (after every watched row) with the lanes ``lanes``."""
        rho = self._threshold_noise(noise, lanes)
        self.rows = np.concatenate([self.rows, rows])
        self.lanes = np.concatenate([self.lanes, lanes])
        self.rho = np.concatenate([self.rho, rho])

    def restart(self, noise: NoiseKey, rows: IntArray, lanes: WordArray) -> None:
        """Resume the monitors of ``rows`` (every watched row, ascending) from a snapshot."""
        self.rows = rows
        self.lanes, self.rho = lanes, self._threshold_noise(noise, lanes)

    def keep(self, mask: BoolArray) -> None:
        """Keep the monitors where ``mask`` is True (the rows' flags are the table's)."""
        self.rows, self.lanes, self.rho = self.rows[mask], self.lanes[mask], self.rho[mask]

    def above(self, noise: NoiseKey, count: IntArray, t: int) -> BoolArray:
        """Lines 2-3 at index ``t``: which monitors see ``count + nu_t >= threshold + rho``."""
        nu = bulk_noise.laplace(noise, self.lanes, self.spec.query_scale,
                                TAG_MONITOR_QUERY, 0, 0, t)
        above: BoolArray = count + nu >= self.spec.threshold + self.rho
        return above
