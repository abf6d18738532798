"""What a Kafka error means to ingest: a broker that does not answer, or a group that moved on.

Neither stops ingest: the window in hand stays uncommitted and its offsets are read again.
"""

from __future__ import annotations

from kafka.errors import (
    CommitFailedError,
    FencedInstanceIdError,
    IllegalGenerationError,
    KafkaError,
    RebalanceInProgressError,
    UnknownMemberIdError,
)

REBALANCE_COMMIT_ERRORS = (CommitFailedError, RebalanceInProgressError,
                           IllegalGenerationError, UnknownMemberIdError,
                           FencedInstanceIdError)
"""A commit refused because the group moved on: the window's files stay, its offsets are
read again by whoever owns the partition now."""


def transient(exc: BaseException) -> bool:
    """A broker that does not answer (an outage, a restart): kafka-python's retriable errors
    (KafkaConnectionError, KafkaTimeoutError, NodeNotReadyError, ...)."""
    return isinstance(exc, KafkaError) and bool(exc.retriable)
