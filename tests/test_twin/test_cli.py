"""Policy specs and the `twin run` / `twin static` commands."""

from __future__ import annotations

import argparse
import json

import pytest

from schemas import DraftTable, TableEnvelope, TableError, TableKey
from tabletune.cli_twin import register
from twin import PolicyError, make_policy, register_policy
from twin.policies import FixedK

SCENARIO = """
seed = 3
[engine]
max_num_seqs = 128
max_k = 5
[[phases]]
name = "low"
duration_s = 12
concurrency = 4
acceptance = [0.7, 0.65, 0.6]
prompt_len = 200
output_len = 150
[[phases]]
name = "high"
duration_s = 13
concurrency = 96
acceptance = [0.7, 0.65, 0.6]
prompt_len = 200
output_len = 150
"""


def dense(spec: str, *, max_k: int = 7, max_batch: int = 256) -> list[int]:
    table, _ = make_policy(spec).initial_table(max_k=max_k, max_batch=max_batch)
    table.validate(max_k, max_batch)
    return table.to_dense(max_batch)[1:]


def test_vllm_doc_table_is_clamped_to_the_engine():
    assert dense("vllm-doc", max_batch=100) == [5] * 16 + [4] * 16 + [3] * 32 + [1] * 36
    assert dense("vllm-doc", max_k=3, max_batch=600) == [3] * 64 + [1] * 64 + [0] * 472


def test_fixed_and_table_policies(tmp_path):
    assert dense("fixed:2", max_batch=8) == [2] * 8
    triples = tmp_path / "t.json"
    triples.write_text("[[1, 4, 3], [5, 16, 1]]")
    assert dense(f"table:{triples}", max_batch=20) == [3] * 4 + [1] * 16  # vLLM's tail rule
    envelope = TableEnvelope(key=TableKey("m", "eagle", "h"), version=9,
                             table=DraftTable.from_vllm([[1, 32, 2]]), startup_k_values=(2,),
                             max_batch=32, created_at="2026-01-01T00:00:00Z")
    path = tmp_path / "envelope.json"
    path.write_text(json.dumps(envelope.to_dict()))
    table, version = make_policy(f"table:{path}").initial_table(max_k=7, max_batch=32)
    assert version == 9 and table.to_dense(32)[1:] == [2] * 32


@pytest.mark.parametrize(("spec", "message"), [
    ("adaptive", "unknown policy 'adaptive'"),
    ("fixed:x", "fixed:K needs an integer K"),
    ("table:", "table:FILE needs a file"),
    ("table:/nonexistent/t.json", "cannot read"),
])
def test_bad_policy_specs(spec, message):
    with pytest.raises(PolicyError, match=message):
        make_policy(spec)


def test_policy_limits_are_checked_against_the_engine(tmp_path):
    with pytest.raises(PolicyError, match="exceeds the engine's max_k 3"):
        make_policy("fixed:5").initial_table(max_k=3, max_batch=8)
    too_big = tmp_path / "big.json"
    too_big.write_text("[[1, 8, 6]]")
    with pytest.raises(TableError, match="exceeds the engine's max K 3"):
        make_policy(f"table:{too_big}").initial_table(max_k=3, max_batch=8)


def test_registered_policies_are_selectable():
    register_policy("always-two", lambda arg: FixedK(2), usage="always-two")
    assert isinstance(make_policy("always-two"), FixedK)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tabletune")
    register(parser.add_subparsers())
    return parser


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return args.handler(args)


def test_twin_run_prints_a_json_summary(tmp_path, capsys):
    path = tmp_path / "two-phase.toml"
    path.write_text(SCENARIO)
    assert _main(["twin", "run", "--scenario", str(path), "--policy", "vllm-doc", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    keys = {"output_tokens_per_s", "tpot_ms_p50", "tpot_ms_p99", "ttft_ms_p50", "steps",
            "mean_batch_size", "k_share"}
    assert keys <= set(summary)
    assert [p["name"] for p in summary["phases"]] == ["low", "high"]
    assert all(keys <= set(p) for p in summary["phases"])
    assert sum(p["steps"] for p in summary["phases"]) == summary["steps"]
    assert [t for t, _ in summary["timeline"]] == [0.0, 10.0, 20.0]
    low, high = summary["phases"]
    assert set(low["k_share"]) == {"5"} and "1" in high["k_share"]  # the doc table at work
    assert high["output_tokens_per_s"] > low["output_tokens_per_s"]
    assert abs(sum(summary["k_share"].values()) - 1) < 1e-9


def test_twin_run_duration_and_errors(tmp_path, capsys):
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO)
    assert _main(["twin", "run", "--scenario", str(path), "--policy", "fixed:1",
                  "--duration", "5", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["duration_s"] == 5 and [p["name"] for p in summary["phases"]] == ["low"]
    assert _main(["twin", "run", "--scenario", str(path), "--policy", "fixed:9"]) == 1
    assert "exceeds the engine's max_k 5" in capsys.readouterr().err
    path.write_text(SCENARIO.replace("concurrency = 96", "concurrency = 0"))
    assert _main(["twin", "run", "--scenario", str(path), "--policy", "fixed:1"]) == 1
    assert "phases[1].concurrency: must be >= 1, got 0" in capsys.readouterr().err


def test_twin_static_prints_a_json_list(generated_traces, capsys):
    trace = ["--trace", str(generated_traces / "gsm8k.jsonl")]
    assert _main(["twin", "static", *trace, "--method", "eagle", "--batch-sizes", "1", "16",
                  "--k", "1", "3", "--requests", "40", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [(r["batch_size"], r["k"]) for r in results] == [(1, 1), (1, 3), (16, 1), (16, 3)]
    speedup = {(r["batch_size"], r["k"]): r["speedup"] for r in results}
    assert speedup[(1, 3)] > speedup[(1, 1)] > 1.0
    assert speedup[(16, 3)] < speedup[(1, 3)]
