"""The numbers of `bench.real_serving`: per arm and phase, over repeats; the comparisons.

Scores are output tokens/s from the telemetry, the median over repeats, and every arm is
scored over the same stretch of the same requests. Per phase: the `measured` window, from
the lead-in to the drain. Over the whole run: the `counted` windows, every second from
TableTune's first table (phase 1 from the median time its engines applied version 1, the
others from their start), and the `undrained` ones, its cold profile included. vLLM's
client result of the median repeat (by `output_throughput`; of two, the slower) is the
arm's `phases` entry. An arm's whole-run rate is the same work at its per-phase rates: the
tokens of every phase over the time they take at those rates, so phases of another length
weigh the same in every arm.
"""

from __future__ import annotations

import statistics
from typing import Any

import polars as pl

from bench.serving_arm import ArmRun
from bench.serving_telemetry import phase_telemetry, timeline

WINDOWS = ("measured", "counted", "undrained")


def arm_entries(runs: list[ArmRun], steps: pl.DataFrame, lead_s: float,
                first_table_s: float) -> dict[str, dict[str, Any]]:
    """{ARM: {"phases": {PHASE: client result}, "repeats": [...], "score": {...}}};
    `first_table_s`: seconds into the first phase from which the `counted` window runs."""
    arms: dict[str, dict[str, Any]] = {}
    for run in runs:
        mine = steps.filter(pl.col("engine_id") == run.engine_id)
        telemetry = {}
        for i, p in enumerate(run.phases):
            telemetry[p["name"]] = phase_telemetry(mine, p, run.results[p["name"]], lead_s,
                                                   first_table_s if i == 0 else 0.0)
            telemetry[p["name"]]["timeline_10s"] = timeline(mine, p["started"], p["ended"])
        arms.setdefault(run.slot.arm, {"repeats": []})["repeats"].append({
            "repeat": run.slot.repeat, "key": run.key, "engine_id": run.engine_id,
            "forced_table": run.table, "server_start_s": _round(run.server_start_s),
            "wall_s": _round(run.wall_s), "phase_times": run.phases, "phases": run.results,
            "telemetry": telemetry})
    for entry in arms.values():
        repeats = entry["repeats"]
        names = [p["name"] for p in repeats[0]["phase_times"]]
        entry["phases"], entry["score"] = {}, {}
        for name in names:
            by_client = sorted(repeats, key=lambda r: r["phases"][name]["output_throughput"])
            entry["phases"][name] = by_client[(len(by_client) - 1) // 2]["phases"][name]
            entry["score"][name] = {
                f"{window}_tok_s": _spread([r["telemetry"][name][window]["tok_s"]
                                            for r in repeats]) for window in WINDOWS}
            entry["score"][name]["client_output_throughput"] = _spread(
                [r["phases"][name]["output_throughput"] for r in repeats])
    return arms


def comparisons(arms: dict[str, dict[str, Any]], phase_names: list[str]) -> dict[str, Any]:
    fixed = sorted(a for a in arms if a.startswith("fixed:"))
    out: dict[str, Any] = {"per_phase": {}, "whole_run": None}
    if not fixed:
        return out

    def rate(arm: str, phase: str, kind: str = "measured_tok_s") -> float:
        value = arms[arm]["score"][phase][kind]["median"]
        return 0.0 if value is None else float(value)

    for phase in phase_names:
        best = max(fixed, key=lambda a: rate(a, phase))
        row: dict[str, Any] = {"best_fixed": best, "best_fixed_tok_s": rate(best, phase),
                               "fixed_tok_s": {a: rate(a, phase) for a in fixed}}
        for arm in ("tabletune", "static"):
            score = arms[arm]["score"][phase]["measured_tok_s"] if arm in arms else None
            if score and score["median"] is not None and rate(best, phase) > 0:
                row[f"{arm}_ratio"] = round(score["median"] / rate(best, phase), 3)
                row[f"{arm}_ratio_range"] = [round(score["min"] / rate(best, phase), 3),
                                             round(score["max"] / rate(best, phase), 3)]
        out["per_phase"][phase] = row

    reference = arms.get("tabletune") or arms[fixed[0]]
    work = {p: float(statistics.median(r["phases"][p]["total_output_tokens"]
                                       for r in reference["repeats"])) for p in phase_names}

    def whole(arm: str, kind: str) -> float | None:
        """None when a phase has no rate (shorter than its lead-in)."""
        if any(rate(arm, p, kind) <= 0 for p in phase_names):
            return None
        seconds = sum(work[p] / rate(arm, p, kind) for p in phase_names)
        return round(sum(work.values()) / seconds, 2)

    rates = {a: whole(a, "counted_tok_s") for a in arms}
    known = [a for a in fixed if rates[a] is not None]
    if not known:
        return out
    best = max(known, key=lambda a: rates[a] or 0.0)
    run: dict[str, Any] = {"work_tokens": work, "tok_s": rates, "best_fixed": best,
                           "best_fixed_tok_s": rates[best]}
    # what a table could win: each phase at its own best fixed K, over the best single K
    per_phase_best = sum(work.values()) / sum(
        work[p] / max(rate(a, p, "counted_tok_s") for a in fixed) for p in phase_names)
    run["headroom"] = round(per_phase_best / rates[best], 3)
    for arm in ("tabletune", "static"):
        if arm in arms and rates[arm] is not None:
            run[f"{arm}_ratio"] = round(rates[arm] / rates[best], 3)
    # the cold profile included: every arm from its first second, against the best fixed K
    cold = {a: whole(a, "undrained_tok_s") for a in arms}
    run["with_cold_profile_tok_s"] = cold
    cold_best = max((cold[a] for a in fixed if cold[a] is not None), default=None)
    run["with_cold_profile_best_tok_s"] = cold_best
    if "tabletune" in arms and cold["tabletune"] and cold_best:
        run["tabletune_with_cold_profile_ratio"] = round(cold["tabletune"] / cold_best, 3)
    out["whole_run"] = run
    return out


def _spread(values: list[float | None]) -> dict[str, Any]:
    """Median, min and max of the runs that have a value (a phase shorter than its lead-in
    has no measured window); all None without any."""
    known = [v for v in values if v is not None]
    if not known:
        return {"median": None, "min": None, "max": None, "runs": values}
    return {"median": round(statistics.median(known), 2), "min": round(min(known), 2),
            "max": round(max(known), 2), "runs": values}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
