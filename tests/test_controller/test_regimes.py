"""Regimes a re-profile measured are recalled when their traffic returns, with no forced step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from controller.fleet.decisions import Decision
from controller.fleet.loop import ClosedLoop
from controller.fleet.regimes import Regime, RegimeMemory, Signature
from twin import EngineConfig, PhaseConfig, Scenario, run_scenario
from twin.config import DrafterConfig
from twin.tabletune_policy import TabletunePolicy

NGRAM_CHAT = (0.35, 0.84, 0.87, 0.90, 0.91)
NGRAM_POOR_CHAT = (0.1, 0.5, 0.6, 0.6, 0.6)
"""Chat whose table drafts below the largest K at 32 users: code's acceptance above it is
censored, so its first visit takes a probe (under NGRAM_CHAT the table drafts K7 already,
which censors nothing, and no visit needs one)."""
NGRAM_CODE = (0.65, 0.93, 0.94, 0.95, 0.95)
THRESHOLD = 0.15  # DriftConfig.acceptance_threshold


def _steps(first_accepted: float, k: int, batch: int = 32, n: int = 400) -> pa.Table:
    """Steps at one K whose first draft position accepts `first_accepted` of 10 drafts."""
    accepted = [[round(10 * first_accepted)] + [0] * (k - 1)] * n
    return pa.table({"k": np.full(n, k), "num_drafts": np.full(n, 10),
                     "batch_size": np.full(n, batch),
                     "accepted_per_pos": pa.array(accepted, type=pa.list_(pa.int64()))})


def _regime(signature: Signature, learned_s: float) -> Regime:
    return Regime(signature, _steps(0.5, 2), None, None, learned_s, "stale")


def test_signatures_compare_at_one_k_or_the_nearest() -> None:
    chat = Signature.of(pa.concat_tables([_steps(0.2, 2), _steps(0.3, 5)]))
    assert chat is not None and chat.acceptance == {2: 0.2, 5: 0.3}
    same_at_5 = Signature.of(_steps(0.3, 5))
    assert same_at_5 is not None and chat.distance(same_at_5) == (0.0, 0.0)
    # a K in common compares there, however many drafts a nearer pair has
    wide = Signature.of(pa.concat_tables([_steps(0.3, 5), _steps(0.9, 6, n=4000)]))
    assert wide is not None and chat.distance(wide) == (0.0, 0.0)
    # none in common: the nearest K within NEAREST_K_GAP (K5 against K7), none further apart
    at_7 = Signature.of(_steps(0.3, 7))
    assert at_7 is not None and chat.distance(at_7) == (0.0, 0.0)
    assert Signature.of(_steps(0.2, 2)).distance(at_7) is None  # type: ignore[union-attr]
    assert Signature.of(_steps(0.0, 2)) is None  # nothing accepted: nothing to sign with


def test_the_closest_matching_regime_is_recalled() -> None:
    memory = RegimeMemory()
    chat, code = Signature.of(_steps(0.2, 2)), Signature.of(_steps(0.6, 2))
    assert chat is not None and code is not None
    memory.remember(_regime(chat, 10.0), THRESHOLD)
    memory.remember(_regime(code, 20.0), THRESHOLD)
    recalled = memory.recall(Signature.of(_steps(0.5, 2)), THRESHOLD)
    assert recalled is not None and recalled.learned_s == 20.0
    assert memory.recall(Signature.of(_steps(0.4, 2)), THRESHOLD) is None  # neither is close
    assert memory.recall(Signature.of(_steps(0.6, 2, batch=128)), THRESHOLD) is None
    memory.remember(_regime(Signature.of(_steps(0.55, 2)), 30.0), THRESHOLD)  # code again
    assert len(memory) == 2
    again = memory.recall(code, THRESHOLD)
    assert again is not None and again.learned_s == 30.0


def test_traffic_measured_again_keeps_the_k_values_it_was_read_at_before() -> None:
    """Code measured at K2 (a chat table's K, in its settling stretch), then again at K5-K7
    only: the second regime replaces the first, and its signature keeps K2, so code read
    again at K2 (the next chat table's K) is still recalled. First-position acceptance
    depends on K (0.6 at K2, 0.4 at K7 here), and K2 is too far from K5 to compare."""
    memory = RegimeMemory()
    first = Signature.of(pa.concat_tables([_steps(0.6, 2), _steps(0.4, 7)]))
    again = Signature.of(pa.concat_tables([_steps(0.5, 5), _steps(0.4, 7)]))
    at_k2 = Signature.of(_steps(0.6, 2))
    assert first is not None and again is not None and at_k2 is not None
    assert again.distance(at_k2) is None  # alone, the second could not be recalled at K2
    memory.remember(_regime(first, 10.0), THRESHOLD)
    kept = memory.remember(_regime(again, 20.0), THRESHOLD)
    assert len(memory) == 1 and kept.learned_s == 20.0
    assert kept.signature.acceptance == {2: 0.6, 5: 0.5, 7: 0.4}
    recalled = memory.recall(at_k2, THRESHOLD)
    assert recalled is kept


def _phase(name: str, acceptance: tuple[float, ...], prompt: int, output: int,
           duration_s: float = 150) -> PhaseConfig:
    return PhaseConfig(name=name, duration_s=duration_s, concurrency=32, acceptance=acceptance,
                       prompt_len=prompt, output_len=output)


def _decisions(*phases: PhaseConfig) -> list[Decision]:
    """The loop's decisions over n-gram traffic at 32 users through `phases`."""
    scenario = Scenario(seed=6, engine=EngineConfig(max_num_seqs=128),
                        drafter=DrafterConfig(method="ngram", ngram_match_prob=0.5),
                        phases=phases)
    policy = TabletunePolicy()
    try:
        run_scenario(scenario, policy)
    finally:
        policy.close()
    assert policy.loop is not None
    return policy.loop.decisions


def test_traffic_that_returns_is_recalled_not_profiled_again() -> None:
    """n-gram at 32 users, chat, code, chat, code: the first code phase is new and takes a
    re-profile; each return is recalled from the sweep that measured it, seconds after the
    switch: its last 20 s then sign half the old traffic and match nothing, its last 10 or
    5 s match (`regimes.SIGNATURE_S`)."""
    chat, code = _phase("chat", NGRAM_POOR_CHAT, 355, 728), _phase("code", NGRAM_CODE, 171, 262)
    decisions = _decisions(chat, code, chat, code)
    reprofiles = [d.t_s for d in decisions if d.what == "reprofile"]
    recalls = [d.t_s for d in decisions if d.what == "recall"]
    assert len(reprofiles) == 1 and 150 < reprofiles[0] < 300, decisions
    assert len(recalls) == 2 and 300 < recalls[0] < 450 < recalls[1] < 600, decisions
    # recalled from the newest seconds (`DriftConfig.fast_window_s`), not the minute's
    # mean (35 s in without them), once their hints held (`loop.HINT_HOLD_S`)
    assert recalls[0] - 300 < 20 and recalls[1] - 450 < 20, decisions
    # ... while new traffic waits for the window: measured early, it is measured young
    before = {d.t_s: d for d in decisions if d.what == "stale"}
    assert "fast" not in before[reprofiles[0]].fields, decisions
    assert any(before[t].fields.get("fast") for t in recalls), decisions
    # a recalled table came from a whole sweep: only the periodic refits' gate may swap it
    since_recalled = {d.fields["reason"] for d in decisions if d.what == "refit"
                      and d.t_s > recalls[0] and d.fields["reason"] != "recall"}
    assert since_recalled == {"periodic"}, decisions


def test_a_visit_of_a_few_seconds_recalls_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """n-gram at 32 users: chat, code, 8 s of chat, code again. The visit moves the newest
    ten seconds' acceptance by two thresholds, and the drift detector hints, for less than
    `loop.HINT_HOLD_S`: no recall of chat's table, and so no re-profile to undo it."""
    hinted: list[float] = []
    held_match = ClosedLoop._held_match

    def spied(loop: ClosedLoop, hint: Any, now_s: float) -> Any:
        hinted.append(now_s)
        return held_match(loop, hint, now_s)

    monkeypatch.setattr(ClosedLoop, "_held_match", spied)
    decisions = _decisions(_phase("chat", NGRAM_POOR_CHAT, 355, 728),
                           _phase("code", NGRAM_CODE, 171, 262),
                           _phase("visit", NGRAM_POOR_CHAT, 355, 728, duration_s=8),
                           _phase("code-again", NGRAM_CODE, 171, 262, duration_s=100))
    assert [t for t in hinted if t > 300], "the visit was never hinted: no test"
    assert not [d for d in decisions if d.t_s > 300 and d.what in ("recall", "reprofile")], \
        decisions
