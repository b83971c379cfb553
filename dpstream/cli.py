"""The ``dpstream`` command: run a flow, check a configuration, make a key, run the demo.

dpstream demo                      # local broker + synthetic stream + counters flow + viewer
dpstream run --config flow.toml    # the counters flow against your Kafka
dpstream check-config flow.toml    # validate and print the privacy guarantee
dpstream keygen                    # a fresh secret noise key (hex)
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
from datetime import timedelta
from pathlib import Path

from dpstream.errors import DpstreamError

__all__ = ["flow_from_environment", "main"]

log = logging.getLogger("dpstream")


RECOVERY_DIR_ENV = "DPSTREAM_RECOVERY_DIR"
EPHEMERAL_ENV = "DPSTREAM_EPHEMERAL"


def flow_from_environment(config_path: str | None = None,  # type: ignore[no-untyped-def]
                          recovery_dir: str | None = None, ephemeral: bool | None = None):
    """Build the counters flow from ``$DPSTREAM_CONFIG`` and the noise key in the environment.

    This is what ``flows/counters.py`` exposes to ``python -m bytewax.run``; it also starts
    the metrics endpoint when ``metrics.port`` is not 0. The flow instance is bound to the
    recovery directory (``recovery_dir`` or ``$DPSTREAM_RECOVERY_DIR``, which must be the
    directory given to Bytewax) before anything runs; without one the run must be
    acknowledged as ephemeral (``ephemeral`` or ``DPSTREAM_EPHEMERAL=1``).
    """
    from dpstream.config import load_config
    from dpstream.core.noise import NoiseKey
    from dpstream.instance import bind_instance
    from dpstream.metrics import FlowMetrics
    from dpstream.pipeline import build_counters_flow, statistics_spec

    config = load_config(config_path)
    noise = NoiseKey.from_environment()
    recovery_dir = recovery_dir or os.environ.get(RECOVERY_DIR_ENV) or None
    if ephemeral is None:
        ephemeral = os.environ.get(EPHEMERAL_ENV, "") not in ("", "0", "false")
    instance = bind_instance(config, statistics_spec(config), noise, recovery_dir,
                             ephemeral=ephemeral)
    metrics = FlowMetrics(config.name, exact_counts=config.metrics_exact_counts)
    if config.metrics_port:
        metrics.serve(config.metrics_port)
        log.info("metrics on :%d/metrics", config.metrics_port)
    log.info("%s\nnoise key fingerprint %s", config.describe(), noise.fingerprint())
    if instance.durable:
        log.info("flow instance %s (%s, kept in %s)", instance.id,
                 "resumed" if instance.resumed else "new", recovery_dir)
    else:
        log.warning("flow instance %s is ephemeral (no recovery store): a restart publishes "
                    "everything again under a new instance", instance.id)
    log.info("reprocessing an input topic is a new flow instance: its privacy spend adds to "
             "every earlier instance's over the same events, and its ledgers cannot see theirs")
    return build_counters_flow(config, noise, instance=instance.id, metrics=metrics)


def _run(args: argparse.Namespace) -> int:
    os.environ.setdefault("RUST_BACKTRACE", "0")  # an interrupt is not a crash: no Rust backtrace
    from bytewax.recovery import RecoveryConfig, init_db_dir
    from bytewax.run import cli_main

    flow = flow_from_environment(args.config, args.recovery_dir, args.ephemeral)
    recovery = None
    if args.recovery_dir:
        directory = Path(args.recovery_dir)
        if not any(directory.glob("*.sqlite3")):
            directory.mkdir(parents=True, exist_ok=True)
            init_db_dir(directory, args.recovery_partitions)
            log.info("initialised %d recovery partitions in %s", args.recovery_partitions,
                     directory)
        recovery = RecoveryConfig(directory)
    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)  # SIGTERM stops as cleanly as Ctrl-C
    try:
        cli_main(flow, workers_per_process=args.workers,
                 epoch_interval=timedelta(seconds=args.snapshot_interval),
                 recovery_config=recovery)
    except Exception as exc:  # Bytewax wraps an interrupt in its own runtime error
        if not _interrupted(exc):
            raise
    except KeyboardInterrupt:
        pass
    else:
        return 0
    # Snapshots are committed per epoch, so an interrupted run loses nothing: a restart with
    # the same recovery store replays the open epoch with the same noise.
    log.info("stopped%s", "; a restart resumes from the recovery store" if recovery else "")
    return 0


def _interrupted(exc: BaseException | None) -> bool:
    """Whether ``exc`` or anything in its cause chain is a KeyboardInterrupt."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _check_config(args: argparse.Namespace) -> int:
    from dpstream.config import load_config

    print(load_config(args.config).describe())
    return 0


def _keygen(_args: argparse.Namespace) -> int:
    print(secrets.token_hex(32))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from dpstream.demo import run_demo

    return run_demo(duration=args.duration, rate=args.rate, workers=args.workers)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dpstream`` command."""
    parser = argparse.ArgumentParser(prog="dpstream", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the counters flow")
    run.add_argument("--config", help="TOML configuration (default: $DPSTREAM_CONFIG)")
    run.add_argument("-w", "--workers", type=int, default=1, help="worker threads (default 1)")
    run.add_argument("--recovery-dir", help="Bytewax recovery store (keep it secret: it holds "
                     "true counts); created and initialised if empty")
    run.add_argument("--recovery-partitions", type=int, default=1)
    run.add_argument("--ephemeral", action="store_true",
                     help="run without a recovery store, acknowledging that every start is a "
                     "new flow instance whose spend adds to earlier runs' (demos, trials)")
    run.add_argument("--snapshot-interval", type=float, default=5.0,
                     help="seconds between snapshots (default 5)")
    run.set_defaults(func=_run)

    check = sub.add_parser("check-config", help="validate a configuration and describe it")
    check.add_argument("config")
    check.set_defaults(func=_check_config)

    keygen = sub.add_parser("keygen", help="print a fresh secret noise key")
    keygen.set_defaults(func=_keygen)

    demo = sub.add_parser("demo", help="run everything locally on a synthetic stream")
    demo.add_argument("--duration", type=float, default=30.0,
                      help="seconds to run (default 30; 0 = until Ctrl-C)")
    demo.add_argument("--rate", type=int, default=5_000, help="synthetic events per second")
    demo.add_argument("-w", "--workers", type=int, default=1)
    demo.set_defaults(func=_demo)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("kafka").setLevel(logging.WARNING)  # kafka-python is chatty at INFO
    try:
        return int(args.func(args))
    except DpstreamError as exc:
        print(f"dpstream: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
