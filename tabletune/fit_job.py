"""`tabletune fit` as a job: read the Parquet window, decide, write, publish; optionally forever.

One refit = read the dataset (optionally only the last `since`), find the current envelope
(the newest version on the tables topic for the key, or a file), `decide_refit`, write the
candidate to `out`, publish it when the decision says so. Steps the dataset holds in two
different records are left out by the reader and counted in the outcome's `conflicts` and
the candidate's `provenance.conflicts`. `watch` repeats that every period
and at once when a controller reports the key's table `stale` on the status topic.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controller.fleet.table_log import publish, read_log
from fitter.dataset import SkippedFile, load_dataset
from fitter.refit import DEFAULT_THRESHOLD, RefitDecision, decide_refit, key_from_records
from fitter.step_conflicts import StepConflicts
from fitter.surface.fit import DEFAULT_HALF_LIFE_S
from schemas import TableEnvelope, TableKey
from schemas.settings import Settings
from schemas.table_files import load_table_file

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class RefitJob:
    """Everything one refit needs; the CLI builds it from flags."""

    parquet: Path
    since: dt.timedelta | None = None
    out: Path | None = None
    key: TableKey | None = None
    max_k: int | None = None
    max_batch: int | None = None
    startup_k_values: Sequence[int] | None = None
    threshold: float = DEFAULT_THRESHOLD
    half_life_s: float | None = DEFAULT_HALF_LIFE_S
    current_file: Path | None = None
    """The current envelope from a file instead of the tables topic."""
    publish: bool = False
    settings: Settings | None = None
    """Needed to read the current envelope from the topic and to publish."""
    strict: bool = False
    """Refuse a Parquet file that is not telemetry instead of skipping it."""


@dataclasses.dataclass(frozen=True, slots=True)
class RefitOutcome:
    decision: RefitDecision
    records: int
    offset: int | None
    """Where the envelope was published (None: not published)."""
    skipped_files: tuple[SkippedFile, ...] = ()
    """Parquet files left out of the fit, each with why."""
    conflicts: StepConflicts = dataclasses.field(default_factory=StepConflicts)
    """Steps stored in two or more different records, every copy left out of the fit."""

    def to_dict(self) -> dict[str, Any]:
        return {**self.decision.to_dict(), "records": self.records, "offset": self.offset,
                "skipped_files": [skipped.to_dict() for skipped in self.skipped_files],
                "conflicts": self.conflicts.to_dict()}


def current_envelope(settings: Settings, key: TableKey) -> tuple[TableEnvelope | None, int]:
    """(the newest envelope for `key` on the tables topic, the newest version number)."""
    envelopes = [e.message for e in read_log(settings, key)
                 if isinstance(e.message, TableEnvelope)]
    if not envelopes:
        return None, 0
    newest = max(envelopes, key=lambda e: e.version)
    return newest, newest.version


def refit_once(job: RefitJob, *, stale: bool = False,
               now: dt.datetime | None = None) -> RefitOutcome:
    """One refit; publishes only when the decision says so and the job allows it."""
    dataset = load_dataset(job.parquet, since=job.since, now=now, strict=job.strict)
    records = dataset.records
    if records.height == 0:
        raise ValueError(f"no telemetry under {job.parquet}"
                         + (f" within the last {job.since}" if job.since else "")
                         + (f" but {len(dataset.conflicts)} steps stored in two different "
                            "records, left out" if len(dataset.conflicts) else ""))
    key = job.key or key_from_records(records)
    current: TableEnvelope | None = None
    newest = 0
    if job.current_file is not None:
        _, current = load_table_file(job.current_file)
        if current is None:
            raise ValueError(f"--current {job.current_file}: needs a TableEnvelope (its "
                             "version and startup K set), not plain triples")
        newest = current.version
    elif job.settings is not None and job.settings.bootstrap_servers:
        current, newest = current_envelope(job.settings, key)
    conflicts = dataset.conflicts
    decision = decide_refit(records, current, key=key, max_k=job.max_k,
                            max_batch=job.max_batch, startup_k_values=job.startup_k_values,
                            newest_version=newest, threshold=job.threshold, stale=stale,
                            half_life_s=job.half_life_s,
                            provenance={"parquet": str(job.parquet),
                                        "since_s": job.since.total_seconds()
                                        if job.since else None,
                                        **({"conflicts": conflicts.to_dict()}
                                           if len(conflicts) else {})})
    if job.out is not None:
        job.out.parent.mkdir(parents=True, exist_ok=True)
        job.out.write_text(json.dumps(decision.envelope.to_dict(), indent=2, sort_keys=True)
                           + "\n")
    offset = None
    if job.publish and decision.publish:
        if job.settings is None or not job.settings.bootstrap_servers:
            raise ValueError("--publish needs --bootstrap (or TABLETUNE_BOOTSTRAP)")
        offset = publish(job.settings, decision.envelope)
        log.info("published %s version %d at offset %d (%s)", key,
                 decision.envelope.version, offset, decision.reason)
    return RefitOutcome(decision, records.height, offset, dataset.skipped, conflicts)
