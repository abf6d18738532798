"""The guardrail rolls back a clearly worse table, never an equal one, and waits for
comparable evidence (same batch-size buckets) before judging."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from controller.guardrail import Guardrail, GuardrailConfig, GuardState, Verdict
from controller.steps import StepColumns


def steps(rng: np.random.Generator, *, version: int, t0: float, n: int, goodput: float,
          batch: int = 64, noise: float = 0.05) -> StepColumns:
    """n decode steps of `batch` requests at about `goodput` tokens/s, 20 ms apart."""
    latency = 0.02 * (1 + noise * rng.standard_normal(n))
    tokens = goodput * 0.02 * (1 + noise * rng.standard_normal(n))
    decode = np.full(n, batch)
    return StepColumns(
        t_s=t0 + 0.02 * np.arange(n), batch_size=decode, decode_reqs=decode,
        prefill_reqs=np.zeros(n, np.int64), k=np.full(n, 3), k_next=np.full(n, 3),
        num_drafts=decode, accepted=np.round(tokens - batch).astype(np.int64),
        latency_s=latency, version=np.full(n, version), forced=np.zeros(n, bool))


def run(ratio: float, *, seed: int, chunks: int = 150) -> list[Verdict]:
    """Baseline 60 s of version 1, swap to version 2 whose goodput is `ratio` x, then
    look after every 1 s chunk (sequential looks, as the loop does)."""
    rng = np.random.default_rng(seed)
    guard = Guardrail(GuardrailConfig())
    for second in range(60):
        guard.observe(steps(rng, version=1, t0=second, n=50, goodput=6000.0))
    guard.arm(2, 1, at_s=60.0)
    verdicts = []
    for second in range(60, 60 + chunks):
        guard.observe(steps(rng, version=2, t0=second, n=50, goodput=6000.0 * ratio))
        verdicts.append(guard.verdict(second + 1.0))
        if verdicts[-1] is not Verdict.HOLD:
            break
    return verdicts


def test_clearly_worse_table_is_rolled_back_within_seconds() -> None:
    verdicts = run(0.85, seed=1)
    assert verdicts[-1] is Verdict.ROLL_BACK
    # after the warm-up, 10 s of steps at 50 steps/s is plenty for a 15% loss
    assert len(verdicts) <= GuardrailConfig().warmup_s + 10


@pytest.mark.parametrize("seed", range(20))
def test_equal_table_is_kept_never_rolled_back(seed: int) -> None:
    verdicts = run(1.0, seed=seed)
    assert Verdict.ROLL_BACK not in verdicts
    assert verdicts[-1] is Verdict.KEEP


def test_slightly_worse_within_threshold_is_not_rolled_back() -> None:
    for seed in range(10):
        assert Verdict.ROLL_BACK not in run(0.99, seed=seed)


def test_no_comparable_bucket_means_no_verdict_until_the_deadline() -> None:
    rng = np.random.default_rng(3)
    guard = Guardrail(GuardrailConfig(max_watch_s=300.0, no_comparison_s=30.0))
    for second in range(30):
        guard.observe(steps(rng, version=1, t0=second, n=50, goodput=6000.0, batch=8))
    guard.arm(2, 1, at_s=30.0)
    for second in range(30, 59):  # far worse, but at another load: not comparable
        guard.observe(steps(rng, version=2, t0=second, n=50, goodput=1000.0, batch=128))
        assert guard.verdict(second + 1.0) is Verdict.HOLD
    guard.observe(steps(rng, version=2, t0=59, n=50, goodput=1000.0, batch=128))
    assert guard.verdict(61.0) is Verdict.INCONCLUSIVE
    assert guard.state is GuardState.IDLE


def test_exploration_steps_do_not_count() -> None:
    rng = np.random.default_rng(4)
    guard = Guardrail()
    for second in range(30):
        guard.observe(steps(rng, version=1, t0=second, n=50, goodput=6000.0))
    guard.arm(2, 1, at_s=30.0)
    for second in range(30, 180):
        chunk = steps(rng, version=2, t0=second, n=50, goodput=6000.0)
        forced = np.zeros(50, bool)
        forced[::5] = True  # probes look terrible; they and the step after are left out
        chunk = replace(chunk, forced=forced,
                        accepted=np.where(forced | np.roll(forced, 1), 0, chunk.accepted))
        guard.observe(chunk)
        verdict = guard.verdict(second + 1.0)
        assert verdict is not Verdict.ROLL_BACK
        if verdict is Verdict.KEEP:
            break
    else:
        pytest.fail("an equal table with probes was never kept")


def forced_sweep(rng: np.random.Generator, *, t0: float, seconds: int) -> list[StepColumns]:
    """A re-profile's forced blocks: terrible goodput, all marked forced."""
    chunks = []
    for second in range(seconds):
        chunk = steps(rng, version=1, t0=t0 + second, n=50, goodput=1000.0)
        chunks.append(replace(chunk, forced=np.ones(50, bool)))
    return chunks


@pytest.mark.parametrize("since", [0.0, None])
def test_after_a_drift_the_settling_stretch_is_the_baseline(since: float | None) -> None:
    """A re-profile: 10 s of the stale table settling, 50 s of forced blocks, then the refit
    swapped in at 0.8 of the stale table's goodput. Armed with the settling stretch as the
    baseline it is rolled back; with only the last `baseline_window_s` (all forced, so
    nothing to compare with) it cannot be judged."""
    rng = np.random.default_rng(6)
    guard = Guardrail()
    for second in range(10):
        guard.observe(steps(rng, version=1, t0=second, n=50, goodput=6000.0))
    for chunk in forced_sweep(rng, t0=10.0, seconds=50):
        guard.observe(chunk)  # forced steps are no baseline
    guard.arm(2, 1, at_s=60.0, after_drift=True, baseline_since_s=since)
    verdicts = []
    for second in range(60, 120):
        guard.observe(steps(rng, version=2, t0=second, n=50, goodput=6000.0 * 0.8))
        verdicts.append(guard.verdict(second + 1.0))
        if verdicts[-1] is not Verdict.HOLD:
            break
    if since is None:
        assert Verdict.ROLL_BACK not in verdicts and verdicts[-1] is Verdict.INCONCLUSIVE
    else:
        assert verdicts[-1] is Verdict.ROLL_BACK, guard.last_evidence


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="threshold"):
        GuardrailConfig(threshold=0.0)


def watch_after_8s_baseline(config: GuardrailConfig, goodput: Callable[[int, int], float], *,
                            seed: int, after_drift: bool = False, settling: bool = False
                            ) -> tuple[list[Verdict], dict[str, object]]:
    """8 s of version 1, a swap to version 2 armed at 60 s, then a look after every 1 s
    chunk for up to 60 s; `goodput(version, second)` sets each chunk's level."""
    rng = np.random.default_rng(seed)

    def chunk(version: int, second: int) -> StepColumns:
        return steps(rng, version=version, t0=second, n=50, goodput=goodput(version, second),
                     noise=0.02)

    guard = Guardrail(config)
    for second in range(52, 60):
        guard.observe(chunk(1, second))
    guard.arm(2, 1, at_s=60.0, after_drift=after_drift, settling=settling)
    verdicts = []
    for second in range(60, 120):
        guard.observe(chunk(2, second))
        verdicts.append(guard.verdict(second + 1.0))
        if verdicts[-1] is not Verdict.HOLD:
            break
    return verdicts, guard.last_evidence


def wave_run(config: GuardrailConfig) -> list[Verdict]:
    """An equal table, but goodput moves in slow waves (which requests the batch holds),
    and the 8 s baseline caught a crest, the first watched seconds a trough."""
    def wave(version: int, second: int) -> float:
        return 6000.0 * (1.0 + 0.05 * np.cos(2 * np.pi * (second - 56) / 28.0))

    return watch_after_8s_baseline(config, wave, seed=11)[0]


def test_slow_waves_in_goodput_widen_the_error_instead_of_rolling_back() -> None:
    assert Verdict.ROLL_BACK not in wave_run(GuardrailConfig())
    # per-step errors alone (one block per window) would call the crest a regression
    assert wave_run(GuardrailConfig(block_s=1e9, prior_dof=0.0))[-1] is Verdict.ROLL_BACK


def crest_run(ratio: float, *, after_drift: bool, settling: bool = False
              ) -> tuple[list[Verdict], dict[str, object]]:
    """8 s of the old table on a crest of the traffic (goodput 15% above its level), then
    the new table at `ratio` x that level: steady within each window, so the blocks'
    spread does not show the shift between them."""
    def level(version: int, second: int) -> float:
        return 6000.0 * (1.15 if version == 1 else ratio)

    return watch_after_8s_baseline(GuardrailConfig(), level, seed=5, after_drift=after_drift,
                                   settling=settling)


def test_after_a_drift_a_crest_in_the_baseline_does_not_roll_back_an_equal_table() -> None:
    verdicts, evidence = crest_run(1.0, after_drift=True)
    assert Verdict.ROLL_BACK not in verdicts
    assert evidence["level_shift_sd"] == GuardrailConfig().drift_level_sd > 0
    # the same comparison armed as any other swap calls the crest a regression
    verdicts, evidence = crest_run(1.0, after_drift=False)
    assert verdicts[-1] is Verdict.ROLL_BACK and evidence["level_shift_sd"] == 0.0


def test_a_follow_up_refits_watch_carries_the_level_shift_too() -> None:
    """Its baseline, the drift's refit's last seconds, lies in the trend that follows the
    drift, as a re-profile's settling stretch does."""
    verdicts, evidence = crest_run(1.0, after_drift=False, settling=True)
    assert Verdict.ROLL_BACK not in verdicts
    assert evidence["level_shift_sd"] == GuardrailConfig().drift_level_sd
    verdicts, _ = crest_run(0.6, after_drift=False, settling=True)
    assert verdicts[-1] is Verdict.ROLL_BACK


def test_after_a_drift_a_far_worse_table_is_still_rolled_back() -> None:
    verdicts, _ = crest_run(0.6, after_drift=True)
    assert verdicts[-1] is Verdict.ROLL_BACK
    assert len(verdicts) <= GuardrailConfig().warmup_s + 10
