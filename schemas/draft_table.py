"""The draft-length table: batch size -> K, as inclusive ranges.

The canonical form is vLLM's: `[(start, end, K), ...]`, sorted, non-overlapping, starting at 1
(`SpeculativeConfig.num_speculative_tokens_per_batch_size`). TableTune's own tables are
stricter than vLLM's: they cover every batch size 1..max_batch without gaps, so a reader
never has to know vLLM's gap-filling rule to know which K applies.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class TableError(ValueError):
    """A table that TableTune refuses; the message names the offending entry."""


Range = tuple[int, int, int]
MAX_TABLE_RANGES = 1024
"""A table changes K a handful of times over its batch sizes, and vLLM scans the ranges on
each lookup: a bound on what a parse builds."""


def _check_range_count(count: int) -> None:
    if count > MAX_TABLE_RANGES:
        raise TableError(f"a table of {count} ranges has more than {MAX_TABLE_RANGES} ranges")


@dataclass(frozen=True, slots=True)
class DraftTable:
    """Inclusive ranges `(start, end, K)`; construct through `from_vllm` or `from_dense`."""

    ranges: tuple[Range, ...]

    def __post_init__(self) -> None:
        _check_range_count(len(self.ranges))

    @classmethod
    def from_vllm(cls, triples: object) -> DraftTable:
        """Parse vLLM's list of `[start, end, K]` (shape checks only; see `validate`); the
        count is checked before any entry is."""
        if not isinstance(triples, list | tuple) or not triples:
            raise TableError("a table is a non-empty list of [start, end, K] triples")
        _check_range_count(len(triples))
        parsed: list[Range] = []
        for index, entry in enumerate(triples):
            if not isinstance(entry, list | tuple) or len(entry) != 3:
                raise TableError(f"entry {index} is {reprlib.repr(entry)}, expected [start, end, K]")
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in entry):
                raise TableError(f"entry {index} is {reprlib.repr(entry)}, expected three "
                                "integers")
            parsed.append((entry[0], entry[1], entry[2]))
        return cls(tuple(parsed))

    @classmethod
    def from_dense(cls, k_by_batch_size: Sequence[int]) -> DraftTable:
        """Merge a dense lookup (index = batch size, index 0 unused) into the fewest ranges."""
        if len(k_by_batch_size) < 2:
            raise TableError("a dense table needs at least batch size 1 (length >= 2)")
        ranges: list[Range] = []
        for batch_size in range(1, len(k_by_batch_size)):
            k = int(k_by_batch_size[batch_size])
            if ranges and ranges[-1][2] == k:
                start, _, _ = ranges[-1]
                ranges[-1] = (start, batch_size, k)
            else:
                ranges.append((batch_size, batch_size, k))
        return cls(tuple(ranges))

    @property
    def max_batch(self) -> int:
        return max(end for _, end, _ in self.ranges)

    @property
    def k_values(self) -> frozenset[int]:
        return frozenset(k for _, _, k in self.ranges)

    def validate(self, max_k: int, max_batch: int) -> DraftTable:
        """Check the table against an engine's limits; returns self so calls chain.

        `max_k` is the engine's startup `num_speculative_tokens` (a table may only lower K)
        and `max_batch` its `max_num_seqs`: every batch size 1..max_batch must have exactly
        one range.
        """
        if not self.ranges:
            raise TableError("the table is empty")
        expected_start = 1
        for start, end, k in self.ranges:
            entry = f"[{start}, {end}, {k}]"
            if start < 1 or end < 1:
                raise TableError(f"range {entry}: batch sizes start at 1")
            if start > end:
                raise TableError(f"range {entry}: start {start} is after end {end}")
            if k < 0:
                raise TableError(f"range {entry}: K {k} is negative")
            if k > max_k:
                raise TableError(f"range {entry}: K {k} exceeds the engine's max K {max_k}")
            if expected_start == 1 and start != 1:
                raise TableError(f"range {entry}: the first range must start at 1")
            if start < expected_start:
                raise TableError(
                    f"range {entry}: overlaps or is out of order (batch sizes up to "
                    f"{expected_start - 1} are already covered)"
                )
            if start > expected_start:
                raise TableError(
                    f"range {entry}: gap, batch sizes {expected_start}..{start - 1} have no K"
                )
            expected_start = end + 1
        if expected_start - 1 < max_batch:
            raise TableError(
                f"the table ends at batch size {expected_start - 1}, "
                f"it must cover up to max batch {max_batch}"
            )
        return self

    def k_for(self, batch_size: int) -> int:
        """K for one batch size, with vLLM's rule for gaps and the tail (previous K)."""
        chosen = self.ranges[0][2]
        for start, _, k in self.ranges:
            if start > batch_size:
                break
            chosen = k
        return chosen

    def to_vllm(self) -> list[list[int]]:
        """`num_speculative_tokens_per_batch_size` as vLLM's config takes it (JSON-ready)."""
        return [[start, end, k] for start, end, k in self.ranges]

    def to_dense(self, max_batch: int) -> list[int]:
        """Lookup with index = batch size, index 0 unused (vLLM's dense schedule layout)."""
        dense = [0] * (max_batch + 1)
        for batch_size in range(1, max_batch + 1):
            dense[batch_size] = self.k_for(batch_size)
        return dense

    def to_trtllm(self) -> dict[int, int]:
        """TensorRT-LLM's `draft_len_schedule`: key = last batch size of a range, value = K.

        TensorRT-LLM reads `{4: 4, 8: 2}` as "batch 1-4 -> 4, 5-8 -> 2, above 8 -> 0", so the
        keys are the inclusive range ends and equal neighbours are merged first.
        """
        merged = DraftTable.from_dense(self.to_dense(self.max_batch))
        return {end: k for _, end, k in merged.ranges}

    @classmethod
    def from_trtllm(cls, schedule: Mapping[int, int]) -> DraftTable:
        """Inverse of `to_trtllm` (batch sizes above the last key are left out, not 0)."""
        triples: list[list[int]] = []
        start = 1
        for end, k in sorted((int(e), int(v)) for e, v in schedule.items()):
            triples.append([start, end, k])
            start = end + 1
        return cls.from_vllm(triples)

