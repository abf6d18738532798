"""How many ranges does a table need? TableTune's tables against the twin's best K per batch size.

    .venv/bin/python -m bench.table_ranges [--traces sharegpt ...] [--out DIR]

A table maps batch size to K. The suite compares its tables with the best fixed K at its
nine closed-loop loads, a curve too coarse to say how many ranges the data asks for between
them. Here, per trace x drafter (the suite's grids, its scenarios and seeds):
- **the truth:** every fixed K 0..7 in the closed loop at 28 concurrencies from 1 to 256
  (one per batch size a closed loop of that many users runs at); at each, the K within
  `--tolerance` of that load's best;
- **ranges needed:** the fewest ranges of any table that is within the tolerance at every
  one of those loads (greedy over the loads in order, which is optimal here: a range lasts
  while some K stays within the tolerance at every load it spans);
- **TableTune:** `tabletune` at the suite's loads (closed 1..256, open 1000-6000 tok/s),
  every table it applied: the most ranges, how many tables have more ranges than needed,
  and how many ranges return to a K an earlier, non-adjacent range had (A-B-A).
The score per load is the suite's (closed: output tok/s over the measured phase). Virtual
time: the machine's load does not change the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import emit
from fitter.derive import DEFAULT_TOLERANCE
from tabletune.suite import grid as grids
from tabletune.suite.runner import Task, run_tasks

DENSE_CONCURRENCIES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64,
                       80, 96, 112, 128, 160, 192, 224, 256)
"""Every batch size up to 8, then about four loads per doubling: K moves by one between them."""


def acceptable(scores: dict[int, float], tolerance: float) -> frozenset[int]:
    """The K values within `tolerance` of the load's best score."""
    best = max(scores.values())
    return frozenset(k for k, s in scores.items() if s >= (1.0 - tolerance) * best)


def ranges_needed(acceptable_by_load: Sequence[frozenset[int]]) -> list[tuple[int, int, int]]:
    """The fewest consecutive load spans each with a K acceptable at every load in it, as
    (first load index, last load index, K); the smallest such K where several are."""
    spans: list[tuple[int, int, int]] = []
    start, common = 0, acceptable_by_load[0]
    for i, ks in enumerate(acceptable_by_load[1:], start=1):
        if common & ks:
            common = common & ks
            continue
        spans.append((start, i - 1, min(common)))
        start, common = i, ks
    spans.append((start, len(acceptable_by_load) - 1, min(common)))
    return spans


def returns(table: Sequence[Sequence[int]]) -> int:
    """Ranges whose K an earlier range had, with a different K between (A-B-A)."""
    seen: set[int] = set()
    count, previous = 0, None
    for _, _, k in table:
        if k != previous and k in seen:
            count += 1
        seen.add(k)
        previous = k
    return count


def plan(spec: grids.SuiteSpec, concurrencies: Sequence[int]) -> list[Task]:
    tasks = []
    for trace in spec.traces:
        for method in spec.methods:
            name = f"{trace}-{method}"
            for c in concurrencies:
                scenario = grids.load_scenario_for(spec, trace, method, concurrency=c)
                for policy in grids.fixed_policies(spec.max_k):
                    tasks.append(Task("load", f"{name} truth c={c}", policy, scenario=scenario,
                                      cost=1.0))
    for case in grids.grid_cases(spec):
        tasks.append(Task("load", f"{case.grid} {case.label}", "tabletune",
                          scenario=case.scenario, cost=10.0))
    return tasks


def assemble(spec: grids.SuiteSpec, concurrencies: Sequence[int], tolerance: float,
             results: list[dict[str, Any]]) -> dict[str, Any]:
    by_key: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        by_key.setdefault(r["key"], {})[r["policy"]] = r
    errors = [f"{r['key']} {r['policy']}: {r['error']}" for r in results if "error" in r]
    cases = grids.grid_cases(spec)
    out: dict[str, Any] = {}
    for trace in spec.traces:
        for method in spec.methods:
            name = f"{trace}-{method}"
            truth = []
            for c in concurrencies:
                runs = by_key.get(f"{name} truth c={c}", {})
                scores = {int(p.split(":")[1]): r["output_tokens_per_s"]
                          for p, r in runs.items() if "error" not in r}
                if scores:
                    truth.append((c, scores))
            if not truth:
                continue
            sets = [acceptable(scores, tolerance) for _, scores in truth]
            best = [max(scores, key=scores.get) for _, scores in truth]
            needed = ranges_needed(sets)
            tables = {f"{case.label} ({case.grid.split('/')[1]})":
                      by_key.get(f"{case.grid} {case.label}", {}).get("tabletune", {})
                      .get("tables", [])
                      for case in cases if case.grid.startswith(f"{name}/")}
            out[name] = {
                "loads": [c for c, _ in truth],
                "best_k": best,
                "acceptable": [sorted(s) for s in sets],
                "best_k_changes": sum(1 for a, b in zip(best[:-1], best[1:], strict=True)
                                      if a != b),
                "needed": [[truth[a][0], truth[b][0], k] for a, b, k in needed],
                "tabletune": {load: {"tables": ts, "ranges": [len(t) for t in ts],
                                     "returns": [returns(t) for t in ts]}
                              for load, ts in tables.items()},
            }
    return {"tolerance": tolerance, "concurrencies": list(concurrencies), "grids": out,
            "errors": errors}


def markdown(result: dict[str, Any]) -> str:
    lines = ["| grid | best K by load (dense) | its ranges | ranges needed within "
             f"{result['tolerance']:.0%} | TableTune tables | most ranges (load) | "
             "tables over the curve's ranges | over the ranges needed | with A-B-A |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, g in result["grids"].items():
        counts = [(n, load) for load, t in g["tabletune"].items() for n in t["ranges"]]
        curve, needed = g["best_k_changes"] + 1, len(g["needed"])
        most = max(counts, default=(0, "-"))
        aba = sum(1 for t in g["tabletune"].values() for r in t["returns"] if r)
        spans = ", ".join(f"{a}-{b}: K{k}" for a, b, k in g["needed"])
        lines.append(f"| {name} | {' '.join(f'K{k}' for k in g['best_k'])} | {curve} | "
                     f"{needed} ({spans}) | {len(counts)} | {most[0]} ({most[1]}) | "
                     f"{sum(1 for n, _ in counts if n > curve)} | "
                     f"{sum(1 for n, _ in counts if n > needed)} | {aba} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", default=list(grids.FULL.traces),
                        choices=list(grids.FULL.traces))
    parser.add_argument("--methods", nargs="+", default=list(grids.FULL.methods),
                        choices=list(grids.FULL.methods))
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help="a K within this share of a load's best is as good "
                             f"(default {DEFAULT_TOLERANCE})")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--out", default=None, help="table_ranges.json and table_ranges.md")
    args = parser.parse_args(argv)
    if not 0.0 <= args.tolerance < 1.0:
        parser.error(f"--tolerance must be in [0, 1), got {args.tolerance}")
    spec = dataclasses.replace(grids.FULL, traces=tuple(args.traces),
                               methods=tuple(args.methods), policies=("tabletune",))
    found = grids.traces_found(spec)
    results = run_tasks(plan(spec, DENSE_CONCURRENCIES), processes=args.processes)
    result = assemble(spec, DENSE_CONCURRENCIES, args.tolerance, results)
    result["traces_found"] = found
    emit("table_ranges", result, args.out)
    text = markdown(result)
    if args.out:
        (Path(args.out) / "table_ranges.md").write_text(text)
    print(text, file=sys.stderr)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
