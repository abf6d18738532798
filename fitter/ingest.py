"""`tabletune ingest`: telemetry topic -> hive-partitioned Parquet, exactly-once in effect.

A consumer group reads frames with explicit offsets. Per Kafka partition, decoded records
accumulate into a window that closes on count or age. Closing a window is a numbered
sequence (Quix Streams' checkpoint):
  1. write each hive group to a temp file, fsync it,
  2. rename it to its final name (topic, partition and offset range) and fsync the folder,
  3. flush the dead-letter producer,
  4. commit offset + 1 synchronously.
A crash anywhere leaves either nothing durable for the window (temp files are removed at
start-up) or final files whose names say which offsets they hold: on restart the window is
read again and records whose offsets a final file in the same folder already covers are
skipped. Readers dedupe on (engine_id, step_seq) as a second defence.
Malformed frames go to the dead-letter topic with the reason and source offset; the job
never stops on bad data.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from kafka import KafkaConsumer, KafkaProducer, OffsetAndMetadata, TopicPartition

from fitter.dataset import (
    SOURCE_OFFSET,
    SOURCE_PARTITION,
    covered_offsets,
    file_name,
    hive_path,
)
from schemas import FrameError, decode_frame
from tabletune.settings import Settings

log = logging.getLogger(__name__)

Stage = str
"""'temp_written', 'renamed', 'dlq_flushed', 'committed' — for fault-injection in tests."""


@dataclass(frozen=True, slots=True)
class IngestConfig:
    out_dir: Path
    group_id: str = "tabletune-ingest"
    window_records: int = 200_000
    """A partition's window closes at this many records ..."""
    window_s: float = 10.0
    """... or when its oldest record has waited this long."""
    until_idle_s: float | None = None
    """Stop after this many seconds without new messages (batch mode); None runs forever."""
    poll_max_records: int = 2000


@dataclass
class IngestCounters:
    records: int = 0
    frames: int = 0
    files: int = 0
    windows: int = 0
    dlq: int = 0
    skipped_duplicates: int = 0
    lag_records: int = 0
    """Messages behind the partitions' high watermarks at the last check (consumer lag)."""
    dlq_reasons: dict[str, int] = field(default_factory=dict)


@dataclass
class _Window:
    tables: list[pa.Table] = field(default_factory=list)
    records: int = 0
    first_offset: int = -1
    last_offset: int = -1
    opened_at: float = 0.0


class Ingestor:
    """One consumer in the ingest group; `run()` until idle or stopped."""

    def __init__(self, settings: Settings, config: IngestConfig,
                 on_stage: Callable[[Stage], None] | None = None) -> None:
        self.settings = settings
        self.config = config
        self.on_stage = on_stage or (lambda stage: None)
        self.counters = IngestCounters()
        self.topic = settings.topics.telemetry
        self._windows: dict[int, _Window] = {}
        self._consumer: KafkaConsumer | None = None
        self._dlq: KafkaProducer | None = None
        self._stop = False
        self._lag_checked = 0.0
        config.out_dir.mkdir(parents=True, exist_ok=True)
        self._remove_temp_files()
        self._coverage = covered_offsets(config.out_dir, self.topic)

    def stop(self) -> None:
        self._stop = True

    def run(self) -> IngestCounters:
        consumer = self._consumer = KafkaConsumer(**self.settings.consumer_kwargs(
            group_id=self.config.group_id, enable_auto_commit=False,
            auto_offset_reset="earliest", max_poll_records=self.config.poll_max_records,
            fetch_max_bytes=64 * 1024 * 1024))
        try:
            consumer.subscribe([self.topic])
            started = last_message = time.monotonic()
            while not self._stop:
                batches = consumer.poll(timeout_ms=200)
                joining = not consumer.assignment() and time.monotonic() - started < 60
                if batches or joining:  # idle time counts once the group has assigned us
                    last_message = time.monotonic()
                for tp, messages in batches.items():
                    for message in messages:
                        self._accept(tp.partition, message)
                if time.monotonic() - self._lag_checked >= 5.0:
                    self._update_lag(consumer)
                idle_for = time.monotonic() - last_message
                self._close_windows(force=bool(idle_for > 1.0 and self._windows))
                until_idle = self.config.until_idle_s
                if until_idle is not None and idle_for >= until_idle and not self._windows:
                    break
            self._close_windows(force=True)
        finally:
            consumer.close(autocommit=False)
            if self._dlq is not None:
                self._dlq.close(timeout=5)
        return self.counters

    def _update_lag(self, consumer: KafkaConsumer) -> None:
        """High watermark (known after a fetch) minus position, over assigned partitions."""
        self._lag_checked = time.monotonic()
        lag = 0
        for tp in consumer.assignment():
            highwater = consumer.highwater(tp)
            if highwater is not None:
                lag += max(0, highwater - consumer.position(tp))
        self.counters.lag_records = lag

    # ---- per message ----------------------------------------------------------------------
    def _accept(self, partition: int, message: object) -> None:
        window = self._windows.get(partition)
        if window is None:
            window = self._windows[partition] = _Window(opened_at=time.monotonic(),
                                                        first_offset=message.offset)
        window.last_offset = message.offset
        try:
            table = decode_frame(message.value or b"", list(message.headers or []))
        except FrameError as exc:
            self._dead_letter(partition, message, exc)
            return
        n = table.num_rows
        table = table.append_column(SOURCE_PARTITION, pa.array(np.full(n, partition, np.int32)))
        table = table.append_column(SOURCE_OFFSET, pa.array(np.full(n, message.offset,
                                                                    np.int64)))
        window.tables.append(table)
        window.records += n
        self.counters.frames += 1

    def _dead_letter(self, partition: int, message: object, error: FrameError) -> None:
        if self._dlq is None:
            self._dlq = KafkaProducer(**self.settings.client_kwargs(), linger_ms=5)
        source = f"{self.topic}:{partition}:{message.offset}"
        headers = [("tabletune-dlq-reason", error.reason.encode()),
                   ("tabletune-dlq-detail", error.detail.encode()[:2000]),
                   ("tabletune-source-topic", self.topic.encode()),
                   ("tabletune-source-partition", str(partition).encode()),
                   ("tabletune-source-offset", str(message.offset).encode())]
        headers += [(f"original-{k}", v) for k, v in (message.headers or [])]
        self._dlq.send(self.settings.topics.dlq, key=source.encode(),
                       value=message.value or b"", headers=headers)
        self.counters.dlq += 1
        self.counters.dlq_reasons[error.reason] = self.counters.dlq_reasons.get(
            error.reason, 0) + 1
        log.warning("dead-lettered %s: %s", source, error)

    # ---- window close ---------------------------------------------------------------------
    def _close_windows(self, *, force: bool) -> None:
        now = time.monotonic()
        for partition in list(self._windows):
            window = self._windows[partition]
            if force or window.records >= self.config.window_records \
                    or now - window.opened_at >= self.config.window_s:
                self._commit_window(partition, window)
                del self._windows[partition]

    def _commit_window(self, partition: int, window: _Window) -> None:
        if window.tables:
            records = pl.from_arrow(pa.concat_tables(window.tables))
            self._write_groups(partition, records)
        if self._dlq is not None:
            self._dlq.flush(timeout=30)
        self.on_stage("dlq_flushed")
        assert self._consumer is not None
        tp = TopicPartition(self.topic, partition)
        self._consumer.commit({tp: OffsetAndMetadata(window.last_offset + 1, "", -1)})
        self.counters.windows += 1
        self.on_stage("committed")

    def _write_groups(self, partition: int, records: pl.DataFrame) -> None:
        stamps = pl.from_epoch(pl.col("ts_ns"), time_unit="ns")
        records = records.with_columns(stamps.dt.strftime("%Y-%m-%d").alias("_date"),
                                       stamps.dt.hour().alias("_hour"))
        written: list[tuple[Path, Path, str, int, int]] = []
        for keys, group in records.group_by(["model", "drafter", "hardware", "_date",
                                             "_hour"]):
            model, drafter, hardware, date, hour = keys
            directory = hive_path(model, drafter, hardware, date, int(hour))
            group = self._skip_covered(partition, directory, group.drop(["_date", "_hour"]))
            if group.height == 0:
                continue
            offsets = group.get_column(SOURCE_OFFSET)
            first, last = int(offsets.min()), int(offsets.max())
            final = self.config.out_dir / directory / file_name(self.topic, partition, first,
                                                                 last)
            final.parent.mkdir(parents=True, exist_ok=True)
            temporary = final.parent / f".tmp-{final.name}"
            table = group.to_arrow()  # identity stays in the file, byte for byte
            pq.write_table(table, temporary, compression="zstd")
            _fsync(temporary)
            written.append((temporary, final, directory, first, last))
            self.counters.records += group.height
        self.on_stage("temp_written")
        for temporary, final, directory, first, last in written:
            os.replace(temporary, final)
            _fsync(final.parent)
            bisect.insort(self._coverage.setdefault((partition, directory), []), (first, last))
            self.counters.files += 1
        self.on_stage("renamed")

    def _skip_covered(self, partition: int, directory: str, group: pl.DataFrame
                      ) -> pl.DataFrame:
        ranges = self._coverage.get((partition, directory))
        if not ranges:
            return group
        offsets = group.get_column(SOURCE_OFFSET).to_numpy()
        starts = np.array([r[0] for r in ranges])
        ends = np.array([r[1] for r in ranges])
        index = np.searchsorted(starts, offsets, side="right") - 1
        covered = (index >= 0) & (offsets <= ends[np.clip(index, 0, None)])
        skipped = int(covered.sum())
        if skipped:
            self.counters.skipped_duplicates += skipped
            group = group.filter(pl.Series(~covered))
        return group

    def _remove_temp_files(self) -> None:
        for leftover in self.config.out_dir.rglob(".tmp-*.parquet"):
            leftover.unlink()


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


