"""The Kafka sink against a real broker, and against no broker at all."""

from __future__ import annotations

import time

from producers.identity import EngineIdentity
from producers.kafka_sink import KafkaSink, KafkaSinkConfig
from producers.recorder import RecorderConfig, StepRecorder
from producers.sinks import sink_from_url
from schemas import records_to_table
from schemas.settings import Settings
from tabletune.broker import free_port
from tests.kafka_helpers import read_telemetry
from tests.test_producers.test_recorder import record
from tests.test_schemas.strategies import sample_records


def test_frames_reach_the_broker_keyed_by_engine(broker, unique_name):
    identity = EngineIdentity(unique_name, "llama", "eagle", "h100")
    sink = sink_from_url(f"kafka://{broker.bootstrap}")
    recorder = StepRecorder(identity, sink, max_k=4, config=RecorderConfig(frame_records=64))
    for i in range(500):
        record(recorder, i)
    assert recorder.flush(timeout_s=10)
    counters = recorder.counters()
    assert counters["sink_sent_records"] == 500 and counters["sink_dropped_frames"] == 0
    recorder.close()
    table = read_telemetry(broker.bootstrap, engine_id=unique_name, min_records=500)
    assert table.column("step_seq").to_pylist() == list(range(500))


def test_no_broker_drops_oldest_frames_within_bounds():
    settings = Settings(bootstrap_servers=(f"127.0.0.1:{free_port()}",))
    sink = KafkaSink(settings, KafkaSinkConfig(max_queued_frames=5, retry_backoff_s=0.05))
    started = time.monotonic()
    for first in range(0, 20 * 10, 10):
        sink.write(records_to_table(sample_records(10, first_seq=first)))
    assert time.monotonic() - started < 2.0  # write() only enqueues
    assert sink.flush(timeout_s=0.5) is False
    counters = sink.counters()
    assert counters["queue_frames"] <= 5
    # 20 frames: at most 5 queued, at most 1 in the sender's hands, the rest dropped.
    assert counters["dropped_frames"] >= 14
    assert counters["dropped_records"] == 10 * counters["dropped_frames"]
    assert counters["sent_frames"] == 0
    sink.close(timeout_s=1)
