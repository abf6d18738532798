"""Two different records for one (engine id, step): a conflict, not a duplicate.

An engine numbers its steps (`step_seq`) and sends each once. A frame it sends again is the
same bytes, so copies of one (engine_id, step_seq) that agree in every step-record field are
duplicates, and the first is kept. Copies that differ in any field are two writers under one
engine id (a forged producer, or one id given to two processes): nothing says which is the
engine, so every copy is left out and the step is counted against the id. Keeping the first
copy let forged files that sorted first replace the honest rows (a fit then read 3x the
latency at K >= 3 and published `[[1,48,0]]`).

Only rows whose key repeats are hashed, so a dataset without copies costs one pass over the
key, as the plain dedupe did.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import polars as pl
import pyarrow as pa
from numpy.typing import NDArray

from fitter.engine_consensus import SHOWN_ENGINES
from fitter.records import as_frame
from schemas import STEP_RECORD_SCHEMA

STEP_KEY = ("engine_id", "step_seq")
"""What names one step of one engine."""

_KEYS_SCHEMA = {"engine_id": pl.String, "step_seq": pl.Int64, "copies": pl.UInt32}
_ROW = "_row"
_CONTENT = "_content"
_VERSIONS = "_versions"

Frame = TypeVar("Frame", pa.Table, pl.DataFrame)


@dataclass(frozen=True, eq=False)
class StepConflicts:
    """The steps that came in two or more different records, each once."""

    keys: pl.DataFrame = field(default_factory=lambda: pl.DataFrame(schema=_KEYS_SCHEMA))
    """engine_id, step_seq, copies (the rows of that step, all left out), sorted."""

    def __len__(self) -> int:
        return self.keys.height

    @property
    def steps(self) -> dict[str, int]:
        """Engine id -> its conflicting steps, the most first."""
        counts = self.keys.group_by("engine_id").len().sort(["len", "engine_id"],
                                                             descending=[True, False])
        return dict(counts.iter_rows())

    @property
    def records(self) -> int:
        """Rows left out: every copy of every conflicting step."""
        return int(self.keys["copies"].sum())

    def newest(self) -> dict[str, int]:
        """Engine id -> its newest conflicting step number."""
        return dict(self.keys.group_by("engine_id").agg(pl.col("step_seq").max()).iter_rows())

    def after(self, newest: Mapping[str, int]) -> StepConflicts:
        """Only the steps numbered above `newest[engine id]` (all of an engine not in it)."""
        if not newest:
            return self
        marks = pl.DataFrame({"engine_id": list(newest), "_mark": list(newest.values())},
                             schema={"engine_id": pl.String, "_mark": pl.Int64})
        later = (self.keys.join(marks, on="engine_id", how="left")
                 .filter(pl.col("_mark").is_null() | (pl.col("step_seq") > pl.col("_mark")))
                 .drop("_mark"))
        return StepConflicts(later)

    def to_dict(self) -> dict[str, Any]:
        """For a fit's JSON output, an envelope's provenance and a status event (bounded: an
        attacker chooses how many engine ids conflict; the count is always given)."""
        steps = self.steps
        return {"steps": len(self), "records": self.records,
                "engines": dict(list(steps.items())[:SHOWN_ENGINES]),
                "engine_count": len(steps)}


def drop_conflicts(records: Frame) -> tuple[Frame, StepConflicts]:
    """`records` with exact copies of a step dropped to the first and every copy of a
    conflicting step dropped (what went is in the `StepConflicts`); order kept."""
    keep, conflicts = find_conflicts(records)
    if keep is None:
        return records, conflicts
    if isinstance(records, pa.Table):
        return records.filter(pa.array(keep)), conflicts
    return records.filter(pl.Series(keep)), conflicts


def find_conflicts(records: pa.Table | pl.DataFrame,
                   ) -> tuple[NDArray[np.bool_] | None, StepConflicts]:
    """Which rows of `records` to keep (None: all of them) and the conflicting steps.

    Content is every step-record field `records` has; other columns (where ingest stored the
    row: `source_partition`, `source_offset`) are not the step's, so a frame stored twice is
    still a duplicate. Arrow converts only the key until a key repeats."""
    key = list(STEP_KEY)
    repeated = (as_frame(records, columns=key).select(pl.struct(key).is_duplicated())
                .to_series().to_numpy())
    if not repeated.any():
        return None, StepConflicts()
    frame = as_frame(records, columns=STEP_RECORD_SCHEMA.names)
    content = [name for name in STEP_RECORD_SCHEMA.names if name in frame.columns]
    by_step = (frame.with_row_index(_ROW).filter(pl.Series(repeated))
               .with_columns(pl.struct(content).hash().alias(_CONTENT))
               .group_by(key)
               .agg(pl.col(_CONTENT).n_unique().alias(_VERSIONS),
                    pl.len().cast(pl.UInt32).alias("copies"), pl.col(_ROW).min()))
    keep = ~repeated
    keep[by_step.filter(pl.col(_VERSIONS) == 1)[_ROW].to_numpy()] = True
    conflicting = (by_step.filter(pl.col(_VERSIONS) > 1).select(*key, "copies")
                   .cast(_KEYS_SCHEMA).sort(key))  # type: ignore[arg-type]
    return keep, StepConflicts(conflicting)
