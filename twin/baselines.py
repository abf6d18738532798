"""Two published ways to choose K, as twin policies, for benchmarks to compare against.

`dsd-goodput` — vLLM's Dynamic Speculative Decoding (DSD) approach. Offline, it profiles the
step latency ITL(B, K) on a grid K in {0, 1, 3, 5} x B in {1, 4, 16, 64, 256}; online, it
keeps acceptance statistics and picks K*(B) = argmax_K AL(K) / ITL(B, K), with ITL linearly
interpolated between profiled batch sizes. Latency is never re-profiled. Here the offline
profile is a short warm-up at engine start: the grid cells are timed on the engine's own
cost model at a fixed profiling context (the way an offline benchmark run on the same GPU
would time them, so it inherits DSD's blind spot: serving context differs from the profile's),
and the first steps force the top grid K so that acceptance is seen at every position. The
table is then recomputed from live acceptance every `refresh_steps` steps.

`ema-adaptive` — SGLang-style adaptive speculation. Per batch-size bucket, an exponential
moving average of the draft acceptance rate (accepted drafts / proposed drafts) moves K one
tier up when it is high and one tier down when it is low; the gap between the two thresholds
plus a cool-down of `cooldown_updates` between changes is the hysteresis that keeps K from
oscillating. Larger batch buckets need a higher acceptance rate to justify more drafts
(speculation costs more verify compute there), so their thresholds are higher.

Both are honest configurations of their authors' published defaults, not tuned to the twin.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from schemas import DraftTable
from twin.policies import Policy

if TYPE_CHECKING:
    from twin.engine import StepStats, TwinEngine

DSD_K_GRID: tuple[int, ...] = (0, 1, 3, 5)
DSD_BATCH_GRID: tuple[int, ...] = (1, 4, 16, 64, 256)
DSD_PROFILE_CONTEXT_TOKENS = 512
"""Context per request in the latency profile (SpecDecode-Bench-style derivation, 512)."""


class AcceptanceStats:
    """Decayed sums of drafts and accepted drafts per position (unconditional counts)."""

    def __init__(self, positions: int, decay: float) -> None:
        self.drafts = np.zeros(positions)
        self.accepted = np.zeros(positions)
        self.decay = decay

    def add(self, step: StepStats) -> None:
        if not step.num_drafts or not step.accepted_per_pos:
            return
        n = min(len(step.accepted_per_pos), self.drafts.size)
        self.drafts *= self.decay
        self.accepted *= self.decay
        self.drafts[:n] += step.num_drafts
        self.accepted[:n] += step.accepted_per_pos[:n]

    def acceptance_length(self, k_values: Sequence[int]) -> np.ndarray:
        """AL(K) = 1 + sum of unconditional rates; positions never drafted repeat the last
        observed conditional rate (the geometric assumption DSD makes)."""
        seen = self.drafts > 0
        if not seen.any():
            return np.ones(len(k_values))
        unconditional = np.where(seen, self.accepted / np.maximum(self.drafts, 1e-12), 0.0)
        last = int(np.flatnonzero(seen)[-1])
        previous = unconditional[last - 1] if last > 0 else 1.0
        rate = unconditional[last] / previous if previous > 0 else 0.0
        rate = float(min(max(rate, 0.0), 0.99))
        for i in range(last + 1, unconditional.size):
            unconditional[i] = unconditional[i - 1] * rate
        cumulative = np.concatenate([[0.0], np.cumsum(unconditional)])
        return np.array([1.0 + cumulative[min(k, unconditional.size)] for k in k_values])


class DsdGoodput(Policy):
    name = "dsd-goodput"

    def __init__(self, *, warmup_steps: int = 200, refresh_steps: int = 256,
                 decay: float = 0.999) -> None:
        self.warmup_steps = warmup_steps
        self.refresh_steps = refresh_steps
        self.step_interval = 1
        self.decay = decay
        self.k_grid: tuple[int, ...] = DSD_K_GRID
        self.itl_s = np.zeros((len(DSD_BATCH_GRID), len(DSD_K_GRID)))
        self.stats: AcceptanceStats | None = None
        self.version = 0
        self.steps = 0
        self.table: DraftTable | None = None

    def initial_table(self, *, max_k: int, max_batch: int) -> tuple[DraftTable, int]:
        self.k_grid = tuple(k for k in DSD_K_GRID if k <= max_k)
        self.stats = AcceptanceStats(max(max_k, 1), self.decay)
        return DraftTable.from_vllm([[1, max_batch, max(self.k_grid)]]), 0

    def start(self, engine: TwinEngine) -> None:
        """The offline latency profile: every grid cell timed on this engine's cost model."""
        cost = engine.cost
        self.itl_s = np.array([
            [cost.step_s(b * DSD_PROFILE_CONTEXT_TOKENS, b * (k + 1), k) for k in self.k_grid]
            for b in DSD_BATCH_GRID])
        self._stage(engine, DraftTable.from_vllm(
            [[1, engine.switch.max_batch, max(self.k_grid)]]), forced=True)

    def on_step(self, engine: TwinEngine, step: StepStats) -> None:
        assert self.stats is not None
        self.stats.add(step)
        self.steps += 1
        if self.steps < self.warmup_steps or self.steps % self.refresh_steps:
            return
        table = self.compute_table(engine.switch.max_batch)
        if table != self.table:
            self._stage(engine, table, forced=False)

    def compute_table(self, max_batch: int) -> DraftTable:
        """K*(B) = argmax_K AL(K) / ITL(B, K) for B = 1..max_batch."""
        assert self.stats is not None
        al = self.stats.acceptance_length(self.k_grid)
        batch = np.arange(1, max_batch + 1)
        itl = np.column_stack([np.interp(batch, DSD_BATCH_GRID, self.itl_s[:, j])
                               for j in range(len(self.k_grid))])
        best = (al[None, :] / itl).argmax(axis=1)
        return DraftTable.from_dense([0, *(self.k_grid[j] for j in best)])

    def _stage(self, engine: TwinEngine, table: DraftTable, *, forced: bool) -> None:
        self.version += 1
        engine.switch.stage(table, self.version, forced=forced)
        self.table = table


EMA_TIERS: tuple[int, ...] = (1, 2, 3, 5, 7)
EMA_BUCKETS: tuple[int, ...] = (8, 32, 128)
"""Bucket upper bounds: 1-8, 9-32, 33-128, 129 and above."""
EMA_UP: tuple[float, ...] = (0.55, 0.65, 0.75, 0.85)
EMA_DOWN: tuple[float, ...] = (0.35, 0.45, 0.55, 0.65)


class EmaAdaptive(Policy):
    name = "ema-adaptive"

    def __init__(self, *, alpha: float = 0.05, update_steps: int = 32,
                 cooldown_updates: int = 4) -> None:
        self.alpha = alpha
        self.step_interval = 1
        self.update_steps = update_steps
        self.cooldown_updates = cooldown_updates
        n = len(EMA_BUCKETS) + 1
        self.ema = np.full(n, np.nan)
        self.tier = np.zeros(n, dtype=np.int64)
        self.cooldown = np.zeros(n, dtype=np.int64)
        self.tiers: tuple[int, ...] = EMA_TIERS
        self.version = 0
        self.steps = 0

    def initial_table(self, *, max_k: int, max_batch: int) -> tuple[DraftTable, int]:
        self.tiers = tuple(k for k in EMA_TIERS if k <= max_k) or (max_k,)
        self.tier[:] = len(self.tiers) // 2
        return self.table(max_batch), 0

    def bucket(self, batch_size: int) -> int:
        return int(np.searchsorted(EMA_BUCKETS, batch_size))

    def table(self, max_batch: int) -> DraftTable:
        dense = [0] + [self.tiers[self.tier[self.bucket(b)]] for b in range(1, max_batch + 1)]
        return DraftTable.from_dense(dense)

    def on_step(self, engine: TwinEngine, step: StepStats) -> None:
        self.steps += 1
        if step.num_draft_tokens > 0:
            b = self.bucket(step.batch_size)
            rate = step.num_accepted_tokens / step.num_draft_tokens
            previous = self.ema[b]
            self.ema[b] = rate if np.isnan(previous) else (
                (1 - self.alpha) * previous + self.alpha * rate)
        if self.steps % self.update_steps:
            return
        changed = False
        for b in range(self.tier.size):
            if self.cooldown[b] > 0:
                self.cooldown[b] -= 1
                continue
            if np.isnan(self.ema[b]):
                continue
            if self.ema[b] >= EMA_UP[b] and self.tier[b] < len(self.tiers) - 1:
                self.tier[b] += 1
            elif self.ema[b] <= EMA_DOWN[b] and self.tier[b] > 0:
                self.tier[b] -= 1
            else:
                continue
            self.cooldown[b] = self.cooldown_updates
            changed = True
        if changed:
            self.version += 1
            engine.switch.stage(self.table(engine.switch.max_batch), self.version)
