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

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from controller.fleet.decisions import Decision
from controller.fleet.table_log import read_log
from fitter.ingest import IngestConfig, Ingestor
from schemas import TableEnvelope, TableKey
from schemas.settings import Settings
from schemas.signing import generate_private_key, private_key_text, public_key_text
from tabletune.broker import EmbeddedBroker
from tabletune.control_process import ControlProcess
from tabletune.demo_scenarios import GROUPS, Group

CONCURRENCIES = (1, 4, 16, 64, 128, 256)
DEMO_SPEEDUP = 5.0
"""Virtual seconds per wall second asked of the fleet. The control service must keep up
with telemetry arriving this many times faster than a real fleet's, beside the broker,
ingest and two fleets on a 2-core machine; at 10x on a busy one its cold profile ended
80 s of virtual time late and its re-profile ran past the phase. The fleet's two 300 s
phases take two minutes."""


def demo_keys() -> tuple[dict[str, str], dict[str, str]]:
    """Tables are signed and verified as in production, with a key pair made for the run:
    (the control service's signing key, the engines' public key)."""
    key = generate_private_key()
    return ({"TABLETUNE_SIGNING_KEY_ID": "demo", "TABLETUNE_SIGNING_KEY": private_key_text(key)},
            {"TABLETUNE_VERIFY_KEYS": f"demo:{public_key_text(key)}"})


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
        signing, verifying = demo_keys()
        env = {"TABLETUNE_BOOTSTRAP": broker.bootstrap, **verifying}
        settings = Settings.from_env(env)
        console.print(f"[bold]embedded broker[/] on {broker.bootstrap}")
        ingestor = Ingestor(settings, IngestConfig(out_dir=out_dir / "parquet",
                                                   group_id="demo-ingest", window_s=1.0))
        ingest_thread = threading.Thread(target=ingestor.run, name="demo-ingest", daemon=True)
        ingest_thread.start()

        fleet_task = progress.add_task("fleet ← tables topic ← tabletune control", total=None)
        with ControlProcess({**env, **signing}, out_dir / "control") as control:
            fleets = {name: _start_fleet(result.group, phase_s, engines_per_group, env,
                                         out_dir) for name, result in results.items()}
            while any(fleet.poll() is None for fleet in fleets.values()):
                progress.update(fleet_task, description="fleet ← tables topic ← tabletune "
                                "control " + _ingest_line(ingestor))
                time.sleep(0.5)
            runs = {name: _fleet_result(fleet) for name, fleet in fleets.items()}
        decisions = control.decisions()
        progress.update(fleet_task, total=1, completed=1,
                        description="fleet: done " + _ingest_line(ingestor))
        envelopes = [e.message for e in read_log(settings)
                     if isinstance(e.message, TableEnvelope)]
        for name, result in results.items():
            _collect(result, runs[name], decisions, envelopes)

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
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console)


def _start_fleet(group: Group, phase_s: float, engines: int, env: dict[str, str],
                 out_dir: Path) -> subprocess.Popen[bytes]:
    """`tabletune twin fleet` for one group, as its own process: the command a user runs,
    and the groups' engines then step on every core instead of sharing one interpreter.
    Engine 0 runs the comparison's seed; engine ids are `<group>-<i>`."""
    scenario = out_dir / f"{group.name}-fleet.toml"
    scenario.write_text(group.scenario_text(0, phase_s, engine_id=group.name))
    with open(out_dir / f"{group.name}-fleet.json", "w") as out, \
            open(out_dir / f"{group.name}-fleet.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tabletune.cli", "twin", "fleet", "--scenario",
             str(scenario), "--engines", str(engines), "--speedup", str(DEMO_SPEEDUP),
             "--json"], env={**os.environ, **env}, stdout=out, stderr=log)


def _fleet_result(fleet: subprocess.Popen[bytes]) -> dict[str, Any]:
    scenario = Path(fleet.args[fleet.args.index("--scenario") + 1])
    output = scenario.with_suffix(".json")
    if fleet.wait() != 0:
        log = scenario.with_suffix(".log").read_text()
        raise RuntimeError(f"tabletune twin fleet --scenario {scenario} failed:\n{log}")
    return json.loads(output.read_text())


def _collect(result: GroupResult, run: dict[str, Any], decisions: list[Decision],
             envelopes: list[TableEnvelope]) -> None:
    result.live = list(run["engines"].values())
    epoch_s = run["epoch_s"]
    key = str(result.key)
    result.tables = [(d.t_s - epoch_s, d.fields["version"], d.fields["table"])
                     for d in decisions if d.key == key and d.what == "stage"]
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

    from controller.fleet.table_log import newest_version
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
    from twin.run import run_scenario
    from twin.scenario_file import parse_scenario

    return run_scenario(parse_scenario(text, base_dir=Path(".")), spec).to_dict()
