"""The flow-kind protocol's documented examples, and the platform's registry of kinds."""

from __future__ import annotations

import dataclasses
import doctest
import tomllib
from pathlib import Path
from typing import Any

import pytest

import dpstream
import dpstream.kind
from dpstream.errors import ConfigError
from dpstream.kinds.counters.kind import CountersConfig
from dpstream.kinds.erm.config import ErmConfig
from dpstream.kinds.pmwg.config import PmwgConfig
from dpstream.platform import KINDS, flow_kind, load_config, parse_config

DEPLOY = Path(__file__).parent.parent / "deploy"


def _toml(path: Path) -> dict[str, Any]:
    return tomllib.loads(path.read_text())


@pytest.mark.flow  # the example of `wire` runs a real bounded counters flow
def test_the_protocol_examples_run() -> None:
    results = doctest.testmod(dpstream.kind, raise_on_error=False)
    assert results.failed == 0
    assert results.attempted >= 10  # every member documents itself with an example


def test_the_registry_holds_every_kind_by_its_name() -> None:
    assert sorted(KINDS) == ["counters", "erm", "pmwg"]
    for name, kind in KINDS.items():
        assert kind.name == name and flow_kind(name) is kind
        assert "dead_letters" in kind.outputs
        assert set(kind.inputs) | set(kind.outputs.values()) <= set(kind.topics)


def test_an_unknown_kind_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"flow": {"kind": "histogram"}})
    assert str(caught.value) == "flow.kind must be one of counters, erm, pmwg, got 'histogram'"


@pytest.mark.parametrize("value", [["counters"], {"name": "counters"}, 3])
def test_a_kind_that_is_not_a_string_is_refused_as_configuration(value: object) -> None:
    with pytest.raises(ConfigError, match="flow.kind must be one of counters, erm, pmwg"):
        parse_config({"flow": {"kind": value}})


@pytest.mark.parametrize(("example", "expected"), [
    ("counters.example.toml", CountersConfig), ("pmwg.example.toml", PmwgConfig),
    ("erm.example.toml", ErmConfig)])
def test_each_kind_parses_its_own_configuration(example: str, expected: type) -> None:
    config = load_config(DEPLOY / example, {})
    assert type(config) is expected
    assert KINDS[config.kind].parse_config(_toml(DEPLOY / example), "again") == \
        dataclasses.replace(config, source="again")


def test_load_config_overrides_the_topics_of_the_kind_it_names(tmp_path: Path) -> None:
    path = tmp_path / "flow.toml"
    path.write_text('[flow]\nkind = "counters"\n')
    environ = {"DPSTREAM_RELEASES_TOPIC": "r2", "DPSTREAM_ANSWERS_TOPIC": "ignored"}
    config = load_config(path, environ)
    assert config.kafka.topic("releases_topic") == "r2"
    assert "answers_topic" not in config.kafka.topics  # a pmwg setting: not the counters'
    assert dpstream.load_config(path, environ) == config  # the package's facade
