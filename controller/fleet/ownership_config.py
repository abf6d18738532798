"""The settings of a control replica's group membership (`controller.fleet.ownership`).

Apart from the module that uses them so that the command line can show their defaults
without importing kafka-python.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.bounds import check_bounds, in_range

SLOTS = 12
"""Partitions of an ownership topic the service creates: keys spread over up to a dozen
replicas, and a slot's keys move together (more slots, finer spreading of few keys)."""
SESSION_TIMEOUT_MS = 6_000
"""A replica silent this long loses its keys: kafka-python's 45 s default would leave a
killed replica's keys unserved for most of a minute. Heartbeats come from kafka-python's
I/O thread, so a long fit on the service's thread does not count against it. (Tansu also
makes a join wait about half of it, 3 s; Apache Kafka's first join waits
group.initial.rebalance.delay.ms, 3 s by default.)"""


@dataclass(frozen=True, slots=True)
class OwnershipConfig:
    group_id: str
    """The control replicas that share one tables topic share this group."""
    session_timeout_ms: int = SESSION_TIMEOUT_MS
    """A member silent this long loses its keys (a killed or stopped replica's keys move
    within it, plus a rebalance)."""
    heartbeat_interval_ms: int = 600
    """Heartbeats refresh the lease: at most a third of the session timeout."""
    slots: int = SLOTS
    """Partitions of the ownership topic when the service has to create it."""

    def __post_init__(self) -> None:
        check_bounds(self, session_timeout_ms=in_range(1_000, 300_000),
                     heartbeat_interval_ms=in_range(100, self.session_timeout_ms / 3),
                     slots=in_range(1, 10_000))
        if not self.group_id.strip():
            raise ValueError("OwnershipConfig.group_id must be a non-empty string")
