"""The comparison baselines (dsd-goodput, ema-adaptive) run in the twin and follow the load."""

from __future__ import annotations

import pytest

from twin import PhaseConfig, PolicyError, Scenario, make_policy, run_scenario
from twin.baselines import AcceptanceStats, DsdGoodput, EmaAdaptive
from twin.config import EngineConfig

ACCEPTANCE = (0.69, 0.66, 0.69, 0.73, 0.76, 0.78, 0.80)


def _drift() -> Scenario:
    """Quiet, then a rush: the best K per step drops when the batch grows."""
    phase = {"acceptance": ACCEPTANCE, "prompt_len": 355.0, "output_len": 300.0}
    return Scenario(seed=3, name="drift",
                    engine=EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192,
                                        max_k=7),
                    phases=(PhaseConfig(duration_s=25, concurrency=4, name="quiet", **phase),
                            PhaseConfig(duration_s=25, concurrency=200, name="rush", **phase)))


def _dominant_k(phase: dict) -> int:
    return int(max(phase["k_share"], key=phase["k_share"].get))


@pytest.mark.parametrize("policy", ["dsd-goodput", "ema-adaptive"])
def test_baseline_lowers_k_when_the_load_rises(policy):
    summary = run_scenario(_drift(), policy)
    quiet, rush = summary.phases
    assert summary.policy == policy
    assert quiet["output_tokens_per_s"] > 0 and rush["output_tokens_per_s"] > 0
    assert _dominant_k(quiet) > _dominant_k(rush), (quiet["k_share"], rush["k_share"])


def test_dsd_table_follows_acceptance_and_batch_size():
    policy = DsdGoodput()
    policy.initial_table(max_k=7, max_batch=256)

    class _Cost:
        def step_s(self, kv, batched, k):  # the H100 shape: verify grows with tokens
            return 0.006 + 4e-8 * kv + 2.1e-5 * batched + (0.0021 if k else 0.0) + 0.0012

    class _Engine:
        cost = _Cost()

        class switch:  # stands in for a TableSwitch
            max_batch = 256

            @staticmethod
            def stage(table, version, forced=False):
                return None

    policy.start(_Engine())
    high = AcceptanceStats(7, 1.0)
    high.drafts[:5] = 100
    high.accepted[:5] = [70, 49, 34, 24, 17]
    policy.stats = high
    table = policy.compute_table(256)
    dense = table.to_dense(256)
    assert dense[1] == 5 and dense[256] < dense[1]
    assert all(a >= b for a, b in zip(dense[1:], dense[2:], strict=False))
    low = AcceptanceStats(7, 1.0)
    low.drafts[:5] = 100
    low.accepted[:5] = [20, 4, 1, 0, 0]
    policy.stats = low
    assert max(policy.compute_table(256).to_dense(256)) < 5
    assert set(policy.compute_table(256).k_values) <= {0, 1, 3, 5}


def test_acceptance_length_extrapolates_unseen_positions():
    stats = AcceptanceStats(7, 1.0)
    stats.drafts[:2] = 100
    stats.accepted[:2] = [80, 64]  # conditional 0.8 at position 2
    al = stats.acceptance_length([0, 1, 2, 4])
    assert al[0] == 1.0 and al[1] == pytest.approx(1.8) and al[2] == pytest.approx(2.44)
    assert al[3] == pytest.approx(2.44 + 0.512 + 0.4096)


def test_ema_hysteresis_moves_one_tier_at_a_time():
    policy = EmaAdaptive(update_steps=1, cooldown_updates=2)
    policy.initial_table(max_k=7, max_batch=256)
    start = policy.tier.copy()
    policy.ema[:] = 0.99
    staged = []

    class _Engine:
        class switch:
            max_batch = 256

            @staticmethod
            def stage(table, version, forced=False):
                staged.append(table)

    class _Step:
        num_draft_tokens = 0
        batch_size = 1

    policy.on_step(_Engine(), _Step())
    assert (policy.tier == start + 1).all() and len(staged) == 1
    policy.on_step(_Engine(), _Step())  # cooling down: no change
    assert (policy.tier == start + 1).all() and len(staged) == 1


def test_baselines_take_no_argument():
    with pytest.raises(PolicyError, match="takes no argument"):
        make_policy("dsd-goodput:3")
    assert make_policy("ema-adaptive").name == "ema-adaptive"
