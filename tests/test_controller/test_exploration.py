"""Exploration: a bounded share of steps, at the plan's candidates, marked forced; 0 disables."""

from __future__ import annotations

import numpy as np
import pytest

from controller.engine.table_switch import TableSwitch
from controller.exploration import (
    ExplorationConfig,
    Explorer,
    explorer_for,
    plan_candidates,
)
from schemas import DraftTable

TABLE = DraftTable.from_vllm([[1, 16, 5], [17, 64, 3], [65, 128, 1]])
PLAN = {"buckets": [{"batch_start": 32, "batch_end": 63, "chosen_k": 3, "expected_gain": 0.01,
                     "candidates": [{"k": 4}, {"k": 2}]}]}


def switch_with(share: float, *, neighbours: bool = True,
                neighbour_fraction: float = 1.0) -> TableSwitch:
    switch = TableSwitch(TABLE, max_k=7, max_batch=128, version=1)
    config = ExplorationConfig(share=share, neighbours=neighbours,
                               neighbour_fraction=neighbour_fraction)
    explorer = explorer_for(PLAN, TABLE, max_batch=128, k_values=range(8), config=config)
    switch.stage(TABLE, 2, explorer=explorer)
    switch.apply_staged()
    return switch


@pytest.mark.parametrize("share", [0.01, 0.02, 0.1])
def test_share_is_bounded_and_probes_are_marked_forced(share: float) -> None:
    switch = switch_with(share)
    steps, probes = 20_000, 0
    for step in range(steps):
        batch = 1 + (step * 7) % 128
        k = switch.k_for_step(batch)
        if switch.step_forced:
            probes += 1
            assert k != switch.k_for(batch)
        else:
            assert k == switch.k_for(batch)
    assert probes <= share * steps + 1
    assert probes >= 0.8 * share * steps  # every batch size has a candidate (neighbours)


def test_probes_follow_the_plan_where_it_has_candidates() -> None:
    switch = switch_with(0.05, neighbours=False)
    seen_in, seen_out = set(), 0
    for step in range(10_000):
        batch = 40 if step % 2 else 100
        k = switch.k_for_step(batch)
        if switch.step_forced:
            if batch == 40:
                seen_in.add(k)
            else:
                seen_out += 1
    assert seen_in == {2, 4}  # both candidates of the uncertain bucket, in turn
    assert seen_out == 0  # no plan there and no neighbours: never probed


def test_where_the_plan_is_sure_neighbours_get_their_smaller_share() -> None:
    """Batch 40 is in the plan's uncertain bucket (candidates 4 and 2), batch 100 is not:
    there the neighbours of its K1 are probed, and at the default quarter of a 2% share,
    a quarter as often as at 40; together they stay within 2%."""
    switch = switch_with(0.02, neighbour_fraction=ExplorationConfig().neighbour_fraction)
    steps = 40_000
    probes = {40: 0, 100: 0}
    probed_at_100 = set()
    for batch in np.random.default_rng(0).choice([40, 100], size=steps):
        k = switch.k_for_step(int(batch))
        probes[int(batch)] += switch.step_forced
        if switch.step_forced and batch == 100:
            probed_at_100.add(k)
    assert probed_at_100 == {0, 2}
    assert sum(probes.values()) <= 0.02 * steps + 1
    assert 0.2 < probes[100] / probes[40] < 0.3
    with pytest.raises(ValueError, match="neighbour_fraction"):
        ExplorationConfig(neighbour_fraction=0.0)


def test_zero_share_disables_exploration() -> None:
    assert explorer_for(PLAN, TABLE, max_batch=128, k_values=range(8),
                        config=ExplorationConfig(share=0.0)) is None
    switch = switch_with(0.0)
    assert switch.explorer is None
    for batch in range(1, 129):
        assert switch.k_for_step(batch) == switch.k_for(batch)
        assert switch.step_forced is False


def test_forced_table_marks_every_step_without_explorer() -> None:
    switch = TableSwitch(TABLE, max_k=7, max_batch=128)
    switch.stage(DraftTable.from_vllm([[1, 128, 6]]), 0, forced=True)
    switch.apply_staged()
    assert switch.k_for_step(10) == 6 and switch.step_forced


def test_candidates_stay_inside_the_startup_set() -> None:
    dense, planned = plan_candidates(PLAN, TABLE, max_batch=128, k_values=[1, 3, 5])
    assert not planned[40] and not planned[10]  # the plan's K are not in the set
    assert dense[40] == ()  # candidates 4 and 2 and neighbours 2, 4: none in the set
    assert set(dense[10]) <= {1, 3, 5} and 5 not in dense[10]  # the table's own K is no probe
    with pytest.raises(ValueError, match="period"):
        Explorer(dense, period=1)
