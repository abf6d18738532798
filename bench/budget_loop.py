"""Per-request budgets in the closed loop: `tabletune` with budgets beside its table alone.

For each trace and load, the suite's load scenario (60 s warm-up, 180 s measured, the
suite's seed per load; `tabletune.suite.grid`) with n-gram drafted for real (prompt lookup
MIN..MAX on the trace's tokens), run under every fixed K 0..max_k, `tabletune` (budgets on,
the default) and `tabletune:budgets=0` (its table alone), side by side. Closed loop scores
the measured phase's output tokens/s, open loop each request's decode rate (1000 / TPOT
p50), as the suite does. Each cell: the policy over that load's best fixed K. Needs
`../shared`'s traces.

    .venv/bin/python -m bench.budget_loop [--traces instructcoder sharegpt] [--lookup 1 4]
        [--loads 1 8 32 64 128 256] [--rates 1000 3000 6000] [--processes 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.common import emit
from tabletune.suite.grid import FULL, LENGTHS, load_scenario_for
from twin import Scenario, run_scenario
from twin.config import DrafterConfig

ADAPTIVE = ("tabletune", "tabletune:budgets=0")


def scenario(trace: str, lookup: tuple[int, int], *, concurrency: int | None = None,
             rate_rps: float | None = None) -> Scenario:
    base = load_scenario_for(FULL, trace, "ngram", concurrency=concurrency, rate_rps=rate_rps)
    drafter = DrafterConfig(method="ngram", prompt_lookup_min=lookup[0],
                            prompt_lookup_max=lookup[1])
    return dataclasses.replace(base, drafter=drafter, name=f"{base.name}-lookup")


def score(task: tuple[Scenario, str, bool]) -> float:
    case, policy, closed = task
    measured = run_scenario(case, policy).phases[-1]
    if closed:
        return float(measured["output_tokens_per_s"])
    tpot = measured["tpot_ms_p50"]
    return 1000.0 / tpot if tpot else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", nargs="+", default=["instructcoder", "sharegpt"],
                        choices=sorted(LENGTHS))
    parser.add_argument("--lookup", type=int, nargs=2, default=(1, 4), metavar=("MIN", "MAX"))
    parser.add_argument("--loads", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--rates", type=float, nargs="*", default=[1000.0, 3000.0, 6000.0],
                        help="open-loop loads, offered output tokens/s (as the suite's)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    lookup = (args.lookup[0], args.lookup[1])
    if not (FULL.data_dir / "instructcoder.jsonl").is_file():
        raise SystemExit(f"{FULL.data_dir} has no traces: this benchmark reads ../shared's")
    policies = (*(f"fixed:{k}" for k in range(FULL.max_k + 1)), *ADAPTIVE)
    cells: list[tuple[str, str, float, Scenario, bool]] = []
    for trace in args.traces:
        for c in args.loads:
            cells.append((trace, f"c={c}", c, scenario(trace, lookup, concurrency=c), True))
        for tok_s in args.rates:
            rate = tok_s / LENGTHS[trace][1]
            cells.append((trace, f"{tok_s:g} tok/s", tok_s,
                          scenario(trace, lookup, rate_rps=rate), False))
    tasks = [(case, policy, closed) for *_, case, closed in cells for policy in policies]
    with ProcessPoolExecutor(args.processes) as pool:
        scores = list(pool.map(score, tasks))
    rows: list[dict[str, Any]] = []
    for index, (trace, label, _, _, closed) in enumerate(cells):
        mine = dict(zip(policies, scores[index * len(policies):(index + 1) * len(policies)],
                        strict=True))
        best_k = max((p for p in policies if p.startswith("fixed:")), key=mine.__getitem__)
        rows.append({"trace": trace, "arrival": "closed" if closed else "open", "load": label,
                     "best_fixed": best_k, "best_fixed_score": round(mine[best_k], 2),
                     **{p: round(mine[p] / mine[best_k], 4) for p in ADAPTIVE}})
    summary = {}
    for trace in args.traces:
        busy = [r for r in rows if r["trace"] == trace and r["arrival"] == "closed"
                and int(r["load"][2:]) >= 32]
        summary[trace] = {p: round(statistics.fmean(r[p] for r in busy), 4) if busy else None
                          for p in ADAPTIVE}
    emit("budget_loop", {"lookup": list(lookup), "warmup_s": FULL.warmup_s,
                         "measure_s": FULL.measure_s, "rows": rows,
                         "closed_mean_c_ge_32": summary}, args.out)


if __name__ == "__main__":
    main()
