"""Swing scenarios with every second counted: TableTune against every fixed K, no settling.

    .venv/bin/python -m bench.swing --scenario swing-eagle-load.toml \\
        [--scenario swing-ngram-workload.toml] [--seeds 21 ...] [--out DIR]

Per scenario and seed, in memory: every fixed K 0..max_k and the `tabletune` policy on the
same traffic. Every phase is scored from its first second (bench/swing_account.py): per
phase against its best fixed K, over the run against the per-phase best and the best single
fixed K, and the headroom between those two. TableTune's step records also go to a sink
that keeps each step's time and `forced` flag, for the share of forced steps (the loop's
profile sweeps) after the cold profile, overall and over the worst 10 minutes. It also
lists each re-profile with its phase, flagged where that phase's traffic ran before (a
return), and counts the ranges of every table TableTune applied.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from bench.common import emit
from bench.swing_account import account, forced_share
from twin import BUILTIN_SCENARIOS, FixedK, load_scenario, run_scenario
from twin.tabletune_policy import TabletunePolicy


class ForcedTally:
    """A sink that keeps only each step's virtual time and whether a force held it."""

    def __init__(self) -> None:
        self._ts: list[np.ndarray] = []
        self._forced: list[np.ndarray] = []

    def write(self, records: pa.Table) -> None:
        self._ts.append(records.column("ts_ns").to_numpy() / 1e9)
        self._forced.append(records.column("forced").to_numpy(zero_copy_only=False))

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        return None

    def counters(self) -> dict[str, int]:
        return {"tally_records": sum(len(ts) for ts in self._ts)}

    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        """(step start s, forced) over every record written."""
        if not self._ts:
            return np.zeros(0), np.zeros(0, bool)
        return np.concatenate(self._ts), np.concatenate(self._forced).astype(bool)


def swing(name: str, seed: int | None = None) -> dict[str, Any]:
    """One scenario at one seed: the accounting, the forced share, the tables TableTune sent."""
    scenario = load_scenario(BUILTIN_SCENARIOS / name)
    if seed is not None:
        scenario = dataclasses.replace(scenario, seed=seed)
    fixed = [f"fixed:{k}" for k in range(scenario.engine.max_k + 1)]
    timelines = {p: run_scenario(scenario, FixedK(int(p.removeprefix("fixed:")))).timeline
                 for p in fixed}
    policy, tally = TabletunePolicy(), ForcedTally()
    try:
        summary = run_scenario(scenario, policy, sink=tally)
    finally:
        policy.close()
    timelines["tabletune"] = summary.timeline
    spans = [(p["name"], p["start_s"], p["end_s"]) for p in summary.phases]
    result = account(timelines, spans, fixed=fixed)
    assert policy.loop is not None
    applied = policy.loop.applied
    first_table_s = float(applied[0][0]) if applied else summary.duration_s
    ts, forced = tally.columns()
    return {"scenario": name, "seed": scenario.seed, **result,
            "first_table_s": round(first_table_s, 2), "tables_applied": len(applied),
            "forced": forced_share(ts, forced, after_s=first_table_s,
                                   end_s=summary.duration_s),
            "decisions": _count(d.what for d in policy.loop.decisions),
            "reprofiles": reprofiles(scenario, policy.loop.decisions),
            "table_ranges": [len(table.ranges) for _, _, table in applied]}


def _traffic(phase: Any) -> tuple[Any, ...]:
    """What makes two phases the same traffic: everything but the name and the length."""
    return dataclasses.astuple(dataclasses.replace(phase, name="", duration_s=1.0))


def reprofiles(scenario: Any, decisions: Any) -> list[dict[str, Any]]:
    """Each re-profile: when, in which phase, whether that phase's traffic ran before (a
    return, where the loop should need no new measurement), and the drift signal that
    started it."""
    starts = np.cumsum([0.0, *(p.duration_s for p in scenario.phases)])
    found = []
    signal = None
    for decision in decisions:
        if decision.what == "stale":
            signal = decision.fields.get("signal")
        if decision.what != "reprofile":
            continue
        index = int(np.searchsorted(starts, decision.t_s, side="right")) - 1
        index = min(max(index, 0), len(scenario.phases) - 1)
        phase = scenario.phases[index]
        seen = {_traffic(p) for p in scenario.phases[:index]}
        found.append({"t_s": decision.t_s, "phase": phase.name or str(index + 1),
                      "into_phase_s": round(decision.t_s - float(starts[index]), 1),
                      "return": _traffic(phase) in seen, "signal": signal})
    return found


def _count(items: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


def markdown(results: list[dict[str, Any]]) -> str:
    """Two tables: TableTune per phase (cells: phase best K, ratio), and over the run."""
    width = max(len(r["phases"]) for r in results)
    lines = ["| scenario | seed | " + " | ".join(str(i + 1) for i in range(width)) + " |",
             "|---|---|" + "---|" * width]
    for r in results:
        cells = [f"K{p['best_fixed'].removeprefix('fixed:')} {_num(p['vs_phase_best'])}"
                 for p in r["phases"]]
        lines.append(f"| {_stem(r)} | {r['seed']} | " + " | ".join(cells) + " |")
    lines += ["", "| scenario | TableTune tok/s | / per-phase best | / best single K | "
              "headroom | forced steps (worst 10 min) | re-profiles (on a return) | "
              "ranges (most) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        run, forced = r["run"], r["forced"]
        single = run["best_single_fixed"].removeprefix("fixed:")
        lines.append(
            f"| {_stem(r)} | {run['tok_s']['tabletune']:.0f} | "
            f"{_num(run['vs_per_phase_best'])} | {_num(run['vs_best_single'])} (K{single}) | "
            f"{_num(run['headroom'])} | {_pct(forced['share'])} "
            f"({_pct(forced['worst_window_share'])}) | {reprofile_cell(r['reprofiles'])} | "
            f"{max(r['table_ranges'], default=0)} |")
    return "\n".join(lines) + "\n"


def reprofile_cell(reprofiles: list[dict[str, Any]]) -> str:
    """How many re-profiles, and each one on a return: its phase, when, its signal."""
    returns = [f"{p['phase']} +{p['into_phase_s']:.0f} s {p['signal']}"
               for p in reprofiles if p["return"]]
    return f"{len(reprofiles)} ({', '.join(returns) or 'none'})"


def _stem(result: dict[str, Any]) -> str:
    return str(result["scenario"]).removesuffix(".toml")


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", action="append", required=True,
                        help="a file in twin/scenarios (repeatable)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="scenario seeds (default: the scenario's own)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    for name in args.scenario:
        for seed in args.seeds or [None]:
            results.append(swing(name, seed))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    table = markdown(results)
    print(table, file=sys.stderr)
    emit("swing", {"results": results}, args.out)
    if args.out:
        Path(args.out, "swing.md").write_text(table)


if __name__ == "__main__":
    main()
