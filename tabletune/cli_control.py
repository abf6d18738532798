"""The command lines of `tabletune tables`, `tabletune controller` and `tabletune control`.

Parsing only: each command's work is in `tabletune.control_commands`, imported when that command
runs, so that commands that never talk to a broker (`tabletune twin run`) do not pay for
importing kafka-python (a third of a twin run's start-up)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from controller.fleet.loop_config import LoopConfig
from controller.fleet.ownership_config import SESSION_TIMEOUT_MS
from schemas.control import MAX_FORCE_S
from tabletune.cli_args import NON_NEGATIVE, POSITIVE, integer, number, table_key


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
    pub.set_defaults(handler=_command("run_publish"))
    follow = table_commands.add_parser(
        "follow", help="print each envelope of a key as one JSON line (for pipelines)",
        description="Reads the tables topic from the beginning and prints every envelope "
        "of KEY whose version is newer than the last printed, then keeps following. "
        "Operator controls are not printed. Ctrl-C stops.")
    follow.add_argument("--key", type=table_key, required=True, help="model|drafter|hardware")
    follow.add_argument("--exit-when-idle", action="store_true",
                        help="stop once caught up instead of following")
    _bootstrap(follow)
    follow.set_defaults(handler=_command("run_follow"))

    ctl = commands.add_parser("controller", help="inspect and steer the engines' tables")
    ctl_commands = ctl.add_subparsers(title="controller commands", metavar="COMMAND",
                                      required=True)
    show = ctl_commands.add_parser("show", help="history, active versions, recent events")
    show.add_argument("key", type=table_key, help="model|drafter|hardware")
    _bootstrap(show)
    show.set_defaults(handler=_command("run_show"))
    pin = ctl_commands.add_parser("pin", help="hold engines of KEY on VERSION")
    pin.add_argument("key", type=table_key)
    pin.add_argument("version", type=integer(1))
    _bootstrap(pin)
    pin.set_defaults(handler=_command("run_control"), action="pin")
    for action, text in (("unpin", "release a pin: follow the newest version again"),
                         ("rollback", "move engines of KEY back to the previous version")):
        sub = ctl_commands.add_parser(action, help=text)
        sub.add_argument("key", type=table_key)
        _bootstrap(sub)
        sub.set_defaults(handler=_command("run_control"), action=action, version=None)

    serve = commands.add_parser(
        "control", help="the control service: profiles, refits, re-profiles every key",
        description="Long-running. Reads every engine's telemetry, the tables topic and "
        "the engines' status announcements; per table key it profiles a cold fleet "
        "(forced K on every engine), publishes the first table, refits on a period, and "
        "after a drift probes what it hides with 3 s blocks on a canary share of the "
        "engines (a one-engine key: on its only engine, within a forced budget) and "
        "publishes the new table. Its clock is the telemetry's timestamps. State lives in the topics: a "
        "restart goes on from the newest published version. Ctrl-C or SIGTERM releases "
        "any force it holds. Run several: replicas on one tables topic share the keys "
        "through a Kafka consumer group (--group), one writer per key at a time, and stamp "
        "what they send with their ownership epoch, which engines fence on "
        "(docs/OPERATIONS.md). Needs TABLETUNE_BOOTSTRAP (or --bootstrap). The share of "
        "steps engines explore at is theirs to set (TABLETUNE_EXPLORE_SHARE); the loop's "
        "tuned constants are in docs/TUNING.md.")
    serve.add_argument("--key", type=table_key, default=None, metavar="MODEL|DRAFTER|HARDWARE",
                       help="serve this key alone, when the group gives it to this replica "
                       "(default: every key whose engines announce themselves and whose slot "
                       "the group gives this replica)")
    serve.add_argument("--group", default=None, metavar="GROUP",
                       help="the Kafka consumer group the control replicas of one tables "
                       "topic share: each key is served by one member at a time, keys spread "
                       "over the members, and a member that stops or stalls loses its keys "
                       "to the others within the session timeout (default "
                       "tabletune-control.<tables topic>; with --key, a group of its own "
                       "keeps a dedicated set of replicas for that key)")
    serve.add_argument("--session-timeout-s", type=number(1, 300),
                       default=SESSION_TIMEOUT_MS / 1000,
                       help="a replica whose heartbeats stop for this long loses its keys to "
                       "the others, and one acts only while its last heartbeat is younger "
                       f"than half of it (default {SESSION_TIMEOUT_MS / 1000:g}; 1 to 300)")
    serve.add_argument("--lookback-s", type=NON_NEGATIVE, default=180.0,
                       help="telemetry from this many seconds before start-up, for the "
                       "first fits only (default 180; 0: only new steps)")
    _operator_settings(serve)
    serve.add_argument("--decisions", default=None, metavar="FILE",
                       help="append every decision of every key's loop to FILE as it is "
                       "taken, one JSON object a line (profile, refit, stale, reprofile, "
                       "stage, ...; each also goes to stderr as a log line); FILE is created "
                       "at start, so a path that cannot be written fails before the service "
                       "runs")
    serve.add_argument("--duration-s", type=POSITIVE, default=None,
                       help="stop after this many wall seconds (default: run until stopped)")
    _bootstrap(serve)
    serve.set_defaults(handler=_command("run_control_service"))


def _operator_settings(serve: argparse.ArgumentParser) -> None:
    """The loop settings an operator may set (`LoopConfig`'s first half), defaults its own."""
    loop = LoopConfig()
    group = serve.add_argument_group("the loop's settings (docs/OPERATIONS.md)")
    group.add_argument("--refit-s", type=POSITIVE, default=loop.refit_interval_s,
                       help="telemetry seconds between periodic refits (default "
                       f"{loop.refit_interval_s:g})")
    group.add_argument("--refit-spacing", type=number(1), default=loop.refit_spacing,
                       help="a periodic refit that the gain gate holds doubles the wait "
                       "for the next, up to this many --refit-s; a new table, a drift or a "
                       f"roll-back brings it back to one (1 = never; default "
                       f"{loop.refit_spacing:g})")
    group.add_argument("--reprofile-on-stale", action=argparse.BooleanOptionalAction,
                       default=loop.reprofile_on_stale,
                       help="after a drift, probe what it hides with short blocks on a canary "
                       "share of the engines (a one-engine key: its only engine); off: "
                       "only refit the passive window (default on)")
    group.add_argument("--canary-share", type=number(0, 1, low_open=True),
                       default=loop.canary_share,
                       help="share of a key's engines a re-profile forces, at least one; the "
                       f"others keep the current table meanwhile (default {loop.canary_share:g})")
    group.add_argument("--force-grace-s",
                       type=number(0, MAX_FORCE_S - loop.longest_block_s, low_open=True),
                       default=loop.force_grace_s,
                       help="a forced block expires this long after it should end: so long "
                       "that transport lag never ends one early, so short that the engines "
                       "of a service killed mid-sweep are soon free (default "
                       f"{loop.force_grace_s:g})")
    group.add_argument("--budgets", action=argparse.BooleanOptionalAction,
                       default=loop.budgets,
                       help="fit a per-request draft budget (K by n-gram match length) beside "
                       "each table where the engines report match lengths; engines that do "
                       "not run the table alone (default on)")
    group.add_argument("--engine-idle-s", type=POSITIVE, default=loop.engine_idle_s,
                       help="an engine without steps for this many seconds has left its key "
                       f"and is no canary (default {loop.engine_idle_s:g})")
    group.add_argument("--guardrail-threshold", type=number(0, 1, low_open=True, high_open=True),
                       default=loop.guardrail.threshold,
                       help="roll a swapped-in table back when it is confidently worse than "
                       "the one before by more than this share of goodput (default "
                       f"{loop.guardrail.threshold:g})")
    group.add_argument("--drift-acceptance-threshold", type=POSITIVE,
                       default=loop.drift.acceptance_threshold,
                       help="relative change of acceptance that makes the table stale and "
                       "starts a re-profile; the bars counted in thresholds move with it "
                       f"(default {loop.drift.acceptance_threshold:g})")


def _bootstrap(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", default=None,
                        help="host:port[,host:port] (default: TABLETUNE_BOOTSTRAP)")


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    """The handler `name` of `tabletune.control_commands`, imported when its command runs."""

    def run(args: argparse.Namespace) -> int:
        from tabletune import control_commands as commands

        return int(getattr(commands, name)(args))

    return run
