"""Telemetry sinks: Kafka (production) and Arrow IPC files (offline profiling, no broker).

Both run on the recorder's background thread. The Kafka sink adds a sender thread of its own
and a bounded queue of encoded frames, because kafka-python's send buffer is unbounded and a
broker outage must cost the engine memory we chose, not memory it grows into.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.ipc as ipc
from kafka import KafkaProducer

from fitter.kafka_clients import check_reachable, close_producer
from schemas import Frame, encode_frame
from schemas.settings import Settings

log = logging.getLogger(__name__)

FINAL_SEND_S = 1.0
"""At close, how long frames handed to the producer after close()'s flush may take before
they are failed (a broker that is down would otherwise hold the engine's shutdown)."""


class SinkError(ValueError):
    """A sink URL or option that cannot work; the message says which."""


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
