"""The fleet's control plane: one `ClosedLoop` per table key, fed every engine's telemetry.

Transport-free: a caller hands it telemetry records, the engines' `started` announcements
and what the tables topic holds, and calls `tick(now_s)`; each key's loop sends its
envelopes and controls through the `ControlChannel` the caller gives for that key. The
`tabletune control` process (`controller.fleet.runner`) feeds it from Kafka with the
telemetry's own timestamps as the clock; the twin feeds it in memory on virtual time. Both
build exactly this class, so what is measured in the twin is what a fleet runs.

With several control replicas, `owns(key)` says which keys this one serves now
(`controller.fleet.claims`); it follows the topics for every key all the same, so that a
key it takes over starts from the topic's state and the last minutes of its telemetry, and
one it loses is dropped (`drop`) without a word to the engines.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from controller.fleet.channel import ControlChannel
from controller.fleet.knowledge_event import KeyMemory
from controller.fleet.loop import OPERATOR_ACTIONS, ClosedLoop, Fit
from controller.fleet.loop_config import LoopConfig
from controller.fleet.publisher import ISSUED_BY
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from schemas import DraftTable, EnvelopeError, TableControl, TableEnvelope, TableKey
from schemas.settings import Settings

log = logging.getLogger(__name__)

FOLDED_ACTIONS = OPERATOR_ACTIONS | {"claim"}
"""Controls a key's loop folds as engines do (force and release are the loops' own)."""

TICK_S = 1.0
"""Each key's loop decides once per telemetry second: its shortest block is one second."""


@dataclass(frozen=True, slots=True)
class KeyStart:
    """What the tables topic and the engines' announcements say about a key."""

    limits: EngineLimits
    startup_table: DraftTable
    current: TableEnvelope | None = None
    newest_version: int = 0
    announced: bool = True
    """False while limits and startup table are only guessed from an envelope."""


class _Recent:
    """A key's steps of the last fit window, in arrival order: a frame costs O(1), as every
    replica keeps every key's telemetry (tens of frames a second)."""

    def __init__(self) -> None:
        self._tables: deque[tuple[int, pa.Table]] = deque()
        self._newest_ns = 0

    def add(self, rows: pa.Table, window_s: float) -> None:
        newest_ns = int(pc.max(rows.column("ts_ns")).as_py())
        self._tables.append((newest_ns, rows))
        self._newest_ns = max(self._newest_ns, newest_ns)
        horizon_ns = self._newest_ns - int(window_s * 1e9)
        while self._tables and self._tables[0][0] < horizon_ns:
            self._tables.popleft()

    def table(self) -> pa.Table:
        return pa.concat_tables([rows for _, rows in self._tables])


@dataclass
class _Key:
    loop: ClosedLoop
    pending: list[pa.Table] = field(default_factory=list)
    next_tick_s: float | None = None
    clock_s: float = 0.0
    """The newest step timestamp seen for the key: its clock when none is given."""


class ControlService:
    def __init__(self, fit: Fit, channel_for: Callable[[TableKey], ControlChannel], *,
                 config: LoopConfig | None = None, settings: Settings | None = None,
                 only_key: TableKey | None = None, service_id: str = "tabletune-control",
                 tick_s: float = TICK_S, owns: Callable[[TableKey], bool] | None = None,
                 issued_by: str = ISSUED_BY) -> None:
        """`channel_for(key)`: the transport for a key's messages; `settings`: where the
        loops' status events go (None: kept in memory); `only_key`: serve that key alone;
        `owns(key)`: whether this replica serves `key` now (None: every key);
        `issued_by`: who the loops' controls say sent them."""
        self.fit = fit
        self.owns = owns
        self.issued_by = issued_by
        self.channel_for = channel_for
        self.config = config or LoopConfig()
        self.settings = settings
        self.only_key = only_key
        self.service_id = service_id
        self.tick_s = tick_s
        self.keys: dict[TableKey, _Key] = {}
        self.starts: dict[TableKey, KeyStart] = {}
        """What is known of each key before its loop starts (limits, the topic's state)."""
        self.unserved_records = 0
        """Telemetry of keys whose limits are not known yet (no `started`, no envelope)."""
        self._history: dict[TableKey, _Recent] = {}
        """Each unserved key's telemetry of the last fit window: a key taken over fits at
        once rather than a fit window later."""
        self.engine_keys: dict[str, TableKey] = {}
        """Engine id -> the key it announced it follows: its telemetry is that key's, even
        where `TABLETUNE_TABLE_KEY` differs from its model|drafter|hardware."""
        self._memories: dict[TableKey, KeyMemory] = {}
        """Each key's newest latency knowledge and regimes on the status topic: what a loop
        that starts for the key measured before."""
        self._logs: dict[TableKey, list[TableEnvelope | TableControl]] = {}
        """Each key's envelopes, operator controls and claims, in topic order: what its loop
        folds when it starts (a pin or an operator's rollback outlives a restart, and what
        a claim fences stays fenced)."""

    # ---- what the fleet says --------------------------------------------------------------
    def engine_started(self, key: TableKey, limits: EngineLimits,
                       startup_table: DraftTable, engine_id: str | None = None) -> None:
        """An engine's announcement: the key's limits are what every engine can take."""
        if engine_id is not None:
            self.engine_keys[engine_id] = key
        if not self._follows(key) or key in self.keys:
            return
        known = self.starts.get(key)
        if known is not None and known.announced:
            limits = EngineLimits(key, known.limits.startup_k_values & limits.startup_k_values,
                                  min(known.limits.max_batch, limits.max_batch))
            startup_table = known.startup_table
        current = None if known is None else known.current
        newest = 0 if known is None else known.newest_version
        self.starts[key] = KeyStart(limits, startup_table, current, newest)

    def table_seen(self, envelope: TableEnvelope, now_s: float | None = None) -> None:
        """An envelope on the tables topic (ours read back, an operator's, an old one)."""
        key = envelope.key
        if not self._follows(key):
            return
        served = self.keys.get(key)
        if served is not None and now_s is not None:
            served.loop.observe_envelope(envelope, now_s)
        self._logs.setdefault(key, []).append(envelope)
        known = self.starts.get(key)
        current = known.current if known is not None else None
        if current is None or envelope.version > current.version:
            current = envelope
        limits = known.limits if known is not None else EngineLimits(
            key, frozenset(envelope.startup_k_values), envelope.max_batch)
        startup = known.startup_table if known is not None else DraftTable.from_vllm(
            [[1, envelope.max_batch, min(envelope.startup_k_values)]])
        self.starts[key] = KeyStart(limits, startup, current,
                                    max(current.version, known.newest_version if known else 0),
                                    announced=known.announced if known is not None else False)

    def control_seen(self, control: TableControl, now_s: float | None = None) -> None:
        """A control on the tables topic: an operator's pin, unpin or rollback is followed
        by the key's loop, a claim raises its epoch (force and release are the loops' own)."""
        key = control.key
        if not self._follows(key) or control.action not in FOLDED_ACTIONS:
            return
        self._logs.setdefault(key, []).append(control)
        served = self.keys.get(key)
        if served is not None and now_s is not None:
            served.loop.observe_control(control, now_s)

    def knowledge_seen(self, memory: KeyMemory) -> None:
        """A key's latency knowledge and regimes as its owner published them (this
        replica's own, read back, or another's): the newest by telemetry time is what a
        loop starting for the key begins from. A loop already serving the key keeps its
        own."""
        if not self._follows(memory.key):
            return
        known = self._memories.get(memory.key)
        if known is None or memory.clock_s >= known.clock_s:
            self._memories[memory.key] = memory

    def history(self, records: pa.Table) -> None:
        """Telemetry from before the service started (a restart's lookback): for the fits
        of each key's loop, never for its clock, guardrail or drift detector."""
        for key, rows in self._by_key(records):
            served = self.keys.get(key)
            if served is not None:
                served.loop.preload(rows)
            else:
                self._remember(key, rows)

    def _remember(self, key: TableKey, rows: pa.Table) -> None:
        """Keep an unserved key's steps for its fits, the last fit window of them."""
        self._history.setdefault(key, _Recent()).add(rows, self.config.fit_window_s)

    def _by_key(self, records: pa.Table) -> list[tuple[TableKey, pa.Table]]:
        if records.num_rows == 0:
            return []
        keys = self._key_column(records)
        texts = pc.unique(keys).to_pylist()
        out = []
        for text in texts:
            try:
                key = TableKey.parse(text)
            except EnvelopeError:  # a field with '|': no table can be keyed by it
                self.unserved_records += records.num_rows
                continue
            if not self._follows(key):
                continue
            out.append((key, records if len(texts) == 1
                        else records.filter(pc.equal(keys, text))))
        return out

    def _key_column(self, records: pa.Table) -> pa.Array:
        """Each row's table key: the one its engine announced, else model|drafter|hardware."""
        identity = pc.binary_join_element_wise(
            records.column("model"), records.column("drafter"), records.column("hardware"),
            "|")
        engines = pc.unique(records.column("engine_id")).to_pylist()
        routed = [e for e in engines if e in self.engine_keys]
        if not routed:
            return identity.combine_chunks() if isinstance(identity, pa.ChunkedArray) \
                else identity
        position = pc.index_in(records.column("engine_id"), value_set=pa.array(routed))
        announced = pa.array([str(self.engine_keys[e]) for e in routed]).take(position)
        chosen = pc.coalesce(announced, identity)
        return chosen.combine_chunks() if isinstance(chosen, pa.ChunkedArray) else chosen

    def records(self, records: pa.Table) -> None:
        """Telemetry from any engines of any keys; kept per key until that key's next tick."""
        for key, rows in self._by_key(records):
            if key not in self.keys and not self._serves(key):
                self._remember(key, rows)
                continue
            served = self.keys.get(key) or self._start(key, rows)
            if served is None:
                self.unserved_records += rows.num_rows
                continue
            served.pending.append(rows)
            served.clock_s = max(served.clock_s,
                                 float(pc.max(rows.column("ts_ns")).as_py()) / 1e9)

    # ---- the clock ------------------------------------------------------------------------
    def tick(self, now_s: float | None = None) -> None:
        """Every key whose tick is due decides, with the records it got since its last.
        `now_s` None: each key's own clock (its newest step)."""
        for served in self.keys.values():
            at_s = served.clock_s if now_s is None else now_s
            if served.next_tick_s is None:
                served.next_tick_s = at_s
            if at_s < served.next_tick_s:
                continue
            served.next_tick_s = at_s + self.tick_s
            records = None
            if served.pending:
                records = pa.concat_tables(served.pending)
                served.pending = []
                if records.num_rows > 1:  # engines interleave: the watchers read time order
                    records = records.sort_by("ts_ns")
            served.loop.tick(at_s, records)

    def loops(self) -> list[ClosedLoop]:
        return [served.loop for served in self.keys.values()]

    def loop(self, key: TableKey) -> ClosedLoop | None:
        served = self.keys.get(key)
        return None if served is None else served.loop

    # ---- keys -----------------------------------------------------------------------------
    def known_keys(self) -> list[TableKey]:
        """The keys whose limits are known: those a loop could serve."""
        return list(self.starts)

    def drop(self, key: TableKey) -> ClosedLoop | None:
        """Stop serving `key` (another replica owns it now): its loop goes, sending nothing;
        its steps stay for the fits of a later takeover."""
        served = self.keys.pop(key, None)
        if served is None:
            return None
        rows = served.loop.window.window(served.loop.clock_s)
        loop = served.loop
        self.knowledge_seen(KeyMemory(key, loop.clock_s, loop.knowledge.cells,
                                      tuple(r for r in loop.regimes.kept()
                                            if r.version is not None)))
        self._history.pop(key, None)
        if rows is not None and rows.num_rows:
            self._remember(key, rows)
        log.info("no longer serving %s (%s)", key, served.loop.state.value)
        return served.loop

    def _follows(self, key: TableKey) -> bool:
        """Whether the service keeps `key`'s state at all (`only_key`)."""
        return self.only_key is None or key == self.only_key

    def _serves(self, key: TableKey) -> bool:
        return self._follows(key) and (self.owns is None or self.owns(key))

    def _start(self, key: TableKey, records: pa.Table) -> _Key | None:
        known = self.starts.get(key)
        if known is None:
            return None
        status = StatusPublisher(self.settings, self.service_id, str(key), history=4096)
        loop = ClosedLoop(self.channel_for(key), known.limits, status, self.fit, self.config,
                          startup_table=known.startup_table, current=known.current,
                          newest_version=known.newest_version,
                          log=tuple(self._logs.get(key, ())),
                          memory=self._memories.get(key),
                          issued_by=self.issued_by)
        # the newest live step: the lookback's older steps came in through `history`
        start_s = float(pc.max(records.column("ts_ns")).as_py()) / 1e9
        recent = self._history.pop(key, None)
        if recent is not None:
            loop.preload(recent.table())
        loop.start(start_s)
        log.info("serving %s from %.1f s (%s)", key, start_s, loop.state.value)
        served = self.keys[key] = _Key(loop)
        return served
