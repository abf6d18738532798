"""Per-request draft budgets: K by a request's prompt-lookup match length, per batch size.

A draft table gives one K to every request in a batch. An n-gram (prompt lookup) draft
says how good it is likely to be: the longer the n-gram it matched, the more of it the
target accepts. A budget gives, for each batch-size range, K for each match length:
`{"min_match": 1, "ranges": [[1, 32, [2, 7]], [33, 256, [0, 1, 4]]]}` reads "at batch
sizes 1-32, a 1-token match drafts 2 and a longer one 7; at 33-256, a 1-token match drafts
nothing, 2 tokens draft 1, longer ones 4". The last K of a list holds for longer matches,
and a request without a match drafts nothing, as in vLLM.

A budget travels with a draft table and stands beside it: an engine whose drafter reports
match lengths runs the budget, any other runs the table (which is also what vLLM's own
config takes), so each gets the best policy it can run. Forced steps (a profile, a probe)
run their forced K for everyone. Ranges cover 1..max_batch like a table's, and no K exceeds
the engine's startup maximum.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

from schemas.draft_table import MAX_TABLE_RANGES, DraftTable, TableError

MAX_MATCH_LENGTHS = 64
"""vLLM's prompt lookup matches a few tokens (prompt_lookup_max is single digits in
practice): a bound on what a parse builds per range."""

BudgetRange = tuple[int, int, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class DraftBudget:
    """K per match length (from `min_match` on) per inclusive batch-size range."""

    min_match: int
    ranges: tuple[BudgetRange, ...]

    @classmethod
    def from_json(cls, data: object) -> DraftBudget:
        """Parse the JSON form (shape checks only; see `validate`)."""
        if not isinstance(data, dict) or set(data) != {"min_match", "ranges"}:
            raise TableError('a budget is {"min_match": N, "ranges": [[start, end, [K, ...]], '
                             f"...]}}, got {reprlib.repr(data)}")
        min_match, ranges = data["min_match"], data["ranges"]
        if not _is_int(min_match) or min_match < 1:
            raise TableError(f"budget min_match {min_match!r} must be an integer >= 1")
        if not isinstance(ranges, list) or not ranges:
            raise TableError("budget ranges must be a non-empty list")
        if len(ranges) > MAX_TABLE_RANGES:
            raise TableError(f"a budget of {len(ranges)} ranges has more than "
                             f"{MAX_TABLE_RANGES} ranges")
        parsed: list[BudgetRange] = []
        for index, entry in enumerate(ranges):
            if (not isinstance(entry, list) or len(entry) != 3 or not _is_int(entry[0])
                    or not _is_int(entry[1]) or not isinstance(entry[2], list)):
                raise TableError(f"budget range {index} is {reprlib.repr(entry)}, expected "
                                 "[start, end, [K, ...]]")
            ks = entry[2]
            if not ks or len(ks) > MAX_MATCH_LENGTHS or not all(_is_int(k) for k in ks):
                raise TableError(f"budget range {index}: K by match length must be 1 to "
                                 f"{MAX_MATCH_LENGTHS} integers, got {reprlib.repr(ks)}")
            parsed.append((entry[0], entry[1], tuple(ks)))
        return cls(min_match, tuple(parsed))

    def to_json(self) -> dict[str, Any]:
        return {"min_match": self.min_match,
                "ranges": [[start, end, list(ks)] for start, end, ks in self.ranges]}

    def validate(self, max_k: int, max_batch: int) -> DraftBudget:
        """Ranges cover 1..max_batch without gaps or overlaps, every K in 0..max_k; returns
        self so calls chain."""
        DraftTable.from_vllm([[start, end, 0] for start, end, _ in self.ranges]).validate(
            0, max_batch)
        for start, end, ks in self.ranges:
            for k in ks:
                if not 0 <= k <= max_k:
                    raise TableError(f"budget range [{start}, {end}]: K {k} is outside "
                                     f"0..{max_k} (the engine's max K)")
        return self

    def k_by_match(self, batch_size: int, max_match: int) -> tuple[int, ...]:
        """K for match lengths 0..max_match at one batch size (0 below `min_match`: no
        match, no draft); past the last range the last one holds, as in a table."""
        chosen = self.ranges[0][2]
        for start, _, ks in self.ranges:
            if start > batch_size:
                break
            chosen = ks
        return tuple(0 if length < self.min_match
                     else chosen[min(length - self.min_match, len(chosen) - 1)]
                     for length in range(max_match + 1))

    def to_dense(self, max_batch: int, max_match: int) -> tuple[tuple[int, ...], ...]:
        """K by (batch size, match length) for batch sizes 1..max_batch and lengths
        0..max_match; index 0 of the batch size unused, as in `DraftTable.to_dense`."""
        return ((),) + tuple(self.k_by_match(size, max_match)
                             for size in range(1, max_batch + 1))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
