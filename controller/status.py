"""Controller events on the status topic: JSON, keyed by engine id, never blocking a caller.

Events are also kept in a small in-process ring so tests, metrics and `show` can read the
recent ones without a broker.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
from collections import Counter, deque
from typing import Any

from kafka import KafkaProducer

from fitter.kafka_clients import NEVER_BLOCK_BOOTSTRAP_MS, close_producer
from schemas.settings import Settings

log = logging.getLogger(__name__)

EVENTS = ("applied", "rejected", "rolled_back", "stale", "started", "forced", "released",
          "conflict", "latency_knowledge")
BULKY_FIELDS = frozenset({"cells"})
"""Fields the topic carries whole, but the log line and the in-process ring only count: a
`latency_knowledge` event holds up to a few thousand latency cells."""


class StatusPublisher:
    def __init__(self, settings: Settings | None, engine_id: str, table_key: str,
                 history: int = 256) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.table_key = table_key
        self.recent: deque[dict[str, Any]] = deque(maxlen=history)
        self.counts: Counter[str] = Counter()
        """Events emitted, by name, since start: the counters the ring cannot be."""
        self.rejections: Counter[str] = Counter()
        """`rejected` events by reason (`replayed`, `bad_envelope`, `too_large`, ...)."""
        self.errors = 0
        self._producer: KafkaProducer | None = None
        self._broken = False
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Record and publish one event; a broker problem is counted, never raised."""
        if event not in EVENTS:
            raise ValueError(f"unknown status event {event!r}")
        payload = {"event": event, "engine_id": self.engine_id, "table_key": self.table_key,
                   "at": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
                   **fields}
        summary = summarized(payload)
        self.recent.append(summary)
        self.counts[event] += 1
        if event == "rejected":
            self.rejections[str(fields.get("reason"))] += 1
        log.info("table status %s", summary)
        if self.settings is not None and self.settings.bootstrap_servers:
            self._publish(payload)
        return summary

    def _publish(self, payload: dict[str, Any]) -> None:
        with self._lock:
            try:
                if self._broken and self._producer is not None:
                    close_producer(self._producer, timeout_s=0)
                    self._producer = None
                self._broken = False
                if self._producer is None:
                    self._producer = KafkaProducer(
                        **self.settings.client_kwargs(), max_block_ms=2000, linger_ms=5,
                        bootstrap_timeout_ms=NEVER_BLOCK_BOOTSTRAP_MS)
                future = self._producer.send(self.settings.topics.status,
                                             key=self.engine_id.encode(),
                                             value=json.dumps(payload, default=str).encode())
                future.add_errback(self._delivery_failed)
            except Exception:  # status is best effort; the decision itself already happened
                self.errors += 1
                log.debug("status event not published", exc_info=True)
                if self._producer is not None:
                    close_producer(self._producer, timeout_s=0)
                    self._producer = None

    def _delivery_failed(self, exc: BaseException) -> None:
        # An idempotent producer cannot recover from a broker that lost its producer ids
        # (a restart): the next event gets a fresh producer.
        self.errors += 1
        self._broken = True

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver what is pending within `timeout_s`; the rest is failed (a broker that is
        down must not hold an engine's shutdown, nor leave a traceback in its log)."""
        with self._lock:
            if self._producer is not None:
                close_producer(self._producer, timeout_s)
                self._producer = None


def summarized(event: dict[str, Any]) -> dict[str, Any]:
    """`event` with each bulky field replaced by its size (latency cells: their count)."""
    return {name: (_size(value) if name in BULKY_FIELDS else value)
            for name, value in event.items()}


def _size(value: Any) -> str:
    rows = value.get("step_s") if isinstance(value, dict) else value
    return f"{len(rows)} rows" if isinstance(rows, list) else "..."
