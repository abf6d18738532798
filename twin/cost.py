"""Step latency of a simulated engine: SpecDecode-Bench's linear model, plus an optional knee,
or a measured grid (`latency_table`, `[cost] table = "PATH.csv"`).

    verify = target_kv·KV + target_batched·max(0, batched − knee) + target_fixed
    draft  = draft_kv·KV + draft_per_token·(K + 1) + draft_fixed       (eagle, draft_model)
           = ngram_fraction · verify                                  (ngram)
    step   = verify + draft + step_overhead                           (no draft when K = 0)

KV = tokens in the KV cache of the scheduled requests, batched = tokens verified in the step.
The draft term is per step, not per request: the drafter runs once over the whole batch, which
is how SpecDecode-Bench fitted (and applies) these coefficients. Functions take scalars or
numpy arrays alike, so the static experiment can evaluate whole batches at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from twin.config import COST_COEFFICIENTS, CostConfig, ScenarioError
from twin.latency_table import LatencyTable, LatencyTableError, load_latency_table

PROFILES: dict[str, dict[str, float]] = {
    # Llama-3.1-8B-Instruct on H100, vLLM 0.10.1, fitted by SpecDecode-Bench
    # (docs/TWIN.md, calibration).
    "h100-llama3.1-8b": {
        "target_kv": 3.92645679e-08,
        "target_batched": 2.10103129e-05,
        "target_fixed": 5.88590713e-03,
        "draft_kv": 2.37768493e-09,
        "draft_per_token": 8.41429603e-07,
        "draft_fixed": 2.13526175e-03,
        "ngram_fraction": 0.005875,
        "step_overhead": 1.20683946e-03,
    },
}


class StepCost(Protocol):
    """What the engine needs of a cost model: a step's noise-free latency."""

    def step_s(self, kv_tokens: int, batched_tokens: int, k_next: int) -> float: ...

    def step_fn(self) -> Callable[[int, int, int], float]: ...


def step_cost(config: CostConfig, method: str, max_k: int) -> StepCost:
    """The scenario's cost model: its measured table (which must hold every K the engine can
    propose, 0..max_k), or the coefficients."""
    if config.table is None:
        return CostModel.from_config(config, method)
    try:
        table: LatencyTable = load_latency_table(config.table)
    except LatencyTableError as exc:
        raise ScenarioError("cost.table", str(exc)) from None
    if table.max_k < max_k:
        raise ScenarioError("cost.table", f"{config.table} has rows for k up to {table.max_k}, "
                                          f"but engine.max_k = {max_k} (give every k to "
                                          f"{max_k}, or lower max_k)")
    return table


@dataclass(frozen=True, slots=True)
class CostModel:
    target_kv: float
    target_batched: float
    target_fixed: float
    draft_kv: float
    draft_per_token: float
    draft_fixed: float
    ngram_fraction: float
    step_overhead: float
    method: str = "eagle"
    knee_tokens: int = 0

    @classmethod
    def from_config(cls, config: CostConfig, method: str) -> CostModel:
        """Profile values overlaid with the explicit coefficients of `config`."""
        if config.profile == "none":
            base: dict[str, float] = {}
        elif config.profile in PROFILES:
            base = dict(PROFILES[config.profile])
        else:
            raise ScenarioError("cost.profile", f"unknown profile {config.profile!r} "
                                                f"(known: {', '.join(PROFILES)}, none)")
        for name in COST_COEFFICIENTS:
            value = getattr(config, name)
            if value is not None:
                base[name] = value
        missing = [name for name in COST_COEFFICIENTS if name not in base]
        if missing:
            raise ScenarioError(f"cost.{missing[0]}",
                                f"required with profile = \"none\" (missing: {', '.join(missing)})")
        return cls(**base, method=method, knee_tokens=config.knee_tokens)

    def verify_s(self, kv_tokens: Any, batched_tokens: Any) -> Any:
        """Target forward over `batched_tokens` new tokens attending to `kv_tokens`."""
        if self.knee_tokens:
            batched_tokens = np.maximum(0, np.asarray(batched_tokens) - self.knee_tokens)
        return (self.target_kv * kv_tokens + self.target_batched * batched_tokens
                + self.target_fixed)

    def draft_s(self, verify_s: Any, kv_tokens: Any, k: Any) -> Any:
        """Proposal of `k` drafts per request (callers skip it when nothing is drafted)."""
        if self.method == "ngram":
            return self.ngram_fraction * verify_s
        return self.draft_kv * kv_tokens + self.draft_per_token * (k + 1) + self.draft_fixed

    def step_s(self, kv_tokens: int, batched_tokens: int, k_next: int) -> float:
        """Noise-free latency of one engine step that proposes `k_next` drafts."""
        verify = self.verify_s(kv_tokens, batched_tokens)
        draft = self.draft_s(verify, kv_tokens, k_next) if k_next > 0 else 0.0
        return float(verify + draft + self.step_overhead)

    def step_fn(self) -> Callable[[int, int, int], float]:
        """`step_s` for integers, coefficients bound (the twin calls it every step): the
        same operations in the same order, so the same floats."""
        target_kv, target_batched, target_fixed = (self.target_kv, self.target_batched,
                                                   self.target_fixed)
        draft_kv, draft_per_token, draft_fixed = (self.draft_kv, self.draft_per_token,
                                                  self.draft_fixed)
        ngram, ngram_fraction = self.method == "ngram", self.ngram_fraction
        knee, overhead = self.knee_tokens, self.step_overhead

        def step_s(kv_tokens: int, batched_tokens: int, k_next: int) -> float:
            if knee:
                batched_tokens = max(0, batched_tokens - knee)
            verify = target_kv * kv_tokens + target_batched * batched_tokens + target_fixed
            if k_next <= 0:
                draft = 0.0
            elif ngram:
                draft = ngram_fraction * verify
            else:
                draft = draft_kv * kv_tokens + draft_per_token * (k_next + 1) + draft_fixed
            return verify + draft + overhead

        return step_s
