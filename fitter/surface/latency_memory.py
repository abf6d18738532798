"""What a key's steps took, remembered across fits: latency does not move when traffic does.

A fit window holds the last minutes of one load. The step time at a batch size, a K and a
context is the engine's, not the traffic's, so a load that returns to a batch size measured
ten minutes ago needs no new measurement of it: its latency cells are kept here and the
latency model fits them beside the window's own (`fitter.surface.fit.fit_surface`). The
acceptance model never sees them, since acceptance is the traffic's and moves with it.

Cells are the latency model's own aggregates (`fitter.surface.telemetry.latency_cells`,
without recency weights): per (decode requests, K, next K, prefill requests, prefill
bucket, KV bucket), the median step time and the step count. A cell measured again is
replaced by the newer measurement. The memory is forgotten only on evidence that the
latency itself moved (the control loop's call: a latency drift at a measured load).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from fitter.records import Records
from fitter.surface.latency import LATENCY_COLUMNS
from fitter.surface.telemetry import (
    KV_BUCKETS_PER_OCTAVE,
    PREFILL_BUCKETS_PER_OCTAVE,
    latency_cells,
    to_frame,
)

MAX_CELLS = 20_000
"""Cells kept at most, the oldest dropped first: a key that ran every batch size to 256 at 8
K values, a few contexts each, fills a few thousand; this bounds a memory that a long run of
drifting contexts would otherwise grow without end (20,000 rows of 9 floats: 1.4 MB)."""

_DECODE, _K, _K_NEXT, _PREFILL_TOKENS, _PREFILL_REQS, _KV = range(6)


@dataclass(frozen=True, slots=True)
class LatencyCells:
    """Latency cells: X (`LATENCY_COLUMNS`), the median step time (s), the step count and
    the telemetry time (ns) of the newest step that measured each."""

    X: NDArray[np.float64]
    y: NDArray[np.float64]
    weight: NDArray[np.float64]
    ts_ns: NDArray[np.int64]

    @classmethod
    def empty(cls) -> LatencyCells:
        return cls(np.zeros((0, len(LATENCY_COLUMNS))), np.zeros(0), np.zeros(0),
                   np.zeros(0, dtype=np.int64))

    @classmethod
    def from_records(cls, records: Records) -> LatencyCells:
        """The cells of `records`' steps, each step counted once (no recency weight)."""
        frame = to_frame(records)
        X, y, weight = latency_cells(frame, np.ones(frame.height), None)
        newest = int(frame["ts_ns"].max())  # type: ignore[arg-type]
        return cls(X, y, weight, np.full(y.size, newest, dtype=np.int64))

    def __len__(self) -> int:
        return int(self.y.size)

    def keys(self) -> NDArray[np.int64]:
        """One integer per cell: the bucketed shape the cell stands for."""
        return cell_keys(self.X)

    def select(self, mask: NDArray[np.bool_]) -> LatencyCells:
        return LatencyCells(self.X[mask], self.y[mask], self.weight[mask], self.ts_ns[mask])

    def without(self, keys: NDArray[np.int64]) -> LatencyCells:
        """These cells less the ones whose shape is in `keys` (measured anew elsewhere)."""
        return self.select(~np.isin(self.keys(), keys))

    def merged(self, newer: LatencyCells, max_cells: int = MAX_CELLS) -> LatencyCells:
        """These cells with `newer`'s: a shape in both takes `newer`'s; past `max_cells`
        the least recently measured go."""
        kept = self.without(newer.keys())
        cells = LatencyCells(np.vstack([kept.X, newer.X]), np.concatenate([kept.y, newer.y]),
                             np.concatenate([kept.weight, newer.weight]),
                             np.concatenate([kept.ts_ns, newer.ts_ns]))
        if len(cells) <= max_cells:
            return cells
        order = np.argsort(cells.ts_ns, kind="stable")[-max_cells:]
        return cells.select(np.isin(np.arange(len(cells)), order))

    def batch_sizes(self) -> NDArray[np.float64]:
        """Each cell's batch size: its decode plus prefill requests."""
        return self.X[:, _DECODE] + self.X[:, _PREFILL_REQS]

    def batch_range(self) -> tuple[int, int] | None:
        """The smallest and largest batch size measured."""
        if not len(self):
            return None
        batch = self.batch_sizes()
        return int(batch.min()), int(batch.max())


def cell_keys(X: NDArray[np.float64]) -> NDArray[np.int64]:
    """The cell of each row of X, as `latency_cells` buckets it (one int64 per row)."""
    pf = np.round(np.log2(X[:, _PREFILL_TOKENS] + 1.0) * PREFILL_BUCKETS_PER_OCTAVE)
    kv = np.round(np.log2(X[:, _KV] + 1.0) * KV_BUCKETS_PER_OCTAVE)
    parts = (X[:, _DECODE], X[:, _K], X[:, _K_NEXT], X[:, _PREFILL_REQS], pf, kv)
    key = np.zeros(X.shape[0], dtype=np.int64)
    for part in parts:  # 10 bits each: counts to 1,023, buckets to 512 octaves
        key = (key << 10) | np.clip(part, 0, 1023).astype(np.int64)
    return key
