"""A key another control replica takes over: the successor starts from the topic's table
and the last minutes of telemetry, and judges that table from its first steps.

In memory: at the takeover the twin's service is replaced by a new one built as
`tabletune control` builds it for a key it is assigned (the key's newest envelope from the
tables topic, its recent steps as the lookback); the first service, like a killed replica,
sends nothing more."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from controller.drift import DriftConfig
from controller.fleet.decisions import Decision
from controller.fleet.knowledge_event import EVENT, knowledge_fields, read_knowledge
from controller.fleet.loop import ClosedLoop
from controller.fleet.loop_config import LoopConfig
from controller.fleet.service import ControlService
from fitter.derive import fit_table
from fitter.engine_consensus import with_screening
from tests.test_controller.test_closed_loop import (
    EAGLE,
    NGRAM_CODE,
    NGRAM_POOR_CHAT,
    ngram_chat_to_code,
)
from twin import EngineConfig, PhaseConfig, Scenario, run_scenario
from twin.config import DrafterConfig
from twin.tabletune_policy import TabletunePolicy

if TYPE_CHECKING:
    from twin.engine import StepStats, TwinEngine


class TakenOverAt(TabletunePolicy):
    """`tabletune`, whose key a second replica takes over at `at_s` of virtual time."""

    def __init__(self, at_s: float, config: LoopConfig,
                 successor_config: LoopConfig | None = None, *, memory: bool = False) -> None:
        """`memory`: the successor reads what the first published of the key's latency
        knowledge and regimes (its last `latency_knowledge` event, through JSON), and
        every envelope of the key, as `tabletune control` reads the status and tables
        topics."""
        super().__init__(config)
        self.at_s = at_s
        self.memory = memory
        self.successor_config = successor_config or config
        self.first: ClosedLoop | None = None
        """The first replica's loop (None before the takeover)."""

    def on_step(self, engine: TwinEngine, step: StepStats) -> None:
        if self.first is None and step.t_s >= self.at_s:
            self.first = self.loop
            self.service = self._successor()
        super().on_step(engine, step)

    def _successor(self) -> ControlService:
        old = self.first
        assert old is not None and self.key is not None and self.channel is not None
        channel = self.channel
        successor = ControlService(with_screening(fit_table), lambda _key: channel,
                                   config=self.successor_config, tick_s=self.tick_s)
        successor.engine_started(self.key, old.limits, old.startup_table)
        current = old.agent.desired()
        assert current is not None  # the tables topic's newest table
        if self.memory:
            for _, envelope in sorted(old.agent.state.accepted.items()):
                successor.table_seen(envelope)
            fields = knowledge_fields(None, str(self.key), old.clock_s, old.knowledge.cells,
                                      old.regimes.kept())
            event = json.loads(json.dumps({"event": EVENT, "table_key": str(self.key),
                                           **fields}))
            successor.knowledge_seen(read_knowledge(event, {}))
        successor.table_seen(current)
        lookback = old.window.window(old.clock_s)
        assert lookback is not None
        successor.history(lookback)
        return successor


def successor_stale(policy: TakenOverAt) -> tuple[list[Decision], Decision]:
    """The successor's decisions and its first `stale`, after checking that it resumed
    the key and that the first replica had called nothing stale before it."""
    first, successor = policy.first, policy.loop
    assert first is not None and successor is not None and successor is not first
    assert not [d for d in first.decisions if d.what == "stale"], first.decisions
    decisions = successor.decisions
    assert decisions[0].what == "resume", decisions
    stale = next(d for d in decisions if d.what == "stale")
    return decisions, stale


def eagle_16_then_128() -> Scenario:
    """EAGLE on one engine, 16 users for 90 s, then 128 for 60 s."""
    return Scenario(seed=6, engine=EngineConfig(max_num_seqs=256), phases=(
        PhaseConfig(name="c16", duration_s=90, concurrency=16, acceptance=EAGLE,
                    prompt_len=355, output_len=300),
        PhaseConfig(name="c128", duration_s=60, concurrency=128, acceptance=EAGLE,
                    prompt_len=355, output_len=300)))


def test_a_key_taken_over_in_a_load_jump_is_called_stale_within_seconds() -> None:
    """EAGLE, 16 users then 128, the key taken over 2 s after the jump: the successor's
    table was fitted at 16, and the successor calls it stale on its coverage within
    seconds of resuming, as the first replica would have, rather than learning the new
    load as the table's reference. (A one-engine key's own load check is off here:
    `probe_block_s` 0 makes it re-profile as a fleet's canaries do.)"""
    config = LoopConfig(probe_block_s=0.0)
    policy = TakenOverAt(92.0, config)
    run_scenario(eagle_16_then_128(), policy)
    policy.close()
    decisions, stale = successor_stale(policy)
    assert stale.fields["signal"] == "coverage", decisions
    # the detector's `min_steps` at 128 users take about 9 s; its reference, 30 s
    assert stale.t_s - decisions[0].t_s <= 15.0, decisions
    reprofile = next(d for d in decisions if d.what == "reprofile")
    assert reprofile.t_s == stale.t_s, decisions


def test_a_load_jump_the_first_replica_missed_is_called_stale_at_the_successors_first_tick(
        ) -> None:
    """EAGLE, 16 users then 128 from 90 s; the first replica's coverage signal is off, so it
    runs its 16-user table on; the key taken over at 120 s. The successor's reference is
    the steps before it started, all at 128 users: coverage fires on them, and the table is
    called stale at the successor's first tick (its live steps alone take about 9 s)."""
    successor_config = LoopConfig(probe_block_s=0.0)
    first_config = LoopConfig(probe_block_s=0.0, drift=DriftConfig(coverage_threshold=1.01))
    policy = TakenOverAt(120.0, first_config, successor_config)
    run_scenario(eagle_16_then_128(), policy)
    policy.close()
    decisions, stale = successor_stale(policy)
    assert stale.fields["signal"] == "coverage", decisions
    assert stale.t_s - decisions[0].t_s <= 2 * successor_config.drift.chunk_s, decisions


def test_a_key_taken_over_in_a_workload_switch_is_called_stale_at_its_first_tick() -> None:
    """n-gram, chat then code from 70 s, the key taken over at 80 s, before the first
    replica's detector had called its window stale (91 s alone): the successor's reference is
    the last 20 s of steps before it started, which miss the table's acceptance by a drift,
    so it calls the table stale at its first tick; a reference of its own live steps would
    take 22 s and learn the code traffic as the table's misfit."""
    config = LoopConfig(probe_block_s=0.0)
    policy = TakenOverAt(80.0, config)
    run_scenario(ngram_chat_to_code(code_s=100, chat=NGRAM_POOR_CHAT), policy)
    policy.close()
    decisions, stale = successor_stale(policy)
    assert stale.fields["signal"] == "acceptance", decisions
    assert stale.t_s - decisions[0].t_s <= 2 * config.drift.chunk_s, decisions


def test_a_key_taken_over_in_steady_traffic_goes_on_with_its_table() -> None:
    """EAGLE at 16 users throughout, the key taken over at 150 s: the successor's reference
    from the steps before it started finds nothing to call stale, and no re-profile starts."""
    scenario = Scenario(seed=6, engine=EngineConfig(max_num_seqs=256), phases=(
        PhaseConfig(name="c16", duration_s=300, concurrency=16, acceptance=EAGLE,
                    prompt_len=355, output_len=300),))
    policy = TakenOverAt(150.0, LoopConfig(probe_block_s=0.0))
    run_scenario(scenario, policy)
    policy.close()
    successor = policy.loop
    assert successor is not None and successor is not policy.first
    assert successor.decisions[0].what == "resume"
    assert not [d for d in successor.decisions if d.what in ("stale", "reprofile")], \
        successor.decisions


def chat_code_chat_code() -> Scenario:
    """n-gram at 32 users, 150 s each of chat, code, chat, code: the first code phase takes
    a re-profile, each return is recalled (`test_regimes`)."""
    def phase(name: str, acceptance: tuple[float, ...], prompt: int, output: int) -> PhaseConfig:
        return PhaseConfig(name=name, duration_s=150, concurrency=32, acceptance=acceptance,
                           prompt_len=prompt, output_len=output)

    chat, code = phase("chat", NGRAM_POOR_CHAT, 355, 728), phase("code", NGRAM_CODE, 171, 262)
    return Scenario(seed=6, engine=EngineConfig(max_num_seqs=128),
                    drafter=DrafterConfig(method="ngram", ngram_match_prob=0.5),
                    phases=(chat, code, chat, code))


def test_a_traffic_measured_before_a_takeover_is_recalled_by_the_successor() -> None:
    """The key taken over in the second chat phase. The successor begins from the regimes
    and latency the first published: code's return is recalled, the table its sweep's
    refit published sent again under a new version, with no force and no re-profile. A
    successor without them probes code again."""
    remembered = TakenOverAt(400.0, LoopConfig(), memory=True)
    run_scenario(chat_code_chat_code(), remembered)
    remembered.close()
    first, successor = remembered.first, remembered.loop
    assert first is not None and successor is not None and successor is not first
    resumed = successor.decisions[0]
    assert resumed.what == "resume" and resumed.fields["regimes"] == len(first.regimes) >= 2
    assert resumed.fields["knowledge_cells"] == len(first.knowledge.cells) > 0
    code_version = next(d.fields["version"] for d in first.decisions
                        if d.what == "refit" and d.fields["reason"] == "stale")
    recall = next(d for d in successor.decisions if d.what == "recall" and d.t_s > 450)
    sent = next(d for d in successor.decisions if d.what == "refit" and d.t_s == recall.t_s)
    assert sent.fields["sent_again"] == code_version, successor.decisions
    assert not [d for d in successor.decisions if d.what == "reprofile"], successor.decisions
    # a sweep's table, sent again, is swapped only through the periodic refits' gate
    assert not [d for d in successor.decisions if d.what == "refit"
                and d.fields["reason"] == "follow_up"], successor.decisions
    code_table = first.agent.state.accepted[code_version].table
    assert successor.agent.desired().table == code_table  # type: ignore[union-attr]

    forgetful = TakenOverAt(400.0, LoopConfig())
    run_scenario(chat_code_chat_code(), forgetful)
    forgetful.close()
    assert forgetful.loop is not None
    assert [d for d in forgetful.loop.decisions if d.what == "reprofile" and d.t_s > 450]
