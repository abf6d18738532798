"""Step times at the machine's steady speed: a shared slowness taken out before a fit.

A CPU server does not run at one speed. On a 2-core host every step ran 15-45% slower for
1-12 s at a time, whatever the K. A one-engine key's probe measures each K in a block of a
few seconds with the table's own steps on both sides, so a spell that falls on the probed
K's block falls on the table's steps beside it too. Fitted as they came, the probed K
carries the spell alone: a probe at 16 requests read K1 at 62 ms a step where K1's servers
ran 48-54 ms, and kept K2, 5% slower than K1.

The table's own steady steps (unforced, no prefill, the K it verifies the K it drafts) are
the reference: each is timed against the median of its batch size and K over the records,
and the machine's speed at any moment is the median of those ratios within `SPEED_SPAN_S`.
Every step's time is divided by it. Where fewer than `MIN_REFERENCE_STEPS` reference steps
lie that close, the step is left as measured.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

SPEED_SPAN_S = 2.0
"""Reference steps this close (either side) time a step: the middle of a probe's 3 s block
still reaches half a second of the table's steps on each side, and a spell (1-12 s) is
longer than the span."""

MIN_REFERENCE_STEPS = 3
"""Fewer reference steps than this within the span say nothing about the speed: one step's
own noise (a request's arrival, a page of KV) would be taken for the machine's."""


def speed_index(records: pa.Table, span_s: float = SPEED_SPAN_S) -> NDArray[np.float64]:
    """Per record, the machine's speed at its step relative to the records' own median (1.0:
    as usual; 1.2: every step 20% slower); 1.0 where too few reference steps lie near."""
    seconds = records.column("ts_ns").to_numpy().astype(np.float64) / 1e9
    latency = records.column("step_latency_s").to_numpy().astype(np.float64)
    forced = records.column("forced").to_numpy(zero_copy_only=False).astype(bool)
    k = records.column("k").to_numpy().astype(np.int64)
    steady = (~forced & (records.column("num_prefill_reqs").to_numpy() == 0)
              & (k == records.column("k_next").to_numpy()) & (latency > 0))
    cell = records.column("batch_size").to_numpy().astype(np.int64) * 1000 + k
    reference = np.flatnonzero(steady)
    ratios = np.empty(reference.size)
    for value in np.unique(cell[reference]):
        members = cell[reference] == value
        ratios[members] = latency[reference[members]] / np.median(latency[reference[members]])
    order = np.argsort(seconds[reference], kind="stable")
    times, ratios = seconds[reference][order], ratios[order]
    first = np.searchsorted(times, seconds - span_s, side="left")
    last = np.searchsorted(times, seconds + span_s, side="right")
    speed = np.ones(records.num_rows)
    for row in np.flatnonzero(last - first >= MIN_REFERENCE_STEPS):
        speed[row] = np.median(ratios[first[row]:last[row]])
    return speed


def at_steady_speed(records: pa.Table, span_s: float = SPEED_SPAN_S) -> pa.Table:
    """`records` with each step time divided by the machine's speed at its step
    (`speed_index`): what each K costs with the machine's wander taken out."""
    if records.num_rows == 0:
        return records
    latency = records.column("step_latency_s").to_numpy().astype(np.float64)
    steady = latency / speed_index(records, span_s)
    at = records.schema.get_field_index("step_latency_s")
    column = pa.array(steady, type=records.schema.field(at).type)
    return records.set_column(at, records.schema.field(at), column)
