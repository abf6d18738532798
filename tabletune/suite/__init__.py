"""`tabletune bench`: every policy side by side on the twin, over a grid of loads and drifts.

    tabletune bench --suite quick --out bench-out      # CI size, < 5 minutes on 2 cores
    tabletune bench --suite full --out bench-out       # the published figures, < 30 minutes

Modules, in the order the data flows: `grid` (what runs: scenarios x policies), `runner`
(runs them, in worker processes), `ratios` (pure arithmetic on the scores), `report` (the
markdown section), `markers` (puts it into BENCHMARKS.md between its markers), `standalone`
(reads the JSON the bench/ scripts wrote), `machine` (what it ran on).
"""
