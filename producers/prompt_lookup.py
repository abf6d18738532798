"""Prompt lookup (n-gram drafting) as vLLM 0.32 does it, with the match length it hides.

vLLM's n-gram proposer (`vllm.v1.spec_decode.ngram_proposer`) finds the longest n-gram of
`min_n`..`max_n` tokens that ends the request's tokens and occurred earlier, takes its
earliest occurrence, and proposes the up to K tokens that followed it. It returns the draft
only; how long the matched n-gram was is what predicts how much of the draft the target
accepts, so per-request budgets need it. This is the same search, in plain numpy, returning
both: the engine side's proposer and the twin draft with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray


@dataclass(frozen=True, slots=True)
class Lookup:
    draft: NDArray[np.int64]
    """The proposed tokens (empty without a match)."""
    match_length: int
    """Tokens of the n-gram matched (0 without a match)."""


NO_MATCH = Lookup(np.zeros(0, dtype=np.int64), 0)


def prompt_lookup(tokens: NDArray[np.integer], *, min_n: int, max_n: int, k: int,
                  max_model_len: int | None = None) -> Lookup:
    """The draft vLLM's n-gram proposer makes for a request whose tokens so far (prompt and
    output) are `tokens`, and the length of the n-gram it matched.

    The longest suffix of `min_n`..`max_n` tokens wins; of its occurrences that end before
    the last token, the earliest; the draft is what followed it, at most `k` tokens and never
    past `max_model_len` in all.
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    seq = np.asarray(tokens)
    total = seq.shape[0]
    if max_model_len is not None:
        k = min(k, max_model_len - total)
    if total < min_n or k <= 0:
        return NO_MATCH
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # windows starting at 0..total-1-n end at or before the second-to-last token
        windows = np.lib.stride_tricks.sliding_window_view(seq[:total - 1], n)
        hits = np.flatnonzero((windows == seq[total - n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return Lookup(seq[start:start + min(k, total - start)].astype(np.int64), n)
    return NO_MATCH


class PromptLookupIndex:
    """One request's n-grams, each at its earliest occurrence, kept as its tokens arrive.

    `prompt_lookup` scans the whole sequence on every call; a request that drafts at every
    step would make that quadratic in its length. Here each new token indexes the
    `max_n - min_n + 1` n-grams it completes, and a lookup is as many dictionary probes.
    It returns exactly what `prompt_lookup` does on the same tokens.
    """

    __slots__ = ("min_n", "max_n", "_tokens", "_indexed", "_first")

    def __init__(self, *, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._tokens: list[int] = []
        self._indexed = 0
        """n-grams ending before token `_indexed` are in `_first`."""
        self._first: dict[tuple[int, ...], int] = {}
        """n-gram -> the index of the token that followed its earliest occurrence."""

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        self._tokens.extend(int(token) for token in tokens)

    def lookup(self, k: int, *, max_model_len: int | None = None) -> Lookup:
        """The draft and match length `prompt_lookup` gives for the tokens so far."""
        seq = self._tokens
        total = len(seq)
        if max_model_len is not None:
            k = min(k, max_model_len - total)
        if total < self.min_n or k <= 0:
            return NO_MATCH
        self._index_up_to(total - 1)  # occurrences end at or before the second-to-last token
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            start = self._first.get(tuple(seq[total - n:]))
            if start is not None:
                return Lookup(np.array(seq[start:start + min(k, total - start)],
                                       dtype=np.int64), n)
        return NO_MATCH

    def _index_up_to(self, end: int) -> None:
        seq, first = self._tokens, self._first
        for stop in range(self._indexed + 1, end + 1):  # the n-grams ending at token stop - 1
            for n in range(self.min_n, min(self.max_n, stop) + 1):
                first.setdefault(tuple(seq[stop - n:stop]), stop)
        self._indexed = max(self._indexed, end)
