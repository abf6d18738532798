"""`tabletune twin run` and `tabletune twin static`: wired in by `register(subparsers)`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from producers.sinks import SinkError, check_kafka_sink
from schemas import TableError
from tabletune.cli_args import POSITIVE, SHARE, integer
from twin.config import DRAFT_METHODS, CostConfig, ScenarioError
from twin.cost import PROFILES, CostModel
from twin.policies import PolicyError
from twin.registry import policy_usages
from twin.run import run_scenario
from twin.static import (
    EXPERIMENT_REQUESTS,
    EXPERIMENT_SEED,
    ngram_match_prob_for,
    static_speedups,
)
from twin.workload import RequestPool, load_trace, parametric_pool


def register(subparsers: Any) -> Any:
    """Add `twin` with its `run`, `calibrate` and `static` sub-commands to a parser's
    sub-commands;
    returns the twin's sub-commands, for commands wired elsewhere (`twin fleet`)."""
    twin = subparsers.add_parser(
        "twin", help="the twin: a trace-driven simulated vLLM engine",
        description="A simulated engine with vLLM's continuous batching and draft-table "
        "semantics, on virtual time: compare policies on the same traffic without a GPU.")
    commands = twin.add_subparsers(title="twin commands", metavar="COMMAND", required=True)

    run = commands.add_parser(
        "run", help="simulate a scenario under a policy",
        description="Runs a scenario file (docs/TWIN.md) and prints its summary. Records "
        "go to --sink exactly as a vLLM engine's would.")
    run.add_argument("--scenario", required=True, help="scenario TOML file")
    run.add_argument("--policy", required=True,
                     help="how K is chosen: " + " | ".join(policy_usages()))
    run.add_argument("--sink", default=None,
                     help="telemetry: kafka://host:port, file:///dir or null:// (default none)")
    run.add_argument("--duration", type=POSITIVE, default=None,
                     help="virtual seconds to run (default: the sum of the phases)")
    run.add_argument("--realtime", action="store_true",
                     help="pace virtual time to the wall clock (demos)")
    run.add_argument("--drain", action="store_true",
                     help="after the end, run without new arrivals until all requests finish")
    run.add_argument("--json", action="store_true", help="print the summary as JSON")
    run.set_defaults(handler=run_twin)

    calibrate_cmd = commands.add_parser(
        "calibrate", help="fit the twin's cost model and acceptance to a real engine's "
        "telemetry",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Reads the step records under --parquet (the ingest job's Parquet) and "
        "writes a scenario the twin runs as it is, whose [cost] and [drafter] tables and "
        "acceptance line can go into any scenario.\n\n"
        "Cost: step_latency_s is fitted by nonnegative least squares on the twin's terms "
        "(docs/TWIN.md):\n"
        "  verify = target_kv*KV + target_batched*max(0, batched - knee) + target_fixed\n"
        "  draft  = [K>0]*(draft_kv*KV + draft_per_token*(K+1) + draft_fixed)  "
        "(eagle, draft_model)\n"
        "         = [K>0]*ngram_fraction*verify                                  (ngram)\n"
        "with KV = kv_tokens (less the step's own drafts and prompt chunk, which vLLM's "
        "context counts), batched = num_decode_reqs + num_draft_tokens + "
        "num_prefill_tokens, K = k_next; step_overhead = the mean inter_step_s - "
        "step_latency_s of steps with decodes (the engine loop outside the step); the "
        "knee by least squares (kept when it gains 2%); noise = the robust spread of "
        "latency / fitted. Terms the records cannot separate (no K = 0, one K only) are 0, "
        "named in the file's notes.\n\n"
        "Acceptance: conditional per draft position from accepted_per_pos over the drafts "
        "that reached it (a short draft counts as rejected); n-gram decodes without a "
        "draft give ngram_match_prob.\n\n"
        "With --cost-table the records are priced by a measured latency table instead (step "
        "+ step_overhead against the table's whole steps): only noise, acceptance and "
        "lengths are fitted.")
    calibrate_cmd.add_argument("--parquet", required=True,
                               help="telemetry folder (hive layout, as ingest writes it)")
    calibrate_cmd.add_argument("--hardware-prefix", default=None,
                               help="only records whose hardware starts with this (e.g. "
                               "cpu2c.fixed for bench.real_serving's fixed:K arms)")
    calibrate_cmd.add_argument("--engine", action="append", default=None, metavar="ID",
                               help="only this engine_id (repeatable)")
    calibrate_cmd.add_argument("--method", choices=DRAFT_METHODS, default=None,
                               help="the twin drafter (default: from the records' drafter)")
    calibrate_cmd.add_argument("--records-from", choices=("vllm", "twin"), default="vllm",
                               help="who wrote the records: vLLM's hook counts a step's "
                               "scheduled tokens in kv_tokens and times inter_step_s update "
                               "to update, the twin neither (default vllm)")
    calibrate_cmd.add_argument("--cost-table", default=None, metavar="CSV",
                               help="a measured latency table (batched_tokens,kv_tokens,k,"
                               "latency_s; docs/TWIN.md) to price the steps by: the profile's "
                               "[cost] is then that table, with the noise measured against it, "
                               "and no coefficient is fitted")
    calibrate_cmd.add_argument("--out", required=True, help="the profile (scenario TOML)")
    calibrate_cmd.add_argument("--json", action="store_true",
                               help="print the calibration as JSON")
    calibrate_cmd.set_defaults(handler=run_calibrate)

    static = commands.add_parser(
        "static", help="SpecDecode-Bench's static-batch experiment: speedup of fixed K",
        description="300 requests sampled with a fixed seed, each run as a batch of B "
        "copies to completion; speedup of each K over no speculation, by throughput.")
    source = static.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="SpecDecode-Bench JSONL file")
    source.add_argument("--acceptance", type=SHARE, nargs="+",
                        help="conditional acceptance per position (instead of a trace)")
    static.add_argument("--prompt-len", type=POSITIVE, default=355.0,
                        help="mean prompt tokens with --acceptance (default 355)")
    static.add_argument("--output-len", type=POSITIVE, default=728.0,
                        help="mean generated tokens with --acceptance (default 728)")
    static.add_argument("--method", choices=DRAFT_METHODS, default="eagle")
    static.add_argument("--batch-sizes", type=integer(1), nargs="+",
                        default=[1, 8, 16, 32, 64, 128])
    static.add_argument("--k", type=integer(0), nargs="+", default=[1, 3, 5],
                        help="K values to compare with no speculation (default 1 3 5)")
    static.add_argument("--requests", type=integer(1), default=EXPERIMENT_REQUESTS)
    static.add_argument("--seed", type=integer(0), default=EXPERIMENT_SEED)
    static.add_argument("--ngram-match-prob", type=SHARE, default=None,
                        help="n-gram match chance where nothing is accepted (default: by "
                        "the trace's dataset name, else 1)")
    static.add_argument("--profile", default="h100-llama3.1-8b", choices=sorted(PROFILES),
                        help="cost profile")
    static.add_argument("--json", action="store_true", help="print the results as JSON")
    static.set_defaults(handler=run_static)
    return commands


def run_twin(args: argparse.Namespace) -> int:
    if args.sink:
        check_kafka_sink(args.sink)
    try:
        # records for a real sink are stamped from now, as a live engine's: ingest refuses
        # stamps before 2020 (the in-memory epoch is 1970)
        external = bool(args.sink) and not args.sink.startswith("null:")
        summary = run_scenario(args.scenario, args.policy, sink=args.sink,
                               duration_s=args.duration, realtime=args.realtime,
                               drain=args.drain, epoch_s=time.time() if external else 0.0)
    except (ScenarioError, PolicyError, TableError, SinkError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    result = summary.to_dict()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{summary.scenario} under {summary.policy}: {summary.steps} steps, "
          f"{summary.duration_s:g} s virtual")
    for label, row in [("all", result), *((p["name"], p) for p in summary.phases)]:
        print(f"  {label:>10}: {row['output_tokens_per_s']:9.1f} tok/s  "
              f"TPOT p50 {_ms(row['tpot_ms_p50'])} p99 {_ms(row['tpot_ms_p99'])}  "
              f"TTFT p50 {_ms(row['ttft_ms_p50'])}  batch {row['mean_batch_size']:.1f}  "
              f"K {_shares(row['k_share'])}")
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    # polars, scipy and the dataset reader are a second of start-up that every other
    # command (twin run above all) would pay
    from twin.calibrate import calibrate, load_records
    from twin.calibration import CalibrationError, profile_toml

    try:
        records = load_records(args.parquet, args.hardware_prefix, args.engine)
        calibration = calibrate(records, method=args.method, source=args.records_from,
                                cost_table=args.cost_table)
        text = profile_toml(calibration, source=args.parquet)
    except CalibrationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        with open(args.out, "w", encoding="utf-8") as out:
            out.write(text)
    except OSError as exc:
        print(f"error: cannot write {args.out}: {exc.strerror}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(calibration.to_dict(), indent=2))
        return 0
    fit = calibration.fit
    r2 = "n/a" if fit["r2"] is None else f"{fit['r2']:.3f}"
    print(f"{calibration.records} step records ({', '.join(calibration.identity['hardware'])})"
          f" -> {args.out}")
    print(f"  cost: R² {r2}, RMSE {fit['rmse_s'] * 1e3:.2f} ms on a mean "
          f"{fit['mean_latency_s'] * 1e3:.2f} ms; K values {fit['k_next_values']}")
    for name, value in calibration.cost_config().items():
        if name != "profile":
            print(f"    {name} = {value if isinstance(value, str) else format(value, '.6g')}")
    print(f"  {calibration.method}: acceptance "
          f"{[round(a, 3) for a in calibration.acceptance]}"
          + (f", ngram_match_prob {calibration.ngram_match_prob:.3f}"
             if calibration.method == "ngram" else ""))
    for note in calibration.notes:
        print(f"  note: {note}")
    return 0


def run_static(args: argparse.Namespace) -> int:
    try:
        cost = CostModel.from_config(CostConfig(profile=args.profile), args.method)
        pool = _static_pool(args)
    except ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    match_prob = args.ngram_match_prob
    if match_prob is None:
        match_prob = ngram_match_prob_for(args.trace) if args.trace else 1.0
    results = static_speedups(pool, method=args.method, batch_sizes=args.batch_sizes,
                              ks=args.k, cost=cost, requests=args.requests, seed=args.seed,
                              ngram_match_prob=match_prob)
    if args.json:
        print(json.dumps([r.to_dict() for r in results]))
        return 0
    for r in results:
        print(f"B={r.batch_size:<4} K={r.k:<2} speedup {r.speedup:.3f}")
    return 0


def _static_pool(args: argparse.Namespace) -> RequestPool:
    if args.trace:
        return load_trace(args.trace, args.method)
    return parametric_pool(tuple(args.acceptance), prompt_len=args.prompt_len,
                           output_len=args.output_len, max_k=max(args.k),
                           rng=np.random.default_rng(args.seed),
                           requests=max(args.requests, 512))


def _shares(k_share: dict[str, float]) -> str:
    return " ".join(f"{k}:{share:.0%}" for k, share in k_share.items())


def _ms(value: float | None) -> str:
    return "   n/a" if value is None else f"{value:6.1f}"
