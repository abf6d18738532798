"""One place for the tiny-engine configuration the vLLM tests share.

Run as a script it generates with vLLM's stock scheduler and prints the greedy token ids as
JSON: the reference our hook must not change (a second engine cannot start in one process).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

STARTUP_TABLE = [[1, 2, 4], [3, 6, 2], [7, 16, 1]]
MAX_NUM_SEQS = 16
MAX_K = 4


def engine_environment(cache_dir: str) -> dict[str, str]:
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": cache_dir,
    }


def llm_kwargs(model_dir: str) -> dict[str, Any]:
    return {
        "model": model_dir,
        "max_model_len": 512,
        "max_num_seqs": MAX_NUM_SEQS,
        "enforce_eager": True,
        "dtype": "float32",
        "seed": 0,
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": MAX_K,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
            "num_speculative_tokens_per_batch_size": STARTUP_TABLE,
        },
    }


def prompts(count: int, offset: int = 0) -> list[str]:
    topics = ["the list of values", "a module of numbers", "the sum of the file",
              "an object in the class", "the return value of a function"]
    return [f"Request {i}: describe {topics[i % len(topics)]} and {topics[(i * 3) % 5]}"
            for i in range(offset, offset + count)]


def generate(llm: Any, batch: list[str], max_tokens: int = 40) -> list[list[int]]:
    from vllm import SamplingParams
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens),
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    model_dir, spec = sys.argv[1], json.loads(sys.argv[2])
    os.environ.update(engine_environment(os.environ.get("VLLM_CACHE_ROOT", "/tmp")))
    from vllm import LLM
    llm = LLM(**llm_kwargs(model_dir))
    print("RESULT " + json.dumps([generate(llm, prompts(**b)) for b in spec]), flush=True)


if __name__ == "__main__":
    main()
