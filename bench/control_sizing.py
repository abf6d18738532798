"""What one `tabletune control` process serves: its CPU, its fits and its lag behind the
telemetry, at a known record rate.

    .venv/bin/python -m bench.control_sizing [--keys 4] [--engines-per-key 4]
        [--speedup 10] [--duration-s 300] [--idle-s 60] [--out DIR]

An embedded broker, `tabletune control` as its own process (the command an operator runs),
and one twin fleet per key (keys by hardware name), paced `speedup` times faster than real
time: each twin engine writes the telemetry of `speedup` real engines' worth of steps per
wall second. Each key's load jumps from 16 to 64 users halfway, so the service profiles,
refits, detects the drift and re-profiles, as it would in service.

While the fleets run, the bench reads the service's decisions file every `WATCH_S`. A
decision's lag is how far the service's clock (the newest step of its key it had read)
trailed the engines' clock when the decision appeared in the file, in wall seconds. At the
end: records per wall second, the service's CPU seconds per wall second (its share of one
core), fits (every `refit` and `fit_failed` decision is one fit of the fitter), and the lag.

`--keys 0` runs no fleet: the service waits with nothing to serve for `--idle-s` wall
seconds after it is ready, and its CPU share is read from /proc over that span alone (its
start-up, imports included, left out): what its reader and its group membership cost.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import emit
from controller.fleet.decisions import What
from schemas.settings import Settings
from tabletune.broker import EmbeddedBroker
from tabletune.control_process import ControlProcess
from tabletune.twin_fleet import Fleet, FleetConfig
from twin.config import DrafterConfig, EngineConfig, PhaseConfig, Scenario

EAGLE = (0.69, 0.66, 0.69, 0.73, 0.76, 0.78, 0.80)
"""EAGLE's per-position acceptance on ShareGPT (the twin's calibration)."""
WATCH_S = 0.1
"""How often the decisions file is read: the lag's resolution, in wall seconds."""
FITS = (What.REFIT, What.FIT_FAILED)


def key_scenario(index: int, duration_s: float) -> Scenario:
    """Key `index`: 16 users, then 64, on an H100-priced twin engine of its own hardware."""
    hardware = f"sizing-h100-{index}"
    phases = tuple(PhaseConfig(name=f"c{users}", duration_s=duration_s / 2, concurrency=users,
                               acceptance=EAGLE, prompt_len=355, output_len=300)
                   for users in (16, 64))
    return Scenario(seed=100 + index, drafter=DrafterConfig(method="eagle"),
                    engine=EngineConfig(max_num_seqs=256, hardware=hardware,
                                        engine_id=f"sizing-{index}"),
                    phases=phases)


def measure_idle(idle_s: float) -> dict[str, Any]:
    """The service with no key, from ready on for `idle_s`: its own CPU share of a core."""
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as work:
        with ControlProcess({"TABLETUNE_BOOTSTRAP": broker.bootstrap}, Path(work)) as control:
            assert control.pid is not None
            before, started = _cpu_s(control.pid), time.monotonic()
            time.sleep(idle_s)
            if control.exited():
                raise SystemExit(f"tabletune control exited while idle:\n"
                                 f"{control.log_path.read_text()}")
            cpu_s, wall_s = _cpu_s(control.pid) - before, time.monotonic() - started
    return {"keys": 0, "idle_s": round(wall_s, 1), "control_cpu_s": round(cpu_s, 2),
            "control_core_share": round(cpu_s / wall_s, 4)}


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of process `pid`, every thread (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(keys: int, engines_per_key: int, speedup: float, duration_s: float
            ) -> dict[str, Any]:
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as work:
        env = {"TABLETUNE_BOOTSTRAP": broker.bootstrap}
        settings = Settings.from_env(env)
        with ControlProcess(env, Path(work)) as control:
            fleets = {f"sizing-h100-{i}": Fleet(key_scenario(i, duration_s), settings,
                                                FleetConfig(engines=engines_per_key,
                                                            speedup=speedup))
                      for i in range(keys)}
            started = time.monotonic()
            for fleet in fleets.values():
                fleet.start()
            lags = _watch_lag(control, fleets, speedup)
            results = [fleet.join() for fleet in fleets.values()]
            wall_s = time.monotonic() - started
        summary = control.summary()
        decisions = control.decisions()
    steps = sum(engine["steps"] for result in results for engine in result["engines"].values())
    fits = [d for d in decisions if d.what in FITS]
    lag = sorted(lags)
    return {
        "keys": keys, "engines_per_key": engines_per_key, "speedup": speedup,
        "duration_s": duration_s, "fleet_wall_s": round(wall_s, 1),
        "records_written": steps, "records_read": summary["records"],
        "records_per_s": round(steps / wall_s, 1),
        "control_cpu_s": summary["cpu_s"], "control_wall_s": summary["wall_s"],
        "control_core_share": round(summary["cpu_s"] / summary["wall_s"], 3),
        "cpu_us_per_record": round(1e6 * summary["cpu_s"] / max(1, summary["records"]), 1),
        "fits": len(fits), "fits_per_s": round(len(fits) / wall_s, 3),
        "decisions": len(decisions),
        "lag_s": {"decisions": len(lag),
                  "median": round(statistics.median(lag), 2) if lag else None,
                  "p90": round(lag[int(0.9 * (len(lag) - 1))], 2) if lag else None,
                  "max": round(lag[-1], 2) if lag else None},
        "keys_state": {key: state["state"] for key, state in summary["keys"].items()},
    }


def _watch_lag(control: ControlProcess, fleets: dict[str, Fleet], speedup: float
               ) -> list[float]:
    """Each decision's lag in wall seconds, read as it appears, until the fleets end."""
    seen = 0
    lags = []
    while any(fleet.running for fleet in fleets.values()):
        decisions = control.decisions()
        for decision in decisions[seen:]:
            fleet = next(f for hw, f in fleets.items() if decision.key.endswith(f"|{hw}"))
            engines_clock_s = fleet.epoch_s + fleet.clock_s
            lags.append(max(0.0, engines_clock_s - decision.t_s) / speedup)
        seen = len(decisions)
        time.sleep(WATCH_S)
    return lags


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| keys × engines | records/s | control CPU (share of a core) | CPU µs per record "
             "| fits | fits/s | lag, median / p90 / max (s) | records read / written |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if row["keys"] == 0:
            lines.append(f"| idle, {row['idle_s']:.0f} s from ready | 0 | {row['control_core_share']:.3f} "
                         "| — | 0 | 0 | — | — |")
            continue
        lag = row["lag_s"]
        lines.append(
            f"| {row['keys']} × {row['engines_per_key']} | {row['records_per_s']:,.0f} | "
            f"{row['control_core_share']:.2f} | {row['cpu_us_per_record']} | {row['fits']} | "
            f"{row['fits_per_s']} | {lag['median']} / {lag['p90']} / {lag['max']} | "
            f"{row['records_read']:,} / {row['records_written']:,} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, nargs="+", default=[4],
                        help="keys per run (one run per value; 0: the service idle, no fleet)")
    parser.add_argument("--engines-per-key", type=int, default=4)
    parser.add_argument("--speedup", type=float, default=10.0)
    parser.add_argument("--duration-s", type=float, default=300.0,
                        help="virtual seconds per key: 16 users for half, then 64")
    parser.add_argument("--idle-s", type=float, default=60.0,
                        help="wall seconds of the idle run (--keys 0)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if any(keys < 0 for keys in args.keys):
        parser.error("--keys must be >= 0")
    if not math.isfinite(args.idle_s) or args.idle_s <= 0:
        parser.error(f"--idle-s {args.idle_s} must be a finite number > 0")
    rows = []
    for keys in args.keys:
        rows.append(measure_idle(args.idle_s) if keys == 0 else
                    measure(keys, args.engines_per_key, args.speedup, args.duration_s))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    emit("control_sizing", {"runs": rows}, args.out)
    if args.out:
        Path(args.out, "control_sizing.md").write_text(markdown(rows))


if __name__ == "__main__":
    main()
