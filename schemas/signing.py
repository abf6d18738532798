"""Ed25519 keys and signatures for tables-topic messages (RFC 8032, via `cryptography`).

Asymmetric on purpose: the control service and operators hold private keys
(TABLETUNE_SIGNING_KEY), engines hold only public keys (TABLETUNE_VERIFY_KEYS). With a
shared secret (an HMAC), every engine pod would hold the secret that signs, so anything that
could verify a table could forge one. Keys are written as base64 (or hex) of their 32 raw bytes;
a signature is 64 bytes, written as 128 hex digits.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

ALGORITHM = "Ed25519"
REFUSED_ALGORITHMS = {"HMAC-SHA256": "HMAC-SHA256 signatures are no longer accepted: any "
                      "holder of an HMAC secret can sign, engines included; tables and "
                      "controls are signed with Ed25519 (issue them again with a key from "
                      "`tabletune keygen`)"}
"""Algorithms of earlier releases, each with why it is refused."""
KEY_BYTES = 32
SIGNATURE_BYTES = 64

Keyring = Mapping[str, Ed25519PublicKey]
"""Key id -> the public key that verifies its signatures."""

_PLACEHOLDER = re.compile(r"(^|[:,=\s])change-?me", re.IGNORECASE)


class KeyFormatError(ValueError):
    """Text that is not a 32-byte key in base64 or hex."""


def generate_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def private_key_text(key: Ed25519PrivateKey) -> str:
    """The 32-byte seed as base64: what TABLETUNE_SIGNING_KEY holds."""
    raw = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    return base64.b64encode(raw).decode()


def public_key_text(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """The 32-byte public key as base64: what TABLETUNE_VERIFY_KEYS lists."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return base64.b64encode(public.public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def load_private_key(text: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(_key_bytes(text, "private"))


def load_public_key(text: str) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(_key_bytes(text, "public"))


def sign_hex(key: Ed25519PrivateKey, payload: bytes) -> str:
    return key.sign(payload).hex()


def signature_matches(key: Ed25519PublicKey, payload: bytes, signature_hex: str) -> bool:
    """Whether `signature_hex` is `key`'s signature of `payload` (False if malformed)."""
    try:
        signature = bytes.fromhex(signature_hex)
    except ValueError:
        return False
    if len(signature) != SIGNATURE_BYTES:
        return False
    try:
        key.verify(signature, payload)
    except InvalidSignature:
        return False
    return True


def is_placeholder(value: str) -> bool:
    """Whether `value` still holds an example manifest's `change-me...` placeholder."""
    return bool(_PLACEHOLDER.search(value))


def _key_bytes(text: str, kind: str) -> bytes:
    value = text.strip()
    raw: bytes | None = None
    if re.fullmatch(r"[0-9a-fA-F]{64}", value):
        raw = bytes.fromhex(value)
    else:
        try:
            raw = base64.b64decode(value + "=" * (-len(value) % 4),
                                   altchars=b"-_" if "-" in value or "_" in value else None,
                                   validate=True)
        except (binascii.Error, ValueError):
            raw = None
    if raw is None or len(raw) != KEY_BYTES:
        raise KeyFormatError(f"not an Ed25519 {kind} key: expected {KEY_BYTES} bytes as "
                             "base64 or hex (`tabletune keygen` makes a pair)")
    return raw


__all__ = ["ALGORITHM", "KeyFormatError", "Keyring", "REFUSED_ALGORITHMS", "generate_private_key",
           "is_placeholder", "load_private_key", "load_public_key", "private_key_text",
           "public_key_text", "sign_hex", "signature_matches"]
