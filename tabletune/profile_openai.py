"""Profile a vLLM server through its OpenAI-compatible completions API.

A closed-loop load driver (N client threads, each sending the next completion as soon as the
previous one returns) runs one (concurrency, K) cell after another. With the tables topic
reachable (`settings` with a bootstrap server) and the server's table key, each cell's K is
forced on the server: a `force` control carrying `[[1, max_batch, K]]` that expires shortly
after the cell, so a profiler that dies leaves nothing forced; the server's controller
applies it at a step boundary and its telemetry marks those steps `forced`. After the last
cell a `release` hands the server back to the table it follows. The cells are chosen like
the twin's (`fitter.profile_plan.next_cell`, refitted from the Parquet telemetry after every
cell when `tabletune ingest` keeps up). Without the topic only the load levels can be set and
every step runs the server's own table; the fit must then extrapolate, as a refit does.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from controller.fleet.table_log import control, force, publish
from fitter.dataset import read_dataset
from fitter.derive import DEFAULT_TOLERANCE
from fitter.profile_plan import Cell, concurrency_levels, next_cell
from fitter.refit import key_from_records
from fitter.surface.fit import SurfaceFit, fit_surface
from schemas import DraftTable, TableKey
from schemas.control import MAX_FORCE_S
from schemas.settings import Settings
from tabletune.profile_result import ProfileError, ProfileResult, envelope_from_records, write_table
from tabletune.profile_twin import CellRun, ProgressCallback

GENERATED_PROMPTS = tuple(
    f"Write a detailed, step-by-step explanation of topic number {i}: how a compiler turns "
    f"source code into machine code, with examples." for i in range(64))
DEFAULT_MAX_TOKENS = 256


class ClosedLoopClient:
    """`concurrency` threads posting completions back to back until `stop_at` (monotonic)."""

    def __init__(self, url: str, *, model: str, prompts: Sequence[str],
                 max_tokens: int = DEFAULT_MAX_TOKENS, timeout_s: float = 120.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"openai:{url}: expected an http:// or https:// URL")
        self.url = url.rstrip("/") + "/v1/completions"
        self.model = model
        self.prompts = list(prompts) or list(GENERATED_PROMPTS)
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.completed = 0
        self.tokens = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def run(self, concurrency: int, duration_s: float) -> None:
        stop_at = time.monotonic() + duration_s
        threads = [threading.Thread(target=self._loop, args=(i, stop_at), daemon=True)
                   for i in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=duration_s + self.timeout_s)

    def _loop(self, worker: int, stop_at: float) -> None:
        n = worker
        while time.monotonic() < stop_at:
            prompt = self.prompts[n % len(self.prompts)]
            n += 1
            body = json.dumps({"model": self.model, "prompt": prompt,
                               "max_tokens": self.max_tokens, "temperature": 0.0}).encode()
            request = urllib.request.Request(  # noqa: S310 (scheme checked in __init__)
                self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310
                    usage = json.loads(response.read()).get("usage", {})
            except (urllib.error.URLError, OSError, ValueError) as exc:
                with self._lock:
                    self.errors.append(str(exc))
                if len(self.errors) > 20:
                    return
                time.sleep(0.5)
                continue
            with self._lock:
                self.completed += 1
                self.tokens += int(usage.get("completion_tokens", 0))


def served_model(url: str) -> str:
    """The first model the server lists (`/v1/models`)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"openai:{url}: expected an http:// or https:// URL")
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=10) as response:  # noqa: S310
        models = json.loads(response.read()).get("data", [])
    if not models:
        raise ValueError(f"{url} serves no model")
    return str(models[0]["id"])


def profile_openai(url: str, *, max_k: int | None, budget_s: float,
                   out_dir: str | Path | None, cells: int, concurrencies: Sequence[int],
                   tolerance: float = DEFAULT_TOLERANCE, version: int = 1,
                   on_progress: ProgressCallback | None = None, model: str | None = None,
                   prompts: str | None = None, parquet: str | None = None,
                   max_batch: int = 256, settings: Settings | None = None,
                   key: str | None = None, k_values: Sequence[int] | None = None) -> ProfileResult:
    """Run the cells for `budget_s` of wall time, then fit the server's telemetry from
    `parquet`. K is forced when `settings` names a bootstrap server (see the module
    docstring); then `key` (model|drafter|hardware) and `max_k` are required, and `k_values`
    (default 0..max_k) must be K values the server was started with, or it refuses them."""
    if parquet is None:
        raise ProfileError("openai: the fit needs the server's telemetry: run the server "
                           "with the TableTune hook, `tabletune ingest --out DIR`, and pass "
                           "--parquet DIR")
    forcing = settings is not None and bool(settings.bootstrap_servers)
    if forcing and (key is None or max_k is None):
        raise ProfileError("openai: forcing K needs the server's table key (--key "
                           "MODEL|DRAFTER|HARDWARE) and its startup K (--max-k)")
    table_key = TableKey.parse(key) if key is not None else None
    prompt_list = (Path(prompts).read_text().splitlines() if prompts else GENERATED_PROMPTS)
    client = ClosedLoopClient(url, model=model or served_model(url),
                              prompts=[p for p in prompt_list if p.strip()])
    loads = concurrency_levels(max_batch, concurrencies)
    if not forcing:
        k_values = (-1,)
    elif k_values is None:
        k_values = tuple(range((max_k or 0) + 1))
    elif max_k is not None and any(not 0 <= int(k) <= max_k for k in k_values):
        raise ProfileError(f"K values {sorted(k_values)} must lie in 0..{max_k}")
    k_values = tuple(sorted({int(k) for k in k_values}))
    cell_s = budget_s / max(cells, 1) if forcing else budget_s / len(loads)
    if forcing and cell_s + FORCE_GRACE_S > MAX_FORCE_S:
        raise ProfileError(f"openai: cells of {cell_s:.0f} s would force K for longer than "
                           f"engines take ({MAX_FORCE_S:.0f} s): more cells or less budget")
    started = time.monotonic()
    began = dt.datetime.now(dt.UTC)
    runs: list[CellRun] = []
    visits: Counter[Cell] = Counter()
    fit: SurfaceFit | None = None
    try:
        for index in range(cells if forcing else len(loads)):
            if forcing:
                pick = next_cell(fit, loads, k_values, visits)
                cell, score, chosen = pick.cell, pick.score, pick.chosen_k
                assert settings is not None and table_key is not None
                publish(settings, force(table_key, DraftTable.from_vllm(
                    [[1, max_batch, cell.k]]), hold_s=cell_s + FORCE_GRACE_S))
            else:
                cell, score, chosen = Cell(loads[index], -1), float("nan"), -1
            visits[cell] += 1
            at = time.monotonic() - started
            if on_progress is not None:
                on_progress(at, CellRun(cell, at, at, score, chosen))
            client.run(cell.concurrency, cell_s)
            runs.append(CellRun(cell, at, time.monotonic() - started, score, chosen))
            if forcing:
                fit = _refit(parquet, began, max_k=max_k or 0, max_batch=max_batch)
    finally:
        if forcing:
            assert settings is not None and table_key is not None
            publish(settings, control(table_key, "release", issued_by="profiler"))
    if client.completed == 0:
        raise ProfileError(f"openai:{url}: no completion succeeded "
                           f"({client.errors[-1] if client.errors else 'no error recorded'})")
    time.sleep(2.0)  # let the hook's last frames reach the ingest job
    records = read_dataset(parquet, since=dt.datetime.now(dt.UTC) - began)
    found = key_from_records(records)
    top_k = max_k if max_k is not None else int(records["k_next"].max())  # type: ignore[arg-type]
    envelope = envelope_from_records(
        records, key=table_key or found, max_k=top_k, max_batch=max_batch,
        startup_k_values=k_values if forcing else tuple(range(top_k + 1)), version=version,
        tolerance=tolerance,
        provenance={"source": "profile", "engine": f"openai:{url}", "forced_k": forcing,
                    "completions": client.completed,
                    "cells": [c.to_dict() for c in runs]})
    result = ProfileResult(envelope=envelope, cells=runs,
                           engine_time_s=time.monotonic() - started,
                           wall_s=time.monotonic() - started, records=records.height)
    if out_dir is not None:
        result.path = write_table(envelope, out_dir)
    return result


FORCE_GRACE_S = 30.0
"""A cell's force outlives the cell by this much, so the next cell's force (or the release)
arrives before it expires even if a request runs long."""


def _refit(parquet: str, since: dt.datetime, *, max_k: int, max_batch: int
           ) -> SurfaceFit | None:
    """The surface from the telemetry ingested so far (None while too little has arrived:
    the planner then keeps to its seed design)."""
    try:
        records = read_dataset(parquet, since=dt.datetime.now(dt.UTC) - since)
        return fit_surface(records, max_k=max_k, max_batch=max_batch, half_life_s=None)
    except (ValueError, OSError):
        return None
