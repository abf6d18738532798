"""The suite's lookup grids: n-gram drafted for real, with TableTune's table alone beside it."""

from __future__ import annotations

from pathlib import Path

from tabletune.suite import grid
from tabletune.suite.collect import plan


def test_lookup_grids_draft_for_real_and_run_the_table_alone_beside_tabletune(
        tmp_path: Path) -> None:
    spec = grid.SuiteSpec(name="t", traces=("instructcoder",), methods=("ngram", grid.LOOKUP),
                          concurrencies=(32,), rates_tok_s=(3000.0,), drift=(),
                          policies=("vllm-doc", "tabletune"))
    cases = {case.grid: case for case in grid.grid_cases(spec)}
    assert set(cases) == {"instructcoder-ngram/closed", "instructcoder-ngram/open",
                          "instructcoder-ngram-lookup/closed", "instructcoder-ngram-lookup/open"}
    lookup = cases["instructcoder-ngram-lookup/closed"]
    assert lookup.scenario.drafter.method == "ngram"
    assert lookup.scenario.drafter.prompt_lookup == grid.LOOKUP_RANGE
    assert lookup.extra_policies == (grid.TABLE_ALONE,)
    recorded = cases["instructcoder-ngram/closed"]
    assert recorded.scenario.drafter.prompt_lookup is None and recorded.extra_policies == ()

    runs = {(task.key, task.policy) for task in plan(spec, tmp_path)}
    assert ("instructcoder-ngram-lookup/closed c=32", grid.TABLE_ALONE) in runs
    assert ("instructcoder-ngram-lookup/open 3000 tok/s", grid.TABLE_ALONE) in runs
    assert not any(policy == grid.TABLE_ALONE and "lookup" not in key for key, policy in runs)

    without = grid.SuiteSpec(name="t", traces=("instructcoder",), methods=(grid.LOOKUP,),
                             concurrencies=(32,), rates_tok_s=(), policies=("vllm-doc",))
    assert all(case.extra_policies == () for case in grid.grid_cases(without))
