"""`tabletune controller ...` and `tabletune tables ...`: operator commands."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from controller.cli_args import NON_NEGATIVE, POSITIVE, integer, number, table_key
from controller.table_log import check_tables_topic, control, publish, read_log, read_topic
from fitter.kafka_clients import check_reachable
from schemas import EnvelopeError, TableControl, TableEnvelope, TableError, TableKey
from schemas.settings import Settings
from schemas.table_files import load_table_file


def register(commands: Any) -> None:
    tables = commands.add_parser("tables", help="publish and follow table envelopes")
    table_commands = tables.add_subparsers(title="tables commands", metavar="COMMAND",
                                           required=True)
    pub = table_commands.add_parser(
        "publish", help="publish a TableEnvelope JSON file to the tables topic",
        description="Signs it (Ed25519) with TABLETUNE_SIGNING_KEY_ID and "
        "TABLETUNE_SIGNING_KEY when they are set.")
    pub.add_argument("file")
    _bootstrap(pub)
    pub.set_defaults(handler=run_publish)
    follow = table_commands.add_parser(
        "follow", help="print each envelope of a key as one JSON line (for pipelines)",
        description="Reads the tables topic from the beginning and prints every envelope "
        "of KEY whose version is newer than the last printed, then keeps following. "
        "Operator controls are not printed. Ctrl-C stops.")
    follow.add_argument("--key", type=table_key, required=True, help="model|drafter|hardware")
    follow.add_argument("--exit-when-idle", action="store_true",
                        help="stop once caught up instead of following")
    _bootstrap(follow)
    follow.set_defaults(handler=run_follow)

    ctl = commands.add_parser("controller", help="inspect and steer the engines' tables")
    ctl_commands = ctl.add_subparsers(title="controller commands", metavar="COMMAND",
                                      required=True)
    show = ctl_commands.add_parser("show", help="history, active versions, recent events")
    show.add_argument("key", type=table_key, help="model|drafter|hardware")
    _bootstrap(show)
    show.set_defaults(handler=run_show)
    pin = ctl_commands.add_parser("pin", help="hold engines of KEY on VERSION")
    pin.add_argument("key", type=table_key)
    pin.add_argument("version", type=integer(1))
    _bootstrap(pin)
    pin.set_defaults(handler=run_control, action="pin")
    for action, text in (("unpin", "release a pin: follow the newest version again"),
                         ("rollback", "move engines of KEY back to the previous version")):
        sub = ctl_commands.add_parser(action, help=text)
        sub.add_argument("key", type=table_key)
        _bootstrap(sub)
        sub.set_defaults(handler=run_control, action=action, version=None)


    serve = commands.add_parser(
        "control", help="the control service: profiles, refits, re-profiles every key",
        description="Long-running. Reads every engine's telemetry, the tables topic and "
        "the engines' status announcements; per table key it profiles a cold fleet "
        "(forced K on every engine), publishes the first table, refits on a period, and "
        "after a drift re-profiles a canary share of the engines and publishes the new "
        "table. Its clock is the telemetry's timestamps. State lives in the topics: a "
        "restart goes on from the newest published version. Ctrl-C or SIGTERM releases "
        "any force it holds. Needs TABLETUNE_BOOTSTRAP (or --bootstrap).")
    serve.add_argument("--key", type=table_key, default=None, metavar="MODEL|DRAFTER|HARDWARE",
                       help="serve this key alone (default: every key whose engines announce "
                       "themselves)")
    serve.add_argument("--lookback-s", type=NON_NEGATIVE, default=180.0,
                       help="telemetry from this many seconds before start-up, for the "
                       "first fits only (default 180; 0: only new steps)")
    serve.add_argument("--canary-share", type=number(0, 1, low_open=True), default=0.25,
                       help="share of a key's engines a re-profile forces, at least one "
                       "(default 0.25)")
    serve.add_argument("--refit-s", type=POSITIVE, default=30.0,
                       help="telemetry seconds between periodic refits (default 30)")
    serve.add_argument("--decisions", default=None, metavar="FILE",
                       help="at exit, write every decision of every key's loop to FILE, one "
                       "JSON object a line (profile, refit, stale, reprofile, stage, ...); "
                       "FILE is created at start, so a path that cannot be written fails "
                       "before the service runs")
    serve.add_argument("--duration-s", type=POSITIVE, default=None,
                       help="stop after this many wall seconds (default: run until stopped)")
    _bootstrap(serve)
    serve.set_defaults(handler=run_control_service)


def run_control_service(args: argparse.Namespace) -> int:
    from controller.control_runner import ControlRunConfig, ControlRunner
    from controller.loop_config import LoopConfig
    from fitter.derive import fit_table
    from fitter.engine_consensus import with_screening

    settings = _settings(args)
    check_tables_topic(settings)  # a compacted or expiring log folds to another state
    try:
        key = None if args.key is None else TableKey.parse(args.key)
        config = ControlRunConfig(key=key, lookback_s=args.lookback_s)
        loop_config = LoopConfig(canary_share=args.canary_share, refit_interval_s=args.refit_s)
    except (ValueError, EnvelopeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    decisions = None if args.decisions is None else open(args.decisions, "w")
    # every fit screened: the service reads the telemetry topic itself, not ingest's checks
    runner = ControlRunner(settings, with_screening(fit_table), config=config,
                           loop_config=loop_config)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: runner.stop())
    try:
        runner.run(timeout_s=args.duration_s)
    except KeyboardInterrupt:
        runner.stop()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if decisions is not None:
        with decisions as out:
            for loop in runner.service.loops():
                for decision in loop.decisions:
                    out.write(json.dumps({"key": str(loop.limits.key), **decision},
                                         default=str) + "\n")
    served = {str(loop.limits.key): {"state": loop.state.value,
                                     "version": loop.agent.state.newest_version}
              for loop in runner.service.loops()}
    print(json.dumps({"records": runner.records, "history_records": runner.history_records,
                      "unserved_records": runner.service.unserved_records,
                      "bad_frames": runner.bad_frames,
                      "send_errors": sum(c.errors for c in runner.channels.values()),
                      "unsent": sum(c.unsent for c in runner.channels.values()),
                      "dropped_unsent": sum(c.dropped for c in runner.channels.values()),
                      "keys": served}))
    return 0


def _bootstrap(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", default=None,
                        help="host:port[,host:port] (default: TABLETUNE_BOOTSTRAP)")


def _settings(args: argparse.Namespace) -> Settings:
    """The settings of a command that talks to Kafka, its bootstrap checked reachable (a dead
    one fails at once, naming it, instead of after kafka-python's retries)."""
    settings = Settings.from_env().with_bootstrap(args.bootstrap)
    check_reachable(settings.require_bootstrap())
    return settings


def run_publish(args: argparse.Namespace) -> int:
    _, envelope = load_table_file(args.file)
    if envelope is None:
        raise TableError("publish needs a TableEnvelope, not plain triples")
    envelope.validate()
    offset = publish(_settings(args), envelope)
    print(json.dumps({"published": str(envelope.key), "version": envelope.version,
                      "offset": offset}))
    return 0


def run_control(args: argparse.Namespace) -> int:
    """Publish a new control: each run issues a fresh id, so running it again is a second
    command, while its bytes sent again are a replay that engines refuse."""
    key = TableKey.parse(args.key)
    message = control(key, args.action, args.version)
    offset = publish(_settings(args), message)
    print(json.dumps({"control": args.action, "key": str(key), "version": args.version,
                      "id": message.control_id, "offset": offset}))
    return 0


def run_show(args: argparse.Namespace) -> int:
    settings = _settings(args)
    key = TableKey.parse(args.key)
    history = []
    for entry in read_log(settings, key):
        if isinstance(entry.message, TableEnvelope):
            env = entry.message
            history.append({"offset": entry.offset, "version": env.version,
                            "created_at": env.created_at, "table": env.table.to_vllm(),
                            "signed_by": env.signature.key_id if env.signature else None})
        elif isinstance(entry.message, TableControl):
            history.append({"offset": entry.offset, "control": entry.message.action,
                            "id": entry.message.control_id, "version": entry.message.version,
                            "issued_at": entry.message.issued_at})
        else:
            history.append({"offset": entry.offset, "error": entry.error})
    events = status_events(settings, str(key))
    active: dict[str, int] = {}
    for event in events:
        if event["event"] in ("applied", "started"):
            active[event["engine_id"]] = event.get("version", 0)
    print(json.dumps({"key": str(key), "history": history, "active_by_engine": active,
                      "recent_events": events[-20:]}, indent=2))
    return 0


def run_follow(args: argparse.Namespace) -> int:
    settings = _settings(args)
    key = TableKey.parse(args.key)
    consumer = KafkaConsumer(**settings.client_kwargs(), enable_auto_commit=False)
    printed = 0
    try:
        partitions = consumer.partitions_for_topic(settings.topics.tables) or set()
        assigned = [TopicPartition(settings.topics.tables, p) for p in sorted(partitions)]
        consumer.assign(assigned)
        consumer.seek_to_beginning(*assigned)
        idle = 0
        while True:
            batches = consumer.poll(timeout_ms=250)
            idle = 0 if batches else idle + 1
            if args.exit_when_idle and idle >= 4:
                return 0
            for messages in batches.values():
                for message in messages:
                    if message.key != str(key).encode():
                        continue
                    try:
                        envelope = TableEnvelope.from_json(message.value)
                    except ValueError:
                        continue  # controls and malformed messages are not envelopes
                    if envelope.version > printed:
                        printed = envelope.version
                        sys.stdout.write(envelope.to_json().decode() + "\n")
                        sys.stdout.flush()
    except KeyboardInterrupt:
        return 0
    finally:
        consumer.close()


def status_events(settings: Settings, key: str, timeout_s: float = 10.0) -> list[dict]:
    """The status topic's events about table `key`, oldest first."""
    events: list[dict] = []
    for message in read_topic(settings, settings.topics.status, timeout_s=timeout_s):
        try:
            event = json.loads(message.value)
        except ValueError:
            continue
        if event.get("table_key") == key:
            events.append(event)
    return events
