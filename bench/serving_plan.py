"""What `bench.real_serving` runs: the phases of load, the arms, and their order.

A phase is one run of vLLM's client (`vllm bench serve`): random prompts, Poisson arrivals
at a rate above what the server can take, capped at a concurrency, so the server runs at
that concurrency and output throughput depends on the table. Every arm runs the same
requests: vLLM's random dataset draws every prompt's lengths in one batch from `--seed`,
so the prompt count decides which requests come, and each phase's count is set once, by
the probe of the first arm to run (a short client run before the phase), for the phase's length in
seconds (lead-in + measured window + drain) at `SIZE_MARGIN` times the probed speed. An arm
up to that much faster than the first still fills its window; a slower one runs longer on
the same work. The first arm should be a middle K: a probe at K0 (half the speed of K4 at
one in flight) leaves the fastest arms a short window, which the run reports as a problem.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

FIXED_K = (0, 1, 2, 3, 4)
SIZE_MARGIN = 1.25
"""Phases are sized for an arm this much faster than the probe's: K4 ran 1.17x K2 at one
request in flight, the widest gap next to a middle K on the 2-core pair."""
PROBE_MIN_PROMPTS = 6
"""One request alone read 25-40% under the speed of the phase it sized (its client's fixed
costs over one request's second at one in flight), which left every window short."""
SHORT_WINDOW = 0.75
"""A measured window under this share of `--measure-s` is reported: the arm outran the
sizing, and its score rests on fewer seconds than asked."""
VLLM_DOC_TABLE = [[1, 16, 5], [17, 32, 4], [33, 64, 3], [65, 128, 1], [129, 512, 0]]
"""vLLM's documented example table (EAGLE-3 on Llama-3.1-8B; twin's `vllm-doc`)."""


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    input_len: int
    output_len: int
    concurrency: int
    """`--max-concurrency`: requests in flight at most."""
    rate_rps: float
    """`--request-rate`, Poisson (burstiness 1); well above the server's capacity at this
    concurrency in the full phases, so the cap, not the arrivals, sets the load: near it,
    a lull in the arrivals lowers one arm's window and not another's."""
    expected_tok_s: float
    """Output tokens/s expected (sizing when nothing was probed: prompts = seconds x this /
    output_len)."""
    seed: int
    """The same prompts and arrivals in every arm."""

    def num_prompts(self, seconds: float, tok_s: float | None = None) -> int:
        """Prompts for `seconds` at `SIZE_MARGIN` x a probed `tok_s` output tokens/s, or at
        `expected_tok_s` (a phase paced by its arrivals)."""
        rate = self.expected_tok_s if tok_s is None else SIZE_MARGIN * tok_s
        # half a request more per slot: the drain runs below the steady rate
        return max(self.probe_prompts,
                   round(seconds * rate / self.output_len) + self.concurrency // 2)

    @property
    def probe_prompts(self) -> int:
        """A probe of the server's speed in this phase, and the least a phase runs: two
        requests per slot, at least `PROBE_MIN_PROMPTS`."""
        return max(2 * self.concurrency, PROBE_MIN_PROMPTS)

    def describe(self) -> str:
        return (f"{self.input_len} in / {self.output_len} out tokens, <= {self.concurrency} "
                f"in flight, Poisson {self.rate_rps:g} req/s")


def phase_seconds(lead_s: float, measure_s: float, speed: dict[str, float] | None) -> float:
    """How long a phase must run: its lead-in, its measured window, and its drain (a median
    request's latency, when fewer requests than the cap are left: not measured)."""
    return lead_s + measure_s + (speed["drain_s"] if speed else 0.0)


def speed_of(result: dict[str, Any]) -> dict[str, float]:
    """A phase's speed from vLLM's client result: output tokens/s and the drain."""
    return {"tok_s": float(result["output_throughput"]),
            "drain_s": float(result.get("median_e2el_ms") or 0.0) / 1000.0}


FULL_PHASES = (
    Phase("low", 64, 96, 2, 4.0, 30.0, 1),
    Phase("high", 64, 96, 16, 10.0, 80.0, 2),
    Phase("long", 256, 96, 6, 5.0, 50.0, 3),
)
"""Low load, short prompts (speculation pays); high load (it hurts); prompts 4x longer at a
moderate load. The rates are over twice what the self-speculative pair serves on 2 cores of
the faster host it has run on, so the queue at the client never empties and each arm's
window, wherever it falls, runs at the cap (the expected tokens/s only size a phase when it
was not probed). At 1.5 req/s, `low` on an AMD EPYC host, which served about 1.45 req/s
at two in flight, ran out of queued requests 65-85 s in: a lull the arms' windows caught
unequally."""

SWING_PHASES = (
    Phase("one", 64, 96, 1, 3.0, 20.0, 1),
    Phase("sixteen", 64, 96, 16, 10.0, 80.0, 2),
    Phase("one-again", 64, 96, 1, 3.0, 20.0, 3),
)
"""One request in flight, sixteen, then one again: a cold profile at one request sees no
other batch size, and the best K moves between the phases. The rates, as above, are over
twice what the server takes."""

PLANS = {"low-high-long": FULL_PHASES, "one-sixteen-one": SWING_PHASES}
"""The full run's phase plans, by name (`--plan`)."""

QUICK_PHASES = (Phase("mixed", 32, 64, 4, 4.0, 256.0, 1),)
"""Paced by its arrivals (4 req/s x 64 tokens, below the tiny model's capacity), so its
length holds on a faster or slower machine: the profile must end inside it."""


def client_argv(phase: Phase, *, prompts: int, base_url: str, model: str, tokenizer: str,
                result_dir: str, result_file: str | None, warmups: int) -> list[str]:
    """`vllm bench serve` arguments for one phase (no result file: not saved)."""
    saving = (["--save-result", "--result-dir", result_dir, "--result-filename", result_file]
              if result_file else [])
    return [
        "--backend", "vllm", "--base-url", base_url, "--model", model,
        "--tokenizer", tokenizer, "--dataset-name", "random",
        "--random-input-len", str(phase.input_len),
        "--random-output-len", str(phase.output_len), "--random-range-ratio", "0.25",
        "--num-prompts", str(prompts), "--request-rate", str(phase.rate_rps),
        "--max-concurrency", str(phase.concurrency), "--ignore-eos", "--temperature", "0",
        "--seed", str(phase.seed), "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        # the caller waited for /health; a warm-up request takes the first-request cost
        "--ready-check-timeout-sec", "0", "--num-warmups", str(warmups), *saving,
    ]


def arm_table(arm: str, max_num_seqs: int, max_k: int) -> list[list[int]] | None:
    """The table of an arm: forced on TableTune's hook (`fixed:K`, `static`), or the startup
    table of vLLM's stock scheduler (`stock:K`); None for `tabletune` (its tables come from
    the service)."""
    if arm == "tabletune":
        return None
    if arm == "static":
        return static_table(max_num_seqs, max_k)
    if arm.startswith(("fixed:", "stock:")):
        k = int(arm.split(":", 1)[1])
        if not 0 <= k <= max_k:
            raise ValueError(f"arm {arm!r}: K must be within 0..{max_k}")
        return [[1, max_num_seqs, k]]
    raise ValueError(f"unknown arm {arm!r} (fixed:K, stock:K, static, tabletune)")


def is_stock(arm: str) -> bool:
    """`stock:K`: vLLM's own scheduler, no TableTune hook, K set by its startup table."""
    return arm.startswith("stock:")


def static_table(max_num_seqs: int, max_k: int) -> list[list[int]]:
    """vLLM's documented table scaled to this engine: its batch axis (1..128, where K
    reaches 1) onto 1..max_num_seqs, its K clamped to max_k. Clamping alone would leave
    [[1, max_num_seqs, max_k]] on a 16-sequence engine, the same as `fixed:max_k`."""
    rows: list[list[int]] = []
    start = 1
    for _, end, k in VLLM_DOC_TABLE[:-1]:
        end = max(round(end * max_num_seqs / 128), start)
        k = min(k, max_k)
        if rows and rows[-1][2] == k:
            rows[-1][1] = end
        elif start <= end:
            rows.append([start, end, k])
        start = end + 1
    if start <= max_num_seqs:
        rows.append([start, max_num_seqs, 0])
    rows[-1][1] = max_num_seqs
    return rows


@dataclass(frozen=True, slots=True)
class Slot:
    """One arm's run with a fresh server."""

    repeat: int
    arm: str

    @property
    def slug(self) -> str:
        return f"{self.arm.replace(':', '')}-r{self.repeat}"


def schedule(arms: list[str], repeats: int, fixed_repeats: int) -> list[Slot]:
    """Every arm once per repeat, in the given order on odd repeats and reversed on even
    ones; `fixed:K` arms only in the first `fixed_repeats` repeats, spread evenly between
    the others rather than run in one block first: run first, they had the machine before
    it slowed (the later arms' steps ran ~10% slower at the same work)."""
    fixed: list[Slot] = []
    others: list[Slot] = []
    for repeat in range(1, repeats + 1):
        order = arms if repeat % 2 == 1 else list(reversed(arms))
        for arm in order:
            if not arm.startswith("fixed:"):
                others.append(Slot(repeat, arm))
            elif repeat <= fixed_repeats:
                fixed.append(Slot(repeat, arm))
    # each slot at the middle of its share of the run; a fixed arm first on a tie
    placed = [((i + 0.5) / len(fixed), 0, slot) for i, slot in enumerate(fixed)]
    placed += [((j + 0.5) / len(others), 1, slot) for j, slot in enumerate(others)]
    return [slot for _, _, slot in sorted(placed, key=lambda p: (p[0], p[1]))]


def plan_dict(phases: tuple[Phase, ...]) -> list[dict[str, Any]]:
    return [asdict(p) for p in phases]
