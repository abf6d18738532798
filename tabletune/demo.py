"""`tabletune demo`: the production path on this machine, in a few minutes, with a report.

An embedded Kafka-protocol broker, and on it the processes of a deployment: `tabletune
control` (a child process, the command an operator runs), the ingest job writing Parquet,
and a twin fleet (an EAGLE group and an n-gram group, two engines each, the H100 cost
model, parametric acceptance, paced at `DEMO_SPEEDUP` times real time). Each engine runs a
real engine's parts: its recorder streams telemetry to the telemetry topic and its table
feed takes tables and controls only from the tables topic. The control service profiles
each cold key, publishes its first table, refits, sees the drift half-way (`stale`),
re-profiles a canary engine and publishes the new table. Then the batch `fit` job refits
from the ingested Parquet, and the policies users have today run on the same traffic, in
memory, for comparison. Writes `demo-out/report.md` and PNG plots.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from controller.table_log import read_log
from fitter.ingest import IngestConfig, Ingestor
from schemas import TableEnvelope, TableKey
from schemas.settings import Settings
from tabletune.broker import EmbeddedBroker
from tabletune.control_process import ControlProcess
from tabletune.demo_scenarios import GROUPS, Group
from tabletune.twin_fleet import Fleet, FleetConfig

CONCURRENCIES = (1, 4, 16, 64, 128, 256)
DEMO_SPEEDUP = 10.0
"""Virtual seconds per wall second: the speed the fleet benchmark measures the control
service at, and it keeps the fleet's two 300 s phases to about a minute."""
SIGNING = {"TABLETUNE_SIGNING_KEY_ID": "demo", "TABLETUNE_SIGNING_SECRET": "demo-secret"}
"""Tables are signed and verified as in production; a demo secret, for a demo broker."""


@dataclass
class GroupResult:
    group: Group
    live: list[dict[str, Any]] = field(default_factory=list)
    """Run summaries of the group's fleet engines, engine 0 first."""
    tables: list[tuple[float, int, list[list[int]]]] = field(default_factory=list)
    """(virtual s, version, table) of each table the control service published."""
    first_envelope: TableEnvelope | None = None
    last_envelope: TableEnvelope | None = None
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)
    best_k_by_load: dict[str, dict[int, int]] = field(default_factory=dict)
    """Per traffic mix (before / after the drift): concurrency -> best fixed K."""
    batch_refit: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> TableKey:
        return TableKey("llama-3.1-8b-instruct", self.group.method, "twin-h100")


def run_demo(out_dir: Path, *, phase_s: float = 300.0, engines_per_group: int = 2,
             console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    out_dir.mkdir(parents=True, exist_ok=True)
    # each demo starts a fresh broker, whose offsets start at 0 again: Parquet left by an
    # earlier run would name those offsets as already ingested, and ingest would skip them
    shutil.rmtree(out_dir / "parquet", ignore_errors=True)
    started = time.monotonic()
    results = {g.name: GroupResult(g) for g in GROUPS}
    with EmbeddedBroker() as broker, _progress(console) as progress:
        env = {"TABLETUNE_BOOTSTRAP": broker.bootstrap, **SIGNING}
        settings = Settings.from_env(env)
        console.print(f"[bold]embedded broker[/] on {broker.bootstrap}")
        ingestor = Ingestor(settings, IngestConfig(out_dir=out_dir / "parquet",
                                                   group_id="demo-ingest", window_s=1.0))
        ingest_thread = threading.Thread(target=ingestor.run, name="demo-ingest", daemon=True)
        ingest_thread.start()

        task = progress.add_task("tabletune control: starting", total=2 * phase_s)
        with ControlProcess(env, out_dir / "control") as control:
            fleets = {name: Fleet(_fleet_scenario(result.group, phase_s), settings,
                                  FleetConfig(engines=engines_per_group,
                                              speedup=DEMO_SPEEDUP)).start()
                      for name, result in results.items()}
            while any(fleet.running for fleet in fleets.values()):
                clock = min(fleet.clock_s for fleet in fleets.values())
                progress.update(task, completed=clock, description=(
                    "fleet ← tables topic ← tabletune control " + _ingest_line(ingestor)))
                time.sleep(0.5)
            runs = {name: fleet.join() for name, fleet in fleets.items()}
        decisions = control.decisions()
        progress.update(task, completed=2 * phase_s, description="fleet: done "
                        + _ingest_line(ingestor))
        envelopes = [e.message for e in read_log(settings)
                     if isinstance(e.message, TableEnvelope)]
        for name, result in results.items():
            _collect(result, runs[name], decisions, envelopes, fleets[name].epoch_s)

        batch = progress.add_task("fit: batch refit from the ingested Parquet", total=1)
        _wait_ingested(ingestor, sum(r["steps"] for g in results.values() for r in g.live))
        for result in results.values():
            result.batch_refit = _batch_refit(out_dir / "parquet", result, settings)
        progress.update(batch, advance=1)

        ingestor.stop()
        ingest_thread.join(timeout=30)
        counters = ingestor.counters

        compare = progress.add_task("compare: fixed K 0..7, vLLM's table, the stale table",
                                    total=len(GROUPS) * (10 + 8 * len(CONCURRENCIES)))
        _compare(results, phase_s, out_dir, lambda: progress.update(compare, advance=1))

    from tabletune.demo_report import write_report
    summary = write_report(out_dir, results, counters, time.monotonic() - started, phase_s)
    console.print(summary["text"])
    console.print(f"[bold]report:[/] {out_dir / 'report.md'}")
    return summary


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn(
        "{task.completed:.0f}/{task.total:.0f}"), TimeElapsedColumn(), console=console)


def _fleet_scenario(group: Group, phase_s: float) -> Any:
    """Engine 0 of the fleet runs the comparison's seed; fleet engine ids `<group>-<i>`."""
    from producers.twin.scenario_file import parse_scenario

    scenario = parse_scenario(group.scenario_text(0, phase_s), base_dir=Path("."),
                              name=group.name)
    return dataclasses.replace(scenario, engine=dataclasses.replace(
        scenario.engine, engine_id=group.name))


def _collect(result: GroupResult, run: dict[str, Any], decisions: list[dict[str, Any]],
             envelopes: list[TableEnvelope], epoch_s: float) -> None:
    result.live = list(run["engines"].values())
    key = str(result.key)
    result.tables = [(d["t_s"] - epoch_s, d["version"], d["table"]) for d in decisions
                     if d["key"] == key and d["what"] == "stage"]
    mine = sorted((e for e in envelopes if e.key == result.key), key=lambda e: e.version)
    if mine:
        result.first_envelope, result.last_envelope = mine[0], mine[-1]


def _ingest_line(ingestor: Any) -> str:
    c = ingestor.counters
    return f"| ingested {c.records:,} records, {c.files} files, dlq {c.dlq}"


def _wait_ingested(ingestor: Any, expected: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ingestor.counters.records < expected and time.monotonic() < deadline:
        time.sleep(0.2)


def _batch_refit(parquet: Path, result: GroupResult, settings: Settings) -> dict[str, Any]:
    """The production batch path: `tabletune fit` on what ingest wrote, for this group."""
    import polars as pl

    from controller.table_log import newest_version
    from fitter.dataset import read_dataset
    from fitter.refit import decide_refit

    key = result.key
    records = read_dataset(parquet).filter(pl.col("drafter") == key.drafter)
    newest = records.get_column("ts_ns").max()
    recent = records.filter(pl.col("ts_ns") >= newest - int(120e9))
    decision = decide_refit(recent.to_arrow(), None, key=key, max_k=7, max_batch=256,
                            startup_k_values=range(8), newest_version=newest_version(
                                settings, key), half_life_s=None)
    return {"records": recent.height, "table": decision.envelope.table.to_vllm(),
            "version": decision.envelope.version}


def _compare(results: dict[str, GroupResult], phase_s: float, out_dir: Path,
             tick: Callable[[], None]) -> None:
    """Every fixed K, vLLM's table and the stale table on each group's traffic (engine 0's
    seed), and the best fixed K per load for the table plot: independent in-memory runs, on
    every core (spawned, not forked: this process runs Kafka client threads)."""
    jobs: dict[tuple[str, str, Any], tuple[str, str]] = {}
    for name, result in results.items():
        group = result.group
        policies = {f"fixed:{k}": f"fixed:{k}" for k in range(8)}
        policies["vllm-doc"] = "vllm-doc"
        if result.first_envelope is not None:
            stale = out_dir / f"{name}-stale-table.json"
            stale.write_text(json.dumps(result.first_envelope.to_dict()))
            policies["stale table (first fit, held)"] = f"table:{stale}"
        for label, spec in policies.items():
            jobs[name, "baseline", label] = (group.scenario_text(0, phase_s), spec)
        for concurrency in CONCURRENCIES:  # one short run covers both traffic mixes
            for k in range(8):
                jobs[name, "load", (concurrency, k)] = (
                    group.scenario_text(0, 60, concurrency=concurrency), f"fixed:{k}")
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1,
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run_text, text, spec): job for job, (text, spec) in jobs.items()}
        done: dict[tuple[str, str, Any], dict[str, Any]] = {}
        for future in as_completed(futures):
            done[futures[future]] = future.result()
            tick()
    for name, result in results.items():
        group = result.group
        mixes = (group.before_name, group.after_name)
        rates: dict[tuple[str, int], dict[int, float]] = {}
        for (group_name, kind, label), summary in done.items():
            if group_name != name:
                continue
            if kind == "baseline":
                result.baselines[label] = summary
                continue
            concurrency, k = label
            for phase, mix in enumerate(mixes):
                rates.setdefault((mix, concurrency), {})[k] = (
                    summary["phases"][phase]["output_tokens_per_s"])
        result.baselines = dict(sorted(result.baselines.items()))
        result.best_k_by_load = {mix: {c: max(rates[mix, c], key=rates[mix, c].__getitem__)
                                       for c in CONCURRENCIES} for mix in mixes}


def _run_text(text: str, spec: str) -> dict[str, Any]:
    """One in-memory twin run of a scenario's TOML text under policy `spec`."""
    from producers.twin.run import run_scenario
    from producers.twin.scenario_file import parse_scenario

    return run_scenario(parse_scenario(text, base_dir=Path(".")), spec).to_dict()
