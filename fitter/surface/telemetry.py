"""From a telemetry table to the estimators' inputs: recency weights and aggregated cells.

Aggregation is what makes a million steps fit in a second: latency is regressed on the
median of each (decode requests, K, prefill bucket, KV bucket, age bucket) cell and
acceptance on per-K sums, both computed with vectorised polars/numpy. Which steps feed which
model: latency takes every step (prefill tokens are part of batched tokens, prefill requests a
feature of their own); acceptance and the draft share take the steps that verified drafts
(`accepted_per_pos` is only non-empty there), so prefill-only rows never dilute them.
"""

from __future__ import annotations

import logging

import numpy as np
import polars as pl
import pyarrow.compute as pc
from numpy.typing import NDArray

from fitter.records import Records, as_frame
from fitter.step_conflicts import drop_conflicts
from fitter.surface.context import CONTEXT_COLUMNS
from fitter.surface.latency import LATENCY_COLUMNS

log = logging.getLogger(__name__)

NEEDED_COLUMNS: tuple[str, ...] = (
    "engine_id", "step_seq", "ts_ns", "batch_size", "num_decode_reqs", "num_prefill_reqs",
    "num_prefill_tokens", "k", "k_next", "num_drafts", "num_draft_tokens", "accepted_per_pos",
    "kv_tokens", "step_latency_s",
)

REQUESTS_COLUMN = "finished_requests"
"""Optional (schema version 2): the finished requests' sums (`request_segment_rows`)."""

KV_BUCKETS_PER_OCTAVE = 2
PREFILL_BUCKETS_PER_OCTAVE = 2
HALF_LIVES_PER_AGE_BUCKET = 2
MAX_AGE_BUCKET = 4
"""Steps older than 8 half-lives share one age bucket: their weight is < 0.4% anyway."""


def to_frame(records: Records, *, dedupe: bool = True) -> pl.DataFrame:
    """The columns the fitter reads, as polars; with `dedupe`, copies of a step (engine_id,
    step_seq) dropped: identical ones to one, differing ones all (`fitter.step_conflicts`).

    `records` are any `fitter.records.Records`. Without a `num_draft_tokens` column every
    drafting request counts as verifying `k` drafts. The readers that report conflicts (the
    dataset, the control service) leave none for here; a caller that passes its own records
    gets them logged.
    """
    wanted = (*NEEDED_COLUMNS, REQUESTS_COLUMN)
    frame = as_frame(records, columns=wanted)
    if "num_draft_tokens" not in frame.columns:
        frame = frame.with_columns(
            (pl.col("num_drafts").cast(pl.Int64) * pl.col("k").cast(pl.Int64))
            .alias("num_draft_tokens"))
    frame = frame.select([c for c in wanted if c in frame.columns or c in NEEDED_COLUMNS])
    if frame.height == 0:
        raise ValueError("no telemetry records to fit")
    if dedupe:
        frame, conflicts = drop_conflicts(frame)
        if len(conflicts):
            log.warning("fit: left out %d steps that came in two or more different records, "
                        "by engine id: %s", len(conflicts), conflicts.to_dict()["engines"])
    return frame


def recency_weights(ts_ns: NDArray[np.int64], half_life_s: float | None,
                    now_ns: int | None = None) -> NDArray[np.float64]:
    """0.5 ** (age / half-life), age measured back from `now_ns` (default: the newest step)."""
    if half_life_s is None:
        return np.ones(ts_ns.shape[0])
    now = int(ts_ns.max()) if now_ns is None else int(now_ns)
    age_s = np.maximum(now - ts_ns, 0).astype(np.float64) * 1e-9
    return np.exp2(-age_s / half_life_s)


def latency_cells(frame: pl.DataFrame, weights: NDArray[np.float64],
                  half_life_s: float | None, now_ns: int | None = None,
                  ) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """(X, median latency, summed recency weight) per cell; X columns are `LATENCY_COLUMNS`.

    The cell median is robust to the multi-x outliers a serving fleet produces; splitting
    cells by age (in half-lives) lets the recency weights act on medians too.
    """
    now = int(frame["ts_ns"].max()) if now_ns is None else int(now_ns)  # type: ignore[arg-type]
    age = (pl.lit(now) - pl.col("ts_ns")).clip(lower_bound=0).cast(pl.Float64) * 1e-9
    age_bucket = (
        (age / (half_life_s * HALF_LIVES_PER_AGE_BUCKET)).floor().clip(upper_bound=MAX_AGE_BUCKET)
        if half_life_s
        else pl.lit(0.0)
    )
    cells = (
        frame.lazy()
        .with_columns(
            _w=pl.Series(weights),
            _age=age_bucket.cast(pl.Int32),
            _kv=(pl.col("kv_tokens").cast(pl.Float64) + 1.0).log(2) * KV_BUCKETS_PER_OCTAVE,
            _pf=(pl.col("num_prefill_tokens").cast(pl.Float64) + 1.0).log(2)
            * PREFILL_BUCKETS_PER_OCTAVE,
        )
        .with_columns(pl.col("_kv").round().cast(pl.Int32), pl.col("_pf").round().cast(pl.Int32))
        .group_by(["num_decode_reqs", "k", "k_next", "num_prefill_reqs", "_pf", "_kv", "_age"])
        .agg(
            pl.col("num_prefill_tokens").cast(pl.Float64).mean().alias("prefill_mean"),
            pl.col("kv_tokens").cast(pl.Float64).mean().alias("kv_mean"),
            pl.col("num_draft_tokens").cast(pl.Float64).mean().alias("draft_tokens_mean"),
            pl.col("step_latency_s").median().alias("latency"),
            pl.col("_w").sum().alias("weight"),
        )
        .collect()
    )
    X = np.column_stack([
        cells["num_decode_reqs"].to_numpy().astype(np.float64),
        cells["k"].to_numpy().astype(np.float64),
        cells["k_next"].to_numpy().astype(np.float64),
        cells["prefill_mean"].to_numpy(),
        cells["num_prefill_reqs"].to_numpy().astype(np.float64),
        cells["kv_mean"].to_numpy(),
        cells["draft_tokens_mean"].to_numpy(),
    ])
    assert X.shape[1] == len(LATENCY_COLUMNS)
    return X, cells["latency"].to_numpy(), cells["weight"].to_numpy()


def acceptance_rows(frame: pl.DataFrame, weights: NDArray[np.float64],
                    n_positions: int) -> NDArray[np.float64]:
    """Acceptance X (see `fitter.surface.acceptance`) with one row per drafted length L.

    Row L-1 sums, with the recency weights applied, num_drafts (column 0) and the accepted
    counts at positions 1..L over the steps that verified L drafts; positions after L are NaN
    (censored). Lengths above `n_positions` are truncated to it.
    """
    arrow = frame.select("num_drafts", "accepted_per_pos").to_arrow()
    lists = arrow.column("accepted_per_pos").combine_chunks()
    raw_lengths = pc.list_value_length(lists).fill_null(0).to_numpy(zero_copy_only=False)
    raw_lengths = raw_lengths.astype(np.int64)
    lengths = np.minimum(raw_lengths, n_positions)
    drafts = arrow.column("num_drafts").to_numpy().astype(np.float64)
    values = pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(np.float64)
    parents = pc.list_parent_indices(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(raw_lengths)[:-1]])
    position = np.arange(values.size) - starts[parents] + 1  # 1-based draft position

    width = n_positions + 1
    drafting = (lengths > 0) & (drafts > 0)
    sums = np.bincount((lengths[drafting] - 1) * width, weights=(weights * drafts)[drafting],
                       minlength=n_positions * width).astype(np.float64)
    usable = (position <= n_positions) & drafting[parents]
    flat = (lengths[parents[usable]] - 1) * width + position[usable]
    sums += np.bincount(flat, weights=(weights[parents] * values)[usable],
                        minlength=sums.size)
    X = sums.reshape(n_positions, width)
    censored = np.arange(width)[None, :] > np.arange(1, n_positions + 1)[:, None]
    X[censored] = np.nan
    return X


def draft_share_rows(frame: pl.DataFrame, weights: NDArray[np.float64],
                     ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Draft-share X (see `fitter.surface.share`) and its weights: one row per number of
    decode requests, weighted means over the steps that verified drafts."""
    decode = frame["num_decode_reqs"].to_numpy().astype(np.int64)
    drafts = frame["num_drafts"].to_numpy().astype(np.float64)
    usable = (drafts > 0) & (decode > 0) & (frame["k"].to_numpy() > 0) & (weights > 0)
    if not usable.any():
        return np.zeros((0, 4)), np.zeros(0)
    d = decode[usable]
    w = weights[usable]
    size = int(d.max()) + 1
    total = np.bincount(d, weights=w, minlength=size)
    present = np.flatnonzero(total > 0)
    columns = [
        drafts[usable],
        frame["num_draft_tokens"].to_numpy()[usable].astype(np.float64),
        drafts[usable] * frame["k"].to_numpy()[usable].astype(np.float64),
    ]
    means = [np.bincount(d, weights=w * c, minlength=size)[present] / total[present]
             for c in columns]
    return np.column_stack([present.astype(np.float64), *means]), total[present]


CONTEXT_PRIOR_STEPS = 50.0
"""An octave with few steps is pulled toward the overall mean as if it had 50 more."""


def context_by_batch(frame: pl.DataFrame, weights: NDArray[np.float64],
                     batch_sizes: NDArray[np.int64]) -> NDArray[np.float64]:
    """Typical KV tokens per request at each batch size (recency-weighted, by octave of B).

    Context per request shifts with load (long chats pile up at high concurrency), so the
    table is derived at the context each batch size actually sees. Octave means are shrunk
    toward the overall mean where data is thin and interpolated in log2(B) between octave
    centres, so the derived goodput has no steps at powers of two.
    """
    batch = frame["batch_size"].to_numpy().astype(np.float64)
    kv = frame["kv_tokens"].to_numpy().astype(np.float64)
    usable = (batch > 0) & (weights > 0)
    if not usable.any():
        return np.zeros(batch_sizes.size)
    octave = np.floor(np.log2(batch[usable])).astype(np.int64)
    w = weights[usable]
    per_request = kv[usable] / batch[usable]
    overall = float(w @ per_request / w.sum())
    weight_sum = np.bincount(octave, weights=w)
    value_sum = np.bincount(octave, weights=w * per_request)
    has_data = np.flatnonzero(weight_sum > 0)
    prior = CONTEXT_PRIOR_STEPS * float(w.mean())
    means = (value_sum[has_data] + prior * overall) / (weight_sum[has_data] + prior)
    return np.interp(np.log2(np.maximum(batch_sizes, 1)), has_data + 0.5, means)


LIFETIME_WINDOW_S = 30.0
"""A request's lifetime in the batch is measured over the trailing 30 s of steps: long enough
for a few hundred requests to leave a busy engine, short enough to follow a switch of workload
(lifetimes are seconds)."""


def batch_shaped_k(frame: pl.DataFrame) -> NDArray[np.float64]:
    """Per step (in `frame`'s row order), the K that shaped the batch it ran: the K asked
    for, lagged by a request's lifetime in the batch.

    A switch of K changes which requests the batch holds only as the requests admitted
    before it finish, so the batch's make-up follows K like a first-order lag whose time
    constant is the lifetime (Little's law: requests in the batch over requests leaving it
    per second, over the trailing `LIFETIME_WINDOW_S`). Leaving, not arriving: when the load
    rises, a burst of fresh requests joins a batch none of whose requests has finished, and
    arrivals would read that as a short lifetime and the batch as reshaped at once (a
    profile's cells raise the load that way). Leaving is arrivals minus the batch's growth
    (a prompt split over several steps counts once per step, which errs short). Each engine
    is lagged on its own.
    """
    n = frame.height
    shaped = np.zeros(n)
    if n == 0:
        return shaped
    steps = (frame.select("engine_id", "step_seq", "ts_ns", "k_next", "batch_size",
                          "num_prefill_reqs")
             .with_columns(_row=pl.int_range(n)).sort("engine_id", "step_seq"))
    rows = steps["_row"].to_numpy()
    engine = steps["engine_id"].to_numpy()
    seconds = steps["ts_ns"].to_numpy().astype(np.float64) * 1e-9
    asked = steps["k_next"].to_numpy().astype(np.float64)
    batch = steps["batch_size"].to_numpy().astype(np.float64)
    arrivals = steps["num_prefill_reqs"].to_numpy().astype(np.float64)
    bounds = np.flatnonzero(np.r_[True, engine[1:] != engine[:-1], True])
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        t = seconds[start:stop]
        dt = np.diff(t, prepend=t[0])
        occupied = np.concatenate([[0.0], np.cumsum(batch[start:stop] * dt)])
        arrived = np.concatenate([[0.0], np.cumsum(arrivals[start:stop])])
        held = np.concatenate([batch[start:start + 1], batch[start:stop]])
        first = np.searchsorted(t, t - LIFETIME_WINDOW_S)
        last = np.arange(1, t.size + 1)
        left = (arrived[last] - arrived[first]) - (held[last] - held[first])
        lifetime = (occupied[last] - occupied[first]) / np.maximum(left, 1.0)
        kept = np.exp(-dt / np.maximum(lifetime, 1e-6))
        # the K a step verifies was asked for by the step before it
        k = np.concatenate([asked[start:start + 1], asked[start:stop - 1]])
        level = k[0]
        lagged = np.empty(t.size)
        for i in range(t.size):
            level = k[i] + (level - k[i]) * kept[i]
            lagged[i] = level
        shaped[rows[start:stop]] = lagged
    return shaped


def composition_by_position(frame: pl.DataFrame, weights: NDArray[np.float64],
                            n_positions: int) -> NDArray[np.float64]:
    """Per draft position 1..n_positions, the K that shaped the batches its acceptance was
    measured on (`batch_shaped_k`), weighted as `acceptance_rows` weighs the drafts; NaN
    where a position was never drafted."""
    shaped = batch_shaped_k(frame)
    lengths = np.minimum(frame["accepted_per_pos"].list.len().fill_null(0).to_numpy()
                         .astype(np.int64), n_positions)
    drafts = frame["num_drafts"].to_numpy().astype(np.float64)
    w = weights * drafts * (lengths > 0)
    # drafts verified at length L count for positions 1..L: sums over L >= position
    by_length = np.bincount(lengths, weights=w, minlength=n_positions + 1)
    shaped_by_length = np.bincount(lengths, weights=w * shaped, minlength=n_positions + 1)
    total = np.cumsum(by_length[::-1])[::-1][1:]
    total_shaped = np.cumsum(shaped_by_length[::-1])[::-1][1:]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, total_shaped / total, np.nan)


def request_segment_rows(frame: pl.DataFrame, n_positions: int) -> NDArray[np.float64]:
    """The finished requests' segments as `fitter.surface.context` reads them (one row per
    request segment; columns `CONTEXT_COLUMNS`, then reached and accepted counts for
    positions 1..n_positions). Empty (0 rows) when the records carry none."""
    width = len(CONTEXT_COLUMNS) + 2 * n_positions
    if REQUESTS_COLUMN not in frame.columns or frame.height == 0:
        return np.zeros((0, width))
    rows = (frame.select("engine_id", "step_seq", REQUESTS_COLUMN)
            .explode(REQUESTS_COLUMN).drop_nulls(REQUESTS_COLUMN).unnest(REQUESTS_COLUMN))
    if rows.height == 0:
        return np.zeros((0, width))
    # a request is one (engine, step record, number within it)
    request = (rows.select(pl.struct("engine_id", "step_seq", "request").rank("dense"))
               .to_series().cast(pl.Float64).to_numpy())
    fixed = [rows.get_column(name).cast(pl.Float64).to_numpy()
             for name in CONTEXT_COLUMNS[1:]]
    counts = []
    for name in ("reached_per_pos", "accepted_per_pos"):
        lists = rows.get_column(name)
        counts += [lists.list.get(i, null_on_oob=True).fill_null(0).cast(pl.Float64).to_numpy()
                   for i in range(n_positions)]
    out = np.column_stack([request, *fixed, *counts])
    return out[out[:, 1] > 0]
