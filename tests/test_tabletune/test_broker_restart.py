"""The embedded broker on S3 storage (tabletune.s3_emulator): a stop and a start on the same
storage keep topics, records and group offsets, and two idempotent producers both work (the
reason for moto rather than s3rver). Skipped where moto's server is not installed."""

from __future__ import annotations

import time

import pytest
from kafka import KafkaConsumer, KafkaProducer, OffsetAndMetadata, TopicPartition

from tabletune.broker import BrokerError, EmbeddedBroker, TopicLayout
from tabletune.s3_emulator import S3Emulator, ensure_moto_server


@pytest.fixture
def s3():
    try:
        ensure_moto_server(install=False)
    except BrokerError as exc:
        pytest.skip(str(exc))
    with S3Emulator() as emulator:
        yield emulator


def _read(bootstrap: str, topic: str, partitions: int, expected: int) -> list[bytes]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                             auto_offset_reset="earliest")
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        values: list[bytes] = []
        deadline = time.monotonic() + 20
        while len(values) < expected and time.monotonic() < deadline:
            for messages in consumer.poll(timeout_ms=200).values():
                values.extend(m.value for m in messages)
        return values
    finally:
        consumer.close()


def test_a_broker_on_s3_storage_keeps_records_and_offsets_over_a_restart(s3):
    layout = TopicLayout(telemetry_partitions=2)
    topic = layout.names.telemetry
    broker = EmbeddedBroker(layout=layout, storage=s3.storage_url, storage_env=s3.env)
    bootstrap = broker.start()
    try:
        producers = [KafkaProducer(bootstrap_servers=bootstrap) for _ in range(2)]
        futures = [producer.send(topic, f"{i}-{n}".encode(), partition=n % 2)
                   for i, producer in enumerate(producers) for n in range(10)]
        for producer in producers:
            producer.flush(timeout=20)
            producer.close()
        assert all(f.succeeded() for f in futures)  # both idempotent producers acknowledged
        group = KafkaConsumer(bootstrap_servers=bootstrap, group_id="restart",
                              enable_auto_commit=False)
        group.assign([TopicPartition(topic, 0)])
        group.commit({TopicPartition(topic, 0): OffsetAndMetadata(7, "", -1)})
        group.close()

        broker.stop()
        assert broker.start() == bootstrap  # same port, same storage

        assert sorted(_read(bootstrap, topic, 2, 20)) == sorted(
            f"{i}-{n}".encode() for i in range(2) for n in range(10))
        group = KafkaConsumer(bootstrap_servers=bootstrap, group_id="restart",
                              enable_auto_commit=False)
        assert group.committed(TopicPartition(topic, 0)) == 7
        group.close()
    finally:
        broker.stop()
