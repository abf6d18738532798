"""The table envelope: a draft table plus what it is for, where it came from, and a signature.

Envelopes travel on the tables topic as canonical JSON, keyed by `model|drafter|hardware`.
Canonical JSON (sorted keys, no whitespace, no NaN) makes the bytes a pure function of the
content, so an HMAC over them verifies on any machine and in any language.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from schemas.draft_table import DraftTable, TableError

ENVELOPE_FORMAT = 1
SIGNATURE_ALGORITHM = "HMAC-SHA256"
KEY_SEPARATOR = "|"


class EnvelopeError(ValueError):
    """An envelope that cannot be parsed; the message names the field."""


class SignatureError(ValueError):
    """An envelope whose signature is missing, unknown or wrong; `reason` is a stable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TableKey:
    """Which engines a table is for: the same model, drafter and hardware."""

    model: str
    drafter: str
    hardware: str

    def __post_init__(self) -> None:
        for name in ("model", "drafter", "hardware"):
            value = getattr(self, name)
            if not value or KEY_SEPARATOR in value:
                raise EnvelopeError(f"key.{name} {value!r} must be non-empty without '|'")

    def __str__(self) -> str:
        return KEY_SEPARATOR.join((self.model, self.drafter, self.hardware))

    @classmethod
    def parse(cls, text: str) -> TableKey:
        parts = text.split(KEY_SEPARATOR)
        if len(parts) != 3:
            raise EnvelopeError(f"table key {text!r} is not model|drafter|hardware")
        return cls(*parts)


@dataclass(frozen=True, slots=True)
class Signature:
    key_id: str
    mac_hex: str
    algorithm: str = SIGNATURE_ALGORITHM


@dataclass(frozen=True, slots=True)
class TableEnvelope:
    """A versioned, attributable, optionally signed draft table for one `TableKey`."""

    key: TableKey
    version: int
    """Strictly increasing per key; engines refuse a version not newer than theirs."""
    table: DraftTable
    startup_k_values: tuple[int, ...]
    """The K values the engine was started with; a table may only use these."""
    max_batch: int
    created_at: str
    """ISO-8601 UTC time of the fit."""
    provenance: Mapping[str, Any] = field(default_factory=dict)
    """What the table was fitted from: record counts, time range, offsets, fitter version."""
    predicted_goodput_tok_s: tuple[float, ...] = ()
    """Predicted goodput at batch sizes 1..max_batch under this table (empty: unknown)."""
    surface: Mapping[str, Any] = field(default_factory=dict)
    """Per-cell predictions and uncertainty (batch_sizes, k_values, goodput, stderr)."""
    exploration: Mapping[str, Any] = field(default_factory=dict)
    """Exploration plan for the controller (which K to try at which batch sizes)."""
    signature: Signature | None = None

    def __post_init__(self) -> None:
        if self.version < 1:
            raise EnvelopeError(f"version {self.version} must be >= 1")
        if self.predicted_goodput_tok_s and len(self.predicted_goodput_tok_s) != self.max_batch:
            raise EnvelopeError(
                f"predicted_goodput_tok_s has {len(self.predicted_goodput_tok_s)} values, "
                f"expected one per batch size 1..{self.max_batch}"
            )

    def validate(self) -> TableEnvelope:
        """The table is well formed for this envelope's limits and uses only startup K values."""
        self.table.validate(max(self.startup_k_values, default=0), self.max_batch)
        unknown = sorted(self.table.k_values - set(self.startup_k_values))
        if unknown:
            raise TableError(
                f"K values {unknown} are not in the engine's startup set "
                f"{sorted(self.startup_k_values)}"
            )
        return self

    def unsigned_payload(self) -> dict[str, Any]:
        payload = self.to_dict()
        payload.pop("signature", None)
        return payload

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": ENVELOPE_FORMAT,
            "key": {"model": self.key.model, "drafter": self.key.drafter,
                    "hardware": self.key.hardware},
            "version": self.version,
            "table": self.table.to_vllm(),
            "startup_k_values": list(self.startup_k_values),
            "max_batch": self.max_batch,
            "created_at": self.created_at,
            "provenance": dict(self.provenance),
            "predicted_goodput_tok_s": list(self.predicted_goodput_tok_s),
            "surface": dict(self.surface),
            "exploration": dict(self.exploration),
        }
        if self.signature is not None:
            out["signature"] = {
                "key_id": self.signature.key_id,
                "algorithm": self.signature.algorithm,
                "mac": self.signature.mac_hex,
            }
        return out

    def to_json(self) -> bytes:
        return canonical_json(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TableEnvelope:
        try:
            if data.get("format", ENVELOPE_FORMAT) != ENVELOPE_FORMAT:
                raise EnvelopeError(f"format {data.get('format')!r} is unknown")
            key = data["key"]
            signature = data.get("signature")
            return cls(
                key=TableKey(str(key["model"]), str(key["drafter"]), str(key["hardware"])),
                version=_int(data["version"], "version"),
                table=DraftTable.from_vllm(data["table"]),
                startup_k_values=tuple(_int(k, "startup_k_values") for k in
                                       data["startup_k_values"]),
                max_batch=_int(data["max_batch"], "max_batch"),
                created_at=str(data["created_at"]),
                provenance=dict(data.get("provenance", {})),
                predicted_goodput_tok_s=tuple(float(g) for g in
                                              data.get("predicted_goodput_tok_s", ())),
                surface=dict(data.get("surface", {})),
                exploration=dict(data.get("exploration", {})),
                signature=None if signature is None else Signature(
                    key_id=str(signature["key_id"]),
                    mac_hex=str(signature["mac"]),
                    algorithm=str(signature.get("algorithm", SIGNATURE_ALGORITHM)),
                ),
            )
        except KeyError as exc:
            raise EnvelopeError(f"envelope field {exc.args[0]!r} is missing") from None
        except (TypeError, AttributeError) as exc:
            raise EnvelopeError(f"envelope is malformed ({exc})") from None

    @classmethod
    def from_json(cls, raw: bytes | str) -> TableEnvelope:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EnvelopeError(f"envelope is not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise EnvelopeError("envelope JSON must be an object")
        return cls.from_dict(data)

    def signed(self, key_id: str, secret: bytes) -> TableEnvelope:
        mac = hmac_hex(secret, canonical_json(self.unsigned_payload()))
        return replace(self, signature=Signature(key_id=key_id, mac_hex=mac))

    def verify(self, keyring: Mapping[str, bytes]) -> None:
        """Raise `SignatureError` unless signed by a key in `keyring` (key id -> secret)."""
        verify_mac(self.signature, canonical_json(self.unsigned_payload()), keyring)


def hmac_hex(secret: bytes, payload: bytes) -> str:
    return hmac.new(secret, payload, hashlib.sha256).hexdigest()


def verify_mac(signature: Signature | None, payload: bytes,
               keyring: Mapping[str, bytes]) -> None:
    """Raise `SignatureError` unless `signature` is a valid HMAC of payload by a known key."""
    if signature is None:
        raise SignatureError("unsigned", "the message carries no signature")
    if signature.algorithm != SIGNATURE_ALGORITHM:
        raise SignatureError("bad_algorithm", f"algorithm {signature.algorithm!r}")
    secret = keyring.get(signature.key_id)
    if secret is None:
        raise SignatureError("unknown_key", f"key id {signature.key_id!r} is not known")
    if not hmac.compare_digest(hmac_hex(secret, payload), signature.mac_hex):
        raise SignatureError("bad_signature", "the MAC does not match the content")


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8, NaN refused: equal content gives equal bytes."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EnvelopeError(f"{name} must be an integer, got {value!r}")
    return value
