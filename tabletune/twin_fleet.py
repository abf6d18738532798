"""`tabletune twin fleet`: N twin engines with a real engine's TableTune parts, over a broker.

Each engine is a `TwinEngine` paced at `speedup` times real time, in its own thread, with
the components a vLLM engine runs: a `StepRecorder` into a `KafkaSink` (the telemetry
topic), and a `TableFeed` that follows the tables topic and stages into the engine's
`TableSwitch`. Nothing else gives an engine a table: with `tabletune control` running on the
same broker this is the whole production loop, on twin engines. Engine i runs the scenario
with seed + i and engine id `<engine_id>-<i>`; virtual time 0 is the fleet's start, so its
records carry wall-clock-like timestamps running `speedup` times faster.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from controller.engine.follower import TableFeed
from controller.fleet.channel import clock_time
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from controller.vllm_compat import check_with_vllm
from producers.identity import EngineIdentity
from producers.kafka_sink import KafkaSink
from producers.recorder import RecorderConfig, StepRecorder
from schemas import DraftTable, TableKey
from schemas.settings import Settings
from twin.config import Scenario
from twin.policies import VLLM_DOC_TABLE, Policy
from twin.run import build_engine, phase_spans
from twin.scenario_file import load_scenario
from twin.summary import summarize

MIN_FRAME_INTERVAL_S = 0.02
"""Wall seconds between an engine's telemetry frames at most speedups: below this, Kafka
messages per second, not the engines, would fill the machine."""


class FollowTables(Policy):
    """A fleet engine's policy: start on the startup table, then whatever the feed stages."""

    name = "tables-topic"

    def __init__(self, startup: DraftTable = VLLM_DOC_TABLE) -> None:
        self.startup = startup

    def initial_table(self, *, max_k: int, max_batch: int) -> tuple[DraftTable, int]:
        return DraftTable.from_dense([min(k, max_k) for k in self.startup.to_dense(max_batch)]), 0


@dataclasses.dataclass(frozen=True, slots=True)
class FleetConfig:
    engines: int = 4
    speedup: float = 10.0
    """Virtual seconds per wall second."""
    explore_share: float = 0.02
    duration_s: float | None = None
    """Virtual seconds (default: the scenario's)."""

    def __post_init__(self) -> None:
        if not 1 <= self.engines <= 64:
            raise ValueError(f"engines={self.engines} must be in 1..64")
        if not 0 < self.speedup <= 1000:
            raise ValueError(f"speedup={self.speedup} must be in (0, 1000]")
        if not 0 <= self.explore_share < 0.5:
            raise ValueError(f"explore_share={self.explore_share} must be in [0, 0.5)")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration_s={self.duration_s} must be > 0")


class Fleet:
    """The engines of one `run_fleet`, for callers that watch them while they run."""

    def __init__(self, scenario: Scenario | str | Path, settings: Settings,
                 config: FleetConfig | None = None) -> None:
        self.config = config or FleetConfig()
        settings.require_bootstrap()
        self.scenario = (load_scenario(scenario) if not isinstance(scenario, Scenario)
                         else scenario)
        self.settings = settings
        self.engines: list[_FleetEngine] = []
        self.epoch_s = 0.0
        """Wall time of virtual second 0, set by `start`."""
        self._threads: list[threading.Thread] = []

    def start(self) -> Fleet:
        check_with_vllm(VLLM_DOC_TABLE)  # loads vLLM's validator now, not mid-run
        epoch_s = self.epoch_s = time.time()
        self.engines = [_FleetEngine(engine_scenario(self.scenario, i), self.settings, self.config,
                                     epoch_s) for i in range(self.config.engines)]
        self._threads = [threading.Thread(target=run.run, name=f"twin-{i}", daemon=True)
                         for i, run in enumerate(self.engines)]
        for thread in self._threads:
            thread.start()
        return self

    @property
    def running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    @property
    def clock_s(self) -> float:
        """The virtual time every engine has reached."""
        return min((run.engine.clock_s for run in self.engines), default=0.0)

    def join(self) -> dict[str, Any]:
        for thread in self._threads:
            thread.join()
        failed = [run.error for run in self.engines if run.error is not None]
        if failed:
            raise failed[0]
        engines = {run.engine_id: run.summary for run in self.engines}
        return {"scenario": self.scenario.name, "policy": "tables-topic",
                "speedup": self.config.speedup, "epoch_s": self.epoch_s, "engines": engines,
                "timeline": _fleet_timeline(self.engines),
                "output_tokens_per_s": float(np.mean([s["output_tokens_per_s"]
                                                      for s in engines.values()]))}


def run_fleet(scenario: Scenario | str | Path, settings: Settings,
              config: FleetConfig | None = None) -> dict[str, Any]:
    """Run the fleet to the scenario's end; the `twin run --json` summary per engine under
    `engines`, and the fleet-mean output tokens/s per virtual second under `timeline`."""
    return Fleet(scenario, settings, config).start().join()


def engine_scenario(scenario: Scenario, index: int) -> Scenario:
    """What fleet engine `index` runs: the scenario at seed + index, engine id `<id>-<index>`."""
    engine = dataclasses.replace(scenario.engine, engine_id=f"{scenario.engine.engine_id}-{index}")
    return dataclasses.replace(scenario, engine=engine, seed=scenario.seed + index)


class _FleetEngine:
    def __init__(self, scenario: Scenario, settings: Settings, config: FleetConfig,
                 epoch_s: float) -> None:
        limits = scenario.engine
        self.engine_id = limits.engine_id
        identity = EngineIdentity(engine_id=limits.engine_id, model=limits.model,
                                  drafter=scenario.drafter.method, hardware=limits.hardware)
        self.sink = KafkaSink(settings)
        self.engine, _, self.policy = build_engine(
            scenario, FollowTables(), duration_s=config.duration_s, realtime=True,
            speedup=config.speedup, epoch_s=epoch_s)
        # frames as often in virtual time as a real engine's are in wall time (0.1 s): the
        # control service's clock advances by frames, and its shortest block is 1 s
        frames = RecorderConfig(frame_interval_s=max(MIN_FRAME_INTERVAL_S,
                                                     RecorderConfig().frame_interval_s
                                                     / config.speedup))
        self.engine.recorder = StepRecorder(identity, self.sink, max_k=limits.max_k,
                                            config=frames)
        key = TableKey(identity.model, identity.drafter, identity.hardware)
        engine_limits = EngineLimits(key, frozenset(range(limits.max_k + 1)),
                                     limits.max_num_seqs)
        self.status = StatusPublisher(settings, limits.engine_id, str(key))
        engine = self.engine
        self.feed = TableFeed(settings, engine.switch, engine_limits, self.status,
                              explore_share=config.explore_share,
                              clock=lambda: clock_time(epoch_s + engine.clock_s))
        self.summary: dict[str, Any] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        self.feed.start()
        try:
            log = self.engine.run(self.policy)
            end_s = self.engine.end_s
            self.summary = summarize(log, policy=self.policy.describe(),
                                     scenario=self.engine.scenario.name, duration_s=end_s,
                                     phase_spans=phase_spans(self.engine, end_s)).to_dict()
        except BaseException as exc:  # reported by run_fleet, not lost in a thread
            self.error = exc
        finally:
            assert self.engine.recorder is not None
            self.engine.recorder.close(timeout_s=30.0)
            self.feed.stop()
            self.status.close()


def _fleet_timeline(runs: list[_FleetEngine]) -> list[list[float]]:
    """[t_s, fleet-mean output tokens/s] per virtual second, from every engine's steps."""
    seconds = int(np.ceil(max(run.engine.end_s for run in runs)))
    rates = np.zeros(seconds)
    for run in runs:
        log = run.engine.log
        ends = np.asarray(log.step_start_s) + np.asarray(log.step_latency_s)
        index = np.minimum(ends.astype(np.int64), seconds - 1)
        rates += np.bincount(index, weights=np.asarray(log.emitted, dtype=np.float64),
                             minlength=seconds)[:seconds]
    rates /= len(runs)
    return [[float(t), round(float(rate), 3)] for t, rate in enumerate(rates)]
