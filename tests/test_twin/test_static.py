"""Static-batch mode: SpecDecode-Bench's experiment, checked by hand and on a GSM8K trace
(the shared one where it is there, else a generated one)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from twin.config import CostConfig
from twin.cost import CostModel
from twin.static import ngram_match_prob_for, static_speedups
from twin.workload import RequestPool, load_trace, parametric_pool


def toy_cost(method: str) -> CostModel:
    """Round coefficients so that expected latencies can be written out by hand."""
    return CostModel(target_kv=1e-3, target_batched=1e-2, target_fixed=1.0, draft_kv=1e-2,
                     draft_per_token=0.1, draft_fixed=0.5, ngram_fraction=0.1,
                     step_overhead=0.2, method=method)


def one_request(prompt: int, acc_len: list[int]) -> RequestPool:
    return RequestPool(np.array([prompt]), np.array([len(acc_len)]), np.array([0]),
                       np.array(acc_len), "toy")


def speedup(pool: RequestPool, method: str, b: int, k: int, match_prob: float = 1.0) -> float:
    [result] = static_speedups(pool, method=method, batch_sizes=[b], ks=[k],
                               cost=toy_cost(method), ngram_match_prob=match_prob)
    return result.speedup


# Prompt 2 tokens, 4 generated. Without speculation: prefill verify(KV 0, 2B tokens) + overhead,
# then 3 decode steps at KV = B·3, B·4, B·5, each verify(KV, B) + overhead.
NO_SPEC_B1 = (1.02 + 0.2) + (1.013 + 0.2) + (1.014 + 0.2) + (1.015 + 0.2)
NO_SPEC_B2 = (1.04 + 0.2) + (1.026 + 0.2) + (1.028 + 0.2) + (1.030 + 0.2)


def test_eagle_batch_of_one_by_hand():
    # K=1: step 1 at KV 3 verifies 2 tokens, accepts min(3, 2); step 2 at KV 5 accepts 2 -> done.
    spec = 1.22 + (1.023 + (0.03 + 0.2 + 0.5) + 0.2) + (1.025 + (0.05 + 0.2 + 0.5) + 0.2)
    assert speedup(one_request(2, [3, 1, 2, 1]), "eagle", 1, 1) == pytest.approx(NO_SPEC_B1 / spec)


def test_eagle_copies_see_the_kv_left_by_the_copies_before_them():
    # B=2: copy 0 drafts at KV 6 then adds its 2 tokens, so copy 1 drafts at KV 8. In step 2
    # copy 0 finishes and releases its 5 + 2 tokens before copy 1 drafts.
    copy0 = 1.24 + (1.046 + 0.76 + 0.2) + (1.05 + 0.80 + 0.2)
    copy1 = 1.24 + (1.046 + 0.78 + 0.2) + (1.05 + 0.75 + 0.2)
    expected = NO_SPEC_B2 / ((copy0 + copy1) / 2)
    assert speedup(one_request(2, [3, 1, 2, 1]), "eagle", 2, 1) == pytest.approx(expected)


def test_ngram_miss_verifies_one_token_without_draft_time():
    pool = one_request(2, [1, 3, 1, 1])
    # Always missing where nothing is accepted: step 1 verifies 1 token, no draft.
    missed = 1.22 + (1.013 + 0.2) + (1.034 + 0.1034 + 0.2)
    assert speedup(pool, "ngram", 1, 2, match_prob=0.0) == pytest.approx(NO_SPEC_B1 / missed)
    matched = 1.22 + (1.033 + 0.1033 + 0.2) + (1.034 + 0.1034 + 0.2)
    assert speedup(pool, "ngram", 1, 2, match_prob=1.0) == pytest.approx(NO_SPEC_B1 / matched)
    between = speedup(pool, "ngram", 4, 2, match_prob=0.5)
    assert speedup(pool, "ngram", 4, 2, 0.0) > between > speedup(pool, "ngram", 4, 2, 1.0)


def test_k0_is_no_speculation_on_both_code_paths():
    pool = parametric_pool((0.7, 0.6), prompt_len=50, output_len=40, max_k=3,
                           rng=np.random.default_rng(0), requests=64)
    for method in ("eagle", "ngram"):
        for b in (1, 7):
            assert speedup(pool, method, b, 0, match_prob=0.3) == pytest.approx(1.0, rel=1e-12)


@pytest.mark.shared_traces
@pytest.mark.parametrize("method", ["eagle", "ngram"])
def test_experiment_on_gsm8k(method, shared_or_generated_traces: Path):
    pool = load_trace(shared_or_generated_traces / "gsm8k.jsonl", method)
    assert len(pool) >= 300  # the experiment samples 300 requests
    cost = CostModel.from_config(CostConfig(), method)
    results = static_speedups(pool, method=method, batch_sizes=[1, 32], ks=[1, 3, 5],
                              cost=cost, ngram_match_prob=ngram_match_prob_for("gsm8k.jsonl"))
    table = {(r.batch_size, r.k): r.speedup for r in results}
    assert len(table) == 6
    again = static_speedups(pool, method=method, batch_sizes=[32], ks=[3], cost=cost,
                            ngram_match_prob=0.2)
    assert again[0].speedup == table[(32, 3)]  # the fixed-seed sample: reproducible
    for k in (1, 3, 5):
        assert table[(1, k)] > table[(32, k)]  # speculation pays less in larger batches
    if method == "eagle":
        assert table[(1, 5)] > table[(1, 3)] > table[(1, 1)] > 1.2
    else:
        assert 1.0 < table[(1, 1)] < 1.3  # n-gram rarely matches on GSM8K


def test_match_probability_follows_the_dataset_name():
    assert ngram_match_prob_for("/x/instructcoder.jsonl") == 0.8
    assert ngram_match_prob_for("combined_sharegpt.jsonl") == 0.2
    assert ngram_match_prob_for("mine.jsonl") == 1.0


@pytest.mark.parametrize("method", ["eagle", "ngram"])
@pytest.mark.parametrize("knee", [0, 256])
def test_the_engines_bound_step_time_is_step_s_to_the_bit(method, knee):
    cost = CostModel.from_config(CostConfig(knee_tokens=knee), method)
    step_s = cost.step_fn()
    rng = np.random.default_rng(7)
    for kv, batched, k in zip(rng.integers(0, 10**6, 500).tolist(),
                              rng.integers(1, 9000, 500).tolist(),
                              rng.integers(0, 8, 500).tolist(), strict=True):
        assert step_s(kv, batched, k) == cost.step_s(kv, batched, k)
