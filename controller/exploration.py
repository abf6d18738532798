"""Exploration: a bounded share of steps run a K other than the table's.

Live traffic only shows the K the table chose (censoring); without probes a refit cannot
see that another K has become better. The fitter says where its argmax is least certain
(`envelope.exploration`: per batch bucket, candidate K values by expected gain); the
`Explorer` turns that plan into a dense per-batch-size lookup once, off the engine thread,
and on the engine thread costs a counter and a lookup per step (`probe`), no allocation.

Share bound: a probe resets the counter and the next needs `period` more steps, so at most
one step in `period` is a probe, whatever the batch sizes visited. A batch size with no
candidate in the plan falls back to the table's neighbours (K+1, K-1) when `neighbours` is
on, so a drift toward another K is seen even where the fit was sure. There only one due
turn in `neighbour_every` probes (`neighbour_fraction` of the share): the fit has said no
other K is likely to win, and each probe of a worse K is goodput lost. Probe steps are
marked `forced` in telemetry (`TableSwitch.step_forced`), so guardrail and drift statistics
can leave them out while the fitter still learns from them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from schemas import DraftTable
from schemas.bounds import check_bounds, in_range


@dataclass(frozen=True, slots=True)
class ExplorationConfig:
    """Probing of other K on an engine: the operator's share first (engines read it from
    TABLETUNE_EXPLORE_SHARE), then the tuned constants (docs/TUNING.md)."""

    # ---- what an operator sets ----
    share: float = 0.02
    """Most steps that may run another K (0 disables exploration)."""

    # ---- tuned constants (docs/TUNING.md) ----
    neighbours: bool = True
    """Probe K±1 where the plan names no candidate, so that a drift toward another K shows
    even where the fit was sure ..."""
    neighbour_fraction: float = 0.25
    """... on this fraction of the share's turns: each probe of a worse K is goodput lost,
    and a fraction (not a fixed share) rises with the share."""

    def __post_init__(self) -> None:
        check_bounds(self, share=in_range(0, 0.5),
                     neighbour_fraction=in_range(0, 1, low_open=True).because(
                         "neighbours=False turns neighbour probes off"))


class Explorer:
    """Engine-thread half: `probe(batch_size, table_k)` -> a K to run instead, or -1."""

    __slots__ = ("period", "candidates", "planned", "neighbour_every", "max_batch", "_count",
                 "_turn", "_neighbour_turn", "probes")

    def __init__(self, candidates: tuple[tuple[int, ...], ...], period: int, *,
                 planned: tuple[bool, ...] | None = None, neighbour_every: int = 1) -> None:
        if period < 2:
            raise ValueError(f"period={period} must be >= 2 (share <= 50%)")
        if neighbour_every < 1:
            raise ValueError(f"neighbour_every={neighbour_every} must be >= 1")
        self.period = period
        self.candidates = candidates
        """Dense: candidates[b] are the K values to try at batch size b (index 0 unused)."""
        self.planned = planned if planned is not None else (True,) * len(candidates)
        """planned[b]: the plan named candidates[b] (else they are the table's neighbours)."""
        self.neighbour_every = neighbour_every
        self.max_batch = len(candidates) - 1
        self._count = 0
        self._turn = 0
        self._neighbour_turn = 0
        self.probes = 0

    def probe(self, batch_size: int, table_k: int) -> int:
        self._count += 1
        if self._count < self.period:
            return -1
        row = batch_size if batch_size < self.max_batch else self.max_batch
        options = self.candidates[row]
        if not options:
            return -1  # stay due: the next step at a batch size with a candidate probes
        self._count = 0
        if not self.planned[row]:
            self._neighbour_turn += 1
            if self._neighbour_turn < self.neighbour_every:
                return -1  # a turn spent: where the fit is sure, most turns probe nothing
            self._neighbour_turn = 0
        self._turn += 1
        k = options[self._turn % len(options)]
        if k == table_k:
            return -1
        self.probes += 1
        return k


def plan_candidates(plan: Mapping[str, Any] | None, table: DraftTable, *, max_batch: int,
                    k_values: Iterable[int], neighbours: bool = True,
                    ) -> tuple[tuple[tuple[int, ...], ...], tuple[bool, ...]]:
    """Dense per-batch-size candidate K values from an envelope's exploration plan, and per
    batch size whether the plan named them (False: the table's neighbours, or none)."""
    allowed = sorted({int(k) for k in k_values})
    dense = table.to_dense(max_batch)
    out: list[tuple[int, ...]] = [()] * (max_batch + 1)
    for bucket in (plan or {}).get("buckets", ()):
        ks = tuple(int(c["k"]) for c in bucket.get("candidates", ()) if int(c["k"]) in allowed)
        for b in range(max(1, int(bucket["batch_start"])),
                       min(max_batch, int(bucket["batch_end"])) + 1):
            out[b] = tuple(k for k in ks if k != dense[b])
    planned = tuple(bool(options) for options in out)
    if neighbours:
        for b in range(1, max_batch + 1):
            if not out[b]:
                k = dense[b]
                out[b] = tuple(n for n in (k + 1, k - 1) if n in allowed)
    return tuple(out), planned


def explorer_for(plan: Mapping[str, Any] | None, table: DraftTable, *, max_batch: int,
                 k_values: Iterable[int], config: ExplorationConfig | None = None,
                 ) -> Explorer | None:
    """The explorer to stage with `table` (None when the share is 0: exploration is off)."""
    config = config or ExplorationConfig()
    if config.share <= 0.0:
        return None
    candidates, planned = plan_candidates(plan, table, max_batch=max_batch, k_values=k_values,
                                          neighbours=config.neighbours)
    return Explorer(candidates, period=max(2, round(1.0 / config.share)), planned=planned,
                    neighbour_every=max(1, round(1.0 / config.neighbour_fraction)))
