"""A forced table the engine's switch refuses is reported once, not on every poll of the
tables topic, and leaves the engine on its table."""

from __future__ import annotations

from controller.engine.feed import EngineFeed
from controller.engine.follower import wall_clock
from controller.engine.table_switch import TableSwitch
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from schemas import DraftTable, TableControl, TableKey
from schemas.control import new_control_id

KEY = TableKey("llama", "eagle", "h100")


def test_a_refused_force_is_reported_once() -> None:
    startup = DraftTable.from_vllm([[1, 64, 1]])
    # The agent's limits allow K=5; this switch was started with max K 3, so it refuses.
    switch = TableSwitch(startup, max_k=3, max_batch=64)
    status = StatusPublisher(None, "engine-0", str(KEY))
    feed = EngineFeed(switch, EngineLimits(KEY, frozenset({0, 1, 3, 5}), 64), status,
                      wall_clock)
    feed.agent.on_control(TableControl(key=KEY, action="force", version=None,
                                       issued_at="2098-12-31T23:30:00+00:00",
                                       control_id=new_control_id(),
                                       table=DraftTable.from_vllm([[1, 64, 5]]),
                                       expires_at="2099-01-01T00:00:00+00:00"))
    for _ in range(3):  # three polls
        feed.sync()
    rejected = [e for e in status.recent if e["event"] == "rejected"]
    assert len(rejected) == 1 and rejected[0]["control"] == "force"
    assert rejected[0]["reason"] == "invalid_table"
    assert not switch.forced and switch.table == startup
