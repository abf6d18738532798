"""`tabletune bench`: the benchmark suite's sub-command."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tabletune.cli_args import integer
from tabletune.suite.grid import SUITES


def register(commands: Any) -> None:
    bench = commands.add_parser(
        "bench", help="run the policy benchmark suite on the twin and update BENCHMARKS.md",
        description="Every policy (fixed K 0..7, vllm-doc, dsd-goodput, ema-adaptive, "
        "tabletune) on a grid of traces x drafters x loads (closed-loop concurrency and "
        "open-loop rates), scored against the per-load best fixed K, plus the drift "
        "scenarios' stale-loss recovery. Writes DIR/results.json and DIR/results.md, reads "
        "the standalone bench/ scripts' JSON from DIR, and replaces the section between "
        "<!-- suite:begin --> and <!-- suite:end --> in the markdown file (appended if "
        "missing). quick: < 5 minutes on 2 cores; full: < 30 minutes.",
    )
    bench.add_argument("--suite", choices=sorted(SUITES), default="quick")
    bench.add_argument("--out", required=True, help="results folder")
    bench.add_argument("--processes", type=integer(1), default=min(2, os.cpu_count() or 1),
                       help="worker processes (default: 2, or 1 on a 1-core machine)")
    bench.add_argument("--markdown", default="BENCHMARKS.md",
                       help="file whose suite section is regenerated (default BENCHMARKS.md)")
    bench.add_argument("--no-markdown", action="store_true",
                       help="write DIR/results.md only, leave the markdown file alone")
    bench.add_argument("--data", default=None,
                       help="folder of the SpecDecode-Bench traces (default ../shared/data/"
                       "specdecode-bench next to the checkout; missing = parametric)")
    bench.set_defaults(handler=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from tabletune.suite.collect import run_suite
    from tabletune.suite.markers import MarkerError, write_section
    from tabletune.suite.report import markdown
    from tabletune.suite.standalone import read_standalone

    spec = SUITES[args.suite]
    if args.data:
        spec = dataclasses.replace(spec, data_dir=Path(args.data))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = f"tabletune bench --suite {args.suite} --out {args.out}"
    started = time.monotonic()
    last = [0.0]

    def progress(done: int, total: int, result: dict[str, Any]) -> None:
        now = time.monotonic() - started
        if "error" in result:
            print(f"[{now:6.0f}s] {result['kind']} {result['key']} {result['policy']}: "
                  f"{result['error']}", file=sys.stderr, flush=True)
        if done == total or now - last[0] >= 15.0:
            last[0] = now
            print(f"[{now:6.0f}s] {done}/{total} runs", file=sys.stderr, flush=True)

    results = run_suite(spec, out_dir=out, processes=max(1, args.processes), command=command,
                        on_progress=progress)
    results["standalone"] = read_standalone(out)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    section = markdown(results)
    (out / "results.md").write_text(section)
    if not args.no_markdown:
        try:
            write_section(args.markdown, section)
        except MarkerError as exc:
            print(f"error: {args.markdown}: {exc}", file=sys.stderr)
            return 1
    print(json.dumps({"results": str(out / "results.json"), "wall_s": results["wall_s"],
                      "runs_failed": len(results["errors"]),
                      "markdown": None if args.no_markdown else args.markdown}))
    return 0
