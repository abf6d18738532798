"""A key's latency knowledge and regimes as a `latency_knowledge` event on the status
topic, and back: what the next owner of the key (a restart, a takeover) begins from.

Engines write the status topic too, so with signing keys configured the event is signed
like a control (the service's Ed25519 key over the key, the clock and the cells) and a
reader that holds verify keys takes only a signed one: a compromised engine cannot plant
step times in a fit. Without keys, as tables and controls, anything on the topic is taken.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from controller.fleet.regimes import MAX_REGIMES, Regime
from fitter.surface.latency_memory import LatencyCells
from schemas import EnvelopeError, TableKey
from schemas.settings import Settings
from schemas.signing import Keyring, sign_hex, signature_matches

EVENT = "latency_knowledge"
QUOTED_CHARS = 80
"""What an error quotes of a field at most: the topic is not ours alone."""


@dataclass(frozen=True, slots=True)
class KeyMemory:
    """What a key's owner measured, as it last published it."""

    key: TableKey
    clock_s: float
    """The key's telemetry time when published: the newest wins."""
    cells: LatencyCells
    regimes: tuple[Regime, ...]
    """Least recently used first, without their records (`Regime.from_json`)."""


def knowledge_fields(settings: Settings | None, table_key: str, clock_s: float,
                     cells: LatencyCells, regimes: list[Regime]) -> dict[str, Any]:
    """The event's fields (signed when `settings` holds a signing key). A regime whose
    refit published no version is left out: nothing could be sent again for it."""
    fields: dict[str, Any] = {"clock_s": round(clock_s, 3), "cells": cells.to_json(),
                              "regimes": [r.to_json() for r in regimes
                                          if r.version is not None]}
    if settings is not None and settings.signing_key is not None:
        fields["key_id"] = settings.signing_key_id
        fields["signature"] = sign_hex(settings.signing_key, _signed_bytes(
            table_key, fields["clock_s"], fields["cells"], fields["regimes"]))
    return fields


def read_knowledge(event: dict[str, Any], keyring: Keyring) -> KeyMemory:
    """The key's memory in a `latency_knowledge` event; ValueError naming what is wrong,
    an unsigned or badly signed event included where `keyring` holds keys."""
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
                public, _signed_bytes(str(text), event["clock_s"], event.get("cells"),
                                      event.get("regimes", [])),
                signature):
            raise ValueError(f"not signed by a known key (key_id {str(key_id)[:QUOTED_CHARS]!r})")
    regimes = event.get("regimes", [])
    if not isinstance(regimes, list) or len(regimes) > MAX_REGIMES:
        raise ValueError(f"regimes: not a list of at most {MAX_REGIMES}")
    return KeyMemory(key, clock_s, LatencyCells.from_json(event.get("cells")),
                     tuple(Regime.from_json(r) for r in regimes))


def _signed_bytes(table_key: str, clock_s: Any, cells: Any, regimes: Any) -> bytes:
    """What the signature covers: one canonical JSON text (floats round-trip exactly)."""
    return json.dumps([EVENT, table_key, clock_s, cells, regimes], sort_keys=True,
                      separators=(",", ":")).encode()
