"""The engine-side follower of the tables topic: a background thread in the engine process.

It reads the whole topic from the beginning with no consumer group (every engine needs every
message of its key; nothing is committed) and hands its key's messages in order to an
`EngineFeed`, which folds them and stages the agent's desired table into the engine's
`TableSwitch` after each poll. It confirms `applied` once the engine has switched at a step
boundary. After a failure (a broker outage, a surprise) it reconnects where it stopped: the
fold already holds what came before, and folding it again would repeat every event of it.
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime

from kafka import KafkaConsumer, TopicPartition

from controller.engine.feed import Clock, EngineFeed
from controller.engine.table_switch import TableSwitch
from controller.engine.watch import EngineWatch, TapSink
from controller.exploration import ExplorationConfig
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from schemas.settings import Settings

log = logging.getLogger(__name__)


def wall_clock() -> datetime:
    return datetime.now(UTC)


class TableFeed:
    def __init__(self, settings: Settings, switch: TableSwitch, limits: EngineLimits,
                 status: StatusPublisher, *, explore_share: float = 0.02,
                 tap: TapSink | None = None, clock: Clock = wall_clock) -> None:
        """`explore_share`: steps run at another K (0 disables); `tap`: the engine's
        recorded steps, for the guardrail and drift detection (None disables both);
        `clock`: what force expiries are compared with (a paced twin's virtual time)."""
        self.settings = settings
        self.switch = switch
        self.limits = limits
        self.status = status
        self.core = EngineFeed(switch, limits, status, clock, keyring=settings.keyring(),
                               exploration=ExplorationConfig(share=explore_share))
        self.agent = self.core.agent
        self.watch = None if tap is None else EngineWatch(self.agent, status, tap,
                                                          limits.max_batch)
        if self.watch is not None:
            watch = self.watch
            runs_budgets = bool(self.core.switch.max_match)
            self.core.on_applied = lambda version, previous, desired: watch.table_applied(
                version, previous, desired.surface if desired is not None else None,
                at_s=clock().timestamp(),
                budget=runs_budgets and desired is not None and desired.budget is not None)
        self.key_bytes = str(limits.key).encode()
        self._next_offsets: dict[int, int] = {}
        """Partition -> the offset after the last message handed to the fold."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tabletune-table-feed",
                                        daemon=True)

    def start(self) -> TableFeed:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        # Announced here, not in the engine's constructor: a down broker must not delay
        # the engine's start (status publishing may wait for metadata).
        self.status.emit("started", version=self.switch.version,
                         startup_k_values=sorted(self.limits.startup_k_values),
                         max_batch=self.limits.max_batch,
                         startup_table=self.switch.startup_table.to_vllm())
        while not self._stop.is_set():
            try:
                self._follow()
            except Exception:  # keep following through broker outages and surprises
                log.exception("table feed failed; retrying")
                self._stop.wait(1.0)

    def _follow(self) -> None:
        topic = self.settings.topics.tables
        consumer = KafkaConsumer(**self.settings.client_kwargs(), enable_auto_commit=False,
                                 group_id=None)
        try:
            partitions = None
            while partitions is None and not self._stop.is_set():
                partitions = consumer.partitions_for_topic(topic)
                if partitions is None:
                    self._stop.wait(0.5)
            if partitions is None:
                return
            assigned = [TopicPartition(topic, p) for p in sorted(partitions)]
            consumer.assign(assigned)
            for tp in assigned:
                if tp.partition in self._next_offsets:
                    consumer.seek(tp, self._next_offsets[tp.partition])
                else:
                    consumer.seek_to_beginning(tp)
            while not self._stop.is_set():
                for messages in consumer.poll(timeout_ms=200).values():
                    for message in messages:
                        # past it first: one whose fold fails (`_run` logs it) is not
                        # folded again on reconnecting; the ones after it are
                        self._next_offsets[message.partition] = message.offset + 1
                        if message.key == self.key_bytes:
                            self.core.handle_bytes(message.value, message.offset)
                if self.watch is not None:
                    self.watch.check()  # may roll back: the agent's decision changes
                self.core.sync()
        finally:
            consumer.close()
