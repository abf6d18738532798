"""Output tokens over time from the Parquet telemetry the ingest job wrote (one row a step).

A step emits one token per decoding request plus its accepted drafts, and one per request
whose prefill it ran (its first token; a chunked prefill's earlier chunks count one too, a
small overcount: `tokens_vs_client` in the results says how small). A phase's rate over a
window = those tokens / the window's length: the client's rate over the same window, which
vLLM's client cannot give for part of a run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl


def load(parquet: Path) -> pl.DataFrame:
    """engine_id, ts_s (a step's end), tokens, k (verified this step), k_next (the table's K
    for the next), batch_size, table_version, forced."""
    from fitter.dataset import read_dataset

    frame = read_dataset(parquet)
    return frame.select(
        "engine_id", (pl.col("ts_ns") / 1e9).alias("ts_s"),
        (pl.col("num_decode_reqs") + pl.col("num_accepted_tokens")
         + pl.col("num_prefill_reqs")).alias("tokens"),
        "k", "k_next", "batch_size", "table_version", "forced").sort("ts_s")


def window_stats(steps: pl.DataFrame, start_s: float, end_s: float) -> dict[str, Any]:
    """Tokens/s (None for an empty window), steps, mean batch size and the share of steps
    per K verified and per K scheduled next, in [start_s, end_s)."""
    inside = steps.filter((pl.col("ts_s") >= start_s) & (pl.col("ts_s") < end_s))
    seconds = max(end_s - start_s, 1e-9)
    tokens = int(inside["tokens"].sum()) if inside.height else 0
    shares: dict[str, dict[str, float]] = {"k": {}, "k_next": {}}
    for column, share in shares.items():
        if inside.height:
            counts = inside.group_by(column).len().sort(column)
            share.update({str(k): round(n / inside.height, 3)
                          for k, n in zip(counts[column], counts["len"], strict=True)})
    return {"start_s": round(start_s, 3), "seconds": round(end_s - start_s, 2),
            "tokens": tokens, "tok_s": round(tokens / seconds, 2) if end_s > start_s else None,
            "steps": inside.height,
            "mean_batch": round(float(inside["batch_size"].mean()), 2) if inside.height else 0,
            "k_share": shares["k"], "k_next_share": shares["k_next"]}


def phase_telemetry(steps: pl.DataFrame, phase: dict[str, Any], result: dict[str, Any],
                    lead_s: float, counted_from_s: float = 0.0) -> dict[str, Any]:
    """Windows of one phase, each ending at its drain (the last median request latency,
    when fewer requests than the cap are left in flight): `measured` after its first
    `lead_s`; `counted` from `counted_from_s` in (a learning table's first); `undrained`
    from its start (what a table that learns pays included). `whole` is the phase."""
    start, end = phase["started"], phase["ended"]
    drain_s = float(result.get("median_e2el_ms") or 0.0) / 1000.0
    drained = max(end - drain_s, start)

    def from_(offset_s: float) -> dict[str, Any]:
        begin = min(start + max(offset_s, 0.0), drained)
        return window_stats(steps, begin, drained)

    whole = window_stats(steps, start, end)
    client_tokens = result.get("total_output_tokens") or 0
    return {"whole": whole, "measured": from_(lead_s), "counted": from_(counted_from_s),
            "undrained": from_(0.0), "lead_s": lead_s, "counted_from_s": counted_from_s,
            "drain_s": round(drain_s, 2),
            "tokens_vs_client": round(whole["tokens"] / client_tokens, 3)
            if client_tokens else None}


def timeline(steps: pl.DataFrame, origin_s: float, end_s: float,
             width_s: float = 10.0) -> list[list[float]]:
    """[[seconds from origin (bucket middle), tokens/s]] per `width_s` bucket (at least one,
    the last full one's end at most; a window shorter than a bucket gives its own rate)."""
    inside = steps.filter((pl.col("ts_s") >= origin_s) & (pl.col("ts_s") < end_s))
    if not inside.height:
        return []
    buckets = (inside.with_columns(((pl.col("ts_s") - origin_s) // width_s).cast(pl.Int64)
                                   .alias("bucket"))
               .group_by("bucket").agg(pl.col("tokens").sum()).sort("bucket"))
    full = int((end_s - origin_s) // width_s)  # a partial last bucket is left out
    if full == 0:
        seconds = max(end_s - origin_s, 1e-9)
        return [[round(seconds / 2, 1), round(int(inside["tokens"].sum()) / seconds, 2)]]
    by_bucket = dict(zip(buckets["bucket"], buckets["tokens"], strict=True))
    return [[round((b + 0.5) * width_s, 1), round(by_bucket.get(b, 0) / width_s, 2)]
            for b in range(full)]
