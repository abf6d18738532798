"""What TableTune did in each `tabletune` arm, read back from the tables and status topics:
the versions it published (when, why, which table), when the engine applied each one, the
K its profile forced, and when its sweeps forced the engine (from the control service's
decisions). Also the checks that a run went as it should."""

from __future__ import annotations

import datetime as dt
import statistics
from typing import Any

from bench.serving_arm import ArmRun
from bench.serving_plan import SHORT_WINDOW
from controller.fleet.table_log import read_log
from schemas import TableControl, TableEnvelope, TableKey
from schemas.settings import Settings


def tabletune_history(settings: Settings, run: ArmRun, events: list[dict[str, Any]]
                      ) -> dict[str, Any]:
    origin = run.phases[0]["started"]
    mine = [e for e in events if e.get("engine_id") == run.engine_id]
    applied: dict[int, float] = {}
    for event in mine:
        if event.get("event") == "applied" and isinstance(event.get("version"), int):
            applied.setdefault(event["version"], _unix(event["at"]))
    versions, forced_k = [], set()
    for entry in read_log(settings, TableKey.parse(run.key)):
        message = entry.message
        if isinstance(message, TableControl) and message.action == "force" and message.table:
            forced_k |= set(message.table.k_values)
        if not isinstance(message, TableEnvelope):
            continue
        published = entry.timestamp_ms / 1000.0
        at = applied.get(message.version)
        versions.append({
            "version": message.version, "reason": message.provenance.get("reason"),
            "table": message.table.to_vllm(), "created_at": message.created_at,
            "published_s": round(published - origin, 1),
            "published_in": phase_at(run, published),
            "applied_s": None if at is None else round(at - origin, 1),
            "applied_in": None if at is None else phase_at(run, at)})
    counts: dict[str, int] = {}
    for event in mine:
        counts[str(event.get("event"))] = counts.get(str(event.get("event")), 0) + 1
    return {"repeat": run.slot.repeat, "key": run.key, "engine_id": run.engine_id,
            "origin_unix_s": origin, "versions": versions, "profile_forced_k": sorted(forced_k),
            "engine_events": counts,
            "applied_versions": sorted(applied), "sweeps": sweeps(run),
            "control_cpu": control_cpu(run)}


def first_table_s(histories: list[dict[str, Any]]) -> float:
    """Seconds into the first phase at which TableTune's engines applied version 1 (the
    median over repeats; 0 without one): where "every second from its first table"
    starts for every arm."""
    times = [v["applied_s"] for h in histories for v in h["versions"]
             if v["version"] == 1 and v["applied_s"] is not None]
    return round(statistics.median(times), 1) if times else 0.0


def short_windows(arms: dict[str, dict[str, Any]], measure_s: float) -> list[str]:
    """Measured (and counted) windows under SHORT_WINDOW of `measure_s`: the arm outran the
    phase's sizing, so its score rests on fewer seconds than asked."""
    short = []
    for arm, entry in arms.items():
        for repeat in entry["repeats"]:
            for phase, telemetry in repeat["telemetry"].items():
                for window in ("measured", "counted"):
                    seconds = telemetry[window]["seconds"]
                    if seconds < SHORT_WINDOW * measure_s:
                        short.append(f"{arm} repeat {repeat['repeat']}: {phase}'s {window} "
                                     f"window was {seconds:.0f} s, under {measure_s:g} (put a "
                                     "faster arm first)")
    return short


def control_cpu(run: ArmRun) -> dict[str, float] | None:
    """The control service's CPU and wall seconds (its exit summary): it ran on the
    server's cores, which a deployment would not share."""
    summary = run.control_summary
    if "cpu_s" not in summary:
        return None
    return {"cpu_s": summary["cpu_s"], "wall_s": summary["wall_s"]}


def sweeps(run: ArmRun) -> list[dict[str, Any]]:
    """The control service's profile and re-profiles of this arm's key: when each began and
    ended (its refit), in which phase, on which drift signal, and its block lengths. While
    one runs, the engine runs forced K, each phase's worse ones included."""
    origin = run.phases[0]["started"]
    out: list[dict[str, Any]] = []
    signal = None
    for decision in run.control_decisions:
        what, at, fields = decision.what.value, decision.t_s, decision.fields
        if what == "stale":
            signal = fields.get("signal")
        elif what in ("profile", "reprofile"):
            out.append({"kind": what, "signal": signal if what == "reprofile" else None,
                        "started_s": round(at - origin, 1), "started_in": phase_at(run, at),
                        # a one-engine key's probe: its one block at the largest K
                        "block_s": fields.get("block_s", fields.get("probe_s")),
                        "confirm_block_s": fields.get("confirm_block_s"),
                        "ended_s": None, "ended_in": None})
            signal = None
        elif (what == "refit" and out and out[-1]["ended_s"] is None
              and fields.get("reason") in ("profile", "stale")):
            out[-1].update(ended_s=round(at - origin, 1), ended_in=phase_at(run, at))
    return out


def phase_at(run: ArmRun, unix_s: float) -> str:
    """The phase running at `unix_s` ("before" the first, "between" two, "after" the last)."""
    if unix_s < run.phases[0]["started"]:
        return "before"
    for phase in run.phases:
        if phase["started"] <= unix_s <= phase["ended"]:
            return phase["name"]
    return "after" if unix_s > run.phases[-1]["ended"] else "between"


def checks(runs: list[ArmRun], histories: list[dict[str, Any]],
           startup_k: set[int]) -> list[str]:
    """Problems that make the run not count (empty: it does)."""
    problems = []
    for run in runs:
        for name, result in run.results.items():
            if not result.get("completed") or result.get("failed"):
                problems.append(f"{run.slot.slug} {name}: vLLM's client completed "
                                f"{result.get('completed')} and failed {result.get('failed')}")
    for history in histories:
        slug = history["engine_id"]
        if not startup_k <= set(history["profile_forced_k"]):
            problems.append(f"{slug}: the profile forced K {history['profile_forced_k']}, "
                            f"not every startup K {sorted(startup_k)}")
        first = next((v for v in history["versions"] if v["version"] == 1), None)
        if first is None or first["reason"] != "profile":
            problems.append(f"{slug}: no version 1 from the profile on the tables topic")
        if not any(v >= 1 for v in history["applied_versions"]):
            problems.append(f"{slug}: the engine applied no TableTune version "
                            f"(events: {history['engine_events']})")
    return problems


def _unix(iso: str) -> float:
    return dt.datetime.fromisoformat(iso).timestamp()
