"""The closed loop's decisions: what it decided for a key, when, and the figures behind it.

Every decision is kept (benchmarks, tests and audits read them) and logged at INFO as it is
taken, the whole `Decision` on the record's `decision` attribute: `tabletune control
--decisions FILE` writes those as JSON lines (`controller.fleet.decision_log`), which
`Decision.from_dict` reads back.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class What(enum.StrEnum):
    """The kind of a decision; its value is the `what` of the log line and the JSON line
    (keep, inconclusive and roll_back are the guardrail's `Verdict` values)."""

    RESUME = "resume"
    PROFILE = "profile"
    PROFILE_EXTENDED = "profile_extended"
    REPROFILE = "reprofile"
    REPROFILE_RESTARTED = "reprofile_restarted"
    REPROFILE_ABANDONED = "reprofile_abandoned"
    SETTLE_REFIT = "settle_refit"
    PROBE_NEIGHBOURS = "probe_neighbours"
    CONFIRM = "confirm"
    INTERIM = "interim"
    REFIT = "refit"
    FIT_FAILED = "fit_failed"
    UNWATCHED = "unwatched"
    STAGE = "stage"
    STALE = "stale"
    LATENCY_FORGOTTEN = "latency_forgotten"
    RECALL = "recall"
    ROLL_BACK = "roll_back"
    KEEP = "keep"
    INCONCLUSIVE = "inconclusive"
    OPERATOR = "operator"
    OPERATOR_CONTROL_IGNORED = "operator_control_ignored"


@dataclass(frozen=True)
class Decision:
    key: str
    """The table key, as its string."""
    t_s: float
    """Telemetry time, rounded to the millisecond."""
    what: What
    fields: Mapping[str, Any] = field(default_factory=dict)
    """The figures behind it, in the order they were given (versions, gains, evidence)."""

    def entry(self) -> dict[str, Any]:
        """t_s, what, then the fields: the decision as the loop took it."""
        return {"t_s": self.t_s, "what": self.what.value, **self.fields}

    def to_dict(self) -> dict[str, Any]:
        """The JSON line's object: the key, then the entry."""
        return {"key": self.key, **self.entry()}

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any]) -> Decision:
        """A decision read back from its JSON line."""
        fields = dict(entry)
        key, t_s, what = fields.pop("key"), fields.pop("t_s"), What(fields.pop("what"))
        return cls(key, t_s, what, fields)


class DecisionLog:
    """One key's decisions, in the order taken, each logged on `log` as it is taken."""

    def __init__(self, key: str, log: logging.Logger) -> None:
        self.key = key
        self.log = log
        self.taken: list[Decision] = []

    def note(self, now_s: float, what: What, **fields: Any) -> None:
        decision = Decision(self.key, round(now_s, 3), what, fields)
        self.taken.append(decision)
        if self.log.isEnabledFor(logging.INFO):
            self.log.info("%s: %s at %.1f s %s", self.key, what, now_s, fields,
                          extra={"decision": decision})
