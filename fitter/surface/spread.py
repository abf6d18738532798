"""Do requests accept alike? The test that switches the per-request corrections on.

Why a test. The batch-composition factor (`fitter.surface.composition`), the draft share
each K's batch drafts at (`CompositionModel.draft_share`) and each K's batch context
(`fitter.surface.context`) all rest on one premise: requests differ in how well their drafts
are accepted, so a K changes which of them a closed loop's batch holds. Where every request
accepts alike, every K's batch holds the same requests in the same proportions and each of
those corrections is 1; the composition model would still read the curvature of the
per-position acceptance as a spread of rates and bend the prediction. Per-step telemetry
cannot tell the two apart, but the finished requests' ledger can
(`schemas.step_record.REQUEST_SEGMENT_TYPE`).

The test. Per finished request, n steps whose draft reached position 1 and x of them that
accepted it (its segments summed: a request holds its slot for its whole life). With one
shared rate p, x is Binomial(n, p) and each request's Pearson term (x - n p)^2 / (n p q) has
mean 1 and variance 2 - 6 / n + 1 / (n p q); rates of their own, and runs of agreement
within a request, spread the counts wider. The statistic is the terms' excess over their
mean, in standard deviations of that sum: z = (sum - (R - 1)) / sqrt(sum of variances), R
the requests that drafted. The corrections are identified when z exceeds `z_threshold`.
Position 1 because every drafting step reaches it (the most trials per request) and because
it is the position the draft-share correction reads. `dispersion_` (the statistic over its
degrees of freedom: about 1 for a shared rate) says by how much (magnitudes in
docs/TUNING.md).

X layout (one row per request segment): `fitter.surface.context.CONTEXT_COLUMNS`, then
`reached_1..P`, then `accepted_1..P` (`fitter.surface.telemetry.request_segment_rows`).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike
from sklearn.base import BaseEstimator

from fitter.surface.context import CONTEXT_COLUMNS
from fitter.surface.validation import check_matrix, check_param

SPREAD_Z = 4.0
"""Pearson terms of requests with few trials at extreme rates have far heavier tails than a
chi-square's; measured in their own standard deviations, homogeneous requests pass 4 in well
under 1% of fits."""

MIN_TEST_REQUESTS = 10
"""Fewer drafting requests than this identify nothing: one or two requests would decide."""


class RequestSpreadTest(BaseEstimator):
    """Overdispersion of first-position acceptance across finished requests."""

    def __init__(self, *, z_threshold: float = SPREAD_Z,
                 min_requests: int = MIN_TEST_REQUESTS) -> None:
        self.z_threshold = z_threshold
        self.min_requests = min_requests

    def fit(self, X: ArrayLike, y: None = None) -> RequestSpreadTest:
        """Test the ledger rows `X`; `y` is unused (kept for the estimator API)."""
        check_param("z_threshold", self.z_threshold, low=0.0)
        check_param("min_requests", self.min_requests, low=2)
        fixed = len(CONTEXT_COLUMNS)
        columns = np.shape(X)[1] if np.ndim(X) == 2 else 0
        if columns < fixed + 2 or (columns - fixed) % 2:
            raise ValueError(f"X needs {fixed} columns plus reached and accepted counts per "
                             f"position, got shape {np.shape(X)}")
        matrix = check_matrix(X, n_columns=columns)
        first_reached = matrix[:, fixed]
        first_accepted = matrix[:, fixed + (columns - fixed) // 2]
        if (first_reached < 0).any() or (first_accepted < 0).any():
            raise ValueError("X's reached and accepted counts must be non-negative")
        _, request = np.unique(matrix[:, 0], return_inverse=True)
        trials = np.bincount(request, weights=first_reached)
        accepted = np.minimum(np.bincount(request, weights=first_accepted), trials)
        drafted = trials > 0
        trials, accepted = trials[drafted], accepted[drafted]
        self.n_requests_ = int(trials.size)
        self.pooled_rate_ = float(accepted.sum() / trials.sum()) if trials.size else 0.0
        rate = self.pooled_rate_
        if self.n_requests_ < 2 or not 0.0 < rate < 1.0:
            # one request, or none that drafted, or all alike at 0 or 1: no spread to see
            self.dispersion_, self.z_ = 0.0, 0.0
        else:
            spread = rate * (1.0 - rate)
            terms = (accepted - trials * rate) ** 2 / (trials * spread)
            variance = 2.0 - 6.0 / trials + 1.0 / (trials * spread)
            excess = float(terms.sum()) - (self.n_requests_ - 1)
            self.dispersion_ = float(terms.sum()) / (self.n_requests_ - 1)
            self.z_ = excess / float(np.sqrt(max(variance.sum(), 1e-12)))
        self.identified_ = bool(self.n_requests_ >= self.min_requests
                                and self.z_ > self.z_threshold)
        """Whether the requests' acceptance differs beyond chance: the per-request
        corrections apply."""
        self.n_features_in_ = columns
        return self
