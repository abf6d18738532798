"""Batch composition: the arrival mixture behind pooled acceptance, and the lag of the batch."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from fitter.surface.composition import CompositionModel, tokens_per_step
from fitter.surface.telemetry import batch_shaped_k, composition_by_position

RATES = np.array([0.0, 0.3, 0.9])
ARRIVALS = np.array([0.4, 0.4, 0.2])
"""A traffic mix: 40% never accept, 40% accept poorly, 20% copy-heavy."""


def _measured(positions: np.ndarray, shaped_k: np.ndarray) -> np.ndarray:
    """What a batch kept by `shaped_k` accepts at each position under `ARRIVALS`."""
    held = ARRIVALS[None, :] / tokens_per_step(RATES, shaped_k)
    held /= held.sum(axis=1, keepdims=True)
    return (held * RATES[None, :] ** positions[:, None]).sum(axis=1)


def _steady(k: int) -> float:
    return float(1.0 / (ARRIVALS / tokens_per_step(RATES, k)[0]).sum() - 1.0)


def test_fit_returns_self_and_predicts_other_ks_batches() -> None:
    """Measured on a batch K3 kept, the mixture predicts what K1 and K7 keep and emit; the
    pooled chain of the same measurements is far off at both ends."""
    positions = np.arange(1, 8, dtype=np.float64)
    measured = _measured(positions, np.full(7, 3.0))
    model = CompositionModel()
    assert model.fit(np.column_stack([positions, np.full(7, 3.0)]), measured) is model
    for k in (1, 3, 5, 7):
        assert model.predict([k])[0] == pytest.approx(_steady(k), rel=0.03)
    pooled_k1, pooled_k7 = measured[:1].sum(), measured.sum()
    assert abs(pooled_k1 / _steady(1) - 1) > 0.1 and abs(pooled_k7 / _steady(7) - 1) > 0.1
    np.testing.assert_allclose(model.predict_under(positions, np.full(7, 3.0)), measured,
                               atol=2e-3)
    assert model.predict([0])[0] == pytest.approx(0.0)


def test_positions_measured_on_different_batches_are_each_read_as_such() -> None:
    """Positions 1-3 from live steps on a K2 batch, 4-7 from a sweep on a K5 batch: the fit
    takes each row's batch into account and still predicts every K."""
    positions = np.arange(1, 8, dtype=np.float64)
    shaped = np.array([2.0, 2.0, 2.0, 5.0, 5.0, 5.0, 5.0])
    model = CompositionModel().fit(np.column_stack([positions, shaped]),
                                   _measured(positions, shaped))
    for k in (1, 4, 7):
        assert model.predict([k])[0] == pytest.approx(_steady(k), rel=0.03)


def _drafting_share(k: float) -> float:
    """n-gram's match model (as the twin's): half of the requests that would accept
    nothing at position 1 find no match and propose no draft."""
    return 1.0 - 0.5 * (1.0 - float(_measured(np.ones(1), np.array([float(k)]))[0]))


def test_the_draft_share_follows_the_batch_each_k_keeps() -> None:
    """Fitted on a K3 batch, where 0.5 of the would-be rejections do not draft: a K7 batch
    holds more of the never-accepting requests and drafts less, a K1 batch more. A share
    held at K3's overcharges K7's step for drafts it does not verify."""
    positions = np.arange(1, 8, dtype=np.float64)
    model = CompositionModel().fit(np.column_stack([positions, np.full(7, 3.0)]),
                                   _measured(positions, np.full(7, 3.0)))
    predicted = model.draft_share(_drafting_share(3), [1, 3, 7])
    truth = [_drafting_share(k) for k in (1, 3, 7)]
    np.testing.assert_allclose(predicted, truth, atol=0.003)
    assert truth[0] - truth[1] > 0.02 and truth[1] - truth[2] > 0.01  # an effect to get right
    without_first = CompositionModel().fit(np.column_stack([positions[1:], np.full(6, 3.0)]),
                                           _measured(positions[1:], np.full(6, 3.0)))
    np.testing.assert_allclose(without_first.draft_share(0.8, [1, 7]), [0.8, 0.8])


def test_bad_input_is_refused() -> None:
    good = np.array([[1.0, 3.0], [2.0, 3.0]])
    with pytest.raises(ValueError, match="within"):
        CompositionModel().fit(good, [0.3, 1.5])
    with pytest.raises(ValueError, match="position"):
        CompositionModel().fit(np.array([[0.0, 3.0], [2.0, 3.0]]), [0.3, 0.2])
    with pytest.raises(ValueError, match="2 rows"):
        CompositionModel().fit(good, [0.3])
    with pytest.raises(ValueError, match="max_rate"):
        CompositionModel(max_rate=1.0).fit(good, [0.3, 0.2])


def _steps(k_next: list[int], *, step_s: float, batch: int, arrivals_per_step: float,
           engine: str = "e0") -> pl.DataFrame:
    n = len(k_next)
    rng = np.random.default_rng(0)
    arrivals = rng.poisson(arrivals_per_step, n)
    return pl.DataFrame({
        "engine_id": [engine] * n, "step_seq": np.arange(n), "ts_ns": (np.arange(n) * step_s
                                                                          * 1e9).astype(np.int64),
        "k_next": k_next, "batch_size": [batch] * n, "num_prefill_reqs": arrivals,
        "num_drafts": [batch] * n,
        "accepted_per_pos": [[0] * k for k in [k_next[0], *k_next[:-1]]],
    })


def test_the_batch_follows_a_switch_of_k_over_a_request_lifetime() -> None:
    """48 requests, 8 arrivals per second: a lifetime of 6 s (Little's law). After a switch
    from K2 to K6 the batch is a lifetime later about 1 - 1/e of the way."""
    step_s = 0.02
    before, after = [2] * 2000, [6] * 2000  # 40 s each
    frame = _steps(before + after, step_s=step_s, batch=48, arrivals_per_step=8 * step_s)
    shaped = batch_shaped_k(frame)
    at_switch = 2000
    assert shaped[at_switch - 1] == pytest.approx(2.0)
    one_lifetime = at_switch + int(6.0 / step_s)
    assert shaped[one_lifetime] == pytest.approx(2.0 + 4.0 * (1 - np.exp(-1.0)), abs=0.3)
    assert shaped[-1] == pytest.approx(6.0, abs=0.05)
    # rows in any order, engines apart
    shuffled = frame.with_columns(pl.Series("_i", np.arange(frame.height))).sample(
        fraction=1.0, shuffle=True, seed=1)
    np.testing.assert_allclose(batch_shaped_k(shuffled.drop("_i")),
                               shaped[shuffled["_i"].to_numpy()])


def test_a_burst_of_arrivals_does_not_read_as_a_reshaped_batch() -> None:
    """8 requests living 6 s at K2, then the load rises to 128 at the switch to K6 (as a
    profile cell does): 120 fresh requests join, none of the old ones has finished, so a
    second later the batch is still mostly as K2 left it. Counting arrivals instead of
    requests leaving would put the lifetime at about 1.5 s and the batch near K6."""
    step_s = 0.02
    n_before, n_after = 2000, 2000
    batch = np.array([8] * n_before + [128] * n_after)
    arrivals = np.zeros(n_before + n_after)
    arrivals[:n_before:int(0.75 / step_s)] = 1  # 8 requests / 6 s lifetime
    arrivals[n_before] = 120
    arrivals[n_before + 1::int(6.0 / 128 / step_s) or 1] = 1
    k_next = [2] * n_before + [6] * n_after
    frame = pl.DataFrame({
        "engine_id": ["e0"] * batch.size, "step_seq": np.arange(batch.size),
        "ts_ns": (np.arange(batch.size) * step_s * 1e9).astype(np.int64),
        "k_next": k_next, "batch_size": batch, "num_prefill_reqs": arrivals.astype(np.int64),
        "num_drafts": batch, "accepted_per_pos": [[0] * k for k in [2, *k_next[:-1]]],
    })
    shaped = batch_shaped_k(frame)
    one_second = n_before + int(1.0 / step_s)
    assert shaped[one_second] < 2.0 + 4.0 * (1 - np.exp(-1.0 / 3.0))


def test_each_position_is_credited_with_the_batches_that_measured_it() -> None:
    """Positions 1-2 were drafted on K2 and K6 batches alike; positions 3-6 only on K6's."""
    step_s = 0.02
    frame = _steps([2] * 3000 + [6] * 3000, step_s=step_s, batch=48,
                   arrivals_per_step=48 * step_s)  # a 1 s lifetime: the lag is short
    by_position = composition_by_position(frame, np.ones(frame.height), 7)
    assert by_position[0] == pytest.approx(4.0, abs=0.1)
    assert by_position[1] == pytest.approx(4.0, abs=0.1)
    np.testing.assert_allclose(by_position[2:6], 6.0, atol=0.1)
    assert np.isnan(by_position[6])  # position 7 was never drafted
