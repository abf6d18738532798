from __future__ import annotations

import datetime as dt
import json

import pytest

from controller.engine.agent import Mode, TableAgent
from controller.validation import EngineLimits
from schemas import DraftTable, SignatureError, TableControl, TableEnvelope, TableKey
from schemas.control import new_control_id
from schemas.signing import generate_private_key

KEY = TableKey("llama", "eagle", "h100")
SIGNING = {"k1": generate_private_key()}
"""The control service's private keys; engines (the agents) hold only KEYRING."""
KEYRING = {key_id: key.public_key() for key_id, key in SIGNING.items()}
ISSUED = "2026-11-29T11:30:00+00:00"


def envelope(version: int, triples, key: TableKey = KEY, sign: str | None = "k1"
             ) -> TableEnvelope:
    env = TableEnvelope(key=key, version=version, table=DraftTable.from_vllm(triples),
                        startup_k_values=(0, 1, 3, 5), max_batch=64,
                        created_at="2026-11-29T00:00:00Z")
    return env.signed(sign, SIGNING.get(sign) or generate_private_key()) if sign else env


def control(action: str, version: int | None = None, sign: bool = True) -> TableControl:
    ctl = TableControl(key=KEY, action=action, version=version, issued_at=ISSUED,
                       control_id=new_control_id())
    return ctl.signed("k1", SIGNING["k1"]) if sign else ctl


@pytest.fixture
def agent_and_events():
    events: list[tuple[str, dict]] = []
    agent = TableAgent(EngineLimits(KEY, frozenset({0, 1, 3, 5}), 64), KEYRING,
                       lambda event, **fields: events.append((event, fields)))
    return agent, events


GOOD = [[1, 16, 5], [17, 64, 1]]


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        (envelope(2, [[2, 64, 1]]), "invalid_table"),
        (envelope(2, [[1, 16, 5], [10, 64, 1]]), "invalid_table"),
        (envelope(2, [[1, 32, 1]]), "invalid_table"),
        (envelope(2, [[1, 64, 7]]), "invalid_table"),
        (envelope(2, [[1, 64, 4]]), "k_not_in_startup_set"),
        (envelope(2, GOOD, key=TableKey("other", "eagle", "h100")), "wrong_key"),
        (envelope(2, GOOD, sign=None), "unsigned"),
        (envelope(2, GOOD, sign="k9"), "unknown_key"),
    ],
)
def test_bad_tables_are_rejected_with_reason(agent_and_events, env, reason):
    agent, events = agent_and_events
    agent.on_envelope(env)
    assert events == [("rejected", {"version": 2, "reason": reason,
                                    "detail": events[0][1]["detail"]})]
    assert agent.desired() is None


def test_forged_signature_and_old_version(agent_and_events):
    agent, events = agent_and_events
    agent.on_envelope(envelope(3, GOOD))
    assert agent.desired().version == 3
    forged = TableEnvelope.from_dict({**envelope(4, GOOD).to_dict(),
                                      "table": [[1, 64, 0]]})
    agent.on_envelope(forged)
    agent.on_envelope(envelope(3, [[1, 64, 1]]))
    agent.on_envelope(envelope(2, [[1, 64, 1]]))
    # version 3 again with another table: two writers numbered alike
    assert [e[1]["reason"] for e in events] == ["bad_signature", "version_conflict",
                                                "stale_version"]
    assert agent.desired().version == 3


def test_pin_unpin_rollback(agent_and_events):
    agent, events = agent_and_events
    for version in (1, 2, 3):
        agent.on_envelope(envelope(version, GOOD))
    agent.on_control(control("pin", 2))
    assert agent.state.mode is Mode.PINNED and agent.desired().version == 2
    agent.on_envelope(envelope(4, GOOD))
    assert agent.desired().version == 2  # pinned engines do not follow
    agent.on_control(control("unpin"))
    assert agent.desired().version == 4
    agent.on_control(control("rollback"))
    assert agent.desired().version == 2  # the version run before 4
    assert ("rolled_back", {"version": 4, "to_version": 2, "reason": "operator"}) in events
    agent.on_control(control("unpin"))
    assert agent.desired().version == 3  # 4 was withdrawn; newest not withdrawn
    agent.on_control(control("pin", 9))
    assert events[-1][1]["reason"] == "unknown_version"
    agent.on_control(control("rollback", sign=False))
    assert events[-1][1]["reason"] == "unsigned"


def test_rollback_to_startup_table(agent_and_events):
    agent, events = agent_and_events
    agent.on_control(control("rollback"))
    assert events[-1][1]["reason"] == "nothing_to_roll_back"
    agent.on_envelope(envelope(1, GOOD))
    assert agent.roll_back("guardrail", loss=0.2) == 0
    assert agent.desired() is None
    assert events[-1] == ("rolled_back", {"version": 1, "to_version": 0,
                                          "reason": "guardrail", "loss": 0.2})


def _force(triples, expires_at: str = "2026-11-29T12:00:00+00:00", sign: bool = True
           ) -> TableControl:
    ctl = TableControl(key=KEY, action="force", version=None, issued_at=ISSUED,
                       control_id=new_control_id(), table=DraftTable.from_vllm(triples),
                       expires_at=expires_at)
    return ctl.signed("k1", SIGNING["k1"]) if sign else ctl


def test_force_holds_over_the_followed_version_until_release_or_expiry(agent_and_events):
    from datetime import UTC, datetime

    agent, events = agent_and_events
    before = datetime(2026, 11, 29, 11, 0, tzinfo=UTC)
    after = datetime(2026, 11, 29, 12, 0, 1, tzinfo=UTC)
    agent.on_envelope(envelope(1, GOOD))
    agent.on_control(_force([[1, 64, 3]]))
    assert agent.forced_table(before) == DraftTable.from_vllm([[1, 64, 3]])
    assert agent.forced_table(after) is None  # expired: a dead profiler leaves no force
    agent.on_envelope(envelope(2, [[1, 64, 1]]))  # following goes on underneath
    assert agent.desired().version == 2 and agent.forced_table(before) is not None
    agent.on_control(control("release"))
    assert agent.forced_table(before) is None and agent.desired().version == 2
    # Bad forces are refused with a reason and change nothing.
    agent.on_control(_force([[1, 64, 4]]))
    agent.on_control(_force([[1, 64, 3]], sign=False))
    reasons = [f["reason"] for e, f in events if e == "rejected"]
    assert reasons == ["k_not_in_startup_set", "unsigned"]
    assert agent.forced_table(before) is None


def test_force_messages_need_a_table_and_a_zoned_expiry():
    from schemas import EnvelopeError, parse_table_message

    with pytest.raises(EnvelopeError, match="needs a table and expires_at"):
        TableControl(key=KEY, action="force", version=None, issued_at=ISSUED,
                     control_id=new_control_id())
    with pytest.raises(EnvelopeError, match="no time zone"):
        _force([[1, 64, 3]], expires_at="2026-11-29T12:00:00")
    with pytest.raises(EnvelopeError, match="not an ISO-8601"):
        _force([[1, 64, 3]], expires_at="soon")
    sent = _force([[1, 8, 3], [9, 64, 1]])
    assert parse_table_message(sent.to_json()) == sent
    sent.verify(KEYRING)  # the table and expiry are under the signature
    tampered = TableControl.from_dict({**sent.to_dict(), "table": [[1, 64, 5]]})
    with pytest.raises(SignatureError, match="^bad_signature"):
        tampered.verify(KEYRING)


def test_a_targeted_force_holds_only_the_engines_it_names():
    forced = DraftTable.from_vllm([[1, 64, 3]])
    force = TableControl(key=KEY, action="force", version=None,
                         issued_at="2098-12-31T23:30:00+00:00", control_id=new_control_id(),
                         table=forced, expires_at="2099-01-01T00:00:00+00:00",
                         targets=("canary-1",)).signed("k1", SIGNING["k1"])
    release = TableControl(key=KEY, action="release", version=None, issued_at=ISSUED,
                           control_id=new_control_id(),
                           targets=("canary-1",)).signed("k1", SIGNING["k1"])
    agents = {engine: TableAgent(EngineLimits(KEY, frozenset({0, 1, 3, 5}), 64), KEYRING,
                                 lambda event, **fields: None, engine_id=engine)
              for engine in ("canary-1", "other-2")}
    now = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    for agent in agents.values():
        agent.on_control(TableControl.from_dict(json.loads(force.to_json())))
    assert agents["canary-1"].forced_table(now) == forced
    assert agents["other-2"].forced_table(now) is None
    agents["canary-1"].on_control(release)
    assert agents["canary-1"].forced_table(now) is None


def test_targets_travel_in_the_signed_payload():
    force = TableControl(key=KEY, action="release", version=None, issued_at=ISSUED,
                         control_id=new_control_id(), targets=("a",)).signed("k1", SIGNING["k1"])
    retargeted = TableControl.from_dict({**json.loads(force.to_json()),
                                         "targets": ["b"]})
    with pytest.raises(SignatureError, match="^bad_signature"):
        retargeted.verify(KEYRING)
