from __future__ import annotations

import threading
import time

import pyarrow as pa
import pytest

from producers.identity import EngineIdentity
from producers.recorder import RecorderConfig, StepRecorder
from producers.sinks import FileSink, SinkError, read_file_sink, sink_from_url
from schemas import table_to_records

IDENTITY = EngineIdentity("engine-1", "llama", "eagle", "h100")


def record(recorder: StepRecorder, i: int, k: int = 3) -> int:
    return recorder.record_step(
        batch_size=1 + i % 8, num_decode_reqs=1 + i % 8, num_prefill_reqs=0,
        num_prefill_tokens=0, k=k, k_next=k, table_version=2, num_drafts=1 + i % 8,
        num_draft_tokens=k * (1 + i % 8), num_accepted_tokens=i % 4,
        accepted_per_pos=[3, 2, 1][:k], kv_tokens=100 + i, ctx_len_mean=50.0,
        ctx_len_max=60, step_latency_s=0.01, inter_step_s=0.012, forced=i % 2 == 0,
        ts_ns=1000 + i,
    )


def test_records_reach_the_file_sink_in_order(tmp_path):
    recorder = StepRecorder(IDENTITY, FileSink(tmp_path), max_k=4,
                            config=RecorderConfig(frame_records=100))
    for i in range(250):
        assert record(recorder, i, k=i % 4) == i
    recorder.close()
    records = table_to_records(read_file_sink(tmp_path))
    assert [r.step_seq for r in records] == list(range(250))
    assert all(r.engine_id == "engine-1" and r.hardware == "h100" for r in records)
    assert [r.accepted_per_pos for r in records[:4]] == [(), (3,), (3, 2), (3, 2, 1)]
    assert records[7].batch_size == 8 and records[7].forced is False and records[8].forced
    assert len(list(tmp_path.glob("*.arrow"))) == 3  # 100 + 100 + 50
    assert recorder.counters()["records_total"] == 250


def test_partial_frame_is_sent_after_the_interval(tmp_path):
    sink = FileSink(tmp_path)
    recorder = StepRecorder(IDENTITY, sink, max_k=4,
                            config=RecorderConfig(frame_records=1024, frame_interval_s=0.05))
    for i in range(5):
        record(recorder, i)
    deadline = time.monotonic() + 5
    while sink.records < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.records == 5  # no flush() call: the background thread sent it by age
    recorder.close()


def test_deferred_steps_are_built_off_thread(tmp_path):
    recorder = StepRecorder(IDENTITY, FileSink(tmp_path), max_k=4)
    def build(raw: int) -> dict[str, object] | None:
        if raw < 0:
            raise ValueError("bad raw step")
        if raw == 0:
            return None
        return dict(batch_size=raw, num_decode_reqs=raw, num_prefill_reqs=0,
                    num_prefill_tokens=0, k=1, k_next=1, table_version=0, num_drafts=raw,
                    num_draft_tokens=raw, num_accepted_tokens=0, accepted_per_pos=[0],
                    kv_tokens=raw, ctx_len_mean=1.0, ctx_len_max=1, step_latency_s=0.1,
                    inter_step_s=0.1)

    for raw in (3, 0, -1, 5):
        recorder.defer(build, raw)
    recorder.close()
    records = table_to_records(read_file_sink(tmp_path))
    assert [r.batch_size for r in records] == [3, 5]
    assert recorder.counters()["build_errors"] == 1


class StuckSink:
    """Injects a sink that never finishes a write, as a wedged disk or client would."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.written: list[pa.Table] = []

    def write(self, records: pa.Table) -> None:
        self.release.wait(timeout=30)
        self.written.append(records)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        self.release.set()

    def counters(self) -> dict[str, int]:
        return {}


def test_stuck_sink_bounds_memory_and_counts_drops():
    sink = StuckSink()
    recorder = StepRecorder(IDENTITY, sink, max_k=4,
                            config=RecorderConfig(frame_records=10, max_pending_buffers=3))
    for i in range(200):
        record(recorder, i)  # returns although the sink is stuck
    counters = recorder.counters()
    assert counters["records_total"] == 200
    assert counters["records_dropped"] > 0
    assert counters["records_pending"] <= 10 * 4
    sink.release.set()
    recorder.close()
    delivered = sum(t.num_rows for t in sink.written)
    assert delivered + recorder.counters()["records_dropped"] == 200


def test_failing_sink_is_counted_not_raised(tmp_path):
    class BrokenSink(StuckSink):
        def write(self, records: pa.Table) -> None:
            raise OSError("disk full")

    recorder = StepRecorder(IDENTITY, BrokenSink(), max_k=4,
                            config=RecorderConfig(frame_records=10))
    for i in range(25):
        record(recorder, i)
    recorder.close()
    counters = recorder.counters()
    assert counters["write_errors"] == 3 and counters["records_dropped"] == 25


@pytest.mark.parametrize(
    ("url", "message"),
    [("kafka://", "needs host:port"), ("file://relative/dir", "file:///absolute/dir"),
     ("s3://bucket", "expected kafka://host:port")],
)
def test_bad_sink_urls_are_named(url, message):
    with pytest.raises(SinkError, match=message):
        sink_from_url(url)


def test_recorder_config_validates():
    with pytest.raises(ValueError, match="frame_records=0"):
        RecorderConfig(frame_records=0)


def test_tables_handed_to_a_sink_survive_buffer_reuse():
    class KeepingSink(StuckSink):
        def write(self, records: pa.Table) -> None:
            self.written.append(records)  # keeps the table, as an in-memory sink would

    sink = KeepingSink()
    recorder = StepRecorder(IDENTITY, sink, max_k=4, config=RecorderConfig(frame_records=10))
    for i in range(40):
        record(recorder, i)
        if i % 10 == 9:
            recorder.flush()  # hands the buffer over now, so the next frame reuses it
    recorder.close()
    seqs = [s for table in sink.written for s in table.column("step_seq").to_pylist()]
    assert seqs == list(range(40))
