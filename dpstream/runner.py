"""Running a flow as a process: logging, metrics port, heartbeat, progress, a clean stop.

Both ways of running a flow, of any kind, come through here: ``dpstream run`` (:func:`run`)
and ``python -m bytewax.run dpstream.flows.counters:flow`` (or ``dpstream.flows.pmwg:flow``,
which import :func:`flow_from_environment`'s result). Either way the process

* configures dpstream's logging (``DPSTREAM_LOG_LEVEL``) unless the host application did;
* turns SIGINT/SIGTERM into a clean stop (:mod:`dpstream.stream.stopping`): no Rust panic
  trace, the last snapshot written, the process exits 0;
* serves metrics on ``metrics.port + process id`` (``-i`` of ``bytewax.run``), so several
  processes on one host do not collide, and says clearly when the port is taken;
* waits for the Kafka cluster at start-up (bounded, logged), then writes heartbeat ticks to the
  input partitions (``flow.heartbeat``) so idle partitions do not stall the steps;
* logs a progress line every ``DPSTREAM_PROGRESS_SECONDS`` (default 30) and a one-line summary
  when a bounded input ends.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import sys
import threading
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from bytewax.dataflow import Dataflow
from prometheus_client import CollectorRegistry

from dpstream.errors import ConfigError, DpstreamError
from dpstream.stream import stopping

__all__ = ["flow_from_environment", "run", "setup_logging"]

log = logging.getLogger("dpstream")

RECOVERY_DIR_ENV = "DPSTREAM_RECOVERY_DIR"
EPHEMERAL_ENV = "DPSTREAM_EPHEMERAL"
INSTANCE_ID_ENV = "DPSTREAM_INSTANCE_ID"
LOG_LEVEL_ENV = "DPSTREAM_LOG_LEVEL"
PROGRESS_ENV = "DPSTREAM_PROGRESS_SECONDS"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str | int | None = None) -> None:
    """Configure logging for dpstream unless the application already configured it.

    ``level`` (or ``$DPSTREAM_LOG_LEVEL``, default ``info``) applies to the ``dpstream``
    loggers; kafka-python's own chatter is kept at WARNING.
    """
    chosen = level if level is not None else os.environ.get(LOG_LEVEL_ENV, "info")
    numeric = chosen if isinstance(chosen, int) else logging.getLevelName(str(chosen).upper())
    if not isinstance(numeric, int):
        raise ConfigError(f"log level must be debug, info, warning or error, got {chosen!r}")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    logging.getLogger("dpstream").setLevel(numeric)
    if numeric > logging.DEBUG:
        logging.getLogger("kafka").setLevel(logging.WARNING)


def process_id(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Return this process's id in a Bytewax cluster (``-i`` or ``$BYTEWAX_PROCESS_ID``)."""
    argv = sys.argv if argv is None else argv
    env = os.environ if environ is None else environ
    for i, arg in enumerate(argv):
        value = None
        if arg in ("-i", "--process-id") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--process-id="):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                return int(value)
            except ValueError:
                break
    try:
        return int(env.get("BYTEWAX_PROCESS_ID", "0"))
    except ValueError:
        return 0


def serve_metrics(metrics: Any, port: int) -> int:
    """Serve ``metrics`` on ``port`` + this process's id; a clear error if it is taken."""
    chosen = port + process_id()
    try:
        metrics.serve(chosen)
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):
            raise ConfigError(
                f"metrics port {chosen} is "
                f"{'in use' if exc.errno == errno.EADDRINUSE else 'not allowed'}"
                f" (metrics.port {port} + process id {chosen - port}): another process, perhaps "
                "another dpstream flow, holds it. Set metrics.port (or DPSTREAM_METRICS_PORT) to "
                "a free port, or 0 to serve no metrics") from None
        raise
    return chosen


def _totals(registry: CollectorRegistry) -> dict[str, float]:
    """Sum every sample of the registry by name (labels summed over)."""
    sums: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.value == sample.value:  # not NaN
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def progress_line(registry: CollectorRegistry) -> str:
    """What the flow has done so far, in one line (operator data: exact counts included)."""
    t = _totals(registry)
    parts = []
    if "dpstream_closed_step" in t:
        parts.append(f"closed through step {t['dpstream_closed_step']:.0f}")
    if "dpstream_step_lag_seconds" in t:
        parts.append(f"{t['dpstream_step_lag_seconds']:.0f} s behind the clock")
    if t.get("dpstream_backlog_steps"):
        parts.append(f"closing {t['dpstream_backlog_steps']:.0f} steps of backlog")
    if t.get("dpstream_steps_pending"):
        parts.append(f"{t['dpstream_steps_pending']:.0f} steps waiting for input partitions")
    if "dpstream_events_total" in t:
        parts.append(f"{t['dpstream_events_total']:.0f} events")
    if "dpstream_dead_letters_total" in t:
        parts.append(f"{t['dpstream_dead_letters_total']:.0f} dead letters")
    if "dpstream_answers_total" in t:  # a pmwg flow
        parts.append(f"{t['dpstream_answers_total']:.0f} answers")
    else:
        parts.append(f"{t.get('dpstream_releases_total', 0):.0f} releases")
        parts.append(f"{t.get('dpstream_alerts_total', 0):.0f} alerts")
    if t.get("dpstream_refused_releases_total"):
        parts.append(f"{t['dpstream_refused_releases_total']:.0f} refused charges")
    if t.get("dpstream_output_pending_records"):
        parts.append(f"{t['dpstream_output_pending_records']:.0f} output records unacknowledged")
    return ", ".join(parts)


BACKLOG_WARN_SECONDS = 60.0
"""A backlog estimated to take longer than this is logged as a warning."""


def _log_backlog(config: Any) -> None:
    """Log the backlog a new instance starts with (``flow.origin`` to now), and its time."""
    from dpstream.backlog import estimate

    try:
        found = estimate(config)
    except Exception as exc:  # noqa: BLE001 - an estimate must never stop a start
        log.debug("no backlog estimate: %s", type(exc).__name__)
        return
    if found.steps <= 1:
        return
    seconds = found.seconds
    level = logging.WARNING if seconds is not None and seconds > BACKLOG_WARN_SECONDS \
        else logging.INFO
    log.log(level, "%s (dpstream_backlog_steps follows it)", found.describe())


def _report_progress(registry: CollectorRegistry, interval: float) -> None:
    while not stopping.wait(interval):
        log.info("progress: %s", progress_line(registry))


def one_blas_thread() -> None:
    """Let numpy's BLAS use one thread per Bytewax worker thread.

    The ERM flow's solvers run inside the workers; with a BLAS thread pool per call on top
    of the workers, the threads fight for the cores and L-BFGS slows down 100-fold on a busy
    machine. Scale out with workers (``-w``) and processes instead. ``threadpoolctl`` (a
    scikit-learn dependency) limits the pools already loaded; ``OPENBLAS_NUM_THREADS`` set
    by the operator still wins for pools loaded later.
    """
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest
TRIM_THRESHOLD_BYTES = 256 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Let glibc's malloc reuse freed large buffers instead of returning them to the kernel.

    A closed step's release records are assembled in buffers of megabytes (a shard's column
    at a million keys is ~12 MB). By default glibc serves such a buffer with ``mmap`` and
    gives it back with ``munmap``, so every step faults every page in again: measured at a
    million keys, about 100 ns a release. With the mmap threshold at 32 MB and the trim
    threshold at 256 MB, freed buffers stay in the heap and are reused; the cost is up to
    256 MB of freed memory that the process keeps rather than returning. Nothing is changed
    off glibc, or when the operator set ``MALLOC_MMAP_THRESHOLD_`` or
    ``MALLOC_TRIM_THRESHOLD_`` (theirs win), or ``DPSTREAM_MALLOC_TUNING=0``.

    Returns:
        Whether the thresholds were set.
    """
    env = os.environ if environ is None else environ
    if env.get("DPSTREAM_MALLOC_TUNING", "1") in ("0", "false") or any(
            name in env for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def flow_module(kind: str) -> Dataflow:
    """The flow of a ``dpstream.flows`` module: :func:`flow_from_environment` for ``kind``.

    A configuration or start-up error prints one line (``dpstream: error: ...``) and exits 2,
    as ``python -m bytewax.run`` would otherwise print a long traceback.
    """
    try:
        return flow_from_environment(kind=kind)
    except DpstreamError as exc:
        print(f"dpstream: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def flow_from_environment(config_path: str | None = None, recovery_dir: str | None = None,
                          ephemeral: bool | None = None, kind: str | None = None) -> Dataflow:
    """Build the flow of ``$DPSTREAM_CONFIG`` (of its ``flow.kind``) with the environment's key.

    Besides the dataflow this starts the process's side parts (metrics endpoint, heartbeat,
    progress log, stop handlers). The flow instance is bound to the recovery directory
    (``recovery_dir`` or ``$DPSTREAM_RECOVERY_DIR``, which must be the directory given to
    Bytewax) before anything runs; without one the run must be acknowledged as ephemeral
    (``ephemeral`` or ``DPSTREAM_EPHEMERAL=1``). In a cluster every process binds the same
    instance: process 0's, found in a shared recovery directory (the others wait for it up to
    ``kafka.startup_timeout``), or ``$DPSTREAM_INSTANCE_ID`` given to every process (a
    recovery directory per process; see :mod:`dpstream.instance`). ``kind``, if given, is the
    flow kind the configuration must have (each ``dpstream.flows`` module runs one kind).
    """
    from dpstream.config import load_config
    from dpstream.core.noise import NoiseKey
    from dpstream.instance import bind_instance
    from dpstream.io.kafka import Heartbeat, is_secret
    from dpstream.kinds import flow_kind
    from dpstream.metrics import FlowMetrics
    from dpstream.platform import build_flow, input_partitions, kafka_clients, output_topics

    setup_logging()
    stopping.install_stop_handlers()
    one_blas_thread()
    keep_freed_memory()
    config = load_config(config_path)
    if kind is not None and config.kind != kind:
        raise ConfigError(f"{config.source} configures a {config.kind!r} flow (flow.kind) but "
                          f"this is the {kind!r} flow module: use dpstream.flows.{config.kind}"
                          ":flow, or dpstream run --config")
    noise = NoiseKey.from_environment()
    recovery_dir = recovery_dir or os.environ.get(RECOVERY_DIR_ENV) or None
    if ephemeral is None:
        ephemeral = os.environ.get(EPHEMERAL_ENV, "") not in ("", "0", "false")
    secrets_in_file = sorted(k for k in config.kafka.add_config if is_secret(k))
    if secrets_in_file:
        log.warning("kafka.add_config holds %s: credentials belong in the environment "
                    "(DPSTREAM_KAFKA_SASL_PASSWORD=... sets sasl.password)",
                    ", ".join(secrets_in_file))
    instance = bind_instance(config, flow_kind(config.kind).binding(config), noise, recovery_dir,
                             ephemeral=ephemeral,
                             instance_id=os.environ.get(INSTANCE_ID_ENV) or None,
                             process=process_id(),
                             wait_seconds=config.kafka.startup_timeout_seconds)
    metrics = FlowMetrics(config.name, exact_counts=config.metrics_exact_counts)
    if config.metrics_port:
        port = serve_metrics(metrics, config.metrics_port)
        log.info("metrics on :%d/metrics", port)
    log.info("%s\nnoise key fingerprint %s", config.describe(), noise.fingerprint())
    if instance.durable:
        log.info("flow instance %s (%s, kept in %s)", instance.id,
                 "resumed" if instance.resumed else "new", recovery_dir)
    else:
        log.warning("flow instance %s is ephemeral (no recovery store): a restart publishes "
                    "everything again under a new instance", instance.id)
    log.info("reprocessing an input topic is a new flow instance: its privacy spend adds to "
             "every earlier instance's over the same events, and its ledgers cannot see theirs")
    if not instance.resumed:  # a resumed instance's backlog starts where it stopped
        _log_backlog(config)
    clients = kafka_clients(config, metrics)
    partitions = input_partitions(config, clients)
    log.info("reading %s from %s; %s (delivery is at least once: consumers de-duplicate, see "
             "README)", ", ".join(f"{t} ({n} partitions)" for t, n in partitions.items()),
             ",".join(config.kafka.brokers),
             ", ".join(f"{role} to {topic}" for role, topic in output_topics(config).items()))
    flow = build_flow(config, noise, instance=instance.id, partitions=partitions,
                      metrics=metrics)
    if config.kafka.tail and config.heartbeat_seconds > 0:
        for topic, count in partitions.items():
            Heartbeat(clients, topic, count, config.heartbeat_seconds).start()
        log.info("heartbeat: a tick to each input partition every %g s (flow.heartbeat)",
                 config.heartbeat_seconds)
    interval = float(os.environ.get(PROGRESS_ENV, "30"))
    if interval > 0:
        threading.Thread(target=_report_progress, args=(metrics.registry, interval),
                         name="dpstream-progress", daemon=True).start()
    if not config.kafka.tail:
        atexit.register(lambda: None if stopping.stop_requested() else log.info(
            "input ended: %s", progress_line(metrics.registry)))
    return flow


def run(config_path: str | None, *, workers: int = 1, recovery_dir: str | None = None,
        recovery_partitions: int = 1, ephemeral: bool = False,
        snapshot_interval: float = 5.0) -> int:
    """Run the configured flow in this process until its input ends or a stop is requested."""
    os.environ.setdefault("RUST_BACKTRACE", "0")
    from bytewax.recovery import RecoveryConfig, init_db_dir
    from bytewax.run import cli_main

    flow = flow_from_environment(config_path, recovery_dir, ephemeral)
    recovery = None
    if recovery_dir:
        directory = Path(recovery_dir)
        if not any(directory.glob("*.sqlite3")):
            directory.mkdir(parents=True, exist_ok=True)
            init_db_dir(directory, recovery_partitions)
            log.info("initialised %d recovery partitions in %s", recovery_partitions, directory)
        recovery = RecoveryConfig(directory)
    try:
        cli_main(flow, workers_per_process=workers,
                 epoch_interval=timedelta(seconds=snapshot_interval),
                 recovery_config=recovery)
    except DpstreamError:
        raise
    except Exception as exc:
        cause = _dpstream_cause(exc)
        if cause is not None:
            raise cause from None
        raise
    if stopping.stop_requested():
        log.info("stopped%s", "; a restart resumes from the recovery store" if recovery else "")
    return 0


def _dpstream_cause(exc: BaseException | None) -> DpstreamError | None:
    """The DpstreamError a Bytewax runtime error wraps, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, DpstreamError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
