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


def drafter_name(method: str, model: str | None, *, tabletune_proposer: bool = False) -> str:
    """The table key's drafter: vLLM's speculative method, with the draft model's folder
    name where the drafter has a model. TableTune's n-gram proposer (a `custom_class`) is
    `ngram`: it drafts as vLLM's n-gram does, so it shares n-gram keys."""
    if method == "custom_class":
        return "ngram" if tabletune_proposer else f"custom_class:{model}"
    if model and method not in ("ngram", "suffix"):
        return f"{method}:{os.path.basename(str(model).rstrip('/'))}"
    return method
