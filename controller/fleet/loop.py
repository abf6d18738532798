"""The closed loop of one table key, for all its engines: profile, refit, guard, re-profile.

Fed the key's telemetry and the clock (`tick(now_s, records)`), it decides what the fleet
runs and says so through a `ControlChannel` (the tables topic, or the twin's engines in
memory): a fitted envelope goes through the loop's own `TableAgent.on_envelope` (validation,
versions) and is sent; sweeps are `force` controls (a re-profile's name its canaries) and a
`release`; the `Guardrail` watches every swap and a ROLL_BACK is sent as a new version that
restores the previous table; the `DriftDetector` emits `stale` and starts a re-profile. Time
is whatever the records say (telemetry time; virtual time in the twin), so the loop runs at
any speed; every wait is a deadline on that clock.

`ClosedLoop` is the state machine (`LoopState`) and the refit schedule; its roles are objects
of their own: the `RecordWindow` of telemetry the fits read, the `SweepPlanner` of the
(re-)profile's forced blocks, the `Publisher` that sends tables and forces, the
`ConflictWatch` that keeps steps sent in two different records out of every fit (and says
so on the status topic), and the `DecisionLog` of every decision taken.

The re-profile after `stale` probes what the drift hides (lengths in `LoopConfig`,
measurements in docs/TUNING.md), on the canaries (`canary_share` of the live engines; a
one-engine key's only engine):

- settle: the drift shows while the old traffic's requests still run, so the stale table
  runs on for `reprofile_settle_s`; that stretch, its one unforced run in the new regime, is
  the guardrail's baseline for the table the re-profile ends with;
- blocks of `probe_block_s` at what the drift hides, the table between them
  (`sweep_planner.Hidden`): acceptance that rose hides the positions above the table's K (one
  block at the largest K); a load or step time that moved hides every K's cost there (the
  largest and the smallest K); acceptance that fell hides nothing (no block: decision
  `settle_refit`);
- the table until the steps since the drift make a fit, then blocks at the K that fit would
  run and its neighbours, where the new load has too few steps of them;
- refit: on every engine's steps since the drift (the engines off the canaries ran the table
  all along), step times at the machine's steady speed (`fitter.steady_speed`); published
  under a guardrail watch when its gain is clear of its error, else the table settles.

About 30 s from the drift to the table. A one-engine key's blocks take at most `probe_share`
of any ten minutes (`forced_budget.ForcedBudget`): all of its traffic pays for them.

With `probe_block_s` 0 the re-profile is the canaries' sweep instead, about a minute: short
blocks at every K up and back down, then the K a fit of them picks and its neighbours in long
runs in mirrored order (a, b, c, c, b, a: between neighbouring K what decides settles only
over a request's lifetime), the engines off the canaries on a table fitted to the sweep
meanwhile, then the refit on the long runs alone; restarted once if the load, or the first
position's acceptance at one K, moved during the runs.

For three minutes after any re-profile the drift detector asks acceptance for twice the
shift (`DriftConfig.after_sweep_factor`).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numpy.typing import NDArray

from controller.drift import DriftDetector, DriftReport
from controller.engine.agent import Mode, TableAgent
from controller.fleet.channel import ControlChannel, clock_time
from controller.fleet.conflict_watch import ConflictWatch
from controller.fleet.decisions import Decision, DecisionLog, What
from controller.fleet.key_fit import Fit, KeyFitter, fittable
from controller.fleet.knowledge_event import EVENT as KNOWLEDGE_EVENT
from controller.fleet.knowledge_event import KeyMemory, knowledge_fields
from controller.fleet.latency_knowledge import LatencyKnowledge
from controller.fleet.loop_config import LoopConfig
from controller.fleet.publisher import CHOSEN_AMONG_K, ISSUED_BY, Publisher
from controller.fleet.record_window import RecordWindow
from controller.fleet.refit_gate import (
    k_shift,
    load_moved,
    measured_load,
    own_steps_miss,
    predicted_gain,
    running_unmeasured,
)
from controller.fleet.regimes import (
    RECALL_TRUST_S,
    SIGNATURE_S,
    Regime,
    RegimeMemory,
    Signature,
    within,
)
from controller.fleet.sweep_planner import Hidden, SweepPlanner, SweepProgress
from controller.guardrail import Guardrail, Verdict
from controller.status import StatusPublisher
from controller.steps import StepColumns
from controller.validation import EngineLimits
from fitter.steady_speed import at_steady_speed
from schemas import DraftTable, TableControl, TableEnvelope

__all__ = ["CHOSEN_AMONG_K", "OPERATOR_ACTIONS", "ClosedLoop", "Fit", "LoopState", "log"]

log = logging.getLogger(__name__)
"""Every decision is logged here at INFO (`tabletune control` prints and files them)."""

SWEEP_REASONS = frozenset({"profile", "stale"})
"""The refits at a sweep's end: their records hold every K at the sweep's load, which the
latency knowledge keeps."""
UNWATCHED_REASONS = frozenset({"profile", "recall"})
"""Refits published without a guardrail watch: a cold key has no table to protect, and a
recalled regime's table was watched when it was first measured."""
FOLLOWED_UP_REASONS = frozenset({"stale"})
"""Refits followed by one on the live steps at their table (`LoopConfig.follow_up_s`). Not a
recall's: its table came from a whole sweep, and a follow-up's gate, with no error bar, swapped
it on noise (twin, n-gram chat's return: K3 to K4 on a 0.4% gain with a 2.8% error, held by
the periodic refits' error bars 1.5% under the best K for the rest of the phase)."""
UNMEASURED_SPAN_S = 5.0
"""A load is read over this much of the newest telemetry to be called unmeasured: long
enough that a burst of arrivals is not a load, short beside a phase of traffic."""
UNMEASURED_MIN_STEPS = 20
"""... and over at least this many steps (a slow engine's 5 s at 16 requests hold 25)."""
HINT_HOLD_S = 5.0
"""The drift detector's fast hints (`DriftReport.fast`) recall a regime only once they have
come for this long (telemetry time): a switch holds, a wander passes. Twin, chat-code-chat
n-gram at 48 users, seed 56: code's acceptance fell 28% over ten seconds, hinted for 3 s,
and the first hint recalled chat's table (23 s of K2 in code, 1.7% of the phase). Then the
first hint whose newest steps match a regime recalls it: held on the match instead, a
return to GSM8K first matched 15 s after its hints began, and a refit published first."""
HINT_GAP_S = 2.0
"""... and a run of hints breaks where none came for this long: the detector tests a chunk
a second, and a tick may close none (a service's ticks follow its polls)."""
REFIT_SPACING_STEP = 2.0
"""A held periodic refit multiplies the wait for the next by this: a 30 s wait reaches
240 s at the third held refit, three minutes after the first."""
OPERATOR_ACTIONS = frozenset({"pin", "unpin", "rollback"})
"""Controls only operators send (the loop sends force and release): it follows them."""


class LoopState(enum.Enum):
    PROFILING = "profiling"
    """Forced-K sweep on a cold key; ends with the first table."""
    LIVE = "live"
    """Following fitted tables; refits, exploration, guardrail and drift detection on."""
    REPROFILING = "reprofiling"
    """Drift was detected: short blocks on the canaries (a one-engine key: its only engine)
    at the K that show what the drift hid, then the refit on the new regime only (with
    `probe_block_s` 0: a sweep of every K and long runs at the K it points to)."""


class ClosedLoop:
    """One key's loop: the state it is in, when it refits, and the roles it conducts."""

    def __init__(self, channel: ControlChannel, limits: EngineLimits, status: StatusPublisher,
                 fit: Fit, config: LoopConfig | None = None, *, startup_table: DraftTable,
                 current: TableEnvelope | None = None, newest_version: int = 0,
                 log: tuple[TableEnvelope | TableControl, ...] = (),
                 memory: KeyMemory | None = None,
                 issued_by: str = ISSUED_BY) -> None:
        """`channel`: where envelopes and controls go (the tables topic, or the twin's
        engines in memory); `startup_table`: what the key's engines run before any version;
        `current`, `newest_version`: what the tables topic already holds for the key (a
        restarted control service goes on from there, LIVE, rather than profiling again);
        `log`: the key's envelopes and operator controls on the topic, in order, folded as
        the engines folded them (a pin or an operator's rollback holds after a restart);
        `memory`: the latency knowledge and regimes an earlier owner of the key last
        published (a regime whose table is not in `log`, or was withdrawn, is left out);
        `issued_by`: who its force and release controls say sent them."""
        self.channel = channel
        self.startup_table = startup_table
        self.limits = limits
        self.status = status
        self.config = config or LoopConfig()
        self.agent = TableAgent(limits, {}, status.emit)
        """The fleet's table as the loop has decided it: versions, withdrawn ones, history."""
        self.guardrail = Guardrail(self.config.guardrail)
        self.drift = DriftDetector(limits.max_batch, self.config.drift)
        self.k_values = tuple(sorted(limits.startup_k_values))
        self.state = LoopState.PROFILING
        self.clock_s = 0.0
        """The time of the last tick."""
        # the module's `log` (the parameter of that name is the topic's)
        self._decisions = DecisionLog(str(limits.key), logging.getLogger(__name__))
        self.window = RecordWindow(self.config.fit_window_s)
        self.conflicts = ConflictWatch(status)
        """Steps sent in two different records under one engine id, left out of the fits."""
        self.knowledge = LatencyKnowledge(None if memory is None else memory.cells)
        """The step times the loop's sweeps measured: a load that returns is measured."""
        self.fitter = KeyFitter(fit, limits, self.config.fewest_ranges, self._decisions,
                                self.conflicts, self.config.merge_z, self.knowledge,
                                budgets=self.config.budgets)
        self.publisher = Publisher(channel, self.agent, limits, startup_table, self.guardrail,
                                   self.drift, self._decisions, issued_by=issued_by)
        self.planner = SweepPlanner(self.config, limits, self.window, self.fitter,
                                    self.publisher, self.guardrail, self._decisions)
        self._next_refit_s = 0.0
        self._refit_wait_s = self.config.refit_interval_s
        """The wait before the next periodic refit (`_space_out_refits`) ..."""
        self._refit_wait_since_s = -math.inf
        """... and when it was last brought back to one interval (`_reset_refit_wait`)."""
        self._cooldown_until_s = 0.0
        self.regimes = RegimeMemory()
        """The traffic each re-profile measured: a regime that returns is recalled."""
        self._recalled_version = -1
        """The version the last recall published, and when (`_recall`)."""
        self._recalled_s = -math.inf
        self._table_regime: Regime | None = None
        """The regime the fleet's table was fitted on (a sweep's or a recall's), which a
        drift away from it never recalls."""
        self._left_regime = False
        """An acceptance or load drift away from `_table_regime` recalled nothing: the next
        table the loop fits and publishes (not recalled) reads the traffic it moved to, and
        from then that regime may be recalled again."""
        self._follow_up_s: float | None = None
        """When the follow-up refit after a re-profile is due (None: none pending)."""
        self._unmeasured_version = -1
        """The table version whose load the loop last found unmeasured (`_unmeasured_load`)."""
        self._judge_probe = False
        """Whether the running probe's refit is judged (`_refit(judged=...)`): every probe's
        but a coverage drift's."""
        self._hints: tuple[float, float] | None = None
        """When the drift detector's current run of fast hints began, and its last hint."""
        self._resumed_report: DriftReport | None = None
        """What the steps before a resumed loop started said of its table: acted on at the
        first tick, once live steps name the engines (`_resume_watch`)."""
        folded = [m for m in log if not (isinstance(m, TableControl) and m.action == "claim")]
        if current is not None or newest_version > 0 or folded:  # LIVE, with a refit due
            self.publisher.resume(current, newest_version, log)
            self.state = LoopState.LIVE
        if memory is not None:
            state = self.agent.state
            self.regimes.restore([r for r in memory.regimes if r.records is not None or (
                r.version in state.accepted and r.version not in state.withdrawn)])

    @property
    def fit(self) -> Fit:
        """The fitter (a benchmark may wrap it once the loop is built)."""
        return self.fitter.fit

    @fit.setter
    def fit(self, fit: Fit) -> None:
        self.fitter.fit = fit

    @property
    def decisions(self) -> list[Decision]:
        """Every decision with its (telemetry) time, for benchmarks, tests and audits."""
        return self._decisions.taken

    @property
    def applied(self) -> list[tuple[float, int, DraftTable]]:
        """(telemetry time, version, table) of each table the loop sent, in order."""
        return self.publisher.applied

    @property
    def pinned(self) -> bool:
        """An operator pinned the fleet's table: the loop holds until the unpin."""
        return self.agent.state.mode is Mode.PINNED

    # ---- inputs ---------------------------------------------------------------------------
    def start(self, now_s: float) -> None:
        """A cold key profiles every engine at once (no table to protect yet); a resumed
        loop refits after a fit window of live steps instead, and judges the table from
        the steps before it started (`_resume_watch`)."""
        cfg = self.config
        if self.state is LoopState.LIVE:  # the fits' window may hold the lookback's steps
            self._next_refit_s = now_s + cfg.refit_interval_s
            self._resume_watch(now_s)
            self._decisions.note(now_s, What.RESUME, version=self.publisher.active_version,
                                 knowledge_cells=len(self.knowledge.cells),
                                 regimes=len(self.regimes))
            return
        self.planner.start_profile(now_s, cfg.profile_block_s)

    def _resume_watch(self, now_s: float) -> None:
        """A resumed loop's drift detector watches the load past what the table's fit
        measured (`measured_load`), as a live table's does. Its reference is the last
        `reference_s` of the steps from before the loop started, where they hold `min_steps`
        of the running version: a replica that takes a key over in a drift judges the table
        at its first tick, where a reference of live steps takes 22 s and learns the drift
        as the table's own misfit."""
        drift = self.config.drift
        desired = self.agent.desired()
        version = self.publisher.active_version
        measured = measured_load(desired)
        span_s = drift.warmup_s + drift.reference_s
        recent = self.window.window(now_s, since_s=now_s - span_s)
        own: StepColumns | None = None  # the table's steps: a dead owner's forced blocks are not
        if recent is not None:
            steps = StepColumns.from_records(recent)
            steps = steps.select((steps.version == version) & ~steps.forced)
            own = steps if len(steps) >= drift.min_steps else None
        # not from before the table ran: its warm-up then skips what the last one left
        since_s = now_s if own is None else max(now_s - span_s, float(own.t_s.min()))
        self.drift.set_envelope(version, None if desired is None else desired.surface, since_s,
                                fitted_batch_range=(None if measured is None
                                                    else (1, math.ceil(measured))),
                                confirmed=(desired is not None
                                           and CHOSEN_AMONG_K in desired.provenance),
                                budget=desired is not None and desired.budget is not None)
        if own is not None:
            self._resumed_report = self.drift.observe(own)

    def publish(self, envelope: TableEnvelope, now_s: float, *, guard: bool = True,
                after_drift: bool = False, settling: bool = False) -> None:
        """An envelope arrives from the tables topic (or the loop's own fit); `after_drift`:
        the loop's refit at the end of a re-profile, `settling` its follow-up
        (`Guardrail.arm`'s level shift).

        One from outside ends a re-profile in progress: the operator's (or a fleet
        fitter's) table runs now, under the guardrail, rather than after the sweep's refit
        replaces it unwatched."""
        accepted = self.agent.on_envelope(envelope)
        if accepted:
            self._reset_refit_wait(now_s)
        if accepted and self.state is not LoopState.LIVE:
            self._leave_sweep(now_s)
            self._next_refit_s = now_s + self.config.refit_interval_s
            self._decisions.note(now_s, What.REPROFILE_ABANDONED, version=envelope.version)
        self.publisher.sync(now_s, guard=guard, after_drift=after_drift,
                            settling=settling)

    def observe_envelope(self, envelope: TableEnvelope, now_s: float) -> None:
        """An envelope on the tables topic that this loop did not send (an operator's, or
        another control replica's): the engines have it already; the loop takes it as the
        fleet's table, watched by the guardrail."""
        if envelope.version <= self.agent.state.newest_version:
            return  # one of ours, read back, or older
        with self.publisher.muted():
            self.publish(envelope, now_s)
        # refused here or not, the number is taken: the next version the loop sends is newer
        self.agent.state.newest_version = max(self.agent.state.newest_version,
                                              envelope.version)

    def observe_control(self, control: TableControl, now_s: float) -> None:
        """An operator's pin, unpin or rollback, which the engines fold as well: the loop's
        table follows theirs. While pinned it holds (no force, refit or re-profile: the
        operator froze the fleet); after a rollback it waits out the guardrail's cooldown
        rather than send the withdrawn table straight back."""
        if control.action == "claim":  # a newer owner's epoch: what older ones send is fenced
            self.agent.on_control(control)
            return
        if control.action not in OPERATOR_ACTIONS:
            return  # force and release are the loop's own (or another replica's)
        self._resumed_report = None  # the operator's move comes after what it said
        if control.targets:  # a part of the fleet: the loop decides for all of it
            self._decisions.note(now_s, What.OPERATOR_CONTROL_IGNORED, action=control.action,
                                 reason="targeted", targets=list(control.targets))
            return
        self.agent.on_control(control)
        cfg = self.config
        if self.pinned and self.state is not LoopState.LIVE:
            self._leave_sweep(now_s)
            self._decisions.note(now_s, What.REPROFILE_ABANDONED, reason="pinned")
        if control.action == "rollback":
            self._cool_down(now_s)
        elif control.action == "unpin":
            self._reset_refit_wait(now_s)
            self._next_refit_s = now_s + cfg.refit_interval_s
        with self.publisher.muted():  # the engines folded it themselves
            self.publisher.sync(now_s, guard=False)
        self._decisions.note(now_s, What.OPERATOR, action=control.action,
                             version=self.agent.state.desired_version, pinned=self.pinned)

    def preload(self, records: pa.Table) -> None:
        """Steps from before the loop started (a restarted service's lookback): kept for
        the fits' window only, never shown to the guardrail or the drift detector."""
        self.window.preload(records)

    def release_forces(self) -> None:
        """Before the loop stops: engines go back to the current table now, not at expiry."""
        self.publisher.release(self.clock_s)

    # ---- the state machine ----------------------------------------------------------------
    def tick(self, now_s: float, records: pa.Table | None) -> None:
        """Once per control interval with the records recorded since the last tick."""
        self.clock_s = now_s
        if records is not None and records.num_rows:
            records = self.window.note_engines(records, now_s, only=self.planner.fitted_engines)
        if records is not None and records.num_rows:
            self.window.add(records, now_s)
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

    def _watch(self, steps: StepColumns, now_s: float) -> None:
        """LIVE: the guardrail's verdict on the last swap, then the drift detector's."""
        self.guardrail.observe(steps)
        verdict = self.guardrail.verdict(now_s)
        if verdict is Verdict.ROLL_BACK:
            evidence = dict(self.guardrail.last_evidence)
            self._decisions.note(now_s, What.ROLL_BACK, **evidence)
            evidence.pop("old_version", None)
            evidence.pop("new_version", None)
            withdrawn = self.agent.state.desired_version
            self.agent.roll_back("guardrail", **evidence)
            self.publisher.roll_forward(now_s, withdrawn)
            self._cool_down(now_s)
            return
        if verdict is not Verdict.HOLD:
            self._decisions.note(now_s, What(verdict.value), **self.guardrail.last_evidence)
        observed = self.drift.observe(steps)
        resumed, self._resumed_report = self._resumed_report, None
        if resumed is not None and resumed.version != self.drift.version:
            resumed = None  # said of a table the fleet no longer runs (a roll-back's too)
        for report in (resumed, observed):
            if report is None:
                continue
            match = self._held_match(report, now_s) if report.fast else None
            if report.fast and match is None:
                continue  # no regime held (new traffic waits for the minute's window)
            self._stale(report, now_s, match=match)
            return
        report = self._unmeasured_load(now_s)
        if report is not None:
            self._stale(report, now_s)

    def _held_match(self, hint: DriftReport, now_s: float) -> tuple[Regime, Signature] | None:
        """The regime a fast hint's newest steps match, once hints have come for
        `HINT_HOLD_S`, never `HINT_GAP_S` apart; None before, or where none matches."""
        run = self._hints
        if run is None or now_s - run[1] > HINT_GAP_S:
            run = (now_s, now_s)
        self._hints = (run[0], now_s)
        if now_s - run[0] < HINT_HOLD_S or not self.config.reprofile_on_stale:
            return None
        return self._match(hint.version, now_s)

    def _stale(self, report: DriftReport, now_s: float, *,
               match: tuple[Regime, Signature] | None = None) -> None:
        """The table is stale: recall a regime seen before (`match`, where a fast report
        found it), settle where acceptance moved within what the table was fitted on, or
        re-profile. Fits start at the drift unless the table's traffic is still the one
        that runs."""
        self.status.emit("stale", **report.fields())
        self._decisions.note(now_s, What.STALE, **report.fields())
        self._reset_refit_wait(now_s)
        self.guardrail.reset_baseline()
        if report.signal == "latency":
            self._forget_if_moved(now_s)
        if self.config.reprofile_on_stale:
            if self._recall(report.version, now_s, match=match):
                self.window.data_since_s = now_s
                return
            hidden = Hidden.of(report.signal, report.magnitude)
            if hidden is Hidden.ACCEPTANCE and self._priced_rise(report):
                # back at what the table priced: the traffic has not left its regime, and
                # its steps so far stay in the fits
                self._settle(now_s, reason="acceptance rose, to no more than the threshold "
                                           "over the table's prediction")
                return
            off = (self._within_regime(now_s)
                   if report.signal == "acceptance" and not report.fast else None)
            if off is not None:  # the table's own traffic, wandering: the same
                if self._left_regime:  # back from traffic that left it: not the same steps
                    self.window.data_since_s = now_s
                    self._left_regime = False
                self._settle(now_s, reason="acceptance moved within the regime the table "
                                           "was fitted on", acceptance_off=round(off, 4))
                return
            self.window.data_since_s = now_s
            # the traffic moved away from the table's regime (a latency drift need not):
            # once a table fitted on it goes out, that regime may be recalled again
            self._left_regime = report.signal != "latency"
            watched_s = max(now_s - self.config.drift.window_s, self.drift.since_s)
            if (hidden is Hidden.ACCEPTANCE and self.planner.probes()
                    and self.planner.ran_largest_k(now_s, since_s=watched_s)):
                self._settle(now_s, reason="acceptance rose where the table drafts the "
                                           "largest K")
            elif (hidden is not Hidden.NOTHING and report.signal != "coverage"
                  and self.planner.probes() and not self.planner.probe_granted(now_s)):
                # a probe with no block measures nothing: the refit reads the table's steps
                self._settle(now_s, reason="the forced budget is spent")
            else:
                # a load past the table's measured range is probed to be measured: its
                # table goes out, and with it the range the detector's coverage reads
                self._judge_probe = report.signal != "coverage"
                self._start_reprofile(now_s, hidden=hidden)
        else:
            self.window.data_since_s = now_s
            self._next_refit_s = now_s + self.config.drift.window_s

    def _within_regime(self, now_s: float) -> float | None:
        """How far (relative first-position acceptance) the newest steps sign from the regime
        the table was fitted on (a sweep's or a recall's; `SIGNATURE_S`), where that is
        within the drift threshold, half the recall's bar, at a batch size the regime
        matches (`regimes.within`); else None. Then an acceptance
        drift is that traffic's own wander, which a probe would measure again, and the fit
        keeps the steps from before it: InstructCoder's acceptance under n-gram at 32 users
        wanders 2.9 to 3.9 tokens a drafting request over 30 s, and a refit on the 10 s
        after a fall priced K4 4% over K7, the phase's best fixed K (twin swing, seed 31).
        One threshold, not the recall's two: a rise from 0.8 to 0.97 a position moves the
        first position's acceptance 21%, and the best K far."""
        regime = self._table_regime
        if regime is None:
            return None
        for span_s in SIGNATURE_S:
            signature = Signature.of(self.window.window(now_s, since_s=now_s - span_s))
            distance = None if signature is None else regime.signature.distance(signature)
            if within(distance, self.config.drift.acceptance_threshold, factor=1.0):
                assert distance is not None
                return math.expm1(distance[0])
        return None

    def _priced_rise(self, report: DriftReport) -> bool:
        """An acceptance rise that ends no more than the drift threshold over the table's own
        prediction hides nothing the table did not price: a closed loop of 16 EAGLE users
        read 25% under its recalled table over the reference, so the reference learned it
        low, and back at the prediction a minute later read 30% over it (twin swing, seed
        21: a 3 s probe then measured the same regime again)."""
        return report.against_prediction < self.config.drift.acceptance_threshold

    def _settle(self, now_s: float, *, reason: str, **evidence: float) -> None:
        """Acceptance rose, and hides nothing a probe would measure: to what the table
        priced (`_priced_rise`), or where the table drafts the largest K, whose steps
        censor no position (an InstructCoder phase's recalled table at K7,
        called stale 22 s after its recall by a reference 20% above the regime's sweep,
        was probed 6 s for a 0.3% gain). The next refit reads the settled steps as after a
        fall, and the detector learns the new level as its reference instead of reporting
        the same drift every minute. Also where acceptance moved, either way, within the
        regime the table was fitted on (`_within_regime`), and where a probe ended in a
        refit that could not tell its table from the running one (`_refit(judged=True)`)."""
        self._decisions.note(now_s, What.SETTLE_REFIT, reason=reason, **evidence)
        self._follow_up_s = None  # the settled refit replaces a re-profile's follow-up
        self.drift.rereference(now_s)
        self._next_refit_s = now_s + self.config.reprofile_settle_s

    def _unmeasured_load(self, now_s: float) -> DriftReport | None:
        """A key whose steps over the last `UNMEASURED_SPAN_S` ran past the drift
        detector's coverage factor times the largest load the running table's fit
        measured (`measured_load`): its K there is a guess, and so would a refit's be,
        so the loop probes the load (signal `coverage`), once per table version. The
        detector's own coverage signal counts steps over its minute-long window, where a
        slow engine's few steps at the new load outnumbered the fast ones of the old only
        30 s into the real one -> sixteen -> one run; a refit's guess, once published,
        the signal no longer questions (there: K0 for 14-16 requests, where K1 led by
        15%, for the rest of the phase)."""
        cfg = self.config
        version = self.agent.state.desired_version
        measured = measured_load(self.publisher.agent.desired())
        if (measured is None or version == self._unmeasured_version
                or not cfg.reprofile_on_stale or not self.planner.probes()):
            return None
        records = self.window.window(now_s, since_s=now_s - UNMEASURED_SPAN_S)
        if records is None or records.num_rows < UNMEASURED_MIN_STEPS:
            return None
        recent = records.column("batch_size").to_numpy()
        past = cfg.drift.coverage_factor * max(measured, 1.0)
        if float(np.median(recent)) <= past:
            return None
        self._unmeasured_version = version
        return DriftReport("coverage", float(np.mean(recent > past)), math.inf,
                           int(recent.size), version)

    def _recall(self, stale_version: int, now_s: float, *,
                match: tuple[Regime, Signature] | None = None) -> bool:
        """Traffic that a re-profile measured before (`RegimeMemory`): refit on that sweep and
        publish now, with no forced step. A recalled table called stale within
        `RECALL_TRUST_S` was a wrong match: the loop measures what it missed (a probe, or a
        settled refit where the table's steps hide nothing)."""
        match = match or self._match(stale_version, now_s)
        if match is None:
            return False
        regime, signature = match
        distance = regime.signature.distance(signature) or (0.0, 0.0)
        self._decisions.note(now_s, What.RECALL, batch_size=round(signature.batch, 1),
                             acceptance_off=round(math.expm1(distance[0]), 4),
                             recalled_batch_size=round(regime.signature.batch, 1),
                             learned_s=round(regime.learned_s, 3))
        if regime.records is None:  # an earlier owner's: its table, sent again
            self._send_again(regime, now_s)
        else:
            self.window.anchor = regime.records
            self._refit(now_s, reason="recall", force=True, k_values=regime.k_values,
                        steps_since_s=regime.steps_since_s, recalled=regime)
        self._recalled_version = self.agent.state.desired_version
        self._recalled_s = now_s
        self._table_regime, self._left_regime = regime, False
        self._follow_up_s = None  # a re-profile's, for the table the recall replaced
        return True

    def _match(self, stale_version: int, now_s: float) -> tuple[Regime, Signature] | None:
        """The regime the newest steps match, and their signature (`_recall`); None where
        none does, or where `stale_version` is a recall's within `RECALL_TRUST_S`."""
        if (stale_version == self._recalled_version
                and now_s - self._recalled_s < RECALL_TRUST_S):
            return None
        for span_s in SIGNATURE_S:
            signature = Signature.of(self.window.window(now_s, since_s=now_s - span_s))
            regime = self.regimes.recall(signature, self.config.drift.acceptance_threshold,
                                         stale=self._table_regime)
            if regime is not None and signature is not None:
                return regime, signature
        return None

    def _send_again(self, regime: Regime, now_s: float) -> None:
        """A regime restored from an earlier owner has no sweep to refit on: the table its
        refit published goes out again under a new version, unwatched as a recall's is."""
        sent = self.agent.state.accepted[regime.version]  # type: ignore[index]
        version = self.agent.state.newest_version + 1
        envelope = dataclasses.replace(
            sent, version=version, signature=None, epoch=0,  # the channel stamps its own
            created_at=clock_time(now_s).isoformat(),
            provenance={**sent.provenance, "reason": "recall", "recalls": sent.version})
        measured = measured_load(sent)
        self.publisher.fitted_range = None if measured is None else (1, math.ceil(measured))
        self.publisher.fitted_steps = None
        self._decisions.note(now_s, What.REFIT, reason="recall", version=version,
                             sent_again=sent.version)
        self.publish(envelope, now_s, guard=False)
        self._next_refit_s = now_s + self.config.refit_interval_s

    def _forget_if_moved(self, now_s: float) -> None:
        """After a latency drift: if the drift window's steps ran off the remembered cells
        of the same shape by the latency threshold, the engine's step times moved (a new
        build, other hardware) and what was measured before is forgotten. Without shared
        cells the drift is at a load never measured: the extrapolation missed."""
        recent = self.window.window(now_s, since_s=now_s - self.config.drift.window_s)
        moved = self.knowledge.shift(recent)
        if moved is not None and abs(moved[0]) >= self.config.drift.latency_threshold:
            cells = self.knowledge.forget()
            self.regimes.forget()  # their tables were priced at the old step times
            self._decisions.note(now_s, What.LATENCY_FORGOTTEN, shift=round(moved[0], 4),
                                 steps=moved[1], cells=cells)
            self._publish_memory(now_s)

    def _start_reprofile(self, now_s: float, *, restarted: bool = False,
                         hidden: Hidden = Hidden.COST) -> None:
        self._follow_up_s = None  # the re-profile's own refit schedules the next one
        if not self.planner.start_reprofile(now_s, restarted=restarted, hidden=hidden):
            # nothing to force: the next refit reads the settled steps, and publishes only
            # on a gain clear of its error (a few requests' acceptance is no evidence)
            self._next_refit_s = now_s + self.config.reprofile_settle_s
            return
        self.state = LoopState.REPROFILING

    def _advance_sweep(self, now_s: float) -> None:
        progress = self.planner.advance(now_s, profiling=self.state is LoopState.PROFILING)
        if progress is SweepProgress.RESTART:
            self._decisions.note(now_s, What.REPROFILE_RESTARTED,
                                 reason="the regime moved during it")
            self._start_reprofile(now_s, restarted=True)
        elif progress is SweepProgress.DONE:
            sweep = self.planner.sweep
            assert sweep is not None
            first = self.state is LoopState.PROFILING
            self.window.anchor = self.window.window(now_s, since_s=sweep.records_from_s)
            self.publisher.baseline_since_s = sweep.started_s
            self._leave_sweep(now_s)
            self.drift.after_sweep(now_s)
            reason = "profile" if first else "stale"
            steps_since_s = sweep.confirm_started_s if sweep.confirmed else None
            newest = self.agent.state.newest_version
            probed = sweep.probe and not first
            judged = probed and self._judge_probe
            self._refit(now_s, reason=reason, force=True, k_values=sweep.confirmed or None,
                        steps_since_s=steps_since_s, records_since_s=sweep.records_from_s,
                        judged=judged, steady=probed)
            published = (self.agent.state.desired_version
                         if self.agent.state.newest_version > newest else None)
            if published is None and judged:
                # the running table stays: so does the regime it was fitted on (a recall of
                # the probe's few steps would publish, unwatched, what the gate refused)
                self._publish_memory(now_s)
                return
            records = self.window.anchor
            signature = Signature.of(records)  # every K's blocks: a later table runs any K
            self._table_regime, self._left_regime = None, False
            if records is not None and signature is not None:
                self._table_regime = self.regimes.remember(
                    Regime(signature, records, sweep.confirmed or None, steps_since_s, now_s,
                           reason, version=published),
                    self.config.drift.acceptance_threshold)
            self._publish_memory(now_s)

    def _leave_sweep(self, now_s: float) -> None:
        """The sweep is over (done or abandoned): its force released, the loop LIVE."""
        self.planner.sweep = None
        self.publisher.release(now_s)
        self.state = LoopState.LIVE

    def _publish_memory(self, now_s: float) -> None:
        """The latency knowledge and the regimes as they now stand, on the status topic:
        the service that next serves the key (a restart, a takeover) starts from them."""
        self.status.emit(KNOWLEDGE_EVENT, **knowledge_fields(
            self.status.settings, self.status.table_key, now_s, self.knowledge.cells,
            self.regimes.kept()))

    # ---- fitting --------------------------------------------------------------------------
    def _refit(self, now_s: float, *, reason: str, force: bool,
               k_values: tuple[int, ...] | None = None, steps_since_s: float | None = None,
               records_since_s: float | None = None, min_gain: float | None = None,
               gain_z: float | None = None, recalled: Regime | None = None,
               judged: bool = False, steady: bool = False) -> bool:
        """Fit, derive, publish if forced or worth it (`min_gain`, `gain_z`: the config's by
        default); False when held back (a rollback's cooldown, a guardrail watch's hold).
        `steady`: the fit reads the step times at the machine's steady speed
        (`fitter.steady_speed`): a probe's, whose blocks alternate with the table's steps.
        `judged` (with `force`): past those holds, but published only if worth it, else the
        running table settles (`_settle`) where its fit measured the load: a probe's,
        whose fit of a slow engine's few steps can price K with errors as large as the
        gains.
        A re-profile's end: `k_values`, the confirmed K (any other is an extrapolation);
        the step models fit only the steps since `steps_since_s` (the sweep's short blocks
        overrate the larger K's tokens per step), the requests that finished since
        `records_since_s` price each K's context. `recalled`: the fit is that regime's sweep,
        weighed as of its own refit, and its table is published unwatched (it was vetted
        when first measured; the drift detector checks its prediction from the first step).
        A follow-up that comes after the load moved (`refit_gate.load_moved`) is judged as a
        periodic refit is, on the newest steps' batch sizes."""
        cfg = self.config
        self._next_refit_s = now_s + cfg.refit_interval_s
        started = self.guardrail.watch_started_s
        watching = started is not None and now_s - started < cfg.watch_hold_s
        if not force and (now_s < self._cooldown_until_s or watching):
            return False
        fit_options: dict[str, Any] = {}
        fit_s, fit_reason = now_s, reason
        if recalled is not None:
            records, fit_s, fit_reason = recalled.records, recalled.learned_s, recalled.reason
            if steps_since_s is not None:
                fit_options["steps_since_ns"] = int(steps_since_s * 1e9)
        elif steps_since_s is None:
            records = self.window.fit_records(now_s)
        else:
            records = self.window.window(now_s, since_s=min(steps_since_s,
                                                            records_since_s or steps_since_s))
            fit_options["steps_since_ns"] = int(steps_since_s * 1e9)
        if not fittable(records):
            return True
        timed = at_steady_speed(records) if steady else records
        version = self.agent.state.newest_version + 1
        envelope = self.fitter(timed, fit_s, reason=reason, version=version,
                               half_life_s=None if fit_reason == "profile" else cfg.half_life_s,
                               tolerance=cfg.tolerance, k_values=k_values or self.k_values,
                               provenance={CHOSEN_AMONG_K: list(k_values)} if k_values else {},
                               **fit_options)
        if reason in SWEEP_REASONS:
            self.knowledge.learn(timed)
        if envelope is None:
            return True
        batch = records.column("batch_size").to_numpy().astype(np.int64)
        current = self.publisher.running_table()
        judged_on = batch[-2000:]
        moved = False
        if reason == "follow_up":
            newest = _latest_batch_sizes(records, UNMEASURED_SPAN_S)
            moved = newest.size >= UNMEASURED_MIN_STEPS and load_moved(judged_on, newest)
            if moved:  # its own bar is for the load its re-profile measured, not this one
                judged_on, min_gain, gain_z = newest, None, None
        gain, stderr = predicted_gain(envelope, current, judged_on)
        running = self.publisher.agent.desired()
        unmeasured = running_unmeasured(running,
                                        _latest_batch_sizes(records, cfg.refit_interval_s))
        miss = (None if force or unmeasured or (running is not None and running.budget)
                else self._own_steps_miss(envelope, records, now_s))
        # a surface that underprices what the running K emits favours smaller K than it
        # should, and one that overprices it larger: a move the miss would reverse waits
        misfit = (miss is not None
                  and abs(math.log1p(miss)) >= math.log1p(cfg.drift.acceptance_threshold)
                  and miss * k_shift(envelope.table, current, judged_on) < 0)
        self._decisions.note(now_s, What.REFIT, reason=reason, version=version,
                             gain=round(gain, 4), gain_stderr=round(stderr, 4),
                             records=records.num_rows,
                             **({"running_unmeasured": True} if unmeasured else {}),
                             **({"load_moved": True} if moved else {}),
                             **({"own_steps_miss": round(miss, 4)} if misfit else {}))
        min_gain = cfg.min_gain if min_gain is None else min_gain
        gain_z = cfg.gain_z if gain_z is None else gain_z
        worth_it = (gain >= min_gain and (gain >= gain_z * stderr or unmeasured)
                    and not misfit)
        if judged and not worth_it and not unmeasured:
            # kept where its fit measured the load: a table that did not would be probed
            # for coverage next, and that probe's table goes out whatever its gain
            self._settle(now_s, reason=f"the probe's fit could not tell its table from the "
                                       f"running one: gain {gain:+.4f} +- {stderr:.4f}")
            self._reset_refit_wait(now_s)
            return True
        if not force and not worth_it:
            if reason == "periodic" and not unmeasured and not misfit:
                # (a miss shrinks as the window rolls on: the next refit comes on time)
                self._space_out_refits(now_s)
            return True
        low, high = (int(v) for v in np.percentile(batch, [1, 99]))
        measured = self.knowledge.batch_range()
        if measured is not None:  # the fit priced those batch sizes as measured too
            low, high = min(low, measured[0]), max(high, measured[1])
        self.publisher.fitted_range = (max(low, 1), max(high, 1))
        self.publisher.fitted_steps = (version, StepColumns.from_records(records))
        vetted = (k_values is not None and steps_since_s is not None
                  and _ran_against(current, k_values, records, steps_since_s))
        if vetted:
            self._decisions.note(now_s, What.UNWATCHED, version=version, reason="the "
                                 "confirmation ran the replaced table's K beside the new pick")
        self.publish(envelope, now_s, guard=reason not in UNWATCHED_REASONS and not vetted,
                     after_drift=reason == "stale", settling=reason == "follow_up")
        if self._left_regime and recalled is None:
            # fitted on the traffic the drift moved to: code recalled at 563 s, GSM8K's
            # table fitted live at 750 s, and code's return at 958 s found its regime
            # still barred as the one the table was fitted on (a 6 s probe instead)
            self._table_regime, self._left_regime = None, False
        if reason in FOLLOWED_UP_REASONS and cfg.follow_up_s > 0:
            self._follow_up_s = now_s + cfg.follow_up_s
        return True

    def _own_steps_miss(self, envelope: TableEnvelope, records: pa.Table,
                        now_s: float) -> float | None:
        """How far `envelope`'s surface misses the running table's own steps over the last
        refit interval (`refit_gate.own_steps_miss`). A miss of a drift is one the detector's
        misfit check would call stale as soon as the table went out: after a recall, a fit of
        the regime's sweep (an earlier visit of the traffic) beside 30 s of the table's K7
        priced K7 20-25% under those very steps, and K5 2% over it (twin, n-gram swing at
        32 users, four engines through the broker, seed 31). A miss the other way after a
        fall (the fit still half on the steps before it) only understates a move to smaller
        K, which goes out."""
        since_ns = int((now_s - self.config.refit_interval_s) * 1e9)
        newest = records.filter(pc.greater_equal(records.column("ts_ns"), since_ns))
        if newest.num_rows == 0:
            return None
        # each engine's steps in order: a step after a forced one verified forced drafts
        newest = newest.sort_by([("engine_id", "ascending"), ("ts_ns", "ascending")])
        return own_steps_miss(envelope, StepColumns.from_records(newest))

    def _space_out_refits(self, now_s: float) -> None:
        """A periodic refit found nothing worth a swap: the next waits `REFIT_SPACING_STEP`
        times as long, up to `refit_spacing` intervals: each refit is a whole fit, and a
        settled key's find nothing (twin EAGLE swing: 23 refits where 45 ran, the same
        tokens per second). Not within `half_life_s` of the last reset, before the steps
        since a drift or a new table weigh as much in a refit as those before it (an
        acceptance fall's settled refit comes 10 s after it, on too few steps to pass the
        gate), and not under a per-request budget, where the drift detector reads no
        latency and the refits watch it."""
        cfg = self.config
        desired = self.agent.desired()
        settling_s = cfg.fit_window_s if cfg.half_life_s is None else cfg.half_life_s
        if (now_s - self._refit_wait_since_s < settling_s
                or (desired is not None and desired.budget is not None)):
            return
        self._refit_wait_s = min(REFIT_SPACING_STEP * self._refit_wait_s,
                                 cfg.refit_spacing * cfg.refit_interval_s)
        self._next_refit_s = now_s + self._refit_wait_s

    def _cool_down(self, now_s: float) -> None:
        """After a roll-back (the guardrail's or an operator's): no refit for
        `rollback_cooldown_s`, then every `refit_interval_s` again, and no follow-up (its
        bar would let the rolled-back table straight back)."""
        self._cooldown_until_s = now_s + self.config.rollback_cooldown_s
        self._follow_up_s = None
        self._reset_refit_wait(now_s)
        self._next_refit_s = max(self._next_refit_s, self._cooldown_until_s)

    def _reset_refit_wait(self, now_s: float) -> None:
        """A new table, a drift or a roll-back: periodic refits every `refit_interval_s`
        again, for `half_life_s` at least (`_space_out_refits`)."""
        self._refit_wait_s = self.config.refit_interval_s
        self._refit_wait_since_s = now_s


def _latest_batch_sizes(records: pa.Table, span_s: float) -> NDArray[np.int64]:
    """Batch sizes of the steps in the last `span_s` of `records`: the load over the last
    refit interval, not the window's."""
    batch = records.column("batch_size").to_numpy().astype(np.int64)
    seconds = records.column("ts_ns").to_numpy() / 1e9
    return batch[seconds >= seconds.max() - span_s]


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
