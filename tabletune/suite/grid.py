"""What the suite runs: load grids (trace x drafter x arrivals) and drift scenarios, x policies.

A *grid* is one workload (a SpecDecode-Bench trace under one drafter) at several loads, all
closed loop (a concurrency) or all open loop (a Poisson rate). Every load is a two-phase
scenario: `warmup` then `measure`, identical traffic, so that the summary's per-phase
metrics give the measured window directly and adaptive policies (TableTune profiles for its
first ~30 virtual seconds) are scored after they settle. Each load has its own seed, shared
by every policy (side by side). Without the shared traces, phases fall back to the
parametric acceptance profiles of docs/TWIN.md, acceptance (the twin logs it).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path

from twin import BUILTIN_SCENARIOS
from twin.config import CostConfig, DrafterConfig, EngineConfig, PhaseConfig, Scenario
from twin.static import ngram_match_prob_for

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = REPO.parent / "shared" / "data" / "specdecode-bench"
MAX_K = 7
BASELINES = ("vllm-doc", "dsd-goodput", "ema-adaptive")
ADAPTIVE = (*BASELINES, "tabletune")
LOOKUP = "ngram-lookup"
"""n-gram drafted for real by vLLM's prompt lookup on the traces' tokens (`ngram` reads the
traces' recorded acceptance): match lengths exist, so TableTune runs per-request budgets."""
LOOKUP_RANGE = (1, 4)
"""Budgets pay where the lookup keeps short matches (docs/MODEL.md); vLLM's default 5..5
has one match length and nothing to key on."""
TABLE_ALONE = "tabletune:budgets=0"
"""TableTune's table without budgets, beside `tabletune` on the lookup grids."""

FALLBACK = {  # docs/TWIN.md, acceptance: conditional rate per position; prompt/output means
    ("sharegpt", "eagle"): (0.69, 0.66, 0.69, 0.73, 0.76),
    ("sharegpt", "ngram"): (0.35, 0.84, 0.87, 0.90, 0.91),
    ("instructcoder", "eagle"): (0.72, 0.73, 0.75, 0.78, 0.80),
    ("instructcoder", "ngram"): (0.65, 0.93, 0.94, 0.95, 0.95),
    ("gsm8k", "eagle"): (0.72, 0.67, 0.65, 0.65, 0.65),
    ("gsm8k", "ngram"): (0.16, 0.61, 0.65, 0.68, 0.71),
}
LENGTHS = {"sharegpt": (355.0, 728.0), "instructcoder": (171.0, 262.0), "gsm8k": (94.0, 166.0)}


def fixed_policies(max_k: int = MAX_K) -> tuple[str, ...]:
    return tuple(f"fixed:{k}" for k in range(max_k + 1))


@dataclass(frozen=True)
class SuiteSpec:
    """One suite size. Durations are virtual seconds."""

    name: str
    traces: tuple[str, ...] = ("sharegpt", "instructcoder", "gsm8k")
    methods: tuple[str, ...] = ("eagle", "ngram", LOOKUP)
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    """Closed-loop loads (one grid per trace x drafter); empty: no closed-loop grids."""
    rates_tok_s: tuple[float, ...] = (1000.0, 3000.0, 6000.0)
    """Open-loop loads as offered output tokens/s; rate = this / the trace's mean output
    length, so one label means a comparable load on every trace. Empty: no open-loop grids."""
    warmup_s: float = 60.0
    measure_s: float = 180.0
    policies: tuple[str, ...] = ADAPTIVE
    """Policies besides fixed K 0..max_k (always run: they define the oracle)."""
    drift: tuple[str, ...] = ("chat-code-chat-ngram", "eagle-concurrency-jump",
                              "context-growth")
    """Drift scenario files (stems, in twin/scenarios, or paths)."""
    settle_s: float = 120.0
    """Drift: each new phase is measured after this long (the controller's time to react)."""
    profile_budget_s: float = 120.0
    """Drift: engine seconds for profiling the pre-drift phase (the stale table)."""
    max_k: int = MAX_K
    seed: int = 7
    data_dir: Path = field(default=DATA_DIR)


QUICK = SuiteSpec(name="quick", traces=("sharegpt",), concurrencies=(1, 8, 64, 256),
                  rates_tok_s=(2000.0, 6000.0), warmup_s=45.0, measure_s=60.0)
FULL = SuiteSpec(name="full", warmup_s=60.0, measure_s=180.0)
SUITES = {"quick": QUICK, "full": FULL}


@dataclass(frozen=True)
class Case:
    """One load of one grid: a scenario every policy runs."""

    grid: str
    """`sharegpt-eagle/closed`, `gsm8k-ngram/open`, ..."""
    label: str
    """`c=64` (closed loop) or `6000 tok/s` (open loop)."""
    load: float
    scenario: Scenario
    extra_policies: tuple[str, ...] = ()
    """Run beside the suite's policies at this load (TableTune's table alone on lookup)."""

    @property
    def closed(self) -> bool:
        return self.grid.endswith("/closed")


def grid_cases(spec: SuiteSpec) -> list[Case]:
    cases = []
    for trace in spec.traces:
        for method in spec.methods:
            name = f"{trace}-{method}"
            extra = (TABLE_ALONE,) if method == LOOKUP and "tabletune" in spec.policies else ()
            for c in spec.concurrencies:
                cases.append(Case(f"{name}/closed", f"c={c}", float(c),
                                  load_scenario_for(spec, trace, method, concurrency=c), extra))
            for tok_s in spec.rates_tok_s:
                rate = tok_s / LENGTHS[trace][1]
                cases.append(Case(f"{name}/open", f"{tok_s:g} tok/s", tok_s,
                                  load_scenario_for(spec, trace, method, rate_rps=rate), extra))
    return cases


def load_scenario_for(spec: SuiteSpec, trace: str, method: str, *,
                      concurrency: int | None = None,
                      rate_rps: float | None = None) -> Scenario:
    """Warm-up then measured phase of one trace x drafter at one load."""
    path = Path(spec.data_dir) / f"{trace}.jsonl"
    prompt_len, output_len = LENGTHS[trace]
    load = f"c{concurrency}" if concurrency is not None else f"r{rate_rps:.3g}"
    name = f"{trace}-{method}-{load}"

    drafter = "ngram" if method == LOOKUP else method

    def phase(label: str, duration_s: float) -> PhaseConfig:
        return PhaseConfig(name=label, duration_s=duration_s, concurrency=concurrency,
                           rate_rps=rate_rps, trace=str(path),
                           acceptance=FALLBACK[(trace, drafter)], prompt_len=prompt_len,
                           output_len=output_len)

    lookup = LOOKUP_RANGE if method == LOOKUP else (None, None)

    return Scenario(
        seed=spec.seed + zlib.crc32(name.encode()) % 100_000, name=name,
        engine=EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_k=spec.max_k),
        cost=CostConfig(profile="h100-llama3.1-8b"),
        drafter=DrafterConfig(method=drafter, ngram_match_prob=ngram_match_prob_for(path)
                              if drafter == "ngram" else 1.0, prompt_lookup_min=lookup[0],
                              prompt_lookup_max=lookup[1]),
        phases=(phase("warmup", spec.warmup_s), phase("measure", spec.measure_s)))


def drift_path(name: str) -> Path:
    path = Path(name)
    if path.suffix == ".toml" and path.exists():
        return path
    return BUILTIN_SCENARIOS / f"{path.stem}.toml"


def traces_found(spec: SuiteSpec) -> dict[str, bool]:
    return {trace: (Path(spec.data_dir) / f"{trace}.jsonl").is_file() for trace in spec.traces}


def drift_scenario(path: Path) -> Scenario:
    from twin.scenario_file import load_scenario

    return load_scenario(path)
