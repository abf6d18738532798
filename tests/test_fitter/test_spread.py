"""The request test (`fitter.surface.spread`): per-request corrections only where identified."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fitter.derive import derive_envelope
from fitter.surface.context import CONTEXT_COLUMNS
from fitter.surface.fit import fit_surface
from fitter.surface.spread import SPREAD_Z, RequestSpreadTest
from fitter.surface.synthetic import make_step_records, true_acceptance_length
from producers.sinks import read_file_sink
from twin import EngineConfig, FixedK, PhaseConfig, Scenario, run_scenario

POSITIONS = 3


def _ledger(trials: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """One single-segment ledger row per request: `trials` drafts reached position 1,
    `accepted` of them accepted it (deeper positions unreached)."""
    n = trials.size
    rows = np.zeros((n, len(CONTEXT_COLUMNS) + 2 * POSITIONS))
    rows[:, 0] = np.arange(n)
    rows[:, 1] = rows[:, 2] = np.maximum(trials, 1)
    rows[:, 3] = rows[:, 1] + accepted
    rows[:, 4] = 500.0 * rows[:, 1]
    rows[:, len(CONTEXT_COLUMNS)] = trials
    rows[:, len(CONTEXT_COLUMNS) + POSITIONS] = accepted
    return rows


def test_requests_with_rates_of_their_own_are_told_from_one_shared_rate() -> None:
    """200 requests of 40 drafts: half accept at 0.3, half at 0.7, against all at 0.5 (the
    same pooled rate). Only the first spreads beyond a binomial's scatter."""
    rng = np.random.default_rng(3)
    trials = np.full(200, 40)
    mixed = rng.binomial(trials, np.repeat([0.3, 0.7], 100))
    alike = rng.binomial(trials, 0.5)
    differ = RequestSpreadTest().fit(_ledger(trials, mixed))
    same = RequestSpreadTest().fit(_ledger(trials, alike))
    assert differ.fit(_ledger(trials, mixed)) is differ
    assert differ.identified_ and differ.z_ > 10 * SPREAD_Z
    # a 0.3 / 0.7 mixture at n = 40: 1 + (n - 1) 0.2^2 / 0.25 = 7.2 times the binomial spread
    assert differ.dispersion_ == pytest.approx(7.2, rel=0.2)
    assert not same.identified_ and same.dispersion_ == pytest.approx(1.0, abs=0.25)
    # a request's segments are summed before the test: split, the same counts say the same
    split = _ledger(trials, mixed)
    halves = np.repeat(split, 2, axis=0)
    halves[0::2, len(CONTEXT_COLUMNS)] = trials // 2
    halves[1::2, len(CONTEXT_COLUMNS)] = trials - trials // 2
    halves[0::2, len(CONTEXT_COLUMNS) + POSITIONS] = mixed // 2
    halves[1::2, len(CONTEXT_COLUMNS) + POSITIONS] = mixed - mixed // 2
    assert RequestSpreadTest().fit(halves).z_ == pytest.approx(differ.z_)


def test_few_trials_at_extreme_rates_do_not_read_as_a_spread() -> None:
    """Requests of 1-4 drafts all accepting at 0.02 (or 0.98): each Pearson term's tail is
    far heavier than a chi-square's, and a test that took it for one (4 sd of sqrt(2 / df))
    would switch the corrections on in about 5% of these fits. Measured in its own
    variance, it hardly does."""
    rng = np.random.default_rng(5)
    fits = 400
    on = 0
    for i in range(fits):
        trials = rng.integers(1, 5, 60)
        rate = 0.02 if i % 2 else 0.98
        on += RequestSpreadTest().fit(_ledger(trials, rng.binomial(trials, rate))).identified_
    assert on / fits < 0.01


def test_too_few_requests_identify_nothing() -> None:
    trials = np.full(6, 50)
    test = RequestSpreadTest().fit(_ledger(trials, np.array([2, 48, 3, 47, 1, 49])))
    assert test.z_ > SPREAD_Z and not test.identified_
    assert RequestSpreadTest(min_requests=5).fit(_ledger(trials, np.array(
        [2, 48, 3, 47, 1, 49]))).identified_


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="reached and accepted counts"):
        RequestSpreadTest().fit(np.zeros((3, len(CONTEXT_COLUMNS) + 3)))
    bad = _ledger(np.array([5, 5]), np.array([1, 2]))
    bad[0, len(CONTEXT_COLUMNS)] = -1
    with pytest.raises(ValueError, match="non-negative"):
        RequestSpreadTest().fit(bad)
    with pytest.raises(ValueError, match="z_threshold"):
        RequestSpreadTest(z_threshold=-1.0).fit(_ledger(np.array([5, 5]), np.array([1, 2])))


def test_homogeneous_synthetic_telemetry_keeps_the_plain_surface() -> None:
    """Synthetic steps and a ledger whose requests all accept alike: composition, the draft
    share per K and the request context stay off, and the surface's tokens per request is
    the pooled chain, close to the truth at every K."""
    records = make_step_records(60_000, seed=21, finished_per_step=0.05, draft_share=0.7)
    fit = fit_surface(records, max_k=7, max_batch=256, half_life_s=None)
    assert fit.request_spread is not None and fit.request_spread.n_requests_ > 1000
    assert not fit.request_spread.identified_
    assert fit.composition is None and fit.request_context is None
    surface = fit.evaluate([64], np.arange(8))
    truth = 1.0 + 0.7 * (true_acceptance_length(
        (0.66, 0.576, 0.553, 0.66, 0.66, 0.66, 0.66), np.arange(8)) - 1.0)
    np.testing.assert_allclose(surface.tokens_per_request, truth, rtol=0.01)
    envelope = derive_envelope(fit, key="m|ngram|h100", version=1, max_k=7, max_batch=256,
                               startup_k_values=range(8))
    assert envelope.surface["request_spread"]["identified"] is False
    assert "composition" not in envelope.surface


def _twin_fit(phase: PhaseConfig, method: str, sink: Path) -> object:
    scenario = Scenario(seed=1, engine=EngineConfig(engine_id=method), phases=(phase,))
    scenario = replace(scenario, drafter=replace(scenario.drafter, method=method,
                                                 ngram_match_prob=0.5))
    run_scenario(scenario, FixedK(3), sink=f"file://{sink}")
    return fit_surface(read_file_sink(sink), max_k=7, max_batch=256, half_life_s=None)


def test_the_twin_switches_composition_by_what_its_requests_do(generated_traces: Path,
                                                               tmp_path: Path) -> None:
    """n-gram on the twin: the parametric profile (every request accepts alike, as the
    demo's default) keeps the plain surface; ShareGPT-shaped requests, each at a rate of its
    own, switch composition and the request context on."""
    alike = _twin_fit(PhaseConfig(duration_s=40.0, concurrency=64,
                                  acceptance=(0.65, 0.93, 0.94, 0.95, 0.95, 0.95, 0.95),
                                  prompt_len=355, output_len=400),
                      "ngram", tmp_path / "parametric")
    differ = _twin_fit(PhaseConfig(duration_s=40.0, concurrency=64,
                                   trace=str(generated_traces / "sharegpt.jsonl")),
                       "ngram", tmp_path / "trace")
    assert alike.request_spread.n_requests_ > 200 and differ.request_spread.n_requests_ > 200
    assert not alike.request_spread.identified_ and alike.composition is None
    assert alike.request_context is None
    assert differ.request_spread.identified_ and differ.request_spread.dispersion_ > 3.0
    assert differ.composition is not None and differ.request_context is not None
