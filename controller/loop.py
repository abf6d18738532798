"""The closed loop on one engine: profile, follow, refit, explore, guard, detect drift.

Fed telemetry records and the clock (`tick(now_s, records)`), it drives a `TableSwitch`
through the same decisions production makes: a fitted envelope goes through
`TableAgent.on_envelope` (validation, versions), the agent's desired table is staged with its
explorer, the `Guardrail` watches every swap and a ROLL_BACK goes through
`TableAgent.roll_back(reason, **evidence)`, the `DriftDetector` emits `stale` and triggers a
re-profile and a refit. Time is whatever the records say (virtual time in the twin), so the
loop runs in-process at any speed; every wait is a deadline on that clock.

The re-profile after `stale`, and why each part. The drift shows while the old traffic's
requests still run, so the stale table first runs on for `reprofile_settle_s`. Short blocks
at every K, up and back down, then measure what live steps censor (acceptance beyond the
table's K, the cost of every K at the new load); a fit of them picks a K, and that K and its
neighbours run for long blocks in mirrored order (a, b, c, c, b, a): which requests a closed
loop holds, and so what a K really emits per step, settles only over a request's lifetime,
and between neighbouring K that is what decides. The refit at its end fits the step models
on the confirmation's runs alone (the sweep's 1 s blocks read the larger K's tokens per step
0.5-2% high) and prices each K at the context its own batch would hold, from every request
that finished during the re-profile (`fitter.surface.context`: a closed loop at a larger K
holds 4-6% less context per request under n-gram, 2-3% more under EAGLE). It is published at
once, under a guardrail watch whose baseline is the settling stretch (the stale table's one
unforced run in the new regime). It used to wait for a warm and a baseline block
of the stale table after the confirmation: 14 s more of the stale table, whose batch the new
table then had to drain inside the phase's measured window (twin, EAGLE 8 -> 64 users: 0.05%
of the phase after its first two minutes). If the load at the confirmation's end is far off
the sweep's, or the first position's acceptance in its last run off its first run's (the
same K), the K values confirmed came from another regime and the re-profile starts again,
once. About 60 s in all (`LoopConfig`), paid once per drift; so the drift detector's
window is long enough that the workload's own wander does not start one, and for three
minutes after a sweep it asks acceptance for twice the shift
(`DriftConfig.after_sweep_factor`).
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from controller.agent import TableAgent
from controller.drift import DriftConfig, DriftDetector
from controller.exploration import ExplorationConfig, explorer_for
from controller.guardrail import Guardrail, GuardrailConfig, Verdict
from controller.refit_gate import predicted_gain
from controller.status import StatusPublisher
from controller.steps import StepColumns
from controller.validation import EngineLimits
from producers.table_switch import TableSwitch
from schemas import DraftTable, TableEnvelope

log = logging.getLogger(__name__)

Fit = Callable[..., TableEnvelope]
"""fit(records, *, key, max_k, max_batch, startup_k_values, version, half_life_s, ...)."""

CHOSEN_AMONG_K = "chosen_among_k"
"""Provenance key of the refit that ends a re-profile: the K values its confirmation ran and
the table was chosen among (the drift detector's `confirmed` factor keys on it)."""


def first_position_acceptance(records: pa.Table, mask: np.ndarray,
                              min_drafts: int = 200) -> float | None:
    """Share of drafts whose first token was accepted, over the steps in `mask` (None with
    fewer than `min_drafts`): every drafting step drafts a first position, so unlike
    accepted tokens per draft it is not cut off by K and compares steps that ran different
    K. Not free of K: at a larger K a closed loop's batch holds fewer well-accepting
    requests (twin, n-gram chat at a fixed K: 0.40 at K1, 0.28 at K3, 0.21 at K7), so only
    large gaps between it at different K say that the workload moved."""
    drafts = records.column("num_drafts").to_numpy().astype(np.float64)
    chosen = mask & (drafts > 0)
    if drafts[chosen].sum() < min_drafts:
        return None
    lists = records.column("accepted_per_pos").filter(pa.array(chosen))
    first = pc.list_element(lists, 0).to_numpy(zero_copy_only=False)
    return float(first.sum() / drafts[chosen].sum())


def confirmation_k_values(k_values: tuple[int, ...], chosen: int,
                          width: int = 3) -> tuple[int, ...]:
    """The `width` neighbouring K values of `k_values` around the sweep's pick `chosen`,
    shifted inward at either end of the set rather than cut short: the short sweep's pick is
    one K off often enough that the best K must be able to lie on either side of it (twin,
    n-gram code: the sweep pointed to K7, so only K6 and K7 ran and K6 was kept where K5 is
    0.3-0.8% better; 6 of 40 seeds)."""
    at = k_values.index(chosen)
    first = max(0, min(at - width // 2, len(k_values) - width))
    return k_values[first:first + width]


class LoopState(enum.Enum):
    PROFILING = "profiling"
    """Forced-K sweep on a cold engine; ends with the first table."""
    LIVE = "live"
    """Following fitted tables; refits, exploration, guardrail and drift detection on."""
    REPROFILING = "reprofiling"
    """Drift was detected: a short forced sweep, long runs at the K it points to and its
    neighbours, then a refit on the new regime only."""


@dataclass(frozen=True, slots=True)
class LoopConfig:
    profile_block_s: float = 2.0
    """Each K of the startup set runs this long in the first sweep ..."""
    profile_rounds: int = 2
    """... this many times over (rounds spread each K over time and load)."""
    reprofile_on_stale: bool = True
    reprofile_settle_s: float = 10.0
    """A drift can show before the new regime has settled (the old traffic's long requests
    still run): the re-profile waits this long, on the current table, so that it measures
    the new regime rather than the mix of both. Short, because the drift detector's
    minute-long window reports a switch only once it dominates. Its steps are the
    guardrail's baseline for the refit at the re-profile's end."""
    reprofile_block_s: float = 1.0
    """Each K's block in the re-profile's sweep, which runs the K values up and back down
    (0..7, 7..0): the acceptance of the few requests that dominate a closed loop wanders
    over seconds, and a sweep that only went up read that trend as the deep positions'
    acceptance (under n-gram its pick was one or two K off in a third of re-profiles).
    Mirrored, a trend cancels between each K's two blocks, in the same 16 s."""
    confirm_block_s: float = 6.0
    """After the re-profile's short sweep, the K its fit picks at the load of the moment and
    the K on each side run this long each, twice over in mirrored order (0 = skip). A short
    block shows each K on the batch the K before it left behind; which requests a closed
    loop holds (and so what a K really emits, and at what context) settles only over a
    request's lifetime, and between neighbouring K that decides the choice."""
    regime_acceptance_factor: float = 4.0
    """A re-profile also starts again (once) when the acceptance of the first draft position
    (`first_position_acceptance`) in the confirmation's last run is off its first run's (the
    same K) by this many of the drift detector's acceptance thresholds (0 = never): the
    confirmation then ran the K values a sweep of another workload pointed to (twin, n-gram: a
    `stale` from the chat traffic's wander 27 s before the switch to code; K1-3 confirmed on
    code, K3 kept where K5 is 4% better). Four thresholds (60%): chat and code differ by about
    90% there (twin traces); the old traffic draining moved it by up to 62%, and at two
    thresholds 22 of 80 n-gram re-profiles restarted."""
    refit_interval_s: float = 30.0
    fit_window_s: float = 180.0
    half_life_s: float = 60.0
    tolerance: float = 0.0
    """The fitter's derivation tolerance (`fitter.derive.choose_k`): its 1% default trades
    goodput for fewer ranges and smaller K on a fleet's table; one engine at one load has
    the telemetry to take the argmax. At 0.5% it kept EAGLE at 64 users off K4, which the
    re-profile's fit overrates by 0.6% (1.5% worse in fact), and cost n-gram chat its best
    K: K2 within 0.5% of K3 (0.1% better in fact) in 119 of 160 phases (twin). The
    follow-up refit (`follow_up_s`) now takes K4 back to K3 where it comes."""
    fewest_ranges: bool = False
    """Off: each batch size takes its smallest K within `tolerance` of its best
    (`fitter.derive.choose_k`). The fewest-ranges pass, right for a fleet's table, stretches
    a range over the batch size the engine runs at with a K that is only within the
    tolerance there (twin, n-gram chat after code, 48 users: [[1, 83, 4], ...] where K3 is
    0.2% better than K4 at 46, and K4 is 1.7% worse than K3 in fact)."""
    min_gain: float = 0.01
    """A periodic refit is published only if it predicts at least this much more goodput."""
    gain_z: float = 2.0
    """... and only if that gain is this many of its standard errors (the surface's): a
    gain the fit cannot tell from noise is a swap on an extrapolation."""
    follow_up_s: float = 60.0
    """One refit this long after a re-profile's table is staged, judged by the lower
    `follow_up_min_gain` bar alone (0 = none). The re-profile chose among its confirmed K on
    a minute of data; between neighbouring K within a fraction of a percent of each other
    its pick is close to a coin flip (twin, n-gram chat: its K3/K2 varies 0.9% between
    seeds where K3 is 0.1% better, and does not track the seed's own ratio, correlation
    -0.16; EAGLE at 64 users: K4, 1.5% worse than K3, in 3 of 40 phases at tolerance 0).
    Later fits hold the new table's live steps, the exploration at its neighbours and the
    sweep: late in the phase their K3/K2 varies 0.4% and tracks the seed's (0.75), and the
    follow-up took each of those K4 back to K3. The periodic refits' standard-error test
    never passes on such a gap, and lowering their bar instead swapped back and forth
    (twin: 0.8 swaps per phase in the measured window, recovery 0.982 against 0.988 without);
    one follow-up per re-profile settles the choice once (160 seeds: chat-again recovery
    0.977 -> 0.985, the concurrency jump 0.985 -> 0.988, BENCHMARKS.md)."""
    follow_up_min_gain: float = 0.002
    """The follow-up publishes a table predicted to gain at least this much (no
    standard-error test: a swap between near-equals risks little, and the guardrail
    watches it)."""
    watch_hold_s: float = 60.0
    """No periodic refit this long into a guardrail watch (the swap would end it unjudged);
    after that a watch still without a verdict no longer holds refits back."""
    rollback_cooldown_s: float = 60.0
    """No periodic refit this long after a rollback (the same fit would come back)."""
    exploration: ExplorationConfig = field(default_factory=ExplorationConfig)
    guardrail: GuardrailConfig = field(default_factory=GuardrailConfig)
    drift: DriftConfig = field(default_factory=DriftConfig)


@dataclass
class _Sweep:
    blocks: list[int | None]
    """K per block; None = the current table, unforced (the settling stretch, which is also
    the guardrail's baseline for the refit at the end)."""
    block_s: list[float]
    started_s: float
    index: int = -1
    confirm: bool = False
    """When the blocks run out: fit, then append the confirmation runs."""
    fit_since_s: float | None = None
    """Fits take the records from here on (default: the sweep's start)."""
    confirmed: tuple[int, ...] = ()
    """The K values the confirmation ran: the refit after it chooses among them."""
    confirm_started_s: float | None = None
    """When the confirmation's runs began (None: not planned yet)."""
    restarted: bool = False
    """This re-profile is the second for one `stale`: the regime moved under the first."""

    @property
    def records_from_s(self) -> float:
        """Where the records the sweep's fits take begin."""
        return self.started_s if self.fit_since_s is None else self.fit_since_s


class ClosedLoop:
    def __init__(self, switch: TableSwitch, limits: EngineLimits, status: StatusPublisher,
                 fit: Fit, config: LoopConfig | None = None,
                 mirror: Callable[[TableEnvelope], None] | None = None) -> None:
        self.switch = switch
        self.mirror = mirror
        """Called with each envelope the loop fits and publishes (e.g. to the tables topic)."""
        self.limits = limits
        self.status = status
        self.fit = fit
        self.config = config or LoopConfig()
        self.agent = TableAgent(limits, {}, status.emit)
        self.guardrail = Guardrail(self.config.guardrail)
        self.drift = DriftDetector(limits.max_batch, self.config.drift)
        self.k_values = tuple(sorted(limits.startup_k_values))
        self.state = LoopState.PROFILING
        self._records: deque[pa.Table] = deque()
        self._data_since_s = 0.0
        self._active_version = switch.version
        self._next_refit_s = 0.0
        self._cooldown_until_s = 0.0
        self._follow_up_s: float | None = None
        """When the follow-up refit after a re-profile is due (None: none pending)."""
        self._staged: tuple[int, float] | None = None
        self._sweep: _Sweep | None = None
        self._fitted_range: tuple[int, int] | None = None
        self._anchor: pa.Table | None = None
        """Records of the last (re-)profile sweep."""
        self._baseline_since_s: float | None = None
        """Where the last re-profile's settling stretch began: the stale table's baseline
        for the guardrail watch on the refit after it."""
        self.decisions: list[dict[str, Any]] = []
        """Every decision with its virtual time, for benchmarks and tests."""
        self.applied: list[tuple[float, int, DraftTable]] = []
        """(virtual time, version, table) of each table the loop staged, in order."""

    # ---- inputs ---------------------------------------------------------------------------
    def start(self, now_s: float) -> None:
        cfg = self.config
        blocks: list[int | None] = [*self.k_values] * cfg.profile_rounds
        self._sweep = _Sweep(blocks, [cfg.profile_block_s] * len(blocks), now_s)
        self._note(now_s, "profile", blocks=len(blocks))

    def publish(self, envelope: TableEnvelope, now_s: float, *, guard: bool = True,
                after_drift: bool = False) -> None:
        """An envelope arrives from the tables topic (or the loop's own fit); `after_drift`:
        the loop's refit at the end of a re-profile (`Guardrail.arm`'s level shift).

        One from outside ends a re-profile in progress: the operator's (or a fleet
        fitter's) table runs now, under the guardrail, rather than after the sweep's refit
        replaces it unwatched."""
        accepted = self.agent.on_envelope(envelope)
        if accepted and self.state is LoopState.REPROFILING:
            self._sweep = None
            self.state = LoopState.LIVE
            self._next_refit_s = now_s + self.config.refit_interval_s
            self._note(now_s, "reprofile_abandoned", version=envelope.version)
        self._sync(now_s, guard=guard, after_drift=after_drift)

    def tick(self, now_s: float, records: pa.Table | None) -> None:
        """Once per control interval with the records recorded since the last tick."""
        self._confirm_applied(now_s)
        if records is not None and records.num_rows:
            self._records.append(records)
            self._trim(now_s)
            steps = StepColumns.from_records(records)
            if self.state is LoopState.LIVE:
                self._watch(steps, now_s)
            else:  # a re-profile's settling stretch is the guardrail's baseline
                self.guardrail.observe(steps)
        if self.state is not LoopState.LIVE:
            self._advance_sweep(now_s)
        elif self._follow_up_s is not None and now_s >= self._follow_up_s:
            if self._refit(now_s, reason="follow_up", force=False,
                           min_gain=self.config.follow_up_min_gain, gain_z=0.0):
                self._follow_up_s = None
        elif now_s >= self._next_refit_s:
            self._refit(now_s, reason="periodic", force=False)

    # ---- live watching --------------------------------------------------------------------
    def _watch(self, steps: StepColumns, now_s: float) -> None:
        self.guardrail.observe(steps)
        verdict = self.guardrail.verdict(now_s)
        if verdict is Verdict.ROLL_BACK:
            evidence = dict(self.guardrail.last_evidence)
            self._note(now_s, "roll_back", **evidence)
            evidence.pop("old_version", None)
            evidence.pop("new_version", None)
            self.agent.roll_back("guardrail", **evidence)
            self._sync(now_s, guard=False)
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
        lengths = [cfg.reprofile_settle_s] + [cfg.reprofile_block_s] * len(ks)
        self._sweep = _Sweep(blocks, lengths, now_s, confirm=cfg.confirm_block_s > 0,
                             fit_since_s=now_s + cfg.reprofile_settle_s, restarted=restarted)
        self._data_since_s = now_s + cfg.reprofile_settle_s
        self.state = LoopState.REPROFILING

    # ---- sweeps ---------------------------------------------------------------------------
    def _advance_sweep(self, now_s: float) -> None:
        sweep = self._sweep
        assert sweep is not None
        elapsed = now_s - sweep.started_s
        ends = np.cumsum(sweep.block_s)
        index = int(np.searchsorted(ends, elapsed, side="right"))
        if index >= len(sweep.blocks) and sweep.confirm:
            self._plan_confirmation(sweep, now_s)
            index = int(np.searchsorted(np.cumsum(sweep.block_s), elapsed, side="right"))
        if index >= len(sweep.blocks) and self._regime_moved(sweep, now_s):
            self._note(now_s, "reprofile_restarted", reason="the regime moved during it")
            self._start_reprofile(now_s, restarted=True)
            return
        if index >= len(sweep.blocks):
            first = self.state is LoopState.PROFILING
            self._anchor = self._window(now_s, since_s=sweep.records_from_s)
            self._baseline_since_s = sweep.started_s
            self._sweep = None
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
        k = sweep.blocks[index]
        if k is None:
            # the guardrail's baseline for the refit to come is this stretch, not what ran
            # before the drift showed
            self.guardrail.reset_baseline()
            desired = self.agent.desired()
            table = self.switch.startup_table if desired is None else desired.table
            self.switch.stage(table, self._active_version)
        else:
            self.switch.stage(DraftTable.from_vllm([[1, self.limits.max_batch, k]]),
                              self._active_version, forced=True)

    def _plan_confirmation(self, sweep: _Sweep, now_s: float) -> None:
        """Append long runs at the K the sweep so far points to and its neighbours (mirrored:
        a, b, c, c, b, a, so a trend over time cancels between them)."""
        cfg = self.config
        sweep.confirm = False
        chosen = self._sweep_choice(now_s, since_s=sweep.records_from_s)
        if chosen is not None:
            sweep.confirmed = confirmation_k_values(self.k_values, chosen)
        runs = [*sweep.confirmed, *sweep.confirmed[::-1]]
        sweep.confirm_started_s = now_s
        sweep.blocks += runs
        sweep.block_s += [cfg.confirm_block_s] * len(runs)
        self._note(now_s, "confirm", k_values=list(sweep.confirmed))

    def _regime_moved(self, sweep: _Sweep, now_s: float) -> bool:
        """Whether the regime moved under the re-profile: the load (median batch size) at its
        end off the sweep's by the drift detector's coverage factor, or the acceptance of
        the first draft position in the confirmation's last run off its first run's (the
        same K) by `LoopConfig.regime_acceptance_factor` acceptance thresholds. The
        confirmation then ran the K values a sweep of another regime pointed to (twin,
        EAGLE 8 -> 64 users in the middle of a re-profile: K5-7 confirmed, K5 kept at 64
        users where K3 is best, 4% lost for the next minutes; n-gram, a re-profile started
        on chat that confirmed K1-3 on code). Acceptance is compared at one K because which
        requests a batch holds, and so what its first position accepts, follows the K run
        over the last seconds: the last run against the sweep (1 s blocks on the stale
        table's batch) restarted 13 of 80 re-profiles after n-gram code -> chat and cost
        them 0.08% of the phase (twin, seeds 1-80); first run against last, 2. A switch
        inside the sweep itself is left to the drift detector, which calls the refit's
        table stale against its own prediction. Once per re-profile."""
        if sweep.restarted or sweep.confirm_started_s is None:
            return False
        records = self._window(now_s, since_s=sweep.records_from_s)
        if records is None:
            return False
        seconds = records.column("ts_ns").to_numpy() / 1e9
        before = seconds < sweep.confirm_started_s
        run_s = self.config.confirm_block_s
        # the load from the last run's last quarter: a jump in its last seconds (EAGLE
        # 8 -> 64 users 3 s before the refit) would not move the median of all of it
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
        if records is None or records.num_rows < 200:
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
        blocks show each K on the batch the K before it left behind, and read the larger
        K's tokens per step 0.5-2% high, but every request it saw finish says what it
        needs at each K)."""
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
        if records is None or records.num_rows < 200:
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
        current = self.switch.table
        gain, stderr = predicted_gain(envelope, current, batch[-2000:])
        self._note(now_s, "refit", reason=reason, version=version, gain=round(gain, 4),
                   gain_stderr=round(stderr, 4), records=records.num_rows)
        min_gain = cfg.min_gain if min_gain is None else min_gain
        gain_z = cfg.gain_z if gain_z is None else gain_z
        if not force and (gain < min_gain or gain < gain_z * stderr):
            return True
        low, high = (int(v) for v in np.percentile(batch, [1, 99]))
        self._fitted_range = (max(low, 1), max(high, 1))
        if self.mirror is not None:
            self.mirror(envelope)
        self.publish(envelope, now_s, guard=reason != "profile",
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

    # ---- the switch -----------------------------------------------------------------------
    def _sync(self, now_s: float, *, guard: bool, after_drift: bool = False) -> None:
        """Stage the agent's desired table if it is not the one running."""
        desired = self.agent.desired()
        version = 0 if desired is None else desired.version
        if version == self._active_version and not self.switch.forced:
            return
        table = self.switch.startup_table if desired is None else desired.table
        explorer = None
        if desired is not None:
            explorer = explorer_for(desired.exploration, table,
                                    max_batch=self.limits.max_batch, k_values=self.k_values,
                                    config=self.config.exploration)
        previous = self._active_version
        self.switch.stage(table, version, explorer=explorer)
        self._active_version = version
        self._staged = (version, now_s)
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
        self.drift.set_envelope(version, None if desired is None else desired.surface, now_s,
                                fitted_batch_range=self._fitted_range, confirmed=confirmed)
        self._note(now_s, "stage", version=version, table=table.to_vllm(), watch=watch)

    def _confirm_applied(self, now_s: float) -> None:
        if self._staged is None or self.switch.pending:
            return
        version, staged_at = self._staged
        if self.switch.version == version:
            self.status.emit("applied", version=version,
                             seconds_to_apply=round(now_s - staged_at, 4))
        self._staged = None

    def _note(self, now_s: float, what: str, **fields: Any) -> None:
        self.decisions.append({"t_s": round(now_s, 3), "what": what, **fields})
        log.debug("loop %s at %.1f s: %s", what, now_s, fields)
