"""What a profile sweep produces, whichever engine it ran on: the result, its table and errors.

Shared by the twin sweep (`tabletune.profile`) and the vLLM server sweep
(`tabletune.profile_openai`), so that both derive and write their tables the same way.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fitter.derive import derive_envelope
from fitter.records import Records
from fitter.surface.fit import fit_surface
from schemas import TableEnvelope, TableKey
from tabletune.profile_twin import CellRun


class ProfileError(ValueError):
    """A profile request that cannot run; the message names the problem."""


@dataclasses.dataclass
class ProfileResult:
    """What a sweep produced: the table envelope and how it was measured."""

    envelope: TableEnvelope
    cells: list[CellRun]
    engine_time_s: float
    wall_s: float
    records: int
    path: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"table": self.envelope.table.to_vllm(), "version": self.envelope.version,
                "key": str(self.envelope.key), "engine_time_s": round(self.engine_time_s, 3),
                "wall_s": round(self.wall_s, 3), "records": self.records,
                "cells": [c.to_dict() for c in self.cells],
                "path": str(self.path) if self.path else None}



def envelope_from_records(records: Records, *, key: TableKey, max_k: int, max_batch: int,
                          startup_k_values: Sequence[int], version: int, tolerance: float,
                          provenance: dict[str, Any]) -> TableEnvelope:
    """Fit all profile steps with equal weight (they are all equally recent) and derive.

    Same estimators and derivation as a refit, so a profiled and a refitted table differ
    only by their data. The table is derived at the context per request the profile saw at
    each batch size (`fitter.surface.telemetry.context_by_batch`).
    """
    fit = fit_surface(records, max_k=max_k, max_batch=max_batch, half_life_s=None)
    return derive_envelope(fit, key=key, version=version, max_k=max_k, max_batch=max_batch,
                           startup_k_values=startup_k_values, tolerance=tolerance,
                           provenance=provenance)


def write_table(envelope: TableEnvelope, out_dir: str | Path) -> Path:
    """`out_dir/table.json`: the envelope, vLLM triples under `table`."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "table.json"
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(envelope.to_dict(), indent=2, sort_keys=True) + "\n")
    temporary.replace(path)
    return path
