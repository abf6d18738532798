"""Engines fence by ownership epoch: after a new owner's claim, what an older epoch sends is
refused, and a version seen before with other content is refused, each with a `rejected`
event on the status topic (issue 46)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import pytest

from controller.engine.agent import TableAgent
from controller.engine.feed import EngineFeed
from controller.engine.follower import TableFeed
from controller.engine.table_switch import TableSwitch
from controller.fleet.channel import KafkaChannel
from controller.fleet.table_log import read_topic
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from schemas import DraftTable, EnvelopeError, TableControl, TableEnvelope, TableKey
from schemas.control import new_control_id, parse_table_message
from schemas.settings import Settings
from schemas.signing import generate_private_key
from tests.kafka_helpers import wait_until

KEY = TableKey("m", "eagle", "h100")
LIMITS = EngineLimits(KEY, frozenset(range(4)), 16)
STARTUP = DraftTable.from_vllm([[1, 16, 1]])
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def envelope(version: int, k: int = 2, epoch: int = 0) -> TableEnvelope:
    return TableEnvelope(key=KEY, version=version, table=DraftTable.from_vllm([[1, 16, k]]),
                         startup_k_values=(0, 1, 2, 3), max_batch=16,
                         created_at=NOW.isoformat(), epoch=epoch)


def claim(epoch: int) -> TableControl:
    return TableControl(key=KEY, action="claim", version=None, issued_at=NOW.isoformat(),
                        control_id=new_control_id(), issued_by="tabletune-control/b",
                        epoch=epoch)


def force(k: int, epoch: int) -> TableControl:
    return TableControl(key=KEY, action="force", version=None, issued_at=NOW.isoformat(),
                        control_id=new_control_id(), issued_by="tabletune-control/a",
                        table=DraftTable.from_vllm([[1, 16, k]]),
                        expires_at=(NOW + timedelta(minutes=5)).isoformat(), epoch=epoch)


@pytest.fixture
def agent_and_events():
    events: list[tuple[str, dict]] = []
    agent = TableAgent(LIMITS, {}, lambda event, **fields: events.append((event, fields)))
    return agent, events


def reasons(events: list[tuple[str, dict]]) -> list[str]:
    return [fields["reason"] for event, fields in events if event == "rejected"]


def test_after_a_claim_an_older_epoch_is_refused(agent_and_events):
    agent, events = agent_and_events
    assert agent.on_envelope(envelope(1, epoch=3))
    agent.on_control(claim(4))
    assert not agent.on_envelope(envelope(2, k=3, epoch=3))  # the old owner, too late
    agent.on_control(force(1, epoch=3))
    assert reasons(events) == ["stale_epoch", "stale_epoch"]
    assert all(fields["epoch"] == 3 for _, fields in events)
    assert agent.state.forced is None and agent.desired().version == 1
    assert agent.on_envelope(envelope(2, k=3, epoch=4))  # the new owner goes on


def test_a_version_seen_with_other_content_is_a_conflict(agent_and_events):
    agent, events = agent_and_events
    first = envelope(2, k=2, epoch=5)
    assert agent.on_envelope(first)
    assert not agent.on_envelope(envelope(2, k=3, epoch=5))  # two writers, one number
    assert not agent.on_envelope(first)  # the same message again: a copy, not a conflict
    assert reasons(events) == ["version_conflict", "stale_version"]
    assert agent.desired().table == first.table


def test_a_claim_ends_the_force_an_older_owner_holds(agent_and_events):
    agent, _ = agent_and_events
    agent.on_control(force(1, epoch=2))
    assert agent.forced_table(NOW) is not None
    agent.on_control(claim(2))  # the same epoch: the owner itself
    assert agent.forced_table(NOW) is not None
    agent.on_control(claim(3))  # a new owner: the old one cannot release it any more
    assert agent.forced_table(NOW) is None


def test_epoch_zero_is_not_fenced(agent_and_events):
    """Operators' controls and envelopes (and an earlier release's) carry no epoch."""
    agent, events = agent_and_events
    agent.on_control(claim(9))
    assert agent.on_envelope(envelope(1))
    agent.on_control(TableControl(key=KEY, action="pin", version=1, issued_at=NOW.isoformat(),
                                  control_id=new_control_id()))
    assert reasons(events) == [] and agent.state.pinned_version == 1


def test_the_epoch_is_signed_and_an_old_record_reads_as_epoch_zero():
    key = generate_private_key()
    keyring = {"k1": key.public_key()}
    signed = envelope(1, epoch=7).signed("k1", key)
    assert json.loads(signed.to_json())["epoch"] == 7
    signed.verify(keyring)
    forged = dataclasses.replace(signed, epoch=99)
    with pytest.raises(ValueError, match="bad_signature"):
        forged.verify(keyring)
    old = envelope(1).signed("k1", key)  # as an earlier release wrote it: no epoch field
    assert "epoch" not in json.loads(old.to_json())
    again = parse_table_message(old.to_json())
    assert again.epoch == 0 and again.to_json() == old.to_json()
    again.verify(keyring)
    with pytest.raises(EnvelopeError, match="claim needs an epoch"):
        claim(0)


def test_an_engine_fed_in_memory_drops_an_old_owners_force_at_a_claim():
    switch = TableSwitch(STARTUP, max_k=3, max_batch=16)
    status = StatusPublisher(None, "e0", str(KEY))
    feed = EngineFeed(switch, LIMITS, status, lambda: NOW)
    feed.handle(force(3, epoch=1))
    feed.sync()
    switch.apply_staged()
    assert switch.forced
    feed.handle(claim(2))
    feed.sync()
    switch.apply_staged()
    assert not switch.forced
    assert [e["event"] for e in status.recent] == ["forced", "released"]


def test_an_engine_reports_each_refusal_on_the_status_topic(topic_settings: Settings):
    """Through the broker: the control service's channel stamps the epoch it is given; the
    engine's feed refuses the older epoch and the conflicting version, on the status topic."""
    settings = topic_settings
    epochs = iter([4, 4, 3, 3, 4])

    @contextmanager
    def holding(key: TableKey) -> Iterator[int]:
        yield next(epochs)

    channel = KafkaChannel(settings, holding)
    for message in (claim(1), envelope(1, k=2), envelope(2, k=3), force(1, epoch=0),
                    envelope(1, k=1)):
        channel.send(message)
    assert channel.unsent == 0
    channel.close()
    switch = TableSwitch(STARTUP, max_k=3, max_batch=16)
    status = StatusPublisher(settings, "engine-0", str(KEY))
    feed = TableFeed(settings, switch, LIMITS, status, explore_share=0.0).start()
    try:
        assert wait_until(lambda: status.rejections.total() >= 3, 30), status.recent
    finally:
        feed.stop()
        status.close()
    assert dict(status.rejections) == {"stale_epoch": 2, "version_conflict": 1}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        published = [json.loads(m.value) for m in read_topic(settings, settings.topics.status,
                                                             idle_polls=2, timeout_s=10)]
        refused = [e for e in published if e["event"] == "rejected"]
        if len(refused) >= 3:
            break
    assert sorted(e["reason"] for e in refused) == ["stale_epoch", "stale_epoch",
                                                     "version_conflict"]
    stale = [e for e in refused if e["reason"] == "stale_epoch"]
    assert {e["epoch"] for e in stale} == {3} and all("offset" in e for e in refused)
    assert agent_state(feed).desired_version == 1 and agent_state(feed).epoch == 4


def agent_state(feed: TableFeed):
    return feed.agent.state
