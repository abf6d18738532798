"""A measured latency table as the twin's cost: the staircase is replayed, bad files refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from producers.sinks import read_file_sink
from tabletune.cli import main
from twin import ScenarioError, load_scenario, run_scenario
from twin.calibrate import calibrate
from twin.calibration import profile_toml
from twin.latency_table import (
    LatencyTableError,
    load_latency_table,
    parse_latency_table,
)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
CONTEXTS = (0, 4096, 65536)


def staircase_latency(batched: int, kv: int, k: int) -> float:
    """A GPU-shaped truth at grid points: flat to 32 tokens, then steps, plus context and K."""
    return 0.006 + 2e-5 * max(0, batched - 32) + 4e-8 * kv + 1.5e-3 * k


def write_staircase(path: Path, max_k: int = 3) -> Path:
    lines = ["batched_tokens,kv_tokens,k,latency_s"]
    lines += [f"{b},{c},{k},{staircase_latency(b, c, k)!r}"
              for k in range(max_k + 1) for b in CAPTURE_SIZES for c in CONTEXTS]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def scenario_text(table: str, *, noise: float = 0.0, max_k: int = 3) -> str:
    return f"""
[engine]
max_num_seqs = 32
max_num_batched_tokens = 1024
max_k = {max_k}
[cost]
table = "{table}"
noise = {noise}
[[phases]]
duration_s = 20
concurrency = 24
acceptance = [0.7, 0.6]
prompt_len = 64
output_len = 96
"""


def test_grid_points_are_exact_and_between_them_the_next_capture_size_counts(tmp_path):
    table = load_latency_table(write_staircase(tmp_path / "gpu.csv"))
    for b in CAPTURE_SIZES:
        for c in CONTEXTS:
            assert table.step_s(c, b, 2) == staircase_latency(b, c, 2)
    # batched 33..48 pads to 48: one flat stair, then a jump at 49
    assert table.step_s(0, 33, 1) == table.step_s(0, 48, 1) == staircase_latency(48, 0, 1)
    assert table.step_s(0, 49, 1) == staircase_latency(64, 0, 1) > table.step_s(0, 48, 1)
    # linear between contexts, at the padded batch
    middle = table.step_s(2048, 20, 0)
    assert middle == pytest.approx((staircase_latency(24, 0, 0)
                                    + staircase_latency(24, 4096, 0)) / 2, rel=1e-12)
    # past the largest point: the last slope continues, never downwards
    assert table.step_s(0, 256, 0) == pytest.approx(
        staircase_latency(128, 0, 0) + 128 * 2e-5, rel=1e-9)


def test_a_scenario_with_a_table_steps_at_the_tables_latencies(tmp_path):
    write_staircase(tmp_path / "gpu.csv")
    path = tmp_path / "gpu.toml"
    path.write_text(scenario_text("gpu.csv"), encoding="utf-8")  # relative to the scenario
    scenario = load_scenario(path)
    assert scenario.cost.table == str((tmp_path / "gpu.csv").resolve())
    out = tmp_path / "records"
    summary = run_scenario(scenario, "fixed:2", sink=f"file://{out}")
    records = read_file_sink(out).to_pydict()
    assert summary.steps == len(records["step_seq"]) > 500
    table = load_latency_table(tmp_path / "gpu.csv")
    batched = [d + drafts + prefill for d, drafts, prefill in zip(
        records["num_decode_reqs"], records["num_draft_tokens"], records["num_prefill_tokens"],
        strict=True)]
    with_drafts = np.array([table.step_s(kv, b, k) for kv, b, k in zip(
        records["kv_tokens"], batched, records["k_next"], strict=True)])
    without = np.array([table.step_s(kv, b, 0) for kv, b in zip(
        records["kv_tokens"], batched, strict=True)])
    latency = np.array(records["step_latency_s"])
    # a step drafts for the next one unless every request in it finished
    drafted = latency == with_drafts
    assert drafted.mean() > 0.99
    np.testing.assert_array_equal(latency[~drafted], without[~drafted])
    padded = {b for b in (d + drafts for d, drafts, p in zip(
        records["num_decode_reqs"], records["num_draft_tokens"],
        records["num_prefill_tokens"], strict=True) if p == 0)}
    assert any(b not in CAPTURE_SIZES for b in padded)  # steps between grid points ran


@pytest.mark.parametrize(("line", "message"), [
    ("8,4096,x,0.01", "line 3, column k: 'x' is not a whole number"),
    ("8,4096,1,-0.01", "line 3, column latency_s: must be a step time"),
    ("8,4096,1,nan", "line 3, column latency_s: must be a step time"),
    ("0,4096,1,0.01", "line 3, column batched_tokens: must be >= 1, got 0"),
    ("8,-1,1,0.01", "line 3, column kv_tokens: must be >= 0"),
    ("8,4096,1", "line 3: 3 fields, the header has 4"),
    ("8,0,0,0.02", "line 3: batched_tokens=8, kv_tokens=0, k=0 is already on line 2"),
])
def test_a_malformed_row_is_refused_with_its_line_and_column(line, message):
    text = f"batched_tokens,kv_tokens,k,latency_s\n8,0,0,0.01\n{line}\n"
    with pytest.raises(LatencyTableError, match=message.replace("(", r"\(")):
        parse_latency_table(text, source="gpu.csv")


def test_an_incomplete_grid_or_header_is_refused():
    with pytest.raises(LatencyTableError, match="header must name the columns"):
        parse_latency_table("batched,kv_tokens,k,latency_s\n1,0,0,0.01\n")
    with pytest.raises(LatencyTableError, match="no row for batched_tokens=8, kv_tokens=0, k=1"):
        parse_latency_table("batched_tokens,kv_tokens,k,latency_s\n1,0,0,0.01\n8,0,0,0.02\n"
                            "1,0,1,0.01\n")
    with pytest.raises(LatencyTableError, match="no rows for k=1"):
        parse_latency_table("batched_tokens,kv_tokens,k,latency_s\n1,0,0,0.01\n1,0,2,0.01\n")


def test_scenario_errors_name_cost_table(tmp_path):
    write_staircase(tmp_path / "gpu.csv", max_k=2)
    path = tmp_path / "s.toml"
    path.write_text(scenario_text("gpu.csv", max_k=3), encoding="utf-8")
    with pytest.raises(ScenarioError, match=r"cost.table: .*k up to 2, but engine.max_k = 3"):
        run_scenario(path, "fixed:1")
    (tmp_path / "bad.csv").write_text("batched_tokens,kv_tokens,k,latency_s\n1,0,zero,1\n")
    path.write_text(scenario_text("bad.csv"), encoding="utf-8")
    with pytest.raises(ScenarioError, match=r"cost.table: .*bad.csv line 2, column k"):
        run_scenario(path, "fixed:1")
    path.write_text(scenario_text("gpu.csv").replace("noise = 0.0", "target_kv = 1e-8"),
                    encoding="utf-8")
    with pytest.raises(ScenarioError, match="cost.table: replaces the coefficients: remove "
                                            "target_kv"):
        load_scenario(path)


def test_calibrate_prices_records_by_the_table_and_measures_its_noise(tmp_path):
    write_staircase(tmp_path / "gpu.csv")
    path = tmp_path / "gpu.toml"
    path.write_text(scenario_text("gpu.csv", noise=0.05), encoding="utf-8")
    run_scenario(path, "fixed:2", sink=f"file://{tmp_path / 'records'}")
    records = pl.from_arrow(read_file_sink(tmp_path / "records"))
    calibration = calibrate(records, source="twin", cost_table=tmp_path / "gpu.csv")
    assert calibration.noise == pytest.approx(0.05, rel=0.15)
    assert calibration.fit["fitted_total_ratio"] == pytest.approx(1.0, abs=0.01)
    assert calibration.cost_config() == {"table": str(tmp_path / "gpu.csv"),
                                         "noise": calibration.noise}
    profile = tmp_path / "profile.toml"
    profile.write_text(profile_toml(calibration), encoding="utf-8")
    replayed = load_scenario(profile)
    assert replayed.cost.table == str(tmp_path / "gpu.csv")
    assert run_scenario(replayed, "fixed:1", duration_s=5.0).steps > 0


def test_profile_and_calibrate_take_a_cost_table_on_the_command_line(tmp_path, capsys):
    write_staircase(tmp_path / "gpu.csv", max_k=7)
    code = main(["profile", "--engine", "twin:open-loop-parametric", "--cost-table",
                 str(tmp_path / "gpu.csv"), "--budget-s", "12", "--cells", "4",
                 "--out", str(tmp_path / "prof"), "--no-progress", "--json"])
    assert code == 0
    assert len(json.loads(capsys.readouterr().out)["cells"]) == 4
    assert main(["profile", "--engine", "openai:http://127.0.0.1:9", "--cost-table",
                 str(tmp_path / "gpu.csv"), "--out", str(tmp_path)]) == 2
    assert "--cost-table only applies to twin:SCENARIO" in capsys.readouterr().err
    (tmp_path / "bad.csv").write_text("batched_tokens,kv_tokens,k,latency_s\n1,0,0,zero\n")
    assert main(["profile", "--engine", "twin:open-loop-parametric", "--cost-table",
                 str(tmp_path / "bad.csv"), "--out", str(tmp_path), "--no-progress"]) == 1
    assert "bad.csv line 2, column latency_s: 'zero' is not a number" in capsys.readouterr().err
