"""Guardrail and drift detection inside an engine, on the table feed's thread.

The recorder hands every frame to a `TapSink` (the engine's own sink, plus a bounded hand-off
to this watcher); the feed thread drains it between polls. A regression verdict rolls the
table back through the `TableAgent`; a drift report is published as `stale`. The same
components run in the twin's closed loop (controller/fleet/loop.py); only the clock differs (here
the records' wall-clock timestamps).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import pyarrow as pa

from controller.drift import DriftConfig, DriftDetector
from controller.engine.agent import TableAgent
from controller.guardrail import Guardrail, Verdict
from controller.status import StatusPublisher
from controller.steps import StepColumns

log = logging.getLogger(__name__)


class TapSink:
    """Forwards frames to the engine's sink and keeps a bounded copy for the watcher."""

    def __init__(self, inner: Any, max_frames: int = 256) -> None:
        self.inner = inner
        self.frames: deque[pa.Table] = deque(maxlen=max_frames)

    def write(self, records: pa.Table) -> None:
        self.frames.append(records)  # the recorder hands over a copy it no longer touches
        self.inner.write(records)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return bool(self.inner.flush(timeout_s))

    def close(self, timeout_s: float = 5.0) -> None:
        self.inner.close(timeout_s)

    def counters(self) -> dict[str, int]:
        return dict(self.inner.counters())

    def take(self) -> pa.Table | None:
        frames = []
        while self.frames:
            frames.append(self.frames.popleft())
        return pa.concat_tables(frames) if frames else None


class EngineWatch:
    """Feeds live steps to the guardrail and the drift detector; acts on their verdicts."""

    def __init__(self, agent: TableAgent, status: StatusPublisher, tap: TapSink,
                 max_batch: int) -> None:
        self.agent = agent
        self.status = status
        self.tap = tap
        self.guardrail = Guardrail()
        # no fast hints: they serve a recall, and an engine has no regimes to recall
        self.drift = DriftDetector(max_batch, DriftConfig(fast_window_s=0.0))
        self.rollbacks = 0

    def table_applied(self, version: int, previous: int, surface: Any, at_s: float, *,
                      budget: bool = False) -> None:
        """`budget`: the engine runs the envelope's per-request budget (drift then reads
        only forced steps)."""
        if previous != 0 and version != 0:
            self.guardrail.arm(version, previous, at_s)
        else:
            self.guardrail.disarm()
        self.drift.set_envelope(version, surface, at_s, budget=budget)

    def check(self) -> bool:
        """Observe what the engine recorded since the last call; True if it rolled back."""
        records = self.tap.take()
        if records is None or records.num_rows == 0:
            return False
        steps = StepColumns.from_records(records)
        now_s = float(steps.t_s[-1])
        self.guardrail.observe(steps)
        if self.guardrail.verdict(now_s) is Verdict.ROLL_BACK:
            evidence = dict(self.guardrail.last_evidence)
            evidence.pop("old_version", None)
            evidence.pop("new_version", None)
            self.agent.roll_back("guardrail", **evidence)
            self.rollbacks += 1
            return True
        report = self.drift.observe(steps)
        if report is not None:
            self.status.emit("stale", **report.fields())
            self.guardrail.reset_baseline()
        return False
