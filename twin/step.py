"""The twin's state and its reference step: vLLM 0.32's continuous batching and Dynamic-SD.

One step, as vLLM's scheduler and model runner do it:
1. apply a staged table (`TableSwitch.apply_staged`), admit arrivals to the waiting queue;
2. schedule: every decode request gets 1 + its pending drafts, then requests in prefill and
   newly admitted ones (up to `max_num_seqs`) get prompt chunks from what is left of
   `max_num_batched_tokens` (chunked prefill);
3. K for the drafts proposed now = lookup[number of scheduled requests, prefills included];
4. verify the drafts proposed at the previous step: a request emits min(acc_len[t], k + 1)
   tokens (never past its output length); a request whose prefill completes emits its first
   token; every request that emitted and goes on gets K drafts, verified at the next step;
5. latency from the cost model with noise advances the virtual clock; one telemetry record.

`StepEngine._step` is that step, one at a time; `twin.fast_paths` takes many steps at once
with the same results, and `twin.engine.TwinEngine.run` chooses between them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from controller.engine.table_switch import TableSwitch
from producers.match_lengths import match_length_rows
from producers.recorder import RecorderConfig, StepRecorder
from producers.request_ledger import RequestLedger
from twin.batch import ARRIVAL, FIRST_TOKEN, OUTPUT, PHASE, POOL_INDEX, REQUEST_ID, RunningBatch
from twin.config import Scenario, ScenarioError
from twin.cost import step_cost
from twin.paths import Paths
from twin.summary import RunLog
from twin.traffic import Arrival, Traffic
from twin.workload import RequestPool, pool_for_phase

_NOISE_BLOCK = 4096
_add = np.add.reduce
_max = np.maximum.reduce


@dataclass(frozen=True, slots=True)
class StepStats:
    """One finished step, as adaptive policies see it (the same quantities as the record)."""

    step_seq: int
    t_s: float
    phase: int
    batch_size: int
    num_decode_reqs: int
    num_prefill_reqs: int
    num_prefill_tokens: int
    k: int
    k_next: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]
    kv_tokens: int
    step_latency_s: float
    emitted_tokens: int
    table_version: int



class StepEngine:
    """The engine's state (batch, waiting queue, virtual clock, random streams) and the
    reference step; `twin.engine.TwinEngine` is the class to use."""

    def __init__(self, scenario: Scenario, switch: TableSwitch, *,
                 recorder: StepRecorder | None = None, duration_s: float | None = None,
                 realtime: bool = False, drain: bool = False, speedup: float = 1.0,
                 epoch_s: float = 0.0) -> None:
        """`realtime`: pace virtual time to the wall clock, `speedup` times faster;
        `epoch_s`: where virtual time 0 lies in the telemetry's timestamps (0: 1970, for
        in-process runs; a paced fleet uses its start, so its records look like a fleet's)."""
        if speedup <= 0:
            raise ValueError(f"speedup={speedup} must be > 0")
        limits = scenario.engine
        self.scenario = scenario
        self.switch = switch
        self.recorder = recorder
        self.realtime = realtime
        self.speedup = speedup
        self.epoch_s = epoch_s
        self._epoch_ns = int(epoch_s * 1e9)
        self.drain = drain
        self.method = scenario.drafter.method
        self.cost = step_cost(scenario.cost, self.method, limits.max_k)
        self._step_s = self.cost.step_fn()
        self.noise = scenario.cost.noise
        self.max_batched_tokens = limits.max_num_batched_tokens
        pool_rng, traffic_rng, self._noise_rng, self._match_rng, self._abort_rng = (
            np.random.default_rng(s) for s in np.random.SeedSequence(scenario.seed).spawn(5))
        self.pools = [self._pool(i, pool_rng) for i in range(len(scenario.phases))]
        bases = np.cumsum([0] + [len(p.acc_len) for p in self.pools])
        self.pool_base = [int(b) for b in bases[:-1]]
        self.acc_len = np.concatenate([p.acc_len for p in self.pools])
        self.match_len = (None if all(p.match_len is None for p in self.pools) else
                          np.concatenate([p.match_len if p.match_len is not None else
                                          np.full(len(p.acc_len), -1, dtype=np.int8)
                                          for p in self.pools]))
        """Per acc_len position, prompt lookup's match length where pools are drafted for
        real (0: no draft); -1 in the other pools (misses drawn at `ngram_match_prob`)."""
        self.end_s = duration_s if duration_s is not None else scenario.duration_s
        self.traffic = Traffic(scenario.phases, self.pools, traffic_rng, end_s=self.end_s)
        self.batch = RunningBatch(limits.max_num_seqs)
        self.waiting: deque[Arrival] = deque()
        self.log = RunLog()
        self.clock_s = 0.0
        self.steps = 0
        self._prefilling = 0
        self._last_k_next = 0
        self._next_request_id = 0
        self._last_step_start_s: float | None = None
        self._noise: list[float] = []
        self._noise_at = 0
        self._match_prob = scenario.drafter.ngram_match_prob if self.method == "ngram" else 1.0
        self.uniform_drafts = self._match_prob == 1.0 and self.match_len is None
        """Every decoding request drafts the step's K (no n-gram misses to model)."""
        self._ledger = RequestLedger(limits.max_k)
        """Per-request sums for telemetry's `finished_requests` (kept while recording)."""
        telemetry = recorder.config if recorder is not None else RecorderConfig()
        self._backlog_check_steps = telemetry.frame_records
        self._backlog_limit = telemetry.frame_records * max(1, telemetry.max_pending_buffers // 2)
        # what the fast paths (`twin.fast_paths`) keep between runs
        self._pool_columns = [(p.prompt_len.tolist(), p.output_len.tolist(),
                               p.acc_offset.tolist()) for p in self.pools]
        """Per phase, its pool's prompt, output and acc_len offset lists (planned runs)."""
        self._next_at: dict[int, np.ndarray] = {}
        """Per K: acc_len position -> position after one step drafting K (`_decode_run`)."""
        self._run_rate = 1.0
        """Tokens per request per decode step lately (how far `_decode_run` looks ahead)."""
        self._paths: dict[int, Paths] = {}
        self._plan_after = 0
        """Step before which no planned run is tried (one just ended early)."""
        self._positions = np.arange(1, limits.max_k + 1)
        """Draft position i + 1 was accepted in a step that emitted more than i + 1 tokens."""

    def _pool(self, index: int, rng: np.random.Generator) -> RequestPool:
        try:
            return pool_for_phase(self.scenario.phases[index], method=self.method,
                                  max_k=self.scenario.engine.max_k, rng=rng,
                                  prompt_lookup=self.scenario.drafter.prompt_lookup)
        except ScenarioError as exc:
            raise exc.under(f"phases[{index}]") from None


    # ---- one step ------------------------------------------------------------------------
    def _step(self, t: float, *, want_stats: bool) -> StepStats | None:
        """Rows [0, d) decode; rows [d, n) are in prefill. Prefill rows always form a suffix:
        budget goes in admission order, so an older request finishes its prompt no later
        than a younger one, and removals keep the order."""
        self.switch.apply_staged()
        b = self.batch
        d = b.n - self._prefilling
        # Every decode row got the previous step's k_next, unless n-gram misses zeroed some.
        uniform = self.uniform_drafts
        k = self._last_k_next if uniform and d else 0
        pending = None if uniform else b.k_pending[:d]
        draft_tokens = k * d if uniform else int(_add(pending))
        if self._prefilling or self.waiting:
            chunks = self._schedule_prefills(d, self.max_batched_tokens - draft_tokens - d)
        else:
            chunks = None
        n = b.n
        # Decodes: verify the drafts proposed at the previous step.
        generated = b.generated[:d]
        ctx = b.prompt[:d] + generated
        kv = int(_add(ctx))
        ctx_max = int(_max(ctx)) if d else 0
        acc = self.acc_len[b.acc_offset[:d] + (generated - 1)]
        if uniform:
            emit_full = np.minimum(acc, k + 1)
            num_drafts = d if k else 0
        else:
            k = int(_max(pending)) if d else 0
            emit_full = np.minimum(acc, pending + 1)
            num_drafts = int(np.count_nonzero(pending))
        left = b.output[:d] - generated
        emit = np.minimum(emit_full, left)
        by_match: np.ndarray | tuple[()] = ()
        if self.recorder is not None and d:
            self._ledger.observe(b.request_id[:d], generated=generated,
                                 drafted=k if uniform else pending,
                                 accepted=emit_full - 1, emitted=emit, context=ctx)
            if self.match_len is not None:
                by_match = self._by_match_length(b.acc_offset[:d] + (generated - 1),
                                                 pending, emit_full - 1)
        generated += emit
        finished = emit == left
        emitted = int(_add(emit))
        batch_size, prefill_reqs, prefill_tokens, completed = d, 0, 0, 0
        if chunks is not None and n > d:
            computed = b.computed[d:n]
            scheduled = chunks > 0
            prefill_reqs = int(np.count_nonzero(scheduled))
            batch_size += prefill_reqs
            prefill_tokens = int(_add(chunks))
            if prefill_reqs:
                kv += int(_add(computed[scheduled]))
                ctx_max = max(ctx_max, int(_max(computed[scheduled])))
            computed += chunks
            first = scheduled & (computed >= b.prompt[d:n])
            completed = int(np.count_nonzero(first))  # a prefix of the prefill rows
            b.generated[d:d + completed] = 1
            emitted += completed
            finished = np.concatenate([finished, first & (b.output[d:n] == 1)])
            self._prefilling -= completed
        k_next = self.switch.k_for_step(batch_size)
        self._last_k_next = k_next
        b.k_pending[:d + completed] = k_next
        n_finished = int(np.count_nonzero(finished))
        budget = None if uniform else self.switch.budget_for(batch_size)
        drafting = (k_next > 0 or budget is not None) and d + completed > n_finished
        if drafting and not uniform:
            drafting = self._per_request_drafts(d + completed, finished, budget)
        accepted = int(_add(emit_full)) - d
        per_pos = self._accepted_per_pos(emit_full, k)
        drafter_k = k_next if budget is None else max(budget)
        latency = self._latency(kv, d + draft_tokens + prefill_tokens,
                                drafter_k if drafting else 0)
        t_end = t + latency
        if completed:
            b.first_token[d:d + completed] = t_end
        phase = self.traffic.phase_index(t)
        inter_step = t - self._last_step_start_s if self._last_step_start_s is not None else 0.0
        self._last_step_start_s = t
        if self.recorder is not None:
            leaving = (self._ledger.finish(b.request_id[:n][finished])
                       if n_finished else ())
            self.recorder.record_step(
                batch_size=batch_size, num_decode_reqs=d, num_prefill_reqs=prefill_reqs,
                num_prefill_tokens=prefill_tokens, k=k, k_next=k_next,
                table_version=self.switch.version, num_drafts=num_drafts,
                num_draft_tokens=draft_tokens, num_accepted_tokens=accepted,
                accepted_per_pos=per_pos, kv_tokens=kv, ctx_len_mean=kv / batch_size,
                ctx_len_max=ctx_max, step_latency_s=latency, inter_step_s=inter_step,
                forced=self.switch.step_forced, ts_ns=self._epoch_ns + int(t * 1e9),
                finished_requests=leaving, by_match_length=by_match)
            if self.steps % self._backlog_check_steps == 0:
                self._wait_for_sink(self.recorder)
        self.log.add_step(t, latency, batch_size, k_next, emitted, phase)
        if n_finished:
            self._finish(finished, t_end)
        self.clock_s = t_end
        self.steps += 1
        if not want_stats:
            return None
        return StepStats(
            step_seq=self.steps - 1, t_s=t, phase=phase, batch_size=batch_size,
            num_decode_reqs=d, num_prefill_reqs=prefill_reqs,
            num_prefill_tokens=prefill_tokens, k=k, k_next=k_next,
            num_drafts=num_drafts, num_draft_tokens=draft_tokens,
            num_accepted_tokens=accepted, accepted_per_pos=tuple(int(c) for c in per_pos),
            kv_tokens=kv, step_latency_s=latency, emitted_tokens=emitted,
            table_version=self.switch.version)

    def abort(self, count: int) -> int:
        """Abort `count` requests, as a client that closes its connections makes vLLM do:
        waiting ones first (newest first), then running ones drawn at random, so what is left
        is still a fair sample of the batch. Aborted requests emit nothing more and do not
        count as finished. Returns how many were aborted."""
        aborted = 0
        while aborted < count and self.waiting:
            self.waiting.pop()
            aborted += 1
        b = self.batch
        take = min(count - aborted, b.n)
        if take > 0:
            rows = self._abort_rng.choice(b.n, size=take, replace=False)
            gone = np.zeros(b.n, dtype=bool)
            gone[rows] = True
            self._ledger.discard(b.request_id[:b.n][gone])
            self._prefilling -= int(np.count_nonzero(gone[b.n - self._prefilling:]))
            b.remove(gone)
            aborted += take
        return aborted

    def _schedule_prefills(self, d: int, budget: int) -> np.ndarray:
        """Prompt chunks for the prefill rows [d, n), then for newly admitted requests while
        a slot and budget are left (decodes always fit: checked by EngineConfig)."""
        b = self.batch
        chunks = []
        for row in range(d, b.n):
            chunk = min(int(b.prompt[row] - b.computed[row]), budget)
            chunks.append(chunk)
            budget -= chunk
        while self.waiting and b.free and budget > 0:
            arrival_s, phase, index = self.waiting.popleft()
            pool = self.pools[phase]
            prompt = int(pool.prompt_len[index])
            b.add(prompt=prompt, output=int(pool.output_len[index]),
                  acc_offset=self.pool_base[phase] + int(pool.acc_offset[index]),
                  request_id=self._next_request_id, phase=phase, pool_index=index,
                  arrival_s=arrival_s)
            self._next_request_id += 1
            self._prefilling += 1
            chunk = min(prompt, budget)
            chunks.append(chunk)
            budget -= chunk
        return np.array(chunks, dtype=np.int64)

    def _per_request_drafts(self, decoding: int, finished: np.ndarray,
                            budget: tuple[int, ...] | None) -> bool:
        """Drafts per request for its next step, where they differ from the step's K.

        Requests whose n-gram lookup finds no match propose nothing: where the pool was
        drafted for real, exactly where lookup missed, and a budget then sets every
        request's K by its match length (in place of the step's K); elsewhere at chance
        1 - `ngram_match_prob` where nothing would be accepted (SpecDecode-Bench's match
        model). Returns whether any request still drafts."""
        b = self.batch
        rows = np.flatnonzero(~finished[:decoding])
        positions = b.acc_offset[rows] + b.generated[rows] - 1
        if self.match_len is not None:
            matched = self.match_len[positions]
            looked_up = matched >= 0
            if budget is None:
                b.k_pending[rows[matched == 0]] = 0
            else:
                b.k_pending[rows[looked_up]] = np.asarray(budget)[matched[looked_up]]
            rows, positions = rows[~looked_up], positions[~looked_up]
        rows = rows[self.acc_len[positions] == 1]
        unmatched = self._match_rng.random(len(rows)) >= self._match_prob
        b.k_pending[rows[unmatched]] = 0
        return bool(np.any(b.k_pending[:decoding][~finished[:decoding]]))

    def _by_match_length(self, positions: np.ndarray, drafts: np.ndarray | None,
                         accepted: np.ndarray) -> np.ndarray | tuple[()]:
        """Telemetry's acceptance by match length for this step's looked-up requests."""
        assert self.match_len is not None and drafts is not None  # looked up: per request
        matched = self.match_len[positions]
        known = matched >= 0
        if not known.any():
            return ()
        return match_length_rows(matched[known], drafts[known], accepted[known],
                                 self.switch.max_k)

    @staticmethod
    def _accepted_per_pos(emit_full: np.ndarray, k: int) -> np.ndarray:
        """Requests whose draft at position i was accepted (unconditional), i = 0..k-1."""
        if k == 0:
            return emit_full[:0]
        counts = np.bincount(emit_full, minlength=k + 2)
        at_least = np.cumsum(counts[::-1])[::-1]
        return at_least[2:k + 2]

    def _latency(self, kv: int, batched: int, k_next: int) -> float:
        base = self._step_s(kv, batched, k_next)
        if not self.noise:
            return base
        if self._noise_at == len(self._noise):
            draws = 1.0 + self.noise * self._noise_rng.standard_normal(_NOISE_BLOCK)
            self._noise = np.maximum(draws, 0.05).tolist()
            self._noise_at = 0
        factor = self._noise[self._noise_at]
        self._noise_at += 1
        return base * factor

    def _wait_for_sink(self, recorder: StepRecorder) -> None:
        """Virtual time can outrun any sink: hand over the backlog before the recorder would
        start dropping records (a real engine must not wait; the twin loses nothing by it)."""
        if recorder.counters().get("records_pending", 0) > self._backlog_limit:
            recorder.flush(timeout_s=30.0)

    def _finish(self, finished: np.ndarray, t_end: float) -> None:
        self._finish_rows(np.flatnonzero(finished), t_end)

    def _finish_rows(self, rows: np.ndarray, t_end: float) -> None:
        b = self.batch
        ints, floats = b.ints[:, rows], b.floats[:, rows]
        self.log.add_finished(floats[ARRIVAL], floats[FIRST_TOKEN], t_end, ints[OUTPUT],
                              ints[REQUEST_ID], ints[POOL_INDEX], ints[PHASE])
        b.remove_rows(rows)
