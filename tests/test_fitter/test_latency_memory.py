"""Latency remembered across fits: a load measured before is priced as measured."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from fitter.derive import derive_envelope
from fitter.surface.fit import MEASURED_BATCH_STEPS, fit_surface
from fitter.surface.latency import decode_matrix
from fitter.surface.latency_memory import LatencyCells
from fitter.surface.synthetic import H100_EAGLE, make_step_records
from schemas.envelope import TableKey
from tests.test_fitter.conftest import MAX_BATCH, MAX_K

CONTEXT = 512.0


def _at_batch(records: pa.Table, low: int, high: int) -> pa.Table:
    batch = records.column("batch_size")
    return records.filter(pc.and_(pc.greater_equal(batch, low), pc.less_equal(batch, high)))


def _records(seed: int, low: int, high: int, start_s: int = 0) -> pa.Table:
    return _at_batch(make_step_records(60_000, seed=seed, max_batch=MAX_BATCH,
                                       context_tokens=CONTEXT,
                                       start_ns=1_700_000_000_000_000_000 + start_s * 10**9),
                     low, high)


def _error_at(fit, batch: int) -> float:
    """Worst relative latency error over K at `batch`, against the cost model's truth."""
    k = np.arange(MAX_K + 1)
    b = np.full(k.size, batch)
    predicted = fit.latency.predict(decode_matrix(b, k, CONTEXT))
    return float(np.max(np.abs(predicted / H100_EAGLE.decode_latency_s(b, k, CONTEXT) - 1)))


def test_a_remembered_load_is_priced_as_measured() -> None:
    # one batch size, as a closed loop at one load runs: alone, the fit cannot tell what a
    # request costs from what a step costs, and its extrapolation to 128 is far off
    small, large = _records(1, 16, 16), _records(2, 120, 136)
    alone = fit_surface(small, max_k=MAX_K, max_batch=MAX_BATCH, half_life_s=None)
    memory = LatencyCells.from_records(large)
    recalled = fit_surface(small, max_k=MAX_K, max_batch=MAX_BATCH, half_life_s=None,
                           latency_memory=memory)
    assert _error_at(alone, 128) > 0.2
    assert _error_at(recalled, 128) < 0.03
    assert _error_at(recalled, 16) < 0.03  # the window's own load stays right
    # acceptance is the window's alone: the memory carries step times, not acceptance
    np.testing.assert_allclose(recalled.acceptance.conditional_, alone.acceptance.conditional_)


def test_cells_measured_again_replace_the_old() -> None:
    old = LatencyCells.from_records(_records(3, 12, 20))
    slower = _records(4, 12, 20)
    slower = slower.set_column(slower.schema.get_field_index("step_latency_s"),
                               "step_latency_s",
                               pc.multiply(slower.column("step_latency_s"), 1.5))
    new = LatencyCells.from_records(slower)
    merged = old.merged(new)
    assert len(merged) == len(np.unique(merged.keys()))
    shared = np.isin(merged.keys(), new.keys())
    assert shared.sum() == len(new)
    by_key = dict(zip(new.keys().tolist(), new.y.tolist(), strict=True))
    assert all(by_key[key] == y for key, y in
               zip(merged.keys()[shared].tolist(), merged.y[shared].tolist(), strict=True))
    assert merged.batch_range() == (12, 20)


def test_the_memory_is_bounded_oldest_first() -> None:
    first = LatencyCells.from_records(_records(5, 1, 8))
    second = LatencyCells.from_records(_records(6, 100, 140, start_s=3600))
    merged = first.merged(second, max_cells=len(second) + 3)
    assert len(merged) == len(second) + 3
    assert np.isin(second.keys(), merged.keys()).all()


def test_a_batch_size_is_measured_in_the_window_or_the_memory() -> None:
    window, remembered = _records(5, 16, 16), _records(6, 120, 121)
    fit = fit_surface(window, max_k=MAX_K, max_batch=MAX_BATCH, half_life_s=None,
                      latency_memory=LatencyCells.from_records(remembered))
    assert fit.measured_batch is not None
    assert list(np.flatnonzero(fit.measured_batch) + 1) == [16, 120, 121]
    envelope = derive_envelope(fit, key=TableKey("m", "eagle", "h100"), version=1,
                               max_k=MAX_K, max_batch=MAX_BATCH,
                               startup_k_values=range(MAX_K + 1))
    assert envelope.surface["measured_batch_max"] == 121  # what the loop's check reads
    few = window.slice(0, MEASURED_BATCH_STEPS - 1)  # one step short at its only batch size
    assert not fit_surface(few, max_k=MAX_K, max_batch=MAX_BATCH,
                           half_life_s=None).measured_batch.any()


def test_cells_round_trip_through_json_exactly() -> None:
    """What a control service publishes of a key's latency knowledge is what its successor
    reads: every float to the bit, through a JSON text."""
    first = LatencyCells.from_records(_records(5, 1, 8))
    second = LatencyCells.from_records(_records(6, 100, 140, start_s=3600))
    cells = first.merged(second)
    back = LatencyCells.from_json(json.loads(json.dumps(cells.to_json())))
    for name in ("X", "y", "weight", "ts_ns"):
        assert np.array_equal(getattr(back, name), getattr(cells, name)), name
    assert back.batch_range() == cells.batch_range()
    newest = LatencyCells.from_json(json.loads(json.dumps(cells.to_json(limit=len(second)))))
    assert set(newest.keys().tolist()) == set(second.keys().tolist())  # the newest kept
    empty = LatencyCells.from_json(json.loads(json.dumps(LatencyCells.empty().to_json())))
    assert len(empty) == 0 and empty.X.shape == (0, cells.X.shape[1])


@pytest.mark.parametrize(("mend", "named"), [
    (lambda d: d.update(columns=d["columns"][:-1]), "columns"),
    (lambda d: d.update(step_s=d["step_s"][:-1]), "different lengths"),
    (lambda d: d["x"][0].pop(), "x"),
    (lambda d: d["step_s"].__setitem__(0, float("nan")), "not finite"),
    (lambda d: d["steps"].__setitem__(0, 0.0), "not positive"),
    (lambda d: d.pop("ts_ns"), "ts_ns"),
])
def test_cells_that_are_not_well_formed_are_refused_by_name(mend, named) -> None:
    data = LatencyCells.from_records(_records(5, 1, 8)).to_json()
    mend(data)
    with pytest.raises(ValueError, match=named):
        LatencyCells.from_json(data)
