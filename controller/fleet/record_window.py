"""The window of one key's telemetry that the closed loop fits on, and who stepped when."""

from __future__ import annotations

from collections import deque

import pyarrow as pa
import pyarrow.compute as pc

RATE_WINDOW_S = 30.0
"""Telemetry seconds over which the forced engines' step rate is measured."""


class RecordWindow:
    def __init__(self, fit_window_s: float) -> None:
        """`fit_window_s`: how far back the fits look (older records are dropped)."""
        self.fit_window_s = fit_window_s
        self._records: deque[pa.Table] = deque()
        self.data_since_s = 0.0
        """Fits take nothing from before here (a drift, a re-profile's settling stretch)."""
        self.anchor: pa.Table | None = None
        """Records of the last (re-)profile sweep."""
        self._engines_seen: dict[str, float] = {}
        """Engine id -> telemetry time of its last step (who is live, for canaries)."""

    def preload(self, records: pa.Table) -> None:
        """Steps from before the loop started (a restarted service's lookback, or the
        telemetry a replica kept of a key it takes over): for the fits' window, and for a
        resumed loop's drift reference (`ClosedLoop._resume_watch`), never the guardrail."""
        if records.num_rows:
            self._records.append(records.sort_by("ts_ns"))

    def add(self, records: pa.Table, now_s: float) -> None:
        """A tick's records; those older than the fit window go."""
        self._records.append(records)
        horizon_ns = int((now_s - self.fit_window_s) * 1e9)
        while self._records and self._records[0].column("ts_ns")[-1].as_py() < horizon_ns:
            self._records.popleft()

    def note_engines(self, records: pa.Table, now_s: float,
                     only: tuple[str, ...] = ()) -> pa.Table:
        """Remember who stepped; keep only the steps of `only` when given (a re-profile's
        canaries: the others run the current table, which the sweep's fits must not mix in)."""
        engines = records.column("engine_id")
        for engine in pc.unique(engines).to_pylist():
            self._engines_seen[engine] = now_s
        if not only:
            return records
        return records.filter(pc.is_in(engines, value_set=pa.array(only)))

    def live_engines(self, since_s: float) -> list[str]:
        """The engines that stepped at `since_s` or later, by id."""
        return sorted(e for e, seen in self._engines_seen.items() if seen >= since_s)

    def window(self, now_s: float, since_s: float | None = None) -> pa.Table | None:
        """The records from `since_s` on (default: the fit window, from `data_since_s`);
        None before any."""
        if not self._records:
            return None
        cutoff = max(now_s - self.fit_window_s, self.data_since_s)
        if since_s is not None:
            cutoff = since_s
        table = pa.concat_tables(self._records)
        return table.filter(pc.greater_equal(table.column("ts_ns"), int(cutoff * 1e9)))

    def fit_records(self, now_s: float) -> pa.Table | None:
        """The recent window plus the last sweep's records: live steps only show the
        table's K, the sweep anchors the fit at every other K until the next sweep."""
        recent = self.window(now_s)
        anchor = self.anchor
        if anchor is None or recent is None or recent.num_rows == 0:
            return recent
        first_ns = recent.column("ts_ns")[0].as_py()
        older = anchor.filter(pc.less(anchor.column("ts_ns"), first_ns))
        return pa.concat_tables([older, recent]) if older.num_rows else recent

    def step_rate(self, now_s: float, targets: tuple[str, ...]) -> float | None:
        """Steps per telemetry second of `targets` (every engine when empty) over the last
        RATE_WINDOW_S; None without steps to measure it on."""
        records = self._of(self.window(now_s, since_s=now_s - RATE_WINDOW_S), targets)
        if records is None or records.num_rows < 2:
            return None
        first_s = records.column("ts_ns")[0].as_py() / 1e9
        span_s = now_s - max(first_s, now_s - RATE_WINDOW_S)
        return records.num_rows / span_s if span_s > 0 else None

    def first_step_at(self, k: int, since_s: float, now_s: float,
                      targets: tuple[str, ...]) -> float | None:
        """When `targets` (every engine when empty) first began a step that drafts `k`
        from `since_s` on: a force's K shows there once it reached an engine. None: not yet."""
        records = self._of(self.window(now_s, since_s=since_s), targets)
        if records is None:
            return None
        at_k = records.filter(pc.equal(records.column("k_next"), k))
        if not at_k.num_rows:
            return None
        return float(pc.min(at_k.column("ts_ns")).as_py()) / 1e9

    @staticmethod
    def _of(records: pa.Table | None, targets: tuple[str, ...]) -> pa.Table | None:
        """`records` of the engines `targets` (all of them when empty)."""
        if records is None or not targets:
            return records
        return records.filter(pc.is_in(records.column("engine_id"),
                                       value_set=pa.array(list(targets))))
