"""The Python API benchmarks call: run a scenario under a policy and get its summary.

Wiring matches a real engine: the policy's startup table goes into a `TableSwitch`, records go
through a `StepRecorder` to a sink. Unlike a real engine, the twin waits for a sink that falls
behind (it runs on virtual time, so waiting costs nothing) rather than dropping telemetry.
"""

from __future__ import annotations

from pathlib import Path

from controller.engine.table_switch import TableSwitch
from producers.identity import EngineIdentity
from producers.recorder import RecorderConfig, Sink, StepRecorder
from producers.sinks import sink_from_url
from schemas import TableError
from twin.config import Scenario
from twin.engine import TwinEngine
from twin.policies import Policy, PolicyError
from twin.registry import make_policy
from twin.scenario_file import load_scenario
from twin.summary import RunSummary, summarize


def open_sink(url: str) -> Sink:
    """`kafka://host:port`, `file:///dir`, or `null://` (recorder on, records discarded)."""
    return sink_from_url(url)


def run_scenario(scenario: Scenario | str | Path, policy: Policy | str, *,
                 sink: Sink | str | None = None, duration_s: float | None = None,
                 realtime: bool = False, drain: bool = False,
                 recorder_config: RecorderConfig | None = None,
                 epoch_s: float = 0.0) -> RunSummary:
    """Simulate `scenario` under `policy`; with `sink`, one telemetry record per step.

    `duration_s` overrides the scenario's total (the last phase lasts until then); `drain`
    keeps stepping after the end, without new arrivals, until every request has finished.
    `epoch_s`: where virtual time 0 lies in the records' timestamps (0: 1970).
    The sink is closed at the end.
    """
    engine, recorder, chosen = build_engine(scenario, policy, sink=sink, duration_s=duration_s,
                                            realtime=realtime, drain=drain,
                                            recorder_config=recorder_config, epoch_s=epoch_s)
    try:
        log = engine.run(chosen)
    finally:
        if recorder is not None:
            recorder.close(timeout_s=30.0)
    end_s = max(engine.end_s, engine.clock_s) if drain else engine.end_s
    summary = summarize(log, policy=chosen.describe(), scenario=engine.scenario.name,
                        duration_s=end_s, phase_spans=phase_spans(engine, end_s))
    if recorder is not None:
        summary.telemetry = recorder.counters()
    return summary


def build_engine(scenario: Scenario | str | Path, policy: Policy | str, *,
                 sink: Sink | str | None = None, duration_s: float | None = None,
                 realtime: bool = False, drain: bool = False,
                 recorder_config: RecorderConfig | None = None, speedup: float = 1.0,
                 epoch_s: float = 0.0) -> tuple[TwinEngine, StepRecorder | None, Policy]:
    """The engine `run_scenario` would run, for callers that drive or inspect it themselves."""
    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario)
    chosen = make_policy(policy) if isinstance(policy, str) else policy
    limits = scenario.engine
    table, version = chosen.initial_table(max_k=limits.max_k, max_batch=limits.max_num_seqs)
    lookup = scenario.drafter.prompt_lookup
    # a drafter that reports no match length runs the table alone, as an engine's feed does
    budget = chosen.initial_budget() if lookup else None
    try:
        switch = TableSwitch(table, max_k=limits.max_k, max_batch=limits.max_num_seqs,
                             version=version, max_match=lookup[1] if lookup else 0,
                             budget=budget)
    except TableError as exc:
        raise PolicyError(f"{chosen.describe()}: {exc}") from None
    recorder = None
    if sink is not None:
        identity = EngineIdentity(engine_id=limits.engine_id, model=limits.model,
                                  drafter=scenario.drafter.method, hardware=limits.hardware)
        recorder = StepRecorder(identity, open_sink(sink) if isinstance(sink, str) else sink,
                                max_k=limits.max_k, config=recorder_config)
    engine = TwinEngine(scenario, switch, recorder=recorder, duration_s=duration_s,
                        realtime=realtime, drain=drain, speedup=speedup, epoch_s=epoch_s)
    return engine, recorder, chosen


def phase_spans(engine: TwinEngine, end_s: float) -> list[tuple[str, float, float]]:
    """(name, start_s, end_s) of each phase that the run reached."""
    spans = []
    phases = engine.scenario.phases
    for index, phase in enumerate(phases):
        start = engine.traffic.starts[index]
        if start >= end_s:
            break
        stop = end_s if index == len(phases) - 1 else min(engine.traffic.starts[index + 1], end_s)
        spans.append((phase.name or f"phase{index}", start, stop))
    return spans
