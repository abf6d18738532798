"""Sustained yield: what each K really emits once an engine has run it for a while.

Why a correction on top of the per-position model. The acceptance model pools every step's
accepted counts by draft position, as if the acceptance of position i did not depend on the
K the engine was running. It does, through *which requests and which stretches of them* the
steps see. In a closed loop a request holds its batch slot for as many steps as it needs, so
the batch over-represents the requests that need many steps; a larger K shortens the
well-accepting requests (copy-heavy code edits under n-gram) far more than the others, so
at a larger K the batch holds fewer of them and every position accepts less. Position 7 is
only ever measured at K = 7, position 1 mostly at small K: chaining the two overstates
AL(7), by 20% on InstructCoder n-gram (bench/profile_quality.py), enough to pick K = 7 where
K = 3 is right. What a steady run at K emits per decode request is measured directly by the
steps of such runs, so this model compares it with the pooled prediction at every K that
ran steadily and carries the log ratio over to the other K as a line in K.

The estimate. Per K that ran steadily: y_K = log(observed accepted tokens per decode request
/ the pooled prediction), with weight = requests seen during those runs (the noise is
between requests: a handful of long copy-heavy requests moves a short run by 30%). A
weighted ridge regression y = level + slope (K - K_ref) with Gaussian priors on both (a
level of zero: without steady runs the pooled model stands) gives the correction and its
covariance; the per-request variance is pooled from the residuals with a prior of
`prior_request_sd` on `prior_request_dof` degrees of freedom.

The slope's prior. Live telemetry runs one K steadily per batch size, which fixes the
level there and says nothing about the slope; a profile or a re-profile sweep runs every K
and measures it (-0.015 per K for EAGLE, -0.08 for n-gram on the shared traces). The
envelope carries the fitted line (`fitter.derive.surface_summary`), and a refit passes the
last sweep's slope as `prior_slope`, so a refit that sees one K extrapolates with the
slope its workload showed instead of a flat line.

X layout (one row per K that ran steadily): `SUSTAINED_COLUMNS`.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator

from fitter.surface.validation import check_is_fitted, check_matrix, check_param

SUSTAINED_COLUMNS: tuple[str, ...] = (
    "k", "accepted_per_decode_observed", "accepted_per_decode_pooled", "requests_seen")
_K, _OBSERVED, _POOLED, _REQUESTS = range(len(SUSTAINED_COLUMNS))
_FLOOR = 1e-6


class SustainedYieldModel(BaseEstimator):
    """Log correction of accepted tokens per decode request, linear in K, with covariance."""

    def __init__(self, *, prior_slope: float = 0.0, prior_level_sd: float = 0.3,
                 prior_slope_sd: float = 0.05, prior_request_sd: float = 0.4,
                 prior_request_dof: float = 2.0) -> None:
        self.prior_slope = prior_slope
        self.prior_level_sd = prior_level_sd
        self.prior_slope_sd = prior_slope_sd
        self.prior_request_sd = prior_request_sd
        self.prior_request_dof = prior_request_dof

    def fit(self, X: ArrayLike, y: None = None) -> SustainedYieldModel:
        """Fit the line; `y` is unused (the target is a ratio of two columns of X)."""
        check_param("prior_slope", self.prior_slope, low=-1.0, high=1.0)
        check_param("prior_level_sd", self.prior_level_sd, low=0.0, inclusive_low=False)
        check_param("prior_slope_sd", self.prior_slope_sd, low=0.0, inclusive_low=False)
        check_param("prior_request_sd", self.prior_request_sd, low=0.0, inclusive_low=False)
        check_param("prior_request_dof", self.prior_request_dof, low=0.0)
        matrix = check_matrix(X, n_columns=len(SUSTAINED_COLUMNS))
        if (matrix < 0).any():
            raise ValueError("X holds K values and counts and must be non-negative")
        usable = ((matrix[:, _K] > 0) & (matrix[:, _OBSERVED] > 0) & (matrix[:, _POOLED] > 0)
                  & (matrix[:, _REQUESTS] > 0))
        rows = matrix[usable]
        k = rows[:, _K]
        requests = rows[:, _REQUESTS]
        target = np.log(np.maximum(rows[:, _OBSERVED], _FLOOR) / rows[:, _POOLED])
        self.k_reference_ = float(requests @ k / requests.sum()) if rows.size else 0.0
        design = np.column_stack([np.ones(k.size), k - self.k_reference_])
        prior_precision = np.diag([1.0 / self.prior_level_sd**2, 1.0 / self.prior_slope_sd**2])
        prior_mean = np.array([0.0, float(self.prior_slope)])

        # The per-request variance and the line depend on each other; two passes settle it.
        request_var = float(self.prior_request_sd) ** 2
        coef = np.zeros(2)
        for _ in range(2):
            precision = design.T @ (design * (requests / request_var)[:, None]) + prior_precision
            covariance = np.linalg.inv(precision)
            coef = covariance @ (design.T @ (requests / request_var * target)
                                 + prior_precision @ prior_mean)
            residual = target - design @ coef
            dof = float(self.prior_request_dof) + max(k.size - 2, 0)
            if dof > 0:
                request_var = ((float(self.prior_request_dof) * self.prior_request_sd**2
                                + float(requests @ residual**2)) / dof)
        precision = design.T @ (design * (requests / request_var)[:, None]) + prior_precision
        self.coef_ = coef
        self.coef_covariance_ = np.linalg.inv(precision)
        self.request_sd_ = float(np.sqrt(request_var))
        self.observed_k_ = k.astype(np.int64)
        self.observed_log_ratio_ = target
        self.requests_seen_ = requests
        self.n_features_in_ = len(SUSTAINED_COLUMNS)
        return self

    def gradient(self, k: ArrayLike) -> NDArray[np.float64]:
        """d correction(K) / d (level, slope), one row per K; zero at K = 0 (nothing drafted)."""
        check_is_fitted(self, "coef_")
        ks = np.asarray(k, dtype=np.float64).reshape(-1)
        rows = np.column_stack([np.ones(ks.size), ks - self.k_reference_])
        return np.where((ks > 0)[:, None], rows, 0.0)

    def predict(self, k: ArrayLike) -> NDArray[np.float64]:
        """Log factor on the pooled accepted tokens per decode request at each K."""
        return self.gradient(k) @ self.coef_

    def predict_var(self, k: ArrayLike) -> NDArray[np.float64]:
        """Variance of the log factor at each K."""
        gradient = self.gradient(k)
        return np.einsum("kp,pq,kq->k", gradient, self.coef_covariance_, gradient)
