"""Steps one engine id sent in two different records, as the closed loop's fits meet them:
left out of every fit (`fitter.step_conflicts`), counted once, and said on the status topic.

A step stays in the fit window for many refits; each is counted and reported the first time
a fit meets it, so an attack that goes on is reported as it goes on, one that stopped is not
repeated every refit.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pyarrow as pa

from controller.status import StatusPublisher
from fitter.engine_consensus import SHOWN_ENGINES
from fitter.step_conflicts import drop_conflicts

log = logging.getLogger(__name__)


class ConflictWatch:
    def __init__(self, status: StatusPublisher) -> None:
        self.status = status
        self.steps: Counter[str] = Counter()
        """Engine id -> its conflicting steps met since the loop started, each once."""
        self._newest: dict[str, int] = {}
        """Engine id -> the newest of its conflicting steps already counted."""

    def screen(self, records: pa.Table) -> pa.Table:
        """`records` with every copy of a conflicting step left out (exact copies kept once);
        conflicting steps newer than those already counted are counted, logged and named in
        a `conflict` status event."""
        kept, conflicts = drop_conflicts(records)
        new = conflicts.after(self._newest)
        if len(new):
            self._newest.update(new.newest())
            self.steps.update(new.steps)
            fields = new.to_dict()
            log.warning("%s: left out %d steps sent in two or more different records under "
                        "one engine id, by engine id: %s", self.status.table_key,
                        fields["steps"], fields["engines"])
            self.status.emit("conflict", **fields)
        return kept

    def to_dict(self) -> dict[str, Any]:
        """The counts for the service's summary (the engines with the most first, bounded)."""
        return {"steps": self.steps.total(),
                "engines": dict(self.steps.most_common(SHOWN_ENGINES)),
                "engine_count": len(self.steps)}
