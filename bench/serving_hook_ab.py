"""Hook A/B under vLLM's client: TableTune's scheduler at a forced K against vLLM's own.

    .venv/bin/python -m bench.serving_hook_ab [--k 2] [--pairs 3] [--phases low high] [--out DIR]

Each pair runs two fresh OpenAI API servers of `bench.real_serving`'s model pair, one after
the other, with the same phases of `vllm bench serve` load: `fixed:K` (the hook, a startup
table of every K in 0..4, a `force` of K from the tables topic, telemetry to the broker) and
`stock:K` (vLLM's stock scheduler with K as its startup table, no TableTune at all). Their
order alternates from pair to pair, so a machine that slows over the run weighs on both.
Score: vLLM's client's output tokens/s and median TPOT per phase. Per pair the hook's over
stock's, and the median over pairs; the noise is the stock arm's own spread over pairs.

--quick: the tiny model and its n-gram drafter, one pair, the quick phase (a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import emit
from bench.real_engine import startup_table
from bench.real_serving import MAX_K, MAX_NUM_SEQS, add_model_arguments, build_model
from bench.serving_arm import ArmContext, ArmRun, run_arm
from bench.serving_plan import FULL_PHASES, QUICK_PHASES, Slot, is_stock
from schemas.settings import Settings
from tabletune.broker import EmbeddedBroker

METRICS = ("output_throughput", "median_tpot_ms")


def pair_order(pairs: int, k: int) -> list[Slot]:
    """stock, hook | hook, stock | ...: each pair's first arm alternates."""
    slots = []
    for repeat in range(1, pairs + 1):
        arms = [f"stock:{k}", f"fixed:{k}"]
        slots += [Slot(repeat, arm) for arm in (arms if repeat % 2 else arms[::-1])]
    return slots


def summarize(runs: list[ArmRun], phases: list[str]) -> dict[str, Any]:
    """Per phase and metric: each pair's hook / stock ratio, their median, and the noise
    (the stock arm's max / min over pairs, minus 1)."""
    by_pair: dict[int, dict[str, ArmRun]] = {}
    for run in runs:
        by_pair.setdefault(run.slot.repeat, {})["stock" if is_stock(run.slot.arm)
                                                else "hook"] = run
    whole = [pair for pair in by_pair.values() if len(pair) == 2]
    out: dict[str, Any] = {"pairs": len(whole), "per_phase": {}}
    for phase in phases:
        row: dict[str, Any] = {}
        for metric in METRICS:
            stock = [float(p["stock"].results[phase][metric]) for p in whole]
            hook = [float(p["hook"].results[phase][metric]) for p in whole]
            ratios = [h / s for h, s in zip(hook, stock, strict=True)]
            row[metric] = {
                "stock": [round(v, 2) for v in stock], "hook": [round(v, 2) for v in hook],
                "ratios": [round(r, 3) for r in ratios],
                "median_ratio": round(statistics.median(ratios), 3) if ratios else None,
                "stock_noise": round(max(stock) / min(stock) - 1, 3) if stock else None}
        out["per_phase"][phase] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=2, help="the K both arms run (default 2)")
    parser.add_argument("--pairs", type=int, default=3, help="A/B pairs (default 3)")
    parser.add_argument("--phases", nargs="+", default=["low", "high"],
                        choices=[p.name for p in FULL_PHASES],
                        help="bench.real_serving's phases each arm runs (default low high)")
    parser.add_argument("--lead-s", type=float, default=5.0,
                        help="each phase is measured after this warm-up (default 5)")
    parser.add_argument("--measure-s", type=float, default=30.0,
                        help="then this long, before the drain (default 30)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, one pair, the quick phase: a smoke run")
    parser.add_argument("--out", default="bench-out/hook-ab")
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    if not 0 <= args.k <= MAX_K:
        parser.error(f"--k must be within 0..{MAX_K}")
    if args.quick:
        args.pairs = 1
    args.model = None  # build_model's --quick option: build the tiny model
    t0 = time.monotonic()
    out = Path(args.out)
    work = Path(args.work or tempfile.mkdtemp(prefix="tabletune-hook-ab-"))
    setup = build_model(args, work)
    phases = QUICK_PHASES if args.quick else tuple(p for p in FULL_PHASES
                                                   if p.name in args.phases)
    runs: list[ArmRun] = []
    with EmbeddedBroker() as broker:
        settings = Settings.from_env({"TABLETUNE_BOOTSTRAP": broker.bootstrap})
        ctx = ArmContext(setup, startup_table(MAX_K, MAX_NUM_SEQS), settings,
                         broker.bootstrap, "hook-ab", out, work / "vllm-cache", phases,
                         args.lead_s, args.measure_s,
                         probe=not args.quick)
        for slot in pair_order(args.pairs, args.k):
            print(f"[{time.monotonic() - t0:5.0f} s] pair {slot.repeat}: {slot.arm}",
                  file=sys.stderr, flush=True)
            runs.append(run_arm(ctx, slot))
    result = {"command": "python -m bench.serving_hook_ab" + (" --quick" if args.quick
                                                              else f" --k {args.k}"),
              "k": args.k, "model": setup.served_name,
              "phases": [p.describe() for p in phases],
              **summarize(runs, [p.name for p in phases]),
              "wall_s": round(time.monotonic() - t0, 1)}
    emit("hook_ab", result, str(out))
    complete = all(r.results[p.name].get("completed") and not r.results[p.name].get("failed")
                   for r in runs for p in phases)
    return 0 if complete and result["pairs"] == args.pairs else 1


if __name__ == "__main__":
    sys.exit(main())
