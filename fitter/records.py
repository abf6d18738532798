"""What callers may hand the fitter as telemetry, and the one frame it computes on.

Every entry point (a fit, a refit, the control service's screened fit) turns its records
into a polars DataFrame here, once; everything below it takes that frame.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeAlias

import polars as pl
import pyarrow as pa

Records: TypeAlias = (
    pl.DataFrame | pa.Table | pa.RecordBatch | pa.RecordBatchReader
    | Sequence[pa.RecordBatch | pa.Table] | Mapping[str, Sequence[Any]]
    | Sequence[Mapping[str, Any]]
)
"""Step records as callers hold them: a polars frame, arrow (a table, a batch, batches or a
reader of them), columns by name, or rows as dicts."""


def as_frame(records: Records, *, columns: Collection[str] | None = None) -> pl.DataFrame:
    """`records` as a polars DataFrame, rows in their order, columns with polars' dtypes.

    A DataFrame is returned as it is. `columns`: an arrow table converts only those of them
    it has (converting the rest would be wasted); other inputs convert whole.
    """
    if isinstance(records, pl.DataFrame):
        return records
    if isinstance(records, pa.Table) and columns is not None:
        records = records.select([c for c in columns if c in records.column_names])
    frame = pl.from_arrow(records) if _is_arrow(records) else pl.DataFrame(records)
    assert isinstance(frame, pl.DataFrame)  # from_arrow of tables and batches is a frame
    return frame


def _is_arrow(records: Records) -> bool:
    if isinstance(records, pa.Table | pa.RecordBatch | pa.RecordBatchReader):
        return True
    return (isinstance(records, Sequence) and len(records) > 0
            and all(isinstance(part, pa.Table | pa.RecordBatch) for part in records))
