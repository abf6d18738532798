"""Every-second accounting of a swing run: no settling window, every phase from its first second.

Pure arithmetic on plain numbers, so that a tiny hand-made run can check it. Rates come from
the twin's 10 s timeline (`[t_s, output tokens/s]`, a bucket belongs to the phase it starts
in); run-level rates weight each phase by its length, so they are token counts over time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tabletune.suite.ratios import window_rate

Timeline = Sequence[Sequence[float]]


def span_rate(timeline: Timeline, start_s: float, end_s: float) -> float:
    """Mean output tokens/s of the buckets that start in [start_s, end_s); 0 when none."""
    rate = window_rate(timeline, start_s, end_s)
    return 0.0 if rate is None else rate


def account(timelines: Mapping[str, Timeline], spans: Sequence[tuple[str, float, float]], *,
            fixed: Sequence[str], policy: str = "tabletune") -> dict[str, Any]:
    """`policy` against the fixed policies, per phase and over the run.

    Per phase: its best fixed K and `policy`'s ratio to it. Over the run: `policy` against
    the per-phase best (an oracle that switches K at every swing), against the best single
    fixed K, and the headroom (per-phase best over best single K).
    """
    by_phase = [{p: span_rate(timelines[p], start, end) for p in [*fixed, policy]}
                for _, start, end in spans]
    widths = [end - start for _, start, end in spans]
    totals = {p: sum(r[p] * w for r, w in zip(by_phase, widths, strict=True))
              for p in [*fixed, policy]}
    single = max(fixed, key=lambda p: (totals[p], p))
    phases, oracle_tokens = [], 0.0
    for (name, start, end), rates, width in zip(spans, by_phase, widths, strict=True):
        best = max(fixed, key=lambda p: (rates[p], p))
        oracle_tokens += rates[best] * width
        phases.append({"name": name, "window_s": [start, end], "best_fixed": best,
                       "best_fixed_tok_s": round(rates[best], 1),
                       "tok_s": {p: round(r, 1) for p, r in rates.items()},
                       "vs_phase_best": _ratio(rates[policy], rates[best]),
                       "vs_run_best_single": _ratio(rates[policy], rates[single])})
    duration = sum(widths)
    return {
        "phases": phases,
        "run": {
            "duration_s": duration,
            "tok_s": {p: round(total / duration, 1) for p, total in totals.items()},
            "per_phase_best_tok_s": round(oracle_tokens / duration, 1),
            "best_single_fixed": single,
            "vs_per_phase_best": _ratio(totals[policy], oracle_tokens),
            "vs_best_single": _ratio(totals[policy], totals[single]),
            "headroom": _ratio(oracle_tokens, totals[single]),
        },
    }


def forced_share(ts_s: np.ndarray, forced: np.ndarray, *, after_s: float, end_s: float,
                 window_s: float = 600.0) -> dict[str, Any]:
    """Forced steps as a share of steps after `after_s`: overall, and the worst `window_s`
    window (one starting at every step, wholly inside the run)."""
    order = np.argsort(ts_s, kind="stable")
    ts, hit = np.asarray(ts_s, float)[order], np.asarray(forced, bool)[order]
    keep = ts >= after_s
    ts, hit = ts[keep], hit[keep]
    out: dict[str, Any] = {"after_s": round(after_s, 2), "window_s": window_s,
                           "steps": int(len(ts)), "forced_steps": int(hit.sum()),
                           "share": _ratio(float(hit.sum()), float(len(ts))),
                           "worst_window_share": None, "worst_window_start_s": None}
    starts = np.flatnonzero(ts + window_s <= end_s)
    if len(starts) == 0:
        return out
    cum = np.concatenate([[0], np.cumsum(hit)])
    stops = np.searchsorted(ts, ts[starts] + window_s, side="left")
    shares = (cum[stops] - cum[starts]) / (stops - starts)
    worst = int(np.argmax(shares))
    out["worst_window_share"] = round(float(shares[worst]), 4)
    out["worst_window_start_s"] = round(float(ts[starts[worst]]), 2)
    return out


def _ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 4) if denominator > 0 else None
