"""Draft share: how many of the K draft slots per decode request are actually verified.

Why a model of its own. A drafter does not always propose K tokens for every request: an
n-gram proposer that finds no match in a request's context proposes nothing for it, and a
match near the end of the context proposes fewer than K. vLLM then verifies only what was
proposed, so per decode request a step verifies `1 + s * r * K` tokens and emits
`1 + s * (AL_drafting(K) - 1)`, where `s` is the share of decode requests that drafted,
`r` the mean draft length over K among those, and `AL_drafting` the acceptance length the
acceptance model measures (over drafting requests only). Counting every request as
verifying K drafts and accepting like a drafting one overstates both what a larger K costs
and what it gains, by 1/s each, and in that ratio a larger K always looks better than it
is. For EAGLE / draft models s = r = 1 and nothing changes.

Estimation. `s` is the per-request draft probability in steps whose requests were asked
for drafts; telemetry does not say which steps those were (`k` is what was verified, 0 when
nobody drafted), but steps with `k > 0` are exactly the ones where at least one of `d`
decode requests drafted. With independent requests the drafters in such a step are a
zero-truncated Binomial(d, s), so `s` is its maximum-likelihood estimate over all steps with
`k > 0`, weighted like the acceptance counts (recency). The truncation matters at small
batches (at d = 1 a drafting step always shows s = 1) and vanishes at large ones. The
standard error is the observed information's. `r` is the weighted ratio of verified draft
tokens to drafting requests times K.

X layout (one row per step, or per group of steps with the same d, holding their weighted
means): `num_decode_reqs`, `num_drafts`, `num_draft_tokens`, `num_drafts * k` (see
`SHARE_COLUMNS`); `sample_weight` the recency weight (of the group: summed). Rows that
verified no drafts are ignored.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.optimize import minimize_scalar
from sklearn.base import BaseEstimator

from fitter.surface.validation import check_is_fitted, check_matrix, check_vector

SHARE_COLUMNS: tuple[str, ...] = ("num_decode_reqs", "num_drafts", "num_draft_tokens",
                                  "num_drafts_x_k")
_DECODE, _DRAFTS, _DRAFT_TOKENS, _DRAFTS_X_K = range(len(SHARE_COLUMNS))
_FULL_TOLERANCE = 1e-9
"""Relative shortfall of drafters below which every request counts as drafting (s = 1)."""
_SHARE_FLOOR = 1e-4


def truncated_binomial_loglik(share: float, decode: NDArray[np.float64],
                              steps: NDArray[np.float64], drafts: NDArray[np.float64]) -> float:
    """Log-likelihood of `share` in (0, 1) given, per group of steps with `decode` requests
    each, `steps` (weighted) steps with at least one drafter and `drafts` drafters in all:
    D log s + (N - D) log(1 - s) - sum_d W_d log(1 - (1 - s)^d)."""
    log_miss = np.log1p(-share)
    drafted = float(drafts.sum())
    at_least_one = np.log(-np.expm1(decode * log_miss))
    return float(drafted * np.log(share) + (float(steps @ decode) - drafted) * log_miss
                 - steps @ at_least_one)


class DraftShareModel(BaseEstimator):
    """Share of decode requests that draft, and the mean draft length over K among them.

    Has no hyper-parameters; subclassing `BaseEstimator` keeps `clone` and `get_params`
    working like the other two models of the surface.
    """

    def fit(self, X: ArrayLike, y: None = None,
            sample_weight: ArrayLike | None = None) -> DraftShareModel:
        """Estimate the share; `y` is unused (kept for the estimator API)."""
        matrix = check_matrix(X, n_columns=len(SHARE_COLUMNS))
        if (matrix < 0).any():
            raise ValueError("X holds counts and must be non-negative")
        weight = check_vector(sample_weight, matrix.shape[0], name="sample_weight", default=1.0)
        usable = (matrix[:, _DRAFTS] > 0) & (matrix[:, _DECODE] > 0) & (weight > 0)
        rows, w = matrix[usable], weight[usable]
        if (rows[:, _DRAFTS] > rows[:, _DECODE] + 1e-9).any():
            raise ValueError("num_drafts exceeds num_decode_reqs in some rows")
        decode, inverse = np.unique(rows[:, _DECODE], return_inverse=True)
        steps = np.bincount(inverse, weights=w, minlength=decode.size)
        drafts = np.bincount(inverse, weights=w * rows[:, _DRAFTS], minlength=decode.size)
        slots = float(steps @ decode)
        self.n_steps_ = float(w.sum())
        self.drafters_ = float(drafts.sum())
        self.requests_ = slots
        share, variance = self._estimate_share(decode, steps, drafts)
        self.share_ = share
        self.share_var_ = variance
        draft_slots = float(w @ rows[:, _DRAFTS_X_K])
        ratio = float(w @ rows[:, _DRAFT_TOKENS]) / draft_slots if draft_slots > 0 else 1.0
        self.draft_length_ratio_ = float(np.clip(ratio, _SHARE_FLOOR, 1.0))
        self.n_features_in_ = len(SHARE_COLUMNS)
        return self

    @staticmethod
    def _estimate_share(decode: NDArray[np.float64], steps: NDArray[np.float64],
                        drafts: NDArray[np.float64]) -> tuple[float, float]:
        slots = float(steps @ decode)
        total = float(drafts.sum())
        if slots <= 0:  # nothing ever drafted: no evidence, assume every request drafts
            return 1.0, 0.0
        if slots - total <= _FULL_TOLERANCE * slots:
            return 1.0, 0.0

        def negative(share: float) -> float:
            return -truncated_binomial_loglik(share, decode, steps, drafts)

        naive = total / slots  # drafters per request in drafting steps: biased upwards
        result = minimize_scalar(negative, bounds=(_SHARE_FLOOR, min(naive, 1.0 - 1e-9)),
                                 method="bounded", options={"xatol": 1e-7})
        share = float(np.clip(result.x, _SHARE_FLOOR, 1.0))
        step = 1e-4 * min(share, 1.0 - share)
        if step <= 0:
            return share, 0.0
        curvature = (negative(share + step) - 2.0 * negative(share)
                     + negative(share - step)) / step**2
        variance = 1.0 / curvature if curvature > 0 else share * (1.0 - share) / slots
        return share, float(variance)

    @property
    def slot_share_(self) -> float:
        """Expected verified drafts per decode request, per unit of K (s * r)."""
        check_is_fitted(self, "share_")
        return self.share_ * self.draft_length_ratio_

    def predict(self, k: ArrayLike) -> NDArray[np.float64]:
        """Expected drafts verified per decode request at draft length K: s * r * K."""
        return self.slot_share_ * np.asarray(k, dtype=np.float64)


def share_rows(decode: NDArray[np.float64], drafts: NDArray[np.float64],
               draft_tokens: NDArray[np.float64], k: NDArray[np.float64]) -> NDArray[np.float64]:
    """The `SHARE_COLUMNS` matrix from per-step columns."""
    return np.column_stack([decode, drafts, draft_tokens, drafts * k]).astype(np.float64)
