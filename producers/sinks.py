"""Telemetry sinks and their URLs: `kafka://` (production, `producers.kafka_sink`),
`file:///dir` (Arrow IPC files: offline profiling, no broker) and `null://`.

All run on the recorder's background thread. The Kafka sink is imported only when a
`kafka://` URL asks for it: kafka-python is a third of the start-up of a twin run that
sends nowhere.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.ipc as ipc

from fitter.reachability import check_reachable
from schemas.settings import Settings

if TYPE_CHECKING:
    from producers.kafka_sink import KafkaSink


class SinkError(ValueError):
    """A sink URL or option that cannot work; the message says which."""


class FileSink:
    """Arrow IPC files, one per frame, named by engine and step range (idempotent)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.files = 0
        self.records = 0

    def write(self, records: pa.Table) -> None:
        engine = records.column("engine_id")[0].as_py()
        seqs = records.column("step_seq")
        name = f"{_safe(engine)}-{seqs[0].as_py():012d}-{seqs[-1].as_py():012d}.arrow"
        final = self.directory / name
        temporary = final.with_suffix(".arrow.tmp")
        options = ipc.IpcWriteOptions(compression="zstd")
        with pa.OSFile(str(temporary), "wb") as out, \
                ipc.new_file(out, records.schema, options=options) as writer:
            writer.write_table(records)
        os.replace(temporary, final)
        self.files += 1
        self.records += records.num_rows

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        return None

    def counters(self) -> dict[str, int]:
        return {"files": self.files, "sent_records": self.records}


class NullSink:
    """Counts and discards frames: the recorder's full cost without any I/O (`null://`)."""

    def __init__(self) -> None:
        self.records = 0
        self.frames = 0

    def write(self, records: pa.Table) -> None:
        self.frames += 1
        self.records += records.num_rows

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        return None

    def counters(self) -> dict[str, int]:
        return {"sent_records": self.records, "frames": self.frames}


def read_file_sink(directory: str | os.PathLike[str]) -> pa.Table:
    """All records a FileSink wrote, in file-name order (engine, then step range)."""
    tables = [ipc.open_file(str(p)).read_all() for p in sorted(Path(directory).glob("*.arrow"))]
    if not tables:
        from schemas import STEP_RECORD_SCHEMA
        return STEP_RECORD_SCHEMA.empty_table()
    return pa.concat_tables(tables)


def sink_from_url(url: str, settings: Settings | None = None
                  ) -> KafkaSink | FileSink | NullSink:
    """`kafka://host:port[,host:port]`, `file:///dir` or `null://` (TABLETUNE_SINK)."""
    parsed = urlparse(url)
    if parsed.scheme == "null":
        return NullSink()
    if parsed.scheme == "kafka":
        servers = url[len("kafka://"):].strip("/")
        if not servers:
            raise SinkError(f"TABLETUNE_SINK={url!r}: kafka:// needs host:port[,host:port]")
        from producers.kafka_sink import KafkaSink

        base = settings or Settings.from_env()
        return KafkaSink(base.with_bootstrap(servers))
    if parsed.scheme == "file":
        if not parsed.path or parsed.netloc:
            raise SinkError(f"TABLETUNE_SINK={url!r}: use file:///absolute/dir")
        return FileSink(parsed.path)
    raise SinkError(f"TABLETUNE_SINK={url!r}: expected kafka://host:port, file:///dir "
                    "or null://")


def check_kafka_sink(url: str) -> None:
    """For command lines: a `kafka://` sink whose brokers do not answer is refused at once
    (KafkaUnreachable, naming them), since the sink itself never fails nor blocks its engine
    and a dead broker would only show as telemetry never sent."""
    servers = url[len("kafka://"):].strip("/") if urlparse(url).scheme == "kafka" else ""
    if servers:  # an empty one is sink_from_url's error to name
        check_reachable(Settings.from_env().with_bootstrap(servers).bootstrap_servers)


def _safe(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)
