"""The fitter on GPU-shaped latency: profiled tables hold on staircases, plateaus and jumps.

The ground truth is not the fitter's own family (an intercept plus hinges in batched tokens):
the twin replays a latency grid (`twin.gpu_shapes`: CUDA-graph padding, a flat floor
to 1,024 tokens, an eager jump past 512, a drafter that grows with the padded batch). The
profile sees only the twin's step records; its table is scored per batch size against the
grid itself: decode goodput B * AL(K) / T(B (K + 1), context, K) at the table's K over the
best K's.
"""

from __future__ import annotations

import pytest

from tabletune.profile import profile
from twin import PhaseConfig, Scenario
from twin.config import CostConfig, DrafterConfig, EngineConfig
from twin.gpu_shapes import SHAPES, gpu_shaped_table, step_latency_s
from twin.latency_table import write_latency_table

ACCEPTANCE = {"eagle": (0.69, 0.66, 0.69, 0.73, 0.76, 0.78, 0.80),  # ShareGPT (docs/TWIN.md)
              "ngram": (0.65, 0.93, 0.94, 0.95, 0.95)}  # InstructCoder: n-gram that pays
PROMPT, OUTPUT = 355, 728
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_K = 7
TARGET = 0.98


def mean_tokens_per_step(method: str, k: int) -> float:
    """AL(K) of the parametric pool: 1 + the expected leading accepted drafts."""
    rates = ACCEPTANCE[method]
    total, chain = 1.0, 1.0
    for position in range(k):
        chain *= rates[min(position, len(rates) - 1)]
        total += chain
    return total


@pytest.mark.parametrize("method", ["eagle", "ngram"])
@pytest.mark.parametrize("shape", SHAPES)
def test_profiled_table_holds_on_a_gpu_shaped_latency_grid(tmp_path, shape, method):
    path = tmp_path / f"{shape}-{method}.csv"
    write_latency_table(gpu_shaped_table(shape, method, max_k=MAX_K), path)
    scenario = Scenario(
        seed=11, engine=EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192,
                                     max_k=MAX_K),
        cost=CostConfig(table=str(path)), drafter=DrafterConfig(method=method),
        phases=(PhaseConfig(duration_s=60, concurrency=1, acceptance=ACCEPTANCE[method],
                            prompt_len=PROMPT, output_len=OUTPUT),))
    table = profile(scenario).envelope.table
    context = PROMPT + OUTPUT / 2  # a request's mean context over its life
    ratios = {}
    for b in BATCH_SIZES:
        goodput = {k: b * mean_tokens_per_step(method, k)
                   / step_latency_s(shape, method, b * (k + 1), int(b * context), k)
                   for k in range(MAX_K + 1)}
        ratios[b] = goodput[table.k_for(b)] / max(goodput.values())
    assert min(ratios.values()) >= TARGET, (table.to_vllm(), ratios)
