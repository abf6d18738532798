"""The settings of one ingest consumer (`tabletune ingest`), checked when made."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from schemas.frames import DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_FRAME_RECORDS
from schemas.settings import SettingsError
from schemas.step_checks import MAX_FUTURE_S

MAX_FRAME_BYTES_LIMIT = 2**31 - 1
"""Arrow buffers and one message's memory: no setting above 2 GiB is sane."""
MAX_FRAME_RECORDS_LIMIT = 10_000_000


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
