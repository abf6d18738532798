"""`tabletune control`: the `ControlService` fed from Kafka, with the telemetry as its clock.

Replicas share the keys through one consumer group on the ownership topic
(`controller.fleet.ownership`): each serves the keys of the slots it is assigned, claims
each before acting for it (`controller.fleet.claims`), and stops serving one the moment
its slot is revoked. Everything it sends carries its epoch.

One reader over three topics, in no consumer group (the service needs every engine of every
key, as any of them may become its own, and commits nothing; its state lives in the topics):
- the tables topic from the beginning: each key's newest version and current envelope, so a
  restarted service goes on from them (LIVE, no second profile, no reused version);
- the status topic from the beginning: the engines' `started` announcements (K set, batch
  limit, startup table), which a cold key's profile needs, and each key's newest latency
  knowledge and regimes (`latency_knowledge`), which a key's next owner starts from;
- the telemetry topic from `lookback_s` ago (broker time): every engine's steps.
Before serving, the first two are read until idle, with the telemetry's partitions paused;
then each poll's tables and status messages are handled before its telemetry (an engine's
`started` names its key before its steps are filed). One consumer, not one per topic: each
kafka-python consumer keeps an I/O thread, and an idle service's four (these three and the
group's) took two thirds of its CPU. The clock of a key is the newest step timestamp seen
for it, so engines paced faster than real time (the twin) and a real fleet
look alike. A stop (SIGTERM, Ctrl-C) releases every force the service holds; a kill -9
leaves them to expire (`LoopConfig.force_grace_s` after their block).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from controller.fleet.channel import KafkaChannel
from controller.fleet.claims import KeyClaims
from controller.fleet.knowledge_event import EVENT as KNOWLEDGE_EVENT
from controller.fleet.knowledge_event import read_knowledge
from controller.fleet.loop_config import LoopConfig
from controller.fleet.ownership import Ownership
from controller.fleet.ownership_config import SESSION_TIMEOUT_MS, OwnershipConfig
from controller.fleet.publisher import ISSUED_BY
from controller.fleet.service import ControlService
from controller.validation import EngineLimits
from controller.vllm_compat import check_with_vllm
from schemas import (
    DraftTable,
    EnvelopeError,
    FrameError,
    SignatureError,
    TableControl,
    TableEnvelope,
    TableError,
    TableKey,
    decode_frame,
    parse_table_message,
)
from schemas.bounds import at_least, check_bounds, in_range
from schemas.settings import Settings

log = logging.getLogger(__name__)

TOPIC_WAIT_LOG_S = 10.0
"""A topic still missing after this long is logged (once): the broker may be creating it,
or the service was pointed at the wrong topics."""
MAX_STATUS_EVENT_BYTES = 1_048_576
"""Status events are read no larger than Kafka's default largest message: the largest, a
key's latency knowledge, stays under 500 KB (`latency_memory.PERSISTED_CELLS`)."""


@dataclass(frozen=True, slots=True)
class ControlRunConfig:
    key: TableKey | None = None
    """Serve this key alone (None: every key whose engines announce themselves)."""
    lookback_s: float = 180.0
    """Telemetry read at start-up from this far back (broker time): a restart's fits see
    the last minutes again instead of waiting for them."""
    poll_ms: int = 100
    """How long one poll of the reader waits when nothing comes: the service's reaction time
    to an ownership change, at most (a message ends the wait)."""
    group: str | None = None
    """The consumer group the replicas of one tables topic share (None: `default_group`)."""
    session_timeout_ms: int = SESSION_TIMEOUT_MS
    """A replica silent this long loses its keys to the others."""
    replica_id: str | None = None
    """Who this replica's controls say sent them, after `tabletune-control/` (None:
    hostname-pid)."""

    def __post_init__(self) -> None:
        check_bounds(self, lookback_s=at_least(0), poll_ms=in_range(1, 10_000),
                     session_timeout_ms=in_range(1_000, 300_000))
        if self.group is not None and not self.group.strip():
            raise ValueError("ControlRunConfig.group must be a non-empty string or None")


def default_group(settings: Settings) -> str:
    """One group per tables topic: the replicas that write it are the ones to share keys."""
    return f"tabletune-control.{settings.topics.tables}"


def _heartbeat_ms(session_timeout_ms: int) -> int:
    """A heartbeat each tenth of the session: a few lost ones cost no lease."""
    return max(100, session_timeout_ms // 10)


class ControlRunner:
    def __init__(self, settings: Settings, fit: object, *,
                 config: ControlRunConfig | None = None,
                 loop_config: LoopConfig | None = None) -> None:
        settings.require_bootstrap()
        self.settings = settings
        self.config = config = config or ControlRunConfig()
        replica = config.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self.issued_by = f"{ISSUED_BY}/{replica}"
        self.ownership = Ownership(settings, OwnershipConfig(
            group_id=config.group or default_group(settings),
            session_timeout_ms=config.session_timeout_ms,
            heartbeat_interval_ms=_heartbeat_ms(config.session_timeout_ms)))
        channels: dict[TableKey, KafkaChannel] = {}

        def channel_for(key: TableKey) -> KafkaChannel:
            return channels.setdefault(key, KafkaChannel(settings, self.ownership.holding))

        self.channels = channels
        self.claims = KeyClaims(self.ownership, lambda claim: channel_for(claim.key).send(claim),
                                self.issued_by)
        self.service = ControlService(fit, channel_for, config=loop_config, settings=settings,  # type: ignore[arg-type]
                                      only_key=config.key, owns=self.claims.serves,
                                      issued_by=self.issued_by)
        self.fenced = 0
        """Messages dropped unsent because their key's owner changed before they went."""
        self.records = 0
        self.history_records = 0
        self.bad_frames = 0
        self._stop = threading.Event()
        self._reader: KafkaConsumer | None = None
        """The one consumer of the tables, status and telemetry topics (`run`)."""
        self._live_from: dict[TopicPartition, int] = {}
        """Per partition, the first offset that is live: the high watermark when it was
        first fetched. What came before is the lookback's history, for fits only."""

    def stop(self) -> None:
        self._stop.set()

    def run(self, timeout_s: float | None = None) -> None:
        """Serve until `stop()` (or `timeout_s` of wall time, for tests)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        check_with_vllm(DraftTable.from_vllm([[1, 1, 0]]))  # loads vLLM's validator now, not at the first table
        topics = self.settings.topics
        reader = self._reader = KafkaConsumer(
            **self.settings.client_kwargs(), enable_auto_commit=False, group_id=None,
            fetch_max_bytes=64 * 1024 * 1024)
        # in this order within a poll: the state topics first
        handlers = {topics.status: self._on_status, topics.tables: self._on_table,
                    topics.telemetry: self._on_telemetry}
        try:
            state = [*self._partitions(topics.tables), *self._partitions(topics.status)]
            telemetry = self._partitions(topics.telemetry)
            reader.assign(state + telemetry)
            if state:
                reader.seek_to_beginning(*state)
            if telemetry:  # until the state topics are read, and from lookback_s ago
                reader.pause(*telemetry)
            self._catch_up(handlers)
            if not self._stop.is_set():
                self._join()
            if telemetry and not self._stop.is_set():
                self._seek_lookback(telemetry)
                reader.resume(*telemetry)
            log.info("ready: %d key(s) known from the tables and status topics; %s in group "
                     "%s at epoch %d, slots %s of %d", len(self.service.starts), self.issued_by,
                     self.ownership.config.group_id, self.ownership.epoch,
                     sorted(self.ownership.slots), self.ownership.slot_count)
            while not self._stop.is_set():
                if deadline is not None and time.monotonic() >= deadline:
                    break
                self._follow_ownership()
                self._drain(handlers, timeout_ms=self.config.poll_ms)
                self.service.tick()
                for channel in self.channels.values():
                    if channel.unsent:
                        channel.resend()
        finally:
            self._release_all()
            reader.close()
            for channel in self.channels.values():
                channel.close()
            self.ownership.close()  # after the releases: they go out while still the owner

    # ---- ownership ------------------------------------------------------------------------
    def _join(self) -> None:
        """Join the group and wait (a few session timeouts at most) for a first assignment,
        so that `ready` says which slots this replica serves."""
        self.ownership.start()
        waited_s = 3 * self.config.session_timeout_ms / 1000
        deadline = time.monotonic() + waited_s
        while self.ownership.epoch == 0 and not self._stop.is_set():
            if time.monotonic() >= deadline:
                log.warning("no assignment from group %s within %.0f s: serving nothing "
                            "until one comes", self.ownership.config.group_id, waited_s)
                return
            self.ownership.beat()
            self._stop.wait(0.05)

    def _follow_ownership(self) -> None:
        """Drop the keys whose slot this replica no longer holds (or holds anew), then claim
        the keys it holds and has not claimed."""
        self.ownership.beat()
        for key in self.claims.ended():
            self._drop(key)
        self.claims.claim(self.service.known_keys())

    def _drop(self, key: TableKey) -> None:
        """Stop serving `key` at once: its loop and its unsent messages go."""
        self.service.drop(key)
        channel = self.channels.pop(key, None)
        if channel is not None:
            self.fenced += channel.unsent
            channel.close(timeout_s=0)

    # ---- the reader -----------------------------------------------------------------------
    def _partitions(self, topic: str) -> list[TopicPartition]:
        """`topic`'s partitions, once it exists (the service may start before the topics;
        kafka-python says an unknown topic has none)."""
        assert self._reader is not None
        partitions = self._reader.partitions_for_topic(topic)
        log_at = time.monotonic() + TOPIC_WAIT_LOG_S
        while not partitions and not self._stop.is_set():
            if log_at is not None and time.monotonic() >= log_at:
                log.warning("topic %s has no partitions yet: waiting for it", topic)
                log_at = None
            self._stop.wait(0.5)
            partitions = self._reader.partitions_for_topic(topic)
        return [TopicPartition(topic, p) for p in sorted(partitions or ())]

    def _seek_lookback(self, partitions: list[TopicPartition]) -> None:
        """Telemetry from `lookback_s` ago (broker time), or only what comes next."""
        assert self._reader is not None
        if self.config.lookback_s <= 0:
            self._reader.seek_to_end(*partitions)
            return
        since_ms = int((time.time() - self.config.lookback_s) * 1000)
        offsets = self._reader.offsets_for_times({tp: since_ms for tp in partitions})
        for tp in partitions:
            found = offsets.get(tp)
            if found is None:  # nothing that recent: only what comes next
                self._reader.seek_to_end(tp)
            else:
                self._reader.seek(tp, found.offset)

    def _catch_up(self, handlers: Mapping[str, Callable[[Any], None]],
                  idle_polls: int = 3) -> None:
        """Read until `idle_polls` polls in a row bring nothing (end offsets are not
        trustworthy on every Kafka-protocol broker; an idle poll is)."""
        idle = 0
        while idle < idle_polls and not self._stop.is_set():
            idle = 0 if self._drain(handlers, timeout_ms=200) else idle + 1

    def _drain(self, handlers: Mapping[str, Callable[[Any], None]], *, timeout_ms: int) -> int:
        """One poll; each message to its topic's handler, the topics in `handlers`' order.
        The number of messages."""
        assert self._reader is not None
        rank = {topic: i for i, topic in enumerate(handlers)}
        batches = sorted(self._reader.poll(timeout_ms=timeout_ms).items(),
                         key=lambda batch: rank[batch[0].topic])
        count = 0
        for partition, messages in batches:
            handle = handlers[partition.topic]
            for message in messages:
                handle(message)
                count += 1
        return count

    # ---- messages -------------------------------------------------------------------------
    def _on_table(self, message: object) -> None:
        try:
            parsed = parse_table_message(message.value)  # type: ignore[attr-defined]
        except (EnvelopeError, TableError):
            return  # engines reject it with a reason; nothing for the service to learn
        loop = self.service.loop(parsed.key)
        now_s = loop.clock_s if loop is not None else None
        if isinstance(parsed, TableEnvelope):
            self.service.table_seen(parsed, now_s)
        elif isinstance(parsed, TableControl):
            keyring = self.settings.keyring()
            if keyring:
                try:
                    parsed.verify(keyring)
                except SignatureError:
                    return  # engines refuse it too, naming the reason
            if parsed.action == "claim" and self.claims.seen(parsed):
                log.warning("%s was claimed at epoch %d, after ours (%d): no longer serving "
                            "it", parsed.key, parsed.epoch, self.ownership.epoch)
                self._drop(parsed.key)
            self.service.control_seen(parsed, now_s)

    def _on_status(self, message: object) -> None:
        value = message.value or b""  # type: ignore[attr-defined]
        if len(value) > MAX_STATUS_EVENT_BYTES:
            log.warning("a status event of %d bytes skipped unread (more than %d)",
                        len(value), MAX_STATUS_EVENT_BYTES)
            return
        try:
            event = json.loads(value)
        except (ValueError, RecursionError):
            return  # another producer's
        if isinstance(event, dict) and event.get("event") == KNOWLEDGE_EVENT:
            self._on_knowledge(event)
            return
        try:
            if not isinstance(event, dict) or event.get("event") != "started" \
                    or "startup_table" not in event:
                return
            key = TableKey.parse(str(event["table_key"]))
            limits = EngineLimits(key, frozenset(int(k) for k in event["startup_k_values"]),
                                  int(event["max_batch"]))
            startup = DraftTable.from_vllm(event["startup_table"])
        except (ValueError, TypeError, KeyError, AttributeError, EnvelopeError, TableError):
            return  # another producer's event, or an older engine's without limits
        engine_id = event.get("engine_id")
        self.service.engine_started(key, limits, startup,
                                    engine_id=engine_id if isinstance(engine_id, str) else None)

    def _on_knowledge(self, event: dict[str, object]) -> None:
        """A key's latency knowledge as a control replica published it."""
        try:
            memory = read_knowledge(event, self.settings.keyring())
        except ValueError as exc:
            log.warning("latency knowledge on the status topic skipped: %s", exc)
            return
        self.service.knowledge_seen(memory)

    def _on_telemetry(self, message: object) -> None:
        try:
            records = decode_frame(message.value or b"",  # type: ignore[attr-defined]
                                   list(message.headers or []))  # type: ignore[attr-defined]
        except FrameError:
            self.bad_frames += 1  # ingest dead-letters it; the service only skips it
            return
        tp = TopicPartition(message.topic, message.partition)  # type: ignore[attr-defined]
        live_from = self._live_from.get(tp)
        if live_from is None:
            assert self._reader is not None
            highwater = self._reader.highwater(tp)
            live_from = self._live_from[tp] = (message.offset  # type: ignore[attr-defined]
                                               if highwater is None else highwater)
        if message.offset < live_from:  # type: ignore[attr-defined]
            self.history_records += records.num_rows
            self.service.history(records)
            return
        self.records += records.num_rows
        self.service.records(records)

    def _release_all(self) -> None:
        for loop in self.service.loops():
            loop.release_forces()
