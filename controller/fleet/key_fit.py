"""The fitter as the closed loop calls it: on one key's records, within the key's limits,
none of a step sent in two different records (`ConflictWatch`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from controller.fleet.conflict_watch import ConflictWatch
from controller.fleet.decisions import DecisionLog, What
from controller.fleet.latency_knowledge import LatencyKnowledge
from controller.validation import EngineLimits
from schemas import TableEnvelope

Fit = Callable[..., TableEnvelope]
"""fit(records, *, key, max_k, max_batch, startup_k_values, version, half_life_s, ...,
budgets) (`fitter.derive.fit_table`; a wrapper passes on the options it does not read)."""

MIN_FIT_RECORDS = 200
"""Fewer step records than this make no fit: the surface has a dozen coefficients per K ..."""
MIN_FIT_STEPS = 50
"""... unless their steps carry that many decoding requests, over at least this many steps:
acceptance is counted per request, and a step time is one sample a step whatever its
batch, so a slow engine's few steps at 16 requests are a fit's worth sooner than 200 steps
(a 2-core CPU ran 4-5 steps a second there)."""


def fittable(records: pa.Table | None) -> bool:
    """Whether `records` hold enough for a fit (`MIN_FIT_RECORDS`, `MIN_FIT_STEPS`)."""
    if records is None:
        return False
    if records.num_rows >= MIN_FIT_RECORDS:
        return True
    decoding = pc.sum(records.column("num_decode_reqs")).as_py() or 0
    return records.num_rows >= MIN_FIT_STEPS and decoding >= MIN_FIT_RECORDS


class KeyFitter:
    def __init__(self, fit: Fit, limits: EngineLimits, fewest_ranges: bool,
                 decisions: DecisionLog, conflicts: ConflictWatch,
                 merge_z: float | None = None,
                 knowledge: LatencyKnowledge | None = None, budgets: bool = True) -> None:
        self.fit = fit
        """The fitter itself (a benchmark may wrap it after the loop is built)."""
        self.limits = limits
        self.fewest_ranges = fewest_ranges
        self.merge_z = merge_z
        self.knowledge = knowledge
        """Latency remembered from earlier windows, which every fit reads beside its own."""
        self.decisions = decisions
        self.conflicts = conflicts
        """Leaves conflicting steps out of every fit, counting and reporting them."""
        self.budgets = budgets
        """Off: no per-request budget, even from records that report match lengths."""

    def __call__(self, records: pa.Table, now_s: float, *, reason: str, version: int,
                 half_life_s: float | None, tolerance: float, k_values: tuple[int, ...],
                 provenance: dict[str, Any] | None = None, **fit_options: Any,
                 ) -> TableEnvelope | None:
        """The fitter on `records`, choosing among `k_values`; None (and a `fit_failed`
        decision) when the records cannot be fitted."""
        records = self.conflicts.screen(records)
        if self.knowledge is not None and len(self.knowledge.cells):
            fit_options.setdefault("latency_memory", self.knowledge.cells)
        if not self.budgets:
            fit_options["budgets"] = False
        try:
            return self.fit(records, key=self.limits.key, max_k=self.limits.max_k,
                            max_batch=self.limits.max_batch, startup_k_values=k_values,
                            version=version, half_life_s=half_life_s,
                            now_ns=int(now_s * 1e9), tolerance=tolerance,
                            fewest_ranges=self.fewest_ranges, merge_z=self.merge_z,
                            provenance={"reason": reason, **(provenance or {})},
                            **fit_options)
        except (ValueError, np.linalg.LinAlgError) as exc:
            self.decisions.note(now_s, What.FIT_FAILED, reason=reason, error=str(exc))
            return None
