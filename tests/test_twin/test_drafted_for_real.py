"""n-gram drafts looked up for real: the twin's pool and engine follow prompt lookup."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fitter.budget import fit_budget, match_statistics
from fitter.refit import decide_refit
from fitter.surface.fit import fit_surface
from producers.prompt_lookup import prompt_lookup
from producers.sinks import read_file_sink
from schemas import DraftTable, TableEnvelope
from schemas.draft_budget import DraftBudget
from twin import DrafterConfig, PhaseConfig, Policy, Scenario, build_engine, run_scenario
from twin.config import ScenarioError
from twin.policies import StaticTable
from twin.workload import LOOKUP_DRAFT_TOKENS, load_trace


def write_trace(path: Path, rows: list[tuple[list[int], list[int]]]) -> Path:
    with open(path, "w") as out:
        for index, (prompt, generated) in enumerate(rows):
            out.write(json.dumps({"id": str(index), "prompt_token_ids": prompt,
                                  "generated_token_ids": generated,
                                  "acc_eagle": {"acc_len": [1] * len(generated)},
                                  "acc_ngram": {"acc_len": [1] * len(generated)}}) + "\n")
    return path


def test_a_pool_drafted_for_real_is_prompt_lookup_at_every_position(tmp_path):
    rng = np.random.default_rng(3)
    rows = [(rng.integers(0, 4, 30).tolist(), rng.integers(0, 4, 60).tolist())
            for _ in range(5)]
    pool = load_trace(write_trace(tmp_path / "t.jsonl", rows), "ngram", prompt_lookup=(2, 4))
    assert pool.match_len is not None
    for request, (prompt, generated) in enumerate(rows):
        start = int(pool.acc_offset[request])
        for t in range(len(generated)):
            lookup = prompt_lookup(np.array(prompt + generated[:t]), min_n=2, max_n=4,
                                   k=LOOKUP_DRAFT_TOKENS)
            agreed = 0
            for drafted, actual in zip(lookup.draft.tolist(), generated[t:], strict=False):
                if drafted != actual:
                    break
                agreed += 1
            assert pool.match_len[start + t] == lookup.match_length
            assert pool.acc_len[start + t] == 1 + agreed
    recorded = load_trace(tmp_path / "t.jsonl", "ngram")
    assert recorded.match_len is None and set(recorded.acc_len.tolist()) == {1}


class Recording(Policy):
    step_interval = 1

    def __init__(self, k: int) -> None:
        self.name, self.k, self.steps = f"recording:{k}", k, []

    def initial_table(self, *, max_k, max_batch):
        return DraftTable.from_vllm([[1, max_batch, self.k]]), 0

    def on_step(self, engine, step):
        self.steps.append(step)


def run_steps(trace: Path, drafter: DrafterConfig, k: int = 4) -> list:
    policy = Recording(k)
    scenario = Scenario(seed=2, drafter=drafter,
                        phases=(PhaseConfig(duration_s=20.0, concurrency=4, trace=str(trace)),))
    engine, _, _ = build_engine(scenario, policy)
    engine.run(policy)
    return [step for step in policy.steps if step.k]


def test_a_request_drafts_only_where_lookup_matched(tmp_path, generated_traces):
    random_tokens = generated_traces / "gsm8k.jsonl"  # ids drawn from 128k: no n-gram repeats
    recorded = run_steps(random_tokens, DrafterConfig(method="ngram"))
    assert all(step.num_drafts == step.num_decode_reqs for step in recorded)
    looked_up = run_steps(random_tokens, DrafterConfig(method="ngram", prompt_lookup_max=3))
    assert sum(step.num_drafts for step in looked_up) == 0
    cycle = [5, 6, 7, 8, 9]
    periodic = write_trace(tmp_path / "cycle.jsonl",
                           [(cycle * 3, (cycle * 40)[:150 + 7 * i]) for i in range(8)])
    copied = run_steps(periodic, DrafterConfig(method="ngram", prompt_lookup_max=3))
    assert all(step.num_drafts == step.num_decode_reqs for step in copied)
    drafted = sum(step.num_draft_tokens for step in copied)
    accepted = sum(step.num_accepted_tokens for step in copied)
    assert accepted > 0.9 * drafted  # a cycle's continuation is always the draft


@pytest.mark.parametrize("fields, field", [({"prompt_lookup_min": 3}, "prompt_lookup_min"),
                                           ({"prompt_lookup_min": 4, "prompt_lookup_max": 3},
                                            "prompt_lookup_min"),
                                           ({"prompt_lookup_max": 0}, "prompt_lookup_max")])
def test_prompt_lookup_settings_are_checked(fields, field):
    with pytest.raises(ScenarioError, match=field):
        DrafterConfig(method="ngram", **fields)
    assert DrafterConfig(method="ngram", prompt_lookup_max=4).prompt_lookup == (4, 4)
    assert DrafterConfig(method="eagle", prompt_lookup_max=4).prompt_lookup is None


def test_a_budget_sets_each_requests_drafts_by_its_match_length(tmp_path):
    rng = np.random.default_rng(5)
    rows = [(rng.integers(0, 6, 40).tolist(), rng.integers(0, 6, 120).tolist())
            for _ in range(12)]
    trace = write_trace(tmp_path / "small-vocab.jsonl", rows)
    drafter = DrafterConfig(method="ngram", prompt_lookup_min=1, prompt_lookup_max=3)

    def steps(budget: dict | None) -> list:
        policy = Recording(4)
        if budget is not None:
            policy.initial_budget = lambda: DraftBudget.from_json(budget)
        scenario = Scenario(seed=2, drafter=drafter, phases=(
            PhaseConfig(duration_s=20.0, concurrency=4, trace=str(trace)),))
        engine, _, _ = build_engine(scenario, policy)
        engine.run(policy)
        return [step for step in policy.steps if step.num_decode_reqs]

    table_alone = steps(None)
    assert {step.k for step in table_alone} == {4}
    only_long = steps({"min_match": 1, "ranges": [[1, 256, [0, 0, 2]]]})
    assert {step.k for step in only_long} <= {0, 2}  # the step's most drafts is 2
    assert sum(s.num_drafts for s in only_long) < sum(s.num_drafts for s in table_alone)
    assert all(s.num_draft_tokens == 2 * s.num_drafts for s in only_long)
    deeper = steps({"min_match": 1, "ranges": [[1, 256, [7, 7, 7]]]})
    assert {step.k for step in deeper} == {7}  # the budget stands beside the table's K


def test_telemetry_splits_each_step_by_match_length(tmp_path):
    rng = np.random.default_rng(7)
    rows = [(rng.integers(0, 5, 40).tolist(), rng.integers(0, 5, 150).tolist())
            for _ in range(16)]
    trace = write_trace(tmp_path / "small-vocab.jsonl", rows)
    scenario = Scenario(seed=3, drafter=DrafterConfig(method="ngram", prompt_lookup_min=1,
                                                      prompt_lookup_max=3),
                        phases=(PhaseConfig(duration_s=30.0, concurrency=8, trace=str(trace)),))
    policy = StaticTable(DraftTable.from_vllm([[1, 256, 4]]), name="k4", budget=DraftBudget(
        min_match=1, ranges=((1, 256, (1, 3, 4)),)))
    run_scenario(scenario, policy, sink=f"file://{tmp_path / 'sink'}")
    records = read_file_sink(tmp_path / "sink").to_pylist()
    decoding = [r for r in records if r["num_decode_reqs"]]
    assert decoding
    seen = set()
    for record in decoding:
        parts = record["by_match_length"]
        seen |= {part["match_length"] for part in parts}
        assert sum(part["requests"] for part in parts) == record["num_decode_reqs"]
        assert sum(part["draft_tokens"] for part in parts) == record["num_draft_tokens"]
        accepted = [sum(part["accepted_per_pos"][i] for part in parts)
                    for i in range(record["k"])]
        assert accepted == record["accepted_per_pos"]
        for part in parts:
            budget = (0, 1, 3, 4)[part["match_length"]]
            assert part["draft_tokens"] <= budget * part["requests"]
            assert part["reached_per_pos"][0] <= part["requests"]
    assert {1, 2, 3} <= seen  # (five token ids: every position matches a 1-gram)


def copying_trace(path: Path, seed: int = 11) -> Path:
    """Requests that copy a cycle with one token in eight replaced: a long n-gram match
    predicts the next tokens better than a short one."""
    rng = np.random.default_rng(seed)
    cycle = rng.integers(0, 50, 12).tolist()

    def noisy_copy(length: int) -> list[int]:
        tokens = (cycle * (length // len(cycle) + 1))[:length]
        return [int(rng.integers(50, 60)) if rng.random() < 0.125 else t for t in tokens]

    return write_trace(path, [(noisy_copy(48), noisy_copy(200)) for _ in range(24)])


def test_a_budget_is_fitted_from_the_twins_telemetry(tmp_path):
    """Telemetry at one K -> the surface and acceptance by match length -> a budget that
    drafts long matches at least as deep as short ones, within the engine's K."""
    trace = copying_trace(tmp_path / "copying.jsonl")
    scenario = Scenario(seed=4, drafter=DrafterConfig(method="ngram", prompt_lookup_min=1,
                                                      prompt_lookup_max=3),
                        phases=(PhaseConfig(duration_s=60.0, concurrency=32,
                                            trace=str(trace)),))
    table = DraftTable.from_vllm([[1, 256, 5]])
    run_scenario(scenario, StaticTable(table, name="k5"), sink=f"file://{tmp_path / 'sink'}")
    records = read_file_sink(tmp_path / "sink")
    statistics = match_statistics(records, n_positions=5, max_match=3)
    parts = [part for step in records.column("by_match_length").to_pylist() for part in step]
    requests = np.bincount([p["match_length"] for p in parts],
                           weights=[p["requests"] for p in parts], minlength=4)
    np.testing.assert_allclose(statistics.share, requests / requests.sum())
    first = [sum(p["accepted_per_pos"][0] for p in parts if p["match_length"] == m)
             / max(1, sum(p["reached_per_pos"][0] for p in parts if p["match_length"] == m))
             for m in range(4)]
    assert first[3] > first[1]  # a longer match predicts a better draft here
    assert statistics.conditional[3, 0] == pytest.approx(first[3], abs=0.02)
    surface = fit_surface(records, max_k=5, max_batch=256, half_life_s=None)
    budget = fit_budget(surface, statistics, max_k=5, min_match=1).validate(5, 256)
    ks = budget.k_by_match(32, max_match=3)
    assert ks[0] == 0 and max(ks) <= 5 and ks[3] >= ks[1]


def test_a_refit_on_telemetry_with_match_lengths_carries_a_budget(tmp_path):
    rng = np.random.default_rng(13)
    rows = [(rng.integers(0, 8, 40).tolist(), rng.integers(0, 8, 160).tolist())
            for _ in range(16)]
    trace = write_trace(tmp_path / "small-vocab.jsonl", rows)

    def records(drafter: DrafterConfig, sink: str):
        scenario = Scenario(seed=6, drafter=drafter, phases=(
            PhaseConfig(duration_s=30.0, concurrency=16, trace=str(trace)),))
        run_scenario(scenario, "fixed:4", sink=f"file://{tmp_path / sink}")
        return read_file_sink(tmp_path / sink)

    looked_up = records(DrafterConfig(method="ngram", prompt_lookup_min=2,
                                      prompt_lookup_max=3), "lookup")
    decision = decide_refit(looked_up, None, max_batch=64,
                            startup_k_values=(0, 1, 2, 4, 7), half_life_s=None)
    budget = decision.envelope.budget
    assert budget is not None and budget.min_match == 2  # the shortest match seen
    assert {k for _, _, ks in budget.ranges for k in ks} <= {0, 1, 2, 4, 7}
    envelope = TableEnvelope.from_json(decision.envelope.to_json()).validate()
    assert envelope.budget == budget
    recorded = records(DrafterConfig(method="ngram"), "recorded")
    assert decide_refit(recorded, None, max_batch=64, half_life_s=None).envelope.budget is None


def test_the_closed_loop_runs_a_budget_and_a_steady_load_stays_fresh(tmp_path):
    """`tabletune` in memory on a looked-up n-gram key: the envelopes it publishes carry a
    budget the engine runs, and the budget's own steps (each request at its own K) do not
    make the table look stale; `budgets=0` runs the table alone."""
    trace = copying_trace(tmp_path / "copying.jsonl")
    scenario = Scenario(seed=3, drafter=DrafterConfig(method="ngram", prompt_lookup_min=1,
                                                      prompt_lookup_max=3),
                        phases=(PhaseConfig(duration_s=240.0, concurrency=32,
                                            trace=str(trace)),))
    engine, _, policy = build_engine(scenario, "tabletune")
    engine.run(policy)
    assert engine.switch.budget is not None and engine.switch.version >= 1
    whats = [str(decision.what) for decision in policy.loop.decisions]
    assert "stale" not in whats, whats
    alone, _, table_only = build_engine(scenario, "tabletune:budgets=0")
    alone.run(table_only)
    assert alone.switch.budget is None and alone.switch.version >= 1


def test_a_drafter_without_match_lengths_runs_the_table_of_a_budget_carrying_policy(tmp_path):
    rows = [([1, 2, 3] * 10, [1, 2, 3] * 20) for _ in range(4)]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    policy = StaticTable(DraftTable.from_vllm([[1, 256, 3]]), name="k3",
                         budget=DraftBudget(min_match=1, ranges=((1, 256, (0, 7)),)))
    scenario = Scenario(seed=1, drafter=DrafterConfig(method="eagle"), phases=(
        PhaseConfig(duration_s=5.0, concurrency=2, trace=str(trace)),))
    engine, _, _ = build_engine(scenario, policy)
    assert engine.switch.budget is None and engine.switch.k_for(1) == 3
