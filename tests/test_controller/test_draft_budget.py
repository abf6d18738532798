"""Per-request draft budgets: parsing, checks against an engine, staging beside a table."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from controller.engine.table_switch import TableSwitch
from schemas import DraftTable, TableEnvelope, TableError, TableKey
from schemas.draft_budget import DraftBudget

BUDGET = {"min_match": 1, "ranges": [[1, 32, [2, 7]], [33, 256, [0, 1, 4]]]}


def test_k_by_match_length_holds_its_last_k_and_drafts_nothing_without_a_match():
    budget = DraftBudget.from_json(BUDGET).validate(max_k=7, max_batch=256)
    assert budget.k_by_match(8, max_match=4) == (0, 2, 7, 7, 7)
    assert budget.k_by_match(33, max_match=4) == (0, 0, 1, 4, 4)
    assert budget.k_by_match(300, max_match=2) == (0, 0, 1)  # past the last range: the last
    assert DraftBudget.from_json(budget.to_json()) == budget
    later = DraftBudget.from_json({"min_match": 3, "ranges": [[1, 256, [5]]]})
    assert later.k_by_match(1, max_match=4) == (0, 0, 0, 5, 5)


def test_the_dense_form_gives_each_batch_size_its_ks():
    dense = DraftBudget.from_json(BUDGET).to_dense(256, max_match=3)
    assert dense[1] == (0, 2, 7, 7) and dense[32] == (0, 2, 7, 7) and dense[40] == (0, 0, 1, 4)
    assert len(dense) == 257


@pytest.mark.parametrize("data, words", [
    ({"ranges": [[1, 256, [1]]]}, "min_match"),
    ({"min_match": 0, "ranges": [[1, 256, [1]]]}, "min_match"),
    ({"min_match": 1, "ranges": []}, "non-empty"),
    ({"min_match": 1, "ranges": [[1, 256, []]]}, "range 0"),
    ({"min_match": 1, "ranges": [[1, 256, 3]]}, "range 0"),
    ({"min_match": 1, "ranges": [[1, 256, [1, True]]]}, "range 0"),
    ({"min_match": 1, "ranges": [[1, 256, [1]] for _ in range(2000)]}, "more than"),
])
def test_a_malformed_budget_is_refused_by_name(data, words):
    with pytest.raises(TableError, match=words):
        DraftBudget.from_json(data)


@pytest.mark.parametrize("ranges, words", [
    ([[1, 100, [1]]], "max batch 256"),
    ([[1, 100, [1]], [90, 256, [2]]], "overlaps"),
    ([[2, 256, [1]]], "start at 1"),
    ([[1, 256, [1, 9]]], "K 9 is outside 0..7"),
])
def test_a_budget_that_does_not_fit_the_engine_is_refused(ranges, words):
    with pytest.raises(TableError, match=words):
        DraftBudget.from_json({"min_match": 1, "ranges": ranges}).validate(7, 256)


def test_an_envelope_carries_a_budget_and_is_unchanged_without_one():
    envelope = TableEnvelope(key=TableKey("m", "ngram", "h100"), version=2,
                             table=DraftTable.from_vllm([[1, 256, 7]]),
                             startup_k_values=tuple(range(8)), max_batch=256,
                             created_at="2026-12-05T00:00:00Z")
    assert "budget" not in json.loads(envelope.to_json())
    with_budget = replace(envelope, budget=DraftBudget.from_json(BUDGET))
    parsed = TableEnvelope.from_json(with_budget.to_json()).validate()
    assert parsed.budget == with_budget.budget
    only_some = replace(with_budget, startup_k_values=(0, 2, 4, 7))
    with pytest.raises(TableError, match=r"budget K values \[1\]"):
        only_some.validate()


def test_the_switch_applies_a_budget_between_steps_and_refuses_one_it_cannot_use():
    table = DraftTable.from_vllm([[1, 256, 4]])
    switch = TableSwitch(table, max_k=7, max_batch=256, max_match=2)
    assert switch.budget_for(10) is None
    switch.stage(table, 1, budget=DraftBudget.from_json(BUDGET))
    assert switch.budget_for(10) is None  # staged, not applied
    switch.apply_staged()
    switch.k_for_step(10)
    assert switch.budget_for(10) == (0, 2, 7)  # beside the table, not under it
    switch.stage(table, 2, forced=True)
    switch.apply_staged()
    switch.k_for_step(10)
    assert switch.budget_for(10) is None
    blind = TableSwitch(table, max_k=7, max_batch=256)
    with pytest.raises(TableError, match="match length"):
        blind.stage(table, 1, budget=DraftBudget.from_json(BUDGET))
    assert blind.version == 0 and not blind.pending
