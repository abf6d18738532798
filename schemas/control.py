"""Operator commands that travel on the tables topic beside the envelopes they refer to.

`pin` holds engines on one version, `unpin` releases them, `rollback` moves them back to the
version before the active one. `force` runs a given table until `release` or until its
`expires_at` passes: the profiler's cells on a live server (telemetry marks those steps
`forced`); the expiry means a profiler that dies mid-sweep cannot leave a fleet forced, even
for an engine that replays the log after a restart. Keeping commands in the same keyed log
as the tables means an engine that reads the log from the beginning folds to the same state
as one that followed it live, with no second channel to keep consistent.

Every control carries an `id`, under its signature, issued once (`new_control_id`): engines
remember the ids they folded, so the same control sent again, at a later offset, is a replay
and is refused. An engine reading the log from the beginning meets each original once, and
every copy after it, so it refuses the same copies as it did live.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from schemas.draft_table import DraftTable
from schemas.envelope import (
    MAX_EPOCH,
    MAX_VERSION,
    EnvelopeError,
    Signature,
    TableEnvelope,
    TableKey,
    canonical_json,
    integer,
    load_json_object,
    sequence,
    text,
    timestamp,
    verify_signature,
)
from schemas.signing import Keyring

ACTIONS = ("pin", "unpin", "rollback", "force", "release", "claim")
MAX_TARGETS = 4096
"""Engine ids one control may name: a key's fleet, with room; bounds what a reader allocates."""
MAX_FORCE_S = 3600.0
"""Longest a force may hold (expires_at - issued_at), keys or not: a profiler cell or a sweep
block with its grace lasts minutes, and an hour bounds what one lost release can hold."""


def new_control_id() -> str:
    """A fresh control id (random, so no two issuers need to agree on a sequence)."""
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class TableControl:
    key: TableKey
    action: str
    version: int | None
    """Target version for `pin` (and the version rolled back to, once resolved)."""
    issued_at: str
    """ISO-8601 time, with its zone; a force's duration counts from it."""
    control_id: str
    """Unique per control (`new_control_id`): a second message with it is a replay."""
    issued_by: str = "operator"
    signature: Signature | None = None
    table: DraftTable | None = None
    """`force`: the table to run."""
    expires_at: str | None = None
    """`force`: ISO-8601 time after which the force no longer holds."""
    targets: tuple[str, ...] = ()
    """The engine ids this control is for (a re-profile's canaries); empty: every engine of
    the key."""
    epoch: int = 0
    """The sender's ownership epoch of the key (a control replica's group generation + 1);
    0: an operator's or an earlier release's control, which no epoch fences. A `claim`
    carries the epoch its new owner starts: engines refuse anything older after it."""

    def __post_init__(self) -> None:
        if not isinstance(self.key, TableKey):
            raise EnvelopeError("a control needs a TableKey")
        if self.action not in ACTIONS:
            raise EnvelopeError(f"control action {self.action!r} is not one of {ACTIONS}")
        text(self.control_id, "control id")
        text(self.issued_by, "issued_by")
        issued = _zoned(self.issued_at, "issued_at")
        if self.version is not None:
            integer(self.version, "version", 0, MAX_VERSION)
        if len(self.targets) > MAX_TARGETS:
            raise EnvelopeError(f"a control names {len(self.targets)} targets, more than "
                                f"{MAX_TARGETS}")
        for target in self.targets:
            text(target, "control targets")
        integer(self.epoch, "epoch", 0, MAX_EPOCH)
        if self.action == "claim" and (self.epoch < 1 or self.version is not None
                                       or self.targets):
            raise EnvelopeError("a claim needs an epoch >= 1, and no version or targets")
        if self.action == "pin" and (self.version is None or self.version < 1):
            raise EnvelopeError("a pin needs a version >= 1")
        if self.action != "force":
            if self.table is not None or self.expires_at is not None:
                raise EnvelopeError(f"a {self.action} carries no table or expires_at")
            return
        if self.table is None or self.expires_at is None:
            raise EnvelopeError("a force needs a table and expires_at")
        held_s = (_zoned(self.expires_at, "expires_at") - issued).total_seconds()
        if held_s > MAX_FORCE_S:
            raise EnvelopeError(f"a force of {held_s:.0f} s (issued_at to expires_at) is "
                                f"longer than the {MAX_FORCE_S:.0f} s a force may hold",
                                reason="force_too_long")

    def applies_to(self, engine_id: str | None) -> bool:
        """Whether an engine with this id follows the control (one with no id: untargeted
        controls only)."""
        return not self.targets or engine_id in self.targets

    def expired(self, now: datetime) -> bool:
        """Whether a force has run out at `now` (never, for other actions)."""
        return self.expires_at is not None and datetime.fromisoformat(self.expires_at) <= now

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "control": self.action,
            "key": {"model": self.key.model, "drafter": self.key.drafter,
                    "hardware": self.key.hardware},
            "version": self.version, "issued_at": self.issued_at, "issued_by": self.issued_by,
            "id": self.control_id,
        }
        if self.table is not None:
            out["table"] = self.table.to_vllm()
        if self.expires_at is not None:
            out["expires_at"] = self.expires_at
        if self.targets:
            out["targets"] = list(self.targets)
        if self.epoch:  # absent at 0: an earlier release's signed bytes stay the same
            out["epoch"] = self.epoch
        if self.signature is not None:
            out["signature"] = self.signature.to_dict()
        return out

    def to_json(self) -> bytes:
        return canonical_json(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TableControl:
        """Parse a JSON object; types are checked here, bounds in `__post_init__`."""
        try:
            signature = data.get("signature")
            version = data.get("version")
            table = data.get("table")
            return cls(
                key=TableKey.from_dict(data["key"]),
                action=data["control"],
                version=None if version is None else integer(version, "version"),
                issued_at=data["issued_at"],
                control_id=data["id"],
                issued_by=data.get("issued_by", "operator"),
                signature=None if signature is None else Signature.from_dict(signature),
                table=None if table is None else DraftTable.from_vllm(table),
                expires_at=data.get("expires_at"),
                targets=tuple(sequence(data.get("targets", []), "control targets")),
                epoch=integer(data.get("epoch", 0), "epoch"),
            )
        except KeyError as exc:
            raise EnvelopeError(f"control field {exc.args[0]!r} is missing") from None
        except (TypeError, AttributeError) as exc:
            raise EnvelopeError(f"control is malformed ({exc})") from None

    def unsigned_payload(self) -> dict[str, Any]:
        payload = self.to_dict()
        payload.pop("signature", None)
        return payload

    def signed(self, key_id: str, key: Ed25519PrivateKey) -> TableControl:
        """This control signed by private `key`, named `key_id`."""
        return replace(self, signature=Signature.of(self.unsigned_payload(), key_id, key))

    def verify(self, keyring: Keyring) -> None:
        """Raise `SignatureError` unless signed by a key in `keyring` (key id -> public key)."""
        verify_signature(self.signature, canonical_json(self.unsigned_payload()), keyring)


def parse_table_message(raw: bytes | str) -> TableEnvelope | TableControl:
    """A tables-topic value: a `TableEnvelope` or a `TableControl` (EnvelopeError if neither,
    or if any field breaks its bounds; `reason` says which kind of refusal)."""
    data = load_json_object(raw, "a tables-topic message")
    if "control" in data:
        return TableControl.from_dict(data)
    return TableEnvelope.from_dict(data)


def _zoned(value: Any, name: str) -> datetime:
    moment = timestamp(value, name)
    if moment.tzinfo is None:
        raise EnvelopeError(f"{name} {value!r} has no time zone")
    return moment


__all__ = ["ACTIONS", "MAX_FORCE_S", "TableControl", "new_control_id", "parse_table_message"]
