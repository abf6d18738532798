"""Batch composition: what a K emits per request once the batch is the one that K keeps.

Why the pooled per-position acceptance is not enough. In a closed loop a request holds its
batch slot for as many steps as it needs, so the batch over-represents the requests that
need many steps. A larger K shortens the well-accepting requests (copy-heavy code edits
under n-gram) far more than the others, so at a larger K the batch holds fewer of them and
every position accepts less; at a smaller K, more. What a sweep measures at each position is
the acceptance of the batch the engine had then, and chaining positions measured on one K's
batch predicts the other K's steady yield badly (`bench/steady_yield.py` measures both; the
numbers are in docs/TUNING.md).

The model. Requests differ in how well their drafts are accepted: a request of rate a
accepts position i with probability a^i, so it emits tau(a, K) = 1 + a + ... + a^K tokens
per step at K. Arrivals are a mixture f over a grid of rates (rate 0 holds the requests
that never accept, e.g. n-gram requests without a match). A batch kept by K holds type j in
proportion to f_j / tau_j(K) (it occupies its slot 1 / tau_j steps per token), so at steady
K a decode request emits, per step, the harmonic mean 1 / sum_j f_j / tau_j(K): that minus
one is `predict(K)`. What the telemetry measured at position i is the same mixture on the
batch of its own time,

    q_i = sum_j f_j a_j^i / tau_j(K_i)  /  sum_j f_j / tau_j(K_i),

with K_i the K that shaped that batch (`telemetry.composition_by_position`: the K asked
for, lagged by a request's lifetime). Multiplied out, sum_j f_j (q_i - a_j^i) / tau_j(K_i)
= 0 is linear in f, so f is one non-negative least-squares solve with the shares summing
to one. Seven positions pin down a few atoms of f, which is all the harmonic mean needs.

Where it is wrong: when requests do not differ (every request accepts alike, as in
`fitter.surface.synthetic` or the twin's parametric profiles), it still reads the curvature
of q_i (positions whose conditional rates differ) as a spread of rates and bends the
prediction. Per-step telemetry cannot tell the two apart; the finished requests' ledger can,
and `fitter.surface.fit` fits this model only where `fitter.surface.spread` finds their
first-position acceptance spread beyond a shared rate's binomial scatter (real traffic's
requests do differ: SpecDecode-Bench traces). Otherwise c(K) = 1.

X layout (one row per draft position): `COMPOSITION_COLUMNS`; y: accepted drafts at that
position per decode request.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.optimize import nnls
from sklearn.base import BaseEstimator

from fitter.surface.validation import check_is_fitted, check_matrix, check_param

COMPOSITION_COLUMNS: tuple[str, ...] = ("position", "batch_shaped_k")
_POSITION, _SHAPED = range(len(COMPOSITION_COLUMNS))
_SUM_ROW_WEIGHT = 100.0
"""The arrival shares must sum to one: one more least-squares row, weighted far above the
acceptance rows (each well under 1)."""


def tokens_per_step(rates: NDArray[np.float64], k: ArrayLike) -> NDArray[np.float64]:
    """tau(a, K) = 1 + a + ... + a^K, one row per K and one column per rate; K may be
    fractional (a batch shaped by a mix of K)."""
    ks = np.asarray(k, dtype=np.float64).reshape(-1, 1)
    a = np.asarray(rates, dtype=np.float64).reshape(1, -1)
    below_one = np.minimum(a, 1.0 - 1e-9)
    return np.where(a > 0, (1.0 - below_one ** (ks + 1.0)) / (1.0 - below_one), 1.0)


class CompositionModel(BaseEstimator):
    """Arrival mixture over per-request acceptance rates, and the steady yield at any K."""

    def __init__(self, *, n_rates: int = 96, max_rate: float = 0.995) -> None:
        self.n_rates = n_rates
        self.max_rate = max_rate

    def fit(self, X: ArrayLike, y: ArrayLike) -> CompositionModel:
        """Fit the arrival mixture to `y`, the accepted drafts per decode request at each
        row's draft position, measured on a batch shaped by the row's K."""
        check_param("n_rates", self.n_rates, low=2)
        check_param("max_rate", self.max_rate, low=0.0, high=0.999, inclusive_low=False)
        matrix = check_matrix(X, n_columns=len(COMPOSITION_COLUMNS))
        target = np.asarray(y, dtype=np.float64).reshape(-1)
        if target.size != matrix.shape[0]:
            raise ValueError(f"y has {target.size} values for {matrix.shape[0]} rows of X")
        if not np.isfinite(target).all() or (target < 0).any() or (target > 1).any():
            raise ValueError("y holds acceptance probabilities and must be within [0, 1]")
        position = matrix[:, _POSITION]
        if (position < 1).any() or (position != np.round(position)).any():
            raise ValueError("X's position column must hold draft positions 1, 2, ...")
        if (matrix[:, _SHAPED] < 0).any():
            raise ValueError("X's batch_shaped_k column must be >= 0")

        rates = np.concatenate([[0.0], np.linspace(0.05, self.max_rate, self.n_rates - 1)])
        accepted = rates[None, :] ** position[:, None]
        design = np.vstack([(target[:, None] - accepted) / tokens_per_step(rates, matrix[:, _SHAPED]),
                            np.full(rates.size, _SUM_ROW_WEIGHT)])
        arrival, _ = nnls(design, np.concatenate([np.zeros(target.size), [_SUM_ROW_WEIGHT]]))
        self.rates_ = rates
        self.arrival_share_ = arrival / max(float(arrival.sum()), 1e-12)
        first = np.flatnonzero(position == 1)
        self.first_position_shaped_k_ = (float(matrix[first[0], _SHAPED]) if first.size
                                         else None)
        """The K that shaped the batches position 1 (every decode request's first draft,
        or its lack) was measured on; None without that row."""
        self.n_features_in_ = len(COMPOSITION_COLUMNS)
        return self

    def predict(self, k: ArrayLike) -> NDArray[np.float64]:
        """Accepted drafts per decode request per step once a batch has run K steadily."""
        check_is_fitted(self, "arrival_share_")
        inverse = 1.0 / tokens_per_step(self.rates_, k)
        return 1.0 / (inverse @ self.arrival_share_) - 1.0

    def draft_share(self, observed_share: float, k: ArrayLike) -> NDArray[np.float64]:
        """The share of decode requests that draft once `k` has shaped the batch, from the
        share observed on the batches position 1 was measured on.

        A request that proposes no draft (n-gram without a match) is one that would accept
        nothing there, so the non-drafting share is taken to follow the mixture's rejection
        at position 1. A larger K drains the well-accepting requests faster and leaves more
        of those that rarely match, and fewer drafts verified is a faster step, which a
        share held at the observed one would charge the larger K for."""
        check_is_fitted(self, "arrival_share_")
        ks = np.asarray(k, dtype=np.float64).reshape(-1)
        if self.first_position_shaped_k_ is None:
            return np.full(ks.size, observed_share)
        reject = 1.0 - self.predict_under(np.ones(ks.size), ks)
        observed = 1.0 - float(self.predict_under([1.0], [self.first_position_shaped_k_])[0])
        if observed <= 1e-9:
            return np.full(ks.size, observed_share)
        return np.clip(1.0 - (1.0 - observed_share) * reject / observed, 0.0, 1.0)

    def predict_under(self, positions: ArrayLike, shaped_k: ArrayLike) -> NDArray[np.float64]:
        """Acceptance at each draft position on a batch shaped by `shaped_k` (one per
        position): the fit's reproduction of what it was given."""
        check_is_fitted(self, "arrival_share_")
        position = np.asarray(positions, dtype=np.float64).reshape(-1)
        held = self.arrival_share_[None, :] / tokens_per_step(self.rates_, shaped_k)
        held /= held.sum(axis=1, keepdims=True)
        return (held * self.rates_[None, :] ** position[:, None]).sum(axis=1)
