"""What the closed loop's operator can set, and the tuned constants behind its decisions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from controller.drift import DriftConfig
from controller.exploration import ExplorationConfig
from controller.guardrail import GuardrailConfig
from schemas.bounds import Bound, above, at_least, check_bounds, in_range, positive
from schemas.control import MAX_FORCE_S


@dataclass(frozen=True, slots=True)
class LoopConfig:
    """The closed loop's settings: the few an operator sets first, then the tuned constants
    (each with its measured reasons in docs/TUNING.md; change one only with a measurement)."""

    # ---- what an operator sets ----
    refit_interval_s: float = 30.0
    """Telemetry seconds between periodic refits."""
    refit_spacing: float = 8.0
    """Each periodic refit that the gain gate holds, from `half_life_s` after the last
    table, drift or roll-back, doubles the wait for the next, up to this many
    `refit_interval_s` (1 = never): a settled key's refits find nothing, and each is a
    whole fit. Never under a per-request budget, whose drift the refits watch."""
    reprofile_on_stale: bool = True
    """Re-profile after `stale` (off: only refit the passive window)."""
    canary_share: float = 0.25
    """A re-profile forces at most this share of the key's live engines (at least one); the
    rest keep the current table until the re-profile's table is published."""
    force_grace_s: float = 30.0
    """A sweep block's force expires this long after the block should end: transport lag
    never ends a block early, and engines of a control service killed mid-sweep are free
    this soon after."""
    engine_idle_s: float = 30.0
    """An engine whose last step is older than this has left the key (no canary of it)."""
    exploration: ExplorationConfig = field(default_factory=ExplorationConfig)
    """Probing of other K on the engines: the twin's engines take it from here, a fleet's
    read TABLETUNE_EXPLORE_SHARE."""
    guardrail: GuardrailConfig = field(default_factory=GuardrailConfig)
    """How much worse a swapped-in table may run before it is rolled back."""
    drift: DriftConfig = field(default_factory=DriftConfig)
    """When the table in service is called stale."""
    budgets: bool = True
    """Fit a per-request budget beside each table where the engines report n-gram match
    lengths (`fitter.budget`); off: the table alone."""

    # ---- tuned constants (docs/TUNING.md) ----
    profile_block_s: float = 2.0
    """Each startup K runs this long in a cold key's profile ..."""
    profile_rounds: int = 2
    """... this many times over (spreads each K over time and load)."""
    reprofile_settle_s: float = 10.0
    """A re-profile first runs the current table this long: the new regime settles, and it
    is the guardrail's baseline."""
    reprofile_block_s: float = 1.0
    """Each K's block in the re-profile's up-and-down sweep (mirrored, so a trend cancels)."""
    probe_block_s: float = 3.0
    """A re-profile forces blocks this long on the canaries after the settling stretch (a
    one-engine key: on its only engine), not a sweep. One at the largest K shows acceptance
    at every draft position; after a load or step-time drift one at the smallest K follows,
    pricing K at the new load beside the table's own (`sweep_planner.Hidden`; 0 = the
    canaries' sweep and confirmation)."""
    probe_share: float = 0.025
    """A one-engine key's blocks take at most this share of any `FORCED_WINDOW_S`
    (exploration's probes come on top): a drift that keeps firing is refitted without one.
    A fleet's canaries carry only their share of its traffic, and have no such budget."""
    confirm_block_s: float = 6.0
    """The sweep's pick and its neighbours then run this long each, twice, mirrored (0 =
    skip)."""
    regime_acceptance_factor: float = 4.0
    """Restart a re-profile once when first-position acceptance moved this many drift
    thresholds during it (0 = never)."""
    fit_window_s: float = 180.0
    """Telemetry seconds a refit reads (plus the last sweep's records)."""
    half_life_s: float = 60.0
    """Recency half-life of a refit's steps."""
    tolerance: float = 0.0
    """Derivation tolerance: 0 takes the argmax K (one fleet at one load has the data for
    it)."""
    fewest_ranges: bool = False
    """Off: no fewest-ranges pass within `tolerance`, which stretched ranges over the running
    batch size."""
    merge_z: float = 1.0
    """Ranges merge where the fit cannot tell K apart by this many standard errors, except at
    the batch sizes the traffic ran (`fitter.derive.SERVED_SHARE`, `MAX_MERGE_LOSS`); 0 =
    argmax per batch size."""
    min_gain: float = 0.01
    """A periodic refit is published only above this predicted gain ..."""
    gain_z: float = 2.0
    """... and only at this many standard errors of that gain."""
    follow_up_s: float = 60.0
    """One refit this long after a re-profile's table, on live steps at it (0 = none)."""
    follow_up_min_gain: float = 0.002
    """The follow-up's bar: this predicted gain alone (no standard-error test)."""
    watch_hold_s: float = 60.0
    """No periodic refit this long into a guardrail watch."""
    rollback_cooldown_s: float = 60.0
    """No periodic refit this long after a rollback (the same fit would come back)."""

    def __post_init__(self) -> None:
        check_bounds(
            self,
            refit_interval_s=positive(),
            refit_spacing=in_range(1, math.inf, high_open=True),
            canary_share=in_range(0, 1, low_open=True),
            force_grace_s=positive(), engine_idle_s=positive(),
            profile_block_s=positive(), profile_rounds=at_least(1),
            reprofile_settle_s=at_least(0), reprofile_block_s=positive(),
            confirm_block_s=at_least(0), probe_block_s=at_least(0),
            probe_share=in_range(0, 1), regime_acceptance_factor=at_least(0),
            fit_window_s=positive(), half_life_s=above(0).or_none(), tolerance=at_least(0),
            merge_z=at_least(0),
            min_gain=at_least(0), gain_z=at_least(0), follow_up_s=at_least(0),
            follow_up_min_gain=at_least(0), watch_hold_s=at_least(0),
            rollback_cooldown_s=at_least(0),
        )
        check_bounds(self, force_grace_s=self._grace_within_force())

    @property
    def longest_block_s(self) -> float:
        """The longest block a force holds (the grace comes on top)."""
        return max(self.profile_block_s, self.reprofile_block_s, self.confirm_block_s,
                   self.probe_block_s)

    def _grace_within_force(self) -> Bound:
        """A block's force lasts the block and the grace: no longer than engines accept."""
        longest = self.longest_block_s
        return Bound(f"<= {MAX_FORCE_S - longest:g}",
                     lambda grace: longest + grace > MAX_FORCE_S).because(
            f"a {longest:g} s block and the grace make a force, and engines take none longer "
            f"than {MAX_FORCE_S:.0f} s")
