"""A twin profile from a real engine's telemetry: its cost model and acceptance, measured.

`tabletune twin calibrate --parquet DIR` reads the step records (`fitter.dataset`) and fits
every coefficient of the twin's cost model (`twin.cost`) and the acceptance the twin draws
into a `twin.calibration.Calibration`, which `profile_toml` writes as a scenario the twin
runs as it is, or whose `[cost]` and `[drafter]` tables and acceptance line go into another
scenario.

What is fitted from which columns, and why:

- Step latency. `step_latency_s` (vLLM: from `schedule()` to `update_from_output()`:
  scheduling, the target's forward pass and the drafter's proposals) is regressed by
  nonnegative least squares on the twin's own terms (docs/TWIN.md, cost model):

      verify = target_kv·KV + target_batched·max(0, batched − knee_tokens) + target_fixed
      draft  = [K > 0]·(draft_kv·KV + draft_per_token·(K + 1) + draft_fixed)  eagle, draft_model
             = [K > 0]·ngram_fraction·verify                                  ngram

  `batched` = num_decode_reqs + num_draft_tokens + num_prefill_tokens (what the step
  computed: one token per decode, its drafts, the prompt chunks), `K` = `k_next` (the drafts
  proposed in the step: what the twin charges a step for), `KV` = `kv_tokens`, less the
  step's drafts and prompt chunk for vLLM's records (vLLM's context counts the tokens
  scheduled in the step; the twin's is prompt + generated for a decode and what was computed
  before for a prefill). Absolute least squares with an intercept keeps the fitted time of
  the records equal to their measured total: throughput is time per token.
- `step_overhead`: the engine loop's time outside `schedule()` → `update_from_output()`
  (output processing, the next schedule's start), which a real engine spends every step and
  the twin adds to it: the mean of `inter_step_s − step_latency_s` over steps with decodes
  (such a step's predecessor left requests running, so its gap holds no idle wait). Twin
  records carry none (their `inter_step_s` runs start to start: the previous step's
  latency), so from them it comes out at 0 and their overhead sits in `target_fixed`: only
  the sum is theirs (`source="twin"`).
- `knee_tokens`: the least-squares knee among the batched tokens' 5–90 % quantiles, kept only
  when it lowers the squared error by 2 % or more; `noise`: the standard deviation of
  latency / fitted − 1 (at most 0.5).
- A term the records cannot tell apart from another is 0 and named in `notes`: without steps
  at K = 0 the draft's KV and fixed terms are the verify's; with one K > 0 only,
  draft_per_token·(K + 1) is a constant; the n-gram fraction needs steps at K = 0 and K > 0.
- Acceptance per draft position, conditional, as the twin draws it: position 0 is
  accepted_per_pos[0] over the requests with drafts (`num_drafts`), position i
  accepted_per_pos[i] over accepted_per_pos[i − 1], over the steps that verified more than
  i drafts. A draft that stopped short of position i counts as rejected there: the twin
  proposes whole drafts, so its tokens per step stay the engine's.
- n-gram: decodes that proposed nothing (no match) give `ngram_match_prob`. The twin skips a
  proposal only where the next draft would be rejected, with probability 1 − p; so over the
  decodes whose previous step proposed (K > 0), a0 = accepted_per_pos[0] / decodes is
  position 0's rate and p = 1 − (share without drafts) / (1 − a0).

With a measured latency table (`cost_table`, `[cost] table`), no coefficient is fitted: the
records are priced by the table (the step as timed plus `step_overhead`, the table being the
whole engine step), and only `noise`, the acceptance and the lengths come from them; `fit`
says how far the table's total is from the records'.

The first record of each engine is left out (it has no previous step, and vLLM's carries
its warm-up).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import polars as pl
from scipy.optimize import nnls

from fitter.dataset import DatasetError, load_dataset
from twin.calibration import Calibration, CalibrationError
from twin.config import COST_COEFFICIENTS, DRAFT_METHODS
from twin.latency_table import LatencyTable, LatencyTableError, load_latency_table

SOURCES = ("vllm", "twin")
KNEE_GAIN = 0.02
"""A knee is kept only when it lowers the squared error by this share."""
MAX_NOISE = 0.5
_RANK_TOL = 1e-7
"""Relative singular value under which a term adds nothing the others do not."""


def load_records(parquet: str | os.PathLike[str], hardware_prefix: str | None = None,
                 engine_ids: list[str] | None = None) -> pl.DataFrame:
    """Step records under `parquet` whose hardware starts with `hardware_prefix` (and whose
    engine is one of `engine_ids`); CalibrationError when there are none."""
    try:
        records = load_dataset(parquet).records
    except FileNotFoundError:
        raise CalibrationError(f"no Parquet telemetry under {parquet}") from None
    except DatasetError as exc:
        raise CalibrationError(str(exc)) from None
    if records.height == 0:
        raise CalibrationError(f"the telemetry under {parquet} holds no step records")
    chosen = records
    if hardware_prefix:
        chosen = chosen.filter(pl.col("hardware").str.starts_with(hardware_prefix))
    if engine_ids is not None:
        chosen = chosen.filter(pl.col("engine_id").is_in(engine_ids))
    if chosen.height == 0:
        found = ", ".join(sorted(records["hardware"].unique().to_list()))
        raise CalibrationError(f"no step records under {parquet} with hardware starting "
                               f"{hardware_prefix!r} (hardware found: {found})")
    return chosen


def method_of(drafter: str) -> str:
    """The twin's drafter method for a record's `drafter` ("draft_model:NAME", "ngram")."""
    method = drafter.split(":", 1)[0]
    if method in DRAFT_METHODS:
        return method
    if method.startswith("eagle"):
        return "eagle"  # eagle3
    raise CalibrationError(f"drafter {drafter!r}: the twin knows {', '.join(DRAFT_METHODS)}; "
                           "give --method")


def calibrate(records: pl.DataFrame, *, method: str | None = None,
              source: str = "vllm", cost_table: str | os.PathLike[str] | None = None,
              ) -> Calibration:
    """Fit the cost model and acceptance to `records` (one drafter). `source`: who wrote
    them, "vllm" (the hook: kv_tokens count the step's scheduled tokens, inter_step_s runs
    update to update) or "twin" (its own context, inter_step_s start to start).
    `cost_table`: a measured latency CSV to price the steps by instead of fitting."""
    if records.height == 0:
        raise CalibrationError("no step records to calibrate from")
    drafters = sorted(records["drafter"].unique().to_list())
    if method is None:
        methods = {method_of(d) for d in drafters}
        if len(methods) > 1:
            raise CalibrationError(f"records of several drafters ({', '.join(drafters)}): "
                                   "select one (--hardware-prefix)")
        method = methods.pop()
    elif method not in DRAFT_METHODS:
        raise CalibrationError(f"method {method!r}: one of {', '.join(DRAFT_METHODS)}")
    if source not in SOURCES:
        raise CalibrationError(f"source {source!r}: one of {', '.join(SOURCES)}")
    steps = _steps(records, source)
    if steps.height < 8:
        raise CalibrationError(f"{steps.height} usable step records (the first of each "
                               "engine is left out): too few to fit a cost model")
    notes: list[str] = []
    table_path = None
    if cost_table is None:
        cost, knee, noise, fit = _fit_cost(steps, method, source, notes)
    else:
        table_path = str(os.path.abspath(cost_table))
        try:
            table = load_latency_table(table_path)
        except LatencyTableError as exc:
            raise CalibrationError(str(exc)) from None
        cost, knee = {name: 0.0 for name in COST_COEFFICIENTS}, 0
        noise, fit = _price_by_table(steps, table, notes)
    acceptance, match_prob = _fit_acceptance(steps, method, notes)
    identity = {name: sorted(records[name].unique().to_list())
                for name in ("model", "drafter", "hardware", "engine_id")}
    return Calibration(method=method, cost=cost, knee_tokens=knee, noise=noise,
                       acceptance=acceptance, ngram_match_prob=match_prob,
                       records=steps.height, fit=fit, notes=notes, identity=identity,
                       lengths=_lengths(steps), cost_table=table_path)


def measure_acceptance(records: pl.DataFrame, method: str
                       ) -> tuple[tuple[float, ...], float, list[str]]:
    """Acceptance per draft position and n-gram match probability of `records` alone (as
    `calibrate` measures them), with its notes; () when no step verified drafts."""
    notes: list[str] = []
    if records.height == 0:
        return (), 1.0, ["acceptance: no records"]
    rates, match_prob = _fit_acceptance(_steps(records, "vllm"), method, notes)
    return rates, match_prob, notes


def predict_step_s(calibration: Calibration, records: pl.DataFrame, *,
                   source: str = "vllm") -> np.ndarray:
    """The calibrated cost model's time per step of `records` (step_overhead included,
    noise-free): what the twin would charge for the same steps."""
    steps = _columns(records, source)
    c = calibration.cost
    batched = steps["batched"].to_numpy().astype(float)
    if calibration.knee_tokens:
        batched = np.maximum(0.0, batched - calibration.knee_tokens)
    kv = steps["kv"].to_numpy().astype(float)
    k = steps["k_next"].to_numpy().astype(float)
    drafting = k > 0
    verify = c["target_kv"] * kv + c["target_batched"] * batched + c["target_fixed"]
    if calibration.method == "ngram":
        draft = c["ngram_fraction"] * verify
    else:
        draft = c["draft_kv"] * kv + c["draft_per_token"] * (k + 1) + c["draft_fixed"]
    return verify + np.where(drafting, draft, 0.0) + c["step_overhead"]


def _columns(records: pl.DataFrame, source: str) -> pl.DataFrame:
    batched = pl.col("num_decode_reqs") + pl.col("num_draft_tokens") + pl.col("num_prefill_tokens")
    kv = pl.col("kv_tokens")
    if source == "vllm":
        kv = pl.max_horizontal(kv - pl.col("num_draft_tokens") - pl.col("num_prefill_tokens"),
                               pl.lit(0))
    return records.with_columns(batched.alias("batched"), kv.alias("kv"))


def _steps(records: pl.DataFrame, source: str) -> pl.DataFrame:
    """Records in engine order with the fit's columns, the previous step's K and the time
    between the two steps (`gap_s`); each engine's first record left out."""
    ordered = _columns(records, source).sort("engine_id", "step_seq")
    # vLLM: inter_step_s = update to update = the gap before the step + the step itself;
    # the twin: start to start = the previous step + the gap
    latency = (pl.col("step_latency_s") if source == "vllm"
               else pl.col("step_latency_s").shift(1).over("engine_id"))
    ordered = ordered.with_columns(
        pl.col("k_next").shift(1).over("engine_id").alias("prev_k_next"),
        (pl.col("inter_step_s") - latency).alias("gap_s"),
        (pl.col("step_seq") - pl.col("step_seq").shift(1).over("engine_id"))
        .alias("seq_gap"))
    return ordered.filter(pl.col("seq_gap").is_not_null())


def _fit_cost(steps: pl.DataFrame, method: str, source: str, notes: list[str]
              ) -> tuple[dict[str, float], int, float, dict[str, Any]]:
    y = steps["step_latency_s"].to_numpy().astype(float)
    kv = steps["kv"].to_numpy().astype(float)
    batched = steps["batched"].to_numpy().astype(float)
    k = steps["k_next"].to_numpy().astype(float)
    drafting = (k > 0).astype(float)
    ones = np.ones_like(y)

    def solve(knee: int) -> tuple[float, dict[str, float], list[str]]:
        b = np.maximum(0.0, batched - knee) if knee else batched
        if method == "ngram":
            return _fit_ngram(y, kv, b, drafting)
        terms = {"target_kv": kv, "target_batched": b, "target_fixed": ones,
                 "draft_fixed": drafting, "draft_per_token": drafting * (k + 1),
                 "draft_kv": drafting * kv}
        sse, coef, dropped = _nnls(terms, y)
        return sse, coef, dropped

    base_sse, best_coef, best_dropped = solve(0)
    knee, best_sse = 0, base_sse
    candidates = sorted({int(q) for q in np.quantile(batched, np.arange(0.05, 0.91, 0.05))
                         if q >= 1})
    for candidate in candidates:
        sse, coef, dropped = solve(candidate)
        if sse < best_sse and sse < base_sse * (1 - KNEE_GAIN):
            best_sse, best_coef, best_dropped, knee = sse, coef, dropped, candidate
    for name in best_dropped:
        notes.append(_WHY_DROPPED.get(name, f"{name}: not separable in these records (0)"))
    cost = {name: 0.0 for name in COST_COEFFICIENTS}
    cost.update(best_coef)
    if method != "ngram":
        notes.append("ngram_fraction: not used by this drafter (0)")
    cost["step_overhead"], overhead_steps = _step_overhead(steps)
    fitted = _predict(cost, method, knee, kv, batched, k) - cost["step_overhead"]
    noise, fit = _fit_stats(y, fitted, k)
    fit.update(mean_step_overhead_s=cost["step_overhead"], step_overhead_steps=overhead_steps)
    return cost, knee, noise, fit


def _step_overhead(steps: pl.DataFrame) -> tuple[float, int]:
    """The engine loop's time outside schedule -> update, on steps that follow a busy step
    (mean, and how many steps it is over)."""
    busy = steps.filter((pl.col("num_decode_reqs") > 0) & (pl.col("inter_step_s") > 0)
                        & (pl.col("seq_gap") == 1))
    gaps = busy["gap_s"].to_numpy()
    return (max(0.0, float(gaps.mean())) if gaps.size else 0.0), int(gaps.size)


def _fit_stats(y: np.ndarray, fitted: np.ndarray, k: np.ndarray
               ) -> tuple[float, dict[str, Any]]:
    """noise (the robust spread of y / fitted) and the fit's summary."""
    residual = y - fitted
    total = float(((y - y.mean()) ** 2).sum())
    relative = y / np.maximum(fitted, 1e-12) - 1.0
    # robust (1.4826 MAD): the twin's noise is Gaussian jitter; a real engine's rare long
    # steps are in the fit's mean, not in a spread that would blow up to cover them
    spread = 1.4826 * float(np.median(np.abs(relative - np.median(relative))))
    noise = float(min(MAX_NOISE, spread)) if y.size > 1 else 0.0
    return noise, {
        "r2": round(1.0 - float((residual ** 2).sum()) / total, 4) if total > 0 else None,
        "rmse_s": float(np.sqrt(np.mean(residual ** 2))),
        "mean_latency_s": float(y.mean()),
        "fitted_total_ratio": round(float(fitted.sum() / y.sum()), 4),
        "relative_residual_p99": round(float(np.quantile(np.abs(relative), 0.99)), 3),
        "k_next_values": sorted({int(v) for v in k})}


def _price_by_table(steps: pl.DataFrame, table: LatencyTable, notes: list[str]
                    ) -> tuple[float, dict[str, Any]]:
    """Noise and fit statistics of the records against a measured table (whole steps)."""
    k = steps["k_next"].to_numpy().astype(int)
    if int(k.max()) > table.max_k:
        raise CalibrationError(f"{table.source}: rows for k up to {table.max_k}, but the "
                               f"records propose up to {int(k.max())} drafts")
    overhead, overhead_steps = _step_overhead(steps)
    step_s = table.step_fn()
    priced = np.array([step_s(kv, batched, k_next) for kv, batched, k_next in zip(
        steps["kv"].to_list(), steps["batched"].to_list(), k.tolist(), strict=True)])
    measured = steps["step_latency_s"].to_numpy().astype(float) + overhead
    noise, fit = _fit_stats(measured, priced, k)
    fit.update(mean_step_overhead_s=overhead, step_overhead_steps=overhead_steps)
    ratio = fit["fitted_total_ratio"]
    if not 0.9 <= ratio <= 1.1:
        notes.append(f"cost table: it prices these records at {ratio:.2f}x their measured "
                     "time (step + engine loop): is it this engine's table?")
    return noise, fit


_WHY_DROPPED = {
    "draft_kv": "draft_kv: not separable from target_kv (no records at K = 0): 0, the "
                "drafter's KV time is in target_kv",
    "draft_fixed": "draft_fixed: not separable from target_fixed (no records at K = 0): 0, "
                   "in target_fixed",
    "draft_per_token": "draft_per_token: one K > 0 only, so (K + 1) is a constant: 0, in "
                       "the fixed terms (the twin is then right at that K only)",
    "ngram_fraction": "ngram_fraction: needs records at K = 0 and K > 0: 0, the proposal "
                      "time is in the verify terms",
    "target_kv": "target_kv: KV does not vary apart from the other terms: 0",
    "target_batched": "target_batched: batched tokens do not vary apart from the other "
                      "terms: 0",
}


def _predict(cost: dict[str, float], method: str, knee: int, kv: np.ndarray,
             batched: np.ndarray, k: np.ndarray) -> np.ndarray:
    b = np.maximum(0.0, batched - knee) if knee else batched
    verify = cost["target_kv"] * kv + cost["target_batched"] * b + cost["target_fixed"]
    if method == "ngram":
        draft = cost["ngram_fraction"] * verify
    else:
        draft = cost["draft_kv"] * kv + cost["draft_per_token"] * (k + 1) + cost["draft_fixed"]
    return verify + np.where(k > 0, draft, 0.0) + cost["step_overhead"]


def _fit_ngram(y: np.ndarray, kv: np.ndarray, batched: np.ndarray, drafting: np.ndarray
               ) -> tuple[float, dict[str, float], list[str]]:
    """verify·(1 + f·[K > 0]): nonnegative least squares for each f of a grid, refined."""
    ones = np.ones_like(y)

    def at(f: float) -> tuple[float, dict[str, float], list[str]]:
        scale = 1.0 + f * drafting
        return _nnls({"target_kv": kv * scale, "target_batched": batched * scale,
                      "target_fixed": ones * scale}, y)

    if drafting.min() == drafting.max():  # all K > 0, or all K = 0
        sse, coef, dropped = at(0.0)
        return sse, {**coef, "ngram_fraction": 0.0}, [*dropped, "ngram_fraction"]
    grid = np.linspace(0.0, 2.0, 41)
    sses = [at(f)[0] for f in grid]
    best = int(np.argmin(sses))
    low, high = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    fine = np.linspace(low, high, 41)
    results = [at(f) for f in fine]
    index = int(np.argmin([r[0] for r in results]))
    sse, coef, dropped = results[index]
    return sse, {**coef, "ngram_fraction": float(fine[index])}, dropped


def _nnls(terms: dict[str, np.ndarray], y: np.ndarray
          ) -> tuple[float, dict[str, float], list[str]]:
    """Nonnegative least squares over the terms that add a direction to those before them
    (in the dict's order); the others are 0 and returned as dropped."""
    kept: list[str] = []
    columns: list[np.ndarray] = []
    dropped: list[str] = []
    for name, column in terms.items():
        norm = float(np.linalg.norm(column))
        if norm == 0.0:
            dropped.append(name)
            continue
        trial = np.column_stack([*columns, column / norm])
        singular = np.linalg.svd(trial, compute_uv=False)
        if singular[-1] <= _RANK_TOL * singular[0]:
            dropped.append(name)
            continue
        kept.append(name)
        columns.append(column / norm)
    coef = {name: 0.0 for name in terms}
    if not kept:
        return float((y ** 2).sum()), coef, dropped
    matrix = np.column_stack(columns)
    solution, _ = nnls(matrix, y, maxiter=50 * matrix.shape[1])
    for name, value in zip(kept, solution, strict=True):
        coef[name] = float(value) / float(np.linalg.norm(terms[name]))
    residual = y - matrix @ solution
    return float((residual ** 2).sum()), coef, dropped


def _fit_acceptance(steps: pl.DataFrame, method: str, notes: list[str]
                    ) -> tuple[tuple[float, ...], float]:
    drafted = steps.filter(pl.col("k") > 0)
    if drafted.height == 0:
        notes.append("acceptance: no step verified drafts (K = 0 only): not measured")
        return (), 1.0
    max_k = int(drafted["k"].max())
    k = drafted["k"].to_numpy()
    per_pos = np.zeros((drafted.height, max_k), dtype=np.int64)
    for i in range(max_k):
        per_pos[:, i] = (drafted.select(pl.col("accepted_per_pos").list.get(i, null_on_oob=True)
                                        .fill_null(0))
                         .to_series().to_numpy())
    drafts = drafted["num_drafts"].to_numpy()
    rates: list[float] = []
    for i in range(max_k):
        deeper = k > i
        reached = drafts[deeper].sum() if i == 0 else per_pos[deeper, i - 1].sum()
        if reached <= 0:
            break
        rates.append(float(per_pos[deeper, i].sum() / reached))
    match_prob = 1.0
    if method == "ngram" and rates:
        # the decodes whose drafts were proposed at the previous step (K > 0 there)
        after = steps.filter((pl.col("seq_gap") == 1) & (pl.col("prev_k_next") > 0)
                             & (pl.col("num_decode_reqs") > 0))
        decodes = int(after["num_decode_reqs"].sum())
        if decodes:
            first = int(after.select(pl.col("accepted_per_pos").list.get(0, null_on_oob=True)
                                     .fill_null(0).sum()).item())
            a0 = first / decodes
            no_draft = 1.0 - int(after["num_drafts"].sum()) / decodes
            match_prob = 1.0 if a0 >= 1.0 else min(1.0, max(0.0, 1.0 - no_draft / (1.0 - a0)))
            rates[0] = a0
            notes.append(f"n-gram: {no_draft:.1%} of decodes proposed no draft -> "
                         f"ngram_match_prob {match_prob:.3f}; acceptance[0] is per decode")
    return tuple(round(r, 4) for r in rates), match_prob


def _lengths(steps: pl.DataFrame) -> dict[str, float]:
    tokens = int((steps["num_decode_reqs"] + steps["num_accepted_tokens"]
                  + steps["num_prefill_reqs"]).sum())
    prefills = int(steps["num_prefill_reqs"].sum())
    requests = 0
    if "finished_requests" in steps.columns:
        requests = int(steps.select(pl.col("finished_requests").list.eval(
            pl.element().struct.field("request").n_unique()).list.first().fill_null(0)
            .sum()).item())
    return {"prompt_len": round(int(steps["num_prefill_tokens"].sum()) / prefills, 1)
            if prefills else 0.0,
            "output_len": round(tokens / requests, 1) if requests else 0.0,
            "mean_batch": round(float(steps["batch_size"].mean()), 2),
            "max_batch": int(steps["batch_size"].max()),
            "max_k": int(steps["k_next"].max())}
