"""One arm of `bench.real_serving`: a fresh server, its table, vLLM's client, phase by phase.

Fixed and static arms publish a `force` of their table on the tables topic before the
server starts (the engine folds it while it reads the topic, and says `forced`); the load
begins once it is staged. A `stock:K` arm (the hook A/B's reference) runs vLLM's own
scheduler with K as its startup table, and sends no telemetry. The `tabletune` arm starts
`tabletune control` for its key instead, and the key is cold: every arm's engine has its own
hardware name, so its own key.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.serving_plan import (
    Phase,
    Slot,
    arm_table,
    client_argv,
    is_stock,
    phase_seconds,
    speed_of,
)
from bench.serving_server import HEALTH_TIMEOUT_S, REPO, ModelSetup, Server, engine_environment
from controller.fleet.decisions import Decision
from controller.fleet.table_log import force, publish, read_topic
from schemas import DraftTable, TableKey
from schemas.control import MAX_FORCE_S
from schemas.settings import Settings
from tabletune.broker import free_port
from tabletune.control_process import ControlProcess, ControlProcessError

CLIENT_READY_TIMEOUT_S = 120.0
FORCED_TIMEOUT_S = 60.0
CONTROL_NICENESS = 10
"""The control service runs beside the server it tunes on the bench's 2 cores, where it took
3-6% of a core; a deployment runs it off the serving hosts, so here it yields to them."""


class ArmError(RuntimeError):
    """The arm could not run (server, client or control service); the message says which."""


@dataclass(frozen=True, slots=True)
class ArmContext:
    """What every arm shares: the model, the broker, where files go, the phase lengths."""

    setup: ModelSetup
    startup_table: list[list[int]]
    settings: Settings
    bootstrap: str
    hardware: str
    out_dir: Path
    cache_dir: Path
    phases: tuple[Phase, ...]
    lead_s: float
    """Seconds of each phase before its measured window, the same for every arm."""
    measure_s: float
    """Seconds of each phase's measured window it is sized for."""
    control_args: tuple[str, ...] = ()
    probe: bool = True
    """Probe a phase's speed before its first run (off: size from `Phase.expected_tok_s`)."""
    speeds: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per phase, `tok_s` and `drain_s` (serving_plan.speed_of): the first probe's, then the
    fastest arm's tokens/s and the longest drain so far (what a later phase of another
    shape, such as serving_ngram_ab's budget part, is sized with)."""
    prompts: dict[str, int] = field(default_factory=dict)
    """Per phase, the prompt count of the first arm that ran it: every later arm runs the
    same requests (serving_plan)."""


@dataclass
class ArmRun:
    slot: Slot
    key: str
    engine_id: str
    table: list[list[int]] | None
    phases: list[dict[str, Any]] = field(default_factory=list)
    """Per phase: name, target seconds, the probe (first arm), prompts, client times
    (`called`, `started`, `ended`), the result file."""
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per phase: vLLM's client result JSON, as it saved it."""
    server_start_s: float | None = None
    wall_s: float | None = None
    control_dir: Path | None = None
    control_decisions: list[Decision] = field(default_factory=list)
    """`tabletune` arms: the control service's decisions, in the order it took them."""
    control_summary: dict[str, Any] = field(default_factory=dict)
    """`tabletune` arms: the control service's exit summary."""


def run_arm(ctx: ArmContext, slot: Slot) -> ArmRun:
    setup = ctx.setup
    hardware = f"{ctx.hardware}.{slot.slug}"
    key = TableKey(setup.served_name, setup.drafter, hardware)
    run = ArmRun(slot, str(key), f"real-serving-{slot.slug}",
                 arm_table(slot.arm, setup.max_num_seqs, setup.max_k))
    run_dir = ctx.out_dir / "runs" / slot.slug
    run_dir.mkdir(parents=True, exist_ok=True)
    stock = is_stock(slot.arm)
    env = arm_environment(ctx, setup, None if stock else (run.engine_id, hardware))
    started = time.monotonic()
    forced = run.table is not None and not stock
    if forced:
        publish(ctx.settings, force(key, DraftTable.from_vllm(run.table),
                                    hold_s=MAX_FORCE_S - 60, issued_by="bench.real_serving"))
    server = Server(setup, run.table if stock else ctx.startup_table, free_port(), env,
                    run_dir / "server.log", hook=not stock)
    plan = []
    for i, phase in enumerate(ctx.phases):
        common = {"base_url": server.url, "model": setup.served_name,
                  "tokenizer": str(setup.target), "result_dir": str(run_dir / "client")}
        speed = ctx.speeds.get(phase.name)
        seconds = phase_seconds(ctx.lead_s, ctx.measure_s, speed)
        probe = ctx.probe and phase.name not in ctx.prompts
        if not ctx.probe:
            ctx.prompts.setdefault(phase.name, phase.num_prompts(seconds))
        # a probed phase's count is the client's to set (it replaces this one)
        prompts = ctx.prompts.get(phase.name, phase.probe_prompts)
        entry: dict[str, Any] = {"name": phase.name, "argv": client_argv(
            phase, prompts=prompts, result_file=f"{phase.name}.json",
            warmups=int(i == 0 and not probe), **common)}
        if probe:
            entry["probe"] = {"argv": client_argv(phase, prompts=phase.probe_prompts,
                                                  result_file=None, warmups=int(i == 0),
                                                  **common),
                              "phase": asdict(phase), "lead_s": ctx.lead_s,
                              "measure_s": ctx.measure_s}
        plan.append(entry)
        run.phases.append({"name": phase.name, "target_s": seconds,
                           "result_file": f"{phase.name}.json"})
    (run_dir / "client-plan.json").write_text(json.dumps({"phases": plan}, indent=1))
    control = None
    client = Client(run_dir)
    try:
        client.launch(run_dir / "client-plan.json")
        server.launch()
        if slot.arm == "tabletune":
            run.control_dir = run_dir / "control"
            control = ControlProcess({"TABLETUNE_BOOTSTRAP": ctx.bootstrap}, run.control_dir,
                                     ["--key", str(key), "--lookback-s", "0",
                                      *ctx.control_args], ready_timeout_s=HEALTH_TIMEOUT_S,
                                     niceness=CONTROL_NICENESS)
            control.__enter__()
        run.server_start_s = server.wait_healthy()
        client.wait_ready()
        if forced:
            wait_for_event(ctx.settings, run.engine_id, "forced", FORCED_TIMEOUT_S)
        client.go()
        for kind_, line in client.lines(timeout_s=sum(p["target_s"] for p in run.phases) * 4
                                        + 600):
            entry = next(p for p in run.phases if p["name"] == line["name"])
            if kind_ == "PROBE":
                entry["probe"] = line
                entry["target_s"] = line["seconds"]
                ctx.speeds.setdefault(line["name"], {k: line[k] for k in ("tok_s", "drain_s")})
                ctx.prompts.setdefault(line["name"], line["prompts"])
                continue
            entry.update({k: line[k] for k in ("called", "started", "ended", "prompts")})
            entry["duration_s"] = line["ended"] - line["started"]
            run.results[line["name"]] = json.loads(
                (run_dir / "client" / entry["result_file"]).read_text())
        for name, result in run.results.items():  # later arms: the fastest, longest drain
            now, known = speed_of(result), ctx.speeds.get(name)
            ctx.speeds[name] = now if known is None else {
                "tok_s": max(now["tok_s"], known["tok_s"]),
                "drain_s": max(now["drain_s"], known["drain_s"])}
        if len(run.results) != len(ctx.phases):
            raise ArmError(f"{slot.slug}: the client ran {sorted(run.results)} of "
                           f"{[p.name for p in ctx.phases]}:\n{client.tail()}")
    finally:
        client.stop()
        server.stop()
        if control is not None:
            control.stop()
            _read_control_output(control, run)
    run.wall_s = time.monotonic() - started
    return run


def arm_environment(ctx: ArmContext, setup: ModelSetup,
                    telemetry: tuple[str, str] | None) -> dict[str, str]:
    """A server's environment: the engine's, the model setup's, and with `telemetry`
    (engine id, hardware name) TableTune's broker for telemetry and tables."""
    env = {**engine_environment(ctx.cache_dir, setup.kv_cache_gb), **dict(setup.engine_env)}
    if telemetry is not None:
        engine_id, hardware = telemetry
        env.update({"TABLETUNE_BOOTSTRAP": ctx.bootstrap,
                    "TABLETUNE_SINK": f"kafka://{ctx.bootstrap}",
                    "TABLETUNE_ENGINE_ID": engine_id, "TABLETUNE_HARDWARE": hardware})
    return env


def _read_control_output(control: ControlProcess, run: ArmRun) -> None:
    """What the stopped service wrote; an arm whose service wrote nothing keeps empty ones
    (its checks say what is missing: no profile version, no table applied)."""
    try:
        run.control_decisions = control.decisions()
        run.control_summary = control.summary()
    except ControlProcessError:
        pass


def wait_for_event(settings: Settings, engine_id: str, event: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for payload in status_events(settings):
            if payload.get("engine_id") == engine_id and payload.get("event") == event:
                return payload
        time.sleep(0.5)
    raise ArmError(f"engine {engine_id} said no {event!r} within {timeout_s:.0f} s")


def status_events(settings: Settings) -> list[dict[str, Any]]:
    events = []
    for message in read_topic(settings, settings.topics.status, idle_polls=1, timeout_s=10):
        try:
            events.append(json.loads(message.value))
        except (TypeError, ValueError):
            continue
    return events


class Client:
    """`python -m bench.serving_client PLAN`: stdout lines go to a queue and a log file."""

    def __init__(self, run_dir: Path) -> None:
        self.log_path = run_dir / "client.log"
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._process: subprocess.Popen[str] | None = None

    def launch(self, plan: Path) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.serving_client", str(plan)], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=_client_env())
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        with open(self.log_path, "w") as log:
            for line in self._process.stdout:
                log.write(line)
                log.flush()
                if line.startswith(("READY", "PHASE ", "PROBE ")):
                    self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_ready(self) -> None:
        line = self._next(CLIENT_READY_TIMEOUT_S)
        if line != "READY":
            raise ArmError(f"vLLM's client did not start:\n{self.tail()}")

    def go(self) -> None:
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write("go\n")
        self._process.stdin.flush()

    def lines(self, timeout_s: float) -> Iterator[tuple[str, dict[str, Any]]]:
        """("PROBE" | "PHASE", its JSON) as the client prints them, until it exits."""
        deadline = time.monotonic() + timeout_s
        while (line := self._next(max(deadline - time.monotonic(), 0.1))) is not None:
            kind, _, payload = line.partition(" ")
            yield kind, json.loads(payload)

    def _next(self, timeout_s: float) -> str | None:
        try:
            return self._lines.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def stop(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _client_env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("TABLETUNE_")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1"})
    return env
