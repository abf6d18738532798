"""What the fitter trusts: valid rows, from engines that agree with the rest.

Nothing at this layer authenticates an engine id: whoever can write the telemetry topic can
claim any id (Kafka ACLs are the defence there, docs/OPERATIONS.md). Copies of honest steps
under new ids with 3x the latency at K >= 3 turned a fitted table into `[[1,48,0]]`. The
fleet itself is the reference instead: engines of one table key run one model, drafter and
GPU, so like steps take like time on each of them.

1. Rows that fail `schemas.step_checks` (NaN latency, accepted > drafted, ...) are dropped:
   the control service fits the telemetry topic directly, not ingest's checked Parquet.
2. Steps are compared in cells of like steps (batch size in quarter octaves, K scheduled,
   context in half octaves, a prefill or not). Each cell's consensus is the median of the
   engines' own medians there (an engine's weight in it is one vote, however many steps it
   sends), where at least `MIN_ENGINES` engines have `MIN_CELL_STEPS` steps.
3. Each step's latency is divided by its cell's consensus; an engine whose median ratio at
   one K, in one batch octave, or over all its steps (an id with a hundred steps is judged
   too) is beyond `LATENCY_RATIO_LIMIT` either way is dropped (logged, and named in the
   refit's result and the envelope's provenance).
4. No engine id keeps more than `RECORD_CAP_FACTOR` times the median engine's steps: the
   rest of a flood under one id is downsampled evenly (over time).

With fewer than `MIN_ENGINES` engines nothing is judged or capped. A majority of engine ids,
or a drift within the band, is beyond this defence (docs/OPERATIONS.md says what is left).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import polars as pl
import pyarrow as pa

from fitter.records import Records, as_frame
from schemas.step_checks import check_steps

log = logging.getLogger(__name__)

MIN_ENGINES = 3
"""A median of two engines cannot say which one is wrong: below three nothing is judged."""
LATENCY_RATIO_LIMIT = 1.5
"""Like steps on engines of one key take within ~10% of each other's time (noise, clocks,
thermals); 1.5x either way is another machine or a forgery (the attack seen was 3x)."""
MIN_CELL_STEPS = 10
"""An engine's median over fewer steps of a cell is too noisy to vote on the consensus (1% of
steps are preemption or GC outliers, up to 4x slow)."""
MIN_GROUP_STEPS = 20
"""Steps an engine needs at one K (in one batch octave, or in all) before it is judged there."""
RECORD_CAP_FACTOR = 4.0
"""No engine id keeps more than 4x the steps of the median engine: an idle engine steps a few
times as often as a busy one, a flood under one id far more."""
SHOWN_ENGINES = 16
"""Engine ids named in an envelope's provenance at most (it is bounded at 1 MiB, and an
attacker chooses how many ids there are); the count is always given."""

_COLUMNS = ("engine_id", "batch_size", "k_next", "ctx_len_mean", "num_prefill_tokens",
            "step_latency_s")
_CELL = ("_batch_cell", "k_next", "_context_cell", "_prefill")

Frame = TypeVar("Frame", pa.Table, pl.DataFrame)


@dataclass(frozen=True, slots=True)
class Screening:
    """What `screen` removed from a fit's records, and why."""

    records_in: int
    records_out: int
    invalid_records: int = 0
    """Rows that failed a semantic check."""
    engines: int = 0
    dropped_engines: dict[str, float] = field(default_factory=dict)
    """Engine id -> its worst median latency ratio to the consensus (K or batch octave)."""
    capped_engines: dict[str, int] = field(default_factory=dict)
    """Engine id -> its steps before the cap (it keeps the cap's worth)."""

    def to_dict(self) -> dict[str, Any]:
        """For a refit's JSON output and an envelope's provenance (bounded)."""
        dropped = sorted(self.dropped_engines)
        return {"records_in": self.records_in, "records_out": self.records_out,
                "invalid_records": self.invalid_records, "engines": self.engines,
                "dropped_engines": dropped[:SHOWN_ENGINES],
                "dropped_engine_count": len(dropped),
                "capped_engines": sorted(self.capped_engines)[:SHOWN_ENGINES],
                "capped_engine_count": len(self.capped_engines)}

    @property
    def changed(self) -> bool:
        return self.records_out != self.records_in


def screen(records: Frame) -> tuple[Frame, Screening]:
    """`records` (pyarrow or polars) without invalid rows and disagreeing engines, capped."""
    n = len(records)
    table = records if isinstance(records, pa.Table) else records.to_arrow()
    checks = check_steps(table, now_ns=None)
    keep = checks.valid.copy()
    invalid = int(n - keep.sum())
    consensus = engine_consensus(_consensus_frame(records), keep)
    keep &= consensus.keep
    screening = Screening(records_in=n, records_out=int(keep.sum()), invalid_records=invalid,
                          engines=consensus.engines, dropped_engines=consensus.dropped,
                          capped_engines=consensus.capped)
    if invalid:
        log.warning("screen: %d of %d records fail a semantic check (%s)", invalid, n,
                    "; ".join(v.detail for v in checks.violations))
    if not screening.changed:
        return records, screening
    if isinstance(records, pa.Table):
        return records.filter(pa.array(keep)), screening
    return records.filter(pl.Series(keep)), screening


def with_screening(fit: Callable[..., Any]) -> Callable[..., Any]:
    """`fit(records, **options)` on `screen(records)`, naming what was removed in the
    `provenance` option (the control service's fit: `fitter.derive.fit_table`)."""

    @functools.wraps(fit)
    def screened_fit(records: Records, **options: Any) -> Any:
        kept, screening = screen(as_frame(records))
        if screening.changed:
            options["provenance"] = {**dict(options.get("provenance") or {}),
                                     "screening": screening.to_dict()}
        return fit(kept, **options)

    return screened_fit


@dataclass(frozen=True, slots=True)
class Consensus:
    keep: np.ndarray
    engines: int
    dropped: dict[str, float]
    capped: dict[str, int]


def engine_consensus(frame: pl.DataFrame | None, valid: np.ndarray) -> Consensus:
    """Which rows to keep (steps 2-4 of the module docstring) among the `valid` ones."""
    n = len(valid)
    if frame is None:
        return Consensus(np.ones(n, dtype=bool), 0, {}, {})
    frame = frame.with_row_index("_row").filter(pl.Series(valid))
    engines = frame["engine_id"].n_unique()
    if engines < MIN_ENGINES:
        return Consensus(np.ones(n, dtype=bool), engines, {}, {})
    dropped = _disagreeing(frame)
    if dropped:
        shown = ", ".join(f"{e} ({r:.2f}x)" for e, r in sorted(dropped.items())[:SHOWN_ENGINES])
        log.warning("engine consensus: dropped %d of %d engines whose step latency disagrees "
                    "with the others' by more than %gx: %s", len(dropped), engines,
                    LATENCY_RATIO_LIMIT, shown)
        frame = frame.filter(~pl.col("engine_id").is_in(list(dropped)))
    keep = np.zeros(n, dtype=bool)
    rows, capped = _capped(frame)
    keep[rows] = True
    if capped:
        log.warning("engine consensus: %d engines send more than %gx the median engine's "
                    "steps, downsampled: %s", len(capped), RECORD_CAP_FACTOR,
                    ", ".join(sorted(capped)[:SHOWN_ENGINES]))
    return Consensus(keep, engines, dropped, capped)


def _disagreeing(frame: pl.DataFrame) -> dict[str, float]:
    latency = pl.col("step_latency_s")
    steps = frame.filter(latency.is_finite() & (latency > 0)).with_columns(
        (pl.col("batch_size").clip(1).cast(pl.Float64).log(2) * 4).floor().alias("_batch_cell"),
        (pl.col("ctx_len_mean").clip(0) + 1).log(2).mul(2).floor().alias("_context_cell"),
        (pl.col("num_prefill_tokens") > 0).alias("_prefill"),
        pl.col("batch_size").clip(1).cast(pl.Float64).log(2).floor().alias("_batch_octave"),
        latency.log().alias("_log_latency"), pl.lit(0).alias("_all"))
    votes = (steps.group_by("engine_id", *_CELL)
             .agg(pl.col("_log_latency").median().alias("_vote"), pl.len().alias("_steps"))
             .filter(pl.col("_steps") >= MIN_CELL_STEPS)
             .group_by(*_CELL)
             .agg(pl.col("_vote").median().alias("_consensus"), pl.len().alias("_voters"))
             .filter(pl.col("_voters") >= MIN_ENGINES))
    judged = steps.join(votes, on=list(_CELL), how="inner").with_columns(
        (pl.col("_log_latency") - pl.col("_consensus")).alias("_log_ratio"))
    worst: dict[str, float] = {}
    for group in ("k_next", "_batch_octave", "_all"):
        ratios = (judged.group_by("engine_id", group)
                  .agg(pl.col("_log_ratio").median().alias("_ratio"), pl.len().alias("_steps"))
                  .filter((pl.col("_steps") >= MIN_GROUP_STEPS)
                          & (pl.col("_ratio").abs() > math.log(LATENCY_RATIO_LIMIT))))
        for engine, ratio in ratios.select("engine_id", "_ratio").iter_rows():
            if abs(ratio) > abs(math.log(worst.get(engine, 1.0))):
                worst[engine] = math.exp(ratio)
    return worst


def _capped(frame: pl.DataFrame) -> tuple[np.ndarray, dict[str, int]]:
    """Row numbers kept, and the engines downsampled (with their steps before)."""
    rows = frame["_row"].to_numpy()
    counts = frame.group_by("engine_id").len()
    if counts.height < MIN_ENGINES:
        return rows, {}
    cap = math.ceil(RECORD_CAP_FACTOR * float(counts["len"].median()))  # type: ignore[arg-type]
    over = counts.filter(pl.col("len") > cap)
    if over.height == 0:
        return rows, {}
    position = frame.select(pl.int_range(pl.len()).over("engine_id").alias("p"))["p"]
    total = frame.select(pl.len().over("engine_id").alias("n"))["n"]
    flooding = frame["engine_id"].is_in(over["engine_id"].implode()).to_numpy()
    p, t = position.to_numpy().astype(np.int64), total.to_numpy().astype(np.int64)
    evenly = (p * cap) // t != ((p - 1) * cap) // t  # exactly `cap` rows, spread over time
    return rows[~flooding | evenly], dict(over.select("engine_id", "len").iter_rows())


def _consensus_frame(records: pa.Table | pl.DataFrame) -> pl.DataFrame | None:
    names = records.column_names if isinstance(records, pa.Table) else records.columns
    if not set(_COLUMNS) <= set(names):
        return None
    return as_frame(records, columns=_COLUMNS).select(_COLUMNS)
