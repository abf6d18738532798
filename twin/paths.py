"""Every pool request's decode steps when it drafts one K all along, computed once per K.

Under one K a request's tokens per step follow from its own acc_len alone: a step at
generated g (acc_len position offset + g - 1) emits min(acc_len, K + 1) tokens, never past
its output length. So the steps of all requests, from their first generated token to their
last, can be laid out once (`Paths`), and a run of steps of a whole batch is the sum of its
requests' rows (the planned runs of `twin.fast_paths`). A request that drafted another K for
a while is off its path and is stepped the ordinary way.
"""

from __future__ import annotations

import numpy as np

from producers.request_ledger import RequestLedger
from twin.workload import RequestPool

DECODING, EMIT_FULL, EMITTED, CONTEXT, CONTEXT_MAX, PER_POS = range(6)
"""Columns of `Paths.sums`: 1 per step, tokens the drafts allowed, tokens emitted, context
(KV tokens), 0 (a batch's maximum context goes there), then one column per draft position:
1 where the draft at that position was accepted."""
_ROWS_AT_ONCE = 64
"""Requests whose ledger rows are computed together (`Paths.ledger_rows`)."""
_CHASE_STEPS = 16
"""Steps taken between checks of which requests are still going (`Paths`)."""


class Paths:
    """Steps of every request of `pools` (numbered in order: phase by phase, pool order)
    drafting `k`, in acc_len order: request r's steps are rows start[r] .. stop[r] - 1."""

    def __init__(self, pools: list[RequestPool], acc_len: np.ndarray, next_at: np.ndarray,
                 k: int, max_positions: int) -> None:
        self.k = k
        bases = np.cumsum([0] + [len(p.acc_len) for p in pools])[:-1]
        offset = np.concatenate([b + p.acc_offset for b, p in zip(bases, pools, strict=True)])
        output = np.concatenate([p.output_len for p in pools])
        prompt = np.concatenate([p.prompt_len for p in pools])
        self.first_request = np.cumsum([0] + [len(p) for p in pools])[:-1]
        """Per phase, the number of its pool's first request."""
        end = offset + output - 1  # a step starts below generated = output
        # every request's positions step after step; those past their request's end are
        # dropped at the end (and, once they are half of them, from the chase)
        alive = offset < end
        at, ends = offset[alive], end[alive]
        steps, bounds = [], []
        while at.size:
            for _ in range(_CHASE_STEPS):
                steps.append(at)
                bounds.append(ends)
                at = next_at.take(at)
            alive = at < ends
            left = int(np.count_nonzero(alive))
            if left < at.size // 2 or not left:
                at, ends = at[alive], ends[alive]
        position = np.concatenate(steps) if steps else np.zeros(0, np.int64)
        position = np.sort(position[position < np.concatenate(bounds)] if steps else position)
        request = np.searchsorted(offset, position, side="right") - 1
        counts = np.bincount(request, minlength=len(offset))
        self.stop = np.cumsum(counts)
        self.start = self.stop - counts
        self.position = position
        self.generated = position - offset[request] + 1
        """Tokens generated before each step."""
        emit_full = np.minimum(acc_len[position], k + 1)
        sums = np.zeros((len(position) + 1, PER_POS + k), dtype=np.int64)  # + a zero row
        sums[:-1, DECODING] = 1
        sums[:-1, EMIT_FULL] = emit_full
        sums[:-1, EMITTED] = np.minimum(emit_full, output[request] - self.generated)
        sums[:-1, CONTEXT] = prompt[request] + self.generated
        sums[:-1, PER_POS:] = emit_full[:, None] > np.arange(1, k + 1)
        self.sums = sums
        self.context = sums[:, CONTEXT]
        self._max_positions = max_positions
        self._rows: dict[int, np.ndarray] = {}

    def index_of(self, positions: np.ndarray) -> np.ndarray:
        """Row of each acc_len position's step, or -1 where no request's path has it."""
        index = np.searchsorted(self.position, positions)
        found = index < len(self.position)
        found[found] = self.position[index[found]] == positions[found]
        return np.where(found, index, -1)

    def ledger_rows(self, request: int) -> np.ndarray:
        """`RequestLedger.finish` rows of a request whose every step is on its path."""
        rows = self._rows.get(request)
        if rows is None:  # its block of requests at once
            first = request - request % _ROWS_AT_ONCE
            self._rows.update(self._ledger_rows(first, min(first + _ROWS_AT_ONCE,
                                                           len(self.start))))
            rows = self._rows[request]
        return rows

    def _ledger_rows(self, first: int, stop: int) -> dict[int, np.ndarray]:
        """Requests first .. stop - 1 each through a ledger, numbered as if alone."""
        requests = np.arange(first, stop)
        ledger = RequestLedger(self._max_positions, ring=_ROWS_AT_ONCE)
        counts = self.stop[first:stop] - self.start[first:stop]
        steps = slice(self.start[first], self.stop[stop - 1])
        self.observe(ledger, np.repeat(requests, counts), steps)
        rows = ledger.finish(requests)  # numbered among the requests that have steps
        stepped = requests[counts > 0].tolist()
        kept = dict.fromkeys(requests.tolist(), rows[:0])
        if stepped:
            per_request = np.bincount(rows[:, 0], minlength=len(stepped))
            rows[:, 0] = 0
            kept.update(zip(stepped, np.split(rows, np.cumsum(per_request)[:-1]),
                            strict=True))
        return kept

    def observe(self, ledger: RequestLedger, ids: np.ndarray, rows: slice | np.ndarray) -> None:
        """Feed `ledger` the steps at `rows` (one per element of `ids`, or all of one id)."""
        sums = self.sums[rows]
        ledger.observe_flat(np.broadcast_to(ids, sums.shape[:1]),
                            generated=self.generated[rows], drafted=self.k,
                            accepted=sums[:, EMIT_FULL] - 1, emitted=sums[:, EMITTED],
                            context=sums[:, CONTEXT])
