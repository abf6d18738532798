"""The twin: a trace-driven simulated vLLM engine (continuous batching, Dynamic-SD tables).

Same interfaces as the real engine hook: records go through `StepRecorder` to a sink, tables
arrive through `TableSwitch`. See docs/TWIN.md for the scenario format.

    from producers.twin import load_scenario, run_scenario
    summary = run_scenario(load_scenario("producers/twin/scenarios/sharegpt-eagle.toml"),
                           "vllm-doc", sink="file:///tmp/telemetry")
"""

from producers.sinks import NullSink
from producers.twin.config import (
    CostConfig,
    DrafterConfig,
    EngineConfig,
    PhaseConfig,
    Scenario,
    ScenarioError,
)
from producers.twin.engine import StepStats, TwinEngine
from producers.twin.policies import (
    FixedK,
    Policy,
    PolicyError,
    StaticTable,
    make_policy,
    register_policy,
)
from producers.twin.run import build_engine, run_scenario
from producers.twin.scenario_file import BUILTIN_SCENARIOS, load_scenario, parse_scenario
from producers.twin.static import StaticResult, static_speedups
from producers.twin.summary import RunSummary

__all__ = [
    "BUILTIN_SCENARIOS",
    "CostConfig",
    "DrafterConfig",
    "EngineConfig",
    "FixedK",
    "NullSink",
    "PhaseConfig",
    "Policy",
    "PolicyError",
    "RunSummary",
    "Scenario",
    "ScenarioError",
    "StaticResult",
    "StaticTable",
    "StepStats",
    "TwinEngine",
    "build_engine",
    "load_scenario",
    "make_policy",
    "parse_scenario",
    "register_policy",
    "run_scenario",
    "static_speedups",
]
