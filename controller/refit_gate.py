"""Is a refit worth a swap? The candidate's own surface judges both tables on today's load.

Both tables are scored under the candidate's fitted surface (it is the newest knowledge of
the engine), on the batch sizes the engine actually ran recently, so a table that differs
only where no traffic goes is not worth a swap (every swap is a guardrail watch and a risk).
The batch fitter asks the same question in `fitter.refit.predicted_gain`, under its full
`SurfaceFit` and weighted by time share; the closed loop only has the fitted envelope, so it
asks it of the envelope's summarised surface, weighted by recent steps. The surface's own
standard errors say whether the gain is more than the fit's noise (`gain_stderr`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from schemas import DraftTable, TableEnvelope


class _Scored(NamedTuple):
    surface: dict[str, Any]
    weight: NDArray[np.float64]
    """Recent steps per surface grid row."""
    new_col: NDArray[np.int64]
    old_col: NDArray[np.int64]
    """The surface column of each table's K, per grid row."""


def _score(candidate: TableEnvelope, current: DraftTable, batch_sizes: NDArray[np.int64],
           needs: str) -> _Scored | None:
    """Both tables on the candidate's surface grid; None when the surface lacks `needs` or a
    table's K, or no steps are given."""
    surface = candidate.surface
    if not surface or needs not in surface or batch_sizes.size == 0:
        return None
    grid = np.asarray(surface["batch_sizes"], dtype=np.int64)
    k_index = {int(k): j for j, k in enumerate(surface["k_values"])}
    rows = np.clip(np.searchsorted(grid, np.minimum(batch_sizes, grid[-1])), 0, grid.size - 1)
    weight = np.bincount(rows, minlength=grid.size).astype(np.float64)
    new_dense = candidate.table.to_dense(int(grid[-1]))
    old_dense = current.to_dense(int(grid[-1]))
    new_col = np.array([k_index.get(new_dense[b], -1) for b in grid])
    old_col = np.array([k_index.get(old_dense[b], -1) for b in grid])
    if (new_col < 0).any() or (old_col < 0).any():
        return None
    return _Scored(surface, weight, new_col, old_col)


def predicted_gain(candidate: TableEnvelope, current: DraftTable,
                   batch_sizes: NDArray[np.int64]) -> float:
    """Relative goodput gain of `candidate.table` over `current`, weighted by `batch_sizes`.

    0.0 when the candidate carries no surface or no steps are given.
    """
    scored = _score(candidate, current, batch_sizes, "goodput_tok_s")
    if scored is None:
        return 0.0
    goodput = np.asarray(scored.surface["goodput_tok_s"], dtype=np.float64)
    at = np.arange(goodput.shape[0])
    new = float(np.sum(scored.weight * goodput[at, scored.new_col]))
    old = float(np.sum(scored.weight * goodput[at, scored.old_col]))
    return new / old - 1.0 if old > 0 else 0.0


def gain_stderr(candidate: TableEnvelope, current: DraftTable,
                batch_sizes: NDArray[np.int64]) -> float:
    """Standard error of `predicted_gain`, from the surface's per-cell goodput errors on the
    batch sizes where the two tables differ (taken as correlated along batch size within a
    K, independent between the two K: the conservative reading of a summarised surface).

    0.0 when the surface carries no errors or the tables agree wherever steps ran.
    """
    scored = _score(candidate, current, batch_sizes, "goodput_stderr_tok_s")
    if scored is None or "goodput_tok_s" not in scored.surface:
        return 0.0
    goodput = np.asarray(scored.surface["goodput_tok_s"], dtype=np.float64)
    stderr = np.asarray(scored.surface["goodput_stderr_tok_s"], dtype=np.float64)
    at = np.arange(goodput.shape[0])
    old = float(np.sum(scored.weight * goodput[at, scored.old_col]))
    differ = scored.new_col != scored.old_col
    if old <= 0 or not differ.any():
        return 0.0
    weight = scored.weight[differ]
    se_new = float(np.sum(weight * stderr[at[differ], scored.new_col[differ]]))
    se_old = float(np.sum(weight * stderr[at[differ], scored.old_col[differ]]))
    return float(np.hypot(se_new, se_old)) / old
