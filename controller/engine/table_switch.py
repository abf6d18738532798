"""The engine's active draft table, swapped atomically between steps.

Writers (the controller's consumer thread, a profiler) call `stage()` off the engine thread;
the engine calls `apply_staged()` at the start of a step. Staging is one attribute store of an
immutable object, and applying is one load and a few stores, so neither side takes a lock and
the engine never sees a half-built table (prometheus_client's copy-a-reference pattern).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from schemas import DraftTable, TableError
from schemas.draft_budget import DraftBudget


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
    budget: DraftBudget | None = None
    budget_lookup: tuple[tuple[int, ...], ...] | None = None
    """Dense K by (batch size, match length) (None: no budget, the table's K for all)."""


class TableSwitch:
    """Holds the active lookup; the only place an engine's K per batch size comes from."""

    def __init__(self, table: DraftTable, *, max_k: int, max_batch: int, version: int = 0,
                 history: int = 64, max_match: int = 0,
                 budget: DraftBudget | None = None) -> None:
        self.max_k = max_k
        self.max_batch = max_batch
        self.max_match = max_match
        """Longest match an n-gram proposer reports (its prompt_lookup_max); 0: it reports
        none, and budgets are refused."""
        active = self._expand(table, version, forced=False, budget=budget)
        self.lookup: tuple[int, ...] = active.lookup
        self.budget = budget
        self.budget_lookup = active.budget_lookup
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
              explorer: StepExplorer | None = None,
              budget: DraftBudget | None = None) -> StagedTable:
        """Validate and expand off the engine thread; applied at the next step boundary.

        Raises TableError and leaves the active table untouched when the table or budget
        does not fit this engine (K above the startup maximum, not covering 1..max_batch, a
        budget where the drafter reports no match length).
        """
        staged = self._expand(table, version, forced=forced, explorer=explorer, budget=budget)
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
        self.budget = staged.budget
        self.budget_lookup = staged.budget_lookup
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

    def budget_for(self, batch_size: int) -> tuple[int, ...] | None:
        """Engine thread: K by match length for this step's drafts, or None (the table's K
        for every request). None on a step whose K was forced: a probe is of one K."""
        lookup = self.budget_lookup
        if lookup is None or self.step_forced:
            return None
        return lookup[min(batch_size, self.max_batch)]

    @property
    def pending(self) -> bool:
        return self._staged is not None

    def _expand(self, table: DraftTable, version: int, *, forced: bool,
                explorer: StepExplorer | None = None,
                budget: DraftBudget | None = None) -> StagedTable:
        table.validate(self.max_k, self.max_batch)
        if version < 0:
            raise TableError(f"table version {version} is negative")
        budget_lookup = None
        if budget is not None:
            if not self.max_match:
                raise TableError("a draft budget needs a drafter that reports match "
                                 "lengths (n-gram prompt lookup)")
            budget.validate(self.max_k, self.max_batch)
            budget_lookup = budget.to_dense(self.max_batch, self.max_match)
        return StagedTable(lookup=tuple(table.to_dense(self.max_batch)), version=version,
                           forced=forced, table=table, explorer=explorer, budget=budget,
                           budget_lookup=budget_lookup)
