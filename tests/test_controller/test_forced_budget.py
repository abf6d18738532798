"""A one-engine key's probe: its forced budget (a share of any sliding window, never more),
and what each kind of drift makes it force."""

from __future__ import annotations

import pytest

from controller.fleet.forced_budget import MIN_PROBE_S, ForcedBudget
from controller.fleet.sweep_planner import Hidden


def test_blocks_are_granted_until_the_share_of_the_window_is_spent() -> None:
    budget = ForcedBudget(share=0.025, window_s=600.0)  # 15 s in any 10 minutes
    assert [budget.grant(t, 4.0) for t in (0.0, 60.0, 120.0, 180.0)] == [4.0, 4.0, 4.0, 3.0]
    assert budget.grant(240.0, 4.0) == 0.0  # nothing left: a drift refits without a block
    # the first block leaves the window 600 s after it ended
    assert budget.grant(603.0, 4.0) == 0.0
    assert budget.grant(604.0, 4.0) == 4.0


def test_what_is_left_is_what_a_grant_would_give_and_spends_nothing() -> None:
    budget = ForcedBudget(share=0.025, window_s=600.0)  # 15 s in any 10 minutes
    budget.grant(0.0, 4.0)
    budget.grant(60.0, 4.0)
    assert budget.left(120.0) == budget.left(120.0) == 7.0
    assert budget.grant(120.0, 10.0) == 7.0 and budget.left(121.0) == 0.0
    assert budget.left(604.0) == 4.0  # the first block left the window


def test_a_remainder_too_short_to_fit_is_not_granted() -> None:
    budget = ForcedBudget(share=0.01, window_s=600.0)  # 6 s
    assert budget.grant(0.0, 5.5) == 5.5
    assert budget.grant(10.0, 5.0) == 0.0  # 0.5 s left: below MIN_PROBE_S
    assert 0.5 < MIN_PROBE_S


@pytest.mark.parametrize("start_s", [0.0, 17.0, 333.3])
def test_no_window_holds_more_than_the_share(start_s: float) -> None:
    budget = ForcedBudget(share=0.025, window_s=600.0)
    blocks = [(start_s + 7.0 * i, budget.grant(start_s + 7.0 * i, 3.0)) for i in range(400)]
    for begin, _ in blocks:
        inside = sum(length for t, length in blocks if begin <= t < begin + 600.0)
        assert inside <= 0.025 * 600.0 + 1e-9


def test_what_a_drift_hides_follows_its_signal_and_sign() -> None:
    assert Hidden.of("acceptance", -0.2) is Hidden.NOTHING  # the table's K drafts them all
    assert Hidden.of("acceptance", 0.3) is Hidden.ACCEPTANCE
    assert Hidden.of("latency", -0.4) is Hidden.COST
    assert Hidden.of("coverage", 0.7) is Hidden.COST
