"""Goodput surface G(B, K) = B * AL(K) / T(B, K) on a grid, with uncertainty per cell.

Uncertainty is propagated analytically (delta method on log G): it is exact enough for a
ranking question and costs one small matrix product per cell, where a bootstrap would refit
both models hundreds of times. Log space makes the two sources add: var(log G) =
var(log AL) + var(log T). Cells at a K the latency data never showed get an extra
extrapolation term that grows with the distance to the nearest observed K, because the
latency model's coefficient covariance cannot know how wrong its *shape* might be there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import ndtr

from fitter.surface.acceptance import AcceptanceModel
from fitter.surface.latency import StepLatencyModel, decode_matrix, latency_design
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
    """d log AL(K) / d p_j, shape (K, n_positions)."""
    acceptance_var: NDArray[np.float64]

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


def evaluate_surface(
    latency: StepLatencyModel,
    acceptance: AcceptanceModel,
    batch_sizes: ArrayLike,
    k_values: ArrayLike,
    context_tokens: ArrayLike,
    *,
    latency_extrapolation_rel: float = DEFAULT_LATENCY_EXTRAPOLATION_REL,
) -> GoodputSurface:
    """Goodput and its uncertainty for pure decode steps at each (B, K).

    `context_tokens` is KV tokens per request, a scalar or one value per batch size.
    """
    check_is_fitted(latency, "coef_")
    check_is_fitted(acceptance, "conditional_")
    batch = np.asarray(batch_sizes, dtype=np.int64).reshape(-1)
    ks = np.asarray(k_values, dtype=np.int64).reshape(-1)
    if batch.size == 0 or ks.size == 0 or batch.min() < 1 or ks.min() < 0:
        raise ValueError("batch_sizes must be >= 1 and k_values >= 0, both non-empty")
    context = np.broadcast_to(np.asarray(context_tokens, dtype=np.float64), batch.shape)

    grid_b, grid_k = np.meshgrid(batch, ks, indexing="ij")
    grid_ctx = np.broadcast_to(context[:, None], grid_b.shape)
    X = decode_matrix(grid_b, grid_k, grid_ctx)
    design = latency_design(X, latency.knots_)
    latency_s = (design @ latency.coef_).reshape(grid_b.shape)
    latency_s = np.maximum(latency_s, 1e-9)
    log_gradient = design.reshape(*grid_b.shape, -1) / latency_s[..., None]
    param_var_log_t = np.einsum("bkp,pq,bkq->bk", log_gradient, latency.coef_covariance_,
                                log_gradient)
    unidentified_rel = latency.unidentified_std(X).reshape(grid_b.shape) / latency_s
    extra_var = (extrapolation_variance(ks, latency.observed_k_, latency_extrapolation_rel)[None, :]
                 + unidentified_rel**2)
    var_log_t = param_var_log_t + extra_var

    al = acceptance.predict(ks)
    al_gradient = acceptance.gradient(ks) / al[:, None]
    var_log_al = al_gradient**2 @ acceptance.conditional_var_

    goodput = grid_b * al[None, :] / latency_s
    return GoodputSurface(
        batch_sizes=batch,
        k_values=ks,
        context_tokens=np.array(context),
        latency_s=latency_s,
        latency_std_s=latency_s * np.sqrt(var_log_t),
        acceptance_length=al,
        acceptance_length_std=al * np.sqrt(var_log_al),
        goodput_tok_s=goodput,
        goodput_std_tok_s=goodput * np.sqrt(var_log_t + var_log_al[None, :]),
        latency_log_gradient=log_gradient,
        latency_covariance=latency.coef_covariance_,
        latency_extrapolation_var=extra_var,
        acceptance_log_gradient=al_gradient,
        acceptance_var=acceptance.conditional_var_,
    )
