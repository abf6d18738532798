"""Operator commands that travel on the tables topic beside the envelopes they refer to.

`pin` holds engines on one version, `unpin` releases them, `rollback` moves them back to the
version before the active one. Keeping commands in the same keyed log as the tables means an
engine that reads the log from the beginning folds to the same state as one that followed it
live, with no second channel to keep consistent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from schemas.envelope import (
    EnvelopeError,
    Signature,
    TableKey,
    canonical_json,
    hmac_hex,
    verify_mac,
)

ACTIONS = ("pin", "unpin", "rollback")


@dataclass(frozen=True, slots=True)
class TableControl:
    key: TableKey
    action: str
    version: int | None
    """Target version for `pin` (and the version rolled back to, once resolved)."""
    issued_at: str
    issued_by: str = "operator"
    signature: Signature | None = None

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise EnvelopeError(f"control action {self.action!r} is not one of {ACTIONS}")
        if self.action == "pin" and (self.version is None or self.version < 1):
            raise EnvelopeError("a pin needs a version >= 1")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "control": self.action,
            "key": {"model": self.key.model, "drafter": self.key.drafter,
                    "hardware": self.key.hardware},
            "version": self.version, "issued_at": self.issued_at, "issued_by": self.issued_by,
        }
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
            return cls(
                key=TableKey(str(key["model"]), str(key["drafter"]), str(key["hardware"])),
                action=str(data["control"]),
                version=None if version is None else int(version),
                issued_at=str(data["issued_at"]),
                issued_by=str(data.get("issued_by", "operator")),
                signature=None if signature is None else Signature(
                    key_id=str(signature["key_id"]), mac_hex=str(signature["mac"]),
                    algorithm=str(signature.get("algorithm", "HMAC-SHA256"))),
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
