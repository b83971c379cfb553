"""Unit tests of the Kafka edge's pure parts: settings, start-up checks, logs, identities."""

from __future__ import annotations

import logging

import orjson
import pytest

from dpstream.errors import ConfigError, DpstreamError
from dpstream.io.kafka import KafkaClients, RateLimitedLog, probe_api_versions, wait_for_topics
from dpstream.kinds.counters.records import RecordEncoder
from dpstream.messages import DeadLetter
from dpstream.platform import parse_config
from dpstream.runner import process_id
from dpstream.schemas import identity


def test_credentials_come_from_the_environment_and_are_masked():
    clients = KafkaClients(("b1:9092",), {"security.protocol": "SASL_SSL"},
                           environ={"DPSTREAM_KAFKA_SASL_USERNAME": "svc",
                                    "DPSTREAM_KAFKA_SASL_PASSWORD": "hunter2",
                                    "DPSTREAM_BROKERS": "ignored:1", "HOME": "/root"})
    settings = clients.settings
    assert settings["sasl.username"] == "svc" and settings["sasl.password"] == "hunter2"
    assert settings["security.protocol"] == "SASL_SSL"
    assert settings["bootstrap.servers"] == "b1:9092"
    assert "hunter2" not in clients.describe() and "sasl.password=***" in clients.describe()
    for kind in ("consumer", "producer", "admin"):  # one configuration for every connection
        config = clients.config(kind)
        assert config["sasl.password"] == "hunter2" and config["client.id"] == f"dpstream-{kind}"
    assert not clients.plaintext


def test_the_environment_may_override_the_bootstrap_servers():
    clients = KafkaClients(("a:1",), {}, environ={"DPSTREAM_KAFKA_BOOTSTRAP_SERVERS": "b:2,c:3"})
    assert clients.bootstrap == ["b:2", "c:3"]


def test_settings_for_a_pre_0_10_broker_are_refused_at_start_up():
    clients = KafkaClients(("127.0.0.1:1",), {"api.version.request": "false",
                                              "broker.version.fallback": "0.9.0.1"}, environ={})
    assert clients.too_old_for_timestamps
    with pytest.raises(DpstreamError, match="older than Kafka 0.10.*no timestamps"):
        wait_for_topics(clients, "events", ["releases"], timeout=1)
    newer = KafkaClients(("h:1",), {"api.version.request": "false",
                                    "broker.version.fallback": "2.8.0"}, environ={})
    assert not newer.too_old_for_timestamps


def test_the_version_probe_tells_reachable_from_unreachable(broker):
    assert probe_api_versions(broker.bootstrap) is True
    from dpstream.io.broker import free_port

    assert probe_api_versions(f"127.0.0.1:{free_port()}", timeout=0.5) is None


def test_rate_limited_log_counts_what_it_suppressed(caplog):
    limited = RateLimitedLog(logging.getLogger("dpstream.test"), interval=3600)
    with caplog.at_level(logging.WARNING, logger="dpstream.test"):
        for i in range(50):
            limited("refused", logging.WARNING, "connection refused %d", i)
        limited("other", logging.WARNING, "another kind")
    assert [r.getMessage() for r in caplog.records] == ["connection refused 0", "another kind"]
    limited.interval = 0
    with caplog.at_level(logging.WARNING, logger="dpstream.test"):
        limited("refused", logging.WARNING, "connection refused again")
    assert "49 similar message(s) suppressed" in caplog.records[-1].getMessage()


def test_process_id_from_the_bytewax_command_line_or_environment():
    assert process_id(["bytewax.run", "m:flow", "-i", "3", "-a", "x"], {}) == 3
    assert process_id(["bytewax.run", "--process-id=2"], {}) == 2
    assert process_id(["dpstream", "run"], {"BYTEWAX_PROCESS_ID": "1"}) == 1
    assert process_id(["dpstream", "run"], {}) == 0


def test_kafka_and_heartbeat_settings_are_validated():
    base = {"flow": {"origin": "2026-01-01T00:00:00Z"}}
    config = parse_config(base)
    assert config.kafka.group_id == "dpstream.counters" and config.kafka.start_offset == "earliest"
    assert config.heartbeat_seconds == 60.0  # step 1m, broker clock: one tick per step
    producer = parse_config({**base, "flow": {**base["flow"], "step": "1s", "clock": "producer"}})
    assert producer.heartbeat_seconds == 1.0  # producer time: the ticks are its only clock
    assert producer.tick_delay_seconds == 2.0 and producer.max_skew_seconds == 86400.0  # 1 d
    assert parse_config({**base, "flow": {**base["flow"], "heartbeat": "5s"}}
                        ).heartbeat_seconds == 5.0
    with pytest.raises(ConfigError, match="kafka.start_offset must be"):
        parse_config({**base, "kafka": {"start_offset": "middle"}})
    with pytest.raises(ConfigError, match="flow.heartbeat must be"):
        parse_config({**base, "flow": {**base["flow"], "heartbeat": "1ms"}})
    with pytest.raises(ConfigError, match="kafka.group_id must not be empty"):
        parse_config({**base, "kafka": {"group_id": ""}})


def test_record_identities_for_de_duplication():
    from datetime import UTC, datetime

    encoder = RecordEncoder("f", datetime(2026, 1, 1, tzinfo=UTC), 1.0, instance="i1")
    _, _, value = encoder.encode_dead_letter(DeadLetter("invalid JSON", b"{", "events", 2, 7))
    assert identity(orjson.loads(value)) == ("dpstream.dead_letter/1", "f", "i1", "events", 2,
                                             7)
    release = {"schema": "dpstream.release/1", "flow": "f", "instance": "i1", "key": "k",
               "step": 3, "value": 1.0}
    assert identity(release) == ("dpstream.release/1", "f", "i1", "k", 3)
    assert identity(dict(release, value=2.0)) == identity(release)
    # two instances of one flow name publish the same coordinates independently
    assert identity(dict(release, instance="i2")) != identity(release)
    with pytest.raises(ValueError, match="not a dpstream record"):
        identity({"schema": "other"})


def test_a_huge_dead_letter_is_truncated_with_its_size_and_digest():
    import base64
    import hashlib
    from datetime import UTC, datetime

    from dpstream.stream.encoded import MAX_ORIGINAL_BYTES

    original = bytes(range(256)) * 8000  # 2 MB
    encoder = RecordEncoder("f", datetime(2026, 1, 1, tzinfo=UTC), 1.0)
    _, _, value = encoder.encode_dead_letter(DeadLetter("invalid JSON", original, "e", 0, 1))
    body = orjson.loads(value)
    assert len(value) < 100_000
    assert base64.b64decode(body["original_base64"]) == original[:MAX_ORIGINAL_BYTES]
    assert body["original_size"] == len(original) and body["original_truncated"] is True
    assert body["original_sha256"] == hashlib.sha256(original).hexdigest()


def test_which_settings_count_as_secrets():
    from dpstream.io.kafka import is_secret

    assert all(map(is_secret, ["sasl.password", "ssl.key.password", "sasl.jaas.config",
                               "sasl.oauthbearer.client.secret", "ssl.key.pem"]))
    assert not any(map(is_secret, ["ssl.key.location", "security.protocol", "sasl.username"]))
