"""`dpstream bounds`: per candidate cap, the events the production bounder keeps, and the noise.

Fast tier: the command runs in this process through :func:`dpstream.cli.main` (no broker, no
subprocess, no dataflow). The samples are small enough to compute the kept fractions by hand;
each expected value is derived in a comment from the bounding rule: per person and period, in
the order (step, line), an event is kept iff its group is already one of the person's groups
and holds fewer than ``max_per_group`` kept events, or the person has fewer than
``max_groups`` groups (the group is then added).
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from support.configs import counters, erm, pmwg, write

from dpstream.bounds import KIND_CAPS
from dpstream.cli import main
from dpstream.demo import demo_config, synthetic_events
from dpstream.errors import ConfigError
from dpstream.platform import parse_config

ROOT = Path(__file__).resolve().parents[1]
ORIGIN = 1_800_000_000  # a whole second: step s is [ORIGIN + s, ORIGIN + s + 1)
TOPICS = {"events": "e", "releases": "r", "alerts": "a", "dead": "d", "queries": "q",
          "answers": "n", "models": "m"}
USER = {"unit": "user", "user_field": "user"}

# The counters sample. Accepted events (line: person key step): 1 alice a 0, 2 alice a 0,
# 3 alice b 0, 4 alice c 0, 5 bob a 0, 9 bob a 1, 10 alice a 1; the other lines are skipped:
# 6 blank (not counted), 7 invalid JSON, 8 no person, 11 a key not declared, 12 before origin.
COUNTERS_SAMPLE = [
    {"user": "alice", "key": "a", "ts": ORIGIN + 0.5},
    {"user": "alice", "key": "a", "ts": ORIGIN + 0.6},
    {"user": "alice", "key": "b", "ts": ORIGIN + 0.7},
    {"user": "alice", "key": "c", "ts": ORIGIN + 0.8},
    {"user": "bob", "key": "a", "ts": ORIGIN + 0.1},
    "",
    "{not json",
    {"key": "a", "ts": ORIGIN + 0.2},
    {"user": "bob", "key": "a", "ts": ORIGIN + 1.5},
    {"user": "alice", "key": "a", "ts": ORIGIN + 1.2},
    {"user": "carol", "key": "z", "ts": ORIGIN + 0.3},
    {"user": "alice", "key": "a", "ts": ORIGIN - 5},
]


def sample_file(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                            for line in lines))
    return path


@pytest.fixture
def counters_files(tmp_path: Path) -> tuple[Path, Path]:
    config = write(tmp_path / "flow.toml", counters(
        "127.0.0.1:9092", TOPICS, origin=ORIGIN, keys=("a", "b", "c"),
        contribution={**USER, "max_keys": 1, "max_per_key": 1}))
    return config, sample_file(tmp_path / "sample.jsonl", COUNTERS_SAMPLE)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["bounds", "-q", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def fractions(report: dict[str, object]) -> dict[tuple[int, ...], float]:
    return {tuple(row["caps"].values()): row["fraction_kept"]  # type: ignore[index]
            for row in report["rows"]}  # type: ignore[attr-defined]


def test_counters_lifetime_kept_fractions_are_the_hand_computed_ones(counters_files, capsys):
    config, sample = counters_files
    report = run_json(capsys, "--config", str(config), "--max-keys", "1,2",
                      "--max-per-key", "1,2", str(sample))
    # Lifetime: alice's events in order are 1(a) 2(a) 3(b) 4(c) 10(a); bob's 5(a) 9(a).
    # (1, 1): alice keeps 1 only, bob keeps 5 only                       -> 2 of 7
    # (1, 2): alice keeps 1, 2 (a is full at 2; b, c are new keys)       -> bob 5, 9: 4 of 7
    # (2, 1): alice keeps 1 and 3 (a second key), bob keeps 5            -> 3 of 7
    # (2, 2): alice keeps 1, 2, 3 (10 finds a full), bob keeps 5, 9      -> 5 of 7
    assert fractions(report) == {(1, 1): 2 / 7, (1, 2): 4 / 7, (2, 1): 3 / 7, (2, 2): 5 / 7}
    sample_info = report["sample"]
    assert sample_info["events"] == 7 and sample_info["people"] == 2  # type: ignore[index]
    assert sample_info["steps"] == 2  # type: ignore[index]
    skipped = sample_info["skipped"]  # type: ignore[index]
    assert skipped["invalid JSON"] == {"lines": 1, "first_line_numbers": [7]}
    assert skipped["field 'user' missing or not a non-empty string"]["first_line_numbers"] == [8]
    assert skipped["event time before flow.origin"]["first_line_numbers"] == [12]
    assert sum(entry["lines"] for entry in skipped.values()) == 4  # the blank line is no event
    rows = {tuple(r["caps"].values()): r for r in report["rows"]}  # type: ignore[attr-defined]
    assert rows[1, 1]["people_capped"] == 2  # both lose an event
    assert rows[2, 2]["people_capped"] == 1  # alice loses 4 and 10, bob keeps his two
    assert rows[1, 2]["people_capped"] == 1  # bob keeps both of his


def test_a_period_resets_the_caps(counters_files, capsys):
    config, sample = counters_files
    report = run_json(capsys, "--config", str(config), "--max-keys", "1", "--max-per-key",
                      "1", "--period", "1s", str(sample))
    # One step a period: step 0 keeps alice's 1 and bob's 5, step 1 alice's 10 and bob's 9
    assert fractions(report) == {(1, 1): 4 / 7}
    assert "1 steps" in report["contribution"] or "period 1 steps" in report["contribution"]


def test_the_table_never_shows_a_person_or_a_skipped_line(counters_files, capsys):
    config, sample = counters_files
    assert main(["bounds", "-q", "--config", str(config), "--max-keys", "1,2",
                 "--max-per-key", "1", str(sample)]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    for secret in ("alice", "bob", "carol", "not json"):
        assert secret not in text
    assert re.search(r"skipped 1 line\(s\): invalid JSON \(line 7\)", text), text
    assert re.search(r"^\s+1\s+1\s+28\.6%\s+100\.0%", text, re.M), text  # 2 of 7 kept
    assert re.search(r"^\s+2\s+1\s+42\.9%", text, re.M), text  # 3 of 7


def test_an_event_level_configuration_takes_the_person_field_from_the_command(tmp_path, capsys):
    config = write(tmp_path / "flow.toml", counters("127.0.0.1:9092", TOPICS, origin=ORIGIN,
                                                    keys=("a", "b", "c")))
    sample = sample_file(tmp_path / "s.jsonl", COUNTERS_SAMPLE)
    assert main(["bounds", "-q", "--config", str(config), str(sample)]) == 2
    assert "--user-field" in capsys.readouterr().err
    report = run_json(capsys, "--config", str(config), "--user-field", "user", "--max-keys",
                      "1", "--max-per-key", "1", str(sample))
    assert fractions(report) == {(1, 1): 2 / 7}


def test_default_grids_include_the_configured_caps(counters_files, capsys):
    config, sample = counters_files
    text = config.read_text().replace("max_keys = 1", "max_keys = 3")
    config.write_text(text)
    report = run_json(capsys, "--config", str(config), "--max-per-key", "1", str(sample))
    keys = sorted(row["caps"]["max_keys"] for row in report["rows"])  # type: ignore[attr-defined]
    assert 3 in keys and {1, 2, 4, 8, 16} <= set(keys)


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-rows", "1"], "--max-rows does not apply to flow.kind = 'counters'"),
    (["--max-keys", "0"], "must be an integer >= 1"),
    (["--max-keys", "70000"], "contribution.max_keys must be an integer in 1..65535"),
    (["--period", "1.5s"], "contribution.period must be 'lifetime' or a whole number of steps"),
])
def test_bad_candidates_are_refused_with_a_precise_message(counters_files, capsys, argv,
                                                          message):
    config, sample = counters_files
    try:
        code = main(["bounds", "-q", "--config", str(config), *argv, str(sample)])
    except SystemExit as exit_:  # argparse's usage error
        code = int(exit_.code or 0)
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_missing_sample_is_a_clear_error(counters_files, capsys):
    config, _sample = counters_files
    assert main(["bounds", "-q", "--config", str(config), str(config.parent / "nope")]) == 2
    assert "cannot read the sample" in capsys.readouterr().err


def test_a_sample_without_a_usable_event_is_an_error_that_says_why(counters_files, capsys):
    config, _sample = counters_files
    sample = sample_file(config.parent / "bad.jsonl",
                         ["{not json", {"user": "dave", "key": "a"}, "", "[1]"])
    assert main(["bounds", "-q", "--config", str(config), str(sample)]) == 2
    err = capsys.readouterr().err
    assert "holds no event the flow would accept" in err
    assert "1 line(s): invalid JSON (line 1)" in err and "(line 2)" in err
    assert "(line 4)" in err and "dave" not in err


def test_pmwg_max_rows_keeps_the_first_rows_of_each_person(tmp_path, capsys):
    histogram = {"name": "h", "mechanism": "histogram", "epsilon": 0.9, "size_epsilon": 0.1,
                 "n": 100, "universe": [{"name": "c", "values": ["x", "y"]}]}
    config = write(tmp_path / "pmwg.toml", pmwg(
        "127.0.0.1:9092", TOPICS, [histogram], origin=ORIGIN,
        contribution={**USER, "max_rows": 1}))
    lines = [{"user": "p", "c": "x", "ts": ORIGIN + 0.1},
             {"user": "p", "c": "y", "ts": ORIGIN + 1.1},
             {"user": "p", "c": "x", "ts": ORIGIN + 2.1},
             {"user": "q", "c": "y", "ts": ORIGIN + 0.2},
             {"user": "q", "c": "w", "ts": ORIGIN + 0.3}]  # the last fits no universe: skipped
    sample = sample_file(tmp_path / "s.jsonl", lines)
    report = run_json(capsys, "--config", str(config), "--max-rows", "1,2,3", str(sample))
    # p has 3 rows, q 1: max_rows 1 keeps 1 + 1 of 4, 2 keeps 2 + 1, 3 keeps all 4
    assert fractions(report) == {(1,): 2 / 4, (2,): 3 / 4, (3,): 1.0}


def test_a_candidate_the_configuration_refuses_is_named(tmp_path, capsys):
    # n = 100 validates at max_rows = 1 but PMWG's gamma < 1 fails at larger caps (the noise
    # grows with max_rows): the default grid's refusal names the candidate, not only the rule
    histogram = {"name": "h", "mechanism": "histogram", "epsilon": 0.9, "size_epsilon": 0.1,
                 "n": 100, "universe": [{"name": "c", "values": ["x", "y"]}]}
    config = write(tmp_path / "pmwg.toml", pmwg(
        "127.0.0.1:9092", TOPICS, [histogram], origin=ORIGIN,
        contribution={**USER, "max_rows": 1}))
    sample = sample_file(tmp_path / "s.jsonl", [{"user": "p", "c": "x", "ts": ORIGIN + 0.1}])
    assert main(["bounds", "-q", "--config", str(config), str(sample)]) == 2
    err = capsys.readouterr().err
    assert "at the candidate caps max_rows = " in err and "gamma" in err
    assert "at the candidate caps max_rows = 1:" not in err  # the configured cap validates


def test_erm_blocks_and_rows_per_block(tmp_path, capsys):
    config = write(tmp_path / "erm.toml", erm(
        "127.0.0.1:9092", {**TOPICS}, origin=ORIGIN,
        model={"dimension": 2}, privacy={"epsilon": 1.0},
        contribution={**USER, "max_rows_per_block": 1, "max_blocks": 1}))
    row = {"features": [0.1, 0.2], "label": "yes", "s": "a"}
    lines = [{**row, "user": "p", "ts": ORIGIN + 0.1}, {**row, "user": "p", "ts": ORIGIN + 0.2},
             {**row, "user": "p", "ts": ORIGIN + 1.1}, {**row, "user": "q", "ts": ORIGIN + 1.2}]
    sample = sample_file(tmp_path / "s.jsonl", lines)
    report = run_json(capsys, "--config", str(config), "--max-rows-per-block", "1,2",
                      "--max-blocks", "1,2", str(sample))
    # p: two rows in block (step) 0, one in block 1; q: one row in block 1.
    # (1 row, 1 block): p keeps 1, q 1 -> 2 of 4; (1, 2): p 1 + 1, q 1 -> 3 of 4
    # (2, 1): p 2, q 1 -> 3 of 4; (2, 2): all 4
    assert fractions(report) == {(1, 1): 2 / 4, (1, 2): 3 / 4, (2, 1): 3 / 4, (2, 2): 1.0}


def test_kind_caps_are_what_each_kind_requires():
    for kind, caps in KIND_CAPS.items():
        raw: dict[str, object] = {"flow": {"kind": kind, "origin": "2026-01-01T00:00:00Z"},
                                  "contribution": dict(USER)}
        with pytest.raises(ConfigError) as refused:
            parse_config(_minimal(kind, raw))
        assert f"({kind} takes {', '.join(caps)})" in str(refused.value)


def _minimal(kind: str, raw: dict[str, object]) -> dict[str, object]:
    if kind == "pmwg":
        raw["histograms"] = [{"name": "h", "mechanism": "histogram", "epsilon": 0.9,
                              "size_epsilon": 0.1, "n": 100,
                              "universe": [{"name": "c", "values": ["x"]}]}]
    if kind == "erm":
        raw["model"] = {"classes": ["no", "yes"], "dimension": 2}
        raw["privacy"] = {"epsilon": 1.0}
    return raw


@pytest.mark.parametrize("example", ["counters", "pmwg", "erm"])
def test_each_examples_commented_contribution_block_is_a_valid_user_level_table(example):
    text = (ROOT / "deploy" / f"{example}.example.toml").read_text()
    block = text[text.index("# [contribution]"):text.index("\n[privacy]")]
    settings = [re.sub(r"^# ?", "", line) for line in block.splitlines()
                if not re.match(r"^#\s+#", line)]
    config = parse_config(tomllib.loads(text.replace(block, "\n".join(settings))))
    assert config.contribution.user_level and config.contribution.user_field == "user"
    assert [name for name, _ in config.contribution.caps] == list(KIND_CAPS[example])


def test_the_demo_at_the_user_level_names_visitors_and_caps_them():
    import random

    event_level = parse_config(tomllib.loads(demo_config("2026-01-01T00:00:00Z",
                                                          "127.0.0.1:9092", 0)))
    user_level = parse_config(tomllib.loads(demo_config("2026-01-01T00:00:00Z",
                                                         "127.0.0.1:9092", 0, "user")))
    assert not event_level.contribution.user_level
    assert dict(user_level.contribution.caps) == {"max_keys": 4, "max_per_key": 5}
    assert user_level.contribution.period_steps == 10
    events = synthetic_events(random.Random(7), 2000, 5.0, 20_000)
    assert all(e["user"].startswith("user-") and e["key"].startswith("page-") for e in events)
    counts: dict[str, int] = {}
    for e in events:
        counts[e["user"]] = counts.get(e["user"], 0) + 1
    # Zipf-like activity (exponent 1 over 20,000 visitors): visitor 0 has weight 1/H, H =
    # ln(20000) + 0.577 = 10.48, so about 2000/10.48 = 191 of the 2000 events (sd 13); a
    # uniform draw would give 0.1. More than 100 catches a lost skew with ease.
    assert counts.get("user-00000", 0) > 100
    assert all(set(e) == {"key", "ts"} for e in synthetic_events(random.Random(7), 10, 5.0))


def test_check_config_prints_the_contribution_line_at_the_user_level(counters_files, capsys):
    config, _sample = counters_files
    assert main(["check-config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "privacy unit: one person (field 'user'), lifetime; caps max_keys = 1" in out
    parsed = parse_config(tomllib.loads(config.read_text()))
    if hasattr(parsed, "noise_std"):  # the kind reports its outputs' noise: each one shown
        assert "noise std" in out
        for name in parsed.noise_std():
            assert re.search(rf"noise std\b.*\b{name} [0-9.e+]+", out), (name, out)
    else:
        assert "noise std" not in out  # nothing invented


def test_each_rows_noise_std_is_the_configurations_at_its_caps(counters_files, capsys):
    config, sample = counters_files
    report = run_json(capsys, "--config", str(config), "--max-keys", "1,3",
                      "--max-per-key", "1,4", str(sample))
    raw = tomllib.loads(config.read_text())
    for row in report["rows"]:  # type: ignore[attr-defined]
        raw["contribution"].update(row["caps"])
        at_caps = parse_config(raw)
        if hasattr(at_caps, "noise_std"):
            assert row["noise_std"] == pytest.approx(at_caps.noise_std(), rel=1e-12)
        else:
            assert row["noise_std"] is None


def test_progress_goes_to_stderr_unless_quiet(counters_files, capsys, monkeypatch):
    import dpstream.bounds

    config, sample = counters_files
    monkeypatch.setattr(dpstream.bounds, "PROGRESS_SECONDS", 0.0)  # report at every batch
    assert main(["bounds", "--config", str(config), "--max-keys", "1,2", "--max-per-key",
                 "1", str(sample)]) == 0
    out = capsys.readouterr()
    assert re.search(r"^dpstream bounds: read 12 lines \(100%\)", out.err, re.M), out.err
    assert "dpstream bounds: candidate 2 of 2" in out.err
    assert "dpstream bounds:" not in out.out
    assert main(["bounds", "-q", "--config", str(config), "--max-keys", "1", "--max-per-key",
                 "1", str(sample)]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.flow
def test_the_command_line_runs_it_as_a_process(counters_files):
    import os
    import subprocess
    import sys

    config, sample = counters_files
    done = subprocess.run([sys.executable, "-m", "dpstream.cli", "bounds", "--json", "-q",
                           "--config", str(config), "--max-keys", "2", "--max-per-key", "2",
                           str(sample)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-2000:]
    assert fractions(json.loads(done.stdout)) == {(2, 2): 5 / 7}  # as derived above
    assert done.stderr == ""
