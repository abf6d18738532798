"""Per-request sums of the decode steps of requests still running, by generation segment.

Fed once per step with the decoding requests (vectorised: the twin passes its batch arrays,
the vLLM hook a few small lists on the recorder's thread), it hands over a request's rows in
`schemas.step_record.REQUEST_SEGMENT_TYPE` when the request leaves the batch. Why the
fitter wants them: `schemas.step_record.REQUEST_SEGMENT_TYPE`.

Requests are integer ids held in a ring of slots (id modulo the ring), so a step costs a few
array additions and no per-request Python: a request id is unique per step and its slot too,
as long as fewer than `ring` newer requests start while it runs. One that outlives that
many has its slot taken and its sums restart (`slots_reused` counts it).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from schemas.step_record import REQUEST_SEGMENTS

_STEPS, _DRAFTING, _TOKENS, _CONTEXT = range(4)


_SEGMENT_OF = np.minimum(np.floor(np.log2(np.maximum(np.arange(1 << 16), 1))),
                         REQUEST_SEGMENTS - 1).astype(np.int64)
"""Segment per generated count (a lookup costs a fraction of a log2 per step); every count
past the table is in the last segment, as its last entry is."""


def generation_segment(generated: ArrayLike) -> np.ndarray:
    """Segment of a decode step that starts with `generated` tokens already generated."""
    counts = np.asarray(generated, dtype=np.int64)
    return _SEGMENT_OF[np.minimum(np.maximum(counts, 0), _SEGMENT_OF.size - 1)]


class RequestLedger:
    """Running sums per (request, segment) in a ring of `ring` slots (a power of two)."""

    def __init__(self, max_positions: int, ring: int = 4096) -> None:
        if ring < 1 or ring & (ring - 1):
            raise ValueError(f"ring={ring} must be a power of two")
        self.max_positions = max(int(max_positions), 1)
        self._mask = ring - 1
        self._owner = np.full(ring, -1, dtype=np.int64)
        # rows are (slot, segment) pairs, flattened; columns the four sums, then drafts
        # reached per position, then accepted per position: one fancy addition per step
        self._counts = np.zeros((ring * REQUEST_SEGMENTS, 4 + 2 * self.max_positions),
                                dtype=np.int64)
        positions = np.arange(self.max_positions)
        reached = np.arange(self.max_positions + 1)[:, None, None] > positions
        accepted = np.arange(self.max_positions + 1)[None, :, None] > positions
        self._position_rows = np.concatenate(np.broadcast_arrays(reached, accepted),
                                             axis=2).reshape(-1, 2 * self.max_positions)
        """One step's position counts (reached, then accepted, per position), at row
        reached * (max_positions + 1) + accepted."""
        self.slots_reused = 0

    def observe(self, requests: ArrayLike, *, generated: ArrayLike, drafted: ArrayLike,
                accepted: ArrayLike, emitted: ArrayLike, context: ArrayLike) -> None:
        """One step's decoding requests (distinct ids): tokens generated before the step,
        drafts verified (one value for all, or one each), drafts accepted, tokens emitted
        and context (KV tokens)."""
        ids = np.asarray(requests, dtype=np.int64)
        if ids.size == 0:
            return
        slots = ids & self._mask
        stale = self._owner[slots] != ids
        if stale.any():
            taken = slots[stale & (self._owner[slots] >= 0)]
            self.slots_reused += int(taken.size)
            self._clear(slots[stale])
            self._owner[slots[stale]] = ids[stale]
        rows = slots * REQUEST_SEGMENTS + generation_segment(generated)
        width = self.max_positions
        drafted = np.minimum(np.asarray(drafted, dtype=np.int64), width)
        accepted = np.minimum(np.asarray(accepted, dtype=np.int64), drafted)
        step = np.empty((ids.size, 4 + 2 * width), dtype=np.int64)
        step[:, _STEPS] = 1
        step[:, _DRAFTING] = drafted > 0
        step[:, _TOKENS] = emitted
        step[:, _CONTEXT] = context
        reached = np.minimum(accepted + 1, drafted)
        step[:, 4:] = self._position_rows[reached * (width + 1) + accepted]
        self._counts[rows] += step

    def finish(self, requests: ArrayLike) -> list[dict[str, object]]:
        """Rows of the requests that left the batch, numbered in the order given (one that
        never decoded has none, and no number); their slots are freed."""
        rows: list[dict[str, object]] = []
        number = 0
        for request in np.asarray(requests, dtype=np.int64).reshape(-1):
            slot = int(request) & self._mask
            if self._owner[slot] != request:
                continue
            first = slot * REQUEST_SEGMENTS
            counts = self._counts[first:first + REQUEST_SEGMENTS]
            width = self.max_positions
            for segment in np.flatnonzero(counts[:, _STEPS]).tolist():
                values = counts[segment].tolist()
                rows.append({
                    "request": number, "segment": segment, "decode_steps": values[_STEPS],
                    "drafting_steps": values[_DRAFTING], "tokens": values[_TOKENS],
                    "context_tokens": values[_CONTEXT],
                    "reached_per_pos": values[4:4 + width],
                    "accepted_per_pos": values[4 + width:],
                })
            number += 1
            self._clear(np.array([slot]))
        return rows

    def discard(self, requests: ArrayLike) -> None:
        """Forget requests without rows (aborted ones: what they would have needed is
        unknown)."""
        ids = np.asarray(requests, dtype=np.int64).reshape(-1)
        slots = ids & self._mask
        self._clear(slots[self._owner[slots] == ids])

    def _clear(self, slots: np.ndarray) -> None:
        self._owner[slots] = -1
        rows = (slots[:, None] * REQUEST_SEGMENTS + np.arange(REQUEST_SEGMENTS)).reshape(-1)
        self._counts[rows] = 0
