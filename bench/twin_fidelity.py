"""Twin fidelity: does the twin, calibrated on a real run's telemetry, serve as that run did?

    .venv/bin/python -m bench.twin_fidelity --run OUT [--out DIR] [--seeds N]

OUT is a finished `bench.real_serving` folder: OUT/real_serving.json (vLLM's client results
and the telemetry scores per arm and phase) and OUT/parquet (the step records). The twin is
calibrated (`twin.calibrate`, the code of `tabletune twin calibrate`) on the
records of the `fixed:K` arms only, the profile written to DIR/twin_profile.toml and read
back from there. Then, for every phase of the run and every fixed K the run has, the twin
serves that phase as vLLM's client did: an engine of the run's `max_num_seqs` and `max_k`
(16 and 4) and vLLM's default 2048 batched tokens, empty at the phase start; Poisson
arrivals at the phase's rate held at the client while `concurrency` requests are in flight
(`--request-rate`, `--max-concurrency`); prompt and output lengths uniform within ±25 % of
the phase's (`--random-range-ratio 0.25`); the acceptance measured in that phase (fixed-arm
records inside the phase's windows; the whole profile's where none drafted there). Its
score is the tokens/s of the steps that end in the real arm's measured window (the same
lead-in and length; the real score counts a step by its record's time, its end), the mean over `--seeds` seeds (their spread says how much one
window of that length varies: the real score is one window).

The real score is the run's own (`bench/serving_summary.py`): output tokens/s from the step
telemetry over each phase's measured window (after its lead-in, before its drain), the
median over repeats; vLLM's client `output_throughput` where a phase has no measured
window (marked). Nothing is fitted to throughput: the twin sees only the step latencies and
the acceptance of the records, and the client's phase settings.

Per (phase, K) the result also takes the ratio apart, to say why when the twin is off:
tokens per step (acceptance and batch), seconds per step (the cost model at the twin's own
batches), and the calibrated cost model priced on the real window's own steps against
their measured time (the cost model alone). Arms or phases missing from the run are
skipped and listed. Writes DIR/twin_fidelity.json (also printed), DIR/twin_fidelity.md and
DIR/twin_profile.toml; DIR defaults to OUT/twin-fidelity.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from bench.common import emit
from fitter.dataset import read_dataset
from twin import (
    DrafterConfig,
    EngineConfig,
    PhaseConfig,
    Scenario,
    build_engine,
    load_scenario,
)
from twin.calibrate import calibrate, measure_acceptance, predict_step_s
from twin.calibration import CalibrationError, profile_toml

TOLERANCE = 0.10
"""The criterion: twin throughput within 10 % of the real engine's."""
MAX_NUM_BATCHED_TOKENS = 2048
"""vLLM's default for the API server (bench.real_serving does not set it; its server log
says 2048)."""
LENGTH_RANGE = 0.25
"""`--random-range-ratio` of bench/serving_plan.py's client."""


def load_run(run: Path) -> dict[str, Any]:
    path = run / "real_serving.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"error: {path} does not exist (a bench.real_serving --out "
                         "folder?)") from None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"error: {path} is not JSON: {exc}") from None


def fixed_arms(result: dict[str, Any], skipped: list[str]) -> dict[int, dict[str, Any]]:
    """{K: arm entry} for the run's fixed:K arms."""
    arms: dict[int, dict[str, Any]] = {}
    for name, entry in sorted(result.get("arms", {}).items()):
        if not name.startswith("fixed:"):
            continue
        if not entry.get("repeats"):
            skipped.append(f"{name}: no repeat in real_serving.json")
            continue
        arms[int(name.split(":", 1)[1])] = entry
    planned = [a for a in result.get("setup", {}).get("arms", []) if a.startswith("fixed:")]
    for name in planned:
        if int(name.split(":", 1)[1]) not in arms:
            skipped.append(f"{name}: planned but not in the results (failed or not run)")
    return arms


def real_score(entry: dict[str, Any], phase: str) -> tuple[float | None, str]:
    score = entry.get("score", {}).get(phase, {})
    measured = (score.get("measured_tok_s") or {}).get("median")
    if measured is not None:
        return float(measured), "measured window (telemetry)"
    client = (entry.get("phases", {}).get(phase) or {}).get("output_throughput")
    if client is not None:
        return float(client), "vLLM client output_throughput (no measured window)"
    return None, "none"


def windows(entry: dict[str, Any], phase: str) -> list[dict[str, float]]:
    """Per repeat: the phase's start and end and its measured window (epoch seconds)."""
    out = []
    for repeat in entry["repeats"]:
        times = next((p for p in repeat.get("phase_times", []) if p["name"] == phase), None)
        measured = (repeat.get("telemetry", {}).get(phase) or {}).get("measured")
        if times is None or not measured or not measured.get("seconds"):
            continue
        out.append({"engine_id": repeat["engine_id"], "started": times["started"],
                    "ended": times["ended"], "start": measured["start_s"],
                    "seconds": measured["seconds"], "steps": measured["steps"],
                    "tokens": measured["tokens"], "mean_batch": measured["mean_batch"]})
    return out


def inside(records: pl.DataFrame, engine_id: str, start: float, end: float) -> pl.DataFrame:
    ts = pl.col("ts_ns") / 1e9
    return records.filter((pl.col("engine_id") == engine_id) & (ts >= start) & (ts < end))


def twin_phase(spec: dict[str, Any], *, lead_s: float, measure_s: float,
               acceptance: tuple[float, ...], engine: EngineConfig, cost: Any,
               drafter: DrafterConfig, k: int, seed: int, by_end: bool = True
               ) -> dict[str, float]:
    """The twin's tokens/s, tokens per step, s per step and mean batch over the window:
    the steps that end in it, as the real score counts steps by their record's time (vLLM
    stamps a record when the step's output comes back; `by_end=False`: that start, as the
    twin stamps its own records). One step can last seconds (a wave of prompts on a CPU), so
    which end of a step counts matters in a short window."""
    phase = PhaseConfig(name=spec["name"], duration_s=lead_s + measure_s,
                        rate_rps=float(spec["rate_rps"]),
                        max_concurrency=int(spec["concurrency"]),
                        acceptance=acceptance or (0.0,), prompt_len=float(spec["input_len"]),
                        output_len=float(spec["output_len"]), length_range=LENGTH_RANGE)
    scenario = Scenario(seed=seed, engine=engine, cost=cost, drafter=drafter, phases=(phase,),
                        name=f"fidelity-{spec['name']}")
    twin, _, policy = build_engine(scenario, f"fixed:{k}")
    log = twin.run(policy)
    end = np.asarray(log.step_start_s) + (np.asarray(log.step_latency_s) if by_end else 0.0)
    chosen = (end >= lead_s) & (end < lead_s + measure_s)
    steps = max(1, int(chosen.sum()))
    tokens = float(np.asarray(log.emitted)[chosen].sum())
    batch = np.asarray(log.batch_size)[chosen]
    return {"tok_s": tokens / measure_s, "tokens_per_step": tokens / steps,
            "s_per_step": measure_s / steps,
            "mean_batch": float(batch.mean()) if batch.size else 0.0}


def run(args: argparse.Namespace) -> dict[str, Any]:
    run_dir = Path(args.run)
    out = Path(args.out) if args.out else run_dir / "twin-fidelity"
    out.mkdir(parents=True, exist_ok=True)
    result = load_run(run_dir)
    setup = result.get("setup", {})
    skipped: list[str] = []
    arms = fixed_arms(result, skipped)
    if not arms:
        raise SystemExit(f"error: {run_dir} has no fixed:K arm with results: nothing to "
                         "calibrate on or compare with")
    try:
        records = read_dataset(run_dir / "parquet")
    except FileNotFoundError as exc:
        raise SystemExit(f"error: {exc}") from None
    engines = {k: [r["engine_id"] for r in entry["repeats"]] for k, entry in arms.items()}
    present = set(records["engine_id"].unique().to_list())
    for k, ids in list(engines.items()):
        if not any(i in present for i in ids):
            skipped.append(f"fixed:{k}: no step records in the Parquet (engines {ids})")
            del arms[k]
    if not arms:
        raise SystemExit(f"error: no step records of a fixed:K arm under {run_dir}/parquet")
    fixed_records = records.filter(pl.col("engine_id").is_in(
        [i for k in arms for i in engines[k]]))
    try:
        calibration = calibrate(fixed_records, source=args.records_from)
    except CalibrationError as exc:
        raise SystemExit(f"error: {exc}") from None
    profile_path = out / "twin_profile.toml"
    profile_path.write_text(profile_toml(calibration, source=str(run_dir / "parquet")))
    profile = load_scenario(profile_path)  # what a user of the CLI's file gets

    max_num_seqs = int(setup.get("max_num_seqs", 16))
    max_k = int(setup.get("max_k", 4))
    engine = EngineConfig(max_num_seqs=max_num_seqs, max_k=max_k,
                          max_num_batched_tokens=max(MAX_NUM_BATCHED_TOKENS,
                                                     max_num_seqs * (max_k + 1)),
                          engine_id="twin-fidelity", model=profile.engine.model,
                          hardware=profile.engine.hardware)
    phases = setup.get("phases") or []
    if not phases:
        raise SystemExit("error: real_serving.json has no setup.phases")
    rows: list[dict[str, Any]] = []
    best: dict[str, Any] = {}
    phase_acceptance: dict[str, Any] = {}
    for spec in phases:
        name = spec["name"]
        # acceptance measured in this phase, from the arms that drafted
        in_phase = [inside(records, w["engine_id"], w["started"], w["ended"])
                    for k, entry in arms.items() if k > 0 for w in windows(entry, name)]
        phase_records = pl.concat(in_phase) if in_phase else records.head(0)
        rates, match_prob, acc_notes = measure_acceptance(phase_records, calibration.method)
        source = "this phase's records"
        if not rates:
            rates, match_prob, source = (calibration.acceptance,
                                         calibration.ngram_match_prob, "whole profile")
        drafter = DrafterConfig(method=calibration.method, ngram_match_prob=match_prob)
        phase_acceptance[name] = {"acceptance": list(rates), "ngram_match_prob": match_prob,
                                  "source": source, "notes": acc_notes}
        for k, entry in sorted(arms.items()):
            real, score_source = real_score(entry, name)
            spans = windows(entry, name)
            if real is None or not spans:
                skipped.append(f"fixed:{k} in phase {name}: no score or no measured window")
                continue
            lead_s = statistics.median(w["start"] - w["started"] for w in spans)
            measure_s = statistics.median(w["seconds"] for w in spans)
            twins = [twin_phase(spec, lead_s=lead_s, measure_s=measure_s, acceptance=rates,
                                engine=engine, cost=profile.cost, drafter=drafter, k=k,
                                seed=int(spec.get("seed", 1)) * 1000 + s,
                                by_end=args.records_from == "vllm")
                     for s in range(args.seeds)]
            twin_tok_s = float(np.mean([t["tok_s"] for t in twins]))
            real_steps = sum(w["steps"] for w in spans)
            real_seconds = sum(w["seconds"] for w in spans)
            priced = [inside(records, w["engine_id"], w["start"], w["start"] + w["seconds"])
                      for w in spans]
            window_records = pl.concat(priced)
            model_s = float(predict_step_s(calibration, window_records,
                                           source=args.records_from).sum()) \
                if window_records.height else float("nan")
            busy_s = busy_time(window_records, calibration.cost["step_overhead"],
                               args.records_from)
            ratio = twin_tok_s / real if real > 0 else float("nan")
            row = {
                "phase": name, "k": k, "real_tok_s": round(real, 2),
                "real_score": score_source,
                "twin_tok_s": round(twin_tok_s, 2),
                "twin_tok_s_range": [round(min(t["tok_s"] for t in twins), 2),
                                     round(max(t["tok_s"] for t in twins), 2)],
                "twin_tok_s_sd": round(float(np.std([t["tok_s"] for t in twins])), 2),
                "ratio": round(ratio, 3),
                "within_10pct": bool(abs(ratio - 1.0) <= TOLERANCE),
                "real_tokens_per_step": round(sum(w["tokens"] for w in spans)
                                              / max(1, real_steps), 3),
                "twin_tokens_per_step": round(float(np.mean(
                    [t["tokens_per_step"] for t in twins])), 3),
                "real_s_per_step": round(real_seconds / max(1, real_steps), 4),
                "twin_s_per_step": round(float(np.mean([t["s_per_step"] for t in twins])), 4),
                "real_mean_batch": round(float(np.mean([w["mean_batch"] for w in spans])), 2),
                "twin_mean_batch": round(float(np.mean([t["mean_batch"] for t in twins])), 2),
                "cost_model_on_real_steps": round(model_s / busy_s, 3)
                if busy_s > 0 else None,
                "real_idle_share": round(max(0.0, 1.0 - busy_s / real_seconds), 3)
                if real_seconds > 0 else None,
                "lead_s": round(lead_s, 2), "measure_s": round(measure_s, 2),
                "real_steps": real_steps,
            }
            row["why"] = why(row)
            rows.append(row)
        mine = [r for r in rows if r["phase"] == name]
        if mine:
            real_best = max(mine, key=lambda r: r["real_tok_s"])["k"]
            twin_best = max(mine, key=lambda r: r["twin_tok_s"])["k"]
            best[name] = {"real_best_k": real_best, "twin_best_k": twin_best,
                          "match": real_best == twin_best,
                          "ks_compared": [r["k"] for r in mine]}
    within = [r["within_10pct"] for r in rows]
    matches = [b["match"] for b in best.values()]
    return {
        "run": str(run_dir), "out": str(out), "profile": str(profile_path),
        "real_setup": {"model": setup.get("model"), "drafter": setup.get("drafter"),
                       "max_num_seqs": max_num_seqs, "max_k": max_k, "phases": phases,
                       "arms_compared": [f"fixed:{k}" for k in sorted(arms)]},
        "calibration": calibration.to_dict(),
        "phase_acceptance": phase_acceptance,
        "twin": {"seeds": args.seeds, "max_num_batched_tokens": engine.max_num_batched_tokens,
                 "length_range": LENGTH_RANGE},
        "rows": rows, "best_k": best, "skipped": skipped,
        "criterion": {
            "throughput_within_10pct": f"{sum(within)}/{len(within)}",
            "best_k_matches": f"{sum(matches)}/{len(matches)}",
            "met": bool(within) and all(within) and bool(matches) and all(matches)
                   and not skipped,
        },
    }


def busy_time(records: pl.DataFrame, step_overhead_s: float, source: str) -> float:
    """The engine's busy time over `records`: vLLM's, each step's whole cycle
    (`inter_step_s`, update to update) except before a step without decodes, whose gap is
    an idle engine's wait for a request (its step and the calibrated overhead count); the
    twin's, its steps' latencies."""
    if not records.height:
        return 0.0
    if source == "twin":
        return float(records["step_latency_s"].sum())
    decoding = pl.col("num_decode_reqs") > 0
    cycles = records.select(pl.when(decoding).then(pl.col("inter_step_s"))
                            .otherwise(pl.col("step_latency_s") + step_overhead_s).sum())
    return float(cycles.item())


def why(row: dict[str, Any]) -> str:
    """Where a ratio comes from: tokens per step (acceptance, batch) and seconds per step
    (the cost model), with the cost model on the real window's own steps."""
    if row["within_10pct"]:
        return ""
    parts = []
    tps = row["twin_tokens_per_step"] / row["real_tokens_per_step"] \
        if row["real_tokens_per_step"] else float("nan")
    sps = row["real_s_per_step"] / row["twin_s_per_step"] if row["twin_s_per_step"] else 0.0
    if abs(tps - 1) > 0.05:
        parts.append(f"tokens/step x{tps:.2f} (batch {row['twin_mean_batch']:g} vs "
                     f"{row['real_mean_batch']:g})")
    if abs(sps - 1) > 0.05:
        parts.append(f"steps x{sps:.2f} as fast")
    model = row["cost_model_on_real_steps"]
    if model is not None and abs(model - 1) > 0.05:
        parts.append(f"cost model prices the real steps at {model:.2f}x their busy time")
    if row["real_idle_share"] and row["real_idle_share"] > 0.05:
        parts.append(f"real engine idle {row['real_idle_share']:.0%} of the window")
    spread = row["twin_tok_s_sd"] / row["twin_tok_s"] if row["twin_tok_s"] else 0.0
    if spread > 0.05:
        parts.append(f"one window varies ±{spread:.0%} (sd over twin seeds), and the real "
                     "score is one window")
    return "; ".join(parts) or "no single cause over 5 %"


def write_markdown(result: dict[str, Any], path: Path) -> None:
    cal = result["calibration"]
    fit = cal["fit"]
    lines = [
        "# Twin fidelity",
        "",
        f"Run: `{result['run']}` ({result['real_setup']['model']}; drafter "
        f"{result['real_setup']['drafter']}). Twin calibrated on the fixed:K arms' "
        f"{cal['records']} step records (`{result['profile']}`): step latency R² "
        f"{fit['r2']}, fitted/measured total {fit['fitted_total_ratio']}, step overhead "
        f"{fit['mean_step_overhead_s'] * 1e3:.2f} ms; {result['twin']['seeds']} twin seeds "
        "per cell.",
        "",
        "Real: output tokens/s over the phase's measured window from the step telemetry "
        "(bench/serving_summary.py's score). Twin: the same window of the same phase "
        "(Poisson arrivals capped at the concurrency, lengths ±25 %), calibrated cost model "
        "and acceptance; nothing fitted to throughput. `model/real` = the cost model priced "
        "on the real window's own steps over their measured busy time (a step's cycle, "
        "less the waits of an idle engine: `real idle`).",
        "",
        "| phase | K | real tok/s | twin tok/s (seeds' range) | twin/real | ≤10 % | "
        "tok/step real / twin | s/step real / twin | batch real / twin | model/real | "
        "real idle | why |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in result["rows"]:
        low, high = r["twin_tok_s_range"]
        lines.append(
            f"| {r['phase']} | {r['k']} | {r['real_tok_s']:.1f}"
            f"{'' if r['real_score'].startswith('measured') else ' (client)'} | "
            f"{r['twin_tok_s']:.1f} ({low:.1f}–{high:.1f}) | {r['ratio']:.3f} | "
            f"{'yes' if r['within_10pct'] else '**no**'} | "
            f"{r['real_tokens_per_step']:.2f} / {r['twin_tokens_per_step']:.2f} | "
            f"{r['real_s_per_step']:.4f} / {r['twin_s_per_step']:.4f} | "
            f"{r['real_mean_batch']:.2f} / {r['twin_mean_batch']:.2f} | "
            f"{r['cost_model_on_real_steps']} | {r['real_idle_share']:.0%} | {r['why']} |")
    lines += ["", "| phase | real best K | twin best K | match | K compared |",
              "| --- | ---: | ---: | --- | --- |"]
    for phase, b in result["best_k"].items():
        lines.append(f"| {phase} | {b['real_best_k']} | {b['twin_best_k']} | "
                     f"{'yes' if b['match'] else '**no**'} | {b['ks_compared']} |")
    crit = result["criterion"]
    lines += ["", f"Within 10 %: {crit['throughput_within_10pct']}; best K matches: "
              f"{crit['best_k_matches']}; criterion met: {'yes' if crit['met'] else 'no'}.",
              ""]
    lines.append("Acceptance per phase (conditional per position; n-gram: position 0 per "
                 "decode):")
    for phase, a in result["phase_acceptance"].items():
        match = (f", ngram_match_prob {a['ngram_match_prob']:.3f}"
                 if cal["method"] == "ngram" else "")
        lines.append(f"- {phase}: {a['acceptance']}{match} ({a['source']})")
    if cal["notes"]:
        lines += ["", "Calibration notes:"] + [f"- {n}" for n in cal["notes"]]
    if result["skipped"]:
        lines += ["", "Skipped:"] + [f"- {s}" for s in result["skipped"]]
    path.write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True,
                        help="a bench.real_serving --out folder (real_serving.json, parquet/)")
    parser.add_argument("--out", default=None,
                        help="twin_fidelity.json/.md and twin_profile.toml (default "
                             "RUN/twin-fidelity)")
    parser.add_argument("--seeds", type=int, default=20,
                        help="twin runs per (phase, K), averaged (default 20)")
    parser.add_argument("--records-from", choices=("vllm", "twin"), default="vllm",
                        help="twin: a folder made from twin runs, as a self-check "
                             "(`twin calibrate --records-from`)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    out = Path(result["out"])
    emit("twin_fidelity", result, str(out))
    write_markdown(result, out / "twin_fidelity.md")
    print(f"wrote {out / 'twin_fidelity.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
