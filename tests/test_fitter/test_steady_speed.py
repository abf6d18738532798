"""Step times at the machine's steady speed: a slow spell shared by the table's steps and a
probe's blocks is taken out of both."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from fitter.steady_speed import MIN_REFERENCE_STEPS, at_steady_speed, speed_index

STEP_S = {1: 0.050, 2: 0.066}
"""Step time at 16 requests per K, as the 2-core host ran K1 and K2."""


def _probe(spell: tuple[float, float] | None, slowdown: float = 1.35, seed: int = 0
           ) -> pa.Table:
    """40 s at 16 requests: the table's K2, and from 20 s on K1 in 3 s blocks with 3 s of the
    table between them; every step `slowdown` times slower inside `spell`; 2% step noise."""
    rng = np.random.default_rng(seed)
    ts, k, forced, latency = [], [], [], []
    now = 0.0
    while now < 40.0:
        probing = now >= 20.0 and now % 6.0 < 3.0
        value = 1 if probing else 2
        cost = STEP_S[value] * rng.normal(1.0, 0.02)
        if spell is not None and spell[0] <= now < spell[1]:
            cost *= slowdown
        ts.append(now)
        k.append(value)
        forced.append(probing)
        latency.append(cost)
        now += cost
    rows = len(ts)
    return pa.table({
        "ts_ns": pa.array((np.array(ts) * 1e9).astype(np.int64)),
        "batch_size": pa.array(np.full(rows, 16), pa.int32()),
        "num_prefill_reqs": pa.array(np.zeros(rows, np.int32)),
        "k": pa.array(k, pa.int16()),
        "k_next": pa.array(k, pa.int16()),
        "forced": pa.array(forced),
        "step_latency_s": pa.array(latency, pa.float64()),
    })


def _median_step_s(records: pa.Table, k: int) -> float:
    values = records.column("step_latency_s").to_numpy()
    return float(np.median(values[records.column("k").to_numpy() == k]))


def test_a_spell_over_the_probes_blocks_is_taken_out_of_them() -> None:
    """The spell covers every K1 block and half the table's K2 steps: as measured, a K1 step
    costs about what a K2 step does; at steady speed it costs its own 0.76 of one again."""
    records = _probe(spell=(19.0, 41.0))
    raw = _median_step_s(records, 1) / _median_step_s(records, 2)
    steady = at_steady_speed(records)
    ratio = _median_step_s(steady, 1) / _median_step_s(steady, 2)
    truth = STEP_S[1] / STEP_S[2]
    assert raw > truth * 1.15, raw  # the bias the fit would have read
    assert abs(ratio / truth - 1.0) < 0.04, (ratio, truth)
    assert steady.schema == records.schema


def test_a_machine_at_one_speed_is_left_as_it_ran() -> None:
    """No spell: the speed index stays within the steps' own noise, and the K's costs
    within 1% of what they ran."""
    records = _probe(spell=None)
    speed = speed_index(records)
    assert np.all(np.abs(speed - 1.0) < 0.03), np.percentile(speed, [0, 100])
    steady = at_steady_speed(records)
    for k in STEP_S:
        assert abs(_median_step_s(steady, k) / _median_step_s(records, k) - 1.0) < 0.01


def test_steps_far_from_any_reference_are_left_as_measured() -> None:
    """A stretch with fewer than MIN_REFERENCE_STEPS of the table's steady steps near: no
    speed is read there (the steps forced, or all prefill)."""
    records = _probe(spell=(0.0, 41.0))
    forced = pa.array(np.ones(records.num_rows, dtype=bool))
    all_forced = records.set_column(records.schema.get_field_index("forced"), "forced", forced)
    assert MIN_REFERENCE_STEPS > 0
    assert np.all(speed_index(all_forced) == 1.0)
    assert at_steady_speed(all_forced).equals(all_forced)
