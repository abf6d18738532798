"""Goodput surface G(B, K) = B * (1 + s (AL(K) - 1) c(K)) / T(B, K) on a grid, with uncertainty.

AL(K) is the acceptance length of a drafting request and s the share of decode requests that
draft (`fitter.surface.share`; 1 for EAGLE and draft models, where G = B * AL / T); c(K) the
batch-composition factor, what K's own batch emits over the pooled chain
(`fitter.surface.composition`; 1 without a mixture); T is evaluated at the drafts actually
verified, s(K) * r * K per request, s(K) the share K's own batch drafts at (the mixture's,
`CompositionModel.draft_share`; s without one), and at each K's own batch context (the
request context model's factor; 1 without one). The fit leaves the mixture and the request
context out where the telemetry does not identify them (`fitter.surface.fit`,
docs/MODEL.md).

Uncertainty is propagated analytically (delta method on log G): it is exact enough for a
ranking question and costs one small matrix product per cell, where a bootstrap would refit
both models hundreds of times. Log space makes the two sources add: var(log G) =
var(log AL) + var(log T). Cells at a K the latency data never showed get an extra
extrapolation term that grows with the distance to the nearest observed K, because the
latency model's coefficient covariance cannot know how wrong its *shape* might be there.
The draft share's own uncertainty enters through both AL and T (`share_log_gradient`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import ndtr

from fitter.surface.acceptance import AcceptanceModel
from fitter.surface.composition import CompositionModel
from fitter.surface.context import RequestContextModel
from fitter.surface.latency import StepLatencyModel, decode_matrix, latency_design
from fitter.surface.share import DraftShareModel
from fitter.surface.validation import check_is_fitted

DEFAULT_LATENCY_EXTRAPOLATION_REL = 0.02
"""Relative latency error assumed per unit of K away from the nearest observed K."""


@dataclass(frozen=True, slots=True)
class GoodputSurface:
    """Predicted goodput for every (batch size, K) cell; rows are B, columns are K."""

    batch_sizes: NDArray[np.int64]
    k_values: NDArray[np.int64]
    context_tokens: NDArray[np.float64]
    """KV tokens per request assumed at each batch size."""
    latency_s: NDArray[np.float64]
    latency_std_s: NDArray[np.float64]
    acceptance_length: NDArray[np.float64]
    acceptance_length_std: NDArray[np.float64]
    goodput_tok_s: NDArray[np.float64]
    goodput_std_tok_s: NDArray[np.float64]
    latency_log_gradient: NDArray[np.float64]
    """d log T / d latency coefficients, shape (B, K, n_coef)."""
    latency_covariance: NDArray[np.float64]
    latency_extrapolation_var: NDArray[np.float64]
    """Extra variance of log T per cell that the data does not constrain (0 where observed)."""
    acceptance_log_gradient: NDArray[np.float64]
    """d log(tokens per request)(K) / d p_j, shape (K, n_positions) (= d log AL when s = 1)."""
    acceptance_var: NDArray[np.float64]
    draft_share: float = 1.0
    """Share of decode requests that draft (s); 1 when every request proposes K drafts."""
    draft_share_std: float = 0.0
    tokens_per_request: NDArray[np.float64] | None = None
    """Expected tokens emitted per decode request per step at each K: 1 + s (AL(K) - 1).
    None means `acceptance_length` (s = 1)."""
    share_log_gradient: NDArray[np.float64] | None = None
    """d log G / d s per cell, shape (B, K); None when s is known exactly."""
    share_var: float = 0.0
    held_latency_s: NDArray[np.float64] | None = None
    """Step time per cell with the per-request terms held at the largest measured request
    count (`StepLatencyModel.predict_held`); None when not evaluated."""
    measured_requests: int | None = None
    """The largest request count the latency data measured, when the data could not tell
    the per-request terms from the per-step ones (`StepLatencyModel.requests_identified_`):
    past it the fit's latency is a guess and `held_latency_s` the cautious reading. None
    when the request count was identified."""

    def log_ratio_vs(self, chosen_index: ArrayLike, margin: float = 0.0,
                     ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Mean and sd of log(G(B, k) / ((1 + margin) G(B, chosen K at B))) per cell.

        Differences are taken before the variance is computed, so the shared parts (the same
        acceptance positions, the same latency coefficients) cancel: AL(7) and AL(6) share
        positions 1..6 and only a_7 decides between them. The chosen cell has sd 0.
        """
        chosen = np.asarray(chosen_index, dtype=np.int64)
        rows = np.arange(self.batch_sizes.size)
        log_g = np.log(self.goodput_tok_s)
        mean = log_g - log_g[rows, chosen][:, None] - np.log1p(margin)
        acc_diff = (self.acceptance_log_gradient[None, :, :]
                    - self.acceptance_log_gradient[chosen][:, None, :])
        var = np.einsum("bkp,p,bkp->bk", acc_diff, self.acceptance_var, acc_diff)
        lat_diff = self.latency_log_gradient - self.latency_log_gradient[rows, chosen][:, None, :]
        var += np.einsum("bkp,pq,bkq->bk", lat_diff, self.latency_covariance, lat_diff)
        var += self.latency_extrapolation_var
        var += self.latency_extrapolation_var[rows, chosen][:, None]
        if self.share_log_gradient is not None and self.share_var > 0:
            share_diff = (self.share_log_gradient
                          - self.share_log_gradient[rows, chosen][:, None])
            var += share_diff**2 * self.share_var
        is_chosen = np.arange(self.k_values.size)[None, :] == chosen[:, None]
        return mean, np.where(is_chosen, 0.0, np.sqrt(np.maximum(var, 0.0)))

    def probability_better(self, chosen_index: ArrayLike, margin: float = 0.0,
                           ) -> NDArray[np.float64]:
        """P(G(B, k) > (1 + margin) G(B, chosen K at B)), normal approximation on log G."""
        mean, sd = self.log_ratio_vs(chosen_index, margin)
        return np.where(sd > 0, ndtr(mean / np.maximum(sd, 1e-300)), 0.0)

    def expected_gain(self, chosen_index: ArrayLike, margin: float = 0.0,
                      ) -> NDArray[np.float64]:
        """E[max(0, log(G(B, k) / ((1 + margin) G(B, chosen))))]: how much switching could win.

        Unlike the probability, this is small where the two K are merely neck and neck with a
        precise estimate (every range boundary) and large where the estimate is uncertain
        and the upside real: the value of exploring that cell.
        """
        mean, sd = self.log_ratio_vs(chosen_index, margin)
        safe_sd = np.maximum(sd, 1e-300)
        z = np.clip(mean / safe_sd, -40.0, 40.0)
        gain = mean * ndtr(z) + sd * np.exp(-0.5 * z**2) / np.sqrt(2.0 * np.pi)
        return np.where(sd > 0, np.maximum(gain, 0.0), 0.0)


def extrapolation_variance(k_values: NDArray[np.int64], observed_k: NDArray[np.int64],
                           relative_error: float) -> NDArray[np.float64]:
    """(relative_error x distance to the nearest observed K)^2 per K."""
    if observed_k.size == 0:
        return np.full(k_values.size, relative_error**2)
    distance = np.abs(k_values[:, None] - observed_k[None, :]).min(axis=1)
    return (relative_error * distance) ** 2


def composition_factor(composition: CompositionModel | None, pooled: NDArray[np.float64],
                       k: NDArray[np.int64]) -> NDArray[np.float64]:
    """c(K): steady accepted drafts per decode request (`fitter.surface.composition`) over
    `pooled`, the pooled chain's s (AL(K) - 1) at the same K; 1 without a mixture and at
    K = 0."""
    if composition is None:
        return np.ones(k.size)
    steady = composition.predict(k)
    return np.where((k > 0) & (pooled > 1e-9), steady / np.maximum(pooled, 1e-9), 1.0)


def evaluate_surface(
    latency: StepLatencyModel,
    acceptance: AcceptanceModel,
    batch_sizes: ArrayLike,
    k_values: ArrayLike,
    context_tokens: ArrayLike,
    *,
    latency_extrapolation_rel: float = DEFAULT_LATENCY_EXTRAPOLATION_REL,
    draft_share: DraftShareModel | None = None,
    composition: CompositionModel | None = None,
    request_context: RequestContextModel | None = None,
) -> GoodputSurface:
    """Goodput and its uncertainty for pure decode steps at each (B, K).

    `context_tokens` is KV tokens per request, a scalar or one value per batch size.
    `draft_share` (fitted) says how many decode requests draft and how long their drafts
    are; None: every request drafts K (EAGLE, draft models). `composition` (fitted) bends the
    pooled chain to what each K's own batch accepts; None: the pooled chain stands. Its
    factor is taken as exact: the mixture is a function of the same acceptance estimates
    whose variance is propagated. `request_context` (fitted) prices each K's step at the
    context its own batch holds (`fitter.surface.context`); None: every K at
    `context_tokens`.
    """
    check_is_fitted(latency, "coef_")
    check_is_fitted(acceptance, "conditional_")
    if draft_share is not None:
        check_is_fitted(draft_share, "share_")
    share = 1.0 if draft_share is None else float(draft_share.share_)
    share_var = 0.0 if draft_share is None else float(draft_share.share_var_)
    length_ratio = 1.0 if draft_share is None else float(draft_share.draft_length_ratio_)
    batch = np.asarray(batch_sizes, dtype=np.int64).reshape(-1)
    ks = np.asarray(k_values, dtype=np.int64).reshape(-1)
    if batch.size == 0 or ks.size == 0 or batch.min() < 1 or ks.min() < 0:
        raise ValueError("batch_sizes must be >= 1 and k_values >= 0, both non-empty")
    context = np.broadcast_to(np.asarray(context_tokens, dtype=np.float64), batch.shape)

    grid_b, grid_k = np.meshgrid(batch, ks, indexing="ij")
    grid_ctx = np.broadcast_to(context[:, None], grid_b.shape)
    if request_context is not None:
        grid_ctx = grid_ctx * request_context.predict(ks)[None, :]
    # the share each K's own batch drafts at (a scalar without a mixture)
    steady_share = (share if composition is None or draft_share is None
                    else composition.draft_share(share, ks))
    X = decode_matrix(grid_b, grid_k, grid_ctx, steady_share * length_ratio)
    design = latency_design(X, latency.knots_)
    latency_s = (design @ latency.coef_).reshape(grid_b.shape)
    latency_s = np.maximum(latency_s, 1e-9)
    held_latency_s = np.maximum(latency.predict_held(X).reshape(grid_b.shape), 1e-9)
    log_gradient = design.reshape(*grid_b.shape, -1) / latency_s[..., None]
    param_var_log_t = latency.coefficient_variance(log_gradient)
    unidentified_rel = latency.unidentified_std(X).reshape(grid_b.shape) / latency_s
    extra_var = (extrapolation_variance(ks, latency.observed_k_, latency_extrapolation_rel)[None, :]
                 + unidentified_rel**2)
    var_log_t = param_var_log_t + extra_var

    al = acceptance.predict(ks)
    var_log_al = (acceptance.gradient(ks) / al[:, None]) ** 2 @ acceptance.conditional_var_
    pooled = share * (al - 1.0)
    factor = composition_factor(composition, pooled, ks)
    accepted = pooled * factor
    tokens = 1.0 + accepted
    tokens_gradient = share * factor[:, None] * acceptance.gradient(ks) / tokens[:, None]
    var_log_tokens = tokens_gradient**2 @ acceptance.conditional_var_

    share_gradient = None
    var_share = np.zeros(grid_b.shape)
    if share_var > 0:
        step = 1e-4 * share
        shifted = decode_matrix(grid_b, grid_k, grid_ctx,
                                (steady_share + step) * length_ratio)
        latency_shifted = np.maximum(
            (latency_design(shifted, latency.knots_) @ latency.coef_).reshape(grid_b.shape),
            1e-9)
        dlog_t = (np.log(latency_shifted) - np.log(latency_s)) / step
        share_gradient = ((al - 1.0) * factor / tokens)[None, :] - dlog_t
        var_share = share_gradient**2 * share_var

    goodput = grid_b * tokens[None, :] / latency_s
    return GoodputSurface(
        batch_sizes=batch,
        k_values=ks,
        context_tokens=np.array(context),
        latency_s=latency_s,
        latency_std_s=latency_s * np.sqrt(var_log_t),
        acceptance_length=al,
        acceptance_length_std=al * np.sqrt(var_log_al),
        goodput_tok_s=goodput,
        goodput_std_tok_s=goodput * np.sqrt(var_log_t + var_log_tokens[None, :] + var_share),
        latency_log_gradient=log_gradient,
        latency_covariance=latency.coef_covariance_,
        latency_extrapolation_var=extra_var,
        acceptance_log_gradient=tokens_gradient,
        acceptance_var=acceptance.conditional_var_,
        draft_share=share,
        draft_share_std=float(np.sqrt(share_var)),
        tokens_per_request=tokens,
        share_log_gradient=share_gradient,
        share_var=share_var,
        held_latency_s=held_latency_s,
        measured_requests=(None if latency.requests_identified_
                           else int(latency.max_measured_requests_)),
    )
