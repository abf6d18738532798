"""How a twin run chooses K: a policy gives the startup table and may restage tables later.

A policy talks to the engine only the way a controller talks to vLLM: through the engine's
`TableSwitch` (`engine.switch.stage(table, version)`), applied at the next step boundary.
Adaptive policies set `step_interval` to get `on_step` every N steps with that step's
statistics; static ones leave it at 0 and cost the engine nothing per step. This module has
the base class and the static policies; `twin.registry` maps `--policy` names to them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from schemas import DraftTable, TableError
from schemas.draft_budget import DraftBudget
from schemas.table_files import load_table_file

if TYPE_CHECKING:
    from twin.engine import StepStats, TwinEngine

VLLM_DOC_TABLE = DraftTable.from_vllm([[1, 16, 5], [17, 32, 4], [33, 64, 3], [65, 128, 1],
                                       [129, 512, 0]])
"""vLLM's documented example for EAGLE-3 on Llama-3.1-8B."""


class PolicyError(ValueError):
    """A policy spec that cannot run on this engine; the message says why."""


class Policy:
    """Base policy: a fixed startup table and no reaction to traffic."""

    name = "policy"
    step_interval = 0
    """> 0: `on_step` is called after every `step_interval`-th step; 0: never."""

    def initial_table(self, *, max_k: int, max_batch: int) -> tuple[DraftTable, int]:
        """The startup table (fitted to the engine's limits) and its version."""
        raise NotImplementedError

    def initial_budget(self) -> DraftBudget | None:
        """Per-request K by n-gram match length under the startup table (None: none)."""
        return None

    def start(self, engine: TwinEngine) -> None:
        """Called once before the first step (e.g. to keep a reference to `engine.switch`)."""

    def on_step(self, engine: TwinEngine, step: StepStats) -> None:
        """Called after a step when `step_interval` says so; may stage a table."""

    def describe(self) -> str:
        return self.name


class FixedK(Policy):
    def __init__(self, k: int) -> None:
        if k < 0:
            raise PolicyError(f"fixed:{k}: K must be >= 0")
        self.k = k
        self.name = f"fixed:{k}"

    def initial_table(self, *, max_k: int, max_batch: int) -> tuple[DraftTable, int]:
        if self.k > max_k:
            raise PolicyError(f"{self.name}: K {self.k} exceeds the engine's max_k {max_k}")
        return DraftTable.from_vllm([[1, max_batch, self.k]]), 0


class StaticTable(Policy):
    """A given table; vLLM's tail rule extends its last range up to max_num_seqs."""

    def __init__(self, table: DraftTable, *, name: str, version: int = 0,
                 clamp_k: bool = False, budget: DraftBudget | None = None) -> None:
        self.table = table
        self.name = name
        self.version = version
        self.clamp_k = clamp_k
        self.budget = budget

    def initial_budget(self) -> DraftBudget | None:
        return self.budget

    def initial_table(self, *, max_k: int, max_batch: int) -> tuple[DraftTable, int]:
        limit = max(self.table.k_values) if self.clamp_k else max_k
        self.table.validate(limit, self.table.max_batch)
        dense = self.table.to_dense(max_batch)
        if self.clamp_k:
            dense = [min(k, max_k) for k in dense]
        return DraftTable.from_dense(dense), self.version


def table_policy(path: str) -> Policy:
    try:
        table, envelope = load_table_file(path)
    except TableError as exc:
        raise PolicyError(f"table:{path}: {exc}") from None
    version = envelope.version if envelope is not None else 0
    budget = envelope.budget if envelope is not None else None
    return StaticTable(table, name=f"table:{Path(path).name}", version=version, budget=budget)
