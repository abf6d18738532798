"""Drift detection: live steps against what the active table's envelope predicted.

Pure: `set_envelope` when a table becomes active, `observe` step records as they come,
and a `DriftReport` comes back when the table has gone stale; the caller emits `stale` with
the report's fields so the fitter refits. Three signals, each with its magnitude:

- latency: log(observed / predicted) step latency on pure-decode steps that verified and
  proposed the table's K (the envelope's `surface.latency_s`, interpolated in batch size);
  context growth, a new kernel or a throttled GPU all show here;
- acceptance: tokens per drafting request, observed over predicted at the K the step
  verified (exploration steps included since they are honest samples); a change in the
  workload mix shows here. The prediction is the one the envelope's goodput used
  (`drafting_request_tokens`): the pooled acceptance length corrected for the batch the
  K keeps, not the pooled one alone;
- coverage: the share of steps at batch sizes far outside the ones the table was fitted on
  (a load jump: the table there is an extrapolation however good the residuals look).

Where the active envelope carries a per-request budget, the engines draft each request its
own K, which the table's predictions do not describe: latency and acceptance then read only
steps whose drafts were proposed at one forced K for all (acceptance: the step after each
exploration probe; latency: runs of forced steps, which exploration's single-step probes do
not make). Under a budget, latency drift is therefore not watched, and acceptance drift
only from probes; coverage and the periodic refits carry the rest.

A signal fires when, over the sliding window, its magnitude passes its threshold and its
z-score passes `z`: magnitude keeps model misfit from firing, z keeps noise from firing.
Acceptance is also read over the newest seconds alone, at a higher bar: such a report is
`fast`, a hint that a workload switched (soon enough to recall a regime seen before) which
leaves the detector's state as it is; the window reports the drift once it passes the bar
there (in a quiet spell, once `renotify_s` is over).
The fitter's own misfit is learned per table as a reference over the first `reference_s`
of the watch, so a fit that is 3% off everywhere is not "drift" - a change after it is.
A reference that misses by more than a drift is reported at once, if the miss stands out
against both samples: the reference's and the fit's own steps (`set_envelope(fit_steps=)`),
since at a small batch a 30 s profile sees a few dozen requests whose acceptance is far from
uniform (a handful that repeat their prompt draw much of the mean).
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from controller.steps import StepColumns
from schemas.bounds import Bound, above, at_least, check_bounds, in_range


class DriftState(enum.Enum):
    BLIND = "blind"
    """The active table carries no prediction (startup or hand-made table)."""
    REFERENCE = "reference"
    """Learning this table's misfit against its own prediction."""
    WATCHING = "watching"
    STALE = "stale"
    """Reported; quiet until a new table or `renotify_s` passes (but for fast hints)."""


@dataclass(frozen=True, slots=True)
class DriftConfig:
    """When the table in service is called stale: the operator's threshold first, then the
    tuned constants (their measurements in docs/TUNING.md)."""

    # ---- what an operator sets ----
    acceptance_threshold: float = 0.15
    """Relative change of acceptance (beyond the reference) that makes a table stale: how far
    the workload may move before a re-profile. The bars counted in thresholds
    (`after_sweep_factor`, the misfit factors, `LoopConfig.regime_acceptance_factor`) move
    with it."""

    # ---- tuned constants (docs/TUNING.md) ----
    window_s: float = 60.0
    """Sliding window over which residuals are averaged. A minute, because a closed loop's
    acceptance wanders with the few requests that dominate it; a switch of workload is a
    lasting shift and still shows within a minute."""
    reference_s: float = 20.0
    """Residuals over this long after a table becomes active are its misfit reference: long
    enough to average the fit's bias over many requests, short so that watching starts soon
    after a swap."""
    warmup_s: float = 2.0
    """Steps this soon after a table becomes active are left out: the batch still holds what
    the previous table left behind."""
    latency_threshold: float = 0.20
    """Relative latency change (beyond the reference) that makes a table stale. High, because
    latency is a proxy: a uniform slowdown leaves the best K where it was, and the contexts
    of a load that just grew (requests still young) or of longer prompts move it while the
    table stays right."""
    coverage_threshold: float = 0.5
    """Share of steps outside the fitted batch range that makes a table stale: half, so that
    the load has moved there rather than visited."""
    coverage_factor: float = 2.0
    """'Outside' = batch size above factor x the largest fitted one, or below 1/factor x the
    smallest."""
    misfit_factor: float = 1.0
    """A table whose own reference misses its prediction by this many thresholds is stale
    from the start (see `DriftDetector._misfit_report`); below that the miss is the fit's
    bias, learned as the reference. One threshold: a miss as large as a drift is one (a
    re-profile that straddled a workload switch fitted the old workload)."""
    confirmed_misfit_factor: float = 1.5
    """The same for the table fitted at the end of a re-profile whose confirmation ran its
    K values steadily (`set_envelope(confirmed=True)`): their yield was measured, not
    extrapolated, and what is left of a miss is the closed loop's wander over the
    `reference_s` reference, which one threshold mistakes for a drift."""
    after_sweep_s: float = 180.0
    after_sweep_factor: float = 2.0
    """For `after_sweep_s` after a sweep over every K measured the regime (`after_sweep`),
    the acceptance signal must pass this many thresholds (1.0: no stricter period). The
    table was fitted on that sweep minutes ago, and its reference is `reference_s` of a
    closed loop whose acceptance wanders with the few requests that dominate it: at one
    threshold that wander starts needless re-profiles, while a real workload switch passes
    two with room. Latency and coverage keep their bars: a load jump right after a
    re-profile shows there first. The misfit check keeps its own factors (`misfit_factor`,
    `confirmed_misfit_factor`)."""
    z: float = 5.0
    """A shift must also stand this many standard errors out, so that noise alone never
    fires: the detector tests again at every chunk (`chunk_s`)."""
    min_steps: int = 200
    """Steps a signal needs (in the window, and in the reference) before it may fire: fewer
    hold too few requests to tell a drift from the batch's own wander."""
    renotify_s: float = 60.0
    """A table left stale is reported again after this long (a lost `stale`, or a re-profile
    that did not come, gets another chance)."""
    fast_window_s: float = 10.0
    """The newest this many seconds of the window are also tested alone, at `fast_factor`
    thresholds: a switch of workload shows in full within seconds, where the minute's mean
    takes half a minute to reach the bar (twin, n-gram at 32 users: per second +40-50%
    acceptance 4 s after the switch, the minute's mean at the bar 31 s after it). Such a
    report is `fast` and leaves the detector's state as it is: soon enough to recall a regime
    seen before, too soon to measure a new one (its requests are young; n-gram acceptance
    grows with their output). Acceptance only: a latency shift says nothing of which
    traffic runs. 0 = off; at least four `chunk_s` chunks otherwise."""
    fast_factor: float = 2.0
    """A shift over `fast_window_s` must pass this many thresholds (or the after-sweep
    factor's, if larger): ten seconds of a closed loop wander more than a minute does, so
    only a shift twice the size of a drift is one there ..."""
    fast_load_factor: float = 1.5
    """... and their mean batch size must lie within this factor of the reference's and the
    window's: a load that moves is a batch still draining, whose survivors accept and cost
    what neither regime does (twin, EAGLE 128 -> 16 users: read 18 s after the drop, 37%
    under)."""
    chunk_s: float = 1.0
    """Standard errors come from the means of chunks this many seconds of telemetry time
    long, however the records arrived: a service that falls behind gets them in larger
    batches, and chunks made of batches would leave it too few to test (the twin's
    in-memory ticks are 1 s)."""

    def __post_init__(self) -> None:
        # chunk_s before fast_window_s: the latter's bound is read in chunks.
        check_bounds(self, window_s=above(0), reference_s=at_least(0), min_steps=at_least(2),
                     chunk_s=in_range(0, self.window_s / 4, low_open=True).because(
                         "a quarter of window_s at most"),
                     fast_window_s=Bound(
                         "0 (off), or 4 x chunk_s to window_s (it tests at least 4 chunks)",
                         lambda value: not (value == 0 or 4 * self.chunk_s <= value
                                            <= self.window_s)),
                     fast_factor=at_least(1), fast_load_factor=above(1))


@dataclass(frozen=True, slots=True)
class DriftReport:
    signal: str
    """latency | acceptance | coverage"""
    magnitude: float
    """Relative change (observed / predicted - 1, beyond the reference), or the share."""
    z: float
    steps: int
    version: int
    against_prediction: float = math.nan
    """The same change against the table's own prediction, the reference's miss included
    (latency and acceptance): a rise back to what the table priced hides nothing from it."""
    fast: bool = False
    """Acceptance read over the newest `DriftConfig.fast_window_s` alone: a hint, repeated
    while it holds; the detector's state does not change, and the window reports the drift
    once it passes the bar there."""

    def fields(self) -> dict[str, Any]:
        fields = {"signal": self.signal, "magnitude": round(self.magnitude, 4),
                  "z": round(min(self.z, 999.0), 2), "steps": self.steps,
                  "version": self.version}
        if math.isfinite(self.against_prediction):
            fields["against_prediction"] = round(self.against_prediction, 4)
        if self.fast:
            fields["fast"] = True
        return fields


BATCH_MEANS_SIZES = (1, 2, 4)
"""Chunks per batch tried by the standard errors of a fit's steps and of the reference in the
misfit check: up to 4 s, the time a small batch's acceptance was seen to run high or low
together on the twin's traces."""
_STATS = 9  # n_lat, sum r, sum r^2, n_acc, sum observed, sum expected, n_outside, n_steps,
# sum of batch sizes


def drafting_request_tokens(surface: Mapping[str, Any], column: int) -> float:
    """Tokens a drafting request emits per step at the surface's `column`-th K, as the
    envelope's goodput predicted them: 1 + (AL - 1) c(K), recovered from its tokens per
    decode request (1 + s (AL - 1) c(K)) and draft share s.

    The pooled acceptance length AL alone leaves out the batch-composition factor c(K)
    (`fitter.surface.composition`), which under n-gram falls steeply with K, so a sound
    table at a large K would miss AL from its first steps and the misfit check would call
    it stale. Envelopes without the fields fall back to AL."""
    pooled = float(surface["acceptance_length"][column])
    tokens = surface.get("tokens_per_request")
    share = surface.get("draft_share")
    if tokens is None or not share or share <= 0:
        return pooled
    return 1.0 + (float(tokens[column]) - 1.0) / float(share)


def drafting_tokens_by_k(surface: Mapping[str, Any]) -> NDArray[np.float64]:
    """`drafting_request_tokens` indexed by K (0..the surface's largest), NaN at a K the
    surface leaves out."""
    k_values = [int(k) for k in surface["k_values"]]
    tokens = np.full(max(k_values) + 1, np.nan)
    for column, k in enumerate(k_values):
        tokens[k] = drafting_request_tokens(surface, column)
    return tokens


class DriftDetector:
    def __init__(self, max_batch: int, config: DriftConfig | None = None) -> None:
        self.config = config or DriftConfig()
        self.max_batch = max_batch
        self.state = DriftState.BLIND
        self.version = 0
        self._latency: NDArray[np.float64] | None = None
        """Predicted log latency, dense (max_batch + 1, max_k + 1); NaN where unknown."""
        self._al: NDArray[np.float64] | None = None
        self._fitted_range: tuple[int, int] | None = None
        self._since_s = 0.0
        self._reported_s = 0.0
        self._strict_until_s = -math.inf
        self._misfit_factor = self.config.misfit_factor
        """The active envelope's misfit factor."""
        self._budget = False
        """The active envelope carries a budget: only forced steps draft one K for all."""
        self._window: deque[tuple[float, NDArray[np.float64]]] = deque()
        """(chunk end, summed stats of the chunk), newest last."""
        self._ref_lat = 0.0
        self._ref_acc = 0.0
        self._ref_stats = np.zeros(_STATS)
        self._ref_chunks: list[NDArray[np.float64]] = []
        self._ref_se = (0.0, 0.0)
        """Standard errors of the reference's latency and acceptance means."""
        self._fit_se = (0.0, 0.0)
        """The same for the fit's steps against their own envelope: the prediction's error."""
        self._fit_chunks = 0
        self._referenced = False
        """The active table's reference was learned (a coverage report can cut it short)."""
        self._open: tuple[int, float, NDArray[np.float64]] | None = None
        """(chunk index, newest step time, summed stats) of the chunk still filling."""

    def set_envelope(self, version: int, surface: Mapping[str, Any] | None, at_s: float, *,
                     fitted_batch_range: tuple[int, int] | None = None,
                     confirmed: bool = False, fit_steps: StepColumns | None = None,
                     budget: bool = False) -> None:
        """A table became active at `at_s`; `surface` is its envelope's (None: no prediction).
        `budget`: the envelope carries a per-request budget, which the engines run.
        `confirmed`: the refit that ends a re-profile, chosen among K values its
        confirmation ran steadily (`DriftConfig.confirmed_misfit_factor`). `fit_steps`: the
        steps the envelope was fitted on, whose spread is the prediction's error in the
        misfit check (None: the reference's error alone)."""
        self.version = version
        self._budget = budget
        self._window.clear()
        self._open = None
        self._since_s = at_s
        self._ref_stats = np.zeros(_STATS)
        self._ref_chunks = []
        self._ref_se = (0.0, 0.0)
        self._ref_lat = self._ref_acc = 0.0
        self._fit_se = (0.0, 0.0)
        self._fit_chunks = 0
        self._referenced = self.config.reference_s <= 0  # no reference period: none to learn
        self._fitted_range = fitted_batch_range
        self._misfit_factor = (self.config.confirmed_misfit_factor if confirmed
                               else self.config.misfit_factor)
        if not surface or "latency_s" not in surface:
            self._latency = self._al = None
            self.state = DriftState.BLIND
            return
        batch = np.asarray(surface["batch_sizes"], dtype=np.float64)
        k_values = [int(k) for k in surface["k_values"]]
        latency = np.asarray(surface["latency_s"], dtype=np.float64)
        dense = np.full((self.max_batch + 1, max(k_values) + 1), np.nan)
        grid = np.arange(self.max_batch + 1, dtype=np.float64)
        for j, k in enumerate(k_values):
            dense[:, k] = np.log(np.interp(grid, batch, latency[:, j]))
        self._latency, self._al = dense, drafting_tokens_by_k(surface)
        if fit_steps is not None and len(fit_steps):
            chunks = self._chunked(fit_steps)
            self._fit_se = (self._batch_means_se(chunks, 0), self._batch_means_se(chunks, 3))
            self._fit_chunks = len(chunks)
        self.state = DriftState.REFERENCE if self.config.reference_s > 0 else DriftState.WATCHING

    @property
    def since_s(self) -> float:
        """When the active table's watch began (its activation, or the last `rereference`)."""
        return self._since_s

    def rereference(self, now_s: float) -> None:
        """The table stays after a drift that hid nothing (acceptance rose where it drafts
        the largest K, or back to its own prediction): learn its new miss, latency and
        acceptance, as the reference from `now_s`, with no misfit check, so that the
        detector watches for the next change, not this one again every `renotify_s`.
        Without a reference period (`reference_s` = 0) there is nothing to relearn, and
        the report stays quiet until `renotify_s` as any other."""
        if self._latency is None or self.config.reference_s <= 0:
            return
        self._open = None
        self._misfit_factor = math.inf
        self._learn_reference(now_s)

    def _learn_reference(self, now_s: float) -> None:
        """Learn the table's reference again from `now_s`."""
        self._window.clear()
        self._since_s = now_s
        self._ref_stats = np.zeros(_STATS)
        self._ref_chunks = []
        self._referenced = False
        self.state = DriftState.REFERENCE

    def after_sweep(self, now_s: float) -> None:
        """A sweep over every K just measured the regime: raise the bars for a while (see
        `DriftConfig.after_sweep_factor`)."""
        self._strict_until_s = now_s + self.config.after_sweep_s

    def _bar(self, signal: str, threshold: float, now_s: float) -> float:
        """The log shift `signal` must pass at `now_s`."""
        strict = signal == "acceptance" and now_s < self._strict_until_s
        return math.log1p((self.config.after_sweep_factor if strict else 1.0) * threshold)

    def observe(self, steps: StepColumns) -> DriftReport | None:
        """Add records; a report when the active table has just gone stale (or a `fast` hint
        that acceptance moved; a window's report wins within one call). A chunk of
        `chunk_s` is tested once a step of a later chunk arrives (late steps of an earlier
        one join the chunk still filling)."""
        if self._latency is None or len(steps) == 0:
            return None
        cfg = self.config
        steps = steps.select((steps.version == self.version)
                             & (steps.t_s >= self._since_s + cfg.warmup_s))
        if len(steps) == 0:
            return None
        index = np.floor(steps.t_s / cfg.chunk_s).astype(np.int64)
        report = None
        for chunk in np.unique(index):
            part = steps.select(index == chunk)
            stats, newest_s = self._stats(part), float(part.t_s.max())
            if self._open is not None and chunk <= self._open[0]:
                open_index, open_s, open_stats = self._open
                self._open = (open_index, max(open_s, newest_s), open_stats + stats)
                continue
            if self._open is not None:
                added = self._add_chunk(self._open[1], self._open[2])
                if added is not None and (report is None or report.fast):
                    report = added  # a fast report never hides the window's
            self._open = (int(chunk), newest_s, stats)
        return report

    def _add_chunk(self, now_s: float, stats: NDArray[np.float64]) -> DriftReport | None:
        cfg = self.config
        if self.state is DriftState.REFERENCE:
            self._ref_stats += stats
            self._ref_chunks.append(stats)
            # the load needs no reference: a table that starts (or a replica that resumes)
            # in a load jump is stale from its first few hundred steps; its reference is
            # learned again once the report's quiet spell is over (`renotify_s`)
            report = self._coverage(self._ref_stats)
            if report is None:
                if now_s - self._since_s < cfg.warmup_s + cfg.reference_s:
                    return None
                report = self._end_reference()
            if report is not None:
                self.state = DriftState.STALE
                self._reported_s = now_s
            return report
        self._window.append((now_s, stats))
        while self._window and self._window[0][0] < now_s - cfg.window_s:
            self._window.popleft()
        if self.state is DriftState.STALE:
            if now_s - self._reported_s < cfg.renotify_s:
                # quiet, but still hinting: a drift reported while the batch turned over
                # matched no regime, and its traffic may match one seconds later (twin,
                # n-gram return to GSM8K: reported 10 s in, matched by the hints after); a
                # table kept after acceptance fell 12% ran such a return for 40 s
                if not self._referenced:
                    return None
                return self._fast_check(now_s, self._window_stats())
            if not self._referenced:  # a coverage report cut its reference short
                self._learn_reference(now_s)
                return None
            self.state = DriftState.WATCHING
        report = self._check(now_s)
        if report is not None and not report.fast:
            self.state = DriftState.STALE
            self._reported_s = now_s
        return report

    # ---- internals ------------------------------------------------------------------------
    def _stats(self, steps: StepColumns) -> NDArray[np.float64]:
        assert self._latency is not None and self._al is not None
        stats = np.zeros(_STATS)
        batch = np.minimum(steps.batch_size, self.max_batch)
        max_k = self._latency.shape[1] - 1
        one_k = steps.forced & steps.after_forced() if self._budget else steps.table_steps()
        steady = (one_k & (steps.prefill_reqs == 0) & (steps.k == steps.k_next)
                  & (steps.k <= max_k) & (steps.decode_reqs > 0))
        predicted = self._latency[batch[steady], steps.k[steady]]
        ok = np.isfinite(predicted)
        resid = np.log(steps.latency_s[steady][ok]) - predicted[ok]
        stats[0], stats[1], stats[2] = resid.size, resid.sum(), (resid * resid).sum()
        drafting = (steps.num_drafts > 0) & (steps.k > 0) & (steps.k <= max_k)
        if self._budget:
            drafting &= steps.after_forced()
        al = self._al[steps.k[drafting]]
        ok = np.isfinite(al)
        observed = (steps.accepted[drafting][ok] + steps.num_drafts[drafting][ok]).astype(float)
        expected = steps.num_drafts[drafting][ok] * al[ok]
        stats[3], stats[4], stats[5] = ok.sum(), observed.sum(), expected.sum()
        if self._fitted_range is not None:
            low, high = self._fitted_range
            factor = self.config.coverage_factor
            outside = (steps.batch_size > factor * high) | (steps.batch_size * factor < low)
            stats[6] = float(outside.sum())
        stats[7] = len(steps)
        stats[8] = float(steps.batch_size.sum())
        return stats

    @staticmethod
    def _means(stats: NDArray[np.float64]) -> tuple[float, float]:
        """Mean log latency residual and log acceptance ratio of summed stats."""
        lat = stats[1] / stats[0] if stats[0] else 0.0
        acc = math.log(stats[4] / stats[5]) if stats[4] > 0 and stats[5] > 0 else 0.0
        return float(lat), float(acc)

    def _end_reference(self) -> DriftReport | None:
        """The reference's means and errors from its chunks; watching starts. A report when
        the table misses its own prediction by a drift (`_misfit_report`)."""
        self._ref_lat, self._ref_acc = self._means(self._ref_stats)
        chunks = np.array(self._ref_chunks)
        # the fit's wander, scaled to the reference's length, bounds the reference's error
        # from below: 20 s of a small batch may all fall in one quiet stretch
        wander = [se * math.sqrt(self._fit_chunks / len(chunks)) for se in self._fit_se]
        self._ref_se = (max(self._chunk_se(chunks, 0), wander[0]),
                        max(self._chunk_se(chunks, 3), wander[1]))
        self.state = DriftState.WATCHING
        self._referenced = True
        return self._misfit_report((max(self._batch_means_se(chunks, 0), wander[0]),
                                    max(self._batch_means_se(chunks, 3), wander[1])))

    def _misfit_report(self, sample_se: tuple[float, float]) -> DriftReport | None:
        """A table that misses its own prediction by more than a drift would, from its first
        steps on, is stale already: it was fitted on another regime (a refit that caught
        only the first seconds of a change), and learning that miss as the reference would
        hide it for good. The miss is tested against both samples' errors (`sample_se`:
        the reference's, from batch means)."""
        cfg = self.config
        for signal, column, value, threshold in (
                ("latency", 0, self._ref_lat, cfg.latency_threshold),
                ("acceptance", 3, self._ref_acc, cfg.acceptance_threshold)):
            se = math.hypot(sample_se[column // 3], self._fit_se[column // 3])
            if (self._ref_stats[column] >= cfg.min_steps
                    and abs(value) >= math.log1p(self._misfit_factor * threshold)
                    and se > 0 and abs(value) / se >= cfg.z):
                return DriftReport(signal, math.expm1(value), abs(value) / se,
                                   int(self._ref_stats[7]), self.version,
                                   against_prediction=math.expm1(value))
        return None

    def _chunked(self, steps: StepColumns) -> NDArray[np.float64]:
        """Summed stats per `chunk_s` of telemetry time, oldest first."""
        index = np.floor(steps.t_s / self.config.chunk_s).astype(np.int64)
        return np.array([self._stats(steps.select(index == chunk))
                         for chunk in np.unique(index)])

    def _batch_means_se(self, chunks: NDArray[np.float64], column: int) -> float:
        """The largest standard error of the mean over batches of 1, 2 and 4 consecutive
        chunks (at least 4 batches each), with the spread taken from successive differences.
        Batches: a small batch's acceptance runs high or low for seconds together when a few
        requests dominate it, and single chunks would count those seconds as independent.
        Differences: one level shift inside a fit (a switch it straddled) is the misfit to
        catch, not spread to forgive."""
        best = 0.0
        usable = chunks[chunks[:, column] > 0] if chunks.size else chunks
        for size in BATCH_MEANS_SIZES:
            whole = len(usable) // size
            if whole < 4:
                break
            merged = usable[:whole * size].reshape(whole, size, -1).sum(axis=1)
            means = np.array([self._means(row)[0 if column == 0 else 1] for row in merged])
            variance = float(np.sum(np.diff(means) ** 2)) / (2 * (whole - 1))
            best = max(best, math.sqrt(variance / whole))
        return best

    def _chunk_se(self, chunks: NDArray[np.float64], column: int) -> float:
        """Standard error of a mean from its chunks' means (0 with fewer than 4 chunks)."""
        usable = chunks[chunks[:, column] > 0] if chunks.size else chunks
        if len(usable) < 4:
            return 0.0
        per_chunk = np.array([self._means(chunk)[0 if column == 0 else 1] for chunk in usable])
        return float(np.std(per_chunk, ddof=1)) / math.sqrt(len(usable))

    def _check(self, now_s: float) -> DriftReport | None:
        """Standard errors come from chunk means (batch means), not steps: consecutive
        steps share their requests, so per-step residuals are far from independent and a
        per-step z would call a few unusual requests a drift. The reference is such a mean
        too, over a handful of requests at a small batch: its error counts in the z."""
        cfg = self.config
        chunks = np.array([entry[1] for entry in self._window])
        stats = chunks.sum(axis=0)
        steps = int(stats[7])
        coverage = self._coverage(stats)
        if coverage is not None:
            return coverage
        lat, acc = self._means(stats)
        candidates = []
        for signal, column, value, ref, ref_se, threshold in (
                ("latency", 0, lat, self._ref_lat, self._ref_se[0], cfg.latency_threshold),
                ("acceptance", 3, acc, self._ref_acc, self._ref_se[1],
                 cfg.acceptance_threshold)):
            usable = chunks[chunks[:, column] > 0]
            if stats[column] < cfg.min_steps or len(usable) < 4:
                continue
            se = math.hypot(self._chunk_se(chunks, column), ref_se)
            shift = value - ref
            candidates.append((signal, shift, abs(shift) / se if se > 0 else math.inf,
                               threshold))
        for signal, shift, z, threshold in candidates:
            if abs(shift) >= self._bar(signal, threshold, now_s) and z >= cfg.z:
                return self._report(signal, z, steps)
        return self._fast_check(now_s, stats)

    def _window_stats(self) -> NDArray[np.float64]:
        """The window's chunks, summed."""
        return np.array([entry[1] for entry in self._window]).sum(axis=0)

    def _fast_check(self, now_s: float, window: NDArray[np.float64]) -> DriftReport | None:
        """Acceptance over the newest `fast_window_s` alone against the reference's, at
        `fast_factor` thresholds (`window`: the window's summed stats, for its load).
        Its error is at least the reference's wander over as many chunks (its chunk spread
        is this table's closed loop at rest): ten chunks of a few requests that run high
        together would otherwise read as a tight mean. Silent where the load moved
        (`fast_load_factor`) against the reference's or the window's."""
        cfg = self.config
        if cfg.fast_window_s <= 0 or cfg.reference_s <= 0:
            return None  # without a reference, no wander to bound ten seconds' error
        recent = np.array([stats for end_s, stats in self._window
                           if end_s > now_s - cfg.fast_window_s])
        if len(recent) < 4:
            return None
        stats = recent.sum(axis=0)
        if not all(self._load_near(stats, other) for other in (self._ref_stats, window)):
            return None
        usable = recent[recent[:, 3] > 0]
        if stats[3] < cfg.min_steps or len(usable) < 4:
            return None
        reference_chunks = max(sum(1 for chunk in self._ref_chunks if chunk[3] > 0), 1)
        wander = self._ref_se[1] * math.sqrt(reference_chunks / len(usable))
        se = math.hypot(max(self._chunk_se(recent, 3), wander), self._ref_se[1])
        threshold = cfg.acceptance_threshold
        strict = self._bar("acceptance", threshold, now_s) > math.log1p(threshold)
        factor = max(cfg.fast_factor, cfg.after_sweep_factor if strict else 1.0)
        shift = abs(self._means(stats)[1] - self._ref_acc)
        if shift >= math.log1p(factor * threshold) and se > 0 and shift / se >= cfg.z:
            return self._report("acceptance", shift / se, int(stats[7]), fast=True)
        return None

    def _load_near(self, stats: NDArray[np.float64], other: NDArray[np.float64]) -> bool:
        """Whether the mean batch sizes of two summed stats lie within `fast_load_factor`
        of each other (False where either has no steps or no batch)."""
        if min(stats[7], stats[8], other[7], other[8]) <= 0:
            return False
        ratio = (stats[8] / stats[7]) / (other[8] / other[7])
        return abs(math.log(ratio)) <= math.log(self.config.fast_load_factor)

    def _report(self, signal: str, z: float, steps: int, *, fast: bool = False) -> DriftReport:
        """A report of `signal`, sized by its newest steps (`_recent_level`)."""
        level = self._recent_level(signal)
        reference = self._ref_lat if signal == "latency" else self._ref_acc
        return DriftReport(signal, math.expm1(level - reference), z, steps, self.version,
                           against_prediction=math.expm1(level), fast=fast)

    def _coverage(self, stats: NDArray[np.float64]) -> DriftReport | None:
        """`coverage_threshold` of `min_steps` or more steps outside the fitted range."""
        steps = int(stats[7])
        if steps >= self.config.min_steps and stats[6] >= self.config.coverage_threshold * steps:
            return DriftReport("coverage", stats[6] / steps, math.inf, steps, self.version)
        return None

    def _recent_level(self, signal: str) -> float:
        """The log ratio to the prediction over the newest `min_steps` steps: a drift is
        caught while the window still mixes old and new steps, and the fitter wants the
        size of the new regime."""
        stats = np.zeros(_STATS)
        column = 0 if signal == "latency" else 3
        for _, chunk in reversed(self._window):
            stats += chunk
            if stats[column] >= self.config.min_steps:
                break
        lat, acc = self._means(stats)
        return lat if signal == "latency" else acc
