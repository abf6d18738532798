from __future__ import annotations

import matplotlib.image as mpimg

from tabletune import plots


def _is_png(path) -> bool:
    image = mpimg.imread(path)
    return image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 400


def test_plots_render(tmp_path):
    surface = {"batch_sizes": [1, 8, 64, 256], "k_values": [0, 1, 2, 3],
               "goodput_tok_s": [[10, 15, 18, 17], [80, 100, 105, 100],
                                 [500, 560, 540, 500], [1500, 1450, 1300, 1100]]}
    table = [[1, 1, 2], [2, 64, 2], [65, 256, 0]]
    assert _is_png(plots.surface_heatmap(surface, table, "surface", tmp_path / "s.png"))
    assert _is_png(plots.table_steps({"fitted": table}, {"chat": {1: 2, 64: 2, 256: 0}}, 256,
                                     "table", tmp_path / "t.png"))
    assert _is_png(plots.throughput_timeline({"tabletune": [[0, 5.0], [10, 6.0]]},
                                             [(5.0, "drift")], "timeline", tmp_path / "l.png"))
    assert plots._k_for(table, 64) == 2 and plots._k_for(table, 65) == 0
