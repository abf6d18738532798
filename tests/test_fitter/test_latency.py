"""StepLatencyModel: estimator contract, held-out-K accuracy, shape, robustness."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.base import clone

from fitter.surface.latency import LATENCY_COLUMNS, StepLatencyModel, decode_matrix
from fitter.surface.synthetic import H100_EAGLE, CostModel, make_step_records
from fitter.surface.telemetry import latency_cells, to_frame
from fitter.surface.validation import NotFittedError
from tests.test_fitter.conftest import HELD_OUT_K, TRAIN_K, mean_abs_pct_error


def _cells(cost: CostModel, max_batch: int, *, seed: int = 1, outliers: float = 0.01,
           noise: float = 0.03, n_steps: int = 30_000):
    records = make_step_records(n_steps, seed=seed, cost=cost, k_values=TRAIN_K,
                                max_batch=max_batch, noise_rel=noise,
                                outlier_fraction=outliers)
    frame = to_frame(records)
    X, y, weight = latency_cells(frame, np.ones(frame.height), None)
    return X, y, weight / (weight + 10.0)


def _held_out_mape(model: StepLatencyModel, cost: CostModel, max_batch: int) -> float:
    batch = np.arange(1, max_batch + 1)
    errors = [
        mean_abs_pct_error(model.predict(decode_matrix(batch, k, 512.0)),
                           cost.decode_latency_s(batch, k, 512.0))
        for k in HELD_OUT_K
    ]
    return max(errors)


@pytest.fixture(scope="module")
def linear_cells():
    return _cells(H100_EAGLE, 256)


KNEE_CASES = {
    "linear": (H100_EAGLE, 256),
    "knee-2048": (CostModel(knee_tokens=2048), 512),
    "knee-256": (CostModel(knee_tokens=256), 256),
}


@pytest.mark.parametrize("case", sorted(KNEE_CASES))
def test_held_out_k_within_3pct(case: str) -> None:
    cost, max_batch = KNEE_CASES[case]
    X, y, w = _cells(cost, max_batch)
    assert set(np.unique(X[:, 1]).astype(int)) == set(TRAIN_K)
    model = StepLatencyModel().fit(X, y, w)
    assert _held_out_mape(model, cost, max_batch) <= 3.0


@pytest.mark.parametrize("case", ["knee-2048", "knee-256"])
def test_knee_data_defeats_a_linear_model(case: str) -> None:
    """The held-out test discriminates: one open segment (a linear model) misses the knee."""
    cost, max_batch = KNEE_CASES[case]
    X, y, w = _cells(cost, max_batch)
    assert _held_out_mape(StepLatencyModel(n_knots=1).fit(X, y, w), cost, max_batch) > 3.0


def test_heavy_outliers_and_raw_steps() -> None:
    """10% of steps 1.5-4x slow, fitted on raw steps (no cell medians): Huber carries it."""
    records = make_step_records(20_000, seed=5, k_values=TRAIN_K, outlier_fraction=0.10)
    frame = to_frame(records)
    X = frame.select(LATENCY_COLUMNS).to_numpy().astype(float)
    model = StepLatencyModel().fit(X, frame["step_latency_s"].to_numpy())
    assert _held_out_mape(model, H100_EAGLE, 256) <= 3.0
    assert model.outlier_weight_.min() < 0.5  # the outliers were actually down-weighted


def test_monotone_in_batch_and_k(linear_cells) -> None:
    model = StepLatencyModel().fit(*linear_cells)
    batch = np.arange(1, 1025)  # well past the training range
    grid = np.stack([model.predict(decode_matrix(batch, k, 900.0)) for k in range(12)])
    assert (np.diff(grid, axis=1) >= -1e-12).all()
    assert (np.diff(grid, axis=0) >= -1e-12).all()
    assert (model.coef_ >= 0).all()


def test_fit_returns_self_and_sets_learned_attributes(linear_cells) -> None:
    model = StepLatencyModel(n_knots=8)
    assert model.fit(*linear_cells) is model
    assert model.n_knots == 8  # hyper-parameters untouched
    assert model.coef_.shape == (len(model.feature_names_),)
    assert list(model.observed_k_) == list(TRAIN_K)


def test_clone_keeps_hyper_parameters_only(linear_cells) -> None:
    fitted = StepLatencyModel(n_knots=9, smoothness=1e-5).fit(*linear_cells)
    copy = clone(fitted)
    assert copy.get_params() == {**fitted.get_params(), "n_knots": 9, "smoothness": 1e-5}
    assert not hasattr(copy, "coef_")


def test_a_drafter_never_switched_off_leaves_k0_uncertain() -> None:
    """Without K=0 steps the drafter's fixed cost hides in the intercept: K=0 is predicted
    cautiously (not faster than the data shows) and flagged as unidentified."""
    cost = H100_EAGLE
    records = make_step_records(20_000, seed=8, k_values=(1, 3), prefill_fraction=0.0)
    frame = to_frame(records)
    X, y, w = latency_cells(frame, np.ones(frame.height), None)
    model = StepLatencyModel().fit(X, y, w / (w + 10))
    assert not model.drafter_off_observed_
    batch = np.arange(1, 257)
    k0 = decode_matrix(batch, 0, 512.0)
    assert (model.unidentified_std(k0) > 0).all()
    assert (model.unidentified_std(decode_matrix(batch, 2, 512.0)) == 0).all()
    assert (model.predict(k0) >= 0.97 * cost.decode_latency_s(batch, 0, 512.0)).all()
    with_k0 = StepLatencyModel().fit(*_cells(cost, 256))
    assert with_k0.drafter_off_observed_
    assert (with_k0.unidentified_std(k0) == 0).all()


def test_unfitted_model_refuses_to_predict() -> None:
    with pytest.raises(NotFittedError, match="not fitted"):
        StepLatencyModel().predict(np.ones((1, len(LATENCY_COLUMNS))))


def test_predict_is_pure(linear_cells) -> None:
    model = StepLatencyModel().fit(*linear_cells)
    X = decode_matrix(np.arange(1, 65), 3, 700.0)
    before = X.copy()
    first = model.predict(X)
    np.testing.assert_array_equal(model.predict(X), first)
    np.testing.assert_array_equal(X, before)


def test_row_permutation_does_not_change_the_fit(linear_cells) -> None:
    X, y, w = linear_cells
    order = np.random.default_rng(0).permutation(y.size)
    a = StepLatencyModel().fit(X, y, w)
    b = StepLatencyModel().fit(X[order], y[order], w[order])
    grid = decode_matrix(np.arange(1, 257), 4, 512.0)
    np.testing.assert_allclose(a.predict(grid), b.predict(grid), rtol=1e-6)


def test_uncertainty_is_positive(linear_cells) -> None:
    model = StepLatencyModel().fit(*linear_cells)
    std = model.predict_std(decode_matrix(np.arange(1, 257), 3, 512.0))
    assert (std > 0).all() and np.isfinite(std).all()


@pytest.mark.parametrize(
    ("params", "match"),
    [({"n_knots": 0}, "n_knots"), ({"smoothness": -1.0}, "smoothness"),
     ({"huber_k": 0.0}, "huber_k")],
)
def test_bad_hyper_parameters_raise_in_fit(linear_cells, params, match) -> None:
    model = StepLatencyModel(**params)  # __init__ stores, never validates
    with pytest.raises(ValueError, match=match):
        model.fit(*linear_cells)


def test_bad_data_raises(linear_cells) -> None:
    X, y, w = linear_cells
    with pytest.raises(ValueError, match="y must be > 0"):
        StepLatencyModel().fit(X, -y, w)
    with pytest.raises(ValueError, match="shape"):
        StepLatencyModel().fit(X[:, :3], y, w)


def test_latency_follows_the_drafts_actually_verified() -> None:
    """30% of requests draft (n-gram): the verify is sized by num_draft_tokens, so latency at
    a candidate K is right with the draft share and would be overstated without it."""
    cost = CostModel(drafter="ngram")
    share = 0.3
    records = make_step_records(20_000, seed=4, cost=cost, k_values=TRAIN_K, draft_share=share)
    frame = to_frame(records)
    X, y, w = latency_cells(frame, np.ones(frame.height), None)
    model = StepLatencyModel().fit(X, y, w / (w + 10.0))
    batch = np.arange(1, 257)
    for k in HELD_OUT_K:
        truth = cost.step_latency_s(batch * (1.0 + share * k), batch * 512.0, k)
        predicted = model.predict(decode_matrix(batch, k, 512.0, draft_share=share))
        assert mean_abs_pct_error(predicted, truth) <= 3.0
        assert (model.predict(decode_matrix(batch, k, 512.0))[128:] > 1.1 * truth[128:]).all()


def test_legacy_layout_without_draft_tokens(linear_cells) -> None:
    """X in the six-column layout (no num_draft_tokens) reads as decode_reqs * k drafts."""
    X, y, w = linear_cells
    full = StepLatencyModel().fit(X, y, w)
    legacy = StepLatencyModel().fit(X[:, :-1], y, w)
    assert legacy.n_features_in_ == len(LATENCY_COLUMNS) - 1
    grid = decode_matrix(np.arange(1, 257), 3, 512.0)
    np.testing.assert_allclose(legacy.predict(grid[:, :-1]), full.predict(grid), rtol=1e-9)
    np.testing.assert_allclose(legacy.predict(grid), full.predict(grid), rtol=1e-9)


def test_the_held_reading_differs_only_past_the_measured_request_count(linear_cells) -> None:
    X, y, weight = linear_cells
    wide = StepLatencyModel().fit(X, y, sample_weight=weight)
    assert wide.requests_identified_  # batch sizes 1..256 tell a request from a step
    one_load = X[:, 0] + X[:, 4] == 16
    narrow = StepLatencyModel().fit(X[one_load], y[one_load], sample_weight=weight[one_load])
    assert not narrow.requests_identified_
    assert narrow.max_measured_requests_ == 16
    k = np.arange(8)
    for batch, same in ((8, True), (16, True), (64, False), (256, False)):
        rows = decode_matrix(np.full(k.size, batch), k, 512.0)
        held, fitted = narrow.predict_held(rows), narrow.predict(rows)
        assert np.allclose(held, fitted) == same
        assert (held <= fitted + 1e-12).all()  # the held terms only ever count fewer
