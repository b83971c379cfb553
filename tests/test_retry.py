"""The one retry helper (dpstream.io.retry): attempts, deadlines, delays, logging, a clean stop.

Fast and without a broker: the operations are plain functions that fail a given number of times.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

import pytest

from dpstream.errors import DpstreamError
from dpstream.io import retry
from dpstream.stream import stopping


@pytest.fixture(autouse=True)
def _no_stop() -> Iterator[None]:
    stopping.reset()
    yield
    stopping.reset()


def failing(times: int, error: BaseException | None = None
            ) -> tuple[Callable[[int], str], list[int]]:
    """An operation that fails ``times`` times (NotYet, or ``error``), then returns "done"."""
    calls: list[int] = []

    def operation(attempt: int) -> str:
        calls.append(attempt)
        if len(calls) <= times:
            if error is not None:
                raise error
            raise retry.NotYet(f"not yet #{len(calls)}")
        return "done"
    return operation, calls


def test_returns_after_failures_and_logs_each_one(caplog: pytest.LogCaptureFixture) -> None:
    operation, calls = failing(3)
    with caplog.at_level(logging.WARNING, logger="dpstream"):
        assert retry.retry(operation, what="the thing", delay=retry.fixed(0.0)) == "done"
    assert calls == [1, 2, 3, 4]
    assert [r.getMessage() for r in caplog.records] == [
        f"waiting for the thing (attempt {n}: not yet #{n})" for n in (1, 2, 3)]


def test_gives_up_after_the_attempts_naming_them_and_the_last_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    operation, calls = failing(10)
    with caplog.at_level(logging.WARNING, logger="dpstream"), \
            pytest.raises(retry.RetryError) as raised:
        retry.retry(operation, what="the thing", attempts=3, delay=retry.fixed(0.0))
    assert calls == [1, 2, 3]
    assert str(raised.value) == ("gave up waiting for the thing after 3 attempt(s); "
                                 "last: not yet #3")
    assert isinstance(raised.value, DpstreamError)
    assert len(caplog.records) == 2  # the last failure is reported by the error, not logged


def test_retry_on_names_the_retried_exceptions_others_propagate() -> None:
    operation, calls = failing(2, ConnectionError("refused"))
    lines: list[str] = []
    got = retry.retry(operation, what="x", retry_on=(ConnectionError,),
                      reason=lambda exc: f"r:{exc}", delay=retry.fixed(0.0),
                      logger=lambda _level, message, *args: lines.append(message % args))
    assert got == "done" and calls == [1, 2, 3]
    assert lines == ["waiting for x (attempt 1: r:refused)", "waiting for x (attempt 2: r:refused)"]

    operation, calls = failing(2, KeyError("bad"))
    with pytest.raises(KeyError):
        retry.retry(operation, what="x", retry_on=(ConnectionError,), delay=retry.fixed(0.0))
    assert calls == [1]  # not retried


def test_deadline_bounds_the_attempts_and_give_up_can_return_a_value() -> None:
    operation, calls = failing(1000)
    seen: list[retry.GaveUp] = []

    def give_up(gave_up: retry.GaveUp) -> str:
        seen.append(gave_up)
        return "fallback"
    started = time.monotonic()
    got = retry.retry(operation, what="x", deadline=started + 0.2, delay=retry.fixed(0.05),
                      level=logging.DEBUG, give_up=give_up)
    elapsed = time.monotonic() - started
    assert got == "fallback"
    assert 0.2 <= elapsed < 2.0
    assert 4 <= len(calls) <= 6  # one attempt per 50 ms for 200 ms, then one past the deadline
    assert seen == [retry.GaveUp("x", len(calls), f"not yet #{len(calls)}", stopped=False)]


def test_the_caller_s_own_error_at_the_end() -> None:
    operation, _calls = failing(5)

    def give_up(gave_up: retry.GaveUp) -> NoReturn:
        raise DpstreamError(f"mine after {gave_up.attempts}: {gave_up.reason}")
    with pytest.raises(DpstreamError, match=r"^mine after 2: not yet #2$"):
        retry.retry(operation, what="x", attempts=2, delay=retry.fixed(0.0), give_up=give_up)


def test_delay_policies() -> None:
    assert [retry.fixed(0.5)(n) for n in (1, 2, 9)] == [0.5, 0.5, 0.5]
    assert [retry.linear(2.0, 10.0)(n) for n in (1, 2, 3, 4, 5, 6)] == [2, 4, 6, 8, 10, 10]
    assert [retry.exponential(0.01, 0.2)(n) for n in range(1, 8)] == pytest.approx(
        [0.01, 0.02, 0.04, 0.08, 0.16, 0.2, 0.2])


def test_the_delays_are_waited() -> None:
    operation, _calls = failing(3)
    started = time.monotonic()
    retry.retry(operation, what="x", delay=retry.linear(0.05, 1.0), logger=lambda *_a: None)
    assert time.monotonic() - started >= 0.05 + 0.10 + 0.15


def test_a_clean_stop_cuts_an_interruptible_wait_short() -> None:
    operation, calls = failing(1000)
    timer = threading.Timer(0.2, stopping.request_stop, args=("test",))
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(retry.RetryError, match=r"^stopped while waiting for x \(attempt 1: "):
            retry.retry(operation, what="x", delay=retry.fixed(30.0), interruptible=True,
                        logger=lambda *_a: None)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 5.0  # not the 30 s delay
    assert calls == [1]


def test_a_stop_does_not_interrupt_a_wait_that_is_not_interruptible() -> None:
    stopping.request_stop("test")
    operation, calls = failing(2)
    assert retry.retry(operation, what="x", delay=retry.fixed(0.0),
                       logger=lambda *_a: None) == "done"
    assert calls == [1, 2, 3]


def test_pause_logs_the_same_line_for_loops_spread_over_calls() -> None:
    lines: list[str] = []

    def logger(level: int, message: str, *args: object) -> None:
        lines.append(f"{logging.getLevelName(level)} {message % args}")
    started = time.monotonic()
    assert retry.pause("topic t", 4, "broken pipe", 0.05, logger=logger) is False
    assert time.monotonic() - started >= 0.05
    assert lines == ["WARNING waiting for topic t (attempt 4: broken pipe)"]
    stopping.request_stop("test")
    assert retry.pause("t", 1, "r", 30.0, logger=logger, interruptible=True) is True


def test_attempts_must_be_positive() -> None:
    with pytest.raises(ValueError, match="attempts"):
        retry.retry(lambda _a: 1, what="x", attempts=0)
