from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import zstandard
from hypothesis import given, settings

from schemas import (
    SCHEMA_VERSION,
    STEP_RECORD_SCHEMA,
    FrameError,
    decode_frame,
    encode_frame,
    records_to_table,
    table_to_records,
)
from schemas.frames import HEADER_FIRST_STEP_SEQ, HEADER_LAST_STEP_SEQ, HEADER_SCHEMA_VERSION
from tests.test_schemas.strategies import sample_records, step_records


@settings(max_examples=60, deadline=None)
@given(step_records())
def test_frame_round_trip(records):
    frame = encode_frame(records_to_table(records))
    assert frame.key == records[0].engine_id.encode()
    headers = dict(frame.headers)
    assert int(headers[HEADER_FIRST_STEP_SEQ]) == records[0].step_seq
    assert int(headers[HEADER_LAST_STEP_SEQ]) == records[-1].step_seq
    assert table_to_records(decode_frame(frame.value, frame.headers)) == records


def _sample_table(n: int = 5) -> pa.Table:
    return records_to_table(sample_records(n))


def _ipc_zstd(table: pa.Table, metadata_version: bytes | None = b"1") -> bytes:
    schema = table.schema
    if metadata_version is None:
        schema = schema.remove_metadata()
    else:
        schema = schema.with_metadata({b"tabletune.schema_version": metadata_version})
    table = table.replace_schema_metadata(schema.metadata)
    sink = io.BytesIO()
    with ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return zstandard.ZstdCompressor().compress(sink.getvalue())


def test_empty_value_is_rejected():
    with pytest.raises(FrameError, match="^empty"):
        decode_frame(b"")


def test_uncompressed_value_is_rejected():
    with pytest.raises(FrameError, match="^not_zstd"):
        decode_frame(b'{"batch_size": 3}')


@pytest.mark.parametrize("keep", [6, 40, 0.5, -3])
def test_truncated_frame_is_named(keep):
    value = encode_frame(_sample_table(200)).value
    cut = value[: int(len(value) * keep)] if isinstance(keep, float) else value[:keep]
    with pytest.raises(FrameError, match="^truncated"):
        decode_frame(cut)


def test_corrupt_payload_is_named():
    value = zstandard.ZstdCompressor().compress(b"definitely not arrow")
    with pytest.raises(FrameError, match="^corrupt"):
        decode_frame(value)


def test_unknown_schema_version_in_header():
    frame = encode_frame(_sample_table())
    with pytest.raises(FrameError, match="^unknown_schema_version.*99"):
        decode_frame(frame.value, [(HEADER_SCHEMA_VERSION, b"99")])


def test_unknown_schema_version_in_metadata():
    with pytest.raises(FrameError, match="^unknown_schema_version.*7"):
        decode_frame(_ipc_zstd(_sample_table(), b"7"))
    with pytest.raises(FrameError, match="^unknown_schema_version.*lacks"):
        decode_frame(_ipc_zstd(_sample_table(), None))


def test_missing_column_is_named():
    table = _sample_table().drop_columns(["kv_tokens", "forced"])
    with pytest.raises(FrameError, match="^missing_column: columns missing: kv_tokens, forced"):
        decode_frame(_ipc_zstd(table))


def test_wrong_type_is_named():
    table = _sample_table()
    index = table.schema.get_field_index("batch_size")
    table = table.set_column(index, "batch_size", table.column("batch_size").cast(pa.string()))
    with pytest.raises(FrameError, match="^wrong_type: column batch_size is string, expected int32"):
        decode_frame(_ipc_zstd(table))


def test_a_version_1_frame_reads_as_one_without_finished_requests():
    table = _sample_table().drop_columns(["finished_requests", "by_match_length"])
    index = table.schema.get_field_index("schema_version")
    table = table.set_column(index, table.schema.field(index),
                             pa.array([1] * table.num_rows, type=pa.int16()))
    decoded = decode_frame(_ipc_zstd(table, b"1"), [(HEADER_SCHEMA_VERSION, b"1")])
    assert decoded.schema.names == STEP_RECORD_SCHEMA.names
    assert decoded.column("finished_requests").to_pylist() == [[]] * 5
    assert decoded.column("by_match_length").to_pylist() == [[]] * 5
    assert decoded.column("schema_version").to_pylist() == [SCHEMA_VERSION] * 5
    assert decoded.column("kv_tokens").to_pylist() == table.column("kv_tokens").to_pylist()


def test_a_version_2_frame_without_finished_requests_is_refused():
    table = _sample_table().drop_columns(["finished_requests", "by_match_length"])
    with pytest.raises(FrameError, match="^missing_column: columns missing: finished_requests"):
        decode_frame(_ipc_zstd(table, b"2"))


def test_a_version_2_frame_reads_as_one_without_match_lengths():
    table = _sample_table().drop_columns(["by_match_length"])
    decoded = decode_frame(_ipc_zstd(table, b"2"), [(HEADER_SCHEMA_VERSION, b"2")])
    assert decoded.column("by_match_length").to_pylist() == [[]] * 5
    assert decoded.column("finished_requests").to_pylist() == \
        table.column("finished_requests").to_pylist()


def test_extra_columns_are_dropped():
    table = _sample_table().append_column("future_field", pa.array([1.0] * 5))
    decoded = decode_frame(_ipc_zstd(table))
    assert decoded.schema.names == STEP_RECORD_SCHEMA.names


def test_encode_refuses_mixed_engines_and_empty():
    mixed = records_to_table(sample_records(2) + sample_records(2, engine_id="other"))
    with pytest.raises(ValueError, match="one engine.s records, got 2 engines"):
        encode_frame(mixed)
    with pytest.raises(ValueError, match="zero records"):
        encode_frame(mixed.slice(0, 0))
