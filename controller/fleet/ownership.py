"""Which table keys this control replica may write: Kafka's group membership decides.

Every replica of `tabletune control` joins one consumer group subscribed to the ownership
topic, whose partitions are slots: a key's slot is the partition Kafka's default partitioner
gives the key's bytes (murmur2), and the member the group coordinator assigned that partition
owns the key, as Kafka Streams shares its tasks. A member that leaves, dies or stalls past
the session timeout loses its partitions to the others at the next rebalance; one that joins
takes its share. Nothing is written to the topic and no offset is committed: the assignment
is the whole of it.

The epoch is the group generation plus one: the coordinator raises the generation at every
rebalance, so a newer owner always holds a higher epoch (Tansu numbers the first generation
0, Apache Kafka 1; the +1 keeps every epoch above 0, which means "not fenced"). Everything
the replica sends carries the epoch, and engines refuse an older one once a newer owner has
claimed the key (`controller.engine.agent`).

A member acts only while its lease holds: its last acknowledged heartbeat is younger than
`LEASE_SHARE` of the session timeout, so the coordinator cannot have expired it yet, and no
rebalance is pending. A process that was stopped (SIGSTOP, a long pause) wakes past its
lease and sends nothing until the group has told it what it still owns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kafka import ConsumerRebalanceListener, KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import NewTopic
from kafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from kafka.errors import TopicAlreadyExistsError
from kafka.partitioner.default import murmur2

from controller.fleet.ownership_config import OwnershipConfig
from schemas import TableKey
from schemas.settings import Settings

log = logging.getLogger(__name__)

LEASE_SHARE = 0.5
"""A member acts while its last heartbeat acknowledgement is younger than this share of the
session timeout: the coordinator received that heartbeat less than a round trip earlier, so
it cannot have expired the member, whatever the round trip up to half the timeout."""
META_TIMEOUT_S = 30.0
"""How long start-up waits for the ownership topic's metadata."""
POLL_MS = 200
"""One poll of the membership thread. It polls back to back: kafka-python 3.0.12 drops a
join that completes while no poll awaits it and joins again, so a consumer polled now and
then between other work (Tansu holds each join ~3 s) never finishes joining."""
LOOP_STALL_S = 5.0
"""The membership thread polls only while the service loop has beaten this recently: a loop
stuck for longer stops the polls, and past `max_poll_interval_ms` kafka-python leaves the
group, so a hung replica's keys move too."""
MAX_POLL_INTERVAL_MS = 120_000
"""A service loop stuck this long (no fit takes a tenth of it) gives its keys up."""


class Ownership(ConsumerRebalanceListener):
    """This replica's share of the keys, kept up to date by the group coordinator.

    A membership thread of its own polls the group (`POLL_MS`) while the service loop beats
    (`beat()`); the rebalance callbacks run on kafka-python's I/O thread, and take the same
    lock a send holds (`holding`): a revoke waits for a send in flight and returns only
    once nothing more is sent for those slots."""

    def __init__(self, settings: Settings, config: OwnershipConfig) -> None:
        self.settings = settings
        self.config = config
        self.topic = settings.topics.ownership
        self.slot_count = 0
        self._lock = threading.RLock()
        self._tenure: dict[int, int] = {}
        """Slot -> the epoch this member's uninterrupted hold of it began at."""
        self._held: frozenset[int] = frozenset()
        """Slots assigned now (empty between a revoke and the next assignment)."""
        self._epoch = 0
        self._consumer: KafkaConsumer | None = None
        self._beat = time.monotonic()
        self._leased = True
        """Whether the lease held at the last send: a change is logged once."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the group ------------------------------------------------------------------------
    def start(self) -> None:
        """Create the ownership topic if it is missing, and join the group."""
        self._ensure_topic()
        consumer = KafkaConsumer(
            **self.settings.client_kwargs(), group_id=self.config.group_id,
            enable_auto_commit=False, session_timeout_ms=self.config.session_timeout_ms,
            heartbeat_interval_ms=self.config.heartbeat_interval_ms,
            max_poll_interval_ms=MAX_POLL_INTERVAL_MS,
            # eager: each assignment is the whole of a member's slots (`on_partitions_assigned`)
            partition_assignment_strategy=(RoundRobinPartitionAssignor,))
        deadline = time.monotonic() + META_TIMEOUT_S
        partitions = consumer.partitions_for_topic(self.topic)
        while not partitions and time.monotonic() < deadline:
            time.sleep(0.2)
            partitions = consumer.partitions_for_topic(self.topic)
        if not partitions:
            consumer.close()
            raise RuntimeError(f"ownership topic {self.topic} has no partitions")
        self.slot_count = len(partitions)
        # fail now, not at the first send, on a client without them
        _ack_time(consumer)
        _stable(consumer)
        consumer.subscribe([self.topic], listener=self)
        self._consumer = consumer
        self._beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(consumer,),
                                        name="tabletune-ownership", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """The service loop is alive: the membership thread goes on polling for it."""
        self._beat = time.monotonic()

    def close(self) -> None:
        """Leave the group: the others take the keys at once instead of at the timeout."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=META_TIMEOUT_S)
            self._thread = None
        self._consumer = None
        with self._lock:
            self._held, self._tenure = frozenset(), {}

    def _run(self, consumer: KafkaConsumer) -> None:
        """Poll the group (joins, rebalances; the topic holds no records) while the loop
        beats, then leave it."""
        try:
            while not self._stop.is_set():
                if time.monotonic() - self._beat < LOOP_STALL_S:
                    consumer.poll(timeout_ms=POLL_MS)
                else:
                    self._stop.wait(POLL_MS / 1000)
        except Exception:  # a broken membership must not pass for a held one
            log.exception("ownership: the membership thread failed; serving nothing")
            with self._lock:
                self._held = frozenset()
        finally:
            consumer.close()

    # ---- what this member may do ----------------------------------------------------------
    def slot(self, key: TableKey) -> int:
        """The partition a record keyed by `key` goes to under Kafka's default partitioner."""
        return (murmur2(str(key).encode()) & 0x7FFFFFFF) % self.slot_count

    @property
    def epoch(self) -> int:
        """The current epoch: the generation of the last assignment, plus one."""
        return self._epoch

    @property
    def slots(self) -> frozenset[int]:
        return self._held

    def tenure(self, key: TableKey) -> int | None:
        """The epoch this member's hold of `key` began at; None once it lost it. A different
        value than before means someone else may have held it in between. Through a
        rebalance (revoked, not yet assigned again) it stays: the hold is suspended, and
        `holding` sends nothing, until the assignment says whether it goes on."""
        with self._lock:
            return self._tenure.get(self.slot(key))

    def lease_holds(self) -> bool:
        """Whether the coordinator has acknowledged this member recently enough that it
        cannot have been expired (`LEASE_SHARE`)."""
        if self._consumer is None:
            return False
        age_s = time.monotonic() - _ack_time(self._consumer)
        # read after the acknowledgement: kafka-python flags the rejoin before it counts a
        # "rebalancing" answer as a heartbeat, so a fresh answer of that kind is seen here
        return (age_s < LEASE_SHARE * self.config.session_timeout_ms / 1000
                and _stable(self._consumer))

    @contextmanager
    def holding(self, key: TableKey) -> Iterator[int | None]:
        """The epoch to send `key`'s message at, None when this member may not send it now
        (not its key, or its lease lapsed); no revoke completes while the block runs."""
        with self._lock:
            owned = self.tenure(key) is not None and self.slot(key) in self._held
            leased = self.lease_holds()
            if owned and leased != self._leased:
                self._leased = leased
                age_s = time.monotonic() - _ack_time(self._consumer) if self._consumer else 0
                log.log(logging.INFO if leased else logging.WARNING,
                        "ownership: lease %s (last heartbeat answer %.1f s ago)",
                        "holds again" if leased else "lapsed: sending nothing", age_s)
            yield self._epoch if owned and leased else None

    # ---- the coordinator's callbacks (kafka-python's I/O thread) ---------------------------
    def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        with self._lock:
            self._held = self._held - {tp.partition for tp in revoked}
        log.info("ownership: slots %s revoked", sorted(tp.partition for tp in revoked))

    def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """The whole assignment (eager rebalancing): a slot held in the generation just
        before keeps its tenure, as nobody else can have held it in between."""
        assert self._consumer is not None
        epoch = self._consumer.group_metadata().generation_id + 1
        with self._lock:
            kept = self._tenure if epoch == self._epoch + 1 else {}
            slots = frozenset(tp.partition for tp in assigned)
            self._tenure = {slot: kept.get(slot, epoch) for slot in slots}
            self._held, self._epoch = slots, epoch
        log.info("ownership: epoch %d, slots %s", epoch, sorted(slots))

    def on_partitions_lost(self, lost: set[TopicPartition]) -> None:
        with self._lock:
            gone = {tp.partition for tp in lost}
            self._held = self._held - gone
            for slot in gone:
                self._tenure.pop(slot, None)
        log.warning("ownership: slots %s lost (the group expired this member)", sorted(gone))

    def _ensure_topic(self) -> None:
        admin = KafkaAdminClient(**self.settings.client_kwargs())
        try:
            if self.topic not in set(admin.list_topics()):
                admin.create_topics([NewTopic(self.topic, self.config.slots, 1)])
                log.info("created ownership topic %s (%d slots)", self.topic,
                         self.config.slots)
        except TopicAlreadyExistsError:
            pass  # another replica created it first
        finally:
            admin.close()


def _stable(consumer: KafkaConsumer) -> bool:
    """Whether the member is in a generation with nothing pending: kafka-python counts a
    heartbeat answered "the group is rebalancing" as acknowledged (it keeps a member's
    session alive), though a newer generation may already have given its slots away."""
    coordinator = consumer._coordinator
    return bool(coordinator.stable() and not coordinator.rejoin_needed)


def _ack_time(consumer: KafkaConsumer) -> float:
    """The monotonic time of the coordinator's last heartbeat acknowledgement (or of the
    last join). kafka-python exposes it on its coordinator only (its metrics give the last
    send, not the last answer); an AttributeError here means a client without it."""
    heartbeat = consumer._coordinator.heartbeat
    return max(heartbeat.last_receive, heartbeat.last_reset)
