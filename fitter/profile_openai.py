"""Profile a vLLM server through its OpenAI-compatible completions API.

What works: a closed-loop load driver (N client threads, each sending the next completion as
soon as the previous one returns) at each concurrency level, then a fit of the telemetry the
server's TableTune hook produced meanwhile (read from the Parquet dataset that `tabletune
ingest` writes) into a first table.

What does not yet: forcing K. A server's K can only change through its controller, which
today applies fitted tables only; until the controller honours a *forced* table on the tables
topic (and stamps `forced` on the steps), the sweep cannot choose (concurrency, K) cells and
every step runs the server's startup table. The fit then sees one K per batch size and must
extrapolate (as a refit does), which is why this path only spreads the budget over load levels.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fitter.dataset import read_dataset
from fitter.derive import DEFAULT_TOLERANCE
from fitter.profile_plan import Cell, concurrency_levels
from fitter.profile_twin import CellRun, ProgressCallback
from fitter.refit import key_from_records

GENERATED_PROMPTS = tuple(
    f"Write a detailed, step-by-step explanation of topic number {i}: how a compiler turns "
    f"source code into machine code, with examples." for i in range(64))
DEFAULT_MAX_TOKENS = 256


class ClosedLoopClient:
    """`concurrency` threads posting completions back to back until `stop_at` (monotonic)."""

    def __init__(self, url: str, *, model: str, prompts: Sequence[str],
                 max_tokens: int = DEFAULT_MAX_TOKENS, timeout_s: float = 120.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"openai:{url}: expected an http:// or https:// URL")
        self.url = url.rstrip("/") + "/v1/completions"
        self.model = model
        self.prompts = list(prompts) or list(GENERATED_PROMPTS)
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.completed = 0
        self.tokens = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def run(self, concurrency: int, duration_s: float) -> None:
        stop_at = time.monotonic() + duration_s
        threads = [threading.Thread(target=self._loop, args=(i, stop_at), daemon=True)
                   for i in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=duration_s + self.timeout_s)

    def _loop(self, worker: int, stop_at: float) -> None:
        n = worker
        while time.monotonic() < stop_at:
            prompt = self.prompts[n % len(self.prompts)]
            n += 1
            body = json.dumps({"model": self.model, "prompt": prompt,
                               "max_tokens": self.max_tokens, "temperature": 0.0}).encode()
            request = urllib.request.Request(  # noqa: S310 (scheme checked in __init__)
                self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310
                    usage = json.loads(response.read()).get("usage", {})
            except (urllib.error.URLError, OSError, ValueError) as exc:
                with self._lock:
                    self.errors.append(str(exc))
                if len(self.errors) > 20:
                    return
                time.sleep(0.5)
                continue
            with self._lock:
                self.completed += 1
                self.tokens += int(usage.get("completion_tokens", 0))


def served_model(url: str) -> str:
    """The first model the server lists (`/v1/models`)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"openai:{url}: expected an http:// or https:// URL")
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=10) as response:  # noqa: S310
        models = json.loads(response.read()).get("data", [])
    if not models:
        raise ValueError(f"{url} serves no model")
    return str(models[0]["id"])


def profile_openai(url: str, *, max_k: int | None, budget_s: float,
                   out_dir: str | Path | None, cells: int, concurrencies: Sequence[int],
                   tolerance: float = DEFAULT_TOLERANCE, version: int = 1,
                   on_progress: ProgressCallback | None = None, model: str | None = None,
                   prompts: str | None = None, parquet: str | None = None,
                   max_batch: int = 256) -> Any:
    """Drive each load level for an equal share of `budget_s` (wall time), then fit the
    server's telemetry from `parquet`; see the module docstring for what is missing."""
    from fitter.profile import ProfileError, ProfileResult, envelope_from_records, write_table

    if parquet is None:
        raise ProfileError("openai: the fit needs the server's telemetry: run the server "
                           "with the TableTune hook, `tabletune ingest --out DIR`, and pass "
                           "--parquet DIR")
    prompt_list = (Path(prompts).read_text().splitlines() if prompts else GENERATED_PROMPTS)
    client = ClosedLoopClient(url, model=model or served_model(url),
                              prompts=[p for p in prompt_list if p.strip()])
    loads = concurrency_levels(max_batch, concurrencies)
    started = time.monotonic()
    began = dt.datetime.now(dt.UTC)
    runs: list[CellRun] = []
    share = budget_s / len(loads)
    for load in loads:
        at = time.monotonic() - started
        run = CellRun(Cell(load, -1), at, at, float("nan"), -1)
        if on_progress is not None:
            on_progress(at, run)
        client.run(load, share)
        runs.append(CellRun(run.cell, at, time.monotonic() - started, run.score, -1))
    if client.completed == 0:
        raise ProfileError(f"openai:{url}: no completion succeeded "
                           f"({client.errors[-1] if client.errors else 'no error recorded'})")
    time.sleep(2.0)  # let the hook's last frames reach the ingest job
    records = read_dataset(parquet, since=dt.datetime.now(dt.UTC) - began)
    key = key_from_records(records)
    top_k = max_k if max_k is not None else int(records["k_next"].max())  # type: ignore[arg-type]
    envelope = envelope_from_records(
        records, key=key, max_k=top_k, max_batch=max_batch,
        startup_k_values=tuple(range(top_k + 1)), version=version, tolerance=tolerance,
        provenance={"source": "profile", "engine": f"openai:{url}", "forced_k": False,
                    "completions": client.completed})
    result = ProfileResult(envelope=envelope, cells=runs,
                           engine_time_s=time.monotonic() - started,
                           wall_s=time.monotonic() - started, records=records.height)
    if out_dir is not None:
        result.path = write_table(envelope, out_dir)
    return result
