"""Whole-phase accounting: a phase counted from its first second, beside the settled window.

Hand-made timelines where TableTune loses its first 20 s after each change and is level with
the best fixed K after it: the settled window says 1.0, the whole phase must say less, by
exactly what those seconds cost.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from bench.fleet_recovery import _whole_run, _window, tables_staged
from bench.swing import reprofiles
from bench.swing_account import account, forced_share
from controller.fleet.decisions import Decision, What
from tabletune.suite.ratios import drift_phase
from tabletune.suite.report import _drift
from twin import EngineConfig, PhaseConfig, Scenario

SPANS = [{"name": "before", "start_s": 0.0, "end_s": 40.0, "output_tokens_per_s": 0},
         {"name": "after", "start_s": 40.0, "end_s": 80.0, "output_tokens_per_s": 0}]


def timeline(*rates: float) -> list[list[float]]:
    return [[10.0 * i, rate] for i, rate in enumerate(rates)]


def test_drift_phase_counts_the_whole_phase_beside_the_settled_window():
    runs = {"fixed:0": {"phases": SPANS, "timeline": timeline(9, 9, 9, 9, 100, 100, 100, 100)},
            "fixed:1": {"phases": SPANS, "timeline": timeline(9, 9, 9, 9, 50, 50, 50, 50)},
            "tabletune": {"phases": SPANS, "timeline": timeline(9, 9, 9, 9, 20, 60, 100, 100)}}
    stale = {"phases": SPANS, "timeline": timeline(9, 9, 9, 9, 60, 60, 60, 60)}
    row = drift_phase(runs, stale, phase=1, settle_s=20.0, fixed=("fixed:0", "fixed:1"),
                      baselines=())
    # the settled window, as before
    assert row["window_s"] == [60.0, 80.0]
    assert row["tabletune_vs_best_fixed"] == 1.0 and row["recovery"] == 1.0
    # the whole phase: (20 + 60 + 100 + 100) / 4 = 70 against 100, stale 60
    whole = row["whole_phase"]
    assert whole["window_s"] == [40.0, 80.0]
    assert whole["best_fixed"] == "fixed:0" and whole["best_fixed_tok_s"] == 100.0
    assert whole["tabletune_tok_s"] == 70.0 and whole["tabletune_vs_best_fixed"] == 0.7
    assert whole["stale_loss"] == 0.4 and whole["recovery"] == 0.25
    results = {"spec": {"settle_s": 20.0, "profile_budget_s": 10.0},
               "drift": {"tiny": {"phases": [row]}}}
    table = [line for line in _drift(results, ["tabletune"]) if line.startswith("| tiny")]
    assert table == ["| tiny | after | 60–80 | `—` | K0 100 | +40.0% | 1.000 | 1.00 "
                     "| 40–80 | K0 100 | +40.0% | 0.700 | 0.25 |"]


def test_fleet_recovery_window_pools_engines_over_the_whole_phase():
    def run(*rates: float) -> SimpleNamespace:
        return SimpleNamespace(timeline=timeline(*rates))

    fixed = [{0: run(0, 0, 100, 100), 1: run(0, 0, 50, 50)},
             {0: run(0, 0, 100, 100), 1: run(0, 0, 50, 50)}]
    stale = [run(0, 0, 60, 60), run(0, 0, 60, 60)]
    fleet = [{"timeline": timeline(0, 0, 20, 100)}, {"timeline": timeline(0, 0, 60, 100)}]
    memory = [run(0, 0, 100, 100), run(0, 0, 40, 100)]
    settled = _window(30.0, 40.0, fixed, stale, fleet, memory)
    whole = _window(20.0, 40.0, fixed, stale, fleet, memory)
    assert settled["fleet_recovery"] == 1.0 and settled["fleet_vs_best_fixed"] == 1.0
    assert whole["best_fixed_k"] == 0 and whole["best_fixed_tok_s"] == 200.0
    assert whole["fleet_tok_s"] == 140.0 and whole["fleet_vs_best_fixed"] == 0.7
    assert whole["fleet_recovery"] == 0.25 and whole["in_memory_recovery"] == 0.625
    assert whole["stale_loss_pct"] == 40.0


def test_fleet_whole_run_pools_engines_bucket_by_bucket():
    def run(*rates: float) -> SimpleNamespace:
        return SimpleNamespace(timeline=timeline(*rates))

    phases = [{"name": "a", "start_s": 0.0, "end_s": 20.0},
              {"name": "b", "start_s": 20.0, "end_s": 40.0}]
    fixed = [{0: run(100, 100, 10, 10), 1: run(40, 40, 50, 50)}] * 2
    fleet = [{"timeline": timeline(50, 100, 20, 50), "phases": phases},
             {"timeline": timeline(50, 100, 20, 50), "phases": phases}]
    memory = [run(100, 100, 50, 50), run(100, 100, 50, 50)]
    result = _whole_run(fleet, fixed, memory)
    # per engine as in the swing account below; pooled, every rate doubles and ratios hold
    assert result["fleet"]["tok_s"]["fleet"] == 110.0
    assert result["fleet"]["vs_per_phase_best"] == pytest.approx(2200 / 3000, abs=1e-4)
    assert result["in_memory"]["vs_per_phase_best"] == 1.0
    assert [(p["best_fixed"], p["fleet"]) for p in result["phases"]] == [
        ("fixed:0", 0.75), ("fixed:1", 0.7)]


def test_reprofiles_are_placed_in_their_phase_and_flagged_on_a_return():
    def phase(name: str, users: int) -> PhaseConfig:
        return PhaseConfig(name=name, duration_s=100, concurrency=users, acceptance=(0.7,))

    scenario = Scenario(engine=EngineConfig(), phases=(
        phase("low", 2), phase("high", 16), phase("low-again", 2)))
    decisions = [SimpleNamespace(what=what, t_s=t_s, fields={"signal": signal})
                 for what, t_s, signal in (
                     ("stale", 130.0, "coverage"), ("reprofile", 130.0, None),
                     ("stale", 210.0, "acceptance"), ("reprofile", 250.0, None))]
    found = reprofiles(scenario, decisions)
    assert found == [
        {"t_s": 130.0, "phase": "high", "into_phase_s": 30.0, "return": False,
         "signal": "coverage"},
        {"t_s": 250.0, "phase": "low-again", "into_phase_s": 50.0, "return": True,
         "signal": "acceptance"}]


def test_swing_account_every_second_per_phase_and_over_the_run():
    spans = [("a", 0.0, 20.0), ("b", 20.0, 40.0)]
    timelines = {"fixed:0": timeline(100, 100, 10, 10), "fixed:1": timeline(40, 40, 50, 50),
                 "tabletune": timeline(50, 100, 20, 50)}
    result = account(timelines, spans, fixed=("fixed:0", "fixed:1"))
    a, b = result["phases"]
    assert a["best_fixed"] == "fixed:0" and a["vs_phase_best"] == 0.75
    assert b["best_fixed"] == "fixed:1" and b["vs_phase_best"] == 0.7
    run = result["run"]
    # tokens over 40 s: tabletune 2200, per-phase best 3000, K0 2200, K1 1800
    assert run["best_single_fixed"] == "fixed:0"
    assert run["tok_s"]["tabletune"] == 55.0 and run["per_phase_best_tok_s"] == 75.0
    assert run["vs_per_phase_best"] == pytest.approx(2200 / 3000, abs=1e-4)
    assert run["vs_best_single"] == 1.0
    assert run["headroom"] == pytest.approx(3000 / 2200, abs=1e-4)
    assert a["vs_run_best_single"] == 0.75 and b["vs_run_best_single"] == 3.5


def test_forced_share_worst_window_after_the_cold_profile():
    ts = np.arange(0.0, 100.0, 1.0)
    forced = (ts < 10) | ((ts >= 50) & (ts < 60))  # the cold profile, then one sweep
    share = forced_share(ts, forced, after_s=10.0, end_s=100.0, window_s=20.0)
    assert share["steps"] == 90 and share["forced_steps"] == 10
    assert share["share"] == pytest.approx(10 / 90, abs=1e-4)
    assert share["worst_window_share"] == 0.5
    assert 40.0 <= share["worst_window_start_s"] <= 50.0
    assert forced_share(ts, forced, after_s=95.0, end_s=100.0,
                        window_s=20.0)["worst_window_share"] is None


def test_each_staged_table_names_what_made_it():
    """A stage is credited to the decision just before it: the refit that published
    (version 3 at 100 s, not the one that computed version 3 at 70 s and kept the table),
    a roll-back or an interim table, whose versions a held-back refit had computed too."""
    key = "model|ngram|twin"
    decisions = [
        Decision(key, 1070.0, What.REFIT, {"reason": "periodic", "version": 3, "gain": 0.001,
                                          "gain_stderr": 0.01}),
        Decision(key, 1100.0, What.REFIT, {"reason": "follow_up", "version": 3, "gain": 0.02,
                                          "gain_stderr": 0.01}),
        Decision(key, 1100.0, What.UNWATCHED, {"version": 3}),
        Decision(key, 1100.0, What.STAGE, {"version": 3, "table": [[1, 128, 5]]}),
        Decision(key, 1130.0, What.REFIT, {"reason": "periodic", "version": 4, "gain": 0.001,
                                          "gain_stderr": 0.01}),
        Decision(key, 1140.0, What.ROLL_BACK, {"old_version": 2, "new_version": 3}),
        Decision(key, 1140.0, What.STAGE, {"version": 4, "table": [[1, 128, 2]]}),
        Decision(key, 1170.0, What.REFIT, {"reason": "periodic", "version": 5, "gain": 0.001,
                                          "gain_stderr": 0.01}),
        Decision(key, 1180.0, What.INTERIM, {"version": 5, "records": 900}),
        Decision(key, 1180.0, What.STAGE, {"version": 5, "table": [[1, 128, 6]]}),
        Decision(key, 1200.0, What.STAGE, {"version": 6, "table": [[1, 128, 3]]}),
    ]
    assert tables_staged(decisions, epoch_s=1000.0) == [
        {"t_s": 100.0, "version": 3, "table": [[1, 128, 5]], "reason": "follow_up",
         "gain": 0.02, "gain_stderr": 0.01},
        {"t_s": 140.0, "version": 4, "table": [[1, 128, 2]], "reason": "roll_back"},
        {"t_s": 180.0, "version": 5, "table": [[1, 128, 6]], "reason": "interim"},
        {"t_s": 200.0, "version": 6, "table": [[1, 128, 3]]},
    ]
