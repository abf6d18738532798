"""Stale-table recovery through the production path, beside the in-memory twin's.

    .venv/bin/python -m bench.fleet_recovery --scenario eagle-concurrency-jump.toml \\
        [--seeds 12 ...] [--engines 4] [--speedup 10] [--out DIR]

Per seed: an embedded broker, `tabletune control` as its own process and `twin fleet`
engines (engine i runs seed + i) whose tables come only from the tables topic. Then, in
memory and per engine seed: every fixed K, the table the fleet ran when each later phase
began held fixed ("stale"), and the in-memory `tabletune` policy (the same ControlService
with an in-memory channel). Rates are pooled over the engines, over each phase after its
first 2 minutes: recovery = (tabletune - stale) / (best fixed K - stale). Also the
re-profile's canary cost: how much less the canary engine emitted than the others while it
was forced, as a share of the fleet's output over the phase. `whole_phase` scores the same
from each phase's first second, against that span's own best fixed K, so that the time the
loop takes to react is counted too. `run` scores the whole run the same way (pooled over the
engines, every second from the first, against the per-phase best and the best single fixed
K, as bench.swing does in memory), `reprofiles` lists each re-profile with its phase,
flagged where that phase's traffic ran before, and `drifts` each drift the service called
and what it made of it (recall, settled refit, re-profile, forgetting its latency
knowledge), and each roll-back, with their fields.

With --failover, two `tabletune control` replicas share the key through their group, and the
one that owns it is killed with -9 `--kill-after-s` wall seconds into its first re-profile:
the survivor must take the key over (the session timeout, then a rebalance) and recover the
phase itself. Their decisions are merged for the scoring.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import emit
from bench.controller_bench import SETTLE_S, window_rate
from bench.swing import reprofile_cell, reprofiles
from bench.swing_account import account
from controller.fleet.decisions import Decision, What
from schemas import DraftTable
from schemas.settings import Settings
from tabletune.broker import EmbeddedBroker
from tabletune.control_process import ControlProcess
from tabletune.twin_fleet import Fleet, FleetConfig, engine_scenario
from twin import BUILTIN_SCENARIOS, FixedK, StaticTable, load_scenario, run_scenario
from twin.config import Scenario
from twin.tabletune_policy import TabletunePolicy

WATCH_S = 0.2
"""How often the failover run reads the replicas' decisions for the first re-profile."""


def run_production(scenario: Scenario, engines: int, speedup: float, work: Path,
                   kill_after_s: float | None = None
                   ) -> tuple[dict[str, Any], list[Decision], float, dict[str, Any] | None]:
    """(the fleet's result, the control service's decisions, the fleet's epoch, the
    failover: when and which replica was killed, None without `kill_after_s`)."""
    with EmbeddedBroker() as broker:
        env = {"TABLETUNE_BOOTSTRAP": broker.bootstrap}
        with contextlib.ExitStack() as stack:
            replicas = [stack.enter_context(ControlProcess(env, work / f"control-{i}"))
                        for i in range(1 if kill_after_s is None else 2)]
            fleet = Fleet(scenario, Settings.from_env(env),
                          FleetConfig(engines=engines, speedup=speedup)).start()
            failover = (None if kill_after_s is None
                        else _kill_owner_mid_reprofile(fleet, replicas, kill_after_s))
            result = fleet.join()
        decisions = sorted((d for r in replicas for d in r.decisions()), key=lambda d: d.t_s)
        return result, decisions, fleet.epoch_s, failover


def _kill_owner_mid_reprofile(fleet: Fleet, replicas: list[ControlProcess],
                              kill_after_s: float) -> dict[str, Any] | None:
    """kill -9 the replica that started the first re-profile, `kill_after_s` after it;
    None when the fleet ended before any re-profile."""
    while fleet.running:
        for index, replica in enumerate(replicas):
            started = [d for d in replica.decisions() if d.what == "reprofile"]
            if started:
                time.sleep(kill_after_s)
                replica.kill()
                done = any(d.what == "refit" and d.fields.get("reason") == "stale"
                           and d.t_s >= started[0].t_s for d in replica.decisions())
                return {"killed": index, "reprofile_t_s": round(started[0].t_s - fleet.epoch_s, 1),
                        "killed_at_s": round(fleet.clock_s, 1), "reprofile_done_before": done}
        time.sleep(WATCH_S)
    return None


def table_at(decisions: list[Decision], epoch_s: float, t_s: float
             ) -> tuple[int, DraftTable] | None:
    staged = [d for d in decisions if d.what == "stage" and d.t_s - epoch_s <= t_s]
    if not staged:
        return None
    return staged[-1].fields["version"], DraftTable.from_vllm(staged[-1].fields["table"])


def tables_staged(decisions: list[Decision], epoch_s: float) -> list[dict[str, Any]]:
    """Every table the run staged, with what made it: the refit noted just before it (its
    reason, predicted gain and error), or an `interim` or `roll_back` decision. A refit
    that published nothing leaves its version to the next table, so only the decision
    just before a stage (an `unwatched` note aside) made it."""
    staged: list[dict[str, Any]] = []
    previous: Decision | None = None
    for decision in decisions:
        if decision.what is What.STAGE:
            why: dict[str, Any] = {}
            if (previous is not None and previous.what is What.REFIT
                    and previous.fields.get("version") == decision.fields["version"]):
                why = {key: previous.fields[key] for key in ("reason", "gain", "gain_stderr")
                       if key in previous.fields}
            elif previous is not None and previous.what in (What.INTERIM, What.ROLL_BACK):
                why = {"reason": previous.what.value}
            staged.append({"t_s": round(decision.t_s - epoch_s, 1),
                           "version": decision.fields["version"],
                           "table": decision.fields["table"], **why})
        if decision.what is not What.UNWATCHED:
            previous = decision
    return staged


def canary_cost(fleet: dict[str, Any], decisions: list[Decision], epoch_s: float,
                phase: dict[str, Any]) -> dict[str, Any] | None:
    """The canary's output deficit while forced, against the other engines' mean, as a
    share of the whole fleet's output over the phase."""
    starts = [d for d in decisions if d.what == "reprofile"
              and phase["start_s"] <= d.t_s - epoch_s < phase["end_s"]]
    if not starts or not starts[0].fields["targets"]:
        return None
    begin = starts[0].t_s - epoch_s
    ends = [d.t_s - epoch_s for d in decisions if d.what == "refit"
            and d.fields.get("reason") == "stale" and d.t_s - epoch_s > begin]
    end = ends[0] if ends else phase["end_s"]
    canaries = set(starts[0].fields["targets"])

    def emitted(summary: dict[str, Any], a: float, b: float) -> float:
        return sum(rate * 10.0 for t, rate in summary["timeline"] if a <= t < b)

    forced = [emitted(s, begin, end) for e, s in fleet["engines"].items() if e in canaries]
    others = [emitted(s, begin, end) for e, s in fleet["engines"].items() if e not in canaries]
    total = sum(emitted(s, phase["start_s"], phase["end_s"]) for s in fleet["engines"].values())
    deficit = sum(np.mean(others) - f for f in forced)
    return {"canaries": sorted(canaries), "forced_s": round(end - begin, 1),
            "canary_vs_others": round(float(np.sum(forced) / (len(forced) * np.mean(others))), 4),
            "fleet_output_lost_pct": round(100 * float(deficit) / total, 3)}


def _in_memory(scenario: Scenario, policy: str) -> Any:
    """One in-memory run: `fixed:K`, or `tabletune` (the loop in memory)."""
    if policy == "tabletune":
        loop = TabletunePolicy()
        try:
            return run_scenario(scenario, loop)
        finally:
            loop.close()
    return run_scenario(scenario, FixedK(int(policy.removeprefix("fixed:"))))


def recovery(name: str, seed: int, engines: int, speedup: float,
             kill_after_s: float | None = None, *, stale_rows: bool = True,
             processes: int = 1) -> dict[str, Any]:
    base = dataclasses.replace(load_scenario(BUILTIN_SCENARIOS / name), seed=seed)
    with tempfile.TemporaryDirectory() as work:
        fleet, decisions, epoch_s, failover = run_production(base, engines, speedup,
                                                             Path(work), kill_after_s)
    scenarios = [engine_scenario(base, i) for i in range(engines)]
    summaries = [fleet["engines"][s.engine.engine_id] for s in scenarios]
    # the fleet's part is over: the in-memory runs are virtual time, and may share cores
    policies = [*(f"fixed:{k}" for k in range(base.engine.max_k + 1)), "tabletune"]
    jobs = [(i, p) for i in range(engines) for p in policies]
    with ProcessPoolExecutor(processes, mp_context=get_context("spawn")) as pool:
        done = list(pool.map(_in_memory, [scenarios[i] for i, _ in jobs],
                             [p for _, p in jobs]))
    runs = dict(zip(jobs, done, strict=True))
    fixed = [{k: runs[i, f"fixed:{k}"] for k in range(base.engine.max_k + 1)}
             for i in range(engines)]
    in_memory = [runs[i, "tabletune"] for i in range(engines)]
    rows = []
    for phase in summaries[0]["phases"][1:] if stale_rows else []:
        start, end = phase["start_s"] + SETTLE_S, phase["end_s"]
        stale = table_at(decisions, epoch_s, phase["start_s"])
        if stale is None:
            continue
        stale_runs = [run_scenario(s, StaticTable(stale[1], name="stale")) for s in scenarios]
        settled = _window(start, end, fixed, stale_runs, summaries, in_memory)
        whole = _window(phase["start_s"], end, fixed, stale_runs, summaries, in_memory)
        rows.append({
            "scenario": name, "seed": seed, "phase": phase["name"], "window_s": [start, end],
            "stale_version": stale[0], "stale_table": stale[1].to_vllm(),
            **{key: settled[key] for key in ("best_fixed_k", "best_fixed_tok_s", "stale_tok_s",
                                             "fleet_tok_s", "in_memory_tok_s", "stale_loss_pct",
                                             "fleet_recovery", "in_memory_recovery")},
            "canary": canary_cost(fleet, decisions, epoch_s, phase),
            "stale_events": sum(1 for d in decisions if d.what == "stale"),
            "versions": sorted({d.fields["version"] for d in decisions if d.what == "stage"}),
            # what the key ran in the phase, and from when: a reader sees which table scored
            "staged": [{"t_s": round(d.t_s - epoch_s, 1), "version": d.fields["version"],
                        "table": d.fields["table"]} for d in decisions
                       if d.what == "stage" and phase["start_s"] <= d.t_s - epoch_s < end],
            "whole_phase": {"window_s": [phase["start_s"], end], **whole},
        })
    learning = ("stale", "reprofile", "recall", "latency_forgotten", "roll_back")
    return {"scenario": name, "seed": seed, "engines": engines, "speedup": speedup,
            "failover": failover,
            "decisions": {what: sum(1 for d in decisions if d.what == what)
                          for what in learning},
            # each drift, what the loop made of it, and each roll-back: the run's own account
            "drifts": [{"t_s": round(d.t_s - epoch_s, 1), "what": d.what, **d.fields}
                       for d in decisions if d.what in (*learning, "settle_refit")],
            "reprofiles": reprofiles(base, [dataclasses.replace(d, t_s=d.t_s - epoch_s)
                                            for d in decisions]),
            "tables": tables_staged(decisions, epoch_s),
            "run": _whole_run(summaries, fixed, in_memory),
            "phases": rows}


def _whole_run(summaries: list[dict[str, Any]], fixed: list[dict[int, Any]],
               in_memory: list[Any]) -> dict[str, Any]:
    """Every second counted, pooled over the engines: the fleet and in memory against the
    per-phase best fixed K and the best single fixed K, over the whole run."""
    timelines = {f"fixed:{k}": _pooled([runs[k].timeline for runs in fixed]) for k in fixed[0]}
    timelines["fleet"] = _pooled([s["timeline"] for s in summaries])
    timelines["in_memory"] = _pooled([run.timeline for run in in_memory])
    spans = [(p["name"], p["start_s"], p["end_s"]) for p in summaries[0]["phases"]]
    fixed_names = [f"fixed:{k}" for k in fixed[0]]
    fleet = account(timelines, spans, fixed=fixed_names, policy="fleet")
    memory = account(timelines, spans, fixed=fixed_names, policy="in_memory")
    return {"fleet": fleet["run"], "in_memory": memory["run"],
            "phases": [{"name": f["name"], "best_fixed": f["best_fixed"],
                        "fleet": f["vs_phase_best"], "in_memory": m["vs_phase_best"]}
                       for f, m in zip(fleet["phases"], memory["phases"], strict=True)]}


def _pooled(timelines: list[Any]) -> list[list[float]]:
    """The engines' 10 s timelines summed bucket by bucket (they share the virtual clock)."""
    total: dict[float, float] = {}
    for timeline in timelines:
        for t, rate in timeline:
            total[float(t)] = total.get(float(t), 0.0) + float(rate)
    return [[t, total[t]] for t in sorted(total)]


def _window(start: float, end: float, fixed: list[dict[int, Any]], stale_runs: list[Any],
            summaries: list[dict[str, Any]], in_memory: list[Any]) -> dict[str, Any]:
    """Rates pooled over the engines over [start, end), against that window's best fixed K."""
    stale_rate = sum(window_rate(run, start, end) for run in stale_runs)
    rates = {k: sum(window_rate(runs[k], start, end) for runs in fixed) for k in fixed[0]}
    best = max(rates, key=lambda k: rates[k])
    fleet_rate = sum(sum(r for t, r in s["timeline"] if start <= t < end)
                     / max(1, sum(1 for t, _ in s["timeline"] if start <= t < end))
                     for s in summaries)
    memory_rate = sum(window_rate(run, start, end) for run in in_memory)
    loss = rates[best] - stale_rate
    return {
        "best_fixed_k": best, "best_fixed_tok_s": round(rates[best], 1),
        "stale_tok_s": round(stale_rate, 1), "fleet_tok_s": round(fleet_rate, 1),
        "in_memory_tok_s": round(memory_rate, 1),
        "stale_loss_pct": round(100 * loss / rates[best], 2),
        "fleet_recovery": round((fleet_rate - stale_rate) / loss, 3) if loss > 0 else None,
        "in_memory_recovery": round((memory_rate - stale_rate) / loss, 3) if loss > 0 else None,
        "fleet_vs_best_fixed": round(fleet_rate / rates[best], 4),
        "in_memory_vs_best_fixed": round(memory_rate / rates[best], 4),
    }


def run_markdown(results: list[dict[str, Any]]) -> str:
    """Over the whole run, every second counted: fleet and in memory against the per-phase
    best fixed K; each phase's ratio; the re-profiles and which came on a return."""
    lines = ["| scenario | seed | engines | fleet / per-phase best | in memory / per-phase best "
             "| fleet / best single K | per phase, fleet (in memory) | re-profiles (on a return) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for result in results:
        run = result["run"]
        phases = ", ".join(f"{p['fleet']:.3f} ({p['in_memory']:.3f})" for p in run["phases"])
        lines.append(
            f"| {result['scenario']} | {result['seed']} | {result['engines']} | "
            f"{run['fleet']['vs_per_phase_best']:.3f} | "
            f"{run['in_memory']['vs_per_phase_best']:.3f} | "
            f"{run['fleet']['vs_best_single']:.3f} | {phases} | "
            f"{reprofile_cell(result['reprofiles'])} |")
    return "\n".join(lines) + "\n"


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| scenario | seed | phase | stale loss | fleet recovery | in-memory recovery | "
             "canary cost (fleet output) | whole: stale loss | whole: fleet recovery | "
             "whole: in-memory recovery | whole: fleet / best fixed K |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for result in results:
        failover = " (owner killed mid re-profile)" if result["failover"] else ""
        for row in result["phases"]:
            canary = row["canary"]
            whole = row["whole_phase"]
            lines.append(
                f"| {row['scenario']}{failover} | {row['seed']} | {row['phase']} | "
                f"{row['stale_loss_pct']}% | {row['fleet_recovery']} | "
                f"{row['in_memory_recovery']} | "
                f"{canary['fleet_output_lost_pct'] if canary else '-'}% | "
                f"{whole['stale_loss_pct']}% | {whole['fleet_recovery']} | "
                f"{whole['in_memory_recovery']} | {whole['fleet_vs_best_fixed']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", action="append", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="scenario seeds (default: the scenario's own)")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--speedup", type=float, default=10.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--failover", action="store_true",
                        help="two control replicas; kill -9 the owner mid re-profile")
    parser.add_argument("--kill-after-s", type=float, default=3.0,
                        help="wall seconds into the first re-profile to kill the owner")
    parser.add_argument("--no-stale", action="store_true",
                        help="skip the per-phase recovery rows (each needs every engine's "
                             "run under the stale table); the whole-run score stays")
    parser.add_argument("--processes", type=int, default=1,
                        help="worker processes for the in-memory runs, after the fleet's")
    args = parser.parse_args()
    results = []
    for name in args.scenario:
        seeds = args.seeds or [load_scenario(BUILTIN_SCENARIOS / name).seed]
        for seed in seeds:
            results.append(recovery(name, seed, args.engines, args.speedup,
                                    args.kill_after_s if args.failover else None,
                                    stale_rows=not args.no_stale,
                                    processes=args.processes))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    emit("fleet_recovery", {"results": results}, args.out)
    if args.out:
        Path(args.out, "fleet_recovery.md").write_text(
            markdown(results) + "\n" + run_markdown(results))


if __name__ == "__main__":
    main()
