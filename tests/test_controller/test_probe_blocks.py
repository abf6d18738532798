"""A one-engine key's probe blocks alternate with the table's own steps (`alternated`)."""

from __future__ import annotations

from controller.fleet.sweep_planner import alternated


def test_each_block_is_followed_by_as_long_at_the_table() -> None:
    """3 s at K4 and at K0: K4, the table 3 s, K0, then the table open-ended; the forced
    seconds are the granted ones."""
    blocks, lengths = alternated([(4, 3.0), (0, 3.0)])
    assert blocks == [4, None, 0, None]
    assert lengths == [3.0, 3.0, 3.0, 0.0]


def test_a_block_the_budget_cut_is_followed_by_its_own_length() -> None:
    blocks, lengths = alternated([(1, 3.0), (3, 1.4)])
    assert blocks == [1, None, 3, None]
    assert lengths == [3.0, 3.0, 1.4, 0.0]


def test_nothing_granted_is_no_block() -> None:
    assert alternated([]) == ([], [])
