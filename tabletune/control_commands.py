"""What the `tabletune tables`, `tabletune controller` and `tabletune control` commands do,
once their command line is parsed (`tabletune.cli_control` registers them): every one talks to the
broker, so kafka-python is imported here and not by the parser."""

from __future__ import annotations

import argparse
import json
import logging
import resource
import signal
import sys
import time
from dataclasses import replace

from kafka import KafkaConsumer, TopicPartition

from controller.fleet.decision_log import decision_file_handler
from controller.fleet.loop import log as loop_log
from controller.fleet.loop_config import LoopConfig
from controller.fleet.runner import ControlRunConfig, ControlRunner
from controller.fleet.table_log import check_tables_topic, control, publish, read_log, read_topic
from controller.status import summarized
from fitter.derive import fit_table
from fitter.engine_consensus import with_screening
from fitter.reachability import check_reachable
from schemas import EnvelopeError, TableControl, TableEnvelope, TableError, TableKey
from schemas.settings import Settings
from schemas.table_files import load_table_file


def run_control_service(args: argparse.Namespace) -> int:
    try:  # before the broker: a bad setting is a usage error wherever the service runs
        key = None if args.key is None else TableKey.parse(args.key)
        config = ControlRunConfig(key=key, lookback_s=args.lookback_s, group=args.group,
                                  session_timeout_ms=round(args.session_timeout_s * 1000))
        loop_config = loop_config_of(args)
    except (ValueError, EnvelopeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = _settings(args)
    check_tables_topic(settings)  # a compacted or expiring log folds to another state
    # the service's decisions are its output: one INFO line each on stderr, and to FILE
    loop_log.setLevel(logging.INFO)
    print(f"budgets: {'on' if loop_config.budgets else 'off'} (where engines report n-gram "
          "match lengths)", file=sys.stderr)
    writer = None if args.decisions is None else decision_file_handler(args.decisions)
    if writer is not None:
        loop_log.addHandler(writer)
    try:
        # every fit screened: the service reads the telemetry topic itself, not ingest's checks
        runner = ControlRunner(settings, with_screening(fit_table), config=config,
                               loop_config=loop_config)
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: runner.stop())
        started = (time.monotonic(), _cpu_s())
        try:
            runner.run(timeout_s=args.duration_s)
        except KeyboardInterrupt:
            runner.stop()
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        if writer is not None:
            loop_log.removeHandler(writer)
            writer.close()
    served = {str(loop.limits.key): {"state": loop.state.value,
                                     "version": loop.agent.state.newest_version,
                                     "conflicting_steps": loop.conflicts.to_dict()}
              for loop in runner.service.loops()}
    print(json.dumps({"records": runner.records, "history_records": runner.history_records,
                      "unserved_records": runner.service.unserved_records,
                      "bad_frames": runner.bad_frames,
                      "send_errors": sum(c.errors for c in runner.channels.values()),
                      "unsent": sum(c.unsent for c in runner.channels.values()),
                      "dropped_unsent": sum(c.dropped for c in runner.channels.values()),
                      "fenced_unsent": runner.fenced, "budgets": loop_config.budgets,
                      "keys": served, **_cpu(started)}))
    return 0


def loop_config_of(args: argparse.Namespace) -> LoopConfig:
    """The `LoopConfig` of `tabletune control`'s flags (`cli_control`): without any,
    `LoopConfig()`."""
    loop = LoopConfig()
    return replace(
        loop, refit_interval_s=args.refit_s, refit_spacing=args.refit_spacing,
        reprofile_on_stale=args.reprofile_on_stale,
        canary_share=args.canary_share, force_grace_s=args.force_grace_s,
        engine_idle_s=args.engine_idle_s, budgets=args.budgets,
        guardrail=replace(loop.guardrail, threshold=args.guardrail_threshold),
        drift=replace(loop.drift, acceptance_threshold=args.drift_acceptance_threshold))


def _cpu(started: tuple[float, float]) -> dict[str, float]:
    """What serving cost the host since start-up: CPU seconds (user + system, every thread)
    and wall seconds, for sizing the service and for benchmarks that run it beside an
    engine."""
    return {"cpu_s": round(_cpu_s() - started[1], 2),
            "wall_s": round(time.monotonic() - started[0], 2)}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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
    recent = [summarized(event) for event in events[-20:]]  # latency cells: their count
    print(json.dumps({"key": str(key), "history": history, "active_by_engine": active,
                      "recent_events": recent}, indent=2))
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
