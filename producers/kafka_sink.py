"""The Kafka sink: step-record frames to the telemetry topic, from the recorder's thread.

It adds a sender thread of its own and a bounded queue of encoded frames, because
kafka-python's send buffer is unbounded and a broker outage must cost the engine memory we
chose, not memory it grows into.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import pyarrow as pa
from kafka import KafkaProducer

from fitter.kafka_clients import NEVER_BLOCK_BOOTSTRAP_MS, close_producer
from schemas import Frame, encode_frame
from schemas.settings import Settings

log = logging.getLogger(__name__)

FINAL_SEND_S = 1.0
"""At close, how long frames handed to the producer after close()'s flush may take before
they are failed (a broker that is down would otherwise hold the engine's shutdown)."""


@dataclass(frozen=True, slots=True)
class KafkaSinkConfig:
    max_queued_frames: int = 1024
    """Frames waiting or in flight; beyond this the oldest waiting frame is dropped."""
    max_queued_bytes: int = 64 * 1024 * 1024
    """Same bound in bytes of encoded frames."""
    send_timeout_s: float = 10.0
    """A frame not acknowledged by then is failed, re-queued and the producer recreated."""
    retry_backoff_s: float = 0.5


class KafkaSink:
    """Frames to the telemetry topic, keyed by engine id; never blocks the caller."""

    def __init__(self, settings: Settings, config: KafkaSinkConfig | None = None) -> None:
        self.settings = settings
        self.config = config or KafkaSinkConfig()
        self.topic = settings.topics.telemetry
        self._client_kwargs = settings.client_kwargs()  # fails fast on missing bootstrap
        self._queue: deque[Frame] = deque()
        self._queued_bytes = 0
        self._in_flight: dict[int, Frame] = {}
        self._deadlines: dict[int, float] = {}
        """Monotonic time by which each in-flight frame must be acknowledged."""
        self._cond = threading.Condition()
        self._closed = False
        self._producer: KafkaProducer | None = None
        self._producer_broken = False
        self.sent_frames = 0
        self.sent_records = 0
        self.dropped_frames = 0
        self.dropped_records = 0
        self.errors = 0
        self.producer_restarts = 0
        self._thread = threading.Thread(target=self._run, name="tabletune-kafka-sink",
                                        daemon=True)
        self._thread.start()

    def write(self, records: pa.Table) -> None:
        self._enqueue(encode_frame(records), front=False)

    def _enqueue(self, frame: Frame, *, front: bool) -> None:
        with self._cond:
            if front:
                self._queue.appendleft(frame)
            else:
                self._queue.append(frame)
            self._queued_bytes += len(frame.value)
            self._enforce_bounds_locked()
            self._cond.notify_all()

    def _enforce_bounds_locked(self) -> None:
        cfg = self.config
        while self._queue and (
            len(self._queue) + len(self._in_flight) > cfg.max_queued_frames
            or self._queued_bytes > cfg.max_queued_bytes
        ):
            oldest = self._queue.popleft()
            self._queued_bytes -= len(oldest.value)
            self.dropped_frames += 1
            self.dropped_records += oldest.num_records

    def _run(self) -> None:
        try:
            self._send_until_closed()
        finally:
            # This thread owns the producer: closed here, even when close() gave up waiting
            # for the thread (blocked in a new producer's bootstrap during an outage).
            producer, self._producer = self._producer, None
            if producer is not None:
                close_producer(producer, timeout_s=FINAL_SEND_S)

    def _send_until_closed(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait(timeout=0.5)
                    self._expire_in_flight_locked()
                if self._closed and not self._queue:
                    return
                frame = self._queue.popleft()
                self._queued_bytes -= len(frame.value)
            if not self._send(frame):
                self._enqueue(frame, front=True)
                self._stop_producer()
                if self._wait_closed(self.config.retry_backoff_s):
                    return

    def _send(self, frame: Frame) -> bool:
        try:
            producer = self._ensure_producer()
            future = producer.send(self.topic, key=frame.key, value=frame.value,
                                   headers=frame.headers)
        except Exception as exc:  # broker down, metadata timeout, closed producer
            self.errors += 1
            log.debug("telemetry send failed: %s", exc)
            return False
        token = id(frame)
        with self._cond:
            self._in_flight[token] = frame
            self._deadlines[token] = time.monotonic() + self.config.send_timeout_s
        future.add_callback(self._on_sent, token)
        future.add_errback(self._on_failed, token)
        return True

    def _on_sent(self, token: int, _metadata: object) -> None:
        with self._cond:
            frame = self._in_flight.pop(token, None)
            self._deadlines.pop(token, None)
            if frame is not None:
                self.sent_frames += 1
                self.sent_records += frame.num_records
            self._cond.notify_all()

    def _on_failed(self, token: int, exc: BaseException) -> None:
        with self._cond:
            frame = self._in_flight.pop(token, None)
            self._deadlines.pop(token, None)
            self.errors += 1
            self._producer_broken = True
        log.debug("telemetry frame failed: %s", exc)
        if frame is not None:
            self._enqueue(frame, front=True)

    def _expire_in_flight_locked(self) -> None:
        now = time.monotonic()
        expired = [t for t, deadline in self._deadlines.items() if deadline < now]
        for token in expired:
            self._deadlines.pop(token, None)
            frame = self._in_flight.pop(token, None)
            if frame is not None:
                self.errors += 1
                self._producer_broken = True
                self._queue.appendleft(frame)
                self._queued_bytes += len(frame.value)
        if expired:
            self._enforce_bounds_locked()

    def _ensure_producer(self) -> KafkaProducer:
        if self._producer_broken and self._producer is not None:
            self._stop_producer()
        if self._producer is None:
            self._producer = KafkaProducer(
                **self._client_kwargs,
                linger_ms=5,
                max_block_ms=2000,
                request_timeout_ms=5000,
                delivery_timeout_ms=int(self.config.send_timeout_s * 1000),
                reconnect_backoff_max_ms=1000,
                max_request_size=16 * 1024 * 1024,
                bootstrap_timeout_ms=NEVER_BLOCK_BOOTSTRAP_MS,
            )
            self._producer_broken = False
        return self._producer

    def _stop_producer(self) -> None:
        # kafka-python's idempotent producer cannot recover from a broker that lost its
        # producer ids (a restart): a fresh producer is the only reliable way back.
        # Its frames still in flight fail (errbacks re-queue them); none waits for a broker.
        producer, self._producer = self._producer, None
        if producer is not None:
            self.producer_restarts += 1
            close_producer(producer, timeout_s=0)
        with self._cond:
            for token, frame in list(self._in_flight.items()):
                self._queue.appendleft(frame)
                self._queued_bytes += len(frame.value)
                self._in_flight.pop(token)
                self._deadlines.pop(token, None)
            self._enforce_bounds_locked()

    def _wait_closed(self, seconds: float) -> bool:
        with self._cond:
            if not self._closed:
                self._cond.wait(timeout=seconds)
            return self._closed

    def flush(self, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(timeout=min(remaining, 0.1))
                self._expire_in_flight_locked()
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)

    def counters(self) -> dict[str, int]:
        with self._cond:
            return {
                "sent_frames": self.sent_frames,
                "sent_records": self.sent_records,
                "dropped_frames": self.dropped_frames,
                "dropped_records": self.dropped_records,
                "errors": self.errors,
                "producer_restarts": self.producer_restarts,
                "queue_frames": len(self._queue) + len(self._in_flight),
                "queue_bytes": self._queued_bytes,
            }
