from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.spec_decode.dynamic.utils import (
    build_dynamic_sd_schedule_lookup,
    validate_and_normalize_dynamic_sd_schedule,
)

from schemas import DraftTable, TableError
from tests.test_schemas.strategies import draft_tables

VLLM_DOC_EXAMPLE = [[1, 16, 5], [17, 32, 4], [33, 64, 3], [65, 128, 1], [129, 512, 0]]


@settings(max_examples=150, deadline=None)
@given(draft_tables())
def test_vllm_round_trip_and_vllm_accepts(table):
    triples = table.to_vllm()
    assert DraftTable.from_vllm(triples) == table
    normalized = validate_and_normalize_dynamic_sd_schedule(triples)
    assert [list(t) for t in normalized] == triples
    table.validate(max_k=7, max_batch=table.max_batch)


@settings(max_examples=150, deadline=None)
@given(draft_tables())
def test_dense_matches_vllm_lookup(table):
    max_batch = table.max_batch
    dense = table.to_dense(max_batch)
    if max(table.k_values) > 0:
        vllm_dense = build_dynamic_sd_schedule_lookup(table.to_vllm(), max_batch, 7)
        assert dense[1:] == vllm_dense[1:]
    merged = DraftTable.from_dense(dense)
    assert merged.to_dense(max_batch) == dense
    assert len(merged.ranges) <= len(table.ranges)


@settings(max_examples=150, deadline=None)
@given(draft_tables())
def test_trtllm_round_trip(table):
    schedule = table.to_trtllm()
    assert list(schedule) == sorted(schedule)
    back = DraftTable.from_trtllm(schedule)
    assert back.to_dense(table.max_batch) == table.to_dense(table.max_batch)


def test_trtllm_semantics_keys_are_range_ends():
    table = DraftTable.from_vllm([[1, 4, 4], [5, 8, 2], [9, 32, 1]])
    assert table.to_trtllm() == {4: 4, 8: 2, 32: 1}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=7), min_size=2, max_size=300))
def test_from_dense_fewest_ranges(dense):
    dense = [0, *dense[1:]]
    table = DraftTable.from_dense(dense)
    assert table.to_dense(len(dense) - 1) == dense
    changes = sum(1 for a, b in zip(dense[1:], dense[2:], strict=False) if a != b)
    assert len(table.ranges) == changes + 1


def test_vllm_doc_example_is_valid_and_converts():
    table = DraftTable.from_vllm(VLLM_DOC_EXAMPLE).validate(max_k=5, max_batch=512)
    assert table.k_for(16) == 5 and table.k_for(17) == 4 and table.k_for(512) == 0
    assert table.to_trtllm() == {16: 5, 32: 4, 64: 3, 128: 1, 512: 0}


@pytest.mark.parametrize(
    ("triples", "max_k", "max_batch", "message"),
    [
        ([[2, 16, 3], [17, 64, 1]], 7, 64, r"\[2, 16, 3\]: the first range must start at 1"),
        ([[1, 16, 3], [10, 64, 1]], 7, 64, r"\[10, 64, 1\]: overlaps or is out of order"),
        ([[1, 16, 3], [20, 64, 1]], 7, 64, r"\[20, 64, 1\]: gap, batch sizes 17..19 have no K"),
        ([[1, 16, 9], [17, 64, 1]], 7, 64, r"\[1, 16, 9\]: K 9 exceeds the engine's max K 7"),
        ([[1, 16, -1], [17, 64, 1]], 7, 64, r"\[1, 16, -1\]: K -1 is negative"),
        ([[1, 16, 3], [30, 17, 1]], 7, 64, r"\[30, 17, 1\]: start 30 is after end 17"),
        ([[1, 16, 3], [17, 32, 1]], 7, 64, r"ends at batch size 32, it must cover up to max batch 64"),
        ([[0, 16, 3]], 7, 16, r"\[0, 16, 3\]: batch sizes start at 1"),
        ([[17, 64, 1], [1, 16, 3]], 7, 64, r"the first range must start at 1"),
    ],
)
def test_invalid_tables_name_the_problem(triples, max_k, max_batch, message):
    with pytest.raises(TableError, match=message):
        DraftTable.from_vllm(triples).validate(max_k, max_batch)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "non-empty list"),
        ({"1-16": 3}, "non-empty list"),
        ([[1, 16]], r"entry 0 is \[1, 16\], expected \[start, end, K\]"),
        ([[1, 16, "3"]], "expected three integers"),
        ([[1, 16, True]], "expected three integers"),
    ],
)
def test_malformed_tables_are_refused(raw, message):
    with pytest.raises(TableError, match=message):
        DraftTable.from_vllm(raw)
