"""What a continual counter returns at each time step."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CounterEstimate"]


@dataclass(frozen=True)
class CounterEstimate:
    """A private estimate of a prefix count.

    Attributes:
        step: the counter's time index (0-based) this estimate is for.
        value: the noisy prefix count (a real number after variance-optimal combining).
        std: the analytic standard deviation of ``value`` around the true prefix count.
    """

    step: int
    value: float
    std: float
