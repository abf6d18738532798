"""The loop's latency knowledge: a load that returns needs no re-profile, and the knowledge
goes only when the step times themselves moved."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from controller.fleet.latency_knowledge import MIN_SHIFT_STEPS, LatencyKnowledge
from fitter.surface.synthetic import make_step_records
from tests.test_controller.test_closed_loop import EAGLE
from twin import EngineConfig, PhaseConfig, Scenario, run_scenario
from twin.tabletune_policy import TabletunePolicy


def _steps(seed: int, scale: float = 1.0, *, forced: bool = True) -> pa.Table:
    """A sweep's steps (forced), or a table's."""
    records = make_step_records(20_000, seed=seed, max_batch=64, forced=forced)
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
    assert abs(same[0]) < 0.03 and same[1] >= MIN_SHIFT_STEPS
    assert abs(slower[0] - 0.4) < 0.05
    elsewhere = make_step_records(5_000, seed=4, max_batch=256)
    batch = elsewhere.column("batch_size")
    assert knowledge.shift(elsewhere.filter(pc.greater(batch, 128))) is None  # never measured
    assert knowledge.forget() > 0 and knowledge.batch_range() is None


def test_only_a_sweep_s_own_steps_are_learned() -> None:
    """The steps before a sweep's first forced one ran what the engines ran before its
    force arrived (a server's first steps, slow): they are not the sweep's measurement."""
    lead = make_step_records(2_000, seed=5, max_batch=256, start_ns=1_600_000_000 * 10**9)
    batch = lead.column("batch_size")
    lead = lead.filter(pc.greater(batch, 128))  # cells no forced step below shares
    sweep = _steps(1)
    knowledge = LatencyKnowledge()
    knowledge.learn(pa.concat_tables([lead.cast(sweep.schema), sweep]))
    low, high = knowledge.batch_range() or (0, 0)
    assert 1 <= low and high <= 64
    unswept = LatencyKnowledge()
    unswept.learn(_steps(1, forced=False))
    assert len(unswept.cells) == 0


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
