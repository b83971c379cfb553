"""Configuration: valid files load; every bad setting fails at start-up with a precise message."""

from pathlib import Path

import pytest

from dpstream.errors import ConfigError
from dpstream.platform import load_config, parse_config

EXAMPLE = Path(__file__).parent.parent / "deploy" / "counters.example.toml"


def base(**tables):
    raw = {"flow": {"origin": "2026-11-20T00:00:00Z", "step": "1s"},
           "privacy": {"accounting": "pure", "budget": 1.0, "delta": 1e-6}}
    for name, values in tables.items():
        raw.setdefault(name, {}).update(values)
    return raw


def test_example_file_loads_and_describes_itself():
    config = load_config(EXAMPLE, environ={})
    assert config.step_seconds == 60
    text = config.describe()
    assert "tree-laplace" in text and "admission delta" in text


def test_environment_overrides(tmp_path):
    config = load_config(EXAMPLE, environ={"DPSTREAM_BROKERS": "a:1,b:2",
                                           "DPSTREAM_METRICS_PORT": "0"})
    assert config.kafka.brokers == ("a:1", "b:2")
    assert config.metrics_port == 0
    with pytest.raises(ConfigError, match=r"\$DPSTREAM_METRICS_PORT must be an integer"):
        load_config(EXAMPLE, environ={"DPSTREAM_METRICS_PORT": "x"})


def test_zcdp_declared_config():
    config = parse_config(base(privacy={"accounting": "zcdp", "budget": 0.5},
                               counter={"rho": 0.4, "horizon": 65536},
                               admission={"mode": "declared", "keys": ["eu", "us"]}))
    assert config.privacy.counter.mechanism == "blt-gaussian"
    assert config.privacy.monitor is None
    assert "(epsilon, delta)" in config.describe()


def test_open_mode_default_threshold_meets_delta():
    config = parse_config(base())
    assert config.admission.delta <= 1e-6
    assert config.privacy.monitor.threshold > 1


@pytest.mark.parametrize("raw, message", [
    (base(flow={"step": "fast"}), "flow.step must be a duration like '1s'"),
    (base(flow={"step": 0}), "flow.step must be at least 1ms"),
    (base(flow={"origin": "yesterday"}), "flow.origin must be an ISO-8601 time"),
    (base(flow={"shards": 0}), "flow.shards must be between 1 and 4096"),
    (base(flow={"stpe": "1s"}), r"unknown setting\(s\) in \[flow\]: stpe"),
    (base(privacy={"budget": -1}), "privacy.budget must be finite and > 0, got -1"),
    (base(privacy={"accounting": "renyi"}), "privacy.accounting must be 'pure' or 'zcdp'"),
    (base(privacy={"budget": 0.5}, counter={"epsilon": 0.7}), "privacy.budget = 0.5 epsilon per "
     "key cannot pay for"),
    (base(counter={"horizon": 1000}), r"\[counter\]: .*power of two"),
    (base(counter={"rho": 0.1}), r"unknown setting\(s\) in \[counter\]: rho"),
    (base(monitor={"threshold": 5}), "monitor.threshold = 5 with monitor windows of .* costs"),
    (base(admission={"mode": "declared"}), "admission.keys"),
    (base(admission={"mode": "open", "keys": ["a"]}), "only used with admission.mode = 'declared'"),
    (base(admission={"mode": "open"}, monitor={"enabled": False}), "needs the threshold monitor"),
    (base(kafka={"input_topic": "bad topic!"}), "not a valid Kafka topic name"),
    (base(kafka={"releases_topic": "events"}), "kafka topics must all differ"),
    (base(metrics={"port": 70000}), "metrics.port must be in 0..65535"),
    ({"flwo": {}}, r"unknown table\(s\) flwo"),
    ({"privacy": {"budget": "1"}}, "privacy.budget must be float, got '1'"),
])
def test_bad_settings_fail_precisely(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_declared_mode_requires_origin():
    raw = base(admission={"mode": "declared", "keys": ["a"]})
    del raw["flow"]["origin"]
    with pytest.raises(ConfigError, match="flow.origin is required"):
        parse_config(raw)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read configuration"):
        load_config(tmp_path / "missing.toml", environ={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[flow\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, environ={})
    with pytest.raises(ConfigError, match="DPSTREAM_CONFIG"):
        load_config(None, environ={})


def test_clock_settings_producer_ticks_and_a_public_end():
    """Issue 22 (items 3, 4, 9): tick delay, max skew and flow.end are parsed and checked."""
    config = parse_config(base(flow={"clock": "producer", "tick_delay": "500ms",
                                     "max_skew": "1m", "end": "2026-11-20T01:00:00Z"}))
    assert config.tick_delay_seconds == 0.5 and config.max_skew_seconds == 60.0
    assert config.end_seconds == config.origin_seconds + 3600
    assert config.heartbeat_seconds == 1.0  # ticks on by default under the producer clock too
    assert parse_config(base()).end is None
    with pytest.raises(ConfigError, match="flow.end must be at least one step"):
        parse_config(base(flow={"end": "2026-11-20T00:00:00.5Z"}))
    with pytest.raises(ConfigError, match="flow.end must be an ISO-8601 time"):
        parse_config(base(flow={"end": "tomorrow"}))
    with pytest.raises(ConfigError, match="flow.max_skew must be a duration"):
        parse_config(base(flow={"max_skew": "soon"}))
    with pytest.raises(ConfigError, match="flow.tick_delay must be a finite duration"):
        parse_config(base(flow={"tick_delay": -1}))


def test_a_producer_clock_flow_that_could_never_close_a_step_is_refused():
    # a tailing flow without its own ticks is allowed (another writer may tick): warned at run
    parse_config(base(flow={"clock": "producer", "heartbeat": "off"}))
    with pytest.raises(ConfigError, match="kafka.tail = false needs flow.end"):
        parse_config(base(flow={"clock": "producer"}, kafka={"tail": False}))
    # a bounded run with a configured end is fine, under either clock
    parse_config(base(flow={"clock": "producer", "end": "2026-11-20T00:01:00Z"},
                      kafka={"tail": False}))
    parse_config(base(flow={"end": "2026-11-20T00:01:00Z"}, kafka={"tail": False}))


def test_a_bounded_run_under_the_broker_clock_needs_a_public_end():
    # review of issue 22: without flow.end the last step followed the broker time of each
    # partition's last record, so one late-arriving event changed which steps exist
    with pytest.raises(ConfigError, match="kafka.tail = false needs flow.end"):
        parse_config(base(flow={"heartbeat": "off"}, kafka={"tail": False}))
    with pytest.raises(ConfigError, match="kafka.tail = false needs flow.end"):
        parse_config(base(kafka={"tail": False}))


def test_the_summary_says_what_closes_steps_and_where_a_run_ends():
    producer = parse_config(base(flow={"clock": "producer", "end": "2026-11-20T00:01:00Z",
                                       "max_skew": "5m"}, kafka={"tail": False}))
    line = producer.describe_clock()
    assert "clock producer" in line and "clock + 300 s" in line
    assert "only heartbeat ticks" in line and "steps from 60 on never close" in line
    assert line in producer.describe()
    broker = parse_config(base())
    assert "clock broker" in broker.describe_clock()
    assert "no flow.end" in broker.describe_clock()
