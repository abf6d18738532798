"""How much forcing a one-engine key's re-profiles may still take: a share of a sliding span.

A key with one engine has no canary: every forced second is a second of all its traffic at
a K the table did not choose. The budget keeps the seconds its probe blocks took and grants a
new block only what is left of `share` over the last `FORCED_WINDOW_S`.
"""

from __future__ import annotations

from collections import deque

FORCED_WINDOW_S = 600.0
"""The span the share is counted over: ten minutes, the window a one-engine key's forced
steps are judged over (docs/TUNING.md)."""

MIN_PROBE_S = 1.0
"""A block the budget would cut shorter than this is not run: too few steps to fit."""


class ForcedBudget:
    def __init__(self, share: float, window_s: float = FORCED_WINDOW_S) -> None:
        self.share = share
        self.window_s = window_s
        self._spent: deque[tuple[float, float]] = deque()
        """(start s, length s) of each block granted, oldest first."""

    def left(self, start_s: float) -> float:
        """Seconds a block from `start_s` could still be granted, spending none."""
        spent = sum(length for begun_s, length in self._spent
                    if begun_s + length > start_s - self.window_s)
        return max(0.0, self.share * self.window_s - spent)

    def grant(self, start_s: float, want_s: float) -> float:
        """Seconds of forcing from `start_s`, at most `want_s` and within the share of every
        window that holds them (0: none now); granted seconds count as spent."""
        while self._spent and self._spent[0][0] + self._spent[0][1] <= start_s - self.window_s:
            self._spent.popleft()  # out of every window from here on
        granted = min(want_s, self.left(start_s))
        if granted < MIN_PROBE_S:
            return 0.0
        self._spent.append((start_s, granted))
        return granted
