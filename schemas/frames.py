"""Wire framing of step records for Kafka.

One Kafka message carries one frame: an Arrow IPC stream of N step records from one engine,
compressed as a whole with zstd (one zstd frame with its content size, so truncation is
detectable). The message key is the engine id, which keeps an engine's frames ordered in one
partition. Headers repeat what a router or a dead-letter reader needs without decoding:
the schema version and the first/last step_seq.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.ipc as ipc
import zstandard

from schemas.step_record import (
    KNOWN_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    SCHEMA_VERSION_METADATA_KEY,
    STEP_RECORD_SCHEMA,
)

CONTENT_TYPE = b"application/vnd.apache.arrow.stream+zstd"
HEADER_CONTENT_TYPE = "content-type"
HEADER_SCHEMA_VERSION = "tabletune-schema-version"
HEADER_FIRST_STEP_SEQ = "tabletune-first-step-seq"
HEADER_LAST_STEP_SEQ = "tabletune-last-step-seq"
HEADER_RECORDS = "tabletune-records"

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
"""Largest decompressed frame a reader accepts by default. Engines frame 1,024 records
(~150 KB of Arrow IPC); 64 MiB leaves room for frames hundreds of times larger while a
compression bomb (a 49 KB zstd frame can declare 1.5 GiB) is refused before it is expanded."""
DEFAULT_MAX_FRAME_RECORDS = 65_536
"""Most records a reader accepts in one frame by default (64 times an engine's frame)."""


class FrameError(ValueError):
    """A telemetry frame that cannot be decoded; `reason` is a stable machine-readable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Frame:
    """A Kafka message ready to send: key, value and headers as kafka-python takes them."""

    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]
    first_step_seq: int
    last_step_seq: int
    num_records: int


def encode_frame(records: pa.Table | pa.RecordBatch, *, compression_level: int = 3) -> Frame:
    """Frame the records of one engine; refuses empty input and mixed engines."""
    table = records if isinstance(records, pa.Table) else pa.Table.from_batches([records])
    if table.num_rows == 0:
        raise ValueError("cannot frame zero records")
    if not table.schema.equals(STEP_RECORD_SCHEMA):  # a recorder's frame already is: 0.5 ms
        table = table.select(list(STEP_RECORD_SCHEMA.names)).cast(STEP_RECORD_SCHEMA)
    engine_ids = table.column("engine_id").unique()
    if len(engine_ids) != 1:
        raise ValueError(f"a frame holds one engine's records, got {len(engine_ids)} engines")
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, STEP_RECORD_SCHEMA) as writer:
        writer.write_table(table)
    raw = sink.getvalue().to_pybytes()
    value = zstandard.ZstdCompressor(level=compression_level).compress(raw)
    seqs = table.column("step_seq")
    first, last = int(seqs[0].as_py()), int(seqs[-1].as_py())
    headers = [
        (HEADER_CONTENT_TYPE, CONTENT_TYPE),
        (HEADER_SCHEMA_VERSION, str(SCHEMA_VERSION).encode()),
        (HEADER_FIRST_STEP_SEQ, str(first).encode()),
        (HEADER_LAST_STEP_SEQ, str(last).encode()),
        (HEADER_RECORDS, str(table.num_rows).encode()),
    ]
    return Frame(
        key=str(engine_ids[0].as_py()).encode(),
        value=value,
        headers=headers,
        first_step_seq=first,
        last_step_seq=last,
        num_records=table.num_rows,
    )


def decode_frame(
    value: bytes, headers: list[tuple[str, bytes]] | None = None, *,
    max_bytes: int = DEFAULT_MAX_FRAME_BYTES, max_records: int = DEFAULT_MAX_FRAME_RECORDS,
) -> pa.Table:
    """Decode one frame into a table with exactly `STEP_RECORD_SCHEMA`.

    Raises `FrameError` naming what is wrong: empty, not_zstd, truncated, corrupt,
    too_large (decompresses to more than `max_bytes`), too_many_records (more than
    `max_records`), unknown_schema_version, missing_column, wrong_type. Extra columns (from a
    newer writer of the same schema version) are dropped. Memory stays bounded by `max_bytes`:
    a declared content size over it is refused before decompressing, and a frame without one
    is expanded only up to the bound.
    """
    headers = headers or []
    _check_header_version(headers)
    _check_header_records(headers, max_records)
    raw = _decompress(value, max_bytes)
    try:
        reader = ipc.open_stream(pa.BufferReader(raw))
        batches = []
        rows = 0
        for batch in reader:
            rows += batch.num_rows
            if rows > max_records:
                raise FrameError("too_many_records",
                                 f"more than {max_records} records in one frame")
            batches.append(batch)
        table = pa.Table.from_batches(batches, schema=reader.schema)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        raise FrameError("corrupt", f"not a readable Arrow IPC stream ({exc})") from exc
    version = _check_schema_version(table.schema)
    if version < SCHEMA_VERSION:
        table = upgrade_earlier_version(table, version)
    return _conform(table)


def _check_header_version(headers: list[tuple[str, bytes]]) -> None:
    for name, raw in headers:
        if name == HEADER_SCHEMA_VERSION:
            _require_known_version(raw, "header " + HEADER_SCHEMA_VERSION)


def _check_header_records(headers: list[tuple[str, bytes]], max_records: int) -> None:
    """A frame that says it holds too many records is refused before it is decompressed
    (the count is checked again on the decoded records: a header can lie)."""
    for name, raw in headers:
        if name == HEADER_RECORDS:
            try:
                declared = int(raw)
            except ValueError:
                continue
            if declared > max_records:
                raise FrameError("too_many_records", f"header {HEADER_RECORDS} says "
                                 f"{declared} records; at most {max_records} are accepted")


def _require_known_version(raw: bytes | None, where: str) -> int:
    try:
        version = int(raw or b"")
    except ValueError:
        raise FrameError("unknown_schema_version", f"{where} is {raw!r}, not a number") from None
    if version not in KNOWN_SCHEMA_VERSIONS:
        raise FrameError(
            "unknown_schema_version",
            f"{where} is {version}; this reader knows {sorted(KNOWN_SCHEMA_VERSIONS)}",
        )
    return version


def _decompress(value: bytes, max_bytes: int) -> bytes:
    if not value:
        raise FrameError("empty", "the message value is empty")
    if not value.startswith(_ZSTD_MAGIC):
        raise FrameError("not_zstd", f"value does not start with the zstd magic ({value[:4]!r})")
    try:
        params = zstandard.get_frame_parameters(value)
    except zstandard.ZstdError as exc:
        raise FrameError("truncated", f"zstd frame header incomplete ({exc})") from exc
    declared = None if params.content_size == zstandard.CONTENTSIZE_UNKNOWN \
        else params.content_size
    if declared is not None and declared > max_bytes:
        raise FrameError("too_large", f"the zstd frame declares {declared} bytes; at most "
                         f"{max_bytes} are accepted")
    try:
        # One zstd frame, expanded at most one byte past the bound whatever it declares.
        with zstandard.ZstdDecompressor().stream_reader(value) as reader:
            out = reader.read(max_bytes + 1)
    except zstandard.ZstdError as exc:
        raise FrameError("corrupt", f"zstd decompression failed ({exc})") from exc
    if len(out) > max_bytes:
        raise FrameError("too_large", f"the zstd frame decompresses to more than {max_bytes} "
                         "bytes")
    if declared is not None and len(out) < declared:
        raise FrameError(
            "truncated", f"decompressed {len(out)} of {declared} bytes: the frame was cut short"
        )
    return out


def _check_schema_version(schema: pa.Schema) -> int:
    metadata = schema.metadata or {}
    if SCHEMA_VERSION_METADATA_KEY not in metadata:
        raise FrameError(
            "unknown_schema_version",
            f"Arrow schema metadata lacks {SCHEMA_VERSION_METADATA_KEY.decode()}",
        )
    return _require_known_version(metadata[SCHEMA_VERSION_METADATA_KEY], "schema metadata")


ADDED_COLUMNS = {2: ("finished_requests",), 3: ("by_match_length",)}
"""The columns each schema version added: empty in a frame of an earlier version."""


def upgrade_earlier_version(table: pa.Table, version: int) -> pa.Table:
    """A table of an earlier schema version as this one: the columns added since are empty
    (nothing was recorded in them), every other column as it was. Engines of several
    versions can share a topic while a fleet upgrades."""
    added = [name for since, names in ADDED_COLUMNS.items() if since > version
             for name in names]
    for name in added:
        if name not in table.schema.names:
            empty = pa.array([[]] * table.num_rows, type=STEP_RECORD_SCHEMA.field(name).type)
            table = table.append_column(STEP_RECORD_SCHEMA.field(name), empty)
    if "schema_version" in table.schema.names:
        index = table.schema.get_field_index("schema_version")
        table = table.set_column(index, table.schema.field(index), pa.array(
            [SCHEMA_VERSION] * table.num_rows, type=pa.int16()))
    return table


def _conform(table: pa.Table) -> pa.Table:
    """`table` with exactly `STEP_RECORD_SCHEMA`, or a FrameError naming the column. A frame
    from this schema's own writer takes one schema comparison, not one per nested field: a
    consumer decodes hundreds of frames a second."""
    if not table.schema.equals(STEP_RECORD_SCHEMA, check_metadata=False):
        table = _select_known_columns(table)
    for name, column in zip(table.schema.names, table.columns, strict=True):
        if column.null_count:
            raise FrameError("wrong_type", f"column {name} holds nulls")
    return table.replace_schema_metadata(STEP_RECORD_SCHEMA.metadata)


def _select_known_columns(table: pa.Table) -> pa.Table:
    """The schema's columns in its order, each of its type (extra columns are dropped)."""
    names = set(table.schema.names)
    missing = [f.name for f in STEP_RECORD_SCHEMA if f.name not in names]
    if missing:
        raise FrameError("missing_column", f"columns missing: {', '.join(missing)}")
    for expected in STEP_RECORD_SCHEMA:
        actual = table.schema.field(expected.name).type
        if actual != expected.type:
            raise FrameError(
                "wrong_type",
                f"column {expected.name} is {actual}, expected {expected.type}",
            )
    return table.select(list(STEP_RECORD_SCHEMA.names))
