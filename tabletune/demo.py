"""`tabletune demo`: the whole system on this machine, in a few minutes, with a report.

An embedded Kafka-protocol broker; a fleet of twin engines (an EAGLE group and an n-gram
group, two engines each, the H100 cost model, parametric acceptance); each engine's hook
records every step to the telemetry topic, the ingest job turns it into Parquet; each
engine's controller profiles, takes its first table, follows live traffic, detects the drift
half-way (`stale`), refits, swaps, explores and guards — the `tabletune` closed loop, whose
tables and status events also go to the tables and status topics. Then the fitter job refits
from the ingested Parquet (the production batch path), and every policy users have today
runs on the same traffic for comparison. Writes `demo-out/report.md` and PNG plots.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from tabletune.demo_scenarios import GROUPS, Group

CONCURRENCIES = (1, 4, 16, 64, 128, 256)


@dataclass
class GroupResult:
    group: Group
    live: list[dict[str, Any]] = field(default_factory=list)
    """Run summaries of the group's engines under `tabletune`."""
    tables: list[tuple[float, int, list[list[int]]]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    first_envelope: Any = None
    last_envelope: Any = None
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)
    best_k_by_load: dict[str, dict[int, int]] = field(default_factory=dict)
    """Per traffic mix (before / after the drift): concurrency -> best fixed K."""
    batch_refit: dict[str, Any] = field(default_factory=dict)


def run_demo(out_dir: Path, *, phase_s: float = 300.0, engines_per_group: int = 2,
             console: Console | None = None) -> dict[str, Any]:
    from fitter.ingest import IngestConfig, Ingestor
    from producers.sinks import KafkaSink
    from tabletune.broker import EmbeddedBroker
    from tabletune.settings import Settings

    console = console or Console()
    out_dir.mkdir(parents=True, exist_ok=True)
    # each demo starts a fresh broker, whose offsets start at 0 again: Parquet left by an
    # earlier run would name those offsets as already ingested, and ingest would skip them
    shutil.rmtree(out_dir / "parquet", ignore_errors=True)
    started = time.monotonic()
    results = {g.name: GroupResult(g) for g in GROUPS}
    with EmbeddedBroker() as broker, _progress(console) as progress:
        settings = Settings(bootstrap_servers=(broker.bootstrap,),
                            signing_key_id="demo", signing_secret=b"demo-secret")
        console.print(f"[bold]embedded broker[/] on {broker.bootstrap}")
        ingestor = Ingestor(settings, IngestConfig(out_dir=out_dir / "parquet",
                                                   group_id="demo-ingest", window_s=1.0))
        ingest_thread = threading.Thread(target=ingestor.run, name="demo-ingest", daemon=True)
        ingest_thread.start()

        fleet = progress.add_task("fleet: profile → table → live → drift → refit",
                                  total=len(GROUPS) * engines_per_group)
        for group in GROUPS:
            for index in range(engines_per_group):
                summary, policy = _run_live_engine(group, index, phase_s, settings,
                                                   KafkaSink(settings))
                _collect(results[group.name], summary, policy)
                progress.update(fleet, advance=1, description=_status_line(
                    group.name, index, summary, ingestor))
        progress.update(fleet, description="fleet: done " + _ingest_line(ingestor))

        batch = progress.add_task("fitter: refit from the ingested Parquet", total=1)
        _wait_ingested(ingestor, sum(r["steps"] for g in results.values() for r in g.live))
        for group in GROUPS:
            results[group.name].batch_refit = _batch_refit(out_dir / "parquet", group,
                                                           settings)
        progress.update(batch, advance=1)

        compare = progress.add_task("compare: fixed K 0..7, vLLM's table, the stale table",
                                    total=len(GROUPS) * (10 + 8 * len(CONCURRENCIES)))
        for group in GROUPS:
            _compare(results[group.name], phase_s, out_dir,
                     lambda: progress.update(compare, advance=1))
        ingestor.stop()
        ingest_thread.join(timeout=30)
        counters = ingestor.counters

    from tabletune.demo_report import write_report
    summary = write_report(out_dir, results, counters, time.monotonic() - started, phase_s)
    console.print(summary["text"])
    console.print(f"[bold]report:[/] {out_dir / 'report.md'}")
    return summary


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn(
        "{task.completed}/{task.total}"), TimeElapsedColumn(), console=console)


def _run_live_engine(group: Group, index: int, phase_s: float, settings: Any,
                     sink: Any) -> tuple[dict[str, Any], Any]:
    from producers.twin.run import run_scenario
    from producers.twin.scenario_file import parse_scenario
    from producers.twin.tabletune_policy import TabletunePolicy

    scenario = parse_scenario(group.scenario_text(index, phase_s), base_dir=Path("."),
                              name=f"{group.name}-{index}")
    policy = TabletunePolicy()
    summary = run_scenario(scenario, policy, sink=sink).to_dict()
    policy.close()
    return summary, policy


def _collect(result: GroupResult, summary: dict[str, Any], policy: Any) -> None:
    result.live.append(summary)
    loop = policy.loop
    if loop is None:
        return
    if not result.tables:  # the first engine of the group tells the story
        result.tables = [(t, v, table.to_vllm()) for t, v, table in loop.applied]
        events = sorted([*policy.status.recent, *policy.feed.status.recent],
                        key=lambda e: e["at"])
        result.events = [e for e in events
                         if e["event"] in ("applied", "stale", "rolled_back", "rejected")]
        result.events += [{"event": d["what"], "t_s": d["t_s"], **{k: v for k, v in d.items()
                          if k in ("reason", "version", "gain")}}
                          for d in loop.decisions if d["what"] in ("refit", "profile")]
        accepted = loop.agent.state.accepted
        if accepted:
            result.first_envelope = accepted[min(accepted)]
            result.last_envelope = accepted[max(accepted)]


def _status_line(name: str, index: int, summary: dict[str, Any], ingestor: Any) -> str:
    return (f"fleet: {name}-{index} done, {summary['output_tokens_per_s']:.0f} tok/s "
            + _ingest_line(ingestor))


def _ingest_line(ingestor: Any) -> str:
    c = ingestor.counters
    return f"| ingested {c.records:,} records, {c.files} files, dlq {c.dlq}"


def _wait_ingested(ingestor: Any, expected: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ingestor.counters.records < expected and time.monotonic() < deadline:
        time.sleep(0.2)


def _batch_refit(parquet: Path, group: Group, settings: Any) -> dict[str, Any]:
    """The production batch path: `tabletune fit` on what ingest wrote, for this group."""
    import polars as pl

    from fitter.dataset import read_dataset
    from fitter.refit import decide_refit

    records = read_dataset(parquet).filter(pl.col("drafter") == group.method)
    newest = records.get_column("ts_ns").max()
    recent = records.filter(pl.col("ts_ns") >= newest - int(120e9))
    from controller.table_log import newest_version
    from schemas import TableKey

    key = TableKey("llama-3.1-8b-instruct", group.method, "twin-h100")
    decision = decide_refit(recent.to_arrow(), None, key=key, max_k=7, max_batch=256,
                            startup_k_values=range(8), newest_version=newest_version(
                                settings, key), half_life_s=None)
    return {"records": recent.height, "table": decision.envelope.table.to_vllm(),
            "version": decision.envelope.version}


def _compare(result: GroupResult, phase_s: float, out_dir: Path,
             tick: Callable[[], None]) -> None:
    from producers.twin.run import run_scenario
    from producers.twin.scenario_file import parse_scenario

    group = result.group
    text = group.scenario_text(0, phase_s)
    policies = {f"fixed:{k}": f"fixed:{k}" for k in range(8)}
    policies["vllm-doc"] = "vllm-doc"
    if result.first_envelope is not None:
        stale = out_dir / f"{group.name}-stale-table.json"
        stale.write_text(json.dumps(result.first_envelope.to_dict()))
        policies["stale table (first fit, held)"] = f"table:{stale}"
    for name, spec in policies.items():
        scenario = parse_scenario(text, base_dir=Path("."), name=group.name)
        result.baselines[name] = run_scenario(scenario, spec).to_dict()
        tick()
    mixes = (group.before_name, group.after_name)
    result.best_k_by_load = {mix: {} for mix in mixes}
    for concurrency in CONCURRENCIES:
        rates: dict[str, dict[int, float]] = {mix: {} for mix in mixes}
        for k in range(8):  # one run covers both traffic mixes, one per phase
            scenario = parse_scenario(group.scenario_text(0, 60, concurrency=concurrency),
                                      base_dir=Path("."), name=group.name)
            summary = run_scenario(scenario, f"fixed:{k}").to_dict()
            for phase, mix in enumerate(mixes):
                rates[mix][k] = summary["phases"][phase]["output_tokens_per_s"]
            tick()
        for mix in mixes:
            result.best_k_by_load[mix][concurrency] = max(rates[mix],
                                                          key=rates[mix].__getitem__)
