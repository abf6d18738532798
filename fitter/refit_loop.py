"""`tabletune fit` as a job: read the Parquet window, decide, write, publish; optionally forever.

One refit = read the dataset (optionally only the last `since`), find the current envelope
(the newest version on the tables topic for the key, or a file), `decide_refit`, write the
candidate to `out`, publish it when the decision says so. `watch` repeats that every period
and at once when a controller reports the key's table `stale` on the status topic.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from controller.table_log import publish, read_log
from fitter.dataset import read_dataset
from fitter.refit import DEFAULT_THRESHOLD, RefitDecision, decide_refit, key_from_records
from fitter.surface.fit import DEFAULT_HALF_LIFE_S
from schemas import TableEnvelope, TableKey
from tabletune.settings import Settings
from tabletune.table_files import load_table_file

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class RefitJob:
    """Everything one refit needs; the CLI builds it from flags."""

    parquet: Path
    since: dt.timedelta | None = None
    out: Path | None = None
    key: TableKey | None = None
    max_k: int | None = None
    max_batch: int | None = None
    startup_k_values: Sequence[int] | None = None
    threshold: float = DEFAULT_THRESHOLD
    half_life_s: float | None = DEFAULT_HALF_LIFE_S
    current_file: Path | None = None
    """The current envelope from a file instead of the tables topic."""
    publish: bool = False
    settings: Settings | None = None
    """Needed to read the current envelope from the topic and to publish."""


@dataclasses.dataclass(frozen=True, slots=True)
class RefitOutcome:
    decision: RefitDecision
    records: int
    offset: int | None
    """Where the envelope was published (None: not published)."""

    def to_dict(self) -> dict[str, Any]:
        return {**self.decision.to_dict(), "records": self.records, "offset": self.offset}


def current_envelope(settings: Settings, key: TableKey) -> tuple[TableEnvelope | None, int]:
    """(the newest envelope for `key` on the tables topic, the newest version number)."""
    envelopes = [e.message for e in read_log(settings, key)
                 if isinstance(e.message, TableEnvelope)]
    if not envelopes:
        return None, 0
    newest = max(envelopes, key=lambda e: e.version)
    return newest, newest.version


def refit_once(job: RefitJob, *, stale: bool = False,
               now: dt.datetime | None = None) -> RefitOutcome:
    """One refit; publishes only when the decision says so and the job allows it."""
    records = read_dataset(job.parquet, since=job.since, now=now)
    if records.height == 0:
        raise ValueError(f"no telemetry under {job.parquet}"
                         + (f" within the last {job.since}" if job.since else ""))
    key = job.key or key_from_records(records)
    current: TableEnvelope | None = None
    newest = 0
    if job.current_file is not None:
        _, current = load_table_file(job.current_file)
        newest = current.version if current is not None else 0
    elif job.settings is not None and job.settings.bootstrap_servers:
        current, newest = current_envelope(job.settings, key)
    decision = decide_refit(records, current, key=key, max_k=job.max_k,
                            max_batch=job.max_batch, startup_k_values=job.startup_k_values,
                            newest_version=newest, threshold=job.threshold, stale=stale,
                            half_life_s=job.half_life_s,
                            provenance={"parquet": str(job.parquet),
                                        "since_s": job.since.total_seconds()
                                        if job.since else None})
    if job.out is not None:
        job.out.parent.mkdir(parents=True, exist_ok=True)
        job.out.write_text(json.dumps(decision.envelope.to_dict(), indent=2, sort_keys=True)
                           + "\n")
    offset = None
    if job.publish and decision.publish:
        if job.settings is None or not job.settings.bootstrap_servers:
            raise ValueError("--publish needs --bootstrap (or TABLETUNE_BOOTSTRAP)")
        offset = publish(job.settings, decision.envelope)
        log.info("published %s version %d at offset %d (%s)", key,
                 decision.envelope.version, offset, decision.reason)
    return RefitOutcome(decision, records.height, offset)


class StaleEvents:
    """`stale` events for one table key on the status topic, newer than when it started.

    Reads from the beginning with explicit partitions (no consumer group: a group join is
    slow on some brokers and the watcher needs no shared offsets) and skips events stamped
    before it started, so end offsets, which some brokers get wrong, are never needed.
    """

    def __init__(self, settings: Settings, key: TableKey | None) -> None:
        self.settings = settings
        self.key = key
        self.started = dt.datetime.now(dt.UTC)
        self._consumer: KafkaConsumer | None = None

    def wait(self, timeout_s: float) -> bool:
        """True as soon as a matching stale event arrives, False after `timeout_s`."""
        consumer = self._ensure()
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return False
            for messages in consumer.poll(timeout_ms=min(left_ms, 500)).values():
                if any(self._matches(m.value) for m in messages):
                    return True

    def _matches(self, value: bytes) -> bool:
        try:
            event = json.loads(value)
            at = dt.datetime.fromisoformat(str(event.get("at", "")))
        except (ValueError, TypeError):
            return False
        if event.get("event") != "stale" or at < self.started:
            return False
        return self.key is None or event.get("table_key") == str(self.key)

    def _ensure(self) -> KafkaConsumer:
        if self._consumer is None:
            consumer = KafkaConsumer(**self.settings.client_kwargs(), enable_auto_commit=False)
            topic = self.settings.topics.status
            partitions = [TopicPartition(topic, p)
                          for p in sorted(consumer.partitions_for_topic(topic) or ())]
            consumer.assign(partitions)
            if partitions:
                consumer.seek_to_beginning(*partitions)
            self._consumer = consumer
        return self._consumer

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


def watch(job: RefitJob, *, period_s: float, count: int | None = None,
          timeout_s: float | None = None,
          on_outcome: Callable[[RefitOutcome], None] | None = None) -> list[RefitOutcome]:
    """Refit every `period_s` and at once on a `stale` event; stop after `count` refits or
    `timeout_s` (both None: until interrupted). A failed refit is logged and retried at the
    next period: a transient broker or data problem must not end the watcher."""
    events = StaleEvents(job.settings, job.key) if job.settings is not None \
        and job.settings.bootstrap_servers else None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    outcomes: list[RefitOutcome] = []
    stale = False
    try:
        while count is None or len(outcomes) < count:
            try:
                outcome = refit_once(job, stale=stale)
            except (ValueError, FileNotFoundError) as exc:
                log.warning("refit failed: %s", exc)
            else:
                outcomes.append(outcome)
                if on_outcome is not None:
                    on_outcome(outcome)
            if count is not None and len(outcomes) >= count:
                break
            wait_s = period_s
            if deadline is not None:
                wait_s = min(wait_s, deadline - time.monotonic())
                if wait_s <= 0:
                    break
            if events is not None:
                stale = events.wait(wait_s)
            else:
                time.sleep(wait_s)
                stale = False
    finally:
        if events is not None:
            events.close()
    return outcomes
