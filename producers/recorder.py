"""Per-step telemetry: the engine thread appends to a buffer of rows, a background thread
turns full or aged buffers into Arrow tables for the sink.

The engine's hot path (`record_step`) appends one tuple of about twenty scalars to the open
buffer under an uncontended lock and returns; it never converts, encodes or does I/O (the
background thread turns a frame's rows into columns at once). Buffers are recycled through a
small pool. When the sink falls behind, the oldest full buffers are dropped and counted
rather than letting memory grow: telemetry must never hurt the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from producers.identity import EngineIdentity
from producers.match_lengths import match_lengths_to_arrow
from producers.request_ledger import to_arrow
from schemas import SCHEMA_VERSION, STEP_RECORD_SCHEMA

log = logging.getLogger(__name__)


StepBuilder = Callable[[Any], Mapping[str, Any] | None]
"""Turns a raw step captured on the engine thread into `record_step` keyword arguments."""


class Sink(Protocol):
    """Where finished tables go. Called only from the recorder's background thread."""

    def write(self, records: pa.Table) -> None: ...

    def flush(self, timeout_s: float = 5.0) -> bool: ...

    def close(self, timeout_s: float = 5.0) -> None: ...

    def counters(self) -> dict[str, int]: ...


@dataclass(frozen=True, slots=True)
class RecorderConfig:
    frame_records: int = 1024
    """A buffer is handed to the sink when it holds this many steps ..."""
    frame_interval_s: float = 0.1
    """... or when its oldest step is this old, whichever comes first."""
    max_pending_buffers: int = 64
    """Full buffers waiting for the background thread; beyond this the oldest are dropped."""
    log_interval_s: float = 60.0
    """How often the counters are logged (0 disables)."""
    max_deferred_steps: int = 65536
    """Raw steps waiting to be turned into records (see `defer`); beyond this the oldest drop."""

    def __post_init__(self) -> None:
        if self.frame_records < 1:
            raise ValueError(f"frame_records={self.frame_records} must be >= 1")
        if self.frame_interval_s <= 0:
            raise ValueError(f"frame_interval_s={self.frame_interval_s} must be > 0")


_INT_COLUMNS = (
    ("ts_ns", np.int64), ("step_seq", np.int64), ("batch_size", np.int32),
    ("num_decode_reqs", np.int32), ("num_prefill_reqs", np.int32),
    ("num_prefill_tokens", np.int32), ("k", np.int16), ("k_next", np.int16),
    ("table_version", np.int64), ("num_drafts", np.int32), ("num_draft_tokens", np.int32),
    ("num_accepted_tokens", np.int32), ("kv_tokens", np.int64), ("ctx_len_max", np.int32),
)
"""The integer scalars of a step's row in `_RowBuffer.rows`, in order, and their types."""
_FLOAT_COLUMNS = ("ctx_len_mean", "step_latency_s", "inter_step_s")
"""The float scalars of a step's row in `_RowBuffer.times`, in order."""


@lru_cache(maxsize=8)
def _constant_columns(identity: EngineIdentity, n: int) -> dict[str, pa.Array]:
    """The columns a frame of `n` records from `identity` holds (immutable: shared)."""
    cols = {"schema_version": pa.array(np.full(n, SCHEMA_VERSION, dtype=np.int16))}
    for name in ("engine_id", "model", "drafter", "hardware"):
        cols[name] = pa.array([getattr(identity, name)] * n, type=pa.string())
    return cols


class _RowBuffer:
    """One frame's worth of steps, row by row."""

    def __init__(self, capacity: int, max_positions: int) -> None:
        self.capacity = capacity
        self.max_positions = max(max_positions, 1)
        self.opened_at = 0.0
        self.rows: list[tuple[Any, ...]] = []
        """Per step, its integer scalars (`_INT_COLUMNS`)."""
        self.times: list[tuple[float, float, float]] = []
        """Per step, its float scalars (`_FLOAT_COLUMNS`)."""
        self.forced: list[bool] = []
        self.accepted: list[Sequence[int]] = []
        """Per step, accepted_per_pos (a reference)."""
        self.finished: list[np.ndarray | tuple[()]] = []
        """Per step, `RequestLedger.finish` rows (or nothing)."""
        self.by_match: list[np.ndarray | tuple[()]] = []
        """Per step, `match_length_rows` (or nothing)."""

    @property
    def size(self) -> int:
        return len(self.rows)

    def clear(self) -> None:
        self.rows.clear()
        self.times.clear()
        self.forced.clear()
        self.accepted.clear()
        self.finished.clear()
        self.by_match.clear()

    def to_table(self, identity: EngineIdentity) -> pa.Table:
        n = len(self.rows)
        ints = np.fromiter(chain.from_iterable(self.rows), dtype=np.int64,
                           count=n * len(_INT_COLUMNS)).reshape(n, len(_INT_COLUMNS))
        floats = np.fromiter(chain.from_iterable(self.times), dtype=np.float64,
                             count=n * len(_FLOAT_COLUMNS)).reshape(n, len(_FLOAT_COLUMNS))
        cols = {name: pa.array(ints[:, i].astype(dtype))
                for i, (name, dtype) in enumerate(_INT_COLUMNS)}
        for i, name in enumerate(_FLOAT_COLUMNS):
            cols[name] = pa.array(floats[:, i].copy())
        cols["forced"] = pa.array(np.array(self.forced, dtype=np.bool_).reshape(n))
        width = self.max_positions
        lengths = np.fromiter((min(len(a), width) for a in self.accepted), dtype=np.int32,
                              count=n)
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = np.fromiter(chain.from_iterable(a[:width] for a in self.accepted),
                             dtype=np.int32, count=int(offsets[-1]))
        cols["accepted_per_pos"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        cols["finished_requests"] = to_arrow(self.finished, width)
        cols["by_match_length"] = match_lengths_to_arrow(self.by_match, width)
        cols.update(_constant_columns(identity, n))
        return pa.table([cols[name] for name in STEP_RECORD_SCHEMA.names],
                        schema=STEP_RECORD_SCHEMA)


class StepRecorder:
    """Engine-side telemetry recorder shared by the vLLM hook and the twin."""

    def __init__(self, identity: EngineIdentity, sink: Sink, *, max_k: int,
                 config: RecorderConfig | None = None, first_step_seq: int = 0) -> None:
        self.identity = identity
        self.sink = sink
        self.config = config or RecorderConfig()
        self.max_k = max_k
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._drain_lock = threading.Lock()
        self._spare: list[_RowBuffer] = [self._new_buffer() for _ in range(2)]
        self._full: deque[_RowBuffer] = deque()
        self._deferred: deque[tuple[StepBuilder, Any]] = deque()
        self._buffer = self._new_buffer()
        self.first_step_seq = first_step_seq
        """The step_seq of this recorder's first step (the next ones count up from it)."""
        self._next_seq = first_step_seq
        self.records_total = 0
        self.records_dropped = 0
        self.frames_total = 0
        self.sink_errors = 0
        self.build_errors = 0
        self._thread: threading.Thread | None = None
        self._last_log = time.monotonic()

    # ---- engine thread -------------------------------------------------------------------
    def record_step(
        self, *, batch_size: int, num_decode_reqs: int, num_prefill_reqs: int,
        num_prefill_tokens: int, k: int, k_next: int, table_version: int, num_drafts: int,
        num_draft_tokens: int, num_accepted_tokens: int, accepted_per_pos: Sequence[int],
        kv_tokens: int, ctx_len_mean: float, ctx_len_max: int, step_latency_s: float,
        inter_step_s: float, forced: bool = False, ts_ns: int | None = None,
        finished_requests: np.ndarray | tuple[()] = (),
        by_match_length: np.ndarray | tuple[()] = (),
    ) -> int:
        """Append one step; returns its step_seq. Never blocks on I/O, never raises on data.

        `accepted_per_pos` (at most `max_k` positions are kept) and `finished_requests`
        (the rows `producers.request_ledger.RequestLedger.finish` gave for the requests that
        left the batch, from a ledger of this recorder's `max_k` positions) and
        `by_match_length` (`match_length_rows` of `max_k` positions) are kept by reference
        until the frame is built: pass objects that are not changed afterwards."""
        if self._thread is None:
            self._start_thread()
        with self._lock:
            buf = self._buffer
            rows = buf.rows
            if not rows:
                buf.opened_at = time.monotonic()
            seq = self._next_seq
            self._next_seq = seq + 1
            rows.append((
                time.time_ns() if ts_ns is None else ts_ns, seq, batch_size, num_decode_reqs,
                num_prefill_reqs, num_prefill_tokens, k, k_next, table_version, num_drafts,
                num_draft_tokens, num_accepted_tokens, kv_tokens, ctx_len_max))
            buf.times.append((ctx_len_mean, step_latency_s, inter_step_s))
            buf.forced.append(forced)
            buf.accepted.append(accepted_per_pos)
            buf.finished.append(finished_requests)
            buf.by_match.append(by_match_length)
            self.records_total += 1
            if len(rows) == buf.capacity:
                self._rotate_locked()
        return seq

    def defer(self, build: StepBuilder, raw: Any) -> None:
        """Engine thread: queue a raw step to be measured off-thread; O(1), never blocks.

        `build(raw)` runs on the background thread and returns `record_step` keyword
        arguments (or None to skip). Used by the vLLM hook, whose per-request accounting is
        too slow for the engine thread; `raw` must hold only objects vLLM no longer mutates.
        """
        if self._thread is None:
            self._start_thread()
        deferred = self._deferred
        if len(deferred) >= self.config.max_deferred_steps:
            deferred.popleft()
            self.records_dropped += 1
        deferred.append((build, raw))

    def _rotate_locked(self) -> None:
        self._full.append(self._buffer)
        if len(self._full) > self.config.max_pending_buffers:
            dropped = self._full.popleft()
            self.records_dropped += dropped.size
            dropped.clear()
            self._spare.append(dropped)
        self._buffer = self._spare.pop() if self._spare else self._new_buffer()
        self._wake.set()

    # ---- background thread ---------------------------------------------------------------
    def _start_thread(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="tabletune-recorder",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        interval = self.config.frame_interval_s
        while not self._stop.is_set():
            self._wake.wait(timeout=interval / 2)
            self._wake.clear()
            self._drain(force=False)
            self._maybe_log()
        self._drain(force=True)

    def _drain(self, *, force: bool) -> None:
        with self._drain_lock:
            self._build_deferred()
            self._drain_locked(force=force)

    def _build_deferred(self) -> None:
        deferred = self._deferred
        while deferred:
            build, raw = deferred.popleft()
            try:
                fields = build(raw)
            except Exception:  # a bad raw step is counted, never raised into the engine
                self.build_errors += 1
                log.debug("could not build a step record", exc_info=True)
                continue
            if fields is not None:
                self.record_step(**fields)

    def _drain_locked(self, *, force: bool) -> None:
        with self._lock:
            buf = self._buffer
            aged = time.monotonic() - buf.opened_at >= self.config.frame_interval_s
            if buf.size and (force or aged):
                self._rotate_locked()
            ready = list(self._full)
            self._full.clear()
        for buf in ready:
            try:
                self.sink.write(buf.to_table(self.identity))
                self.frames_total += 1
            except Exception:  # a sink failure is counted, never raised into the engine
                self.sink_errors += 1
                self.records_dropped += buf.size
                log.exception("telemetry sink failed; %d records dropped", buf.size)
            buf.clear()
            with self._lock:
                if len(self._spare) < 4:
                    self._spare.append(buf)

    def _maybe_log(self) -> None:
        every = self.config.log_interval_s
        if every and time.monotonic() - self._last_log >= every:
            self._last_log = time.monotonic()
            log.info("telemetry %s", self.counters())

    def _new_buffer(self) -> _RowBuffer:
        return _RowBuffer(self.config.frame_records, self.max_k)

    # ---- any thread ----------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """Recorder and sink counters, readable in-process at any time."""
        with self._lock:
            pending = self._buffer.size + sum(b.size for b in self._full)
        return {
            "records_total": self.records_total,
            "records_dropped": self.records_dropped,
            "records_pending": pending,
            "frames_total": self.frames_total,
            "write_errors": self.sink_errors,
            "build_errors": self.build_errors,
            "deferred_pending": len(self._deferred),
            **{f"sink_{k}": v for k, v in self.sink.counters().items()},
        }

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Hand everything recorded so far to the sink and wait for it to be delivered.

        For tests and shutdown, never the engine thread. True when the sink confirmed all.
        """
        self._drain(force=True)
        return self.sink.flush(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the background thread, hand over what is buffered, close the sink."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        self._drain(force=True)
        self.sink.close(timeout_s)
