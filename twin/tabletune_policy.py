"""`tabletune`: the whole system as a twin policy, on virtual time and in-process.

The engine records every step through its `StepRecorder` (the same one vLLM's hook uses);
this policy keeps a copy of the frames in memory (`MemorySink`) and, every `tick_s` of
virtual time, hands them to a `controller.fleet.service.ControlService` (the class the
`tabletune control` process runs) and ticks it with the virtual clock. The service's loop
sends envelopes and force/release controls through an `InMemoryChannel` to the engine's
`EngineFeed` (the class a vLLM engine's table feed runs), which stages them into the
engine's `TableSwitch`. Only the transport (memory instead of the tables topic) and the
clock (virtual) differ from a fleet.

    run_scenario("twin/scenarios/load-drift.toml", "tabletune")
    run_scenario(..., "tabletune:explore=0,refit=20")
"""

from __future__ import annotations

import threading
from collections import deque
from datetime import datetime
from typing import TYPE_CHECKING

import pyarrow as pa

from controller.engine.feed import EngineFeed
from controller.exploration import ExplorationConfig
from controller.fleet.channel import InMemoryChannel, clock_time
from controller.fleet.loop import ClosedLoop
from controller.fleet.loop_config import LoopConfig
from controller.fleet.service import ControlService
from controller.guardrail import GuardrailConfig
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from producers.identity import EngineIdentity
from producers.recorder import StepRecorder
from schemas import DraftTable, TableControl, TableEnvelope, TableKey
from twin.policies import VLLM_DOC_TABLE, Policy, PolicyError

if TYPE_CHECKING:
    from twin.engine import StepStats, TwinEngine


class MemorySink:
    """Keeps frames until taken; optionally forwards them to another sink too."""

    def __init__(self, forward: object | None = None) -> None:
        self.forward = forward
        self._frames: deque[pa.Table] = deque()
        self._lock = threading.Lock()
        self.records = 0

    def write(self, records: pa.Table) -> None:
        # The recorder's tables alias its recycled column buffers (pa.array of numpy is
        # zero-copy): a sink that keeps a table past `write` must copy it.
        records = records.take(pa.array(range(records.num_rows), type=pa.int64()))
        with self._lock:
            self._frames.append(records)
            self.records += records.num_rows
        if self.forward is not None:
            self.forward.write(records)  # type: ignore[attr-defined]

    def take(self) -> pa.Table | None:
        with self._lock:
            frames, self._frames = list(self._frames), deque()
        return pa.concat_tables(frames) if frames else None

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True if self.forward is None else bool(self.forward.flush(timeout_s))  # type: ignore[attr-defined]

    def close(self, timeout_s: float = 5.0) -> None:
        if self.forward is not None:
            self.forward.close(timeout_s)  # type: ignore[attr-defined]

    def counters(self) -> dict[str, int]:
        return {"memory_records": self.records}


class TabletunePolicy(Policy):
    name = "tabletune"
    step_interval = 4

    def __init__(self, config: LoopConfig | None = None, *, tick_s: float = 1.0,
                 startup: DraftTable = VLLM_DOC_TABLE) -> None:
        self.config = config or LoopConfig()
        self.tick_s = tick_s
        self.startup = startup
        self.service: ControlService | None = None
        self.feed: EngineFeed | None = None
        self.channel: InMemoryChannel | None = None
        self.key: TableKey | None = None
        self._sink = MemorySink()
        self._recorder: StepRecorder | None = None
        self._own_recorder = False
        self._next_tick_s = 0.0
        self._planned: list[tuple[float, DraftTable | TableControl]] = []

    @property
    def loop(self) -> ClosedLoop | None:
        """The service's loop for this engine's key (None before its first records)."""
        if self.service is None or self.key is None:
            return None
        return self.service.loop(self.key)

    @property
    def status(self) -> StatusPublisher | None:
        loop = self.loop
        return None if loop is None else loop.status

    def initial_table(self, *, max_k: int, max_batch: int) -> tuple[DraftTable, int]:
        dense = [min(k, max_k) for k in self.startup.to_dense(max_batch)]
        return DraftTable.from_dense(dense), 0

    def plant(self, at_s: float, message: DraftTable | TableControl) -> None:
        """At virtual time `at_s`, put on the tables topic (as an operator would) a table,
        published as the next version (a test of the guardrail: a bad table that must be
        rolled back), or a control (pin, unpin, rollback: the service must follow it)."""
        self._planned.append((at_s, message))
        self._planned.sort(key=lambda entry: entry[0])

    def start(self, engine: TwinEngine) -> None:
        # the fitter's heavy imports only when used
        from fitter.derive import fit_table
        from fitter.engine_consensus import with_screening

        scenario = engine.scenario
        limits = scenario.engine
        key = self.key = TableKey(model=limits.model, drafter=scenario.drafter.method,
                                  hardware=limits.hardware)
        if engine.recorder is None:
            identity = EngineIdentity(engine_id=limits.engine_id, model=limits.model,
                                      drafter=scenario.drafter.method,
                                      hardware=limits.hardware)
            engine.recorder = StepRecorder(identity, self._sink, max_k=limits.max_k)
            self._own_recorder = True
        else:  # keep what the caller's sink gets, and see it too
            self._sink.forward = engine.recorder.sink
            engine.recorder.sink = self._sink
        self._recorder = engine.recorder
        engine_limits = EngineLimits(key=key, startup_k_values=frozenset(range(limits.max_k + 1)),
                                     max_batch=limits.max_num_seqs)
        def clock() -> datetime:
            """The telemetry's clock: virtual time from the engine's epoch (0 in memory)."""
            return clock_time(engine.epoch_s + engine.clock_s)

        self.feed = EngineFeed(engine.switch, engine_limits,
                               StatusPublisher(None, limits.engine_id, str(key), history=4096),
                               clock, exploration=self.config.exploration)
        channel = self.channel = InMemoryChannel([self.feed])
        # the fit `tabletune control` runs: screened rows, then the fleet's consensus
        self.service = ControlService(with_screening(fit_table), lambda _key: channel,
                                      config=self.config,
                                      tick_s=self.tick_s)
        self.service.engine_started(key, engine_limits, engine.switch.startup_table)
        self._next_tick_s = engine.clock_s + self.tick_s

    def on_step(self, engine: TwinEngine, step: StepStats) -> None:
        now = step.t_s
        if now < self._next_tick_s or self.service is None or self._recorder is None:
            return
        self._next_tick_s = now + self.tick_s
        self._recorder.flush(timeout_s=30.0)
        records = self._sink.take()
        if records is not None:
            self.service.records(records)
        at_s = engine.epoch_s + now  # the records' timestamps, which the service keys on
        self.service.tick(at_s)
        while self._planned and self._planned[0][0] <= now:
            _, planted = self._planned.pop(0)
            assert self.channel is not None
            if isinstance(planted, TableControl):
                self.channel.send(planted)
                self.service.control_seen(planted, at_s)
                continue
            envelope = self._envelope(planted)
            self.channel.send(envelope)
            self.service.table_seen(envelope, at_s)
        assert self.feed is not None
        self.feed.sync()  # a force's expiry, and the engine's `applied`
        if now + step.step_latency_s >= engine.end_s and not engine.drain:
            self.close()

    def close(self) -> None:
        """Stop the recorder this policy started (run_scenario closes only its own)."""
        if self._own_recorder and self._recorder is not None:
            self._recorder.close(timeout_s=5.0)
            self._own_recorder = False

    def _envelope(self, table: DraftTable) -> TableEnvelope:
        loop = self.loop
        assert loop is not None
        limits = loop.limits
        return TableEnvelope(key=limits.key, version=loop.agent.state.newest_version + 1,
                             table=table, startup_k_values=tuple(sorted(limits.startup_k_values)),
                             max_batch=limits.max_batch, created_at="1970-01-01T00:00:00+00:00",
                             provenance={"planted": True})


def tabletune_policy(arg: str | None) -> Policy:
    """`tabletune[:explore=SHARE,refit=SECONDS,threshold=FRACTION,reprofile=0|1,budgets=0|1]`
    (`make_policy("tabletune...")` calls this). Budgets are on by default: they apply where
    the engine reports n-gram match lengths (a trace drafted for real), and `budgets=0` is
    TableTune's table alone."""
    options: dict[str, float] = {}
    for part in (arg or "").split(","):
        if not part:
            continue
        name, _, value = part.partition("=")
        try:
            options[name] = float(value)
        except ValueError:
            raise PolicyError(f"tabletune:{arg}: {part!r} is not NAME=NUMBER") from None
    unknown = set(options) - {"explore", "refit", "threshold", "reprofile", "budgets"}
    if unknown:
        raise PolicyError(f"tabletune: unknown option(s) {sorted(unknown)}")
    config = LoopConfig(
        exploration=ExplorationConfig(share=options.get("explore", 0.02)),
        refit_interval_s=options.get("refit", 30.0),
        guardrail=GuardrailConfig(threshold=options.get("threshold", 0.03)),
        reprofile_on_stale=bool(options.get("reprofile", 1.0)),
        budgets=bool(options.get("budgets", 1.0)),
    )
    return TabletunePolicy(config)
