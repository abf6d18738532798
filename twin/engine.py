"""The twin: a discrete-event engine with vLLM 0.32's continuous batching and Dynamic-SD semantics.

`TwinEngine.run` steps the engine until the end of the run. Each step is vLLM's scheduler and
model runner step (`twin.step`); where the batch only decodes with one K, the fast paths
(`twin.fast_paths`) take many such steps at once with the same records and draws. A policy
sees the engine through `PolicyHooks`: `start` before the first step, `on_step` after every
`step_interval`-th one.
"""

from __future__ import annotations

import time
from typing import Protocol

from twin.fast_paths import FastPathEngine
from twin.step import StepStats
from twin.summary import RunLog

__all__ = ["PolicyHooks", "StepStats", "TwinEngine"]


class PolicyHooks(Protocol):
    """What `TwinEngine.run` calls on a policy (`twin.policies.Policy` has them all)."""

    step_interval: int
    """> 0: `on_step` is called after every `step_interval`-th step; 0: never."""

    def start(self, engine: TwinEngine) -> None: ...

    def on_step(self, engine: TwinEngine, step: StepStats) -> None: ...


class TwinEngine(FastPathEngine):
    """The simulated engine: `TwinEngine(scenario, switch).run(policy)` returns the run's log."""

    def run(self, policy: PolicyHooks) -> RunLog:
        """Step until the end of the run (and, with `drain`, until every request finished)."""
        policy.start(self)
        interval = policy.step_interval
        wall_start = time.monotonic()
        batch = self.batch
        # decode runs: whenever the step would only decode (paced runs step one by one);
        # planned runs when the policy does not look at steps
        runs = not self.realtime and self.uniform_drafts and interval != 1
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
            fast = not started and not self._prefilling
            if fast and plans:
                started, stats = self._planned_run(t, interval)
            elif fast and runs and not self.waiting:
                started, stats = self._decode_run(t, interval)
            else:  # one step, also where a run stopped at this step's start
                started = False
                stats = self._step(t, want_stats=interval > 0
                                   and (self.steps + 1) % interval == 0)
            if stats is not None:
                policy.on_step(self, stats)
        return self.log
