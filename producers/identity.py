"""Who is speaking: the engine id and the table key fields stamped on every record."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    engine_id: str
    model: str
    drafter: str
    hardware: str


def default_engine_id(environ: Mapping[str, str] | None = None) -> str:
    """TABLETUNE_ENGINE_ID, else hostname-pid (unique per engine process on a host)."""
    env = os.environ if environ is None else environ
    return env.get("TABLETUNE_ENGINE_ID") or f"{socket.gethostname()}-{os.getpid()}"
