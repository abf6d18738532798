"""Shared bits of the benchmarks: result writing (the machine description is the suite's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tabletune.suite.machine import machine


def emit(name: str, result: dict[str, Any], out_dir: str | None) -> None:
    """Print the JSON result and, with --out, write it next to a markdown table."""
    payload = {"benchmark": name, "machine": machine(), **result}
    text = json.dumps(payload, indent=2)
    print(text)
    if out_dir:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{name}.json").write_text(text + "\n")
