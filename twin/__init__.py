"""The twin: a trace-driven simulated vLLM engine (continuous batching, Dynamic-SD tables).

Same interfaces as the real engine hook: records go through `StepRecorder` to a sink, tables
arrive through `TableSwitch`. See docs/TWIN.md for the scenario format.

    from twin import load_scenario, run_scenario
    summary = run_scenario(load_scenario("twin/scenarios/sharegpt-eagle.toml"),
                           "vllm-doc", sink="file:///tmp/telemetry")
"""

from producers.sinks import NullSink
from twin.config import (
    CostConfig,
    DrafterConfig,
    EngineConfig,
    PhaseConfig,
    Scenario,
    ScenarioError,
)
from twin.engine import StepStats, TwinEngine
from twin.policies import FixedK, Policy, PolicyError, StaticTable
from twin.registry import make_policy, register_policy
from twin.run import build_engine, run_scenario
from twin.scenario_file import BUILTIN_SCENARIOS, load_scenario, parse_scenario
from twin.static import StaticResult, static_speedups
from twin.summary import RunSummary

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
