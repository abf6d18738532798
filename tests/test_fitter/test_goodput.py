"""Goodput surface: G = B * AL / T, uncertainty where the data is thin, P(another K wins)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from fitter.surface.acceptance import AcceptanceModel
from fitter.surface.fit import SurfaceFit, fit_surface
from fitter.surface.goodput import evaluate_surface
from fitter.surface.latency import StepLatencyModel
from fitter.surface.synthetic import H100_EAGLE, SHAREGPT_EAGLE_CONDITIONAL, true_acceptance_length
from fitter.surface.validation import NotFittedError
from tests.test_fitter.conftest import MAX_BATCH, MAX_K


def test_goodput_is_batch_times_tokens_per_request_over_latency(all_k_fit: SurfaceFit) -> None:
    batch, ks = np.array([1, 7, 64, 200]), np.arange(MAX_K + 1)
    surface = all_k_fit.evaluate(batch, ks)
    assert surface.tokens_per_request is not None  # 1 + s (AL - 1) c, s = 1 under EAGLE
    expected = batch[:, None] * surface.tokens_per_request[None, :] / surface.latency_s
    np.testing.assert_allclose(surface.goodput_tok_s, expected)
    truth = (batch[:, None] * true_acceptance_length(SHAREGPT_EAGLE_CONDITIONAL, ks)[None, :]
             / H100_EAGLE.decode_latency_s(batch[:, None], ks[None, :], 512.0))
    np.testing.assert_allclose(surface.goodput_tok_s, truth, rtol=0.05)


def test_uncertainty_grows_where_telemetry_is_censored(censored_records) -> None:
    fit = fit_surface(censored_records, max_k=MAX_K, max_batch=MAX_BATCH, half_life_s=None)
    surface = fit.evaluate([4], np.arange(MAX_K + 1))
    relative = surface.goodput_std_tok_s[0] / surface.goodput_tok_s[0]
    assert (relative > 0).all() and np.isfinite(relative).all()
    # K=6, 7 were never drafted: their acceptance and latency are extrapolations.
    assert relative[7] > relative[6] > 3 * relative[5]
    assert surface.acceptance_length_std[7] > 10 * surface.acceptance_length_std[5]


def test_probability_better(all_k_fit: SurfaceFit) -> None:
    surface = all_k_fit.evaluate(np.arange(1, MAX_BATCH + 1), np.arange(MAX_K + 1))
    best = surface.goodput_tok_s.argmax(axis=1)
    p_vs_best = surface.probability_better(best)
    assert (p_vs_best[np.arange(best.size), best] == 0).all()
    assert (p_vs_best <= 0.5 + 1e-9).all()  # nothing is expected to beat the argmax
    worst = surface.goodput_tok_s.argmin(axis=1)
    p_vs_worst = surface.probability_better(worst)
    assert (p_vs_worst[np.arange(best.size), best] > 0.99).all()
    assert (surface.probability_better(best, margin=0.5) < 1e-6).all()


def test_unfitted_models_are_refused() -> None:
    with pytest.raises(NotFittedError):
        evaluate_surface(StepLatencyModel(), AcceptanceModel(), [1], [0], 512.0)


def test_evaluate_rejects_batch_sizes_outside_the_fit(all_k_fit: SurfaceFit) -> None:
    with pytest.raises(ValueError, match="batch sizes must be in"):
        all_k_fit.evaluate([MAX_BATCH + 1], [1])


def test_a_covariance_a_rounding_error_short_of_psd_gives_finite_errors(
        all_k_fit: SurfaceFit) -> None:
    """The latency coefficients' covariance comes from a pseudo-inverse, whose quadratic
    forms can fall a rounding error below zero: the goodput's standard error must stay
    finite there (a NaN made the envelope unpublishable, and the refit failed)."""
    fit = copy.deepcopy(all_k_fit)  # the fixture is the session's
    n = fit.latency.coef_covariance_.shape[0]
    fit.latency.coef_covariance_ = -1e-30 * np.eye(n)
    surface = fit.evaluate(np.array([1, 64]), np.arange(MAX_K + 1))
    assert np.isfinite(surface.latency_std_s).all()
    assert np.isfinite(surface.goodput_std_tok_s).all()
