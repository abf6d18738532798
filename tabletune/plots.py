"""PNG plots for the demo report: the fitted surface, the table, throughput across drift."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from schemas import DraftTable


def surface_heatmap(surface: Mapping[str, Any], table: Sequence[Sequence[int]], title: str,
                    path: Path) -> Path:
    """Predicted goodput per (B, K), normalised per batch size, with the chosen K marked."""
    batch = np.array(surface["batch_sizes"])
    k_values = np.array(surface["k_values"])
    goodput = np.array(surface["goodput_tok_s"], dtype=float)
    relative = goodput / goodput.max(axis=1, keepdims=True)
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=110)
    image = ax.imshow(relative.T, aspect="auto", origin="lower", cmap="viridis",
                      vmin=max(0.5, float(relative.min())), vmax=1.0,
                      extent=(-0.5, len(batch) - 0.5, k_values[0] - 0.5, k_values[-1] + 0.5))
    chosen = [_k_for(table, int(b)) for b in batch]
    ax.plot(range(len(batch)), chosen, "w-", lw=2, drawstyle="steps-mid", label="chosen K")
    ax.plot(range(len(batch)), k_values[np.argmax(goodput, axis=1)], "r.", ms=6,
            label="argmax of the fit")
    ticks = np.linspace(0, len(batch) - 1, min(9, len(batch))).astype(int)
    ax.set_xticks(ticks, [str(batch[i]) for i in ticks])
    ax.set_xlabel("batch size B")
    ax.set_ylabel("draft length K")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    fig.colorbar(image, ax=ax, label="goodput / best goodput at this B")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def table_steps(tables: Mapping[str, Sequence[Sequence[int]]],
                best_k_by_load: Mapping[str, Mapping[int, int]], max_batch: int, title: str,
                path: Path) -> Path:
    """Tables as step functions of B, against the best fixed K measured at each load
    (one series of points per traffic mix)."""
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    batch = np.arange(1, max_batch + 1)
    for (name, table), style in zip(tables.items(), ("-", "--", ":", "-."), strict=False):
        ax.step(batch, [_k_for(table, int(b)) for b in batch], style, where="post", lw=2,
                label=name)
    for (label, best), marker in zip(best_k_by_load.items(), ("o", "s", "^"), strict=False):
        loads = sorted(best)
        ax.plot(loads, [best[c] for c in loads], marker, color="black", mfc="none"
                if marker != "o" else "black", ms=7, label=f"best fixed K, {label} (measured)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B (log scale)")
    ax.set_ylabel("draft length K")
    return _finish(fig, ax, title, path)


def throughput_timeline(series: Mapping[str, Sequence[Sequence[float]]],
                        events: Sequence[tuple[float, str]], title: str, path: Path, *,
                        xlabel: str = "time (s, virtual)") -> Path:
    """Output tokens/s over (virtual) time per policy, with drift and swap events marked."""
    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=110)
    for name, points in series.items():
        if points:
            t, rate = zip(*points, strict=False)
            ax.plot(t, rate, lw=1.8, label=name)
    for at, label in events:
        ax.axvline(at, color="grey", ls="--", lw=1)
        ax.annotate(label, (at, ax.get_ylim()[1]), rotation=90, va="top", ha="right",
                    fontsize=8, color="grey")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("output tokens / s")
    return _finish(fig, ax, title, path)


def _finish(fig: Any, ax: Any, title: str, path: Path) -> Path:
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _k_for(table: Sequence[Sequence[int]], batch_size: int) -> int:
    return DraftTable.from_vllm([list(r) for r in table]).k_for(batch_size)
