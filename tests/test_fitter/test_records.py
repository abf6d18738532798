"""Every kind of records the fitter accepts becomes the same polars frame."""

from __future__ import annotations

import polars as pl
import pyarrow as pa
import pytest
from polars.testing import assert_frame_equal

from fitter.records import as_frame
from fitter.surface.synthetic import make_step_records

TABLE = make_step_records(300, seed=2, n_engines=2, finished_per_step=0.5)
BATCHES = TABLE.to_batches(max_chunksize=70)


@pytest.mark.parametrize("records", [
    TABLE, TABLE.combine_chunks().to_batches()[0], BATCHES,
    [TABLE.slice(0, 100), TABLE.slice(100)],
    pa.RecordBatchReader.from_batches(TABLE.schema, BATCHES),
], ids=["table", "batch", "batches", "tables", "reader"])
def test_arrow_records_are_one_frame_in_row_order(records: object) -> None:
    assert_frame_equal(as_frame(records), pl.from_arrow(TABLE), check_exact=True)


def test_a_frame_is_taken_as_it_is() -> None:
    frame = pl.from_arrow(TABLE)
    assert as_frame(frame) is frame


def test_columns_by_name_and_rows_as_dicts_are_frames_too() -> None:
    columns = {"engine_id": ["a", "b"], "batch_size": [3, 5]}
    assert_frame_equal(as_frame(columns), pl.DataFrame(columns))
    rows = [{"engine_id": "a", "batch_size": 3}, {"engine_id": "b", "batch_size": 5}]
    assert_frame_equal(as_frame(rows), pl.DataFrame(columns))
    assert as_frame([]).height == 0


def test_an_arrow_table_converts_only_the_columns_asked_for() -> None:
    table = make_step_records(20, seed=1)
    frame = as_frame(table, columns=("k", "batch_size", "absent"))
    assert frame.columns == ["k", "batch_size"]
    assert frame.dtypes == [pl.Int16, pl.Int32]
