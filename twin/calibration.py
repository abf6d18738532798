"""What `tabletune twin calibrate` produces: the calibration, and the scenario it writes.

`twin.calibrate` measures a `Calibration` from step records; `profile_toml` writes it as a
scenario the twin runs as it is, whose `[cost]` and `[drafter]` tables and acceptance line
can also go into another scenario.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field
from typing import Any

from twin.config import COST_COEFFICIENTS


class CalibrationError(ValueError):
    """No records to calibrate from, or records that cannot give a profile."""


@dataclass(slots=True)
class Calibration:
    method: str
    cost: dict[str, float]
    """Every `CostConfig` coefficient (`COST_COEFFICIENTS`)."""
    knee_tokens: int
    noise: float
    acceptance: tuple[float, ...]
    """Conditional acceptance per draft position (empty: no drafts were verified)."""
    ngram_match_prob: float = 1.0
    records: int = 0
    fit: dict[str, Any] = field(default_factory=dict)
    """r2, rmse_s, mean_latency_s, fitted_total_ratio (fitted / measured total latency),
    mean_step_overhead_s, step_overhead_steps, relative_residual_p99, k_next_values."""
    notes: list[str] = field(default_factory=list)
    identity: dict[str, list[str]] = field(default_factory=dict)
    """model, drafter, hardware, engine_id values of the records."""
    lengths: dict[str, float] = field(default_factory=dict)
    """prompt_len, output_len, mean_batch, max_batch, max_k of the records."""
    cost_table: str | None = None
    """The measured latency CSV the records were priced by (then `cost` is not fitted)."""

    def cost_config(self) -> dict[str, Any]:
        """`[cost]` fields: `CostConfig(**calibration.cost_config())`."""
        if self.cost_table is not None:
            return {"table": self.cost_table, "noise": self.noise}
        return {"profile": "none", **self.cost, "knee_tokens": self.knee_tokens,
                "noise": self.noise}

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "cost": self.cost_config(),
                "acceptance": list(self.acceptance),
                "ngram_match_prob": self.ngram_match_prob, "records": self.records,
                "fit": self.fit, "notes": self.notes, "identity": self.identity,
                "lengths": self.lengths}


def profile_toml(calibration: Calibration, *, source: str = "") -> str:
    """A scenario the twin runs as it is (`twin run --scenario FILE`): the calibrated
    `[cost]` and `[drafter]`, and one phase with the measured acceptance and lengths."""
    c = calibration
    lengths = c.lengths
    max_k = max(1, int(lengths.get("max_k", 1)), len(c.acceptance))
    max_batch = max(1, int(lengths.get("max_batch", 1)))
    model = _name(c.identity.get("model", []))
    hardware = _name(c.identity.get("hardware", []))
    fit = c.fit
    r2 = "n/a" if fit.get("r2") is None else f"{fit['r2']:.3f}"
    lines = [
        f"# Twin profile calibrated by `tabletune twin calibrate` from {c.records} step "
        f"records{' under ' + source if source else ''}",
        f"# on {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}: hardware "
        f"{', '.join(c.identity.get('hardware', []))}; drafter "
        f"{', '.join(c.identity.get('drafter', []))}.",
        f"# Step latency fit: R² {r2}, RMSE {fit.get('rmse_s', 0.0) * 1e3:.2f} ms, mean "
        f"{fit.get('mean_latency_s', 0.0) * 1e3:.2f} ms, K values {fit.get('k_next_values')}.",
        *(f"# note: {note}" for note in c.notes),
        "# Runs as it is (tabletune twin run --scenario THIS --policy fixed:2); or copy [cost],",
        "# [drafter] and the phase's acceptance into another scenario.",
        f"name = {_toml_str('calibrated-' + hardware)}",
        "seed = 1",
        "",
        "[engine]",
        f"max_num_seqs = {max_batch}            # the largest batch in the records",
        f"max_num_batched_tokens = {max(8192, max_batch * (max_k + 1))}",
        f"max_k = {max_k}                   # the largest K in the records",
        f"model = {_toml_str(model)}",
        f"hardware = {_toml_str(hardware)}",
        "",
        "[cost]",
        *([f"table = {_toml_str(c.cost_table)}"] if c.cost_table is not None else [
            'profile = "none"',
            *(f"{name} = {_toml_float(c.cost[name])}" for name in COST_COEFFICIENTS),
            f"knee_tokens = {c.knee_tokens}"]),
        f"noise = {_toml_float(round(c.noise, 4))}",
        "",
        "[drafter]",
        f"method = {_toml_str(c.method)}",
        f"ngram_match_prob = {_toml_float(round(c.ngram_match_prob, 4))}",
        "",
        "[[phases]]",
        'name = "calibrated"',
        "duration_s = 300",
        f"concurrency = {max(1, round(lengths.get('mean_batch', 1.0)))}"
        "        # the records' mean batch size: set the load to simulate",
        "acceptance = [" + ", ".join(_toml_float(a) for a in (c.acceptance or (0.0,)))
        + "]" + ("" if c.acceptance else "  # not measured: no drafts verified"),
        f"prompt_len = {_toml_float(max(1.0, lengths.get('prompt_len', 1.0)))}"
        "    # prompt tokens per prefill in the records",
        f"output_len = {_toml_float(max(1.0, lengths.get('output_len', 1.0)))}"
        "    # tokens per finished request in the records",
        "",
    ]
    return "\n".join(lines)


def _name(values: list[str]) -> str:
    if len(values) == 1 and values[0] and "|" not in values[0]:
        return values[0]
    return "calibrated"


def _toml_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_float(value: float) -> str:
    value = float(value)
    if not math.isfinite(value):
        raise CalibrationError(f"a fitted value is not finite: {value}")
    return repr(value)
