"""Requests the twin serves: from a SpecDecode-Bench trace, or drawn from an acceptance profile.

Either way a workload is a `RequestPool`: per request a prompt length, an output length and
`acc_len[t]` for every generated position t (tokens a step would emit if drafting started
there, unlimited K). Flat numpy arrays keep the engine's per-step lookup one fancy index.
A parametric pool samples `acc_len` from the conditional acceptance rates up front, so the
engine has a single code path for both sources.

With `prompt_lookup`, an n-gram pool is drafted for real: vLLM's prompt lookup runs on each
request's own tokens (prompt, then what the target generated), and `acc_len[t]` is one more
than the draft's leading tokens that the target then generated. The match length comes with
it: it is what per-request budgets key on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from producers.prompt_lookup import PromptLookupIndex
from twin.config import PhaseConfig, ScenarioError

log = logging.getLogger(__name__)

TRACE_FIELDS = {"eagle": "acc_eagle", "ngram": "acc_ngram", "draft_model": "acc_eagle"}
"""Which acceptance column of a trace each drafter reads (draft_model has none of its own)."""

PARAMETRIC_POOL_REQUESTS = 512
LOOKUP_DRAFT_TOKENS = 32
"""Tokens drafted per position when a pool is drafted for real: acc_len is cut at one more
(past any engine's K; the benchmark's own traces stop at 20)."""


@dataclass(frozen=True, slots=True)
class RequestPool:
    prompt_len: np.ndarray
    output_len: np.ndarray
    """Generated tokens: len(acc_len) of the request, as SpecDecode-Bench counts them."""
    acc_offset: np.ndarray
    """Where each request's acc_len starts in `acc_len`."""
    acc_len: np.ndarray
    source: str
    match_len: np.ndarray | None = None
    """Drafted for real: per position, as `acc_len`, the tokens of the n-gram prompt lookup
    matched (0: no match, and so no draft)."""

    def __len__(self) -> int:
        return len(self.prompt_len)

    def scaled(self, prompt_scale: float) -> RequestPool:
        """The same requests with prompts `prompt_scale` times as long (at least 1 token)."""
        if prompt_scale == 1.0:
            return self
        prompts = np.maximum(1, np.rint(self.prompt_len * prompt_scale)).astype(np.int64)
        return RequestPool(prompts, self.output_len, self.acc_offset, self.acc_len,
                           f"{self.source} x{prompt_scale:g} prompt", self.match_len)


def load_trace(path: str | Path, method: str, *,
               prompt_lookup: tuple[int, int] | None = None) -> RequestPool:
    """Requests of a SpecDecode-Bench JSONL file that generated at least one token, in order.

    `prompt_lookup` = (min_n, max_n), n-gram only: draft each request for real from its token
    ids instead of reading the recorded `acc_ngram`."""
    resolved = Path(path).resolve()
    try:
        mtime = resolved.stat().st_mtime_ns
    except OSError as exc:
        raise ScenarioError("trace", f"cannot read {resolved}: {exc.strerror}") from None
    if prompt_lookup is not None and method == "ngram":
        return _looked_up_trace_cached(str(resolved), mtime, *prompt_lookup)
    return _load_trace_cached(str(resolved), mtime, TRACE_FIELDS[method])


@lru_cache(maxsize=8)
def _load_trace_cached(path: str, _mtime_ns: int, acc_field: str) -> RequestPool:
    prompts: list[int] = []
    accs: list[list[int]] = []
    for number, row in _rows(path):
        try:
            acc = row[acc_field]["acc_len"]
            prompt = len(row["prompt_token_ids"])
        except (KeyError, TypeError) as exc:
            raise ScenarioError("trace", f"{path}:{number}: not a SpecDecode-Bench "
                                         f"request ({exc!r})") from None
        if acc:
            prompts.append(prompt)
            accs.append(acc)
    if not accs:
        raise ScenarioError("trace", f"{path} holds no request with generated tokens")
    return _pool(prompts, accs, source=f"{Path(path).name}:{acc_field}")


@lru_cache(maxsize=8)
def _looked_up_trace_cached(path: str, _mtime_ns: int, min_n: int, max_n: int) -> RequestPool:
    prompts: list[int] = []
    accs: list[np.ndarray] = []
    matches: list[np.ndarray] = []
    for number, row in _rows(path):
        try:
            prompt, generated = row["prompt_token_ids"], row["generated_token_ids"]
            acc, match = drafted_for_real(prompt, generated, min_n=min_n, max_n=max_n)
        except (KeyError, TypeError, ValueError) as exc:
            raise ScenarioError("trace", f"{path}:{number}: no token ids to draft from "
                                         f"({exc!r})") from None
        if len(acc):
            prompts.append(len(prompt))
            accs.append(acc)
            matches.append(match)
    if not accs:
        raise ScenarioError("trace", f"{path} holds no request with generated tokens")
    pool = _pool(prompts, accs, source=f"{Path(path).name}:lookup({min_n},{max_n})")
    return replace(pool, match_len=np.concatenate(matches).astype(np.int8))


def drafted_for_real(prompt: list[int], generated: list[int], *, min_n: int, max_n: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Per generated position t: 1 + the leading tokens of prompt lookup's draft on
    prompt + generated[:t] that equal generated[t:], and the match length."""
    index = PromptLookupIndex(min_n=min_n, max_n=max_n)
    index.extend(prompt)
    acc = np.ones(len(generated), dtype=np.int64)
    match = np.zeros(len(generated), dtype=np.int64)
    for t, token in enumerate(generated):
        lookup = index.lookup(LOOKUP_DRAFT_TOKENS)
        if lookup.match_length:
            match[t] = lookup.match_length
            agreed = 0
            for drafted, actual in zip(lookup.draft.tolist(), generated[t:], strict=False):
                if drafted != actual:
                    break
                agreed += 1
            acc[t] = 1 + agreed
        index.extend((token,))
    return acc, match


def _rows(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, row) of a JSONL file, blank lines skipped."""
    with open(path, "rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                yield number, json.loads(raw)
            except UnicodeDecodeError as exc:  # its repr would carry the whole line
                raise ScenarioError("trace", f"{path}:{number}: not UTF-8 text (byte "
                                             f"{exc.start} of the line)") from None
            except json.JSONDecodeError as exc:
                raise ScenarioError("trace", f"{path}:{number}: not a SpecDecode-Bench "
                                             f"request ({exc!r})") from None


def parametric_pool(acceptance: tuple[float, ...], *, prompt_len: float, output_len: float,
                    max_k: int, rng: np.random.Generator,
                    requests: int = PARAMETRIC_POOL_REQUESTS,
                    length_range: float | None = None) -> RequestPool:
    """Synthetic requests: lengths ~ Gamma(shape 2) with the given means (with
    `length_range` r: uniform integers in [mean·(1 − r), mean·(1 + r)], vLLM's random
    dataset); per position, acc_len = 1 + leading accepted drafts, position i accepted with
    conditional rate a_i."""
    if length_range is None:
        prompts = _gamma_lengths(rng, prompt_len, requests)
        outputs = _gamma_lengths(rng, output_len, requests)
    else:
        prompts = _uniform_lengths(rng, prompt_len, length_range, requests)
        outputs = _uniform_lengths(rng, output_len, length_range, requests)
    total = int(outputs.sum())
    positions = max(max_k, 1)
    rates = np.array([acceptance[min(i, len(acceptance) - 1)] for i in range(positions)])
    accepted = rng.random((total, positions)) < rates
    # 1 + the leading accepted positions: the first rejected one's index, a rejected one
    # appended so that every row has one
    padded = np.zeros((total, positions + 1), dtype=bool)
    padded[:, :positions] = accepted
    acc_flat = 1 + padded.argmin(axis=1)
    if max_k == 0:
        acc_flat[:] = 1
    offsets = np.zeros(requests, dtype=np.int64)
    np.cumsum(outputs[:-1], out=offsets[1:])
    source = "parametric(" + ",".join(f"{a:g}" for a in acceptance) + ")"
    return RequestPool(prompts, outputs, offsets, acc_flat.astype(np.int64), source)


def pool_for_phase(phase: PhaseConfig, *, method: str, max_k: int, rng: np.random.Generator,
                   prompt_lookup: tuple[int, int] | None = None) -> RequestPool:
    """The phase's trace if it can be read, else its acceptance profile (logged)."""
    if phase.trace is not None:
        if Path(phase.trace).is_file() or phase.acceptance is None:
            return load_trace(phase.trace, method,
                              prompt_lookup=prompt_lookup).scaled(phase.prompt_scale)
        log.warning("trace %s is missing; using the phase's acceptance profile", phase.trace)
    assert phase.acceptance is not None  # guaranteed by PhaseConfig
    return parametric_pool(phase.acceptance, prompt_len=phase.prompt_len * phase.prompt_scale,
                           output_len=phase.output_len, max_k=max_k, rng=rng,
                           length_range=phase.length_range)


def _gamma_lengths(rng: np.random.Generator, mean: float, count: int) -> np.ndarray:
    lengths = np.rint(rng.gamma(2.0, mean / 2.0, size=count))
    return np.clip(lengths, 1, max(1, int(8 * mean))).astype(np.int64)


def _uniform_lengths(rng: np.random.Generator, mean: float, spread: float, count: int
                     ) -> np.ndarray:
    low = max(1, int(np.floor(mean * (1.0 - spread))))
    high = max(low, int(np.ceil(mean * (1.0 + spread))))
    return rng.integers(low, high + 1, size=count).astype(np.int64)


def _pool(prompts: list[int], accs: Sequence[Sequence[int] | np.ndarray], *,
          source: str) -> RequestPool:
    outputs = np.array([len(a) for a in accs], dtype=np.int64)
    offsets = np.zeros(len(accs), dtype=np.int64)
    np.cumsum(outputs[:-1], out=offsets[1:])
    flat = np.concatenate([np.asarray(a, dtype=np.int64) for a in accs])
    if flat.min() < 1:
        raise ScenarioError("trace", f"{source}: acc_len values must be >= 1")
    return RequestPool(np.array(prompts, dtype=np.int64), outputs, offsets, flat, source)
