"""Sustained yield: steady runs at K correct the pooled per-position prediction."""

from __future__ import annotations

import dataclasses

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


def _constant_steps(engine: str, *, k: int, accepted: list[int], n: int = 400) -> pl.DataFrame:
    """`n` steps of one engine at K = `k`, 8 decode requests drafting, a request starting
    every step (so a run has seen hundreds: strong evidence)."""
    return pl.DataFrame({
        "engine_id": [engine] * n, "step_seq": list(range(n)), "ts_ns": list(range(n)),
        "batch_size": [9] * n, "num_decode_reqs": [8] * n, "num_prefill_reqs": [1] * n,
        "num_prefill_tokens": [50] * n, "k": [k] * n, "k_next": [k] * n,
        "num_drafts": [8] * n, "num_draft_tokens": [8 * k] * n,
        "accepted_per_pos": [accepted] * n, "kv_tokens": [800] * n,
        "step_latency_s": [0.010 + 0.001 * k] * n})


def test_the_surface_follows_steady_runs_where_pooling_misreads() -> None:
    """Two steady runs whose per-position counts, pooled, overstate what K=4 emits:
    at K=1 every drafter accepts; at K=4 only half accept anything, all four then."""
    frame = pl.concat([_constant_steps("a", k=1, accepted=[8]),
                       _constant_steps("b", k=4, accepted=[4, 4, 4, 4])])
    fit = fit_surface(frame, max_k=4, max_batch=9, half_life_s=None)
    assert fit.sustained is not None
    surface = fit.evaluate([8], [1, 4])
    # Pooled: p1 = 12/16, p2..p4 = 1 -> 1 + 4 * 0.75 = 4.0 at K=4; steady runs say 3.0.
    assert fit.acceptance.predict([4])[0] == pytest.approx(4.0, rel=0.02)
    assert surface.tokens_per_request[1] == pytest.approx(3.0, rel=0.05)
    assert surface.tokens_per_request[0] == pytest.approx(2.0, rel=0.05)


def test_a_single_steady_k_extrapolates_with_the_prior_slope() -> None:
    """Live windows run one K: the level comes from it, the slope from the last sweep."""
    flat = SustainedYieldModel().fit(_rows([4], [1.0], [1.2], [5000]))
    carried = SustainedYieldModel(prior_slope=-0.08).fit(_rows([4], [1.0], [1.2], [5000]))
    for model in (flat, carried):
        assert model.predict([4])[0] == pytest.approx(np.log(1.0 / 1.2), abs=0.01)
    assert flat.predict([7])[0] == pytest.approx(flat.predict([4])[0], abs=1e-3)
    assert carried.predict([7])[0] - carried.predict([4])[0] == pytest.approx(-0.24, abs=0.01)


def test_the_envelope_carries_the_line_and_a_refit_keeps_its_slope() -> None:
    from fitter.derive import derive_envelope
    from fitter.refit import decide_refit

    k1 = _constant_steps("a", k=1, accepted=[8])
    k4 = _constant_steps("b", k=4, accepted=[4, 4, 4, 4])
    fit = fit_surface(pl.concat([k1, k4]), max_k=4, max_batch=9, half_life_s=None)
    envelope = derive_envelope(fit, key="m|ngram|hw", version=1, max_k=4, max_batch=9,
                               startup_k_values=range(5))
    line = envelope.surface["sustained_yield"]
    assert line["observed_k"] == [1, 4] and line["slope"] < -0.05
    # A live window that ran K=4 only: the refit's line keeps the envelope's slope.
    decision = decide_refit(_constant_steps("c", k=4, accepted=[5, 4, 4, 3]), envelope,
                            half_life_s=None)
    refit_line = decision.envelope.surface["sustained_yield"]
    assert refit_line["observed_k"] == [4]
    assert refit_line["slope"] == pytest.approx(line["slope"], abs=0.01)


def test_an_envelope_says_its_slope() -> None:
    from schemas import DraftTable, TableEnvelope

    envelope = TableEnvelope(key="m|d|h", version=1, table=DraftTable.from_vllm([[1, 8, 3]]),
                             startup_k_values=(0, 3), max_batch=8,
                             created_at="2026-01-01T00:00:00+00:00",
                             surface={"sustained_yield": {"slope": -0.07}})
    assert envelope.sustained_slope == pytest.approx(-0.07)
    assert dataclasses.replace(envelope, surface={}).sustained_slope == 0.0
