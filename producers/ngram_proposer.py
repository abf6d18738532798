"""TableTune's n-gram proposer for vLLM: prompt lookup that knows each draft's match length.

Attach it with `speculative_config={"method": "custom_class", "model":
"producers.ngram_proposer.TableTuneNgramProposer", "num_speculative_tokens": K, ...}`.
It drafts exactly as vLLM's n-gram proposer does (the longest suffix n-gram of `min_n`..
`max_n` tokens, its earliest earlier occurrence, the tokens that followed). With the
scheduler hook attached it marks each draft with its match length, and the hook cuts it to
the live budget's K for that length, or to the table's K (producers/proposer_link.py).
Without the hook it drafts `num_speculative_tokens`: vLLM does not pass a custom proposer
the table's K. vLLM sets `prompt_lookup_min/max` to 0 for a custom class, so the range
comes from TABLETUNE_PROMPT_LOOKUP_MIN / _MAX (vLLM's rule: one of them sets both; neither
is vLLM's default 5..5).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np

from producers.proposer_link import drafts_are_marked, mark
from schemas.draft_budget import MAX_MATCH_LENGTHS

DEFAULT_LOOKUP = 5
"""vLLM's n-gram default for both ends of the range (vllm.config.speculative)."""
LOOKUP_MIN_ENV = "TABLETUNE_PROMPT_LOOKUP_MIN"
LOOKUP_MAX_ENV = "TABLETUNE_PROMPT_LOOKUP_MAX"


def lookup_range_from_env(environ: dict[str, str] | None = None) -> tuple[int, int]:
    """(min_n, max_n) from the environment, by vLLM's rules for prompt_lookup_min/max.
    Raises ValueError naming the variable when a value is not an integer within
    1..MAX_MATCH_LENGTHS (a budget's bound), or the minimum exceeds the maximum."""
    env = os.environ if environ is None else environ

    def read(name: str) -> int | None:
        text = env.get(name, "").strip()
        if not text:
            return None
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{name}={text!r} is not an integer") from None
        if not 1 <= value <= MAX_MATCH_LENGTHS:
            raise ValueError(f"{name}={value} must be within 1..{MAX_MATCH_LENGTHS}")
        return value

    low, high = read(LOOKUP_MIN_ENV), read(LOOKUP_MAX_ENV)
    if low is None and high is None:
        return DEFAULT_LOOKUP, DEFAULT_LOOKUP
    low = high if low is None else low
    high = low if high is None else high
    assert low is not None and high is not None
    if low > high:
        raise ValueError(f"{LOOKUP_MIN_ENV}={low} must not exceed {LOOKUP_MAX_ENV}={high}")
    return low, high


class TableTuneNgramProposer:
    """vLLM's custom proposer interface: built with the VllmConfig, `propose` per step."""

    DRAFT_MARKS = True
    """Under the hook its drafts carry producers/proposer_link.py's marks."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.min_n, self.max_n = lookup_range_from_env()
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.marks = drafts_are_marked(vllm_config)
        """The hook is attached: drafts carry their match length, and it cuts them."""
        self._kernel = compiled_lookup()
        # compile now, not on the first request
        self._lookup(np.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.int32),
                     np.zeros((1, 8), dtype=np.int32), batch=1)

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """One draft per request of the batch, in its row order: what vLLM's n-gram proposer
        drafts at the engine's max K, marked with its match length when the hook is
        attached. Rows that sampled nothing (a prefill chunk) draft nothing, unmarked."""
        rows = np.fromiter((i for i, sampled in enumerate(sampled_token_ids)
                            if sampled and num_tokens_no_spec[i] < self.max_model_len),
                           dtype=np.int32)
        count = len(sampled_token_ids)
        starts, lengths, matched = self._lookup(rows, num_tokens_no_spec, token_ids_cpu,
                                                batch=count)
        out: list[list[int]] = []
        for row in range(count):
            match = int(matched[row])
            if match < 0:
                out.append([])
                continue
            start, take = int(starts[row]), int(lengths[row])
            draft = token_ids_cpu[row, start:start + take].tolist() if match else []
            out.append(mark(draft, match) if self.marks else draft)
        return out

    def _lookup(self, rows: np.ndarray, num_tokens: np.ndarray, token_ids: np.ndarray, *,
                batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        starts = np.zeros(batch, dtype=np.int32)
        lengths = np.zeros(batch, dtype=np.int32)
        matched = np.full(batch, -1, dtype=np.int32)
        self._kernel(rows, num_tokens, token_ids, self.min_n, self.max_n, self.max_model_len,
                     self.k, starts, lengths, matched)
        return starts, lengths, matched

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: vLLM calls this on every drafter."""


@cache
def compiled_lookup() -> Callable[..., None]:
    """`lookup_rows` compiled by numba, as vLLM compiles its own lookup (numba comes with
    vLLM; imported here so that importing this module compiles nothing)."""
    from numba import njit

    return njit(nogil=True)(lookup_rows)  # type: ignore[no-any-return]


def lookup_rows(rows: np.ndarray, num_tokens: np.ndarray, token_ids: np.ndarray, min_n: int,
                max_n: int, max_model_len: int, k: int, starts: np.ndarray,
                lengths: np.ndarray, matched: np.ndarray) -> None:
    """For each row in `rows`, vLLM 0.32's `_find_longest_matched_ngram_and_propose_tokens`
    (Apache-2.0) on `token_ids[row, :num_tokens[row]]`, keeping where the draft starts, its
    length and the n-gram length matched (0: none) in place of the draft: a KMP pass over
    the reversed tokens finds the longest suffix that recurs, at its earliest occurrence."""
    for i in range(rows.shape[0]):
        row = rows[i]
        total = num_tokens[row]
        matched[row] = 0
        lengths[row] = 0
        room = min(k, max_model_len - total)
        if total < min_n or room <= 0:
            continue
        reverse = token_ids[row, :total][::-1]
        lps = np.zeros(max_n, dtype=np.int32)
        longest = 0
        position = 0
        previous = 0
        j = 1
        while j < total:
            if reverse[previous] == reverse[j]:
                previous += 1
                if previous >= longest:
                    longest = previous
                    position = j
                if j < max_n:
                    lps[j] = previous
                if previous == max_n:
                    previous = lps[max_n - 1]
                j += 1
            elif previous != 0:
                previous = lps[previous - 1]
            else:
                j += 1
        if longest < min_n:
            continue
        start = total - 1 - position + longest
        starts[row] = start
        matched[row] = longest
        lengths[row] = min(room, total - start)
