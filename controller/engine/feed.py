"""The engine side of control, with no transport: fold tables-topic messages, stage tables.

One per engine. Messages (envelopes and controls) go through the `TableAgent` in log order;
`sync()` then stages what the agent wants into the engine's `TableSwitch`: a `force` in
effect first, else the desired version with its explorer. The Kafka follower (`TableFeed`)
and the twin's in-memory control plane both drive this class, so an engine behaves the same
whichever carries its messages; only the clock is injected (wall time on a real engine, the
twin's virtual time in the twin).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from controller.engine.agent import TableAgent
from controller.engine.table_switch import TableSwitch
from controller.exploration import ExplorationConfig, explorer_for
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from schemas import (
    DraftTable,
    EnvelopeError,
    TableControl,
    TableEnvelope,
    TableError,
    parse_table_message,
)
from schemas.signing import Keyring

Clock = Callable[[], datetime]
"""Now, as an aware datetime: what a force's `expires_at` is compared with."""


class EngineFeed:
    def __init__(self, switch: TableSwitch, limits: EngineLimits, status: StatusPublisher,
                 clock: Clock, *, keyring: Keyring | None = None,
                 exploration: ExplorationConfig | None = None,
                 engine_id: str | None = None) -> None:
        self.switch = switch
        self.limits = limits
        self.status = status
        self.clock = clock
        self.agent = TableAgent(limits, keyring or {}, status.emit,
                                engine_id=engine_id or status.engine_id)
        self.exploration = exploration or ExplorationConfig()
        self.applied_version = switch.version
        """The version the engine last confirmed running (`applied`)."""
        self._staged_version: int | None = None
        self._staged_at: datetime | None = None
        self._last_desired = 0
        """Stage on a change of decision only, so a forced table is not undone."""
        self._forced: DraftTable | None = None
        """The table a `force` control has staged, until its release or expiry."""
        self._refused_force: DraftTable | None = None
        """A forced table the switch refused: said once on the status topic, not every poll."""
        self.on_applied: Callable[[int, int, TableEnvelope | None], None] | None = None
        """Called with (version, previous version, envelope) once the engine runs a table."""

    # ---- messages -------------------------------------------------------------------------
    def handle_bytes(self, value: bytes, offset: int | None = None) -> None:
        """A raw tables-topic value of this engine's key; one that is malformed or breaks a
        bound is rejected before anything is built from it."""
        try:
            message = parse_table_message(value)
        except EnvelopeError as exc:
            self.agent.on_rejected_message(exc.reason, str(exc), offset=offset)
            return
        except TableError as exc:
            self.agent.on_rejected_message("bad_envelope", str(exc), offset=offset)
            return
        self.handle(message, offset)

    def handle(self, message: TableEnvelope | TableControl, offset: int | None = None) -> None:
        """Fold one message; `offset`: where it is in the log (None: in memory)."""
        if isinstance(message, TableControl):
            self.agent.on_control(message, offset)
        else:
            self.agent.on_envelope(message, offset)

    # ---- the switch -----------------------------------------------------------------------
    def sync(self) -> None:
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
            seconds = (self.clock() - self._staged_at).total_seconds() \
                if self._staged_at is not None else 0.0
            self.status.emit("applied", version=switch.version,
                             seconds_to_apply=round(seconds, 4))
            if self.on_applied is not None:
                self.on_applied(switch.version, self.applied_version, desired)
            self.applied_version = switch.version
            self._staged_version = None
        if version == self._last_desired:
            return
        if version != switch.version or switch.pending or switch.forced:
            self._stage(desired, version)
        self._last_desired = version  # only once staged or refused: a surprise stages again

    def _stage(self, desired: TableEnvelope | None, version: int) -> None:
        """Stage the desired table with its explorer and budget (the startup table for
        version 0). An engine whose drafter reports no match length runs the table alone:
        the budget is for drafters that do."""
        switch = self.switch
        table = switch.startup_table if desired is None else desired.table
        explorer = budget = None
        if desired is not None:
            budget = desired.budget if switch.max_match else None
            explorer = explorer_for(desired.exploration, table, max_batch=self.limits.max_batch,
                                    k_values=self.limits.startup_k_values,
                                    config=self.exploration)
        try:
            switch.stage(table, version, explorer=explorer, budget=budget)
        except TableError as exc:  # checked already; the switch has the final word
            self.status.emit("rejected", version=version, reason="invalid_table",
                             detail=str(exc))
            return
        self._staged_version = version
        self._staged_at = self.clock()

    def _sync_forced(self) -> bool:
        """Stage a newly forced table, or note the end of a force; True while one holds."""
        forced = self.agent.forced_table(self.clock())
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
