"""Step-latency model T(B, K, context): monotone in batched tokens, ramps and jumps.

Shape, and why. A verify forward is memory-bound (flat in batched tokens: weights are read
once however many tokens ride along) up to a knee, then compute-bound (linear in tokens); a
GPU adds steps: CUDA graphs pad a batch to the next capture size, and a batch past the
largest one runs eager and jumps. A sum of non-negative *segment ramps* over knots in
batched tokens (flat, knee, slope, several slopes) plus non-negative *steps* at the same
knots (padding, the eager jump) represents all of these and is non-decreasing by
construction; it is neither linear (the twin's H100 model is) nor convex, and no breakpoint
is assumed: the knots come from the data (`place_knots`). Attention adds time per KV token
(and per KV token per extra query position), the drafter adds a fixed launch cost when it
runs plus a cost per draft pass, and per request it drafts for, once per step and once per
pass (n-gram matching on the CPU, an EAGLE drafter's forward at the padded batch). Because batched tokens = decode_reqs + draft tokens +
prefill tokens is shared by all K, a K never seen in telemetry is predicted from the
batched-token curve learned at other (B, K) cells - that is how the model extrapolates under
censoring.

Draft tokens are the ones actually verified (`num_draft_tokens`), not decode_reqs * K: an
n-gram drafter proposes nothing for a request without a match, so at K = 7 a step may verify
two drafts per request, not seven. A pure-decode step at a candidate K is predicted with the
expected share of draft slots that get filled (`decode_matrix(..., draft_share=...)`, from
`fitter.surface.share`); 1 for drafters that always propose K (EAGLE, draft models).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator, RegressorMixin

from fitter.surface.nonneg import HUBER_EFFICIENCY_K, robust_relative_nnls
from fitter.surface.validation import check_is_fitted, check_matrix, check_param, check_vector

LATENCY_COLUMNS: tuple[str, ...] = (
    "num_decode_reqs", "k", "k_next", "num_prefill_tokens", "num_prefill_reqs", "kv_tokens",
    "num_draft_tokens",
)
"""Columns of X, in order (all step-record fields; see `schemas.step_record`). `k` is the
longest draft verified this step, `num_draft_tokens` all drafts verified (they size the
verify), `k_next` the drafter (drafts proposed for the next). X without the last column (the
layout before it was added) is read as every decode request verifying `k` drafts."""

_DECODE, _K, _K_NEXT, _PREFILL_TOKENS, _PREFILL_REQS, _KV, _DRAFT_TOKENS = range(
    len(LATENCY_COLUMNS))
LEGACY_N_COLUMNS = len(LATENCY_COLUMNS) - 1

NON_HINGE_FEATURES: tuple[str, ...] = (
    "kv_tokens", "kv_tokens_x_k", "kv_tokens_if_drafting", "drafter_launch", "draft_passes",
    "batch_size", "prefill_reqs", "requests_if_drafting", "requests_x_draft_passes",
)
_DRAFTER_ON_OFF_FEATURES = ("kv_tokens_if_drafting", "drafter_launch", "requests_if_drafting")
"""Identifiable only when some steps ran without the drafter; otherwise they are the
intercept and the KV slope under another name."""
UNIFORM_SD = 1.0 / np.sqrt(12.0)
HELD_FEATURES = ("batch_size", "requests_if_drafting")
"""Per-request terms that do not depend on K. At one load the request count hardly varies,
so the fit cannot tell them from the per-step intercept; past the largest measured count
they are the guess that makes drafts look free (`StepLatencyModel.predict_held`)."""
MEASURED_CELL_WEIGHT = 0.5
"""A latency cell counts as measured with this saturated weight (ten steps at the default
saturation), or half the heaviest cell's where none has it: one stray step at a batch size
does not make it known."""
REQUEST_SPREAD = 2.0
"""Measured request counts at least this factor apart identify the per-request terms: the
drift detector's coverage factor, the step at which a load counts as another."""
HEAVY_KNOT_SHARE = 0.02
"""A batched-token value with this share of the latency weight gets its own knot: a
profile's 16 cells hold ~6% each, a refit's busy batch sizes a few percent."""


def latency_matrix(X: ArrayLike, *, name: str = "X") -> NDArray[np.float64]:
    """X as a float matrix with all `LATENCY_COLUMNS`; the legacy layout without
    `num_draft_tokens` gets decode_reqs * k there."""
    array = np.asarray(X, dtype=np.float64)
    if array.ndim == 2 and array.shape[1] == LEGACY_N_COLUMNS:
        array = np.column_stack([array, array[:, _DECODE] * array[:, _K]])
    return check_matrix(array, n_columns=len(LATENCY_COLUMNS), name=name)


def batched_tokens(X: NDArray[np.float64]) -> NDArray[np.float64]:
    """Tokens the target verifies in a step: one per decode request, its drafts, prefill."""
    return X[:, _DECODE] + X[:, _DRAFT_TOKENS] + X[:, _PREFILL_TOKENS]


def requests_in_flight(X: NDArray[np.float64]) -> NDArray[np.float64]:
    """Requests a step carries: its decode requests and the ones it prefills."""
    return X[:, _DECODE] + X[:, _PREFILL_REQS]


def drafts_per_decode(X: NDArray[np.float64]) -> NDArray[np.float64]:
    """Verified drafts per decode request (query positions beyond the first); 0 without any."""
    decode = X[:, _DECODE]
    return np.divide(X[:, _DRAFT_TOKENS], decode, out=np.zeros(X.shape[0]), where=decode > 0)


def decode_matrix(batch_sizes: ArrayLike, k: ArrayLike, context_tokens: ArrayLike,
                  draft_share: ArrayLike = 1.0) -> NDArray[np.float64]:
    """X rows for pure decode steps: B requests at draft length K, each with `context_tokens`
    of KV, verifying `draft_share * K` drafts each on average (1: every request drafts K)."""
    b, kk, ctx, share = np.broadcast_arrays(
        np.asarray(batch_sizes, dtype=np.float64),
        np.asarray(k, dtype=np.float64),
        np.asarray(context_tokens, dtype=np.float64),
        np.asarray(draft_share, dtype=np.float64),
    )
    zeros = np.zeros(b.size)
    return np.column_stack([b.ravel(), kk.ravel(), kk.ravel(), zeros, zeros, (b * ctx).ravel(),
                            (b * kk * share).ravel()])


def place_knots(tokens: NDArray[np.float64], n_knots: int,
                weight: NDArray[np.float64] | None = None) -> NDArray[np.float64]:
    """Knots at quantiles of the distinct batched-token values, first knot at 0, plus a knot
    at each heavily observed value.

    Quantiles of *distinct* values (not of steps) spread the knots over the range the cells
    cover, so a busy batch size does not crowd all knots into one corner; every segment but
    the last is bounded by observed values, the last one is open to extrapolation. The
    heavy values (`HEAVY_KNOT_SHARE` of the weight or more: a profile cell's or a busy
    batch's decode steps) get a knot of their own, so that a GPU's kink there (the end of
    a memory-bound plateau, a capture size) is not smeared over a segment that straddles it.
    """
    positive = tokens > 0
    distinct = np.unique(tokens[positive])
    if distinct.size == 0:
        return np.zeros(1)
    interior = np.quantile(distinct, np.linspace(0.0, 1.0, n_knots + 1)[1:-1])
    heavy = np.zeros(0)
    if weight is not None and weight[positive].sum() > 0:
        values, inverse = np.unique(tokens[positive], return_inverse=True)
        mass = np.bincount(inverse, weights=weight[positive]) / weight[positive].sum()
        heavy = values[mass >= HEAVY_KNOT_SHARE]
        heavy = heavy[np.argsort(-mass[mass >= HEAVY_KNOT_SHARE])][:n_knots]
    knots = np.unique(np.concatenate([[0.0], np.round(interior), heavy]))
    return knots[knots < distinct[-1]]


def hinge_features(tokens: NDArray[np.float64], knots: NDArray[np.float64]) -> NDArray[np.float64]:
    """Segment ramps: column j is the part of `tokens` that falls in [knot_j, knot_j+1).

    With non-negative coefficients the coefficient of column j is the slope on segment j, so
    the curve is non-decreasing and continuous; the last segment is open-ended.
    """
    widths = np.diff(knots)
    over = tokens[:, None] - knots[None, :]
    ramps = np.clip(over[:, :-1], 0.0, widths[None, :])
    return np.column_stack([ramps, np.maximum(over[:, -1], 0.0)])


def step_features(tokens: NDArray[np.float64], knots: NDArray[np.float64]) -> NDArray[np.float64]:
    """Column j: 1 past knot j + 1. With non-negative coefficients, jumps up at the knots (a
    CUDA-graph capture size, the eager path past the largest one), still non-decreasing."""
    return (tokens[:, None] > knots[None, 1:]).astype(np.float64)


def latency_design(X: NDArray[np.float64], knots: NDArray[np.float64]) -> NDArray[np.float64]:
    """Design matrix: intercept, hinges in batched tokens, steps at the knots, then
    `NON_HINGE_FEATURES`."""
    decode, k_next = X[:, _DECODE], X[:, _K_NEXT]
    drafting = drafter_runs(X).astype(np.float64)
    kv = X[:, _KV]
    tokens = batched_tokens(X)
    requests = requests_in_flight(X)
    return np.column_stack([
        np.ones(X.shape[0]),
        hinge_features(tokens, knots),
        step_features(tokens, knots),
        kv,
        kv * drafts_per_decode(X),
        kv * drafting,
        drafting,
        k_next,
        requests,
        X[:, _PREFILL_REQS],
        requests * drafting,
        decode * k_next,
    ])


def non_hinge_columns(knots: NDArray[np.float64], names: tuple[str, ...]) -> list[int]:
    """Columns of `latency_design` for these `NON_HINGE_FEATURES`: after the intercept,
    a hinge per knot and a step per knot but the first."""
    offset = 1 + 2 * knots.size - 1
    return [offset + NON_HINGE_FEATURES.index(name) for name in names]


def drafter_runs(X: NDArray[np.float64]) -> NDArray[np.bool_]:
    """The drafter runs in a step that proposes drafts for the next one (k_next > 0)."""
    return X[:, _K_NEXT] > 0


def smoothness_penalty(knots: NDArray[np.float64], n_features: int, strength: float,
                       tokens_span: float, latency_scale: float, total_weight: float,
                       ) -> NDArray[np.float64]:
    """Rows that penalise slope changes between neighbouring segments.

    Expressed in the same relative units as the residuals (a slope change times the token
    span, over a typical latency) and proportional to the total data weight, so `strength`
    means the same thing for 100 cells and for 100,000.
    """
    n_hinges = knots.size
    rows = np.zeros((max(n_hinges - 1, 0), n_features))
    factor = np.sqrt(strength * total_weight) * tokens_span / latency_scale
    for j in range(n_hinges - 1):
        rows[j, 1 + j] = -factor
        rows[j, 2 + j] = factor
    return rows


class StepLatencyModel(RegressorMixin, BaseEstimator):
    """Robust monotone regression of step latency (s) on step shape; see the module docstring.

    X has the columns `LATENCY_COLUMNS` (one row per step, or per aggregated cell with its
    count in `sample_weight`); y is `step_latency_s`. Subclassing scikit-learn's public
    `BaseEstimator` gives get_params/set_params, so `sklearn.base.clone` and searches work.
    """

    def __init__(self, *, n_knots: int = 24, smoothness: float = 1e-6,
                 huber_k: float = HUBER_EFFICIENCY_K, max_iter: int = 25) -> None:
        self.n_knots = n_knots
        self.smoothness = smoothness
        self.huber_k = huber_k
        self.max_iter = max_iter

    def fit(self, X: ArrayLike, y: ArrayLike,
            sample_weight: ArrayLike | None = None) -> StepLatencyModel:
        check_param("n_knots", self.n_knots, low=1, high=200)
        check_param("smoothness", self.smoothness, low=0.0)
        check_param("huber_k", self.huber_k, low=0.0, inclusive_low=False)
        check_param("max_iter", self.max_iter, low=1)
        n_columns = np.shape(X)[1] if np.ndim(X) == 2 else len(LATENCY_COLUMNS)
        matrix = latency_matrix(X)
        if (matrix < 0).any():
            raise ValueError("X must be non-negative (counts and token totals)")
        target = check_vector(y, matrix.shape[0], name="y", positive=True)
        weight = check_vector(sample_weight, matrix.shape[0], name="sample_weight", default=1.0)
        if weight.sum() <= 0:
            raise ValueError("sample_weight sums to zero")

        tokens = batched_tokens(matrix)
        knots = place_knots(tokens, int(self.n_knots), weight)
        design = latency_design(matrix, knots)
        runs = drafter_runs(matrix)
        drafter_off_seen = bool((~runs & (weight > 0)).any())
        drafter_on_seen = bool((runs & (weight > 0)).any())
        unidentified = self._unidentified_columns(knots, drafter_off_seen and drafter_on_seen)
        design[:, unidentified] = 0.0  # NNLS keeps a zero column's coefficient at zero
        penalty = smoothness_penalty(
            knots, design.shape[1], float(self.smoothness),
            tokens_span=max(float(tokens.max()), 1.0),
            latency_scale=float(np.median(target)), total_weight=float(weight.sum()),
        )
        result = robust_relative_nnls(design, target, weight, penalty=penalty,
                                      huber_k=float(self.huber_k), max_iter=int(self.max_iter))
        self.knots_ = knots
        self.coef_ = result.coef
        self.coef_covariance_ = result.covariance
        self.residual_scale_ = result.residual_scale
        self.outlier_weight_ = result.weights
        self.n_iter_ = result.n_iter
        self.observed_k_ = np.unique(matrix[weight > 0, _K]).astype(int)
        self.drafter_off_observed_ = drafter_off_seen
        self.drafter_on_observed_ = drafter_on_seen
        self.max_batched_tokens_ = float(tokens.max())
        # the request counts of decode cells with weight (a prefill-only cell says little
        # of what a request in flight costs); of the heaviest ones when none has ten steps
        requests = requests_in_flight(matrix)
        decoding = (matrix[:, _DECODE] > 0) & (weight > 0)
        pool = weight[decoding] if decoding.any() else weight
        bar = min(MEASURED_CELL_WEIGHT, 0.5 * float(pool.max()))
        measured = (decoding if decoding.any() else weight > 0) & (weight >= bar)
        self.max_measured_requests_ = int(max(requests[measured].max(), 1.0))
        self.min_measured_requests_ = int(max(requests[measured].min(), 1.0))
        self.n_features_in_ = int(n_columns)
        return self

    def predict(self, X: ArrayLike) -> NDArray[np.float64]:
        """Expected step latency in seconds."""
        check_is_fitted(self, "coef_")
        matrix = latency_matrix(X)
        return latency_design(matrix, self.knots_) @ self.coef_

    def predict_held(self, X: ArrayLike) -> NDArray[np.float64]:
        """Expected step latency (s) with the K-independent per-request terms
        (`HELD_FEATURES`) counting at most `max_measured_requests_` requests: the other
        reading of data that never varied the request count, where the growth past it comes
        only from batched tokens, KV and draft passes. Equal to `predict` up to there."""
        check_is_fitted(self, "coef_")
        matrix = latency_matrix(X)
        design = latency_design(matrix, self.knots_)
        requests = requests_in_flight(matrix)
        scale = np.divide(np.minimum(requests, self.max_measured_requests_), requests,
                          out=np.ones_like(requests), where=requests > 0)
        design[:, non_hinge_columns(self.knots_, HELD_FEATURES)] *= scale[:, None]
        return design @ self.coef_

    @property
    def requests_identified_(self) -> bool:
        """Whether the measured request counts spread wide enough (`REQUEST_SPREAD`) to
        tell the per-request terms from the per-step ones."""
        check_is_fitted(self, "coef_")
        return self.max_measured_requests_ >= REQUEST_SPREAD * self.min_measured_requests_

    def predict_std(self, X: ArrayLike) -> NDArray[np.float64]:
        """Standard error (s) of the expected latency: coefficient uncertainty plus what the
        data could not identify (`unidentified_std`)."""
        check_is_fitted(self, "coef_")
        matrix = latency_matrix(X)
        design = latency_design(matrix, self.knots_)
        return np.sqrt(self.coefficient_variance(design) + self.unidentified_std(matrix) ** 2)

    def coefficient_variance(self, design: NDArray[np.float64]) -> NDArray[np.float64]:
        """Variance of `design @ coef_` from the coefficients' covariance, per row of
        `design` (any leading shape; the last axis is the coefficients'). Clipped at 0: a
        pseudo-inverse's quadratic form can fall a rounding error below it, and its square
        root was NaN (twin n-gram swing, seed 22: 3 refits failed on it)."""
        check_is_fitted(self, "coef_")
        variance = np.einsum("...p,pq,...q->...", design, self.coef_covariance_, design)
        return np.maximum(variance, 0.0)

    def unidentified_std(self, X: ArrayLike) -> NDArray[np.float64]:
        """Latency (s) the data cannot pin down at all, per row.

        If the drafter never was off in training, its fixed cost is indistinguishable from
        the step's fixed cost and the fit books all of it on the intercept: a step without
        the drafter is then predicted as slow as a drafting one (the cautious error: it never
        talks the table into switching speculation off). If it never ran, drafting steps
        are predicted without its fixed cost. Either way the truth lies anywhere between
        zero and the whole intercept, so the unseen side carries a uniform-prior standard
        deviation, which the exploration plan turns into "try it".
        """
        check_is_fitted(self, "coef_")
        matrix = latency_matrix(X)
        unknown = np.zeros(matrix.shape[0], dtype=bool)
        if not self.drafter_off_observed_:
            unknown |= ~drafter_runs(matrix)
        if not self.drafter_on_observed_:
            unknown |= drafter_runs(matrix)
        return np.where(unknown, self.coef_[0] * UNIFORM_SD, 0.0)

    @staticmethod
    def _unidentified_columns(knots: NDArray[np.float64], both_seen: bool) -> list[int]:
        return [] if both_seen else non_hinge_columns(knots, _DRAFTER_ON_OFF_FEATURES)

    @property
    def feature_names_(self) -> tuple[str, ...]:
        check_is_fitted(self, "coef_")
        hinges = tuple(f"tokens_from_{int(k)}" for k in self.knots_)
        steps = tuple(f"step_past_{int(k)}" for k in self.knots_[1:])
        return ("intercept", *hinges, *steps, *NON_HINGE_FEATURES)
