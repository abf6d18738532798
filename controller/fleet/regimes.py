"""The regimes a key's re-profiles measured, so that traffic coming back is recalled, not
measured again.

A re-profile forces every K for a minute because acceptance above the running K is censored:
only forced steps show it. A workload that swings back (chat, then code, then chat) has
shown it already. Each finished sweep is kept with its signature: the first draft
position's acceptance (which every drafting step measures, whatever its K) and the median
batch size. When the table goes stale and the last seconds' signature matches a kept
regime, the loop refits on that regime's sweep and publishes at once, with no forced step.
A regime an earlier owner of the key published (a restart, a takeover) comes without its
sweep: its recall sends the table that sweep's refit published again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from controller.fleet.sweep import first_position_acceptance

MAX_REGIMES = 8
"""Regimes kept per key, the least recently used dropped first: a sweep's records are a
minute of one key's steps (a few MB at most)."""
RECALL_TRUST_S = 90.0
"""A recalled table called stale this soon was a wrong match (the drift detector's reference
and first window take about a minute): the next drift re-profiles instead, unless the
newest steps still sign the recalled regime (`ClosedLoop._within_regime`)."""
SIGNATURE_S = (20.0, 10.0, 5.0)
"""Telemetry seconds whose steps sign the traffic at a drift, tried in turn until one
matches a regime: 20 s holds the first position's 200 drafts at one user, but a drift
called 11 s after a switch back (n-gram, 32 users) signs half the old traffic over 20 s
and matched nothing; the last 10 or 5 s are the new traffic alone when they hold the
drafts (`Signature.of` gives none without)."""
MATCH_FACTOR = 2.0
"""A regime matches when the first position's acceptance at one K is within this many drift
acceptance thresholds (30% at the default 0.15): the sweep's one-second blocks at a K read
up to 29% off what the same traffic settles at under a table (twin, GSM8K n-gram at K5-K7),
while the workloads a swing moves between differ three-fold (0.16 against 0.46-0.6). A match
that is wrong shows at once: the drift detector holds the recalled table to its prediction
from its first steps, and a recalled table called stale soon is re-profiled."""
NEAREST_K_GAP = 2
"""Signatures with no K in common compare at their nearest K values, this far apart at most:
the first position's acceptance moves about 5% a K (0.58 at K2, 0.46 at K7), so two K apart
stay well inside the match bar while workloads differ three-fold. A one-engine key's regime
holds its settling stretch's K and its probe's largest K only."""
MATCH_BATCH_FACTOR = 1.5
"""... and the median batch size within this factor (the drift detector's coverage factor is
2: within it, one table serves both)."""


@dataclass(frozen=True, slots=True)
class Signature:
    acceptance: dict[int, float]
    """Share of first draft positions accepted, per K that drafted enough to read it: at a
    larger K a closed loop's batch holds fewer well-accepting requests, so one traffic shows
    0.46 at K7 and 0.58 at K2 (twin, InstructCoder n-gram), and only one K compares."""
    drafts: dict[int, float]
    """Drafts behind each of those shares."""
    batch: float
    """Median batch size."""

    @classmethod
    def of(cls, records: pa.Table | None) -> Signature | None:
        """The signature of `records`' steps; None without enough drafts at any K."""
        if records is None or not records.num_rows:
            return None
        k = records.column("k").to_numpy()
        drafts = records.column("num_drafts").to_numpy().astype(np.float64)
        acceptance, counts = {}, {}
        for value in np.unique(k[k > 0]):
            share = first_position_acceptance(records, k == value)
            if share is not None and share > 0:
                acceptance[int(value)] = share
                counts[int(value)] = float(drafts[k == value].sum())
        if not acceptance:
            return None
        return cls(acceptance, counts, float(np.median(records.column("batch_size").to_numpy())))

    def keeping(self, older: Signature) -> Signature:
        """This signature, with the K values only `older` read (the same traffic measured
        at other K): first-position acceptance depends on K, so the next drift, read at
        whatever K the table then runs, finds a K to compare at."""
        return Signature({**older.acceptance, **self.acceptance},
                         {**older.drafts, **self.drafts}, self.batch)

    def distance(self, other: Signature) -> tuple[float, float] | None:
        """(|log acceptance ratio| at the shared K with the most drafts on both sides, else
        at the nearest K values within NEAREST_K_GAP, |log batch ratio|); None without."""
        pairs = [(a, b) for a in self.acceptance for b in other.acceptance
                 if abs(a - b) <= NEAREST_K_GAP]
        if not pairs:
            return None
        gap = min(abs(a - b) for a, b in pairs)
        a, b = max((pair for pair in pairs if abs(pair[0] - pair[1]) == gap),
                   key=lambda pair: min(self.drafts[pair[0]], other.drafts[pair[1]]))
        return (abs(math.log(self.acceptance[a] / other.acceptance[b])),
                abs(math.log(max(self.batch, 1.0) / max(other.batch, 1.0))))


@dataclass(frozen=True, slots=True)
class Regime:
    signature: Signature
    records: pa.Table | None
    """The sweep's records, as its refit read them (None: a regime an earlier owner of the
    key measured, restored from the status topic; its recall sends `version` again)."""
    k_values: tuple[int, ...] | None
    """The K its confirmation ran (the refit chose among them); None: every startup K."""
    steps_since_s: float | None
    """Where its refit's step models started (the confirmation), if not at the records'."""
    learned_s: float
    """Telemetry time of its refit: the fit weighs its records as of then."""
    reason: str
    """Its refit's reason ("profile", "stale"): the recency weights it fitted with."""
    version: int | None = None
    """The table version its refit published (None: it published none)."""

    def to_json(self) -> dict[str, Any]:
        """What a later owner of the key recalls it by: the signature and the version."""
        signature = self.signature
        return {"acceptance": {str(k): v for k, v in signature.acceptance.items()},
                "drafts": {str(k): v for k, v in signature.drafts.items()},
                "batch": signature.batch, "version": self.version,
                "k_values": None if self.k_values is None else list(self.k_values),
                "learned_s": self.learned_s, "reason": self.reason}

    @classmethod
    def from_json(cls, data: object) -> Regime:
        """A regime from `to_json`'s form, without its records; ValueError naming what is
        wrong."""
        if not isinstance(data, dict):
            raise ValueError("regime: expected an object")
        try:
            acceptance = _shares(data["acceptance"], "acceptance")
            drafts = _shares(data["drafts"], "drafts")
            batch, learned_s = float(data["batch"]), float(data["learned_s"])
            version = data["version"]
            k_values = data["k_values"]
            reason = data["reason"]
        except KeyError as exc:
            raise ValueError(f"regime: no {exc}") from None
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"regime: {str(exc)[:80]}") from None
        if set(acceptance) != set(drafts) or not acceptance:
            raise ValueError("regime: acceptance and drafts name different K values")
        if not (math.isfinite(batch) and batch > 0 and math.isfinite(learned_s)):
            raise ValueError("regime: batch or learned_s is not a finite positive number")
        if not (isinstance(version, int) and not isinstance(version, bool) and version > 0):
            raise ValueError(f"regime: version {str(version)[:40]} is not a positive integer")
        if k_values is not None and not (isinstance(k_values, list) and all(
                isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in k_values)):
            raise ValueError("regime: k_values is not a list of K values")
        if not isinstance(reason, str):
            raise ValueError("regime: reason is not a string")
        return cls(Signature(acceptance, drafts, batch), None,
                   None if k_values is None else tuple(k_values), None, learned_s,
                   reason[:40], version)


class RegimeMemory:
    def __init__(self) -> None:
        self._regimes: list[Regime] = []

    def __len__(self) -> int:
        return len(self._regimes)

    def remember(self, regime: Regime, acceptance_threshold: float) -> Regime:
        """Keep `regime` and return what is kept: one it matches (the same traffic measured
        again) is replaced, its signature's other K kept in the new one's."""
        same = [r for r in self._regimes
                if _matches(r.signature, regime.signature, acceptance_threshold)]
        signature = regime.signature
        for older in reversed(same):  # most recently used first: its readings win
            signature = signature.keeping(older.signature)
        kept = dataclasses.replace(regime, signature=signature)
        self._regimes = [r for r in self._regimes if not any(r is o for o in same)]
        self._regimes.append(kept)
        del self._regimes[:-MAX_REGIMES]
        return kept

    def recall(self, signature: Signature | None, acceptance_threshold: float, *,
               stale: Regime | None = None) -> Regime | None:
        """The kept regime closest to `signature` within the match bars, or None; never
        `stale`, the regime the table just called stale was fitted on (its traffic is the
        one that moved away)."""
        if signature is None:
            return None
        matching = [r for r in self._regimes if r is not stale
                    and _matches(r.signature, signature, acceptance_threshold)]
        if not matching:
            return None
        best = min(matching, key=lambda r: r.signature.distance(signature) or (math.inf,))
        self._regimes.remove(best)  # most recently used last: the last to be dropped
        self._regimes.append(best)
        return best

    def forget(self) -> None:
        self._regimes.clear()

    def kept(self) -> list[Regime]:
        """The regimes, least recently used first."""
        return list(self._regimes)

    def restore(self, regimes: list[Regime]) -> None:
        """Begin from what an earlier owner of the key kept (least recently used first)."""
        self._regimes = list(regimes[-MAX_REGIMES:])


def _shares(value: object, name: str) -> dict[int, float]:
    """A signature's per-K numbers from JSON (K as text keys), each finite and positive."""
    if not isinstance(value, dict) or len(value) > 64:
        raise ValueError(f"{name} is not an object of at most 64 K values")
    shares = {int(k): float(v) for k, v in value.items()}
    if not all(k >= 0 and math.isfinite(v) and v > 0 for k, v in shares.items()):
        raise ValueError(f"{name} holds a negative K or a value that is not finite and positive")
    return shares


def within(distance: tuple[float, float] | None, acceptance_threshold: float,
           factor: float = MATCH_FACTOR) -> bool:
    """Whether a `Signature.distance` is inside the match bars: the acceptance within
    `factor` thresholds, the batch within `MATCH_BATCH_FACTOR`."""
    if distance is None:
        return False
    acceptance, batch = distance
    return (acceptance <= math.log1p(factor * acceptance_threshold)
            and batch <= math.log(MATCH_BATCH_FACTOR))


def _matches(a: Signature, b: Signature, acceptance_threshold: float) -> bool:
    return within(a.distance(b), acceptance_threshold)
