"""Random prompt-lookup cases for the tests that hold a lookup against vLLM's own."""

from __future__ import annotations

from typing import Any

import numpy as np


def lookup_cases(seed: int, count: int = 3000, max_len: int = 80) -> list[dict[str, Any]]:
    """Token sequences with n-gram ranges, K and max_model_len; small vocabularies make
    the n-grams repeat, so most cases match."""
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(count):
        vocab = int(rng.choice([2, 3, 5, 20, 1000]))
        length = int(rng.integers(0, max_len))
        min_n = int(rng.integers(1, 4))
        cases.append({"tokens": rng.integers(0, vocab, size=length).tolist(), "min_n": min_n,
                      "max_n": int(rng.integers(min_n, 6)), "k": int(rng.integers(1, 8)),
                      "max_model_len": length + int(rng.integers(-2, 10))})
    return cases
