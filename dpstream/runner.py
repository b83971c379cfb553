"""Running a flow as a process: logging, metrics port, heartbeat, progress, a clean stop.

Both ways of running a flow, of any kind, come through here: ``dpstream run`` (:func:`run`)
and ``python -m bytewax.run dpstream.flows.counters:flow`` (or ``dpstream.flows.pmwg:flow``,
which import :func:`flow_from_environment`'s result). Either way the process

* configures dpstream's logging (``DPSTREAM_LOG_LEVEL``) unless the host application did;
* turns SIGINT/SIGTERM into a clean stop (:mod:`dpstream.stream.stopping`): no Rust panic
  trace, the last snapshot written; ``dpstream run`` then exits 130 after SIGINT (Ctrl-C, as a
  shell expects of an interrupted command) and 0 after SIGTERM (an orderly stop, as asked by
  Kubernetes, systemd or docker stop);
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
import signal
import sys
import threading
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from bytewax.dataflow import Dataflow
from prometheus_client import CollectorRegistry

from dpstream.errors import ConfigError, DpstreamError
from dpstream.messages import TICK
from dpstream.stream import stopping

__all__ = ["flow_from_environment", "run", "setup_logging"]

log = logging.getLogger("dpstream")

RECOVERY_DIR_ENV = "DPSTREAM_RECOVERY_DIR"
EPHEMERAL_ENV = "DPSTREAM_EPHEMERAL"
INSTANCE_ID_ENV = "DPSTREAM_INSTANCE_ID"
LOG_LEVEL_ENV = "DPSTREAM_LOG_LEVEL"
PROGRESS_ENV = "DPSTREAM_PROGRESS_SECONDS"
SKIP_RECORDS_ENV = "DPSTREAM_SKIP_RECORDS"
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


def process_count(argv: list[str] | None = None,
                  environ: Mapping[str, str] | None = None) -> int:
    """How many processes the Bytewax cluster has (``-a``/``$BYTEWAX_ADDRESSES``; else 1)."""
    argv = sys.argv if argv is None else argv
    env = os.environ if environ is None else environ
    addresses = env.get("BYTEWAX_ADDRESSES")
    for i, arg in enumerate(argv):
        if arg in ("-a", "--addresses") and i + 1 < len(argv):
            addresses = argv[i + 1]
        elif arg.startswith("--addresses="):
            addresses = arg.split("=", 1)[1]
    if not addresses:
        return 1
    return max(1, len([a for a in addresses.split(";") if a.strip()]))


def serve_metrics(metrics: Any, port: int, host: str = "127.0.0.1") -> int:
    """Serve ``metrics`` on ``host``, port ``port`` + this process's id; a clear error if taken.

    ``host`` is ``metrics.host``: 127.0.0.1 unless the configuration (or
    ``DPSTREAM_METRICS_HOST``, which the container and Kubernetes files set to 0.0.0.0) opens
    the endpoint to other hosts. It has no authentication.
    """
    chosen = port + process_id()
    try:
        metrics.serve(chosen, host)
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


def _lag_text(lag: float) -> str:
    """How far the closed steps are behind this host's clock, in words.

    Steps close only by a trusted clock (broker time, or the flow's own heartbeat ticks), so
    a closed step ends in the future only if that clock is ahead of this host's, or a bounded
    run closed through a ``flow.end`` that lies ahead: said so, never as a negative lag.
    """
    if lag >= 0:
        return f"{lag:.0f} s behind the clock"
    return (f"the last closed step ends {-lag:.0f} s after this host's clock (flow.end, or a "
            "trusted clock ahead of this host's)")


EXACT_SERIES = ("dpstream_events_total", "dpstream_dead_letters_total",
                "dpstream_input_lag_records")
"""The series that are exact input counts (see :mod:`dpstream.metrics`)."""


def progress_line(registry: CollectorRegistry, exact_counts: bool = False) -> str:
    """What the flow has done so far, in one line.

    Exact input counts (events, dead letters) appear only with ``exact_counts``
    (``metrics.exact_counts``): a log line is shown as widely as a dashboard.
    """
    t = _totals(registry)
    if not exact_counts:
        for name in EXACT_SERIES:
            t.pop(name, None)
    parts = []
    if "dpstream_closed_step" in t:
        parts.append(f"closed through step {t['dpstream_closed_step']:.0f}")
    if "dpstream_step_lag_seconds" in t:
        parts.append(_lag_text(t["dpstream_step_lag_seconds"]))
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


def _report_progress(registry: CollectorRegistry, interval: float, exact_counts: bool) -> None:
    while not stopping.wait(interval):
        log.info("progress: %s", progress_line(registry, exact_counts))


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
        recovery_dir = (_bytewax_recovery_directory(sys.argv, os.environ)
                        if _under_bytewax_run() else None)
        if recovery_dir is not None:
            _check_recovery_partitions(recovery_dir,
                                       cluster=_bytewax_cluster(sys.argv, os.environ))
        return flow_from_environment(kind=kind)
    except DpstreamError as exc:
        print(f"dpstream: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _under_bytewax_run() -> bool:
    """Whether this process is ``python -m bytewax.run`` (whose arguments sys.argv holds)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and spec.name == "bytewax.run"


def _bytewax_recovery_directory(argv: list[str], environ: Mapping[str, str]) -> str | None:
    """The recovery directory given to ``python -m bytewax.run`` (``-r``), if any."""
    for i, arg in enumerate(argv):
        if arg in ("-r", "--recovery-directory") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--recovery-directory="):
            return arg.split("=", 1)[1]
    return environ.get("BYTEWAX_RECOVERY_DIRECTORY") or None


def _bytewax_cluster(argv: list[str], environ: Mapping[str, str]) -> bool:
    """Whether ``python -m bytewax.run`` runs one process of several (``-i``/``-a``)."""
    options = ("-i", "--process-id", "-a", "--addresses")
    return any(arg in options or arg.startswith(("--process-id=", "--addresses="))
               for arg in argv) or any(
        name in environ for name in ("BYTEWAX_PROCESS_ID", "BYTEWAX_ADDRESSES",
                                     "BYTEWAX_POD_NAME", "BYTEWAX_HOSTFILE_PATH"))


def _check_recovery_partitions(recovery_dir: str, *, cluster: bool) -> None:
    """Refuse a recovery directory without partitions (Bytewax: a NoPartitionsError trace).

    Those it has are made private (mode 0600, see
    :func:`dpstream.instance.private_recovery_files`). A process of a cluster may hold none
    (more processes than partitions): it is not refused.
    """
    from dpstream.instance import private_recovery_files

    if not private_recovery_files(recovery_dir) and not cluster:
        raise ConfigError(
            f"the recovery directory {recovery_dir} holds no Bytewax recovery partitions; "
            f"initialise it once: mkdir -p {recovery_dir} && chmod 700 {recovery_dir} && "
            f"python -m bytewax.recovery {recovery_dir} N (N partitions, at least 1; "
            f"dpstream run --recovery-dir {recovery_dir} does this itself)")


def flow_from_environment(config_path: str | None = None, recovery_dir: str | None = None,
                          ephemeral: bool | None = None, kind: str | None = None,
                          recovery_partitions: int = 1,
                          skip_records: list[str] | None = None) -> Dataflow:
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

    Before the instance is bound, the recovery partitions this process writes are locked for
    its lifetime (:mod:`dpstream.store_lock`): a second process on the same store stops here
    with a one-line error naming the holder's pid and host. ``recovery_partitions``: how many
    partitions an empty store will get (``dpstream run --recovery-partitions``).

    ``skip_records`` (``TOPIC:PARTITION:OFFSET`` names, with those of
    ``$DPSTREAM_SKIP_RECORDS``) quarantines records that crash the flow
    (:mod:`dpstream.stream.quarantine`): they are recorded in the instance manifest, and every
    record ever skipped in the instance becomes a dead letter; the list is logged at start.
    """
    from dpstream.core.noise.keys import NoiseKey
    from dpstream.instance import bind_instance, private_directory
    from dpstream.io.kafka import Heartbeat, is_secret
    from dpstream.metrics import FlowMetrics
    from dpstream.platform import (
        build_flow,
        check_broker_time,
        check_input_topology,
        flow_kind,
        input_partitions,
        kafka_clients,
        load_config,
        output_topics,
    )
    from dpstream.store_lock import lock_recovery_store
    from dpstream.stream.quarantine import parse_skipped

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
    requested = parse_skipped([*(skip_records or ()), os.environ.get(SKIP_RECORDS_ENV, "")])
    inputs = [config.kafka.topic(setting) for setting in flow_kind(config.kind).inputs]
    strangers = sorted({r.topic for r in requested} - set(inputs))
    if strangers:  # checked before anything is recorded: a recorded skip is never undone
        raise ConfigError(f"--skip-record names {', '.join(map(repr, strangers))}, not an input "
                          f"topic of this flow ({', '.join(inputs)})")
    if recovery_dir:
        private_directory(Path(recovery_dir))
        held = lock_recovery_store(recovery_dir, process=process_id(),
                                   processes=process_count(), expected=recovery_partitions)
        log.info("recovery store %s locked by this process (pid %d): %s", recovery_dir,
                 os.getpid(), ", ".join(p.name for p in held))
    instance = bind_instance(config, flow_kind(config.kind).binding(config), noise, recovery_dir,
                             ephemeral=ephemeral,
                             instance_id=os.environ.get(INSTANCE_ID_ENV) or None,
                             process=process_id(),
                             wait_seconds=config.kafka.startup_timeout_seconds,
                             skip_records=requested)
    metrics = FlowMetrics(config.name, exact_counts=config.metrics_exact_counts)
    if config.metrics_port:
        port = serve_metrics(metrics, config.metrics_port, config.metrics_host)
        log.info("metrics on %s:%d/metrics%s", config.metrics_host, port,
                 " (exact input counts included: metrics.exact_counts)"
                 if config.metrics_exact_counts else "")
    log.info("%s\nnoise key fingerprint %s", config.describe(), noise.fingerprint())
    if instance.durable:
        log.info("flow instance %s (%s, kept in %s)", instance.id,
                 "resumed" if instance.resumed else "new", recovery_dir)
    else:
        log.warning("flow instance %s is ephemeral (no recovery store): a restart publishes "
                    "everything again under a new instance", instance.id)
    if instance.skipped:
        log.warning("%d record(s) quarantined by the operator become dead letters in this flow "
                    "instance (recorded in its manifest: skipped on every run of it): %s%s",
                    len(instance.skipped), ", ".join(map(str, instance.skipped)),
                    f" (new now: {', '.join(map(str, instance.newly_skipped))})"
                    if instance.newly_skipped else "")
    if not instance.resumed:  # news only when this start made a new instance
        log.info("reprocessing an input topic is a new flow instance: its privacy spend adds "
                 "to every earlier instance's over the same events, and its ledgers cannot see "
                 "theirs")
    if not instance.resumed:  # a resumed instance's backlog starts where it stopped
        _log_backlog(config)
    clients = kafka_clients(config, metrics)
    partitions = input_partitions(config, clients)
    check_broker_time(config, clients)
    if config.clock == "producer":
        log.info("flow.clock = \"producer\": the input's producer timestamps are trusted (every "
                 "producer of %s must be)", ", ".join(partitions))
    log.info("reading %s from %s; %s (delivery is at least once: consumers de-duplicate, see "
             "README)", ", ".join(f"{t} ({n} partitions)" for t, n in partitions.items()),
             ",".join(config.kafka.brokers),
             ", ".join(f"{role} to {topic}" for role, topic in output_topics(config).items()))
    metrics.declare_input_topics(partitions)
    rewind = check_input_topology(config, clients, partitions,
                                  recovery_dir if instance.resumed else None, metrics)
    flow = build_flow(config, noise, instance=instance.id, partitions=partitions,
                      metrics=metrics, skip_records=instance.skipped, rewind=rewind,
                      recovery_dir=recovery_dir if instance.durable else None)
    if config.kafka.tail and config.heartbeat_seconds > 0:
        delay = config.tick_delay_seconds if config.clock == "producer" else 0.0
        for topic, count in partitions.items():
            Heartbeat(clients, topic, count, config.heartbeat_seconds, delay).start()
        log.info("heartbeat: a tick to each input partition every %g s (flow.heartbeat)%s",
                 config.heartbeat_seconds,
                 f", stamped {delay:g} s behind this host's clock (flow.tick_delay)"
                 if delay else "")
    elif config.kafka.tail and config.clock == "producer":
        log.warning("flow.clock = 'producer' with flow.heartbeat = 'off': this flow writes no "
                    "ticks, and records' own times never move the producer clock, so steps "
                    "close only by tick records another writer puts on the input partitions "
                    "(value %s) or by broker time (LogAppendTime)", TICK.decode())
    interval = float(os.environ.get(PROGRESS_ENV, "30"))
    if interval > 0:
        threading.Thread(target=_report_progress, args=(metrics.registry, interval,
                                               config.metrics_exact_counts),
                         name="dpstream-progress", daemon=True).start()
    if not config.kafka.tail:
        atexit.register(lambda: None if stopping.stop_requested() else log.info(
            "input ended: %s", progress_line(metrics.registry, config.metrics_exact_counts)))
    return flow


def run(config_path: str | None, *, workers: int = 1, recovery_dir: str | None = None,
        recovery_partitions: int = 1, ephemeral: bool = False,
        snapshot_interval: float = 5.0, skip_records: list[str] | None = None) -> int:
    """Run the configured flow in this process until its input ends or a stop is requested."""
    os.environ.setdefault("RUST_BACKTRACE", "0")
    from bytewax.recovery import RecoveryConfig, init_db_dir
    from bytewax.run import cli_main

    from dpstream.instance import private_recovery_files

    flow = flow_from_environment(config_path, recovery_dir, ephemeral,
                                 recovery_partitions=recovery_partitions,
                                 skip_records=skip_records)
    recovery = None
    if recovery_dir:
        directory = Path(recovery_dir)
        if not private_recovery_files(directory):  # also narrows the umask: files made 0600
            directory.mkdir(parents=True, exist_ok=True)
            init_db_dir(directory, recovery_partitions)  # type: ignore[no-untyped-call]  # bytewax: unannotated
            private_recovery_files(directory)
            log.info("initialised %d recovery partitions in %s", recovery_partitions, directory)
        recovery = RecoveryConfig(directory)  # type: ignore[no-untyped-call]  # bytewax: unannotated
    try:
        cli_main(flow, workers_per_process=workers,  # type: ignore[no-untyped-call]  # bytewax: unannotated  # bytewax: unannotated
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
        if stopping.stop_signal() == signal.SIGINT:
            return 130  # 128 + SIGINT: a shell (or script) sees the run was interrupted
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
