"""GPU-shaped latency tables: step latencies shaped like a CUDA-graph engine's, for what-ifs.

The twin's coefficient model is linear in batched tokens; a GPU is not (docs/TWIN.md, "Replaying
your GPU's latencies"). These four shapes keep the H100 / Llama-3.1-8B profile's magnitudes
(`cost.PROFILES`) and change the shape, one feature each, so that a fitter or a policy can be
tested on what it will meet on a GPU:

- `staircase`: the batch is padded to vLLM's next CUDA-graph capture size (1, 2, 4, then every
  8 up to 512): latency is flat between capture sizes and steps up at each;
- `plateau`: memory-bound, flat up to 1,024 padded tokens, then linear;
- `eager-jump`: past the largest capture size (512) the step runs eager: 3 ms more, and 30 %
  steeper;
- `drafter-growth`: the drafter's cost grows with the padded batch of requests (EAGLE: K passes,
  each a forward of the drafter at the padded request count; n-gram: CPU matching per request).
"""

from __future__ import annotations

import math

from twin.cost import PROFILES
from twin.latency_table import LatencyTable

SHAPES = ("staircase", "plateau", "eager-jump", "drafter-growth")
CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, *range(8, 513, 8))
"""vLLM's default CUDA-graph capture sizes (V1, `max_capture_size` 512)."""
EAGER_STEP = 32
"""Grid spacing past the largest capture size, where steps are not padded."""
CONTEXT_POINTS: tuple[int, ...] = (0, 8192, 32768, 131072, 524288, 2097152)
"""KV tokens of the batch: attention is linear in them, so a few points suffice."""
PLATEAU_TOKENS = 1024
EAGER_JUMP_S = 3e-3
EAGER_SLOPE = 1.3
DRAFTER_PASS_S = 3.5e-4
"""EAGLE drafter-growth: one drafter pass at a one-request batch (a one-layer forward)."""
DRAFTER_PER_REQUEST_S = 6e-6
"""... and per padded request (256 requests: +1.5 ms per pass)."""
NGRAM_PER_REQUEST_S = 1.5e-5
"""n-gram drafter-growth: CPU matching per request and step (256 requests: +3.8 ms)."""


def padded(tokens: int) -> int:
    """The batch a CUDA-graph step runs: the next capture size up, or itself past them."""
    if tokens > CAPTURE_SIZES[-1]:
        return tokens
    low, high = 0, len(CAPTURE_SIZES) - 1
    while low < high:
        middle = (low + high) // 2
        if CAPTURE_SIZES[middle] < tokens:
            low = middle + 1
        else:
            high = middle
    return CAPTURE_SIZES[low]


def batched_points(max_batched_tokens: int) -> tuple[int, ...]:
    """Capture sizes, then every `EAGER_STEP` tokens up to `max_batched_tokens`."""
    eager = range(CAPTURE_SIZES[-1] + EAGER_STEP, max_batched_tokens + EAGER_STEP, EAGER_STEP)
    return (*CAPTURE_SIZES, *eager)


def step_latency_s(shape: str, method: str, batched: int, kv: int, k: int) -> float:
    """One step of `shape` with drafter `method` (eagle, draft_model or ngram), noise-free."""
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r}: one of {', '.join(SHAPES)}")
    c = PROFILES["h100-llama3.1-8b"]
    tokens = padded(batched)
    verify = c["target_fixed"] + c["target_kv"] * kv
    if shape == "plateau":
        verify += c["target_batched"] * max(0, tokens - PLATEAU_TOKENS)
    elif shape == "eager-jump" and tokens > CAPTURE_SIZES[-1]:
        verify += (EAGER_JUMP_S + c["target_batched"] * CAPTURE_SIZES[-1]
                   + EAGER_SLOPE * c["target_batched"] * (tokens - CAPTURE_SIZES[-1]))
    else:
        verify += c["target_batched"] * tokens
    draft = 0.0
    if k > 0:
        requests = max(1, math.ceil(batched / (k + 1)))
        if method == "ngram":
            draft = c["ngram_fraction"] * verify
            if shape == "drafter-growth":
                draft += NGRAM_PER_REQUEST_S * requests
        elif shape == "drafter-growth":
            draft = k * (DRAFTER_PASS_S + DRAFTER_PER_REQUEST_S * padded(requests))
        else:
            draft = c["draft_kv"] * kv + c["draft_per_token"] * (k + 1) + c["draft_fixed"]
    return verify + draft + c["step_overhead"]


def gpu_shaped_table(shape: str, method: str, *, max_k: int = 7,
                     max_batched_tokens: int = 8192) -> LatencyTable:
    """The grid of `shape` at the capture sizes, the eager points and `CONTEXT_POINTS`."""
    batched = batched_points(max_batched_tokens)
    planes = tuple(
        tuple(tuple(step_latency_s(shape, method, b, kv, k) for kv in CONTEXT_POINTS)
              for b in batched)
        for k in range(max_k + 1))
    return LatencyTable(batched=batched, kv=CONTEXT_POINTS, ks=tuple(range(max_k + 1)),
                        latency_s=planes, source=f"gpu-shaped:{shape}:{method}")
