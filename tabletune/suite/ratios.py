"""The suite's arithmetic, as pure functions on plain numbers.

Scores are "higher is better" (output tokens/s in a closed loop, per-request decode speed
1000 / TPOT p50 in an open loop). `None` stands for a run that failed or measured nothing;
any statistic that would need it is `None` too, never a silently shorter average.

- oracle: at each load, the best fixed K (the per-load best fixed K);
- best single fixed K: the one fixed K with the best mean ratio to the oracle over a grid's
  loads (a mean of ratios, so that high loads' larger token rates do not decide alone);
- recovery after a drift: (tabletune - stale) / (best fixed K - stale) over a window: the
  phase after it settles, and the whole phase from its first second.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

Scores = Mapping[str, float | None]
"""Policy -> score at one load."""


def stat(values: Sequence[float | None]) -> dict[str, Any] | None:
    """Mean and worst (min) of per-load ratios, or None when any is missing."""
    if not values or any(v is None for v in values):
        return None
    numbers = [float(v) for v in values if v is not None]
    return {"mean": round(statistics.fmean(numbers), 4), "worst": round(min(numbers), 4),
            "per_load": [round(v, 4) for v in numbers]}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def oracle(load: Scores, fixed: Sequence[str]) -> tuple[str | None, float | None]:
    """The best fixed K at one load: (policy, score); (None, None) if none ran."""
    ran = [(load[p], p) for p in fixed if load.get(p) is not None]
    if not ran:
        return None, None
    score, policy = max(ran, key=lambda entry: (entry[0], entry[1]))
    return policy, score


def best_single_fixed(loads: Sequence[Scores], fixed: Sequence[str]) -> str | None:
    """The fixed K with the highest mean ratio to the per-load oracle over all loads."""
    best: tuple[float, str] | None = None
    oracles = [oracle(load, fixed)[1] for load in loads]
    for policy in fixed:
        summary = stat([ratio(load.get(policy), o) for load, o in zip(loads, oracles,
                                                                      strict=True)])
        if summary is not None and (best is None or summary["mean"] > best[0]):
            best = (summary["mean"], policy)
    return None if best is None else best[1]


def grid_ratios(loads: Sequence[Scores], *, fixed: Sequence[str],
                baselines: Sequence[str]) -> dict[str, Any]:
    """Every policy's ratios over one grid's loads (in load order)."""
    oracles = [oracle(load, fixed) for load in loads]
    single = best_single_fixed(loads, fixed)
    policies = sorted({p for load in loads for p in load})
    out: dict[str, Any] = {}
    for policy in policies:
        mine = [load.get(policy) for load in loads]
        out[policy] = {
            "vs_oracle": stat([ratio(m, o[1]) for m, o in zip(mine, oracles, strict=True)]),
            "vs_best_single_fixed": None if single is None else stat(
                [ratio(m, load.get(single)) for m, load in zip(mine, loads, strict=True)]),
            "vs": {b: stat([ratio(m, load.get(b)) for m, load in zip(mine, loads, strict=True)])
                   for b in baselines if b != policy},
        }
    return {"oracle": [{"policy": p, "score": s} for p, s in oracles],
            "best_single_fixed": single, "policies": out}


def curve_changes(oracles: Sequence[Mapping[str, Any]]) -> int | None:
    """How often the best fixed K changes from one load to the next, in load order: a table
    needs no more than this many ranges plus one (None when a load has no best K)."""
    picks = [entry.get("policy") for entry in oracles]
    if not picks or any(p is None for p in picks):
        return None
    return sum(1 for before, after in zip(picks[:-1], picks[1:], strict=True) if before != after)


def window_rate(timeline: Sequence[Sequence[float]], start_s: float, end_s: float) -> float | None:
    """Mean output tokens/s of the 10 s timeline buckets that start in [start_s, end_s)."""
    points = [rate for t, rate in timeline if start_s <= t < end_s]
    return statistics.fmean(points) if points else None


MIN_STALE_LOSS = 0.01
"""Recovery is only defined when the stale table lost at least this share of the best fixed
K's rate: below it the denominator is noise and the quotient meaningless."""


def recovery(tabletune: float | None, stale: float | None, best: float | None, *,
             min_loss: float = MIN_STALE_LOSS) -> float | None:
    """Share of the stale table's loss that TableTune won back; None when it lost too little
    (less than `min_loss` of `best`) to measure a recovery against."""
    if tabletune is None or stale is None or best is None or best <= 0:
        return None
    if (best - stale) / best < min_loss or best <= stale:
        return None
    return (tabletune - stale) / (best - stale)


def drift_phase(runs: Mapping[str, Any], stale: Mapping[str, Any] | None, *, phase: int,
                settle_s: float, fixed: Sequence[str],
                baselines: Sequence[str]) -> dict[str, Any]:
    """One new phase of a drift scenario: window rates per policy, stale loss, recovery.

    `runs` maps a policy to its drift result (`timeline`, `phases`), `stale` is the run under
    the table profiled before this phase; failed runs carry `error` and score None. The
    top-level keys score the settled window (after `settle_s`); `whole_phase` scores the
    same from the phase's first second, so that what the reaction costs is counted too.
    """
    spans = next((r["phases"] for r in [*runs.values(), stale or {}] if "phases" in r), None)
    if spans is None or phase >= len(spans):
        return {"phase": phase, "error": "no run reached this phase"}
    span = spans[phase]
    settled = _window_scores(runs, stale, span["start_s"] + settle_s, span["end_s"],
                             fixed=fixed, baselines=baselines)
    row = {"phase": phase, "name": span["name"], **settled,
           "whole_phase": _window_scores(runs, stale, span["start_s"], span["end_s"],
                                         fixed=fixed, baselines=baselines)}
    if stale:
        row["stale"] = {k: stale.get(k) for k in ("profiled_phase", "table", "table_path",
                                                  "profile_wall_s", "profile_engine_s",
                                                  "profile_records", "error")
                        if k in stale}
    return row


def _window_scores(runs: Mapping[str, Any], stale: Mapping[str, Any] | None, start: float,
                   end: float, *, fixed: Sequence[str],
                   baselines: Sequence[str]) -> dict[str, Any]:
    """Rates, best fixed K, stale loss and recovery over [start, end) of the timelines."""

    def rate(run: Mapping[str, Any] | None) -> float | None:
        return None if not run or "timeline" not in run else window_rate(run["timeline"],
                                                                        start, end)

    rates = {policy: rate(run) for policy, run in runs.items()}
    best_policy, best = oracle(rates, fixed)
    stale_rate, tabletune = rate(stale), rates.get("tabletune")
    return {
        "window_s": [start, end],
        "best_fixed": best_policy, "best_fixed_tok_s": _round(best),
        "stale_tok_s": _round(stale_rate), "tabletune_tok_s": _round(tabletune),
        "stale_loss": _round(None if best is None or stale_rate is None
                             else 1 - stale_rate / best, 4),
        "tabletune_vs_best_fixed": _round(ratio(tabletune, best), 4),
        "recovery": _round(recovery(tabletune, stale_rate, best), 3),
        "vs_best_fixed": {p: _round(ratio(rates.get(p), best), 4)
                          for p in (*baselines, "tabletune") if p in rates},
        "tok_s": {p: _round(r) for p, r in rates.items()},
    }


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)
