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

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
from numpy.typing import ArrayLike

from schemas.step_record import REQUEST_SEGMENT_TYPE, REQUEST_SEGMENTS

_STEPS, _DRAFTING, _TOKENS, _CONTEXT = range(4)
_ROW_FIXED = 6
"""Columns of a finished row before the position counts: request, segment, the four sums."""


_SEGMENT_OF = np.minimum(np.floor(np.log2(np.maximum(np.arange(1 << 16), 1))),
                         REQUEST_SEGMENTS - 1).astype(np.int64)
"""Segment per generated count (a lookup costs a fraction of a log2 per step); every count
past the table is in the last segment, as its last entry is."""


def generation_segment(generated: ArrayLike) -> np.ndarray:
    """Segment of a decode step that starts with `generated` tokens already generated."""
    counts = np.asarray(generated, dtype=np.int64)
    return _SEGMENT_OF[np.minimum(counts, _SEGMENT_OF.size - 1)]  # counts are >= 0


def to_arrow(steps: Sequence[np.ndarray | tuple[()]], max_positions: int) -> pa.ListArray:
    """The `finished_requests` column of a frame from each step's `RequestLedger.finish`
    rows (built from flat columns: a frame holds thousands of rows)."""
    counts = np.array([len(rows) for rows in steps], dtype=np.int32)
    offsets = np.zeros(len(steps) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    width = _ROW_FIXED + 2 * max_positions
    flat = (np.concatenate([rows for rows in steps if len(rows)]) if offsets[-1]
            else np.zeros((0, width), dtype=np.int64))
    if flat.shape[1] != width:
        raise ValueError(f"rows have {flat.shape[1]} columns, expected {width}")
    per_pos = np.arange(flat.shape[0] + 1, dtype=np.int32) * max_positions

    def positions(first: int) -> pa.ListArray:
        values = pa.array(flat[:, first:first + max_positions].reshape(-1).astype(np.int32))
        return pa.ListArray.from_arrays(pa.array(per_pos), values)

    fields = list(REQUEST_SEGMENT_TYPE)  # request, segment, the four sums, the two lists
    sums = [pa.array(flat[:, i], type=field.type) for i, field in enumerate(fields[:_ROW_FIXED])]
    struct = pa.StructArray.from_arrays(
        [*sums, positions(_ROW_FIXED), positions(_ROW_FIXED + max_positions)], fields=fields)
    return pa.ListArray.from_arrays(pa.array(offsets), struct)


class RequestLedger:
    """Running sums per (request, segment) in a ring of `ring` slots (a power of two).

    A step's counts but tokens and context depend only on (drafts, accepted), so they are
    kept as a histogram of those pairs per (slot, segment) and turned into counts when the
    request finishes: a step costs three one-dimensional additions."""

    def __init__(self, max_positions: int, ring: int = 4096) -> None:
        if ring < 1 or ring & (ring - 1):
            raise ValueError(f"ring={ring} must be a power of two")
        self.max_positions = max(int(max_positions), 1)
        self.ring = ring
        self._mask = ring - 1
        self._owner = np.full(ring, -1, dtype=np.int64)
        width = self.max_positions
        reached = np.arange(width + 1)[:, None, None] > np.arange(width)
        accepted = np.arange(width + 1)[None, :, None] > np.arange(width)
        steps = np.broadcast_to(np.array([1, 0, 0, 0]), (width + 1, width + 1, 4)).copy()
        steps[1:, :, _DRAFTING] = 1  # a draft reached position 1 iff the request drafted
        by_reached = np.concatenate([steps, *np.broadcast_arrays(reached, accepted)],
                                    axis=2).astype(np.int64)  # [reached, accepted]
        drafts, accepted = np.arange(width + 1)[:, None], np.arange(width + 1)[None, :]
        step_rows = by_reached[np.minimum(accepted + 1, drafts), accepted]
        """One step's counts but tokens and context, at [drafts, accepted] (drafts reach
        position i when all before it were accepted)."""
        # the (drafts, accepted <= drafts) pairs, numbered: a histogram bin each
        pairs = np.flatnonzero((accepted <= drafts).reshape(-1))
        self._pairs = len(pairs)
        self._pair_of = np.zeros((width + 1) * (width + 1), dtype=np.int64)
        self._pair_of[pairs] = np.arange(self._pairs)
        self._pair_of = self._pair_of.reshape(width + 1, width + 1)
        """[drafts, accepted] -> histogram bin (accepted <= drafts)."""
        self._pair_rows = step_rows.reshape(-1, step_rows.shape[-1])[pairs]
        """Per histogram bin, the counts of one step."""
        cells = ring * REQUEST_SEGMENTS  # (slot, segment) pairs, flattened
        self._hist = np.zeros(cells * self._pairs, dtype=np.int32)
        self._tokens = np.zeros(cells, dtype=np.int64)
        self._context = np.zeros(cells, dtype=np.int64)
        self._no_rows = np.zeros((0, _ROW_FIXED + 2 * self.max_positions), dtype=np.int64)
        self.slots_reused = 0

    def observe(self, requests: ArrayLike, *, generated: ArrayLike, drafted: ArrayLike,
                accepted: ArrayLike, emitted: ArrayLike, context: ArrayLike) -> None:
        """One step's decoding requests (distinct ids): tokens generated before the step,
        drafts verified (one value for all, or one each), drafts accepted, tokens emitted
        and context (KV tokens)."""
        ids = np.asarray(requests, dtype=np.int64)
        if ids.size == 0:
            return
        slots, shared = self._own(ids)
        cells = slots * REQUEST_SEGMENTS + generation_segment(generated)
        if np.ndim(drafted) == 0:  # one draft length for all: one row of the bins
            reach = min(int(drafted), self.max_positions)
            bins = self._pair_of[reach].take(np.minimum(accepted, reach))
        else:
            drafted = np.minimum(drafted, self.max_positions)
            bins = self._pair_of[drafted, np.minimum(accepted, drafted)]
        keys = cells * self._pairs + bins
        if shared:  # two requests in one slot (one outlived `ring` newer ones): where they
            # share a cell, the last one's step counts, as for the sums below
            _, last = np.unique(cells[::-1], return_index=True)
            keys = keys[cells.size - 1 - last]
        self._hist[keys] += 1
        self._tokens[cells] += emitted
        self._context[cells] += context

    def observe_steps(self, requests: ArrayLike, *, generated: np.ndarray, drafted: int,
                      accepted: np.ndarray, emitted: np.ndarray, context: np.ndarray) -> None:
        """Consecutive steps of the same decoding requests, all verifying `drafted` drafts:
        row s of each (steps, requests) array is one step, as `observe` takes it. The same
        sums as one `observe` per row (the twin's runs of decode-only steps)."""
        ids = np.asarray(requests, dtype=np.int64)
        if ids.size == 0 or len(generated) == 0:
            return
        slots = ids & self._mask
        if (self._owner.take(slots) != ids).any() and np.unique(slots).size < slots.size:
            for step in range(len(generated)):  # requests sharing a slot: step by step
                self.observe(ids, generated=generated[step], drafted=drafted,
                             accepted=accepted[step], emitted=emitted[step],
                             context=context[step])
            return
        cells = generation_segment(generated)
        cells += self._own(ids)[0] * REQUEST_SEGMENTS
        self._add(cells.reshape(-1), drafted, accepted, emitted, context)

    def observe_flat(self, requests: ArrayLike, *, generated: ArrayLike, drafted: int,
                     accepted: ArrayLike, emitted: ArrayLike, context: ArrayLike) -> None:
        """Decode steps one per element, of requests that may repeat, all verifying `drafted`
        drafts: the same sums as one `observe` per step. The requests must not share a slot
        (their ids are less than `ring` apart), as the order of their steps is not given."""
        ids = np.asarray(requests, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            return
        distinct = np.unique(ids)
        if np.unique(distinct & self._mask).size < distinct.size:
            raise ValueError("observe_flat: requests share a slot; observe them step by step")
        self._own(distinct)
        cells = generation_segment(np.asarray(generated).reshape(-1))
        cells += (ids & self._mask) * REQUEST_SEGMENTS
        self._add(cells, drafted, accepted, emitted, context)

    def _add(self, cells: np.ndarray, drafted: int, accepted: ArrayLike, emitted: ArrayLike,
             context: ArrayLike) -> None:
        """Steps at flat `cells` (which may repeat), all verifying `drafted` drafts."""
        reach = min(int(drafted), self.max_positions)
        keys = cells * self._pairs
        keys += self._pair_of[reach].take(np.minimum(accepted, reach).reshape(-1))
        # a request's cell repeats from step to step: unbuffered additions (flat, and values
        # of the array's type: np.add.at's fast path)
        np.add.at(self._hist, keys, np.ones(keys.size, dtype=self._hist.dtype))
        np.add.at(self._tokens, cells, np.asarray(emitted, dtype=np.int64).reshape(-1))
        np.add.at(self._context, cells, np.asarray(context, dtype=np.int64).reshape(-1))

    def finish(self, requests: ArrayLike) -> np.ndarray:
        """Rows of the requests that left the batch, numbered in the order given (one that
        never decoded has none, and no number); their slots are freed. Columns: request,
        segment, then this ledger's counts (`to_arrow` turns steps' rows into the column)."""
        ids = np.asarray(requests, dtype=np.int64).reshape(-1)
        slots = ids & self._mask
        slots = slots[self._owner.take(slots) == ids]
        if slots.size == 0:
            return self._no_rows
        cells = slots[:, None] * REQUEST_SEGMENTS + np.arange(REQUEST_SEGMENTS)
        hist = self._hist.reshape(-1, self._pairs)[cells]  # (requests, segments, bins)
        request, segment = np.nonzero(hist.any(axis=2))
        counts = hist[request, segment].astype(np.int64) @ self._pair_rows
        held = cells[request, segment]
        counts[:, _TOKENS] = self._tokens[held]
        counts[:, _CONTEXT] = self._context[held]
        rows = np.column_stack((request, segment, counts))
        self._clear(slots)
        return rows

    def discard(self, requests: ArrayLike) -> None:
        """Forget requests without rows (aborted ones: what they would have needed is
        unknown)."""
        ids = np.asarray(requests, dtype=np.int64).reshape(-1)
        slots = ids & self._mask
        self._clear(slots[self._owner[slots] == ids])

    def _own(self, ids: np.ndarray) -> tuple[np.ndarray, bool]:
        """The requests' slots, taken over where another request held them (its sums
        restart; a free slot is already clear), and whether two of them share a slot."""
        slots = ids & self._mask
        owners = self._owner.take(slots)
        stale = owners != ids
        if not stale.any():
            return slots, False
        taken = slots[stale & (owners >= 0)]
        if taken.size:
            self.slots_reused += int(taken.size)
            self._clear(taken)
        self._owner[slots[stale]] = ids[stale]
        return slots, bool((self._owner.take(slots) != ids).any())

    def _clear(self, slots: np.ndarray) -> None:
        self._owner[slots] = -1
        cells = (slots[:, None] * REQUEST_SEGMENTS + np.arange(REQUEST_SEGMENTS)).reshape(-1)
        self._hist.reshape(-1, self._pairs)[cells] = 0
        self._tokens[cells] = 0
        self._context[cells] = 0
