"""Static-batch mode: SpecDecode-Bench's `simulate_like_experiment`, reproduced.

The experiment, per batch size B and draft length K:
- 300 requests sampled without replacement with Python's `random.Random(42)` from the trace's
  requests that generated at least one token (in file order);
- each request runs as a batch of B identical copies that start together: one prefill step
  over B·prompt tokens (no KV yet), after which the KV holds B·(prompt + 1) tokens;
- without speculation: one token per copy per step until every copy generated `len(acc_len)`
  tokens; a step costs verify(KV, B) + overhead and then adds B tokens to the KV;
- with K: each step verifies K + 1 tokens per copy and emits min(acc_len[t], K + 1); a step
  costs verify(KV, Σ inputs) + that copy's draft time + overhead. Copies are processed in
  order and each one's accepted tokens (and, when it finishes, its whole context released)
  change the KV that the next copy's draft time sees;
- n-gram: where acc_len[t] == 1 the proposer finds no match with probability 1 − p (a Python
  `random()` draw in copy order, from the same generator as the sample): that copy verifies
  one token and costs no draft time. p is the dataset's (sharegpt .2, gsm8k .2, cnn .4,
  instructcoder .8, told by the trace's file name) unless given;
- per batch, throughput = B·generated / mean latency of its copies; speedup = mean over
  batches of throughput with K / mean of throughput without.
The one deliberate difference: with K = 0 no draft time is charged (speedup 1.0).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from twin.cost import CostModel
from twin.workload import RequestPool

NGRAM_MATCH_PROB = {"sharegpt": 0.2, "cnn": 0.4, "gsm8k": 0.2, "instructcoder": 0.8}
"""SpecDecode-Bench's chance that n-gram finds a match where nothing would be accepted."""
EXPERIMENT_REQUESTS = 300
EXPERIMENT_SEED = 42


@dataclass(frozen=True, slots=True)
class StaticResult:
    batch_size: int
    k: int
    speedup: float
    """Mean batch throughput with K over mean batch throughput without speculation."""

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def ngram_match_prob_for(trace: str | Path) -> float:
    """The dataset's match probability from the trace's file name; 1.0 (always) if unknown."""
    stem = Path(trace).stem.lower()
    for dataset, prob in NGRAM_MATCH_PROB.items():
        if dataset in stem:
            return prob
    return 1.0


def static_speedups(pool: RequestPool, *, method: str, batch_sizes: Sequence[int],
                    ks: Sequence[int], cost: CostModel, requests: int = EXPERIMENT_REQUESTS,
                    seed: int = EXPERIMENT_SEED, ngram_match_prob: float = 1.0,
                    ) -> list[StaticResult]:
    """Speedup of each fixed K over no speculation, for each batch size (B-major order)."""
    results = []
    for batch_size in batch_sizes:
        for k in ks:
            stream = random.Random(seed)  # noqa: S311 - reproduces the experiment's sampling
            chosen = np.array(stream.sample(range(len(pool)), k=min(requests, len(pool))))
            baseline = _no_spec_latency(pool, chosen, batch_size, cost)
            misses = None
            if method == "ngram" and ngram_match_prob < 1.0 and k > 0:
                misses = _ngram_misses(pool, chosen, batch_size, k, ngram_match_prob, stream)
            spec = _spec_latency(pool, chosen, batch_size, k, cost, misses)
            tokens = batch_size * pool.output_len[chosen]
            speedup = float(np.mean(tokens / spec) / np.mean(tokens / baseline))
            results.append(StaticResult(batch_size=batch_size, k=k, speedup=speedup))
    return results


def _no_spec_latency(pool: RequestPool, chosen: np.ndarray, b: int,
                     cost: CostModel) -> np.ndarray:
    """Per-request latency without speculation, in closed form (decode steps s = 0..G-2
    see KV = B·(P + 1 + s))."""
    prompt = pool.prompt_len[chosen].astype(np.float64)
    steps = pool.output_len[chosen].astype(np.float64) - 1
    prefill = cost.verify_s(0.0, b * prompt) + cost.step_overhead
    kv_sum = b * (steps * (prompt + 1) + steps * (steps - 1) / 2)
    decode = steps * (cost.verify_s(0.0, b) + cost.step_overhead) + cost.target_kv * kv_sum
    return prefill + decode


def _spec_latency(pool: RequestPool, chosen: np.ndarray, b: int, k: int, cost: CostModel,
                  unmatched: np.ndarray | None = None) -> np.ndarray:
    """Mean copy latency with K, every sampled request at once (one row per batch).

    The B copies of a request move in lock-step: an n-gram miss happens only where
    acc_len == 1, and then a copy emits one token whether it matched or not. So only the
    cost differs between copies: `unmatched[j]` is how many copies missed at the j-th
    acc_len == 1 step, counted batch by batch in step order. The draft time's KV is averaged
    over the copies' processing order (exact: the draft cost is linear in KV)."""
    prompt = pool.prompt_len[chosen]
    output = pool.output_len[chosen]
    offset = pool.acc_offset[chosen]
    generated = np.ones(len(chosen), dtype=np.int64)
    kv = (b * (prompt + 1)).astype(np.float64)
    latency = cost.verify_s(0.0, b * prompt.astype(np.float64)) + cost.step_overhead
    if unmatched is not None:
        next_miss = np.concatenate([[0], np.cumsum(_miss_steps(pool, chosen, k))[:-1]])
    rows = np.arange(len(chosen))
    while len(rows):
        target = pool.acc_len[offset[rows] + generated[rows] - 1]
        accepted = np.minimum(target, k + 1)
        drafting = np.full(len(rows), float(b))
        if unmatched is not None:
            at = np.flatnonzero(target == 1)
            drafting[at] -= unmatched[next_miss[rows[at]]]
            next_miss[rows[at]] += 1
        verify = cost.verify_s(kv[rows], drafting * (k + 1) + (b - drafting))
        generated[rows] += accepted
        done = generated[rows] >= output[rows]
        delta = accepted - np.where(done, generated[rows] + prompt[rows], 0)
        if k:
            draft = cost.draft_s(verify, kv[rows] + delta * (b - 1) / 2, k) * (drafting / b)
        else:
            draft = 0.0
        latency[rows] += verify + draft + cost.step_overhead
        kv[rows] += b * delta
        rows = rows[~done]
    return latency


def _miss_steps(pool: RequestPool, chosen: np.ndarray, k: int) -> np.ndarray:
    """Per sampled request, the steps at which acc_len == 1 (where n-gram may miss)."""
    output = pool.output_len[chosen]
    offset = pool.acc_offset[chosen]
    generated = np.ones(len(chosen), dtype=np.int64)
    counts = np.zeros(len(chosen), dtype=np.int64)
    rows = np.arange(len(chosen))
    while len(rows):
        target = pool.acc_len[offset[rows] + generated[rows] - 1]
        counts[rows] += target == 1
        generated[rows] += np.minimum(target, k + 1)
        rows = rows[generated[rows] < output[rows]]
    return counts


def _ngram_misses(pool: RequestPool, chosen: np.ndarray, b: int, k: int, match_prob: float,
                  stream: random.Random) -> np.ndarray:
    """Copies that miss at each acc_len == 1 step: B draws per such step, in the
    experiment's order (batch by batch, step by step, copy by copy)."""
    steps = int(_miss_steps(pool, chosen, k).sum())
    draws = np.fromiter((stream.random() for _ in range(steps * b)), dtype=np.float64,
                        count=steps * b).reshape(steps, b)
    return np.count_nonzero(draws >= match_prob, axis=1)
