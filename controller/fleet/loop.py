"""The closed loop of one table key, for all its engines: profile, refit, guard, re-profile.

Fed the key's telemetry and the clock (`tick(now_s, records)`), it decides what the fleet
runs and says so through a `ControlChannel` (the tables topic, or the twin's engines in
memory): a fitted envelope goes through the loop's own `TableAgent.on_envelope` (validation,
versions) and is sent; sweeps are `force` controls (a re-profile's name its canaries) and a
`release`; the `Guardrail` watches every swap and a ROLL_BACK is sent as a new version that
restores the previous table; the `DriftDetector` emits `stale` and starts a re-profile. Time
is whatever the records say (telemetry time; virtual time in the twin), so the loop runs at
any speed; every wait is a deadline on that clock.

The re-profile after `stale`, and why each part (lengths in `LoopConfig`, measurements in
docs/TUNING.md):

- settle: the drift shows while the old traffic's requests still run, so the stale table
  runs on for `reprofile_settle_s`; that stretch, its one unforced run in the new regime, is
  the guardrail's baseline for the table the re-profile ends with (no watch when the
  confirmation ran the stale table's K: its mirrored blocks already compared the two);
- sweep: short blocks at every K, up and back down, measure what live steps censor
  (acceptance beyond the table's K, the cost of every K at the new load);
- confirmation: the K a fit of the sweep picks and its neighbours run for long blocks in
  mirrored order (a, b, c, c, b, a), because which requests a closed loop holds, and so what
  a K really emits per step, settles only over a request's lifetime, and between
  neighbouring K that is what decides;
- refit: the step models fit the confirmation's runs alone (the sweep's short blocks
  overrate the larger K's tokens per step), each K is priced at the context its own batch
  would hold, from every request that finished during the re-profile
  (`fitter.surface.context`); the table is published, under a guardrail watch, as soon as
  the confirmation ends (more of the stale table would leave the new one its batch to
  drain);
- restart, once: if the load, or the first position's acceptance at one K, moved during the
  confirmation, the K values it ran came from another regime.

About 60 s in all, paid once per drift; so the drift detector's window is long enough that
the workload's own wander does not start one, and for three minutes after a sweep it asks
acceptance for twice the shift (`DriftConfig.after_sweep_factor`).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from controller.drift import DriftDetector
from controller.engine.agent import Mode, TableAgent
from controller.fleet.channel import ControlChannel, clock_time
from controller.fleet.loop_config import LoopConfig
from controller.fleet.refit_gate import predicted_gain
from controller.fleet.sweep import (
    CONFIRM_WIDTH,
    Sweep,
    confirmation_k_values,
    first_position_acceptance,
)
from controller.guardrail import Guardrail, Verdict
from controller.status import StatusPublisher
from controller.steps import StepColumns
from controller.validation import EngineLimits
from schemas import DraftTable, TableControl, TableEnvelope
from schemas.control import new_control_id

log = logging.getLogger(__name__)

Fit = Callable[..., TableEnvelope]
"""fit(records, *, key, max_k, max_batch, startup_k_values, version, half_life_s, ...)."""

CHOSEN_AMONG_K = "chosen_among_k"
"""Provenance key of the refit that ends a re-profile: the K values its confirmation ran and
the table was chosen among (the drift detector's `confirmed` factor keys on it)."""

ROLLBACK_OF = "rollback_of"
"""Provenance key of an envelope that puts an earlier table back after a guardrail verdict:
the version it withdraws. A rollback is a new version, so a log replayed from the beginning
folds to the same table as one followed live."""

MIN_FIT_RECORDS = 200
"""Fewer step records than this make no fit: the surface has a dozen coefficients per K."""

MAX_PROFILE_STRETCH = 16
"""A cold key's profile repeats with blocks up to this many times longer until it holds
MIN_FIT_RECORDS: a slow engine (a few steps a second: a large model on few devices, or a CPU)
ran only a handful of steps per 2 s block, and its key got no first table at all. A
re-profile's blocks stretch at most as far (REPROFILE_STEPS)."""

REPROFILE_STEPS = 300
"""A re-profile's sweep, and then its confirmation, each last long enough to hold this many
steps of the engines they force, at their recent rate (1.5 x MIN_FIT_RECORDS: the rate moves
with the K forced). At a few steps a second, 1 s sweep blocks held 4-8 steps each, the
pick had no fit, and the re-profile ended with no table."""

RATE_WINDOW_S = 30.0
"""Telemetry seconds over which the forced engines' step rate is measured."""

OPERATOR_ACTIONS = frozenset({"pin", "unpin", "rollback"})
"""Controls only operators send (the loop sends force and release): it follows them."""


class LoopState(enum.Enum):
    PROFILING = "profiling"
    """Forced-K sweep on a cold key; ends with the first table."""
    LIVE = "live"
    """Following fitted tables; refits, exploration, guardrail and drift detection on."""
    REPROFILING = "reprofiling"
    """Drift was detected: a short forced sweep on the canaries, long runs at the K it
    points to and its neighbours, then a refit on the new regime only."""


class ClosedLoop:
    def __init__(self, channel: ControlChannel, limits: EngineLimits, status: StatusPublisher,
                 fit: Fit, config: LoopConfig | None = None, *, startup_table: DraftTable,
                 current: TableEnvelope | None = None, newest_version: int = 0,
                 log: tuple[TableEnvelope | TableControl, ...] = ()) -> None:
        """`channel`: where envelopes and controls go (the tables topic, or the twin's
        engines in memory); `startup_table`: what the key's engines run before any version;
        `current`, `newest_version`: what the tables topic already holds for the key (a
        restarted control service goes on from there, LIVE, rather than profiling again);
        `log`: the key's envelopes and operator controls on the topic, in order, folded as
        the engines folded them (a pin or an operator's rollback holds after a restart)."""
        self.channel = channel
        self.startup_table = startup_table
        self.limits = limits
        self.status = status
        self.fit = fit
        self.config = config or LoopConfig()
        self.agent = TableAgent(limits, {}, status.emit)
        """The fleet's table as the loop has decided it: versions, withdrawn ones, history."""
        self.guardrail = Guardrail(self.config.guardrail)
        self.drift = DriftDetector(limits.max_batch, self.config.drift)
        self.k_values = tuple(sorted(limits.startup_k_values))
        self.state = LoopState.PROFILING
        self._records: deque[pa.Table] = deque()
        self._data_since_s = 0.0
        self._active_version = 0
        self._forcing: tuple[str, ...] | None = None
        """Targets of the force the loop holds on engines (None: none)."""
        self._engines_seen: dict[str, float] = {}
        """Engine id -> telemetry time of its last step (who is live, for canaries)."""
        self._muted = False
        """Set while the loop takes in an envelope the engines already have."""
        self.clock_s = 0.0
        """The time of the last tick."""
        self._next_refit_s = 0.0
        self._cooldown_until_s = 0.0
        self._follow_up_s: float | None = None
        """When the follow-up refit after a re-profile is due (None: none pending)."""
        self._sweep: Sweep | None = None
        self._fitted_range: tuple[int, int] | None = None
        self._fitted_steps: tuple[int, StepColumns] | None = None
        """(version, the steps it was fitted on): the drift check's prediction error."""
        self._anchor: pa.Table | None = None
        """Records of the last (re-)profile sweep."""
        self._baseline_since_s: float | None = None
        """Where the last re-profile's settling stretch began: the stale table's baseline
        for the guardrail watch on the refit after it."""
        self.decisions: list[dict[str, Any]] = []
        """Every decision with its (telemetry) time, for benchmarks, tests and audits."""
        self.applied: list[tuple[float, int, DraftTable]] = []
        """(telemetry time, version, table) of each table the loop sent, in order."""
        if current is not None or newest_version > 0 or log:
            self._resume(current, newest_version, log)

    # ---- inputs ---------------------------------------------------------------------------
    def _resume(self, current: TableEnvelope | None, newest_version: int,
                log: tuple[TableEnvelope | TableControl, ...]) -> None:
        """Go on from the tables topic's state: the newest version's number, and the table
        the fleet runs (LIVE, with a refit due; no profile)."""
        agent = self.agent
        if log:
            emit, agent.emit = agent.emit, lambda *args, **fields: None  # said once, live
            try:
                for message in log:
                    if isinstance(message, TableEnvelope):
                        agent.on_envelope(message)
                    elif not message.targets:
                        agent.on_control(message)
            finally:
                agent.emit = emit
            self._active_version = agent.state.desired_version
        elif current is not None:
            agent.state.newest_version = current.version - 1
            agent.on_envelope(current)
            self._active_version = current.version
        agent.state.newest_version = max(newest_version, agent.state.newest_version)
        self.state = LoopState.LIVE

    @property
    def pinned(self) -> bool:
        """An operator pinned the fleet's table: the loop holds until the unpin."""
        return self.agent.state.mode is Mode.PINNED

    def start(self, now_s: float) -> None:
        """A cold key profiles every engine at once (no table to protect yet); a resumed
        loop refits after a fit window of live steps instead."""
        cfg = self.config
        if self.state is LoopState.LIVE:  # the fits' window may hold the lookback's steps
            self._next_refit_s = now_s + cfg.refit_interval_s
            desired = self.agent.desired()
            self.drift.set_envelope(self._active_version,
                                    None if desired is None else desired.surface, now_s)
            self._note(now_s, "resume", version=self._active_version)
            return
        self._start_profile(now_s, cfg.profile_block_s)

    def _start_profile(self, now_s: float, block_s: float, *,
                       fit_since_s: float | None = None) -> None:
        blocks: list[int | None] = [*self.k_values] * self.config.profile_rounds
        self._sweep = Sweep(blocks, [block_s] * len(blocks), now_s, fit_since_s=fit_since_s)
        self._note(now_s, "profile", blocks=len(blocks), block_s=block_s)

    def publish(self, envelope: TableEnvelope, now_s: float, *, guard: bool = True,
                after_drift: bool = False) -> None:
        """An envelope arrives from the tables topic (or the loop's own fit); `after_drift`:
        the loop's refit at the end of a re-profile (`Guardrail.arm`'s level shift).

        One from outside ends a re-profile in progress: the operator's (or a fleet
        fitter's) table runs now, under the guardrail, rather than after the sweep's refit
        replaces it unwatched."""
        accepted = self.agent.on_envelope(envelope)
        if accepted and self.state is not LoopState.LIVE:
            self._sweep = None
            self._release(now_s)
            self.state = LoopState.LIVE
            self._next_refit_s = now_s + self.config.refit_interval_s
            self._note(now_s, "reprofile_abandoned", version=envelope.version)
        self._sync(now_s, guard=guard, after_drift=after_drift)

    def observe_envelope(self, envelope: TableEnvelope, now_s: float) -> None:
        """An envelope on the tables topic that this loop did not send (an operator's, or
        another control replica's): the engines have it already; the loop takes it as the
        fleet's table, watched by the guardrail."""
        if envelope.version <= self.agent.state.newest_version:
            return  # one of ours, read back, or older
        self._muted = True
        try:
            self.publish(envelope, now_s)
        finally:
            self._muted = False
        # refused here or not, the number is taken: the next version the loop sends is newer
        self.agent.state.newest_version = max(self.agent.state.newest_version,
                                              envelope.version)

    def observe_control(self, control: TableControl, now_s: float) -> None:
        """An operator's pin, unpin or rollback, which the engines fold as well: the loop's
        table follows theirs. While pinned it holds (no force, refit or re-profile: the
        operator froze the fleet); after a rollback it waits out the guardrail's cooldown
        rather than send the withdrawn table straight back."""
        if control.action not in OPERATOR_ACTIONS:
            return  # force and release are the loop's own (or another replica's)
        if control.targets:  # a part of the fleet: the loop decides for all of it
            self._note(now_s, "operator_control_ignored", action=control.action,
                       reason="targeted", targets=list(control.targets))
            return
        self.agent.on_control(control)
        cfg = self.config
        if self.pinned and self.state is not LoopState.LIVE:
            self._sweep = None
            self._release(now_s)
            self.state = LoopState.LIVE
            self._note(now_s, "reprofile_abandoned", reason="pinned")
        if control.action == "rollback":
            self._cooldown_until_s = now_s + cfg.rollback_cooldown_s
            self._follow_up_s = None
            self._next_refit_s = max(self._next_refit_s, self._cooldown_until_s)
        elif control.action == "unpin":
            self._next_refit_s = now_s + cfg.refit_interval_s
        self._muted = True  # the engines folded it themselves
        try:
            self._sync(now_s, guard=False)
        finally:
            self._muted = False
        self._note(now_s, "operator", action=control.action,
                   version=self.agent.state.desired_version, pinned=self.pinned)

    def preload(self, records: pa.Table) -> None:
        """Steps from before the loop started (a restarted service's lookback): kept for
        the fits' window only, never shown to the guardrail or the drift detector."""
        if records.num_rows:
            self._records.append(records.sort_by("ts_ns"))

    def tick(self, now_s: float, records: pa.Table | None) -> None:
        """Once per control interval with the records recorded since the last tick."""
        self.clock_s = now_s
        if records is not None and records.num_rows:
            records = self._note_engines(records, now_s)
        if records is not None and records.num_rows:
            self._records.append(records)
            self._trim(now_s)
            if self.pinned:
                return
            steps = StepColumns.from_records(records)
            if self.state is LoopState.LIVE:
                self._watch(steps, now_s)
            else:  # a re-profile's settling stretch is the guardrail's baseline
                self.guardrail.observe(steps)
        if self.pinned:
            return
        if self.state is not LoopState.LIVE:
            self._advance_sweep(now_s)
        elif self._follow_up_s is not None and now_s >= self._follow_up_s:
            if self._refit(now_s, reason="follow_up", force=False,
                           min_gain=self.config.follow_up_min_gain, gain_z=0.0):
                self._follow_up_s = None
        elif now_s >= self._next_refit_s:
            # a key without a table yet (its profile could not fit) takes the first fit
            self._refit(now_s, reason="periodic", force=self.agent.state.newest_version == 0)

    # ---- live watching --------------------------------------------------------------------
    def _watch(self, steps: StepColumns, now_s: float) -> None:
        self.guardrail.observe(steps)
        verdict = self.guardrail.verdict(now_s)
        if verdict is Verdict.ROLL_BACK:
            evidence = dict(self.guardrail.last_evidence)
            self._note(now_s, "roll_back", **evidence)
            evidence.pop("old_version", None)
            evidence.pop("new_version", None)
            withdrawn = self.agent.state.desired_version
            self.agent.roll_back("guardrail", **evidence)
            self._roll_forward(now_s, withdrawn)
            self._cooldown_until_s = now_s + self.config.rollback_cooldown_s
            self._follow_up_s = None  # its bar would let the rolled-back table straight back
            self._next_refit_s = max(self._next_refit_s, self._cooldown_until_s)
            return
        if verdict is not Verdict.HOLD:
            self._note(now_s, verdict.value, **self.guardrail.last_evidence)
        report = self.drift.observe(steps)
        if report is None:
            return
        self.status.emit("stale", **report.fields())
        self._note(now_s, "stale", **report.fields())
        self.guardrail.reset_baseline()
        self._data_since_s = now_s
        if self.config.reprofile_on_stale:
            self._start_reprofile(now_s)
        else:
            self._next_refit_s = now_s + self.config.drift.window_s

    def _start_reprofile(self, now_s: float, *, restarted: bool = False) -> None:
        # acceptance beyond the table's K is censored, a new load range unobserved and a
        # new context's cost at other K unmeasured: only a sweep shows them
        cfg = self.config
        self._follow_up_s = None  # the re-profile's own refit schedules the next one
        ks = [*self.k_values, *self.k_values[::-1]]
        blocks: list[int | None] = [None, *ks]
        targets = self._canaries(now_s)
        block_s, confirm_s = self._sized_for_steps(now_s, targets)
        lengths = [cfg.reprofile_settle_s] + [block_s] * len(ks)
        self._sweep = Sweep(blocks, lengths, now_s, confirm=confirm_s > 0,
                            fit_since_s=now_s + cfg.reprofile_settle_s, restarted=restarted,
                            targets=targets, confirm_block_s=confirm_s)
        stretched = ({"block_s": round(block_s, 2), "confirm_block_s": round(confirm_s, 2)}
                     if (block_s, confirm_s) != (cfg.reprofile_block_s, cfg.confirm_block_s)
                     else {})
        self._note(now_s, "reprofile", targets=list(self._sweep.targets), **stretched)
        self._data_since_s = now_s + cfg.reprofile_settle_s
        self.state = LoopState.REPROFILING

    def _sized_for_steps(self, now_s: float, targets: tuple[str, ...]) -> tuple[float, float]:
        """The re-profile's sweep block and confirmation run lengths: the configured ones,
        longer (up to MAX_PROFILE_STRETCH times) where the engines to be forced ran too few
        steps a second for REPROFILE_STEPS in the sweep and in the confirmation."""
        cfg = self.config
        rate = self._step_rate(now_s, targets)
        if rate is None:
            return cfg.reprofile_block_s, cfg.confirm_block_s

        def sized(base_s: float, blocks: int) -> float:
            return min(base_s * MAX_PROFILE_STRETCH, max(base_s, REPROFILE_STEPS / (rate * blocks)))

        sweep_blocks = 2 * len(self.k_values)
        confirm_runs = 2 * min(len(self.k_values), CONFIRM_WIDTH)
        confirm_s = sized(cfg.confirm_block_s, confirm_runs) if cfg.confirm_block_s else 0.0
        return sized(cfg.reprofile_block_s, sweep_blocks), confirm_s

    def _step_rate(self, now_s: float, targets: tuple[str, ...]) -> float | None:
        """Steps per telemetry second of `targets` (every engine when empty) over the last
        RATE_WINDOW_S; None without steps to measure it on."""
        records = self._window(now_s, since_s=now_s - RATE_WINDOW_S)
        if records is None or records.num_rows < 2:
            return None
        if targets:
            records = records.filter(pc.is_in(records.column("engine_id"),
                                              value_set=pa.array(list(targets))))
            if records.num_rows < 2:
                return None
        first_s = records.column("ts_ns")[0].as_py() / 1e9
        span_s = now_s - max(first_s, now_s - RATE_WINDOW_S)
        return records.num_rows / span_s if span_s > 0 else None

    # ---- sweeps ---------------------------------------------------------------------------
    def _advance_sweep(self, now_s: float) -> None:
        sweep = self._sweep
        assert sweep is not None
        index = sweep.block_at(now_s)
        if index >= len(sweep.blocks) and sweep.confirm:
            self._plan_confirmation(sweep, now_s)
            index = sweep.block_at(now_s)
        if index >= len(sweep.blocks) and self._regime_moved(sweep, now_s):
            self._note(now_s, "reprofile_restarted", reason="the regime moved during it")
            self._start_reprofile(now_s, restarted=True)
            return
        if index >= len(sweep.blocks) and self._profile_too_short(sweep, now_s):
            return
        if index >= len(sweep.blocks):
            first = self.state is LoopState.PROFILING
            self._anchor = self._window(now_s, since_s=sweep.records_from_s)
            self._baseline_since_s = sweep.started_s
            self._sweep = None
            self._release(now_s)
            self.state = LoopState.LIVE
            self.drift.after_sweep(now_s)
            self._refit(now_s, reason="profile" if first else "stale", force=True,
                        k_values=sweep.confirmed or None,
                        steps_since_s=sweep.confirm_started_s if sweep.confirmed else None,
                        records_since_s=sweep.records_from_s)
            return
        if index == sweep.index:
            return
        sweep.index = index
        if index == 1 and sweep.blocks[0] is None and sweep.fit_since_s is not None:
            # the settling stretch ran long if its tick came late: the fits start where
            # the first forced block really does (a longer profile has none: its fits keep
            # the first run's records)
            sweep.fit_since_s = sweep.started_s + sweep.late_s + sweep.block_s[0]
            self._data_since_s = max(self._data_since_s, sweep.fit_since_s)
        k = sweep.blocks[index]
        if k is None:
            # the guardrail's baseline for the refit to come is this stretch, not what ran
            # before the drift showed
            self.guardrail.reset_baseline()
            self._release(now_s)
        else:
            block_end_s = (sweep.started_s + sweep.late_s
                           + float(np.sum(sweep.block_s[:index + 1])))
            self._force(DraftTable.from_vllm([[1, self.limits.max_batch, k]]), now_s,
                        until_s=block_end_s + self.config.force_grace_s,
                        targets=sweep.targets)

    def _profile_too_short(self, sweep: Sweep, now_s: float) -> bool:
        """A cold key's profile that ended with too few records for a fit runs again, its
        blocks longer by the shortfall (the first run's records are kept for the fit): a
        first table within about a minute even at a few steps a second."""
        if self.state is not LoopState.PROFILING:
            return False
        records = self._window(now_s, since_s=sweep.records_from_s)
        held = 0 if records is None else records.num_rows
        block_s = sweep.block_s[0]
        longest = self.config.profile_block_s * MAX_PROFILE_STRETCH
        if held >= MIN_FIT_RECORDS or block_s >= longest:
            return False
        # sized for twice the minimum over both runs, at the rate the first one ran
        stretch = min(longest, block_s * max(1.0, (2 * MIN_FIT_RECORDS - held) / max(held, 1)))
        self._note(now_s, "profile_extended", records=held, block_s=round(stretch, 2))
        self._start_profile(now_s, stretch, fit_since_s=sweep.records_from_s)
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
        self._note(now_s, "confirm", k_values=list(sweep.confirmed))

    def _stage_interim(self, now_s: float, *, since_s: float) -> None:
        """A canary re-profile's sweep, fitted, for the engines it does not force: they leave
        the stale table now, not after the confirmation (a minute or more of the phase on
        three engines of four); the confirmation's refit replaces it. A key whose canary is
        all of it has no engine to serve, and publishes none."""
        records = self._window(now_s, since_s=since_s)
        if records is None or records.num_rows < MIN_FIT_RECORDS:
            return
        version = self.agent.state.newest_version + 1
        envelope = self._fit(records, now_s, reason="interim", version=version,
                             half_life_s=None, tolerance=self.config.tolerance,
                             k_values=self.k_values)
        if envelope is None or not self.agent.on_envelope(envelope):
            return
        self._note(now_s, "interim", version=version, records=records.num_rows)
        self._sync(now_s, guard=False)

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
        records = self._window(now_s, since_s=sweep.records_from_s)
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
        records = self._window(now_s, since_s=since_s)
        if records is None or records.num_rows < MIN_FIT_RECORDS:
            return None
        envelope = self._fit(records, now_s, reason="confirm", version=1, half_life_s=None,
                             tolerance=0.0, k_values=self.k_values)
        if envelope is None:
            return None
        batch = records.column("batch_size").to_numpy()
        median = int(np.clip(np.median(batch), 1, self.limits.max_batch))
        k = envelope.table.k_for(median)
        return k if k in self.k_values else None

    # ---- fitting --------------------------------------------------------------------------
    def _refit(self, now_s: float, *, reason: str, force: bool,
               k_values: tuple[int, ...] | None = None, steps_since_s: float | None = None,
               records_since_s: float | None = None, min_gain: float | None = None,
               gain_z: float | None = None) -> bool:
        """Fit, derive, publish if forced or worth it (`min_gain` and `gain_z` default to
        the config's); False when held back (a rollback's cooldown, a guardrail watch's
        hold) before fitting. `k_values` limits the table's K (the
        confirmed ones after a re-profile: a K beyond them is an extrapolation of the mixture
        the confirmation's batches were fitted on). `steps_since_s`: the step models fit
        only the steps from there on, and the requests that finished since
        `records_since_s` price each K's context (a re-profile's end: its sweep's 1 s
        blocks show each K on the batch the K before it left behind, and overrate the larger
        K's tokens per step, but every request it saw finish says what it needs at each
        K)."""
        cfg = self.config
        self._next_refit_s = now_s + cfg.refit_interval_s
        started = self.guardrail.watch_started_s
        watching = started is not None and now_s - started < cfg.watch_hold_s
        if not force and (now_s < self._cooldown_until_s or watching):
            return False
        fit_options: dict[str, Any] = {}
        if steps_since_s is None:
            records = self._fit_records(now_s)
        else:
            records = self._window(now_s, since_s=min(steps_since_s,
                                                       records_since_s or steps_since_s))
            fit_options["steps_since_ns"] = int(steps_since_s * 1e9)
        if records is None or records.num_rows < MIN_FIT_RECORDS:
            return True
        version = self.agent.state.newest_version + 1
        envelope = self._fit(records, now_s, reason=reason, version=version,
                             half_life_s=None if reason == "profile" else cfg.half_life_s,
                             tolerance=cfg.tolerance, k_values=k_values or self.k_values,
                             provenance={CHOSEN_AMONG_K: list(k_values)} if k_values else {},
                             **fit_options)
        if envelope is None:
            return True
        batch = records.column("batch_size").to_numpy().astype(np.int64)
        current = self._running_table()
        gain, stderr = predicted_gain(envelope, current, batch[-2000:])
        self._note(now_s, "refit", reason=reason, version=version, gain=round(gain, 4),
                   gain_stderr=round(stderr, 4), records=records.num_rows)
        min_gain = cfg.min_gain if min_gain is None else min_gain
        gain_z = cfg.gain_z if gain_z is None else gain_z
        if not force and (gain < min_gain or gain < gain_z * stderr):
            return True
        low, high = (int(v) for v in np.percentile(batch, [1, 99]))
        self._fitted_range = (max(low, 1), max(high, 1))
        self._fitted_steps = (version, StepColumns.from_records(records))
        vetted = (k_values is not None and steps_since_s is not None
                  and _ran_against(current, k_values, records, steps_since_s))
        if vetted:
            self._note(now_s, "unwatched", version=version, reason="the confirmation ran "
                       "the replaced table's K beside the new pick")
        self.publish(envelope, now_s, guard=reason != "profile" and not vetted,
                     after_drift=reason == "stale")
        if reason == "stale" and cfg.follow_up_s > 0:
            self._follow_up_s = now_s + cfg.follow_up_s
        return True

    def _fit(self, records: pa.Table, now_s: float, *, reason: str, version: int,
             half_life_s: float | None, tolerance: float, k_values: tuple[int, ...],
             provenance: dict[str, Any] | None = None, **fit_options: Any,
             ) -> TableEnvelope | None:
        """The fitter on `records`, choosing among `k_values`; None (and a `fit_failed`
        decision) when the records cannot be fitted."""
        try:
            return self.fit(records, key=self.limits.key, max_k=self.limits.max_k,
                            max_batch=self.limits.max_batch, startup_k_values=k_values,
                            version=version, half_life_s=half_life_s,
                            now_ns=int(now_s * 1e9), tolerance=tolerance,
                            fewest_ranges=self.config.fewest_ranges,
                            provenance={"reason": reason, **(provenance or {})},
                            **fit_options)
        except (ValueError, np.linalg.LinAlgError) as exc:
            self._note(now_s, "fit_failed", reason=reason, error=str(exc))
            return None

    def _window(self, now_s: float, since_s: float | None = None) -> pa.Table | None:
        if not self._records:
            return None
        cutoff = max(now_s - self.config.fit_window_s, self._data_since_s)
        if since_s is not None:
            cutoff = since_s
        table = pa.concat_tables(self._records)
        return table.filter(pc.greater_equal(table.column("ts_ns"), int(cutoff * 1e9)))

    def _fit_records(self, now_s: float) -> pa.Table | None:
        """The recent window plus the last sweep's records: live steps only show the
        table's K, the sweep anchors the fit at every other K until the next sweep."""
        recent = self._window(now_s)
        anchor = self._anchor
        if anchor is None or recent is None or recent.num_rows == 0:
            return recent
        first_ns = recent.column("ts_ns")[0].as_py()
        older = anchor.filter(pc.less(anchor.column("ts_ns"), first_ns))
        return pa.concat_tables([older, recent]) if older.num_rows else recent

    def _trim(self, now_s: float) -> None:
        horizon_ns = int((now_s - self.config.fit_window_s) * 1e9)
        while self._records and self._records[0].column("ts_ns")[-1].as_py() < horizon_ns:
            self._records.popleft()

    # ---- the engines ----------------------------------------------------------------------
    def _running_table(self) -> DraftTable:
        """What the key's unforced engines run: the desired version's table."""
        desired = self.agent.desired()
        return self.startup_table if desired is None else desired.table

    def _sync(self, now_s: float, *, guard: bool, after_drift: bool = False) -> None:
        """Send the agent's desired table if it is not the one the engines were sent."""
        desired = self.agent.desired()
        version = 0 if desired is None else desired.version
        if version == self._active_version:
            return
        if desired is not None and not self._muted:
            self.channel.send(desired)
        previous = self._active_version
        self._active_version = version
        table = self._running_table()
        self.applied.append((now_s, version, table))
        watch = None
        if guard and previous != 0:
            self.guardrail.arm(version, previous, now_s, after_drift=after_drift,
                               baseline_since_s=self._baseline_since_s if after_drift else None)
            watch = "after_drift" if after_drift else "swap"
        else:
            self.guardrail.disarm()
        # the refit that ends a re-profile was chosen among the K its confirmation ran
        confirmed = (after_drift and desired is not None
                     and CHOSEN_AMONG_K in desired.provenance)
        fitted = self._fitted_steps
        self.drift.set_envelope(version, None if desired is None else desired.surface, now_s,
                                fitted_batch_range=self._fitted_range, confirmed=confirmed,
                                fit_steps=fitted[1] if fitted and fitted[0] == version else None)
        self._note(now_s, "stage", version=version, table=table.to_vllm(), watch=watch)

    def _roll_forward(self, now_s: float, withdrawn: int) -> None:
        """After the agent withdrew `withdrawn`: the table it went back to, sent as a new
        version (engines never walk back through a log; replaying it gives the same table)."""
        back = self.agent.desired()
        version = self.agent.state.newest_version + 1
        created_at = clock_time(now_s).isoformat()
        if back is None:  # the startup table, which engines run without an envelope
            envelope = TableEnvelope(
                key=self.limits.key, version=version, table=self.startup_table,
                startup_k_values=self.k_values, max_batch=self.limits.max_batch,
                created_at=created_at, provenance={ROLLBACK_OF: withdrawn, "restores": 0})
        else:
            envelope = dataclasses.replace(
                back, version=version, signature=None, created_at=created_at,
                provenance={**back.provenance, ROLLBACK_OF: withdrawn,
                            "restores": back.version})
        self.agent.on_envelope(envelope)
        self._sync(now_s, guard=False)

    def _force(self, table: DraftTable, now_s: float, *, until_s: float,
               targets: tuple[str, ...]) -> None:
        self.channel.send(TableControl(
            key=self.limits.key, action="force", version=None,
            issued_at=clock_time(now_s).isoformat(), control_id=new_control_id(),
            issued_by="tabletune-control", table=table,
            expires_at=clock_time(until_s).isoformat(), targets=targets))
        self._forcing = targets

    def release_forces(self) -> None:
        """Before the loop stops: engines go back to the current table now, not at expiry."""
        self._release(self.clock_s)

    def _release(self, now_s: float) -> None:
        if self._forcing is None:
            return
        self.channel.send(TableControl(
            key=self.limits.key, action="release", version=None,
            issued_at=clock_time(now_s).isoformat(), control_id=new_control_id(),
            issued_by="tabletune-control", targets=self._forcing))
        self._forcing = None

    def _note_engines(self, records: pa.Table, now_s: float) -> pa.Table:
        """Remember who stepped; during a re-profile keep only its canaries' steps (the
        others run the current table, which the sweep's fits must not mix in)."""
        engines = records.column("engine_id")
        for engine in pc.unique(engines).to_pylist():
            self._engines_seen[engine] = now_s
        sweep = self._sweep
        if sweep is None or not sweep.targets:
            return records
        return records.filter(pc.is_in(engines, value_set=pa.array(sweep.targets)))

    def _canaries(self, now_s: float) -> tuple[str, ...]:
        """The engines a re-profile forces: `canary_share` of the live ones, at least one,
        the same ones each time while they live; all of them (no targets) for one engine."""
        horizon = now_s - self.config.engine_idle_s
        live = sorted(e for e, seen in self._engines_seen.items() if seen >= horizon)
        if len(live) <= 1:
            return ()
        count = max(1, int(len(live) * self.config.canary_share))
        return tuple(live[:count])

    def _note(self, now_s: float, what: str, **fields: Any) -> None:
        """Keep the decision and log it at INFO as it is taken, the whole of it under the
        record's `decision` attribute (`tabletune control --decisions` streams those)."""
        entry = {"t_s": round(now_s, 3), "what": what, **fields}
        self.decisions.append(entry)
        if log.isEnabledFor(logging.INFO):
            log.info("%s: %s at %.1f s %s", self.limits.key, what, now_s, fields,
                     extra={"decision": {"key": str(self.limits.key), **entry}})


def _ran_against(current: DraftTable, k_values: tuple[int, ...], records: pa.Table,
                 since_s: float) -> bool:
    """Whether a re-profile's confirmation ran `current`'s K (at the batch size it served
    most) among `k_values`: the refit then chose against it in mirrored blocks of one
    stretch, and a before/after watch against the settling stretch is the weaker evidence
    (after a load jump goodput moves by more than a table does: docs/TUNING.md)."""
    steps = records.filter(pc.greater_equal(records.column("ts_ns"), int(since_s * 1e9)))
    if steps.num_rows == 0:
        return False
    batch = steps.column("batch_size").to_numpy().astype(np.int64)
    return current.k_for(int(np.median(batch))) in k_values
