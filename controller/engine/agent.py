"""The in-engine controller's state machine: which table version an engine should run.

It consumes the table log of one key in order (envelopes and operator controls) and decides a
*desired* version; the feed stages it into the engine's table switch once it has caught up, so
a restart that replays the whole log applies only the final state. Pure: no Kafka, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from controller.validation import EngineLimits, Rejection, check_envelope, check_table
from schemas import DraftTable, SignatureError, TableControl, TableEnvelope
from schemas.signing import Keyring

Emit = Callable[..., None]
"""emit(event, **fields): report a decision on the status topic."""


class Mode(enum.Enum):
    FOLLOWING = "following"
    """Run the newest valid version."""
    PINNED = "pinned"
    """Run the pinned version until unpinned."""


@dataclass
class TableAgentState:
    mode: Mode = Mode.FOLLOWING
    newest_version: int = 0
    pinned_version: int | None = None
    desired_version: int = 0
    """0 = the engine's startup table."""
    accepted: dict[int, TableEnvelope] = field(default_factory=dict)
    withdrawn: set[int] = field(default_factory=set)
    """Versions rolled back; never followed again (a newer version must replace them)."""
    history: list[int] = field(default_factory=list)
    """Desired versions in the order they were chosen (for rollback)."""
    forced: TableControl | None = None
    """The `force` in effect until its release or expiry (over whatever version is desired)."""
    folded_controls: set[str] = field(default_factory=set)
    """Ids of the authentic controls folded so far: one met again is a replay. A few dozen
    bytes per control, and a key sees a few dozen controls per re-profile."""


class TableAgent:
    """Decides the desired table version from the log; one instance per engine and key."""

    def __init__(self, limits: EngineLimits, keyring: Keyring, emit: Emit, *,
                 engine_id: str | None = None) -> None:
        """`engine_id`: which targeted controls are for this engine (None: untargeted only)."""
        self.limits = limits
        self.engine_id = engine_id
        self.keyring = dict(keyring)
        self.emit = emit
        self.state = TableAgentState()

    # ---- inputs ---------------------------------------------------------------------------
    def on_envelope(self, envelope: TableEnvelope, offset: int | None = None) -> bool:
        """Validate and keep `envelope`; False (and a `rejected` event, with the log offset
        when known) when refused."""
        state = self.state
        try:
            check_envelope(envelope, self.limits, self.keyring)
            if envelope.version <= state.newest_version:
                raise Rejection("stale_version", f"version {envelope.version} is not newer "
                                f"than {state.newest_version}")
        except Rejection as exc:
            self.emit("rejected", version=envelope.version, reason=exc.reason,
                      detail=exc.detail, **_at(offset))
            return False
        state.accepted[envelope.version] = envelope
        state.newest_version = envelope.version
        if state.mode is Mode.FOLLOWING:
            self._desire(envelope.version)
        return True

    def on_control(self, control: TableControl, offset: int | None = None) -> None:
        """Fold a control of this key meant for this engine; a forged one, or a copy of one
        folded before (a replay), is refused with a `rejected` event naming it."""
        if control.key != self.limits.key or not control.applies_to(self.engine_id):
            return
        named = {"control": control.action, "control_id": control.control_id, **_at(offset)}
        if self.keyring:
            try:
                control.verify(self.keyring)
            except SignatureError as exc:
                self.emit("rejected", reason=exc.reason, detail=str(exc), **named)
                return
        if control.control_id in self.state.folded_controls:
            self.emit("rejected", reason="replayed", detail=f"control {control.control_id} "
                      "was folded before: this is a copy sent again", **named)
            return
        self.state.folded_controls.add(control.control_id)
        handler = {"pin": self._pin, "unpin": self._unpin, "rollback": self._rollback,
                   "force": self._force, "release": self._release}
        handler[control.action](control)

    def forced_table(self, now: datetime) -> DraftTable | None:
        """The table a `force` holds the engine on at `now`; None once released or expired
        (the caller owns the clock: the agent stays a pure fold of the log)."""
        forced = self.state.forced
        if forced is None or forced.expired(now):
            return None
        return forced.table

    def on_rejected_message(self, reason: str, detail: str, **fields: Any) -> None:
        """A message that could not even be parsed."""
        self.emit("rejected", reason=reason, detail=detail, **fields)

    def roll_back(self, reason: str, **evidence: Any) -> int | None:
        """Guardrail: withdraw the desired version and go back to the previous one."""
        return self._rollback(None, reason=reason, **evidence)

    # ---- transitions ----------------------------------------------------------------------
    def _pin(self, control: TableControl) -> None:
        version = control.version
        assert version is not None
        if version not in self.state.accepted:
            self.emit("rejected", control="pin", version=version, reason="unknown_version",
                      detail=f"version {version} was never accepted by this engine")
            return
        self.state.mode = Mode.PINNED
        self.state.pinned_version = version
        self._desire(version)

    def _force(self, control: TableControl) -> None:
        assert control.table is not None
        try:
            check_table(control.table, self.limits)
        except Rejection as exc:
            self.emit("rejected", control="force", reason=exc.reason, detail=exc.detail)
            return
        self.state.forced = control

    def _release(self, control: TableControl) -> None:
        self.state.forced = None

    def _unpin(self, control: TableControl) -> None:
        self.state.mode = Mode.FOLLOWING
        self.state.pinned_version = None
        followable = [v for v in self.state.accepted if v not in self.state.withdrawn]
        self._desire(max(followable, default=0))

    def _rollback(self, control: TableControl | None, reason: str = "operator",
                  **evidence: Any) -> int | None:
        state = self.state
        current = state.desired_version
        if current == 0:
            self.emit("rejected", control="rollback", reason="nothing_to_roll_back",
                      detail="the engine runs its startup table")
            return None
        state.withdrawn.add(current)
        previous = next((v for v in reversed(state.history[:-1])
                         if v not in state.withdrawn), 0)
        state.mode = Mode.FOLLOWING
        state.pinned_version = None
        self._desire(previous)
        self.emit("rolled_back", version=current, to_version=previous, reason=reason,
                  **evidence)
        return previous

    def _desire(self, version: int) -> None:
        if version != self.state.desired_version:
            self.state.desired_version = version
            self.state.history.append(version)

    def desired(self) -> TableEnvelope | None:
        """The envelope the engine should run (None: its startup table)."""
        return self.state.accepted.get(self.state.desired_version)


def _at(offset: int | None) -> dict[str, int]:
    """The `offset` field of an event about a message read from the log (none in memory)."""
    return {} if offset is None else {"offset": offset}
