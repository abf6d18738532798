"""How good is the first table `tabletune profile` makes? Profiled table vs every fixed K.

For each trace x drafter (SpecDecode-Bench traces, H100 / Llama-3.1-8B cost model): profile
the twin within the default budget, write the table, then run closed-loop loads at each
concurrency under the profiled table (policy `table:DIR/table.json`) and under every fixed K
in 0..max_k, same scenario and seed, side by side. The score per load is the table's
throughput over the best fixed K's at that load (the per-load oracle); the target is >= 97%
at every load and >= 99% on average. Prints one JSON object; with --out also writes
`profile_quality.json`, `profile_quality.md` and the profiled tables.

    .venv/bin/python bench/profile_quality.py [--quick] [--out DIR]
    .venv/bin/python -m bench.profile_quality --shapes all --traces sharegpt --out DIR

`--shapes`: the same on GPU-shaped latency tables (`twin.gpu_shapes`: staircase,
plateau, eager-jump, drafter-growth) besides or instead of the linear H100 model (`linear`;
`all` is both), one row per shape x trace x drafter; each table is written as CSV beside
the profiled table and runs as `[cost] table`. `tabletune bench` reports the file's figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.common import emit
from tabletune.profile import DEFAULT_BUDGET_S, profile
from twin import PhaseConfig, Scenario, run_scenario
from twin.config import CostConfig, DrafterConfig, EngineConfig
from twin.gpu_shapes import SHAPES, gpu_shaped_table
from twin.latency_table import write_latency_table
from twin.static import ngram_match_prob_for

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "specdecode-bench"
TRACES = ("sharegpt", "instructcoder", "gsm8k")
METHODS = ("eagle", "ngram")
CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_K = 7
FALLBACK_ACCEPTANCE = {  # docs/TWIN.md conditional rates, used only without the traces
    ("sharegpt", "eagle"): (0.69, 0.66, 0.69, 0.73, 0.76),
    ("sharegpt", "ngram"): (0.35, 0.84, 0.87, 0.90, 0.91),
    ("instructcoder", "eagle"): (0.72, 0.73, 0.75, 0.78, 0.80),
    ("instructcoder", "ngram"): (0.65, 0.93, 0.94, 0.95, 0.95),
    ("gsm8k", "eagle"): (0.72, 0.67, 0.65, 0.65, 0.65),
    ("gsm8k", "ngram"): (0.16, 0.61, 0.65, 0.68, 0.71),
}


def scenario(trace: str, method: str, concurrency: int, duration_s: float,
             seed: int, cost_table: Path | None = None) -> Scenario:
    path = DATA / f"{trace}.jsonl"
    return Scenario(
        seed=seed, name=f"{trace}-{method}",
        engine=EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_k=MAX_K),
        cost=(CostConfig(profile="h100-llama3.1-8b") if cost_table is None
              else CostConfig(table=str(cost_table))),
        drafter=DrafterConfig(method=method, ngram_match_prob=ngram_match_prob_for(path)
                              if method == "ngram" else 1.0),
        phases=(PhaseConfig(duration_s=duration_s, concurrency=concurrency, trace=str(path),
                            acceptance=FALLBACK_ACCEPTANCE[(trace, method)]),))


def measure(trace: str, method: str, *, loads: tuple[int, ...], duration_s: float,
            budget_s: float, seed: int, table_dir: Path,
            shape: str | None = None,
            profile_loads: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Profile once (at `profile_loads` only, as a live key's traffic allows, or over the
    sweep's own concurrencies), then every load under the table and under each fixed K."""
    started = time.monotonic()
    cost_table = None
    if shape is not None:
        cost_table = table_dir / f"{shape}-{method}.csv"
        cost_table.parent.mkdir(parents=True, exist_ok=True)
        write_latency_table(gpu_shaped_table(shape, method, max_k=MAX_K), cost_table)
    sweep = {} if profile_loads is None else {"concurrencies": profile_loads}
    result = profile(scenario(trace, method, loads[0], duration_s, seed + 1000, cost_table),
                     budget_s=budget_s, out_dir=table_dir, **sweep)
    profile_wall = time.monotonic() - started
    table_policy = f"table:{result.path}"
    rows = []
    for load in loads:
        case = scenario(trace, method, load, duration_s, seed, cost_table)
        fixed = {k: run_scenario(case, f"fixed:{k}").output_tokens_per_s
                 for k in range(MAX_K + 1)}
        table = run_scenario(case, table_policy).output_tokens_per_s
        best_k = max(fixed, key=lambda k: fixed[k])
        rows.append({"concurrency": load, "table_tok_s": round(table, 1),
                     "best_fixed_k": best_k, "best_fixed_tok_s": round(fixed[best_k], 1),
                     "ratio": round(table / fixed[best_k], 4),
                     "fixed_tok_s": {str(k): round(v, 1) for k, v in fixed.items()}})
    ratios = [r["ratio"] for r in rows]
    return {"trace": trace, "method": method, "shape": shape or "linear",
            "table": result.envelope.table.to_vllm(),
            "profile_engine_s": round(result.engine_time_s, 2),
            "profile_wall_s": round(profile_wall, 2), "profile_records": result.records,
            "mean_ratio": round(statistics.fmean(ratios), 4), "worst_ratio": min(ratios),
            "meets_target": min(ratios) >= 0.97 and statistics.fmean(ratios) >= 0.99,
            "loads": rows}


def markdown(results: list[dict[str, Any]], loads: tuple[int, ...]) -> str:
    header = ("| cost | trace | drafter | " + " | ".join(f"c={c}" for c in loads)
              + " | mean | worst | profile engine s | wall s |")
    lines = [header, "|" + "---|" * (len(loads) + 7)]
    for r in results:
        cells = " | ".join(f"{row['ratio']:.3f} (K{row['best_fixed_k']})" for row in r["loads"])
        lines.append(f"| {r['shape']} | {r['trace']} | {r['method']} | {cells} | "
                     f"{r['mean_ratio']:.4f} | "
                     f"{r['worst_ratio']:.4f} | {r['profile_engine_s']:g} | "
                     f"{r['profile_wall_s']:g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="CI size: one trace, both drafters, 4 loads, 30 s runs")
    parser.add_argument("--traces", nargs="+", choices=TRACES, default=None)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=None)
    parser.add_argument("--duration", type=float, default=None,
                        help="virtual seconds per evaluation run (default 180; quick 30)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"profile budget, engine seconds (default {DEFAULT_BUDGET_S:g})")
    parser.add_argument("--shapes", nargs="+", choices=("linear", *SHAPES, "all"),
                        default=None,
                        help="latency shapes: linear (the H100 coefficients, the default), "
                        "the GPU-shaped tables, or all of them")
    parser.add_argument("--loads", type=int, nargs="+", default=None,
                        help=f"concurrencies (default {' '.join(map(str, CONCURRENCIES))})")
    parser.add_argument("--profile-loads", type=int, nargs="+", default=None,
                        help="profile at these concurrencies only (a live key sees the load "
                        "it has), then score every load; default: the sweep's own")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default=None, help="write JSON, markdown and tables here")
    args = parser.parse_args(argv)
    traces = tuple(args.traces or (("sharegpt",) if args.quick else TRACES))
    methods = tuple(args.methods or METHODS)
    loads = tuple(args.loads or ((1, 8, 64, 256) if args.quick else CONCURRENCIES))
    chosen = ("linear", *SHAPES) if "all" in (args.shapes or ()) else (args.shapes or ("linear",))
    shapes = tuple(None if shape == "linear" else shape for shape in chosen)
    duration = args.duration or (30.0 if args.quick else 180.0)
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="profile-quality-"))
    started = time.monotonic()
    results = [measure(trace, method, loads=loads, duration_s=duration,
                       budget_s=args.budget_s, seed=args.seed, shape=shape,
                       profile_loads=tuple(args.profile_loads) if args.profile_loads else None,
                       table_dir=base / "tables" / f"{shape or 'linear'}-{trace}-{method}")
               for shape in shapes for trace in traces for method in methods]
    ratios = [row["ratio"] for r in results for row in r["loads"]]
    summary = {
        "command": "python -m bench.profile_quality " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "traces_found": DATA.exists(), "duration_s": duration, "budget_s": args.budget_s,
        "seed": args.seed, "profile_loads": args.profile_loads,
        "mean_ratio": round(statistics.fmean(ratios), 4),
        "worst_ratio": min(ratios), "all_meet_target": all(r["meets_target"] for r in results),
        "wall_s": round(time.monotonic() - started, 1), "results": results,
    }
    emit("profile_quality", summary, args.out)
    if args.out:
        (base / "profile_quality.md").write_text(markdown(results, loads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
