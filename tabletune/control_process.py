"""`tabletune control` as a child process: the command an operator runs, on a caller's broker.

The demo and the fleet benchmark start it this way so that what they show is the deployed
service, not a copy of its loop inside the caller's process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from controller.fleet.decisions import Decision
from tabletune.broker import stop_process

READY_TIMEOUT_S = 90.0
"""Start-up reads the tables and status topics and imports the fitter: seconds on a busy
2-core machine, never a minute and a half."""
STOP_TIMEOUT_S = 60.0
"""SIGTERM releases held forces and closes the decisions file before exiting."""


class ControlProcessError(RuntimeError):
    """`tabletune control` exited, or never said it was ready; the message holds its log."""


class ControlProcess:
    """Runs `tabletune --verbose control --decisions FILE` with `env` until the block ends."""

    def __init__(self, env: Mapping[str, str], work_dir: Path,
                 args: Sequence[str] = (), ready_timeout_s: float = READY_TIMEOUT_S,
                 niceness: int = 0) -> None:
        self.env = {**os.environ, **env}
        self.niceness = niceness
        """Added to the service's nice value: where it shares the cores of the server it
        tunes, which a deployment would not, it takes what the server leaves."""
        self.ready_timeout_s = ready_timeout_s
        """Longer where it starts beside a vLLM server's start-up (three processes importing
        torch on the same cores)."""
        self.log_path = work_dir / "control.log"
        self.decisions_path = work_dir / "decisions.jsonl"
        self.summary_path = work_dir / "control-summary.json"
        self.args = list(args)
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ControlProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.decisions_path.unlink(missing_ok=True)
        with open(self.log_path, "w") as log, open(self.summary_path, "w") as summary:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tabletune.cli", "--verbose", "control",
                 "--decisions", str(self.decisions_path), *self.args],
                env=self.env, stdout=summary, stderr=log)
        if self.niceness:  # before the interpreter starts its threads, which inherit it
            pid = self._process.pid
            os.setpriority(os.PRIO_PROCESS, pid,
                           min(os.getpriority(os.PRIO_PROCESS, pid) + self.niceness, 19))
        deadline = time.monotonic() + self.ready_timeout_s
        while "ready:" not in self.log_path.read_text():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ControlProcessError(
                    f"tabletune control did not start:\n{self.log_path.read_text()}")
            time.sleep(0.2)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        """The service's process id (None before the block starts it)."""
        return None if self._process is None else self._process.pid

    def stop(self) -> None:
        stop_process(self._process, STOP_TIMEOUT_S)

    def exited(self) -> bool:
        """Whether the service has exited (or never started)."""
        return self._process is None or self._process.poll() is not None

    def kill(self) -> None:
        """kill -9: no release of its forces, no exit summary (a crash, for failover)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=STOP_TIMEOUT_S)

    def decisions(self) -> list[Decision]:
        """Every decision of every key's loop, in the order the service took them. Whole
        lines only: the service may be writing one now, or have been killed in one."""
        if not self.decisions_path.exists():
            raise ControlProcessError(
                f"tabletune control wrote no decisions:\n{self.log_path.read_text()}")
        whole = self.decisions_path.read_text().split("\n")[:-1]
        return [Decision.from_dict(json.loads(line)) for line in whole if line]

    def summary(self) -> dict[str, Any]:
        """The service's exit line (records, errors, each key's state, `cpu_s`, `wall_s`)."""
        try:
            summary = json.loads(self.summary_path.read_text())
        except (OSError, ValueError) as exc:
            raise ControlProcessError(
                f"tabletune control wrote no exit summary ({exc}):\n"
                f"{self.log_path.read_text()}") from exc
        if not isinstance(summary, dict):
            raise ControlProcessError(f"tabletune control's exit summary is not an object: "
                                      f"{summary!r}")
        return summary
