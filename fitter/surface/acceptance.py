"""Acceptance model: per-position acceptance under censoring, with Beta posteriors.

Censoring is the reason for the shape. A step that drafted K tokens says nothing about
position K+1, so unconditional rates cannot be averaged over all steps (positions beyond the
usual K would read as zero and the table would never raise K again). Instead each position's
*conditional* rate p_i = P(accept i | accepted 1..i-1) is estimated only from steps that
drafted position i (accepted_i / accepted_{i-1}), and the unconditional rates are the chained
products a_i = p_1 ... p_i. A position nobody drafted keeps its prior: the previous
position's estimate (times `extrapolation_decay`) with only `prior_strength` pseudo-counts, so
it is plausible, never zero, and visibly uncertain - which is what the exploration plan reads.

X layout (one row per step, or per group of steps with summed counts): column 0 is the number
of requests that drafted (num_drafts), column i >= 1 is `accepted_per_pos[i-1]`, NaN where the
position was not drafted. Recency weighting enters through `sample_weight`.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator

from fitter.surface.validation import check_is_fitted, check_matrix, check_param, check_vector

_PROBABILITY_FLOOR = 1e-3


def position_counts(X: NDArray[np.float64], weight: NDArray[np.float64],
                    n_positions: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Weighted (trials, successes) per position, counting only rows that drafted it.

    trials_i = sum of accepted_{i-1} (num_drafts for i = 1) over rows where position i is not
    NaN; successes_i = sum of accepted_i over the same rows.
    """
    trials = np.zeros(n_positions)
    successes = np.zeros(n_positions)
    usable = min(n_positions, X.shape[1] - 1)
    for i in range(1, usable + 1):
        drafted = ~np.isnan(X[:, i])
        previous = X[drafted, i - 1]
        trials[i - 1] = float(weight[drafted] @ previous)
        successes[i - 1] = float(weight[drafted] @ np.minimum(X[drafted, i], previous))
    return trials, successes


def beta_posteriors(trials: NDArray[np.float64], successes: NDArray[np.float64], *,
                    prior_mean: float, prior_strength: float, extrapolation_decay: float,
                    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Chained Beta posteriors (alpha, beta) for the conditional rates, position by position.

    Position i's prior is centred on position i-1's posterior mean: neighbouring positions
    of one drafter behave alike (docs/TWIN.md, acceptance: .69 .66 .69 .73 .76), so the best
    guess for an unobserved position is its predecessor, held loosely.
    """
    n_positions = trials.size
    alpha = np.zeros(n_positions)
    beta = np.zeros(n_positions)
    centre = prior_mean
    for i in range(n_positions):
        centre = float(np.clip(centre, _PROBABILITY_FLOOR, 1.0 - _PROBABILITY_FLOOR))
        alpha[i] = centre * prior_strength + successes[i]
        beta[i] = (1.0 - centre) * prior_strength + (trials[i] - successes[i])
        centre = alpha[i] / (alpha[i] + beta[i]) * extrapolation_decay
    return alpha, beta


def acceptance_length(conditional: NDArray[np.float64], k: NDArray[np.int64]) -> NDArray[np.float64]:
    """AL(K) = 1 + sum_{i<=K} prod_{j<=i} p_j (expected tokens per request per step)."""
    cumulative = np.concatenate([[0.0], np.cumsum(np.cumprod(conditional))])
    return 1.0 + cumulative[k]


def acceptance_length_gradient(conditional: NDArray[np.float64],
                               k: NDArray[np.int64]) -> NDArray[np.float64]:
    """dAL(K)/dp_j for each K (rows) and position j (columns): sum_{j<=i<=K} a_i / p_j."""
    unconditional = np.cumprod(conditional)
    n_positions = conditional.size
    positions = np.arange(1, n_positions + 1)
    included = positions[None, :] <= k[:, None]  # a_i counts in AL(K) when i <= K
    tail = np.cumsum((unconditional * included)[:, ::-1], axis=1)[:, ::-1]
    return np.where(included, tail / conditional[None, :], 0.0)


class AcceptanceModel(BaseEstimator):
    """Censoring-aware, recency-weighted per-position acceptance; predicts AL(K)."""

    def __init__(self, *, n_positions: int | None = None, prior_mean: float = 0.6,
                 prior_strength: float = 8.0, extrapolation_decay: float = 0.95) -> None:
        self.n_positions = n_positions
        self.prior_mean = prior_mean
        self.prior_strength = prior_strength
        self.extrapolation_decay = extrapolation_decay

    def fit(self, X: ArrayLike, y: None = None,
            sample_weight: ArrayLike | None = None) -> AcceptanceModel:
        """Estimate the conditional rates; `y` is unused (kept for the estimator API)."""
        check_param("n_positions", self.n_positions, low=1, high=64, allow_none=True)
        check_param("prior_mean", self.prior_mean, low=0.0, high=1.0, inclusive_low=False)
        check_param("prior_strength", self.prior_strength, low=0.0, inclusive_low=False)
        check_param("extrapolation_decay", self.extrapolation_decay, low=0.0, high=1.0,
                    inclusive_low=False)
        matrix = np.asarray(X, dtype=np.float64)
        if matrix.ndim != 2 or matrix.shape[1] < 1:
            raise ValueError(f"X must have shape (n, 1 + positions), got {matrix.shape}")
        matrix = check_matrix(matrix, n_columns=matrix.shape[1], allow_nan=True)
        if np.isnan(matrix[:, 0]).any():
            raise ValueError("X column 0 (requests that drafted) must not be NaN")
        if (np.nan_to_num(matrix, nan=0.0) < 0).any():
            raise ValueError("X holds counts and must be non-negative")
        drafted = ~np.isnan(matrix[:, 1:])
        if (drafted[:, 1:] & ~drafted[:, :-1]).any():
            raise ValueError("X rows must be drafted up to some position, then NaN")
        weight = check_vector(sample_weight, matrix.shape[0], name="sample_weight", default=1.0)

        n_positions = self.n_positions if self.n_positions is not None else matrix.shape[1] - 1
        n_positions = max(int(n_positions), 1)
        trials, successes = position_counts(matrix, weight, n_positions)
        alpha, beta = beta_posteriors(
            trials, successes, prior_mean=float(self.prior_mean),
            prior_strength=float(self.prior_strength),
            extrapolation_decay=float(self.extrapolation_decay),
        )
        total = alpha + beta
        self.n_positions_ = n_positions
        self.trials_ = trials
        self.successes_ = successes
        self.alpha_ = alpha
        self.beta_ = beta
        self.conditional_ = alpha / total
        self.conditional_var_ = alpha * beta / (total**2 * (total + 1.0))
        self.unconditional_ = np.cumprod(self.conditional_)
        self.observed_positions_ = np.flatnonzero(trials > 0) + 1
        return self

    def _check_k(self, k: ArrayLike) -> NDArray[np.int64]:
        check_is_fitted(self, "conditional_")
        values = np.asarray(k)
        if values.size and (values.min() < 0 or values.max() > self.n_positions_
                            or not np.all(np.equal(np.mod(values, 1), 0))):
            raise ValueError(f"K must be integers in 0..{self.n_positions_}, got {k!r}")
        return values.astype(np.int64).reshape(-1)

    def predict(self, k: ArrayLike) -> NDArray[np.float64]:
        """AL(K): expected tokens emitted per drafting request per step at draft length K."""
        ks = self._check_k(k)
        return acceptance_length(self.conditional_, ks)

    def predict_std(self, k: ArrayLike) -> NDArray[np.float64]:
        """Delta-method standard deviation of AL(K) (independent Beta posteriors)."""
        gradient = self.gradient(k)
        return np.sqrt(gradient**2 @ self.conditional_var_)

    def gradient(self, k: ArrayLike) -> NDArray[np.float64]:
        """dAL(K)/dp_j, rows per K: what goodput uncertainty propagation needs."""
        ks = self._check_k(k)
        return acceptance_length_gradient(self.conditional_, ks)
