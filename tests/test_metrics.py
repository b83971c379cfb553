"""FlowMetrics: every series and method, read back from a fresh registry."""

import math
import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dpstream.kinds.counters.metrics import register_metrics as counters_series
from dpstream.kinds.erm.metrics import register_metrics as erm_series
from dpstream.kinds.pmwg.metrics import register_metrics as pmwg_series
from dpstream.metrics import FlowMetrics

FLOW = "counters"


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(exact_counts=True, now=0.0):
    clock = FakeClock(now)
    metrics = FlowMetrics(FLOW, CollectorRegistry(), exact_counts=exact_counts, clock=clock)
    return metrics, clock


def value(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, {"flow": FLOW, **labels})


def names(metrics):
    return {s.name for family in metrics.registry.collect() for s in family.samples}


def test_up_is_one_from_the_start():
    metrics, _ = make()
    assert value(metrics, "dpstream_up") == 1.0


def test_operational_counters_start_at_zero_so_increase_sees_the_first_one():
    metrics, _ = make()
    for role in ("releases", "alerts", "dead_letters"):
        assert value(metrics, "dpstream_output_delivered_total", role=role) == 0.0
    for client in ("consumer", "producer", "admin"):
        assert value(metrics, "dpstream_kafka_client_errors_total", client=client) == 0.0
    assert value(metrics, "dpstream_output_retries_total") == 0.0
    assert value(metrics, "dpstream_output_pending_records") == 0.0


def test_observe_partition_sets_frontier_and_broker_time_per_partition():
    metrics, _ = make()
    metrics.observe_partition(0, 41, 1_700_000_123.5)
    metrics.observe_partition(3, 40, None)
    assert value(metrics, "dpstream_partition_frontier_step", partition="0") == 41
    broker_time = value(metrics, "dpstream_partition_broker_time_seconds", partition="0")
    assert broker_time == 1_700_000_123.5
    assert value(metrics, "dpstream_partition_frontier_step", partition="3") == 40
    assert value(metrics, "dpstream_partition_broker_time_seconds", partition="3") is None
    metrics.observe_partition(0, None, 1_700_000_200.0)  # None leaves the value as it was
    assert value(metrics, "dpstream_partition_frontier_step", partition="0") == 41
    broker_time = value(metrics, "dpstream_partition_broker_time_seconds", partition="0")
    assert broker_time == 1_700_000_200.0
    metrics.observe_partition(0, 42, None)
    assert value(metrics, "dpstream_partition_frontier_step", partition="0") == 42


def test_observe_shard_aggregates_min_closed_and_max_pending():
    metrics, _ = make()
    assert value(metrics, "dpstream_closed_step") is None
    assert value(metrics, "dpstream_steps_pending") is None
    metrics.observe_shard(0, 10, 1)
    assert value(metrics, "dpstream_closed_step") == 10
    assert value(metrics, "dpstream_steps_pending") == 1
    metrics.observe_shard(5, 7, 4)
    assert value(metrics, "dpstream_closed_step") == 7
    assert value(metrics, "dpstream_steps_pending") == 4
    metrics.observe_shard(5, 12, 0)  # shard 5 catches up: shard 0 is now the slowest
    assert value(metrics, "dpstream_closed_step") == 10
    assert value(metrics, "dpstream_steps_pending") == 1
    metrics.observe_shard(0, 11, 0)
    assert value(metrics, "dpstream_closed_step") == 11
    assert value(metrics, "dpstream_steps_pending") == 0


def test_a_shard_that_closed_nothing_hides_the_closed_step_and_the_lag():
    metrics, clock = make(now=1000.0)
    metrics.set_clock(0.0, 60.0)
    metrics.observe_shard(0, 3, 0)
    assert value(metrics, "dpstream_closed_step") == 3
    metrics.observe_shard(1, None, 2)
    assert value(metrics, "dpstream_closed_step") is None
    assert value(metrics, "dpstream_step_lag_seconds") is None
    assert value(metrics, "dpstream_steps_pending") == 2
    metrics.observe_shard(1, 5, 0)
    assert value(metrics, "dpstream_closed_step") == 3
    assert value(metrics, "dpstream_step_lag_seconds") == 1000.0 - 4 * 60.0


def test_step_lag_is_now_minus_the_end_of_the_closed_step_at_scrape_time():
    origin, step = 1_763_596_800.0, 60.0
    metrics, clock = make(now=origin + 100 * step + 15.0)
    assert value(metrics, "dpstream_step_lag_seconds") is None  # no clock, no closed step
    metrics.observe_shard(0, 98, 1)
    assert value(metrics, "dpstream_step_lag_seconds") is None  # no clock yet
    metrics.set_clock(origin, step)
    # step 98 ends at origin + 99 * step: lag = 1 step + 15 s
    assert value(metrics, "dpstream_step_lag_seconds") == pytest.approx(75.0)
    clock.now += 30.0  # computed when read, not when observed
    assert value(metrics, "dpstream_step_lag_seconds") == pytest.approx(105.0)
    metrics.observe_shard(0, 99, 0)
    assert value(metrics, "dpstream_step_lag_seconds") == pytest.approx(45.0)
    assert metrics.step_lag_seconds() == pytest.approx(45.0)


def test_step_lag_with_fractional_steps():
    metrics, _ = make(now=10.0)
    metrics.set_clock(2.5, 0.5)
    metrics.observe_shard(0, 9, 0)  # step 9 ends at 2.5 + 10 * 0.5 = 7.5
    assert value(metrics, "dpstream_step_lag_seconds") == pytest.approx(2.5)


def test_step_lag_uses_the_wall_clock_by_default():
    metrics = FlowMetrics(FLOW, CollectorRegistry())
    metrics.set_clock(0.0, 1.0)
    metrics.observe_shard(0, 0, 0)
    lag = metrics.registry.get_sample_value("dpstream_step_lag_seconds", {"flow": FLOW})
    assert lag is not None and lag > 1_700_000_000  # now is far past 1970-01-01T00:00:01


@pytest.mark.parametrize(("origin", "step"), [(0.0, 0.0), (0.0, -1.0), (0.0, math.inf),
                                              (0.0, math.nan), (math.nan, 1.0), (math.inf, 1.0)])
def test_set_clock_refuses_a_bad_grid(origin, step):
    metrics, _ = make()
    with pytest.raises(ValueError, match="must be finite"):
        metrics.set_clock(origin, step)


def test_observe_input_lag_per_partition():
    metrics, _ = make()
    metrics.observe_input_lag(0, 1234)
    metrics.observe_input_lag(1, 0)
    assert value(metrics, "dpstream_input_lag_records", partition="0") == 1234
    assert value(metrics, "dpstream_input_lag_records", partition="1") == 0
    metrics.observe_input_lag(0, 17)
    assert value(metrics, "dpstream_input_lag_records", partition="0") == 17


def test_without_exact_counts_no_input_lag_and_no_delivered_dead_letters():
    metrics, _ = make(exact_counts=False)
    metrics.observe_input_lag(0, 1234)
    metrics.observe_delivery(0, {"releases": 3, "dead_letters": 2}, 0)
    assert value(metrics, "dpstream_input_lag_records", partition="0") is None
    assert value(metrics, "dpstream_output_delivered_total", role="dead_letters") is None
    assert value(metrics, "dpstream_output_delivered_total", role="releases") == 3
    exposition = generate_latest(metrics.registry).decode()
    assert "dpstream_input_lag_records" not in exposition
    assert 'role="dead_letters"' not in exposition
    assert not names(metrics) & {"dpstream_events_total", "dpstream_dead_letters_total"}


def test_observe_delivery_counts_by_role_and_sets_pending():
    metrics, _ = make()
    metrics.observe_delivery(12, {"releases": 5, "alerts": 1}, 0)
    metrics.observe_delivery(3, {"releases": 2, "dead_letters": 4, "alerts": 0}, 7)
    assert value(metrics, "dpstream_output_pending_records") == 3
    assert value(metrics, "dpstream_output_delivered_total", role="releases") == 7
    assert value(metrics, "dpstream_output_delivered_total", role="alerts") == 1
    assert value(metrics, "dpstream_output_delivered_total", role="dead_letters") == 4
    assert value(metrics, "dpstream_output_retries_total") == 7
    metrics.observe_delivery(0, {}, 2)
    assert value(metrics, "dpstream_output_pending_records") == 0
    assert value(metrics, "dpstream_output_retries_total") == 9


@pytest.mark.parametrize(("delivered", "retried", "message"), [
    ({"status": 1}, 0,
     "role must be one of releases, alerts, answers, models, dead_letters, got 'status'"),
    ({"releases": -1}, 0, r"delivered\['releases'\] must be >= 0, got -1"),
    ({}, -2, "retried must be >= 0, got -2"),
])
def test_observe_delivery_refuses_bad_input_and_counts_nothing(delivered, retried, message):
    metrics, _ = make()
    with pytest.raises(ValueError, match=message):
        metrics.observe_delivery(5, {"alerts": 1, **delivered}, retried)
    assert value(metrics, "dpstream_output_delivered_total", role="alerts") == 0
    assert value(metrics, "dpstream_output_pending_records") == 0


def test_observe_kafka_error_per_client():
    metrics, _ = make()
    metrics.observe_kafka_error("consumer")
    metrics.observe_kafka_error("consumer")
    metrics.observe_kafka_error("admin")
    assert value(metrics, "dpstream_kafka_client_errors_total", client="consumer") == 2
    assert value(metrics, "dpstream_kafka_client_errors_total", client="producer") == 0
    assert value(metrics, "dpstream_kafka_client_errors_total", client="admin") == 1
    with pytest.raises(ValueError, match="client must be one of consumer, producer, admin"):
        metrics.observe_kafka_error("broker")


def test_every_series_carries_the_flow_label_and_no_other_label_is_unbounded():
    metrics, _ = make(now=100.0)
    metrics.set_clock(0.0, 1.0)
    metrics.observe_partition(0, 5, 6.0)
    metrics.observe_shard(0, 4, 0)
    metrics.observe_input_lag(0, 1)
    metrics.observe_delivery(1, {"releases": 1}, 1)
    metrics.observe_kafka_error("producer")
    allowed = {"flow", "partition", "role", "client", "mechanism", "unit", "reason"}
    samples = [s for family in metrics.registry.collect() for s in family.samples]
    assert {s.name for s in samples} >= {
        "dpstream_up", "dpstream_partition_frontier_step", "dpstream_partition_broker_time_seconds",
        "dpstream_closed_step", "dpstream_steps_pending", "dpstream_step_lag_seconds",
        "dpstream_output_pending_records", "dpstream_output_delivered_total",
        "dpstream_output_retries_total", "dpstream_kafka_client_errors_total",
        "dpstream_input_lag_records"}
    for sample in samples:
        assert sample.labels["flow"] == FLOW, sample
        assert set(sample.labels) <= allowed, sample


def test_concurrent_shards_aggregate_correctly():
    metrics, _ = make()

    def shard(index):
        for closed in range(200):
            metrics.observe_shard(index, closed, 200 - closed)
            metrics.observe_delivery(0, {"releases": 1}, 0)

    threads = [threading.Thread(target=shard, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert value(metrics, "dpstream_closed_step") == 199
    assert value(metrics, "dpstream_steps_pending") == 1
    assert value(metrics, "dpstream_output_delivered_total", role="releases") == 8 * 200


def test_existing_metrics_are_unchanged():
    metrics, _ = make()
    metrics.set_budget("tree", "epsilon", 1.0)
    metrics.observe_input("events", 3)
    metrics.observe_input("dead_letter:malformed", 1)
    assert value(metrics, "dpstream_events_total") == 3
    assert value(metrics, "dpstream_dead_letters_total", reason="malformed") == 1
    assert value(metrics, "dpstream_privacy_budget", mechanism="tree", unit="epsilon") == 1.0
    assert value(metrics, "dpstream_privacy_remaining", mechanism="tree", unit="epsilon") == 1.0
    assert value(metrics, "dpstream_privacy_spent", mechanism="tree", unit="epsilon") == 0.0



# -- every flow kind: kind, budgets, releases, refusals, exhaustion ---------------------------

from dpstream.kinds.erm.shard import ModelRecord  # noqa: E402
from dpstream.kinds.pmwg.shard import AnswerRecord  # noqa: E402


def answer(kind, spent, histogram="h", mechanism="pmwg", kinds=None, reason=None, budget=1.0,
           hard=0):
    value = None if kind in ("bottom", "waiting", "error") else 0.5
    return AnswerRecord(histogram, mechanism, "q", 3, 500, kind, value, kinds, reason, spent,
                        budget, hard)


def model(role, spent, stream="a", budget=2.0, algorithm="continual"):
    from fractions import Fraction  # noqa: PLC0415

    from dpstream.core.erm.model import PrivateModel  # noqa: PLC0415

    private = None if role == "exhausted" else PrivateModel(
        [[0.5, -0.25]], Fraction(1, 4), 0.1, Fraction(1, 2), Fraction(1, 100), 100.0, 100)
    return ModelRecord(stream, algorithm, 4, role, None, 0, 4, (), private, 0.5, spent, budget,
                       None)


def test_set_kind_publishes_the_flow_kind_and_a_counters_flow_alerts_from_zero():
    metrics, _ = make()
    metrics.set_kind("counters")
    assert value(metrics, "dpstream_flow_info", kind="counters") == 1
    assert value(metrics, "dpstream_alerts_total") == 0
    other, _ = make()
    other.set_kind("pmwg")
    assert value(other, "dpstream_flow_info", kind="pmwg") == 1
    assert value(other, "dpstream_alerts_total") is None  # no monitor in a pmwg flow


def test_set_budget_starts_releases_refusals_and_exhaustion_at_zero():
    metrics, _ = make()
    metrics.set_budget("tree-laplace", "epsilon", 1.0)
    assert value(metrics, "dpstream_releases_total", mechanism="tree-laplace") == 0
    assert value(metrics, "dpstream_refused_releases_total", mechanism="tree-laplace") == 0
    assert value(metrics, "dpstream_budget_exhausted", mechanism="tree-laplace") == 0


def test_a_stream_budget_has_no_spend_until_its_first_record():
    """A histogram or model stream: a restarted process shows a gap, not a false 0."""
    metrics, _ = make()
    metrics.set_budget("continual", "rho", 2.0, "a")
    assert value(metrics, "dpstream_privacy_budget", mechanism="continual", unit="rho") == 2.0
    assert value(metrics, "dpstream_privacy_spent", mechanism="continual", unit="rho") is None
    erm_series(metrics).observe_models([model("base", 0.5)])
    assert value(metrics, "dpstream_privacy_spent", mechanism="continual", unit="rho") == 0.5
    assert value(metrics, "dpstream_privacy_remaining", mechanism="continual", unit="rho") == 1.5


def test_pmwg_answers_count_releases_bottoms_and_exhaust_the_mechanism():
    metrics, _ = make()
    metrics.set_budget("pmwg", "epsilon", 1.0, "h")
    pmwg_series(metrics).observe_answers([answer("waiting", 0.2), answer("easy", 0.4),
                             answer("hard", 0.6, hard=1)])
    assert value(metrics, "dpstream_releases_total", mechanism="pmwg") == 2
    assert value(metrics, "dpstream_refused_releases_total", mechanism="pmwg") == 0
    assert value(metrics, "dpstream_budget_exhausted", mechanism="pmwg") == 0
    assert value(metrics, "dpstream_bottom_answers_total", histogram="h", reason="privacy") == 0
    assert value(metrics, "dpstream_privacy_spent", mechanism="pmwg", unit="epsilon") == 0.6
    pmwg_series(metrics).observe_answers([
        answer("bottom", 0.9, reason="privacy budget exhausted"),
        answer("marginal", 0.9, kinds=["hard", "bottom"], reason="hard-query budget exceeded"),
        answer("bottom", 0.9, reason="hard-query budget exceeded")])
    assert value(metrics, "dpstream_bottom_answers_total", histogram="h", reason="privacy") == 1
    assert value(metrics, "dpstream_bottom_answers_total", histogram="h",
                 reason="hard_queries") == 2
    assert value(metrics, "dpstream_refused_releases_total", mechanism="pmwg") == 3
    assert value(metrics, "dpstream_releases_total", mechanism="pmwg") == 3  # the marginal
    assert value(metrics, "dpstream_budget_exhausted", mechanism="pmwg") == 1
    assert value(metrics, "dpstream_privacy_remaining", mechanism="pmwg",
                 unit="epsilon") == pytest.approx(0.1)


def test_the_spend_series_show_the_histogram_closest_to_exhaustion():
    metrics, _ = make()
    metrics.set_budget("pmwg", "epsilon", 2.0, "big")
    metrics.set_budget("pmwg", "epsilon", 1.0, "small")
    pmwg_series(metrics).observe_answers([answer("hard", 1.2, "big", budget=2.0),
                             answer("hard", 0.5, "small", budget=1.0)])
    labels = {"mechanism": "pmwg", "unit": "epsilon"}
    # big: 0.8 left, small: 0.5 left -> small, with its own spent and budget
    assert value(metrics, "dpstream_privacy_spent", **labels) == 0.5
    assert value(metrics, "dpstream_privacy_budget", **labels) == 1.0
    assert value(metrics, "dpstream_privacy_remaining", **labels) == 0.5
    pmwg_series(metrics).observe_answers([answer("hard", 1.8, "big", budget=2.0)])
    assert value(metrics, "dpstream_privacy_spent", **labels) == 1.8
    assert value(metrics, "dpstream_privacy_budget", **labels) == 2.0
    assert value(metrics, "dpstream_privacy_remaining", **labels) == pytest.approx(0.2)
    pmwg_series(metrics).observe_answers([answer("easy", 1.0, "big", budget=2.0)])  # no way back
    assert value(metrics, "dpstream_privacy_spent", **labels) == 1.8


def test_an_undeclared_mechanism_counts_but_publishes_no_spend():
    """The flow kinds declare their budgets (and units) in wire(); without, no unit is known."""
    metrics, _ = make()
    pmwg_series(metrics).observe_answers([answer("hard", 0.6)])
    assert value(metrics, "dpstream_releases_total", mechanism="pmwg") == 1
    assert "dpstream_privacy_spent" not in names(metrics)
    assert value(metrics, "dpstream_histogram_privacy_spent", histogram="h",
                 mechanism="pmwg") == 0.6


def test_erm_models_count_as_releases_and_an_exhausted_stream_as_a_refusal():
    metrics, _ = make()
    for stream in ("a", "b"):
        metrics.set_budget("continual", "epsilon", 2.0, stream)
    erm_series(metrics).observe_models([model("base", 0.5), model("base", 0.5, "b"),
                            model("update", 1.25)])
    assert value(metrics, "dpstream_releases_total", mechanism="continual") == 3
    assert value(metrics, "dpstream_models_released_total", stream="a", role="update") == 1
    assert value(metrics, "dpstream_privacy_spent", mechanism="continual",
                 unit="epsilon") == 1.25
    assert value(metrics, "dpstream_budget_exhausted", mechanism="continual") == 0
    erm_series(metrics).observe_models([model("exhausted", 1.25, "b")])
    assert value(metrics, "dpstream_refused_releases_total", mechanism="continual") == 1
    assert value(metrics, "dpstream_releases_total", mechanism="continual") == 3
    assert value(metrics, "dpstream_budget_exhausted", mechanism="continual") == 1
    metrics.set_budget("continual", "epsilon", 2.0, "c")  # a later declaration keeps it
    assert value(metrics, "dpstream_budget_exhausted", mechanism="continual") == 1


def test_a_counters_refusal_exhausts_its_mechanism():
    from dpstream.core.counting.outputs import BudgetExhausted  # noqa: PLC0415

    metrics, _ = make()
    metrics.set_budget("tree-laplace", "epsilon", 1.0)
    status = BudgetExhausted("k", 7, "tree-laplace", "budget lowered", 0.9, 0.5, "epsilon")
    counters_series(metrics).observe_outputs([status], "tree-laplace")
    assert value(metrics, "dpstream_refused_releases_total", mechanism="tree-laplace") == 1
    assert value(metrics, "dpstream_budget_exhausted", mechanism="tree-laplace") == 1


def test_the_labels_of_every_kind_come_from_a_small_public_vocabulary():
    metrics, _ = make()
    metrics.set_kind("pmwg")
    metrics.set_budget("pmwg", "epsilon", 1.0, "h")
    pmwg_series(metrics).observe_answers([answer("bottom", 0.9, reason="privacy budget exhausted")])
    erm_series(metrics).observe_models([model("base", 0.5)])
    allowed = {"flow", "mechanism", "unit", "kind", "histogram", "reason", "stream", "role",
               "partition", "client"}
    for family in metrics.registry.collect():
        for sample in family.samples:
            assert sample.labels["flow"] == FLOW, sample
            assert set(sample.labels) <= allowed, sample
            assert "q" not in sample.labels.values(), sample  # never a question id


def test_record_warnings_are_rate_limited_per_partition_and_say_how_many_were_not_logged(
        caplog):
    from dpstream.metrics import RECORD_WARNING_SECONDS, RecordWarnings

    now = [0.0]
    warnings = RecordWarnings(exact_counts=True, clock=lambda: now[0])
    with caplog.at_level("INFO", logger="dpstream"):
        warnings.undecodable("events[0]", 10, "undecodable record (ValueError)")
        warnings.undecodable("events[0]", 11, "undecodable record (ValueError)")
        warnings.undecodable("events[1]", 12, "undecodable record (ValueError)")
        warnings.clamped("events[0]", "ahead", 3, 13)
        now[0] = RECORD_WARNING_SECONDS
        warnings.undecodable("events[0]", 20, "undecodable record (ValueError)")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines
    assert lines[0].startswith("input events[0] offset 10: undecodable record (ValueError)")
    assert lines[1].startswith("input events[1] offset 12: ")
    assert lines[2] == ("input events[0] offset 13: record stamped more than flow.max_skew "
                        "ahead of its partition's clock (heartbeat ticks): counted at the "
                        "limit (2 more such record(s) since the last line not logged)")
    assert lines[3].startswith("input events[0] offset 20: ")
    assert lines[3].endswith("(1 more such record(s) since the last line not logged)")


def test_without_exact_counts_record_warnings_log_each_kind_once_with_no_offset(caplog):
    from dpstream.metrics import RecordWarnings

    warnings = RecordWarnings(exact_counts=False)
    with caplog.at_level("INFO", logger="dpstream"):
        for offset in range(3):
            warnings.undecodable("events[0]", offset, "undecodable record (ValueError)")
            warnings.clamped("events[1]", "ahead", 5, offset)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    for line in lines:
        assert "offset" not in line and "events[" not in line and "5" not in line
        assert "metrics.exact_counts = true" in line


def test_clamped_records_are_exact_counts_declared_at_zero_per_topic_and_bound():
    registry = CollectorRegistry()
    metrics = FlowMetrics("f", registry)
    metrics.declare_input_topics(["events"])
    for bound in ("ahead", "behind"):
        assert registry.get_sample_value(
            "dpstream_clamped_records_total",
            {"flow": "f", "topic": "events", "bound": bound}) == 0
    metrics.observe_clamped(0, "events", "ahead", 2, 7)
    assert registry.get_sample_value(
        "dpstream_clamped_records_total", {"flow": "f", "topic": "events", "bound": "ahead"}) == 2
    with pytest.raises(ValueError, match="bound"):
        metrics.observe_clamped(0, "events", "sideways", 1, 7)
    off = CollectorRegistry()
    hidden = FlowMetrics("f", off, exact_counts=False)
    hidden.declare_input_topics(["events"])
    hidden.observe_clamped(0, "events", "ahead", 2, 7)
    assert "dpstream_clamped_records" not in generate_latest(off).decode()


@pytest.mark.flow  # imports the module in a fresh interpreter
def test_the_shared_metrics_import_no_kind_and_no_mechanism():
    """metrics.py holds what is shared; each kind registers its own series."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = ("import sys, dpstream.metrics; print(sorted(m for m in sys.modules if m.startswith("
            "('dpstream.kinds', 'dpstream.core.counting', 'dpstream.core.pmwg', "
            "'dpstream.core.erm'))))")  # the package's own imports: the ledger and the noise key
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_kinds_series_are_registered_once_per_flow_metrics():
    metrics, _ = make()
    assert pmwg_series(metrics) is pmwg_series(metrics)
    assert erm_series(metrics) is erm_series(metrics)
    assert counters_series(metrics) is counters_series(metrics)
    pmwg_series(metrics).observe_answers([answer("easy", 0.4)])
    pmwg_series(metrics).observe_answers([answer("easy", 0.5)])  # no duplicate registration
    assert value(metrics, "dpstream_answers_total", histogram="h", kind="easy") == 2
