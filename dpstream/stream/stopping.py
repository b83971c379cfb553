"""A clean stop: signals ask the inputs to end instead of interrupting the engine.

Bytewax checks Python signals from inside its Rust run loop and turns a ``KeyboardInterrupt``
into a panic (``src/run.rs:133`` in 0.21.1), which prints a Rust panic message and backtrace
at every Ctrl-C or SIGTERM, and stops the workers wherever they are. dpstream instead installs
handlers that only *request* a stop: the Kafka input partitions then end their input, the
stateful steps see the end without closing any time step (:func:`stop_requested` tells them
it is not the end of a bounded input), Bytewax writes its last snapshot and returns normally.
A second signal exits at once (the recovery store then replays the open epoch on restart,
with the same noise).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType

__all__ = ["install_stop_handlers", "request_stop", "reset", "stop_requested", "stop_signal"]

log = logging.getLogger("dpstream")

_STOP = threading.Event()
_INSTALLED = False
_SIGNAL: int | None = None


def stop_requested() -> bool:
    """Whether a stop was requested (a signal, or :func:`request_stop`)."""
    return _STOP.is_set()


def stop_signal() -> int | None:
    """The signal that asked for the stop (SIGINT, SIGTERM), or None."""
    return _SIGNAL


def request_stop(reason: str = "requested") -> None:
    """Ask the flow to stop cleanly: its inputs end at their next batch."""
    if not _STOP.is_set():
        log.info("stopping (%s): inputs end now; state is snapshotted before exit", reason)
    _STOP.set()


def reset() -> None:
    """Forget an earlier stop request (tests that run several flows in one process)."""
    global _SIGNAL
    _SIGNAL = None
    _STOP.clear()


def wait(timeout: float) -> bool:
    """Sleep up to ``timeout`` seconds; return True at once if a stop was requested."""
    return _STOP.wait(timeout)


def _handle(signum: int, _frame: FrameType | None) -> None:
    global _SIGNAL
    name = signal.Signals(signum).name
    if _STOP.is_set():
        log.warning("%s again: exiting now (a restart replays the open epoch)", name)
        logging.shutdown()
        os._exit(130)
    if _SIGNAL is None:
        _SIGNAL = signum
    request_stop(name)


def install_stop_handlers() -> None:
    """Make SIGINT and SIGTERM request a clean stop (main thread only; idempotent)."""
    global _INSTALLED
    if _INSTALLED or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _handle)
    signal.signal(signal.SIGTERM, _handle)
    _INSTALLED = True
