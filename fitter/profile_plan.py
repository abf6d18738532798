"""Which (concurrency, forced K) cell a profile sweep measures next.

A full grid (9 load levels x 8 K values) at a few seconds per cell would take the whole
default budget just to visit each cell once, and most cells are useless: at 256 concurrent
requests nobody needs to know K=7 precisely, only that it loses. The planner therefore
starts from a tiny seed design that makes both models identifiable (every draft position at
the top K, the latency floor at K=0, a middle point) and then, after every cell, refits the
surface and measures where the *argmax* is most uncertain: the cell whose K could beat the
currently chosen K at its load by the largest expected margin (`expected_gain`), or the
chosen cell itself when it is the less certain side of that comparison. Measuring one side
of a close comparison is what moves the decision; cells already known to lose are skipped.

The planner is pure: it sees a fitted surface and the visit counts, it never touches an
engine, so the twin driver and the OpenAI client driver share it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fitter.surface.fit import SurfaceFit

DEFAULT_CONCURRENCIES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
COVERAGE_BONUS = 0.002
"""Score added to an unvisited cell next to a load's chosen K: the delta method only knows
the latency model's parameter noise, not its misfit, so the cells that decide the table are
measured directly at least once (0.2% in log goodput, the derivation's minimum worth)."""


@dataclass(frozen=True, slots=True, order=True)
class Cell:
    """One design point: closed-loop concurrency and the K forced for every batch size."""

    concurrency: int
    k: int


@dataclass(frozen=True, slots=True)
class CellScore:
    """Why a cell was picked (for the progress display and the envelope's provenance)."""

    cell: Cell
    score: float
    """Expected gain in log goodput of resolving this cell (plus the coverage bonus)."""
    chosen_k: int
    """The K the current fit picks at this load."""


def concurrency_levels(max_batch: int,
                       levels: Sequence[int] = DEFAULT_CONCURRENCIES) -> tuple[int, ...]:
    """The load levels a profile may use: powers of two up to the engine's max batch."""
    kept = sorted({min(int(c), max_batch) for c in levels if int(c) >= 1})
    if not kept:
        raise ValueError(f"no concurrency level in {list(levels)} is >= 1")
    return tuple(kept)


def seed_design(concurrencies: Sequence[int], k_values: Sequence[int]) -> list[Cell]:
    """Three cells that make a first fit possible, in the order to run them.

    Top K at a middle load shows acceptance at every draft position with many drafts per
    second; K=0 at the top load pins the latency floor where batched tokens are largest;
    a middle K at a low load spans the rest of the latency model's range.
    """
    loads = sorted(set(concurrencies))
    ks = sorted(set(k_values))
    if not loads or not ks:
        raise ValueError("a profile needs at least one concurrency and one K")
    middle_load = loads[len(loads) // 2]
    low_load = loads[max(0, len(loads) // 4)]
    cells = [Cell(middle_load, ks[-1]), Cell(loads[-1], ks[0]), Cell(low_load, ks[len(ks) // 2])]
    unique: list[Cell] = []
    for cell in cells:
        if cell not in unique:
            unique.append(cell)
    return unique


def score_cells(fit: SurfaceFit, concurrencies: Sequence[int], k_values: Sequence[int],
                visits: Mapping[Cell, int], *,
                coverage_bonus: float = COVERAGE_BONUS) -> list[CellScore]:
    """Every cell's value of measurement under the current fit, best first."""
    loads = np.asarray(sorted(set(concurrencies)), dtype=np.int64)
    ks = np.asarray(sorted(set(k_values)), dtype=np.int64)
    surface = fit.evaluate(np.minimum(loads, fit.max_batch), ks)
    chosen = surface.goodput_tok_s.argmax(axis=1)
    gain = surface.expected_gain(chosen)
    relative_sd = surface.goodput_std_tok_s / surface.goodput_tok_s
    scores: dict[Cell, float] = {}
    for row, load in enumerate(loads):
        best = int(chosen[row])
        for col in range(ks.size):
            if col == best:
                continue
            # Resolve the comparison on its less certain side.
            side = col if relative_sd[row, col] >= relative_sd[row, best] else best
            cell = Cell(int(load), int(ks[side]))
            scores[cell] = max(scores.get(cell, 0.0), float(gain[row, col]))
        for col in range(max(0, best - 1), min(ks.size, best + 2)):
            cell = Cell(int(load), int(ks[col]))
            if visits.get(cell, 0) == 0:
                scores[cell] = scores.get(cell, 0.0) + coverage_bonus
    ranked = [
        CellScore(cell, score / (1.0 + visits.get(cell, 0)),
                  int(ks[chosen[int(np.flatnonzero(loads == cell.concurrency)[0])]]))
        for cell, score in scores.items()
    ]
    ranked.sort(key=lambda s: (-s.score, s.cell))
    return ranked


def next_cell(fit: SurfaceFit | None, concurrencies: Sequence[int], k_values: Sequence[int],
              visits: Mapping[Cell, int]) -> CellScore:
    """The seed design first (while it has unvisited cells or no fit exists), then the
    highest-scoring cell. Repeat visits are discounted by 1/(1 + visits) so that a cell whose
    score stays high for model-misfit reasons cannot take the whole budget."""
    for cell in seed_design(concurrencies, k_values):
        if visits.get(cell, 0) == 0:
            return CellScore(cell, float("inf"), cell.k)
    if fit is None:
        cell = seed_design(concurrencies, k_values)[0]
        return CellScore(cell, float("inf"), cell.k)
    ranked = score_cells(fit, concurrencies, k_values, visits)
    if not ranked:  # a single K: nothing to decide, spread over loads
        k = int(min(k_values))
        cell = min((Cell(c, k) for c in concurrencies), key=lambda c: visits.get(c, 0))
        return CellScore(cell, 0.0, k)
    return ranked[0]
