"""What a twin run measured: a per-step and per-request log, and the summary drawn from it.

Rates are per second of virtual time. TPOT is vLLM's definition per finished request,
(finish − first token) / (output tokens − 1); TTFT is first token − arrival. A request counts
in the phase in which it finished, a step in the phase in which it started.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

TIMELINE_BUCKET_S = 10.0


class RunLog:
    """Columns appended by the engine: cheap list appends per step, arrays per finish."""

    def __init__(self) -> None:
        self.step_start_s: list[float] = []
        self.step_latency_s: list[float] = []
        self.batch_size: list[int] = []
        self.k_next: list[int] = []
        self.emitted: list[int] = []
        self.phase: list[int] = []
        self._finished: list[tuple[np.ndarray, ...]] = []

    def add_step(self, start_s: float, latency_s: float, batch_size: int, k_next: int,
                 emitted: int, phase: int) -> None:
        self.step_start_s.append(start_s)
        self.step_latency_s.append(latency_s)
        self.batch_size.append(batch_size)
        self.k_next.append(k_next)
        self.emitted.append(emitted)
        self.phase.append(phase)

    def add_steps(self, start_s: list[float], latency_s: list[float], batch_size: int,
                  k_next: int, emitted: list[int], phase: list[int]) -> None:
        """Consecutive steps of one batch size and K, as one `add_step` each."""
        self.step_start_s.extend(start_s)
        self.step_latency_s.extend(latency_s)
        self.batch_size.extend([batch_size] * len(start_s))
        self.k_next.extend([k_next] * len(start_s))
        self.emitted.extend(emitted)
        self.phase.extend(phase)

    def add_step_columns(self, start_s: list[float], latency_s: list[float],
                         batch_size: list[int], k_next: list[int], emitted: list[int],
                         phase: list[int]) -> None:
        """Consecutive steps, column by column, as one `add_step` each."""
        self.step_start_s.extend(start_s)
        self.step_latency_s.extend(latency_s)
        self.batch_size.extend(batch_size)
        self.k_next.extend(k_next)
        self.emitted.extend(emitted)
        self.phase.extend(phase)

    def add_finished(self, arrival_s: np.ndarray, first_token_s: np.ndarray, finish_s: float,
                     output_tokens: np.ndarray, request_id: np.ndarray,
                     pool_index: np.ndarray, phase: np.ndarray) -> None:
        finish = np.full(len(arrival_s), finish_s)
        self._finished.append((arrival_s, first_token_s, finish, output_tokens, request_id,
                               pool_index, phase))

    def add_finished_rows(self, rows: list[tuple[float, float, float, int, int, int, int]]
                          ) -> None:
        """Finished requests one tuple each, in `finished`'s column order, after those
        added before."""
        columns = tuple(zip(*rows, strict=True))
        self._finished.append(tuple(np.array(column, dtype=np.int64 if i > 2 else np.float64)
                                    for i, column in enumerate(columns)))

    def finished(self) -> dict[str, np.ndarray]:
        """Finished requests as columns (arrival_s, first_token_s, finish_s, output_tokens,
        request_id, pool_index, phase), in finishing order."""
        names = ("arrival_s", "first_token_s", "finish_s", "output_tokens", "request_id",
                 "pool_index", "phase")
        if not self._finished:
            return {name: np.zeros(0, np.int64 if i > 2 else np.float64)
                    for i, name in enumerate(names)}
        return {name: np.concatenate([chunk[i] for chunk in self._finished])
                for i, name in enumerate(names)}


@dataclass
class RunSummary:
    policy: str
    scenario: str
    duration_s: float
    output_tokens_per_s: float
    output_tokens: int
    tpot_ms_p50: float | None
    tpot_ms_p99: float | None
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    requests_finished: int
    steps: int
    mean_batch_size: float
    k_share: dict[str, float]
    """Share of steps per K chosen by the table (the step's k_next), keys as strings."""
    phases: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[list[float]] = field(default_factory=list)
    """[t_s, output_tokens_per_s] per 10 s of virtual time."""
    telemetry: dict[str, int] | None = None
    """Recorder counters when records were sent to a sink."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(log: RunLog, *, policy: str, scenario: str, duration_s: float,
              phase_spans: list[tuple[str, float, float]]) -> RunSummary:
    """`phase_spans` = (name, start_s, end_s) per phase, in order, clipped to the run."""
    start = np.asarray(log.step_start_s)
    latency = np.asarray(log.step_latency_s)
    steps = {
        "end": start + latency,
        "batch": np.asarray(log.batch_size, dtype=np.int64),
        "k": np.asarray(log.k_next, dtype=np.int64),
        "emitted": np.asarray(log.emitted, dtype=np.int64),
        "phase": np.asarray(log.phase, dtype=np.int64),
    }
    requests = log.finished()
    overall = _metrics(steps, requests, np.ones(len(start), bool),
                       np.ones(len(requests["finish_s"]), bool), duration_s)
    phases = []
    for index, (name, phase_start, phase_end) in enumerate(phase_spans):
        in_phase = (requests["finish_s"] >= phase_start) & (requests["finish_s"] < phase_end)
        if index == len(phase_spans) - 1:
            in_phase = requests["finish_s"] >= phase_start
        metrics = _metrics(steps, requests, steps["phase"] == index, in_phase,
                           max(phase_end - phase_start, 1e-9))
        phases.append({"name": name, "start_s": phase_start, "end_s": phase_end, **metrics})
    return RunSummary(policy=policy, scenario=scenario, duration_s=duration_s, phases=phases,
                      timeline=_timeline(steps["end"], steps["emitted"], duration_s), **overall)


def _metrics(steps: dict[str, np.ndarray], requests: dict[str, np.ndarray], step_mask: np.ndarray,
             request_mask: np.ndarray, span_s: float) -> dict[str, Any]:
    output = requests["output_tokens"][request_mask]
    first = requests["first_token_s"][request_mask]
    multi = output > 1
    tpot_ms = (requests["finish_s"][request_mask][multi] - first[multi]) / (output[multi] - 1) * 1e3
    ttft_ms = (first - requests["arrival_s"][request_mask]) * 1e3
    tokens = int(steps["emitted"][step_mask].sum())
    batch = steps["batch"][step_mask]
    ks, counts = np.unique(steps["k"][step_mask], return_counts=True)
    return {
        "output_tokens_per_s": tokens / span_s,
        "output_tokens": tokens,
        "tpot_ms_p50": _percentile(tpot_ms, 50),
        "tpot_ms_p99": _percentile(tpot_ms, 99),
        "ttft_ms_p50": _percentile(ttft_ms, 50),
        "ttft_ms_p99": _percentile(ttft_ms, 99),
        "requests_finished": int(request_mask.sum()),
        "steps": int(step_mask.sum()),
        "mean_batch_size": float(batch.mean()) if len(batch) else 0.0,
        "k_share": {str(int(k)): float(c) / len(batch) for k, c in zip(ks, counts, strict=True)},
    }


def _percentile(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _timeline(step_end_s: np.ndarray, emitted: np.ndarray, duration_s: float) -> list[list[float]]:
    buckets = max(1, int(np.ceil(duration_s / TIMELINE_BUCKET_S - 1e-9)))
    index = np.minimum((step_end_s // TIMELINE_BUCKET_S).astype(np.int64), buckets - 1)
    tokens = np.bincount(index, weights=emitted, minlength=buckets)[:buckets]
    points = []
    for i in range(buckets):
        start = i * TIMELINE_BUCKET_S
        width = min(TIMELINE_BUCKET_S, duration_s - start)
        points.append([start, float(tokens[i]) / width if width > 0 else 0.0])
    return points
