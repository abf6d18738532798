"""A broker outage under an engine's producers leaves nothing in its log (issue 31, defect 12).

kafka-python's close() raises KafkaTimeoutError when records are pending and leaves its I/O
thread running; the garbage collector's __del__ then printed an `Exception ignored in
KafkaProducer.__del__` traceback to the engine's stderr once per outage.
"""

from __future__ import annotations

import gc
import threading
import time

from kafka import KafkaProducer

from controller.fleet import channel as channel_module
from controller.fleet.channel import KafkaChannel
from controller.fleet.table_log import control
from controller.status import StatusPublisher
from fitter.kafka_clients import close_producer
from producers.kafka_sink import KafkaSink, KafkaSinkConfig
from schemas import TableKey, records_to_table
from schemas.settings import Settings
from tabletune.broker import EmbeddedBroker
from tests.test_schemas.strategies import sample_records

KEY = TableKey("m", "ngram", "cpu")


THREAD_STOP_S = 10.0
"""How long a closed producer's I/O thread may take to end on a loaded machine: it is
stopped, not joined, by a bounded close."""


def _producer_threads(before: set[threading.Thread]) -> list[str]:
    """kafka-python I/O threads started since `before` and still running once each has had
    THREAD_STOP_S to end (a leaked one never ends)."""
    deadline = time.monotonic() + THREAD_STOP_S
    while True:
        running = [t for t in set(threading.enumerate()) - before
                   if t.is_alive() and t.name.endswith("-network-thread")]
        if not running or time.monotonic() > deadline:
            return sorted(t.name for t in running)
        running[0].join(timeout=0.1)


def test_close_fails_what_a_dead_broker_holds_and_stops_the_thread(capfd):
    before = set(threading.enumerate())
    with EmbeddedBroker() as broker:
        producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
        producer.send("tabletune.status", b"up").get(timeout=10)
        broker.stop(timeout_s=0.1)  # an outage, not a graceful stop
        failed = []
        producer.send("tabletune.status", b"down").add_errback(failed.append)
        started = time.monotonic()
        assert close_producer(producer, timeout_s=0.2) is False
        assert time.monotonic() - started < 3.0
    assert len(failed) == 1  # the errback ran: a caller can keep what was not delivered
    del producer
    gc.collect()
    assert _producer_threads(before) == []
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "Traceback" not in err


def test_a_broker_outage_under_sink_status_and_channel_leaves_no_traceback(
        capfd, monkeypatch, unique_name):
    monkeypatch.setattr(channel_module, "ACK_TIMEOUT_S", 0.5)
    before = set(threading.enumerate())
    with EmbeddedBroker() as broker:
        settings = Settings(bootstrap_servers=(broker.bootstrap,))
        status = StatusPublisher(settings, unique_name, str(KEY))
        sink = KafkaSink(settings, KafkaSinkConfig(send_timeout_s=30.0))
        channel = KafkaChannel(settings)
        status.emit("started")
        sink.write(records_to_table(sample_records(10, engine_id=unique_name)))
        assert sink.flush(timeout_s=10)
        channel.send(control(KEY, "unpin"))
        assert channel.unsent == 0

        broker.stop(timeout_s=0.1)  # each producer now holds a record the broker will never take
        status.emit("applied", version=1)
        sink.write(records_to_table(sample_records(10, engine_id=unique_name, first_seq=10)))
        channel.send(control(KEY, "unpin"))
        assert channel.unsent == 1 and channel.errors == 1  # kept for the broker's return
        started = time.monotonic()
        sink.close(timeout_s=0.5)
        status.close(timeout_s=0.5)
        channel.close()
        assert time.monotonic() - started < 5.0
        assert sink.counters()["sent_frames"] == 1
    del status, sink, channel
    gc.collect()
    assert _producer_threads(before) == []
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "Traceback" not in err
