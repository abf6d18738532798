"""From a goodput surface to a draft table: K*(B) = argmax_K G(B, K), as few ranges as possible.

Rules beyond the argmax, and why:
- Within `tolerance` of the best goodput, smaller K wins. The surface is an estimate; at equal
  predicted goodput a smaller K spends less target compute, wastes fewer drafts if acceptance
  drops, and is the cheaper mistake - but only by the step time it saves, so a smaller K's
  tolerance is capped at the best K's predicted latency premium over it. Where a GPU pads
  K5..K7 to one CUDA-graph size, the larger K costs nothing and keeps its gain.
- Among tables that keep every batch size within tolerance, the one with the fewest ranges
  wins (then the smallest K). Noise otherwise makes K flicker 3,2,3 between neighbouring batch
  sizes, which is a table nobody can read and a switch the engine makes for nothing.
- With `merge_z` (the closed loop's tables), a K is also acceptable where the fit cannot tell
  it from the row's best (`indistinguishable`), and among the fewest-range tables the one with
  the least predicted loss wins: a range boundary then only stands where the data says K
  changes there, so an A-B-A pattern needs the data to demand it.
- An unmeasured batch size (`SurfaceFit.measured_batch`) takes its K from a path that never
  turns back (`bracket_between_measured`): between two measured ones from the lower one's
  K to the upper one's, past the last one down, before the first one up. There the fit
  interpolates or extrapolates, 5-20% off between neighbouring K, and its argmax flickered
  over 10 ranges on a real server's probe at 14-16 requests after a profile at one.
- Past the largest request count of data that never varied it, K is chosen on its worse
  share of the best under two readings of that data (`robust_goodput`): a fit at one load
  cannot tell a per-request cost from the per-step one, and either guess alone picks K far
  off at 16x the load.
The envelope also carries the surface (so the controller can compare live goodput against the
prediction) and an exploration plan (where another K most plausibly beats the chosen one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fitter.budget import add_fitted_budget
from fitter.records import Records
from fitter.surface.composition import CompositionModel
from fitter.surface.fit import DEFAULT_HALF_LIFE_S, SurfaceFit, fit_surface
from fitter.surface.goodput import GoodputSurface
from fitter.surface.spread import RequestSpreadTest
from schemas.draft_table import DraftTable
from schemas.envelope import TableEnvelope, TableKey

DEFAULT_TOLERANCE = 0.01
DEFAULT_MIN_PROBABILITY = 0.05
DEFAULT_MIN_EXPECTED_GAIN = 0.002
"""Explore only where switching K could be expected to win at least 0.2% goodput."""
FITTER_VERSION = "tabletune-fitter/1"
DEFAULT_MERGE_Z = 1.0
"""A K within this many standard errors of its row's best may take the row when that merges
ranges: one standard error of the difference is where a ranking is a coin toss at 1:5."""
MAX_MERGE_LOSS = 0.02
"""... but never at more than this predicted loss, however uncertain the fit: a wide error far
from the measured batch sizes must not flatten a table into one K predicted 5% worse."""
UNMEASURED_SMOOTHING = 1.25
"""Past the measured request count, K is chosen on goodput averaged over batch sizes within
this factor: the fit's step features jump there by 10% between neighbours (a profile at
one user), which made K flicker over 20 ranges."""
SERVED_SHARE = 0.01
"""A batch size that ran at least this share of the fit's steps merges only within
`SERVED_MAX_LOSS`: there the traffic runs the table's choice and pays a merge's loss (at 16
users the suite's EAGLE table took K7 from the small batch sizes where K5 was measured 1.3%
better)."""
SERVED_MAX_LOSS = 0.005
"""... where a served batch size may still take a neighbour's K when the fit cannot tell
them apart at no more than this predicted loss: an open load's many served batch sizes
kept argmax flicker 0.1-0.3% apart (16 ranges at the suite's ShareGPT EAGLE 3000 tok/s),
while the 1.3% above stays out."""
MOVE_TIE_BREAK = 1e-9
"""Where no K path keeps to the acceptable cells, the least loss picks it; a move costs
only this, so of two paths with the same loss the one with fewer changes wins."""
SURFACE_GRID_POINTS = 64
"""The envelope's `surface` holds at most this many batch sizes: it must stay far below the
broker's message size while the table itself is derived at every batch size."""


def candidate_k_values(startup_k_values: Sequence[int], max_k: int) -> NDArray[np.int64]:
    """K values a table may use: the engine's startup set, capped at `max_k`, sorted."""
    allowed = sorted({int(k) for k in startup_k_values if 0 <= int(k) <= max_k})
    if not allowed:
        raise ValueError(
            f"no startup K value in {sorted(startup_k_values)} is within 0..max_k={max_k}"
        )
    return np.asarray(allowed, dtype=np.int64)


def choose_k(goodput: NDArray[np.float64], *, tolerance: float = DEFAULT_TOLERANCE,
             fewest_ranges: bool = True,
             latency: NDArray[np.float64] | None = None,
             indistinct: NDArray[np.bool_] | None = None,
             measured: NDArray[np.bool_] | None = None) -> NDArray[np.int64]:
    """Column index chosen per row of `goodput` (rows: batch sizes in order, columns: K ascending).

    A column is acceptable at a row when its goodput is within `tolerance` of the row's best;
    with `latency` (the same shape), a column left of the best is within no more than the
    best's latency premium over it (`tolerance_margins`). Without `fewest_ranges` each row
    takes its smallest acceptable K; with it, a Viterbi pass picks acceptable columns
    minimising (number of changes, then sum of K indices). `indistinct` (the same shape, from
    `indistinguishable`) makes its cells acceptable too and always runs the Viterbi pass,
    with the summed relative loss against each row's best as the second criterion.
    `measured` (one flag per row) gives each unmeasured row the one K of a path that
    never turns back from its measured neighbours' K (`bracket_between_measured`): their
    best, or without the Viterbi pass the smallest acceptable K they take.
    """
    if goodput.ndim != 2 or goodput.size == 0:
        raise ValueError(f"goodput must be a non-empty (batch, K) matrix, got {goodput.shape}")
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance={tolerance!r} is outside [0, 1)")
    best = goodput.max(axis=1, keepdims=True)
    acceptable = goodput >= (1.0 - tolerance_margins(goodput, tolerance, latency)) * best
    n_rows, n_cols = goodput.shape
    if indistinct is not None:
        if indistinct.shape != goodput.shape:
            raise ValueError(f"indistinct {indistinct.shape} and goodput {goodput.shape} "
                             "differ in shape")
        acceptable |= indistinct
    greedy = indistinct is None and not fewest_ranges
    if measured is not None:
        anchors = acceptable.argmax(axis=1) if greedy else goodput.argmax(axis=1)
        bracket = bracket_between_measured(goodput, measured, acceptable, anchors)
        if bracket is not None:
            acceptable = np.where(measured[:, None], acceptable, bracket)
    if indistinct is not None:
        cell_cost = np.maximum(1.0 - goodput / best, 0.0)
    elif greedy:
        return acceptable.argmax(axis=1).astype(np.int64)
    else:
        cell_cost = np.broadcast_to(np.arange(n_cols, dtype=np.float64), goodput.shape)
    return _fewest_changes(acceptable, cell_cost)


def _fewest_changes(acceptable: NDArray[np.bool_],
                    cell_cost: NDArray[np.float64]) -> NDArray[np.int64]:
    """The acceptable column per row that minimises (number of changes, then summed
    `cell_cost`), by a Viterbi pass over the rows."""
    n_rows, n_cols = acceptable.shape
    change_cost = float(cell_cost.sum()) + 1.0  # one change outweighs any sum of cell costs
    infeasible = np.inf
    cost = np.where(acceptable[0], cell_cost[0], infeasible)
    came_from = np.zeros((n_rows, n_cols), dtype=np.int64)
    columns = np.arange(n_cols)
    for row in range(1, n_rows):
        best_prev = int(cost.argmin())
        switch = cost[best_prev] + change_cost
        stay_cheaper = cost <= switch
        came_from[row] = np.where(stay_cheaper, columns, best_prev)
        cost = np.where(stay_cheaper, cost, switch) + cell_cost[row]
        cost = np.where(acceptable[row], cost, infeasible)
    return _backtrack(came_from, int(cost.argmin()))


def _backtrack(came_from: NDArray[np.int64], last: int) -> NDArray[np.int64]:
    """A Viterbi pass's path, from the column it ends in and each cell's predecessor."""
    path = np.zeros(came_from.shape[0], dtype=np.int64)
    path[-1] = last
    for row in range(came_from.shape[0] - 1, 0, -1):
        path[row - 1] = came_from[row, path[row]]
    return path


def indistinguishable(surface: GoodputSurface, z: float = DEFAULT_MERGE_Z,
                      max_loss: float = MAX_MERGE_LOSS,
                      served: NDArray[np.bool_] | None = None) -> NDArray[np.bool_]:
    """Cells the fit cannot tell from their row's best K: a predicted loss within `z`
    standard errors of the difference (shared parts cancelled, `log_ratio_vs`) and at most
    `max_loss`; in the `served` rows (where the traffic runs and pays a merge's loss), at
    most `SERVED_MAX_LOSS`."""
    if z < 0 or not 0.0 <= max_loss < 1.0:
        raise ValueError(f"merge z={z!r} must be >= 0 and max_loss={max_loss!r} in [0, 1)")
    best = surface.goodput_tok_s.argmax(axis=1)
    mean, sd = surface.log_ratio_vs(best)
    close = (mean >= -z * sd) & (mean >= np.log1p(-max_loss))
    if served is None:
        return close
    return close & (~served[:, None] | (mean >= np.log1p(-min(max_loss, SERVED_MAX_LOSS))))


def bracket_between_measured(goodput: NDArray[np.float64], measured: NDArray[np.bool_],
                             acceptable: NDArray[np.bool_] | None = None,
                             anchors: NDArray[np.int64] | None = None,
                             ) -> NDArray[np.bool_] | None:
    """Cells each row may take: one K at each unmeasured row, the measured rows any.
    Between two measured rows, a path from the lower one's K to the upper one's; past the
    last, from its K down; before the first, from its K up. A measured row's K is its
    `anchors` column (default: its best). Each path never turns back; of those that keep
    to the `acceptable` cells (and to each row's best on the way), the one with the fewest
    changes, then the least predicted loss, wins; where none keeps to them, the one with
    the least loss (`_monotone_path`). None when no row is measured.

    Why monotone: the best K falls or stays as the batch grows on every latency shape
    measured here, so an unmeasured stretch changes K only as far as its ends do; the fit's
    own argmax there flickered over 10 ranges on a real server (measured at 1 and 14-16
    requests) and climbed back to K7 at 172-256 after a profile at one request."""
    n_rows, n_cols = goodput.shape
    if measured.shape != (n_rows,):
        raise ValueError(f"measured {measured.shape} does not match goodput's {n_rows} rows")
    near = np.zeros(goodput.shape, dtype=np.bool_) if acceptable is None else acceptable
    if near.shape != goodput.shape:
        raise ValueError(f"acceptable {near.shape} and goodput {goodput.shape} differ in shape")
    rows = np.flatnonzero(measured)
    if rows.size == 0:
        return None
    anchor = goodput.argmax(axis=1) if anchors is None else anchors
    loss = 1.0 - goodput / goodput.max(axis=1, keepdims=True)
    allowed = np.ones(goodput.shape, dtype=np.bool_)

    def take(span: slice, path: NDArray[np.int64]) -> None:
        allowed[span] = False
        allowed[np.arange(n_rows)[span], path] = True

    for below, above in zip(rows[:-1], rows[1:], strict=True):
        if above - below > 1:
            span = slice(below + 1, above)
            take(span, _monotone_path(loss[span], near[span], int(anchor[below]),
                                      int(anchor[above]), ends_there=True))
    if rows[-1] < n_rows - 1:
        span = slice(rows[-1] + 1, n_rows)
        take(span, _monotone_path(loss[span], near[span], int(anchor[rows[-1]]), 0))
    if rows[0] > 0:  # walked from the first measured row down to batch size 1
        span = slice(0, rows[0])
        take(span, _monotone_path(loss[span][::-1], near[span][::-1], int(anchor[rows[0]]),
                                  n_cols - 1)[::-1])
    return allowed


def _monotone_path(loss: NDArray[np.float64], near: NDArray[np.bool_], start: int,
                   end: int, ends_there: bool = False) -> NDArray[np.int64]:
    """Per row of `loss`, a column between `start` and `end` that moves only from `start`
    towards `end` (and, `ends_there`, on into `end` after the last row). Within the `near`
    cells and each row's least loss on the way, the path with the fewest moves, then the
    least summed loss, wins; where no such path exists, the one with the least summed loss."""
    step = 1 if end >= start else -1
    columns = np.arange(start, end + step, step)  # in the order the path may visit them
    cost = loss[:, columns]
    allowed = near[:, columns] | (cost <= cost.min(axis=1, keepdims=True))
    path = _fewest_moves(cost, allowed, move_cost=float(cost.sum()) + 1.0,
                         ends_last=ends_there)
    if path is None:  # the loss decides; a move costs only enough to break its ties
        path = _fewest_moves(cost, None, move_cost=MOVE_TIE_BREAK, ends_last=ends_there)
        assert path is not None  # every cell allowed: some path always exists
    return columns[path]


def _fewest_moves(cost: NDArray[np.float64], allowed: NDArray[np.bool_] | None,
                  move_cost: float, ends_last: bool) -> NDArray[np.int64] | None:
    """The column per row, starting in column 0 before the first row and moving only
    right, that minimises (moves x `move_cost` + summed `cost`) over `allowed` cells,
    counting a move into the last column after the last row when `ends_last` (ties: the
    later move); None when no path keeps to them."""
    n_rows, n_cols = cost.shape
    total = np.full(n_cols, np.inf)
    total[0] = 0.0  # the measured row the stretch starts from
    came_from = np.zeros(cost.shape, dtype=np.int64)
    columns = np.arange(n_cols)
    for row in range(n_rows):
        source = np.r_[0, _argmin_prefix(total)[:-1]]  # the best column left of each
        moved = np.where(columns > 0, total[source], np.inf) + move_cost
        stay = total < moved
        came_from[row] = np.where(stay, columns, source)
        total = np.where(stay, total, moved) + cost[row]
        if allowed is not None:
            total = np.where(allowed[row], total, np.inf)
    if ends_last:
        total[:-1] += move_cost
    if not np.isfinite(total.min()):
        return None
    return _backtrack(came_from, int(total.argmin()))


def _argmin_prefix(values: NDArray[np.float64]) -> NDArray[np.int64]:
    """For each index i, the first index of the minimum of values[: i + 1]."""
    index = np.zeros(values.size, dtype=np.int64)
    for i in range(1, values.size):
        index[i] = index[i - 1] if values[index[i - 1]] <= values[i] else i
    return index


def robust_goodput(surface: GoodputSurface) -> NDArray[np.float64]:
    """The goodput a table is chosen on: the fitted surface, except past the largest
    request count of data whose request counts spread less than 2x
    (`GoodputSurface.measured_requests`).

    There the fit cannot tell a per-request cost from the per-step cost, so it has two
    readings: the fit's own, where the step grows by that cost with every request (drafts
    look free, or, booked on the drafter, drafting looks ruinous), and `held_latency_s`,
    where only batched tokens, KV and draft passes grow. Each K is scored by its worse
    share of the best K under either reading (each share averaged over batch sizes within
    `UNMEASURED_SMOOTHING`), scaled to the fit's best: the K that stays
    close under both (the cheaper mistake) wins over one that is best under one reading and
    far off under the other."""
    goodput = surface.goodput_tok_s
    if surface.held_latency_s is None or surface.measured_requests is None:
        return goodput
    unmeasured = surface.batch_sizes > surface.measured_requests
    if not unmeasured.any():
        return goodput
    held = goodput * surface.latency_s / surface.held_latency_s
    best = goodput.max(axis=1, keepdims=True)
    worse_share = np.minimum(
        _neighbourhood_mean(goodput / best, surface.batch_sizes),
        _neighbourhood_mean(held / held.max(axis=1, keepdims=True), surface.batch_sizes))
    return np.where(unmeasured[:, None], worse_share * best, goodput)


def _neighbourhood_mean(share: NDArray[np.float64],
                        batch_sizes: NDArray[np.int64]) -> NDArray[np.float64]:
    """Each row averaged with the rows within `UNMEASURED_SMOOTHING` of its batch size: a
    reading extrapolated far from its data jumps where its knots do, and an unmeasured
    batch size is not known well enough for K to follow each jump."""
    sizes = batch_sizes.astype(np.float64)
    if (np.diff(sizes) <= 0).any():
        raise ValueError("batch sizes must be strictly increasing")
    low = np.searchsorted(sizes, sizes / UNMEASURED_SMOOTHING, side="left")
    high = np.searchsorted(sizes, sizes * UNMEASURED_SMOOTHING, side="right")
    cumulative = np.vstack([np.zeros((1, share.shape[1])), np.cumsum(share, axis=0)])
    return (cumulative[high] - cumulative[low]) / (high - low)[:, None]


def tolerance_margins(goodput: NDArray[np.float64], tolerance: float,
                      latency: NDArray[np.float64] | None) -> NDArray[np.float64]:
    """Per cell, how far below the row's best goodput it may be and still be chosen.

    `tolerance` everywhere without `latency`. With it, a K smaller than the row's best gets
    at most the best's relative latency premium over it: if the best K's extra positions
    accepted nothing, it would lose exactly that premium, so a smaller K is the cheaper
    mistake only up to there (zero where both pad to one step).
    """
    margins = np.full(goodput.shape, tolerance)
    if latency is None:
        return margins
    if latency.shape != goodput.shape:
        raise ValueError(f"latency {latency.shape} and goodput {goodput.shape} differ in shape")
    rows = np.arange(goodput.shape[0])
    best_col = goodput.argmax(axis=1)
    premium = np.maximum(latency[rows, best_col][:, None] / latency - 1.0, 0.0)
    left_of_best = np.arange(goodput.shape[1])[None, :] < best_col[:, None]
    return np.where(left_of_best, np.minimum(margins, premium), margins)


def exploration_plan(surface: GoodputSurface, chosen_index: NDArray[np.int64], *,
                     tolerance: float = DEFAULT_TOLERANCE,
                     min_probability: float = DEFAULT_MIN_PROBABILITY,
                     min_expected_gain: float = DEFAULT_MIN_EXPECTED_GAIN,
                     max_candidates: int = 2) -> dict[str, Any]:
    """Where to spend exploration steps: per batch bucket, the K values that could beat the
    table's choice by more than `tolerance`, the bucket with the most to gain first.

    Buckets are the table's ranges split at powers of two, so one bucket has one chosen K.
    Only a win beyond the tolerance would change the table, so that is what is scored, by
    probability and by expected gain; a candidate needs both above their minimum, which
    leaves out the neck-and-neck but precisely known cells at every range boundary and
    makes exploration cost nothing where the table is already sure.
    """
    p_better = surface.probability_better(chosen_index, margin=tolerance)
    gain = surface.expected_gain(chosen_index, margin=tolerance)
    batch = surface.batch_sizes
    octave = np.floor(np.log2(batch)).astype(np.int64)
    boundaries = np.flatnonzero((np.diff(chosen_index) != 0) | (np.diff(octave) != 0)) + 1
    buckets = []
    for rows in np.split(np.arange(batch.size), boundaries):
        p_bucket = p_better[rows].max(axis=0)
        gain_bucket = gain[rows].max(axis=0)
        worth = (p_bucket >= min_probability) & (gain_bucket >= min_expected_gain)
        order = [int(j) for j in np.argsort(-gain_bucket, kind="stable") if worth[j]]
        if not order:
            continue
        chosen_col = int(chosen_index[rows[0]])
        buckets.append({
            "batch_start": int(batch[rows[0]]),
            "batch_end": int(batch[rows[-1]]),
            "chosen_k": int(surface.k_values[chosen_col]),
            "expected_gain": _round(gain_bucket[order[0]]),
            "candidates": [
                {
                    "k": int(surface.k_values[j]),
                    "p_better": _round(p_bucket[j]),
                    "expected_gain": _round(gain_bucket[j]),
                    "goodput_ratio": _round(float(np.median(
                        surface.goodput_tok_s[rows, j] / surface.goodput_tok_s[rows, chosen_col]
                    ))),
                }
                for j in order[:max_candidates]
            ],
        })
    buckets.sort(key=lambda entry: -entry["expected_gain"])
    return {
        "method": "delta method on log goodput; score = E[max(0, log(G_k / ((1+tol) G_K*)))]",
        "tolerance": tolerance,
        "min_probability": min_probability,
        "min_expected_gain": min_expected_gain,
        "buckets": buckets,
    }


def surface_grid(max_batch: int, n_points: int = SURFACE_GRID_POINTS) -> NDArray[np.int64]:
    """Batch sizes stored in the envelope: every one up to 16, geometric above."""
    if max_batch <= n_points:
        return np.arange(1, max_batch + 1)
    dense = np.arange(1, 17)
    sparse = np.geomspace(17, max_batch, n_points - dense.size).round().astype(np.int64)
    return np.unique(np.concatenate([dense, sparse, [max_batch]]))


def surface_summary(surface: GoodputSurface, rows: NDArray[np.int64], fit: SurfaceFit,
                    measured: NDArray[np.bool_] | None = None) -> dict[str, Any]:
    """The envelope's `surface`: per-cell predictions and uncertainty on a batch-size grid;
    `measured`: the fit's measured flags for `surface`'s batch sizes."""
    acceptance = fit.acceptance
    return {
        "batch_sizes": [int(b) for b in surface.batch_sizes[rows]],
        "k_values": [int(k) for k in surface.k_values],
        "context_tokens": _round_list(surface.context_tokens[rows]),
        "goodput_tok_s": _round_matrix(surface.goodput_tok_s[rows]),
        "goodput_stderr_tok_s": _round_matrix(surface.goodput_std_tok_s[rows]),
        "latency_s": _round_matrix(surface.latency_s[rows]),
        "latency_stderr_s": _round_matrix(surface.latency_std_s[rows]),
        "acceptance_length": _round_list(surface.acceptance_length),
        "acceptance_length_stderr": _round_list(surface.acceptance_length_std),
        "acceptance_per_position": _round_list(acceptance.unconditional_),
        "conditional_acceptance": _round_list(acceptance.conditional_),
        "conditional_acceptance_trials": _round_list(acceptance.trials_),
        "draft_share": _round(surface.draft_share),
        "draft_share_stderr": _round(surface.draft_share_std),
        "tokens_per_request": _round_list(surface.acceptance_length
                                          if surface.tokens_per_request is None
                                          else surface.tokens_per_request),
        "latency_observed_k": [int(k) for k in fit.latency.observed_k_],
        **({} if fit.composition is None else {"composition": _mixture(fit.composition)}),
        **({} if fit.request_spread is None
           else {"request_spread": _spread(fit.request_spread)}),
        "latency_residual_scale": _round(fit.latency.residual_scale_),
        # past it the table is the robust choice of two readings (`robust_goodput`)
        **({} if surface.measured_requests is None
           else {"measured_requests": int(surface.measured_requests)}),
        # the largest batch size with steps enough to be priced as measured (window or
        # latency memory): past it the table's K is extrapolated
        **({} if measured is None or not measured.any()
           else {"measured_batch_max": int(np.flatnonzero(measured)[-1] + 1)}),
    }


def derive_envelope(
    fit: SurfaceFit,
    *,
    key: TableKey | str,
    version: int,
    max_k: int,
    max_batch: int,
    startup_k_values: Sequence[int],
    tolerance: float = DEFAULT_TOLERANCE,
    fewest_ranges: bool = True,
    merge_z: float | None = None,
    min_exploration_probability: float = DEFAULT_MIN_PROBABILITY,
    created_at: str | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> TableEnvelope:
    """The validated table envelope for batch sizes 1..max_batch from a fitted surface;
    `merge_z`: merge ranges where the fit cannot tell K apart (`indistinguishable`)."""
    if max_batch > fit.max_batch:
        raise ValueError(f"max_batch {max_batch} exceeds the fit's {fit.max_batch}")
    k_values = candidate_k_values(startup_k_values, max_k)
    batch_sizes = np.arange(1, max_batch + 1)
    surface = fit.evaluate(batch_sizes, k_values)
    decision = robust_goodput(surface)
    indistinct = _mergeable(surface, decision, merge_z, _served(fit, max_batch))
    measured = None if fit.measured_batch is None else fit.measured_batch[:max_batch]
    chosen = choose_k(decision, tolerance=tolerance, fewest_ranges=fewest_ranges,
                      latency=surface.latency_s, indistinct=indistinct, measured=measured)
    dense = [0, *(int(k) for k in k_values[chosen])]
    table = DraftTable.from_dense(dense).validate(int(k_values.max()), max_batch)
    predicted = surface.goodput_tok_s[np.arange(max_batch), chosen]
    grid_rows = surface_grid(max_batch) - 1
    envelope = TableEnvelope(
        key=key if isinstance(key, TableKey) else TableKey.parse(key),
        version=version,
        table=table,
        startup_k_values=tuple(sorted({int(k) for k in startup_k_values})),
        max_batch=max_batch,
        created_at=created_at or datetime.now(UTC).isoformat(timespec="seconds"),
        provenance={
            "fitter": FITTER_VERSION,
            "records": fit.n_records,
            "latency_cells": fit.n_latency_cells,
            "ts_min_ns": fit.ts_min_ns,
            "ts_max_ns": fit.ts_max_ns,
            "half_life_s": fit.half_life_s,
            "tolerance": tolerance,
            **({} if merge_z is None else {"merge_z": merge_z}),
            "max_k": max_k,
            **dict(provenance or {}),
        },
        predicted_goodput_tok_s=tuple(_round(g) for g in predicted),
        surface=surface_summary(surface, grid_rows, fit, measured),
        exploration=exploration_plan(surface, chosen, tolerance=tolerance,
                                     min_probability=min_exploration_probability),
    )
    return envelope.validate()


def fit_table(
    records: Records,
    *,
    key: TableKey | str,
    max_k: int,
    max_batch: int,
    startup_k_values: Sequence[int],
    version: int,
    tolerance: float = DEFAULT_TOLERANCE,
    fewest_ranges: bool = True,
    merge_z: float | None = None,
    half_life_s: float | None = DEFAULT_HALF_LIFE_S,
    now_ns: int | None = None,
    created_at: str | None = None,
    provenance: Mapping[str, Any] | None = None,
    budgets: bool = True,
    **fit_options: Any,
) -> TableEnvelope:
    """Fit the surface from a telemetry table and derive its table envelope in one call;
    with `budgets`, records that report n-gram match lengths add a per-request budget
    (`fitter.budget`).

    `fit_options` go to `fitter.surface.fit.fit_surface` (estimator templates, cell
    saturation, latency extrapolation error, dedupe, request context, steps since).
    """
    fit = fit_surface(records, max_k=max_k, max_batch=max_batch, half_life_s=half_life_s,
                      now_ns=now_ns, **fit_options)
    envelope = derive_envelope(fit, key=key, version=version, max_k=max_k,
                               max_batch=max_batch, startup_k_values=startup_k_values,
                               tolerance=tolerance, fewest_ranges=fewest_ranges,
                               merge_z=merge_z, created_at=created_at, provenance=provenance)
    return add_fitted_budget(envelope, fit, records, max_k=max_k) if budgets else envelope


def _mergeable(surface: GoodputSurface, decision: NDArray[np.float64], merge_z: float | None,
               served: NDArray[np.bool_] | None) -> NDArray[np.bool_] | None:
    """Cells that may take a row to save a range (`choose_k`'s `indistinct`): with
    `merge_z`, those the fit cannot tell from the row's best (`indistinguishable`); at
    batch sizes past the measured request count, instead, any K within `MAX_MERGE_LOSS` of
    the robust best (`decision`): they are not known to 1%, and the fit's own standard
    errors judge its own reading there, not the robust one. Served rows keep their argmax."""
    indistinct = None if merge_z is None else indistinguishable(surface, merge_z,
                                                                served=served)
    if surface.measured_requests is None:
        return indistinct
    rows = surface.batch_sizes > surface.measured_requests
    if not rows.any():
        return indistinct
    if served is not None:
        rows &= ~served
    near = decision >= (1.0 - MAX_MERGE_LOSS) * decision.max(axis=1, keepdims=True)
    unmeasured = near & rows[:, None]
    return unmeasured if indistinct is None else np.where(rows[:, None], unmeasured, indistinct)


def _served(fit: SurfaceFit, max_batch: int) -> NDArray[np.bool_] | None:
    """Batch sizes 1..max_batch that ran at least `SERVED_SHARE` of the fit's steps."""
    if fit.batch_share is None:
        return None
    return fit.batch_share[:max_batch] >= SERVED_SHARE


def _mixture(composition: CompositionModel) -> dict[str, list[float]]:
    """The arrival mixture's atoms (rates with a share of at least 0.1%), for a reader of
    the envelope: which kinds of request the fit thinks the traffic holds."""
    held = composition.arrival_share_ >= 1e-3
    return {"rates": _round_list(composition.rates_[held]),
            "arrival_share": _round_list(composition.arrival_share_[held])}


def _spread(test: RequestSpreadTest) -> dict[str, Any]:
    """What the request test saw, for a reader of the envelope: whether the per-request
    corrections were applied, and on how much evidence."""
    return {"requests": test.n_requests_, "dispersion": _round(test.dispersion_),
            "z": _round(test.z_), "identified": test.identified_}


def _round(value: float) -> float:
    """Six significant digits: the envelope is canonical JSON, so keep it short and finite."""
    number = float(value)
    if not np.isfinite(number):
        raise ValueError(f"refusing to publish a non-finite value {number!r}")
    return float(f"{number:.6g}")


def _round_list(values: NDArray[np.float64]) -> list[float]:
    return [_round(v) for v in np.asarray(values).reshape(-1)]


def _round_matrix(values: NDArray[np.float64]) -> list[list[float]]:
    return [_round_list(row) for row in values]
