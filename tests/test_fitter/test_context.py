"""Each K's own batch context from finished requests' sums (`fitter.surface.context`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from fitter.surface.context import CONTEXT_COLUMNS, RequestContextModel
from fitter.surface.telemetry import request_segment_rows, to_frame
from producers.sinks import read_file_sink
from twin import EngineConfig, FixedK, PhaseConfig, Scenario, run_scenario


def _row(request: int, steps: int, tokens: int, context: float, rate: float,
         positions: int = 4, k: int = 4) -> list[float]:
    """A request segment that ran `steps` steps at K `k`, accepting each position at `rate`."""
    reached, accepted, chain = [], [], 1.0
    for i in range(positions):
        reach = steps * chain if i < k else 0.0
        reached.append(reach)
        accepted.append(reach * rate)
        chain *= rate
    return [request, steps, steps, tokens, context * steps, *reached, *accepted]


def test_a_larger_k_drains_the_well_accepting_requests_and_their_context():
    # long requests that accept well at 2,000 tokens of context, short ones that do not at 200
    X = np.array([_row(0, 300, 1000, 2000.0, 0.9), _row(1, 100, 120, 200.0, 0.1)])
    model = RequestContextModel(prior_strength=0.0).fit(X)
    factor = model.predict([1, 2, 4])
    assert factor[0] > factor[1] > factor[2]
    # by hand at K2: steps needed = tokens / (1 + a + a^2); context weighted by them
    need = np.array([1000 / (1 + 0.9 + 0.81), 120 / (1 + 0.1 + 0.01)])
    observed = (300 * 2000 + 100 * 200) / 400
    assert factor[1] == pytest.approx((need @ [2000, 200] / need.sum()) / observed)


def test_requests_that_accept_alike_keep_the_context():
    X = np.array([_row(0, 200, 400, 3000.0, 0.6), _row(1, 50, 100, 300.0, 0.6)])
    model = RequestContextModel().fit(X)
    assert np.allclose(model.predict([0, 1, 2, 3, 4]), 1.0, atol=0.02)


def test_a_thin_segment_borrows_its_request_rate():
    # one request, a well-observed segment at rate .9 and a one-step segment that rejected
    X = np.array([_row(0, 400, 1000, 100.0, 0.9), _row(0, 1, 1, 1000.0, 0.0)])
    shrunk = RequestContextModel(prior_strength=4.0).fit(X)
    assert shrunk.chain_[1, 0] > 0.5  # not the 0 its single step says
    assert RequestContextModel(prior_strength=0.0).fit(X).chain_[1, 0] == 0.0


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="reached and accepted counts"):
        RequestContextModel().fit(np.zeros((3, len(CONTEXT_COLUMNS) + 3)))
    bad = np.array([_row(0, 10, 20, 100.0, 0.5)])
    bad[0, 1] = 0
    with pytest.raises(ValueError, match="decode steps"):
        RequestContextModel().fit(bad)


def _chat(k: int, trace: Path, tmp_path: Path) -> pl.DataFrame:
    """Step records of a ShareGPT-shaped n-gram chat at fixed `k` (no fallback: a missing
    trace is an error, not parametric requests without the effect)."""
    phase = PhaseConfig(duration_s=150.0, concurrency=48, trace=str(trace))
    scenario = Scenario(seed=1, engine=EngineConfig(engine_id="ctx"), phases=(phase,))
    scenario = replace(scenario, drafter=replace(scenario.drafter, method="ngram",
                                                 ngram_match_prob=0.5))
    run_scenario(scenario, FixedK(k), sink=f"file://{tmp_path / str(k)}")
    frame = to_frame(read_file_sink(tmp_path / str(k)))
    return frame.filter(pl.col("ts_ns") >= 30 * 10**9)  # after the closed loop settled


def test_twin_requests_at_k3_predict_the_context_a_k2_batch_holds(generated_traces, tmp_path):
    """n-gram chat: at K2 a closed loop's batch holds more context per request than at K3
    (the long requests accept well and stay longer); K3's finished requests say how much."""
    trace = generated_traces / "sharegpt.jsonl"
    at_k3, at_k2 = _chat(3, trace, tmp_path), _chat(2, trace, tmp_path)

    def decode_context(frame: pl.DataFrame) -> float:
        decode = frame.filter(pl.col("num_prefill_reqs") == 0)
        return decode["kv_tokens"].sum() / decode["batch_size"].sum()

    true = decode_context(at_k2) / decode_context(at_k3)
    model = RequestContextModel().fit(request_segment_rows(at_k3, 7))
    predicted = model.predict([2, 3])
    assert true > 1.02  # the effect is real in the twin ...
    assert predicted[0] / predicted[1] == pytest.approx(true, abs=0.01)  # ... and predicted
    assert model.n_requests_ > 500


def test_rows_from_two_engines_are_two_requests():
    row = {"request": 0, "segment": 4, "decode_steps": 10, "drafting_steps": 10,
           "tokens": 20, "context_tokens": 1000, "reached_per_pos": [10, 5],
           "accepted_per_pos": [5, 2]}
    frame = pl.DataFrame({"engine_id": ["a", "b", "a"], "step_seq": [7, 7, 8],
                          "finished_requests": [[row], [row, {**row, "segment": 5}], []]})
    X = request_segment_rows(frame, n_positions=3)
    assert X.shape == (3, len(CONTEXT_COLUMNS) + 6)
    assert len(set(X[:, 0])) == 2  # engine a's request and engine b's (two segments)
    assert X[0, 5:].tolist() == [10, 5, 0, 5, 2, 0]  # a third position nobody reached
