"""Issue 31 defect 9: an engine that replays the tables topic after a restart must fold to
the state it reached following the topic live. The topic keeps every record
(`cleanup.policy=delete`, `retention.ms=-1`), so the replayed log is the live log; these
tests fold the log through what each deployment keeps of it, and through what compaction
would keep, which is why the topic is not compacted under any choice of record keys."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from kafka.admin import KafkaAdminClient, NewTopic

from controller.engine.feed import EngineFeed
from controller.engine.follower import wall_clock
from controller.engine.table_switch import TableSwitch
from controller.fleet.table_log import (
    TABLES_TOPIC_CONFIG,
    Record,
    check_tables_topic,
    compacted,
    control,
    force,
    topic_config_problems,
)
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from schemas import DraftTable, TableControl, TableEnvelope, TableKey
from schemas.settings import Settings, SettingsError
from schemas.signing import generate_private_key
from tabletune.broker import TopicLayout

KEY = TableKey("meta-llama/Llama-3.1-8B-Instruct", "eagle", "NVIDIA H100 80GB HBM3")
SECRET = generate_private_key()
KEYRING = {"k1": SECRET.public_key()}
LIMITS = EngineLimits(KEY, frozenset({0, 1, 3, 5}), 64)
STARTUP = DraftTable.from_vllm([[1, 64, 1]])
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def signed(message: TableEnvelope | TableControl) -> TableEnvelope | TableControl:
    return message.signed("k1", SECRET)


def envelope(version: int, k: int) -> TableEnvelope:
    return TableEnvelope(key=KEY, version=version, table=DraftTable.from_vllm([[1, 64, k]]),
                         startup_k_values=(0, 1, 3, 5), max_batch=64,
                         created_at="2026-12-01T00:00:00+00:00")


def table_key(message: TableEnvelope | TableControl) -> bytes:
    """The record key every writer uses (`table_log.publish`, `KafkaChannel`)."""
    return str(message.key).encode()


def per_record_key(message: TableEnvelope | TableControl) -> bytes:
    """The alternative: a key per version and per control id, so that compaction drops no
    envelope and no control."""
    if isinstance(message, TableEnvelope):
        return f"{message.key}@v{message.version}".encode()
    return f"{message.key}#{message.control_id}".encode()


def the_log(key_of: Callable[[TableEnvelope | TableControl], bytes]) -> list[Record]:
    """publish v1, v2, v3, pin v2, force, release, rollback, unpin; then the rollback's and
    the pin's bytes sent again (replays, refused)."""
    pin = signed(control(KEY, "pin", 2))
    rollback = signed(control(KEY, "rollback"))
    messages = [signed(envelope(1, 5)), signed(envelope(2, 3)), signed(envelope(3, 0)), pin,
                signed(force(KEY, DraftTable.from_vllm([[1, 64, 5]]), hold_s=60)),
                signed(control(KEY, "release")), rollback, signed(control(KEY, "unpin")),
                rollback, pin]
    return [(key_of(m), m.to_json()) for m in messages]


def fold(records: list[tuple[int, Record]], *, live: bool) -> dict:
    """An engine's state after folding `records` ((offset, (key, value))): `live` syncs the
    switch after each record, as the feed does poll by poll; otherwise once at the end, as
    after a restart. Every record of this log is of KEY, whatever its record key."""
    switch = TableSwitch(STARTUP, max_k=5, max_batch=64)
    status = StatusPublisher(None, "engine-0", str(KEY))
    feed = EngineFeed(switch, LIMITS, status, wall_clock, keyring=KEYRING)
    for offset, (_, value) in records:
        assert value is not None
        feed.handle_bytes(value, offset)
        if live:
            feed.sync()
            switch.apply_staged()
    feed.sync()
    switch.apply_staged()
    return {"agent": feed.agent.state, "version": switch.version, "forced": switch.forced,
            "rejected": [(e["reason"], e.get("control_id"), e.get("offset"))
                         for e in status.recent if e["event"] == "rejected"]}


def retained(records: list[Record], config: dict[str, str]) -> list[tuple[int, Record]]:
    """What a topic with `config` holds once its cleaner has run (retention -1: no age or
    size limit)."""
    if "compact" in config.get("cleanup.policy", "delete").split(","):
        return compacted(records)
    assert config.get("retention.ms") == "-1", config
    return list(enumerate(records))


def _deployed_configs() -> dict[str, dict[str, str]]:
    """The tables topic's `--config` of every kafka-topics.sh command in deploy/, and the
    embedded broker's."""
    found: dict[str, dict[str, str]] = {}
    for path in sorted(DEPLOY.rglob("*.y*ml")):
        for line in path.read_text().splitlines():
            if re.search(r"--topic tabletune\.tables\b", line):
                found[path.name] = dict(re.findall(r"--config ([\w.]+)=(\S+)", line))
    layout = TopicLayout()
    tables = next(t for t in layout.new_topics() if t.name == layout.names.tables)
    found["tabletune broker"] = dict(tables.topic_configs)
    return found


def test_compaction_keeps_the_last_value_of_each_key_and_drops_tombstones() -> None:
    records: list[Record] = [(b"a", b"1"), (b"b", b"1"), (b"a", b"2"), (b"c", b"1"),
                             (b"b", None), (b"a", b"3"), (b"d", b"1"), (b"d", None)]
    assert compacted(records) == [(3, (b"c", b"1")), (5, (b"a", b"3"))]
    assert compacted([]) == []
    once = [(b"x", b"1"), (b"y", b"2")]
    assert compacted(once) == list(enumerate(once))  # distinct keys: nothing goes


def test_every_deployment_keeps_the_whole_tables_log() -> None:
    configs = _deployed_configs()
    assert {"docker-compose.yml", "topics-job.yaml", "tabletune broker"} <= set(configs)
    for where, config in configs.items():
        assert config == TABLES_TOPIC_CONFIG, where
        assert topic_config_problems(config) == [], where


@pytest.mark.parametrize("key_of", [table_key, per_record_key], ids=["table key", "per record"])
def test_the_log_a_deployment_keeps_folds_to_the_live_state(key_of: Callable) -> None:
    log = the_log(key_of)
    live = fold(list(enumerate(log)), live=True)
    assert live["version"] == 3 and not live["forced"]
    assert live["agent"].withdrawn == {2} and live["agent"].pinned_version is None
    assert [r[0] for r in live["rejected"]] == ["replayed", "replayed"]
    for where, config in _deployed_configs().items():
        assert fold(retained(log, config), live=False) == live, where


def test_a_compacted_tables_topic_folds_to_another_state() -> None:
    """Why the topic is not compacted. Keyed by table key, compaction keeps the key's last
    record: a restarted engine meets a pin whose envelope is gone (`unknown_version`) and
    runs its startup table. Keyed per version and per control id, every envelope and
    control survives, but a re-sent control replaces its original: the replayed rollback
    is folded at its later offset, as a new control, and the engine ends on another
    version (2, not 3). No record key avoids that: a replayer copies the key as well."""
    log = the_log(table_key)
    live = fold(list(enumerate(log)), live=True)
    pinned_prefix = fold(compacted(log[:4]), live=False)
    assert pinned_prefix["version"] == 0
    assert [r[0] for r in pinned_prefix["rejected"]] == ["unknown_version"]
    whole = fold(compacted(log), live=False)
    assert whole["version"] == 0 and whole != live

    log = the_log(per_record_key)
    live = fold(list(enumerate(log)), live=True)
    assert len(compacted(log)) == len(log) - 2  # the originals of the two replays
    replayed = fold(compacted(log), live=False)
    assert replayed["version"] == 2 != live["version"] == 3
    assert replayed["rejected"] == []  # the copies were folded as if new


def test_the_control_service_refuses_a_tables_topic_that_loses_records(
        topic_settings: Settings) -> None:
    check_tables_topic(topic_settings)  # as the test broker creates it: kept whole
    admin = KafkaAdminClient(bootstrap_servers=list(topic_settings.bootstrap_servers))
    name = topic_settings.topics.tables + "-compacted"
    admin.create_topics([NewTopic(name, 1, 1, topic_configs={"cleanup.policy": "compact"})])
    admin.close()
    compacting = dataclasses.replace(
        topic_settings, topics=dataclasses.replace(topic_settings.topics, tables=name))
    with pytest.raises(SettingsError, match=re.escape(f"tables topic {name} loses records: "
                                                      "cleanup.policy=compact")):
        check_tables_topic(compacting)
    assert topic_config_problems({"cleanup.policy": "compact,delete",
                                  "retention.ms": "604800000"}) == [
        "cleanup.policy=compact,delete (compaction keeps only each key's last record: a "
        "pin's envelope, a replayed control's original)",
        "retention.ms=604800000 (old versions and controls would be deleted)"]
