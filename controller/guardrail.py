"""The guardrail: is the table just swapped in worse than the one it replaced?

Pure: fed step records (`StepColumns`), returns a `Verdict`; the caller acts on it
(`TableAgent.roll_back(reason, **evidence)` in an engine, the twin policy's switch in the twin).

Comparable windows. Goodput depends on load and on the workload, not only on the table, so
the comparison is stratified by batch-size bucket (octaves) and the baseline is only the
previous table's most recent steps before the swap (`baseline_window_s`); `reset_baseline`
drops older ones when drift was detected, because steps from before a drift do not compare
with steps after it. Per bucket, goodput is a ratio estimator (tokens / seconds) whose
variance comes from the delta method; buckets are combined in log space, weighted by the new
table's time share, so the verdict is about the traffic the engine actually serves.

Time blocks, not steps, set the error. Consecutive steps serve the same requests, and which
requests a closed loop holds drifts over a request's lifetime (seconds, tens of seconds for
long chats), so a few seconds of goodput vary far more than their steps' own error says.
So the log goodput of `block_s` blocks is compared around each window's mean, pooled over
both windows, and a window's error is the larger of that and the per-step delta method.

After a drift the baseline is the re-profile's settling stretch, the stale table's only
unforced steps in the new regime (`arm(baseline_since_s=...)`), and the traffic's wander
between that stretch and the watch shifts goodput by a level that the blocks inside either
window do not show: a swap armed `after_drift` adds that level shift
(`GuardrailConfig.drift_level_sd`) to the error.

Roll back only when the *upper* confidence bound of new/old goodput is below 1 - threshold:
confident that the new table is worse by more than the threshold, so a table equal to the old
one is never rolled back by noise, however long it is watched.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from controller.steps import StepColumns, batch_bucket
from schemas.bounds import above, at_least, check_bounds, in_range

N_BUCKETS = 16
"""Octave buckets cover batch sizes up to 65535."""


class GuardState(enum.Enum):
    IDLE = "idle"
    """No swap under watch; recent steps feed the next baseline."""
    WATCHING = "watching"
    """A swap is under watch."""


class Verdict(enum.Enum):
    HOLD = "hold"
    """Not enough evidence either way (or nothing under watch)."""
    KEEP = "keep"
    """The new table is, with confidence, not worse by more than the threshold."""
    ROLL_BACK = "roll_back"
    """The new table is, with confidence, worse by more than the threshold."""
    INCONCLUSIVE = "inconclusive"
    """The watch deadline passed without comparable evidence; the new table stays."""


@dataclass(frozen=True, slots=True)
class GuardrailConfig:
    """How much worse a swapped-in table may run before it is rolled back: the operator's
    threshold first, then the tuned constants (their measurements in docs/TUNING.md)."""

    # ---- what an operator sets ----
    threshold: float = 0.03
    """Roll back when the new table is worse than this fraction of the old one's goodput."""

    # ---- tuned constants (docs/TUNING.md) ----
    z: float = 3.0
    """One-sided confidence multiplier: high, because the verdict is taken again as each
    batch of steps comes, and every look is a chance of a false alarm."""
    baseline_window_s: float = 20.0
    """The old table's steps this long before the swap form the baseline: short, because
    goodput trends after a load or workload change (contexts grow for minutes), and the
    longer the baseline the more of that trend reads as the new table's fault."""
    warmup_s: float = 10.0
    """Steps right after the swap are skipped: a closed loop's batch holds the requests the
    old table served slowly until they finish, and at the new table's K it first shows that
    batch, on which the new table looks worse than it is."""
    min_steps_per_bucket: int = 100
    """A bucket counts only with this many steps in both windows: on fewer the delta
    method's variance of its ratio is not to be trusted."""
    max_watch_s: float = 300.0
    """Deadline: after this long without a confident verdict the new table stays."""
    no_comparison_s: float = 30.0
    """Sooner deadline when the new table serves batch sizes the old one never ran in its
    baseline (a load jump): nothing will ever compare, and a watch holds back refits."""
    block_s: float = 5.0
    """Time blocks whose goodput spread sets the error of a window (see the module doc)."""
    prior_variance_s: float = 0.015
    """Prior of that spread, as the variance of log goodput times seconds, worth `prior_dof`
    blocks: right after a swap a window has a block or two, too few to say how much goodput
    wanders. Wide enough that a re-profile's sound pick is not rolled back on a short
    baseline's wander; a far worse table still is, promptly."""
    prior_dof: float = 2.0
    """Blocks the prior is worth: a couple, so that a window's own spread outweighs it once
    the window has a few blocks."""
    drift_level_sd: float = 0.04
    """Added (as a standard deviation of log goodput) to the error of a swap armed
    `after_drift`: the refit at the end of a re-profile, compared with the stale table's
    settling stretch, the one window of it in the new regime; and to its follow-up's
    (`settling`), whose baseline lies in the same trend (twin, EAGLE 16 -> 64 users, seed
    62: K3, 1.5% better, rolled back to K4 at 0.911, 88 s after the jump). Between that and
    the watch the traffic's own wander moves goodput by a level that no watch length
    averages away, and without it a sound pick is rolled back to the table just called
    stale. 0 = compare as any other swap."""

    def __post_init__(self) -> None:
        check_bounds(self, threshold=in_range(0, 1, low_open=True, high_open=True),
                     drift_level_sd=at_least(0), block_s=above(0),
                     prior_variance_s=at_least(0), prior_dof=at_least(0), z=above(0),
                     min_steps_per_bucket=at_least(2))


def _ratio_sums(tokens: NDArray[np.float64], seconds: NDArray[np.float64],
                bucket: NDArray[np.int64]) -> NDArray[np.float64]:
    """Per bucket: n, sum x, sum y, sum xx, sum yy, sum xy (x = seconds, y = tokens)."""
    out = np.zeros((N_BUCKETS, 6))
    bucket = np.minimum(bucket, N_BUCKETS - 1)
    for j, values in enumerate((np.ones_like(tokens), seconds, tokens, seconds * seconds,
                                tokens * tokens, seconds * tokens)):
        out[:, j] = np.bincount(bucket, weights=values, minlength=N_BUCKETS)
    return out


def ratio_log_estimate(sums: NDArray[np.float64]) -> tuple[NDArray[np.float64],
                                                            NDArray[np.float64]]:
    """log(goodput) per bucket and its variance (delta method on the ratio estimator)."""
    n, sx, sy, sxx, syy, sxy = (sums[:, j] for j in range(6))
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = sy / sx
        resid = (syy - 2 * rate * sxy + rate * rate * sxx) / np.maximum(n - 1, 1)
        var_rate = np.maximum(resid, 0.0) * n / (sx * sx)
        return np.log(rate), var_rate / (rate * rate)


Blocks = dict[tuple[int, int], NDArray[np.float64]]
"""(bucket, block index) -> [seconds, tokens] of the steps in that time block."""


def _block_sums(steps: StepColumns, block_s: float) -> Blocks:
    bucket = np.minimum(batch_bucket(steps.batch_size), N_BUCKETS - 1)
    block = np.floor(steps.t_s / block_s).astype(np.int64)
    keys, inverse = np.unique(np.column_stack([bucket, block]), axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    seconds = np.bincount(inverse, weights=steps.latency_s, minlength=len(keys))
    tokens = np.bincount(inverse, weights=steps.tokens, minlength=len(keys))
    return {(int(b), int(i)): np.array([seconds[j], tokens[j]])
            for j, (b, i) in enumerate(keys)}


def _add_blocks(into: Blocks, more: Blocks) -> None:
    for key, value in more.items():
        if key in into:
            into[key] = into[key] + value
        else:
            into[key] = value.copy()


def block_log_variance(windows: list[Blocks], bucket: int, *, prior: float = 0.0,
                       prior_dof: float = 0.0) -> float:
    """Variance of log goodput per second of steps in `bucket`: a block of x seconds has
    variance tau^2 / x around its window's mean; tau^2 pooled over the windows' blocks
    with `prior` worth `prior_dof` blocks (0.0 without either)."""
    squares, blocks, fitted = 0.0, 0, 0
    for window in windows:
        rows = np.array([value for (b, _), value in window.items() if b == bucket
                         and value[0] > 0 and value[1] > 0])
        if rows.size == 0:
            continue
        seconds, tokens = rows[:, 0], rows[:, 1]
        center = np.log(tokens.sum() / seconds.sum())
        squares += float(seconds @ (np.log(tokens / seconds) - center) ** 2)
        blocks += rows.shape[0]
        fitted += 1
    dof = prior_dof + max(blocks - fitted, 0)
    return (prior_dof * prior + squares) / dof if dof > 0 else 0.0


@dataclass
class _Watch:
    new_version: int
    old_version: int
    at_s: float
    baseline: NDArray[np.float64]
    baseline_blocks: Blocks
    candidate: NDArray[np.float64] = field(default_factory=lambda: np.zeros((N_BUCKETS, 6)))
    candidate_blocks: Blocks = field(default_factory=dict)
    level_sd: float = 0.0


class Guardrail:
    """Watches one swap at a time; `observe` every chunk of records, read `verdict`."""

    def __init__(self, config: GuardrailConfig | None = None) -> None:
        self.config = config or GuardrailConfig()
        self.state = GuardState.IDLE
        self._recent: deque[tuple[float, int, NDArray[np.float64], Blocks]] = deque()
        """(chunk end time, version, per-bucket sums, block sums) of table steps, newest
        last."""
        self._watch: _Watch | None = None
        self.last_evidence: dict[str, Any] = {}

    # ---- inputs ---------------------------------------------------------------------------
    def observe(self, steps: StepColumns) -> None:
        if len(steps) == 0:
            return
        steps = steps.select(steps.table_steps() & (steps.decode_reqs > 0))
        if len(steps) == 0:
            return
        end_s = float(steps.t_s[-1])
        watch = self._watch
        for version in np.unique(steps.version):
            part = steps.select(steps.version == version)
            if watch is not None and version == watch.new_version:
                part = part.select(part.t_s >= watch.at_s + self.config.warmup_s)
                watch.candidate += self._sums(part)
                _add_blocks(watch.candidate_blocks, _block_sums(part, self.config.block_s))
            # every table's recent steps stay: the table under watch is the next baseline
            self._recent.append((end_s, int(version), self._sums(part),
                                 _block_sums(part, self.config.block_s)))
        horizon = end_s - self.config.baseline_window_s
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()

    def arm(self, new_version: int, old_version: int, at_s: float, *,
            after_drift: bool = False, settling: bool = False,
            baseline_since_s: float | None = None) -> None:
        """A swap from `old_version` to `new_version` happened at `at_s`: start watching.
        `after_drift`: the swap ends a re-profile, and its error carries
        `GuardrailConfig.drift_level_sd`. `settling`: the swap follows such a refit while
        the new regime still settles (its follow-up), so its baseline, the last
        `baseline_window_s`, lies in the same trend: the error carries the level shift too.
        `baseline_since_s`: the old table's steps from
        then on are the baseline (a re-profile's settling stretch, before its forced
        blocks), not those of the last `baseline_window_s`. It reaches back only as far as
        the kept steps do: they are pruned to `baseline_window_s` behind the newest table
        step observed, and forced steps are not table steps, so a sweep prunes nothing."""
        since_s = (at_s - self.config.baseline_window_s if baseline_since_s is None
                   else baseline_since_s)
        baseline = np.zeros((N_BUCKETS, 6))
        blocks: Blocks = {}
        for end_s, version, sums, chunk_blocks in self._recent:
            if version == old_version and end_s >= since_s:
                baseline += sums
                _add_blocks(blocks, chunk_blocks)
        self._watch = _Watch(new_version, old_version, at_s, baseline, blocks,
                             level_sd=(self.config.drift_level_sd
                                       if after_drift or settling else 0.0))
        self.state = GuardState.WATCHING

    @property
    def watch_started_s(self) -> float | None:
        """When the swap under watch happened (None when idle)."""
        return None if self._watch is None else self._watch.at_s

    def disarm(self) -> None:
        self._watch = None
        self.state = GuardState.IDLE

    def reset_baseline(self) -> None:
        """Drift was detected: earlier steps no longer compare with later ones."""
        self._recent.clear()
        if self._watch is not None:
            self._watch.baseline[:] = 0.0
            self._watch.baseline_blocks.clear()

    # ---- output ---------------------------------------------------------------------------
    def verdict(self, now_s: float) -> Verdict:
        """KEEP/ROLL_BACK/INCONCLUSIVE end the watch; `last_evidence` says why."""
        watch = self._watch
        if watch is None:
            return Verdict.HOLD
        cfg = self.config
        enough = ((watch.baseline[:, 0] >= cfg.min_steps_per_bucket)
                  & (watch.candidate[:, 0] >= cfg.min_steps_per_bucket))
        verdict = Verdict.HOLD
        if enough.any():
            log_new, var_new = ratio_log_estimate(watch.candidate[enough])
            log_old, var_old = ratio_log_estimate(watch.baseline[enough])
            for i, bucket in enumerate(np.flatnonzero(enough)):
                per_second = block_log_variance(
                    [watch.baseline_blocks, watch.candidate_blocks], int(bucket),
                    prior=cfg.prior_variance_s, prior_dof=cfg.prior_dof)
                var_new[i] = max(var_new[i], per_second / watch.candidate[bucket, 1])
                var_old[i] = max(var_old[i], per_second / watch.baseline[bucket, 1])
            weight = watch.candidate[enough, 1] / watch.candidate[enough, 1].sum()
            log_ratio = float(np.sum(weight * (log_new - log_old)))
            sd = float(np.sqrt(np.sum(weight * weight * (var_new + var_old))
                               + watch.level_sd ** 2))
            limit = math.log1p(-cfg.threshold)
            self.last_evidence = {
                "old_version": watch.old_version, "new_version": watch.new_version,
                "goodput_ratio": round(math.exp(log_ratio), 4),
                "ratio_upper": round(math.exp(log_ratio + cfg.z * sd), 4),
                "ratio_lower": round(math.exp(log_ratio - cfg.z * sd), 4),
                "threshold": cfg.threshold,
                "level_shift_sd": watch.level_sd,
                "buckets": [int(b) for b in np.flatnonzero(enough)],
                "steps_new": int(watch.candidate[enough, 0].sum()),
                "steps_old": int(watch.baseline[enough, 0].sum()),
                "watched_s": round(now_s - watch.at_s, 2),
            }
            if log_ratio + cfg.z * sd < limit:
                verdict = Verdict.ROLL_BACK
            elif log_ratio - cfg.z * sd > limit:
                verdict = Verdict.KEEP
        served = watch.candidate[:, 0] >= cfg.min_steps_per_bucket
        nothing_to_compare = (served.any() and not enough.any()
                              and now_s - watch.at_s >= cfg.no_comparison_s)
        if verdict is Verdict.HOLD and (nothing_to_compare
                                        or now_s - watch.at_s >= cfg.max_watch_s):
            verdict = Verdict.INCONCLUSIVE
            self.last_evidence = {**self.last_evidence, "old_version": watch.old_version,
                                  "new_version": watch.new_version}
        if verdict is not Verdict.HOLD:
            self.disarm()
        return verdict

    @staticmethod
    def _sums(steps: StepColumns) -> NDArray[np.float64]:
        return _ratio_sums(steps.tokens, steps.latency_s, batch_bucket(steps.batch_size))
