"""Reading telemetry back from a real broker in tests: explicit offsets, idle-poll end; and
waiting for what a broker delivers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pyarrow as pa
from kafka import KafkaConsumer, TopicPartition

from schemas import STEP_RECORD_SCHEMA, decode_frame
from schemas.settings import Settings

T = TypeVar("T")


def read_telemetry(bootstrap: str, *, topic: str = "tabletune.telemetry",
                   min_records: int = 1, timeout_s: float = 30.0,
                   engine_id: str | None = None) -> pa.Table:
    """All step records on the topic (optionally one engine's), once at least `min_records`
    arrived and the topic has been idle for a moment, or when the timeout is reached."""
    settings = Settings(bootstrap_servers=(bootstrap,))
    consumer = KafkaConsumer(**settings.consumer_kwargs(enable_auto_commit=False))
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        tables: list[pa.Table] = []
        count = 0
        deadline = time.monotonic() + timeout_s
        idle_polls = 0
        while time.monotonic() < deadline:
            batches = consumer.poll(timeout_ms=200)
            if not batches:
                idle_polls += 1
                if count >= min_records and idle_polls >= 3:
                    break
                continue
            idle_polls = 0
            for messages in batches.values():
                for message in messages:
                    if engine_id is not None and message.key != engine_id.encode():
                        continue
                    table = decode_frame(message.value, message.headers)
                    tables.append(table)
                    count += table.num_rows
        if not tables:
            return STEP_RECORD_SCHEMA.empty_table()
        return pa.concat_tables(tables).sort_by([("engine_id", "ascending"),
                                                 ("step_seq", "ascending")])
    finally:
        consumer.close()


def wait_for(predicate: Callable[[], T], timeout_s: float, step_s: float = 0.25) -> T:
    """Polls `predicate` every `step_s` until it returns something truthy, which it returns;
    past `timeout_s`, whatever it returns then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step_s)
    return predicate()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Polls `predicate` until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False
