"""`tabletune profile` and `tabletune fit`: wired in by `register(commands)`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fitter.reachability import check_reachable
from schemas import TableKey
from schemas.settings import Settings
from tabletune.cli_args import (
    EXIT_FAILED,
    EXIT_USAGE,
    NON_NEGATIVE,
    POSITIVE,
    integer,
    integers,
    table_key,
)


def register(commands: Any) -> None:
    """Add `profile` and `fit` to a parser's sub-commands."""
    profile = commands.add_parser(
        "profile", help="profile a cold engine and write its first table",
        description="Forces K for every batch size through the engine's table switch "
        "(telemetry marks those steps forced), drives a closed-loop load, and chooses each "
        "next (concurrency, K) cell where the fitted goodput surface is least sure which K "
        "wins - not a full grid. Writes DIR/table.json: a TableEnvelope whose vLLM triples "
        "are under 'table'. With twin:SCENARIO the scenario supplies cost model, drafter "
        "and acceptance, and the budget is virtual engine time.")
    profile.add_argument("--engine", required=True, metavar="twin:SCENARIO|openai:URL",
                         help="twin:FILE.toml or twin:NAME (a built-in scenario such as "
                         "sharegpt-eagle), or openai:http://host:port of a vLLM server")
    profile.add_argument("--max-k", type=integer(0), default=None,
                         help="largest K to try (default: the engine's startup K)")
    profile.add_argument("--budget-s", type=POSITIVE, default=120.0,
                         help="engine seconds for the whole sweep (default 120)")
    profile.add_argument("--out", required=True, metavar="DIR", help="folder for table.json")
    profile.add_argument("--cells", type=integer(1), default=None,
                         help="cells that share the budget (default 16: 7.5 s each of the "
                         "default budget)")
    profile.add_argument("--sink", default=None,
                         help="twin: also send the profile's telemetry to kafka://host:port "
                         "or file:///dir")
    profile.add_argument("--cost-table", default=None, metavar="CSV",
                         help="twin: step latencies measured on your GPU "
                         "(batched_tokens,kv_tokens,k,latency_s; docs/TWIN.md) in place of "
                         "the scenario's cost model")
    profile.add_argument("--model", default=None, help="openai: model name to request")
    profile.add_argument("--prompts", default=None,
                         help="openai: a file with one prompt per line (default: generated)")
    profile.add_argument("--parquet", default=None,
                         help="openai: Parquet telemetry the server's hook produces (via "
                         "`tabletune ingest`), read after the load")
    profile.add_argument("--bootstrap", default=None, metavar="HOST:PORT",
                         help="openai: Kafka of the server's TableTune controller (default "
                         "$TABLETUNE_BOOTSTRAP); with it each cell's K is forced on the server "
                         "through the tables topic, and released at the end")
    profile.add_argument("--key", type=table_key, default=None,
                         metavar="MODEL|DRAFTER|HARDWARE",
                         help="openai: the server's table key (needed to force K)")
    profile.add_argument("--k-values", type=integers(0), default=None, metavar="0,1,3,5",
                         help="openai: K values to force, all in the server's startup "
                         "table (default 0..--max-k)")
    profile.add_argument("--json", action="store_true", help="print the result as JSON")
    profile.add_argument("--no-progress", action="store_true", help="no progress bar")
    profile.set_defaults(handler=run_profile)

    fit = commands.add_parser(
        "fit", help="refit from live telemetry; publish only when it pays",
        description="Fits the Parquet telemetry (mostly the K the current table chose, "
        "plus exploration steps) and derives a candidate table. With --publish it is "
        "published as version newest+1 only when its predicted gain over the current table "
        "(the newest on the tables topic, or --current) exceeds --threshold, or when the "
        "table is flagged stale (--stale). The candidate is always written to --out. A "
        "one-shot batch job: the long-running control plane is `tabletune control`.")
    fit.add_argument("--parquet", required=True, metavar="DIR", help="telemetry dataset")
    fit.add_argument("--since", default=None, metavar="30m",
                     help="only steps this recent: 90s, 30m, 2h, 1d (default: all)")
    fit.add_argument("--out", required=True, metavar="FILE", help="candidate envelope JSON")
    fit.add_argument("--publish", action="store_true", help="publish when the decision says so")
    fit.add_argument("--bootstrap", default=None,
                     help="host:port[,host:port] (default: TABLETUNE_BOOTSTRAP)")
    fit.add_argument("--key", type=table_key, default=None, metavar="MODEL|DRAFTER|HARDWARE",
                     help="table key (default: the one key in the records)")
    fit.add_argument("--max-k", type=integer(0), default=None,
                     help="largest K (default: the current table's startup set, else the "
                     "largest K in the records)")
    fit.add_argument("--max-batch", type=integer(1), default=None,
                     help="default: the current envelope's, else the largest batch seen")
    fit.add_argument("--startup-k", type=integer(0), nargs="+", default=None, metavar="K",
                     help="K values the engines started with (default: the current "
                     "envelope's, else 0..max-k)")
    fit.add_argument("--threshold", type=NON_NEGATIVE, default=0.01,
                     help="publish above this predicted relative gain (default 0.01)")
    fit.add_argument("--half-life-s", type=POSITIVE, default=1800.0,
                     help="recency half-life of steps (default 1800)")
    fit.add_argument("--current", default=None, metavar="FILE",
                     help="the current envelope from a file instead of the tables topic")
    fit.add_argument("--stale", action="store_true", help="treat the current table as stale")
    fit.add_argument("--strict", action="store_true",
                     help="refuse (exit 1, naming it) a Parquet file that cannot be read or "
                     "is not telemetry, instead of skipping it with a warning (skipped files "
                     "are counted under skipped_files)")
    fit.set_defaults(handler=run_fit)


def run_profile(args: argparse.Namespace) -> int:
    from producers.sinks import SinkError, check_kafka_sink, sink_from_url
    from tabletune.profile import DEFAULT_CELLS, ProfileError, profile
    from tabletune.profile_progress import ProgressBar
    from twin.config import ScenarioError

    options: dict[str, Any] = {}
    if args.engine.startswith("openai:"):
        options = {k: v for k, v in (("model", args.model), ("prompts", args.prompts),
                                     ("parquet", args.parquet), ("key", args.key),
                                     ("k_values", args.k_values))
                   if v is not None}
        settings = Settings.from_env().with_bootstrap(args.bootstrap)
        if settings.bootstrap_servers:
            check_reachable(settings.bootstrap_servers)
            options["settings"] = settings
    elif args.bootstrap or args.key or args.k_values:
        print("error: tabletune profile: --bootstrap, --key and --k-values only apply to "
              "openai:URL", file=sys.stderr)
        return EXIT_USAGE
    else:
        options = {"cost_table": args.cost_table} if args.cost_table else {}
    if args.cost_table and args.engine.startswith("openai:"):
        print("error: tabletune profile: --cost-table only applies to twin:SCENARIO (a real "
              "engine's latencies are its own)", file=sys.stderr)
        return EXIT_USAGE
    if args.sink:
        check_kafka_sink(args.sink)
    try:
        sink = sink_from_url(args.sink) if args.sink else None
        with ProgressBar(args.budget_s, enabled=not args.no_progress) as bar:
            result = profile(args.engine, max_k=args.max_k, budget_s=args.budget_s,
                             out_dir=args.out,
                             cells=DEFAULT_CELLS if args.cells is None else args.cells, sink=sink,
                             on_progress=bar.update, **options)
    except (ProfileError, ScenarioError, SinkError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(f"wrote {result.path}: {json.dumps(result.envelope.table.to_vllm())} "
              f"({result.records} steps, {result.engine_time_s:.1f} s engine time, "
              f"{len(result.cells)} cells, {result.wall_s:.1f} s wall)")
    return 0


def run_fit(args: argparse.Namespace) -> int:
    from fitter.refit import RefitError, parse_since
    from tabletune.fit_job import RefitJob, refit_once

    try:
        settings = Settings.from_env().with_bootstrap(args.bootstrap)
        if args.publish:
            settings.require_bootstrap()
        if args.publish or (settings.bootstrap_servers and args.current is None):
            check_reachable(settings.bootstrap_servers)  # the current envelope, the publish
        job = RefitJob(
            parquet=Path(args.parquet),
            since=parse_since(args.since) if args.since else None,
            out=Path(args.out), key=TableKey.parse(args.key) if args.key else None,
            max_k=args.max_k, max_batch=args.max_batch, startup_k_values=args.startup_k,
            threshold=args.threshold, half_life_s=args.half_life_s,
            current_file=Path(args.current) if args.current else None,
            publish=args.publish, settings=settings, strict=args.strict)
        outcome = refit_once(job, stale=args.stale)
    except (RefitError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(outcome.to_dict()))
    return 0
