"""The budget derivation: long matches draft deep, short ones stop drafting under load."""

from __future__ import annotations

import numpy as np
import pytest

from fitter.budget import acceptance_lengths, best_ks, derive_budget, goodput, with_budget
from schemas import DraftTable, TableEnvelope, TableKey
from schemas.draft_budget import DraftBudget

STEP_FIXED_S = 0.01
PER_TOKEN_S = 2e-4


def linear_latency(batch_size: int, drafts: np.ndarray) -> np.ndarray:
    """A step costs a fixed part and a part per verified token."""
    return STEP_FIXED_S + PER_TOKEN_S * batch_size * (1.0 + np.asarray(drafts))


def test_acceptance_length_chains_the_conditional_rates():
    assert acceptance_lengths([0.5, 0.5], 3).tolist() == [1.0, 1.5, 1.75, 1.875]
    assert acceptance_lengths([], 2).tolist() == [1.0, 1.0, 1.0]


def test_a_lone_request_drafts_deep_and_a_full_batch_drops_the_weak_matches():
    conditional = [[0.0], [0.2], [0.95]]  # length 0: no match; 1: weak; 2: strong
    share = [0.2, 0.4, 0.4]
    budget = derive_budget([0] + [7] * 256, conditional, share, linear_latency)
    alone = budget.k_by_match(1, max_match=2)
    assert alone[0] == 0 and alone[1] >= 1 and alone[2] == 7
    busy = budget.k_by_match(256, max_match=2)
    assert busy[1] == 0 and 1 <= busy[2] < 7
    assert len(budget.ranges) < 16  # equal neighbours merge


def test_the_budget_beats_every_uniform_k_by_its_own_model():
    conditional = [[0.0], [0.3], [0.6], [0.9]]
    share = np.array([0.1, 0.3, 0.3, 0.3])
    lengths = np.stack([acceptance_lengths(c, 7) for c in conditional])

    def goodput(batch_size: int, ks: tuple[int, ...]) -> float:
        rows = np.arange(len(ks))
        tokens = share @ lengths[rows, list(ks)]
        return float(batch_size * tokens
                     / linear_latency(batch_size, np.array([share @ np.array(ks)]))[0])

    for batch_size in (1, 16, 64, 256):
        ks = best_ks(batch_size, 7, lengths, share, linear_latency)
        uniform = max(goodput(batch_size, (0,) + (k,) * 3) for k in range(8))
        assert goodput(batch_size, ks) >= uniform * (1 - 1e-12)
        assert list(ks[1:]) == sorted(ks[1:])  # a longer match never drafts less here


def test_the_table_caps_the_budget_and_bad_shapes_are_refused():
    conditional, share = [[0.0], [0.99]], [0.0, 1.0]
    budget = derive_budget([0, 2, 2, 5], conditional, share, linear_latency)
    assert budget.k_by_match(1, 1) == (0, 2) and budget.k_by_match(3, 1) == (0, 5)
    with pytest.raises(ValueError, match="one entry per match length"):
        derive_budget([0, 2], conditional, [1.0], linear_latency)
    with pytest.raises(ValueError, match="min_match"):
        derive_budget([0, 2], conditional, share, linear_latency, min_match=2)


def test_the_table_stands_where_a_budget_would_gain_too_little():
    """Two lengths that accept almost alike: against the best uniform K at each batch size
    (the table), K by length gains less than MIN_GAIN, so the budget drafts the table's
    K; with lengths far apart it departs from it."""

    def best_uniform(conditional: list[list[float]], share: list[float]) -> list[int]:
        lengths = np.stack([acceptance_lengths(c, 7) for c in conditional])
        rates = np.asarray(share)
        return [0] + [max(range(8), key=lambda k, b=b: goodput(
            b, (0,) + (k,) * (len(share) - 1), lengths, rates, linear_latency))
            for b in range(1, 65)]

    alike, share = [[0.0], [0.70], [0.72]], [0.1, 0.45, 0.45]
    table = best_uniform(alike, share)
    budget = derive_budget([0] + [7] * 64, alike, share, linear_latency, table_by_batch=table)
    for start, _, ks in budget.ranges:
        assert ks == (table[start],) * 2  # one K for both lengths: the table's
    apart = [[0.0], [0.1], [0.97]]
    table = best_uniform(apart, share)
    budget = derive_budget([0] + [7] * 64, apart, share, linear_latency, table_by_batch=table)
    assert budget.k_by_match(64, max_match=2) != (0, table[64], table[64])


def test_a_budget_uses_only_the_engines_k_values_and_never_costs_the_table():
    budget = derive_budget([0] + [7] * 256, [[0.0], [0.05], [0.97]], [0.1, 0.45, 0.45],
                           linear_latency, k_values=(2, 4, 7))
    assert {k for _, _, ks in budget.ranges for k in ks} <= {2, 4, 7}
    envelope = TableEnvelope(key=TableKey("m", "ngram", "h100"), version=1,
                             table=DraftTable.from_vllm([[1, 256, 2]]),
                             startup_k_values=(2, 4, 7), max_batch=256,
                             created_at="2026-12-05T00:00:00Z")
    outside = DraftBudget(min_match=1, ranges=((1, 256, (0, 7)),))
    kept = with_budget(envelope, outside)
    assert kept.budget is None and "budget_refused" in kept.provenance
    assert with_budget(envelope, budget).budget == budget
