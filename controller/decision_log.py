"""`tabletune control --decisions FILE`: each loop decision appended to FILE as it is taken.

The loop logs every decision at INFO with the whole of it on the record (`ClosedLoop._note`);
this handler writes those as JSON lines and flushes each, so a service killed with -9 leaves
every decision it took before the kill, and a reader can follow the file while it runs.
"""

from __future__ import annotations

import json
import logging
from typing import TextIO


class DecisionWriter(logging.Handler):
    """Writes the `decision` attribute of each record it gets, one JSON object a line."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(level=logging.INFO)
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        decision = getattr(record, "decision", None)
        if decision is None:
            return
        try:
            self.stream.write(json.dumps(decision, default=str) + "\n")
            self.stream.flush()
        except OSError:  # a full disk must not stop the service; the log line still shows it
            self.handleError(record)

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            super().close()
