"""Does the twin's prompt lookup reproduce the acceptance the traces recorded?

For each SpecDecode-Bench trace, the twin drafts every generated position for real
(`twin.workload.drafted_for_real`: vLLM's prompt lookup on the request's own tokens) and
compares acc_len with the trace's recorded `acc_ngram`, both cut at 21 (the traces drafted at
most 20 tokens). Per lookup setting: the share of positions where the two agree exactly, the
mean of each, and the share of positions where lookup found a match. Needs `../shared`.

    .venv/bin/python -m bench.lookup_agreement [--lookup 3 7 --lookup 5 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.common import emit
from twin.workload import load_trace

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "specdecode-bench"
TRACES = ("sharegpt", "instructcoder", "gsm8k")
RECORDED_CAP = 21
"""The traces drafted at most 20 tokens per position: their acc_len stops at 21."""


def agreement(trace: Path, lookup: tuple[int, int]) -> dict[str, float]:
    started = time.perf_counter()
    drafted = load_trace(trace, "ngram", prompt_lookup=lookup)
    seconds = time.perf_counter() - started
    recorded = load_trace(trace, "ngram")
    if not np.array_equal(drafted.output_len, recorded.output_len):
        raise SystemExit(f"{trace}: acc_ngram and generated_token_ids differ in length")
    ours = np.minimum(drafted.acc_len, RECORDED_CAP)
    theirs = np.minimum(recorded.acc_len, RECORDED_CAP)
    assert drafted.match_len is not None
    return {"positions": int(len(ours)), "agree": float(np.mean(ours == theirs)),
            "mean_acc_len_lookup": float(ours.mean()), "mean_acc_len_recorded": float(theirs.mean()),
            "matched": float(np.mean(drafted.match_len > 0)), "lookup_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lookup", type=int, nargs=2, action="append", metavar=("MIN", "MAX"),
                        help="prompt_lookup_min and _max (repeatable; default 3 7 and 5 5)")
    parser.add_argument("--traces", nargs="+", default=list(TRACES), choices=TRACES)
    parser.add_argument("--out")
    args = parser.parse_args()
    settings = [tuple(pair) for pair in (args.lookup or [(3, 7), (5, 5)])]
    result: dict[str, dict[str, dict[str, float]]] = {}
    for name in args.traces:
        path = DATA / f"{name}.jsonl"
        if not path.is_file():
            raise SystemExit(f"{path} is missing: this benchmark reads ../shared's traces")
        result[name] = {f"{lo}..{hi}": agreement(path, (lo, hi)) for lo, hi in settings}
    emit("lookup_agreement", result, args.out)


if __name__ == "__main__":
    main()
