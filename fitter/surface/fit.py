"""Fit both halves of the throughput surface from one telemetry table.

This is the orchestration between raw telemetry and the two estimators: dedupe, then the
estimators' inputs, computed once (`features`: recency weights, aggregation into cells, the
context each batch size is evaluated at), then the fits. The math is in `latency`,
`acceptance` and `goodput`; this module only wires them.

It also decides which corrections the telemetry identifies (docs/MODEL.md). The draft share
s is always measured (every step says how many requests drafted). The per-request
corrections (batch composition, the share each K's batch drafts at, each K's batch context)
are fitted only when the finished requests' ledger shows that requests accept differently
(`fitter.surface.spread`); without a ledger, or on requests that accept alike, the fit is
the plain surface: the pooled chain, the observed share, one context per batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
from numpy.typing import ArrayLike, NDArray
from sklearn.base import clone

from fitter.records import Records
from fitter.surface.acceptance import AcceptanceModel
from fitter.surface.composition import CompositionModel
from fitter.surface.context import RequestContextModel
from fitter.surface.features import SurfaceFeatures, surface_features
from fitter.surface.goodput import (
    DEFAULT_LATENCY_EXTRAPOLATION_REL,
    GoodputSurface,
    evaluate_surface,
)
from fitter.surface.latency import StepLatencyModel
from fitter.surface.latency_memory import LatencyCells
from fitter.surface.share import DraftShareModel
from fitter.surface.spread import RequestSpreadTest
from fitter.surface.telemetry import to_frame
from fitter.surface.validation import check_param

DEFAULT_HALF_LIFE_S = 1800.0
"""Half an hour: a shift in the workload mix shows within one refit, noise does not."""

MIN_CONTEXT_REQUESTS = 50
"""Fewer finished requests than this and each K is priced at the pooled context: a few
long requests would swing the weighting (`fitter.surface.context`)."""

DEFAULT_CELL_SATURATION = 10.0
"""A latency cell with n steps weighs n / (n + 10): a well-observed cell's median is precise
to well under the model's misfit, so more steps should not let one cell outvote the shape."""

MEASURED_BATCH_STEPS = 10
"""A batch size is measured once this many steps ran at it, at any K, in the fit's window
or in the latency memory: ten steps pin that K's step time to a few percent and the model
carries it to the other K, where the fit between measured batch sizes is 5-20% off (a real
server's probe at 14-16 requests after a profile at one)."""


@dataclass(frozen=True, slots=True)
class SurfaceFit:
    """The fitted latency and acceptance models plus what is needed to evaluate them."""

    latency: StepLatencyModel
    acceptance: AcceptanceModel
    max_batch: int
    context_tokens: NDArray[np.float64]
    """KV tokens per request at batch sizes 1..max_batch (index 0 = batch size 1)."""
    n_records: int
    n_latency_cells: int
    ts_min_ns: int
    ts_max_ns: int
    half_life_s: float | None
    latency_extrapolation_rel: float = DEFAULT_LATENCY_EXTRAPOLATION_REL
    draft_share: DraftShareModel | None = None
    """Share of decode requests that draft (n-gram: those with a match); None = all do."""
    composition: CompositionModel | None = None
    """The arrival mixture behind the pooled acceptance: what each K's own batch emits
    (`fitter.surface.composition`); None when off, not identified (`request_spread`) or no
    position was drafted."""
    request_context: RequestContextModel | None = None
    """Each K's own batch context (`fitter.surface.context`), from the finished requests'
    sums; None when off or not identified (then every K is priced at `context_tokens`)."""
    request_spread: RequestSpreadTest | None = None
    """The test of whether requests accept differently (`fitter.surface.spread`), which
    switches `composition` and `request_context` on; None without a request ledger."""
    batch_share: NDArray[np.float64] | None = None
    """Share of the fit's (recency-weighted) steps at batch sizes 1..max_batch: where the
    traffic it was fitted on ran."""
    measured_batch: NDArray[np.bool_] | None = None
    """Batch sizes 1..max_batch with at least `MEASURED_BATCH_STEPS` steps in the fit's
    window or its latency memory: the unmeasured ones between, past and before them take
    a K path that never turns back (`fitter.derive.bracket_between_measured`)."""

    def evaluate(self, batch_sizes: ArrayLike, k_values: ArrayLike) -> GoodputSurface:
        """Goodput surface at these batch sizes (each within 1..max_batch) and K values."""
        batch = np.asarray(batch_sizes, dtype=np.int64).reshape(-1)
        if batch.size and (batch.min() < 1 or batch.max() > self.max_batch):
            raise ValueError(f"batch sizes must be in 1..{self.max_batch}")
        return evaluate_surface(
            self.latency, self.acceptance, batch, k_values, self.context_tokens[batch - 1],
            latency_extrapolation_rel=self.latency_extrapolation_rel,
            draft_share=self.draft_share, composition=self.composition,
            request_context=self.request_context,
        )


def fit_surface(
    records: Records,
    *,
    max_k: int,
    max_batch: int,
    half_life_s: float | None = DEFAULT_HALF_LIFE_S,
    now_ns: int | None = None,
    latency_model: StepLatencyModel | None = None,
    acceptance_model: AcceptanceModel | None = None,
    cell_saturation: float = DEFAULT_CELL_SATURATION,
    latency_extrapolation_rel: float = DEFAULT_LATENCY_EXTRAPOLATION_REL,
    dedupe: bool = True,
    batch_composition: bool = True,
    request_context: bool = True,
    steps_since_ns: int | None = None,
    latency_memory: LatencyCells | None = None,
) -> SurfaceFit:
    """Fit latency on aggregated cells of all steps, acceptance and the share of requests
    that draft on drafting steps.

    `records` hold the step-record columns (`fitter.records.Records`). The estimators
    passed in are templates: they are cloned (hyper-parameters only), never fitted in place.
    `batch_composition` allows modelling which requests each K's batch holds
    (`fitter.surface.composition`) and `request_context` pricing each K at its own batch's
    context (`fitter.surface.context`, from at least `MIN_CONTEXT_REQUESTS` finished
    requests); either applies only where the finished requests identify it
    (`fitter.surface.spread`: they accept differently). Otherwise the pooled per-position
    chain stands and every K is priced at one context per batch size, which is right where
    requests accept alike.
    `steps_since_ns`: the step models take only the steps from then on, the request test and
    context every finished request in `records` (a re-profile's steady runs for the former,
    all of its requests for the latter: which requests a batch holds is a question of many).
    `latency_memory`: latency cells measured before (`fitter.surface.latency_memory`); the
    latency model fits those whose shape `records` did not measure beside its own, at the
    speed `records` ran where it moved (`LatencyCells.recalled_beside`).
    """
    check_param("max_k", max_k, low=0, high=64)
    check_param("max_batch", max_batch, low=1)
    check_param("half_life_s", half_life_s, low=0.0, inclusive_low=False, allow_none=True)
    check_param("cell_saturation", cell_saturation, low=0.0)
    check_param("latency_extrapolation_rel", latency_extrapolation_rel, low=0.0)

    frame = requests = to_frame(records, dedupe=dedupe)
    if steps_since_ns is not None:
        frame = frame.filter(pl.col("ts_ns") >= steps_since_ns)
        if frame.height == 0:
            raise ValueError(f"no telemetry records from ts_ns {steps_since_ns} on to fit")
    acceptance = clone(acceptance_model) if acceptance_model is not None else AcceptanceModel()
    n_positions = acceptance.n_positions
    if n_positions is None:
        n_positions = max(max_k, 1)
        acceptance.set_params(n_positions=n_positions)
    features = surface_features(frame, requests, n_positions=n_positions, max_batch=max_batch,
                                half_life_s=half_life_s, now_ns=now_ns)

    cell_X, cell_y, cell_weight = features.latency_X, features.latency_y, features.latency_weight
    if latency_memory is not None and len(latency_memory):
        recalled = latency_memory.recalled_beside(LatencyCells(
            cell_X, cell_y, cell_weight, np.zeros(cell_y.size, dtype=np.int64)))
        cell_X = np.vstack([cell_X, recalled.X])
        cell_y = np.concatenate([cell_y, recalled.y])
        cell_weight = np.concatenate([cell_weight, recalled.weight])
    keep = (cell_weight > 0) & (cell_y > 0)
    saturated = cell_weight[keep] / (cell_weight[keep] + cell_saturation)
    latency = clone(latency_model) if latency_model is not None else StepLatencyModel()
    latency.fit(cell_X[keep], cell_y[keep], sample_weight=saturated)

    acceptance.fit(features.acceptance_X)

    draft_share = (DraftShareModel().fit(features.share_X, sample_weight=features.share_weight)
                   if features.share_weight.size else None)

    ledger = features.ledger
    spread = RequestSpreadTest().fit(ledger) if ledger.shape[0] else None
    identified = spread is not None and spread.identified_
    composition = (_fit_composition(features, acceptance, draft_share)
                   if batch_composition and identified else None)
    return SurfaceFit(
        latency=latency,
        acceptance=acceptance,
        max_batch=int(max_batch),
        context_tokens=features.context_tokens,
        n_records=frame.height,
        n_latency_cells=int(keep.sum()),
        ts_min_ns=int(features.ts_ns.min()),
        ts_max_ns=int(features.ts_ns.max()),
        half_life_s=half_life_s,
        latency_extrapolation_rel=latency_extrapolation_rel,
        draft_share=draft_share,
        composition=composition,
        request_context=(RequestContextModel().fit(ledger)
                         if request_context and identified
                         and np.unique(ledger[:, 0]).size >= MIN_CONTEXT_REQUESTS else None),
        request_spread=spread,
        batch_share=_batch_share(features, max_batch),
        measured_batch=_measured_batch(features, latency_memory, max_batch),
    )


def _batch_share(features: SurfaceFeatures, max_batch: int) -> NDArray[np.float64]:
    """Recency-weighted share of the steps at each batch size 1..max_batch."""
    batch = np.clip(features.steps["batch_size"].to_numpy(), 1, max_batch)
    counts = np.bincount(batch - 1, weights=features.weights, minlength=max_batch)
    total = counts.sum()
    return counts / total if total > 0 else counts


def _measured_batch(features: SurfaceFeatures, latency_memory: LatencyCells | None,
                    max_batch: int) -> NDArray[np.bool_]:
    """Batch sizes 1..max_batch with `MEASURED_BATCH_STEPS` steps, counted once each (no
    recency weight), in the window or the latency memory."""
    batch = np.clip(features.steps["batch_size"].to_numpy(), 1, max_batch)
    steps = np.bincount(batch - 1, minlength=max_batch).astype(np.float64)
    if latency_memory is not None and len(latency_memory):
        remembered = np.clip(latency_memory.batch_sizes().astype(np.int64), 1, max_batch)
        steps = np.maximum(steps, np.bincount(remembered - 1, weights=latency_memory.weight,
                                              minlength=max_batch))
    return steps >= MEASURED_BATCH_STEPS


def _fit_composition(features: SurfaceFeatures, acceptance: AcceptanceModel,
                     draft_share: DraftShareModel | None) -> CompositionModel | None:
    """The arrival mixture (`fitter.surface.composition`) fitted to each drafted position's
    acceptance per decode request, as pooled by the acceptance model (its prior keeps a
    thinly observed position from swinging the mixture), and the K that shaped the batches
    it was measured on; None when no position was drafted."""
    shaped = features.shaped_k_by_position()
    positions = acceptance.observed_positions_
    positions = positions[np.isfinite(shaped[positions - 1])]
    if positions.size == 0:
        return None
    share = 1.0 if draft_share is None else float(draft_share.share_)
    per_request = np.clip(share * acceptance.unconditional_[positions - 1], 0.0, 1.0)
    X = np.column_stack([positions.astype(np.float64), shaped[positions - 1]])
    return CompositionModel().fit(X, per_request)
