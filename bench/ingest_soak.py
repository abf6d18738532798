"""Ingest soak: 3 replicas killed and restarted at random, a broker restart and
malformed frames, on a twin fleet's telemetry; counts what was lost, duplicated and
dead-lettered against the topic itself. A bench, not CI: about minutes + 3 on 2 cores.

    .venv/bin/python -m bench.ingest_soak [--minutes 10] [--seed S] [--out DIR]

Set-up: an embedded broker (Tansu) on storage that outlives it (`s3://` on moto's S3
server, `tabletune.s3_emulator`), a telemetry topic of 6 partitions; a twin fleet
(`tabletune.twin_fleet.Fleet`, 4 engines at 10x real time, a steady open-loop peak, one
engine per partition: `one_writer_per_partition`) in this process, its engines' Kafka sinks
riding through the outage as designed (bounded queue, re-sent frames, dropped frames
counted); malformed frames at a known count on the other 2 partitions (garbage bytes,
truncated frames, a zstd bomb, frames with a negative batch size and a NaN latency among
valid rows); 3 `tabletune ingest` processes in one group writing one dataset
(`--window-s 2`), one of them killed with SIGKILL every 20-60 s and restarted 2-8 s later;
one broker stop, 10 s down, and start on the same storage, 30% into the run.

At the end the producers stop and the 3 replicas catch up (the group's commits reach every
partition's true end, read by a fetch), then stop (SIGTERM). Then the telemetry topic is
read end to end with a plain consumer: it is the ground truth. Each message is decoded and
checked as ingest does (`decode_frame`, `check_steps`):

- lost: a valid row in the topic whose record (engine_id, step_seq) no Parquet file holds, at
  any offset (ingest stores a re-sent copy once, at its first offset); an invalid row or an undecodable frame the dead-letter topic lacks;
  records an engine's sink counted as acknowledged that the topic does not hold (a row past
  the group's committed offset is counted apart, as unread: ingest stopped behind);
- duplicated: a row in Parquet more than once, by (partition, offset, engine_id, step_seq)
  (ingest's doing) and by (engine_id, step_seq) (also counts frames an engine's producer sent
  twice, which the topic holds twice: readers dedupe those, `fitter.dataset.read_dataset`);
- dead-lettered: dead-letter messages by reason, and distinct by source offset (a window
  read again after a kill re-sends its dead-letter messages: at least once).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.partitioner.default import murmur2

from bench.common import emit
from fitter.dataset import SOURCE_OFFSET, SOURCE_PARTITION, read_dataset
from fitter.ingest import partition_bounds
from fitter.kafka_clients import close_producer
from fitter.surface.synthetic import make_step_records
from schemas import FrameError, decode_frame, encode_frame
from schemas.settings import Settings
from schemas.step_checks import check_steps
from tabletune import twin_fleet
from tabletune.broker import BrokerError, EmbeddedBroker, TopicLayout
from tabletune.s3_emulator import S3Emulator
from tabletune.suite.machine import describe
from tabletune.twin_fleet import Fleet, FleetConfig
from twin import BUILTIN_SCENARIOS, load_scenario

log = logging.getLogger("bench.ingest_soak")

GROUP = "tabletune-ingest-soak"
PARTITIONS = 6
REPLICAS = 3
MALFORMED_ENGINE = "soak-malformed"
KINDS = ("garbage", "truncated", "zstd_bomb", "invalid_rows")
FRAME_INTERVAL_S = 4.0
"""Wall seconds between an engine's frames (a frame also closes at 1,024 records, about 4 s
of an engine at 10x). Tansu's S3 storage keeps each produced batch as an object and lists
every object of a partition at each fetch: at ~1,000 objects per partition a fetch took
seconds on the S3 emulator, heartbeats queued behind fetches, and the group rebalanced
without end (10 minutes of 1 s frames). A real engine frames every 0.1 s; Apache Kafka reads
by offset index, so only this broker needs fewer, larger messages."""
IDENTITY = ["source_partition", "source_offset", "engine_id", "step_seq"]


def one_writer_per_partition(engines: int) -> tuple[str, list[int]]:
    """An engine-id base whose fleet ids (`<base>-<i>`) the producers' key hash sends to
    distinct partitions, and the partitions left for the malformed frames.

    Tansu 0.6 on S3 storage: a partition that two producers write at once stopped serving
    fetches for good in 3 of 4 runs (any consumer, any offset: no records, only the high
    watermark; partitions with one writer never did). So each partition here has one writer;
    on Apache Kafka any number may share one."""
    if not 1 <= engines < PARTITIONS:
        raise SystemExit(f"--engines must be within 1..{PARTITIONS - 1}")
    for n in range(10_000):
        base = f"twin{n}"
        used = [(murmur2(f"{base}-{i}".encode()) & 0x7FFFFFFF) % PARTITIONS
                for i in range(engines)]
        if len(set(used)) == engines:
            return base, [p for p in range(PARTITIONS) if p not in used]
    raise RuntimeError("no engine-id base with one engine per partition")


def _progress(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- ingest replicas ----------------------------------------------------------------------

def _tabletune() -> list[str]:
    script = Path(sys.executable).with_name("tabletune")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tabletune.cli"]


@dataclasses.dataclass
class Replica:
    name: str
    command: list[str]
    log_path: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    restart_at: float | None = None
    starts: int = 0
    kills: int = 0
    crashes: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def start(self) -> None:
        handle = open(self.log_path, "ab")  # the child holds it
        handle.write(f"--- start {self.starts + 1} at {time.strftime('%H:%M:%S')}\n".encode())
        handle.flush()
        self.process = subprocess.Popen(self.command, stdout=handle, stderr=handle,
                                        stdin=subprocess.DEVNULL, env=self.env,
                                        start_new_session=True)
        handle.close()
        self.starts += 1
        self.restart_at = None

    @property
    def up(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.kills += 1

    def stop(self, timeout_s: float = 60.0, *, signal_first: bool = True) -> int | None:
        if not self.up:
            return None if self.process is None else self.process.returncode
        assert self.process is not None
        if signal_first:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# ---- malformed frames ---------------------------------------------------------------------

def _bomb() -> bytes:
    """256 MiB of zeros without a declared content size: refused at the reader's bound."""
    stream = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    chunk = bytes(1 << 20)
    return b"".join([*(stream.compress(chunk) for _ in range(256)), stream.flush()])


def _invalid_rows_frame(index: int) -> tuple[bytes, list[tuple[str, bytes]]]:
    """8 rows of one forged engine: row 0 a negative batch size, row 1 a NaN latency, six
    valid rows (which must reach Parquet)."""
    table = make_step_records(8, seed=index, outlier_fraction=0.0)
    n = table.num_rows
    now = time.time_ns()
    batch = table.column("batch_size").to_numpy().copy()
    batch[0] = -1
    latency = table.column("step_latency_s").to_numpy().copy()
    latency[1] = math.nan
    replace = {"engine_id": pa.array([MALFORMED_ENGINE] * n, pa.string()),
               "step_seq": pa.array(np.arange(n, dtype=np.int64) + 1000 * index),
               "ts_ns": pa.array(np.full(n, now, np.int64) + np.arange(n)),
               "batch_size": pa.array(batch.astype(np.int32)),
               "step_latency_s": pa.array(latency)}
    for name, column in replace.items():
        table = table.set_column(table.schema.get_field_index(name), name, column)
    checks = check_steps(table, now_ns=now)
    reasons = sorted(v.reason for v in checks.violations)
    if reasons != ["invalid_batch_size", "invalid_step_latency_s"] or sum(checks.valid) != 6:
        raise RuntimeError(f"the invalid-rows frame is not what the soak expects: {reasons}")
    frame = encode_frame(table)
    return frame.value, frame.headers


class MalformedProducer(threading.Thread):
    """`per_kind` frames of each kind, at random times in [start, end), round-robin over the
    partitions; each is sent until the broker acknowledges it (a send that fails in the
    outage is sent again on a new producer)."""

    def __init__(self, settings: Settings, topic: str, per_kind: int, start_s: float,
                 end_s: float, rng: random.Random, partitions: list[int]) -> None:
        super().__init__(name="soak-malformed", daemon=True)
        self.settings = settings
        self.topic = topic
        items = [kind for kind in KINDS for _ in range(per_kind)]
        rng.shuffle(items)
        times = sorted(rng.uniform(start_s, end_s) for _ in items)
        self.plan = list(zip(times, items, strict=True))
        self.rng = rng
        self.partitions = partitions
        self.end_s = end_s
        self.acknowledged: list[dict[str, Any]] = []
        self.failed_sends = 0
        self.unsent: list[str] = []
        self._bomb = _bomb()
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def _frame(self, kind: str, index: int) -> tuple[bytes, list[tuple[str, bytes]]]:
        if kind == "garbage":
            return self.rng.randbytes(self.rng.randint(16, 4096)), []
        if kind == "truncated":
            table = make_step_records(64, seed=index)
            table = table.set_column(table.schema.get_field_index("engine_id"), "engine_id",
                                     pa.array([MALFORMED_ENGINE] * 64))
            frame = encode_frame(table)
            return frame.value[:len(frame.value) // 2], frame.headers
        if kind == "zstd_bomb":
            return self._bomb, []
        return _invalid_rows_frame(index)

    def run(self) -> None:
        producer: KafkaProducer | None = None
        for index, (at, kind) in enumerate(self.plan):
            while not self._halt.is_set() and time.monotonic() < at:
                self._halt.wait(min(1.0, at - time.monotonic()))
            value, headers = self._frame(kind, index)
            partition = self.partitions[index % len(self.partitions)]
            while True:
                if self._halt.is_set():
                    self.unsent.append(kind)
                    break
                try:
                    if producer is None:
                        producer = KafkaProducer(**self.settings.client_kwargs(),
                                                 max_request_size=16 << 20,
                                                 request_timeout_ms=5000)
                    meta = producer.send(self.topic, key=MALFORMED_ENGINE.encode(),
                                         value=value, headers=headers,
                                         partition=partition).get(timeout=10)
                except Exception as exc:  # the outage: counted, sent again
                    self.failed_sends += 1
                    log.info("malformed %s send failed (%s): again", kind, exc)
                    if producer is not None:
                        close_producer(producer, timeout_s=0)
                        producer = None
                    self._halt.wait(1.0)
                    continue
                self.acknowledged.append({"kind": kind, "partition": meta.partition,
                                          "offset": meta.offset})
                break
        if producer is not None:
            close_producer(producer, timeout_s=5)


# ---- reading back ---------------------------------------------------------------------------

def read_topic(settings: Settings, topic: str, *, timeout_s: float = 600.0,
               unread: dict[int, int] | None = None):
    """Every message of `topic`, partition by partition in offset order, up to the true end.
    Big fetches: after a restart Tansu on S3 took ~9 s per fetch of a partition of ~300
    batches. With `unread`, a read that times out ends there and notes the messages per
    partition it did not get (the broker did not serve them)."""
    bounds = partition_bounds(settings, topic)
    consumer = KafkaConsumer(**settings.client_kwargs(), group_id=None,
                             enable_auto_commit=False, auto_offset_reset="earliest",
                             max_poll_records=5000, fetch_max_bytes=256 << 20,
                             max_partition_fetch_bytes=64 << 20)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(bounds)]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, bounds[tp.partition][0])
        ends = {tp: bounds[tp.partition][1] for tp in tps}
        if any(end is None for end in ends.values()):
            raise RuntimeError(f"end offsets of {topic} unknown: {bounds}")
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            if time.monotonic() > deadline:
                if unread is None:
                    raise RuntimeError(f"{topic} not read to its end within {timeout_s} s")
                unread.update({tp.partition: ends[tp] - consumer.position(tp) for tp in tps
                               if consumer.position(tp) < ends[tp]})
                log.warning("%s: not read to its end within %g s: %s", topic, timeout_s,
                            unread)
                return
            for _tp, messages in consumer.poll(timeout_ms=500).items():
                yield from messages
    finally:
        consumer.close()


def topic_truth(settings: Settings) -> dict[str, Any]:
    """The telemetry topic decoded and checked as ingest does."""
    valid: list[pa.Table] = []
    invalid: list[dict[str, Any]] = []
    frame_errors: list[dict[str, Any]] = []
    messages = 0
    unread: dict[int, int] = {}
    for message in read_topic(settings, settings.topics.telemetry, unread=unread):
        messages += 1
        try:
            table = decode_frame(message.value or b"", list(message.headers or []))
        except FrameError as exc:
            frame_errors.append({"partition": message.partition, "offset": message.offset,
                                 "reason": exc.reason})
            continue
        checks = check_steps(table, now_ns=time.time_ns())
        ids = table.select(["engine_id", "step_seq"])
        n = ids.num_rows
        ids = ids.append_column(SOURCE_PARTITION, pa.array(np.full(n, message.partition,
                                                                     np.int32)))
        ids = ids.append_column(SOURCE_OFFSET, pa.array(np.full(n, message.offset, np.int64)))
        if not checks.ok:
            engine = ids.column("engine_id").to_pylist()
            seq = ids.column("step_seq").to_pylist()
            for violation in checks.violations:
                invalid.extend({"source_partition": message.partition,
                                "source_offset": message.offset, "engine_id": engine[row],
                                "step_seq": seq[row], "reason": violation.reason}
                               for row in violation.rows.tolist())
            ids = ids.filter(pa.array(checks.valid))
        valid.append(ids)
    rows = pl.from_arrow(pa.concat_tables(valid)).select(IDENTITY) if valid else \
        pl.DataFrame(schema=dict.fromkeys(IDENTITY, pl.Int64))
    return {"messages": messages, "valid": rows, "invalid": invalid,
            "frame_errors": frame_errors, "unserved": unread}


def parquet_rows(out: Path) -> tuple[pl.DataFrame, int]:
    """Every stored row's (partition, offset, engine_id, step_seq), before any dedupe."""
    files = sorted(p for p in out.rglob("*.parquet") if not p.name.startswith(".tmp-"))
    tables = [pq.read_table(f, columns=["engine_id", "step_seq", SOURCE_PARTITION,
                                        SOURCE_OFFSET]) for f in files]
    if not tables:
        return pl.DataFrame(schema=dict.fromkeys(IDENTITY, pl.Int64)), 0
    return pl.from_arrow(pa.concat_tables(tables)).select(IDENTITY), len(files)


def dlq_contents(settings: Settings) -> dict[str, Any]:
    frames: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for message in read_topic(settings, settings.topics.dlq):
        headers = {k: v.decode(errors="replace") for k, v in message.headers or []}
        source = (int(headers["tabletune-source-partition"]),
                  int(headers["tabletune-source-offset"]))
        reason = headers["tabletune-dlq-reason"]
        frames.append({"partition": source[0], "offset": source[1], "reason": reason})
        if reason.startswith("invalid_"):
            original = [(k, v) for k, v in message.headers or []
                        if not k.startswith("tabletune-dlq") and not k.startswith(
                            "tabletune-source")]
            table = decode_frame(message.value, original)
            rows.extend({"source_partition": source[0], "source_offset": source[1],
                         "engine_id": e, "step_seq": s, "reason": reason}
                        for e, s in zip(table.column("engine_id").to_pylist(),
                                        table.column("step_seq").to_pylist(), strict=True))
    return {"messages": frames, "rows": rows}


def committed_lag(settings: Settings, committed_out: dict[int, int] | None = None
                  ) -> dict[int, int]:
    """Messages per partition between the group's commits and the true end offsets (the
    group's committed offsets into `committed_out`)."""
    bounds = partition_bounds(settings, settings.topics.telemetry)
    consumer = KafkaConsumer(**settings.client_kwargs(), group_id=GROUP,
                             enable_auto_commit=False)
    try:
        lag = {}
        for partition, (begin, end) in bounds.items():
            committed = consumer.committed(TopicPartition(settings.topics.telemetry,
                                                          partition))
            lag[partition] = (end if end is not None else 10**12) - max(begin, committed or 0)
            if committed_out is not None:
                committed_out[partition] = committed or 0
        return lag
    finally:
        consumer.close()


# ---- the soak --------------------------------------------------------------------------------

def soak(minutes: float, seed: int, engines: int, speedup: float, per_kind: int,
         window_s: float, work: Path) -> dict[str, Any]:
    rng = random.Random(seed)  # noqa: S311 (a schedule, not a secret)
    produce_s = minutes * 60.0
    scenario = load_scenario(BUILTIN_SCENARIOS / "open-loop-parametric.toml")
    peak = dataclasses.replace(scenario.phases[-1], duration_s=produce_s * speedup)
    base, spare = one_writer_per_partition(engines)
    scenario = dataclasses.replace(scenario, phases=(peak,), seed=seed, name="open-loop-peak",
                                   engine=dataclasses.replace(scenario.engine, engine_id=base))
    out = work / "parquet"
    events: list[dict[str, Any]] = []
    started = time.monotonic()

    def event(what: str, **fields: Any) -> None:
        events.append({"t_s": round(time.monotonic() - started, 1), "what": what, **fields})
        _progress(f"{what} {fields if fields else ''}")

    s3 = S3Emulator().start()
    broker = EmbeddedBroker(layout=TopicLayout(telemetry_partitions=PARTITIONS),
                            storage=s3.storage_url, storage_env=s3.env, ready_timeout_s=60)
    replicas: list[Replica] = []
    fleet: Fleet | None = None
    malformed: MalformedProducer | None = None
    try:
        bootstrap = broker.start()
        settings = Settings(bootstrap_servers=(bootstrap,))
        env = {**os.environ, "TABLETUNE_BOOTSTRAP": bootstrap}
        env.pop("TABLETUNE_METRICS_PORT", None)
        command = [*_tabletune(), "-v", "ingest", "--bootstrap", bootstrap, "--out", str(out),
                   "--group", GROUP, "--window-s", str(window_s)]
        replicas = [Replica(f"ingest-{i}", command, work / f"ingest-{i}.log", env)
                    for i in range(REPLICAS)]
        for replica in replicas:
            replica.start()
        event("replicas started", replicas=REPLICAS)

        twin_fleet.MIN_FRAME_INTERVAL_S = FRAME_INTERVAL_S  # fewer, larger messages
        fleet = Fleet(scenario, settings, FleetConfig(engines=engines, speedup=speedup,
                                                      duration_s=produce_s * speedup))
        fleet.start()
        t0 = time.monotonic()
        produce_end = t0 + produce_s
        malformed = MalformedProducer(settings, settings.topics.telemetry, per_kind,
                                      t0 + 5, produce_end - 10, rng, spare)
        malformed.start()
        event("producing", engines=engines, speedup=speedup, seconds=produce_s)

        broker_down: dict[str, float] = {}

        def restart_broker() -> None:
            broker_down["stop"] = time.monotonic()
            event("broker stop")
            broker.stop()
            time.sleep(10.0)
            broker_down["start"] = time.monotonic()
            for attempt in range(5):
                try:
                    broker.start()
                    break
                except BrokerError as exc:
                    event("broker start failed", attempt=attempt + 1, error=str(exc))
                    time.sleep(2.0)
            else:
                return
            broker_down["ready"] = time.monotonic()
            event("broker started", down_s=round(broker_down["ready"] - broker_down["stop"], 1))

        broker_at = t0 + produce_s * 0.3
        broker_thread = threading.Thread(target=restart_broker, daemon=True)
        next_kill = t0 + rng.uniform(20, 60)
        last_report = t0
        while time.monotonic() < produce_end:
            now = time.monotonic()
            if not broker_thread.is_alive() and "stop" not in broker_down and now >= broker_at:
                broker_thread.start()
            for replica in replicas:
                if replica.restart_at is None and not replica.up:
                    code = replica.process.returncode if replica.process else None
                    replica.crashes.append({"t_s": round(now - started, 1), "code": code,
                                            "log": replica.log_tail()})
                    event("replica exited by itself", replica=replica.name, code=code)
                    replica.restart_at = now + 2.0
                if replica.restart_at is not None and now >= replica.restart_at:
                    replica.start()
                    event("replica restarted", replica=replica.name)
            if now >= next_kill and now < produce_end - 15:
                running = [r for r in replicas if r.up and r.restart_at is None]
                if running:
                    victim = rng.choice(running)
                    victim.kill()
                    victim.restart_at = now + rng.uniform(2, 8)
                    event("kill -9", replica=victim.name,
                          restart_in_s=round(victim.restart_at - now, 1))
                next_kill = now + rng.uniform(20, 60)
            if now - last_report >= 30:
                last_report = now
                sinks = [run.engine.recorder.counters() for run in fleet.engines
                         if run.engine.recorder is not None]
                _progress(f"acked {sum(c['sink_sent_records'] for c in sinks)} records, "
                          f"dropped {sum(c['sink_dropped_records'] for c in sinks)}, "
                          f"malformed acked {len(malformed.acknowledged)}, "
                          f"replicas up {sum(r.up for r in replicas)}, "
                          f"load {os.getloadavg()[0]:.1f}")
            time.sleep(0.2)
        # ---- producers stop -------------------------------------------------------------
        for run in fleet.engines:  # the engines stop at the deadline even if they lag
            run.engine.end_s = min(run.engine.end_s, run.engine.clock_s)
        fleet_result = fleet.join()
        produced_s = time.monotonic() - t0
        malformed.stop()
        malformed.join(timeout=30)
        broker_thread.join(timeout=60)
        event("producers stopped", seconds=round(produced_s, 1))
        for replica in replicas:  # a replica killed in the last seconds comes back first
            if not replica.up:
                replica.start()
        catch_up_start = time.monotonic()
        lag: dict[int, int] = {}
        while time.monotonic() - catch_up_start < 300:
            try:
                lag = committed_lag(settings)
            except Exception as exc:  # the group rebalancing: ask again
                log.info("lag check failed: %s", exc)
                lag = {-1: -1}
            if lag and all(v <= 0 for v in lag.values()):
                break
            if int(time.monotonic() - catch_up_start) % 20 < 2:
                _progress(f"catching up: lag {lag}")
            for replica in replicas:
                if not replica.up:
                    replica.crashes.append({"t_s": round(time.monotonic() - started, 1),
                                            "code": replica.process.returncode,
                                            "log": replica.log_tail()})
                    replica.start()
            time.sleep(2.0)
        caught_up_s = time.monotonic() - catch_up_start
        event("caught up" if all(v <= 0 for v in lag.values()) else "NOT caught up",
              seconds=round(caught_up_s, 1), lag=lag)
        for replica in replicas:  # all at once: a leader leaving mid-rebalance holds a
            if replica.up:         # Tansu group for minutes (tests/test_fitter)
                replica.process.send_signal(signal.SIGTERM)
        stop_codes = {r.name: r.stop(signal_first=False) for r in replicas}
        committed: dict[int, int] = {}
        after_stop = committed_lag(settings, committed)
        event("replicas stopped", codes=stop_codes, lag=after_stop)

        # ---- counting -------------------------------------------------------------------
        truth = topic_truth(settings)
        stored, files = parquet_rows(out)
        dlq = dlq_contents(settings)
        deduped = read_dataset(out).height
        result = count(truth, stored, dlq, fleet, fleet_result, malformed, committed)
        result.update({
            "minutes": minutes, "seed": seed, "engines": engines, "speedup": speedup,
            "window_s": window_s,
            "partitions": PARTITIONS, "replicas": REPLICAS, "files": files,
            "read_dataset_rows": deduped,
            "kills": sum(r.kills for r in replicas),
            "replica_starts": sum(r.starts for r in replicas),
            "crashes": [dict(c, replica=r.name) for r in replicas for c in r.crashes],
            "broker_restarts": 1 if "ready" in broker_down else 0,
            "broker_down_s": round(broker_down["ready"] - broker_down["stop"], 1)
            if "ready" in broker_down else None,
            "produce_s": round(produced_s, 1), "catch_up_s": round(caught_up_s, 1),
            "wall_s": round(time.monotonic() - started, 1),
            "caught_up": all(v <= 0 for v in lag.values()),
            "lag_after_stop": after_stop,
            "events": events,
        })
        result["records_per_s"] = round(result["topic"]["valid_rows"] / produced_s, 1)
        return result
    finally:
        if malformed is not None:
            malformed.stop()
        for replica in replicas:
            if replica.up:
                replica.process.kill()
        broker.stop()
        s3.stop()


def count(truth: dict[str, Any], stored: pl.DataFrame, dlq: dict[str, Any], fleet: Fleet,
          fleet_result: dict[str, Any], malformed: MalformedProducer,
          committed: dict[int, int]) -> dict[str, Any]:
    valid: pl.DataFrame = truth["valid"]
    stored = stored.cast({"source_partition": pl.Int64})
    valid = valid.cast({"source_partition": pl.Int64})
    # a copy an engine re-sent (the topic holds it at two offsets) is stored once, at the
    # first: a row is missing only if its record is stored at no offset
    missing = valid.join(stored.select("engine_id", "step_seq").unique(),
                         on=["engine_id", "step_seq"], how="anti")
    # below the group's committed offset a missing row is lost; at or past it, only unread
    # (ingest had not caught up when it was stopped)
    marks = pl.DataFrame({"source_partition": list(committed),
                          "committed": list(committed.values())},
                         schema={"source_partition": pl.Int64, "committed": pl.Int64})
    missing = missing.join(marks, on="source_partition", how="left").with_columns(
        pl.col("committed").fill_null(0))
    lost_rows = missing.filter(pl.col("source_offset") < pl.col("committed")).drop("committed")
    unread_rows = missing.filter(pl.col("source_offset") >= pl.col("committed"))
    extra_rows = stored.join(valid, on=IDENTITY, how="anti")
    dup_by_offset = stored.height - stored.unique(IDENTITY).height
    dup_by_identity = stored.height - stored.unique(["engine_id", "step_seq"]).height
    topic_dup_identity = valid.height - valid.unique(["engine_id", "step_seq"]).height

    expected_frames = {(f["partition"], f["offset"], f["reason"]) for f in truth["frame_errors"]}
    dlq_messages = [(m["partition"], m["offset"], m["reason"]) for m in dlq["messages"]]
    dlq_frame_set = {m for m in dlq_messages if not m[2].startswith("invalid_")}
    expected_rows = {(r["source_partition"], r["source_offset"], r["engine_id"], r["step_seq"],
                      r["reason"]) for r in truth["invalid"]}
    dlq_rows = [(r["source_partition"], r["source_offset"], r["engine_id"], r["step_seq"],
                 r["reason"]) for r in dlq["rows"]]
    by_reason = Counter(m[2] for m in dlq_messages)
    distinct_by_reason = Counter(m[2] for m in set(dlq_messages))

    engines = {}
    topic_by_engine = dict(valid.group_by("engine_id").agg(
        pl.col("step_seq").n_unique()).iter_rows())
    for run in fleet.engines:
        counters = run.engine.recorder.counters() if run.engine.recorder else {}
        acked = counters.get("sink_sent_records", 0)
        in_topic = int(topic_by_engine.get(run.engine_id, 0))
        engines[run.engine_id] = {
            "recorded": counters.get("records_total", 0),
            "recorder_dropped": counters.get("records_dropped", 0),
            "sink_acknowledged": acked,
            "sink_dropped": counters.get("sink_dropped_records", 0),
            "sink_errors": counters.get("sink_errors", 0),
            "sink_producer_restarts": counters.get("sink_producer_restarts", 0),
            "in_topic_distinct": in_topic,
            "acknowledged_not_in_topic": max(0, acked - in_topic)}
    acked_kinds = Counter(m["kind"] for m in malformed.acknowledged)
    dlq_sources = {m[:2] for m in dlq_messages}
    def read(partition: int, offset: int) -> bool:  # below the group's committed offset
        return offset < committed.get(partition, 0)

    lost = {"valid_rows_not_in_parquet": lost_rows.height,
            "invalid_rows_not_in_dlq": sum(1 for r in expected_rows - set(dlq_rows)
                                           if read(r[0], r[1])),
            "bad_frames_not_in_dlq": sum(1 for f in expected_frames - dlq_frame_set
                                         if read(f[0], f[1])),
            "acknowledged_not_in_topic": sum(e["acknowledged_not_in_topic"]
                                             for e in engines.values())}
    return {
        "lost": sum(lost.values()), "lost_detail": lost,
        "lost_sample": lost_rows.head(10).to_dicts(),
        "unread_rows": unread_rows.height,
        "committed_offsets": committed,
        "duplicated": dup_by_offset,
        "duplicated_detail": {
            "parquet_same_offset_twice": dup_by_offset,
            "parquet_same_identity_twice": dup_by_identity,
            "topic_same_identity_twice": topic_dup_identity},
        "parquet_rows_not_valid_in_topic": extra_rows.height,
        "topic": {"messages": truth["messages"], "valid_rows": valid.height,
                  "unserved_messages": truth["unserved"],
                  "invalid_rows": len(truth["invalid"]),
                  "undecodable_frames": len(truth["frame_errors"]),
                  "undecodable_by_reason": dict(Counter(f["reason"]
                                                        for f in truth["frame_errors"]))},
        "parquet_rows": stored.height,
        "dead_lettered": {"messages": len(dlq_messages), "by_reason": dict(by_reason),
                          "distinct_sources": len(set(dlq_messages)),
                          "distinct_by_reason": dict(distinct_by_reason),
                          "rows": len(dlq_rows), "distinct_rows": len(set(dlq_rows))},
        "malformed": {"planned": len(malformed.plan), "acknowledged": len(malformed.acknowledged),
                      "acknowledged_by_kind": dict(acked_kinds),
                      "failed_sends_retried": malformed.failed_sends,
                      "unsent": len(malformed.unsent),
                      "expected_dlq_messages": acked_kinds["garbage"] + acked_kinds["truncated"]
                      + acked_kinds["zstd_bomb"] + 2 * acked_kinds["invalid_rows"],
                      "acknowledged_in_dlq": sum(
                          1 for m in malformed.acknowledged
                          if (m["partition"], m["offset"]) in dlq_sources),
                      "dlq_messages_found": len({
                          d for d in dlq_messages
                          if d[:2] in {(m["partition"], m["offset"])
                                       for m in malformed.acknowledged}})},
        "engine_sinks": engines,
        "fleet_output_tokens_per_s": round(fleet_result["output_tokens_per_s"], 1),
    }


def markdown(result: dict[str, Any], commit: str) -> str:
    m = result["machine"]
    dead = result["dead_lettered"]
    mal = result["malformed"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(dead["distinct_by_reason"].items()))
    engines = result["engine_sinks"].values()
    rows = [
        ("lost (acknowledged, not in Parquet or DLQ)", result["lost"]),
        ("not ingested, past the group's committed offsets (unread at the stop)",
         result["unread_rows"]),
        ("duplicated in Parquet (same partition+offset+record)", result["duplicated"]),
        ("same (engine_id, step_seq) twice in Parquet / in the topic",
         f"{result['duplicated_detail']['parquet_same_identity_twice']} / "
         f"{result['duplicated_detail']['topic_same_identity_twice']}"),
        ("valid records in the topic / rows in Parquet",
         f"{result['topic']['valid_rows']} / {result['parquet_rows']} "
         f"({result['files']} files)"),
        ("dead-lettered, distinct sources by reason", f"{dead['distinct_sources']}: {reasons}"),
        ("dead-letter messages (re-sent after a kill)",
         f"{dead['messages']} ({dead['messages'] - dead['distinct_sources']})"),
        ("malformed frames acknowledged (in the DLQ) / their DLQ messages expected / found",
         f"{mal['acknowledged']} ({mal['acknowledged_in_dlq']}) / "
         f"{mal['expected_dlq_messages']} / {mal['dlq_messages_found']}"),
        ("engines' sinks: acknowledged / dropped / producer restarts",
         f"{sum(e['sink_acknowledged'] for e in engines)} / "
         f"{sum(e['sink_dropped'] for e in engines)} / "
         f"{sum(e['sink_producer_restarts'] for e in engines)}"),
        ("kill -9 / replica starts / exits by themselves",
         f"{result['kills']} / {result['replica_starts']} / {len(result['crashes'])}"),
        ("caught up (lag 0 on every partition) / lag after the stop",
         f"{result['caught_up']} / {sum(result['lag_after_stop'].values())}"),
        ("topic messages the broker did not serve to the final read",
         sum(result["topic"]["unserved_messages"].values())),
        ("broker restarts (down)", f"{result['broker_restarts']} ({result['broker_down_s']} s)"),
        ("producing / catch-up / wall", f"{result['produce_s']} s / {result['catch_up_s']} s / "
                                        f"{result['wall_s']} s"),
        ("telemetry rate", f"{result['records_per_s']} records/s "
                           f"({result['engines']} engines at {result['speedup']}x)"),
    ]
    lines = [f"`{result['command']}` at {commit}, {m['date']}, {describe(m)}", "",
             "| ingest soak | value |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--speedup", type=float, default=10.0)
    parser.add_argument("--malformed-per-kind", type=int, default=10)
    parser.add_argument("--window-s", type=float, default=2.0,
                        help="the replicas' --window-s (default 2: a kill every 20-60 s is two "
                        "rebalances of about 5 s each on Tansu, and a window must close "
                        "between them; ingest's own default is 10)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--keep", action="store_true", help="keep the broker data, Parquet "
                        "and replica logs (under OUT/ingest_soak-work)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    if args.keep and args.out:
        work = Path(args.out) / "ingest_soak-work"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="ingest-soak-"))
    try:
        result = soak(args.minutes, args.seed, args.engines, args.speedup,
                      args.malformed_per_kind, args.window_s, work)
    finally:
        if not (args.keep and args.out):
            shutil.rmtree(work, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    result["command"] = "python -m bench.ingest_soak " + " ".join(sys.argv[1:])
    result["commit"] = commit
    result["date"] = dt.date.today().isoformat()
    emit("ingest_soak", result, args.out)
    if args.out:
        from tabletune.suite.machine import machine
        result["machine"] = machine()
        Path(args.out, "ingest_soak.md").write_text(markdown(result, commit))


if __name__ == "__main__":
    main()
