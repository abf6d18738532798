"""Ingest's dead-letter writer: frames refused whole, and the rows of good frames that fail a
semantic check, sent to the dead-letter topic with the reason and the source offset.

Frames that do not decode (or would decompress past `max_frame_bytes`, or hold more than
`max_frame_records`) are sent as they came, their headers kept as `original-*`. Rows that
fail `schemas.step_checks` (a negative batch, accepted > drafted, NaN latency, a stamp in
2262) are left out of the window's records and sent at window close: one message per source
offset and check, a frame of just those rows, its reason naming the field
(`invalid_batch_size`). `delivered()` says whether the broker acknowledged every message
sent since it was last asked; a window commits only once it has.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pyarrow as pa
from kafka import KafkaProducer
from kafka.errors import KafkaError

from fitter.dataset import SOURCE_OFFSET, SOURCE_PARTITION
from fitter.ingest.broker_errors import transient
from fitter.ingest.counters import IngestCounters
from fitter.kafka_clients import close_producer
from schemas import FrameError, encode_frame
from schemas.settings import Settings
from schemas.step_checks import StepChecks, Violation, check_steps

log = logging.getLogger(__name__)


class DeadLetters:
    """The dead-letter producer of one ingest consumer, made at the first letter."""

    def __init__(self, settings: Settings, topic: str, counters: IngestCounters,
                 max_future_s: float) -> None:
        self.settings = settings
        self.topic = topic
        self.counters = counters
        self.max_future_s = max_future_s
        self._producer: KafkaProducer | None = None
        self._sent: list[object] = []
        """Futures of dead-letter sends not yet checked at a window commit."""

    def refuse_frame(self, partition: int, message: object, error: FrameError) -> None:
        """A frame that does not decode, sent as it came."""
        original = [(f"original-{k}", v) for k, v in (message.headers or [])]
        source = self._send(partition, message.offset, error.reason, error.detail,
                            message.value or b"", original)
        log.warning("dead-lettered %s: %s", source, error)

    def screen(self, partition: int, table: pa.Table) -> pa.Table:
        """The rows of a window that pass the semantic checks; the others are sent to the
        dead-letter topic (flushed before the window commits)."""
        checks = check_steps(table, now_ns=time.time_ns(), max_future_s=self.max_future_s)
        if checks.ok:
            return table
        self._refuse_rows(partition, table, checks)
        return table.filter(pa.array(checks.valid))

    def delivered(self) -> bool:
        """Flush, then True when every message sent since the last call was acknowledged
        (or none was ever sent). A failed one keeps the window uncommitted: it is read
        again."""
        if self._producer is None:
            return True
        try:
            self._producer.flush(timeout=30)
        except KafkaError as exc:  # pending sends are counted as failed below
            if not transient(exc):
                raise
            log.warning("dead-letter flush failed (%s: %s)", type(exc).__name__, exc)
        sent, self._sent = self._sent, []
        failed = [future for future in sent if not future.succeeded()]  # or still pending
        if not failed:
            return True
        self.counters.dlq_failures += len(failed)
        log.error("%d dead-letter messages were not acknowledged (%s): the window is not "
                  "committed and is read again", len(failed), failed[0].exception)
        return False

    def close(self) -> None:
        if self._producer is not None:
            close_producer(self._producer, timeout_s=5)

    def _refuse_rows(self, partition: int, table: pa.Table, checks: StepChecks) -> None:
        """One message per (check, source offset, engine): a frame of those rows, so the
        dead-letter topic holds every record left out, decodable as telemetry."""
        offsets = table.column(SOURCE_OFFSET).to_numpy()
        records = table.drop_columns([SOURCE_PARTITION, SOURCE_OFFSET])
        for violation in checks.violations:
            at = offsets[violation.rows]
            order = np.argsort(at, kind="stable")
            starts = np.flatnonzero(np.r_[True, at[order][1:] != at[order][:-1]])
            for group in np.split(order, starts[1:]):
                self._refuse_group(partition, int(at[group[0]]), records,
                                   violation.subset(group))
            self.counters.invalid_records += len(violation.rows)
            log.warning("dead-lettered %d rows of %s:%d offsets %d-%d: %s",
                        len(violation.rows), self.topic, partition, int(at.min()),
                        int(at.max()), violation.detail)

    def _refuse_group(self, partition: int, offset: int, records: pa.Table,
                      violation: Violation) -> None:
        rows = records.take(pa.array(violation.rows))
        engines = rows.column("engine_id").to_numpy(zero_copy_only=False)
        for engine in dict.fromkeys(engines):  # one engine per frame (a forged one may mix)
            mine = np.flatnonzero(engines == engine)
            frame = encode_frame(rows.take(pa.array(mine)))
            self._send(partition, offset, violation.reason, violation.subset(mine).detail,
                       frame.value, [("tabletune-dlq-field", violation.field.encode()),
                                     *frame.headers])

    def _send(self, partition: int, offset: int, reason: str, detail: str, value: bytes,
              headers: list[tuple[str, bytes]]) -> str:
        if self._producer is None:
            self._producer = KafkaProducer(**self.settings.client_kwargs(), linger_ms=5,
                                           max_request_size=16 * 1024 * 1024)
        source = f"{self.topic}:{partition}:{offset}"
        headers = [("tabletune-dlq-reason", reason.encode()),
                   ("tabletune-dlq-detail", detail.encode()[:2000]),
                   ("tabletune-source-topic", self.topic.encode()),
                   ("tabletune-source-partition", str(partition).encode()),
                   ("tabletune-source-offset", str(offset).encode()), *headers]
        self._sent.append(self._producer.send(self.settings.topics.dlq, key=source.encode(),
                                              value=value, headers=headers))
        self.counters.dlq += 1
        self.counters.dlq_reasons[reason] = self.counters.dlq_reasons.get(reason, 0) + 1
        return source
