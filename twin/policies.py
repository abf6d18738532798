"""How a twin run chooses K: a policy gives the startup table and may restage tables later.

A policy talks to the engine only the way a controller talks to vLLM: through the engine's
`TableSwitch` (`engine.switch.stage(table, version)`), applied at the next step boundary.
Adaptive policies set `step_interval` to get `on_step` every N steps with that step's
statistics; static ones leave it at 0 and cost the engine nothing per step.

    make_policy("fixed:3") | make_policy("table:t.json") | make_policy("vllm-doc")
    register_policy("ema-adaptive", factory)     # later work: factory(arg: str | None) -> Policy
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from schemas import DraftTable, TableError
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
                 clamp_k: bool = False) -> None:
        self.table = table
        self.name = name
        self.version = version
        self.clamp_k = clamp_k

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
    return StaticTable(table, name=f"table:{Path(path).name}", version=version)


PolicyFactory = Callable[[str | None], Policy]

_REGISTRY: dict[str, tuple[PolicyFactory, str]] = {}


def register_policy(name: str, factory: PolicyFactory, *, usage: str | None = None) -> None:
    """Make `name[:ARG]` selectable; `factory` gets ARG (or None) and returns a Policy."""
    _REGISTRY[name] = (factory, usage or name)


def make_policy(spec: str) -> Policy:
    """`fixed:K`, `table:FILE`, `vllm-doc`, or any registered name."""
    name, _, arg = spec.partition(":")
    entry = _REGISTRY.get(name)
    if entry is None:
        known = ", ".join(usage for _, usage in _REGISTRY.values())
        raise PolicyError(f"unknown policy {spec!r} (known: {known})")
    return entry[0](arg or None)


def policy_usages() -> list[str]:
    return [usage for _, usage in _REGISTRY.values()]


def _fixed(arg: str | None) -> Policy:
    if arg is None or not arg.lstrip("-").isdigit():
        raise PolicyError(f"fixed:K needs an integer K, got {arg!r}")
    return FixedK(int(arg))


def _table(arg: str | None) -> Policy:
    if not arg:
        raise PolicyError("table:FILE needs a file")
    return table_policy(arg)


def _vllm_doc(arg: str | None) -> Policy:
    if arg:
        raise PolicyError(f"vllm-doc takes no argument, got {arg!r}")
    return StaticTable(VLLM_DOC_TABLE, name="vllm-doc", clamp_k=True)


register_policy("fixed", _fixed, usage="fixed:K")
def _tabletune(arg: str | None) -> Policy:
    # imported when used: the control service's stack is this policy's alone (a quarter of
    # `tabletune twin run`'s start-up otherwise)
    from twin.tabletune_policy import tabletune_policy

    return tabletune_policy(arg)


register_policy("table", _table, usage="table:FILE")
register_policy("vllm-doc", _vllm_doc)

import twin.baselines  # noqa: E402,F401  (registers dsd-goodput, ema-adaptive)

register_policy("tabletune", _tabletune, usage="tabletune[:explore=S,refit=S,threshold=F]")
