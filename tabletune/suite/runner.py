"""Runs the suite's tasks, in worker processes (the twin is single-threaded), and collects
plain-dict results. A task that raises is recorded with its error and the suite goes on: one
broken policy must not cost the other figures.

Task kinds:
- `load`: one grid load under one policy; the measured phase's metrics.
- `drift`: one drift scenario under one policy; its 10 s timeline and phase spans.
- `stale`: profile a drift scenario's phase before the drift (`tabletune.profile`, its own
  seed), write the table, then run the whole scenario under `table:FILE` held fixed.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twin.config import Scenario

Progress = Callable[[int, int, dict[str, Any]], None]
"""(done, total, the result just finished)."""

_MEASURED = ("output_tokens_per_s", "tpot_ms_p50", "tpot_ms_p99", "ttft_ms_p50",
             "ttft_ms_p99", "requests_finished", "steps", "mean_batch_size", "k_share")


@dataclass(frozen=True)
class Task:
    kind: str
    """`load`, `drift` or `stale`."""
    key: str
    """The grid load (`sharegpt-eagle/closed c=64`) or the drift scenario's stem."""
    policy: str
    scenario: Scenario | None = None
    """`load`: the scenario to run."""
    path: str | None = None
    """`drift`, `stale`: the scenario file."""
    phase: int = 0
    """`stale`: the index of the phase after the drift."""
    profile_budget_s: float = 120.0
    table_dir: str | None = None
    """`stale`: where the profiled table is written."""
    cost: float = 1.0
    """Rough relative run time; the longest tasks start first."""


def run_task(task: Task) -> dict[str, Any]:
    """Never raises: errors come back as `{"error": ...}`."""
    started = time.monotonic()
    try:
        if task.kind == "load":
            result = _run_load(task)
        elif task.kind == "drift":
            result = _run_drift(task)
        elif task.kind == "stale":
            result = _run_stale(task)
        else:
            raise ValueError(f"unknown task kind {task.kind!r}")
    except Exception as exc:  # reported in results.json, never hidden
        result = {"error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc(limit=6)[-2000:]}
    return {"kind": task.kind, "key": task.key, "policy": task.policy, "phase": task.phase,
            "wall_s": round(time.monotonic() - started, 3), **result}


def run_tasks(tasks: list[Task], *, processes: int = 2,
              on_progress: Progress | None = None) -> list[dict[str, Any]]:
    """Results in the order of `tasks`; with `processes` > 1, in a spawned process pool."""
    order = sorted(range(len(tasks)), key=lambda i: -tasks[i].cost)
    results: list[dict[str, Any] | None] = [None] * len(tasks)
    if processes <= 1:
        stream: Iterable[tuple[int, dict[str, Any]]] = (
            (i, run_task(tasks[i])) for i in order)
        _collect(stream, results, on_progress)
    else:
        # spawn: workers never inherit a parent's threads or locks (recorders run threads).
        context = multiprocessing.get_context("spawn")
        with context.Pool(processes) as pool:
            stream = pool.imap_unordered(_indexed, [(i, tasks[i]) for i in order], chunksize=1)
            _collect(stream, results, on_progress)
    return [r for r in results if r is not None]


def _indexed(item: tuple[int, Task]) -> tuple[int, dict[str, Any]]:
    return item[0], run_task(item[1])


def _collect(stream: Iterable[tuple[int, dict[str, Any]]], results: list[dict[str, Any] | None],
             on_progress: Progress | None) -> None:
    for done, (index, result) in enumerate(stream, start=1):
        results[index] = result
        if on_progress is not None:
            on_progress(done, len(results), result)


def _run_policy(scenario: Scenario | str | Path, spec: str) -> tuple[Any, dict[str, Any]]:
    from twin import make_policy, run_scenario

    policy = make_policy(spec)
    try:
        summary = run_scenario(scenario, policy)
    finally:
        close = getattr(policy, "close", None)
        if callable(close):
            close()
    extra: dict[str, Any] = {}
    loop = getattr(policy, "loop", None)
    applied = getattr(loop, "applied", None)
    if applied:  # TableTune: when its first fitted table went live (virtual s)
        extra["first_table_s"] = round(float(applied[0][0]), 2)
        extra["tables_applied"] = len(applied)
        extra["table_ranges"] = [len(table.ranges) for _, _, table in applied]
        extra["tables"] = [table.to_vllm() for _, _, table in applied]
    return summary, extra


def _run_load(task: Task) -> dict[str, Any]:
    assert task.scenario is not None
    summary, extra = _run_policy(task.scenario, task.policy)
    measured = summary.phases[-1]
    return {**{name: measured[name] for name in _MEASURED},
            "run_output_tokens_per_s": summary.output_tokens_per_s, **extra}


def _spans(summary: Any) -> list[dict[str, Any]]:
    return [{"name": p["name"], "start_s": p["start_s"], "end_s": p["end_s"],
             "output_tokens_per_s": p["output_tokens_per_s"]} for p in summary.phases]


def _run_drift(task: Task) -> dict[str, Any]:
    assert task.path is not None
    summary, extra = _run_policy(task.path, task.policy)
    return {"timeline": summary.timeline, "phases": _spans(summary), **extra}


def _run_stale(task: Task) -> dict[str, Any]:
    from tabletune.profile import profile
    from twin import load_scenario

    assert task.path is not None and task.table_dir is not None
    scenario = load_scenario(task.path)
    before = scenario.phases[task.phase - 1]
    alone = dataclasses.replace(scenario, phases=(before,), seed=scenario.seed + 1000,
                                name=f"{scenario.name}-{before.name or task.phase - 1}")
    result = profile(alone, budget_s=task.profile_budget_s, out_dir=task.table_dir)
    summary, _ = _run_policy(task.path, f"table:{result.path}")
    return {"timeline": summary.timeline, "phases": _spans(summary),
            "profiled_phase": before.name or f"phase{task.phase - 1}",
            "table": result.envelope.table.to_vllm(), "table_path": str(result.path),
            "profile_wall_s": round(result.wall_s, 2),
            "profile_engine_s": round(result.engine_time_s, 2),
            "profile_records": result.records}
