"""A periodic refit is worth a swap only for a gain on today's load that its own surface can
tell from noise."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from controller.fleet.key_fit import MIN_FIT_RECORDS, MIN_FIT_STEPS, fittable
from controller.fleet.refit_gate import (
    k_shift,
    load_moved,
    measured_load,
    own_steps_miss,
    predicted_gain,
    running_unmeasured,
)
from controller.steps import StepColumns
from schemas import DraftTable, TableEnvelope, TableKey

BATCH = [1, 8, 16, 32, 64]


def envelope(triples: list[list[int]], goodput_k4: float, stderr: float) -> TableEnvelope:
    """A surface where K3 makes 1000 tok/s at every batch size and K4 `goodput_k4`, each
    with `stderr`."""
    surface: dict[str, Any] = {
        "batch_sizes": BATCH, "k_values": [3, 4],
        "goodput_tok_s": [[1000.0, goodput_k4] for _ in BATCH],
        "goodput_stderr_tok_s": [[stderr, stderr] for _ in BATCH]}
    return TableEnvelope(key=TableKey.parse("m|d|h"), version=2,
                         table=DraftTable.from_vllm(triples), startup_k_values=(3, 4),
                         max_batch=64, created_at="2026-11-30T00:00:00Z", surface=surface)


def test_the_gain_counts_only_the_batch_sizes_that_ran() -> None:
    candidate = envelope([[1, 16, 3], [17, 64, 4]], goodput_k4=1100.0, stderr=5.0)
    current = DraftTable.from_vllm([[1, 64, 3]])
    assert predicted_gain(candidate, current, np.full(100, 8))[0] == 0.0
    assert predicted_gain(candidate, current, np.full(100, 64))[0] == pytest.approx(0.10)
    assert predicted_gain(candidate, current, np.full(100, 8))[1] == 0.0


def test_a_gain_within_the_surfaces_noise_has_a_stderr_as_large() -> None:
    current = DraftTable.from_vllm([[1, 64, 3]])
    batch = np.full(100, 64)
    sure = envelope([[1, 64, 4]], goodput_k4=1020.0, stderr=2.0)
    unsure = envelope([[1, 64, 4]], goodput_k4=1020.0, stderr=20.0)
    assert predicted_gain(sure, current, batch)[0] == pytest.approx(0.02)
    assert predicted_gain(sure, current, batch)[1] == pytest.approx(np.hypot(2.0, 2.0) / 1000.0)
    gain, stderr = predicted_gain(unsure, current, batch)
    assert stderr == pytest.approx(np.hypot(20.0, 20.0) / 1000.0)
    assert stderr > gain / 2


def test_tables_that_differ_between_grid_points_differ() -> None:
    """The surface has no row between 32 and 64; the current table runs K4 over 41-63 and
    the candidate K3 there. At 60 users the swap is the grid row 64's K3-over-K4 gain."""
    candidate = envelope([[1, 64, 3]], goodput_k4=950.0, stderr=1.0)
    current = DraftTable.from_vllm([[1, 40, 3], [41, 63, 4], [64, 64, 3]])
    gain, stderr = predicted_gain(candidate, current, np.full(100, 60))
    assert gain == pytest.approx(1000.0 / 950.0 - 1.0)
    assert stderr > 0
    assert predicted_gain(candidate, current, np.full(100, 64)) == (0.0, 0.0)


def test_a_running_table_is_unmeasured_where_most_steps_ran_past_its_fits_load() -> None:
    one_load = envelope([[1, 64, 4]], goodput_k4=1020.0, stderr=2.0)
    one_load = dataclasses.replace(one_load, surface={**one_load.surface,
                                                      "measured_requests": 1})
    wide = envelope([[1, 64, 4]], goodput_k4=1020.0, stderr=2.0)  # no measured_requests
    sixteen = np.full(100, 16)
    assert running_unmeasured(one_load, sixteen)
    assert not running_unmeasured(one_load, np.ones(100, dtype=np.int64))
    assert not running_unmeasured(one_load, np.r_[np.ones(60), np.full(40, 16)].astype(int))
    assert not running_unmeasured(wide, sixteen)
    # a fit that told requests from steps at 1 and 2 still measured no batch past 2
    identified = dataclasses.replace(wide, surface={**wide.surface, "measured_batch_max": 2})
    assert running_unmeasured(identified, sixteen)
    assert not running_unmeasured(identified, np.full(100, 2))
    assert not running_unmeasured(None, sixteen)  # the startup table
    assert not running_unmeasured(one_load, np.zeros(0, dtype=np.int64))


def test_the_measured_load_is_the_largest_batch_size_measured() -> None:
    """A fit that told requests from steps (a profile at 1 and 2 requests) names no
    measured request count, yet it measured nothing past 2: the largest batch size with
    steps enough says so; an envelope from before that field falls back to the count."""
    base = envelope([[1, 64, 4]], goodput_k4=1020.0, stderr=2.0)

    def with_surface(**fields: int) -> TableEnvelope:
        return dataclasses.replace(base, surface={**base.surface, **fields})

    assert measured_load(with_surface(measured_batch_max=2)) == 2.0
    assert measured_load(with_surface(measured_batch_max=17, measured_requests=16)) == 17.0
    assert measured_load(with_surface(measured_requests=16)) == 16.0
    assert measured_load(base) is None
    assert measured_load(None) is None


def test_a_fit_needs_200_steps_or_200_decoding_requests_over_50() -> None:
    """A slow engine's few steps at 16 requests make a fit's worth of acceptance and step
    times sooner than 200 steps; a handful of busy steps, or idle ones, do not."""
    def steps(n: int, decode: int) -> pa.Table:
        return pa.table({"num_decode_reqs": np.full(n, decode, dtype=np.int64)})

    assert fittable(steps(MIN_FIT_RECORDS, 0))  # as before: 200 steps of anything
    assert fittable(steps(MIN_FIT_STEPS, 4))  # 50 steps of 4 requests
    assert not fittable(steps(MIN_FIT_STEPS - 1, 64))  # too few step times
    assert not fittable(steps(MIN_FIT_RECORDS - 1, 1))  # 199 requests
    assert not fittable(None)


def test_a_swing_of_users_moves_the_load_and_a_wander_of_arrivals_does_not() -> None:
    sixteen = np.array([16, 15, 16, 12, 16, 14, 16] * 100, dtype=np.int64)
    one = np.ones(40, dtype=np.int64)
    assert load_moved(sixteen, one) and load_moved(one, sixteen)
    assert not load_moved(sixteen, np.array([12, 13, 14, 16] * 10, dtype=np.int64))
    assert not load_moved(np.zeros(500, dtype=np.int64), one)  # idle steps read as one
    assert not load_moved(sixteen, np.zeros(0, dtype=np.int64))


def test_a_change_at_the_load_now_is_judged_there_not_over_the_old_loads_steps() -> None:
    """The window still holds the old load (64) where the candidate gains 10% clear of its
    error; at the new load (1) it swaps K on a 2% gain inside a 1.4% error. Judged on the
    newest steps, as a follow-up is once the load moved, the gain does not clear 2 errors."""
    surface: dict[str, Any] = {
        "batch_sizes": BATCH, "k_values": [3, 4],
        "goodput_tok_s": [[1000.0, 1020.0], *[[1000.0, 1100.0] for _ in BATCH[1:]]],
        "goodput_stderr_tok_s": [[10.0, 10.0] for _ in BATCH]}
    candidate = dataclasses.replace(envelope([[1, 64, 4]], goodput_k4=1100.0, stderr=1.0),
                                    surface=surface)
    current = DraftTable.from_vllm([[1, 64, 3]])
    window = np.concatenate([np.full(1500, 64), np.ones(500)]).astype(np.int64)
    newest = np.ones(200, dtype=np.int64)
    assert load_moved(window, newest)
    gain, stderr = predicted_gain(candidate, current, window)
    assert gain > 0.07 and gain > 2 * stderr
    gain, stderr = predicted_gain(candidate, current, newest)
    assert gain == pytest.approx(0.02) and gain < 2 * stderr


def drafting_steps(k: list[int], accepted: list[int], forced: list[bool]) -> StepColumns:
    """One engine's steps of 10 drafting requests each."""
    n = len(k)
    drafts = np.full(n, 10)
    return StepColumns(
        t_s=np.arange(n, dtype=np.float64), batch_size=drafts, decode_reqs=drafts,
        prefill_reqs=np.zeros(n, np.int64), k=np.asarray(k), k_next=np.asarray(k),
        num_drafts=drafts, accepted=np.asarray(accepted), latency_s=np.full(n, 0.01),
        version=np.full(n, 2), forced=np.asarray(forced))


def test_a_surface_is_held_to_the_running_tables_own_steps() -> None:
    """The miss is tokens a drafting request over the surface's prediction, on the steps that
    ran the table's K only: a forced step, and the step after it (which verified the forced
    drafts), are left out."""
    candidate = dataclasses.replace(
        envelope([[1, 64, 3]], goodput_k4=1000.0, stderr=1.0),
        surface={**envelope([[1, 64, 3]], 1000.0, 1.0).surface,
                 "acceptance_length": [2.0, 2.5], "tokens_per_request": [1.5, 1.75],
                 "draft_share": 0.5})
    # a drafting request emits 1 + (1.5 - 1) / 0.5 = 2.0 tokens at K3 as predicted
    on_prediction = drafting_steps([3, 3, 3], [10, 10, 10], [False] * 3)
    assert own_steps_miss(candidate, on_prediction) == pytest.approx(0.0)
    richer = drafting_steps([3, 4, 3, 3], [15, 40, 40, 15], [False, True, False, False])
    assert own_steps_miss(candidate, richer) == pytest.approx(0.25)  # 25 / 20 a step
    assert own_steps_miss(candidate, drafting_steps([0, 0], [0, 0], [False] * 2)) is None
    bare = dataclasses.replace(candidate, surface={"batch_sizes": BATCH, "k_values": [3, 4]})
    assert own_steps_miss(bare, on_prediction) is None


def test_a_moves_direction_is_read_where_the_steps_ran() -> None:
    """K5 over K7 at 32 users, K7 over K3 at 4: the move is down where 32 users ran, up
    where 4 did, and nothing where the tables agree."""
    current = DraftTable.from_vllm([[1, 8, 3], [9, 64, 7]])
    candidate = DraftTable.from_vllm([[1, 8, 7], [9, 64, 5]])
    assert k_shift(candidate, current, np.full(50, 32)) == pytest.approx(-2.0)
    assert k_shift(candidate, current, np.full(50, 4)) == pytest.approx(4.0)
    assert k_shift(candidate, current, np.array([4, 32])) == pytest.approx(1.0)
    assert k_shift(current, current, np.full(50, 32)) == 0.0
    assert k_shift(candidate, current, np.zeros(0, np.int64)) == 0.0
