"""The engine's active draft table, swapped atomically between steps.

Writers (the controller's consumer thread, a profiler) call `stage()` off the engine thread;
the engine calls `apply_staged()` at the start of a step. Staging is one attribute store of an
immutable object, and applying is one load and two stores, so neither side takes a lock and
the engine never sees a half-built table (prometheus_client's copy-a-reference pattern).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from schemas import DraftTable, TableError


class StepExplorer(Protocol):
    """Per-step exploration (controller.exploration.Explorer): a K to run instead, or -1."""

    def probe(self, batch_size: int, table_k: int) -> int: ...


@dataclass(frozen=True, slots=True)
class StagedTable:
    lookup: tuple[int, ...]
    """Dense K by batch size (index 0 unused), length max_batch + 1."""
    version: int
    forced: bool
    """True for profile/exploration tables whose K is not a fitted choice."""
    table: DraftTable
    explorer: StepExplorer | None = None
    """Exploration plan that travels with this table (None: no exploration)."""


class TableSwitch:
    """Holds the active lookup; the only place an engine's K per batch size comes from."""

    def __init__(self, table: DraftTable, *, max_k: int, max_batch: int, version: int = 0,
                 history: int = 64) -> None:
        self.max_k = max_k
        self.max_batch = max_batch
        active = self._expand(table, version, forced=False)
        self.lookup: tuple[int, ...] = active.lookup
        self.version = version
        self.forced = False
        self.table = table
        self.startup_table = table
        """What the engine was started with: the table a rollback to version 0 restores."""
        self._staged: StagedTable | None = None
        self.explorer: StepExplorer | None = None
        """The active table's explorer; consulted by `k_for_step` only."""
        self.step_forced = False
        """Whether the K of the last `k_for_step` was not the table's fitted choice."""
        self.applied: deque[StagedTable] = deque(maxlen=history)
        """Tables applied so far, newest last (read by the controller for status events)."""

    def stage(self, table: DraftTable, version: int, *, forced: bool = False,
              explorer: StepExplorer | None = None) -> StagedTable:
        """Validate and expand off the engine thread; applied at the next step boundary.

        Raises TableError and leaves the active table untouched when the table does not
        fit this engine (K above the startup maximum, not covering 1..max_batch).
        """
        staged = self._expand(table, version, forced=forced, explorer=explorer)
        self._staged = staged
        return staged

    def apply_staged(self) -> StagedTable | None:
        """Engine thread, start of a step: switch to the staged table if there is one."""
        staged = self._staged
        if staged is None:
            return None
        self._staged = None
        self.lookup = staged.lookup
        self.version = staged.version
        self.forced = staged.forced
        self.step_forced = staged.forced  # what a lookup without an explorer reports
        self.table = staged.table
        self.explorer = staged.explorer
        self.applied.append(staged)
        return staged

    def k_for(self, batch_size: int) -> int:
        """K for a batch size; sizes above max_batch use the last entry, as vLLM does."""
        return self.lookup[min(batch_size, self.max_batch)]

    def k_for_step(self, batch_size: int) -> int:
        """Engine thread: K for the drafts proposed this step, exploration included.

        Sets `step_forced` (what telemetry's `forced` should say for this step). Without an
        explorer this is `k_for` plus one store.
        """
        k = self.lookup[min(batch_size, self.max_batch)]
        explorer = self.explorer
        if explorer is not None:
            probe = explorer.probe(batch_size, k)
            if 0 <= probe <= self.max_k and probe != k:
                self.step_forced = True
                return probe
        self.step_forced = self.forced
        return k

    @property
    def pending(self) -> bool:
        return self._staged is not None

    def _expand(self, table: DraftTable, version: int, *, forced: bool,
                explorer: StepExplorer | None = None) -> StagedTable:
        table.validate(self.max_k, self.max_batch)
        if version < 0:
            raise TableError(f"table version {version} is negative")
        return StagedTable(lookup=tuple(table.to_dense(self.max_batch)), version=version,
                           forced=forced, table=table, explorer=explorer)
