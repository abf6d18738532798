"""A local S3 emulator (moto's server) as storage that outlives the embedded broker.

Tansu's memory storage loses every topic, record and group offset when the broker stops, and
this Tansu build has no sqlite or postgres storage. Its `s3://` storage against an S3
emulator in a process of its own keeps them while the broker stops and starts again, so a
broker stopped and started on the same storage is a broker restart (soak and restart
benches). Moto, because Tansu keeps producer ids and group offsets in shared objects that it
updates with conditional writes: s3rver ignores the conditions, and two idempotent producers
on it fail every send after their first (the same producer id handed to both).
The emulator keeps the objects in its memory and listens on loopback only.

    with S3Emulator() as s3:
        broker = EmbeddedBroker(storage=s3.storage_url, storage_env=s3.env)

moto's server is found in TABLETUNE_MOTO_SERVER, on PATH, or in a virtual environment of its
own under ~/.cache/tabletune/moto (its dependencies are not the project's): set that up once
with the command the missing-server error prints. Nothing is installed at run time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tabletune.broker import HOST, BrokerError, free_port, stop_process

MOTO_REQUIREMENT = "moto[server]>=5.1"
CACHE = Path.home() / ".cache" / "tabletune" / "moto"
BUCKET = "tansu"


def ensure_moto_server() -> str:
    """Path of moto's server executable: TABLETUNE_MOTO_SERVER, else on PATH, else CACHE's
    venv. Never installed at run time (no downloads while running): the error says how."""
    configured = os.environ.get("TABLETUNE_MOTO_SERVER")
    if configured:
        return configured
    cached = CACHE / "bin" / "moto_server"
    found = shutil.which("moto_server") or (str(cached) if cached.exists() else None)
    if found:
        return found
    raise BrokerError(f"moto_server not found: python -m venv {CACHE} && {CACHE}/bin/pip "
                      f"install '{MOTO_REQUIREMENT}' (or set TABLETUNE_MOTO_SERVER)")


@dataclass
class S3Emulator:
    """moto's S3 on 127.0.0.1 with the bucket Tansu uses; its objects live until `stop`."""

    port: int | None = None
    ready_timeout_s: float = 30.0
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def storage_url(self) -> str:
        return f"s3://{BUCKET}/"

    @property
    def endpoint(self) -> str:
        if self.port is None:
            raise BrokerError("the S3 emulator has not been started")
        return f"http://{HOST}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What Tansu needs to reach it (moto takes any credentials)."""
        return {"AWS_ENDPOINT": self.endpoint, "AWS_ALLOW_HTTP": "true",
                "AWS_ACCESS_KEY_ID": "tabletune", "AWS_SECRET_ACCESS_KEY": "tabletune",
                "AWS_DEFAULT_REGION": "us-east-1"}

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> S3Emulator:
        if self._process is not None:
            return self
        self.port = self.port or free_port()
        self._process = subprocess.Popen(
            [ensure_moto_server(), "-H", HOST, "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            start_new_session=True)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code = self._process.returncode
                self._process = None
                raise BrokerError(f"moto_server exited with code {code} before listening")
            try:
                request = urllib.request.Request(  # noqa: S310 (http on loopback)
                    f"{self.endpoint}/{BUCKET}", method="PUT")
                with urllib.request.urlopen(request, timeout=2):  # noqa: S310 (loopback)
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise BrokerError(f"moto_server did not serve on {HOST}:{self.port} "
                          f"within {self.ready_timeout_s} s")

    def stop(self, timeout_s: float = 5.0) -> None:
        process, self._process = self._process, None
        stop_process(process, timeout_s)

    def __enter__(self) -> S3Emulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
