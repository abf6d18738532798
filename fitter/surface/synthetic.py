"""Synthetic step telemetry from a parametric cost model, vectorised (a million steps in ~1 s).

For tests, benchmarks and `profile` dry runs: the twin (producers/) is the faithful simulated
engine; this is the quick stand-in that writes the same `STEP_RECORD_SCHEMA` columns with a
known ground truth, so a fit can be scored against the truth it was generated from.
Defaults are the H100 / Llama-3.1-8B cost model and ShareGPT EAGLE acceptance of docs/TWIN.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from numpy.typing import ArrayLike, NDArray

from schemas.step_record import REQUEST_SEGMENT_TYPE, SCHEMA_VERSION, STEP_RECORD_SCHEMA

SHAREGPT_EAGLE_CONDITIONAL: tuple[float, ...] = (0.66, 0.576, 0.553, 0.66, 0.66, 0.66, 0.66)
"""Conditional acceptance per position consistent with the ShareGPT EAGLE AL column of
docs/TWIN.md, acceptance (1.66 2.04 2.25 . 2.48 . 2.58; K=4 and 6 interpolated geometrically).
The table's own 'conditional' column does not reproduce its AL column, and the AL column is
what the quoted best-K pattern was derived from."""

GSM8K_NGRAM_CONDITIONAL: tuple[float, ...] = (0.16, 0.61, 0.65, 0.68, 0.71, 0.71, 0.71)
"""A very different drafter/workload, for drift tests (docs/TWIN.md, acceptance: GSM8K
n-gram)."""


@dataclass(frozen=True, slots=True)
class CostModel:
    """Step latency in seconds: drafter + target verify + per-step overhead."""

    verify_per_kv_s: float = 3.92645679e-08
    verify_per_token_s: float = 2.10103129e-05
    verify_base_s: float = 5.88590713e-03
    draft_per_kv_s: float = 2.37768493e-09
    draft_per_position_s: float = 8.41429603e-07
    """Times (K + 1), as SpecDecode-Bench fitted it."""
    draft_base_s: float = 2.13526175e-03
    overhead_s: float = 1.20683946e-03
    knee_tokens: float = 0.0
    """Verify is flat in batched tokens up to here (memory-bound), linear after; 0 = linear."""
    drafter: str = "eagle"
    """'eagle' (SpecDecode-Bench EAGLE cost) or 'ngram' (0.5875% of verify)."""

    def step_latency_s(self, batched_tokens: ArrayLike, kv_tokens: ArrayLike,
                       k: ArrayLike) -> NDArray[np.float64]:
        tokens = np.asarray(batched_tokens, dtype=np.float64)
        kv = np.asarray(kv_tokens, dtype=np.float64)
        kk = np.asarray(k, dtype=np.float64)
        verify = (self.verify_base_s + self.verify_per_kv_s * kv
                  + self.verify_per_token_s * np.maximum(tokens - self.knee_tokens, 0.0))
        if self.drafter == "ngram":
            draft = 0.005875 * verify
        else:
            draft = (self.draft_per_kv_s * kv + self.draft_per_position_s * (kk + 1.0)
                     + self.draft_base_s)
        return verify + np.where(kk > 0, draft, 0.0) + self.overhead_s

    def decode_latency_s(self, batch_size: ArrayLike, k: ArrayLike,
                         context_tokens: float) -> NDArray[np.float64]:
        """Latency of a pure decode step: the quantity the table trades off against AL."""
        b = np.asarray(batch_size, dtype=np.float64)
        kk = np.asarray(k, dtype=np.float64)
        return self.step_latency_s(b * (kk + 1.0), b * context_tokens, kk)


H100_EAGLE = CostModel()

LEDGER_MEAN_STEPS = 200.0
"""Decode steps per synthetic finished request (Gamma, shape 2): a few hundred tokens at K > 0,
as the twin's parametric requests."""


def true_acceptance_length(conditional: Sequence[float], k: ArrayLike) -> NDArray[np.float64]:
    """AL(K) = 1 + sum_{i<=K} prod_{j<=i} p_j for the generator's conditional rates."""
    cumulative = np.concatenate([[0.0], np.cumsum(np.cumprod(conditional))])
    return 1.0 + cumulative[np.asarray(k, dtype=np.int64)]


def make_step_records(
    n_steps: int,
    *,
    seed: int = 0,
    cost: CostModel = H100_EAGLE,
    conditional: Sequence[float] = SHAREGPT_EAGLE_CONDITIONAL,
    conditional_after: Sequence[float] | None = None,
    drift_at: float = 0.5,
    k_values: Sequence[int] = tuple(range(8)),
    k_table: Sequence[int] | None = None,
    max_batch: int = 256,
    context_tokens: float = 512.0,
    prefill_fraction: float = 0.1,
    noise_rel: float = 0.03,
    outlier_fraction: float = 0.01,
    n_engines: int = 1,
    engine_prefix: str = "engine",
    forced: bool = False,
    start_ns: int = 1_700_000_000_000_000_000,
    draft_share: float = 1.0,
    finished_per_step: float = 0.0,
) -> pa.Table:
    """`n_steps` step records; K is uniform over `k_values` or, if given, `k_table[batch]`.

    Batch sizes are log-uniform over 1..max_batch (small batches are common in serving and
    where K matters most); a `prefill_fraction` of steps carries one chunked prefill; noise is
    multiplicative Gaussian, and `outlier_fraction` of steps are 1.5-4x slower (preemptions,
    GC). After `drift_at` (a fraction of the steps) acceptance follows `conditional_after`.
    `forced` marks every step as an exploration step (K not the table's choice).
    `draft_share` < 1 is an n-gram-like drafter: each decode request drafts K tokens with that
    probability and proposes nothing otherwise (`conditional` is then acceptance among
    drafting requests); a step where nobody drafted verifies nothing (k = 0, k_next = K).
    `finished_per_step` > 0 gives each step a Poisson number of finished requests whose
    ledger (`finished_requests`) accepts like the steps, every request alike (0: none, and
    each K is priced at one context).
    """
    rng = np.random.default_rng(seed)
    batch = np.floor(np.exp(rng.uniform(0.0, np.log(max_batch + 1.0), n_steps))).astype(np.int64)
    batch = np.clip(batch, 1, max_batch)
    if k_table is not None:
        k = np.asarray(k_table, dtype=np.int64)[batch]
    else:
        k = rng.choice(np.asarray(k_values, dtype=np.int64), size=n_steps)
    prefill_reqs = (rng.random(n_steps) < prefill_fraction).astype(np.int64)
    prefill_tokens = prefill_reqs * rng.integers(16, 2048, n_steps)
    decode = batch - prefill_reqs
    ctx = context_tokens * rng.lognormal(0.0, 0.25, n_steps)
    kv = np.round(decode * ctx + prefill_tokens).astype(np.int64)
    k_next = k
    if draft_share < 1.0:  # extra draws only here: draft_share = 1 keeps every stream as before
        drafts = np.where(k > 0, rng.binomial(decode, draft_share), 0)
        k = np.where(drafts > 0, k, 0)
    else:
        drafts = np.where(k > 0, decode, 0)
    batched = decode + drafts * k + prefill_tokens

    latency = (cost.step_latency_s(batched, kv, k_next)
               * (1.0 + noise_rel * rng.standard_normal(n_steps)))
    outlier = rng.random(n_steps) < outlier_fraction
    latency[outlier] *= rng.uniform(1.5, 4.0, outlier.sum())
    latency = np.maximum(latency, 1e-5)

    accepted = _accepted_counts(rng, drafts, k, conditional, conditional_after, drift_at)
    lengths = np.where(drafts > 0, k, 0)
    in_list = np.arange(accepted.shape[1])[None, :] < lengths[:, None]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    per_pos = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()),
                                       pa.array(accepted[in_list].astype(np.int32)))

    elapsed_ns = np.cumsum(latency * 1e9).astype(np.int64)
    columns = {
        "schema_version": np.full(n_steps, SCHEMA_VERSION, np.int16),
        "engine_id": pa.array([f"{engine_prefix}-{i}" for i in range(n_engines)]).take(
            pa.array(np.arange(n_steps) % n_engines)),
        "model": pa.array(["llama-3.1-8b"] * n_steps),
        "drafter": pa.array([cost.drafter] * n_steps),
        "hardware": pa.array(["h100"] * n_steps),
        "ts_ns": start_ns + elapsed_ns // n_engines,
        "step_seq": np.arange(n_steps) // n_engines,
        "batch_size": batch.astype(np.int32),
        "num_decode_reqs": decode.astype(np.int32),
        "num_prefill_reqs": prefill_reqs.astype(np.int32),
        "num_prefill_tokens": prefill_tokens.astype(np.int32),
        "k": k.astype(np.int16),
        "k_next": k_next.astype(np.int16),
        "table_version": np.zeros(n_steps, np.int64),
        "num_drafts": drafts.astype(np.int32),
        "num_draft_tokens": (drafts * k).astype(np.int32),
        "num_accepted_tokens": np.where(in_list, accepted, 0).sum(axis=1).astype(np.int32),
        "accepted_per_pos": per_pos,
        "kv_tokens": kv,
        "ctx_len_mean": ctx,
        "ctx_len_max": np.round(ctx * 1.5).astype(np.int32),
        "step_latency_s": latency,
        "inter_step_s": np.full(n_steps, 2e-4),
        "forced": np.full(n_steps, forced),
        "finished_requests": _ledger(np.random.default_rng([seed, 1]), finished_per_step,
                                     k_next, conditional, draft_share, context_tokens),
        "by_match_length": pa.array([[]] * n_steps,
                                    type=STEP_RECORD_SCHEMA.field("by_match_length").type),
    }
    return pa.table({name: columns[name] for name in STEP_RECORD_SCHEMA.names},
                    schema=STEP_RECORD_SCHEMA)


def _accepted_counts(rng: np.random.Generator, drafts: NDArray[np.int64], k: NDArray[np.int64],
                     conditional: Sequence[float], conditional_after: Sequence[float] | None,
                     drift_at: float) -> NDArray[np.int64]:
    """Unconditional accepted counts per position: A_i ~ Binomial(A_{i-1}, p_i), A_0 = drafts."""
    n_steps = drafts.size
    n_positions = max(int(k.max(initial=0)), 1)
    rates = np.tile(_padded(conditional, n_positions), (n_steps, 1))
    if conditional_after is not None:
        rates[int(drift_at * n_steps):] = _padded(conditional_after, n_positions)
    accepted = np.zeros((n_steps, n_positions), np.int64)
    previous = drafts
    for i in range(n_positions):
        previous = np.where(k > i, rng.binomial(previous, rates[:, i]), 0)
        accepted[:, i] = previous
    return accepted


def _padded(conditional: Sequence[float], n_positions: int) -> NDArray[np.float64]:
    """Rates for positions 1..n_positions; the last given rate repeats."""
    rates = np.asarray(conditional, dtype=np.float64)
    if rates.size < n_positions:
        rates = np.concatenate([rates, np.full(n_positions - rates.size, rates[-1])])
    return rates[:n_positions]


def _ledger(rng: np.random.Generator, per_step: float, k: NDArray[np.int64],
            conditional: Sequence[float], draft_share: float,
            context_tokens: float) -> pa.ListArray:
    """Finished requests per step, one segment each: steps ~ Gamma around
    `LEDGER_MEAN_STEPS`, drafting at `draft_share` at the step's K, positions accepted at
    `conditional` (chained), whatever the request. Its own random stream: the steps' draws
    stay as they were without it."""
    counts = rng.poisson(per_step, k.size) if per_step > 0 else np.zeros(k.size, np.int64)
    n = int(counts.sum())
    request_k = np.repeat(k, counts)
    steps = np.maximum(np.rint(rng.gamma(2.0, LEDGER_MEAN_STEPS / 2.0, n)), 1).astype(np.int64)
    reached = np.where(request_k > 0, rng.binomial(steps, draft_share), 0)
    drafting = reached.copy()
    positions = max(int(k.max(initial=0)), 1)
    rates = _padded(conditional, positions)
    reached_rows = np.zeros((n, positions), np.int64)
    accepted_rows = np.zeros((n, positions), np.int64)
    for i in range(positions):
        reached = np.where(request_k > i, reached, 0)
        reached_rows[:, i] = reached
        accepted_rows[:, i] = rng.binomial(reached, rates[i])
        reached = accepted_rows[:, i]
    in_list = np.arange(positions)[None, :] < request_k[:, None]
    offsets = pa.array(np.concatenate([[0], np.cumsum(request_k)]).astype(np.int32))
    segments = pa.StructArray.from_arrays(
        [pa.array(np.concatenate([np.arange(c) for c in counts]).astype(np.int32)
                  if n else np.zeros(0, np.int32)),
         pa.array(np.zeros(n, np.int8)),
         pa.array(steps.astype(np.int32)),
         pa.array(drafting.astype(np.int32)),
         pa.array((steps + accepted_rows.sum(axis=1)).astype(np.int32)),
         pa.array(np.rint(steps * context_tokens).astype(np.int64)),
         pa.ListArray.from_arrays(offsets, pa.array(reached_rows[in_list].astype(np.int32))),
         pa.ListArray.from_arrays(offsets, pa.array(accepted_rows[in_list].astype(np.int32)))],
        fields=list(REQUEST_SEGMENT_TYPE))
    step_offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
    return pa.ListArray.from_arrays(step_offsets, segments)
