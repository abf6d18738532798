"""`tabletune ingest`: telemetry topic -> hive-partitioned Parquet, exactly-once in effect.

A consumer group reads frames with explicit offsets. Per Kafka partition, decoded records
accumulate into a window that closes on count or age; closing one is the numbered sequence
of `Ingestor._commit_window` (files durable, dead letters acknowledged, then the commit). A
crash anywhere leaves either nothing durable for the window or final files whose names say
which offsets they may hold: the window is read again, and the partition store
(`fitter.ingest.partition_store`) skips a record only if such a file holds the record itself.

`Ingestor` is a facade over its roles: the partition store (files, de-duplication, the lock
and temp files), the dead-letter writer (`fitter.ingest.dead_letters`), the rebalance listener
(`fitter.ingest.assignment_changes`) and the batch-mode checks (`fitter.ingest.catch_up`). It keeps the
poll loop and the commit sequence.

Rebalances: the consumer's rebalance callbacks only note that the assignment changed; the
poll loop then abandons every in-flight window (nothing of it committed: the partition's
owner reads it again from the committed offset, and the store keeps a window that was
already renamed from being written twice) and rewinds its partitions to their committed
offsets. A commit refused because the group is rebalancing (or has moved on without this
member) is logged and treated the same way; ingest keeps running.

Broker outages: what the loop asks the broker between polls (the commit, committed offsets,
positions for the lag, the dead-letter flush), and kafka-python 3.0's poll itself, fail
with its retriable errors (KafkaConnectionError, KafkaTimeoutError) while no broker answers.
A failed poll, commit or dead-letter flush leaves the open windows uncommitted, read again
like a refused commit; a failed rewind or lag check is tried again at the next poll. Ingest
exits on no such error.

Bad data never stops the job: frames that do not decode, and rows that fail a semantic
check, go to the dead-letter topic with the reason and source offset.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import polars as pl
import pyarrow as pa
from kafka import KafkaConsumer, OffsetAndMetadata, TopicPartition
from kafka.errors import KafkaError

from fitter.dataset import SOURCE_OFFSET, SOURCE_PARTITION
from fitter.ingest.assignment_changes import AssignmentChanges
from fitter.ingest.broker_errors import REBALANCE_COMMIT_ERRORS, transient
from fitter.ingest.catch_up import CatchUp
from fitter.ingest.config import IngestConfig
from fitter.ingest.counters import IngestCounters
from fitter.ingest.dead_letters import DeadLetters
from fitter.ingest.partition_store import PartitionStore
from schemas import FrameError, decode_frame
from schemas.settings import Settings

__all__ = ["Ingestor", "Stage"]

log = logging.getLogger(__name__)

REBALANCE_TIMEOUT_MS = 30_000
"""max_poll_interval_ms, which kafka-python sends as the JoinGroup's rebalance timeout: how
long Apache Kafka holds a rebalance for a member gone in mid-join (kafka-python's 300 s
default held the group five minutes). The loop polls every 200 ms; no window takes 30 s."""
STOP_JOIN_WAIT_S = 15.0
"""A stop during a rebalance polls up to this long for the join to end before leaving: a
LeaveGroup sent behind an in-flight JoinGroup waits on the coordinator's connection until
that join completes, then leaves a generation it was just made a member of."""
CLOSE_TIMEOUT_MS = 10_000
"""The most close() waits for the LeaveGroup's answer: the session timeout ends the
membership anyway."""

Stage = str
"""'temp_written', 'renamed', 'dlq_flushed', 'committed' — for fault-injection in tests."""


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
        self._dead_letters = DeadLetters(settings, self.topic, self.counters,
                                         config.max_future_s)
        self._stop = False
        self._lag_checked = 0.0
        self._changes = AssignmentChanges()
        self._rewind = False
        self._seen_changes = 0
        self._catch_up = CatchUp(settings, config, self.counters)
        self._store = PartitionStore(config.out_dir, self.topic, self.counters)

    @property
    def assignment(self) -> frozenset[int]:
        """The partitions this consumer holds, as its rebalance listener last heard."""
        return self._changes.held

    def stop(self) -> None:
        self._stop = True

    def run(self) -> IngestCounters:
        self._store.claim()
        consumer = self._consumer = KafkaConsumer(**self.settings.consumer_kwargs(
            group_id=self.config.group_id, enable_auto_commit=False,
            auto_offset_reset="earliest", max_poll_records=self.config.poll_max_records,
            fetch_max_bytes=64 * 1024 * 1024))
        try:
            consumer.subscribe([self.topic], listener=self._changes)
            started = last_message = time.monotonic()
            while not self._stop:
                self._seen_changes = self._changes.changes
                try:
                    batches = consumer.poll(timeout_ms=200)
                except KafkaError as exc:
                    if not transient(exc):
                        raise
                    # kafka-python 3.0's poll raises the coordinator lookup's connection
                    # error while no broker answers; the group may have moved meanwhile
                    self._rewind = True
                    last_message = time.monotonic()
                    log.warning("poll failed (%s: %s): the broker does not answer; open "
                                "windows are read again", type(exc).__name__, exc)
                    time.sleep(0.5)
                    continue
                if self._changes.joining:  # a rebalance: poll only, until assigned
                    self._drop_windows()
                    self._rewind = True
                    last_message = time.monotonic()
                    self._catch_up.check_join(started)
                    continue
                self._catch_up.joined()
                if self._rewind or self._assignment_moved():
                    # The assignment moved during this poll (or a commit was refused): what
                    # it returned and every open window may belong to another owner now.
                    self._abandon_windows(consumer)
                    last_message = time.monotonic()
                    continue
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
                if until_idle is not None and idle_for >= until_idle and not self._windows \
                        and not self._rewind and self._catch_up.caught_up(consumer):
                    break
            if self._stop:
                self._finish_join(consumer)
            if not self._rewind:
                self._close_windows(force=True)
        finally:
            consumer.close(autocommit=False, timeout_ms=CLOSE_TIMEOUT_MS)
            self._dead_letters.close()
            self._store.release()
        return self.counters

    def _update_lag(self, consumer: KafkaConsumer) -> None:
        """High watermark (known after a fetch) minus position, over assigned partitions."""
        self._lag_checked = time.monotonic()
        lag = 0
        try:
            for tp in consumer.assignment():
                highwater = consumer.highwater(tp)
                if highwater is not None:
                    lag += max(0, highwater - consumer.position(tp))
        except KafkaError as exc:
            if not transient(exc):
                raise
            log.info("lag not measured (%s: %s): the broker does not answer",
                     type(exc).__name__, exc)
            return
        self.counters.lag_records = lag

    def _finish_join(self, consumer: KafkaConsumer) -> None:
        """Stopped during a rebalance: poll until the join ends (STOP_JOIN_WAIT_S), so that
        close() leaves a settled generation in one rebalance instead of queueing its
        LeaveGroup behind the JoinGroup. What the polls return is not kept: uncommitted."""
        if not self._changes.joining:
            return
        self._rewind = True  # the join moves the assignment: no open window is ours
        deadline = time.monotonic() + STOP_JOIN_WAIT_S
        while self._changes.joining and time.monotonic() < deadline:
            try:
                consumer.poll(timeout_ms=200)
            except KafkaError as exc:
                if not transient(exc):
                    raise
                return  # no broker answers: nothing to leave cleanly

    # ---- rebalance ------------------------------------------------------------------------
    def _assignment_moved(self) -> bool:
        """A rebalance callback ran since the last poll began."""
        return self._changes.changes != self._seen_changes

    def _drop_windows(self) -> None:
        if self._windows:
            log.info("rebalance: abandoning windows of partitions %s (uncommitted; read "
                     "again from the committed offsets)", sorted(self._windows))
        self.counters.abandoned_windows += len(self._windows)
        self._windows.clear()

    def _abandon_windows(self, consumer: KafkaConsumer) -> None:
        """Drop every open window uncommitted and rewind the assigned partitions to the
        group's committed offsets: their records are read again, by us or the new owner."""
        self._rewind = True
        self._drop_windows()
        try:
            for tp in consumer.assignment():
                committed = consumer.committed(tp)
                if committed is None:
                    consumer.seek_to_beginning(tp)
                else:
                    consumer.seek(tp, committed)
        except (*REBALANCE_COMMIT_ERRORS, ValueError, KafkaError) as exc:
            # the group moved again (ValueError: a partition is no longer assigned), or the
            # broker does not answer
            if isinstance(exc, KafkaError) and not isinstance(
                    exc, REBALANCE_COMMIT_ERRORS) and not transient(exc):
                raise
            log.info("rebalance: rewind deferred to the next poll (%s)", exc)
            return
        self._rewind = False

    # ---- per message ----------------------------------------------------------------------
    def _accept(self, partition: int, message: object) -> None:
        window = self._windows.get(partition)
        if window is None:
            window = self._windows[partition] = _Window(opened_at=time.monotonic(),
                                                        first_offset=message.offset)
        window.last_offset = message.offset
        try:
            table = decode_frame(message.value or b"", list(message.headers or []),
                                 max_bytes=self.config.max_frame_bytes,
                                 max_records=self.config.max_frame_records)
        except FrameError as exc:
            self._dead_letters.refuse_frame(partition, message, exc)
            return
        n = table.num_rows
        table = table.append_column(SOURCE_PARTITION, pa.array(np.full(n, partition, np.int32)))
        table = table.append_column(SOURCE_OFFSET, pa.array(np.full(n, message.offset,
                                                                    np.int64)))
        window.tables.append(table)
        window.records += n
        self.counters.frames += 1

    # ---- window close ---------------------------------------------------------------------
    def _close_windows(self, *, force: bool) -> None:
        now = time.monotonic()
        for partition in list(self._windows):
            window = self._windows[partition]
            if force or window.records >= self.config.window_records \
                    or now - window.opened_at >= self.config.window_s:
                del self._windows[partition]
                if not self._commit_window(partition, window):
                    return

    def _commit_window(self, partition: int, window: _Window) -> bool:
        """Close one window, in this order, so that a crash at any step loses and
        duplicates nothing:
          1. write each hive group to a temp file, fsync it (records a final file already
             holds, and copies an engine re-sent, left out),
          2. rename it to its final name (topic, partition and offset range) and fsync the
             folder,
          3. flush the dead-letter producer (frames refused whole, and the window's invalid
             rows) and check that the broker acknowledged every message; if not, stop here,
          4. commit offset + 1 synchronously.
        False when the group refused the commit, or the assignment moved since the poll
        (a rebalance): the poll loop then abandons the other windows and rewinds."""
        if self._assignment_moved():
            self._rewind = True
            return False
        if window.tables:
            records = self._dead_letters.screen(partition, pa.concat_tables(window.tables))
            if records.num_rows:
                written = self._store.write_temp(partition, pl.from_arrow(records))
                self.on_stage("temp_written")
                self._store.rename(written)
                self.on_stage("renamed")
        if not self._dead_letters.delivered():
            self._rewind = True
            return False
        self.on_stage("dlq_flushed")
        assert self._consumer is not None
        tp = TopicPartition(self.topic, partition)
        if self._assignment_moved():  # the files stay; the offsets are read again
            self._rewind = True
            return False
        try:
            self._consumer.commit({tp: OffsetAndMetadata(window.last_offset + 1, "", -1)})
        except (*REBALANCE_COMMIT_ERRORS, KafkaError) as exc:
            if not isinstance(exc, REBALANCE_COMMIT_ERRORS) and not transient(exc):
                raise
            self.counters.commit_failures += 1
            self._rewind = True
            log.warning("commit of partition %d offsets %d-%d refused (%s: %s): its files "
                        "stay, the offsets are read again", partition,
                        window.first_offset, window.last_offset, type(exc).__name__, exc)
            return False
        self.counters.windows += 1
        self.on_stage("committed")
        return True
