"""What the closed loop's operator can set, and the tuned constants behind its decisions."""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.drift import DriftConfig
from controller.exploration import ExplorationConfig
from controller.guardrail import GuardrailConfig


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
    guardrail: GuardrailConfig = field(default_factory=GuardrailConfig)
    drift: DriftConfig = field(default_factory=DriftConfig)

    def __post_init__(self) -> None:
        for name in ("profile_block_s", "reprofile_block_s", "refit_interval_s",
                     "fit_window_s", "force_grace_s", "engine_idle_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LoopConfig.{name}={getattr(self, name)} must be > 0")
        for name in ("reprofile_settle_s", "confirm_block_s", "follow_up_s", "watch_hold_s",
                     "rollback_cooldown_s", "tolerance", "min_gain", "gain_z",
                     "follow_up_min_gain", "regime_acceptance_factor"):
            if getattr(self, name) < 0:
                raise ValueError(f"LoopConfig.{name}={getattr(self, name)} must be >= 0")
        if self.profile_rounds < 1:
            raise ValueError(f"LoopConfig.profile_rounds={self.profile_rounds} must be >= 1")
        if not 0 < self.canary_share <= 1:
            raise ValueError(f"LoopConfig.canary_share={self.canary_share} must be in (0, 1]")
        if self.half_life_s is not None and self.half_life_s <= 0:
            raise ValueError(f"LoopConfig.half_life_s={self.half_life_s} must be > 0")
