"""The demo's plots draw their data: checked on the matplotlib objects, then the PNG."""

from __future__ import annotations

from collections.abc import Iterator

import matplotlib.image as mpimg
import numpy as np
import pytest
from matplotlib.figure import Figure

from tabletune import plots

SURFACE = {"batch_sizes": [1, 8, 64, 256], "k_values": [0, 1, 2, 3],
           "goodput_tok_s": [[10, 15, 18, 17], [80, 100, 105, 100],
                             [500, 560, 540, 500], [1500, 1450, 1300, 1100]]}
TABLE = [[1, 1, 2], [2, 64, 2], [65, 256, 0]]
"""K 2 up to B 64, then 0."""


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Figure]]:
    """Each figure a plot function closes after saving, kept open for inspection."""
    kept: list[Figure] = []
    close = plots.plt.close
    monkeypatch.setattr(plots.plt, "close", kept.append)
    yield kept
    for figure in kept:
        close(figure)


def _is_png(path) -> bool:
    image = mpimg.imread(path)
    return image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 400


def _lines(ax) -> dict[str, tuple[list[float], list[float]]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
            for line in ax.get_lines()}


def test_surface_heatmap_shows_goodput_per_batch_size_and_the_chosen_k(tmp_path, figures):
    assert _is_png(plots.surface_heatmap(SURFACE, TABLE, "surface", tmp_path / "s.png"))
    [figure] = figures
    ax = figure.axes[0]
    goodput = np.array(SURFACE["goodput_tok_s"], dtype=float)
    shown = np.asarray(ax.images[0].get_array())
    assert shown.shape == (4, 4)  # K rows, B columns
    np.testing.assert_allclose(shown.T * goodput.max(axis=1, keepdims=True), goodput)
    lines = _lines(ax)
    assert lines["chosen K"][1] == [2, 2, 2, 0]  # the table at B 1, 8, 64, 256
    assert lines["argmax of the fit"][1] == [2, 2, 1, 0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "8", "64", "256"]
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == (
        "batch size B", "draft length K", "surface")


def test_table_steps_draw_each_table_against_the_measured_best_k(tmp_path, figures):
    best = {"chat": {1: 2, 64: 2, 256: 0}}
    assert _is_png(plots.table_steps({"fitted": TABLE}, best, 256, "table", tmp_path / "t.png"))
    [figure] = figures
    ax = figure.axes[0]
    lines = _lines(ax)
    batch, k = lines["fitted"]
    assert batch == list(range(1, 257))
    assert k == [2] * 64 + [0] * 192
    assert lines["best fixed K, chat (measured)"] == ([1, 64, 256], [2, 2, 0])
    assert ax.get_xscale() == "log" and ax.get_title() == "table"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "fitted", "best fixed K, chat (measured)"]


def test_throughput_timeline_plots_each_policy_and_marks_the_events(tmp_path, figures):
    series = {"tabletune": [[0, 5.0], [10, 6.0]], "fixed:3": [[0, 4.0], [10, 4.5]]}
    path = plots.throughput_timeline(series, [(5.0, "drift")], "timeline", tmp_path / "l.png")
    assert _is_png(path)
    [figure] = figures
    ax = figure.axes[0]
    lines = _lines(ax)
    assert lines["tabletune"] == ([0, 10], [5.0, 6.0])
    assert lines["fixed:3"] == ([0, 10], [4.0, 4.5])
    events = [line for line in ax.get_lines() if line.get_label() not in series]
    assert [list(line.get_xdata()) for line in events] == [[5.0, 5.0]]
    assert [t.get_text() for t in ax.texts] == ["drift"]
    assert ax.get_ylabel() == "output tokens / s"


def test_k_for_reads_the_table_like_vllm():
    assert plots._k_for(TABLE, 64) == 2 and plots._k_for(TABLE, 65) == 0
