"""Ingest's rebalance listener: it takes notes on kafka-python's IO thread, and the poll loop
acts on them (abandons its open windows, rewinds its partitions) on its own thread."""

from __future__ import annotations

import logging
import threading

from kafka.consumer.subscription_state import ConsumerRebalanceListener

log = logging.getLogger(__name__)


class AssignmentChanges(ConsumerRebalanceListener):
    """Counts the callbacks and notes which partitions are held; changes nothing itself.

    `joining` is True from a revocation (every eager rebalance starts with one) until the
    next assignment. Meanwhile the poll loop only polls: kafka-python 3.0 finishes a
    JoinGroup/SyncGroup in the background and, if no poll() is waiting on it when it
    completes (the loop busy committing or asking for offsets, which queue behind the
    JoinGroup on the coordinator's connection), drops the result and joins again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changes = 0
        self._joining = False
        self._held: frozenset[int] = frozenset()

    @property
    def changes(self) -> int:
        with self._lock:
            return self._changes

    @property
    def joining(self) -> bool:
        with self._lock:
            return self._joining

    @property
    def held(self) -> frozenset[int]:
        """The partitions assigned and not revoked or lost since, as the callbacks said."""
        with self._lock:
            return self._held

    def _note(self, what: str, partitions: object, *, joining: bool) -> None:
        numbers = frozenset(getattr(tp, "partition", tp) for tp in partitions or ())
        with self._lock:
            self._changes += 1
            self._joining = joining
            self._held = self._held | numbers if what == "assigned" else self._held - numbers
        log.info("partitions %s: %s", what, sorted(numbers))

    def on_partitions_revoked(self, revoked: object) -> None:
        self._note("revoked", revoked, joining=True)

    def on_partitions_lost(self, lost: object) -> None:
        self._note("lost", lost, joining=True)

    def on_partitions_assigned(self, assigned: object) -> None:
        self._note("assigned", assigned, joining=False)
