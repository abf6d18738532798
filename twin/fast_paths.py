"""The twin's fast paths: many steps at once, with every step, record and draw `_step` gives.

Most steps only decode (no prompt to prefill, nobody waiting, one K for all): from one such
step on, `_decode_run` computes the steps up to the next one where a request finishes as
arrays over (steps, requests) — each request's tokens per step follow from its acc_len
chain alone — and then takes them one by one exactly as `run` and `_step` would (arrivals,
staged tables, latency and noise, telemetry), stopping where the batch would change. When
the policy never looks at steps, `_planned_run` goes further: every request stays on its
precomputed path for one K (`twin.paths`), so requests may finish and be admitted on the way.
"""

from __future__ import annotations

import math

import numpy as np

from producers.request_ledger import RequestLedger
from twin.batch import INT_COLUMNS, Row
from twin.paths import CONTEXT, CONTEXT_MAX, DECODING, EMIT_FULL, EMITTED, PER_POS, Paths
from twin.step import StepEngine, StepStats

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


class FastPathEngine(StepEngine):
    """`StepEngine` with decode runs and planned runs; `twin.engine.TwinEngine` picks one
    per step."""

    def _decode_run(self, t: float, interval: int) -> tuple[bool, StepStats | None]:
        """Steps from `t`, whose start `run` took, while every running request only decodes,
        all with the K proposed at the previous step: up to and including the first step in
        which a request finishes, a step whose start brings arrivals or a new table (not
        taken: returns True, and `run` hands that step to `_step`), the end of the run, or
        a step whose statistics the policy wants (returned with the flag, for `run` to hand
        to the policy). What each step does, and every draw, is what `_step` would do; the
        per-request arithmetic is done for all steps at once."""
        switch = self.switch
        switch.apply_staged()
        b = self.batch
        d = b.n
        k = self._last_k_next
        want_at = interval - 1 - self.steps % interval if interval > 0 else _RUN_STEPS
        if switch.explorer is not None or switch.lookup[min(d, switch.max_batch)] != k \
                or want_at == 0:
            return False, self._step(t, want_stats=want_at == 0)  # apply_staged finds none
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
            return started, StepStats(
                step_seq=self.steps - 1, t_s=starts[i], phase=phases[i], batch_size=d,
                num_decode_reqs=d, num_prefill_reqs=0, num_prefill_tokens=0, k=k, k_next=k,
                num_drafts=num_drafts, num_draft_tokens=k * d,
                num_accepted_tokens=accepted[i],
                accepted_per_pos=tuple(int(c) for c in per_pos[i]), kv_tokens=kv[i],
                step_latency_s=latencies[i], emitted_tokens=emitted[i],
                table_version=version)
        return started, None

    def _planned_run(self, t: float, interval: int) -> tuple[bool, StepStats | None]:
        """Steps from `t`, whose start `run` took, while every request drafts one K and stays
        on its path for that K (`twin.paths`): a batch's decode sums per step are
        its requests' path rows added up, once per request for the whole run, so requests
        may finish and arrivals be admitted on the way (whole prompts only); the running
        requests are kept in Python until the run ends and `batch` is written back. Stops
        before a step whose start brings a new table or a chunked prompt (returns True:
        `run` hands that step to `_step`), after a step that chose another K, at the end of
        the run or after `_PLAN_STEPS`. Every step, record and draw is what `_step` would
        give. Returns the flag and, where it hands over to `_decode_run`, that run's
        statistics."""
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
                return False, None
            return self._decode_run(t, interval)
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
        return started, None

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
