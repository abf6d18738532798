"""Writing to and reading from the tables topic outside engines (fitter, operators).

The tables topic keeps every record forever (`cleanup.policy=delete`, `retention.ms=-1`):
envelopes and controls share the table key as their record key, and an engine that reads
the log from the beginning must meet every record an engine that followed it live met, in
the same order, or it folds to another state (`compacted` says what compaction would leave,
and `tests/test_controller/test_log_compaction.py` folds both). `check_tables_topic` refuses
a topic configured to lose records.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.errors import KafkaError

from fitter.kafka_clients import close_producer
from schemas import (
    DraftTable,
    EnvelopeError,
    TableControl,
    TableEnvelope,
    TableError,
    TableKey,
    parse_table_message,
)
from schemas.control import new_control_id
from schemas.settings import Settings, SettingsError

log = logging.getLogger(__name__)

Record = tuple[bytes | None, bytes | None]
"""A record's (key, value); a None value is a tombstone."""

TABLES_TOPIC_CONFIG = {"cleanup.policy": "delete", "retention.ms": "-1",
                       "retention.bytes": "-1"}
"""What the tables topic needs: nothing is ever removed from it (a few KB per version, a few
dozen controls per re-profile)."""


@dataclass(frozen=True, slots=True)
class LogEntry:
    offset: int
    timestamp_ms: int
    message: TableEnvelope | TableControl | None
    error: str | None = None


def publish(settings: Settings, message: TableEnvelope | TableControl) -> int:
    """Sign (when a signing key is configured) and publish; returns the offset."""
    if settings.signing_key_id is not None and settings.signing_key is not None:
        message = message.signed(settings.signing_key_id, settings.signing_key)
    producer = KafkaProducer(**settings.client_kwargs(), max_block_ms=10_000)
    try:
        future = producer.send(settings.topics.tables, key=str(message.key).encode(),
                               value=message.to_json())
        return int(future.get(timeout=15).offset)
    finally:
        close_producer(producer, timeout_s=5)


def control(key: TableKey, action: str, version: int | None = None,
            issued_by: str = "operator") -> TableControl:
    """A new control, with its own id: publishing it twice would be a replay."""
    return TableControl(key=key, action=action, version=version,
                        issued_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                        control_id=new_control_id(), issued_by=issued_by)


def force(key: TableKey, table: DraftTable, *, hold_s: float,
          issued_by: str = "profiler") -> TableControl:
    """A new `force` of `table` that expires `hold_s` seconds from now (EnvelopeError past
    `schemas.control.MAX_FORCE_S`)."""
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    return TableControl(key=key, action="force", version=None, issued_at=now.isoformat(),
                        control_id=new_control_id(), issued_by=issued_by, table=table,
                        expires_at=(now + dt.timedelta(seconds=hold_s)).isoformat())


def read_topic(settings: Settings, topic: str, *, idle_polls: int = 3,
               timeout_s: float = 30.0) -> list[Any]:
    """Every message of `topic`, read from the beginning of all its partitions.

    "Caught up" is decided by idle polls, not end offsets (they are unreliable on some
    Kafka-protocol brokers). No consumer group: nothing is committed."""
    consumer = KafkaConsumer(**settings.client_kwargs(), enable_auto_commit=False)
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        assigned = [TopicPartition(topic, p) for p in sorted(partitions)]
        if not assigned:
            return []
        consumer.assign(assigned)
        consumer.seek_to_beginning(*assigned)
        messages: list[Any] = []
        idle = 0
        deadline = time.monotonic() + timeout_s
        while idle < idle_polls and time.monotonic() < deadline:
            batches = consumer.poll(timeout_ms=200)
            idle = 0 if batches else idle + 1
            for batch in batches.values():
                messages.extend(batch)
        return messages
    finally:
        consumer.close()


def read_log(settings: Settings, key: TableKey | None = None, *,
             idle_polls: int = 3, timeout_s: float = 30.0) -> list[LogEntry]:
    """Every message of the tables topic (of one key), read from the beginning."""
    wanted = None if key is None else str(key).encode()
    return [_entry(message) for message in read_topic(
        settings, settings.topics.tables, idle_polls=idle_polls, timeout_s=timeout_s)
        if wanted is None or message.key == wanted]


def newest_version(settings: Settings, key: TableKey) -> int:
    versions = [e.message.version for e in read_log(settings, key)
                if isinstance(e.message, TableEnvelope)]
    return max(versions, default=0)


def _entry(message: Any) -> LogEntry:
    try:
        parsed = parse_table_message(message.value)
    except (EnvelopeError, TableError) as exc:
        return LogEntry(message.offset, message.timestamp, None, str(exc))
    return LogEntry(message.offset, message.timestamp, parsed)


def compacted(records: Sequence[Record]) -> list[tuple[int, Record]]:
    """What Kafka's log cleaner leaves of `records` (in offset order) once it has cleaned
    the whole log: the last record of each key, at its own offset, tombstones (a None
    value, once `delete.retention.ms` has passed) removed. Returns (offset, record) pairs.

    The cleaner never cleans the active segment, so a live compacted log holds this and
    possibly more; a log read after the cleaner caught up holds exactly this."""
    last = {key: offset for offset, (key, _) in enumerate(records)}
    return [(offset, (key, value)) for offset, (key, value) in enumerate(records)
            if last[key] == offset and value is not None]


def topic_config_problems(configs: Mapping[str, str]) -> list[str]:
    """Why a tables topic described as `configs` would lose records an engine folds (empty:
    none that can be seen; a setting the broker does not report is not judged)."""
    problems = []
    policy = configs.get("cleanup.policy")
    if policy is not None and "compact" in policy.split(","):
        problems.append(f"cleanup.policy={policy} (compaction keeps only each key's last "
                        "record: a pin's envelope, a replayed control's original)")
    for name in ("retention.ms", "retention.bytes"):
        value = configs.get(name)
        if value is not None and value.strip() != "-1":
            problems.append(f"{name}={value} (old versions and controls would be deleted)")
    return problems


def check_tables_topic(settings: Settings) -> None:
    """Raise SettingsError, naming the topic and each setting, when the tables topic is
    configured to lose records (the control service checks this at start). A broker that
    does not describe its topic configs, or an ACL without DescribeConfigs, is logged and
    passes: nothing is known to be wrong."""
    topic = settings.topics.tables
    resource = ConfigResource(ConfigResourceType.TOPIC, topic)  # every config: filtered here
    try:
        admin = KafkaAdminClient(**settings.client_kwargs())
        try:
            try:  # defaults too: Apache Kafka's own retention.ms default is 7 days
                described = admin.describe_configs([resource], config_filter="all")
            except TypeError:  # kafka-python 2.x: no filter, every value is returned
                described = admin.describe_configs([resource])
        finally:
            admin.close()
    except KafkaError as exc:
        log.warning("could not read the configuration of %s (%s): not checked", topic, exc)
        return
    problems = topic_config_problems(_config_values(described, topic))
    if problems:
        wanted = " ".join(f"--config {k}={v}" for k, v in TABLES_TOPIC_CONFIG.items())
        raise SettingsError(f"tables topic {topic} loses records: {'; '.join(problems)}; "
                            f"it needs {wanted}")


def _config_values(described: Any, topic: str) -> dict[str, str]:
    """Config name -> value from kafka-python's describe_configs answer: a dict by resource
    type and name (3.x), or a list of responses holding `resources` tuples (2.x)."""
    values: dict[str, str] = {}
    if isinstance(described, Mapping):
        for name, entry in dict(described.get("topic", {}).get(topic, {})).items():
            value = entry.get("value") if isinstance(entry, Mapping) else entry
            if value is not None:
                values[str(name)] = str(value)
        return values
    for response in described if isinstance(described, list) else [described]:
        for resource in getattr(response, "resources", []):
            for entry in resource[4]:
                if entry[1] is not None:
                    values[str(entry[0])] = str(entry[1])
    return values
