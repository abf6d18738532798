"""The drift detector flags a shifted acceptance or latency (with its magnitude), a load that
left the fitted range, and stays quiet on noise around the prediction."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np
import pytest

from controller.drift import DriftConfig, DriftDetector, DriftState
from controller.steps import StepColumns

K_VALUES = [0, 1, 2, 3]
AL = [1.0, 1.7, 2.1, 2.4]


def surface() -> dict[str, Any]:
    batch = [1, 2, 4, 8, 16, 32, 64, 128]
    latency = [[0.008 + 0.0001 * b * (k + 1) for k in K_VALUES] for b in batch]
    return {"batch_sizes": batch, "k_values": K_VALUES, "latency_s": latency,
            "acceptance_length": AL}


def steps(rng: np.random.Generator, t0: float, n: int, *, latency_factor: float = 1.0,
          acceptance_factor: float = 1.0, batch: int = 32, k: int = 2) -> StepColumns:
    """Steps as the prediction says (times the factors), with 3% latency noise and
    binomial-ish acceptance noise."""
    decode = np.full(n, batch)
    latency = (0.008 + 0.0001 * batch * (k + 1)) * latency_factor
    latency_s = latency * (1 + 0.03 * rng.standard_normal(n))
    mean_accepted = batch * (AL[k] * acceptance_factor - 1)
    accepted = rng.poisson(mean_accepted, n)
    return StepColumns(
        t_s=t0 + np.arange(n) * latency, batch_size=decode, decode_reqs=decode,
        prefill_reqs=np.zeros(n, np.int64), k=np.full(n, k), k_next=np.full(n, k),
        num_drafts=decode, accepted=accepted, latency_s=latency_s,
        version=np.full(n, 7), forced=np.zeros(n, bool))


def feed(detector: DriftDetector, rng: np.random.Generator, seconds: range,
         **shift: Any) -> list[Any]:
    """Every report, fast hints included: a test of quiet traffic asserts neither comes."""
    reports = []
    for second in seconds:
        report = detector.observe(steps(rng, float(second), 60, **shift))
        if report is not None:
            reports.append(report)
    return reports


def window(reports: list[Any]) -> list[Any]:
    """The window's reports (a fast hint, of the newest seconds alone, repeats while it
    holds)."""
    return [report for report in reports if not report.fast]


def fresh(**config: Any) -> DriftDetector:
    detector = DriftDetector(max_batch=128, config=DriftConfig(**config))
    detector.set_envelope(7, surface(), at_s=0.0, fitted_batch_range=(16, 48))
    return detector


@pytest.mark.parametrize("seed", range(5))
def test_noise_around_the_prediction_is_not_drift(seed: int) -> None:
    rng = np.random.default_rng(seed)
    detector = fresh()
    assert feed(detector, rng, range(0, 120)) == []
    assert detector.state is DriftState.WATCHING


def test_acceptance_shift_is_flagged_with_its_magnitude() -> None:
    rng = np.random.default_rng(1)
    detector = fresh()
    assert feed(detector, rng, range(0, 40)) == []
    reports = window(feed(detector, rng, range(40, 80), acceptance_factor=1.3))
    assert len(reports) == 1  # reported once, then quiet until renotify_s
    report = reports[0]
    assert report.signal == "acceptance"
    assert report.magnitude == pytest.approx(0.3, abs=0.08)
    assert report.fields()["version"] == 7
    assert detector.state is DriftState.STALE


def _concat(parts: list[StepColumns]) -> StepColumns:
    return StepColumns(**{name: np.concatenate([getattr(p, name) for p in parts])
                          for name in StepColumns.__dataclass_fields__})


@pytest.mark.parametrize("batch_s", [1, 5, 20])
def test_a_drift_is_flagged_however_the_records_are_batched(batch_s: int) -> None:
    """A service that falls behind reads the same steps in larger batches: the detector's
    chunks are telemetry seconds, so it still sees the drift, at the same step."""
    rng = np.random.default_rng(1)
    seconds = [steps(rng, float(t), 60) for t in range(0, 40)]
    seconds += [steps(rng, float(t), 60, acceptance_factor=1.3) for t in range(40, 80)]
    detector = fresh()
    reports = [detector.observe(_concat(seconds[i:i + batch_s]))
               for i in range(0, len(seconds), batch_s)]
    found = [r for r in reports if r is not None and not r.fast]
    assert len(found) == 1 and found[0].signal == "acceptance"
    one_by_one = fresh()
    expected = [r for r in (one_by_one.observe(part) for part in seconds)
                if r is not None and not r.fast]
    assert found[0].steps == expected[0].steps
    assert found[0].magnitude == pytest.approx(expected[0].magnitude)


def test_latency_shift_is_flagged() -> None:
    rng = np.random.default_rng(2)
    detector = fresh()
    feed(detector, rng, range(0, 40))
    reports = window(feed(detector, rng, range(40, 100), latency_factor=1.25))
    assert [r.signal for r in reports] == ["latency"]
    assert reports[0].magnitude == pytest.approx(0.25, abs=0.05)


def test_a_latency_rise_below_the_threshold_is_not_drift() -> None:
    """+12%: what young requests' contexts growing after a load jump do to step latency;
    the best K stays, so no re-profile (the threshold is 20%)."""
    rng = np.random.default_rng(2)
    detector = fresh()
    feed(detector, rng, range(0, 40))
    assert feed(detector, rng, range(40, 100), latency_factor=1.12) == []


def test_a_constant_misfit_is_learned_as_the_reference() -> None:
    """A fit 8% off from the start is the fitter's bias, not drift."""
    rng = np.random.default_rng(3)
    detector = fresh()
    assert feed(detector, rng, range(0, 120), latency_factor=1.08) == []


@pytest.mark.parametrize("factor", [0.84, 1.17])
def test_a_confirmed_refits_miss_is_learned_unless_it_straddled(factor: float) -> None:
    """16-17% off from the start: the tail of the refits that end a confirmed re-profile
    (twin, n-gram), whose yield the confirmation measured; under
    `confirmed_misfit_factor` thresholds, learned. Any other table (a cold profile's) that
    far off is stale, and so is a confirmed refit 40% off (a re-profile that straddled a
    workload switch)."""
    rng = np.random.default_rng(3)
    confirmed = DriftDetector(max_batch=128)
    confirmed.after_sweep(0.0)
    confirmed.set_envelope(7, surface(), at_s=0.0, fitted_batch_range=(16, 48),
                           confirmed=True)
    assert feed(confirmed, rng, range(0, 120), acceptance_factor=factor) == []
    assert confirmed.state is DriftState.WATCHING

    profiled = fresh()
    profiled.after_sweep(0.0)
    reports = window(feed(profiled, rng, range(0, 40), acceptance_factor=factor))
    assert [r.signal for r in reports] == ["acceptance"]

    straddled = DriftDetector(max_batch=128)
    straddled.after_sweep(0.0)
    straddled.set_envelope(7, surface(), at_s=0.0, fitted_batch_range=(16, 48),
                           confirmed=True)
    reports = window(feed(straddled, rng, range(0, 40), acceptance_factor=0.6))
    assert [r.signal for r in reports] == ["acceptance"]

    # the factor is that envelope's, not every later one's
    confirmed.set_envelope(7, surface(), at_s=120.0, fitted_batch_range=(16, 48))
    later = window(feed(confirmed, rng, range(120, 160), acceptance_factor=factor))
    assert [r.signal for r in later] == ["acceptance"]


@pytest.mark.parametrize("factor", [0.6, 1.2])
def test_a_table_far_off_its_own_prediction_from_the_start_is_stale(factor: float) -> None:
    """40% or 20% off from the first steps (more than a drift threshold): fitted on another
    regime, not a bias to learn."""
    rng = np.random.default_rng(3)
    detector = fresh()
    reports = window(feed(detector, rng, range(0, 40), acceptance_factor=factor))
    assert [r.signal for r in reports] == ["acceptance"]
    assert reports[0].magnitude == pytest.approx(factor - 1, abs=0.08)
    assert detector.state is DriftState.STALE


def test_a_rise_back_to_the_prediction_is_reported_against_both() -> None:
    """A table kept after its first steps read 25% under its prediction (a misfit, which
    the reference learned) calls the return to its prediction a 33% rise: the report also
    says where the steps stand against the prediction itself, which the loop reads before
    it probes what a rise hides (twin EAGLE swing, 16 users, seed 21)."""
    rng = np.random.default_rng(3)
    detector = fresh()
    [misfit] = window(feed(detector, rng, range(0, 40), acceptance_factor=0.75))
    assert misfit.signal == "acceptance"
    assert misfit.against_prediction == pytest.approx(-0.25, abs=0.08)
    [back] = window(feed(detector, rng, range(40, 120)))
    assert back.signal == "acceptance"
    assert back.magnitude == pytest.approx(1 / 0.75 - 1, abs=0.08)
    assert back.against_prediction == pytest.approx(0.0, abs=0.05)
    assert back.fields()["against_prediction"] == round(back.against_prediction, 4)


@pytest.mark.parametrize("with_yield", [True, False])
def test_the_prediction_is_the_goodputs_with_its_composition_factor(with_yield: bool) -> None:
    """At a K far from the sweep's, a closed loop accepts less than the pooled acceptance
    length says; the envelope's goodput carried that (tokens per request with the composition
    factor, here 0.6 at K = 2 with draft share 0.5), and the detector checks that
    prediction. Steps that meet it are not a misfit; checked against the pooled AL alone
    (an envelope without the fields) the same steps are 29% short and stale at once."""
    rng = np.random.default_rng(3)
    share, factor = 0.5, [1.0, 0.6, 0.6, 0.6]
    tokens = [1.0 + share * (al - 1.0) * c for al, c in zip(AL, factor, strict=True)]
    corrected = 1.0 + (AL[2] - 1.0) * factor[2]
    detector = DriftDetector(max_batch=128)
    fields = {"tokens_per_request": tokens, "draft_share": share} if with_yield else {}
    detector.set_envelope(7, {**surface(), **fields}, at_s=0.0, fitted_batch_range=(16, 48))
    reports = window(feed(detector, rng, range(0, 60), acceptance_factor=corrected / AL[2]))
    if with_yield:
        assert reports == []
        assert detector.state is DriftState.WATCHING
    else:
        assert [r.signal for r in reports] == ["acceptance"]
        assert reports[0].magnitude == pytest.approx(corrected / AL[2] - 1, abs=0.05)


def test_load_outside_the_fitted_range_is_flagged() -> None:
    rng = np.random.default_rng(4)
    detector = fresh()
    feed(detector, rng, range(0, 30))
    reports = []
    for second in range(30, 60):
        report = detector.observe(steps(rng, float(second), 60, batch=128))
        if report is not None:
            reports.append(report)
    assert [r.signal for r in reports] == ["coverage"]


def test_a_table_that_starts_in_a_load_jump_is_flagged_before_its_reference_ends() -> None:
    """The load is outside the fitted range from the table's first steps (a replica that
    takes a key over in a load jump): coverage needs no reference, so it is flagged after
    `min_steps` steps, not after the reference period."""
    rng = np.random.default_rng(4)
    detector = fresh()
    reports = [(second, report) for second in range(0, 200)
               if (report := detector.observe(steps(rng, float(second), 60, batch=128)))]
    config = detector.config
    first_s, first = reports[0]
    assert first.signal == "coverage"
    assert first_s <= config.warmup_s + 5 < config.warmup_s + config.reference_s
    # while the load stays there, reported again as coverage, once per `renotify_s`
    assert {r.signal for _, r in reports} == {"coverage"}
    assert all(b - a >= config.renotify_s for (a, _), (b, _) in pairwise(reports))


def test_a_table_without_prediction_is_not_watched() -> None:
    detector = DriftDetector(max_batch=128)
    detector.set_envelope(3, None, at_s=0.0)
    rng = np.random.default_rng(5)
    assert feed(detector, rng, range(0, 30), latency_factor=2.0) == []
    assert detector.state is DriftState.BLIND


def test_after_a_sweep_only_a_large_acceptance_shift_is_drift() -> None:
    """Minutes after a sweep measured the regime, a 20% acceptance dip is the workload's
    wander and the table stays; a 40% one is a switch; once the period is over, 20% counts
    again."""
    rng = np.random.default_rng(6)
    detector = fresh()
    detector.after_sweep(0.0)
    feed(detector, rng, range(0, 40))
    assert feed(detector, rng, range(40, 120), acceptance_factor=0.8) == []
    reports = window(feed(detector, rng, range(120, 180), acceptance_factor=0.6))
    assert [r.signal for r in reports] == ["acceptance"]

    late = fresh()
    late.after_sweep(0.0)
    feed(late, rng, range(0, 190))  # the period (180 s) ends
    reports = window(feed(late, rng, range(190, 260), acceptance_factor=0.8))
    assert [r.signal for r in reports] == ["acceptance"]


def test_after_a_sweep_latency_and_misfit_keep_their_bars() -> None:
    """The stricter period is for acceptance's wander: a 30% slowdown (a load jump shows
    there first) and a table 20% off its own prediction from its first steps (fitted on
    another regime) are still reported."""
    rng = np.random.default_rng(7)
    slower = fresh()
    slower.after_sweep(0.0)
    feed(slower, rng, range(0, 40))
    reports = window(feed(slower, rng, range(40, 120), latency_factor=1.3))
    assert [r.signal for r in reports] == ["latency"]

    misfit = fresh()
    misfit.after_sweep(0.0)
    reports = window(feed(misfit, rng, range(0, 40), acceptance_factor=0.8))
    assert [r.signal for r in reports] == ["acceptance"]


def _first_report_s(detector: DriftDetector, rng: np.random.Generator, switch_s: int,
                    factor: float) -> float | None:
    """Feed steps as predicted until `switch_s`, then acceptance times `factor`; the second
    of the first report (None: none in the 60 s after the switch)."""
    feed(detector, rng, range(0, switch_s))
    for second in range(switch_s, switch_s + 60):
        if detector.observe(steps(rng, float(second), 60, acceptance_factor=factor)):
            return float(second)
    return None


@pytest.mark.parametrize("factor", [1.5, 0.6])
def test_a_switch_is_flagged_within_seconds_not_at_the_minutes_mean(factor: float) -> None:
    """A switch of workload shows in full at once: the newest ten seconds report it, where
    the minute's mean would reach the bar only after half a minute of the wrong table."""
    fast = _first_report_s(fresh(), np.random.default_rng(11), 100, factor)
    slow = _first_report_s(fresh(fast_window_s=0.0), np.random.default_rng(11), 100, factor)
    assert fast is not None and fast - 100 <= 10
    assert slow is not None and slow - 100 >= 15


def test_ten_seconds_of_a_small_batchs_wander_is_not_a_switch() -> None:
    """Ten seconds 35% high, then ten 35% low, over and over: a few requests dominate the
    batch. The reference saw the same wander (in 5 s runs), and its spread, not the ten
    seconds' own, is their error: no report."""
    rng = np.random.default_rng(12)
    detector = DriftDetector(max_batch=128)
    detector.set_envelope(7, surface(), at_s=0.0, fitted_batch_range=(2, 8))
    assert detector.observe(wandering(rng, range(0, 30), swing=0.35)) is None
    assert detector.observe(wandering(rng, range(30, 150), swing=0.35, run_s=10)) is None


def test_in_the_quiet_spell_the_hints_go_on() -> None:
    """Reported while the batch turned over, a switch may match no regime yet: in the
    report's quiet spell the drift is still hinted (a loop recalls once the newest steps
    match one), and the detector stays stale; ten seconds back at the reference hint
    nothing."""
    rng = np.random.default_rng(13)
    detector = fresh()
    feed(detector, rng, range(0, 100))
    fell = feed(detector, rng, range(100, 150), acceptance_factor=0.6)
    assert window(fell) and detector.state is DriftState.STALE
    held = feed(detector, rng, range(150, 160), acceptance_factor=0.6)
    assert held and all(r.fast for r in held)
    assert detector.state is DriftState.STALE
    feed(detector, rng, range(160, 170))  # the newest ten seconds turn over
    assert not [r for r in feed(detector, rng, range(170, 200)) if r.fast]


def test_no_hint_while_the_load_moves() -> None:
    """Acceptance 50% up as the batch drops from 32 to 8: a batch that drains accepts what
    neither load does, so the newest seconds hint nothing; the window judges it."""
    rng = np.random.default_rng(14)
    detector = DriftDetector(max_batch=128)
    detector.set_envelope(7, surface(), at_s=0.0, fitted_batch_range=(4, 48))
    feed(detector, rng, range(0, 100))
    moved = [detector.observe(steps(rng, float(t), 60, batch=8, acceptance_factor=1.5))
             for t in range(100, 160)]
    reports = [r for r in moved if r is not None]
    assert reports and not any(r.fast for r in reports)


def wandering(rng: np.random.Generator, seconds: range, *, level: float = 1.0,
              swing: float = 0.3, run_s: int = 5, batch: int = 4) -> StepColumns:
    """A small batch whose acceptance runs `swing` above and below `level` for `run_s`
    seconds at a time: a few requests dominate it (the twin's instructcoder trace at 4
    requests in flight)."""
    return _concat([steps(rng, float(s), 60, batch=batch,
                          acceptance_factor=level * (1 + swing * (1 if (s // run_s) % 2 else -1)))
                    for s in seconds])


@pytest.mark.parametrize("seed", range(3))
def test_a_reference_is_judged_against_the_fits_own_spread(seed: int) -> None:
    """A 20 s reference 25% under a prediction fitted on 30 s of a wandering small batch is
    that batch's wander, not a stale table; nor is the ordinary wander after it. The same
    miss against a fit of steady steps is stale, and so is it with the fit's steps unknown."""
    rng = np.random.default_rng(seed)
    fit = wandering(rng, range(0, 30))

    def run(fit_steps: StepColumns | None) -> list[Any]:
        detector = DriftDetector(max_batch=128)
        detector.set_envelope(7, surface(), at_s=30.0, fitted_batch_range=(2, 8),
                              fit_steps=fit_steps)
        reports = window(feed(detector, rng, range(30, 53), batch=4, acceptance_factor=0.75))
        for second in range(53, 173):
            report = detector.observe(wandering(rng, range(second, second + 1)))
            if report is not None:
                reports.append(report)
        return reports

    assert run(fit) == []
    steady = _concat([steps(rng, float(s), 60, batch=32) for s in range(30)])
    assert [r.signal for r in run(steady)][:1] == ["acceptance"]
    assert [r.signal for r in run(None)][:1] == ["acceptance"]


def test_under_a_budget_only_steps_of_one_forced_k_speak_for_the_table() -> None:
    """A budget gives each request its own K, which the table's prediction does not
    describe: its steps (here accepting far below the table's K) are not drift; a shift
    that the forced steps show still is."""

    def budget_steps(rng: np.random.Generator, t0: float, *, forced_factor: float) -> StepColumns:
        part = steps(rng, t0, 60, acceptance_factor=0.6)  # each request at its own, lower K
        probe = steps(rng, t0 + 0.5, 12, acceptance_factor=forced_factor)
        probe.forced[:] = True
        return _concat([part, probe])

    for budget, expected in ((True, []), (False, ["acceptance"])):
        rng = np.random.default_rng(3)
        detector = DriftDetector(max_batch=128, config=DriftConfig())
        detector.set_envelope(7, surface(), at_s=0.0, fitted_batch_range=(16, 48),
                              budget=budget)
        reports = [detector.observe(budget_steps(rng, float(s), forced_factor=1.0))
                   for s in range(0, 90)]
        assert [r.signal for r in reports if r is not None][:1] == expected
    rng = np.random.default_rng(4)
    detector = DriftDetector(max_batch=128, config=DriftConfig())
    detector.set_envelope(7, surface(), at_s=0.0, fitted_batch_range=(16, 48), budget=True)
    quiet = [detector.observe(budget_steps(rng, float(s), forced_factor=1.0))
             for s in range(0, 40)]
    shifted = [detector.observe(budget_steps(rng, float(s), forced_factor=1.4))
               for s in range(40, 120)]
    assert all(r is None for r in quiet)
    assert [r.signal for r in shifted if r is not None][:1] == ["acceptance"]


def test_a_rereferenced_table_learns_the_new_level_and_watches_for_the_next() -> None:
    """Acceptance rises 30% and is reported; the loop keeps the table (its K showed every
    position) and re-references: the same level is never reported again, not after
    `renotify_s` either, while a further rise is."""
    rng = np.random.default_rng(4)
    detector = fresh()
    assert feed(detector, rng, range(0, 40)) == []
    [report] = window(feed(detector, rng, range(40, 80), acceptance_factor=1.3))
    assert report.signal == "acceptance" and report.magnitude > 0
    detector.rereference(80.0)
    assert detector.state is DriftState.REFERENCE and detector.since_s == 80.0
    assert feed(detector, rng, range(80, 260), acceptance_factor=1.3) == []
    later = window(feed(detector, rng, range(260, 320), acceptance_factor=1.3 * 1.3))
    assert [r.signal for r in later] == ["acceptance"]


def test_without_a_reference_period_rereference_changes_nothing() -> None:
    rng = np.random.default_rng(4)
    detector = fresh(reference_s=0.0)
    reports = window(feed(detector, rng, range(0, 50), acceptance_factor=1.3))
    assert reports and detector.state is DriftState.STALE
    detector.rereference(50.0)
    assert detector.state is DriftState.STALE and detector.since_s == 0.0
