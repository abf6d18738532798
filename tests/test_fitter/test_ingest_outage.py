"""Ingest through a broker restart, as the soak (bench/ingest_soak.py) found it: the poll
and the consumer calls the loop makes between polls (commit, committed offsets, positions
for the lag) and the dead-letter flush fail with kafka-python's retriable errors while the
broker is away (two of three replicas exited 1, `error: Kafka at ...: KafkaConnectionError:
111 ECONNREFUSED`, seven seconds into a broker restart: from the commit, then from
kafka-python 3.0's poll); and engines send frames again that the broker had written (their
acknowledgements lost), so the topic holds records twice."""

from __future__ import annotations

import threading

import pyarrow as pa
import pyarrow.parquet as pq
from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import KafkaConnectionError, KafkaTimeoutError

import fitter.ingest.catch_up
import fitter.ingest.dead_letters
import fitter.ingest.ingestor
from fitter.ingest import IngestConfig, Ingestor
from tests.test_fitter.test_ingest_hardening import (
    RECORDS_PER_FRAME,
    _raw_keys,
    _send_frames,
    _settings,
    _topics,
)


class _Outage:
    """Fails the first `n` calls of each patched method, as a broker that is away."""

    def __init__(self, n: int) -> None:
        self.left: dict[str, int] = {}
        self.n = n
        self.raised: dict[str, int] = {}
        self.lock = threading.Lock()

    def hit(self, name: str, error: type[Exception] = KafkaConnectionError) -> None:
        with self.lock:
            left = self.left.setdefault(name, self.n)
            if left > 0:
                self.left[name] = left - 1
                self.raised[name] = self.raised.get(name, 0) + 1
                raise error("111 ECONNREFUSED")


def test_a_broker_outage_under_the_loops_consumer_calls_loses_and_duplicates_nothing(
        broker, tmp_path, unique_name, monkeypatch):
    topics = _topics(broker, unique_name, 2)
    settings = _settings(broker, topics)
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    sent = _send_frames(producer, topics.telemetry, "e0", 0, 6)
    sent |= _send_frames(producer, topics.telemetry, "e1", 1, 6)
    bad = producer.send(topics.telemetry, key=b"bad", value=b"not a frame", partition=0)
    producer.flush(timeout=10)
    producer.close()
    assert bad.succeeded()
    outage = _Outage(2)

    class AwayConsumer(KafkaConsumer):
        def poll(self, *args, **kwargs):
            if self.assignment():  # once assigned: windows are open
                outage.hit("poll")
            return super().poll(*args, **kwargs)

        def commit(self, *args, **kwargs):
            outage.hit("commit")
            return super().commit(*args, **kwargs)

        def committed(self, *args, **kwargs):
            outage.hit("committed")
            return super().committed(*args, **kwargs)

        def position(self, *args, **kwargs):
            outage.hit("position")
            return super().position(*args, **kwargs)

    class AwayProducer(KafkaProducer):
        def flush(self, *args, **kwargs):
            outage.hit("flush", KafkaTimeoutError)
            return super().flush(*args, **kwargs)

    monkeypatch.setattr(fitter.ingest.ingestor, "KafkaConsumer", AwayConsumer)
    monkeypatch.setattr(fitter.ingest.catch_up, "KafkaConsumer", AwayConsumer)  # partition_bounds
    monkeypatch.setattr(fitter.ingest.dead_letters, "KafkaProducer", AwayProducer)
    out = tmp_path / "parquet"
    config = IngestConfig(out_dir=out, group_id=unique_name, window_s=0.5, until_idle_s=2.0,
                          lag_wait_s=20)
    ingestor = Ingestor(settings, config)
    ingestor._lag_checked = -1e9  # the lag check (positions) runs at the first poll
    counters = ingestor.run()

    assert set(outage.raised) == {"poll", "commit", "committed", "position", "flush"}
    keys = _raw_keys(out)
    assert len(keys) == len(set(keys)) and set(keys) == sent
    assert counters.commit_failures >= 2  # the window was read again, its files kept
    assert counters.dlq_reasons.get("not_zstd", 0) >= 1
    assert counters.unread == {}


def test_frames_an_engine_sent_again_are_stored_once(broker, tmp_path, unique_name):
    """The soak's broker restart: an engine's sink timed out on frames the broker had
    written, sent them again on a new producer, and the topic held 1,024 records twice (at
    two offsets). Copies in the same window, in a later window, and after an ingest restart
    are dropped; the records at the earlier offsets are the ones stored."""
    topics = _topics(broker, unique_name, 1)
    settings = _settings(broker, topics)
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    sent = _send_frames(producer, topics.telemetry, "e0", 0, 3)           # offsets 0-2
    _send_frames(producer, topics.telemetry, "e0", 0, 1, first_frame=2)   # 3: copy of 2
    sent |= _send_frames(producer, topics.telemetry, "e0", 0, 2, first_frame=3)  # 4-5: 3, 4
    producer.flush(timeout=10)
    out = tmp_path / "parquet"
    config = IngestConfig(out_dir=out, group_id=unique_name, until_idle_s=1.0,
                          window_records=4 * RECORDS_PER_FRAME)  # windows: 0-3 and 4-5 ...
    first = Ingestor(settings, config).run()
    assert first.resent_duplicates == RECORDS_PER_FRAME  # the copy in the first window
    _send_frames(producer, topics.telemetry, "e0", 0, 1, first_frame=4)   # 6: copy of 5
    _send_frames(producer, topics.telemetry, "e0", 0, 1, first_frame=1)   # 7: copy of 1
    sent |= _send_frames(producer, topics.telemetry, "e0", 0, 1, first_frame=5)  # 8
    producer.flush(timeout=10)
    producer.close()
    second = Ingestor(settings, config).run()  # a restart: the originals are in files only
    assert second.resent_duplicates == 2 * RECORDS_PER_FRAME
    keys = _raw_keys(out)
    assert len(keys) == len(set(keys)) and set(keys) == sent
    offsets = pa.concat_tables([pq.read_table(f, columns=["step_seq", "source_offset"])
                                for f in out.rglob("*.parquet")]).to_pydict()
    by_seq = dict(zip(offsets["step_seq"], offsets["source_offset"], strict=True))
    assert by_seq[2 * RECORDS_PER_FRAME] == 2 and by_seq[4 * RECORDS_PER_FRAME] == 5
