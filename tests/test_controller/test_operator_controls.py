"""The control service follows an operator's pin, unpin and rollback on the tables topic.

Engines fold these controls themselves; a service that ignored them would force canaries
through a pin and send the table an operator withdrew straight back. The twin runs the
service and one engine in memory; the restart case folds a log as `tabletune control` does
when it starts."""

from __future__ import annotations

import datetime as dt

from controller.fleet.loop import ClosedLoop
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from schemas import DraftTable, TableControl, TableEnvelope, TableKey
from schemas.control import new_control_id
from tests.test_controller.test_closed_loop import EAGLE, NGRAM_POOR_CHAT, ngram_chat_to_code
from twin import EngineConfig, PhaseConfig, Scenario, run_scenario
from twin.tabletune_policy import TabletunePolicy


def operator(key: TableKey, action: str, version: int | None = None) -> TableControl:
    return TableControl(key=key, action=action, version=version,
                        issued_at="2026-12-01T00:00:00+00:00", control_id=new_control_id())


def first_table_version(policy: TabletunePolicy) -> int:
    assert policy.loop is not None
    staged = [d.fields["version"] for d in policy.loop.decisions if d.what == "stage"]
    assert staged, policy.loop.decisions
    return staged[0]


def test_a_pin_holds_the_service_through_a_drift_and_an_unpin_lets_it_go_on() -> None:
    """Pinned at 50 s, the chat -> code drift at 70 s starts no re-profile: no force, no new
    version; the unpin at 150 s gives the loop back, and it moves the table."""
    scenario = ngram_chat_to_code(code_s=200, chat=NGRAM_POOR_CHAT)  # code moves the table
    key = TableKey(scenario.engine.model, "ngram", scenario.engine.hardware)
    policy = TabletunePolicy()
    policy.plant(50.0, operator(key, "pin", 1))
    policy.plant(150.0, operator(key, "unpin"))
    run_scenario(scenario, policy)
    policy.close()
    loop, feed = policy.loop, policy.feed
    assert loop is not None and feed is not None
    assert first_table_version(policy) == 1
    held = [d for d in loop.decisions if 50.0 <= d.t_s < 150.0]
    assert [d.what for d in held][:1] == ["operator"] and held[0].fields["pinned"], held
    assert not [d for d in held if d.what in ("reprofile", "stage", "refit", "stale")], held
    after = [d for d in loop.decisions if d.t_s >= 150.0]
    assert after[0].what == "operator" and not after[0].fields["pinned"]
    moved = [d for d in after if d.what == "stage" and d.fields["version"] > 1]
    assert moved, after
    assert feed.agent.state.desired_version == moved[-1].fields["version"]


def test_after_an_operator_rollback_the_service_waits_out_its_cooldown() -> None:
    """The operator withdraws the first table at 50 s: engines and service go back to the
    startup table, and the service sends no table before the rollback cooldown ends."""
    scenario = Scenario(seed=3, engine=EngineConfig(max_num_seqs=128), phases=(
        PhaseConfig(duration_s=200, concurrency=64, acceptance=EAGLE, prompt_len=355,
                    output_len=300),))
    key = TableKey(scenario.engine.model, "eagle", scenario.engine.hardware)
    policy = TabletunePolicy()
    policy.plant(50.0, operator(key, "rollback"))
    run_scenario(scenario, policy)
    policy.close()
    loop, feed = policy.loop, policy.feed
    assert loop is not None and feed is not None
    assert first_table_version(policy) == 1
    assert 1 in feed.agent.state.withdrawn and 1 in loop.agent.state.withdrawn
    cooldown_end = 50.0 + loop.config.rollback_cooldown_s
    stages = [d for d in loop.decisions if d.what == "stage" and d.t_s > 50.0]
    assert stages[0].fields["version"] == 0  # the engines' own move back, taken in
    sent = stages[1:]
    assert all(d.t_s >= cooldown_end and d.fields["version"] > 1 for d in sent), sent
    refits = [d for d in loop.decisions if d.what == "refit" and d.t_s > 50.0]
    assert refits and refits[0].t_s >= cooldown_end, refits


def test_a_restarted_service_folds_the_pin_it_finds_on_the_topic() -> None:
    """The tables topic holds v1, v2 and a pin of v1: the service that starts on it runs
    v1, pinned, and holds; without the pin it would resume on v2."""
    key = TableKey("meta-llama/Llama-3.1-8B-Instruct", "eagle", "NVIDIA H100 80GB HBM3")
    limits = EngineLimits(key, frozenset({0, 1, 3, 5}), 64)

    def envelope(version: int, k: int) -> TableEnvelope:
        return TableEnvelope(key=key, version=version, table=DraftTable.from_vllm([[1, 64, k]]),
                             startup_k_values=(0, 1, 3, 5), max_batch=64,
                             created_at="2026-12-01T00:00:00+00:00")

    sent: list[object] = []

    class Channel:
        def send(self, message: object) -> None:
            sent.append(message)

    def loop_on(log: tuple[TableEnvelope | TableControl, ...]) -> ClosedLoop:
        return ClosedLoop(Channel(), limits, StatusPublisher(None, "control", str(key)),  # type: ignore[arg-type]
                          fit=lambda *a, **k: None,  # type: ignore[arg-type,return-value]
                          startup_table=DraftTable.from_vllm([[1, 64, 1]]),
                          current=log[1], newest_version=2, log=log)

    pinned = loop_on((envelope(1, 3), envelope(2, 5), operator(key, "pin", 1)))
    following = loop_on((envelope(1, 3), envelope(2, 5)))
    assert pinned.pinned and pinned.agent.state.desired_version == 1
    assert not following.pinned and following.agent.state.desired_version == 2
    start = dt.datetime(2026, 12, 1, tzinfo=dt.UTC).timestamp()
    pinned.start(start)
    for step in range(120):  # past a refit interval: nothing is fitted or sent while pinned
        pinned.tick(start + step, None)
    assert not sent
    assert [d.what for d in pinned.decisions] == ["resume"]
    pinned.observe_control(operator(key, "unpin"), start + 120)
    assert not pinned.pinned and pinned.agent.state.desired_version == 2
