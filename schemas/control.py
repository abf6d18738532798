"""Operator commands that travel on the tables topic beside the envelopes they refer to.

`pin` holds engines on one version, `unpin` releases them, `rollback` moves them back to the
version before the active one. `force` runs a given table until `release` or until its
`expires_at` passes: the profiler's cells on a live server (telemetry marks those steps
`forced`); the expiry means a profiler that dies mid-sweep cannot leave a fleet forced, even
for an engine that replays the log after a restart. Keeping commands in the same keyed log
as the tables means an engine that reads the log from the beginning folds to the same state
as one that followed it live, with no second channel to keep consistent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from schemas.draft_table import DraftTable
from schemas.envelope import (
    EnvelopeError,
    Signature,
    TableKey,
    canonical_json,
    hmac_hex,
    verify_mac,
)

ACTIONS = ("pin", "unpin", "rollback", "force", "release")
MAX_TARGETS = 4096
"""Engine ids one control may name: a key's fleet, with room; bounds what a reader allocates."""


@dataclass(frozen=True, slots=True)
class TableControl:
    key: TableKey
    action: str
    version: int | None
    """Target version for `pin` (and the version rolled back to, once resolved)."""
    issued_at: str
    issued_by: str = "operator"
    signature: Signature | None = None
    table: DraftTable | None = None
    """`force`: the table to run."""
    expires_at: str | None = None
    """`force`: ISO-8601 time after which the force no longer holds."""
    targets: tuple[str, ...] = ()
    """The engine ids this control is for (a re-profile's canaries); empty: every engine of
    the key."""

    def __post_init__(self) -> None:
        if len(self.targets) > MAX_TARGETS:
            raise EnvelopeError(f"a control names {len(self.targets)} targets, more than "
                                f"{MAX_TARGETS}")
        if any(not isinstance(t, str) or not t for t in self.targets):
            raise EnvelopeError("control targets must be non-empty engine ids")
        if self.action not in ACTIONS:
            raise EnvelopeError(f"control action {self.action!r} is not one of {ACTIONS}")
        if self.action == "pin" and (self.version is None or self.version < 1):
            raise EnvelopeError("a pin needs a version >= 1")
        if self.action == "force":
            if self.table is None or self.expires_at is None:
                raise EnvelopeError("a force needs a table and expires_at")
            try:
                expiry = datetime.fromisoformat(self.expires_at)
            except ValueError:
                raise EnvelopeError(f"expires_at {self.expires_at!r} is not an ISO-8601 "
                                    "time") from None
            if expiry.tzinfo is None:
                raise EnvelopeError(f"expires_at {self.expires_at!r} has no time zone")

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
        }
        if self.table is not None:
            out["table"] = self.table.to_vllm()
        if self.expires_at is not None:
            out["expires_at"] = self.expires_at
        if self.targets:
            out["targets"] = list(self.targets)
        if self.signature is not None:
            out["signature"] = {"key_id": self.signature.key_id,
                                "algorithm": self.signature.algorithm,
                                "mac": self.signature.mac_hex}
        return out

    def to_json(self) -> bytes:
        return canonical_json(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TableControl:
        try:
            key = data["key"]
            signature = data.get("signature")
            version = data.get("version")
            table = data.get("table")
            expires_at = data.get("expires_at")
            targets = data.get("targets", [])
            if not isinstance(targets, list):
                raise EnvelopeError("control targets must be a list of engine ids")
            return cls(
                key=TableKey(str(key["model"]), str(key["drafter"]), str(key["hardware"])),
                action=str(data["control"]),
                version=None if version is None else int(version),
                issued_at=str(data["issued_at"]),
                issued_by=str(data.get("issued_by", "operator")),
                signature=None if signature is None else Signature(
                    key_id=str(signature["key_id"]), mac_hex=str(signature["mac"]),
                    algorithm=str(signature.get("algorithm", "HMAC-SHA256"))),
                table=None if table is None else DraftTable.from_vllm(table),
                expires_at=None if expires_at is None else str(expires_at),
                targets=tuple(targets),
            )
        except KeyError as exc:
            raise EnvelopeError(f"control field {exc.args[0]!r} is missing") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise EnvelopeError(f"control is malformed ({exc})") from None

    def unsigned_payload(self) -> dict[str, Any]:
        payload = self.to_dict()
        payload.pop("signature", None)
        return payload

    def signed(self, key_id: str, secret: bytes) -> TableControl:
        mac = hmac_hex(secret, canonical_json(self.unsigned_payload()))
        return replace(self, signature=Signature(key_id=key_id, mac_hex=mac))

    def verify(self, keyring: Mapping[str, bytes]) -> None:
        verify_mac(self.signature, canonical_json(self.unsigned_payload()), keyring)


def parse_table_message(raw: bytes | str) -> Any:
    """A tables-topic value: a `TableEnvelope` or a `TableControl` (EnvelopeError if neither)."""
    from schemas.envelope import TableEnvelope

    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EnvelopeError(f"not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise EnvelopeError("a tables-topic message must be a JSON object")
    if "control" in data:
        return TableControl.from_dict(data)
    return TableEnvelope.from_dict(data)


__all__ = ["ACTIONS", "TableControl", "parse_table_message"]
