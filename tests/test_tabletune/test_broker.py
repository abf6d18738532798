"""Frames through the real embedded broker, and the `tabletune broker` command."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from schemas import decode_frame, encode_frame, records_to_table, table_to_records
from schemas.settings import Settings
from tabletune.broker import EmbeddedBroker
from tests.kafka_helpers import read_telemetry
from tests.test_schemas.strategies import sample_records


def _consume_all(bootstrap: str, topic: str, expected: int, timeout_s: float = 5.0):
    settings = Settings(bootstrap_servers=(bootstrap,))
    consumer = KafkaConsumer(**settings.consumer_kwargs(enable_auto_commit=False))
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        messages = []
        deadline = time.monotonic() + timeout_s
        while len(messages) < expected and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=200).values():
                messages.extend(batch)
        return messages
    finally:
        consumer.close()


def test_frames_round_trip_through_broker(broker: EmbeddedBroker, unique_name: str):
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    sent = []
    engines = [f"{unique_name}-{suffix}" for suffix in "abc"]
    for engine in engines:
        records = sample_records(300, engine_id=engine)
        frame = encode_frame(records_to_table(records))
        producer.send("tabletune.telemetry", key=frame.key, value=frame.value,
                      headers=frame.headers)
        sent.append(records)
    producer.flush(timeout=10)
    producer.close()

    # The session broker's topic is shared with other tests: keep this test's engines.
    received = {}
    for engine in engines:
        table = read_telemetry(broker.bootstrap, engine_id=engine, min_records=300)
        received[engine] = table_to_records(table)
    assert received == {records[0].engine_id: records for records in sent}


def test_broker_command_prints_bootstrap_and_stops_on_sigterm(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "tabletune.cli", "broker"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        bootstrap = process.stdout.readline().strip()
        assert bootstrap.startswith("127.0.0.1:")
        producer = KafkaProducer(bootstrap_servers=bootstrap)
        frame = encode_frame(records_to_table(sample_records(10)))
        producer.send("tabletune.telemetry", key=frame.key, value=frame.value,
                      headers=frame.headers).get(timeout=10)
        producer.close()
        messages = _consume_all(bootstrap, "tabletune.telemetry", expected=1)
        assert table_to_records(decode_frame(messages[0].value)) == sample_records(10)
        topics = KafkaConsumer(bootstrap_servers=bootstrap)
        assert {"tabletune.telemetry", "tabletune.tables", "tabletune.status",
                "tabletune.dlq"} <= topics.topics()
        topics.close()
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    # The Tansu child went with it: nothing listens on the port any more.
    assert not _listening(bootstrap)


def _listening(bootstrap: str) -> bool:
    import socket
    host, port = bootstrap.split(":")
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, int(port))) == 0


def test_broker_restart_on_same_port_loses_topics_and_recreates_them():
    broker = EmbeddedBroker()
    broker.start()
    port = broker.port
    pid = broker.pid
    broker.stop()
    assert not _listening(f"127.0.0.1:{port}")
    with EmbeddedBroker(port=port) as again:
        assert again.pid != pid
        consumer = KafkaConsumer(bootstrap_servers=again.bootstrap)
        assert "tabletune.tables" in consumer.topics()
        consumer.close()
    assert not _listening(f"127.0.0.1:{port}")
