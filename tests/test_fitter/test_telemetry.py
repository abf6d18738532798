"""Telemetry -> estimator inputs: the vectorised aggregation agrees with a plain loop."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from fitter.surface.latency import LATENCY_COLUMNS
from fitter.surface.share import DraftShareModel, share_rows
from fitter.surface.synthetic import make_step_records
from fitter.surface.telemetry import (
    acceptance_rows,
    context_by_batch,
    draft_share_rows,
    latency_cells,
    recency_weights,
    to_frame,
)


def _small() -> pa.Table:
    return make_step_records(2_000, seed=9, max_batch=32, n_engines=2)


def test_acceptance_rows_match_a_loop_over_steps() -> None:
    frame = to_frame(_small())
    weights = np.random.default_rng(1).random(frame.height)
    n_positions = 5  # lengths 6 and 7 are truncated to 5
    expected = np.zeros((n_positions, n_positions + 1))
    for w, drafts, per_pos in zip(weights, frame["num_drafts"], frame["accepted_per_pos"],
                                  strict=True):
        length = min(len(per_pos), n_positions)
        if length == 0 or drafts == 0:
            continue
        expected[length - 1, 0] += w * drafts
        for i in range(length):
            expected[length - 1, i + 1] += w * per_pos[i]
    got = acceptance_rows(frame, weights, n_positions)
    censored = np.isnan(got)
    assert censored[0, 2:].all() and not censored[0, :2].any() and not censored[-1].any()
    np.testing.assert_allclose(np.nan_to_num(got), expected)


def test_duplicates_are_dropped_and_polars_input_accepted() -> None:
    records = _small()
    doubled = pa.concat_tables([records, records.slice(0, 500)])
    assert to_frame(doubled).height == records.num_rows
    assert to_frame(pl.from_arrow(doubled)).height == records.num_rows
    assert to_frame(doubled, dedupe=False).height == records.num_rows + 500


def test_latency_cells_keep_all_weight_and_use_medians() -> None:
    frame = to_frame(_small())
    weights = recency_weights(frame["ts_ns"].to_numpy(), half_life_s=0.5)
    X, y, cell_weight = latency_cells(frame, weights, half_life_s=0.5)
    assert np.isclose(cell_weight.sum(), weights.sum())
    assert X.shape == (y.size, len(LATENCY_COLUMNS)) and (y > 0).all()
    assert y.size < frame.height  # aggregated


def test_recency_weights_halve_per_half_life() -> None:
    ts = np.array([0, 10 * 10**9, 20 * 10**9], dtype=np.int64)
    np.testing.assert_allclose(recency_weights(ts, 10.0), [0.25, 0.5, 1.0])
    np.testing.assert_allclose(recency_weights(ts, None), [1.0, 1.0, 1.0])


def test_context_by_batch_tracks_the_data() -> None:
    records = make_step_records(5_000, seed=2, max_batch=64, context_tokens=1500.0,
                                prefill_fraction=0.0)
    frame = to_frame(records)
    context = context_by_batch(frame, np.ones(frame.height), np.arange(1, 129))
    assert context.shape == (128,)
    np.testing.assert_allclose(context, 1500.0 * np.exp(0.25**2 / 2), rtol=0.1)


def test_draft_share_rows_aggregate_like_per_step_rows() -> None:
    records = make_step_records(3_000, seed=9, max_batch=32, draft_share=0.4)
    frame = to_frame(records)
    weights = np.random.default_rng(2).random(frame.height)
    X, w = draft_share_rows(frame, weights)
    assert np.isclose(w.sum(), weights[frame["k"].to_numpy() > 0].sum())
    per_step = share_rows(*(frame[c].to_numpy().astype(float) for c in
                            ("num_decode_reqs", "num_drafts", "num_draft_tokens", "k")))
    a = DraftShareModel().fit(X, sample_weight=w)
    b = DraftShareModel().fit(per_step, sample_weight=weights)
    assert a.share_ == pytest.approx(b.share_, rel=1e-6) and abs(a.share_ - 0.4) < 0.03
    assert a.draft_length_ratio_ == pytest.approx(1.0)
