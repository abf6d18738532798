"""What a figure was measured on: cores, CPU model, Python, date."""

from __future__ import annotations

import datetime as dt
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


def describe(info: dict[str, Any]) -> str:
    """`2 cores, AMD EPYC, Python 3.11.7` from a `machine()` dict (or a bench JSON's)."""
    parts = [f"{info.get('cores', '?')} cores", str(info.get("cpu", "unknown CPU"))]
    if info.get("python"):
        parts.append(f"Python {info['python']}")
    return ", ".join(parts)
