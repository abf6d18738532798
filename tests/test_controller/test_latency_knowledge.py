"""The loop's latency knowledge: a load that returns needs no re-profile, and the knowledge
goes only when the step times themselves moved."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from controller.fleet.latency_knowledge import MIN_SHIFT_STEPS, LatencyKnowledge
from controller.fleet.regimes import Regime, RegimeMemory, Signature
from fitter.surface.synthetic import make_step_records
from twin import (
    BUILTIN_SCENARIOS,
    EngineConfig,
    PhaseConfig,
    Scenario,
    StepStats,
    TwinEngine,
    load_scenario,
    run_scenario,
)
from twin.tabletune_policy import TabletunePolicy

EAGLE = (0.69, 0.66, 0.69, 0.73, 0.76, 0.78, 0.80)


def _steps(seed: int, scale: float = 1.0) -> pa.Table:
    records = make_step_records(20_000, seed=seed, max_batch=64)
    latency = records.schema.get_field_index("step_latency_s")
    return records.set_column(latency, "step_latency_s",
                              pc.multiply(records.column("step_latency_s"), scale))


def test_a_shift_is_read_against_cells_of_the_same_shape() -> None:
    knowledge = LatencyKnowledge()
    assert knowledge.shift(_steps(1)) is None  # nothing remembered yet
    knowledge.learn(_steps(1))
    same = knowledge.shift(_steps(2))
    slower = knowledge.shift(_steps(3, scale=1.4))
    assert same is not None and slower is not None
    assert abs(same.change) < 0.03 and same.steps >= MIN_SHIFT_STEPS
    assert abs(slower.change - 0.4) < 0.05
    elsewhere = make_step_records(5_000, seed=4, max_batch=256)
    batch = elsewhere.column("batch_size")
    assert knowledge.shift(elsewhere.filter(pc.greater(batch, 128))) is None  # never measured
    assert knowledge.forget() > 0 and knowledge.batch_range() is None


def test_the_measured_share_counts_steps_at_batch_sizes_measured() -> None:
    """At any K and context: the shapes a load drains through after a drop are new, its
    batch sizes are not."""
    knowledge = LatencyKnowledge()
    assert knowledge.measured_share(_steps(1)) == 0.0  # nothing remembered yet
    knowledge.learn(_steps(1))
    # the same load, slower: the share reads batch sizes only (`shift` reads the times)
    assert knowledge.measured_share(_steps(2, scale=1.4)) > 0.95
    elsewhere = make_step_records(5_000, seed=4, max_batch=256)
    past = pc.mean(pc.greater(elsewhere.column("batch_size"), 64).cast("float64")).as_py()
    assert 0.15 < past < 0.85  # both sides are there
    assert knowledge.measured_share(elsewhere) == pytest.approx(1 - past, abs=0.05)


def test_a_load_that_returns_is_not_profiled_again(generated_traces: Path) -> None:
    """16 users, then 128, then 16 again (EAGLE on ShareGPT-shaped requests, one engine): the
    jump to 128 is a load never measured and takes a re-profile; the way back is measured
    and takes none."""
    trace = str(generated_traces / "sharegpt.jsonl")
    phases = tuple(PhaseConfig(name=name, duration_s=180, concurrency=users, acceptance=EAGLE,
                               prompt_len=355, output_len=728, trace=trace)
                   for name, users in (("c16", 16), ("c128", 128), ("c16-again", 16)))
    policy = TabletunePolicy()
    try:
        run_scenario(Scenario(seed=21, engine=EngineConfig(max_num_seqs=256), phases=phases),
                     policy)
    finally:
        policy.close()
    assert policy.loop is not None
    decisions = policy.loop.decisions
    reprofiles = [d.t_s for d in decisions if d.what == "reprofile"]
    assert len(reprofiles) == 1 and 180 < reprofiles[0] < 360, decisions
    assert not [d for d in decisions if d.what == "latency_forgotten"]
    low, high = policy.loop.knowledge.batch_range() or (0, 0)
    assert low <= 16 and high >= 100  # both loads are remembered


class _RecallsNothing(RegimeMemory):
    """Regimes that sign no return: through the broker, a return's first seconds mix the
    drain of the last load's requests, and the recall's signature matched no regime there
    (EAGLE swing, seeds 21 and 31); here the latency knowledge alone must carry it."""

    def recall(self, signature: Signature | None, acceptance_threshold: float, *,
               stale: Regime | None = None) -> Regime | None:
        return None


class _NoRecallPolicy(TabletunePolicy):
    def on_step(self, engine: TwinEngine, step: StepStats) -> None:
        super().on_step(engine, step)
        if self.loop is not None and not isinstance(self.loop.regimes, _RecallsNothing):
            self.loop.regimes = _RecallsNothing()


def test_a_latency_drift_at_a_measured_load_is_settled_not_probed() -> None:
    """The EAGLE swing (seed 21) from 16 users to 128 and back, with no recall: back at 16
    the batch drains the 128-user requests, whose long contexts the table did not
    predict, and the latency drifts 25%. Every batch size there was measured (the profile
    at 16, the probe at 128), so the loop settles: no block, and no re-profile."""
    swing = load_scenario(BUILTIN_SCENARIOS / "swing-eagle-load.toml")
    scenario = dataclasses.replace(swing, seed=21, phases=swing.phases[:3])
    returns_s = sum(phase.duration_s for phase in scenario.phases[:2])
    policy = _NoRecallPolicy()
    try:
        run_scenario(scenario, policy)
    finally:
        policy.close()
    assert policy.loop is not None
    decisions = [d for d in policy.loop.decisions if d.t_s >= returns_s]
    drift = next(d for d in decisions if d.what == "stale")
    assert drift.fields["signal"] == "latency", decisions
    settle = next(d for d in decisions if d.t_s >= drift.t_s and d.what != "stale")
    assert settle.what == "settle_refit", decisions
    assert settle.fields["reason"].startswith("the load runs at batch sizes measured")
    assert not [d for d in decisions if d.what in ("reprofile", "latency_forgotten")], decisions
