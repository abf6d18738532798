"""Hardening defect 6: a signed control re-sent on the tables topic is a replay, refused with
a reason and counted; a force is bounded in time even with no signing key; and an engine
that restarts and folds the log again ends where one that followed it live did."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import pytest
from kafka import KafkaProducer

from controller.engine.feed import EngineFeed
from controller.engine.follower import TableFeed, wall_clock
from controller.engine.table_switch import TableSwitch
from controller.fleet.channel import InMemoryChannel
from controller.fleet.loop import ClosedLoop
from controller.fleet.sweep_planner import FORCE_ARRIVAL_LIMIT_S
from controller.fleet.table_log import control, force, publish, read_topic
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from producers.metrics import engine_counters
from schemas import DraftTable, EnvelopeError, TableControl, TableEnvelope, TableKey
from schemas.control import MAX_FORCE_S
from schemas.settings import Settings
from schemas.signing import generate_private_key
from tests.kafka_helpers import wait_until

KEY = TableKey("meta-llama/Llama-3.1-8B-Instruct", "eagle", "NVIDIA H100 80GB HBM3")
SECRET = generate_private_key()
"""The control service's private key; engines hold KEYRING, its public key only."""
KEYRING = {"k1": SECRET.public_key()}
LIMITS = EngineLimits(KEY, frozenset({0, 1, 3, 5}), 64)
STARTUP = DraftTable.from_vllm([[1, 64, 1]])


def envelope(version: int, k: int) -> TableEnvelope:
    return TableEnvelope(key=KEY, version=version, table=DraftTable.from_vllm([[1, 64, k]]),
                         startup_k_values=(0, 1, 3, 5), max_batch=64,
                         created_at="2026-12-01T00:00:00+00:00").signed("k1", SECRET)


def engine(name: str = "engine-0") -> tuple[EngineFeed, TableSwitch, StatusPublisher]:
    switch = TableSwitch(STARTUP, max_k=5, max_batch=64)
    status = StatusPublisher(None, name, str(KEY))
    return EngineFeed(switch, LIMITS, status, wall_clock, keyring=KEYRING), switch, status


def rejected(status: StatusPublisher) -> list[dict]:
    return [e for e in status.recent if e["event"] == "rejected"]


def test_a_re_sent_rollback_is_refused_as_a_replay_and_counted() -> None:
    """The attack as found: one operator's signed rollback, sent three times, walked an
    engine v3 -> v2 -> v1 -> startup table."""
    feed, switch, status = engine()
    for version, k in ((1, 5), (2, 3), (3, 0)):
        feed.handle_bytes(envelope(version, k).to_json())
    rollback = control(KEY, "rollback").signed("k1", SECRET).to_json()
    for _ in range(3):  # the operator's rollback, then two copies of its bytes
        feed.handle_bytes(rollback)
        feed.sync()
        switch.apply_staged()
    assert switch.version == 2 and feed.agent.state.desired_version == 2
    replays = [e for e in rejected(status) if e["reason"] == "replayed"]
    assert len(replays) == 2
    assert {e["control_id"] for e in replays} == {json.loads(rollback)["id"]}
    assert replays[0]["control"] == "rollback"
    assert status.counts["rejected"] == 2 and status.rejections["replayed"] == 2
    assert engine_counters(None, None, feed)["table_replayed_controls_total"] == 2


def test_each_control_is_issued_with_its_own_id() -> None:
    """Two operators' identical commands are two controls, not a replay of one."""
    feed, _, status = engine()
    for version in (1, 2, 3):
        feed.handle_bytes(envelope(version, 3).to_json())
    first, second = (control(KEY, "rollback").signed("k1", SECRET) for _ in range(2))
    assert first.control_id != second.control_id
    feed.handle_bytes(first.to_json())
    feed.handle_bytes(second.to_json())
    assert feed.agent.state.desired_version == 1 and not rejected(status)
    forces = {force(KEY, DraftTable.from_vllm([[1, 64, 3]]), hold_s=5).control_id
              for _ in range(3)}
    assert len(forces) == 3


def test_a_control_needs_an_id_under_its_signature() -> None:
    feed, _, status = engine()
    feed.handle_bytes(envelope(1, 3).to_json())
    pin = control(KEY, "pin", 1).signed("k1", SECRET)
    without_id = {k: v for k, v in pin.to_dict().items() if k != "id"}
    feed.handle_bytes(json.dumps(without_id).encode())
    renamed = {**pin.to_dict(), "id": "another-id-0001"}  # a replay under a new id
    feed.handle_bytes(json.dumps(renamed).encode())
    reasons = [(e["reason"], e["detail"]) for e in rejected(status)]
    assert reasons[0][0] == "bad_envelope" and "'id' is missing" in reasons[0][1]
    assert reasons[1][0] == "bad_signature"
    assert feed.agent.state.pinned_version is None


def test_restart_folds_the_log_to_the_state_it_followed_live() -> None:
    """The log holds a pin, its replay, an unpin, a rollback and two replays of it: an
    engine that reads it from the beginning ends exactly where the live one did, refusing
    the same copies and no original."""
    pin = control(KEY, "pin", 2).signed("k1", SECRET).to_json()
    unpin = control(KEY, "unpin").signed("k1", SECRET).to_json()
    rollback = control(KEY, "rollback").signed("k1", SECRET).to_json()
    log = [envelope(1, 5).to_json(), envelope(2, 3).to_json(), pin, envelope(3, 0).to_json(),
           pin, unpin, rollback, rollback, envelope(4, 1).to_json(), rollback]
    live, live_switch, live_status = engine()
    for offset, value in enumerate(log):
        live.handle_bytes(value, offset)
        live.sync()
        live_switch.apply_staged()
    restarted, restarted_switch, restarted_status = engine()
    for offset, value in enumerate(log):
        restarted.handle_bytes(value, offset)
    restarted.sync()
    restarted_switch.apply_staged()
    assert live.agent.state == restarted.agent.state
    assert restarted_switch.version == live_switch.version == 4
    assert [(e["reason"], e.get("control_id")) for e in rejected(live_status)] == [
        (e["reason"], e.get("control_id")) for e in rejected(restarted_status)]
    assert [e["reason"] for e in rejected(live_status)] == ["replayed"] * 3


def _far_force(expires_at: str | None) -> bytes:
    """A force whose expiry was edited after it was made: what a stuck or hostile issuer
    sends when no signing key is configured."""
    data = force(KEY, DraftTable.from_vllm([[1, 64, 3]]), hold_s=5).to_dict()
    data["expires_at"] = expires_at
    return json.dumps(data).encode()


def test_a_force_with_no_keys_has_a_maximum_duration() -> None:
    switch = TableSwitch(STARTUP, max_k=5, max_batch=64)
    status = StatusPublisher(None, "engine-0", str(KEY))
    feed = EngineFeed(switch, LIMITS, status, wall_clock)  # no keys configured
    feed.handle_bytes(_far_force("2999-01-01T00:00:00+00:00"))
    feed.handle_bytes(_far_force(None))
    feed.sync()
    assert not switch.pending and feed.agent.forced_table(wall_clock()) is None
    reasons = [e["reason"] for e in rejected(status)]
    assert reasons == ["force_too_long", "bad_envelope"]
    assert f"{MAX_FORCE_S:.0f} s" in rejected(status)[0]["detail"]
    with pytest.raises(EnvelopeError, match="longer than") as refused:
        force(KEY, DraftTable.from_vllm([[1, 64, 3]]), hold_s=MAX_FORCE_S + 1)
    assert refused.value.reason == "force_too_long"
    ok = force(KEY, DraftTable.from_vllm([[1, 64, 3]]), hold_s=MAX_FORCE_S)
    feed.handle_bytes(ok.to_json())
    feed.sync()
    switch.apply_staged()
    assert switch.forced and switch.table == DraftTable.from_vllm([[1, 64, 3]])


def _follow(settings: Settings, name: str) -> tuple[TableFeed, TableSwitch, StatusPublisher]:
    switch = TableSwitch(STARTUP, max_k=5, max_batch=64)
    status = StatusPublisher(None, name, str(KEY))
    return TableFeed(settings, switch, LIMITS, status, explore_share=0.0).start(), switch, \
        status


def test_a_replayed_rollback_on_the_broker_is_refused_live_and_after_a_restart(
        topic_settings: Settings) -> None:
    """Through the broker: the operator's signed rollback (as `tabletune controller
    rollback` publishes it), then its exact bytes sent twice more by another producer."""
    settings = dataclasses.replace(topic_settings, signing_key_id="k1", signing_key=SECRET,
                                   verify_keys=KEYRING)
    for version, k in ((1, 5), (2, 3), (3, 0)):
        publish(settings, envelope(version, k))
    feed, switch, status = _follow(settings, "live-engine")
    try:
        def on(version: int) -> bool:
            switch.apply_staged()
            return switch.version == version
        assert wait_until(lambda: on(3))
        offset = publish(settings, control(KEY, "rollback"))
        assert wait_until(lambda: on(2))
        original = [m for m in _tables(settings) if m[0] == offset][0][1]
        producer = KafkaProducer(bootstrap_servers=list(settings.bootstrap_servers))
        for _ in range(2):
            producer.send(settings.topics.tables, key=str(KEY).encode(), value=original).get(10)
        producer.close()
        assert wait_until(lambda: len(rejected(status)) == 2)
        # a release with no force in effect changes nothing; once it is folded, so is
        # everything before it, and the poll that held the copies has been synced
        marker = control(KEY, "release")
        publish(settings, marker)
        assert wait_until(lambda: _folded(feed, marker))
        switch.apply_staged()
        assert switch.version == 2
        assert [e["reason"] for e in rejected(status)] == ["replayed", "replayed"]
        assert {e["offset"] for e in rejected(status)} == {offset + 1, offset + 2}
    finally:
        feed.stop()
    restarted, restarted_switch, restarted_status = _follow(settings, "live-engine")
    try:
        assert wait_until(lambda: len(rejected(restarted_status)) == 2)

        def settled() -> bool:
            """The whole log folded and the switch on what the fold decided."""
            restarted_switch.apply_staged()
            return _folded(restarted, marker) and not restarted_switch.pending \
                and restarted_switch.version == restarted.agent.state.desired_version
        assert wait_until(settled)
        assert restarted_switch.version == 2
        assert restarted.agent.state == feed.agent.state
        assert [e["reason"] for e in rejected(restarted_status)] == ["replayed", "replayed"]
    finally:
        restarted.stop()


def _folded(feed: TableFeed, marker: TableControl) -> bool:
    """Whether `feed` has folded `marker` (a control published after the ones under test)."""
    return marker.control_id in feed.agent.state.folded_controls


def _tables(settings: Settings) -> list[tuple[int, bytes]]:
    return [(m.offset, m.value) for m in read_topic(settings, settings.topics.tables,
                                                    idle_polls=2, timeout_s=10)]


def test_the_control_service_issues_an_id_per_control() -> None:
    """The loop's forces and releases (profile blocks) each carry a fresh id, and engines
    following the in-memory channel fold every one of them (none taken for a replay)."""
    feed, _, status = engine()
    sent: list[TableControl | TableEnvelope] = []

    class Recording(InMemoryChannel):
        def send(self, message: TableControl | TableEnvelope) -> None:
            sent.append(message)
            super().send(message.signed("k1", SECRET))

    loop = ClosedLoop(Recording([feed]), LIMITS, StatusPublisher(None, "control", str(KEY)),
                      fit=lambda *a, **k: None, startup_table=STARTUP)  # type: ignore[arg-type]
    start = dt.datetime(2026, 12, 1, tzinfo=dt.UTC).timestamp()
    loop.start(start)
    # no engine steps here: each block waits its longest for its K to show, then goes on
    for step in range(4):
        loop.tick(start + (FORCE_ARRIVAL_LIMIT_S + 0.1) * step, None)
    loop.release_forces()
    controls = [m for m in sent if isinstance(m, TableControl)]
    assert [c.action for c in controls] == ["force"] * 4 + ["release"]
    assert len({c.control_id for c in controls}) == len(controls)
    assert not rejected(status)
