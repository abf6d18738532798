"""Sustained yield: steady runs at K correct the pooled per-position prediction."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from fitter.surface.fit import fit_surface
from fitter.surface.sustained import SustainedYieldModel
from fitter.surface.telemetry import sustained_rows


def _rows(ks, observed, pooled, requests) -> np.ndarray:
    columns = np.broadcast_arrays(*(np.asarray(c, dtype=np.float64)
                                    for c in (ks, observed, pooled, requests)))
    return np.column_stack(columns)


def test_fit_returns_self_and_recovers_a_line_from_strong_data() -> None:
    ks = np.arange(1, 8)
    truth = -0.02 - 0.06 * (ks - 4)
    pooled = 0.4 * ks
    model = SustainedYieldModel()
    assert model.fit(_rows(ks, pooled * np.exp(truth), pooled, 1e6)) is model
    np.testing.assert_allclose(model.predict(ks), truth, atol=2e-3)
    assert model.predict([0])[0] == 0.0  # K = 0 drafts nothing: nothing to correct
    assert (model.predict_var(ks) < 1e-4).all()


def test_weak_evidence_is_shrunk_toward_no_correction() -> None:
    ks = np.array([2, 6])
    pooled = np.array([0.8, 1.6])
    observed = pooled * np.exp([0.3, -0.3])
    strong = SustainedYieldModel().fit(_rows(ks, observed, pooled, 1e5))
    weak = SustainedYieldModel().fit(_rows(ks, observed, pooled, 2))
    assert abs(weak.coef_[1]) < 0.5 * abs(strong.coef_[1])
    assert weak.predict_var([7])[0] > strong.predict_var([7])[0]


def test_rows_without_evidence_mean_no_correction() -> None:
    model = SustainedYieldModel().fit(_rows([0, 3], [1.0, 0.0], [1.0, 2.0], [10, 10]))
    np.testing.assert_array_equal(model.predict([1, 4, 7]), 0.0)
    with pytest.raises(ValueError, match="no rows"):
        SustainedYieldModel().fit(np.zeros((0, 4)))


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        SustainedYieldModel().fit(_rows([1], [-1.0], [1.0], [5]))
    with pytest.raises(ValueError, match="prior_slope_sd"):
        SustainedYieldModel(prior_slope_sd=0.0).fit(_rows([1], [1.0], [1.0], [5]))


def _steps(ks_asked: list[int], *, engine: str = "e0", decode: int = 4, accepted: int = 2,
           start_seq: int = 0) -> pl.DataFrame:
    """One record per step; step i verifies what step i-1 asked for (k_next)."""
    n = len(ks_asked)
    return pl.DataFrame({
        "engine_id": [engine] * n, "step_seq": list(range(start_seq, start_seq + n)),
        "k_next": ks_asked, "num_decode_reqs": [decode] * n, "num_prefill_reqs": [1] * n,
        "batch_size": [decode + 1] * n,
        "accepted_per_pos": [[accepted] if k else [] for k in [0, *ks_asked[:-1]]],
    })


def test_sustained_rows_count_only_steps_deep_in_a_run() -> None:
    frame = _steps([3] * 10 + [5] * 3 + [3] * 10)
    rows = sustained_rows(frame, np.ones(frame.height), min_run_steps=4)
    # K=3: two runs of 10 asks -> steps verifying them are 10 and 10 long (the first
    # verifies nothing asked before the data), minus 4 each (the first run loses one more).
    np.testing.assert_array_equal(rows[:, 0], [3])
    assert rows[0, 1] == pytest.approx(2 / 4)
    steps = (10 - 1 - 4) + (10 - 4)
    first_of_runs = 2 * 5  # batch size at the first counted step of each run
    assert rows[0, 3] == pytest.approx(steps * 1 + first_of_runs)


def test_a_gap_in_step_seq_breaks_a_run() -> None:
    whole = _steps([2] * 12)
    gapped = pl.concat([_steps([2] * 6), _steps([2] * 6, start_seq=100)])
    assert sustained_rows(whole, np.ones(12), min_run_steps=6).shape[0] == 1
    assert sustained_rows(gapped, np.ones(12), min_run_steps=6).shape[0] == 0


def test_the_surface_follows_steady_runs_where_pooling_misreads() -> None:
    """Two steady runs whose per-position counts, pooled, overstate what K=4 emits:
    at K=1 every drafter accepts; at K=4 only half accept anything, all four then. A
    request starts every step, so each run has seen hundreds: strong evidence."""
    n = 400
    k1 = pl.DataFrame({
        "engine_id": ["a"] * n, "step_seq": list(range(n)), "ts_ns": list(range(n)),
        "batch_size": [9] * n, "num_decode_reqs": [8] * n, "num_prefill_reqs": [1] * n,
        "num_prefill_tokens": [50] * n, "k": [1] * n, "k_next": [1] * n,
        "num_drafts": [8] * n, "num_draft_tokens": [8] * n,
        "accepted_per_pos": [[8]] * n, "kv_tokens": [800] * n,
        "step_latency_s": [0.010] * n})
    k4 = k1.with_columns(
        engine_id=pl.lit("b"), k=pl.lit(4, dtype=pl.Int64), k_next=pl.lit(4, dtype=pl.Int64),
        num_draft_tokens=pl.lit(32, dtype=pl.Int64),
        accepted_per_pos=pl.lit([4, 4, 4, 4]), step_latency_s=pl.lit(0.014))
    frame = pl.concat([k1, k4])
    fit = fit_surface(frame, max_k=4, max_batch=9, half_life_s=None)
    assert fit.sustained is not None
    surface = fit.evaluate([8], [1, 4])
    # Pooled: p1 = 12/16, p2..p4 = 1 -> 1 + 4 * 0.75 = 4.0 at K=4; steady runs say 3.0.
    assert fit.acceptance.predict([4])[0] == pytest.approx(4.0, rel=0.02)
    assert surface.tokens_per_request[1] == pytest.approx(3.0, rel=0.05)
    assert surface.tokens_per_request[0] == pytest.approx(2.0, rel=0.05)
