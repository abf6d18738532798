"""Per step, acceptance by the length of the n-gram each request's draft came from.

A step record's `by_match_length` column (`schemas.step_record.MATCH_LENGTH_TYPE`): for each
match length among the step's decode requests, how many there were, the drafts they
verified, and per draft position how many drafts reached it and how many accepted it.
Reached-and-accepted counts per request, not per step, keep it censoring-aware when the
requests of one step draft different lengths (a budget gives each length its own K).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from schemas.step_record import MATCH_LENGTH_TYPE

_ROW_FIXED = 3
"""match_length, requests, draft_tokens; then reached and accepted per position."""


def match_length_rows(match_length: NDArray[np.integer], drafts: NDArray[np.integer],
                      accepted: NDArray[np.integer], max_positions: int) -> np.ndarray:
    """One row per match length present: (length, requests, draft tokens, reached per
    position, accepted per position), from each decode request's match length, drafts
    verified and drafts accepted this step. Positions past `max_positions` are not kept."""
    width = max(int(max_positions), 1)
    lengths, inverse = np.unique(np.asarray(match_length), return_inverse=True)
    rows = np.zeros((len(lengths), _ROW_FIXED + 2 * width), dtype=np.int64)
    if not len(lengths):
        return rows
    drafted = np.asarray(drafts, dtype=np.int64)
    took = np.minimum(np.asarray(accepted, dtype=np.int64), drafted)
    positions = np.arange(width)
    reached = (drafted[:, None] > positions) & (took[:, None] >= positions)
    accepted_at = (drafted[:, None] > positions) & (took[:, None] > positions)
    rows[:, 0] = lengths
    rows[:, 1] = np.bincount(inverse, minlength=len(lengths))
    rows[:, 2] = np.bincount(inverse, weights=drafted, minlength=len(lengths))
    for row in range(len(lengths)):
        mine = inverse == row
        rows[row, _ROW_FIXED:_ROW_FIXED + width] = reached[mine].sum(axis=0)
        rows[row, _ROW_FIXED + width:] = accepted_at[mine].sum(axis=0)
    return rows


def match_lengths_to_arrow(steps: Sequence[np.ndarray | tuple[()]],
                           max_positions: int) -> pa.ListArray:
    """The `by_match_length` column of a frame from each step's `match_length_rows`."""
    width = max(int(max_positions), 1)
    counts = np.array([len(rows) for rows in steps], dtype=np.int32)
    offsets = np.zeros(len(steps) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    flat = (np.concatenate([rows for rows in steps if len(rows)]) if offsets[-1]
            else np.zeros((0, _ROW_FIXED + 2 * width), dtype=np.int64))
    if flat.shape[1] != _ROW_FIXED + 2 * width:
        raise ValueError(f"rows have {flat.shape[1]} columns, expected {_ROW_FIXED + 2 * width}")
    per_pos = np.arange(flat.shape[0] + 1, dtype=np.int32) * width

    def positions(first: int) -> pa.ListArray:
        values = pa.array(flat[:, first:first + width].reshape(-1).astype(np.int32))
        return pa.ListArray.from_arrays(pa.array(per_pos), values)

    fields = list(MATCH_LENGTH_TYPE)
    fixed = [pa.array(flat[:, i], type=field.type) for i, field in enumerate(fields[:_ROW_FIXED])]
    struct = pa.StructArray.from_arrays(
        [*fixed, positions(_ROW_FIXED), positions(_ROW_FIXED + width)], fields=fields)
    return pa.ListArray.from_arrays(pa.array(offsets), struct)
