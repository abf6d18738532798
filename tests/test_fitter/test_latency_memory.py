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


def _cells(rows: list[tuple[int, int, float, float]]) -> LatencyCells:
    """Cells of one shape per (batch size, K, step ms, steps): decode only, one context."""
    X = np.array([[b, k, k, 0.0, 0.0, 1024.0] for b, k, _, _ in rows])
    y = np.array([ms / 1e3 for _, _, ms, _ in rows])
    weight = np.array([n for _, _, _, n in rows], dtype=np.float64)
    return LatencyCells(X, y, weight, np.full(len(rows), 1, dtype=np.int64))


def test_recalled_cells_run_at_the_speed_the_window_ran_at_their_batch_size() -> None:
    """The cold profile measured K3 and K4 at one request at 39 and 43 ms; three minutes
    later the server ran K4 at 51 ms. Beside that, K3's 39 ms made K3 look 15% ahead; at
    the window's speed it is 46 ms. A batch size the window ran at the memory's speed, or
    one it did not run, keeps the remembered step times."""
    memory = _cells([(1, 3, 39.0, 100), (1, 4, 43.0, 100), (16, 1, 100.0, 300),
                     (16, 3, 180.0, 50), (8, 2, 70.0, 80)])
    window = _cells([(1, 4, 51.0, 160), (16, 1, 102.0, 400)])
    recalled = memory.recalled_beside(window)
    by_shape = {(int(b), int(k)): y * 1e3 for (b, k), y in
                zip(recalled.X[:, :2].tolist(), recalled.y.tolist(), strict=True)}
    assert set(by_shape) == {(1, 3), (16, 3), (8, 2)}
    assert by_shape[(1, 3)] == pytest.approx(39.0 * 51.0 / 43.0)
    assert by_shape[(16, 3)] == pytest.approx(180.0)  # 2% is within the speed's noise
    assert by_shape[(8, 2)] == pytest.approx(70.0)  # nothing shared at 8
    few = _cells([(1, 4, 51.0, 20)])  # 20 steps do not read a speed
    assert memory.recalled_beside(few).y[0] * 1e3 == pytest.approx(39.0)


def test_a_shift_reads_the_median_over_the_shared_shapes() -> None:
    memory = _cells([(1, 3, 40.0, 100), (1, 4, 50.0, 100), (2, 4, 60.0, 100)])
    recent = _cells([(1, 3, 44.0, 150), (1, 4, 55.0, 150), (2, 4, 90.0, 50), (4, 4, 1.0, 500)])
    shift, steps = memory.shift(recent, min_steps=200)
    assert shift == pytest.approx(0.10) and steps == 250
    assert memory.shift(recent, min_steps=300) is None
