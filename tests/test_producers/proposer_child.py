"""TableTune's n-gram proposer run in a child process, JSON in on stdin and out on stdout.

Its kernel is numba-compiled, like vLLM's own; numba objects left in the test process break
the vLLM engine the hook tests start there, so the tests call this instead.

    python -m tests.test_producers.proposer_child lookup   # cases -> ours and vLLM's drafts
    python -m tests.test_producers.proposer_child propose  # one batch under a K or budget
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np


def lookup(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens as vllm_lookup,
    )

    from producers.ngram_proposer import compiled_lookup

    kernel = compiled_lookup()
    out = []
    for case in cases:
        tokens = np.array(case["tokens"], dtype=np.int32)
        starts, lengths, matched = (np.zeros(1, dtype=np.int32) for _ in range(3))
        kernel(np.zeros(1, dtype=np.int32), np.array([len(tokens)], dtype=np.int32),
               tokens.reshape(1, -1) if len(tokens) else np.zeros((1, 1), dtype=np.int32),
               case["min_n"], case["max_n"], case["max_model_len"], case["k"], starts,
               lengths, matched)
        start, match, take = int(starts[0]), int(matched[0]), int(lengths[0])
        theirs = vllm_lookup(tokens, case["min_n"], case["max_n"], case["max_model_len"],
                             case["k"])
        out.append({"ours": tokens[start:start + take].tolist(), "match": int(match),
                    "theirs": theirs.tolist()})
    return out


HOOK = "producers.vllm.TableTuneScheduler"
"""`--scheduler-cls` as users give it."""


def propose(spec: dict[str, Any]) -> dict[str, Any]:
    from producers.ngram_proposer import TableTuneNgramProposer
    from producers.proposer_link import PROPOSER_CLASS

    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=spec["k"],
                                           method="custom_class", model=PROPOSER_CLASS),
        model_config=SimpleNamespace(max_model_len=spec["max_model_len"]),
        scheduler_config=SimpleNamespace(scheduler_cls=HOOK if spec["hook"] else None,
                                         async_scheduling=False))
    proposer = TableTuneNgramProposer(config)
    rows = spec["rows"]
    token_ids = np.zeros((len(rows), spec["max_model_len"]), dtype=np.int32)
    for i, row in enumerate(rows):
        token_ids[i, :len(row)] = row
    drafts = proposer.propose(spec["sampled"], np.array([len(r) for r in rows], dtype=np.int32),
                              token_ids)
    return {"drafts": drafts, "lookup_range": [proposer.min_n, proposer.max_n]}


def main() -> None:
    command, data = sys.argv[1], json.load(sys.stdin)
    result = lookup(data) if command == "lookup" else propose(data)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
