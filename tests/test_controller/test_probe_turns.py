"""A one-engine key's probe blocks run in turns between the table's (`interleaved`)."""

from __future__ import annotations

from controller.fleet.sweep_planner import PROBE_RUN_S, interleaved


def test_each_k_takes_turns_with_the_table_between() -> None:
    """3 s at K4 and at K0 in 1 s turns: K4, table, K0, table, ... and the table open-ended
    after the last; the forced seconds are the granted ones."""
    blocks, lengths = interleaved([(4, 3.0), (0, 3.0)], 1.0)
    assert blocks == [4, None, 0, None] * 3
    assert lengths[:-1] == [1.0] * 11 and lengths[-1] == 0.0
    forced = sum(length for k, length in zip(blocks, lengths, strict=True) if k is not None)
    assert forced == 6.0


def test_a_block_the_budget_cut_takes_fewer_turns() -> None:
    """K1 granted 3 s and K3 only 1.4 s: K3's one turn comes first round, K1's others after."""
    blocks, lengths = interleaved([(1, 3.0), (3, 1.4)], 1.0)
    assert [k for k in blocks if k is not None] == [1, 3, 1, 1]
    assert lengths[2] == 1.4 and lengths[3] == 1.4


def test_turns_as_long_as_the_block_make_one_block() -> None:
    """Turns no shorter than the block (a loop that ticks every 2 s): one block per K."""
    blocks, _ = interleaved([(7, 3.0)], 4.0)
    assert blocks == [7, None]
    assert interleaved([], PROBE_RUN_S) == ([], [])
