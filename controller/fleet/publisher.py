"""What the closed loop tells a key's engines: the table they run, and the forces of a sweep.

The `TableAgent` holds the fleet's table as the loop decided it; the publisher sends its
desired version when that moves, arms the guardrail on the swap and points the drift
detector at the new table, and sends the force and release controls of the sweeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

from controller.drift import DriftDetector
from controller.engine.agent import TableAgent
from controller.fleet.channel import ControlChannel, clock_time
from controller.fleet.decisions import DecisionLog, What
from controller.guardrail import Guardrail
from controller.steps import StepColumns
from controller.validation import EngineLimits
from schemas import DraftTable, TableControl, TableEnvelope
from schemas.control import new_control_id

CHOSEN_AMONG_K = "chosen_among_k"
"""Provenance key of the refit that ends a re-profile: the K values its confirmation ran and
the table was chosen among (the drift detector's `confirmed` factor keys on it)."""

ROLLBACK_OF = "rollback_of"
"""Provenance key of an envelope that puts an earlier table back after a guardrail verdict:
the version it withdraws. A rollback is a new version, so a log replayed from the beginning
folds to the same table as one followed live."""

ISSUED_BY = "tabletune-control"
"""Who the loop's force and release controls say sent them (a replica adds its id)."""


class Publisher:
    def __init__(self, channel: ControlChannel, agent: TableAgent, limits: EngineLimits,
                 startup_table: DraftTable, guardrail: Guardrail, drift: DriftDetector,
                 decisions: DecisionLog, *, issued_by: str = ISSUED_BY) -> None:
        self.channel = channel
        self.issued_by = issued_by
        self.agent = agent
        self.limits = limits
        self.startup_table = startup_table
        self.guardrail = guardrail
        self.drift = drift
        self.decisions = decisions
        self.active_version = 0
        """The version the engines were last sent (0: the startup table)."""
        self.applied: list[tuple[float, int, DraftTable]] = []
        """(telemetry time, version, table) of each table the loop sent, in order."""
        self.fitted_range: tuple[int, int] | None = None
        """Batch sizes the last published refit saw (1st to 99th percentile)."""
        self.fitted_steps: tuple[int, StepColumns] | None = None
        """(version, the steps it was fitted on): the drift check's prediction error."""
        self.baseline_since_s: float | None = None
        """Where the last re-profile's settling stretch began: the stale table's baseline
        for the guardrail watch on the refit after it."""
        self._forcing: tuple[str, ...] | None = None
        """Targets of the force the loop holds on engines (None: none)."""
        self._muted = False
        """Set while the loop takes in an envelope the engines already have."""

    def resume(self, current: TableEnvelope | None, newest_version: int,
               log: tuple[TableEnvelope | TableControl, ...]) -> None:
        """Go on from the tables topic's state: the newest version's number, and the table
        the fleet runs, as sent (`log`: folded as the engines folded it)."""
        agent = self.agent
        if log:
            emit, agent.emit = agent.emit, lambda *args, **fields: None  # said once, live
            try:
                for message in log:
                    if isinstance(message, TableEnvelope):
                        agent.on_envelope(message)
                    elif not message.targets:
                        agent.on_control(message)
            finally:
                agent.emit = emit
            self.active_version = agent.state.desired_version
        elif current is not None:
            agent.state.newest_version = current.version - 1
            agent.on_envelope(current)
            self.active_version = current.version
        agent.state.newest_version = max(newest_version, agent.state.newest_version)

    @contextmanager
    def muted(self) -> Iterator[None]:
        """Take in what the engines already have (from the topic) without sending it."""
        self._muted = True
        try:
            yield
        finally:
            self._muted = False

    def running_table(self) -> DraftTable:
        """What the key's unforced engines run: the desired version's table."""
        desired = self.agent.desired()
        return self.startup_table if desired is None else desired.table

    def sync(self, now_s: float, *, guard: bool, after_drift: bool = False,
             settling: bool = False) -> None:
        """Send the agent's desired table if it is not the one the engines were sent;
        `after_drift` and `settling` as `Guardrail.arm` reads them."""
        desired = self.agent.desired()
        version = 0 if desired is None else desired.version
        if version == self.active_version:
            return
        if desired is not None and not self._muted:
            self.channel.send(desired)
        previous = self.active_version
        self.active_version = version
        table = self.running_table()
        self.applied.append((now_s, version, table))
        watch = None
        if guard and previous != 0:
            self.guardrail.arm(version, previous, now_s, after_drift=after_drift,
                               settling=settling,
                               baseline_since_s=self.baseline_since_s if after_drift else None)
            watch = "after_drift" if after_drift else "settling" if settling else "swap"
        else:
            self.guardrail.disarm()
        # the refit that ends a re-profile was chosen among the K its confirmation ran
        confirmed = (after_drift and desired is not None
                     and CHOSEN_AMONG_K in desired.provenance)
        fitted = self.fitted_steps
        self.drift.set_envelope(version, None if desired is None else desired.surface, now_s,
                                fitted_batch_range=self.fitted_range, confirmed=confirmed,
                                fit_steps=fitted[1] if fitted and fitted[0] == version else None,
                                budget=desired is not None and desired.budget is not None)
        self.decisions.note(now_s, What.STAGE, version=version, table=table.to_vllm(),
                            watch=watch)

    def stage_interim(self, envelope: TableEnvelope, now_s: float, *, records: int) -> None:
        """A canary re-profile's sweep, fitted, for the engines it does not force: they leave
        the stale table now, not after the confirmation, whose refit replaces it."""
        if not self.agent.on_envelope(envelope):
            return
        self.decisions.note(now_s, What.INTERIM, version=envelope.version, records=records)
        self.sync(now_s, guard=False)

    def roll_forward(self, now_s: float, withdrawn: int) -> None:
        """After the agent withdrew `withdrawn`: the table it went back to, sent as a new
        version (engines never walk back through a log; replaying it gives the same table)."""
        back = self.agent.desired()
        version = self.agent.state.newest_version + 1
        created_at = clock_time(now_s).isoformat()
        if back is None:  # the startup table, which engines run without an envelope
            envelope = TableEnvelope(
                key=self.limits.key, version=version, table=self.startup_table,
                startup_k_values=tuple(sorted(self.limits.startup_k_values)),
                max_batch=self.limits.max_batch, created_at=created_at,
                provenance={ROLLBACK_OF: withdrawn, "restores": 0})
        else:
            envelope = dataclasses.replace(
                back, version=version, signature=None, created_at=created_at,
                provenance={**back.provenance, ROLLBACK_OF: withdrawn,
                            "restores": back.version})
        self.agent.on_envelope(envelope)
        self.sync(now_s, guard=False)

    def force(self, table: DraftTable, now_s: float, *, until_s: float,
              targets: tuple[str, ...]) -> None:
        """Engines `targets` (all: empty) run `table` until `until_s` or the release."""
        self.channel.send(TableControl(
            key=self.limits.key, action="force", version=None,
            issued_at=clock_time(now_s).isoformat(), control_id=new_control_id(),
            issued_by=self.issued_by, table=table,
            expires_at=clock_time(until_s).isoformat(), targets=targets))
        self._forcing = targets

    def release(self, now_s: float) -> None:
        """End the force the loop holds, if any: the engines go back to the current table."""
        if self._forcing is None:
            return
        self.channel.send(TableControl(
            key=self.limits.key, action="release", version=None,
            issued_at=clock_time(now_s).isoformat(), control_id=new_control_id(),
            issued_by=self.issued_by, targets=self._forcing))
        self._forcing = None
