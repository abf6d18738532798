"""The in-engine controller's state machine: which table version an engine should run.

It consumes the table log of one key in order (envelopes and operator controls) and decides a
*desired* version; the feed stages it into the engine's table switch once it has caught up, so
a restart that replays the whole log applies only the final state. Pure: no Kafka, no clock.

Fencing: each control replica stamps what it sends with its ownership epoch of the key, and a
new owner's first word is a `claim` at its epoch. The agent keeps the highest epoch seen and
refuses anything older (`stale_epoch`): a replica that lost the key, stalled or partitioned,
cannot move the engines once its successor has claimed. It also refuses a version it accepted
before with other content (`version_conflict`): two writers numbered two tables alike.
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
    epoch: int = 0
    """The highest ownership epoch of an authentic message so far (0: none carried one)."""
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
            self._check_epoch(envelope.epoch)
            if envelope.version <= state.newest_version:
                raise _version_refusal(envelope, state.accepted.get(envelope.version),
                                       state.newest_version)
        except Rejection as exc:
            self.emit("rejected", version=envelope.version, reason=exc.reason,
                      detail=exc.detail, **_epoch(envelope.epoch), **_at(offset))
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
        try:
            self._check_epoch(control.epoch)
        except Rejection as exc:
            self.emit("rejected", reason=exc.reason, detail=exc.detail,
                      **_epoch(control.epoch), **named)
            return
        handler = {"pin": self._pin, "unpin": self._unpin, "rollback": self._rollback,
                   "force": self._force, "release": self._release, "claim": self._claim}
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

    def _check_epoch(self, epoch: int) -> None:
        """Raise `stale_epoch` for an epoch older than the newest seen, else take it as the
        newest; epoch 0 (an operator, an earlier release) is not fenced."""
        if epoch == 0:
            return
        if epoch < self.state.epoch:
            raise Rejection("stale_epoch", f"epoch {epoch} is older than epoch "
                            f"{self.state.epoch}, whose owner has claimed the key since")
        self.state.epoch = epoch

    # ---- transitions ----------------------------------------------------------------------
    def _claim(self, control: TableControl) -> None:
        """A new owner's epoch (taken by `_check_epoch`): a force an older owner holds ends,
        as its sender can no longer release it."""
        forced = self.state.forced
        if forced is not None and 0 < forced.epoch < control.epoch:
            self.state.forced = None

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


def _version_refusal(envelope: TableEnvelope, seen: TableEnvelope | None,
                     newest: int) -> Rejection:
    """Why a version not newer than `newest` is refused: the same version with other content
    (two writers), the same message again, or an older number."""
    if seen is None:
        return Rejection("stale_version", f"version {envelope.version} is not newer than "
                         f"{newest}")
    if seen.unsigned_payload() != envelope.unsigned_payload():
        return Rejection("version_conflict", f"version {envelope.version} was accepted "
                         "before with other content")
    return Rejection("stale_version", f"version {envelope.version} was accepted before: "
                     "this is a copy")


def _epoch(epoch: int) -> dict[str, int]:
    """The `epoch` field of a refusal of a message that carried one."""
    return {"epoch": epoch} if epoch else {}


def _at(offset: int | None) -> dict[str, int]:
    """The `offset` field of an event about a message read from the log (none in memory)."""
    return {} if offset is None else {"offset": offset}
