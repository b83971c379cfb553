"""Encoding a release column (issue 9): ns per record, bulk (numpy) against the previous code.

In one process, on one core, interleaved; each figure is the median of ``--repeats`` rounds.
A column of ``--sizes`` releases (keys ``item-0001234``) of one closed step, with float64
values that are noisy counts (integers between -20 and 40) or quarters (-20.0 to 40.0 in
steps of 0.25: 3.25, -0.5, ...):

* ``bulk``: :meth:`RecordEncoder.encode_step`, the records built with numpy into one buffer
  (an :class:`~dpstream.stream.encoded.EncodedColumn`);
* ``previous``: the bulk encoder before it (a copy of its ``_bulk`` is below): the same
  template and ``orjson`` texts, each record formatted by ``template % (key, value)``, a list
  of triples;
* ``per release``: :meth:`RecordEncoder.encode` on each release (one ``orjson.dumps`` of a
  dict per record).

Each round runs every method in turn, three times: once after the other methods (*cold*:
their objects have left the caches, and freed memory may have gone back to the system, so
new buffers are page-faulted in, as in a flow where a step's encoding follows the shard's
close and the sink), once more right after (*warm*), and once followed by listing the
triples as the Kafka sink does (``pending.extend(item)``, kept until delivered: the bulk
column slices each key and record out of its buffer then). Whatever a run made is dropped
before the next. The three methods give the same bytes (checked before timing).

Usage::

    python bench/encode_speed.py                       # prints the table
    python bench/encode_speed.py --out issue9-encode   # and writes results/issue9-encode.*
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from dpstream import schemas
from dpstream.core.counting.outputs import ReleaseColumns, StepOutputs
from dpstream.kinds.counters.records import _KEY_MARK, _NUMPY, _VALUE_MARK, RecordEncoder
from dpstream.messages import Encoded

RESULTS = Path(__file__).resolve().parent / "results"
ORIGIN = datetime(2026, 9, 21, 14, 13, 20, tzinfo=UTC)
STEP = 123_456


def previous_bulk(role: str, body: dict[str, Any], keys: list[str], values: np.ndarray | None
                  ) -> list[Encoded] | None:
    """``records._bulk`` before the numpy assembly (verbatim): the baseline."""
    text = orjson.dumps(body, option=_NUMPY)
    key_mark, value_mark = orjson.dumps(_KEY_MARK), orjson.dumps(_VALUE_MARK)
    if text.count(key_mark) != 1 or text.count(value_mark) != (values is not None):
        return None  # a marker inside another field (e.g. the flow's name)
    head, tail = text.replace(b"%", b"%%").split(key_mark)
    if values is not None and value_mark not in tail:
        return None  # the templates put the key first
    try:
        keys_json = orjson.dumps(keys)
    except (orjson.JSONEncodeError, TypeError):  # e.g. a lone surrogate: as encode fails
        return None
    if b"\\" in keys_json:  # some key needed escaping: its JSON differs from its bytes
        names = [key.encode() for key in keys]
        quoted: list[bytes] = list(map(orjson.dumps, keys))
        template = head + b"%s" + tail
    else:
        names = quoted = keys_json[2:-2].split(b'","')
        template = head + b'"%s"' + tail
    if values is None:
        records = list(map(template.__mod__, quoted))
    else:
        texts = orjson.dumps(np.ascontiguousarray(values), option=_NUMPY)[1:-1].split(b",")
        template = template.replace(value_mark, b"%s")
        records = list(map(template.__mod__, zip(quoted, texts, strict=True)))
    return list(zip(repeat(role), names, records))


def previous_encode_step(encoder: RecordEncoder, outputs: StepOutputs) -> list[Encoded]:
    """What ``encode_step`` did for a step of release columns before (the baseline)."""
    records: list[Encoded] = []
    for c in outputs.releases:
        body = schemas.to_builtins(encoder._release(_KEY_MARK, c.step, _VALUE_MARK, c.std,
                                                    c.mechanism, c.spent, c.budget, c.unit,
                                                    c.delta))
        bulk = previous_bulk("releases", body, c.keys, np.asarray(c.values, np.float64))
        assert bulk is not None
        records.extend(bulk)
    return records


def column(size: int, kind: str, seed: int = 0) -> StepOutputs:
    """A closed step with one release column of ``size`` keys and values of ``kind``."""
    rng = np.random.default_rng(seed)
    if kind == "counts":
        values = rng.integers(-20, 41, size).astype(np.float64)
    else:
        values = rng.integers(-80, 161, size) / 4.0
    keys = [f"item-{i:07d}" for i in range(size)]
    releases = ReleaseColumns(STEP, keys, values, 1.5, "tree-laplace", 0.35, 1.0, "epsilon",
                              0.0)
    return StepOutputs(STEP, [], [], [releases])


def sink(records: Iterable[Encoded]) -> list[Encoded]:
    """The triples listed, as the Kafka sink lists them to produce them."""
    pending: list[Encoded] = []
    pending.extend(records)
    return pending


def timed(run: Callable[[], Any], then_sink: bool) -> tuple[float, int]:
    """Seconds and minor page faults of one run (what it made is dropped before returning)."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.perf_counter()
    result = run()
    listed = sink(result) if then_sink else None
    seconds = time.perf_counter() - started
    del result, listed
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def measure(size: int, kind: str, repeats: int) -> dict[str, Any]:
    """Every method on one column, interleaved, after checking that they agree."""
    encoder = RecordEncoder("bench", ORIGIN, 1.0, 1e-6)
    outputs = column(size, kind)
    per_release = [encoder.encode(release) for release in outputs]
    assert encoder.encode_step(outputs) == per_release
    assert previous_encode_step(encoder, outputs) == per_release
    del per_release
    methods: dict[str, Callable[[], Any]] = {
        "bulk": lambda: encoder.encode_step(outputs),
        "previous": lambda: previous_encode_step(encoder, outputs),
        "per release": lambda: [encoder.encode(release) for release in outputs],
    }
    runs: dict[str, list[tuple[float, int]]] = {}
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        for name, run in methods.items():
            for label, then_sink in ((name, False), (f"{name}, warm", False),
                                     (f"{name} + sink", True)):
                runs.setdefault(label, []).append(timed(run, then_sink))
    return {label: {"ns_per_record": statistics.median(s for s, _ in rows[1:]) / size * 1e9,
                    "page_faults_per_record": statistics.median(f for _, f in rows[1:]) / size,
                    "runs_seconds": [s for s, _ in rows[1:]]}
            for label, rows in runs.items()}


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    columns = ["bulk", "bulk, warm", "previous", "previous, warm", "per release",
               "bulk + sink", "previous + sink"]
    lines = ["| releases | values | " + " | ".join(columns) + " | previous / bulk |",
             "|---|---|" + "---|" * (len(columns) + 1)]
    for case, row in results.items():
        size, kind = case.split(" ", 1)
        ns = {label: row[label]["ns_per_record"] for label in columns}
        cells = [f"{ns[label]:,.0f} ns" for label in columns]
        warm = ns["previous, warm"] / ns["bulk, warm"]
        ratio = f"{ns['previous'] / ns['bulk']:.1f} (warm {warm:.1f})"
        lines.append(f"| {int(size):,} | {kind} | " + " | ".join(cells) + f" | {ratio} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="6250,62500",
                        help="releases per column, comma-separated")
    parser.add_argument("--kinds", default="counts,quarters")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None, help="results name, e.g. issue9-encode")
    args = parser.parse_args()
    results = {f"{size} {kind}": measure(int(size), kind, args.repeats)
               for size in args.sizes.split(",") for kind in args.kinds.split(",")}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    meta = {"command": "python bench/encode_speed.py " + " ".join(sys.argv[1:]),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "python": platform.python_version(), "numpy": np.__version__,
            "orjson": orjson.__version__, "cpus": os.cpu_count(), "load_average_at_end": load}
    lines = [
        "# Encoding a release column: bulk (numpy) against the previous encoder (issue 9)", "",
        f"`{meta['command']}` on {meta['date']}: {meta['cpus']} vCPUs, Python "
        f"{meta['python']}, numpy {meta['numpy']}, orjson {meta['orjson']}; load average at "
        f"the end {load:.2f}.", "",
        f"One process, one core, interleaved; ns per record, the median of {args.repeats} "
        "rounds. One closed step with one release column (keys `item-0001234`; values: "
        "*counts*, integers -20 to 40, or *quarters*, -20 to 40 in steps of 0.25). *bulk*: "
        "`RecordEncoder.encode_step` (numpy assembly into one buffer); *previous*: the bulk "
        "encoder before it (`template % (key, value)` per record); *per release*: "
        "`RecordEncoder.encode` per release. Plain figures are *cold* (each method run after "
        "the others: caches cold, new buffers page-faulted in); *warm*: the same run again "
        "right after; *+ sink*: the triples also listed as the Kafka sink lists them to "
        "produce them (the bulk column slices its buffers then). All three give the same "
        "bytes.", "",
        *table(results),
    ]
    print("\n".join(lines))
    if args.out:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.out}.json").write_text(json.dumps(
            {**meta, "repeats": args.repeats, "results": results}, indent=2))
        (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
