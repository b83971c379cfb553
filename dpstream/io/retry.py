"""One retry helper for every wait on, and resend to, Kafka.

:func:`retry` runs an operation until it succeeds, with bounded attempts and/or a deadline, a
delay policy between attempts (:func:`fixed`, :func:`linear`, :func:`exponential`), optionally
interruptible by a clean stop (:mod:`dpstream.stream.stopping`). An attempt fails by raising
:class:`NotYet` (a "not yet" result, with its reason) or one of the ``retry_on`` exceptions;
anything else propagates at once. Each failure that is retried is logged in one format,
``waiting for <what> (attempt N: <reason>)``; giving up calls ``give_up`` with a
:class:`GaveUp` naming the attempts and the last reason (by default it raises
:class:`RetryError`, whose message says both). Loops whose attempts are spread over several
calls (a consumer's polls) use :func:`pause`, the same log line and delay, directly.

Why not a library such as tenacity: the callers need a delay that a clean stop cuts short, a
log line that goes through a rate-limited logger (output resends), "not yet" results as well
as exceptions, and a last step that may return a value (a poll gives ``[]``) or raise a
caller's own error naming the last reason. tenacity expresses each of those with a custom
stop/sleep/before_sleep/retry_error_callback object, which would be longer than this module
and add a dependency for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, TypeVar

from dpstream.errors import DpstreamError
from dpstream.stream import stopping

__all__ = ["GaveUp", "NotYet", "RetryError", "exponential", "fixed", "linear", "pause",
           "retry"]

log = logging.getLogger("dpstream")

T = TypeVar("T")
Delay = Callable[[int], float]
"""Seconds to wait after failed attempt ``N`` (1-based) before the next one."""
LogCall = Callable[..., None]
"""Called as ``log(level, message, *args)``, like :meth:`logging.Logger.log`."""


class NotYet(Exception):
    """Raised by an operation: this attempt did not succeed, for ``reason``; try again."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RetryError(DpstreamError):
    """The default end of :func:`retry`: gave up (message names attempts and last reason)."""


@dataclass(frozen=True)
class GaveUp:
    """Why :func:`retry` stopped trying."""

    what: str
    attempts: int
    reason: str
    stopped: bool  # a clean stop was requested (else: out of attempts or time)

    def message(self) -> str:
        """``gave up waiting for <what> after N attempt(s); last: <reason>`` (or stopped)."""
        if self.stopped:
            return f"stopped while waiting for {self.what} (attempt {self.attempts}: {self.reason})"
        return (f"gave up waiting for {self.what} after {self.attempts} attempt(s); "
                f"last: {self.reason}")


def _raise(gave_up: GaveUp) -> NoReturn:
    raise RetryError(gave_up.message())


def fixed(seconds: float) -> Delay:
    """The same delay after every attempt."""
    return lambda _attempt: seconds


def linear(step: float, cap: float) -> Delay:
    """``step * N`` seconds after attempt N, at most ``cap``."""
    return lambda attempt: min(step * attempt, cap)


def exponential(first: float, cap: float, factor: float = 2.0) -> Delay:
    """``first * factor**(N-1)`` seconds after attempt N, at most ``cap``."""
    return lambda attempt: min(first * factor ** (attempt - 1), cap)


def pause(what: str, attempt: int, reason: str, seconds: float, *,
          logger: LogCall | None = None, level: int = logging.WARNING,
          interruptible: bool = False) -> bool:
    """Log ``waiting for <what> (attempt N: <reason>)``, then wait ``seconds``.

    Returns:
        True if a clean stop was requested (only with ``interruptible``, which then cuts the
        wait short), else False.
    """
    (logger or log.log)(level, "waiting for %s (attempt %d: %s)", what, attempt, reason)
    if not interruptible:
        if seconds > 0:
            time.sleep(seconds)
        return False
    return stopping.wait(seconds) or stopping.stop_requested()


def retry(operation: Callable[[int], T], *, what: str,
          retry_on: tuple[type[BaseException], ...] = (),
          reason: Callable[[BaseException], str] = str,
          attempts: int | None = None, deadline: float | None = None,
          delay: Delay | None = None, logger: LogCall | None = None,
          level: int = logging.WARNING, interruptible: bool = False,
          give_up: Callable[[GaveUp], T] = _raise) -> T:
    """Call ``operation(attempt)`` (attempt = 1, 2, ...) until it returns; return its result.

    Args:
        operation: one attempt; fails by raising :class:`NotYet` or one of ``retry_on``.
        what: what is waited for, as in ``waiting for <what>``.
        retry_on: the exceptions that mean "try again" (others propagate).
        reason: the reason logged for one of ``retry_on``.
        attempts: at most this many attempts (None: no bound).
        deadline: no new attempt after this :func:`time.monotonic` time (None: no bound).
        delay: seconds to wait after a failed attempt (not shortened by the deadline;
            default 1 s).
        logger: where the retried failures go, called like :meth:`logging.Logger.log`.
        level: their level.
        interruptible: a clean stop cuts the wait short and gives up (``stopped``).
        give_up: called on giving up; raises, or returns the result. Default: raise
            :class:`RetryError`.
    """
    if attempts is not None and attempts < 1:
        raise ValueError(f"attempts must be >= 1 or None, got {attempts}")
    attempt = 0
    while True:
        attempt += 1
        try:
            return operation(attempt)
        except NotYet as exc:
            why = exc.reason
        except retry_on as exc:
            why = reason(exc)
        if ((attempts is not None and attempt >= attempts)
                or (deadline is not None and time.monotonic() >= deadline)):
            return give_up(GaveUp(what, attempt, why, stopped=False))
        seconds = 1.0 if delay is None else delay(attempt)
        if pause(what, attempt, why, seconds, logger=logger, level=level,
                 interruptible=interruptible):
            return give_up(GaveUp(what, attempt, why, stopped=True))

