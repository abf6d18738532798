"""Every estimator input of one surface fit, taken from its frames before any model is fitted.

`fitter.surface.fit` wires the estimators; this is what they are fitted on, each computed
once by `fitter.surface.telemetry` from the steps and the finished requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
from numpy.typing import NDArray

from fitter.surface.telemetry import (
    acceptance_rows,
    composition_by_position,
    context_by_batch,
    draft_share_rows,
    latency_cells,
    recency_weights,
    request_segment_rows,
)


@dataclass(frozen=True, slots=True)
class SurfaceFeatures:
    """The step models' inputs (from the steps) and the request ledger (from all requests)."""

    steps: pl.DataFrame
    """The steps the step models take."""
    ts_ns: NDArray[np.int64]
    weights: NDArray[np.float64]
    """Recency weight of each step, in `steps`' row order."""
    n_positions: int
    """Draft positions the acceptance rows, the ledger and the composition cover."""
    latency_X: NDArray[np.float64]
    latency_y: NDArray[np.float64]
    latency_weight: NDArray[np.float64]
    """Per latency cell: `LATENCY_COLUMNS`, median latency, summed recency weight."""
    acceptance_X: NDArray[np.float64]
    share_X: NDArray[np.float64]
    share_weight: NDArray[np.float64]
    ledger: NDArray[np.float64]
    """The finished requests' segments (`request_segment_rows`); 0 rows without a ledger."""
    context_tokens: NDArray[np.float64]
    """KV tokens per request at batch sizes 1..max_batch."""

    def shaped_k_by_position(self) -> NDArray[np.float64]:
        """`composition_by_position` of the steps: only a composition fit needs it, and it
        walks every step, so it is computed on demand."""
        return composition_by_position(self.steps, self.weights, self.n_positions)


def surface_features(steps: pl.DataFrame, requests: pl.DataFrame, *, n_positions: int,
                     max_batch: int, half_life_s: float | None,
                     now_ns: int | None) -> SurfaceFeatures:
    """The inputs of a fit on `steps`, with the request ledger read from `requests`."""
    ts_ns = steps["ts_ns"].to_numpy()
    weights = recency_weights(ts_ns, half_life_s, now_ns)
    latency_X, latency_y, latency_weight = latency_cells(steps, weights, half_life_s, now_ns)
    share_X, share_weight = draft_share_rows(steps, weights)
    return SurfaceFeatures(
        steps=steps, ts_ns=ts_ns, weights=weights, n_positions=n_positions,
        latency_X=latency_X, latency_y=latency_y, latency_weight=latency_weight,
        acceptance_X=acceptance_rows(steps, weights, n_positions),
        share_X=share_X, share_weight=share_weight,
        ledger=request_segment_rows(requests, n_positions),
        context_tokens=context_by_batch(steps, weights, np.arange(1, max_batch + 1)))
