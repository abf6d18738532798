"""Where TableTune's n-gram proposer and the scheduler hook meet inside one engine process.

vLLM builds the proposer (in the model runner) and the scheduler separately and gives
neither a handle on the other. A custom proposer is not told the step's K, and the
scheduler is not told which n-gram each draft came from. Both run on the engine-core thread
of one process (vLLM's single-process executor), so they share this one object: the hook
writes the step's K and budget after `schedule()`; the proposer reads them, drafts, and
leaves each row's match length for the hook's telemetry. Under tensor parallelism the
proposer runs in the worker processes, where nothing here is written: it then drafts the
engine's `num_speculative_tokens` (see `ProposerLink.linked`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PROPOSER_CLASS = "producers.ngram_proposer.TableTuneNgramProposer"
"""What `speculative_config["model"]` names with `"method": "custom_class"`."""


@dataclass(slots=True)
class ProposerLink:
    lookup_range: tuple[int, int] | None = None
    """(min_n, max_n) of the proposer built in this process; None: no TableTune proposer."""
    step_k: int | None = None
    """The K vLLM's table (or a forced K) gives the drafts proposed this step; None: the
    hook is not attached, and the proposer drafts the engine's `num_speculative_tokens`."""
    step_budget: tuple[int, ...] | None = None
    """K by match length for this step's drafts, or None (every request drafts `step_k`)."""
    match_lengths: np.ndarray | None = None
    """Per input-batch row of the last proposal, the n-gram length its draft came from
    (0: no match; -1: the row was not looked up, e.g. a prefill chunk)."""

    @property
    def linked(self) -> bool:
        """A proposer was built in this process, so the hook can steer it."""
        return self.lookup_range is not None


LINK = ProposerLink()
"""The engine process's one link (vLLM runs one engine per process)."""
