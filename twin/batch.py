"""The engine's running requests as columns of two numpy matrices, in admission order.

Rows `[0, n)` are live. Finishing requests are removed by one boolean compaction per matrix,
which keeps vLLM's running-queue order (oldest first) and keeps every per-step operation a
vector operation over `n` requests instead of a Python loop over request objects.
"""

from __future__ import annotations

import numpy as np

# Integer columns (rows of `ints`).
PROMPT, COMPUTED, GENERATED, OUTPUT, ACC_OFFSET, K_PENDING, REQUEST_ID, PHASE, POOL_INDEX = range(9)
INT_COLUMNS = 9
# Float columns (rows of `floats`), virtual seconds.
ARRIVAL, FIRST_TOKEN = range(2)


class Row:
    """One request's columns as Python values (the twin's planned runs keep them so)."""

    __slots__ = ("prompt", "computed", "generated", "output", "acc_offset", "k_pending",
                 "request_id", "phase", "pool_index", "arrival", "first_token")

    def __init__(self, prompt: int, computed: int, generated: int, output: int,
                 acc_offset: int, k_pending: int, request_id: int, phase: int,
                 pool_index: int, arrival: float, first_token: float) -> None:
        self.prompt, self.computed, self.generated, self.output = (prompt, computed,
                                                                   generated, output)
        self.acc_offset, self.k_pending, self.request_id = acc_offset, k_pending, request_id
        self.phase, self.pool_index = phase, pool_index
        self.arrival, self.first_token = arrival, first_token

    def ints(self) -> tuple[int, ...]:
        """The integer columns, in `ints` row order."""
        return (self.prompt, self.computed, self.generated, self.output, self.acc_offset,
                self.k_pending, self.request_id, self.phase, self.pool_index)


class RunningBatch:
    """Per-request state of the requests admitted to the engine and not yet finished."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.n = 0
        self.ints = np.zeros((9, capacity), dtype=np.int64)
        self.floats = np.zeros((2, capacity), dtype=np.float64)
        # Named row views: writing through them writes the matrix.
        self.prompt = self.ints[PROMPT]
        self.computed = self.ints[COMPUTED]
        """Prompt tokens whose KV exists (== prompt once prefill is complete)."""
        self.generated = self.ints[GENERATED]
        self.output = self.ints[OUTPUT]
        self.acc_offset = self.ints[ACC_OFFSET]
        self.k_pending = self.ints[K_PENDING]
        """Drafts proposed for this request, verified at its next step."""
        self.request_id = self.ints[REQUEST_ID]
        self.phase = self.ints[PHASE]
        self.pool_index = self.ints[POOL_INDEX]
        self.arrival = self.floats[ARRIVAL]
        self.first_token = self.floats[FIRST_TOKEN]

    @property
    def free(self) -> int:
        return self.capacity - self.n

    def add(self, *, prompt: int, output: int, acc_offset: int, request_id: int, phase: int,
            pool_index: int, arrival_s: float) -> None:
        i = self.n
        self.ints[:, i] = (prompt, 0, 0, output, acc_offset, 0, request_id, phase, pool_index)
        self.floats[:, i] = (arrival_s, np.nan)
        self.n = i + 1

    def remove(self, done: np.ndarray) -> None:
        """Drop the rows where `done` (length n) is True, keeping the others' order."""
        self.remove_rows(np.flatnonzero(done))

    def remove_rows(self, rows: np.ndarray) -> None:
        """Drop rows `rows` (ascending, distinct, below n), keeping the others' order."""
        n = self.n
        if len(rows) == 1:  # the common case: shift the tail left by one row
            row = int(rows[0])
            self.ints[:, row:n - 1] = self.ints[:, row + 1:n]
            self.floats[:, row:n - 1] = self.floats[:, row + 1:n]
            self.n = n - 1
            return
        keep = np.ones(n, dtype=bool)
        keep[rows] = False
        m = n - len(rows)
        self.ints[:, :m] = self.ints[:, :n][:, keep]
        self.floats[:, :m] = self.floats[:, :n][:, keep]
        self.n = m
