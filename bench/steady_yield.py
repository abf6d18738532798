"""How well one re-profile sweep predicts each K's steady yield, on the twin.

    .venv/bin/python bench/steady_yield.py [--seeds 1 2 3] [--cases ngram-code ...] [--out DIR]

A diagnostic, not a gate: it measures the modelling error behind the stale-table recovery
gap. In a closed loop the batch holds the requests that need many steps, and which ones
those are depends on K (at a larger K the well-accepting requests finish sooner, so the
batch keeps fewer of them). A sweep measures every draft position on the batch the stale K
left behind; what each K emits once it has shaped its own batch is something else.

Per case (a scenario, a time in its new phase and the K the stale table ran there):
- truth: the twin at fixed K (1..7) from the phase's start, accepted tokens per decode
  request over the next 140 s;
- the sweep: the stale K until then, then 1 s blocks of K 1..7..1 (14 s); the accepted
  count at each position per decode request is pooled as the fitter's acceptance model
  does;
- "pooled": the chain of those positions, sum of q_1..q_K (what the fitter's acceptance model
  predicts before the composition factor);
- "mixture" (the fitter's `fitter.surface.composition`): requests of per-request rate a
  accept position i with a^i; the arrivals are a mixture over a grid of rates (rate 0 =
  never accepts) fitted by non-negative least squares to the sweep's q_i as seen on a batch
  the stale K kept (type j in proportion to f_j / tau_j(K)), then evaluated on the batch
  each K keeps: 1 / sum_j f_j / tau_j(K) - 1, with tau(a, K) = 1 + a + ... + a^K.
Both are compared with the truth relative to the stale K (the level there is what live
telemetry measures well), and as a pick: the K with the best goodput when the truth's
latency is combined with each prediction, and what that K loses against the best.

Prints JSON; with --out also writes steady_yield.json and steady_yield.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit
from fitter.surface.composition import CompositionModel
from schemas import DraftTable
from twin import BUILTIN_SCENARIOS, build_engine, load_scenario
from twin.engine import StepStats, TwinEngine
from twin.policies import Policy

K_VALUES = tuple(range(1, 8))
TRUTH_S = 140.0
CASES: dict[str, tuple[str, float, int]] = {
    # name: (scenario, start of the measured stretch in virtual s, the stale table's K)
    "ngram-chat": ("chat-code-chat-ngram", 100.0, 3),
    "ngram-code": ("chat-code-chat-ngram", 340.0, 3),
    "ngram-chat-again": ("chat-code-chat-ngram", 640.0, 5),
    "eagle-c64": ("eagle-concurrency-jump", 340.0, 5),
}


class ScriptedK(Policy):
    """Runs K by a schedule of (from virtual second, K), each a one-range table."""

    step_interval = 1

    def __init__(self, schedule: list[tuple[float, int]]) -> None:
        self.schedule = schedule
        self.steps: list[StepStats] = []
        self.name = "scripted"

    def initial_table(self, *, max_k: int, max_batch: int) -> tuple[DraftTable, int]:
        self.max_batch = max_batch
        return DraftTable.from_vllm([[1, max_batch, self.schedule[0][1]]]), 0

    def start(self, engine: TwinEngine) -> None:
        self.current = self.schedule[0][1]

    def on_step(self, engine: TwinEngine, step: StepStats) -> None:
        self.steps.append(step)
        k = [k for since, k in self.schedule if since <= step.t_s][-1]
        if k != self.current:
            self.current = k
            engine.switch.stage(DraftTable.from_vllm([[1, self.max_batch, k]]), 0)


def run(scenario: Any, schedule: list[tuple[float, int]], until_s: float) -> list[StepStats]:
    policy = ScriptedK(schedule)
    engine, _, _ = build_engine(scenario, policy, duration_s=until_s)
    engine.run(policy)
    return policy.steps


def steady(steps: list[StepStats], start_s: float, end_s: float) -> tuple[float, float]:
    """Accepted tokens per decode request, and emitted tokens per second."""
    chosen = [s for s in steps if start_s <= s.t_s < end_s]
    accepted = sum(s.num_accepted_tokens for s in chosen)
    decode = sum(s.num_decode_reqs for s in chosen)
    return accepted / max(decode, 1), sum(s.emitted_tokens for s in chosen) / (end_s - start_s)


def mixture_prediction(per_position: np.ndarray, shaped_k: int) -> dict[int, float]:
    """The fitter's composition model, fitted to the sweep as seen on the stale K's batch."""
    positions = np.arange(1, per_position.size + 1)
    model = CompositionModel().fit(
        np.column_stack([positions, np.full(positions.size, float(shaped_k))]), per_position)
    return dict(zip(K_VALUES, model.predict(K_VALUES).tolist(), strict=True))


def measure(case: str, seed: int) -> dict[str, Any]:
    name, start_s, stale_k = CASES[case]
    scenario = dataclasses.replace(load_scenario(BUILTIN_SCENARIOS / f"{name}.toml"), seed=seed)
    truth = {k: steady(run(scenario, [(0.0, k)], start_s + TRUTH_S), start_s, start_s + TRUTH_S)
             for k in K_VALUES}
    sweep = [*K_VALUES, *K_VALUES[::-1]]
    schedule = [(0.0, stale_k), *((start_s + i, k) for i, k in enumerate(sweep)),
                (start_s + len(sweep), stale_k)]
    steps = run(scenario, schedule, start_s + len(sweep) + 2)
    accepted = np.zeros(len(K_VALUES))
    decode = np.zeros(len(K_VALUES))
    for s in steps:
        if start_s + 0.3 <= s.t_s < start_s + len(sweep):
            for i in range(min(len(s.accepted_per_pos), s.k, len(K_VALUES))):
                accepted[i] += s.accepted_per_pos[i]
                decode[i] += s.num_decode_reqs
    per_position = accepted / np.maximum(decode, 1.0)
    predictions = {
        "pooled": {k: float(per_position[:k].sum()) for k in K_VALUES},
        "mixture": mixture_prediction(per_position, stale_k),
    }
    best_rate = max(rate for _, rate in truth.values())
    result: dict[str, Any] = {
        "case": case, "seed": seed, "stale_k": stale_k,
        "best_k": max(K_VALUES, key=lambda k: truth[k][1]),
        "truth_vs_stale_k": {k: round(truth[k][0] / truth[stale_k][0], 4) for k in K_VALUES},
    }
    for label, predicted in predictions.items():
        ratio = {k: predicted[k] / predicted[stale_k] for k in K_VALUES}
        # goodput at K: the truth's rate with its accepted tokens replaced by the prediction,
        # the prediction scaled to the truth at the stale K
        level = truth[stale_k][0] / predicted[stale_k]
        goodput = {k: truth[k][1] * (1.0 + level * predicted[k]) / (1.0 + truth[k][0])
                   for k in K_VALUES}
        pick = max(goodput, key=goodput.get)
        result[label] = {
            "vs_stale_k": {k: round(ratio[k], 4) for k in K_VALUES},
            "max_abs_error": round(max(abs(ratio[k] - truth[k][0] / truth[stale_k][0])
                                       for k in K_VALUES), 4),
            "pick": pick,
            "pick_loss": round(1.0 - truth[pick][1] / best_rate, 4),
        }
    return result


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | seed | stale K | best K | pooled: max error, pick (loss) |"
             " mixture: max error, pick (loss) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = [f"{r[m]['max_abs_error']:.3f}, K{r[m]['pick']} ({100 * r[m]['pick_loss']:.2f}%)"
                 for m in ("pooled", "mixture")]
        lines.append(f"| {r['case']} | {r['seed']} | K{r['stale_k']} | K{r['best_k']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--out", help="folder for steady_yield.json and steady_yield.md")
    args = parser.parse_args(argv)
    rows = [measure(case, seed) for case in args.cases for seed in args.seeds]
    summary = {
        label: {
            "mean_max_abs_error": round(float(np.mean([r[label]["max_abs_error"] for r in rows])),
                                        4),
            "mean_pick_loss": round(float(np.mean([r[label]["pick_loss"] for r in rows])), 4),
        }
        for label in ("pooled", "mixture")
    }
    emit("steady_yield", {"rows": rows, "summary": summary}, args.out)
    if args.out:
        (Path(args.out) / "steady_yield.md").write_text(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
