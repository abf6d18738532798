"""Context per request at each K: what a closed loop at that K holds in its batch.

Why the step records' context is not enough. A request holds its batch slot for as many steps
as it needs, so the batch over-represents the requests (and the parts of them) that need
many steps, and a K changes which those are. Under n-gram the long requests accept well: a
larger K drains them faster and the batch's context per request falls. Under EAGLE it is the
short ones, and the context rises. Priced at one pooled context, the larger K's step is
overpriced on n-gram and underpriced on EAGLE, and between neighbouring K that decides.

The model. Each finished request's decode steps are summed per segment of its generation
(`schemas.step_record.REQUEST_SEGMENT_TYPE`): steps, tokens, context, and per draft position
how often a draft reached it and how often it was accepted. A (request, segment) emits
tau(K) = (1 - d) + d (1 + p_1 + p_1 p_2 + ... + p_1...p_K) tokens per step at K, d the share
of its steps that drafted and p_i its conditional acceptance, shrunk towards the request's
own and that towards the pool's (`prior_strength` pseudo-steps each), so a thinly observed
segment borrows from its request. At steady K it needs tokens / tau(K) steps, and the batch
holds it in that proportion, so each K's context per request is the steps-weighted mean of
the segments' mean contexts. `predict(K)` is that over the mean the telemetry's own batches
held (weighted by the steps they took): a factor on the context the surface is priced at
(how well it predicts another K's context: docs/TUNING.md).

When it applies. Where requests accept alike every K's batch holds them in the same
proportions and the factor is 1; fitted anyway it would weigh each request by its own
acceptance noise. So `fitter.surface.fit` fits it only where `fitter.surface.spread` finds
the requests' acceptance spread beyond chance.

X layout (one row per request segment): `CONTEXT_COLUMNS` then `reached_1..P`, then
`accepted_1..P`.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator

from fitter.surface.validation import check_is_fitted, check_matrix, check_param

CONTEXT_COLUMNS = ("request", "decode_steps", "drafting_steps", "tokens", "context_tokens")


class RequestContextModel(BaseEstimator):
    """Each K's steady batch context per request, relative to the observed batches'."""

    def __init__(self, prior_strength: float = 4.0) -> None:
        self.prior_strength = prior_strength

    def fit(self, X: ArrayLike, y: None = None) -> RequestContextModel:
        check_param("prior_strength", self.prior_strength, low=0.0)
        columns = np.shape(X)[1] if np.ndim(X) == 2 else 0
        fixed = len(CONTEXT_COLUMNS)
        if columns < fixed + 2 or (columns - fixed) % 2:
            raise ValueError(f"X needs {fixed} columns plus reached and accepted counts per "
                             f"position, got shape {np.shape(X)}")
        X = check_matrix(X, n_columns=columns)
        steps = X[:, 1]
        if steps.min() <= 0:
            raise ValueError("every row of X must have decode steps")
        positions = (X.shape[1] - fixed) // 2
        reached = X[:, fixed:fixed + positions]
        accepted = np.minimum(X[:, fixed + positions:], reached)
        _, request = np.unique(X[:, 0], return_inverse=True)
        strength = float(self.prior_strength)
        pooled = accepted.sum(axis=0) / np.maximum(reached.sum(axis=0), 1.0)
        by_request = np.zeros((request.max() + 1, positions, 2))
        np.add.at(by_request, request, np.stack([reached, accepted], axis=2))
        request_rate = ((by_request[..., 1] + strength * pooled)
                        / (by_request[..., 0] + strength))
        rate = (accepted + strength * request_rate[request]) / (reached + strength)
        self.chain_ = np.cumprod(rate, axis=1)
        self.steps_ = steps
        self.tokens_ = X[:, 3]
        self.drafting_share_ = np.clip(X[:, 2] / steps, 0.0, 1.0)
        self.mean_context_ = X[:, 4] / steps
        self.observed_context_ = float(steps @ self.mean_context_ / steps.sum())
        self.n_requests_ = int(request.max() + 1)
        return self

    def steps_needed(self, k: int) -> NDArray[np.float64]:
        """Decode steps each row's tokens would take at a steady `k`."""
        check_is_fitted(self, "chain_")
        tau = 1.0 + self.drafting_share_ * self.chain_[:, :max(int(k), 0)].sum(axis=1)
        return self.tokens_ / tau

    def predict(self, k_values: ArrayLike) -> NDArray[np.float64]:
        """Context per request in K's own batch over the observed batches' (1 = no change)."""
        check_is_fitted(self, "chain_")
        ks = np.asarray(k_values, dtype=np.int64).reshape(-1)
        out = np.ones(ks.size)
        for i, k in enumerate(ks):
            needed = self.steps_needed(int(k))
            out[i] = (needed @ self.mean_context_ / needed.sum()) / self.observed_context_
        return out
