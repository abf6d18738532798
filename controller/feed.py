"""The engine-side follower of the tables topic: a background thread in the engine process.

It reads the whole topic from the beginning with no consumer group (every engine needs every
message of its key; nothing is committed), feeds its key's messages in order to the
`TableAgent`, and after each poll stages the agent's desired table into the engine's
`TableSwitch`. It confirms `applied` once the engine has switched at a step boundary.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime

from kafka import KafkaConsumer, TopicPartition

from controller.agent import TableAgent
from controller.engine_watch import EngineWatch, TapSink
from controller.exploration import ExplorationConfig, explorer_for
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from producers.table_switch import TableSwitch
from schemas import DraftTable, EnvelopeError, TableControl, TableError, parse_table_message
from tabletune.settings import Settings

log = logging.getLogger(__name__)


class TableFeed:
    def __init__(self, settings: Settings, switch: TableSwitch, limits: EngineLimits,
                 status: StatusPublisher, *, explore_share: float = 0.02,
                 tap: TapSink | None = None) -> None:
        """`explore_share`: steps run at another K (0 disables); `tap`: the engine's
        recorded steps, for the guardrail and drift detection (None disables both)."""
        self.settings = settings
        self.switch = switch
        self.limits = limits
        self.status = status
        self.agent = TableAgent(limits, settings.keyring(), status.emit)
        self.exploration = ExplorationConfig(share=explore_share)
        self.watch = None if tap is None else EngineWatch(self.agent, status, tap,
                                                          limits.max_batch)
        self._applied_version = switch.version
        self.key_bytes = str(limits.key).encode()
        self._stop = threading.Event()
        self._staged_version: int | None = None
        self._staged_at = 0.0
        self._last_desired = 0
        """Stage on a change of decision only, so a profiler's forced table is not undone."""
        self._forced: DraftTable | None = None
        """The table a `force` control has staged, until its release or expiry."""
        self._refused_force: DraftTable | None = None
        """A forced table the switch refused: said once on the status topic, not every poll."""
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
                         startup_k_values=sorted(self.limits.startup_k_values))
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
            consumer.seek_to_beginning(*assigned)
            while not self._stop.is_set():
                for messages in consumer.poll(timeout_ms=200).values():
                    for message in messages:
                        if message.key == self.key_bytes:
                            self._handle(message.value, message.offset)
                if self.watch is not None:
                    self.watch.check()  # may roll back: the agent's decision changes
                self._sync()
        finally:
            consumer.close()

    def _handle(self, value: bytes, offset: int) -> None:
        try:
            message = parse_table_message(value)
        except (EnvelopeError, TableError) as exc:
            self.agent.on_rejected_message("bad_envelope", str(exc), offset=offset)
            return
        if isinstance(message, TableControl):
            self.agent.on_control(message)
        else:
            self.agent.on_envelope(message)

    def _sync(self) -> None:
        """Stage the desired table if the engine runs another; confirm what it applied.
        A `force` in effect takes precedence; once released or expired, the desired table
        is staged again."""
        switch = self.switch
        if self._sync_forced():
            return
        desired = self.agent.desired()
        version = 0 if desired is None else desired.version
        if self._staged_version is not None and switch.version == self._staged_version \
                and not switch.pending:
            self.status.emit("applied", version=switch.version,
                             seconds_to_apply=round(time.monotonic() - self._staged_at, 4))
            if self.watch is not None:
                surface = desired.surface if desired is not None else None
                self.watch.table_applied(switch.version, self._applied_version, surface,
                                         at_s=time.time())
            self._applied_version = switch.version
            self._staged_version = None
        if version == self._last_desired:
            return
        self._last_desired = version
        if version == switch.version and not switch.pending and not switch.forced:
            return
        table = switch.startup_table if desired is None else desired.table
        explorer = None
        if desired is not None:
            explorer = explorer_for(desired.exploration, table, max_batch=self.limits.max_batch,
                                    k_values=self.limits.startup_k_values,
                                    config=self.exploration)
        try:
            switch.stage(table, version, explorer=explorer)
        except TableError as exc:  # checked already; the switch has the final word
            self.status.emit("rejected", version=version, reason="invalid_table",
                             detail=str(exc))
            return
        self._staged_version = version
        self._staged_at = time.monotonic()

    def _sync_forced(self) -> bool:
        """Stage a newly forced table, or note the end of a force; True while one holds."""
        forced = self.agent.forced_table(datetime.now(UTC))
        if forced is not None:
            if forced == self._refused_force:
                return False
            if forced != self._forced:
                try:
                    self.switch.stage(forced, self.switch.version, forced=True)
                except TableError as exc:
                    self._refused_force = forced
                    self.status.emit("rejected", control="force", reason="invalid_table",
                                     detail=str(exc))
                    return False
                self._forced = forced
                self._staged_version = None
                self.status.emit("forced", table=forced.to_vllm(), version=self.switch.version)
            return True
        if self._forced is not None:
            self._forced = None
            self._last_desired = -1  # the desired table goes back in, whatever its version
            self.status.emit("released", version=self.switch.version)
        return False
