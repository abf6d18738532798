"""Semantic checks at ingest, against the real broker: a frame mixing good rows and every
kind of bad one writes the good rows to Parquet and dead-letters each bad one with a reason
naming its field; nothing is lost and the offsets are committed."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic

from fitter.ingest import IngestConfig, Ingestor
from schemas import decode_frame, encode_frame, records_to_table
from schemas.settings import Settings, TopicNames
from schemas.step_checks import MAX_STEP_LATENCY_S, check_steps
from tests.test_schemas.strategies import sample_records


def _ns(year: int) -> int:
    return int(dt.datetime(year, 1, 1, tzinfo=dt.UTC).timestamp()) * 10**9


def _by_match(length: int, *, requests: int, reached: list[int], accepted: list[int]) -> dict:
    return {"match_length": length, "requests": requests, "draft_tokens": len(reached),
            "reached_per_pos": reached, "accepted_per_pos": accepted}


BAD_ROWS = {
    # step_seq within the mixed frame -> (the change, the reason it must be dead-lettered with)
    3: ({"batch_size": -5}, "invalid_batch_size"),
    5: ({"batch_size": 1_000_000}, "invalid_batch_size"),
    7: ({"num_draft_tokens": 4, "num_accepted_tokens": 9}, "invalid_num_accepted_tokens"),
    9: ({"step_latency_s": math.nan}, "invalid_step_latency_s"),
    11: ({"step_latency_s": math.inf}, "invalid_step_latency_s"),
    13: ({"step_latency_s": 0.0}, "invalid_step_latency_s"),
    15: ({"step_latency_s": MAX_STEP_LATENCY_S * 2}, "invalid_step_latency_s"),
    17: ({"ts_ns": _ns(2262)}, "invalid_ts_ns"),  # int64 nanoseconds end in April 2262
    19: ({"ts_ns": _ns(1823)}, "invalid_ts_ns"),
    21: ({"ts_ns": time.time_ns() + 3 * 86_400 * 10**9}, "invalid_ts_ns"),
    23: ({"k": 99}, "invalid_k"),
    25: ({"num_drafts": -1, "num_draft_tokens": 0, "num_accepted_tokens": 0,
          "accepted_per_pos": ()}, "invalid_num_drafts"),
    27: ({"inter_step_s": -0.5}, "invalid_inter_step_s"),
    29: ({"ctx_len_mean": math.nan}, "invalid_ctx_len_mean"),
    31: ({"kv_tokens": -100}, "invalid_kv_tokens"),
    33: ({"num_drafts": 1, "num_draft_tokens": 50, "num_accepted_tokens": 0,
          "accepted_per_pos": (0, 0, 0)}, "invalid_num_draft_tokens"),
    35: ({"accepted_per_pos": (-1, 0, 0)}, "invalid_accepted_per_pos"),
    37: ({"table_version": -2}, "invalid_table_version"),
    39: ({"schema_version": 9}, "invalid_schema_version"),
    41: ({"by_match_length": (_by_match(2, requests=1, reached=[1, 1], accepted=[1, 2]),)},
         "invalid_by_match_length"),  # more accepted than reached
    43: ({"by_match_length": (_by_match(2, requests=10**6, reached=[1], accepted=[1]),)},
         "invalid_by_match_length"),  # more requests than the step decoded
    45: ({"by_match_length": (_by_match(99, requests=1, reached=[1], accepted=[0]),)},
         "invalid_by_match_length"),  # a match longer than any lookup
}
"""Each row breaks one rule only; the reason is `invalid_<the field>`."""


def _mixed_records() -> list:
    records = sample_records(48, engine_id="mixed")
    records[1] = dataclasses.replace(records[1], by_match_length=(  # a good row: 2 decoding
        _by_match(0, requests=1, reached=[0], accepted=[0]),
        _by_match(3, requests=1, reached=[1, 1], accepted=[1, 0])))
    for seq, (change, _) in BAD_ROWS.items():
        records[seq] = dataclasses.replace(records[seq], **change)
    return records


def test_every_kind_of_bad_row_is_charged_to_its_field():
    """The checks alone (no broker): each bad row to its own reason, the good rows kept."""
    table = records_to_table(_mixed_records())
    checks = check_steps(table, now_ns=time.time_ns())
    charged = {int(row): v.reason for v in checks.violations for row in v.rows}
    assert charged == {seq: reason for seq, (_, reason) in BAD_ROWS.items()}
    assert np.flatnonzero(~checks.valid).tolist() == sorted(BAD_ROWS)
    for violation in checks.violations:
        assert violation.detail.startswith(violation.field)
    assert check_steps(records_to_table(sample_records(1024)), now_ns=time.time_ns()).ok


@pytest.fixture
def topics(broker, unique_name) -> TopicNames:
    names = TopicNames(telemetry=f"{unique_name}.telemetry", tables=f"{unique_name}.tables",
                       status=f"{unique_name}.status", dlq=f"{unique_name}.dlq")
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic(names.telemetry, 1, 1), NewTopic(names.dlq, 1, 1)])
    admin.close()
    return names


def _dead_letters(bootstrap: str, topic: str, expected: int) -> list:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    messages: list = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(messages) < expected:
        for batch in consumer.poll(timeout_ms=200).values():
            messages.extend(batch)
    consumer.close()
    return messages


def test_a_frame_of_good_and_bad_rows_writes_the_good_and_dead_letters_the_bad(
        broker, topics, tmp_path, unique_name):
    mixed = _mixed_records()
    nameless = [dataclasses.replace(r, engine_id="") for r in sample_records(4)]
    good = sample_records(30, engine_id="good")
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    for records in (mixed, nameless, good):
        frame = encode_frame(records_to_table(records))
        producer.send(topics.telemetry, key=frame.key, value=frame.value,
                      headers=frame.headers, partition=0)
    producer.flush(timeout=10)
    producer.close()
    settings = Settings(bootstrap_servers=(broker.bootstrap,), topics=topics)
    config = IngestConfig(out_dir=tmp_path / "parquet", group_id=unique_name, until_idle_s=1.0)
    counters = Ingestor(settings, config).run()

    kept = {(r.engine_id, r.step_seq) for r in mixed if r.step_seq not in BAD_ROWS}
    kept |= {(r.engine_id, r.step_seq) for r in good}
    files = sorted((tmp_path / "parquet").rglob("*.parquet"))
    stored = [key for f in files for key in zip(
        *pq.read_table(f, columns=["engine_id", "step_seq"]).to_pydict().values(), strict=True)]
    assert sorted(stored) == sorted(kept)  # every good row once, no bad one
    assert counters.records == len(kept)
    assert counters.invalid_records == len(BAD_ROWS) + len(nameless)

    expected = {("mixed", seq): reason for seq, (_, reason) in BAD_ROWS.items()}
    expected |= {("", r.step_seq): "invalid_engine_id" for r in nameless}
    messages = _dead_letters(broker.bootstrap, topics.dlq, counters.dlq)
    assert len(messages) == counters.dlq
    lettered: dict[tuple[str, int], str] = {}
    for message in messages:
        headers = dict(message.headers)
        reason = headers["tabletune-dlq-reason"].decode()
        field = headers["tabletune-dlq-field"].decode()
        assert reason == f"invalid_{field}"
        assert headers["tabletune-dlq-detail"].decode().startswith(field)
        assert message.key.decode().startswith(f"{topics.telemetry}:0:")
        rows = decode_frame(message.value, message.headers)  # the rows, as telemetry
        for key in zip(rows.column("engine_id").to_pylist(),
                       rows.column("step_seq").to_pylist(), strict=True):
            assert key not in lettered  # each bad row once
            lettered[key] = reason
    assert lettered == expected  # each bad row, with the reason naming its problem
    assert sum(counters.dlq_reasons.values()) == counters.dlq and counters.dlq_failures == 0

    again = Ingestor(settings, IngestConfig(out_dir=tmp_path / "parquet", group_id=unique_name,
                                            until_idle_s=1.0)).run()
    assert again.records == again.dlq == 0  # the offsets were committed past all three frames


def test_malformed_match_length_entries_are_charged_to_their_own_rows_without_a_crash():
    """Nulls inside entries, position lists of unequal length, and a step whose entries add
    up to more requests than it decoded: each bad row dead-lettered, the good ones kept."""
    records = sample_records(6, engine_id="nested")
    good = _by_match(1, requests=1, reached=[1, 1], accepted=[1, 0])
    rows = [
        [good],                                                           # 0: good
        [{**good, "accepted_per_pos": [1]}],                              # 1: unequal lists
        [good],                                                           # 2: good
        [{**good, "reached_per_pos": [1], "accepted_per_pos": [1, 1, 1]}],  # 3: unequal
        [{**good, "match_length": None}],                                 # 4: a null
        [good] * 3,                                                       # 5: 3 > 2 decoded
    ]
    records = [dataclasses.replace(r, num_decode_reqs=2) for r in records]
    table = records_to_table(records)
    column = pa.array(rows, type=table.schema.field("by_match_length").type)
    table = table.set_column(table.schema.get_field_index("by_match_length"),
                             table.schema.field("by_match_length"), column)
    checks = check_steps(table, now_ns=None)
    assert np.flatnonzero(~checks.valid).tolist() == [1, 3, 4, 5]
    assert {v.reason for v in checks.violations} == {"invalid_by_match_length"}
