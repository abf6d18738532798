"""`tabletune ingest`: telemetry topic -> hive-partitioned Parquet, exactly-once in effect.

A consumer group reads frames with explicit offsets. Per Kafka partition, decoded records
accumulate into a window that closes on count or age. Closing a window is a numbered
sequence (Quix Streams' checkpoint):
  1. write each hive group to a temp file, fsync it,
  2. rename it to its final name (topic, partition and offset range) and fsync the folder,
  3. flush the dead-letter producer (frames refused whole, and the window's invalid rows)
     and check that the broker acknowledged every message; if not, stop here,
  4. commit offset + 1 synchronously.
A crash anywhere leaves either nothing durable for the window (temp files of dead writers are
removed at start-up) or final files whose names say which offsets they may hold: the window
is read again, and a record at an offset such a file covers is skipped only if that file
holds the record itself (engine_id, step_seq, ts_ns). Offsets alone are not identities: a
topic deleted and created again restarts at offset 0 under the same name, and its records
are new; they are written (next to the old files, under a free name), never dropped.
An engine's producer that sends a frame again after the broker wrote it (the acknowledgement
lost in a broker restart: a new producer, so the broker's idempotence does not see the copy)
puts a copy at a later offset: a record identical to one earlier in its window, or to one in
the partition's last files before the window (RESENT_LOOKBACK_FILES), is dropped as a copy.
Readers dedupe on (engine_id, step_seq) as a second defence.

Rebalances: the consumer's rebalance callbacks only note that the assignment changed; the
poll loop then abandons every in-flight window (nothing of it committed: the partition's
owner reads it again from the committed offset, and the file check above keeps a window that
was already renamed from being written twice) and rewinds its partitions to their committed
offsets. A commit refused because the group is rebalancing (or has moved on without this
member) is logged and treated the same way; ingest keeps running.

Broker outages: what the loop asks the broker between polls (the commit, committed offsets,
positions for the lag, the dead-letter flush), and kafka-python 3.0's poll itself, fail
with its retriable errors (KafkaConnectionError, KafkaTimeoutError) while no broker answers.
A failed poll, commit or dead-letter flush leaves the open windows uncommitted, read again
like a refused commit; a failed rewind or lag check is tried again at the next poll. Ingest
exits on no such error.

Malformed frames go to the dead-letter topic with the reason and source offset; so do frames
that would decompress past `max_frame_bytes` or hold more than `max_frame_records` (refused
before they are expanded). Rows of a good frame that fail a semantic check
(`schemas.step_checks`: a negative batch, accepted > drafted, NaN latency, a stamp in 2262)
are left out of the Parquet files and dead-lettered too, at window close: one message per
source offset and check, a frame of just those rows, its reason naming the field
(`invalid_batch_size`). A window commits only once its files are renamed and every
dead-letter message sent for it is acknowledged. The job never stops on bad data.

`until_idle_s` (batch jobs) stops only once caught up: every partition of the topic, whoever
owns it, committed by the group up to its end offset. Idle but behind (a member holds
partitions without committing, a rebalance is due), it keeps consuming; once nothing has
moved for `lag_wait_s`, `run()` raises `IngestIncomplete` naming the lag per partition.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from kafka import KafkaConsumer, KafkaProducer, OffsetAndMetadata, TopicPartition
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.errors import (
    CommitFailedError,
    FencedInstanceIdError,
    IllegalGenerationError,
    KafkaError,
    RebalanceInProgressError,
    UnknownMemberIdError,
)

from fitter.dataset import (
    RECORD_IDENTITY,
    SOURCE_OFFSET,
    SOURCE_PARTITION,
    file_name,
    hive_path,
    offset_files,
)
from fitter.kafka_clients import close_producer
from schemas import FrameError, decode_frame, encode_frame
from schemas.frames import DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_FRAME_RECORDS
from schemas.settings import Settings, SettingsError
from schemas.step_checks import MAX_FUTURE_S, StepChecks, Violation, check_steps

log = logging.getLogger(__name__)

Stage = str
"""'temp_written', 'renamed', 'dlq_flushed', 'committed' — for fault-injection in tests."""

MAX_FRAME_BYTES_LIMIT = 2**31 - 1
"""Arrow buffers and one message's memory: no setting above 2 GiB is sane."""
MAX_FRAME_RECORDS_LIMIT = 10_000_000

_REBALANCE_COMMIT_ERRORS = (CommitFailedError, RebalanceInProgressError,
                            IllegalGenerationError, UnknownMemberIdError,
                            FencedInstanceIdError)
"""A commit refused because the group moved on: the window's files stay, its offsets are
read again by whoever owns the partition now."""



def _transient(exc: BaseException) -> bool:
    """A broker that does not answer (an outage, a restart): kafka-python's retriable errors
    (KafkaConnectionError, KafkaTimeoutError, NodeNotReadyError, ...)."""
    return isinstance(exc, KafkaError) and bool(exc.retriable)


_LOCKS = ".ingest-locks"
_TEMP_PREFIX = ".tmp-"
_IDENTITY_CACHE_FILES = 64
RESENT_LOOKBACK_FILES = 8
"""Files of a partition before a window searched for the originals of re-sent frames (an
engine's sink re-sends within seconds: a timed-out frame goes first when the broker is back)."""


@dataclass(frozen=True, slots=True)
class IngestConfig:
    out_dir: Path
    group_id: str = "tabletune-ingest"
    window_records: int = 200_000
    """A partition's window closes at this many records ..."""
    window_s: float = 10.0
    """... or when its oldest record has waited this long."""
    until_idle_s: float | None = None
    """Stop after this many seconds without new messages, once caught up (batch mode);
    None runs forever."""
    lag_wait_s: float = 30.0
    """Batch mode, idle but behind the topic's end offsets: how long nothing may move (no
    message for us, no commit by any member) before `run()` gives up with `IngestIncomplete`.
    Longer than a session timeout, so a dead member's partitions come to us first."""
    poll_max_records: int = 2000
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """Largest decompressed frame accepted; larger ones are dead-lettered (too_large)."""
    max_frame_records: int = DEFAULT_MAX_FRAME_RECORDS
    """Most records accepted in one frame; more are dead-lettered (too_many_records)."""
    max_future_s: float = MAX_FUTURE_S
    """Records stamped further than this after the ingest clock are dead-lettered
    (invalid_ts_ns); raise it for twin fleets paced far faster than real time."""

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> SettingsError:
            return SettingsError(f"ingest {name}={getattr(self, name)!r}: {rule}")

        if not 1 <= self.window_records:
            raise bad("window_records", "must be >= 1")
        if not self.window_s > 0:
            raise bad("window_s", "must be > 0")
        if self.until_idle_s is not None and not self.until_idle_s > 0:
            raise bad("until_idle_s", "must be > 0 (or None to run forever)")
        if not self.lag_wait_s >= 0:
            raise bad("lag_wait_s", "must be >= 0")
        if not 1 <= self.poll_max_records:
            raise bad("poll_max_records", "must be >= 1")
        if not 1024 <= self.max_frame_bytes <= MAX_FRAME_BYTES_LIMIT:
            raise bad("max_frame_bytes", f"must be within 1024..{MAX_FRAME_BYTES_LIMIT}")
        if not 1 <= self.max_frame_records <= MAX_FRAME_RECORDS_LIMIT:
            raise bad("max_frame_records", f"must be within 1..{MAX_FRAME_RECORDS_LIMIT}")
        if not 0 <= self.max_future_s < float("inf"):
            raise bad("max_future_s", "must be finite and >= 0")


@dataclass
class IngestCounters:
    records: int = 0
    frames: int = 0
    files: int = 0
    windows: int = 0
    dlq: int = 0
    """Dead-letter messages sent (frames refused whole, and messages of invalid rows)."""
    invalid_records: int = 0
    """Rows of decodable frames that failed a semantic check (dead-lettered, not written)."""
    dlq_failures: int = 0
    """Dead-letter messages the broker did not acknowledge: their window was not committed
    (read again)."""
    skipped_duplicates: int = 0
    resent_duplicates: int = 0
    """Copies of records at later offsets (an engine re-sent a frame the broker had
    written), dropped: the earlier offset's record is the one stored."""
    reset_records: int = 0
    """Records at offsets an existing file covers that the file does not hold (the topic's
    offsets restarted): written, not skipped."""
    abandoned_windows: int = 0
    """In-flight windows dropped uncommitted on a rebalance (their records are read again)."""
    commit_failures: int = 0
    """Window commits the group refused during a rebalance (files kept, offsets re-read)."""
    lag_records: int = 0
    """Messages behind the partitions' high watermarks at the last check (consumer lag)."""
    unread: dict[int, int] = field(default_factory=dict)
    """Batch mode: messages per partition between the group's committed offset and the end
    offset at the last check, over every partition of the topic (empty: caught up)."""
    dlq_reasons: dict[str, int] = field(default_factory=dict)


class IngestIncomplete(RuntimeError):
    """Batch mode ended idle but not caught up; `unread` maps partition -> messages."""

    def __init__(self, topic: str, unread: dict[int, int], detail: str,
                 counters: IngestCounters) -> None:
        total = sum(unread.values())
        behind = f": {total} messages unread" if total else ""
        super().__init__(f"not caught up on {topic}{behind} ({detail})")
        self.topic = topic
        self.unread = unread
        self.counters = counters


@dataclass
class _Window:
    tables: list[pa.Table] = field(default_factory=list)
    records: int = 0
    first_offset: int = -1
    last_offset: int = -1
    opened_at: float = 0.0


class _AssignmentChanges(ConsumerRebalanceListener):
    """Runs on kafka-python's IO thread: only notes changes; the poll loop acts on them.

    `joining` is True from a revocation (every eager rebalance starts with one) until the
    next assignment. Meanwhile the poll loop only polls: kafka-python 3.0 finishes a
    JoinGroup/SyncGroup in the background and, if no poll() is waiting on it when it
    completes (the loop busy committing or asking for offsets, which queue behind the
    JoinGroup on the coordinator's connection), drops the result and joins again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changes = 0
        self._joining = False

    @property
    def changes(self) -> int:
        with self._lock:
            return self._changes

    @property
    def joining(self) -> bool:
        with self._lock:
            return self._joining

    def _note(self, what: str, partitions: object, *, joining: bool) -> None:
        with self._lock:
            self._changes += 1
            self._joining = joining
        log.info("partitions %s: %s", what, sorted(getattr(tp, "partition", tp)
                                                   for tp in partitions or ()))

    def on_partitions_revoked(self, revoked: object) -> None:
        self._note("revoked", revoked, joining=True)

    def on_partitions_lost(self, lost: object) -> None:
        self._note("lost", lost, joining=True)

    def on_partitions_assigned(self, assigned: object) -> None:
        self._note("assigned", assigned, joining=False)


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
        self._dlq_sent: list[object] = []
        """Futures of dead-letter sends not yet checked at a window commit."""
        self._stop = False
        self._lag_checked = 0.0
        self._changes = _AssignmentChanges()
        self._rewind = False
        self._seen_changes = 0
        self._joining_since: float | None = None
        self._identities: OrderedDict[Path, pl.DataFrame] = OrderedDict()
        self._token = uuid.uuid4().hex[:12]
        self._lock_file: IO[str] | None = None
        self._caught_up_checked = 0.0
        self._progress: tuple[tuple[int, int], ...] | None = None
        self._stalled_since = 0.0
        config.out_dir.mkdir(parents=True, exist_ok=True)
        self._claim()
        self._remove_dead_temp_files()

    def stop(self) -> None:
        self._stop = True

    def run(self) -> IngestCounters:
        if self._lock_file is None:
            self._claim()
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
                    if not _transient(exc):
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
                    self._check_join(started)
                    continue
                self._joining_since = None
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
                        and not self._rewind and self._caught_up(consumer):
                    break
            if not self._rewind:
                self._close_windows(force=True)
        finally:
            consumer.close(autocommit=False)
            if self._dlq is not None:
                close_producer(self._dlq, timeout_s=5)
            self._release()
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
            if not _transient(exc):
                raise
            log.info("lag not measured (%s: %s): the broker does not answer",
                     type(exc).__name__, exc)
            return
        self.counters.lag_records = lag

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
        except (*_REBALANCE_COMMIT_ERRORS, ValueError, KafkaError) as exc:
            # the group moved again (ValueError: a partition is no longer assigned), or the
            # broker does not answer
            if isinstance(exc, KafkaError) and not isinstance(
                    exc, _REBALANCE_COMMIT_ERRORS) and not _transient(exc):
                raise
            log.info("rebalance: rewind deferred to the next poll (%s)", exc)
            return
        self._rewind = False

    # ---- batch mode: caught up? ------------------------------------------------------------
    def _check_join(self, started: float) -> None:
        """Batch mode: a rebalance that never ends (a member gone without leaving holds it
        for its rebalance timeout) is a failure to report, not a reason to wait forever."""
        now = time.monotonic()
        if self._joining_since is None:
            self._joining_since = now
        limit = max(60.0, self.config.lag_wait_s)
        if self.config.until_idle_s is not None and now - self._joining_since >= limit:
            raise IngestIncomplete(self.topic, dict(self.counters.unread), (
                f"group {self.config.group_id!r} has been rebalancing for {limit:g}s "
                f"(running {now - started:.0f}s); a member that is gone without leaving "
                "holds the group until its rebalance timeout"), self.counters)

    def _caught_up(self, consumer: KafkaConsumer) -> bool:
        """True once the group's committed offsets reach the end offsets of every partition
        of the topic; raises `IngestIncomplete` once behind with nothing moving for
        `lag_wait_s`."""
        now = time.monotonic()
        if now - self._caught_up_checked < 1.0:
            return False
        self._caught_up_checked = now
        try:
            bounds = partition_bounds(self.settings, self.topic)
            committed = {p: consumer.committed(TopicPartition(self.topic, p)) for p in bounds}
        except KafkaError as exc:
            if not _transient(exc):
                raise
            log.info("caught-up check deferred (%s: %s)", type(exc).__name__, exc)
            return False
        unread: dict[int, int] = {}
        details: list[str] = []
        for partition, (begin, end) in sorted(bounds.items()):
            if end is None:
                unread[partition] = 0
                details.append(f"partition {partition}: end offset unknown")
                continue
            done = max(begin, committed[partition] or 0)
            if end > done:
                unread[partition] = end - done
                details.append(f"partition {partition}: {end - done} (committed "
                               f"{committed[partition]}, end {end})")
        self.counters.unread = unread
        if not unread:
            return True
        progress = tuple(sorted((p, c or 0) for p, c in committed.items()))
        if progress != self._progress:
            self._progress, self._stalled_since = progress, now
        if now - self._stalled_since >= self.config.lag_wait_s:
            owned = sorted(tp.partition for tp in consumer.assignment())
            raise IngestIncomplete(self.topic, unread, "; ".join(details) + (
                f"; this member owns partitions {owned}, nothing moved for "
                f"{self.config.lag_wait_s:g}s: another member of group "
                f"{self.config.group_id!r} holds the rest without committing"),
                self.counters)
        return False

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
        original = [(f"original-{k}", v) for k, v in (message.headers or [])]
        source = self._send_dlq(partition, message.offset, error.reason, error.detail,
                                message.value or b"", original)
        log.warning("dead-lettered %s: %s", source, error)

    def _send_dlq(self, partition: int, offset: int, reason: str, detail: str, value: bytes,
                  headers: list[tuple[str, bytes]]) -> str:
        if self._dlq is None:
            self._dlq = KafkaProducer(**self.settings.client_kwargs(), linger_ms=5,
                                      max_request_size=16 * 1024 * 1024)
        source = f"{self.topic}:{partition}:{offset}"
        headers = [("tabletune-dlq-reason", reason.encode()),
                   ("tabletune-dlq-detail", detail.encode()[:2000]),
                   ("tabletune-source-topic", self.topic.encode()),
                   ("tabletune-source-partition", str(partition).encode()),
                   ("tabletune-source-offset", str(offset).encode()), *headers]
        self._dlq_sent.append(self._dlq.send(self.settings.topics.dlq, key=source.encode(),
                                             value=value, headers=headers))
        self.counters.dlq += 1
        self.counters.dlq_reasons[reason] = self.counters.dlq_reasons.get(reason, 0) + 1
        return source

    def _screen(self, partition: int, table: pa.Table) -> pa.Table:
        """The rows of a window that pass the semantic checks; the others are sent to the
        dead-letter topic (flushed before the window commits)."""
        checks = check_steps(table, now_ns=time.time_ns(),
                             max_future_s=self.config.max_future_s)
        if checks.ok:
            return table
        self._dead_letter_rows(partition, table, checks)
        return table.filter(pa.array(checks.valid))

    def _dead_letter_rows(self, partition: int, table: pa.Table, checks: StepChecks) -> None:
        """One message per (check, source offset, engine): a frame of those rows, so the
        dead-letter topic holds every record left out, decodable as telemetry."""
        offsets = table.column(SOURCE_OFFSET).to_numpy()
        records = table.drop_columns([SOURCE_PARTITION, SOURCE_OFFSET])
        for violation in checks.violations:
            at = offsets[violation.rows]
            order = np.argsort(at, kind="stable")
            starts = np.flatnonzero(np.r_[True, at[order][1:] != at[order][:-1]])
            for group in np.split(order, starts[1:]):
                self._dead_letter_group(partition, int(at[group[0]]), records,
                                        violation.subset(group))
            self.counters.invalid_records += len(violation.rows)
            log.warning("dead-lettered %d rows of %s:%d offsets %d-%d: %s",
                        len(violation.rows), self.topic, partition, int(at.min()),
                        int(at.max()), violation.detail)

    def _dead_letter_group(self, partition: int, offset: int, records: pa.Table,
                           violation: Violation) -> None:
        rows = records.take(pa.array(violation.rows))
        engines = rows.column("engine_id").to_numpy(zero_copy_only=False)
        for engine in dict.fromkeys(engines):  # one engine per frame (a forged one may mix)
            mine = np.flatnonzero(engines == engine)
            frame = encode_frame(rows.take(pa.array(mine)))
            self._send_dlq(partition, offset, violation.reason,
                           violation.subset(mine).detail, frame.value,
                           [("tabletune-dlq-field", violation.field.encode()),
                            *frame.headers])

    def _dlq_delivered(self) -> bool:
        """After a flush: True when every dead-letter message sent since the last check was
        acknowledged. A failed one keeps the window uncommitted: it is read again."""
        sent, self._dlq_sent = self._dlq_sent, []
        failed = [future for future in sent if not future.succeeded()]  # or still pending
        if not failed:
            return True
        self.counters.dlq_failures += len(failed)
        log.error("%d dead-letter messages were not acknowledged (%s): the window is not "
                  "committed and is read again", len(failed), failed[0].exception)
        return False

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
        """False when the group refused the commit, or the assignment moved since the poll
        (a rebalance): the poll loop then abandons the other windows and rewinds."""
        if self._assignment_moved():
            self._rewind = True
            return False
        if window.tables:
            records = self._screen(partition, pa.concat_tables(window.tables))
            if records.num_rows:
                self._write_groups(partition, pl.from_arrow(records))
        if self._dlq is not None:
            try:
                self._dlq.flush(timeout=30)
            except KafkaError as exc:  # pending sends are counted as failed below
                if not _transient(exc):
                    raise
                log.warning("dead-letter flush failed (%s: %s)", type(exc).__name__, exc)
            if not self._dlq_delivered():
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
        except (*_REBALANCE_COMMIT_ERRORS, KafkaError) as exc:
            if not isinstance(exc, _REBALANCE_COMMIT_ERRORS) and not _transient(exc):
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

    def _write_groups(self, partition: int, records: pl.DataFrame) -> None:
        stamps = pl.from_epoch(pl.col("ts_ns"), time_unit="ns")
        records = records.with_columns(stamps.dt.strftime("%Y-%m-%d").alias("_date"),
                                       stamps.dt.hour().alias("_hour"))
        written: list[tuple[Path, Path]] = []
        for keys, group in records.group_by(["model", "drafter", "hardware", "_date",
                                             "_hour"]):
            model, drafter, hardware, date, hour = keys
            directory = hive_path(model, drafter, hardware, date, int(hour))
            folder = self.config.out_dir / directory
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
        self.on_stage("temp_written")
        for temporary, final in written:
            os.replace(temporary, final)
            _fsync(final.parent)
            self.counters.files += 1
        self.on_stage("renamed")

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

    # ---- temp files of dead writers -------------------------------------------------------
    def _claim(self) -> None:
        """Hold an advisory lock for as long as this ingestor may leave temp files, so a
        replica starting beside it removes only the temp files of writers that are gone."""
        locks = self.config.out_dir / _LOCKS
        locks.mkdir(exist_ok=True)
        handle = open(locks / f"{self._token}.lock", "w")  # noqa: SIM115 (held until release)
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._lock_file = handle

    def _release(self) -> None:
        handle, self._lock_file = self._lock_file, None
        if handle is not None:
            Path(handle.name).unlink(missing_ok=True)
            handle.close()

    def _remove_dead_temp_files(self) -> None:
        live = {self._token}
        for lock in (self.config.out_dir / _LOCKS).glob("*.lock"):
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
        for leftover in self.config.out_dir.rglob(f"{_TEMP_PREFIX}*"):
            owner = leftover.name[len(_TEMP_PREFIX):len(_TEMP_PREFIX) + len(self._token)]
            if owner not in live:
                leftover.unlink(missing_ok=True)


def partition_bounds(settings: Settings, topic: str, *, timeout_s: float = 10.0
                     ) -> dict[int, tuple[int, int | None]]:
    """(log start, end offset) of every partition of `topic`; the end is None where no fetch
    answered within `timeout_s`.

    The end is the high watermark a fetch reports (`consumer.highwater`), read by a consumer
    outside any group that assigns itself every partition and fetches once near its end.
    ListOffsets (`end_offsets`) is only the hint where to fetch from: it is exact on Apache
    Kafka, but some Kafka-protocol brokers answer the start of the last batch + 1."""
    consumer = KafkaConsumer(**settings.client_kwargs(), group_id=None,
                             enable_auto_commit=False, auto_offset_reset="earliest",
                             fetch_max_wait_ms=100)
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            raise SettingsError(f"topic {topic!r} has no partitions (does it exist?)")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        begins = consumer.beginning_offsets(tps)
        hints = consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, max(begins[tp], hints[tp] - 1))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(consumer.highwater(tp) is None
                                                  for tp in tps):
            consumer.poll(timeout_ms=100)
        return {tp.partition: (begins[tp], consumer.highwater(tp)) for tp in tps}
    finally:
        consumer.close()


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
