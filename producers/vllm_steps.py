"""Turning one vLLM engine step into a step record, off the engine thread.

The hook captures a `RawStep` on the engine thread: references to the step's
`SchedulerOutput` (built fresh each step and not mutated after `update_from_output`) and the
number of tokens each request sampled, copied before vLLM trims them at stop tokens, because
vLLM's SpecDecodingStats counts acceptance before that trim. Everything else — acceptance per
position, the prefill/decode split, context lengths — is computed here on the recorder's
background thread. Imports nothing from vLLM so it can be tested and reused without it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from producers.match_lengths import match_length_rows
from producers.request_ledger import RequestLedger


@dataclass(slots=True)
class RawStep:
    """Captured on the engine thread; not frozen because frozen init costs microseconds."""

    schedule_start_s: float
    """perf_counter() when schedule() started (sync scheduling latency starts here)."""
    update_start_s: float
    """perf_counter() when update_from_output() started."""
    previous_update_start_s: float | None
    scheduler_output: Any
    sampled_lengths: list[int]
    """len(sampled_token_ids[i]) per request index, before vLLM trims at stop tokens."""
    req_id_to_index: dict[str, int]
    table_version: int
    forced: bool
    async_scheduling: bool
    max_positions: int
    ts_ns: int
    draft_match: tuple[list[str], list[int]] | None = None
    """TableTune's proposer only: the request ids and match lengths of the drafts this step
    verifies (proposed at the step before), in one order."""


SampledDecode = tuple[str, int, int, int, int]
"""(request id, tokens generated before the step, context, drafts verified, tokens sampled)."""


def sampled_decodes(raw: RawStep, decoding: list[tuple[str, int, int]]) -> list[SampledDecode]:
    """The decoding requests `build_step_fields` sorted out, (request id, tokens generated
    before the step, context), that sampled this step, with their drafts and samples."""
    drafts_of = raw.scheduler_output.scheduled_spec_decode_tokens
    lengths, index_of = raw.sampled_lengths, raw.req_id_to_index
    out = []
    for req_id, outputs, tokens in decoding:
        index = index_of.get(req_id)
        if index is None or index >= len(lengths) or not lengths[index]:
            continue  # sampled nothing this step
        out.append((req_id, outputs, tokens, len(drafts_of.get(req_id, ())), lengths[index]))
    return out


class VllmRequests:
    """vLLM's request ids on a `RequestLedger` (which keys requests by number): a request is
    numbered when it first decodes and handed over when vLLM lists it as finished (or
    aborted) in the next step's `finished_req_ids`. Recorder thread only."""

    def __init__(self, max_positions: int) -> None:
        self.ledger = RequestLedger(max_positions)
        self._numbers: dict[str, int] = {}
        self._next = itertools.count()
        self._gone: list[int] = []

    def observe(self, decodes: list[SampledDecode]) -> None:
        """This step's decoding requests that sampled (`sampled_decodes`)."""
        numbers, generated, drafted, accepted, emitted, context = [], [], [], [], [], []
        for req_id, outputs, tokens, drafts, sampled in decodes:
            number = self._numbers.get(req_id)
            if number is None:
                number = self._numbers[req_id] = next(self._next)
            numbers.append(number)
            generated.append(outputs)
            drafted.append(drafts)
            accepted.append(min(sampled - 1, drafts))
            emitted.append(sampled)
            context.append(tokens)
        self.ledger.observe(numbers, generated=generated, drafted=drafted, accepted=accepted,
                            emitted=emitted, context=context)

    def note_finished(self, raw: RawStep) -> None:
        """The requests vLLM lists as gone since its last step; their rows go with the next
        step record (an idle engine's first step lists the last batch's requests)."""
        gone = getattr(raw.scheduler_output, "finished_req_ids", None) or ()
        self._gone.extend(self._numbers.pop(req_id) for req_id in gone
                          if req_id in self._numbers)

    def take_finished(self) -> np.ndarray:
        numbers, self._gone = self._gone, []
        return self.ledger.finish(numbers)


def build_step_fields(raw: RawStep, requests: VllmRequests | None = None
                      ) -> dict[str, Any] | None:
    """`StepRecorder.record_step` arguments for one step (None for an empty step).
    `requests` (kept across steps) adds the finished requests' sums."""
    out = raw.scheduler_output
    num_scheduled: dict[str, int] = out.num_scheduled_tokens
    batch_size = len(num_scheduled)
    finished: np.ndarray | tuple[()] = ()
    if requests is not None:
        requests.note_finished(raw)
        if batch_size:
            finished = requests.take_finished()
    if batch_size == 0:
        return None

    accepted_per_pos = [0] * raw.max_positions
    num_drafts = num_draft_tokens = num_accepted = k_verified = 0
    lengths, index_of = raw.sampled_lengths, raw.req_id_to_index
    for req_id, drafts in out.scheduled_spec_decode_tokens.items():
        drafted = len(drafts)
        index = index_of.get(req_id)
        if not drafted or index is None or index >= len(lengths) or not lengths[index]:
            continue  # vLLM counts a draft only when the request sampled tokens this step
        accepted = min(max(lengths[index] - 1, 0), drafted)
        num_drafts += 1
        num_draft_tokens += drafted
        num_accepted += accepted
        k_verified = max(k_verified, drafted)
        for position in range(min(accepted, raw.max_positions)):
            accepted_per_pos[position] += 1

    prefill_reqs = prefill_tokens = 0
    context_lengths: list[int] = []
    for new in out.scheduled_new_reqs:
        scheduled = num_scheduled.get(new.req_id, 0)
        prefill_reqs += 1
        prefill_tokens += scheduled
        context_lengths.append(new.num_computed_tokens + scheduled)
    cached = out.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    decoding: list[tuple[str, int, int]] = []
    for req_id, computed, outputs in zip(cached.req_ids, cached.num_computed_tokens,
                                         cached.num_output_tokens, strict=False):
        scheduled = num_scheduled.get(req_id, 0)
        if outputs == 0 or req_id in resumed:
            prefill_reqs += 1
            prefill_tokens += scheduled
        elif scheduled:
            decoding.append((req_id, outputs, computed + scheduled))
        context_lengths.append(computed + scheduled)
    decodes = (sampled_decodes(raw, decoding)
               if requests is not None or raw.draft_match is not None else [])
    if requests is not None:
        requests.observe(decodes)
    by_match: np.ndarray | tuple[()] = ()
    if raw.draft_match is not None and decodes:
        by_match = acceptance_by_match_length(raw.draft_match, decodes, raw.max_positions)

    kv_tokens = sum(context_lengths)
    previous = raw.previous_update_start_s
    inter_step_s = 0.0 if previous is None else raw.update_start_s - previous
    return {
        "ts_ns": raw.ts_ns,
        "batch_size": batch_size,
        "num_decode_reqs": batch_size - prefill_reqs,
        "num_prefill_reqs": prefill_reqs,
        "num_prefill_tokens": prefill_tokens,
        "k": k_verified,
        "k_next": int(getattr(out, "num_spec_tokens_to_schedule", 0)),
        "table_version": raw.table_version,
        "num_drafts": num_drafts,
        "num_draft_tokens": num_draft_tokens,
        "num_accepted_tokens": num_accepted,
        "accepted_per_pos": accepted_per_pos[:k_verified],
        "kv_tokens": kv_tokens,
        "ctx_len_mean": kv_tokens / len(context_lengths) if context_lengths else 0.0,
        "ctx_len_max": max(context_lengths, default=0),
        "step_latency_s": step_latency_s(raw),
        "inter_step_s": inter_step_s,
        "forced": raw.forced,
        "finished_requests": finished,
        "by_match_length": by_match,
    }


def acceptance_by_match_length(draft_match: tuple[list[str], list[int]],
                               decodes: list[SampledDecode], max_positions: int
                               ) -> np.ndarray | tuple[()]:
    """`match_length_rows` over the step's sampled decodes whose draft was looked up (a
    request drafting nothing after a miss counts at length 0)."""
    req_ids, lengths = draft_match
    length_of = dict(zip(req_ids, lengths, strict=False))
    matched, drafted, accepted = [], [], []
    for req_id, _, _, drafts, sampled in decodes:
        length = length_of.get(req_id, -1)
        if length < 0:
            continue
        matched.append(length)
        drafted.append(drafts)
        accepted.append(min(sampled - 1, drafts))
    if not matched:
        return ()
    return match_length_rows(np.array(matched), np.array(drafted), np.array(accepted),
                             max_positions)


def step_latency_s(raw: RawStep) -> float:
    """The step's own time. Synchronous: schedule() to update_from_output(). Async
    scheduling overlaps a step's schedule with the previous step's execution, so there the
    gap between updates is the step; but not for the first step, nor one scheduled after
    the previous update (the engine was idle), whose gap holds no step or the idle time."""
    previous = raw.previous_update_start_s
    if raw.async_scheduling and previous is not None and raw.schedule_start_s < previous:
        return raw.update_start_s - previous
    return raw.update_start_s - raw.schedule_start_s
