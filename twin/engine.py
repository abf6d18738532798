"""The twin: a discrete-event engine with vLLM 0.32's continuous batching and Dynamic-SD semantics.

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

Most steps only decode (no prompt to prefill, nobody waiting, one K for all): from one such
step on, `_decode_run` computes the steps up to the next one where a request finishes as
arrays over (steps, requests) — each request's tokens per step follow from its acc_len
chain alone — and then takes them one by one exactly as `run` and `_step` would (arrivals,
staged tables, latency and noise, telemetry, policy), stopping where the batch would change.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from controller.engine.table_switch import TableSwitch
from producers.recorder import RecorderConfig, StepRecorder
from producers.request_ledger import RequestLedger
from twin.batch import (
    ARRIVAL,
    FIRST_TOKEN,
    INT_COLUMNS,
    OUTPUT,
    PHASE,
    POOL_INDEX,
    REQUEST_ID,
    Row,
    RunningBatch,
)
from twin.config import Scenario, ScenarioError
from twin.cost import step_cost
from twin.paths import CONTEXT, CONTEXT_MAX, DECODING, EMIT_FULL, EMITTED, PER_POS, Paths
from twin.policies import Policy
from twin.summary import RunLog
from twin.traffic import Arrival, Traffic
from twin.workload import RequestPool, pool_for_phase

_NOISE_BLOCK = 4096
_RUN_STEPS = 64
"""At most this many decode-only steps are computed ahead at once (`_decode_run`)."""
_PLAN_STEPS = 16384
"""At most this many steps are planned at once (`_planned_run`)."""
_PLAN_SHORT, _PLAN_BACKOFF = 32, 256
"""A planned run shorter than this is not tried again for that many steps."""
_PATHS_KEPT = 3
"""Paths kept for this many K values."""
_add = np.add.reduce
_max = np.maximum.reduce
_min = np.minimum.reduce


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


class TwinEngine:
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
        self._pool_columns = [(p.prompt_len.tolist(), p.output_len.tolist(),
                               p.acc_offset.tolist()) for p in self.pools]
        """Per phase, its pool's prompt, output and acc_len offset lists (planned runs)."""
        self.acc_len = np.concatenate([p.acc_len for p in self.pools])
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
        self._next_at: dict[int, np.ndarray] = {}
        """Per K: acc_len position -> position after one step drafting K (`_decode_run`)."""
        self._run_rate = 1.0
        self._paths: dict[int, Paths] = {}
        self._plan_after = 0
        """Step before which no planned run is tried (one just ended early)."""
        """Tokens per request per decode step lately (how far `_decode_run` looks ahead)."""
        self._positions = np.arange(1, limits.max_k + 1)
        """Draft position i + 1 was accepted in a step that emitted more than i + 1 tokens."""
        self._ledger = RequestLedger(limits.max_k)
        """Per-request sums for telemetry's `finished_requests` (kept while recording)."""
        telemetry = recorder.config if recorder is not None else RecorderConfig()
        self._backlog_check_steps = telemetry.frame_records
        self._backlog_limit = telemetry.frame_records * max(1, telemetry.max_pending_buffers // 2)

    def _pool(self, index: int, rng: np.random.Generator) -> RequestPool:
        try:
            return pool_for_phase(self.scenario.phases[index], method=self.method,
                                  max_k=self.scenario.engine.max_k, rng=rng)
        except ScenarioError as exc:
            raise exc.under(f"phases[{index}]") from None

    # ---- the loop ------------------------------------------------------------------------
    def run(self, policy: Policy) -> RunLog:
        """Step until the end of the run (and, with `drain`, until every request finished)."""
        policy.start(self)
        interval = policy.step_interval
        wall_start = time.monotonic()
        batch = self.batch
        # decode runs: whenever the step would only decode (paced runs step one by one);
        # planned runs when the policy does not look at steps
        runs = not self.realtime and self._match_prob == 1.0 and interval != 1
        plans = runs and interval == 0
        started = False  # the step at clock_s had its start (arrivals) taken by a run
        while True:
            t = self.clock_s
            if not started:
                if t >= self.end_s and (not self.drain or (batch.n == 0 and not self.waiting)):
                    break
                if self.realtime:  # pace virtual time to the wall clock, idle gaps included
                    time.sleep(max(0.0, t / self.speedup - (time.monotonic() - wall_start)))
                for arrival in self.traffic.arrivals(t, batch.n + len(self.waiting)):
                    self.waiting.append(arrival)
                if batch.n == 0 and not self.waiting:
                    self.clock_s = min(self.traffic.next_event_s(t), max(self.end_s, t))
                    if self.clock_s <= t:
                        break
                    continue
            if started:  # a run stopped at this step's start: it goes step by step
                started = False
            elif plans and not self._prefilling:
                started = self._planned_run(t, policy, interval)
                continue
            elif runs and not self._prefilling and not self.waiting:
                started = self._decode_run(t, policy, interval)
                continue
            stats = self._step(t, want_stats=interval > 0 and (self.steps + 1) % interval == 0)
            if stats is not None:
                policy.on_step(self, stats)
        return self.log

    # ---- one step ------------------------------------------------------------------------
    def _step(self, t: float, *, want_stats: bool) -> StepStats | None:
        """Rows [0, d) decode; rows [d, n) are in prefill. Prefill rows always form a suffix:
        budget goes in admission order, so an older request finishes its prompt no later
        than a younger one, and removals keep the order."""
        self.switch.apply_staged()
        b = self.batch
        d = b.n - self._prefilling
        # Every decode row got the previous step's k_next, unless n-gram misses zeroed some.
        uniform = self._match_prob == 1.0
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
        if self.recorder is not None and d:
            self._ledger.observe(b.request_id[:d], generated=generated,
                                 drafted=k if uniform else pending,
                                 accepted=emit_full - 1, emitted=emit, context=ctx)
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
        drafting = k_next > 0 and d + completed > n_finished
        if drafting and not uniform:
            drafting = self._drop_unmatched_ngram(d + completed, finished)
        accepted = int(_add(emit_full)) - d
        per_pos = self._accepted_per_pos(emit_full, k)
        latency = self._latency(kv, d + draft_tokens + prefill_tokens, k_next if drafting else 0)
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
                finished_requests=leaving)
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

    def _decode_run(self, t: float, policy: Policy, interval: int) -> bool:
        """Steps from `t`, whose start `run` took, while every running request only decodes,
        all with the K proposed at the previous step: up to and including the first step in
        which a request finishes, a step whose start brings arrivals or a new table (not
        taken: returns True, and `run` hands that step to `_step`), the end of the run, or
        a step whose statistics the policy wants. What each step does, and every draw, is
        what `_step` would do; the per-request arithmetic is done for all steps at once."""
        switch = self.switch
        switch.apply_staged()
        b = self.batch
        d = b.n
        k = self._last_k_next
        want_at = interval - 1 - self.steps % interval if interval > 0 else _RUN_STEPS
        if switch.explorer is not None or switch.lookup[min(d, switch.max_batch)] != k \
                or want_at == 0:
            stats = self._step(t, want_stats=want_at == 0)  # its apply_staged finds none
            if stats is not None:
                policy.on_step(self, stats)
            return False
        # Each request's acc_len positions step by step (position = offset + generated - 1):
        # `ahead` steps computed, as many as the request nearest its end is likely to need.
        left0 = b.output[:d] - b.generated[:d]
        ahead = min(int(_min(left0) / self._run_rate) + 2, _RUN_STEPS, want_at + 1)
        next_at = self._next_at.get(k)
        if next_at is None:
            next_at = self._next_positions(k)
        at = np.empty((ahead + 1, d), dtype=np.int64)
        np.add(b.acc_offset[:d], b.generated[:d], out=at[0])
        at[0] -= 1
        for i in range(ahead):
            next_at.take(at[i], out=at[i + 1])
        done = at[1:] - at[0]  # tokens emitted up to and including each step, uncapped
        finishing = done >= left0
        ends = finishing.any(axis=1)
        steps = int(ends.argmax()) + 1 if ends[-1] else ahead  # through the first finish
        finish_step = steps - 1 if ends[-1] else -1
        emit_full = at[1:steps + 1] - at[:steps]
        context = at[:steps] + (b.prompt[:d] + b.generated[:d] - at[0])
        kv = _add(context, axis=1).tolist()
        ctx_max = _max(context, axis=1).tolist()
        emit_sums = _add(emit_full, axis=1)
        accepted = (emit_sums - d).tolist()
        emitted = emit_sums.tolist()
        finished = None
        n_finished = 0
        if finish_step >= 0:
            left = left0 - (done[finish_step - 1] if finish_step else 0)
            emit_last = np.minimum(emit_full[finish_step], left)
            finished = finishing[finish_step]
            n_finished = int(np.count_nonzero(finished))
            emitted[finish_step] = int(_add(emit_last))
        per_pos = ((emit_full[:, :, None] > self._positions[:k]).sum(axis=1) if k
                   else emit_full[:, :0])
        # The steps one by one, as `run` and `_step` take them.
        batched = d + k * d
        starts: list[float] = []
        latencies: list[float] = []
        phases: list[int] = []
        forced: list[bool] = []
        started = False
        traffic = self.traffic
        for i in range(steps):
            if i:
                if t >= self.end_s and not self.drain:
                    break
                arrivals = traffic.arrivals(t, d)
                if arrivals:
                    self.waiting.extend(arrivals)
                    started = True
                    break
                if switch.apply_staged() is not None:
                    started = True
                    break
            switch.k_for_step(d)  # == k: no explorer, the same table
            forced.append(switch.step_forced)
            drafting = k > 0 and (i != finish_step or d > n_finished)
            latency = self._latency(kv[i], batched, k if drafting else 0)
            starts.append(t)
            latencies.append(latency)
            phases.append(traffic.phase_index(t))
            t = t + latency
        taken = len(starts)
        if taken < steps:
            finish_step = -1
        # State after the steps taken; the ledger first (a finishing request's rows).
        generated = b.generated[:d]
        recorder = self.recorder
        if recorder is not None:
            ledger_emit = emit_full[:taken]
            if finish_step >= 0:
                ledger_emit = ledger_emit.copy()
                ledger_emit[finish_step] = emit_last
            self._ledger.observe_steps(b.request_id[:d], generated=at[:taken] - (at[0] - generated),
                                       drafted=k, accepted=emit_full[:taken] - 1,
                                       emitted=ledger_emit, context=context[:taken])
        generated += done[taken - 1]
        if finish_step >= 0:
            generated -= emit_full[finish_step] - emit_last
        b.k_pending[:d] = k
        self._run_rate = max(0.5, float(_add(done[taken - 1])) / (d * taken))
        version = switch.version
        num_drafts = d if k else 0
        previous = self._last_step_start_s
        seq0 = self.steps
        for i in range(taken):
            start = starts[i]
            inter_step = start - previous if previous is not None else 0.0
            previous = start
            if recorder is not None:
                leaving = (self._ledger.finish(b.request_id[:d][finished])
                           if i == finish_step and n_finished else ())
                recorder.record_step(
                    batch_size=d, num_decode_reqs=d, num_prefill_reqs=0,
                    num_prefill_tokens=0, k=k, k_next=k, table_version=version,
                    num_drafts=num_drafts, num_draft_tokens=k * d,
                    num_accepted_tokens=accepted[i], accepted_per_pos=per_pos[i],
                    kv_tokens=kv[i], ctx_len_mean=kv[i] / d, ctx_len_max=ctx_max[i],
                    step_latency_s=latencies[i], inter_step_s=inter_step, forced=forced[i],
                    ts_ns=self._epoch_ns + int(start * 1e9), finished_requests=leaving)
                if (seq0 + i) % self._backlog_check_steps == 0:
                    self._wait_for_sink(recorder)
        self._last_step_start_s = previous
        self.log.add_steps(starts, latencies, d, k, emitted[:taken], phases)
        if finish_step >= 0 and n_finished:
            self._finish(finished, t)
        self.clock_s = t
        self.steps = seq0 + taken
        if not started and want_at == taken - 1:
            i = taken - 1
            policy.on_step(self, StepStats(
                step_seq=self.steps - 1, t_s=starts[i], phase=phases[i], batch_size=d,
                num_decode_reqs=d, num_prefill_reqs=0, num_prefill_tokens=0, k=k, k_next=k,
                num_drafts=num_drafts, num_draft_tokens=k * d,
                num_accepted_tokens=accepted[i],
                accepted_per_pos=tuple(int(c) for c in per_pos[i]), kv_tokens=kv[i],
                step_latency_s=latencies[i], emitted_tokens=emitted[i],
                table_version=version))
        return started

    def _planned_run(self, t: float, policy: Policy, interval: int) -> bool:
        """Steps from `t`, whose start `run` took, while every request drafts one K and stays
        on its path for that K (`twin.paths`): a batch's decode sums per step are
        its requests' path rows added up, once per request for the whole run, so requests
        may finish and arrivals be admitted on the way (whole prompts only); the running
        requests are kept in Python until the run ends and `batch` is written back. Stops
        before a step whose start brings a new table or a chunked prompt (returns True:
        `run` hands that step to `_step`), after a step that chose another K, at the end of
        the run or after `_PLAN_STEPS`. Every step, record and draw is what `_step` would
        give."""
        switch = self.switch
        switch.apply_staged()
        b = self.batch
        n = b.n
        k = self._last_k_next
        ledger = self._ledger if self.recorder is not None else None
        ring = ledger.ring if ledger is not None else 0
        paths = None
        if (switch.explorer is None and n and self.steps >= self._plan_after
                and switch.lookup[min(n, switch.max_batch)] == k
                and (not ring or b.request_id[n - 1] - b.request_id[0] < ring)):
            paths = self._paths.get(k) or self._make_paths(k)
            rows = paths.index_of(b.acc_offset[:n] + b.generated[:n] - 1)
            if (rows < 0).any():  # some request drafted another K for a while
                paths = None
        if paths is None:
            if self.waiting:
                self._step(t, want_stats=False)
                return False
            return self._decode_run(t, policy, interval)
        plan = np.zeros((_PLAN_STEPS, PER_POS + k), dtype=np.int64)
        ends: dict[int, list[int]] = {}
        tracks: dict[int, tuple[int, int, bool, int]] = {}
        # the running requests in admission order
        running = {request_id: Row(*ints, *floats) for request_id, ints, floats in zip(
            b.request_id[:n].tolist(), b.ints[:INT_COLUMNS, :n].T.tolist(),
            b.floats[:, :n].T.tolist(), strict=True)}
        requests = paths.first_request[b.phase[:n]] + b.pool_index[:n]
        for request_id, row, request, fresh in zip(
                running, rows.tolist(), requests.tolist(), (b.generated[:n] == 1).tolist(),
                strict=True):
            self._track(plan, ends, tracks, paths, request_id, request, row, 0, fresh)
        recorder = self.recorder
        traffic = self.traffic
        waiting = self.waiting
        version = switch.version
        previous = self._last_step_start_s
        finished: list[tuple[float, float, float, int, int, int, int]] = []
        log = ([], [], [], [], [], [])  # the steps' RunLog columns
        starts, latencies, batch_sizes, k_nexts, emitted, phases = (c.append for c in log)
        taken = 0
        started = False
        for i in range(_PLAN_STEPS):
            if i:  # the start of the step, as `run` takes it
                if t >= self.end_s and (not self.drain or (not running and not waiting)):
                    break
                if not running and not waiting:
                    break
                for arrival in traffic.arrivals(t, len(running) + len(waiting)):
                    waiting.append(arrival)
                if switch.apply_staged() is not None:
                    started = True
                    break
            sums = plan[i].tolist()
            d = sums[DECODING]  # every running request decodes
            k_step = k if d else 0
            admitted: list[tuple[int, Row]] = []
            prefill_tokens = 0
            if waiting:
                whole = self._admit_whole(running, self.max_batched_tokens - k_step * d - d,
                                          ring)
                if whole is None:
                    started = True
                    break
                admitted = whole
                prefill_tokens = sum(request.prompt for _, request in admitted)
            batch_size = d + len(admitted)
            k_next = switch.k_for_step(batch_size)
            finishing = ends.pop(i, [])
            at_once = [request_id for request_id, request in admitted if request.output == 1]
            n_finished = len(finishing) + len(at_once)
            drafting = k_next > 0 and batch_size > n_finished
            kv = sums[CONTEXT]
            latency = self._latency(kv, d + k_step * d + prefill_tokens,
                                    k_next if drafting else 0)
            t_end = t + latency
            for request_id, request in admitted:
                request.first_token = t_end
                running[request_id] = request
            phase = traffic.phase_index(t)
            inter_step = t - previous if previous is not None else 0.0
            previous = t
            if recorder is not None:
                leaving = (self._planned_leaving(paths, tracks, finishing, ledger)
                           if finishing else ())
                recorder.record_step(
                    batch_size=batch_size, num_decode_reqs=d,
                    num_prefill_reqs=len(admitted), num_prefill_tokens=prefill_tokens,
                    k=k_step, k_next=k_next, table_version=version,
                    num_drafts=d if k_step else 0, num_draft_tokens=k_step * d,
                    num_accepted_tokens=sums[EMIT_FULL] - d,
                    accepted_per_pos=sums[PER_POS:] if k_step else (), kv_tokens=kv,
                    ctx_len_mean=kv / batch_size, ctx_len_max=sums[CONTEXT_MAX],
                    step_latency_s=latency, inter_step_s=inter_step,
                    forced=switch.step_forced, ts_ns=self._epoch_ns + int(t * 1e9),
                    finished_requests=leaving)
                if self.steps % self._backlog_check_steps == 0:
                    self._wait_for_sink(recorder)
            starts(t)
            latencies(latency)
            batch_sizes(batch_size)
            k_nexts(k_next)
            emitted(sums[EMITTED] + len(admitted))
            phases(phase)
            if n_finished:  # in admission order, as `_finish` logs them
                for request_id in finishing:
                    del tracks[request_id]
                for request_id in finishing + at_once:
                    request = running.pop(request_id)
                    finished.append((request.arrival, request.first_token, t_end,
                                     request.output, request_id, request.pool_index,
                                     request.phase))
            t = self.clock_s = t_end
            self.steps += 1
            self._last_step_start_s = previous
            self._last_k_next = k_next
            taken = i + 1
            if k_next != k:  # the next step verifies other drafts: off these paths
                break
            for request_id, request in admitted:
                if request.output > 1:
                    path = int(paths.first_request[request.phase]) + request.pool_index
                    self._track(plan, ends, tracks, paths, request_id, path,
                                int(paths.start[path]), i + 1, True)
        self.log.add_step_columns(*log)
        if finished:
            self.log.add_finished_rows(finished)
        self._end_plan(paths, tracks, running, taken, ledger)
        return started

    def _track(self, plan: np.ndarray, ends: dict[int, list[int]],
               tracks: dict[int, tuple[int, int, bool, int]], paths: Paths, request_id: int,
               request: int, row: int, step: int, fresh: bool) -> None:
        """Request `request_id` (path `request`, now at path row `row`) decodes from plan
        step `step` on: its rows go into the plan's sums, its last step into `ends`."""
        length = int(paths.stop[request]) - row
        span = min(length, _PLAN_STEPS - step)
        if span > 0:
            plan[step:step + span] += paths.sums[row:row + span]
            top = plan[step:step + span, CONTEXT_MAX]
            np.maximum(top, paths.context[row:row + span], out=top)
        if length <= _PLAN_STEPS - step:
            ends.setdefault(step + length - 1, []).append(request_id)
        tracks[request_id] = (row, step, fresh, request)

    def _admit_whole(self, running: dict[int, Row], budget: int, ring: int
                     ) -> list[tuple[int, Row]] | None:
        """Admit waiting requests as `_schedule_prefills` would, when every prompt admitted
        fits whole in this step's budget and the ledger's ring holds every running request
        apart; None (admitting nobody) otherwise. Returns (request id, request) per request
        admitted, in order; a planned run adds them to `running` once their step's end is
        known."""
        free = self.batch.capacity - len(running)
        prompts = []
        for _, phase, index in self.waiting:
            if len(prompts) >= free or budget <= 0:
                break
            prompt = self._pool_columns[phase][0][index]
            if prompt > budget:
                return None  # chunked: the next steps prefill it
            prompts.append(prompt)
            budget -= prompt
        if ring and prompts:
            oldest = next(iter(running)) if running else self._next_request_id
            if self._next_request_id + len(prompts) - 1 - oldest >= ring:
                return None
        admitted = []
        for prompt in prompts:
            arrival_s, phase, index = self.waiting.popleft()
            _, outputs, offsets = self._pool_columns[phase]
            admitted.append((self._next_request_id, Row(
                prompt, prompt, 1, outputs[index], self.pool_base[phase] + offsets[index],
                0, self._next_request_id, phase, index, arrival_s, math.nan)))
            self._next_request_id += 1
        return admitted

    def _planned_leaving(self, paths: Paths, tracks: dict[int, tuple[int, int, bool, int]],
                         finishing: list[int], ledger: RequestLedger | None) -> np.ndarray:
        """`RequestLedger.finish` rows of requests finishing in a planned run, in order."""
        pieces = []
        for number, request_id in enumerate(finishing):
            row, _, fresh, request = tracks[request_id]
            if fresh:  # every step on its path: the path's rows
                rows = paths.ledger_rows(request)
            else:
                assert ledger is not None
                paths.observe(ledger, np.array([request_id]), slice(row, paths.stop[request]))
                rows = ledger.finish([request_id])
            if number:
                rows = rows.copy()
                rows[:, 0] = number
            pieces.append(rows)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _end_plan(self, paths: Paths, tracks: dict[int, tuple[int, int, bool, int]],
                  running: dict[int, Row], taken: int, ledger: RequestLedger | None
                  ) -> None:
        """`batch` from the running requests after `taken` planned steps (tokens generated
        along their paths, drafts pending), and their steps so far in the ledger."""
        if taken < _PLAN_SHORT:  # planning costs more than it saves here: not for a while
            self._plan_after = self.steps + _PLAN_BACKOFF
        ids, firsts, counts = [], [], []
        for request_id, request in running.items():
            request.k_pending = self._last_k_next
            track = tracks.get(request_id)
            if track is not None and taken > track[1]:
                ids.append(request_id)
                firsts.append(track[0])
                counts.append(taken - track[1])
        if ids:
            first, steps = np.array(firsts), np.array(counts)
            for request_id, generated in zip(ids, paths.generated[first + steps].tolist(),
                                             strict=True):
                running[request_id].generated = generated
            if ledger is not None:
                ends = np.cumsum(steps)
                flat = np.arange(ends[-1]) + np.repeat(first - (ends - steps), steps)
                paths.observe(ledger, np.repeat(np.array(ids), steps), flat)
        b = self.batch
        b.n = n = len(running)
        if n:
            b.ints[:INT_COLUMNS, :n] = np.array(
                [request.ints() for request in running.values()], dtype=np.int64).T
            b.floats[:, :n] = np.array([(request.arrival, request.first_token)
                                        for request in running.values()]).T

    def _make_paths(self, k: int) -> Paths:
        if len(self._paths) >= _PATHS_KEPT:
            del self._paths[next(iter(self._paths))]
        next_at = self._next_at.get(k)
        if next_at is None:
            next_at = self._next_positions(k)
        paths = self._paths[k] = Paths(self.pools, self.acc_len, next_at, k,
                                       self.scenario.engine.max_k)
        return paths

    def _next_positions(self, k: int) -> np.ndarray:
        """acc_len position -> the position one step drafting `k` moves a request to; past
        the end, positions stay (only requests that already finished get there)."""
        size = len(self.acc_len)
        positions = np.arange(size + self.scenario.engine.max_k + 2, dtype=np.int64)
        positions[:size] += np.minimum(self.acc_len, k + 1)
        self._next_at[k] = positions
        return positions

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

    def _drop_unmatched_ngram(self, decoding: int, finished: np.ndarray) -> bool:
        """n-gram finds no match at some positions where nothing would be accepted: those
        requests propose no drafts for their next step (SpecDecode-Bench's match model).
        Returns whether any request still drafts."""
        b = self.batch
        rows = np.flatnonzero(~finished[:decoding])
        nothing = self.acc_len[b.acc_offset[rows] + b.generated[rows] - 1] == 1
        rows = rows[nothing]
        unmatched = self._match_rng.random(len(rows)) >= self._match_prob
        b.k_pending[rows[unmatched]] = 0
        return bool(np.any(b.k_pending[:decoding][~finished[:decoding]]))

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
