"""A tiny suite end to end through `tabletune bench`: results.json, markdown, BENCHMARKS.md."""

from __future__ import annotations

import json

import pytest

from tabletune.cli import main
from tabletune.suite import grid
from tabletune.suite.collect import RESULT_KEYS
from tabletune.suite.markers import BEGIN, END

DRIFT = """
seed = 5
[engine]
max_num_seqs = 64
max_num_batched_tokens = 4096
max_k = 3
[drafter]
method = "eagle"
[[phases]]
name = "c2"
duration_s = 20
concurrency = 2
acceptance = [0.69, 0.66, 0.69]
[[phases]]
name = "c48"
duration_s = 30
concurrency = 48
acceptance = [0.69, 0.66, 0.69]
"""
HOOK = {"benchmark": "hook_overhead", "command": "python -m bench.hook_overhead",
        "machine": {"cores": 2, "cpu": "Test CPU", "python": "3.11.7", "date": "2026-01-02"},
        "results": [{"batch_size": 64, "engine_thread_us_median": 8.2}]}
QUALITY = {"benchmark": "profile_quality", "command": "python -m bench.profile_quality",
           "machine": HOOK["machine"], "mean_ratio": 0.9931, "results": [
               {"shape": "linear", "trace": "sharegpt", "method": "eagle",
                "loads": [{"concurrency": 1, "ratio": 1.0}, {"concurrency": 256, "ratio": 0.99}]},
               {"shape": "plateau", "trace": "sharegpt", "method": "ngram",
                "loads": [{"concurrency": 128, "ratio": 0.984}]}]}


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    drift = tmp_path / "tiny-drift.toml"
    drift.write_text(DRIFT)
    spec = grid.SuiteSpec(
        name="tiny", traces=("sharegpt",), methods=("eagle",), concurrencies=(2, 32),
        rates_tok_s=(3000.0,), warmup_s=8.0, measure_s=12.0,
        policies=("vllm-doc", "tabletune"), drift=(str(drift),), settle_s=10.0,
        profile_budget_s=8.0, max_k=3, data_dir=tmp_path / "no-traces")
    monkeypatch.setitem(grid.SUITES, "tiny", spec)
    return spec


def test_tiny_suite_end_to_end(tmp_path, tiny, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "hook_overhead.json").write_text(json.dumps(HOOK))
    (out / "profile_quality.json").write_text(json.dumps(QUALITY))
    benchmarks = tmp_path / "BENCHMARKS.md"
    benchmarks.write_text("# Benchmarks\n\nhand-written\n")
    assert main(["bench", "--suite", "tiny", "--out", str(out), "--processes", "1",
                 "--markdown", str(benchmarks)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["results"] == str(out / "results.json")

    results = json.loads((out / "results.json").read_text())
    # the runner records a crashing policy instead of raising: here, none may crash
    assert results["errors"] == [] and printed["runs_failed"] == 0, results["errors"]
    assert set(results) == set(RESULT_KEYS)
    assert results["suite"] == "tiny" and results["traces_found"] == {"sharegpt": False}
    assert results["command"] == f"tabletune bench --suite tiny --out {out}"
    assert {"cores", "cpu", "date"} <= set(results["machine"])
    assert set(results["grids"]) == {"sharegpt-eagle/closed", "sharegpt-eagle/open"}
    closed = results["grids"]["sharegpt-eagle/closed"]
    assert closed["arrival"] == "closed" and closed["score"] == "output_tok_s"
    assert [load["label"] for load in closed["loads"]] == ["c=2", "c=32"]
    policies = {"fixed:0", "fixed:1", "fixed:2", "fixed:3", "vllm-doc", "tabletune"}
    for load in closed["loads"]:
        assert set(load["runs"]) == policies
        assert all(score is not None and score > 0 for score in load["scores"].values())
    ratios = closed["ratios"]
    assert ratios["best_single_fixed"] in {f"fixed:{k}" for k in range(4)}
    doc = ratios["policies"]["vllm-doc"]["vs_oracle"]
    assert 0 < doc["worst"] <= doc["mean"] <= 1.0 + 1e-9
    assert set(ratios["policies"]["vllm-doc"]["vs"]) == set()  # only baseline: itself
    assert ratios["policies"]["tabletune"]["vs"].keys() == {"vllm-doc"}

    [row] = results["drift"]["tiny-drift"]["phases"]
    assert row["name"] == "c48" and row["window_s"] == [30.0, 50.0]
    assert {"recovery", "stale_loss", "best_fixed", "tabletune_vs_best_fixed"} <= set(row)
    assert row["stale"]["profiled_phase"] == "c2" and row["stale"]["table"][0][0] == 1
    assert (out / "tables" / "tiny-drift-before-1" / "table.json").is_file()

    standalone = results["standalone"]
    assert standalone["hook_overhead"]["status"] == "ok"
    assert "B=64: 8.2 µs" in standalone["hook_overhead"]["value"]
    assert standalone["ingest_throughput"]["status"] == "not run"
    assert standalone["profile_quality"]["value"] == (
        "profiled table / each load's best fixed K over 3 loads (linear, plateau): mean "
        "0.993, worst 0.984 (plateau sharegpt ngram at c=128)")

    section = (out / "results.md").read_text()
    assert "| grid | loads | best single fixed K | vllm-doc | tabletune |" in section
    assert "| sharegpt-eagle/closed | c=2 … c=32 (2) |" in section
    assert "### Drift: stale-loss recovery" in section and "Test CPU" in section
    ranges = [max(load["runs"]["tabletune"]["table_ranges"]) for load in closed["loads"]]
    assert all(count >= 1 for count in ranges)
    for load in closed["loads"]:  # the tables themselves, for a yardstick to read
        run = load["runs"]["tabletune"]
        assert [len(table) for table in run["tables"]] == run["table_ranges"]
        assert all(table[0][0] == 1 for table in run["tables"])
    assert f"| {max(ranges)} (" in section.split("### Table ranges")[1]
    text = benchmarks.read_text()
    assert text.startswith("# Benchmarks\n\nhand-written\n\n" + BEGIN)
    assert text.endswith(END + "\n") and section.strip() in text
