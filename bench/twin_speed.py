"""How fast the twin simulates: steps per second of wall time, on one core.

    .venv/bin/python bench/twin_speed.py [--steps 20000] [--policy fixed:3] [--trace FILE] [--out DIR]
    .venv/bin/python bench/twin_speed.py --process [--runs 5] [--scenario FILE] [--out DIR]

Prints JSON: per concurrency (1, 64, 256), steps/s without telemetry ("recorder": false) and
with every step going through the StepRecorder to a sink that discards ("recorder": true).
The process is pinned to one CPU so the recorder's background thread competes with the
engine the way it would on a loaded host. Setup (trace loading, pools) is not timed.

`--process` times the whole command instead, start-up included (target:
>= 20,000 steps/s): `tabletune twin run --scenario bench/twin_speed_eagle64.toml
--policy fixed:3 --sink null:// --json` (600 s virtual, 64 users, EAGLE), `--runs` times
in a row; per run the wall time, the child's user + sys CPU time and steps / wall, then
their medians. Not pinned (the command is what a user runs); PYTHONPATH is passed on, so
another checkout can be timed with the same interpreter. Bytecode is cached as Python does
by default, in a fresh PYTHONPYCACHEPREFIX folder, and one untimed run writes it first: a
user's every run after the first (PYTHONDONTWRITEBYTECODE, set on some CI machines, would
have every run compile the project's sources again, +0.1 s).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit
from producers.sinks import NullSink
from twin import EngineConfig, PhaseConfig, Scenario, build_engine
from twin.cost import CostModel

SHAREGPT_EAGLE = (0.69, 0.66, 0.69, 0.73, 0.76, 0.78, 0.80)
SPEED_SCENARIO = Path(__file__).with_name("twin_speed_eagle64.toml")


def scenario_for(concurrency: int, steps: int, trace: str | None) -> Scenario:
    """Long enough in virtual time for about `steps` steps at this concurrency."""
    cost = CostModel.from_config(Scenario(phases=(_phase(1, 1.0, None),)).cost, "eagle")
    step_s = cost.step_s(concurrency * 1100, concurrency * 4, 3)
    return Scenario(seed=1, engine=EngineConfig(max_num_seqs=256),
                    phases=(_phase(concurrency, steps * step_s, trace),))


def _phase(concurrency: int, duration_s: float, trace: str | None) -> PhaseConfig:
    return PhaseConfig(duration_s=duration_s, concurrency=concurrency, trace=trace,
                       acceptance=SHAREGPT_EAGLE, prompt_len=355, output_len=728)


def measure(concurrency: int, *, recorder: bool, steps: int, policy: str,
            trace: str | None) -> dict[str, object]:
    engine, rec, chosen = build_engine(scenario_for(concurrency, steps, trace), policy,
                                       sink=NullSink() if recorder else None)
    start = time.perf_counter()
    engine.run(chosen)
    if rec is not None:
        rec.close()
    wall = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "recorder": recorder,
        "steps": engine.steps,
        "mean_batch_size": float(np.mean(engine.log.batch_size)),
        "wall_s": round(wall, 4),
        "steps_per_s": round(engine.steps / wall, 1),
        "records_dropped": rec.counters()["records_dropped"] if rec is not None else None,
    }


def measure_process(scenario: str, *, policy: str, sink: str, runs: int) -> dict[str, object]:
    """`tabletune twin run` as a user runs it, `runs` times: wall, CPU (user + sys), steps/s."""
    command = [str(Path(sys.executable).with_name("tabletune")), "twin", "run",
               "--scenario", scenario, "--policy", policy, "--sink", sink, "--json"]
    with tempfile.TemporaryDirectory(prefix="twin-speed-pycache-") as pycache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = pycache
        subprocess.run(command, check=True, capture_output=True, env=env)  # writes bytecode
        rows = [_timed(command, env) for _ in range(runs)]
    wall = statistics.median(r["wall_s"] for r in rows)
    return {
        "command": " ".join(command),
        "runs": rows,
        "median_wall_s": wall,
        "median_cpu_s": statistics.median(r["cpu_s"] for r in rows),
        "steps": rows[0]["steps"],
        "steps_per_s": round(rows[0]["steps"] / wall, 1),
        "steps_per_cpu_s": round(rows[0]["steps"] / statistics.median(r["cpu_s"] for r in rows), 1),
    }


def _timed(command: list[str], env: dict[str, str]) -> dict[str, float]:
    """One run of `command`: its wall time, its user + sys CPU time and steps / wall."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    steps = int(json.loads(done.stdout)["steps"])
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "steps": steps,
            "steps_per_s": round(steps / wall, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000, help="about this many per run")
    parser.add_argument("--policy", default="fixed:3")
    parser.add_argument("--trace", default=None, help="SpecDecode-Bench JSONL (default: "
                        "a parametric ShareGPT/EAGLE profile)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--no-pin", action="store_true", help="do not pin to one CPU")
    parser.add_argument("--out", default=None, help="also write twin_speed.json here")
    parser.add_argument("--process", action="store_true",
                        help="time the whole `tabletune twin run` command instead")
    parser.add_argument("--scenario", default=str(SPEED_SCENARIO), help="with --process")
    parser.add_argument("--sink", default="null://", help="with --process")
    parser.add_argument("--runs", type=int, default=5, help="with --process")
    args = parser.parse_args()
    if args.process:
        result = measure_process(args.scenario, policy=args.policy, sink=args.sink,
                                 runs=args.runs)
        emit("twin_speed_process", {"numpy": np.__version__, "policy": args.policy, **result},
             args.out)
        return 0
    pinned = None
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        pinned = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {pinned})
    results = [measure(c, recorder=r, steps=args.steps, policy=args.policy, trace=args.trace)
               for c in args.concurrency for r in (False, True)]
    emit("twin_speed", {
        "numpy": np.__version__,
        "pinned_cpu": pinned,
        "policy": args.policy,
        "workload": args.trace or "parametric sharegpt/eagle",
        "results": results,
    }, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
