"""What one ingest consumer did: records and files written, copies dropped, letters sent."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IngestCounters:
    records: int = 0
    frames: int = 0
    files: int = 0
    windows: int = 0
    dlq: int = 0
    """Dead-letter messages sent (frames refused whole, and messages of invalid rows)."""
    invalid_records: int = 0
    """Rows of decodable frames that failed a semantic check (dead-lettered, not written)."""
    dlq_failures: int = 0
    """Dead-letter messages the broker did not acknowledge: their window was not committed
    (read again)."""
    skipped_duplicates: int = 0
    resent_duplicates: int = 0
    """Copies of records at later offsets (an engine re-sent a frame the broker had
    written), dropped: the earlier offset's record is the one stored."""
    reset_records: int = 0
    """Records at offsets an existing file covers that the file does not hold (the topic's
    offsets restarted): written, not skipped."""
    abandoned_windows: int = 0
    """In-flight windows dropped uncommitted on a rebalance (their records are read again)."""
    commit_failures: int = 0
    """Window commits the group refused during a rebalance (files kept, offsets re-read)."""
    lag_records: int = 0
    """Messages behind the partitions' high watermarks at the last check (consumer lag)."""
    unread: dict[int, int] = field(default_factory=dict)
    """Batch mode: messages per partition between the group's committed offset and the end
    offset at the last check, over every partition of the topic (empty: caught up)."""
    dlq_reasons: dict[str, int] = field(default_factory=dict)
