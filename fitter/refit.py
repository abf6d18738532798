"""Refit from live telemetry and decide whether the new table is worth publishing.

Live windows mostly show the K the current table chose at each batch size (plus the
controller's exploration steps), so the fit extrapolates under censoring; a new table is
only worth the churn of a swap when the *new* surface predicts it beats the current table
by more than a threshold where the fleet actually runs, or when a controller flagged the
current table stale (its live goodput left the predicted band: the prediction itself must be
renewed even if the table stays the same).

`decide_refit` is pure (records in, decision out): the CLI, the watch loop and the
closed-loop twin policy all call it in-process. Publishing is separate (`publish_decision`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence
from typing import Any

import numpy as np
import polars as pl

from fitter.budget import add_fitted_budget
from fitter.derive import DEFAULT_TOLERANCE, derive_envelope
from fitter.engine_consensus import Screening, screen
from fitter.records import Records, as_frame
from fitter.surface.fit import DEFAULT_HALF_LIFE_S, SurfaceFit, fit_surface
from schemas import TableEnvelope, TableKey

DEFAULT_THRESHOLD = 0.01
"""Publish when the predicted goodput gain over the current table exceeds 1%: below that a
swap costs more in churn (and in trust, if noise flips it back) than it wins."""


class RefitError(ValueError):
    """Telemetry or options a refit cannot use; the message names the problem."""


@dataclasses.dataclass(frozen=True, slots=True)
class RefitDecision:
    """The candidate envelope and whether (and why) to publish it."""

    envelope: TableEnvelope
    """The new table, version = newest known version + 1."""
    publish: bool
    reason: str
    """'no current table' | 'stale' | 'gain' | 'below threshold'."""
    predicted_gain: float | None
    """Relative goodput gain of the candidate over the current table under the new fit,
    weighted by the engine time spent at each batch size (None without a current table)."""
    threshold: float
    current_version: int | None
    stale: bool
    screening: Screening | None = None
    """What was left out of the fit: invalid rows, engines that disagree with the rest
    (`dropped_engines`), engines capped (`fitter.engine_consensus`)."""

    def to_dict(self) -> dict[str, Any]:
        return {"publish": self.publish, "reason": self.reason,
                "predicted_gain": None if self.predicted_gain is None
                else round(self.predicted_gain, 6),
                "threshold": self.threshold, "current_version": self.current_version,
                "version": self.envelope.version, "stale": self.stale,
                "key": str(self.envelope.key), "table": self.envelope.table.to_vllm(),
                "screening": None if self.screening is None else self.screening.to_dict()}


def key_from_records(records: Records) -> TableKey:
    """The one model|drafter|hardware the records are for; several is an error."""
    return _table_key(as_frame(records))


def time_share_by_batch(records: Records, max_batch: int) -> np.ndarray:
    """Engine time spent at each batch size 1..max_batch (shares summing to 1).

    Goodput gained at a batch size only matters in proportion to the time the fleet spends
    there; sizes above max_batch use the last entry, as the engine's lookup does.
    """
    return _time_share(as_frame(records), max_batch)


def predicted_gain(fit: SurfaceFit, candidate: TableEnvelope, current: TableEnvelope,
                   weights: np.ndarray) -> float:
    """sum_B w_B G(B, K_new(B)) / sum_B w_B G(B, K_cur(B)) - 1, both under the new fit."""
    max_batch = candidate.max_batch
    new_k = np.asarray(candidate.table.to_dense(max_batch)[1:], dtype=np.int64)
    old_k = np.asarray(current.table.to_dense(max_batch)[1:], dtype=np.int64)
    ks = np.unique(np.concatenate([new_k, old_k]))
    surface = fit.evaluate(np.arange(1, max_batch + 1), ks)
    rows = np.arange(max_batch)
    g_new = surface.goodput_tok_s[rows, np.searchsorted(ks, new_k)]
    g_old = surface.goodput_tok_s[rows, np.searchsorted(ks, old_k)]
    return float(weights @ g_new / (weights @ g_old) - 1.0)


def decide_refit(
    records: Records,
    current: TableEnvelope | None,
    *,
    key: TableKey | str | None = None,
    max_k: int | None = None,
    max_batch: int | None = None,
    startup_k_values: Sequence[int] | None = None,
    newest_version: int = 0,
    threshold: float = DEFAULT_THRESHOLD,
    stale: bool = False,
    tolerance: float = DEFAULT_TOLERANCE,
    half_life_s: float | None = DEFAULT_HALF_LIFE_S,
    now_ns: int | None = None,
    created_at: str | None = None,
    provenance: dict[str, Any] | None = None,
    **fit_options: Any,
) -> RefitDecision:
    """Fit `records`, derive a candidate table and decide whether to publish it.

    Defaults come from the current envelope (max batch, startup K set, key) and otherwise
    from the records (their one table key, the largest K and batch size they show).
    The candidate's version is max(newest_version, current.version) + 1.
    The fit sees `fitter.engine_consensus.screen(records)`: no invalid rows, no engine that
    disagrees with the rest, none outweighing them (what went is in `screening`).
    """
    if threshold < 0:
        raise RefitError(f"threshold={threshold} must be >= 0")
    frame = as_frame(records)
    if frame.height == 0:
        raise RefitError("no telemetry records to fit")
    frame, screening = screen(frame)
    if frame.height == 0:
        raise RefitError(f"no telemetry records left to fit after screening "
                         f"({screening.to_dict()})")
    if key is None:
        key = current.key if current is not None else _table_key(frame)
    key = key if isinstance(key, TableKey) else TableKey.parse(key)
    if startup_k_values is None:
        if current is not None:
            startup_k_values = current.startup_k_values
        else:
            top = max_k if max_k is not None else int(frame["k_next"].max())  # type: ignore[arg-type]
            startup_k_values = tuple(range(top + 1))
    if max_k is None:
        max_k = max(startup_k_values)
    if max_batch is None:
        max_batch = current.max_batch if current is not None else int(frame["batch_size"].max())  # type: ignore[arg-type]
    fit = fit_surface(frame, max_k=max_k, max_batch=max_batch, half_life_s=half_life_s,
                      now_ns=now_ns, **fit_options)
    base = max(newest_version, current.version if current is not None else 0)
    screened = {"screening": screening.to_dict()} if screening.changed else {}
    candidate = derive_envelope(
        fit, key=key, version=base + 1, max_k=max_k, max_batch=max_batch,
        startup_k_values=startup_k_values, tolerance=tolerance, created_at=created_at,
        provenance={"source": "refit", "stale": stale, **screened, **dict(provenance or {})})
    candidate = add_fitted_budget(candidate, fit, frame, max_k=max_k)
    if current is None:
        return RefitDecision(candidate, True, "no current table", None, threshold, None, stale,
                             screening)
    gain = predicted_gain(fit, candidate, current, _time_share(frame, max_batch))
    candidate = dataclasses.replace(
        candidate, provenance={**candidate.provenance, "predicted_gain": round(gain, 6),
                               "replaces_version": current.version})
    if stale:
        return RefitDecision(candidate, True, "stale", gain, threshold, current.version, stale,
                             screening)
    publish = gain > threshold
    return RefitDecision(candidate, publish, "gain" if publish else "below threshold", gain,
                         threshold, current.version, stale, screening)


def parse_since(text: str) -> dt.timedelta:
    """`90s`, `30m`, `2h`, `1d` (a bare number is minutes)."""
    units = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
    value, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "m")
    try:
        amount = float(value)
    except ValueError:
        raise RefitError(f"--since {text!r}: expected a number with s, m, h or d") from None
    if amount <= 0:
        raise RefitError(f"--since {text!r} must be positive")
    return dt.timedelta(**{units[unit]: amount})


def _table_key(frame: pl.DataFrame) -> TableKey:
    missing = [c for c in ("model", "drafter", "hardware") if c not in frame.columns]
    if missing:
        raise RefitError(f"records lack {missing} to derive the table key: pass key=")
    keys = frame.select("model", "drafter", "hardware").unique().rows()
    if len(keys) != 1:
        shown = ", ".join("|".join(map(str, k)) for k in sorted(keys)[:5])
        raise RefitError(f"records hold {len(keys)} table keys ({shown}): pass key=")
    return TableKey(*(str(part) for part in keys[0]))


def _time_share(frame: pl.DataFrame, max_batch: int) -> np.ndarray:
    batch = np.clip(frame["batch_size"].to_numpy().astype(np.int64), 1, max_batch)
    seconds = frame["step_latency_s"].to_numpy().astype(np.float64)
    share = np.bincount(batch - 1, weights=seconds, minlength=max_batch)[:max_batch]
    total = share.sum()
    return share / total if total > 0 else np.full(max_batch, 1.0 / max_batch)
