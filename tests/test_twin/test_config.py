"""Scenario files: what loads, and errors that name the field path and the reason."""

from __future__ import annotations

import pytest

from twin import (
    BUILTIN_SCENARIOS,
    ScenarioError,
    load_scenario,
    parse_scenario,
    run_scenario,
)
from twin.config import CostConfig
from twin.cost import PROFILES, CostModel

SCENARIOS = sorted(BUILTIN_SCENARIOS.glob("*.toml"))

VALID = """
seed = 7
[engine]
max_num_seqs = 64
max_num_batched_tokens = 4096
max_k = 5
[cost]
profile = "h100-llama3.1-8b"
target_fixed = 0.004
knee_tokens = 128
noise = 0.0
[drafter]
method = "ngram"
[[phases]]
duration_s = 30
concurrency = 8
trace = "traces/chat.jsonl"
[[phases]]
duration_s = 15.5
rate_rps = 2
acceptance = [0.7, 0.6]
prompt_scale = 2
"""


def test_valid_scenario_loads_with_types_and_relative_trace(tmp_path):
    scenario = parse_scenario(VALID, base_dir=tmp_path, name="valid")
    assert scenario.seed == 7
    assert scenario.engine.max_num_seqs == 64 and scenario.engine.max_k == 5
    assert scenario.drafter.method == "ngram"
    assert scenario.phases[0].trace == str((tmp_path / "traces/chat.jsonl").resolve())
    assert scenario.phases[1].rate_rps == 2.0 and scenario.phases[1].acceptance == (0.7, 0.6)
    assert scenario.duration_s == pytest.approx(45.5)
    cost = CostModel.from_config(scenario.cost, scenario.drafter.method)
    assert cost.target_fixed == 0.004  # explicit coefficient overrides the profile
    assert cost.target_kv == PROFILES["h100-llama3.1-8b"]["target_kv"]
    assert cost.knee_tokens == 128


@pytest.mark.parametrize(("edit", "message"), [
    (("concurrency = 8", "concurrency = 0"), "phases[0].concurrency: must be >= 1, got 0"),
    (("rate_rps = 2", "rate_rps = 2\nconcurrency = 3"),
     "phases[1].concurrency: give exactly one of concurrency"),
    (("max_k = 5", "max_kk = 5"), "engine.max_kk: unknown field"),
    (("noise = 0.0", 'noise = "low"'), "cost.noise: must be a number, got 'low'"),
    (("max_num_seqs = 64", "max_num_seqs = 6.4"), "engine.max_num_seqs: must be an integer"),
    (("[0.7, 0.6]", "[0.7, 1.6]"), "phases[1].acceptance[1]: must be between 0 and 1, got 1.6"),
    (('method = "ngram"', 'method = "medusa"'), "drafter.method: must be one of eagle"),
    (("max_num_batched_tokens = 4096", "max_num_batched_tokens = 300"),
     "engine.max_num_batched_tokens: 300 cannot hold max_num_seqs=64"),
    (("duration_s = 30", "duration_s = -1"), "phases[0].duration_s: must be > 0, got -1.0"),
    (('trace = "traces/chat.jsonl"', ""), "phases[0].trace: give a trace file or an acceptance"),
    (("seed = 7", "seeds = 7"), "seeds: unknown field"),
])
def test_bad_scenarios_name_the_field_and_the_reason(tmp_path, edit, message):
    old, new = edit
    assert old in VALID
    with pytest.raises(ScenarioError) as error:
        parse_scenario(VALID.replace(old, new, 1), base_dir=tmp_path)
    assert str(error.value).startswith(message)


def test_no_phases_is_an_error():
    with pytest.raises(ScenarioError, match=r"^phases: at least one"):
        parse_scenario("seed = 1\n")


def test_unknown_profile_and_missing_coefficients_are_errors():
    with pytest.raises(ScenarioError, match=r"^cost.profile: unknown profile 'a100'"):
        CostModel.from_config(CostConfig(profile="a100"), "eagle")
    with pytest.raises(ScenarioError, match=r"^cost.target_kv: required with profile"):
        CostModel.from_config(CostConfig(profile="none", target_batched=1e-5), "eagle")


def test_a_missing_trace_without_a_fallback_names_the_phase(tmp_path):
    scenario = parse_scenario(VALID.replace("traces/chat.jsonl", "absent.jsonl"),
                              base_dir=tmp_path)
    with pytest.raises(ScenarioError, match=r"^phases\[0\]\.trace: cannot read .*absent"):
        run_scenario(scenario, "fixed:1")


def test_unreadable_scenario_and_invalid_toml(tmp_path):
    with pytest.raises(ScenarioError, match="cannot read scenario"):
        load_scenario(tmp_path / "absent.toml")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        parse_scenario("[engine\n")


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.name for p in SCENARIOS])
def test_example_scenarios_load(path):
    scenario = load_scenario(path)
    assert scenario.phases and scenario.duration_s > 0
    for phase in scenario.phases:  # each one runs without the shared data too
        assert phase.acceptance is not None
