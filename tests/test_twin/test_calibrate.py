"""`twin calibrate`: a cost profile and acceptance fitted to the twin's own telemetry come back."""

from __future__ import annotations

import argparse

import polars as pl
import pyarrow.parquet as pq
import pytest

from producers.sinks import read_file_sink
from tabletune.cli_twin import register
from twin import (
    CostConfig,
    DrafterConfig,
    EngineConfig,
    PhaseConfig,
    Scenario,
    load_scenario,
    run_scenario,
)
from twin.calibrate import calibrate, load_records
from twin.calibration import CalibrationError

KNOWN = {"target_kv": 2.0e-6, "target_batched": 4.0e-4, "target_fixed": 5.0e-3,
         "draft_kv": 5.0e-7, "draft_per_token": 1.0e-3, "draft_fixed": 2.0e-3,
         "ngram_fraction": 0.0, "step_overhead": 1.0e-3}
ACCEPTANCE = (0.8, 0.6, 0.5, 0.4)


def _records(tmp_path, method: str, cost: dict[str, float], ks: tuple[int, ...],
             match_prob: float = 1.0, noise: float = 0.02) -> pl.DataFrame:
    """The twin's records at each fixed K over loads that move KV and batched apart."""
    phases = tuple(PhaseConfig(name=f"c{c}", duration_s=6.0, concurrency=c,
                               acceptance=ACCEPTANCE, prompt_len=prompt, output_len=48)
                   for c, prompt in ((1, 400), (4, 60), (12, 200), (16, 30)))
    for k in ks:
        scenario = Scenario(
            seed=k + 1, phases=phases,
            engine=EngineConfig(max_num_seqs=16, max_k=4, engine_id=f"twin-k{k}",
                                hardware=f"twin.fixed{k}"),
            cost=CostConfig(profile="none", noise=noise, **cost),
            drafter=DrafterConfig(method=method, ngram_match_prob=match_prob))
        run_scenario(scenario, f"fixed:{k}", sink=f"file://{tmp_path / 'sink'}")
    return pl.from_arrow(read_file_sink(tmp_path / "sink"))


def _close(fitted: float, known: float, rel: float) -> bool:
    return abs(fitted - known) <= rel * known


def test_eagle_cost_and_acceptance_come_back(tmp_path):
    records = _records(tmp_path, "eagle", KNOWN, ks=(0, 1, 2, 4))
    cal = calibrate(records, source="twin")
    cost = cal.cost
    assert cal.method == "eagle" and cal.knee_tokens == 0
    # the twin's records carry no time outside a step: its overhead comes back in target_fixed
    assert cost["step_overhead"] < 1e-5
    assert _close(cost["target_fixed"] + cost["step_overhead"],
                  KNOWN["target_fixed"] + KNOWN["step_overhead"], 0.05), cost
    for name in ("target_kv", "target_batched", "draft_per_token", "draft_fixed"):
        assert _close(cost[name], KNOWN[name], 0.1), (name, cost)
    assert _close(cost["draft_kv"], KNOWN["draft_kv"], 0.3), cost
    assert cal.fit["r2"] > 0.95 and abs(cal.fit["fitted_total_ratio"] - 1) < 0.01
    assert 0.01 < cal.noise < 0.03
    assert len(cal.acceptance) == 4
    for fitted, known in zip(cal.acceptance, ACCEPTANCE, strict=True):
        assert abs(fitted - known) < 0.03, cal.acceptance


def test_ngram_fraction_and_match_probability_come_back(tmp_path):
    cost = {**KNOWN, "draft_kv": 0.0, "draft_per_token": 0.0, "draft_fixed": 0.0,
            "ngram_fraction": 0.3}
    records = _records(tmp_path, "ngram", cost, ks=(0, 3), match_prob=0.4, noise=0.01)
    cal = calibrate(records, source="twin")
    assert cal.method == "ngram"
    assert abs(cal.cost["ngram_fraction"] - 0.3) < 0.03, cal.cost
    assert _close(cal.cost["target_batched"], KNOWN["target_batched"], 0.1), cal.cost
    assert abs(cal.ngram_match_prob - 0.4) < 0.05, cal.ngram_match_prob
    assert abs(cal.acceptance[0] - ACCEPTANCE[0]) < 0.03, cal.acceptance
    assert abs(cal.acceptance[1] - ACCEPTANCE[1]) < 0.05, cal.acceptance


def test_one_k_only_names_what_it_cannot_separate(tmp_path):
    cal = calibrate(_records(tmp_path, "eagle", KNOWN, ks=(2,)), source="twin")
    assert cal.cost["draft_per_token"] == cal.cost["draft_fixed"] == cal.cost["draft_kv"] == 0
    assert any(note.startswith("draft_per_token") for note in cal.notes)
    assert any(note.startswith("draft_kv") for note in cal.notes)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tabletune")
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.handler(args)


def test_cli_writes_a_profile_the_twin_runs(tmp_path, capsys):
    table = read_file_sink(_sink(tmp_path))
    leaf = tmp_path / "parquet/model=m/drafter=eagle/hardware=twin.fixed2/date=2026-01-01/hour=00"
    leaf.mkdir(parents=True)
    pq.write_table(table, leaf / "tabletune.telemetry-p0-000000000000-000000000009.parquet")
    out = tmp_path / "profile.toml"
    assert _main(["twin", "calibrate", "--parquet", str(tmp_path / "parquet"),
                  "--hardware-prefix", "twin.fixed", "--records-from", "twin",
                  "--out", str(out)]) == 0
    assert "step records" in capsys.readouterr().out
    scenario = load_scenario(out)
    assert scenario.cost.profile == "none" and scenario.cost.target_batched > 0
    assert scenario.phases[0].acceptance and scenario.drafter.method == "eagle"
    assert run_scenario(scenario, "fixed:2", duration_s=5.0).output_tokens > 0

    assert _main(["twin", "calibrate", "--parquet", str(tmp_path / "parquet"),
                  "--hardware-prefix", "gpu", "--out", str(out)]) == 1
    assert "no step records" in capsys.readouterr().err
    assert _main(["twin", "calibrate", "--parquet", str(tmp_path / "nothing"),
                  "--out", str(out)]) == 1
    assert "no Parquet telemetry" in capsys.readouterr().err


def _sink(tmp_path):
    scenario = Scenario(seed=1, engine=EngineConfig(max_num_seqs=16, max_k=4,
                                                    hardware="twin.fixed2"),
                        cost=CostConfig(profile="none", **KNOWN),
                        phases=(PhaseConfig(duration_s=5.0, concurrency=4,
                                            acceptance=ACCEPTANCE, prompt_len=60,
                                            output_len=40),))
    run_scenario(scenario, "fixed:2", sink=f"file://{tmp_path / 'sink'}")
    return tmp_path / "sink"


def test_empty_records_are_an_error(tmp_path):
    with pytest.raises(CalibrationError, match="no Parquet telemetry"):
        load_records(tmp_path)
    with pytest.raises(CalibrationError, match="no step records"):
        calibrate(pl.DataFrame())


def test_capped_poisson_arrivals_and_uniform_lengths():
    """vLLM's client as bench.twin_fidelity runs it: Poisson arrivals held at the client
    while `max_concurrency` are in flight, lengths within ±25 % of the means."""
    def run(rate: float):
        phase = PhaseConfig(duration_s=60.0, rate_rps=rate, max_concurrency=3,
                            acceptance=ACCEPTANCE, prompt_len=40, output_len=32,
                            length_range=0.25)
        return run_scenario(Scenario(seed=2, phases=(phase,),
                                     engine=EngineConfig(max_num_seqs=16, max_k=4),
                                     cost=CostConfig(profile="none", **KNOWN)), "fixed:2")

    flooded = run(1000.0)
    assert 2.9 < flooded.mean_batch_size <= 3.0  # the cap, not the rate, sets the load
    sparse = run(1.0)
    assert sparse.mean_batch_size < 1.5
    assert 24 <= sparse.output_tokens / sparse.requests_finished <= 40
    with pytest.raises(ValueError, match="max_concurrency"):
        PhaseConfig(concurrency=3, max_concurrency=3, acceptance=ACCEPTANCE)
