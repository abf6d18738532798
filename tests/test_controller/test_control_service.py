"""The production loop end to end on a real broker: `tabletune control` and a fleet of twin
engines whose tables come only from the tables topic."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest
from kafka.admin import KafkaAdminClient, NewTopic

import controller.fleet.runner as runner_module
from controller.engine.follower import TableFeed
from controller.engine.table_switch import TableSwitch
from controller.fleet.ownership_config import SLOTS
from controller.fleet.runner import ControlRunConfig, ControlRunner
from controller.fleet.table_log import TABLES_TOPIC_CONFIG, read_topic
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from fitter.derive import fit_table
from fitter.engine_consensus import with_screening
from fitter.surface.latency_memory import LatencyCells
from schemas import DraftTable, TableControl, TableEnvelope, TableKey, parse_table_message
from schemas.settings import Settings, TopicNames
from tabletune.twin_fleet import Fleet, FleetConfig
from tests.kafka_helpers import wait_for
from tests.test_controller.test_closed_loop import EAGLE, NGRAM_POOR_CHAT, ngram_chat_to_code
from twin.config import DrafterConfig, EngineConfig, PhaseConfig, Scenario

SPEEDUP = 10.0


def jump(c8_s: float = 70.0, c64_s: float = 100.0) -> Scenario:
    """EAGLE, 8 users then 64."""
    phases = [PhaseConfig(name="c8", duration_s=c8_s, concurrency=8, acceptance=EAGLE,
                          prompt_len=355, output_len=300)]
    if c64_s:
        phases.append(PhaseConfig(name="c64", duration_s=c64_s, concurrency=64,
                                  acceptance=EAGLE, prompt_len=355, output_len=300))
    return Scenario(seed=6, engine=EngineConfig(max_num_seqs=128),
                    drafter=DrafterConfig(method="eagle"), phases=tuple(phases))


KEY = TableKey("llama-3.1-8b-instruct", "eagle", "twin-h100")
NGRAM_KEY = TableKey("llama-3.1-8b-instruct", "ngram", "twin-h100")


@pytest.fixture
def settings(topic_settings) -> Settings:
    return topic_settings


def tables_log(settings: Settings) -> list[Any]:
    return [parse_table_message(m.value) for m in read_topic(
        settings, settings.topics.tables, idle_polls=2, timeout_s=10)]


def status_events(settings: Settings) -> list[dict[str, Any]]:
    return [json.loads(m.value) for m in read_topic(
        settings, settings.topics.status, idle_polls=2, timeout_s=10)]


class ControlProcess:
    """`tabletune control` as its own process, on the test's topics."""

    def __init__(self, settings: Settings, log_path: Any) -> None:
        self.env = {**os.environ, "TABLETUNE_BOOTSTRAP": ",".join(settings.bootstrap_servers),
                    "TABLETUNE_TOPIC_TELEMETRY": settings.topics.telemetry,
                    "TABLETUNE_TOPIC_TABLES": settings.topics.tables,
                    "TABLETUNE_TOPIC_STATUS": settings.topics.status,
                    "TABLETUNE_TOPIC_DLQ": settings.topics.dlq,
                    "TABLETUNE_TOPIC_OWNERSHIP": settings.topics.ownership}
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> ControlProcess:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tabletune.cli", "--verbose", "control",
             "--duration-s", "300", "--decisions", str(self.log_path) + ".decisions"],
            env=self.env, stdout=subprocess.DEVNULL,
            stderr=open(self.log_path, "w"))
        assert wait_for(lambda: "ready:" in self.log_path.read_text(), 60), self.log()
        return self

    def decisions_path(self) -> Any:
        return self.log_path.with_name(self.log_path.name + ".decisions")

    def log(self) -> str:
        decisions = self.decisions_path()
        return self.log_path.read_text() + (decisions.read_text() if decisions.exists() else "")

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def __enter__(self) -> ControlProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def test_a_cold_fleet_is_profiled_then_gets_its_first_table(settings, tmp_path):
    # the cold profile takes ~35 virtual s; 90 s leaves the fit and the publish 5 s of wall
    # time even on a loaded machine (60 s missed the apply once, beside two benches)
    fleet = Fleet(jump(c8_s=90.0, c64_s=0.0), settings,
                  FleetConfig(engines=2, speedup=SPEEDUP))
    with ControlProcess(settings, tmp_path / "control.log") as control:
        result = fleet.start().join()
    assert "(profiling)" in control.log()
    envelopes = [m for m in tables_log(settings) if isinstance(m, TableEnvelope)]
    assert envelopes and envelopes[0].version == 1 and envelopes[0].key == KEY
    assert envelopes[0].provenance["reason"] == "profile"
    forces = [m for m in tables_log(settings) if isinstance(m, TableControl)
              and m.action == "force"]
    assert {k for m in forces for k in m.table.k_values} == set(range(8))  # every K
    assert all(not m.targets for m in forces)  # a cold profile forces every engine
    for engine in fleet.engines:
        assert engine.engine.switch.version == envelopes[-1].version
        assert not engine.engine.switch.forced
    for summary in result["engines"].values():
        assert set(summary["k_share"]) == {str(k) for k in range(8)}
    applied = [e for e in status_events(settings)
               if e["event"] == "applied" and e["version"] == 1]
    assert {e["engine_id"] for e in applied} == {e.engine_id for e in fleet.engines}


def test_a_drift_reprofiles_a_canary_and_a_late_engine_gets_the_current_table(settings,
                                                                               tmp_path):
    # n-gram chat -> code: acceptance beyond the table's K moves, which live steps censor,
    # so only a re-profile sees it (a load jump a pooled periodic refit may fix first); a
    # chat whose table drafts below the largest K, which would censor nothing
    fleet = Fleet(ngram_chat_to_code(code_s=180, chat=NGRAM_POOR_CHAT), settings,
                  FleetConfig(engines=4, speedup=SPEEDUP))
    with ControlProcess(settings, tmp_path / "control.log") as control:
        fleet.start()
        # an engine that joins once the fleet has a table reads the log and runs it
        assert wait_for(lambda: any(isinstance(m, TableEnvelope)
                                    for m in tables_log(settings)), 90), control.log()
        late = TableSwitch(DraftTable.from_vllm([[1, 128, 3]]), max_k=7, max_batch=128)
        status = StatusPublisher(settings, "late-engine", str(NGRAM_KEY))
        feed = TableFeed(settings, late, EngineLimits(NGRAM_KEY, frozenset(range(8)), 128),
                         status,
                         explore_share=0.0).start()
        try:
            def applied_late() -> bool:
                late.apply_staged()
                return late.version >= 1
            assert wait_for(applied_late, 20)
        finally:
            feed.stop()
            status.close()
        fleet.join()
    log = tables_log(settings)
    stale = [e for e in status_events(settings)
             if e["event"] == "stale" and e["engine_id"] == "tabletune-control"]
    assert stale, control.log()
    canary_forces = [m for m in log if isinstance(m, TableControl) and m.action == "force"
                     and m.targets]
    assert canary_forces, control.log()
    targets = canary_forces[0].targets
    assert len(targets) == 1  # 25% of four engines
    assert all(m.targets == targets for m in canary_forces)
    decisions = control.log()
    versions = [m.version for m in log if isinstance(m, TableEnvelope)]
    assert versions == sorted(set(versions)) and len(versions) >= 2
    after = [m for m in log if isinstance(m, TableEnvelope)
             and m.provenance.get("reason") == "stale"]
    assert after, decisions
    # a probe, not a sweep: acceptance rose, so its first block runs the largest K, and the
    # three engines off the canary run the stale table until the probe's table comes
    forced_k = [m.table.k_for(1) for m in canary_forces]
    assert forced_k[0] == 7 and len(forced_k) < 8, forced_k
    assert not [m for m in log if isinstance(m, TableEnvelope)
                and m.provenance.get("reason") == "interim"], decisions
    for engine in fleet.engines:  # every engine ends on the newest table, none forced
        assert engine.engine.switch.version == versions[-1]
        assert not engine.engine.switch.forced


def test_a_killed_control_leaves_no_engine_forced_and_its_restart_goes_on(settings, tmp_path):
    # code_s: room after the kill and the force's expiry for the restart to serve live steps,
    # even when a busy machine slows the restarted process's start-up
    # three engines (a canary of one, as of four): the fleet's steps are this test's time
    fleet = Fleet(ngram_chat_to_code(code_s=250, chat=NGRAM_POOR_CHAT), settings,
                  FleetConfig(engines=3, speedup=SPEEDUP))
    first = ControlProcess(settings, tmp_path / "control-1.log").start()
    second = ControlProcess(settings, tmp_path / "control-2.log")
    try:
        fleet.start()

        def canary_forced() -> bool:
            return any(isinstance(m, TableControl) and m.action == "force" and m.targets
                       for m in tables_log(settings))
        assert wait_for(canary_forced, 150), first.log()
        first.kill()
        # the decisions file is written as they are taken: the kill leaves them all
        taken = [json.loads(line) for line in first.decisions_path().read_text().splitlines()]
        assert {"profile", "stage", "stale"} <= {d["what"] for d in taken}, taken
        assert all(d["key"] == str(NGRAM_KEY) for d in taken), taken
        killed_at = max(m.version for m in tables_log(settings)
                        if isinstance(m, TableEnvelope))
        # the force's expiry (its block + LoopConfig.force_grace_s, 30 virtual seconds)
        assert wait_for(lambda: not any(e.engine.switch.forced for e in fleet.engines), 60)
        second.start()
        assert wait_for(lambda: "(live)" in second.log(), 120), second.log()
        fleet.join()
    finally:
        first.stop()
        second.stop()
    log = tables_log(settings)
    versions = [m.version for m in log if isinstance(m, TableEnvelope)]
    assert versions == sorted(set(versions))  # no duplicate, no regressing version
    assert max(versions) >= killed_at
    restart = second.log()
    assert "(live)" in restart and "(profiling)" not in restart, restart  # from the topics
    assert '"what": "resume"' in restart
    # the latency the first measured outlives it: the restart starts from its last snapshot
    resumed = next(d for d in map(json.loads, second.decisions_path().read_text().splitlines())
                   if d["what"] == "resume")
    published = [e for e in status_events(settings) if e["event"] == "latency_knowledge"
                 and e["clock_s"] <= resumed["t_s"]]
    assert published and {e["table_key"] for e in published} == {str(NGRAM_KEY)}, published
    cells = LatencyCells.from_json(published[-1]["cells"])
    assert len(cells) > 0 and resumed["knowledge_cells"] == len(cells), (resumed, len(cells))
    assert resumed["regimes"] == len(published[-1]["regimes"]) >= 1, resumed  # the profile's


def test_a_service_started_before_the_telemetry_topic_serves_it_once_created(
        broker, unique_name, caplog, monkeypatch):
    """Kafka says an unknown topic has no partitions: the service waits for the telemetry
    topic (saying so) instead of reading nothing from it for good."""
    names = TopicNames(telemetry=f"{unique_name}.telemetry", tables=f"{unique_name}.tables",
                       status=f"{unique_name}.status", dlq=f"{unique_name}.dlq",
                       ownership=f"{unique_name}.ownership")
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic(names.tables, 1, 1, topic_configs=dict(TABLES_TOPIC_CONFIG)),
                         NewTopic(names.status, 1, 1), NewTopic(names.dlq, 1, 1),
                         NewTopic(names.ownership, SLOTS, 1)])
    settings = Settings(bootstrap_servers=(broker.bootstrap,), topics=names)
    monkeypatch.setattr(runner_module, "TOPIC_WAIT_LOG_S", 0.0)
    caplog.set_level(logging.INFO, logger=runner_module.__name__)
    runner = ControlRunner(settings, with_screening(fit_table),
                           config=ControlRunConfig(lookback_s=0))
    serving = threading.Thread(target=runner.run, kwargs={"timeout_s": 300})
    serving.start()
    try:
        assert wait_for(lambda: f"topic {names.telemetry} has no partitions yet" in caplog.text,
                        30)
        admin.create_topics([NewTopic(names.telemetry, 4, 1)])
        assert wait_for(lambda: "ready:" in caplog.text, 60)  # lookback_s=0: what comes next
        fleet = Fleet(jump(c8_s=30.0, c64_s=0.0), settings,
                      FleetConfig(engines=1, speedup=SPEEDUP))
        fleet.start()
        assert wait_for(lambda: runner.records > 0, 60)
        fleet.join()
    finally:
        admin.close()
        runner.stop()
        serving.join(timeout=60)
    assert not serving.is_alive()
    assert runner.service.loop(KEY) is not None  # its key is served
