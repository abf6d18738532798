"""Ingest's partition store: a window's records as Parquet files named by their offsets.

Writing is two steps, so the caller can place them in its commit sequence: `write_temp`
writes each hive group to a temp file and fsyncs it; `rename` gives each its final name
(topic, partition and offset range, `fitter.dataset.file_name`) and fsyncs the folder. A
crash between them leaves temp files only: an advisory lock per store marks whose temp files
are live, and a store starting up removes those of writers that are gone.

A window read again (a crash before its commit, a rebalance) must not be stored twice: a
record at an offset that a final file covers is skipped only if that file holds the record
itself (engine_id, step_seq, ts_ns). Offsets alone are not identities: a topic deleted and
created again restarts at offset 0 under the same name, and its records are new; they are
written (next to the old files, under a free name), never dropped. An engine's producer that
sends a frame again after the broker wrote it (the acknowledgement lost in a broker restart:
a new producer, so the broker's idempotence does not see the copy) puts a copy at a later
offset: a record identical to one earlier in its window, or to one in the partition's last
files before the window (RESENT_LOOKBACK_FILES), is dropped as a copy. Readers dedupe on
(engine_id, step_seq) as a second defence.
"""

from __future__ import annotations

import fcntl
import logging
import os
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import IO

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from fitter.dataset import RECORD_IDENTITY, SOURCE_OFFSET, file_name, hive_path, offset_files
from fitter.ingest.counters import IngestCounters

log = logging.getLogger(__name__)

_LOCKS = ".ingest-locks"
_TEMP_PREFIX = ".tmp-"
_IDENTITY_CACHE_FILES = 64
RESENT_LOOKBACK_FILES = 8
"""Files of a partition before a window searched for the originals of re-sent frames (an
engine's sink re-sends within seconds: a timed-out frame goes first when the broker is back)."""

TempFiles = list[tuple[Path, Path]]
"""(temp file, final name) of each file `write_temp` wrote, for `rename`."""


class PartitionStore:
    """The Parquet files of one topic under `out_dir`, written by one ingest consumer."""

    def __init__(self, out_dir: Path, topic: str, counters: IngestCounters) -> None:
        self.out_dir = out_dir
        self.topic = topic
        self.counters = counters
        self._identities: OrderedDict[Path, pl.DataFrame] = OrderedDict()
        self._token = uuid.uuid4().hex[:12]
        self._lock_file: IO[str] | None = None
        out_dir.mkdir(parents=True, exist_ok=True)
        self.claim()
        self._remove_dead_temp_files()

    # ---- durable writes -------------------------------------------------------------------
    def write_temp(self, partition: int, records: pl.DataFrame) -> TempFiles:
        """Each hive group's records not stored yet, to a temp file each, fsynced."""
        stamps = pl.from_epoch(pl.col("ts_ns"), time_unit="ns")
        records = records.with_columns(stamps.dt.strftime("%Y-%m-%d").alias("_date"),
                                       stamps.dt.hour().alias("_hour"))
        written: TempFiles = []
        for keys, group in records.group_by(["model", "drafter", "hardware", "_date",
                                             "_hour"]):
            model, drafter, hardware, date, hour = keys
            directory = hive_path(model, drafter, hardware, date, int(hour))
            folder = self.out_dir / directory
            group = self._skip_stored(partition, folder, group.drop(["_date", "_hour"]))
            group = self._drop_resent(partition, folder, group)
            if group.height == 0:
                continue
            offsets = group.get_column(SOURCE_OFFSET)
            first, last = int(offsets.min()), int(offsets.max())
            reuse = 0
            while (folder / file_name(self.topic, partition, first, last, reuse)).exists():
                reuse += 1  # same offsets, other records: the topic's offsets restarted
            final = folder / file_name(self.topic, partition, first, last, reuse)
            final.parent.mkdir(parents=True, exist_ok=True)
            temporary = final.parent / f"{_TEMP_PREFIX}{self._token}-{final.name}.part"
            table = group.to_arrow()  # identity stays in the file, byte for byte
            pq.write_table(table, temporary, compression="zstd")
            _fsync(temporary)
            written.append((temporary, final))
            self.counters.records += group.height
        return written

    def rename(self, written: TempFiles) -> None:
        """Give each temp file its final name, the folder fsynced after each."""
        for temporary, final in written:
            os.replace(temporary, final)
            _fsync(final.parent)
            self.counters.files += 1

    # ---- de-duplication -------------------------------------------------------------------
    def _skip_stored(self, partition: int, folder: Path, group: pl.DataFrame
                     ) -> pl.DataFrame:
        """Drop the records a file in `folder` already holds. Only files whose name covers a
        record's offset are read (their identity columns, cached): the folder is listed at
        each write, so files another replica renamed since are seen too."""
        files = offset_files(folder, self.topic, partition)
        if not files:
            return group
        offsets = group.get_column(SOURCE_OFFSET).to_numpy()
        covered = np.zeros(len(offsets), dtype=bool)
        covering: list[Path] = []
        for first, last, name in files:
            inside = (offsets >= first) & (offsets <= last)
            if inside.any():
                covered |= inside
                covering.append(folder / name)
        if not covering:
            return group
        stored = pl.concat([self._stored_identities(path) for path in covering])
        rows = group.select(RECORD_IDENTITY).with_row_index("_row").filter(pl.Series(covered))
        held = rows.join(stored, on=list(RECORD_IDENTITY), how="semi").get_column("_row")
        skip = np.zeros(len(offsets), dtype=bool)
        skip[held.to_numpy()] = True
        skipped = int(skip.sum())
        reset = int(covered.sum()) - skipped
        if reset:
            self.counters.reset_records += reset
            log.warning("partition %d: %d records at offsets that files in %s cover are not in "
                        "them (the topic's offsets restarted?): written, not skipped",
                        partition, reset, folder)
        if skipped:
            self.counters.skipped_duplicates += skipped
            group = group.filter(pl.Series(~skip))
        return group

    def _drop_resent(self, partition: int, folder: Path, group: pl.DataFrame
                     ) -> pl.DataFrame:
        """Drop copies of records at later offsets: a second copy within `group`, and
        records the partition's last files before `group` hold (same engine_id, step_seq and
        ts_ns: an engine's re-sent frame)."""
        if group.height == 0:
            return group
        group = group.sort(SOURCE_OFFSET, maintain_order=True)  # the first copy is kept
        unique = group.unique(subset=list(RECORD_IDENTITY), keep="first", maintain_order=True)
        first = int(group.get_column(SOURCE_OFFSET).min())
        before = [folder / name for _, last, name in
                  sorted((f for f in offset_files(folder, self.topic, partition)
                          if f[1] < first), key=lambda f: f[1])[-RESENT_LOOKBACK_FILES:]]
        if before:
            stored = pl.concat([self._stored_identities(path) for path in before])
            unique = unique.join(stored, on=list(RECORD_IDENTITY), how="anti")
        copies = group.height - unique.height
        if copies:
            self.counters.resent_duplicates += copies
            log.warning("partition %d: %d records are copies of records at earlier offsets "
                        "(an engine re-sent frames the broker had written): dropped",
                        partition, copies)
        return unique

    def _stored_identities(self, path: Path) -> pl.DataFrame:
        cached = self._identities.get(path)
        if cached is not None:
            self._identities.move_to_end(path)
            return cached
        try:
            table = pq.read_table(path, columns=list(RECORD_IDENTITY))
            identities = pl.from_arrow(table).unique()
        except (OSError, pa.ArrowException, pl.exceptions.PolarsError) as exc:
            # an unreadable file holds nothing we may skip for: rather a duplicate than a loss
            log.warning("cannot read identities of %s (%s): its offsets are written again",
                        path, exc)
            identities = pl.DataFrame(schema={"engine_id": pl.String, "step_seq": pl.Int64,
                                              "ts_ns": pl.Int64})
        self._identities[path] = identities
        while len(self._identities) > _IDENTITY_CACHE_FILES:
            self._identities.popitem(last=False)
        return identities

    # ---- the lock and temp files of dead writers ------------------------------------------
    def claim(self) -> None:
        """Hold an advisory lock for as long as this store may leave temp files, so a replica
        starting beside it removes only the temp files of writers that are gone."""
        if self._lock_file is not None:
            return
        locks = self.out_dir / _LOCKS
        locks.mkdir(exist_ok=True)
        handle = open(locks / f"{self._token}.lock", "w")  # held until release
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._lock_file = handle

    def release(self) -> None:
        handle, self._lock_file = self._lock_file, None
        if handle is not None:
            Path(handle.name).unlink(missing_ok=True)
            handle.close()

    def _remove_dead_temp_files(self) -> None:
        live = {self._token}
        for lock in (self.out_dir / _LOCKS).glob("*.lock"):
            if lock.stem == self._token:
                continue
            try:
                with open(lock) as handle:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    lock.unlink(missing_ok=True)  # its owner is gone
            except BlockingIOError:
                live.add(lock.stem)
            except FileNotFoundError:
                pass
        for leftover in self.out_dir.rglob(f"{_TEMP_PREFIX}*"):
            owner = leftover.name[len(_TEMP_PREFIX):len(_TEMP_PREFIX) + len(self._token)]
            if owner not in live:
                leftover.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
