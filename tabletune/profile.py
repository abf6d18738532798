"""The profile sweep: a first draft table for a cold engine within a fixed engine-time budget.

    from tabletune.profile import profile
    result = profile("twin:twin/scenarios/sharegpt-eagle.toml", out_dir="prof")
    result.envelope            # the TableEnvelope, also written to prof/table.json

The sweep forces K for every batch size through the engine's table switch (telemetry marks
those steps `forced`), drives a closed-loop load at a chosen concurrency, and picks each next
(concurrency, K) cell where the argmax of the fitted goodput surface is least certain
(`fitter.profile_plan`). The table is then derived from all profile steps exactly as a refit
derives one from live telemetry (`fitter.derive`), so the two are comparable version to
version.

Engines: `twin:SCENARIO` (a scenario file, or the name of a built-in one) runs here on
virtual time; `openai:URL` drives a vLLM server's completions API (`tabletune.profile_openai`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fitter.derive import DEFAULT_TOLERANCE
from fitter.profile_plan import DEFAULT_CONCURRENCIES, concurrency_levels
from producers.recorder import Sink
from schemas import TableKey
from tabletune.profile_openai import profile_openai
from tabletune.profile_result import ProfileError, ProfileResult, envelope_from_records, write_table
from tabletune.profile_twin import ProgressCallback, run_twin_profile
from twin.config import CostConfig, Scenario
from twin.scenario_file import BUILTIN_SCENARIOS, load_scenario

DEFAULT_BUDGET_S = 120.0
"""Two minutes of engine time (virtual time on the twin)."""
DEFAULT_CELLS = 16
"""Cells per budget: the seed design plus a dozen adaptive picks, each 7.5 s of the default
budget. Fewer, longer cells beat more, shorter ones: a cell starts with a batch of fresh
requests and acceptance moves along an output (n-gram matches more the more text it has
seen), so a short cell only sees openings; the latency model needs few cells to generalise,
the acceptance estimate needs the batch to age (bench/profile_quality.py, 24 vs 16 cells)."""
MIN_CELL_S = 1.0


def resolve_twin_scenario(spec: str) -> Scenario:
    """A scenario file path, or the stem of a built-in scenario (`sharegpt-eagle`)."""
    path = Path(spec)
    if not path.exists():
        builtin = BUILTIN_SCENARIOS / f"{spec}.toml"
        if not builtin.exists():
            known = ", ".join(sorted(p.stem for p in BUILTIN_SCENARIOS.glob("*.toml")))
            raise ProfileError(f"twin:{spec}: no such scenario file or built-in scenario "
                               f"(built-in: {known})")
        path = builtin
    return load_scenario(path)


def profile(engine: str | Scenario, *, max_k: int | None = None,
            budget_s: float = DEFAULT_BUDGET_S, out_dir: str | Path | None = None,
            cells: int = DEFAULT_CELLS,
            concurrencies: Sequence[int] = DEFAULT_CONCURRENCIES,
            tolerance: float = DEFAULT_TOLERANCE, version: int = 1,
            sink: Sink | None = None, on_progress: ProgressCallback | None = None,
            cost_table: str | Path | None = None, **openai_options: Any) -> ProfileResult:
    """Profile a cold engine and derive its first table; write `out_dir/table.json`.

    `engine` is `twin:SCENARIO`, a `Scenario`, or `openai:URL` (then `openai_options` go to
    `tabletune.profile_openai.profile_openai`). `max_k` defaults to the engine's startup K;
    `budget_s` is engine time; `cells` how many cells share it; `sink` receives the profile's
    telemetry as well (twin only); `cost_table` (twin only): a measured latency CSV that
    replaces the scenario's cost model (its noise stays).
    """
    if budget_s <= 0:
        raise ProfileError(f"budget_s={budget_s} must be > 0")
    if cells < 1:
        raise ProfileError(f"cells={cells} must be >= 1")
    if isinstance(engine, str) and engine.startswith("openai:"):
        if cost_table is not None:
            raise ProfileError("cost_table only applies to twin engines")
        return profile_openai(engine.removeprefix("openai:"), max_k=max_k, budget_s=budget_s,
                              out_dir=out_dir, cells=cells, concurrencies=concurrencies,
                              tolerance=tolerance, version=version, on_progress=on_progress,
                              **openai_options)
    if openai_options:
        raise ProfileError(f"options {sorted(openai_options)} only apply to openai:URL")
    if isinstance(engine, str):
        if not engine.startswith("twin:"):
            raise ProfileError(f"engine {engine!r}: expected twin:SCENARIO or openai:URL")
        scenario = resolve_twin_scenario(engine.removeprefix("twin:"))
    else:
        scenario = engine
    if cost_table is not None:
        scenario = dataclasses.replace(scenario, cost=CostConfig(
            table=str(Path(cost_table).resolve()), noise=scenario.cost.noise))
    limits = scenario.engine
    top_k = limits.max_k if max_k is None else max_k
    if not 0 <= top_k <= limits.max_k:
        raise ProfileError(f"max_k={top_k} is outside the engine's startup range "
                           f"0..{limits.max_k}")
    k_values = tuple(range(top_k + 1))
    loads = concurrency_levels(limits.max_num_seqs, concurrencies)
    started = time.monotonic()
    run = run_twin_profile(scenario, k_values=k_values, concurrencies=loads,
                           budget_s=budget_s, cell_s=max(MIN_CELL_S, budget_s / cells),
                           fit_max_k=top_k, sink=sink, on_progress=on_progress)
    key = TableKey(limits.model, scenario.drafter.method, limits.hardware)
    envelope = envelope_from_records(
        run.records, key=key, max_k=top_k, max_batch=limits.max_num_seqs,
        startup_k_values=k_values, version=version, tolerance=tolerance,
        provenance={"source": "profile", "engine": f"twin:{scenario.name}",
                    "engine_time_s": round(run.engine_time_s, 3),
                    "cells": [c.to_dict() for c in run.cells]})
    result = ProfileResult(envelope=envelope, cells=run.cells, engine_time_s=run.engine_time_s,
                           wall_s=time.monotonic() - started, records=run.records.num_rows)
    if out_dir is not None:
        result.path = write_table(envelope, out_dir)
    return result
