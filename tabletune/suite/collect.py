"""From a `SuiteSpec` to the results dict that `results.json` holds.

    results = run_suite(QUICK, out_dir=Path("bench-out"), processes=2)

Keys of the results (documented in `RESULT_KEYS`; `results.json` is this dict as JSON):
`suite`, `command`, `machine`, `started_at`, `wall_s`, `processes`, `spec`, `traces_found`,
`grids` (per grid: `arrival`, `score`, `loads` [per load: `label`, `load`, `scores`, `runs`],
`ratios` from `ratios.grid_ratios`), `drift` (per scenario: `path`, `phases` from
`ratios.drift_phase`), `errors` (every task that raised), `standalone` (filled by the CLI
from the bench/ scripts' JSON files).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from pathlib import Path
from typing import Any

from tabletune.suite import grid as grids
from tabletune.suite.machine import machine
from tabletune.suite.ratios import drift_phase, grid_ratios
from tabletune.suite.runner import Progress, Task, run_tasks

RESULT_KEYS = ("suite", "command", "machine", "started_at", "wall_s", "processes", "spec",
               "traces_found", "grids", "drift", "errors", "standalone")
CLOSED_SCORE = "output_tok_s"
OPEN_SCORE = "decode_tok_s_per_request"
"""Open loop: offered load is fixed, so throughput only says whether the engine kept up;
what a policy changes is how fast each request decodes, 1000 / TPOT p50 (ms)."""


def plan(spec: grids.SuiteSpec, out_dir: Path) -> list[Task]:
    policies = (*grids.fixed_policies(spec.max_k), *spec.policies)
    tasks = []
    for case in grids.grid_cases(spec):
        for policy in (*policies, *case.extra_policies):
            cost = (spec.warmup_s + spec.measure_s) * (
                3.0 if policy.startswith("tabletune") else 1.0)
            cost *= 1.5 if case.closed and case.load <= 8 else 1.0
            tasks.append(Task("load", f"{case.grid} {case.label}", policy,
                              scenario=case.scenario, cost=cost))
    for name in spec.drift:
        path = grids.drift_path(name)
        scenario = grids.drift_scenario(path)
        duration = scenario.duration_s
        for policy in policies:
            cost = duration * (4.0 if policy == "tabletune" else 1.5)
            tasks.append(Task("drift", path.stem, policy, path=str(path), cost=cost))
        for phase in range(1, len(scenario.phases)):
            tasks.append(Task("stale", path.stem, "stale", path=str(path), phase=phase,
                              profile_budget_s=spec.profile_budget_s,
                              table_dir=str(out_dir / "tables" / f"{path.stem}-before-{phase}"),
                              cost=duration * 2.0))
    return tasks


def run_suite(spec: grids.SuiteSpec, *, out_dir: Path, processes: int = 2,
              command: str = "", on_progress: Progress | None = None) -> dict[str, Any]:
    started, started_at = time.monotonic(), dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    tasks = plan(spec, out_dir)
    results = run_tasks(tasks, processes=processes, on_progress=on_progress)
    spec_dict = {k: (str(v) if isinstance(v, Path) else v)
                 for k, v in dataclasses.asdict(spec).items()}
    return {
        "suite": spec.name, "command": command, "machine": machine(), "started_at": started_at,
        "wall_s": round(time.monotonic() - started, 1), "processes": processes,
        "spec": spec_dict, "traces_found": grids.traces_found(spec),
        "grids": assemble_grids(spec, results), "drift": assemble_drift(spec, results),
        "errors": [{k: r[k] for k in ("kind", "key", "policy", "phase", "error")}
                   for r in results if "error" in r],
        "standalone": {},
    }


def score(run: dict[str, Any], closed: bool) -> float | None:
    if "error" in run:
        return None
    if closed:
        return run.get("output_tokens_per_s")
    tpot = run.get("tpot_ms_p50")
    return 1000.0 / tpot if tpot else None


def assemble_grids(spec: grids.SuiteSpec, results: list[dict[str, Any]]) -> dict[str, Any]:
    by_key: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        if r["kind"] == "load":
            by_key.setdefault(r["key"], {})[r["policy"]] = r
    out: dict[str, Any] = {}
    for case in grids.grid_cases(spec):
        entry = out.setdefault(case.grid, {
            "arrival": "closed" if case.closed else "open",
            "score": CLOSED_SCORE if case.closed else OPEN_SCORE, "loads": []})
        runs = by_key.get(f"{case.grid} {case.label}", {})
        entry["loads"].append({
            "label": case.label, "load": case.load,
            "scores": {p: _round(score(run, case.closed)) for p, run in runs.items()},
            "runs": {p: {k: v for k, v in run.items() if k not in ("kind", "key")}
                     for p, run in runs.items()}})
    fixed = grids.fixed_policies(spec.max_k)
    baselines = [b for b in grids.BASELINES if b in spec.policies]
    for entry in out.values():
        entry["ratios"] = grid_ratios([load["scores"] for load in entry["loads"]],
                                      fixed=fixed, baselines=baselines)
    return out


def assemble_drift(spec: grids.SuiteSpec, results: list[dict[str, Any]]) -> dict[str, Any]:
    fixed = grids.fixed_policies(spec.max_k)
    baselines = [b for b in grids.BASELINES if b in spec.policies]
    out: dict[str, Any] = {}
    for name in spec.drift:
        path = grids.drift_path(name)
        runs = {r["policy"]: r for r in results if r["kind"] == "drift" and r["key"] == path.stem}
        stale = {r["phase"]: r for r in results if r["kind"] == "stale" and r["key"] == path.stem}
        phases = len(grids.drift_scenario(path).phases)
        out[path.stem] = {"path": str(path), "phases": [
            drift_phase(runs, stale.get(phase), phase=phase, settle_s=spec.settle_s,
                        fixed=fixed, baselines=baselines) for phase in range(1, phases)]}
    return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
