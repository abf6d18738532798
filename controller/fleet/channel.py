"""How the closed loop's decisions reach engines: the one thing, with the clock, that differs
between a fleet and the twin.

The loop hands every message to a `ControlChannel`: envelopes it publishes and `force` /
`release` controls for its sweeps. On a fleet that is the tables topic (`KafkaChannel`);
in the twin, `InMemoryChannel` hands the same messages to each engine's `EngineFeed` at
once, as if the topic had no latency. Engines fold them with the same code either way.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime
from typing import Protocol

from kafka import KafkaProducer

from controller.engine.feed import EngineFeed
from fitter.kafka_clients import NEVER_BLOCK_BOOTSTRAP_MS, close_producer
from schemas import TableControl, TableEnvelope, TableKey
from schemas.settings import Settings

log = logging.getLogger(__name__)

Message = TableEnvelope | TableControl


def clock_time(seconds: float) -> datetime:
    """The loop's clock (telemetry seconds since the epoch) as an aware datetime."""
    return datetime.fromtimestamp(seconds, UTC)


class ControlChannel(Protocol):
    def send(self, message: Message) -> None:
        """Deliver `message` to every engine of its key, in order; never raises for a
        broker problem (what could not be sent is kept and sent first next time)."""


class InMemoryChannel:
    """The tables topic of one key, in memory: every message to every feed, at once."""

    def __init__(self, feeds: list[EngineFeed] | None = None) -> None:
        self.feeds = list(feeds or [])

    def send(self, message: Message) -> None:
        for feed in self.feeds:
            feed.handle(message)
            feed.sync()


RETRY_S = 2.0
"""After a failed send, the next try comes this much later."""
ACK_TIMEOUT_S = 5.0
"""How long one send waits for the broker's acknowledgement before the message is kept for
the next try (a tick of the service stalls at most this long in an outage)."""
CLOSE_S = 2.0
"""At shutdown, what the producer gets to deliver what it holds; past it, the rest fails
(a down broker must not hold the service's exit)."""
Holding = Callable[[TableKey], AbstractContextManager[int | None]]
"""holding(key): the epoch to send a message of `key` at, for as long as the block runs;
None while this sender may not send it (`controller.fleet.ownership.Ownership.holding`)."""


@contextmanager
def unfenced(key: TableKey) -> Iterator[int | None]:
    """A sender outside any group (tests, tools): epoch 0, which engines do not fence."""
    yield 0


MAX_UNSENT = 1024
"""Messages kept through a broker outage, oldest dropped first (a control service ticks once
a second: minutes of decisions)."""


class KafkaChannel:
    """The tables topic: signed when a signing key is configured, keyed by table key.

    A message the broker did not acknowledge is kept, in order, and sent before the next
    one (`resend()` also retries on the service's idle polls): an envelope the loop decided
    on reaches the engines once the broker is back, and in the order it was decided.

    Each message is stamped with the sender's epoch and signed as it goes out, under
    `holding`: one the sender may not send now is kept, and goes once it may again (a lease
    renewed) or is dropped with the channel (the key's owner changed)."""

    def __init__(self, settings: Settings, holding: Holding = unfenced) -> None:
        self.settings = settings
        self.holding = holding
        self.errors = 0
        self.dropped = 0
        self._unsent: list[Message] = []
        self._producer: KafkaProducer | None = None
        self._retry_at = 0.0

    def send(self, message: Message) -> None:
        self._unsent.append(message)
        if len(self._unsent) > MAX_UNSENT:
            self._unsent.pop(0)
            self.dropped += 1
        self.resend()

    @property
    def unsent(self) -> int:
        return len(self._unsent)

    def resend(self) -> bool:
        """Send what is waiting, in order; False (counted, logged) at the first failure,
        and no new try for `RETRY_S` after one (a down broker would block every poll)."""
        settings = self.settings
        if time.monotonic() < self._retry_at:
            return False
        while self._unsent:
            message = self._unsent[0]
            try:
                with self.holding(message.key) as epoch:
                    if epoch is None:  # not this sender's to send now: kept
                        return False
                    self._deliver(self._stamped(message, epoch))
            except Exception as exc:  # a broker outage: kept for the next try
                self.errors += 1
                # one line per failed try, not a traceback every RETRY_S through an outage
                log.warning("could not send %s to %s (%d waiting): %s", type(message).__name__,
                            settings.topics.tables, len(self._unsent), exc)
                self.close(timeout_s=0)  # it had ACK_TIMEOUT_S
                self._retry_at = time.monotonic() + RETRY_S
                return False
            self._unsent.pop(0)
        return True

    def _stamped(self, message: Message, epoch: int) -> Message:
        """`message` at `epoch`, signed over it when a signing key is configured."""
        settings = self.settings
        if epoch:
            message = dataclasses.replace(message, epoch=epoch, signature=None)
        if settings.signing_key_id is not None and settings.signing_key is not None:
            message = message.signed(settings.signing_key_id, settings.signing_key)
        return message

    def _deliver(self, message: Message) -> None:
        """Send and wait for the broker's acknowledgement (raises on a broker problem)."""
        if self._producer is None:
            self._producer = KafkaProducer(
                **self.settings.client_kwargs(), max_block_ms=2000, linger_ms=0,
                bootstrap_timeout_ms=NEVER_BLOCK_BOOTSTRAP_MS)
        self._producer.send(self.settings.topics.tables, key=str(message.key).encode(),
                            value=message.to_json()).get(timeout=ACK_TIMEOUT_S)

    def close(self, timeout_s: float = CLOSE_S) -> None:
        """Drop the producer; a message it still held stays in `_unsent` for the next one."""
        if self._producer is not None:
            close_producer(self._producer, timeout_s)
            self._producer = None
