"""The forced-K sweeps of a (re-)profile: their blocks, and the measures that steer them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def first_position_acceptance(records: pa.Table, mask: np.ndarray,
                              min_drafts: int = 200) -> float | None:
    """Share of drafts whose first token was accepted, over the steps in `mask` (None with
    fewer than `min_drafts`): every drafting step drafts a first position, so unlike
    accepted tokens per draft it is not cut off by K and compares steps that ran different
    K. Not free of K: at a larger K a closed loop's batch holds fewer well-accepting
    requests, so only large gaps between it at different K say that the workload moved."""
    drafts = records.column("num_drafts").to_numpy().astype(np.float64)
    chosen = mask & (drafts > 0)
    if drafts[chosen].sum() < min_drafts:
        return None
    lists = records.column("accepted_per_pos").filter(pa.array(chosen))
    first = pc.list_element(lists, 0).to_numpy(zero_copy_only=False)
    return float(first.sum() / drafts[chosen].sum())


CONFIRM_WIDTH = 3
"""K values a re-profile's confirmation runs: the sweep's pick and a neighbour each side."""


def confirmation_k_values(k_values: tuple[int, ...], chosen: int,
                          width: int = CONFIRM_WIDTH) -> tuple[int, ...]:
    """The `width` neighbouring K values of `k_values` around the sweep's pick `chosen`,
    shifted inward at either end of the set rather than cut short: the short sweep's pick is
    one K off often enough that the best K must be able to lie on either side of it."""
    at = k_values.index(chosen)
    first = max(0, min(at - width // 2, len(k_values) - width))
    return k_values[first:first + width]


@dataclass
class Sweep:
    blocks: list[int | None]
    """K per block; None = the current table, unforced (the settling stretch, which is also
    the guardrail's baseline for the refit at the end)."""
    block_s: list[float]
    started_s: float
    index: int = -1
    confirm: bool = False
    """When the blocks run out: fit, then append the confirmation runs."""
    fit_since_s: float | None = None
    """Fits take the records from here on (default: the sweep's start)."""
    confirmed: tuple[int, ...] = ()
    """The K values the confirmation ran: the refit after it chooses among them."""
    confirm_started_s: float | None = None
    """When the confirmation's runs began (None: not planned yet)."""
    restarted: bool = False
    """This re-profile is the second for one `stale`: the regime moved under the first."""
    targets: tuple[str, ...] = ()
    """The engines it forces (the canaries); empty: every engine of the key."""
    confirm_block_s: float = 0.0
    """Length of each confirmation run (a slow engine's are longer than configured)."""
    probe: bool = False
    """A re-profile that probes: short blocks at what the drift hid, and its fits keep the
    settling stretch and every engine's steps (the table's own K at the new traffic)."""

    climbs: int = 0
    """Fits a probe made of its pick, to run its neighbours (`PROBE_NEIGHBOURS`)."""

    late_s: float = 0.0
    """How far the blocks run behind their plan: a tick that came after a whole block's
    end ran that block from then on rather than skipping it, and a force that took time to
    reach the engines moved its block's end by as much."""

    arriving_k: int | None = None
    """The running block's K until the forced engines' steps show it (None: they do, or
    the block runs the table)."""
    forced_at_s: float = 0.0
    """When the running block's force was sent."""

    def block_at(self, now_s: float) -> int:
        """The block to run at `now_s` (len(blocks) once all ran). At most one block further
        than the last one asked for: with ticks coarser than a block (telemetry arriving in
        bursts, a slow fit) the later blocks shift instead of being skipped."""
        elapsed = now_s - self.started_s - self.late_s
        ends = np.cumsum(self.block_s)
        index = int(np.searchsorted(ends, elapsed, side="right"))
        following = self.index + 1
        if index > following:
            self.late_s += elapsed - (float(ends[following - 1]) if following > 0 else 0.0)
            index = following
        return index

    @property
    def records_from_s(self) -> float:
        """Where the records the sweep's fits take begin."""
        return self.started_s if self.fit_since_s is None else self.fit_since_s
