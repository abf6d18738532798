"""n-gram under vLLM's client: TableTune's proposer at one K against vLLM's own, then a budget.

    .venv/bin/python -m bench.serving_ngram_ab [--k 2] [--pairs 3] [--lookup 1 4] [--out DIR]

Part 1, the A/B. Each pair runs three fresh OpenAI API servers of `bench.real_serving`'s
target model (its drafter replaced by prompt lookup), one after the other, with the same
phases of `vllm bench serve` load, in an order that reverses from pair to pair:
- `stock`: vLLM's n-gram proposer and stock scheduler, K as its startup table, no TableTune;
- `hook`: vLLM's n-gram proposer under TableTune's hook, K forced from the tables topic;
- `proposer`: TableTune's n-gram proposer (`producers.ngram_proposer`) and hook, K forced:
  no budget, so it must draft what vLLM's does at a cost within the noise.
Score: vLLM's client's output tokens/s per phase; per pair the ratios, their median over
pairs, and the noise (the stock arm's spread over pairs).

Part 2, a budget applied (`--no-budget` skips it). One server with the proposer and hook, the
table `[[1, 16, K]]` published, then two phases of the `high` load back to back with the
same prompts. When the first ends, an envelope with the same table and `--budget` is
published. From the telemetry: per table version and match length, the requests, drafted
tokens per request and accepted per drafted token; and the client's tokens/s per phase.

--quick: the tiny model, one pair, the quick phase, a short budget part (a smoke run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import emit
from bench.real_engine import startup_table
from bench.real_serving import MAX_K, add_model_arguments, build_model
from bench.serving_arm import ArmContext, ArmRun, Client, arm_environment, run_arm
from bench.serving_plan import (
    FULL_PHASES,
    QUICK_PHASES,
    Phase,
    Slot,
    client_argv,
    phase_seconds,
)
from bench.serving_server import ModelSetup, Server
from controller.fleet.table_log import publish, read_topic
from producers.proposer_link import PROPOSER_CLASS
from schemas import DraftTable, TableEnvelope, TableKey
from schemas.draft_budget import DraftBudget
from schemas.frames import FrameError, decode_frame
from schemas.settings import Settings
from tabletune.broker import EmbeddedBroker, free_port

ARMS = ("stock", "hook", "proposer")
DEFAULT_BUDGET = {"min_match": 1, "ranges": [[1, 16, [0, 2, 4, 4]]]}
"""For lookup 1..4 and K2: a one-token match drafts nothing, two tokens draft the table's
K, three or four tokens the engine's max K."""


def setups(base: ModelSetup, lookup: tuple[int, int]) -> dict[str, ModelSetup]:
    """The arms' engines: vLLM's n-gram (stock and hook arms) and TableTune's proposer."""
    low, high = lookup
    ngram = replace(base, speculative={"method": "ngram", "prompt_lookup_min": low,
                                       "prompt_lookup_max": high})
    proposer = replace(base, speculative={"method": "custom_class", "model": PROPOSER_CLASS},
                       engine_env=(("TABLETUNE_PROMPT_LOOKUP_MIN", str(low)),
                                   ("TABLETUNE_PROMPT_LOOKUP_MAX", str(high))))
    return {"stock": ngram, "hook": ngram, "proposer": proposer}


def pair_order(pairs: int) -> list[tuple[int, str]]:
    order = []
    for repeat in range(1, pairs + 1):
        order += [(repeat, arm) for arm in (ARMS if repeat % 2 else ARMS[::-1])]
    return order


def summarize(runs: dict[tuple[int, str], ArmRun], phases: list[str]) -> dict[str, Any]:
    """Per phase: each arm's tokens/s per pair; per pair proposer/stock, proposer/hook and
    hook/stock, and their medians; the stock arm's spread (max / min - 1), the noise."""
    pairs = sorted({repeat for repeat, _ in runs})
    whole = [r for r in pairs if all((r, arm) in runs for arm in ARMS)]
    out: dict[str, Any] = {"pairs": len(whole), "per_phase": {}}
    for phase in phases:
        tok_s = {arm: [float(runs[r, arm].results[phase]["output_throughput"]) for r in whole]
                 for arm in ARMS}
        row: dict[str, Any] = {arm: [round(v, 2) for v in values]
                               for arm, values in tok_s.items()}
        for top, bottom in (("proposer", "stock"), ("proposer", "hook"), ("hook", "stock")):
            ratios = [a / b for a, b in zip(tok_s[top], tok_s[bottom], strict=True)]
            row[f"{top}/{bottom}"] = [round(r, 3) for r in ratios]
            row[f"{top}/{bottom} median"] = (round(statistics.median(ratios), 3)
                                             if ratios else None)
        stock = tok_s["stock"]
        row["stock noise"] = round(max(stock) / min(stock) - 1, 3) if stock else None
        out["per_phase"][phase] = row
    return out


def budget_part(ctx: ArmContext, k: int, budget: DraftBudget, phase: Phase, lead_s: float,
                measure_s: float) -> dict[str, Any]:
    """Part 2: one server of `ctx.setup`, the table, then the budget published between two
    phases."""
    setup = ctx.setup
    hardware = f"{ctx.hardware}.budget"
    key = TableKey(setup.served_name, setup.drafter, hardware)
    engine_id = "ngram-ab-budget"
    run_dir = ctx.out_dir / "budget"
    run_dir.mkdir(parents=True, exist_ok=True)
    table = DraftTable.from_vllm([[1, setup.max_num_seqs, k]])
    startup = startup_table(setup.max_k, setup.max_num_seqs)
    k_values = tuple(sorted(DraftTable.from_vllm(startup).k_values))

    def envelope(version: int, with_budget: DraftBudget | None) -> TableEnvelope:
        return TableEnvelope(key=key, version=version, table=table, startup_k_values=k_values,
                             max_batch=setup.max_num_seqs, budget=with_budget,
                             created_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))

    publish(ctx.settings, envelope(1, None))
    server = Server(setup, startup, free_port(), arm_environment(ctx, setup, (engine_id, hardware)),
                    run_dir / "server.log")
    speed = ctx.speeds.get(phase.name)
    seconds = phase_seconds(lead_s, measure_s, speed)
    names = ("table", "budget")
    plan = {"phases": [{"name": name, "argv": client_argv(
        phase, prompts=phase.num_prompts(seconds, speed["tok_s"] if speed else None),
        base_url=server.url, model=setup.served_name, tokenizer=str(setup.target),
        result_dir=str(run_dir / "client"), result_file=f"{name}.json",
        warmups=int(name == "table"))} for name in names]}
    (run_dir / "client-plan.json").write_text(json.dumps(plan, indent=1))
    client = Client(run_dir)
    results: dict[str, Any] = {}
    try:
        client.launch(run_dir / "client-plan.json")
        server.launch()
        server.wait_healthy()
        client.wait_ready()
        client.go()  # version 1 applies at the engine's first step, the client's warm-up
        for _, line in client.lines(timeout_s=4 * seconds + 600):
            results[line["name"]] = {
                **json.loads((run_dir / "client" / f"{line['name']}.json").read_text()),
                "started": line["started"], "ended": line["ended"]}
            if line["name"] == "table":
                publish(ctx.settings, envelope(2, budget))
    finally:
        client.stop()
        server.stop()
    steps = engine_steps(ctx.settings, engine_id)
    return {"key": str(key), "table": table.to_vllm(), "budget": budget.to_json(),
            "phases": {name: {"output_throughput": round(float(r["output_throughput"]), 2),
                              "completed": r.get("completed")} for name, r in results.items()},
            "by_version": by_version(steps)}


def engine_steps(settings: Settings, engine_id: str) -> list[dict[str, Any]]:
    """The engine's step records from the telemetry topic, in step order."""
    rows: list[dict[str, Any]] = []
    for message in read_topic(settings, settings.topics.telemetry, timeout_s=30):
        try:
            frame = decode_frame(message.value, message.headers)
        except FrameError:
            continue
        rows += [r for r in frame.to_pylist() if r["engine_id"] == engine_id]
    return sorted(rows, key=lambda r: r["step_seq"])


def by_version(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per table version (its first step left out: it verifies the previous version's
    drafts) and match length: requests, drafted tokens per request, accepted per drafted
    token; and the version's steps, forced ones left out."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for step in steps:
        version = step["table_version"]
        if version not in seen:
            seen.add(version)
            continue
        if step["forced"]:
            continue
        entry = out.setdefault(str(version), {"steps": 0, "lengths": {}})
        entry["steps"] += 1
        for row in step["by_match_length"] or []:
            cell = entry["lengths"].setdefault(str(row["match_length"]),
                                               {"requests": 0, "drafted": 0, "accepted": 0})
            cell["requests"] += row["requests"]
            cell["drafted"] += row["draft_tokens"]
            cell["accepted"] += sum(row["accepted_per_pos"])
    for entry in out.values():
        for cell in entry["lengths"].values():
            cell["drafted_per_request"] = round(cell["drafted"] / max(cell["requests"], 1), 3)
            cell["accepted_per_drafted"] = (round(cell["accepted"] / cell["drafted"], 3)
                                            if cell["drafted"] else None)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=2, help="the K every arm runs (default 2)")
    parser.add_argument("--pairs", type=int, default=3, help="A/B rounds (default 3)")
    parser.add_argument("--lookup", type=int, nargs=2, default=[1, 4], metavar=("MIN", "MAX"),
                        help="prompt lookup's n-gram range, both proposers (default 1 4)")
    parser.add_argument("--phases", nargs="+", default=["low", "high"],
                        choices=[p.name for p in FULL_PHASES],
                        help="bench.real_serving's phases each arm runs (default low high)")
    parser.add_argument("--lead-s", type=float, default=5.0)
    parser.add_argument("--measure-s", type=float, default=30.0)
    parser.add_argument("--budget", type=json.loads, default=DEFAULT_BUDGET,
                        help=f"part 2's budget, JSON (default {json.dumps(DEFAULT_BUDGET)})")
    parser.add_argument("--no-budget", action="store_true", help="skip part 2")
    parser.add_argument("--quick", action="store_true", help="tiny model, a smoke run")
    parser.add_argument("--out", default="bench-out/ngram-ab")
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    if not 0 <= args.k <= MAX_K:
        parser.error(f"--k must be within 0..{MAX_K}")
    if args.quick:
        args.pairs = 1
    args.model = None
    budget = DraftBudget.from_json(args.budget).validate(MAX_K, 16)
    t0 = time.monotonic()
    out = Path(args.out)
    work = Path(args.work or tempfile.mkdtemp(prefix="tabletune-ngram-ab-"))
    arms = setups(build_model(args, work), tuple(args.lookup))
    phases = QUICK_PHASES if args.quick else tuple(p for p in FULL_PHASES
                                                   if p.name in args.phases)
    runs: dict[tuple[int, str], ArmRun] = {}
    with EmbeddedBroker() as broker:
        settings = Settings.from_env({"TABLETUNE_BOOTSTRAP": broker.bootstrap})
        base = ArmContext(arms["stock"], startup_table(MAX_K, arms["stock"].max_num_seqs),
                          settings, broker.bootstrap, "ngram-ab", out, work / "vllm-cache",
                          phases, args.lead_s, args.measure_s,
                          probe=not args.quick)
        for repeat, arm in pair_order(args.pairs):
            print(f"[{time.monotonic() - t0:5.0f} s] pair {repeat}: {arm}", file=sys.stderr,
                  flush=True)
            ctx = replace(base, setup=arms[arm], out_dir=out / arm, hardware=f"ngram-ab-{arm}")
            slot = Slot(repeat, f"stock:{args.k}" if arm == "stock" else f"fixed:{args.k}")
            runs[repeat, arm] = run_arm(ctx, slot)
        budget_result = None
        if not args.no_budget:
            print(f"[{time.monotonic() - t0:5.0f} s] budget", file=sys.stderr, flush=True)
            phase = phases[-1] if args.quick else next(p for p in FULL_PHASES
                                                       if p.name == "high")
            budget_result = budget_part(replace(base, setup=arms["proposer"]), args.k, budget,
                                        phase, args.lead_s, args.measure_s)
    result = {"command": "python -m bench.serving_ngram_ab" + (" --quick" if args.quick else
                                                               f" --k {args.k}"),
              "k": args.k, "lookup": args.lookup, "model": arms["stock"].served_name,
              "phases": [p.describe() for p in phases],
              **summarize(runs, [p.name for p in phases]), "budget_part": budget_result,
              "wall_s": round(time.monotonic() - t0, 1)}
    emit("ngram_ab", result, str(out))
    complete = all(r.results[p.name].get("completed") and not r.results[p.name].get("failed")
                   for r in runs.values() for p in phases)
    return 0 if complete and result["pairs"] == args.pairs else 1


if __name__ == "__main__":
    sys.exit(main())
