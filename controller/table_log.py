"""Writing to and reading from the tables topic outside engines (fitter, operators)."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition

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
from schemas.settings import Settings


@dataclass(frozen=True, slots=True)
class LogEntry:
    offset: int
    timestamp_ms: int
    message: TableEnvelope | TableControl | None
    error: str | None = None


def publish(settings: Settings, message: TableEnvelope | TableControl) -> int:
    """Sign (when a signing key is configured) and publish; returns the offset."""
    if settings.signing_key_id is not None and settings.signing_secret is not None:
        message = message.signed(settings.signing_key_id, settings.signing_secret)
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
