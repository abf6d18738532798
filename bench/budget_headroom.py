"""What per-request draft budgets can gain over the best fixed K, on the twin drafting for real.

For a trace, a prompt-lookup setting and each closed-loop load: every fixed K 0..max_k, and
every two-level budget "K_hi where the n-gram match is at least n tokens, else K_lo"
(`schemas.draft_budget`, under a table of K_hi). The best budget is picked on one seed and
scored on another against that seed's best fixed K, so the figure is not the pick's luck.
The budgets are static oracles: this is the headroom a learner can reach.

Beside them, two budgets `fitter.budget` derives: "derived", from the true statistics
(acceptance by match length and position, and each length's share, counted over the trace's
positions) and the twin's own latency model, which checks the derivation; and "learned",
from telemetry alone: a run of its own seed at the table's K (max_k) with a telemetry sink,
`fit_surface` on its records and `fit_budget` on the surface and the records' acceptance by
match length, which is what a fit on a live key does. Needs `../shared`'s traces (the twin
looks prompt lookup up on their tokens).

    .venv/bin/python -m bench.budget_headroom --trace instructcoder --lookup 1 4 \\
        --loads 1 32 128 [--max-k 7] [--duration 90] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import numpy as np

from bench.common import emit
from fitter.budget import derive_budget, fit_budget, match_statistics
from fitter.surface.fit import fit_surface
from producers.sinks import read_file_sink
from schemas import DraftTable
from schemas.draft_budget import DraftBudget
from twin import DrafterConfig, PhaseConfig, Scenario, run_scenario
from twin.config import CostConfig, EngineConfig
from twin.cost import step_cost
from twin.policies import StaticTable
from twin.workload import load_trace

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "specdecode-bench"
PICK_SEED, SCORE_SEED, LEARN_SEED = 1, 2, 5
MAX_BATCH = EngineConfig().max_num_seqs


def scenario(trace: Path, load: int, lookup: tuple[int, int], max_k: int, seed: int,
             duration_s: float) -> Scenario:
    return Scenario(seed=seed, engine=EngineConfig(max_k=max_k),
                    drafter=DrafterConfig(method="ngram", prompt_lookup_min=lookup[0],
                                          prompt_lookup_max=lookup[1]),
                    phases=(PhaseConfig(duration_s=duration_s, concurrency=load,
                                        trace=str(trace)),))


def throughput(trace: Path, load: int, lookup: tuple[int, int], max_k: int, k: int,
               budget: DraftBudget | None, seed: int, duration_s: float) -> float:
    policy = StaticTable(DraftTable.from_vllm([[1, MAX_BATCH, k]]), name=f"k{k}",
                         budget=budget)
    return run_scenario(scenario(trace, load, lookup, max_k, seed, duration_s),
                        policy).output_tokens_per_s


def learned_budget(trace: Path, load: int, lookup: tuple[int, int], max_k: int,
                   duration_s: float) -> DraftBudget:
    """The budget fitted from a telemetry run at the table's K, as a live key's fit would."""
    table = DraftTable.from_vllm([[1, MAX_BATCH, max_k]])
    with tempfile.TemporaryDirectory() as sink:
        run_scenario(scenario(trace, load, lookup, max_k, LEARN_SEED, duration_s),
                     StaticTable(table, name=f"k{max_k}"), sink=f"file://{sink}")
        records = read_file_sink(sink)
    surface = fit_surface(records, max_k=max_k, max_batch=MAX_BATCH, half_life_s=None)
    statistics = match_statistics(records, n_positions=max_k, max_match=lookup[1])
    return fit_budget(surface, statistics, max_k=max_k, min_match=lookup[0])


def two_level(lookup: tuple[int, int], high: int, low: int, at_least: int) -> DraftBudget:
    ks = [high if length >= at_least else low for length in range(lookup[0], lookup[1] + 1)]
    return DraftBudget(min_match=lookup[0], ranges=((1, MAX_BATCH, tuple(ks)),))


def headroom(trace: Path, load: int, lookup: tuple[int, int], max_k: int,
             duration_s: float) -> dict[str, object]:
    def run(k: int, budget: DraftBudget | None, seed: int) -> float:
        return throughput(trace, load, lookup, max_k, k, budget, seed, duration_s)

    fixed = {k: run(k, None, PICK_SEED) for k in range(max_k + 1)}
    candidates = {(high, low, n): run(high, two_level(lookup, high, low, n), PICK_SEED)
                  for high in range(1, max_k + 1) for low in range(high + 1)
                  for n in range(lookup[0] + 1, lookup[1] + 1)
                  if low < high or n == lookup[0] + 1}  # low == high: fixed K, once
    best = max(candidates, key=candidates.__getitem__)
    scored_fixed = {k: run(k, None, SCORE_SEED) for k in range(max_k + 1)}
    scored = run(best[0], two_level(lookup, *best), SCORE_SEED)
    best_k = max(scored_fixed, key=scored_fixed.__getitem__)
    derived = derived_budget(trace, load, lookup, max_k)
    derived_tok_s = run(max_k, derived, SCORE_SEED)
    learned = learned_budget(trace, load, lookup, max_k, duration_s)
    learned_tok_s = run(max_k, learned, SCORE_SEED)
    return {"load": load, "budget": {"k_high": best[0], "k_low": best[1], "at_least": best[2]},
            "pick_ratio": candidates[best] / max(fixed.values()),
            "score_ratio": scored / scored_fixed[best_k], "score_best_fixed_k": best_k,
            "score_tok_s": scored, "score_best_fixed_tok_s": scored_fixed[best_k],
            "derived": derived.k_by_match(load, lookup[1])[lookup[0]:],
            "derived_ratio": derived_tok_s / scored_fixed[best_k],
            "learned": learned.k_by_match(load, lookup[1])[lookup[0]:],
            "learned_ratio": learned_tok_s / scored_fixed[best_k]}


def derived_budget(trace: Path, load: int, lookup: tuple[int, int], max_k: int
                   ) -> DraftBudget:
    """`derive_budget` on the pool's true statistics and the twin's latency, at `load`."""
    pool = load_trace(trace, "ngram", prompt_lookup=lookup)
    assert pool.match_len is not None
    acc = np.minimum(pool.acc_len, max_k + 1)
    share = np.bincount(pool.match_len, minlength=lookup[1] + 1) / len(acc)
    conditional = []
    for length in range(lookup[1] + 1):
        at = acc[pool.match_len == length]
        reached = np.array([np.count_nonzero(at >= i) for i in range(1, max_k + 1)])
        accepted = np.array([np.count_nonzero(at >= i + 1) for i in range(1, max_k + 1)])
        conditional.append(np.divide(accepted, reached, out=np.zeros(max_k),
                                     where=reached > 0))
    context = float(np.mean(pool.prompt_len + pool.output_len / 2))
    step_s = step_cost(CostConfig(noise=0.0), "ngram", max_k).step_fn()

    def latency(batch_size: int, drafts: np.ndarray) -> np.ndarray:
        return np.array([step_s(int(batch_size * context), int(round(batch_size * (1 + d))),
                                max_k) for d in drafts])

    cap = [max_k] * (MAX_BATCH + 1)
    return derive_budget(cap, conditional, share, latency, min_match=lookup[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="instructcoder",
                        choices=("instructcoder", "sharegpt", "gsm8k"))
    parser.add_argument("--lookup", type=int, nargs=2, default=(1, 4), metavar=("MIN", "MAX"))
    parser.add_argument("--loads", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--max-k", type=int, default=7)
    parser.add_argument("--duration", type=float, default=90.0, help="virtual s per run")
    parser.add_argument("--out")
    args = parser.parse_args()
    trace = DATA / f"{args.trace}.jsonl"
    if not trace.is_file():
        raise SystemExit(f"{trace} is missing: this benchmark reads ../shared's traces")
    if not 1 <= args.lookup[0] < args.lookup[1]:
        raise SystemExit("--lookup MIN MAX needs 1 <= MIN < MAX: with MIN == MAX every "
                         "match has one length and a budget has nothing to key on")
    rows = [headroom(trace, load, tuple(args.lookup), args.max_k, args.duration)
            for load in args.loads]
    emit("budget_headroom", {"trace": args.trace, "lookup": list(args.lookup),
                             "max_k": args.max_k, "duration_s": args.duration,
                             "pick_seed": PICK_SEED, "score_seed": SCORE_SEED, "loads": rows},
         args.out)


if __name__ == "__main__":
    main()
