"""The ranges yardstick: how many ranges the measured best K asks for, and A-B-A in a table."""

from __future__ import annotations

from bench.table_ranges import acceptable, ranges_needed, returns


def test_a_k_within_the_tolerance_is_as_good_as_the_best():
    assert acceptable({5: 100.0, 6: 99.5, 7: 98.0}, 0.01) == {5, 6}
    assert acceptable({5: 100.0, 6: 99.5, 7: 98.0}, 0.0) == {5}


def test_a_staircase_of_near_ties_needs_fewer_ranges_than_its_argmax_has_changes():
    # argmax 7 6 7 6 5 (four changes); K6 is within the tolerance from the first load to the
    # fourth, K5 only at the last
    sets = [frozenset({6, 7}), frozenset({6}), frozenset({6, 7}), frozenset({5, 6}),
            frozenset({5})]
    assert ranges_needed(sets) == [(0, 3, 6), (4, 4, 5)]


def test_a_real_step_is_kept_and_the_smaller_k_taken_in_a_tie():
    sets = [frozenset({7}), frozenset({7}), frozenset({3, 4}), frozenset({3, 4})]
    assert ranges_needed(sets) == [(0, 1, 7), (2, 3, 3)]
    assert ranges_needed([frozenset({2})]) == [(0, 0, 2)]


def test_a_return_to_an_earlier_k_is_counted_once_per_range():
    assert returns([[1, 10, 7], [11, 11, 6], [12, 22, 7], [23, 24, 6], [25, 28, 7]]) == 3
    assert returns([[1, 25, 7], [26, 43, 6], [44, 128, 5]]) == 0
    assert returns([[1, 2, 5], [3, 5, 3], [6, 19, 5]]) == 1
