"""End-to-end ingest throughput: frames on the embedded broker -> Parquet on disk.

Produces N step records as 1024-record frames (the producer's frame size) to a fresh topic,
then runs one `Ingestor` (kafka-python consumer group, decode, window, Parquet, fsync,
rename, commit) and times from its start to the commit that made the last record durable
(group join included). Target: >= 100,000 records/s.

    .venv/bin/python -m bench.ingest_throughput [--records 1000000] [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic

from bench.common import emit
from fitter.ingest import IngestConfig, Ingestor
from schemas import encode_frame, records_to_table
from schemas.settings import Settings, TopicNames
from tabletune.broker import EmbeddedBroker


def synthetic_frames(total: int, engines: int, frame_records: int = 1024) -> list:
    from tests.test_schemas.strategies import sample_records

    frames = []
    per_engine = total // engines
    for engine in range(engines):
        for first in range(0, per_engine, frame_records):
            n = min(frame_records, per_engine - first)
            frames.append(encode_frame(records_to_table(
                sample_records(n, engine_id=f"engine-{engine}", first_seq=first))))
    return frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    frames = synthetic_frames(args.records, args.engines)
    total = sum(f.num_records for f in frames)
    with EmbeddedBroker() as broker:
        topic = f"bench-{uuid.uuid4().hex[:8]}"
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
        admin.create_topics([NewTopic(topic, args.partitions, 1)])
        admin.close()
        producer = KafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=5)
        for frame in frames:
            producer.send(topic, key=frame.key, value=frame.value, headers=frame.headers)
        producer.flush()
        producer.close()

        settings = Settings(bootstrap_servers=(broker.bootstrap,),
                            topics=TopicNames(telemetry=topic))
        out = Path(tempfile.mkdtemp(prefix="tabletune-ingest-bench-"))
        durable_at: list[float] = []
        ingestor: Ingestor | None = None

        def on_stage(stage: str) -> None:
            if stage == "committed" and ingestor is not None and \
                    ingestor.counters.records >= total:
                durable_at.append(time.perf_counter())

        ingestor = Ingestor(settings, IngestConfig(out_dir=out, group_id=topic,
                                                   until_idle_s=2.0), on_stage=on_stage)
        started = time.perf_counter()
        counters = ingestor.run()
        elapsed = durable_at[0] - started
    emit("ingest_throughput", {
        "command": "python -m bench.ingest_throughput",
        "records": total, "ingested": counters.records, "files": counters.files,
        "seconds": round(elapsed, 2), "records_per_s": round(total / elapsed),
        "target_records_per_s": 100_000,
    }, args.out)


if __name__ == "__main__":
    main()
