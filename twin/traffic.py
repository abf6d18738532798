"""When requests arrive and which ones: closed or open loop, phase by phase.

Closed loop (`concurrency`): at every step start the system is topped up to the phase's
concurrency, so a finished request is replaced when the step that finished it ends.
Open loop (`rate_rps`): a Poisson process whose rate is piecewise constant over the phases;
a gap that would cross a phase boundary is redrawn from the boundary (exact, by memorylessness).
With `max_concurrency` as well, arrivals wait at the client (in arrival order, each with its
phase's request) and are sent at a step start while fewer than that many are in the system,
as vLLM's `bench serve --max-concurrency` holds them; a sent request arrives when it is sent,
and those still held when their phase ends are dropped (that phase's client has ended).
"""

from __future__ import annotations

import bisect
import math
from itertools import accumulate

import numpy as np

from twin.config import PhaseConfig
from twin.workload import RequestPool

Arrival = tuple[float, int, int]
"""(arrival time s, phase index, index into that phase's pool)."""


class Traffic:
    def __init__(self, phases: tuple[PhaseConfig, ...], pools: list[RequestPool],
                 rng: np.random.Generator, *, end_s: float) -> None:
        self.phases = phases
        self.pools = pools
        self.rng = rng
        self.pick_rngs = rng.spawn(len(phases))
        """Which request arrives comes from its phase's own stream: under a closed loop a
        faster policy draws more requests in a phase, and with one shared stream every later
        phase would then serve other requests than a slower policy's run does, whose
        goodput differs by itself (docs/TUNING.md sizes that noise). Per phase, two
        policies' runs serve the same requests in the same order from each phase's start
        (common random numbers: a paired comparison of policies compares the policies, not
        the traffic)."""
        self.end_s = end_s
        self.held: list[Arrival] = []
        """Arrivals waiting at the client for a slot (phases with `max_concurrency`)."""
        self._load(phases)
        self.next_open_s = self._next_open_after(0.0)

    def set_phases(self, phases: tuple[PhaseConfig, ...], now_s: float) -> None:
        """Change the load from `now_s` on (the profiler sets each cell's concurrency so):
        the same number of phases, with the same pools; the next open-loop arrival is
        redrawn only where a rate changed."""
        if len(phases) != len(self.phases):
            raise ValueError(f"{len(phases)} phases in place of {len(self.phases)}")
        rates_changed = [p.rate_rps for p in phases] != [p.rate_rps for p in self.phases]
        self.phases = phases
        self._load(phases)
        if rates_changed:
            self.next_open_s = self._next_open_after(now_s)

    def _load(self, phases: tuple[PhaseConfig, ...]) -> None:
        """Per-phase lookups `arrivals` reads every step (set with the phases, never apart)."""
        self.starts = [0.0, *accumulate(p.duration_s for p in phases)][:-1]
        self._concurrency = [p.concurrency for p in phases]
        self._cap = [p.max_concurrency for p in phases]
        self._capped = any(cap is not None for cap in self._cap)

    def phase_index(self, t_s: float) -> int:
        """Phase in effect at `t_s`; the last phase lasts until the run ends."""
        if len(self.starts) == 1:
            return 0
        return max(0, min(bisect.bisect_right(self.starts, t_s) - 1, len(self.phases) - 1))

    def phase_end_s(self, index: int) -> float:
        return self.starts[index + 1] if index + 1 < len(self.phases) else self.end_s

    def arrivals(self, t_s: float, in_system: int) -> list[Arrival]:
        """New requests at step start `t_s`, given how many are running or waiting."""
        if t_s >= self.end_s:
            return []
        out: list[Arrival] = []
        while self.next_open_s <= t_s:
            arrival_s = self.next_open_s
            out.append(self._draw(arrival_s, self.phase_index(arrival_s)))
            self.next_open_s = self._next_open_after(arrival_s)
        if self._capped:
            out = self._release(t_s, in_system, out)
        index = self.phase_index(t_s)
        concurrency = self._concurrency[index]
        if concurrency is not None and concurrency - in_system - len(out) > 0:
            out.extend(self._draw(t_s, index) for _ in range(concurrency - in_system - len(out)))
        return out

    def _release(self, t_s: float, in_system: int, new: list[Arrival]) -> list[Arrival]:
        """Of the held and the new arrivals, those the client sends now (its cap is the
        phase's at `t_s`; without one, all); they arrive at `t_s`."""
        index = self.phase_index(t_s)
        self.held.extend(new)
        if self.held and self.held[0][1] != index:  # a phase's client ends with its phase
            self.held = [arrival for arrival in self.held if arrival[1] == index]
        cap = self._cap[index]
        count = len(self.held) if cap is None else max(0, min(len(self.held), cap - in_system))
        sent, self.held = self.held[:count], self.held[count:]
        return [(t_s, phase, index) for _, phase, index in sent]

    def next_event_s(self, t_s: float) -> float:
        """When an idle engine has something to do again: an arrival or a phase change."""
        index = self.phase_index(t_s)
        boundary = self.phase_end_s(index) if index + 1 < len(self.phases) else math.inf
        return min(self.next_open_s, boundary)

    def _draw(self, t_s: float, phase: int) -> Arrival:
        return (t_s, phase, int(self.pick_rngs[phase].integers(len(self.pools[phase]))))

    def _next_open_after(self, t_s: float) -> float:
        while t_s < self.end_s:
            index = self.phase_index(t_s)
            phase_end = self.phase_end_s(index)
            rate = self.phases[index].rate_rps
            if rate is not None:
                candidate = t_s + float(self.rng.exponential(1.0 / rate))
                if candidate < phase_end:
                    return candidate
            t_s = phase_end
        return math.inf
