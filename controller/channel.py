"""How the closed loop's decisions reach engines: the one thing, with the clock, that differs
between a fleet and the twin.

The loop hands every message to a `ControlChannel`: envelopes it publishes and `force` /
`release` controls for its sweeps. On a fleet that is the tables topic (`KafkaChannel`);
in the twin, `InMemoryChannel` hands the same messages to each engine's `EngineFeed` at
once, as if the topic had no latency. Engines fold them with the same code either way.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Protocol

from kafka import KafkaProducer

from controller.engine_feed import EngineFeed
from schemas import TableControl, TableEnvelope
from tabletune.settings import Settings

log = logging.getLogger(__name__)

Message = TableEnvelope | TableControl


def clock_time(seconds: float) -> datetime:
    """The loop's clock (telemetry seconds since the epoch) as an aware datetime."""
    return datetime.fromtimestamp(seconds, UTC)


class ControlChannel(Protocol):
    def send(self, message: Message) -> None:
        """Deliver `message` to every engine of its key, in order; never raises for a
        broker problem (the loop's next decision will be sent again)."""


class InMemoryChannel:
    """The tables topic of one key, in memory: every message to every feed, at once."""

    def __init__(self, feeds: list[EngineFeed] | None = None) -> None:
        self.feeds = list(feeds or [])
        self.log: list[Message] = []
        """Every message sent, in order: what an engine that joins later replays."""

    def send(self, message: Message) -> None:
        self.log.append(message)
        for feed in self.feeds:
            feed.handle(message)
            feed.sync()

    def join(self, feed: EngineFeed) -> None:
        """A new engine reads the log from the beginning, as a `TableFeed` does."""
        for message in self.log:
            feed.handle(message)
        feed.sync()
        self.feeds.append(feed)


class KafkaChannel:
    """The tables topic: signed when a signing key is configured, keyed by table key."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.errors = 0
        self._producer: KafkaProducer | None = None

    def send(self, message: Message) -> None:
        settings = self.settings
        if settings.signing_key_id is not None and settings.signing_secret is not None:
            message = message.signed(settings.signing_key_id, settings.signing_secret)
        try:
            if self._producer is None:
                self._producer = KafkaProducer(**settings.client_kwargs(), max_block_ms=5000,
                                               linger_ms=0)
            self._producer.send(settings.topics.tables, key=str(message.key).encode(),
                                value=message.to_json()).get(timeout=10)
        except Exception:  # a broker outage: counted; the caller's state says what to resend
            self.errors += 1
            log.warning("could not send %s to %s", type(message).__name__,
                        settings.topics.tables, exc_info=True)
            self.close()

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close(timeout=2)
            self._producer = None
