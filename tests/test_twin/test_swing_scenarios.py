"""The swing scenarios: eight 3-minute phases swinging between two workloads, on the H100 model."""

from __future__ import annotations

import pytest

from twin import BUILTIN_SCENARIOS, load_scenario, parse_scenario, run_scenario

SWINGS = {
    "swing-eagle-load.toml": ("eagle", lambda p: p.concurrency, (16, 128)),
    "swing-ngram-workload.toml": ("ngram", lambda p: p.trace.rsplit("/", 1)[-1],
                                  ("gsm8k.jsonl", "instructcoder.jsonl")),
    "swing-ngram-lookup.toml": ("ngram", lambda p: p.trace.rsplit("/", 1)[-1],
                                ("gsm8k.jsonl", "instructcoder.jsonl")),
}


@pytest.mark.parametrize("name", sorted(SWINGS))
def test_swing_scenario_swings_eight_times_three_minutes(name):
    method, side, (a, b) = SWINGS[name]
    scenario = load_scenario(BUILTIN_SCENARIOS / name)
    assert scenario.drafter.method == method
    assert scenario.cost.profile == "h100-llama3.1-8b"
    assert [p.duration_s for p in scenario.phases] == [180.0] * 8
    assert scenario.duration_s == 24 * 60
    assert [side(p) for p in scenario.phases] == [a, b] * 4
    assert len({p.name for p in scenario.phases}) == 8
    for phase in scenario.phases:  # the parametric fallback is there for every phase
        assert phase.acceptance and phase.prompt_len > 0 and phase.output_len > 0
    if method == "ngram":
        assert {p.concurrency for p in scenario.phases} == {32}


def test_the_lookup_swing_drafts_for_real_the_recorded_one_does_not():
    lookup = load_scenario(BUILTIN_SCENARIOS / "swing-ngram-lookup.toml")
    recorded = load_scenario(BUILTIN_SCENARIOS / "swing-ngram-workload.toml")
    assert lookup.drafter.prompt_lookup == (1, 4)
    assert recorded.drafter.prompt_lookup is None
    assert lookup.phases == recorded.phases


@pytest.mark.parametrize("name", sorted(SWINGS))
def test_swing_scenario_runs_without_the_shared_traces(name, tmp_path):
    text = (BUILTIN_SCENARIOS / name).read_text()
    scenario = parse_scenario(text, base_dir=tmp_path, name=name)  # traces not found there
    summary = run_scenario(scenario, "fixed:3", duration_s=200.0)
    assert summary.output_tokens > 0
    assert [p["name"] for p in summary.phases][:2] == [p.name for p in scenario.phases[:2]]
