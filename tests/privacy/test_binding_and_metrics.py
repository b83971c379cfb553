"""Noise bound to the flow instance and the parameters; metrics that carry no exact count.

Issue 5, items 5 and 6.
"""

from __future__ import annotations

import pickle

import pytest
from harness import ORIGIN, CoreFlow, about, make_config, run_core, run_dataflow, stream
from support.recording import RecordingKey

from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import NoiseKeyError, RecoveryMismatchError
from dpstream.kinds.counters.kind import statistics_spec
from dpstream.kinds.counters.shard import ShardState
from dpstream.metrics import FlowMetrics

pytestmark = [pytest.mark.privacy]

NOISE = NoiseKey.for_tests(5)


def declared_stream(skip_first: int = 0):
    items = [(t % 2, "a", t + 0.1 * j) for t in range(20) for j in range(3)]
    return stream(items[skip_first:])


def values(records, key="a"):
    return {b["step"]: b["value"] for r, b in about(records, key) if r == "releases"}


def test_a_reprocessing_is_a_new_instance_with_independent_noise():
    """The topic minus its first five events, same name and key: the releases must not differ
    by exactly 5 (that difference would be the exact difference of the true counts)."""
    config = make_config("declared", "pure")
    first = values(run_core(config, declared_stream(), NOISE, instance="first"))
    again = values(run_core(config, declared_stream(skip_first=5), NOISE, instance="second"))
    differences = [first[s] - again[s] for s in first if s >= 2]
    assert sum(abs(d - 5) < 1e-6 for d in differences) < len(differences) // 2
    same_instance = values(run_core(config, declared_stream(skip_first=5), NOISE,
                                    instance="first"))
    assert all(abs(first[s] - same_instance[s] - 5) < 1e-6 for s in first if s >= 2)  # control


@pytest.mark.parametrize("changed", [{"counter": {"epsilon": 0.4}},
                                     {"monitor": {"epsilon": 0.25}},
                                     {"monitor": {"threshold": 400}},
                                     {"admission": {"initial_epsilon": 0.15}}])
def test_changed_parameters_draw_noise_at_other_coordinates(changed):
    """Same instance, same key: a changed mechanism never reuses a coordinate (item 6)."""
    items = [(t % 2, "hot", t + 0.5) for t in range(12) for _ in range(80)]
    messages = stream(items)
    calls = []
    for config in (make_config("open", "pure"), make_config("open", "pure", **changed)):
        recorder = RecordingKey(4)
        records = run_core(config, messages, recorder, instance="same")
        assert about(records, "hot")
        calls.append(set(recorder.calls))
    touched = {c[2] for c in calls[0] ^ calls[1]}  # the mechanisms whose coordinates moved
    assert not calls[0] & {c for c in calls[1] if c[2] in touched}


def test_a_recovery_store_resumed_with_another_key_or_instance_is_refused():
    config = make_config("declared", "pure")
    flow = CoreFlow(config, NOISE, "inst", 2)
    for p, batch in enumerate([declared_stream()[:10], declared_stream()[10:20]]):
        flow.feed(p, [m[:0] + (p,) + m[1:] for m in batch])
    state = pickle.loads(pickle.dumps(next(iter(flow.shards.values())).to_state()))
    with pytest.raises(NoiseKeyError, match="another noise key"):
        ShardState(statistics_spec(config, "inst"), 2, None, NoiseKey.for_tests(6), state)
    with pytest.raises(RecoveryMismatchError, match="another flow instance"):
        ShardState(statistics_spec(config, "other"), 2, None, NOISE, state)


def metric_samples(registry):
    return sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                  for m in registry.collect() for s in m.samples
                  if s.name.startswith("dpstream_") and not s.name.endswith("_created"))


@pytest.mark.flow
def test_without_exact_counts_the_metrics_are_the_same_for_neighbours():
    """Item 5: with metrics.exact_counts = false no series moves with one event."""
    config = make_config("declared", "pure", metrics={"exact_counts": False})
    base = declared_stream()
    # mid-stream, in broker-time order: a far-future event and a malformed record
    extra = [m for m in base if m[4] <= (ORIGIN + 10) * 1000]
    extra += [(0, b'{"key": "a", "ts": 1e300}', 10**6, "events", (ORIGIN + 10) * 1000, 2),
              (0, b"{broken", 10**6 + 1, "events", (ORIGIN + 10) * 1000, 2)]
    extra += [m for m in base if m[4] > (ORIGIN + 10) * 1000]
    samples = []
    for messages in (base, extra):  # a fixed wall clock: dpstream_step_lag_seconds reads it
        metrics = FlowMetrics("nb", exact_counts=config.metrics_exact_counts,
                              clock=lambda: ORIGIN + 10**6)
        run_dataflow(config, messages, NOISE, metrics=metrics)
        samples.append(metric_samples(metrics.registry))
    assert samples[0] == samples[1]
    names = {name for name, _, _ in samples[0]}
    assert "dpstream_releases_total" in names
    assert not names & {"dpstream_events_total", "dpstream_dead_letters_total"}
    exact = []
    for messages in (base, extra):  # the default: the operator's exact counts are there
        metrics = FlowMetrics("nb")
        run_dataflow(config, messages, NOISE, metrics=metrics)
        exact.append(metric_samples(metrics.registry))
    assert exact[0] != exact[1]
