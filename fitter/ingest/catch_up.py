"""Batch mode (`until_idle_s`): whether ingest may stop, or must report that it cannot.

It stops only once caught up: every partition of the topic, whoever owns it, committed by
the group up to its end offset. Idle but behind (a member holds partitions without
committing, a rebalance is due), it keeps consuming; once nothing has moved for
`lag_wait_s`, or a rebalance has not ended in time, it raises `IngestIncomplete` naming the
lag per partition.
"""

from __future__ import annotations

import logging
import time

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from fitter.ingest.broker_errors import transient
from fitter.ingest.config import IngestConfig
from fitter.ingest.counters import IngestCounters
from schemas.settings import Settings, SettingsError

log = logging.getLogger(__name__)


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


class CatchUp:
    """The batch-mode checks of one ingest consumer, each asked from its poll loop."""

    def __init__(self, settings: Settings, config: IngestConfig,
                 counters: IngestCounters) -> None:
        self._settings = settings
        self._config = config
        self._counters = counters
        self._topic = settings.topics.telemetry
        self._joining_since: float | None = None
        self._caught_up_checked = 0.0
        self._progress: tuple[tuple[int, int], ...] | None = None
        self._stalled_since = 0.0

    def joined(self) -> None:
        """The group has assigned us: no rebalance is running."""
        self._joining_since = None

    def check_join(self, started: float) -> None:
        """Batch mode: a rebalance that never ends (a member gone without leaving holds it
        for its rebalance timeout) is a failure to report, not a reason to wait forever."""
        now = time.monotonic()
        if self._joining_since is None:
            self._joining_since = now
        limit = max(60.0, self._config.lag_wait_s)
        if self._config.until_idle_s is not None and now - self._joining_since >= limit:
            raise IngestIncomplete(self._topic, dict(self._counters.unread), (
                f"group {self._config.group_id!r} has been rebalancing for {limit:g}s "
                f"(running {now - started:.0f}s); a member that is gone without leaving "
                "holds the group until its rebalance timeout"), self._counters)

    def caught_up(self, consumer: KafkaConsumer) -> bool:
        """True once the group's committed offsets reach the end offsets of every partition
        of the topic; raises `IngestIncomplete` once behind with nothing moving for
        `lag_wait_s`."""
        now = time.monotonic()
        if now - self._caught_up_checked < 1.0:
            return False
        self._caught_up_checked = now
        try:
            bounds = partition_bounds(self._settings, self._topic)
            committed = {p: consumer.committed(TopicPartition(self._topic, p)) for p in bounds}
        except KafkaError as exc:
            if not transient(exc):
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
        self._counters.unread = unread
        if not unread:
            return True
        progress = tuple(sorted((p, c or 0) for p, c in committed.items()))
        if progress != self._progress:
            self._progress, self._stalled_since = progress, now
        if now - self._stalled_since >= self._config.lag_wait_s:
            owned = sorted(tp.partition for tp in consumer.assignment())
            raise IngestIncomplete(self._topic, unread, "; ".join(details) + (
                f"; this member owns partitions {owned}, nothing moved for "
                f"{self._config.lag_wait_s:g}s: another member of group "
                f"{self._config.group_id!r} holds the rest without committing"),
                self._counters)
        return False


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
