"""Issue 31 defect 10, in the engine: tables and controls are Ed25519-signed by the control
service, and an engine holding only the public key follows them; one signed by another key,
tampered with, or HMAC-signed (what an earlier release published) is refused with a reason,
and the engine keeps its table."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json

from controller.engine.feed import EngineFeed
from controller.engine.follower import TableFeed, wall_clock
from controller.engine.table_switch import TableSwitch
from controller.fleet.channel import KafkaChannel
from controller.fleet.table_log import control, publish
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from schemas import DraftTable, TableEnvelope, TableKey, canonical_json
from schemas.settings import Settings
from schemas.signing import generate_private_key, private_key_text, public_key_text
from tests.kafka_helpers import wait_until

KEY = TableKey("meta-llama/Llama-3.1-8B-Instruct", "eagle", "NVIDIA H100 80GB HBM3")
LIMITS = EngineLimits(KEY, frozenset({0, 1, 3, 5}), 64)
STARTUP = DraftTable.from_vllm([[1, 64, 1]])
CONTROL_KEY = generate_private_key()
"""The control service's private key: it is never given to an engine."""
CONTROL_ENV = {"TABLETUNE_SIGNING_KEY_ID": "2026-12",
               "TABLETUNE_SIGNING_KEY": private_key_text(CONTROL_KEY)}
ENGINE_ENV = {"TABLETUNE_VERIFY_KEYS": f"2026-12:{public_key_text(CONTROL_KEY)}"}


def envelope(version: int, k: int) -> TableEnvelope:
    return TableEnvelope(key=KEY, version=version, table=DraftTable.from_vllm([[1, 64, k]]),
                         startup_k_values=(0, 1, 3, 5), max_batch=64,
                         created_at="2026-12-01T00:00:00+00:00")


def engine() -> tuple[EngineFeed, TableSwitch, StatusPublisher]:
    settings = Settings.from_env(ENGINE_ENV)
    assert settings.signing_key is None  # nothing to sign with
    switch = TableSwitch(STARTUP, max_k=5, max_batch=64)
    status = StatusPublisher(None, "engine-0", str(KEY))
    return (EngineFeed(switch, LIMITS, status, wall_clock, keyring=settings.keyring()),
            switch, status)


def rejected(status: StatusPublisher) -> list[tuple[str, str]]:
    return [(e["reason"], e["detail"]) for e in status.recent if e["event"] == "rejected"]


def test_an_engine_with_only_the_public_key_follows_the_control_service(
        topic_settings: Settings) -> None:
    """Through the broker, signed as the service signs: `table_log.publish` (operators,
    `tabletune fit --publish`) and the service's `KafkaChannel`."""
    service = dataclasses.replace(Settings.from_env(CONTROL_ENV),
                                  bootstrap_servers=topic_settings.bootstrap_servers,
                                  topics=topic_settings.topics)
    engine_settings = dataclasses.replace(Settings.from_env(ENGINE_ENV),
                                          bootstrap_servers=topic_settings.bootstrap_servers,
                                          topics=topic_settings.topics)
    switch = TableSwitch(STARTUP, max_k=5, max_batch=64)
    status = StatusPublisher(None, "engine-0", str(KEY))
    feed = TableFeed(engine_settings, switch, LIMITS, status, explore_share=0.0).start()
    channel = KafkaChannel(service)
    try:
        def on(version: int) -> bool:
            switch.apply_staged()
            return switch.version == version
        publish(service, envelope(1, 5))
        assert wait_until(lambda: on(1))
        channel.send(envelope(2, 3))
        assert wait_until(lambda: on(2))
        publish(service, control(KEY, "pin", 1))
        assert wait_until(lambda: on(1))
        assert rejected(status) == []
        assert feed.agent.state.pinned_version == 1
    finally:
        channel.close()
        feed.stop()


def test_another_key_a_tampered_payload_and_an_hmac_are_refused_with_a_reason() -> None:
    feed, switch, status = engine()
    feed.handle_bytes(envelope(1, 5).signed("2026-12", CONTROL_KEY).to_json(), 0)
    feed.sync()
    switch.apply_staged()
    assert switch.version == 1 and rejected(status) == []

    impostor = generate_private_key()  # an engine's own key, say: not the service's
    tampered = json.loads(envelope(3, 3).signed("2026-12", CONTROL_KEY).to_json())
    tampered["table"] = [[1, 64, 0]]
    legacy = envelope(4, 3).to_dict()
    legacy["signature"] = {"key_id": "2026-12", "algorithm": "HMAC-SHA256", "mac": hmac.new(
        b"the old shared secret", canonical_json(legacy), hashlib.sha256).hexdigest()}
    pin = control(KEY, "pin", 1)
    for offset, value in enumerate([
            envelope(2, 3).signed("2026-12", impostor).to_json(),
            json.dumps(tampered).encode(),
            json.dumps(legacy).encode(),
            envelope(5, 3).signed("2026-11", CONTROL_KEY).to_json(),
            envelope(6, 3).to_json(),
            pin.signed("2026-12", impostor).to_json()], start=1):
        feed.handle_bytes(value, offset)
    feed.sync()
    switch.apply_staged()
    assert switch.version == 1 and feed.agent.state.pinned_version is None
    reasons = rejected(status)
    assert [r for r, _ in reasons] == ["bad_signature", "bad_signature", "bad_algorithm",
                                      "unknown_key", "unsigned", "bad_signature"]
    assert "not key '2026-12''s signature" in reasons[0][1]
    assert "HMAC-SHA256 signatures are no longer accepted" in reasons[2][1]
    assert status.counts["rejected"] == 6
