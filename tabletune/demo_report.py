"""The demo's report: numbers per group, the markdown file and its plots."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from tabletune import plots
from tabletune.suite.ratios import MIN_STALE_LOSS, recovery

VLLM_DOC = [[1, 16, 5], [17, 32, 4], [33, 64, 3], [65, 128, 1], [129, 256, 0]]


def window_mean(timeline: list[list[float]], start_s: float, end_s: float) -> float:
    """Mean output tokens/s over the timeline points inside [start_s, end_s)."""
    values = [rate for t, rate in timeline if start_s <= t < end_s]
    return statistics.fmean(values) if values else float("nan")


def group_numbers(result: Any, phase_s: float) -> dict[str, Any]:
    live = result.live[0]  # same seed as the comparison runs: like for like
    after_start, end = phase_s + 120.0, 2 * phase_s
    fixed = {name: s for name, s in result.baselines.items() if name.startswith("fixed:")}
    best_overall = max(fixed, key=lambda n: fixed[n]["output_tokens_per_s"])
    best_before = max(fixed, key=lambda n: fixed[n]["phases"][0]["output_tokens_per_s"])
    best_after = max(fixed, key=lambda n: window_mean(fixed[n]["timeline"], after_start, end))
    stale = result.baselines.get("stale table (first fit, held)")
    numbers: dict[str, Any] = {
        "live_tok_s": live["output_tokens_per_s"],
        "fleet_median_tok_s": statistics.median(s["output_tokens_per_s"] for s in result.live),
        "best_single_fixed": best_overall,
        "best_single_fixed_tok_s": fixed[best_overall]["output_tokens_per_s"],
        "vllm_doc_tok_s": result.baselines["vllm-doc"]["output_tokens_per_s"],
        "phases": [],
    }
    for best, start, stop in ((best_before, 120.0, phase_s), (best_after, after_start, end)):
        phase = {"best_fixed": best,
                 "best_fixed_tok_s": window_mean(fixed[best]["timeline"], start, stop),
                 "live_tok_s": window_mean(live["timeline"], start, stop),
                 "vllm_doc_tok_s": window_mean(result.baselines["vllm-doc"]["timeline"],
                                               start, stop)}
        if stale is not None:
            phase["stale_tok_s"] = window_mean(stale["timeline"], start, stop)
        numbers["phases"].append(phase)
    after = numbers["phases"][1]
    if stale is not None:
        lost = after["best_fixed_tok_s"] - after["stale_tok_s"]
        numbers["stale_loss"] = lost / after["best_fixed_tok_s"]
        numbers["recovery"] = recovery(after["live_tok_s"], after["stale_tok_s"],
                                       after["best_fixed_tok_s"])
    return numbers


def write_report(out_dir: Path, results: dict[str, Any], ingest: Any, wall_s: float,
                 phase_s: float) -> dict[str, Any]:
    lines = ["# TableTune demo", "",
             f"Two groups of twin engines (H100 Llama-3.1-8B cost model), {phase_s:.0f} s of "
             "virtual time per phase, a drift between the phases. Engines profile, take their "
             "first table, follow live traffic, detect the drift, refit and swap (the "
             "`tabletune` closed loop); telemetry, tables and status events went through the "
             f"embedded Kafka broker. Wall time {wall_s:.0f} s.", "",
             f"Ingest: {ingest.records:,} step records into {ingest.files} Parquet files "
             f"({ingest.dlq} dead-lettered).", ""]
    text = []
    report: dict[str, Any] = {"groups": {}}
    for name, result in results.items():
        numbers = group_numbers(result, phase_s)
        report["groups"][name] = numbers
        group = result.group
        before, after = numbers["phases"]
        lines += [f"## {name}: {group.before_name} → {group.after_name} "
                  f"(concurrency {group.concurrency})", ""]
        if result.first_envelope is not None and result.last_envelope is not None:
            lines += [f"- first fitted table (v{result.first_envelope.version}): "
                      f"`{result.first_envelope.table.to_vllm()}`",
                      f"- table at the end (v{result.last_envelope.version}): "
                      f"`{result.last_envelope.table.to_vllm()}`"]
        lines += [f"- the fitter's batch refit from the ingested Parquet (last 120 s, "
                  f"{result.batch_refit.get('records', 0):,} records): "
                  f"`{result.batch_refit.get('table')}`", "",
                  "| window | tabletune | best fixed K | vLLM's example table | stale table |",
                  "|---|---|---|---|---|"]
        for label, phase in ((f"{group.before_name} (after 120 s)", before),
                             (f"{group.after_name} (after 120 s)", after)):
            lines.append(f"| {label} | {phase['live_tok_s']:.0f} | {phase['best_fixed_tok_s']:.0f}"
                         f" ({phase['best_fixed']}) | {phase['vllm_doc_tok_s']:.0f} | "
                         f"{phase.get('stale_tok_s', float('nan')):.0f} |")
        lines.append(f"| whole run | {numbers['live_tok_s']:.0f} | "
                     f"{numbers['best_single_fixed_tok_s']:.0f} ({numbers['best_single_fixed']})"
                     f" | {numbers['vllm_doc_tok_s']:.0f} | |")
        recovered = _recovered(numbers.get("recovery"))
        lines += ["", f"Output tokens/s (virtual time). After the drift the stale table loses "
                  f"{100 * numbers.get('stale_loss', 0):.1f}% to the best fixed K; tabletune "
                  f"recovers {recovered} of that loss.", ""]
        lines += _plots(out_dir, name, result, phase_s)
        text.append(f"{name}: tabletune {after['live_tok_s']:.0f} tok/s after the drift vs "
                    f"best fixed {after['best_fixed_tok_s']:.0f} ({after['best_fixed']}), "
                    f"stale {after.get('stale_tok_s', float('nan')):.0f}, vLLM table "
                    f"{after['vllm_doc_tok_s']:.0f}; recovery {recovered}")
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    report["text"] = "\n".join(text)
    return report


def _plots(out_dir: Path, name: str, result: Any, phase_s: float) -> list[str]:
    lines = []
    if result.last_envelope is not None and result.last_envelope.surface:
        path = plots.surface_heatmap(
            result.last_envelope.surface, result.last_envelope.table.to_vllm(),
            f"{name}: fitted goodput surface after the drift (v{result.last_envelope.version})",
            out_dir / f"{name}-surface.png")
        lines.append(f"![surface]({path.name})")
    tables = {"vLLM's example table": VLLM_DOC}
    if result.first_envelope is not None:
        tables = {f"fitted before the drift (v{result.first_envelope.version})":
                  result.first_envelope.table.to_vllm(),
                  f"at the end (v{result.last_envelope.version})":
                  result.last_envelope.table.to_vllm(), **tables}
    path = plots.table_steps(tables, result.best_k_by_load, 256,
                             f"{name}: tables vs the best fixed K per load",
                             out_dir / f"{name}-table.png")
    lines.append(f"![table]({path.name})")
    series = {"tabletune": result.live[0]["timeline"]}
    for label in ("stale table (first fit, held)", "vllm-doc"):
        if label in result.baselines:
            series[label] = result.baselines[label]["timeline"]
    best_after = group_numbers(result, phase_s)["phases"][1]["best_fixed"]
    series[f"{best_after} (best after the drift)"] = result.baselines[best_after]["timeline"]
    events = [(phase_s, "drift")]
    events += [(t, f"v{v}") for t, v, _ in result.tables[1:]]
    path = plots.throughput_timeline(series, events, f"{name}: throughput across the drift",
                                     out_dir / f"{name}-timeline.png")
    lines += [f"![timeline]({path.name})", ""]
    return lines


def _recovered(share: float | None) -> str:
    """A recovery in words; n/a when the stale table lost too little for the quotient to mean
    anything (`tabletune.suite.ratios.recovery`)."""
    if share is None:
        return f"n/a (the stale table lost under {100 * MIN_STALE_LOSS:.0f}%)"
    return f"{100 * share:.0f}%"
