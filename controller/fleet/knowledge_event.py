"""A key's latency knowledge as a `latency_knowledge` event on the status topic, and back.

Engines write the status topic too, so with signing keys configured the event is signed
like a control (the service's Ed25519 key over the key, the clock and the cells) and a
reader that holds verify keys takes only a signed one: a compromised engine cannot plant
step times in a fit. Without keys, as tables and controls, anything on the topic is taken.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fitter.surface.latency_memory import LatencyCells
from schemas import EnvelopeError, TableKey
from schemas.settings import Settings
from schemas.signing import Keyring, sign_hex, signature_matches

EVENT = "latency_knowledge"
QUOTED_CHARS = 80
"""What an error quotes of a field at most: the topic is not ours alone."""


def knowledge_fields(settings: Settings | None, table_key: str, clock_s: float,
                     cells: LatencyCells) -> dict[str, Any]:
    """The event's fields (signed when `settings` holds a signing key)."""
    fields: dict[str, Any] = {"clock_s": round(clock_s, 3), "cells": cells.to_json()}
    if settings is not None and settings.signing_key is not None:
        fields["key_id"] = settings.signing_key_id
        fields["signature"] = sign_hex(settings.signing_key,
                                       _signed_bytes(table_key, fields["clock_s"],
                                                     fields["cells"]))
    return fields


def read_knowledge(event: dict[str, Any],
                   keyring: Keyring) -> tuple[TableKey, float, LatencyCells]:
    """(key, telemetry time, cells) of a `latency_knowledge` event; ValueError naming what
    is wrong, an unsigned or badly signed event included where `keyring` holds keys."""
    try:
        text = event["table_key"]
        key = TableKey.parse(str(text))
        clock_s = float(event["clock_s"])
    except KeyError as exc:
        raise ValueError(f"no {exc}") from None
    except (TypeError, ValueError, OverflowError, EnvelopeError) as exc:
        raise ValueError(str(exc)[:QUOTED_CHARS]) from None
    if not math.isfinite(clock_s):
        raise ValueError(f"clock_s {clock_s} is not finite")
    if keyring:
        key_id, signature = event.get("key_id"), event.get("signature")
        public = keyring.get(key_id) if isinstance(key_id, str) else None
        if public is None or not isinstance(signature, str) or not signature_matches(
                public, _signed_bytes(str(text), event["clock_s"], event.get("cells")),
                signature):
            raise ValueError(f"not signed by a known key (key_id {str(key_id)[:QUOTED_CHARS]!r})")
    return key, clock_s, LatencyCells.from_json(event.get("cells"))


def _signed_bytes(table_key: str, clock_s: Any, cells: Any) -> bytes:
    """What the signature covers: one canonical JSON text (floats round-trip exactly)."""
    return json.dumps([EVENT, table_key, clock_s, cells], sort_keys=True,
                      separators=(",", ":")).encode()
