"""Shared bits of the benchmarks: machine description and result writing."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cores": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "date": dt.date.today().isoformat()}


def emit(name: str, result: dict[str, Any], out_dir: str | None) -> None:
    """Print the JSON result and, with --out, write it next to a markdown table."""
    payload = {"benchmark": name, "machine": machine(), **result}
    text = json.dumps(payload, indent=2)
    print(text)
    if out_dir:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{name}.json").write_text(text + "\n")
