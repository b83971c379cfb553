"""The ``dpstream`` command: run a flow, check a configuration, make a key, run the demo.

dpstream demo                          # local broker + synthetic stream + counters flow + viewer
dpstream run --config flow.toml        # the counters flow against your Kafka
dpstream check-config flow.toml        # validate and print the privacy guarantee
dpstream bounds --config flow.toml sample.jsonl  # user level: events kept vs noise per cap
dpstream keygen --out noise.key        # a fresh secret noise key in a new 0600 file
dpstream topics --config flow.toml     # create the flow's four Kafka topics if missing
dpstream broker                        # a throw-away local broker for trials (Ctrl-C stops it)
dpstream query --config pmwg.toml --histogram NAME '{"kind": "count"}'  # ask a PMWG flow
dpstream tail --config flow.toml       # the latest value of every key, live (--json, --web)
dpstream budget --metrics HOST:9464    # privacy spend, burn rate and projected exhaustion
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dpstream.errors import DpstreamError

__all__ = ["flow_from_environment", "main"]

log = logging.getLogger("dpstream")


def flow_from_environment(config_path: str | None = None,  # type: ignore[no-untyped-def]
                          recovery_dir: str | None = None, ephemeral: bool | None = None):
    """The counters flow (see :func:`dpstream.runner.flow_from_environment`)."""
    from dpstream.runner import flow_from_environment as build

    return build(config_path, recovery_dir, ephemeral)


def _run(args: argparse.Namespace) -> int:
    from dpstream.runner import run

    return run(args.config, workers=args.workers, recovery_dir=args.recovery_dir,
               recovery_partitions=args.recovery_partitions, ephemeral=args.ephemeral,
               snapshot_interval=args.snapshot_interval, skip_records=args.skip_record)


def _check_config(args: argparse.Namespace) -> int:
    from dpstream.backlog import estimate
    from dpstream.platform import load_config

    config = load_config(args.config)
    described = config.describe()
    print(described)
    for line in _user_level_lines(config, described):
        print(line)
    print(estimate(config).describe())  # measures the mechanisms for ~0.3 s
    return 0


def _user_level_lines(config: Any, described: str) -> list[str]:
    """At ``contribution.unit = "user"``: the contribution line and the noise std per output.

    The contribution line and the noise std are printed unless the kind's own summary already
    carries them (the kind's summary states the per-person guarantee); the noise std comes
    from the kind configuration's ``noise_std()`` at the configured caps, when it has one.
    """
    contribution = config.contribution
    if not contribution.user_level:
        return []
    lines = []
    line = contribution.describe()
    if line not in described:
        lines.append(line)
    noise_std = getattr(config, "noise_std", None)
    if callable(noise_std) and "noise std" not in described:  # else the kind's summary has it
        stds = noise_std()
        shown = ", ".join(f"{name} {float(std):.4g}" for name, std in stds.items())
        lines.append(f"noise std at these caps: {shown or 'none'} (`dpstream bounds` shows "
                     "other caps against the events they keep)")
    return lines


def _cap_grid(text: str) -> list[int]:
    """A comma-separated list of candidate caps, each an integer >= 1."""
    values = [part.strip() for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of integers >= 1, "
                                         f"got {text!r}")
    return [_positive_int(value) for value in values]


def _bounds(args: argparse.Namespace) -> int:
    """Per candidate caps: the fraction of the sample's events kept and the noise std."""
    import json

    from dpstream.bounds import print_progress, run_bounds

    grids = {name: values for name in ("max_keys", "max_per_key", "max_rows",
                                       "max_rows_per_block", "max_blocks")
             if (values := getattr(args, name)) is not None}
    report = run_bounds(args.config, args.sample, grids, user_field=args.user_field,
                        period=args.period, progress=None if args.quiet else print_progress)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(report.table())
    return 0


LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "error": logging.ERROR}
KEY_FILE_MODE = 0o600


def _keygen(args: argparse.Namespace) -> int:
    """Make a fresh key: into a new 0600 file (printing its fingerprint), or onto stdout."""
    from dpstream.core.noise.keys import NOISE_KEY_FILE_ENV, NoiseKey

    raw = secrets.token_bytes(32)
    key = NoiseKey(raw)  # validates it like any loaded key
    if args.out is None:
        print("dpstream: warning: the key printed on stdout is secret: whoever reads it can "
              "subtract the noise. Prefer `dpstream keygen --out PATH` (a new file, mode 0600); "
              "if you redirect stdout into a file, `chmod 600` it before anything else "
              "(dpstream refuses a key file others can read)", file=sys.stderr)
        print(raw.hex())
        return 0
    _write_new_private_file(args.out, raw.hex() + "\n")
    print(f"dpstream: wrote a new noise key to {args.out} (mode 0600); use it with "
          f"{NOISE_KEY_FILE_ENV}={os.path.abspath(args.out)}", file=sys.stderr)
    print(key.fingerprint())
    return 0


def _write_new_private_file(path: str, text: str) -> None:
    """Create ``path`` with mode 0600 and write ``text``; never overwrite or follow a link.

    ``O_CREAT | O_EXCL`` creates the file atomically with its final mode (no moment at which
    it exists with wider permissions) and fails if anything, even a dangling symlink, is
    already there.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
    except FileExistsError:
        raise DpstreamError(f"{path} already exists: refusing to overwrite it (it may hold the "
                            "key of a running flow); remove it first or choose another "
                            "path") from None
    except OSError as exc:
        raise DpstreamError(f"cannot create {path}: {exc.strerror}") from None
    try:
        with open(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        Path(path).unlink(missing_ok=True)
        raise DpstreamError(f"cannot write {path}: {exc.strerror}") from None


def _topics(args: argparse.Namespace) -> int:
    """Create the flow's input and output topics that are missing; say what the broker did.

    Each input topic is asked for ``message.timestamp.type=LogAppendTime``. Under ``flow.clock
    = "broker"`` one heartbeat tick (which every consumer of the flow skips, and whose broker
    time precedes every later record's) is then written to its partition 0 and read back, and
    the line reports the timestamp type the broker actually gave it: a broker that accepts the
    setting but ignores it (the embedded ``dpstream broker``) shows as CreateTime. Under the
    producer clock nothing is written: a tick stamped now would make backfilled events late.
    """
    from dpstream.io.kafka import TIMESTAMP_NAMES, create_missing_topics, probe_timestamp_type
    from dpstream.platform import flow_kind, kafka_clients, load_config

    config = load_config(args.config)
    kind = flow_kind(config.kind)
    # input topics: broker time stamps every record (what flow.clock = "broker" trusts)
    stamped = {"message.timestamp.type": "LogAppendTime"}
    roles = {setting.removesuffix("_topic").replace("_", "-"):
             (config.kafka.topic(setting), stamped if setting in kind.inputs else {})
             for setting in kind.topics}
    clients = kafka_clients(config)
    result = create_missing_topics(
        clients, {name: (args.partitions, settings) for name, settings in roles.values()},
        timeout=args.timeout)
    unusable = []
    for role, (name, settings) in roles.items():
        existed = result[name]
        line = (f"exists   {role:<12} {name} ({existed} partitions)" if existed is not None
                else f"created  {role:<12} {name} ({args.partitions} partitions)")
        if settings and config.clock != "broker":
            line += ("; timestamps not probed (flow.clock = \"producer\" places events by "
                     "their producers' timestamps)")
        elif settings:  # an input topic: what does the broker stamp its records with?
            got = probe_timestamp_type(clients, name, 0, write=True, timeout=args.timeout)
            shown = "unknown (the probe record was not read back)" if got is None \
                else TIMESTAMP_NAMES.get(got, str(got))
            asked = "asked for LogAppendTime, " if existed is None else ""
            line += f"; {asked}records get timestamp type {shown}"
            if got is not None and got != 2:
                unusable.append(name)
        print(line)
    if unusable:
        print(f"dpstream: warning: {', '.join(unusable)}: records carry no broker time "
              "(LogAppendTime), so this flow's clock (flow.clock = \"broker\") would "
              "dead-letter every event and `dpstream run` refuses to start. The "
              "broker ignores LogAppendTime (the embedded `dpstream broker` does) or the topic "
              "lacks it: set message.timestamp.type=LogAppendTime on the topic, use a broker "
              "that honours it, or, with trusted producers only, flow.clock = \"producer\" "
              "(DPSTREAM_FLOW_CLOCK=producer)", file=sys.stderr)
    return 0


def _broker(args: argparse.Namespace) -> int:
    """Run the embedded broker in the foreground until Ctrl-C or SIGTERM."""
    import shutil
    import tempfile
    import time

    from dpstream.io.broker import EmbeddedBroker

    terminated = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal terminated
        terminated = True
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    # Ctrl-C stops it even when started in the background by a shell that ignores SIGINT
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Our own log directory: Ctrl-C in a terminal also reaches the broker, which then looks
    # as if it died by itself and EmbeddedBroker would keep its temporary logs.
    log_dir = Path(tempfile.mkdtemp(prefix="dpstream-broker-"))
    broker = EmbeddedBroker(port=args.port, log_dir=log_dir)
    interrupted = False
    try:
        broker.start()
        print(f"bootstrap: {broker.bootstrap}", flush=True)
        print(f"embedded Kafka-protocol broker (in memory: everything is lost when it stops). "
              f"Point a configuration at it with kafka.brokers = [\"{broker.bootstrap}\"] "
              f"(or DPSTREAM_BROKERS={broker.bootstrap}), create its topics with "
              "`dpstream topics --config FILE`; Ctrl-C stops it. It does not stamp records "
              "with broker time (LogAppendTime), so set flow.clock = \"producer\" for flows "
              "reading it (with trusted producers only).", flush=True)
        while broker.is_running():
            time.sleep(0.2)
        raise DpstreamError(f"the embedded broker exited by itself; its logs are in {log_dir}")
    except KeyboardInterrupt:
        interrupted = True
    finally:
        broker.stop()
        if interrupted:
            shutil.rmtree(log_dir, ignore_errors=True)
    print("broker stopped", flush=True)
    return 130 if interrupted and not terminated else 0  # Ctrl-C: 128 + SIGINT


def _query(args: argparse.Namespace) -> int:
    """Ask a running PMWG flow one question and print its answer.

    Exit 0 when the flow answered (any kind but ``error``), 1 when it refused the query
    (``kind = "error"``), on a timeout or any other failure (the message on stderr).
    """
    import json

    from kafka import KafkaConsumer

    from dpstream.io.kafka import KafkaClients
    from dpstream.kinds.pmwg.config import PmwgConfig
    from dpstream.platform import load_config
    from dpstream.query_client import (
        QUERY_SCHEMA,
        QueryClient,
        describe_answer,
        kafka_python_settings,
    )

    def fail(message: str) -> int:
        print(f"dpstream: error: {message}", file=sys.stderr)
        return 1

    try:
        config = load_config(args.config)
    except DpstreamError as exc:
        return fail(str(exc))
    if not isinstance(config, PmwgConfig):  # flow.kind = "pmwg"
        return fail(f"{config.source} configures a {config.kind!r} flow: `dpstream query` asks "
                    "a PMWG flow (flow.kind = \"pmwg\") through its queries and answers topics")
    names = [h.name for h in config.histograms]
    histogram = args.histogram
    if histogram is None:
        if len(names) != 1:
            return fail(f"--histogram is required: this flow has the histograms "
                        f"{', '.join(names)}")
        histogram = names[0]
    elif histogram not in names:
        return fail(f"{histogram!r} is not a histogram of flow {config.name!r} (its histograms: "
                    f"{', '.join(names)}); the flow would dead-letter the question")
    text = sys.stdin.read() if args.query == "-" else args.query
    try:
        query = json.loads(text)
    except ValueError as exc:
        return fail(f"the query is not valid JSON ({exc}); give a {QUERY_SCHEMA} object, e.g. "
                    "'{\"kind\": \"count\", \"where\": [{\"attr\": \"country\", "
                    "\"eq\": \"de\"}]}'")
    if not isinstance(query, dict):
        return fail(f"the query must be a JSON object ({QUERY_SCHEMA}), got "
                    f"{type(query).__name__}")
    query.setdefault("schema", QUERY_SCHEMA)
    clients = KafkaClients(config.kafka.brokers, config.kafka.add_config)
    settings = kafka_python_settings(clients.settings)
    if "bootstrap_timeout_ms" in KafkaConsumer.DEFAULT_CONFIG:  # kafka-python >= 3
        settings.setdefault("bootstrap_timeout_ms", 10_000)
    if getattr(args, "log_level", "info") != "debug":  # kafka-python logs every refused
        logging.getLogger("kafka").setLevel(logging.CRITICAL)  # connection: our error says it
    try:
        with QueryClient(clients.bootstrap, queries_topic=config.kafka.topic("queries_topic"),
                         answers_topic=config.kafka.topic("answers_topic"), flow=config.name,
                         **settings) as client:
            query_id = client.submit(histogram, query, args.id)
            answer = client.answer(query_id, args.timeout)
    except (DpstreamError, ValueError) as exc:
        return fail(str(exc))
    if args.json:
        print(json.dumps(answer, ensure_ascii=False))
    elif answer.get("kind") != "error":
        print(describe_answer(answer))
    if answer.get("kind") == "error":
        return fail(f"query {query_id} was refused by the flow: {answer.get('reason')}")
    return 0


def _kafka_source(args: argparse.Namespace) -> tuple[list[str], list[str], str | None,
                                                     dict[str, Any]]:
    """Brokers, topics, flow filter and kafka-python settings of ``tail``'s arguments."""
    brokers: list[str] = []
    topics: list[str] = []
    flow, settings = args.flow, {}
    if args.config is not None:
        from dpstream.io.kafka import KafkaClients
        from dpstream.platform import flow_kind, load_config
        from dpstream.query_client import kafka_python_settings

        config = load_config(args.config)
        clients = KafkaClients(config.kafka.brokers, config.kafka.add_config)
        brokers, settings = clients.bootstrap, kafka_python_settings(clients.settings)
        topics = [config.kafka.topic(setting) for role, setting
                  in flow_kind(config.kind).outputs.items() if role != "dead_letters"]
        flow = config.name if flow is None else flow
    if args.brokers:
        brokers = [b for b in args.brokers.split(",") if b.strip()]
    elif not brokers and os.environ.get("DPSTREAM_BROKERS"):
        brokers = os.environ["DPSTREAM_BROKERS"].split(",")
    if args.topic:
        topics = [t for text in args.topic for t in text.split(",") if t.strip()]
    if not brokers:
        raise DpstreamError("no brokers: pass --brokers HOST:PORT, --config FILE or set "
                            "$DPSTREAM_BROKERS")
    if not topics:
        raise DpstreamError("no topics: pass --topic NAME (releases, alerts, answers or "
                            "models topic) or --config FILE")
    return brokers, topics, flow or None, settings


class _TailOutput:
    """Where ``tail`` shows records: JSON lines, rows appended, or a table redrawn in place."""

    REDRAW_SECONDS = 0.5

    def __init__(self, mode: str, title: str, consumer: Any) -> None:
        self.mode, self.title, self.consumer = mode, title, consumer
        self.dirty, self.drawn_at, self.header_done = True, 0.0, False
        self.flows: set[str] = set()
        self.instances: set[str | None] = set()

    def take(self, item: Any) -> None:
        """Show one new record."""
        self.flows.add(item.record.flow)
        self.instances.add(item.record.instance)
        if self.mode == "json":
            sys.stdout.buffer.write(item.value.rstrip(b"\n") + b"\n")
            sys.stdout.flush()
        elif self.mode == "append":
            from dpstream.client.render import record_row, table_header

            if not self.header_done:
                print(table_header(), flush=False)
                self.header_done = True
            print(record_row(item.record, several_flows=len(self.flows) > 1,
                             several_instances=len(self.instances) > 1), flush=True)
        else:
            self.dirty = True

    def tick(self, final: bool = False) -> None:
        """Redraw the live table when it changed (at most every half second)."""
        if self.mode != "live" or not (self.dirty or final):
            return
        now = time.monotonic()
        if not final and now - self.drawn_at < self.REDRAW_SECONDS:
            return
        from dpstream.client.render import live_table

        height = shutil.get_terminal_size().lines
        table = live_table(self.consumer.latest, self.consumer.stats, self.title, height)
        sys.stdout.write("\x1b[H\x1b[2J" + table + "\n")
        sys.stdout.flush()
        self.dirty, self.drawn_at = False, now


class _TailWeb:
    """Feeds ``dpstream.web.LiveView`` (``tail --web``) the releases, alerts and statuses.

    The page derives the spend per mechanism from the releases; with ``--metrics`` it shows
    the spend read from those endpoints instead (refreshed every few seconds).
    """

    BUDGET_SECONDS = 2.0

    def __init__(self, spec: str, title: str, metrics: list[str] | None) -> None:
        try:
            from dpstream.web import LiveView
        except ImportError as exc:
            raise DpstreamError(f"--web needs dpstream.web, which cannot be imported: "
                                f"{exc}") from None
        host, _, port = spec.rpartition(":")
        if not port.isdigit() or int(port) > 65535:
            raise DpstreamError(f"--web takes [HOST:]PORT, e.g. 8080 or 0.0.0.0:8080, got "
                                f"{spec!r}")
        self.view = LiveView(host=host or "127.0.0.1", port=int(port), title=title)
        self.metrics = metrics
        self.budget_at = -math.inf
        self.url = self.view.start()

    def take(self, item: Any) -> None:
        """Give one new record to the page (answers, models and dead letters are not shown)."""
        from dpstream.client import Alert, Release, Status

        record = item.record
        if isinstance(record, Release):
            self.view.add_release(item.body())
        elif isinstance(record, Alert):
            self.view.add_alert(item.body())
        elif isinstance(record, Status):
            self.view.add_status(item.body())

    def tick(self) -> None:
        """With ``--metrics``: read the spend per mechanism and show it (every few seconds)."""
        now = time.monotonic()
        if not self.metrics or now - self.budget_at < self.BUDGET_SECONDS:
            return
        self.budget_at = now
        from dpstream.client import budget_from_metrics

        try:
            rows = budget_from_metrics(self.metrics)
        except DpstreamError as exc:
            log.warning("tail --web: %s", exc)
            return
        self.view.set_budget([{"mechanism": r.mechanism + (f" {r.scope}" if r.scope else ""),
                               "unit": r.unit or "", "spent": r.spent, "budget": r.budget}
                              for r in rows if r.budget is not None])

    def stop(self) -> None:
        """Stop serving the page."""
        self.view.stop()


def _tail(args: argparse.Namespace) -> int:
    """Show a flow's published records live: a table of the latest value per key, or JSON."""
    from dpstream.client import RecordConsumer

    started = time.monotonic()  # --timeout bounds the whole command, connecting included
    if args.max_records is not None and args.max_records < 1:
        raise DpstreamError(f"--max-records must be >= 1, got {args.max_records}")
    if args.metrics and args.web is None:
        raise DpstreamError("--metrics goes with --web (the page's spend plot); for the spend "
                            "itself see `dpstream budget --metrics URL`")
    brokers, topics, flow, settings = _kafka_source(args)
    if args.timeout is not None:  # kafka-python waits 10 s for an unreachable broker
        left_ms = max(1, int((args.timeout - (time.monotonic() - started)) * 1000))
        settings = dict(settings, bootstrap_timeout_ms=min(
            left_ms, settings.get("bootstrap_timeout_ms", left_ms)))
    if getattr(args, "log_level", "info") != "debug":  # kafka-python logs every refused
        logging.getLogger("kafka").setLevel(logging.CRITICAL)  # connection: our error says it
    mode = "json" if args.json else "live" if sys.stdout.isatty() else "append"
    title = f"dpstream tail {', '.join(topics)}" + (f" (flow {flow})" if flow else "") \
        + (f" (instance {args.instance})" if args.instance else "")
    stop = threading.Event()  # Ctrl-C or SIGTERM: the loop ends between polls, never inside
    stopped_by: list[int] = []  # kafka-python's code

    def request_stop(signum: int, _frame: object) -> None:
        stopped_by.append(signum)
        stop.set()

    previous = {signum: signal.signal(signum, request_stop)
                for signum in (signal.SIGINT, signal.SIGTERM)}
    consumer = web = None
    try:
        consumer = RecordConsumer(brokers, topics, flow=flow, instance=args.instance or None,
                                  from_beginning=args.from_beginning,
                                  strict_versions=not args.skip_unsupported, **settings)
        output = _TailOutput(mode, title, consumer)
        if args.web is not None:
            web = _TailWeb(args.web, title, args.metrics)
            print(f"dpstream tail: live view at {web.url}", file=sys.stderr, flush=True)
        try:
            left = (None if args.timeout is None
                    else max(0.0, args.timeout - (time.monotonic() - started)))
            _tail_loop(consumer, output, web, left, args.max_records, stop)
            output.tick(final=True)  # also after Ctrl-C or SIGTERM: the way to stop a live tail
        except BrokenPipeError:  # `dpstream tail --json | head`: the reader is gone
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        from dpstream.client.render import store_summary

        print(f"dpstream tail: {consumer.stats.describe()}; {store_summary(consumer.latest)}",
              file=sys.stderr, flush=True)
        return 130 if stopped_by[:1] == [signal.SIGINT] else 0  # Ctrl-C: 128 + SIGINT
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if web is not None:
            web.stop()
        if consumer is not None:
            consumer.close()


def _tail_loop(consumer: Any, output: _TailOutput, web: _TailWeb | None,
               timeout: float | None, max_records: int | None, stop: threading.Event) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    shown = 0
    while (deadline is None or time.monotonic() < deadline) and not stop.is_set():
        wait = 0.2 if deadline is None else max(0.001, min(0.2, deadline - time.monotonic()))
        for item in consumer.poll(wait):
            if not item.new:
                continue
            output.take(item)
            if web is not None:
                web.take(item)
            shown += 1
            if max_records is not None and shown >= max_records:
                return
        output.tick()
        if web is not None:
            web.tick()


def _budget(args: argparse.Namespace) -> int:
    """Print the privacy spend, remaining budget and projected exhaustion per mechanism."""
    import json

    from dpstream.client import budget_from_metrics, budget_from_prometheus
    from dpstream.client.render import budget_table

    now = time.time()
    if args.prometheus is not None:
        rows = budget_from_prometheus(args.prometheus, flow=args.flow, window=args.window,
                                      instance=args.instance or None)
        source, hint = args.prometheus, ""
    else:
        if args.interval < 0:
            raise DpstreamError(f"--interval must be >= 0 seconds, got {args.interval}")
        rows = budget_from_metrics(args.metrics, flow=args.flow, interval=args.interval,
                                   instance=args.instance or None)
        source, hint = ",".join(args.metrics), "sample twice: --interval SECONDS"
    if args.json:
        print(json.dumps({"source": source, "time": now,
                          "rows": [row.to_dict(now) for row in rows]}))
    else:
        print(budget_table(rows, hint, now))
    return 0


def _version() -> str:
    """``dpstream <version> (bytewax <version>)``, without importing Bytewax."""
    from importlib.metadata import PackageNotFoundError, version

    from dpstream import __version__

    try:
        bytewax = version("bytewax")
    except PackageNotFoundError:
        bytewax = "not installed"
    return f"dpstream {__version__} (bytewax {bytewax})"


class _QuietEventLoopWarning(logging.Filter):
    """Keeps kafka-python's "blocking the event loop" warning out unless debugging.

    kafka-python 3 times every step of its I/O loop by the wall clock and warns past 0.1 s
    (``kafka.net.selector``, a check meant for its own coroutines). In dpstream's processes
    its I/O thread shares the GIL with busy threads (the demo's producer and viewer, tail's
    decoding), so a step that waited for the GIL is reported as a blocked loop: nothing a user
    can act on. It still shows with ``--log-level debug``.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return ("blocking the event loop" not in record.getMessage()
                or logging.getLogger(record.name).isEnabledFor(logging.DEBUG))


def _configure_logging(level_name: str) -> None:
    """Apply ``level_name`` to the root logging configuration and the ``dpstream`` logger."""
    level = LOG_LEVELS[level_name]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)  # also when logging was configured before us
    logging.getLogger("dpstream").setLevel(level)
    # kafka-python is chatty at INFO: its records show only at debug, or when asked for less
    logging.getLogger("kafka").setLevel(level if level != logging.INFO else logging.WARNING)
    selector = logging.getLogger("kafka.net.selector")
    if not any(isinstance(f, _QuietEventLoopWarning) for f in selector.filters):
        selector.addFilter(_QuietEventLoopWarning())


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _seconds(text: str) -> float:
    """A duration in seconds: finite and >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    """A duration in seconds: finite and > 0."""
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _port_or_off(text: str) -> int:
    """A TCP port, or 0 for off."""
    if text.strip() == "0":
        return 0
    try:
        return _port(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a TCP port 1..65535, or 0 for none, got "
                                         f"{text}") from None


def _plain(text: str) -> str:
    """``text`` (a docstring) as plain text for ``--help``: no reStructuredText literals."""
    return text.replace("``", "")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a TCP port 1..65535, got {text}")
    return value


def _demo(args: argparse.Namespace) -> int:
    from dpstream.demo import run_demo

    return run_demo(duration=args.duration, rate=args.rate, workers=args.workers,
                    web_port=args.web_port, unit=args.unit)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dpstream`` command."""
    # The logging options are accepted before and after the subcommand; SUPPRESS keeps a
    # subcommand from resetting what was given before it. (No set_defaults for them: the
    # parsers share these action objects, and set_defaults would change all their defaults.)
    logging_options = argparse.ArgumentParser(add_help=False)
    logging_options.add_argument(
        "--log-level", choices=list(LOG_LEVELS), default=argparse.SUPPRESS,
        help="logging level of dpstream and the root logger (default info)")
    logging_options.add_argument("-v", "--verbose", dest="log_level", action="store_const",
                                 const="debug", default=argparse.SUPPRESS,
                                 help="debug logging (same as --log-level debug)")
    parser = argparse.ArgumentParser(prog="dpstream", description=_plain(__doc__ or ""),
                                     parents=[logging_options],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True,
                                help="what to do (dpstream COMMAND --help tells more)")

    def add_parser(name: str, help: str) -> argparse.ArgumentParser:  # noqa: A002 (argparse's)
        return sub.add_parser(name, parents=[logging_options], help=help)

    run = add_parser("run", help="run the counters flow")
    run.add_argument("--config", help="TOML configuration (default: $DPSTREAM_CONFIG)")
    run.add_argument("-w", "--workers", type=_positive_int, default=1,
                     help="worker threads (default 1)")
    run.add_argument("--recovery-dir", help="Bytewax recovery store (keep it secret: it holds "
                     "true counts); created and initialised if empty")
    run.add_argument("--recovery-partitions", type=_positive_int, default=1, metavar="N",
                     help="partitions of a new recovery store (default 1), made when "
                     "--recovery-dir holds none; an existing store keeps its own")
    run.add_argument("--ephemeral", action="store_true",
                     help="run without a recovery store, acknowledging that every start is a "
                     "new flow instance whose spend adds to earlier runs' (demos, trials)")
    run.add_argument("--snapshot-interval", type=_positive_seconds, default=5.0,
                     help="seconds between snapshots (default 5)")
    run.add_argument("--skip-record", action="append", default=[],
                     metavar="TOPIC:PARTITION:OFFSET",
                     help="quarantine the input record at this offset of this partition of "
                     "this topic (repeatable; also $DPSTREAM_SKIP_RECORDS, comma-separated): "
                     "it becomes a dead letter (\"quarantined by the operator\") instead of "
                     "being read. For a record that crashes the flow on every restart. The "
                     "skip is recorded in the flow instance's manifest and applies to every "
                     "later run of the instance (it cannot be undone)")
    run.set_defaults(func=_run)

    check = add_parser("check-config", help="validate a configuration and describe it")
    check.add_argument("config", help="the TOML configuration file")
    check.set_defaults(func=_check_config)

    bounds = sub.add_parser(
        "bounds", parents=[logging_options],
        help="choose user-level caps: per candidate cap, the fraction of a sample's events "
        "kept and the noise std of the outputs",
        description="Reads a public or synthetic sample (JSON lines in the flow's event "
        "format: the person field, the key or row fields, the time field) and the flow's "
        "configuration, and shows per candidate caps the fraction of events the production "
        "bounder keeps and the noise std of each output at those caps. No broker is read: "
        "each event is placed in its step (and period) by its own event time, with "
        "flow.origin and flow.step, and the file's lines are one input partition in order. "
        "Person ids are hashed as in the flow and never printed. Caps not given are tried "
        "over a default grid (plus the configured cap).")
    bounds.add_argument("sample", help="the sample file (JSON lines, one event a line)")
    bounds.add_argument("--config", help="TOML configuration (default: $DPSTREAM_CONFIG); "
                        "its [contribution] table may be at unit = 'event' if --user-field "
                        "is given")
    bounds.add_argument("--user-field", help="the event field naming the person (default: "
                        "contribution.user_field)")
    bounds.add_argument("--period", help="'lifetime' or a duration of whole steps such as "
                        "'1d' (default: contribution.period, else lifetime)")
    for cap, meaning in (("max_keys", "counters: keys a person may contribute to (L0)"),
                         ("max_per_key", "counters: events a person may contribute to one "
                          "key (Linf)"),
                         ("max_rows", "pmwg: rows a person may add to a histogram"),
                         ("max_rows_per_block", "erm: rows a person may add to one block"),
                         ("max_blocks", "erm: blocks a person may contribute to")):
        bounds.add_argument("--" + cap.replace("_", "-"), dest=cap, type=_cap_grid,
                            metavar="N[,N...]", help=f"candidates for {meaning}, per period")
    bounds.add_argument("--json", action="store_true", help="print JSON instead of a table")
    bounds.add_argument("-q", "--quiet", action="store_true",
                        help="no progress lines on stderr")
    bounds.set_defaults(func=_bounds)

    keygen = add_parser("keygen", help="make a fresh secret noise key")
    keygen.add_argument("--out", metavar="PATH",
                        help="write the key to this new file (mode 0600; never overwritten) "
                        "and print only its fingerprint; without it the key goes to stdout")
    keygen.set_defaults(func=_keygen)

    topics = add_parser("topics", help="create the configuration's Kafka topics if missing")
    topics.add_argument("--config", help="TOML configuration (default: $DPSTREAM_CONFIG)")
    topics.add_argument("--partitions", type=_positive_int, default=1,
                        help="partitions of each topic created (default 1; existing topics "
                        "are left as they are)")
    topics.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for the brokers (default 10)")
    topics.set_defaults(func=_topics)

    broker = add_parser("broker", help="run a throw-away local Kafka-protocol broker for "
                        "trials, until Ctrl-C")
    broker.add_argument("--port", type=_port, default=None,
                        help="TCP port on 127.0.0.1 (default: a free one)")
    broker.set_defaults(func=_broker)

    query = add_parser("query", help="ask a running PMWG flow one question and print its "
                       "answer")
    query.add_argument("--config", help="TOML configuration of the pmwg flow (default: "
                       "$DPSTREAM_CONFIG)")
    query.add_argument("--histogram", help="the histogram asked (default: the flow's only one)")
    query.add_argument("query", help="the query as JSON (dpstream.query/1; \"schema\" may be "
                       "left out), or - to read it from stdin")
    query.add_argument("--id", help="the query's id (default: a fresh uuid4 hex)")
    query.add_argument("--timeout", type=float, default=60.0,
                       help="seconds to wait for the answer (default 60)")
    query.add_argument("--json", action="store_true",
                       help="print the answer record as JSON instead of a readable line")
    query.set_defaults(func=_query)

    tail = add_parser("tail", help="show a flow's releases, alerts, answers or models live: "
                      "the latest value per key (a table), or JSON lines")
    tail.add_argument("--config", help="take the brokers, the output topics and the flow name "
                      "from this flow configuration (the dead-letter topic only with --topic)")
    tail.add_argument("--brokers", help="host:port[,host:port] (default: the configuration's, "
                      "or $DPSTREAM_BROKERS)")
    tail.add_argument("--topic", action="append", metavar="NAME", help="a topic to read "
                      "(repeat or comma-separate; default: the configuration's output topics)")
    tail.add_argument("--flow", help="only this flow's records (default with --config: its "
                      "flow.name; --flow '' shows every flow)")
    tail.add_argument("--instance", metavar="ID", help="only this flow instance's records (its "
                      "id, or a prefix of it: every record names its instance; two instances "
                      "of one flow name publish independent values)")
    tail.add_argument("--from-beginning", action="store_true",
                      help="read each topic from its first record (default: from its end)")
    tail.add_argument("--json", action="store_true", help="one record per line, as published "
                      "(de-duplicated), for scripts")
    tail.add_argument("--web", metavar="[HOST:]PORT", help="also serve a page with live plots "
                      "(default host 127.0.0.1; port 0 picks a free one)")
    tail.add_argument("--metrics", action="append", metavar="URL", help="with --web: show the "
                      "spend read from this metrics endpoint (default: from the releases)")
    tail.add_argument("--max-records", type=int, metavar="N",
                      help="stop after showing N records")
    tail.add_argument("--timeout", type=_positive_seconds, metavar="SECONDS",
                      help="stop after this many seconds (connecting to the brokers included)")
    tail.add_argument("--skip-unsupported", action="store_true",
                      help="skip (and count) records of a newer major schema version instead "
                      "of stopping with an error")
    tail.set_defaults(func=_tail)

    budget = add_parser("budget", help="privacy spend, remaining budget and projected "
                        "exhaustion per mechanism, from metrics or Prometheus")
    source = budget.add_mutually_exclusive_group(required=True)
    source.add_argument("--metrics", action="append", metavar="URL",
                        help="a flow's metrics endpoint (http://host:9464/metrics or "
                        "host:9464; repeat for each process of a flow)")
    source.add_argument("--prometheus", metavar="URL",
                        help="a Prometheus server scraping the flows (http://host:9090)")
    budget.add_argument("--flow", help="only this flow")
    budget.add_argument("--instance", metavar="ID", help="only the processes running this flow "
                        "instance (its id, or a prefix of it; dpstream_flow_instance_info)")
    budget.add_argument("--interval", type=float, default=0.0, metavar="SECONDS",
                        help="with --metrics: sample twice, this far apart, to measure the "
                        "burn rate (default 0: the burn rate is unknown)")
    budget.add_argument("--window", default="1h", metavar="DURATION",
                        help="with --prometheus: the window of the burn rate (PromQL "
                        "duration, default 1h)")
    budget.add_argument("--json", action="store_true", help="print JSON instead of a table")
    budget.set_defaults(func=_budget)

    demo = add_parser("demo", help="run everything locally on a synthetic stream")
    demo.add_argument("--duration", type=_seconds, default=30.0,
                      help="seconds to run (default 30; 0 = until Ctrl-C)")
    demo.add_argument("--rate", type=_positive_int, default=5_000,
                      help="synthetic events per second (default 5000)")
    demo.add_argument("-w", "--workers", type=_positive_int, default=1,
                      help="worker threads of the demo's flow (default 1)")
    demo.add_argument("--web-port", type=_port_or_off, default=None,
                      help="port of the live page on 127.0.0.1 (default $DPSTREAM_DEMO_WEB_PORT "
                           "or 8765; a free port when busy; 0 = no page)")
    demo.add_argument("--unit", choices=("event", "user"), default="event",
                      help="the privacy unit: one page view (default) or one visitor, whose "
                      "contribution is capped (the synthetic events then name their visitor)")
    demo.set_defaults(func=_demo)

    args = parser.parse_args(argv)
    _configure_logging(getattr(args, "log_level", "info"))
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a reader that went away shows here, not as a traceback at exit
        return code
    except BrokenPipeError:  # `dpstream check-config FILE | head -1`: the reader is gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader left
    except DpstreamError as exc:
        print(f"dpstream: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
