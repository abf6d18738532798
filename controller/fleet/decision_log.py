"""`tabletune control --decisions FILE`: each loop decision appended to FILE as it is taken.

The loop logs every decision at INFO with the whole of it on the record
(`controller.fleet.decisions.DecisionLog`); a stdlib `FileHandler` with this formatter writes
those as JSON lines and flushes each, so a service killed with -9 leaves every decision it
took before the kill, and a reader can follow the file while it runs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path


class DecisionFormatter(logging.Formatter):
    """A record's `decision` attribute as one JSON object."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(record.decision.to_dict(), default=str)  # type: ignore[attr-defined]


def decision_file_handler(path: str | Path) -> logging.FileHandler:
    """A handler that writes only the records carrying a decision, to `path` (created now,
    so a path that cannot be written fails before the service runs)."""
    handler = logging.FileHandler(path, mode="w", encoding="utf-8")
    handler.setFormatter(DecisionFormatter())
    handler.addFilter(lambda record: hasattr(record, "decision"))
    return handler
