"""The profile sweep: adaptive cell choice, and an end-to-end run on the twin."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from fitter.profile_plan import Cell, next_cell, score_cells, seed_design
from fitter.surface.fit import fit_surface
from fitter.surface.synthetic import make_step_records
from producers.sinks import FileSink, read_file_sink
from schemas import TableEnvelope
from schemas.table_files import load_table_file
from tabletune.profile import ProfileError, profile
from twin import PhaseConfig, Scenario
from twin.config import EngineConfig

LOADS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KS = tuple(range(8))


@pytest.fixture(scope="module")
def uniform_fit():
    """Every K at every batch size: a well-determined surface (ShareGPT EAGLE, H100)."""
    records = make_step_records(20_000, seed=3, max_batch=256)
    return fit_surface(records, max_k=7, max_batch=256, half_life_s=None)


def test_seed_design_covers_top_k_and_floor():
    cells = seed_design(LOADS, KS)
    assert Cell(256, 0) in cells
    assert any(c.k == 7 for c in cells)
    assert len(cells) == len(set(cells)) == 3


def test_seed_cells_come_first_then_scored_cells():
    visits: Counter[Cell] = Counter()
    for cell in seed_design(LOADS, KS):
        assert next_cell(None, LOADS, KS, visits).cell == cell
        visits[cell] += 1


def test_scores_concentrate_near_the_argmax(uniform_fit):
    """Cells far from each load's best K are not worth measuring; the top picks are near it."""
    ranked = score_cells(uniform_fit, LOADS, KS, {})
    by_cell = {s.cell: s for s in ranked}
    # At the top load K=7 clearly loses and at the bottom load K=0 clearly loses.
    assert by_cell.get(Cell(256, 7)) is None or by_cell[Cell(256, 7)].score < 1e-3
    assert by_cell.get(Cell(1, 0)) is None or by_cell[Cell(1, 0)].score < 1e-3
    for score in ranked[:10]:
        assert abs(score.cell.k - score.chosen_k) <= 2, score
    # Far fewer cells are worth anything than a full grid holds.
    assert sum(s.score > 1e-3 for s in ranked) < len(LOADS) * len(KS) / 2


def test_repeat_visits_lower_a_cells_score(uniform_fit):
    ranked = score_cells(uniform_fit, LOADS, KS, {})
    top = ranked[0]
    again = {s.cell: s.score for s in score_cells(uniform_fit, LOADS, KS, {top.cell: 3})}
    assert again.get(top.cell, 0.0) < top.score


def _parametric_scenario() -> Scenario:
    return Scenario(seed=5, name="param", engine=EngineConfig(max_num_seqs=64,
                                                              max_num_batched_tokens=4096,
                                                              max_k=5),
                    phases=(PhaseConfig(duration_s=60, rate_rps=5.0,
                                        acceptance=(0.8, 0.75, 0.72, 0.7, 0.68),
                                        prompt_len=256, output_len=128),))


def test_profile_on_the_twin_writes_a_valid_table(tmp_path):
    sink_dir = tmp_path / "telemetry"
    result = profile(_parametric_scenario(), budget_s=24.0, cells=8, out_dir=tmp_path / "out",
                     sink=FileSink(sink_dir))
    path = tmp_path / "out" / "table.json"
    assert result.path == path
    payload = json.loads(path.read_text())
    assert payload["table"] == result.envelope.table.to_vllm()
    table, envelope = load_table_file(path)
    assert isinstance(envelope, TableEnvelope)
    envelope.validate()
    table.validate(5, 64)
    assert envelope.max_batch == 64 and envelope.version == 1
    assert result.engine_time_s == pytest.approx(24.0, abs=0.5)
    # Adaptive: 8 cells from a 7x6 grid, each forced through the switch and marked so.
    assert len(result.cells) == 8
    records = read_file_sink(sink_dir)
    assert records.num_rows == result.records
    forced = np.asarray(records.column("forced"))
    assert forced[5:].all()  # every step after the first forced table applies
    assert len(set(np.asarray(records.column("k_next")).tolist())) >= 3
    # High acceptance (0.8 ...) on a small engine: speculation must pay at low batch sizes.
    assert table.k_for(1) >= 3


def test_profile_rejects_bad_requests():
    with pytest.raises(ProfileError, match="twin:SCENARIO or openai:URL"):
        profile("vllm:whatever")
    with pytest.raises(ProfileError, match="no such scenario"):
        profile("twin:does-not-exist")
    with pytest.raises(ProfileError, match="outside the engine's startup range"):
        profile(_parametric_scenario(), max_k=9)
    with pytest.raises(ProfileError, match="--parquet"):
        profile("openai:http://127.0.0.1:9", budget_s=1.0)


def test_profile_command_line(tmp_path, capsys):
    from tabletune.cli import main

    code = main(["profile", "--engine", "twin:open-loop-parametric", "--budget-s", "12",
                 "--cells", "4", "--out", str(tmp_path), "--no-progress", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["path"] == str(tmp_path / "table.json") and len(out["cells"]) == 4
    assert main(["profile", "--engine", "twin:nope", "--out", str(tmp_path)]) == 1


def test_lowering_the_load_aborts_the_surplus_instead_of_draining_it(tmp_path):
    """A cell at a lower concurrency runs at that concurrency from its first step: left to
    drain, the surplus would fill the cell with the longest requests of the previous one."""
    sink_dir = tmp_path / "telemetry"
    result = profile(_parametric_scenario(), budget_s=24.0, cells=8, sink=FileSink(sink_dir))
    records = read_file_sink(sink_dir)
    ts_s = np.asarray(records.column("ts_ns")) * 1e-9
    batch = np.asarray(records.column("batch_size"))
    lowered = 0
    for previous, cell in zip(result.cells, result.cells[1:], strict=False):
        if cell.cell.concurrency >= previous.cell.concurrency:
            continue
        lowered += 1
        inside = (ts_s >= cell.start_s) & (ts_s < cell.end_s - 1e-6)  # ts_ns truncates
        assert inside.any() and batch[inside].max() <= cell.cell.concurrency
    assert lowered >= 1


def test_each_cell_runs_at_its_own_concurrency(tmp_path):
    """The load follows the cell: a raised concurrency fills the batch (at 33a1ceb the twin's
    traffic kept the first cell's load for the whole sweep, and the tables came out flat)."""
    sink_dir = tmp_path / "telemetry"
    result = profile(_parametric_scenario(), budget_s=24.0, cells=8, sink=FileSink(sink_dir))
    records = read_file_sink(sink_dir)
    ts_s = np.asarray(records.column("ts_ns")) * 1e-9
    batch = np.asarray(records.column("batch_size"))
    concurrencies = {run.cell.concurrency for run in result.cells}
    assert len(concurrencies) >= 3
    for run in result.cells:
        inside = (ts_s >= run.start_s) & (ts_s < run.end_s - 1e-6)
        assert batch[inside].max() == min(run.cell.concurrency, 64), run.to_dict()
