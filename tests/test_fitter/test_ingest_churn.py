"""Rolling restarts of `tabletune ingest` (issue 46): two replicas, a third member that joins
and is sent SIGTERM five times mid-traffic, then a batch run that must catch up and exit 0
with every step stored once. Subprocesses on the real broker; waits are on log lines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic

from schemas import encode_frame, records_to_table
from tests.kafka_helpers import wait_until
from tests.test_fitter.test_ingest_hardening import _raw_keys
from tests.test_schemas.strategies import sample_records

PARTITIONS = 8
ENGINES = 8
RECORDS_PER_FRAME = 20
CHURNS = 5
JOIN_S = 30.0
"""A member's first assignment: Tansu holds each join about half the session timeout."""
LEAVE_S = 20.0
"""SIGTERM to exit: at most a join in progress (ingest's STOP_JOIN_WAIT_S) and a leave."""


def _ingest(bootstrap: str, out: Path, group: str, env: dict[str, str], log: Path,
            *extra: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as sink:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "tabletune.cli", "-v", "ingest", "--bootstrap", bootstrap,
             "--out", str(out), "--group", group, "--window-s", "1", *extra],
            env=env, stdout=sink, stderr=subprocess.STDOUT)


def _assigned(log: Path) -> bool:
    """The member logged an assignment that holds at least one partition."""
    return any("partitions assigned: [" in line and "assigned: []" not in line
               for line in log.read_text(errors="replace").splitlines())


def test_five_churns_then_a_batch_run_exits_0_losing_and_duplicating_nothing(
        broker, tmp_path, unique_name):
    topic = f"{unique_name}.telemetry"
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic(topic, PARTITIONS, 1), NewTopic(f"{unique_name}.dlq", 1, 1)])
    admin.close()
    env = {**os.environ, "TABLETUNE_TOPIC_TELEMETRY": topic,
           "TABLETUNE_TOPIC_DLQ": f"{unique_name}.dlq",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()),
                                                       os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "parquet"
    sent: set[tuple[str, int]] = set()
    producing = threading.Event()
    producing.set()

    def produce() -> None:
        producer = KafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=5)
        frame = 0
        while producing.is_set():
            for e in range(ENGINES):
                records = sample_records(RECORDS_PER_FRAME, engine_id=f"e{e}",
                                         first_seq=frame * RECORDS_PER_FRAME)
                encoded = encode_frame(records_to_table(records))
                producer.send(topic, key=encoded.key, value=encoded.value,
                              headers=encoded.headers)
                sent.update((r.engine_id, r.step_seq) for r in records)
            frame += 1
            time.sleep(0.1)  # pacing of the engines, not a wait on the system under test
        producer.flush(timeout=10)
        producer.close()

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b")}
    replicas = [_ingest(broker.bootstrap, out, unique_name, env, logs[n]) for n in logs]
    try:
        assert wait_until(lambda: all(_assigned(log) for log in logs.values()), JOIN_S)
        for i in range(CHURNS):
            log = tmp_path / f"churn{i}.log"
            member = _ingest(broker.bootstrap, out, unique_name, env, log)
            assert wait_until(lambda log=log: _assigned(log), JOIN_S), log.read_text()
            member.send_signal(signal.SIGTERM)
            assert member.wait(timeout=LEAVE_S) == 0, log.read_text()
        producing.clear()
        thread.join(timeout=15)
        final_log = tmp_path / "final.log"
        final = _ingest(broker.bootstrap, out, unique_name, env, final_log,
                        "--until-idle", "2", "--lag-wait", "20")
        assert final.wait(timeout=90) == 0, final_log.read_text()[-3000:]
    finally:
        for replica in replicas:
            replica.send_signal(signal.SIGTERM)
        for replica in replicas:
            assert replica.wait(timeout=LEAVE_S) == 0
    keys = _raw_keys(out)
    assert len(keys) == len(set(keys)), f"{len(keys) - len(set(keys))} duplicated"
    assert set(keys) == sent, f"{len(sent - set(keys))} lost"
