"""Robust non-negative least squares on relative residuals: the solver under the latency model.

Why non-negative: every latency feature (hinges in batched tokens, KV tokens, draft passes)
can only add time, so non-negative coefficients make the fitted surface non-decreasing in B
and K by construction - no extrapolation can predict that more work is faster.
Why relative residuals: the table compares goodput ratios, so a 1 ms error matters at 5 ms and
not at 60 ms; minimising relative error is minimising what the argmax is sensitive to.
Why Huber IRLS: GC pauses, preemptions and swap-ins give multi-x outliers; Huber weights cap
their pull without discarding the heavy-but-real tail of a busy engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import nnls
from threadpoolctl import threadpool_limits

HUBER_EFFICIENCY_K = 1.345
"""Huber's constant: 95% efficiency under Gaussian noise."""


@dataclass(frozen=True, slots=True)
class RobustFit:
    coef: NDArray[np.float64]
    """Non-negative coefficients, in the units of the unscaled design."""
    covariance: NDArray[np.float64]
    """Approximate covariance of `coef` (active set treated as an unconstrained WLS fit)."""
    residual_scale: float
    """Robust (MAD) scale of the relative residuals."""
    weights: NDArray[np.float64]
    """Final per-row robustness weights (1 = kept, < 1 = down-weighted outlier)."""
    n_iter: int


def nnls_normal(gram: NDArray[np.float64], moment: NDArray[np.float64]) -> NDArray[np.float64]:
    """NNLS from the normal equations: min x'Gx - 2c'x subject to x >= 0.

    With G = R'R (Cholesky) this is ||Rx - R'^-1 c||^2 + const, so Lawson-Hanson runs on a
    p x p system whatever the number of rows: the data pass is one matrix product.
    """
    n_cols = gram.shape[0]
    jitter = 1e-12 * max(float(np.trace(gram)) / n_cols, 1e-300)
    upper = np.linalg.cholesky(gram + jitter * np.eye(n_cols)).T
    rhs = np.linalg.solve(upper.T, moment)
    coef, _ = nnls(upper, rhs, maxiter=50 * n_cols)
    return coef


def robust_relative_nnls(
    design: NDArray[np.float64],
    target: NDArray[np.float64],
    sample_weight: NDArray[np.float64],
    *,
    penalty: NDArray[np.float64] | None = None,
    huber_k: float = HUBER_EFFICIENCY_K,
    max_iter: int = 20,
    tol: float = 1e-6,
) -> RobustFit:
    """Minimise sum w * huber((y - A b) / y) subject to b >= 0, by IRLS.

    `penalty` rows (already scaled) are appended unweighted to every solve: they express
    smoothness between neighbouring hinge slopes and keep empty segments from collapsing.
    BLAS runs single-threaded here: the products are tall and skinny (cells x ~35), threads
    gain nothing on them and spin-wait badly when the fitter shares its cores.
    """
    with threadpool_limits(limits=1, user_api="blas"):
        return _robust_relative_nnls(design, target, sample_weight, penalty=penalty,
                                     huber_k=huber_k, max_iter=max_iter, tol=tol)


def _robust_relative_nnls(
    design: NDArray[np.float64],
    target: NDArray[np.float64],
    sample_weight: NDArray[np.float64],
    *,
    penalty: NDArray[np.float64] | None,
    huber_k: float,
    max_iter: int,
    tol: float,
) -> RobustFit:
    column_scale = np.sqrt((design**2).mean(axis=0))
    column_scale[column_scale == 0] = 1.0
    relative = design / target[:, None] / column_scale
    pen = np.zeros((0, design.shape[1])) if penalty is None else penalty / column_scale
    robust_w = np.ones_like(target)
    coef_scaled = np.zeros(design.shape[1])
    scale = 1.0
    n_iter = 0
    while n_iter < max_iter:
        n_iter += 1
        row_w = sample_weight * robust_w
        gram = (relative.T * row_w) @ relative + pen.T @ pen
        new_coef = nnls_normal(gram, relative.T @ row_w)
        residual = 1.0 - relative @ new_coef
        scale = _robust_scale(residual, sample_weight)
        cutoff = huber_k * scale
        robust_w = np.minimum(1.0, cutoff / np.maximum(np.abs(residual), 1e-300))
        change = np.max(np.abs(new_coef - coef_scaled)) / max(np.max(np.abs(new_coef)), 1e-300)
        coef_scaled = new_coef
        if change < tol:
            break
    covariance_scaled = _active_set_covariance(
        relative, sample_weight * robust_w, pen, coef_scaled, scale
    )
    inverse_scale = 1.0 / column_scale
    return RobustFit(
        coef=coef_scaled * inverse_scale,
        covariance=covariance_scaled * np.outer(inverse_scale, inverse_scale),
        residual_scale=float(scale),
        weights=robust_w,
        n_iter=n_iter,
    )


def _robust_scale(residual: NDArray[np.float64], weight: NDArray[np.float64]) -> float:
    """1.4826 x median absolute residual over weighted rows: a Gaussian-consistent sigma
    that ignores outliers."""
    median = float(np.median(np.abs(residual[weight > 0])))
    return max(1.4826 * median, 1e-6)


def _active_set_covariance(
    relative: NDArray[np.float64],
    weight: NDArray[np.float64],
    penalty: NDArray[np.float64],
    coef: NDArray[np.float64],
    scale: float,
) -> NDArray[np.float64]:
    """sigma^2 (A'WA)^-1 over the coefficients NNLS left free; bound ones get zero variance.

    The weights are per-cell, not per-step, so this measures how well the cells pin the
    coefficients down given the misfit between cells - the uncertainty that matters when a
    (B, K) cell was never observed.
    """
    n_cols = relative.shape[1]
    active = coef > 0
    covariance = np.zeros((n_cols, n_cols))
    if not active.any():
        return covariance
    weighted = relative[:, active] * np.sqrt(weight)[:, None]
    gram = weighted.T @ weighted + penalty[:, active].T @ penalty[:, active]
    covariance[np.ix_(active, active)] = scale**2 * np.linalg.pinv(gram)
    return covariance
