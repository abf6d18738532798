"""A step's latency from the hook's clocks, under synchronous and async scheduling."""

from __future__ import annotations

import pytest

from producers.vllm_steps import RawStep, step_latency_s
from schemas.step_checks import MAX_STEP_LATENCY_S


def raw(schedule_s: float, update_s: float, previous_update_s: float | None, *,
        async_scheduling: bool) -> RawStep:
    return RawStep(schedule_start_s=schedule_s, update_start_s=update_s,
                   previous_update_start_s=previous_update_s, scheduler_output=None,
                   sampled_lengths=[], req_id_to_index={}, table_version=0, forced=False,
                   async_scheduling=async_scheduling, max_positions=4, ts_ns=0)


def test_sync_steps_run_from_schedule_to_update() -> None:
    assert step_latency_s(raw(10.0, 10.02, 9.99, async_scheduling=False)) == pytest.approx(0.02)


def test_overlapped_async_steps_are_the_gap_between_updates() -> None:
    # step N was scheduled while step N-1 ran (before N-1's update): the step is the gap
    assert step_latency_s(raw(10.00, 10.05, 10.03, async_scheduling=True)) == pytest.approx(0.02)


def test_the_first_async_step_and_one_after_idle_time_are_their_own_span() -> None:
    # the first step has no previous update: a gap of 0 was dead-lettered as invalid
    first = step_latency_s(raw(5.0, 5.03, None, async_scheduling=True))
    assert first == pytest.approx(0.03) and first > 0
    # scheduled 60 s after the previous update (no traffic): not a 60 s step
    after_idle = step_latency_s(raw(70.0, 70.04, 10.0, async_scheduling=True))
    assert after_idle == pytest.approx(0.04) and after_idle < MAX_STEP_LATENCY_S
