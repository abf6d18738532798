"""The suite's arithmetic on hand-made numbers."""

from __future__ import annotations

import pytest

from tabletune.suite.collect import score
from tabletune.suite.ratios import (
    best_single_fixed,
    curve_changes,
    drift_phase,
    grid_ratios,
    oracle,
    recovery,
    window_rate,
)

FIXED = ("fixed:0", "fixed:1")
LOADS = [
    {"fixed:0": 100.0, "fixed:1": 200.0, "a": 150.0, "b": 100.0},
    {"fixed:0": 300.0, "fixed:1": 200.0, "a": 300.0, "b": 150.0},
]


def test_oracle_is_the_best_fixed_k_per_load():
    assert oracle(LOADS[0], FIXED) == ("fixed:1", 200.0)
    assert oracle(LOADS[1], FIXED) == ("fixed:0", 300.0)
    assert oracle({"fixed:0": None, "a": 5.0}, FIXED) == (None, None)


def test_curve_changes_counts_where_the_best_k_moves_from_load_to_load():
    def curve(*policies):
        return [{"policy": p, "score": 1.0} for p in policies]

    assert curve_changes(curve("fixed:7", "fixed:7", "fixed:5", "fixed:5", "fixed:2")) == 2
    assert curve_changes(curve("fixed:3")) == 0
    # A-B-A counts twice: the curve itself turns back
    assert curve_changes(curve("fixed:3", "fixed:4", "fixed:3")) == 2
    assert curve_changes(curve("fixed:3", None)) is None


def test_best_single_fixed_is_best_mean_ratio_not_best_mean_rate():
    loads = [{"fixed:0": 100.0, "fixed:1": 200.0}, {"fixed:0": 1000.0, "fixed:1": 850.0}]
    # fixed:0 has the higher mean rate (550 vs 525), fixed:1 the higher mean ratio
    # to the per-load best (0.925 vs 0.75): the high load must not decide alone.
    assert best_single_fixed(loads, FIXED) == "fixed:1"
    assert best_single_fixed(LOADS, FIXED) == "fixed:1"


def test_grid_ratios():
    out = grid_ratios(LOADS, fixed=FIXED, baselines=("b",))
    assert out["best_single_fixed"] == "fixed:1"
    assert out["oracle"] == [{"policy": "fixed:1", "score": 200.0},
                             {"policy": "fixed:0", "score": 300.0}]
    a = out["policies"]["a"]
    assert a["vs_oracle"] == {"mean": 0.875, "worst": 0.75, "per_load": [0.75, 1.0]}
    assert a["vs_best_single_fixed"] == {"mean": 1.125, "worst": 0.75,
                                         "per_load": [0.75, 1.5]}
    assert a["vs"]["b"] == {"mean": 1.75, "worst": 1.5, "per_load": [1.5, 2.0]}
    assert "b" not in out["policies"]["b"]["vs"]
    assert out["policies"]["fixed:1"]["vs_oracle"]["mean"] == pytest.approx(0.8333, abs=1e-4)


def test_a_failed_run_makes_its_statistics_none_not_shorter():
    loads = [dict(LOADS[0]), {**LOADS[1], "a": None}]
    out = grid_ratios(loads, fixed=FIXED, baselines=("b",))
    assert out["policies"]["a"]["vs_oracle"] is None
    assert out["policies"]["b"]["vs_oracle"]["worst"] == 0.5


def test_recovery():
    assert recovery(95.0, 80.0, 100.0) == pytest.approx(0.75)
    assert recovery(80.0, 80.0, 100.0) == 0.0
    assert recovery(99.0, 99.5, 100.0) is None  # lost 0.5%: nothing to recover
    assert recovery(None, 80.0, 100.0) is None


def test_window_rate_uses_buckets_starting_in_the_window():
    timeline = [[0.0, 1.0], [10.0, 2.0], [20.0, 4.0], [30.0, 8.0]]
    assert window_rate(timeline, 10.0, 30.0) == 3.0
    assert window_rate(timeline, 100.0, 200.0) is None


def test_drift_phase_on_hand_made_timelines():
    spans = [{"name": "before", "start_s": 0.0, "end_s": 20.0, "output_tokens_per_s": 0},
             {"name": "after", "start_s": 20.0, "end_s": 60.0, "output_tokens_per_s": 0}]

    def run(after: float) -> dict:
        return {"phases": spans, "timeline": [[0.0, 9.0], [10.0, 9.0], [20.0, 1.0],
                                              [30.0, 1.0], [40.0, after], [50.0, after]]}

    runs = {"fixed:0": run(100.0), "fixed:1": run(50.0), "tabletune": run(90.0),
            "b": {"error": "boom"}}
    row = drift_phase(runs, run(60.0), phase=1, settle_s=20.0, fixed=FIXED, baselines=("b",))
    assert row["window_s"] == [40.0, 60.0]
    assert row["best_fixed"] == "fixed:0" and row["best_fixed_tok_s"] == 100.0
    assert row["stale_tok_s"] == 60.0 and row["stale_loss"] == 0.4
    assert row["recovery"] == 0.75
    assert row["tabletune_vs_best_fixed"] == 0.9
    assert row["vs_best_fixed"] == {"b": None, "tabletune": 0.9}


def test_score_closed_is_throughput_open_is_decode_speed():
    run = {"output_tokens_per_s": 1234.0, "tpot_ms_p50": 20.0}
    assert score(run, closed=True) == 1234.0
    assert score(run, closed=False) == 50.0
    assert score({"error": "x"}, closed=True) is None
    assert score({"tpot_ms_p50": None}, closed=False) is None
