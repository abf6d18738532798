"""Measure a GPU's step latencies as the twin's `[cost] table` CSV, in plain PyTorch.

    python -m bench.gpu_latency --out gpu.csv                 # on a CUDA GPU, Llama-3.1-8B shape
    python -m bench.gpu_latency --tiny --device cpu --out t.csv  # a smoke run anywhere

A Llama-3.1-8B-shaped decoder (32 layers, hidden 4096, 32 query / 8 KV heads, MLP 14336)
with random bf16 weights, timed on prefill-free decode steps: `batched_tokens` query tokens
from `batched_tokens / (k + 1)` requests over `kv_tokens` of context, at vLLM's CUDA-graph
capture sizes (each size captured as a graph, as vLLM runs it) and eagerly past the largest.
The drafter is an EAGLE-sized one-layer decoder: a step that proposes k drafts adds k of its
passes at the padded request count. A step is then

    latency(batched, kv, k) = verify(batched, kv) + k * draft_pass(pad(requests))

(the verify's attention is timed at one query position per request, which makes the verify
independent of k: a simplification the CSV inherits). Every layer attends to one shared KV
buffer, so the grid's largest context costs one layer's cache, not 32. Writes the CSV that
`twin.latency_table` reads, and prints a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from twin.gpu_shapes import CAPTURE_SIZES, padded
from twin.latency_table import LatencyTable, write_latency_table


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 14336

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA_8B = Shape()
TINY = Shape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256)
EAGER_POINTS = (640, 768, 1024, 1536, 2048)
CONTEXTS = (0, 16384, 65536, 262144)
REPEATS = 10


class Decoder:
    """`layers` Llama layers with random weights; `forward(tokens, kv)` runs one step."""

    def __init__(self, shape: Shape, layers: int, device: str, dtype: torch.dtype,
                 max_context: int) -> None:
        g = torch.Generator(device="cpu").manual_seed(0)

        def weight(*size: int) -> torch.Tensor:
            return (torch.randn(*size, generator=g) * 0.02).to(device=device, dtype=dtype)

        d, kvd = shape.hidden, shape.kv_heads * shape.head_dim
        self.shape, self.layers = shape, layers
        self.qkv = [weight(d, d + 2 * kvd) for _ in range(layers)]
        self.out = [weight(d, d) for _ in range(layers)]
        self.up = [weight(d, 2 * shape.intermediate) for _ in range(layers)]
        self.down = [weight(shape.intermediate, d) for _ in range(layers)]
        self.cache = torch.zeros(2, max(max_context, 1), shape.kv_heads, shape.head_dim,
                                 device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, requests: int, context: int) -> torch.Tensor:
        s = self.shape
        per_request = max(context // max(requests, 1), 1)
        keys = self.cache[0, :requests * per_request].view(requests, per_request, s.kv_heads,
                                                             s.head_dim).transpose(1, 2)
        values = self.cache[1, :requests * per_request].view(requests, per_request,
                                                               s.kv_heads, s.head_dim
                                                               ).transpose(1, 2)
        tokens = x.shape[0]
        for layer in range(self.layers):
            h = F.rms_norm(x, (s.hidden,))
            q = (h @ self.qkv[layer])[:, :s.hidden]
            q = q[:requests].view(requests, 1, s.heads, s.head_dim).transpose(1, 2)
            attn = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
            attn = attn.transpose(1, 2).reshape(requests, s.hidden)
            x = x + F.pad(attn @ self.out[layer], (0, 0, 0, tokens - requests))
            gate, up = (F.rms_norm(x, (s.hidden,)) @ self.up[layer]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ self.down[layer]
        return x


def timed(run: Callable[[], object], device: str) -> float:
    """Median seconds of `run` over `REPEATS` calls, after a warm-up."""
    run()
    samples = []
    for _ in range(REPEATS):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def step_time(model: Decoder, tokens: int, requests: int, context: int, device: str,
              graph: bool) -> float:
    x = torch.randn(tokens, model.shape.hidden, device=device, dtype=model.cache.dtype)
    if not graph:
        return timed(lambda: model.forward(x, requests, context), device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model.forward(x, requests, context)  # warm-up on a side stream, as capture needs
    torch.cuda.current_stream().wait_stream(stream)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        model.forward(x, requests, context)
    return timed(cuda_graph.replay, device)


def measure(shape: Shape, *, device: str, max_k: int, max_tokens: int,
            contexts: tuple[int, ...]) -> LatencyTable:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    graph = device == "cuda"
    target = Decoder(shape, shape.layers, device, dtype, max(contexts))
    drafter = Decoder(shape, 1, device, dtype, max(contexts))
    batched = tuple(b for b in (*CAPTURE_SIZES, *EAGER_POINTS) if b <= max_tokens)
    verify = {(b, c): step_time(target, b, b, c, device, graph and b <= CAPTURE_SIZES[-1])
              for b in batched for c in contexts}
    passes: dict[tuple[int, int], float] = {}
    planes = []
    for k in range(max_k + 1):
        plane = []
        for b in batched:
            row = []
            for c in contexts:
                draft = 0.0
                if k:
                    requests = padded(math.ceil(b / (k + 1)))
                    if (requests, c) not in passes:
                        passes[(requests, c)] = step_time(drafter, requests, requests, c,
                                                          device, graph)
                    draft = k * passes[(requests, c)]
                row.append(verify[(b, c)] + draft)
            plane.append(tuple(row))
        planes.append(tuple(plane))
    return LatencyTable(batched=batched, kv=contexts, ks=tuple(range(max_k + 1)),
                        latency_s=tuple(planes), source=f"gpu_latency:{device}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the CSV to write")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true",
                        help="a two-layer toy shape (a smoke run on any machine)")
    parser.add_argument("--max-k", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=2048,
                        help="largest batched-token point (default 2048)")
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS),
                        help="kv_tokens points (default %(default)s)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    table = measure(TINY if args.tiny else LLAMA_8B, device=args.device, max_k=args.max_k,
                    max_tokens=args.max_tokens, contexts=tuple(sorted(set(args.contexts))))
    write_latency_table(table, args.out)
    print(json.dumps({"benchmark": "gpu_latency", "out": args.out, "device": args.device,
                      "device_name": (torch.cuda.get_device_name() if args.device == "cuda"
                                      else "cpu"),
                      "points": len(table.batched) * len(table.kv) * len(table.ks),
                      "verify_ms_at_1": round(table.latency_s[0][0][0] * 1e3, 3),
                      "wall_s": round(time.monotonic() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
