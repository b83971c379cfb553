"""The threshold monitor: say once, privately, when a running count crosses a threshold.

**Stated as OpenDP states a measurement**

* input domain: streams of integer increments ``>= 0`` whose prefix counts ``c_t`` are
  tested at steps ``0 .. horizon - 1`` (unbounded without a horizon); input metric: event
  level, ``d_in = sum_t |x_t - x'_t|`` (one event moves every ``c_t`` by at most one).
* function: AboveThreshold: the bits ``[c_t + nu_t >= threshold + rho]`` up to and including
  the first ``True``, then ``False`` without reading the data; ``rho ~ DLap(2 / epsilon)`` once,
  ``nu_t ~ DLap(4 / epsilon)`` fresh per step, exact, on the integers.
* output measure: pure epsilon-DP; privacy map: ``d_in ↦ epsilon d_in`` (Dwork & Roth 2014,
  Theorem 3.23, with integer shifts; paper 002, Observation 1.8). The ledger charges
  ``ThresholdMonitorSpec.charge = PrivacyCharge(epsilon=epsilon)`` once per run.

This solves the threshold monitor problem (Problem 1.6 of paper 002) with
the AboveThreshold algorithm (Dwork, Naor, Reingold, Rothblum, Vadhan 2009;
Dwork & Roth 2014, Algorithm 1), as paper 002's Observation 1.8 suggests: at
every step the prefix count ``c_t`` is one query of sensitivity 1, tested
against a noisy threshold, and the monitor halts at the first "above".

Line by line (Dwork & Roth, Algorithm 1, with discrete Laplace noise):

1. ``rho ~ DLap(2 / epsilon)``, drawn **once** for the monitor's lifetime.
2. For each step ``t``: ``nu_t ~ DLap(4 / epsilon)``, drawn **fresh**.
3. If ``c_t + nu_t >= threshold + rho``: output "above" (``True``) and halt.
   Otherwise output "below" (``False``).

The whole run is epsilon-DP with respect to adding or removing one event
(the proof of Dwork & Roth, Theorem 3.23, goes through unchanged for
integer-valued queries and discrete Laplace noise: it only shifts ``rho`` by
1 and one ``nu_t`` by 2). Nothing but the bit is released: the noise that
decided "above" is never used for an answer, and the threshold noise is
never reused after a halt (a halted monitor stays halted; a new monitor has
new coordinates). These are the broken variants listed by Lyu, Su, Li 2017.

Noise is exact (Canonne, Kamath, Steinke 2020) and replay-safe: ``rho`` comes
from the monitor's lane ``noise_key.lane(*coordinates)`` at
``(TAG_MONITOR_THRESHOLD, 0, 0, 0)`` and ``nu_t`` from ``(TAG_MONITOR_QUERY, 0, 0, t)``
(:mod:`dpstream.core.noise.bulk`), so a replay after a crash makes the same decisions.

**After halting** :meth:`ThresholdMonitor.step` keeps accepting steps and
returns ``False`` without looking at the data or drawing noise; check
:attr:`ThresholdMonitor.fired` to tell "halted" from "below".

**Horizon.** With ``horizon`` set, the monitor tests only the steps
``0 .. horizon - 1`` and then *expires*: it never fires afterwards. A horizon
makes :func:`~dpstream.core.counting.admission_bounds.admission_delta` finite, the
probability that a monitor started lazily at a key's first event fires although the key has
only that one event.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final

from dpstream.core._checks import increment as checked_increment
from dpstream.core._checks import integer_at_least, is_integer, positive_finite
from dpstream.core.accounting.ledger import PrivacyCharge, exact
from dpstream.core.noise.bulk import laplace_one
from dpstream.core.noise.coordinates import (
    TAG_MONITOR_QUERY,
    TAG_MONITOR_THRESHOLD,
    check_coordinates,
)
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError

__all__ = ["ThresholdMonitor", "ThresholdMonitorSpec"]

_STATE_VERSION: Final = 1


def _check_epsilon(epsilon: object) -> float:
    return positive_finite("epsilon", epsilon)


def _check_horizon(horizon: object) -> int:
    return integer_at_least("horizon", horizon, 1)


@dataclass(frozen=True)
class ThresholdMonitorSpec:
    """Parameters of a threshold monitor.

    Attributes:
        epsilon: the pure-DP epsilon of the whole run.
        threshold: the count ``tau`` to detect (an integer >= 1).
        horizon: if set, the number of steps tested before the monitor expires.

    """

    epsilon: float
    threshold: int
    horizon: int | None = None

    def __post_init__(self) -> None:
        _check_epsilon(self.epsilon)
        if not is_integer(self.threshold) or self.threshold < 1:
            raise InvalidParameterError(
                f"threshold must be an integer >= 1, got {self.threshold!r}"
            )
        if self.horizon is not None:
            _check_horizon(self.horizon)

    @property
    def charge(self) -> PrivacyCharge:
        """The privacy cost of the whole run (one query's worth, Dwork & Roth Thm 3.23)."""
        return PrivacyCharge(epsilon=float(self.epsilon), label="threshold monitor")

    @functools.cached_property
    def threshold_scale(self) -> Fraction:
        """The exact scale ``2 / epsilon`` of the threshold noise ``rho``."""
        return Fraction(2) / exact(self.epsilon)

    @functools.cached_property
    def query_scale(self) -> Fraction:
        """The exact scale ``4 / epsilon`` of each query noise ``nu_t``."""
        return Fraction(4) / exact(self.epsilon)


class ThresholdMonitor:
    """A running AboveThreshold test of a prefix count.

    Args:
        spec: the monitor's parameters.
        noise_key: the secret key all noise is derived from.
        coordinates: the release's coordinates, e.g. ``(flow, mechanism, key)``.
        state: a dict from :meth:`to_state` to resume from, or ``None`` to start.
        first_step: the step (within the horizon) at which a lazily started monitor begins;
            the steps before it are not tested. Query noise is drawn at the step's index
            within the horizon, so a monitor started late makes exactly the decisions of one
            started at step 0 unless that one would have fired on a count of 0 before
            ``first_step`` (see
            :func:`~dpstream.core.counting.admission_bounds.lazy_start_delta`).

    Raises:
        InvalidParameterError: bad coordinates, or a malformed or mismatched state.

    """

    __slots__ = ("spec", "_key", "_coordinates", "_lane", "_steps", "_count", "_fired_at",
                 "_rho")

    def __init__(
        self,
        spec: ThresholdMonitorSpec,
        noise_key: NoiseKey,
        coordinates: tuple[str | int, ...],
        state: dict[str, Any] | None = None,
        first_step: int = 0,
    ) -> None:
        self.spec = spec
        self._key = noise_key
        self._coordinates = check_coordinates(coordinates)
        self._lane = noise_key.lane(*self._coordinates)
        self._steps = integer_at_least("first_step", first_step, 0)
        self._count = 0
        self._fired_at: int | None = None
        self._rho: int | None = None  # derived from the key when first needed; never stored
        if state is not None:
            self._load(state)

    def _load(self, state: dict[str, Any]) -> None:
        try:
            if state["version"] != _STATE_VERSION:
                raise InvalidParameterError(
                    f"unknown threshold monitor state version {state['version']!r}"
                )
            same = (
                Fraction(state["epsilon"]) == Fraction(self.spec.epsilon)
                and state["threshold"] == self.spec.threshold
                and state["horizon"] == self.spec.horizon
            )
            if not same:
                raise InvalidParameterError(
                    "threshold monitor state was made with another spec "
                    f"(epsilon={state['epsilon']!r}, threshold={state['threshold']!r}, "
                    f"horizon={state['horizon']!r})"
                )
            steps, count, fired_at = int(state["steps"]), int(state["count"]), state["fired_at"]
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidParameterError):
                raise
            raise InvalidParameterError(f"malformed threshold monitor state: {exc!r}") from None
        if (
            steps < 0
            or count < 0
            or not (fired_at is None or (is_integer(fired_at) and 0 <= fired_at < steps))
        ):
            raise InvalidParameterError("malformed threshold monitor state: inconsistent fields")
        self._steps, self._count = steps, count
        self._fired_at = None if fired_at is None else int(fired_at)

    def to_state(self) -> dict[str, Any]:
        """Return the state as plain JSON- and pickle-safe data (no key, no noise).

        It holds the true prefix count: keep it secret.
        """
        return {
            "version": _STATE_VERSION,
            "epsilon": float(self.spec.epsilon),
            "threshold": int(self.spec.threshold),
            "horizon": None if self.spec.horizon is None else int(self.spec.horizon),
            "steps": self._steps,
            "count": self._count,
            "fired_at": self._fired_at,
        }

    @property
    def fired(self) -> bool:
        """Whether the monitor has answered "above" (and halted)."""
        return self._fired_at is not None

    @property
    def fired_at(self) -> int | None:
        """The 0-based step at which it fired, or ``None``."""
        return self._fired_at

    @property
    def count_steps(self) -> int:
        """The number of steps fed so far (including any after halting)."""
        return self._steps

    @property
    def expired(self) -> bool:
        """Whether the horizon has passed without firing (it never fires now)."""
        h = self.spec.horizon
        return self._fired_at is None and h is not None and self._steps >= h

    @property
    def halted(self) -> bool:
        """Whether the monitor no longer tests (fired or expired)."""
        return self.fired or self.expired

    def _threshold_noise(self) -> int:
        if self._rho is None:  # Algorithm 1, line 1: once per monitor
            self._rho = laplace_one(self._key, self._lane, self.spec.threshold_scale,
                                    TAG_MONITOR_THRESHOLD, 0, 0, 0)
        return self._rho

    def step(self, increment: int) -> bool:
        """Feed one step's events; return ``True`` exactly on the step the monitor fires.

        Args:
            increment: the number of events in this step (an integer >= 0).

        Returns:
            ``True`` if the noisy prefix count crossed the noisy threshold at
            this step; ``False`` otherwise, and always once halted or expired.

        Raises:
            InvalidParameterError: ``increment`` is not a non-negative integer.

        """
        increment = checked_increment(increment)
        t = self._steps
        self._steps = t + 1
        if self._fired_at is not None:
            return False  # halted: the data is not looked at again
        self._count += int(increment)
        horizon = self.spec.horizon
        if horizon is not None and t >= horizon:
            return False  # expired
        rho = self._threshold_noise()
        # Algorithm 1, line 2: fresh query noise at every step
        nu = laplace_one(self._key, self._lane, self.spec.query_scale, TAG_MONITOR_QUERY, 0, 0, t)
        if self._count + nu >= self.spec.threshold + rho:  # line 3
            self._fired_at = t
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"ThresholdMonitor(epsilon={self.spec.epsilon!r}, threshold={self.spec.threshold}, "
            f"horizon={self.spec.horizon}, steps={self._steps}, fired_at={self._fired_at})"
        )
