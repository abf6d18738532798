"""Table derivation: argmax with tolerance, startup K set, coverage, ranges, vLLM validity."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from fitter.derive import (
    DEFAULT_MERGE_Z,
    SERVED_MAX_LOSS,
    bracket_between_measured,
    candidate_k_values,
    choose_k,
    derive_envelope,
    fit_table,
    indistinguishable,
)
from fitter.surface.fit import SurfaceFit, fit_surface
from fitter.surface.synthetic import (
    H100_EAGLE,
    SHAREGPT_EAGLE_CONDITIONAL,
    CostModel,
    make_step_records,
    true_acceptance_length,
)
from schemas.envelope import TableEnvelope, TableKey
from tests.test_fitter.conftest import MAX_BATCH, MAX_K
from tests.test_fitter.test_latency_memory import CONTEXT
from tests.test_fitter.test_latency_memory import _records as one_load_records

KEY = TableKey("llama-3.1-8b", "eagle", "h100")
# docs/TWIN.md, calibration: ShareGPT EAGLE at 512 context, best fixed K per batch size.
KNOWN_BEST_K = {1: 7, 2: 7, 4: 7, 8: 7, 16: 5, 32: 4, 64: 3, 128: 2, 256: 2}


def test_ties_go_to_the_smaller_k() -> None:
    goodput = np.array([[100.0, 100.5, 100.9, 99.0], [100.0, 102.0, 101.5, 90.0]])
    assert list(choose_k(goodput, tolerance=0.01, fewest_ranges=False)) == [0, 1]
    assert list(choose_k(goodput, tolerance=0.0, fewest_ranges=False)) == [2, 1]
    assert list(choose_k(goodput, tolerance=0.01)) == [1, 1]  # one range, both acceptable


def test_a_smaller_k_is_within_tolerance_only_by_the_step_time_it_saves() -> None:
    # Row 0: K5..K7 pad to one CUDA-graph step, so K7's 1% gain over K5 is all upside.
    # Row 1: K7 costs 2% more per step than K5: K5 stays the cheaper mistake within 1%.
    goodput = np.array([[186.6, 187.6, 188.4], [186.6, 187.6, 188.4]])
    latency = np.array([[7.20e-3, 7.20e-3, 7.20e-3], [7.20e-3, 7.27e-3, 7.344e-3]])
    assert list(choose_k(goodput, tolerance=0.01, fewest_ranges=False)) == [0, 0]
    capped = choose_k(goodput, tolerance=0.01, fewest_ranges=False, latency=latency)
    assert list(capped) == [2, 0]
    with pytest.raises(ValueError, match="shape"):
        choose_k(goodput, latency=latency[:, :2])


def test_fewest_ranges_removes_flicker_within_tolerance() -> None:
    rng = np.random.default_rng(0)
    base = np.array([100.0, 110.0, 111.0, 95.0])
    goodput = base + rng.uniform(-0.5, 0.5, size=(50, 4))  # K index 1 and 2 within 1%
    greedy = choose_k(goodput, tolerance=0.01, fewest_ranges=False)
    fewest = choose_k(goodput, tolerance=0.01)
    assert len(set(fewest)) == 1
    best = goodput.max(axis=1)
    assert (goodput[np.arange(50), fewest] >= 0.99 * best).all()
    assert np.count_nonzero(np.diff(greedy)) >= np.count_nonzero(np.diff(fewest))


def test_fewest_ranges_keeps_a_real_change() -> None:
    goodput = np.array([[10.0, 20.0]] * 5 + [[20.0, 10.0]] * 5)
    assert list(choose_k(goodput)) == [1] * 5 + [0] * 5


def test_candidate_k_values() -> None:
    assert list(candidate_k_values([7, 0, 3, 5, 3], max_k=5)) == [0, 3, 5]
    with pytest.raises(ValueError, match="no startup K"):
        candidate_k_values([6, 7], max_k=5)


def _ranges_are_fewest(envelope: TableEnvelope) -> bool:
    ks = [k for _, _, k in envelope.table.ranges]
    return all(a != b for a, b in zip(ks, ks[1:], strict=False))


def _true_goodput(batch: np.ndarray, k: np.ndarray) -> np.ndarray:
    al = true_acceptance_length(SHAREGPT_EAGLE_CONDITIONAL, k)
    return batch * al / H100_EAGLE.decode_latency_s(batch, k, 512.0 * np.exp(0.25**2 / 2))


def test_h100_argmax_matches_the_known_pattern(all_k_fit: SurfaceFit) -> None:
    """Without tolerance the table is the plain argmax: it must land near the published one."""
    envelope = derive_envelope(all_k_fit, key=KEY, version=3, max_k=MAX_K, tolerance=0.0,
                               max_batch=MAX_BATCH, startup_k_values=range(MAX_K + 1))
    table = envelope.table
    for batch, best in KNOWN_BEST_K.items():
        assert abs(table.k_for(batch) - best) <= 1, (batch, table.to_vllm())


def test_h100_table_is_near_optimal_with_tolerance(all_k_fit: SurfaceFit) -> None:
    """With the default 1% tolerance K may be smaller than the argmax, never much worse."""
    envelope = derive_envelope(all_k_fit, key=KEY, version=3, max_k=MAX_K,
                               max_batch=MAX_BATCH, startup_k_values=range(MAX_K + 1))
    batch = np.arange(1, MAX_BATCH + 1)
    chosen = np.array(envelope.table.to_dense(MAX_BATCH)[1:])
    truth = _true_goodput(batch[:, None], np.arange(MAX_K + 1)[None, :])
    regret = 1.0 - truth[np.arange(MAX_BATCH), chosen] / truth.max(axis=1)
    assert regret.max() < 0.02  # the 1% tolerance plus fitting error
    ks = [k for _, _, k in envelope.table.ranges]
    assert ks == sorted(ks, reverse=True)  # K falls as the batch grows
    assert len(ks) <= 5 and _ranges_are_fewest(envelope)


def test_censored_telemetry_still_gives_a_good_table(censored_records: pa.Table) -> None:
    """K never exceeded 5 and never was 0 in this telemetry, yet the table comes out right
    (within tolerance of the truth) and the plan asks to explore the never-seen K."""
    envelope = fit_table(censored_records, key=KEY, max_k=MAX_K, max_batch=MAX_BATCH,
                         startup_k_values=range(MAX_K + 1), version=1, half_life_s=None)
    batch = np.arange(1, MAX_BATCH + 1)
    chosen = np.array(envelope.table.to_dense(MAX_BATCH)[1:])
    truth = _true_goodput(batch[:, None], np.arange(MAX_K + 1)[None, :])
    regret = 1.0 - truth[np.arange(MAX_BATCH), chosen] / truth.max(axis=1)
    assert regret.max() < 0.03, envelope.table.to_vllm()
    for b, best in KNOWN_BEST_K.items():
        assert abs(envelope.table.k_for(b) - best) <= 2, envelope.table.to_vllm()
    plan = envelope.exploration["buckets"]
    assert plan, "censoring must leave something to explore"
    explored = {c["k"] for bucket in plan for c in bucket["candidates"]}
    assert explored & {6, 7}  # never drafted, so most in doubt
    gains = [bucket["expected_gain"] for bucket in plan]
    assert gains == sorted(gains, reverse=True)


def test_exploration_is_empty_when_nothing_is_in_doubt(all_k_fit: SurfaceFit) -> None:
    envelope = derive_envelope(all_k_fit, key=KEY, version=1, max_k=MAX_K,
                               max_batch=MAX_BATCH, startup_k_values=range(MAX_K + 1))
    assert envelope.exploration["buckets"] == []


@pytest.mark.parametrize(("startup", "max_k", "max_batch"),
                         [((0, 2, 4), 3, 100), ((1, 3, 5, 7), 7, 256), ((2,), 7, 17)])
def test_startup_set_max_k_and_coverage(all_k_fit: SurfaceFit, startup, max_k,
                                        max_batch) -> None:
    envelope = derive_envelope(all_k_fit, key=KEY, version=1, max_k=max_k,
                               max_batch=max_batch, startup_k_values=startup)
    allowed = {k for k in startup if k <= max_k}
    assert envelope.table.k_values <= allowed
    dense = envelope.table.to_dense(max_batch)
    assert len(dense) == max_batch + 1 and envelope.table.max_batch == max_batch
    assert envelope.table.ranges[0][0] == 1
    assert len(envelope.predicted_goodput_tok_s) == max_batch
    assert _ranges_are_fewest(envelope)


def test_envelope_carries_surface_and_round_trips(all_k_fit: SurfaceFit) -> None:
    envelope = derive_envelope(all_k_fit, key=KEY, version=2, max_k=MAX_K,
                               max_batch=MAX_BATCH, startup_k_values=range(MAX_K + 1),
                               created_at="2026-01-01T00:00:00+00:00",
                               provenance={"source": "test"})
    surface = envelope.surface
    n_b, n_k = len(surface["batch_sizes"]), len(surface["k_values"])
    assert n_b <= 64 and surface["batch_sizes"][0] == 1 and surface["batch_sizes"][-1] == 256
    assert np.shape(surface["goodput_tok_s"]) == (n_b, n_k)
    assert np.shape(surface["goodput_stderr_tok_s"]) == (n_b, n_k)
    assert envelope.provenance["source"] == "test"
    assert envelope.provenance["records"] > 0
    predicted = np.array(envelope.predicted_goodput_tok_s)
    # More requests, more tokens per second (up to the tolerance where K steps down).
    assert (predicted[1:] > 0.99 * predicted[:-1]).all()
    assert TableEnvelope.from_json(envelope.to_json()) == envelope


def test_vllm_accepts_the_table(all_k_fit: SurfaceFit) -> None:
    utils = pytest.importorskip("vllm.v1.spec_decode.dynamic.utils")
    envelope = derive_envelope(all_k_fit, key=KEY, version=1, max_k=MAX_K,
                               max_batch=MAX_BATCH, startup_k_values=range(MAX_K + 1))
    schedule = utils.validate_and_normalize_dynamic_sd_schedule(envelope.table.to_vllm())
    assert [list(entry) for entry in schedule] == envelope.table.to_vllm()
    dense = utils.build_dynamic_sd_schedule_lookup(envelope.table.to_vllm(), MAX_BATCH, MAX_K)
    assert dense == envelope.table.to_dense(MAX_BATCH)


def test_package_exports_resolve_lazily() -> None:
    import fitter

    assert fitter.fit_table is fit_table
    assert "fit_table" in dir(fitter)
    with pytest.raises(AttributeError, match="no attribute"):
        _ = fitter.not_a_thing


NGRAM_SHARE = 0.3
NGRAM_DRAFTING_CONDITIONAL = (0.5, 0.8, 0.85, 0.88, 0.9, 0.9, 0.9)
"""Acceptance among the requests that drafted (n-gram: those that found a match)."""


@pytest.fixture(scope="module")
def partial_draft_records() -> pa.Table:
    """n-gram-like telemetry: only 30% of decode requests draft in a step, every K explored."""
    return make_step_records(40_000, seed=21, cost=CostModel(drafter="ngram"),
                             conditional=NGRAM_DRAFTING_CONDITIONAL, draft_share=NGRAM_SHARE,
                             max_batch=MAX_BATCH)


def _true_partial_goodput(batch: np.ndarray, k: np.ndarray) -> np.ndarray:
    """B (1 + s (AL(K) - 1)) / T(B, K) with the verify sized by the drafts actually made."""
    tokens = 1.0 + NGRAM_SHARE * (true_acceptance_length(NGRAM_DRAFTING_CONDITIONAL, k) - 1.0)
    context = 512.0 * np.exp(0.25**2 / 2)
    latency = CostModel(drafter="ngram").step_latency_s(batch * (1.0 + NGRAM_SHARE * k),
                                                        batch * context, k)
    return batch * tokens / latency


def test_partial_drafting_does_not_inflate_k(partial_draft_records: pa.Table) -> None:
    """Requests without a draft must not count as verifying (or accepting) K drafts: that
    would make a large K look cheap and rewarding, and the table would keep K high at high B."""
    # the synthetic requests accept alike, step by step: no batch-composition effect to model
    fit = fit_surface(partial_draft_records, max_k=MAX_K, max_batch=MAX_BATCH,
                      half_life_s=None, batch_composition=False)
    assert fit.draft_share is not None
    assert abs(fit.draft_share.share_ - NGRAM_SHARE) < 0.01
    envelope = derive_envelope(fit, key=KEY, version=1, max_k=MAX_K, max_batch=MAX_BATCH,
                               startup_k_values=range(MAX_K + 1))
    batch = np.arange(1, MAX_BATCH + 1)
    ks = np.arange(MAX_K + 1)
    truth = _true_partial_goodput(batch[:, None], ks[None, :])
    best = truth.argmax(axis=1)
    assert best[-1] < MAX_K  # the case discriminates: at B=256 the largest K loses
    chosen = np.array(envelope.table.to_dense(MAX_BATCH)[1:])
    for b in (64, 128, 192, 256):
        assert chosen[b - 1] <= best[b - 1] + 1, (b, envelope.table.to_vllm())
    regret = 1.0 - truth[np.arange(MAX_BATCH), chosen] / truth.max(axis=1)
    assert regret.max() < 0.02, envelope.table.to_vllm()
    assert envelope.surface["draft_share"] == pytest.approx(NGRAM_SHARE, abs=0.01)


def test_a_flicker_the_fit_cannot_resolve_is_merged() -> None:
    """K index 1 and 2 alternate as best by 1% where the fit cannot tell them apart: one
    range; where it can (a 10% step at row 6), the change stays."""
    goodput = np.array([[100.0, 110.0, 111.0], [100.0, 111.0, 110.0]] * 3
                       + [[100.0, 120.0, 108.0]] * 2)
    argmax = choose_k(goodput, tolerance=0.0, fewest_ranges=False)
    assert list(argmax) == [2, 1, 2, 1, 2, 1, 1, 1]
    indistinct = np.zeros(goodput.shape, dtype=bool)
    indistinct[:6, 1:] = True  # rows 0-5: K index 1 and 2 within the fit's error
    merged = choose_k(goodput, tolerance=0.0, fewest_ranges=False, indistinct=indistinct)
    assert list(merged) == [1] * 8
    indistinct[:] = False  # a fit that tells them apart keeps the flicker: the data demands it
    kept = choose_k(goodput, tolerance=0.0, fewest_ranges=False, indistinct=indistinct)
    assert list(kept) == list(argmax)


def test_unmeasured_batch_sizes_never_turn_back() -> None:
    """A real server's probe: measured at batch 1 (best K3) and 14-16 (best K1); between
    them the fit's argmax flickered over K0..K4 in 10 ranges. The rows between take a path
    from K3 to K1 that never turns back and loses the least predicted goodput; unmeasured
    rows at either end take a path that moves away from their measured neighbour's K only
    as the batch size says (down past it, up before it)."""
    argmax = [3, 4, 2, 3, 4, 1, 3, 0, 2, 3, 1, 2, 1, 1, 1, 1]
    goodput = np.full((16, 5), 90.0)
    goodput[np.arange(16), argmax] = 100.0
    goodput[1:13, 2] = 97.0  # K2 is a close second between the measurements
    measured = np.zeros(16, dtype=bool)
    measured[[0, 13, 14, 15]] = True
    bracket = bracket_between_measured(goodput, measured)
    assert bracket is not None
    assert bracket[[0, 13, 14, 15]].all()  # measured rows are free
    assert (bracket[1:13].sum(axis=1) == 1).all()  # each row between takes one K
    chosen = choose_k(goodput, tolerance=0.0, measured=measured)
    assert list(chosen) == [3] + [2] * 11 + [1] * 4
    unbracketed = choose_k(goodput, tolerance=0.0)
    assert np.count_nonzero(np.diff(unbracketed)) >= 9
    # past the last measured row K only falls from its K; before the first it only rises
    past = bracket_between_measured(goodput, np.arange(16) == 0)
    assert past is not None
    assert list(past[1:].argmax(axis=1)) == [2] * 11 + [1] * 4  # the least loss
    before = bracket_between_measured(goodput, np.arange(16) == 15)
    assert before is not None
    assert list(before[:15].argmax(axis=1)) == [3] + [2] * 11 + [1] * 3
    assert bracket_between_measured(goodput, np.zeros(16, dtype=bool)) is None


def test_a_k_path_keeps_to_acceptable_cells_with_the_fewest_changes() -> None:
    """Measured K3 at batch 1 and K1 at 6; between them K2 is predicted best, K1 within the
    fit's error everywhere and K3 at 2-3. Staying at K2 would change twice (3 -> 2 -> 1), so
    the path changes once, as late as the acceptable cells allow."""
    goodput = np.array([[50.0, 80.0, 90.0, 100.0]]
                       + [[50.0, 99.0, 100.0, 99.0]] * 2
                       + [[50.0, 99.0, 100.0, 90.0]] * 2
                       + [[50.0, 100.0, 90.0, 80.0]])
    indistinct = np.zeros(goodput.shape, dtype=bool)
    indistinct[1:5, 1:3] = True
    indistinct[1:3, 3] = True
    measured = np.array([True, False, False, False, False, True])
    chosen = choose_k(goodput, tolerance=0.0, indistinct=indistinct, measured=measured)
    assert list(chosen) == [3, 3, 3, 1, 1, 1]
    # without the Viterbi pass, the rows between still never turn back from their ends
    greedy = choose_k(goodput, tolerance=0.0, fewest_ranges=False, measured=measured)
    assert (np.diff(greedy) <= 0).all() and greedy[0] == 3 and greedy[-1] == 1
    with pytest.raises(ValueError, match="measured"):
        bracket_between_measured(goodput, measured[:4])


def test_merging_spares_the_batch_sizes_the_traffic_ran(all_k_fit: SurfaceFit) -> None:
    surface = all_k_fit.evaluate(np.arange(1, MAX_BATCH + 1), np.arange(MAX_K + 1))
    loose = indistinguishable(surface, z=3.0, max_loss=0.5)
    share = surface.goodput_tok_s / surface.goodput_tok_s.max(axis=1, keepdims=True)
    costly = loose & (share < 1.0 - SERVED_MAX_LOSS)
    row = int(np.flatnonzero(costly.any(axis=1))[0])  # a choice that would cost the traffic
    served = np.zeros(MAX_BATCH, dtype=bool)
    served[row] = True
    spared = indistinguishable(surface, z=3.0, max_loss=0.5, served=served)
    assert (spared[row] == (loose[row] & ~costly[row])).all()  # only what costs ~0 merges
    assert (spared[~served] == loose[~served]).all()
    best = surface.goodput_tok_s.argmax(axis=1)
    assert loose[np.arange(MAX_BATCH), best].all()  # the best is never excluded
    with pytest.raises(ValueError, match="merge z"):
        indistinguishable(surface, z=-1.0)


def test_loop_tables_have_no_more_ranges_than_the_fit_supports(all_k_fit: SurfaceFit) -> None:
    plain = derive_envelope(all_k_fit, key=KEY, version=1, max_k=MAX_K, max_batch=MAX_BATCH,
                            startup_k_values=range(MAX_K + 1), tolerance=0.0,
                            fewest_ranges=False)
    merged = derive_envelope(all_k_fit, key=KEY, version=1, max_k=MAX_K, max_batch=MAX_BATCH,
                             startup_k_values=range(MAX_K + 1), tolerance=0.0,
                             fewest_ranges=False, merge_z=1.0)
    assert len(merged.table.ranges) <= len(plain.table.ranges)
    assert merged.provenance["merge_z"] == 1.0
    assert _ranges_are_fewest(merged)
    truth = {b: _true_goodput(np.array([b]), np.array([merged.table.k_for(b)]))[0]
             / _true_goodput(np.full(MAX_K + 1, b), np.arange(MAX_K + 1)).max()
             for b in KNOWN_BEST_K}
    assert min(truth.values()) > 0.97, truth


@pytest.mark.parametrize("load", [1, 16])
def test_batch_sizes_past_a_single_measured_load_take_the_cheaper_mistake(load: int) -> None:
    # a live key at one load: the fit cannot tell a request's cost from a step's, and read
    # its own way it makes drafts look free far past the load it saw
    fit = fit_surface(one_load_records(1, load, load), max_k=MAX_K, max_batch=MAX_BATCH,
                      half_life_s=None)
    assert not fit.latency.requests_identified_
    envelope = derive_envelope(fit, key=KEY, version=1, max_k=MAX_K, max_batch=MAX_BATCH,
                               startup_k_values=range(MAX_K + 1), tolerance=0.0,
                               merge_z=DEFAULT_MERGE_Z)
    surface = fit.evaluate(np.arange(1, MAX_BATCH + 1), np.arange(MAX_K + 1))
    optimistic = choose_k(surface.goodput_tok_s, tolerance=0.0, latency=surface.latency_s)
    k = np.arange(MAX_K + 1)

    def share_of_best(batch: int, chosen: int) -> float:
        latency = H100_EAGLE.decode_latency_s(np.full(k.size, batch), k, CONTEXT)
        goodput = batch * true_acceptance_length(SHAREGPT_EAGLE_CONDITIONAL, k) / latency
        return float(goodput[chosen] / goodput.max())

    unmeasured = (64, 128, 256)
    table = min(share_of_best(b, envelope.table.k_for(b)) for b in unmeasured)
    fitted = min(share_of_best(b, int(optimistic[b - 1])) for b in unmeasured)
    # seeds 1-5: the table 0.868-0.939 from one request and 0.939 from sixteen; the fit's
    # own reading 0.676 and 0.867-0.923
    assert table >= 0.86
    assert table >= fitted + 0.01
    assert len(envelope.table.to_vllm()) <= 6
