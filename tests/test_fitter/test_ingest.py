"""Ingest against the real broker: windows to Parquet, crash/restart, dead letters."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import zstandard
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic

from fitter.dataset import read_dataset
from fitter.ingest import IngestConfig, Ingestor
from schemas import encode_frame, records_to_table
from schemas.frames import HEADER_SCHEMA_VERSION
from schemas.settings import Settings, TopicNames
from tests.test_schemas.strategies import sample_records

FRAMES_PER_ENGINE = 6
RECORDS_PER_FRAME = 50


@pytest.fixture
def topics(broker, unique_name) -> TopicNames:
    names = TopicNames(telemetry=f"{unique_name}.telemetry", tables=f"{unique_name}.tables",
                       status=f"{unique_name}.status", dlq=f"{unique_name}.dlq")
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic(names.telemetry, 3, 1), NewTopic(names.dlq, 1, 1)])
    admin.close()
    return names


def _settings(broker, topics) -> Settings:
    return Settings(bootstrap_servers=(broker.bootstrap,), topics=topics)


def _produce(broker, topics, engines=("e1", "e2", "e3")) -> int:
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    total = 0
    for engine in engines:
        for f in range(FRAMES_PER_ENGINE):
            records = sample_records(RECORDS_PER_FRAME, engine_id=engine,
                                     first_seq=f * RECORDS_PER_FRAME)
            frame = encode_frame(records_to_table(records))
            producer.send(topics.telemetry, key=frame.key, value=frame.value,
                          headers=frame.headers)
            total += len(records)
    producer.flush(timeout=10)
    producer.close()
    return total


def _config(tmp_path, group: str, **overrides) -> IngestConfig:
    return IngestConfig(out_dir=tmp_path / "parquet", group_id=group, until_idle_s=2.0,
                        **overrides)


def test_ingest_writes_hive_partitioned_parquet(broker, topics, tmp_path, unique_name):
    total = _produce(broker, topics)
    counters = Ingestor(_settings(broker, topics), _config(tmp_path, unique_name)).run()
    assert counters.records == total and counters.dlq == 0
    frame = read_dataset(tmp_path / "parquet")
    assert frame.height == total
    assert set(frame["engine_id"].unique()) == {"e1", "e2", "e3"}
    files = list((tmp_path / "parquet").rglob("*.parquet"))
    assert files and all("model=m/drafter=ngram/hardware=cpu/date=" in f.as_posix()
                         for f in files)
    assert all(f.name.startswith(f"{topics.telemetry}-p") for f in files)
    # A second run of the same group finds nothing new.
    again = Ingestor(_settings(broker, topics), _config(tmp_path, unique_name)).run()
    assert again.records == 0


class Crash(RuntimeError):
    pass


@pytest.mark.parametrize("stage", ["temp_written", "renamed", "dlq_flushed"])
def test_crash_between_write_and_commit_loses_and_duplicates_nothing(
        broker, topics, tmp_path, unique_name, stage):
    total = _produce(broker, topics)

    def crash(at: str) -> None:
        if at == stage:
            raise Crash(at)

    with pytest.raises(Crash):
        Ingestor(_settings(broker, topics),
                 _config(tmp_path, unique_name, window_records=120), on_stage=crash).run()
    resumed = Ingestor(_settings(broker, topics), _config(tmp_path, unique_name,
                                                          window_records=100)).run()
    files = list((tmp_path / "parquet").rglob("*.parquet"))
    raw = pa.concat_tables([pa.parquet.read_table(f) for f in files])
    keys = list(zip(raw.column("engine_id").to_pylist(), raw.column("step_seq").to_pylist(),
                    strict=True))
    assert len(keys) == len(set(keys)) == total  # no loss, no duplicate, even before dedupe
    assert not list((tmp_path / "parquet").rglob(".tmp-*"))
    if stage == "renamed" or stage == "dlq_flushed":
        assert resumed.skipped_duplicates > 0


def _bad_frames() -> dict[str, tuple[bytes, list]]:
    good = encode_frame(records_to_table(sample_records(5, engine_id="bad")))
    table = records_to_table(sample_records(5, engine_id="bad"))
    sink = io.BytesIO()
    dropped = table.drop_columns(["kv_tokens"])
    with ipc.new_stream(sink, dropped.schema) as writer:
        writer.write_table(dropped)
    missing = zstandard.ZstdCompressor().compress(sink.getvalue())
    retyped = table.set_column(table.schema.get_field_index("k"), "k",
                               table.column("k").cast(pa.float64()))
    sink = io.BytesIO()
    with ipc.new_stream(sink, retyped.schema) as writer:
        writer.write_table(retyped)
    wrong = zstandard.ZstdCompressor().compress(sink.getvalue())
    return {
        "empty": (b"", []),
        "not_zstd": (b'{"json": true}', []),
        "truncated": (good.value[: len(good.value) // 2], []),
        "corrupt": (zstandard.ZstdCompressor().compress(b"not arrow at all"), []),
        "unknown_schema_version": (good.value, [(HEADER_SCHEMA_VERSION, b"42")]),
        "missing_column": (missing, []),
        "wrong_type": (wrong, []),
    }


def test_each_kind_of_bad_frame_goes_to_the_dlq(broker, topics, tmp_path, unique_name):
    bad = _bad_frames()
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    for value, headers in bad.values():
        producer.send(topics.telemetry, key=b"bad", value=value, headers=headers,
                      partition=0)
    producer.flush(timeout=10)
    producer.close()
    total = _produce(broker, topics, engines=("good",))
    counters = Ingestor(_settings(broker, topics), _config(tmp_path, unique_name)).run()
    assert counters.records == total  # good data still ingested around the bad
    assert counters.dlq == len(bad)
    assert counters.dlq_reasons == {reason: 1 for reason in bad}

    consumer = KafkaConsumer(bootstrap_servers=broker.bootstrap, enable_auto_commit=False)
    tp = TopicPartition(topics.dlq, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    messages = []
    for _ in range(50):
        for batch in consumer.poll(timeout_ms=200).values():
            messages.extend(batch)
        if len(messages) >= len(bad):
            break
    consumer.close()
    reasons = {dict(m.headers)["tabletune-dlq-reason"].decode(): m for m in messages}
    assert set(reasons) == set(bad)
    for reason, message in reasons.items():
        assert message.value == bad[reason][0]  # the bad bytes are kept as they were
        headers = dict(message.headers)
        assert headers["tabletune-source-partition"] == b"0"
        assert message.key.decode().startswith(f"{topics.telemetry}:0:")
        assert headers["tabletune-dlq-detail"]


def test_read_dataset_reads_files_of_both_schema_versions(tmp_path):
    """A fleet mid-upgrade leaves version-1 files (no finished_requests) beside version-2
    ones; the dataset reads both, the older rows with no requests."""
    hour = tmp_path / "model=m" / "drafter=ngram" / "hardware=h" / "date=2026-12-01"
    finished = {"request": 0, "segment": 3, "decode_steps": 4, "drafting_steps": 4,
                "tokens": 9, "context_tokens": 40, "reached_per_pos": [4], "accepted_per_pos": [3]}
    version_2 = records_to_table([dataclasses.replace(
        sample_records(1, engine_id="e", first_seq=2)[0], finished_requests=(finished,))])
    version_1 = records_to_table(sample_records(1, engine_id="e", first_seq=1)).drop_columns(
        ["finished_requests"])
    for number, table in enumerate([version_1, version_2]):
        folder = hour / f"hour={number}"
        folder.mkdir(parents=True)
        pq.write_table(table, folder / f"telemetry-0-{number}-{number}.parquet")
    frame = read_dataset(tmp_path)
    assert frame.get_column("step_seq").to_list() == [1, 2]
    requests = frame.get_column("finished_requests").to_list()
    assert requests[0] is None and requests[1][0]["segment"] == 3


def test_twin_run_telemetry_reaches_parquet_whole(broker, topics, tmp_path, unique_name):
    """`tabletune twin run --sink kafka://...` then ingest, as docs/TWIN.md shows: every step
    lands in Parquet and none is dead-lettered (in memory the twin's clock starts in 1970,
    which ingest's checks refuse; for a real sink its records are stamped from now)."""
    scenario = tmp_path / "s.toml"
    scenario.write_text('seed = 1\n[[phases]]\nduration_s = 5\nconcurrency = 4\n'
                        'acceptance = [0.7, 0.6, 0.6]\nprompt_len = 100\noutput_len = 50\n')
    env = {**os.environ, "TABLETUNE_TOPIC_TELEMETRY": topics.telemetry}
    started_ns = time.time_ns()
    run = subprocess.run([sys.executable, "-m", "tabletune.cli", "twin", "run", "--scenario",
                          str(scenario), "--policy", "fixed:2", "--json",
                          "--sink", f"kafka://{broker.bootstrap}"],
                         capture_output=True, text=True, timeout=120, env=env, check=True)
    steps = json.loads(run.stdout)["steps"]
    ingest = Ingestor(_settings(broker, topics), _config(tmp_path, unique_name))
    ingest.run()
    assert ingest.counters.dlq == 0 and ingest.counters.invalid_records == 0
    stored = read_dataset(tmp_path / "parquet")
    assert stored.height == steps > 0
    assert stored["ts_ns"].min() >= started_ns
