"""Ingest against the real broker when things go wrong: compression bombs and oversized
frames, a topic whose offsets restart under a kept dataset, rebalances while windows are
open, and batch mode that must not call itself done while partitions are unread."""

from __future__ import annotations

import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic

from fitter.dataset import read_dataset
from fitter.ingest import IngestConfig, Ingestor, partition_bounds
from schemas import FrameError, decode_frame, encode_frame, records_to_table
from schemas.frames import HEADER_RECORDS
from schemas.settings import Settings, SettingsError, TopicNames
from tabletune.cli import main
from tests.test_schemas.strategies import sample_records

RECORDS_PER_FRAME = 50


def _topics(broker, name: str, partitions: int) -> TopicNames:
    names = TopicNames(telemetry=f"{name}.telemetry", tables=f"{name}.tables",
                       status=f"{name}.status", dlq=f"{name}.dlq")
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic(names.telemetry, partitions, 1), NewTopic(names.dlq, 1, 1)])
    admin.close()
    return names


def _settings(broker, topics: TopicNames) -> Settings:
    return Settings(bootstrap_servers=(broker.bootstrap,), topics=topics)


def _send_frames(producer: KafkaProducer, topic: str, engine: str, partition: int,
                 frames: int, first_frame: int = 0) -> set[tuple[str, int]]:
    keys = set()
    for f in range(first_frame, first_frame + frames):
        records = sample_records(RECORDS_PER_FRAME, engine_id=engine,
                                 first_seq=f * RECORDS_PER_FRAME)
        frame = encode_frame(records_to_table(records))
        producer.send(topic, key=frame.key, value=frame.value, headers=frame.headers,
                      partition=partition)
        keys.update((r.engine_id, r.step_seq) for r in records)
    return keys


def _wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `condition` until it holds; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.05)


def _raw_keys(out: Path) -> list[tuple[str, int]]:
    """Every stored row's identity, across all files, before any dedupe."""
    files = sorted(out.rglob("*.parquet"))
    if not files:
        return []
    raw = pa.concat_tables([pq.read_table(f, columns=["engine_id", "step_seq"])
                            for f in files])
    return list(zip(raw.column("engine_id").to_pylist(), raw.column("step_seq").to_pylist(),
                    strict=True))


# ---- defect 2: bounded decompression and frame size ------------------------------------

def _zero_bomb(size: int, *, declare: bool) -> bytes:
    compressor = zstandard.ZstdCompressor(write_content_size=declare)
    if declare:
        return compressor.compress(bytes(size))
    chunk, parts = bytes(1 << 20), []
    stream = compressor.compressobj()
    parts = [stream.compress(chunk) for _ in range(size >> 20)]
    return b"".join([*parts, stream.flush()])


def test_decode_frame_refuses_a_bomb_without_expanding_it():
    bomb = _zero_bomb(256 << 20, declare=False)  # no content size: stream to the bound only
    assert len(bomb) < 20_000
    tracemalloc.start()
    try:
        with pytest.raises(FrameError) as refused:
            decode_frame(bomb, max_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.reason == "too_large"
    assert peak < 8 << 20
    with pytest.raises(FrameError) as declared:  # declared size: refused before expanding
        decode_frame(_zero_bomb(256 << 20, declare=True))
    assert declared.value.reason == "too_large" and "declares" in declared.value.detail


def test_oversized_frames_go_to_the_dlq_and_good_ones_still_land(broker, tmp_path,
                                                                  unique_name):
    topics = _topics(broker, unique_name, 1)
    many = encode_frame(records_to_table(sample_records(300, engine_id="many")))
    liar = [(k, b"5" if k == HEADER_RECORDS else v) for k, v in many.headers]
    bad = {
        "undeclared_bomb": (_zero_bomb(200 << 20, declare=False), []),
        "declared_bomb": (_zero_bomb(200 << 20, declare=True), []),
        "many_records": (many.value, many.headers),
        "lying_header": (many.value, liar),
    }
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    for value, headers in bad.values():
        producer.send(topics.telemetry, key=b"bad", value=value, headers=headers)
    good = _send_frames(producer, topics.telemetry, "good", 0, 4)
    producer.flush(timeout=10)
    producer.close()
    config = IngestConfig(out_dir=tmp_path / "parquet", group_id=unique_name, until_idle_s=1.0,
                          max_frame_bytes=8 << 20, max_frame_records=200)
    counters = Ingestor(_settings(broker, topics), config).run()
    assert counters.dlq_reasons == {"too_large": 2, "too_many_records": 2}
    assert set(_raw_keys(tmp_path / "parquet")) == good
    assert counters.records == len(good)


def test_frame_bounds_are_checked_settings(tmp_path, capsys):
    with pytest.raises(SettingsError, match="max_frame_bytes"):
        IngestConfig(out_dir=tmp_path, max_frame_bytes=0)
    with pytest.raises(SettingsError, match="max_frame_records"):
        IngestConfig(out_dir=tmp_path, max_frame_records=10**9)
    assert main(["ingest", "--bootstrap", "127.0.0.1:9", "--out", str(tmp_path),
                 "--max-frame-records", "0"]) == 2  # a usage error, naming the flag
    assert "--max-frame-records" in capsys.readouterr().err


# ---- defect 3: offsets that restart under a kept dataset --------------------------------

def test_a_recreated_topic_loses_nothing_to_the_files_of_the_old_one(broker, tmp_path,
                                                                      unique_name):
    topics = _topics(broker, unique_name, 2)
    settings = _settings(broker, topics)
    out = tmp_path / "parquet"
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    old = _send_frames(producer, topics.telemetry, "old-a", 0, 4)
    old |= _send_frames(producer, topics.telemetry, "old-b", 1, 4)
    producer.flush(timeout=10)
    producer.close()
    config = IngestConfig(out_dir=out, group_id=unique_name, until_idle_s=1.0)
    assert Ingestor(settings, config).run().records == len(old)

    # The same topic name again, offsets from 0: same partitions, same hour folder.
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.delete_topics([topics.telemetry])
    time.sleep(0.5)
    admin.create_topics([NewTopic(topics.telemetry, 2, 1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    new = _send_frames(producer, topics.telemetry, "new-a", 0, 4)  # offsets 0-3, as before
    new |= _send_frames(producer, topics.telemetry, "new-b", 1, 6)  # 0-5: 0-3 named before
    producer.flush(timeout=10)
    producer.close()
    counters = Ingestor(settings, IngestConfig(out_dir=out, group_id=f"{unique_name}-2",
                                               until_idle_s=1.0)).run()
    assert counters.records == len(new) and counters.skipped_duplicates == 0
    assert counters.reset_records == 8 * RECORDS_PER_FRAME
    keys = _raw_keys(out)
    assert len(keys) == len(set(keys)) and set(keys) == old | new  # all, once each
    assert read_dataset(out).height == len(old | new)

    # Replaying the new topic from the start (a crash before any commit) adds nothing.
    replay = Ingestor(settings, IngestConfig(out_dir=out, group_id=f"{unique_name}-3",
                                             until_idle_s=1.0)).run()
    assert replay.records == 0 and replay.skipped_duplicates == len(new)
    assert sorted(_raw_keys(out)) == sorted(keys)


# ---- defect 4: rebalances while windows are open ----------------------------------------

class Crash(RuntimeError):
    pass


def test_replicas_joining_and_crashing_mid_run_lose_and_duplicate_nothing(broker, tmp_path,
                                                                          unique_name):
    partitions = 4
    topics = _topics(broker, unique_name, partitions)
    settings = _settings(broker, topics)
    out = tmp_path / "parquet"
    sent: set[tuple[str, int]] = set()
    producing = threading.Event()
    producing.set()

    def produce() -> None:
        producer = KafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=5)
        frame = 0
        while producing.is_set():
            for p in range(partitions):
                sent.update(_send_frames(producer, topics.telemetry, f"e{p}", p, 1, frame))
            frame += 1
            time.sleep(0.05)
        producer.flush(timeout=10)
        producer.close()

    results: dict[str, object] = {}

    def replica(name: str, config: IngestConfig, on_stage=None) -> Ingestor:
        ingestor = Ingestor(settings, config, on_stage=on_stage)

        def run() -> None:
            try:
                results[name] = ingestor.run()
            except BaseException as exc:  # reported by the test
                results[name] = exc

        threading.Thread(target=run, name=name, daemon=True).start()
        return ingestor

    def config(**overrides) -> IngestConfig:
        return IngestConfig(out_dir=out, group_id=unique_name, window_s=1.5,
                            window_records=10**6, **overrides)

    armed = threading.Event()

    def crash_when_armed(stage: str) -> None:
        if stage == "renamed" and armed.is_set():
            raise Crash("after the rename, before the commit")

    everything = frozenset(range(partitions))

    def shared(*replicas: Ingestor) -> bool:
        """Each replica holds partitions, none twice, all of them between them."""
        held = [r.assignment for r in replicas]
        return all(held) and sum(map(len, held)) == partitions \
            and frozenset().union(*held) == everything

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    a = replica("a", config(), on_stage=crash_when_armed)
    _wait_until(lambda: a.assignment == everything and a.counters.frames >= partitions, 30,
                "a joins and holds open windows on every partition")
    b = replica("b", config())  # joins mid-run: a's open windows are revoked
    _wait_until(lambda: shared(a, b) and b.counters.windows > 0, 60,
                "a and b share the partitions and b commits")
    armed.set()  # a dies between its next rename and commit: b re-reads those offsets
    deadline = time.monotonic() + 30
    while "a" not in results and time.monotonic() < deadline:
        time.sleep(0.1)
    c = replica("c", config(until_idle_s=1.0, lag_wait_s=20))  # joins: a rebalance again
    _wait_until(lambda: shared(b, c) and c.counters.windows > 0, 60,
                "b and c share the partitions and c commits")
    producing.clear()
    producer.join(timeout=15)  # its last frames flushed
    b.stop()  # leaves: c takes its partitions and catches up
    deadline = time.monotonic() + 60
    while not {"b", "c"} <= set(results) and time.monotonic() < deadline:
        time.sleep(0.1)

    assert isinstance(results["a"], Crash)
    assert not isinstance(results.get("b"), BaseException), results.get("b")
    assert not isinstance(results.get("c"), BaseException), results.get("c")
    assert {"b", "c"} <= set(results)
    keys = _raw_keys(out)
    assert len(keys) == len(set(keys)), "duplicates on disk"
    assert set(keys) == sent, f"{len(sent - set(keys))} records lost"
    # the scenario happened: open windows given up in a rebalance, a renamed window re-read
    assert sum(r.counters.abandoned_windows + r.counters.commit_failures for r in (a, b, c)) > 0
    assert b.counters.skipped_duplicates + c.counters.skipped_duplicates > 0
    assert results["c"].unread == {}


# ---- defect 5: batch mode ends only when caught up --------------------------------------

def test_partition_bounds_are_the_true_end_offsets(broker, unique_name):
    topics = _topics(broker, unique_name, 3)
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    for _batch in range(3):  # several batches per partition: end_offsets' weak spot
        for _i in range(5):
            producer.send(topics.telemetry, b"x", partition=0)
        producer.flush(timeout=10)
    producer.send(topics.telemetry, b"x", partition=1)
    producer.flush(timeout=10)
    producer.close()
    bounds = partition_bounds(Settings(bootstrap_servers=(broker.bootstrap,)),
                              topics.telemetry)
    assert bounds == {0: (0, 15), 1: (0, 1), 2: (0, 0)}


def test_until_idle_fails_naming_the_lag_while_a_member_holds_partitions(
        broker, tmp_path, unique_name, monkeypatch, capsys):
    topics = _topics(broker, unique_name, 3)
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    sent: set[tuple[str, int]] = set()
    for p in range(3):
        sent |= _send_frames(producer, topics.telemetry, f"e{p}", p, 3)
    producer.flush(timeout=10)
    producer.close()

    # A member of the same group that consumes and never commits (stuck, or a zombie).
    # Its short poll interval bounds how long the group waits for it after it is gone.
    settings = _settings(broker, topics)
    holding = threading.Event()
    holding.set()
    holder = KafkaConsumer(**settings.consumer_kwargs(group_id=unique_name,
                                                      enable_auto_commit=False,
                                                      max_poll_interval_ms=6000))
    holder.subscribe([topics.telemetry])

    def hold() -> None:
        while holding.is_set():
            holder.poll(timeout_ms=100)
        holder.close(autocommit=False)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not holder.assignment() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert holder.assignment()

    monkeypatch.setenv("TABLETUNE_TOPIC_TELEMETRY", topics.telemetry)
    monkeypatch.setenv("TABLETUNE_TOPIC_DLQ", topics.dlq)
    out = tmp_path / "parquet"
    argv = ["ingest", "--bootstrap", broker.bootstrap, "--out", str(out), "--group",
            unique_name, "--until-idle", "1", "--lag-wait", "3"]
    try:
        assert main(argv) == 3
        # Let the holder take the whole topic before it leaves: a group whose leader leaves
        # mid-rebalance is left (on Tansu) waiting for that leader's assignment. 20 s was
        # once too short on a fresh clone (the next run then saw a 60 s rebalance).
        deadline = time.monotonic() + 60
        while len(holder.assignment()) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        holding.clear()
        thread.join(timeout=10)
    err = capsys.readouterr().err
    assert "not caught up" in err and "partition" in err and "committed" in err
    assert set(_raw_keys(out)) < sent

    # The holder gone, the same job catches up and succeeds.
    assert main(argv) == 0
    keys = _raw_keys(out)
    assert len(keys) == len(set(keys)) and set(keys) == sent

