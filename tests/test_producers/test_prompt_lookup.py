"""Our prompt lookup proposes exactly what vLLM's own n-gram proposer does."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from producers.prompt_lookup import PromptLookupIndex, prompt_lookup
from tests.test_producers.lookup_cases import lookup_cases

VLLM_SEARCH = """
import json, sys
import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens
cases = json.load(sys.stdin)
print(json.dumps([_find_longest_matched_ngram_and_propose_tokens(
    origin_tokens=np.array(c["tokens"], dtype=np.int32), min_ngram=c["min_n"],
    max_ngram=c["max_n"], max_model_len=c["max_model_len"], k=c["k"]).tolist()
    for c in cases]))
"""
"""vLLM's own search, in a child process: importing vLLM's spec-decode modules here would
leave numba objects in this process that break the vLLM engine the hook tests start."""


def test_the_same_drafts_as_vllms_proposer() -> None:
    cases = lookup_cases(seed=0)
    child = subprocess.run([sys.executable, "-c", VLLM_SEARCH], input=json.dumps(cases),
                           capture_output=True, text=True, timeout=300, check=True)
    drafts = json.loads(child.stdout.strip().splitlines()[-1])
    matched = 0
    for case, theirs in zip(cases, drafts, strict=True):
        ours = prompt_lookup(np.array(case["tokens"], dtype=np.int32), min_n=case["min_n"],
                             max_n=case["max_n"], k=case["k"],
                             max_model_len=case["max_model_len"])
        assert ours.draft.tolist() == theirs, case
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


def test_the_incremental_index_looks_up_what_a_full_scan_does() -> None:
    rng = np.random.default_rng(1)
    for _ in range(300):
        vocab = int(rng.choice([2, 3, 5, 20]))
        tokens = rng.integers(0, vocab, size=int(rng.integers(0, 60)))
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        index = PromptLookupIndex(min_n=min_n, max_n=max_n)
        for end in range(len(tokens) + 1):
            k = int(rng.integers(0, 8))
            limit = None if rng.random() < 0.5 else end + int(rng.integers(-2, 5))
            scan = prompt_lookup(tokens[:end], min_n=min_n, max_n=max_n, k=k,
                                 max_model_len=limit)
            probe = index.lookup(k, max_model_len=limit)
            assert (probe.match_length, probe.draft.tolist()) == (
                scan.match_length, scan.draft.tolist()), (tokens[:end].tolist(), min_n, max_n, k)
            if end < len(tokens):
                index.extend(tokens[end:end + 1].tolist())
