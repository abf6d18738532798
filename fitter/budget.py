"""The budget that maximises predicted goodput: K per request by its n-gram match length.

Per batch size B, requests split by the length m of the n-gram their prompt lookup matched
(m = 0: no match, no draft), in shares p_m. A request of length m drafting K_m emits
AL_m(K_m) tokens on average, and the step verifies B * (1 + sum_m p_m K_m) tokens, so

    goodput(B, K_1..K_M) = B * sum_m p_m AL_m(K_m) / T(B, sum_m p_m K_m)

where T is the step latency at B decode requests drafting that many tokens each on average.
A long match is worth drafting deep where a short one is not: at large B every verified
token costs, and the short matches' drafts are mostly rejected. The K of one length is
chosen with the others held, length by length, until none moves (coordinate ascent: the
goodput is a ratio of two sums, and a few rounds settle it), within the engine's startup K.
The budget keeps the table's K wherever it is not predicted to beat it by `MIN_GAIN`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import polars as pl
from numpy.typing import ArrayLike, NDArray

from fitter.records import Records, as_frame
from fitter.surface.acceptance import acceptance_length, beta_posteriors
from fitter.surface.fit import SurfaceFit
from fitter.surface.latency import decode_matrix
from schemas.draft_budget import MAX_MATCH_LENGTHS, DraftBudget
from schemas.draft_table import DraftTable, TableError
from schemas.envelope import TableEnvelope

LatencyFn = Callable[[int, NDArray[np.float64]], NDArray[np.float64]]
"""T(B, mean drafts per decode request) in seconds, vectorised over the mean drafts."""

MAX_ROUNDS = 8
"""Coordinate-ascent rounds per batch size; two or three settle it in practice, the bound
only keeps a tie from cycling."""
PRIOR_MEAN, PRIOR_STRENGTH, EXTRAPOLATION_DECAY = 0.6, 8.0, 0.95
"""The acceptance model's priors (`fitter.surface.acceptance.AcceptanceModel`'s defaults):
a length's unmeasured positions are judged as the pooled model judges them."""
MIN_GAIN = 0.01
"""A budget departs from the table's K at a batch size only where it is predicted to gain
more than this: the latency fit prices mean drafts it never measured, and a budget that
gains less is within its error (GSM8K, lookup 1..4: -0.3 to -0.5% at some loads without)."""
MERGE_LOSS = 0.005
"""A batch size keeps its lower neighbour's K by length when that is predicted to cost it
under this share of goodput: a budget reads as a few ranges, not one per batch size."""
LATENCY_FLOOR_S = 1e-6
"""A fitted step latency is positive; the floor only keeps a ratio finite."""


def acceptance_lengths(conditional: ArrayLike, max_k: int) -> NDArray[np.float64]:
    """AL(K) for K = 0..max_k from conditional acceptance per draft position (the last
    rate holds for positions past the array)."""
    rates = np.asarray(conditional, dtype=np.float64)
    if rates.size == 0:
        rates = np.zeros(1)
    padded = np.concatenate([rates, np.full(max(0, max_k - rates.size), rates[-1])])[:max_k]
    return acceptance_length(padded, np.arange(max_k + 1))


def best_ks(batch_size: int, cap: int, lengths: NDArray[np.float64],
            share: NDArray[np.float64], latency: LatencyFn,
            k_values: Sequence[int] | None = None) -> tuple[int, ...]:
    """K per match length 0..M at one batch size, among `k_values` (default 0..cap) up to
    `cap` (a length drafts no K outside them, 0 included). `lengths[m, K]` is AL_m(K) for
    K = 0..cap (row 0, no match, is ignored: it never drafts); `share[m]` the share of
    decode requests whose lookup matched m tokens."""
    n_lengths = share.size
    allowed = sorted({int(k) for k in (k_values if k_values is not None else range(cap + 1))
                      if 0 <= k <= cap})
    if not allowed:
        raise ValueError(f"no K of {sorted(k_values or ())} is within 0..{cap}")
    candidates = np.array(allowed, dtype=np.int64)
    ks = np.full(n_lengths, candidates[-1], dtype=np.int64)
    ks[0] = 0
    rows = np.arange(n_lengths)
    for _ in range(MAX_ROUNDS):
        moved = False
        for length in range(1, n_lengths):
            if share[length] <= 0.0:
                continue
            others = ks.copy()
            others[length] = 0
            base_tokens = float(share @ lengths[rows, others])
            base_drafts = float(share @ others)
            tokens = (base_tokens - share[length] * lengths[length, 0]
                      + share[length] * lengths[length, candidates])
            drafts = base_drafts + share[length] * candidates
            goodput = tokens / latency(batch_size, drafts)
            best = int(candidates[np.argmax(goodput)])  # the smallest K among ties
            if best != ks[length]:
                ks[length], moved = best, True
        if not moved:
            break
    return tuple(int(k) for k in ks)


def derive_budget(cap_by_batch: Sequence[int], conditional_by_length: Sequence[ArrayLike],
                  share: ArrayLike, latency: LatencyFn, *, min_match: int = 1,
                  k_values: Sequence[int] | None = None,
                  table_by_batch: Sequence[int] | None = None,
                  min_gain: float = MIN_GAIN) -> DraftBudget:
    """The goodput-maximising budget for batch sizes 1..len(cap_by_batch) - 1.

    `cap_by_batch[B]`: the largest K at B (index 0 unused; the engine's startup K).
    `conditional_by_length[m]`: conditional acceptance per position of requests whose
    lookup matched m tokens, for m = 0..M (entry 0 unused). `share[m]`: their share of
    decode requests. `k_values`: the K an engine can run (its startup set; default all).
    `table_by_batch[B]`: the table's K, which every matched request drafts at B unless the
    best K by length is predicted to beat it by more than `min_gain`. A batch size joins the range below it when that
    range's K by length is predicted within `MERGE_LOSS` of its own choice."""
    shares = np.asarray(share, dtype=np.float64)
    if shares.ndim != 1 or shares.size != len(conditional_by_length) or shares.size < 2:
        raise ValueError("share and conditional_by_length need one entry per match length "
                         f"0..M, got {shares.size} and {len(conditional_by_length)}")
    if not 1 <= min_match < shares.size:
        raise ValueError(f"min_match {min_match} must be in 1..{shares.size - 1}")
    max_cap = max(int(k) for k in cap_by_batch[1:])
    lengths = np.stack([acceptance_lengths(c, max_cap) for c in conditional_by_length])
    ranges: list[tuple[int, int, tuple[int, ...]]] = []
    held: tuple[int, ...] | None = None  # the open range's K for every length 0..M
    for batch_size in range(1, len(cap_by_batch)):
        cap = int(cap_by_batch[batch_size])
        ks = best_ks(batch_size, cap, lengths[:, :cap + 1], shares, latency, k_values)
        chosen = goodput(batch_size, ks, lengths, shares, latency)
        if table_by_batch is not None:
            table_k = min(int(table_by_batch[batch_size]), cap)
            uniform = (0,) + (table_k,) * (shares.size - 1)
            kept = goodput(batch_size, uniform, lengths, shares, latency)
            if chosen <= (1.0 + min_gain) * kept:
                ks, chosen = uniform, kept
        if held is not None and max(held) <= cap and (
                goodput(batch_size, held, lengths, shares, latency)
                >= (1.0 - MERGE_LOSS) * chosen):
            ranges[-1] = (ranges[-1][0], batch_size, ranges[-1][2])
            continue
        held = ks
        ranges.append((batch_size, batch_size, ks[min_match:]))
    return DraftBudget(min_match=min_match, ranges=tuple(ranges))


def goodput(batch_size: int, ks: Sequence[int], lengths: NDArray[np.float64],
            share: NDArray[np.float64], latency: LatencyFn) -> float:
    """Predicted tokens/s at one batch size when match length m drafts `ks[m]`."""
    chosen = np.asarray(ks, dtype=np.int64)
    tokens = float(share @ lengths[np.arange(share.size), chosen])
    seconds = float(latency(batch_size, np.array([float(share @ chosen)]))[0])
    return batch_size * tokens / seconds


@dataclass(frozen=True, slots=True)
class MatchStatistics:
    """What telemetry says about requests by their n-gram match length."""

    share: NDArray[np.float64]
    """Share of decode requests per match length 0..M."""
    conditional: NDArray[np.float64]
    """(M + 1, positions): posterior mean of P(accept position i | reached it) per length."""


def match_statistics(records: Records, *, n_positions: int, max_match: int,
                     prior_mean: float = PRIOR_MEAN, prior_strength: float = PRIOR_STRENGTH,
                     extrapolation_decay: float = EXTRAPOLATION_DECAY) -> MatchStatistics:
    """Shares and chained Beta posteriors of acceptance per (match length, position) from
    the records' `by_match_length` sums. A position a length never reached keeps its
    predecessor's estimate, decayed and loosely held (`fitter.surface.acceptance`), so a
    K a budget has not drafted yet is priced plausibly rather than as worthless."""
    frame = as_frame(records, columns=("by_match_length",))
    if "by_match_length" not in frame.columns:
        raise ValueError("the records have no by_match_length column (schema version < 3)")
    parts = frame.select(pl.col("by_match_length").explode().struct.unnest()).drop_nulls()
    parts = parts.filter(pl.col("match_length").is_between(0, max_match))
    lengths = parts["match_length"].to_numpy().astype(np.int64)
    requests = np.bincount(lengths, weights=parts["requests"].to_numpy(),
                           minlength=max_match + 1)
    if requests.sum() <= 0:
        raise ValueError("no decode request with a match length in the records")
    reached = np.zeros((max_match + 1, n_positions))
    accepted = np.zeros((max_match + 1, n_positions))
    for column, into in (("reached_per_pos", reached), ("accepted_per_pos", accepted)):
        for length, counts in zip(lengths, parts[column].to_list(), strict=True):
            width = min(len(counts), n_positions)
            into[length, :width] += counts[:width]
    conditional = np.zeros_like(reached)
    for length in range(max_match + 1):
        alpha, beta = beta_posteriors(reached[length], np.minimum(accepted[length],
                                                                   reached[length]),
                                      prior_mean=prior_mean, prior_strength=prior_strength,
                                      extrapolation_decay=extrapolation_decay)
        conditional[length] = alpha / (alpha + beta)
    return MatchStatistics(requests / requests.sum(), conditional)


def fit_budget(surface: SurfaceFit, statistics: MatchStatistics, *, max_k: int,
               min_match: int, k_values: Sequence[int] | None = None,
               table: DraftTable | None = None) -> DraftBudget:
    """The budget `derive_budget` gives with the surface's step-latency model, each match
    length's K within the engine's startup `max_k`. A step of B decode requests drafting d
    tokens each on average is priced as the model prices B requests at `max_k` with
    d / max_k of the draft slots filled, at the context the surface holds for B. With
    `table`, the budget keeps the table's K where it is not predicted to gain `MIN_GAIN`."""
    cap = [max_k] * (surface.max_batch + 1)
    context = surface.context_tokens

    def latency(batch_size: int, drafts: NDArray[np.float64]) -> NDArray[np.float64]:
        share = drafts / max_k if max_k else np.zeros_like(drafts)
        rows = decode_matrix(batch_size, max_k, context[batch_size - 1], share)
        return np.maximum(surface.latency.predict(rows), LATENCY_FLOOR_S)

    return derive_budget(cap, list(statistics.conditional), statistics.share, latency,
                         min_match=min_match, k_values=k_values,
                         table_by_batch=None if table is None
                         else table.to_dense(surface.max_batch))


def add_fitted_budget(envelope: TableEnvelope, surface: SurfaceFit, records: Records, *,
                      max_k: int) -> TableEnvelope:
    """`envelope` with the budget fitted beside its table when the records report match
    lengths (else as it is), K among its startup set (`with_budget`). The lengths run
    from the shortest match seen (prompt_lookup_min: shorter n-grams are never matched) to
    the longest; a longer one takes the last K."""
    frame = as_frame(records, columns=("by_match_length",))
    if "by_match_length" not in frame.columns or max_k < 1:
        return envelope
    seen = (frame.select(pl.col("by_match_length").explode().struct.field("match_length"))
            .drop_nulls().to_series())
    matched = seen.filter(seen > 0)
    if matched.len() == 0:
        return envelope
    max_match = min(int(matched.max()), MAX_MATCH_LENGTHS)  # type: ignore[arg-type]
    min_match = min(int(matched.min()), max_match)  # type: ignore[arg-type]
    statistics = match_statistics(frame, n_positions=max_k, max_match=max_match)
    budget = fit_budget(surface, statistics, max_k=max_k, min_match=min_match,
                        k_values=envelope.startup_k_values, table=envelope.table)
    return with_budget(envelope, budget)


def with_budget(envelope: TableEnvelope, budget: DraftBudget) -> TableEnvelope:
    """`envelope` carrying `budget`; without it, and saying why in its provenance, when the
    budget does not validate against the envelope (a K outside its startup set): a budget
    must never cost a key its table."""
    try:
        return replace(envelope, budget=budget).validate()
    except TableError as exc:
        return replace(envelope, provenance={**envelope.provenance, "budget_refused": str(exc)})
