"""`schemas.bounds`: each config declares its fields' bounds once, and a value out of bounds
is an error naming the config, the field, the value and the bound."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pytest

from controller.drift import DriftConfig
from controller.exploration import ExplorationConfig
from controller.fleet.loop_config import LoopConfig
from controller.fleet.runner import ControlRunConfig
from controller.guardrail import GuardrailConfig
from schemas.bounds import above, at_least, check_bounds, in_range, positive

NAN = math.nan


@pytest.mark.parametrize(("bound", "accepted", "refused"), [
    (at_least(0), [0, 0.5, math.inf, NAN], [-1e-9, -math.inf]),
    (above(0), [1e-9, math.inf, NAN], [0, -1]),
    (positive(), [1e-9, math.inf], [0, -1, NAN]),
    (in_range(0, 1), [0, 0.5, 1], [-0.1, 1.1, NAN]),
    (in_range(0, 1, low_open=True, high_open=True), [0.5], [0, 1, NAN]),
    (above(0).or_none(), [None, 1], [0]),
])
def test_bounds_refuse_what_their_comparison_refuses(bound, accepted, refused):
    assert not any(bound.refuses(value) for value in accepted)
    assert all(bound.refuses(value) for value in refused)


@pytest.mark.parametrize(("bound", "text"), [
    (at_least(2), ">= 2"), (above(0), "> 0"), (positive(), "> 0"),
    (in_range(0, 0.5), "in [0, 0.5]"), (in_range(0, 1, low_open=True), "in (0, 1]"),
    (in_range(1, 10_000), "in [1, 10000]"), (at_least(1_000_000), ">= 1000000"),
    (at_least(0.0), ">= 0"), (above(0).because("why"), "> 0 (why)"),
])
def test_bound_texts(bound, text):
    assert bound.text == text


def test_the_error_names_the_config_field_value_and_bound():
    @dataclass
    class Example:
        share: float

    with pytest.raises(ValueError, match=re.escape("Example.share=0.7 must be in [0, 0.5]")):
        check_bounds(Example(0.7), share=in_range(0, 0.5))

    class OwnError(ValueError):
        pass

    with pytest.raises(OwnError):
        check_bounds(Example(-1), OwnError, share=at_least(0))
    check_bounds(Example(0.2), share=in_range(0, 0.5))


@pytest.mark.parametrize(("build", "message"), [
    (lambda: LoopConfig(refit_interval_s=0), "LoopConfig.refit_interval_s=0 must be > 0"),
    (lambda: LoopConfig(canary_share=1.5), "LoopConfig.canary_share=1.5 must be in (0, 1]"),
    (lambda: LoopConfig(profile_rounds=0), "LoopConfig.profile_rounds=0 must be >= 1"),
    (lambda: LoopConfig(force_grace_s=3595), "LoopConfig.force_grace_s=3595 must be <= 3594"),
    (lambda: DriftConfig(window_s=-1), "DriftConfig.window_s=-1 must be > 0"),
    (lambda: DriftConfig(chunk_s=20), "DriftConfig.chunk_s=20 must be in (0, 15]"),
    (lambda: DriftConfig(fast_window_s=2), "DriftConfig.fast_window_s=2 must be 0 (off), or 4"),
    (lambda: DriftConfig(min_steps=1), "DriftConfig.min_steps=1 must be >= 2"),
    (lambda: GuardrailConfig(z=0), "GuardrailConfig.z=0 must be > 0"),
    (lambda: GuardrailConfig(threshold=1), "GuardrailConfig.threshold=1 must be in (0, 1)"),
    (lambda: GuardrailConfig(min_steps_per_bucket=1),
     "GuardrailConfig.min_steps_per_bucket=1 must be >= 2"),
    (lambda: ExplorationConfig(share=0.6), "ExplorationConfig.share=0.6 must be in [0, 0.5]"),
    (lambda: ControlRunConfig(poll_ms=0), "ControlRunConfig.poll_ms=0 must be in [1, 10000]"),
])
def test_configs_name_the_failing_field(build, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


def test_nan_is_refused_where_a_range_bounds_it():
    with pytest.raises(ValueError, match="refit_interval_s"):
        LoopConfig(refit_interval_s=NAN)
    with pytest.raises(ValueError, match="threshold"):
        GuardrailConfig(threshold=NAN)
    for spacing in (NAN, math.inf):  # uncapped: the wait would double for good
        with pytest.raises(ValueError, match=re.escape("refit_spacing=") + ".* must be in "):
            LoopConfig(refit_spacing=spacing)


def test_an_unset_half_life_means_no_recency_weighting():
    assert LoopConfig(half_life_s=None).half_life_s is None  # type: ignore[arg-type]
