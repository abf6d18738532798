"""Per-request sums: what a finished request's rows say, and that slots are reused safely."""

from __future__ import annotations

import numpy as np
import pytest

from producers.request_ledger import RequestLedger, generation_segment, to_arrow


def finish(ledger: RequestLedger, requests: list[int]) -> list[dict]:
    """The rows as the telemetry column carries them."""
    return to_arrow([ledger.finish(requests)], ledger.max_positions).to_pylist()[0]


def test_segments_are_octaves_of_generated_tokens():
    assert generation_segment([0, 1, 2, 3, 4, 7, 8, 4095, 4096, 10**6]).tolist() == [
        0, 0, 1, 1, 2, 2, 3, 11, 12, 12]


def test_a_finished_request_reports_its_steps_by_segment():
    ledger = RequestLedger(max_positions=3)
    # request 7: two steps in segment 1 (generated 2, 3), one in segment 2 (generated 5);
    # request 9 runs alongside and stays
    ledger.observe([7, 9], generated=[2, 1], drafted=[3, 3], accepted=[3, 0],
                   emitted=[4, 1], context=[102, 51])
    ledger.observe([7, 9], generated=[3, 2], drafted=[3, 0], accepted=[1, 0],
                   emitted=[2, 1], context=[106, 52])
    ledger.observe([7], generated=[5], drafted=[2], accepted=[0], emitted=[1], context=[108])
    rows = finish(ledger, [7])
    assert rows == [
        {"request": 0, "segment": 1, "decode_steps": 2, "drafting_steps": 2, "tokens": 6,
         "context_tokens": 208, "reached_per_pos": [2, 2, 1], "accepted_per_pos": [2, 1, 1]},
        {"request": 0, "segment": 2, "decode_steps": 1, "drafting_steps": 1, "tokens": 1,
         "context_tokens": 108, "reached_per_pos": [1, 0, 0], "accepted_per_pos": [0, 0, 0]},
    ]
    assert finish(ledger, [7]) == []  # handed over once
    first, second = finish(ledger, [9])  # generated 1, then 2: segments 0 and 1
    assert (first["segment"], second["segment"]) == (0, 1)
    assert first["reached_per_pos"] == [1, 0, 0]  # drafted 3, the first one rejected
    assert second["drafting_steps"] == 0 and second["reached_per_pos"] == [0, 0, 0]


def test_requests_are_numbered_per_call_and_aborted_ones_dropped():
    ledger = RequestLedger(max_positions=2)
    ledger.observe([1, 2, 3], generated=[1, 1, 1], drafted=[1, 1, 1], accepted=[1, 0, 1],
                   emitted=[2, 1, 2], context=[10, 10, 10])
    ledger.discard([2])
    rows = finish(ledger, [3, 2, 1])
    assert [(r["request"], r["tokens"]) for r in rows] == [(0, 2), (1, 2)]


def test_a_slot_taken_by_a_newer_request_restarts_and_is_counted():
    ledger = RequestLedger(max_positions=1, ring=4)
    ledger.observe([1], generated=[1], drafted=[1], accepted=[1], emitted=[2], context=[5])
    ledger.observe([5], generated=[1], drafted=[1], accepted=[0], emitted=[1], context=[6])
    assert ledger.slots_reused == 1
    assert finish(ledger, [1]) == []
    assert finish(ledger, [5])[0]["tokens"] == 1
    with pytest.raises(ValueError, match="power of two"):
        RequestLedger(max_positions=1, ring=6)


def test_accepted_is_capped_at_what_was_drafted():
    ledger = RequestLedger(max_positions=4)
    ledger.observe(np.array([0]), generated=[1], drafted=[2], accepted=[5], emitted=[3],
                   context=[1])
    (row,) = finish(ledger, [0])
    assert row["reached_per_pos"] == [1, 1, 0, 0]
    assert row["accepted_per_pos"] == [1, 1, 0, 0]


def test_one_draft_length_for_the_whole_step():
    ledger = RequestLedger(max_positions=3)
    ledger.observe([4, 5], generated=[1, 1], drafted=2, accepted=[2, 0], emitted=[3, 1],
                   context=[10, 20])
    rows = finish(ledger, [4, 5])
    assert [r["reached_per_pos"] for r in rows] == [[1, 1, 0], [1, 0, 0]]
    assert [r["accepted_per_pos"] for r in rows] == [[1, 1, 0], [0, 0, 0]]


def test_a_frame_column_keeps_each_steps_rows_apart():
    ledger = RequestLedger(max_positions=2)
    ledger.observe([1, 2], generated=[1, 300], drafted=2, accepted=[1, 2], emitted=[2, 3],
                   context=[5, 400])
    column = to_arrow([ledger.finish([1]), (), ledger.finish([2])], 2).to_pylist()
    assert [len(rows) for rows in column] == [1, 0, 1]
    assert column[2][0]["segment"] == 8 and column[2][0]["context_tokens"] == 400
    with pytest.raises(ValueError, match="columns"):
        to_arrow([np.zeros((1, 5), dtype=np.int64)], 2)


@pytest.mark.parametrize("ring", [4096, 4])  # 4: requests 11 and 15 share a slot
def test_several_steps_at_once_sum_as_one_observe_per_step(ring):
    rng = np.random.default_rng(3)
    steps, requests = 6, 5
    generated = 1 + np.cumsum(rng.integers(1, 4, size=(steps, requests)), axis=0)
    accepted = rng.integers(0, 4, size=(steps, requests))
    emitted = accepted + 1
    context = 100 + generated
    ids = [11, 12, 13, 14, 15]
    one, many = RequestLedger(3, ring=ring), RequestLedger(3, ring=ring)
    for s in range(steps):
        one.observe(ids, generated=generated[s], drafted=3, accepted=accepted[s],
                    emitted=emitted[s], context=context[s])
    many.observe_steps(ids, generated=generated, drafted=3, accepted=accepted,
                       emitted=emitted, context=context)
    assert one.slots_reused == many.slots_reused == (0 if ring > 4 else steps - 1)
    rows = many.finish(ids)
    assert np.array_equal(one.finish(ids), rows) and rows.shape[0] > 0
    assert many.finish(ids).shape[0] == 0


def test_steps_one_per_element_sum_as_one_observe_per_step():
    one, flat = RequestLedger(max_positions=2), RequestLedger(max_positions=2)
    steps = [([3, 4], [1, 1], [2, 0], [3, 1], [10, 20]), ([3, 4], [4, 2], [1, 2], [2, 3], [13, 21])]
    for ids, generated, accepted, emitted, context in steps:
        one.observe(ids, generated=generated, drafted=2, accepted=accepted, emitted=emitted,
                    context=context)
    flat.observe_flat([4, 3, 4, 3], generated=[2, 4, 1, 1], drafted=2, accepted=[2, 1, 0, 2],
                      emitted=[3, 2, 1, 3], context=[21, 13, 20, 10])
    assert np.array_equal(one.finish([3, 4]), flat.finish([3, 4]))
    with pytest.raises(ValueError, match="share a slot"):
        RequestLedger(max_positions=2, ring=4).observe_flat(
            [1, 5], generated=[1, 1], drafted=1, accepted=[0, 0], emitted=[1, 1],
            context=[1, 1])
