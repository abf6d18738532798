"""The demo report's recovery: defined only when the stale table lost enough to measure."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tabletune.demo_report import group_numbers

PHASE_S = 240.0


def _summary(before: float, after: float) -> dict[str, Any]:
    timeline = [[t, before if t < PHASE_S else after] for t in range(0, 480, 10)]
    return {"output_tokens_per_s": (before + after) / 2, "timeline": timeline,
            "phases": [{"output_tokens_per_s": before}, {"output_tokens_per_s": after}]}


def _result(*, stale_after: float, live_after: float) -> SimpleNamespace:
    return SimpleNamespace(
        live=[_summary(1000.0, live_after)],
        baselines={"fixed:2": _summary(1000.0, 900.0), "fixed:3": _summary(990.0, 1000.0),
                   "vllm-doc": _summary(980.0, 950.0),
                   "stale table (first fit, held)": _summary(1000.0, stale_after)})


def test_recovery_is_the_share_of_the_stale_loss_won_back() -> None:
    numbers = group_numbers(_result(stale_after=900.0, live_after=980.0), PHASE_S)
    assert numbers["stale_loss"] == 0.1
    assert abs(numbers["recovery"] - 0.8) < 1e-9


def test_no_recovery_when_the_stale_table_lost_under_one_percent() -> None:
    """A 0.2% stale loss and a live run 0.5% under the best would read as -150%."""
    numbers = group_numbers(_result(stale_after=998.0, live_after=995.0), PHASE_S)
    assert numbers["recovery"] is None
