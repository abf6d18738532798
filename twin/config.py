"""What a twin run simulates: engine limits, cost model, drafter and the phases of traffic.

Plain frozen dataclasses, one per scenario section. Every field has a default; checks that
involve one field or several run in `__post_init__` and raise `ScenarioError` naming the field,
so that the TOML loader only has to prefix the section path (`phases[1].concurrency: ...`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.bounds import Bound, at_least, in_range, positive
from schemas.draft_budget import MAX_MATCH_LENGTHS

DRAFT_METHODS = ("eagle", "ngram", "draft_model")
MAX_LOOKUP_N = MAX_MATCH_LENGTHS
"""Longest n-gram prompt lookup may match: a budget keys on at most this many lengths."""


class ScenarioError(ValueError):
    """An invalid scenario; the message starts with the field path, then the reason."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}" if path else reason)
        self.path = path
        self.reason = reason

    def under(self, prefix: str) -> ScenarioError:
        """The same error with its path nested under `prefix` (a section or list item)."""
        if not self.path:
            return ScenarioError(prefix, self.reason)
        joiner = "" if self.path.startswith("[") else "."
        return ScenarioError(f"{prefix}{joiner}{self.path}", self.reason)


_FRACTION = Bound("between 0 and 1", in_range(0.0, 1.0).refuses)


def _within(name: str, value: float, bound: Bound) -> None:
    if bound.refuses(value):
        raise ScenarioError(name, f"must be {bound.text}, got {value}")


def _at_least(name: str, value: float, minimum: float) -> None:
    _within(name, value, at_least(minimum))


def _positive(name: str, value: float) -> None:
    _within(name, value, positive())


def _fraction(name: str, value: float) -> None:
    _within(name, value, _FRACTION)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_num_seqs: int = 256
    """vLLM's `max_num_seqs`: most requests in one step, and the table's max batch size."""
    max_num_batched_tokens: int = 8192
    """Token budget of one step (decode tokens incl. drafts, plus prefill chunks)."""
    max_k: int = 7
    """Startup `num_speculative_tokens`: no table may use a larger K."""
    engine_id: str = "twin"
    """Stamped on every telemetry record; keep it unique per concurrent run."""
    model: str = "llama-3.1-8b-instruct"
    hardware: str = "twin-h100"

    def __post_init__(self) -> None:
        _at_least("max_num_seqs", self.max_num_seqs, 1)
        _at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _at_least("max_k", self.max_k, 0)
        if self.max_num_batched_tokens < self.max_num_seqs * (self.max_k + 1):
            raise ScenarioError(
                "max_num_batched_tokens",
                f"{self.max_num_batched_tokens} cannot hold max_num_seqs={self.max_num_seqs} "
                f"decodes with max_k={self.max_k} drafts each "
                f"(needs >= {self.max_num_seqs * (self.max_k + 1)})",
            )
        for name in ("engine_id", "model", "hardware"):
            if not getattr(self, name) or "|" in getattr(self, name):
                raise ScenarioError(name, f"must be non-empty without '|', "
                                          f"got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class CostConfig:
    """Step latency model in seconds; explicit coefficients override the named profile's, and
    a measured table replaces them all."""

    profile: str = "h100-llama3.1-8b"
    """A built-in profile (see `cost.PROFILES`), or "none" to give every coefficient."""
    target_kv: float | None = None
    """Seconds per KV-cache token of the scheduled requests (attention)."""
    target_batched: float | None = None
    """Seconds per verified token (past `knee_tokens` when that is set)."""
    target_fixed: float | None = None
    draft_kv: float | None = None
    draft_per_token: float | None = None
    """Seconds per proposed position, counted as K + 1 (SpecDecode-Bench's fit)."""
    draft_fixed: float | None = None
    ngram_fraction: float | None = None
    """n-gram proposal time as a fraction of the step's verify time."""
    step_overhead: float | None = None
    """Scheduler and sampling time per step, independent of the batch."""
    knee_tokens: int = 0
    """> 0: verify time is flat in batched tokens up to this many (memory-bound), then linear."""
    noise: float = 0.03
    """Relative standard deviation of step latency (Gaussian, per step, clipped positive)."""
    table: str | None = None
    """A measured latency grid (CSV: batched_tokens,kv_tokens,k,latency_s; absolute, or
    relative to the scenario file) in place of the coefficients (`latency_table`)."""

    def __post_init__(self) -> None:
        _at_least("knee_tokens", self.knee_tokens, 0)
        if self.table is not None:
            given = [name for name in COST_COEFFICIENTS if getattr(self, name) is not None]
            if given or self.knee_tokens:
                raise ScenarioError("table", "replaces the coefficients: remove "
                                             f"{(given or ['knee_tokens'])[0]} or the table")
            if not self.table:
                raise ScenarioError("table", "must name a CSV file")
        _at_least("noise", self.noise, 0.0)
        if self.noise > 0.5:
            raise ScenarioError("noise", f"must be <= 0.5 (relative), got {self.noise}")
        for name in COST_COEFFICIENTS:
            value = getattr(self, name)
            if value is not None:
                _at_least(name, value, 0.0)


COST_COEFFICIENTS = ("target_kv", "target_batched", "target_fixed", "draft_kv",
                     "draft_per_token", "draft_fixed", "ngram_fraction", "step_overhead")


@dataclass(frozen=True, slots=True)
class DrafterConfig:
    method: str = "eagle"
    """eagle | ngram | draft_model (draft_model reads the trace's EAGLE acceptance)."""
    ngram_match_prob: float = 1.0
    """n-gram only: chance of a match where the trace says nothing would be accepted;
    without a match a request proposes no drafts for its next step (SpecDecode-Bench)."""
    prompt_lookup_max: int | None = None
    """n-gram on traces: draft for real, running vLLM's prompt lookup on each request's
    token ids with n-grams of up to this many tokens (`ngram_match_prob` is then moot).
    Unset: read the trace's recorded acceptance (SpecDecode-Bench drafted with 3..7)."""
    prompt_lookup_min: int | None = None
    """The shortest n-gram prompt lookup matches (unset: `prompt_lookup_max`, as in vLLM)."""

    def __post_init__(self) -> None:
        if self.method not in DRAFT_METHODS:
            raise ScenarioError("method", f"must be one of {', '.join(DRAFT_METHODS)}, "
                                          f"got {self.method!r}")
        _fraction("ngram_match_prob", self.ngram_match_prob)
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= MAX_LOOKUP_N:
                raise ScenarioError(name, f"must be within 1..{MAX_LOOKUP_N}, got {value}")
        if self.prompt_lookup_min is not None and self.prompt_lookup_max is None:
            raise ScenarioError("prompt_lookup_min", "needs prompt_lookup_max (it turns "
                                                     "prompt lookup on)")
        if self.prompt_lookup is not None and self.prompt_lookup[0] > self.prompt_lookup[1]:
            raise ScenarioError("prompt_lookup_min", f"must be <= prompt_lookup_max="
                                                     f"{self.prompt_lookup_max}, got "
                                                     f"{self.prompt_lookup_min}")

    @property
    def prompt_lookup(self) -> tuple[int, int] | None:
        """(min_n, max_n) when n-gram drafts are looked up for real, else None."""
        if self.method != "ngram" or self.prompt_lookup_max is None:
            return None
        return (self.prompt_lookup_min or self.prompt_lookup_max, self.prompt_lookup_max)


@dataclass(frozen=True, slots=True)
class PhaseConfig:
    """A stretch of traffic; a change of phase is how drift is modelled."""

    duration_s: float = 60.0
    concurrency: int | None = None
    """Closed loop: requests kept in the system (a finished one is replaced at once)."""
    rate_rps: float | None = None
    """Open loop: Poisson arrivals at this mean rate."""
    max_concurrency: int | None = None
    """With `rate_rps`: arrivals wait at the client while this many requests are in the
    system, as vLLM's `bench serve --request-rate R --max-concurrency C` holds them."""
    trace: str | None = None
    """SpecDecode-Bench JSONL (absolute, or relative to the scenario file)."""
    acceptance: tuple[float, ...] | None = None
    """Conditional acceptance per draft position; the last value repeats for later positions.
    Used when there is no trace, or when the trace file is missing."""
    prompt_len: float = 355.0
    """Mean prompt tokens of parametric requests."""
    output_len: float = 728.0
    """Mean generated tokens of parametric requests."""
    prompt_scale: float = 1.0
    """Multiplies prompt lengths (context-length drift)."""
    length_range: float | None = None
    """Parametric requests: prompt and output lengths uniform within this fraction of their
    means (vLLM's random dataset, `--random-range-ratio`) instead of Gamma(shape 2)."""
    name: str = ""

    def __post_init__(self) -> None:
        _positive("duration_s", self.duration_s)
        if (self.concurrency is None) == (self.rate_rps is None):
            raise ScenarioError("concurrency", "give exactly one of concurrency (closed loop) "
                                               f"or rate_rps (open loop), got concurrency="
                                               f"{self.concurrency} and rate_rps={self.rate_rps}")
        if self.concurrency is not None:
            _at_least("concurrency", self.concurrency, 1)
        if self.rate_rps is not None:
            _positive("rate_rps", self.rate_rps)
        if self.max_concurrency is not None:
            if self.rate_rps is None:
                raise ScenarioError("max_concurrency", "caps open-loop arrivals: give it "
                                                       "with rate_rps")
            _at_least("max_concurrency", self.max_concurrency, 1)
        if self.length_range is not None and not 0.0 <= self.length_range < 1.0:
            raise ScenarioError("length_range", f"must be >= 0 and < 1, got "
                                                f"{self.length_range}")
        if self.trace is None and self.acceptance is None:
            raise ScenarioError("trace", "give a trace file or an acceptance profile")
        if self.acceptance is not None:
            if not self.acceptance:
                raise ScenarioError("acceptance", "must list at least one rate")
            for index, rate in enumerate(self.acceptance):
                _fraction(f"acceptance[{index}]", rate)
        _at_least("prompt_len", self.prompt_len, 1.0)
        _at_least("output_len", self.output_len, 1.0)
        _positive("prompt_scale", self.prompt_scale)


@dataclass(frozen=True, slots=True)
class Scenario:
    seed: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    phases: tuple[PhaseConfig, ...] = ()
    name: str = "scenario"

    def __post_init__(self) -> None:
        if not self.phases:
            raise ScenarioError("phases", "at least one [[phases]] entry is required")

    @property
    def duration_s(self) -> float:
        return sum(phase.duration_s for phase in self.phases)
