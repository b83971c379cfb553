"""Memory of contribution bounding: bytes a person, at 10 million people, and across periods.

What is measured is the state of :class:`dpstream.core.contribution.ContributionBounder` (issue
24's target: at most 64 bytes a person at L0 = max_groups <= 8, measured with tracemalloc at 10 M
people, and a state that does not grow with the number of periods).

* **people**: for each grouping (``key``: counters, L0 = 8 keys and Linf = 2; ``step``: ERM, 8
  blocks of 4 rows; ``one``: PMWG, 4 rows), ``--people`` people (10 M) arrive over ``--steps``
  steps (1 M new people a step), each with ``--events`` events (counters: over distinct keys
  drawn from ``--keys`` keys, 100 k). *held* is what tracemalloc counts as allocated after the
  last step, with the inputs and outputs freed, less what was allocated before the bounder was
  made: the person columns, the period's key ids (a dict of the keys) and the bounder itself;
  *peak* is tracemalloc's peak over the run (the bounder's state plus a step's inputs and its
  scratch arrays), less the same baseline. Both are divided by the people held.
* **speed**: CPU time per event of :meth:`PersonHasher.hash_many` and of ``keep`` (counters'
  rule), 5 steps of ``--speed-events`` Zipf-distributed events over ``--speed-people`` people
  and ``--keys`` keys, with string keys and with integer key codes.
* **periods**: a period of 2 steps, ``--periods`` periods of 1 M new people each (1 M a step,
  half of them returning in the period's second step); held bytes (less the bench's own array
  of the period's people) and people after each step.
  The previous period's people and key ids are dropped when a later period's first step comes,
  so the held bytes return to the same level every period.

People are random 16-byte values, as their keyed hashes are (the bench measures the state, not
hashing: :class:`dpstream.core.contribution.PersonHasher` gives the same ``V16`` items); keys are
integer codes (an int64 array, the declared positions' path), so that tracemalloc does not spend
the run on 10 M Python objects. Events come one partition, in offset order. *keep ns / event*
is the CPU time (process time, not wall time: the machine is shared) of
:meth:`ContributionBounder.keep` over the events.

Usage::

    python bench/contribution_memory.py                       # 10 M people, the table
    python bench/contribution_memory.py --people 1000000 --steps 4
    python bench/contribution_memory.py --out issue24-contribution-memory
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

from dpstream.core.contribution import BoundingRule, ContributionBounder

RESULTS = Path(__file__).resolve().parent / "results"
RULES = {
    "key": BoundingRule("key", 8, 2),
    "step": BoundingRule("step", 8, 4),
    "one": BoundingRule("one", 1, 4),
}


def step_events(rng: np.random.Generator, people: np.ndarray, events: int, keys: int,
                offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each person ``events`` times (consecutive distinct keys from a random one), in one
    partition in offset order; the events of a person are spread over the step."""
    count = people.size * events
    who = np.tile(people, events)
    first_key = rng.integers(0, keys, people.size)
    key = (np.tile(first_key, events) + np.repeat(np.arange(events), people.size)) % keys
    return who, key.astype(np.int64), np.zeros(count, np.int64), \
        np.arange(offset, offset + count, dtype=np.int64)


def new_people(rng: np.random.Generator, count: int) -> np.ndarray:
    return np.frombuffer(rng.bytes(16 * count), dtype="V16")


def people_run(grouping: str, people: int, steps: int, events: int, keys: int,
               seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    per_step = people // steps
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    bounder = ContributionBounder(RULES[grouping])
    offset, seconds, kept = 0, 0.0, 0
    for step in range(steps):
        who, key, partition, offsets = step_events(rng, new_people(rng, per_step), events, keys,
                                                   offset)
        offset += who.size
        start = time.process_time()
        keep, _first = bounder.keep(step, who, key, partition, offsets)
        seconds += time.process_time() - start
        kept += int(keep.sum())
        del who, key, partition, offsets, keep, _first
    gc.collect()
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    held, peak = held - base, peak - base
    return {"grouping": grouping, "rule": RULES[grouping].to_dict(), "people": bounder.people,
            "events": people * events, "kept": kept, "columns_bytes": bounder.nbytes,
            "held_bytes": held, "peak_bytes": peak,
            "columns_per_person": bounder.nbytes / bounder.people,
            "held_per_person": held / bounder.people, "peak_per_person": peak / bounder.people,
            "keep_seconds": seconds, "ns_per_event": 1e9 * seconds / (people * events)}


def periods_run(periods: int, per_period: int, events: int, keys: int,
                seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    rule = BoundingRule("key", 8, 2, period_steps=2)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    bounder = ContributionBounder(rule)
    rows, offset = [], 0
    for step in range(2 * periods):
        if step % 2 == 0:
            cohort = new_people(rng, per_period)
            arriving = cohort
        else:  # half of the period's people return in its second step
            arriving = cohort[: per_period // 2]
        who, key, partition, offsets = step_events(rng, arriving, events, keys, offset)
        offset += who.size
        bounder.keep(step, who, key, partition, offsets)
        del who, key, partition, offsets
        gc.collect()
        # the bench's own cohort array (the period's people, for its second step) is not state
        held = tracemalloc.get_traced_memory()[0] - base - cohort.nbytes
        rows.append({"step": step, "period": bounder.period, "people": bounder.people,
                     "held_bytes": held, "held_per_person": held / bounder.people})
    tracemalloc.stop()
    return rows


def speed_run(events: int, people: int, keys: int, steps: int, seed: int) -> list[dict[str, Any]]:
    """CPU time of hashing and of ``keep`` on Zipf-distributed people and keys (s = 1.3).

    Each step has ``events`` events over ``people`` people and ``keys`` keys (string keys, as
    decoded, and the same as integer codes), two partitions interleaved in offset order.
    """
    from dpstream.core.contribution import PersonHasher

    rng = np.random.default_rng(seed)
    ids = [f"person-{i}" for i in range(people)]
    names = [f"key-{i}" for i in range(keys)]
    hasher = PersonHasher(bytes(range(32)))
    rows = []
    for label in ("string keys", "integer keys"):
        bounder = ContributionBounder(RULES["key"])
        hash_s = keep_s = 0.0
        for step in range(steps):
            who = (rng.zipf(1.3, events) - 1) % people
            what = (rng.zipf(1.3, events) - 1) % keys
            batch = [ids[i] for i in who.tolist()]
            groups: Any = [names[i] for i in what.tolist()] if label == "string keys" else what
            partition = np.arange(events, dtype=np.int64) % 2
            offsets = np.arange(events, dtype=np.int64) // 2 + step * events
            start = time.process_time()
            hashes = hasher.hash_many(batch)
            middle = time.process_time()
            bounder.keep(step, hashes, groups, partition, offsets)
            keep_s += time.process_time() - middle
            hash_s += middle - start
        rows.append({"keys": label, "events": events * steps, "people held": bounder.people,
                     "hash_ns_per_event": 1e9 * hash_s / (events * steps),
                     "keep_ns_per_event": 1e9 * keep_s / (events * steps)})
    return rows


def mib(value: float) -> str:
    return f"{value / 2**20:,.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--people", type=int, default=10_000_000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--events", type=int, default=2, help="events a person (distinct keys)")
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--periods", type=int, default=6)
    parser.add_argument("--period-people", type=int, default=1_000_000)
    parser.add_argument("--groupings", default="key,step,one")
    parser.add_argument("--seed", type=int, default=24)
    parser.add_argument("--speed-events", type=int, default=1_000_000,
                        help="events a step of the speed table (0: no speed table)")
    parser.add_argument("--speed-people", type=int, default=1_000_000)
    parser.add_argument("--out", default="", help="write results/<out>.json and .md")
    args = parser.parse_args()

    runs = [people_run(g, args.people, args.steps, args.events, args.keys, args.seed)
            for g in args.groupings.split(",")]
    lines = ["| grouping | rule | people | columns / person | held / person | peak / person "
             "| held | peak | keep ns / event |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rule = r["rule"]
        lines.append(
            f"| {r['grouping']} | {rule['max_groups']} x {rule['max_per_group']} | "
            f"{r['people']:,} | {r['columns_per_person']:.1f} B | {r['held_per_person']:.1f} B | "
            f"{r['peak_per_person']:.1f} B | {mib(r['held_bytes'])} | {mib(r['peak_bytes'])} | "
            f"{r['ns_per_event']:.0f} |")
    period_rows = periods_run(args.periods, args.period_people, args.events, args.keys,
                              args.seed + 1)
    lines += ["", "| step | period | people held | held | held / person |", "|---|---|---|---|---|"]
    for row in period_rows:
        lines.append(f"| {row['step']} | {row['period']} | {row['people']:,} | "
                     f"{mib(row['held_bytes'])} | {row['held_per_person']:.1f} B |")
    speed = (speed_run(args.speed_events, args.speed_people, args.keys, 5, args.seed + 2)
             if args.speed_events else [])
    if speed:
        lines += ["", "| keys | events | people held | hash ns / event | keep ns / event |",
                  "|---|---|---|---|---|"]
        for row in speed:
            lines.append(f"| {row['keys']} | {row['events']:,} | {row['people held']:,} | "
                         f"{row['hash_ns_per_event']:.0f} | {row['keep_ns_per_event']:.0f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        RESULTS.mkdir(exist_ok=True)
        meta = {"args": vars(args), "python": platform.python_version(),
                "numpy": np.__version__, "machine": platform.machine(),
                "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        (RESULTS / f"{args.out}.json").write_text(json.dumps(
            {"meta": meta, "people": runs, "periods": period_rows, "speed": speed},
            indent=1) + "\n")
        print(f"wrote results/{args.out}.json")


if __name__ == "__main__":
    main()
