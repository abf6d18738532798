"""Drive a profile sweep on the twin: set the load, force K through the table switch, refit.

The twin runs on virtual time, so the whole sweep is one engine run whose policy is the
profiler: at the end of every cell it hands the recorded steps to the fit (virtual time
stands still meanwhile, as it would not on a real engine), asks the planner for the next
cell, sets the closed-loop concurrency and stages a forced table. Records go through the
engine's own recorder, so they carry `forced=True` exactly as a real engine's would, and can
be teed to any sink (Kafka, files) for the rest of the pipeline to see.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from fitter.profile_plan import Cell, CellScore, next_cell
from fitter.surface.fit import SurfaceFit, fit_surface
from producers.recorder import Sink
from schemas import DraftTable
from schemas.step_record import STEP_RECORD_SCHEMA
from twin.config import PhaseConfig, Scenario
from twin.policies import Policy
from twin.run import build_engine

if TYPE_CHECKING:
    from twin.engine import StepStats, TwinEngine

log = logging.getLogger(__name__)

CHECK_EVERY_STEPS = 8
"""How often the profiler looks at the clock: a cell overshoots by at most 8 steps."""


class MemorySink:
    """Keeps every frame in memory for the fit and passes it on to an optional sink."""

    def __init__(self, downstream: Sink | None = None) -> None:
        self.downstream = downstream
        self.tables: list[pa.Table] = []

    def write(self, records: pa.Table) -> None:
        # The recorder reuses its column buffers once write() returns and its tables are
        # zero-copy views of them: keep a copy, never the table handed in.
        self.tables.append(records.take(pa.array(np.arange(records.num_rows))))
        if self.downstream is not None:
            self.downstream.write(records)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self.downstream.flush(timeout_s) if self.downstream is not None else True

    def close(self, timeout_s: float = 5.0) -> None:
        if self.downstream is not None:
            self.downstream.close(timeout_s)

    def counters(self) -> dict[str, int]:
        own = {"frames": len(self.tables), "records": sum(t.num_rows for t in self.tables)}
        return {**own, **(self.downstream.counters() if self.downstream is not None else {})}

    def table(self) -> pa.Table:
        if not self.tables:
            return STEP_RECORD_SCHEMA.empty_table()
        return pa.concat_tables(self.tables)


@dataclasses.dataclass(frozen=True, slots=True)
class CellRun:
    """One measured cell: what was forced, when, and why it was chosen."""

    cell: Cell
    start_s: float
    end_s: float
    score: float
    chosen_k: int

    def to_dict(self) -> dict[str, Any]:
        return {"concurrency": self.cell.concurrency, "k": self.cell.k,
                "start_s": round(self.start_s, 3), "end_s": round(self.end_s, 3),
                "score": None if self.score == float("inf") else round(self.score, 6),
                "chosen_k": self.chosen_k}


ProgressCallback = Callable[[float, CellRun], None]
"""(engine seconds used so far, the cell now running)."""


class ProfilePolicy(Policy):
    """The profiler as a twin policy: one cell after another until the engine run ends."""

    name = "profile"
    step_interval = CHECK_EVERY_STEPS

    def __init__(self, *, k_values: tuple[int, ...], concurrencies: tuple[int, ...],
                 cell_s: float, max_k: int, fit_max_k: int,
                 on_progress: ProgressCallback | None = None) -> None:
        self.k_values = k_values
        self.concurrencies = concurrencies
        self.cell_s = cell_s
        self.max_k = max_k
        self.fit_max_k = fit_max_k
        self.on_progress = on_progress
        self.visits: Counter[Cell] = Counter()
        self.cells: list[CellRun] = []
        self.fit: SurfaceFit | None = None
        self.fit_failures = 0
        self.memory: MemorySink | None = None
        self._cell_end_s = 0.0
        self._phase: PhaseConfig | None = None

    def initial_table(self, *, max_k: int, max_batch: int) -> tuple[DraftTable, int]:
        return DraftTable.from_vllm([[1, max_batch, 0]]), 0

    def start(self, engine: TwinEngine) -> None:
        self._phase = engine.traffic.phases[0]
        self._begin(engine, next_cell(None, self.concurrencies, self.k_values, self.visits))

    def on_step(self, engine: TwinEngine, step: StepStats) -> None:
        if engine.clock_s < self._cell_end_s:
            return
        self._finish_cell(engine)
        self._refit(engine)
        self._begin(engine, next_cell(self.fit, self.concurrencies, self.k_values, self.visits))

    def _begin(self, engine: TwinEngine, pick: CellScore) -> None:
        cell = pick.cell
        assert self._phase is not None
        # The load is the profiler's: a closed loop at the cell's concurrency (the scenario
        # only supplies the workload). Lowering it aborts the surplus, as a load client
        # closing connections would: left to drain, the survivors would fill the cell with a
        # shrinking batch of the longest requests, whose acceptance is nothing like the mix's.
        engine.traffic.set_phases((dataclasses.replace(
            self._phase, concurrency=cell.concurrency, rate_rps=None),), engine.clock_s)
        surplus = engine.batch.n + len(engine.waiting) - cell.concurrency
        if surplus > 0:
            engine.abort(surplus)
        table = DraftTable.from_vllm([[1, engine.switch.max_batch, cell.k]])
        engine.switch.stage(table, 0, forced=True)
        start = engine.clock_s
        self._cell_end_s = start + self.cell_s
        self.cells.append(CellRun(cell, start, start, pick.score, pick.chosen_k))
        self.visits[cell] += 1
        if self.on_progress is not None:
            self.on_progress(start, self.cells[-1])

    def _finish_cell(self, engine: TwinEngine) -> None:
        last = self.cells[-1]
        self.cells[-1] = dataclasses.replace(last, end_s=engine.clock_s)

    def _refit(self, engine: TwinEngine) -> None:
        if engine.recorder is None or self.memory is None:
            return
        engine.recorder.flush(timeout_s=30.0)
        try:
            self.fit = fit_surface(self.memory.table(), max_k=self.fit_max_k,
                                   max_batch=engine.switch.max_batch, half_life_s=None)
        except ValueError as exc:  # too little data for a fit yet: keep the seed design going
            self.fit_failures += 1
            log.info("profile refit skipped: %s", exc)

    def finish(self, engine: TwinEngine) -> None:
        """Close the last cell's record after the engine run ended."""
        if self.cells:
            self._finish_cell(engine)


@dataclasses.dataclass
class TwinProfileRun:
    records: pa.Table
    cells: list[CellRun]
    engine_time_s: float
    steps: int


def run_twin_profile(scenario: Scenario, *, k_values: tuple[int, ...],
                     concurrencies: tuple[int, ...], budget_s: float, cell_s: float,
                     fit_max_k: int, sink: Sink | None = None,
                     on_progress: ProgressCallback | None = None) -> TwinProfileRun:
    """Run the sweep for `budget_s` seconds of virtual engine time; return its telemetry."""
    first = scenario.phases[0]
    one_phase = dataclasses.replace(
        scenario, phases=(dataclasses.replace(first, duration_s=budget_s,
                                              concurrency=concurrencies[0], rate_rps=None),))
    policy = ProfilePolicy(k_values=k_values, concurrencies=concurrencies, cell_s=cell_s,
                           max_k=scenario.engine.max_k, fit_max_k=fit_max_k,
                           on_progress=on_progress)
    memory = MemorySink(sink)
    policy.memory = memory
    engine, recorder, _ = build_engine(one_phase, policy, sink=memory, duration_s=budget_s)
    assert recorder is not None
    try:
        engine.run(policy)
        policy.finish(engine)
    finally:
        recorder.close(timeout_s=30.0)
    return TwinProfileRun(records=memory.table(), cells=policy.cells,
                          engine_time_s=min(engine.clock_s, budget_s), steps=engine.steps)
