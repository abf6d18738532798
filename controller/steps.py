"""Step records as the controller's components read them: a few numpy columns.

The guardrail and the drift detector are fed the same telemetry records the fitter reads
(the recorder's Arrow frames, from the telemetry topic or an in-memory sink in the twin), so
the conversion lives in one place. Goodput per step counts decode tokens only
(`num_decode_reqs + num_accepted_tokens`): a prefill's first token depends on the prompt, not
on the table, and would only add noise to a comparison of tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

_COLUMNS = ("ts_ns", "batch_size", "num_decode_reqs", "num_prefill_reqs", "k", "k_next",
            "num_drafts", "num_accepted_tokens", "step_latency_s", "table_version", "forced")


@dataclass(frozen=True, slots=True)
class StepColumns:
    """One chunk of step records, in step order (one engine)."""

    t_s: NDArray[np.float64]
    batch_size: NDArray[np.int64]
    decode_reqs: NDArray[np.int64]
    prefill_reqs: NDArray[np.int64]
    k: NDArray[np.int64]
    """Drafts verified in the step (chosen by the previous step)."""
    k_next: NDArray[np.int64]
    """Drafts proposed in the step (the table's, or an exploration probe's, choice)."""
    num_drafts: NDArray[np.int64]
    accepted: NDArray[np.int64]
    latency_s: NDArray[np.float64]
    version: NDArray[np.int64]
    forced: NDArray[np.bool_]
    """The step's K was not the table's choice (profile or exploration)."""

    @classmethod
    def from_records(cls, records: pa.Table) -> StepColumns:
        col = {name: records.column(name).to_numpy(zero_copy_only=False) for name in _COLUMNS}
        return cls(
            t_s=col["ts_ns"].astype(np.float64) / 1e9,
            batch_size=col["batch_size"].astype(np.int64),
            decode_reqs=col["num_decode_reqs"].astype(np.int64),
            prefill_reqs=col["num_prefill_reqs"].astype(np.int64),
            k=col["k"].astype(np.int64),
            k_next=col["k_next"].astype(np.int64),
            num_drafts=col["num_drafts"].astype(np.int64),
            accepted=col["num_accepted_tokens"].astype(np.int64),
            latency_s=col["step_latency_s"].astype(np.float64),
            version=col["table_version"].astype(np.int64),
            forced=col["forced"].astype(bool),
        )

    def __len__(self) -> int:
        return int(self.t_s.shape[0])

    @property
    def tokens(self) -> NDArray[np.float64]:
        """Decode tokens emitted per step: one per decode request plus accepted drafts."""
        return (self.decode_reqs + self.accepted).astype(np.float64)

    def table_steps(self) -> NDArray[np.bool_]:
        """Steps that ran the table's own K, both for the drafts they verified and proposed.

        A step after an exploration probe verifies the probe's drafts, so it is excluded
        as well as the probe itself.
        """
        return ~(self.forced | self.after_forced())

    def after_forced(self) -> NDArray[np.bool_]:
        """Steps whose verified drafts were proposed at a forced K (the step before was
        forced): under a budget, the only steps every request of which drafted one K."""
        after = np.zeros_like(self.forced)
        after[1:] = self.forced[:-1]
        return after

    def select(self, mask: NDArray[np.bool_]) -> StepColumns:
        return StepColumns(*(getattr(self, name)[mask] for name in self.__slots__))


def batch_bucket(batch_size: NDArray[np.int64]) -> NDArray[np.int64]:
    """Octave buckets (1, 2-3, 4-7, ...): steps in one bucket have comparable batch sizes."""
    return np.floor(np.log2(np.maximum(batch_size, 1))).astype(np.int64)
