"""Golden runs: small deterministic flows whose every output is recorded byte for byte.

A golden run is a configuration (the same tables a TOML file holds), a fixed noise key, a fixed
flow instance id and a deterministic list of raw input records. :func:`run_flow` runs one
through the real Bytewax dataflow in memory (one worker) and returns every output record as a
consumer of its topic would read it: ``(topic, key, value)`` bytes, in the order the flow
published them (one worker publishes in a deterministic order; the recorder checks that two
recordings are identical).

Recovery stores: :func:`run_flow` with ``recovery_dir`` binds the flow instance to the
directory as a deployment does (the instance manifest beside the Bytewax store) and runs the
input with a crash (``TestingSource.ABORT``) after ``stop_after`` records, after which the
store holds the snapshot of the last epoch; a second call with the same arguments resumes it
and reads the rest of the input. ``tests/golden/record.py`` records both with a baseline
version; ``tests/test_golden.py`` checks the current code against them.

Everything this module needs from dpstream is imported in :func:`run_flow` and
:func:`bind_store`: configuration parsing, the flow kind's binding, the instance binding and
the platform's ``build_flow``. When modules move, adapt those imports here.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import pickle
import random
import shutil
import sqlite3
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ORIGIN = 1_790_000_000  # 2026-09-21T14:13:20Z, an arbitrary whole second
ORIGIN_ISO = "2026-09-21T14:13:20Z"
INSTANCE = "601d0000000000000000000000000023"
"""The flow instance id of every golden run (32 hex digits, as a durable instance's)."""
CREATE_TIME = 1
"""Kafka's timestamp type of a producer-stamped record (CreateTime)."""
LOG_APPEND_TIME = 2
"""Kafka's timestamp type of a broker-stamped record (LogAppendTime)."""
TICK = b'{"dpstream.tick":1}'
"""A heartbeat tick's value (it moves its partition's clock and is otherwise skipped)."""

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "golden"
STORES_DIR = GOLDEN_DIR / "stores"

RawMessage = tuple[int, bytes, int, str, int, int]
"""(partition, value, offset, topic, broker time in ms, timestamp type), as the source reads."""
Output = tuple[str, bytes | None, bytes]
"""(topic, key, value) of one published record."""


@dataclass(frozen=True)
class GoldenRun:
    """One deterministic run: configuration, noise key seed, input partitions and records."""

    name: str
    config: dict[str, Any]
    messages: Callable[[], list[RawMessage]]
    partitions: int | dict[str, int] = 2
    noise_seed: int = 23
    batch: int = 50
    stop_after: int | None = None
    """With a recovery store: the records read before the crash (the rest on resume)."""
    skip: tuple[tuple[str, int, int], ...] = ()
    """Records the operator quarantined: (topic, partition of that topic, offset)."""
    resumes: tuple[tuple[str, dict[str, Any]], ...] = ()
    """Other configurations the store is also resumed under: (name, tables to update)."""


# -- input records ------------------------------------------------------------------------

def _raw(partition: int, value: bytes, offset: int, broker: float, topic: str = "events"
         ) -> RawMessage:
    return (partition, value, offset, topic, round(broker * 1000), LOG_APPEND_TIME)


def _in_time_order(items: list[RawMessage]) -> list[RawMessage]:
    return sorted(items, key=lambda m: (m[4], m[0], m[2]))


def _counter_events(steps: int, rates: dict[str, int], seed: int, partitions: int = 2
                    ) -> list[RawMessage]:
    rng = random.Random(seed)
    offsets = [0] * partitions
    out = []
    for step in range(steps):
        batch = []
        for key, rate in rates.items():
            n = rng.randint(rate // 2, rate) if rate else 0
            batch += [(key, ORIGIN + step + rng.random() * 0.99) for _ in range(n)]
        batch.sort(key=lambda e: e[1])
        for key, ts in batch:
            p = rng.randrange(partitions)
            out.append(_raw(p, json.dumps({"key": key, "ts": ts}).encode(), offsets[p], ts))
            offsets[p] += 1
    return out


BAD_COUNTER_RECORDS: list[bytes] = [
    b"not json", b"[1,2]", b'{"ts": 1}', b'{"key": "a"}', b'{"key": "a", "ts": "soon"}',
    b"\xff\xfe", json.dumps({"key": "zzz", "ts": ORIGIN + 1}).encode(),
    json.dumps({"key": "a", "ts": ORIGIN - 100}).encode(),
    json.dumps({"key": "a", "ts": ORIGIN + 0.5}).encode(),
]


def _declared_events() -> list[RawMessage]:
    items = _counter_events(10, {"a": 8, "b": 3, "c": 0}, seed=1)
    offset = 10_000
    for value in BAD_COUNTER_RECORDS:  # the last one's broker time is in step 0, long closed
        late = value is BAD_COUNTER_RECORDS[-1]
        items.append(_raw(0, value, offset, ORIGIN + (0.5 if late else 4.9)))
        offset += 1
    return items


def _producer_events() -> list[RawMessage]:
    """Events stamped by their producers (CreateTime), heartbeat ticks every 0.5 s on each
    partition through 7 s, a late event, one beyond the clock skew, some after flow.end."""
    rng = random.Random(5)
    items: list[tuple[float, int, bytes, float]] = []  # (arrival, partition, value, stamp)
    for step in range(7):
        for key, rate in (("a", 6), ("b", 2)):
            for _ in range(rng.randint(rate // 2, rate)):
                t = step + rng.random() * 0.99
                items.append((t, rng.randrange(2), json.dumps({"key": key, "ts": ORIGIN + t})
                              .encode(), t))
    items.append((6.9, 0, json.dumps({"key": "a", "ts": ORIGIN + 0.3}).encode(), 0.3))  # late
    items.append((4.4, 1, json.dumps({"key": "b", "ts": ORIGIN + 4.4}).encode(), 9000.0))
    for k in range(1, 15):
        for partition in (0, 1):
            items.append((k * 0.5 + 1e-6, partition, TICK, k * 0.5))
    items.sort(key=lambda item: (item[0], item[1]))
    offsets = [0, 0]
    out = []
    for _arrival, partition, value, stamp in items:
        out.append((partition, value, offsets[partition], "events",
                    round((ORIGIN + stamp) * 1000), CREATE_TIME))
        offsets[partition] += 1
    return out


def _open_events() -> list[RawMessage]:
    """A hot key, a warm one never admitted, a rare one (one event), and a slow key that
    crosses the threshold only in the second monitor window."""
    items = _counter_events(14, {"hot": 40, "warm": 6}, seed=2)
    rng = random.Random(9)
    offset = 10**5
    for step in range(14):
        for _ in range(2 if step < 10 else 60):
            ts = ORIGIN + step + rng.random() * 0.99
            items.append(_raw(1, json.dumps({"key": "slow", "ts": ts}).encode(), offset, ts))
            offset += 1
    items.append(_raw(0, json.dumps({"key": "rare", "ts": ORIGIN + 13.5}).encode(), 10**6,
                      ORIGIN + 13.5))
    return _in_time_order(items)


def _counters(accounting: str, mode: str, **tables: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "flow": {"name": "golden", "origin": ORIGIN_ISO, "step": "1s", "shards": 3},
        "privacy": {"accounting": accounting, "budget": 1.0, "delta": 1e-6},
        "metrics": {"port": 0},
    }
    if mode == "declared":
        raw["admission"] = {"mode": "declared", "keys": ["a", "b", "c"]}
        raw["counter"] = ({"epsilon": 0.6, "horizon": 8} if accounting == "pure"
                          else {"rho": 0.6, "horizon": 16})
    else:
        raw["admission"] = {"mode": "open",
                            "initial_epsilon" if accounting == "pure" else "initial_rho": 0.2}
        raw["monitor"] = {"epsilon": 0.3 if accounting == "pure" else 0.5, "horizon": 10}
        raw["counter"] = ({"epsilon": 0.4, "horizon": 32} if accounting == "pure"
                          else {"rho": 0.25, "horizon": 32})
    for table, values in tables.items():
        raw.setdefault(table, {}).update(values)
    return raw


UNIVERSE = [{"name": "country", "values": ["de", "fr", "uk"]},
            {"name": "age", "edges": [0, 18, 40, 120]}]
PMWG_PARTITIONS = {"events": 2, "queries": 1}  # the questions' partition is input partition 2


def _pmwg_config() -> dict[str, Any]:
    return {
        "flow": {"kind": "pmwg", "name": "golden", "origin": ORIGIN_ISO, "step": "1s",
                 "shards": 3},
        "privacy": {"accounting": "pure", "budget": 4.0},
        "metrics": {"port": 0},
        "histograms": [
            {"name": "h", "universe": UNIVERSE, "epsilon": 0.9, "size_epsilon": 2.0,
             "size_horizon": 32, "alpha": 0.1, "n": 300, "mode": "practical",
             "hard_queries": 4},
            {"name": "g", "mechanism": "histogram", "epsilon": 0.09, "size_epsilon": 0.5,
             "size_horizon": 32, "n": 600, "universe": UNIVERSE[:1]},
        ],
    }


def _question(qid: str, query: Any, histogram: str = "h") -> bytes:
    return json.dumps({"id": qid, "histogram": histogram,
                       "query": {"schema": "dpstream.query/1", **query}}).encode()


QUESTIONS: list[tuple[str, dict[str, Any]]] = [
    ("h", {"kind": "count", "where": [{"attr": "country", "eq": "de"}]}),
    ("h", {"kind": "count", "where": [{"attr": "country", "eq": "fr"},
                                      {"attr": "age", "range": [18, 120]}]}),
    ("h", {"kind": "marginal", "attrs": ["country"]}),
    ("g", {"kind": "count", "where": [{"attr": "country", "eq": "de"}]}),
]


def _pmwg_events() -> list[RawMessage]:
    rng = random.Random(3)
    items: list[RawMessage] = []
    offsets = [0, 0, 0]
    for step in range(10):
        for _ in range(150):
            p = rng.randrange(2)
            country = rng.choices(["de", "fr", "uk"], [5, 3, 2])[0]
            ts = ORIGIN + step + rng.random() * 0.9
            body = json.dumps({"country": country, "age": rng.uniform(0, 100), "ts": ts})
            items.append(_raw(p, body.encode(), offsets[p], ts, "events"))
            offsets[p] += 1
        for i, (histogram, query) in enumerate(QUESTIONS):
            items.append(_raw(2, _question(f"s{step}-{i}", query, histogram), offsets[2],
                              ORIGIN + step + 0.95, "queries"))
            offsets[2] += 1
    bad_events = [b"not json", json.dumps({"country": "xx", "age": 3, "ts": ORIGIN + 4.2}).encode(),
                  json.dumps({"country": "de", "ts": ORIGIN + 4.3}).encode()]
    for value in bad_events:
        items.append(_raw(0, value, offsets[0], ORIGIN + 4.5, "events"))
        offsets[0] += 1
    bad_questions = [b"{", _question("bad-h", {"kind": "count"}, "nope"),
                     _question("bad-q", {"kind": "count", "where": [{"attr": "x", "eq": 1}]})]
    for value in bad_questions:
        items.append(_raw(2, value, offsets[2], ORIGIN + 5.5, "queries"))
        offsets[2] += 1
    return _in_time_order(items)


ERM_DIMENSION = 3
_TRUE_W = (2.0, -1.5, 1.0)


def _erm_events(steps: int = 6, rate: int = 60, classes: tuple[str, ...] = ("no", "yes"),
                bad: bool = False) -> Callable[[], list[RawMessage]]:
    def make() -> list[RawMessage]:
        rng = random.Random(4)
        items: list[RawMessage] = []
        offsets = [0, 0]
        for step in range(steps):
            for _ in range(rate):
                p = rng.randrange(2)
                x = [rng.gauss(0, 1) for _ in range(ERM_DIMENSION)]
                score = sum(w * v for w, v in zip(_TRUE_W, x, strict=True)) + rng.gauss(0, 0.5)
                label = (classes[int(score > 0)] if len(classes) == 2
                         else classes[min(len(classes) - 1, max(0, int(score + 1.5)))])
                ts = ORIGIN + step + rng.random() * 0.9
                body = {"features": x, "label": label, "s": rng.choice("ab"), "ts": ts}
                items.append(_raw(p, json.dumps(body).encode(), offsets[p], ts))
                offsets[p] += 1
        if bad:
            for value in [b"not json", json.dumps({"features": [1, 2], "label": "no", "s": "a",
                                                   "ts": ORIGIN + 2.1}).encode(),
                          json.dumps({"features": [0, 0, 0], "label": "maybe", "s": "a",
                                      "ts": ORIGIN + 2.2}).encode(),
                          json.dumps({"features": [0, 0, 0], "label": "no", "s": "zz",
                                      "ts": ORIGIN + 2.3}).encode()]:
                items.append(_raw(0, value, offsets[0], ORIGIN + 2.5))
                offsets[0] += 1
        return _in_time_order(items)
    return make


def _erm(algorithm: str, accounting: str = "pure", classes: tuple[str, ...] = ("no", "yes"),
         **release: Any) -> dict[str, Any]:
    privacy: dict[str, Any] = ({"accounting": "pure", "epsilon": 1.0} if accounting == "pure"
                               else {"accounting": "zcdp", "rho": 0.5})
    model: dict[str, Any] = {"classes": list(classes), "dimension": ERM_DIMENSION,
                             "clip_norm": 3.0, "regularization": 0.05}
    if accounting == "pure" and algorithm != "ermg":  # recorded with output perturbation
        model["learner"] = "output"
    if algorithm == "ermg":
        privacy = {"epsilon": 1.0, "delta": 1e-6}
        rel: dict[str, Any] = {"algorithm": "ermg", "block_size": 60, "first_blocks": 2}
    else:
        model.update({"streams": ["a", "b"], "stream_field": "s"})
        rel = {"algorithm": algorithm, "block_size": 60, "base_blocks": 2}
    rel.update(release)
    return {
        "flow": {"kind": "erm", "name": "golden", "origin": ORIGIN_ISO, "step": "1s",
                 "shards": 2},
        "privacy": privacy, "metrics": {"port": 0}, "model": model, "release": rel,
    }


def _erm_run(name: str, algorithm: str, **release: Any) -> GoldenRun:
    return GoldenRun(name, _erm(algorithm, **release), _erm_events())


RUNS: list[GoldenRun] = [
    # counters: binary tree under pure epsilon, declared keys, a budget exhausted at the
    # counter's horizon (status records), dead letters of bad records
    GoldenRun("counters-pure-declared", _counters("pure", "declared"), _declared_events),
    # BLT under zCDP, declared keys, exhausted likewise; releases only every 2nd step
    GoldenRun("counters-zcdp-declared-every2",
              _counters("zcdp", "declared", release={"every": 2}), _declared_events),
    # the producer clock (heartbeat ticks), lateness, flow.end closing every step before it at
    # the end of the input; two records quarantined by the operator
    GoldenRun("counters-producer-clock-end",
              _counters("pure", "declared", flow={"clock": "producer", "lateness": "1s",
                                                  "end": "2026-09-21T14:13:27Z",
                                                  "max_skew": "1h"}),
              _producer_events, skip=(("events", 0, 3), ("events", 1, 0))),
    # open universe: threshold monitor alerts, admission with an initial count
    GoldenRun("counters-pure-open", _counters("pure", "open"), _open_events),
    GoldenRun("counters-zcdp-open", _counters("zcdp", "open"), _open_events),
    # PMWG: the pmwg and histogram mechanisms, answers (easy, hard, marginal, waiting, error)
    GoldenRun("pmwg", _pmwg_config(), _pmwg_events, partitions=PMWG_PARTITIONS),
    # ERM: every release schedule, with and without sampling, and zCDP multinomial
    GoldenRun("erm-continual", _erm("continual"), _erm_events(bad=True)),
    _erm_run("erm-multi-resolution", "multi-resolution"),
    _erm_run("erm-sliding-window", "sliding-window", window_blocks=3),
    _erm_run("erm-independent", "independent"),
    _erm_run("erm-continual-sampling", "continual", sampling=True),
    _erm_run("erm-multi-resolution-sampling", "multi-resolution", sampling=True),
    _erm_run("erm-sliding-window-sampling", "sliding-window", window_blocks=3, sampling=True),
    GoldenRun("erm-ermg", _erm("ermg"), _erm_events()),
    GoldenRun("erm-continual-end",
              {**_erm("continual"), "flow": {"kind": "erm", "name": "golden",
                                             "origin": ORIGIN_ISO, "step": "1s", "shards": 2,
                                             "end": "2026-09-21T14:13:26Z"}},
              _erm_events()),
    GoldenRun("erm-zcdp-multinomial",
              _erm("continual", accounting="zcdp", classes=("lo", "mid", "hi")),
              _erm_events(classes=("lo", "mid", "hi"))),
]
"""Every golden run; together they publish every output record kind of every flow kind."""

STORE_RUNS: dict[str, GoldenRun] = {
    # resumed as it was, and under a raised budget (the budget may change under an instance)
    "counters": GoldenRun("store-counters", _counters("pure", "open"), _open_events,
                          batch=20, stop_after=400,
                          resumes=(("raised-budget", {"privacy": {"budget": 2.0}}),)),
    "pmwg": GoldenRun("store-pmwg", _pmwg_config(), _pmwg_events,
                      partitions=PMWG_PARTITIONS, batch=100, stop_after=800),
    "erm": GoldenRun("store-erm", _erm("continual"), _erm_events(), batch=40, stop_after=250),
}
"""One run per flow kind that leaves a recovery store after ``stop_after`` records."""


def status_records() -> list[Output]:
    """Budget status records (``dpstream.status/1``), encoded as the counters flow does.

    No valid configuration exhausts a budget in a flow run: the configuration is refused
    unless the budget pays every charge one key can make, and a resume under another budget
    is checked the same way. The records are encoded here directly, by the encoder the
    counters flow publishes them with. (This and :func:`run_flow` are the only places that
    import dpstream.)
    """
    from dpstream.core.counting.outputs import BudgetExhausted
    from dpstream.kinds.counters.records import RecordEncoder
    from dpstream.platform import output_topics, parse_config

    out: list[Output] = []
    for accounting, unit, delta in (("pure", "epsilon", 0.0), ("zcdp", "rho", 1e-6)):
        config = parse_config(_counters(accounting, "declared"))
        topics = output_topics(config)
        encoder = RecordEncoder(config.name, config.origin, config.step_seconds, delta,
                                instance=INSTANCE)
        for status in (BudgetExhausted("a", 7, "tree counter", "budget of 1 exhausted", 1.0,
                                       0.5, unit),
                       BudgetExhausted("ü\"b", 10**6, "counter", "refused: 1.2 > 1", 0.6,
                                       0.6, unit)):
            role, key, value = encoder.encode(status)
            out.append((topics[role], key, value))
    return out


# -- running ------------------------------------------------------------------------------

def bind_store(run: GoldenRun, recovery_dir: Path) -> str:
    """Bind ``run``'s flow instance to ``recovery_dir`` as a deployment does; its id.

    Raises whatever the instance binding raises for a store it refuses.
    """
    from dpstream.core.noise.keys import NoiseKey
    from dpstream.instance import bind_instance
    from dpstream.platform import flow_kind, parse_config

    config = parse_config(run.config)
    noise = NoiseKey.for_tests(run.noise_seed)
    instance = bind_instance(config, flow_kind(config.kind).binding(config), noise,
                             recovery_dir, instance_id=INSTANCE)
    return instance.id


def resumed_under(run: GoldenRun, name: str) -> GoldenRun:
    """``run`` under its resume configuration ``name`` (see :attr:`GoldenRun.resumes`)."""
    changes = dict(run.resumes)[name]
    config = {table: dict(values) if isinstance(values, dict) else values
              for table, values in run.config.items()}
    for table, values in changes.items():
        config.setdefault(table, {}).update(values)
    return GoldenRun(f"{run.name}-{name}", config, run.messages, run.partitions, run.noise_seed,
                     run.batch, run.stop_after)


def run_flow(run: GoldenRun, recovery_dir: Path | None = None, *, crash: bool = False
             ) -> list[Output]:
    """Run ``run`` through the real Bytewax dataflow in memory; every record it published.

    With ``recovery_dir`` (a Bytewax store, initialised) the flow instance is bound to it and
    snapshots are taken at every epoch. With ``crash``, the input crashes after
    ``run.stop_after`` records; without, the store is resumed where its snapshot left the
    input, and the flow reads the rest.
    """
    from datetime import timedelta

    from bytewax.recovery import RecoveryConfig
    from bytewax.testing import TestingSink, TestingSource, run_main

    from dpstream.core.noise.keys import NoiseKey
    from dpstream.platform import build_flow, output_topics, parse_config

    config = parse_config(run.config)
    topics = output_topics(config)
    items: list[Any] = list(run.messages())
    recovery = None
    instance = INSTANCE
    if recovery_dir is not None:
        if crash:
            assert run.stop_after is not None, f"{run.name} has no stop_after"
            items = items[:run.stop_after] + [TestingSource.ABORT()] + items[run.stop_after:]
        instance = bind_store(run, recovery_dir)
        recovery = RecoveryConfig(str(recovery_dir))
    sink: list[tuple[str, bytes | None, bytes]] = []
    flow = build_flow(config, NoiseKey.for_tests(run.noise_seed), instance=instance,
                      partitions=run.partitions, source=TestingSource(items, run.batch),
                      sink=TestingSink(sink),
                      skip_records=run.skip)  # type: ignore[arg-type]  # triples are accepted
    if recovery is None:
        run_main(flow)
    else:
        run_main(flow, epoch_interval=timedelta(0), recovery_config=recovery)
    return [(topics[role], key, value) for role, key, value in sink]


def init_store(directory: Path, partitions: int = 1) -> None:
    """A new, private Bytewax recovery store in ``directory``."""
    from bytewax.recovery import init_db_dir

    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    init_db_dir(directory, partitions)


def copy_store(source: Path, target: Path) -> None:
    """Copy a committed store to ``target``, private (git keeps no permissions but x)."""
    shutil.copytree(source, target)
    os.chmod(target, 0o700)
    for path in target.iterdir():
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)


def pickled_globals(store: Path) -> list[str]:
    """Every Bytewax step with a snapshot in ``store``, and every ``module.name`` one pickles.

    Lines ``step <step id> <state keys>``, then ``global <module>.<name>`` (sorted): each
    snapshot is unpickled with an unpickler that records every class or function it loads.
    """
    found: set[str] = set()
    steps: dict[str, set[str]] = {}

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found.add(f"{module}.{name}")
            return super().find_class(module, name)

    for part in sorted(store.glob("part-*.sqlite3")):
        with contextlib.closing(sqlite3.connect(part)) as db:
            for step, key, blob in db.execute("SELECT step_id, state_key, ser_change FROM snaps"):
                steps.setdefault(step, set()).add(key)
                if blob is not None:
                    Recording(io.BytesIO(blob)).load()
    return ([f"step {step} {' '.join(sorted(keys))}" for step, keys in sorted(steps.items())]
            + [f"global {name}" for name in sorted(found)])


# -- recording format ---------------------------------------------------------------------

def _bytes_field(name: str, data: bytes | None) -> dict[str, Any]:
    if data is None:
        return {name: None}
    try:
        return {name: data.decode("utf-8")}
    except UnicodeDecodeError:
        return {f"{name}_base64": base64.b64encode(data).decode("ascii")}


def _field_bytes(line: dict[str, Any], name: str) -> bytes | None:
    if f"{name}_base64" in line:
        return base64.b64decode(line[f"{name}_base64"])
    value = line[name]
    return None if value is None else str(value).encode("utf-8")


def encode_outputs(outputs: Iterable[Output]) -> str:
    """One JSON line per record: topic, key and value (UTF-8 text, or base64 if not)."""
    lines = []
    for topic, key, value in outputs:
        line = {"topic": topic, **_bytes_field("key", key), **_bytes_field("value", value)}
        lines.append(json.dumps(line, ensure_ascii=False, sort_keys=True))
    return "".join(line + "\n" for line in lines)


def decode_outputs(text: str) -> list[Output]:
    """The records :func:`encode_outputs` wrote, as bytes."""
    out: list[Output] = []
    for raw_line in text.splitlines():
        line = json.loads(raw_line)
        value = _field_bytes(line, "value")
        assert value is not None
        out.append((line["topic"], _field_bytes(line, "key"), value))
    return out


def by_topic(outputs: Iterable[Output]) -> dict[str, list[tuple[bytes | None, bytes]]]:
    """Each topic's records in publication order (what a consumer of that topic compares)."""
    topics: dict[str, list[tuple[bytes | None, bytes]]] = {}
    for topic, key, value in outputs:
        topics.setdefault(topic, []).append((key, value))
    return topics


def difference(expected: list[Output], actual: list[Output]) -> str | None:
    """None if equal per topic; else a readable account of the first differences."""
    want, got = by_topic(expected), by_topic(actual)
    problems: list[str] = []
    for topic in sorted(set(want) | set(got)):
        a, b = want.get(topic, []), got.get(topic, [])
        if a == b:
            continue
        problems.append(f"topic {topic}: {len(a)} records recorded, {len(b)} now")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                at = next((j for j, (p, q) in enumerate(zip(x[1], y[1], strict=False))
                           if p != q), min(len(x[1]), len(y[1])))
                problems.append(f"  first difference at record {i} (value byte {at}: "
                                f"{x[1][max(0, at - 30):at + 30]!r} recorded, "
                                f"{y[1][max(0, at - 30):at + 30]!r} now):\n"
                                f"    recorded key={x[0]!r}\n    recorded value={x[1]!r}\n"
                                f"    now      key={y[0]!r}\n    now      value={y[1]!r}")
                break
        else:
            extra = a[len(b):] or b[len(a):]
            problems.append(f"  then {'missing' if len(a) > len(b) else 'extra'}: {extra[0]!r}")
    return "\n".join(problems) or None
