"""AcceptanceModel and DraftShareModel: censoring, recency weighting, uncertainty, contract."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.base import clone

from fitter.surface.acceptance import AcceptanceModel
from fitter.surface.share import DraftShareModel, share_rows
from fitter.surface.synthetic import (
    GSM8K_NGRAM_CONDITIONAL,
    SHAREGPT_EAGLE_CONDITIONAL,
    make_step_records,
    true_acceptance_length,
)
from fitter.surface.telemetry import acceptance_rows, recency_weights, to_frame
from fitter.surface.validation import NotFittedError

TRUTH = np.asarray(SHAREGPT_EAGLE_CONDITIONAL)


def _rows(records, n_positions=7, half_life_s=None):
    frame = to_frame(records)
    weights = recency_weights(frame["ts_ns"].to_numpy(), half_life_s)
    return acceptance_rows(frame, weights, n_positions)


@pytest.fixture(scope="module")
def short_k_rows():
    """Drafts of length 1 or 2 only: positions 3+ are censored everywhere."""
    return _rows(make_step_records(20_000, seed=3, k_values=(1, 2), max_batch=64))


def test_censored_positions_are_estimated_only_where_drafted(short_k_rows) -> None:
    model = AcceptanceModel().fit(short_k_rows)
    np.testing.assert_allclose(model.conditional_[:2], TRUTH[:2], atol=0.02)
    unconditional_truth = np.cumprod(TRUTH)
    np.testing.assert_allclose(model.unconditional_[:2], unconditional_truth[:2], atol=0.02)
    # Position 2 is drafted in about half the steps; a naive unconditional average over all
    # drafting steps reads those misses as rejections and lands far below the truth.
    naive_a2 = np.nansum(short_k_rows[:, 2]) / short_k_rows[:, 0].sum()
    assert naive_a2 < 0.7 * unconditional_truth[1]
    assert list(model.observed_positions_) == [1, 2]


def test_unobserved_position_is_not_zero_and_is_uncertain(short_k_rows) -> None:
    model = AcceptanceModel().fit(short_k_rows)
    assert model.unconditional_[2] > 0.5 * model.unconditional_[1]
    assert model.predict([3])[0] > model.predict([2])[0]
    assert model.conditional_var_[2] > 50 * model.conditional_var_[1]
    std = model.predict_std([1, 2, 3])
    assert std[2] > 10 * std[1]


def test_full_data_recovers_acceptance_length() -> None:
    rows = _rows(make_step_records(30_000, seed=4, max_batch=128))
    model = AcceptanceModel().fit(rows)
    k = np.arange(8)
    np.testing.assert_allclose(model.predict(k), true_acceptance_length(TRUTH, k), rtol=0.01)
    assert model.predict([0])[0] == 1.0


def test_recency_weighting_follows_a_drift() -> None:
    records = make_step_records(40_000, seed=6, max_batch=64, k_values=(1, 2, 3),
                                conditional=SHAREGPT_EAGLE_CONDITIONAL,
                                conditional_after=GSM8K_NGRAM_CONDITIONAL, drift_at=0.5)
    ts = records.column("ts_ns").to_numpy()
    span_s = (ts.max() - ts.min()) * 1e-9
    unweighted = AcceptanceModel().fit(_rows(records, 3, None))
    recent = AcceptanceModel().fit(_rows(records, 3, span_s / 20))
    new_p1, old_p1 = GSM8K_NGRAM_CONDITIONAL[0], SHAREGPT_EAGLE_CONDITIONAL[0]
    assert abs(unweighted.conditional_[0] - new_p1) > 0.15  # a plain average is stuck between
    assert abs(recent.conditional_[0] - new_p1) < 0.03
    assert abs(recent.conditional_[0] - new_p1) < abs(unweighted.conditional_[0] - new_p1)
    assert abs(recent.conditional_[0] - old_p1) > 0.4


def test_sample_weight_scales_evidence_not_estimate(short_k_rows) -> None:
    one = AcceptanceModel().fit(short_k_rows)
    tenth = AcceptanceModel().fit(short_k_rows, sample_weight=np.full(len(short_k_rows), 0.1))
    np.testing.assert_allclose(one.conditional_[:2], tenth.conditional_[:2], atol=0.01)
    assert (tenth.conditional_var_[:2] > one.conditional_var_[:2]).all()


def test_row_order_does_not_matter(short_k_rows) -> None:
    reversed_rows = short_k_rows[::-1].copy()
    a = AcceptanceModel().fit(short_k_rows)
    b = AcceptanceModel().fit(reversed_rows)
    np.testing.assert_allclose(a.conditional_, b.conditional_)


def test_contract(short_k_rows) -> None:
    model = AcceptanceModel(prior_strength=4.0)
    assert model.fit(short_k_rows) is model
    assert model.prior_strength == 4.0 and model.n_positions is None
    assert model.n_positions_ == short_k_rows.shape[1] - 1
    with pytest.raises(NotFittedError, match="not fitted"):
        AcceptanceModel().predict([1])
    with pytest.raises(ValueError, match="K must be integers"):
        model.predict([model.n_positions_ + 1])


@pytest.mark.parametrize(
    ("params", "match"),
    [({"prior_mean": 1.5}, "prior_mean"), ({"prior_strength": 0.0}, "prior_strength"),
     ({"extrapolation_decay": 0.0}, "extrapolation_decay")],
)
def test_bad_hyper_parameters_raise_in_fit(short_k_rows, params, match) -> None:
    with pytest.raises(ValueError, match=match):
        AcceptanceModel(**params).fit(short_k_rows)


def test_bad_data_raises() -> None:
    holes = np.array([[10.0, np.nan, 3.0]])
    with pytest.raises(ValueError, match="drafted up to some position"):
        AcceptanceModel().fit(holes)
    with pytest.raises(ValueError, match="non-negative"):
        AcceptanceModel().fit(np.array([[10.0, -1.0]]))


def _binomial_share_rows(share: float, n_steps: int, max_decode: int, seed: int):
    rng = np.random.default_rng(seed)
    decode = rng.integers(1, max_decode + 1, n_steps).astype(float)
    drafts = rng.binomial(decode.astype(int), share).astype(float)
    k = np.where(drafts > 0, 4.0, 0.0)  # a step where nobody drafted verifies nothing
    return share_rows(decode, drafts, drafts * k, k)


@pytest.mark.parametrize("share", [0.05, 0.3, 0.9])
def test_draft_share_corrects_for_steps_where_nobody_drafted(share: float) -> None:
    """Small batches: steps with no drafter are invisible (k = 0), so the drafters per request
    in the visible steps overstate the share; the zero-truncated likelihood does not."""
    X = _binomial_share_rows(share, 40_000, max_decode=4, seed=1)
    visible = X[:, 1] > 0
    naive = X[visible, 1].sum() / X[visible, 0].sum()
    model = DraftShareModel().fit(X)
    assert abs(model.share_ - share) < 4 * np.sqrt(model.share_var_) + 1e-3
    assert naive - share > 10 * np.sqrt(model.share_var_)  # the correction matters here
    assert model.draft_length_ratio_ == 1.0
    np.testing.assert_allclose(model.predict([0, 2, 7]), model.share_ * np.array([0, 2, 7]))


def test_draft_share_is_exactly_one_when_every_request_drafts() -> None:
    X = _binomial_share_rows(1.0, 2_000, max_decode=64, seed=2)
    model = DraftShareModel().fit(X, sample_weight=np.full(X.shape[0], 0.5))
    assert model.share_ == 1.0 and model.share_var_ == 0.0
    assert not hasattr(clone(model), "share_")


def test_draft_share_sees_short_drafts_and_rejects_bad_counts() -> None:
    decode = np.full(100, 8.0)
    drafts = np.full(100, 4.0)
    model = DraftShareModel().fit(share_rows(decode, drafts, drafts * 3.0, np.full(100, 6.0)))
    assert model.draft_length_ratio_ == pytest.approx(0.5)
    assert model.slot_share_ == pytest.approx(model.share_ * 0.5)
    with pytest.raises(ValueError, match="exceeds"):
        DraftShareModel().fit(share_rows(decode, decode + 1, decode, decode))
    with pytest.raises(NotFittedError):
        DraftShareModel().predict([1])
