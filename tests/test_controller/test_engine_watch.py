"""Guardrail and drift inside an engine: frames tapped from the recorder's sink drive a
rollback through the TableAgent, as in production (controller/engine/watch.py)."""

from __future__ import annotations

import numpy as np

from controller.engine.agent import TableAgent
from controller.engine.watch import EngineWatch, TapSink
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from producers.sinks import FileSink, read_file_sink
from schemas import DraftTable, StepRecord, TableEnvelope, TableKey, records_to_table

KEY = TableKey("llama", "eagle", "h100")


def frame(rng, *, version: int, t0: float, n: int, goodput: float, seq0: int):
    """n decode steps of 64 requests, 20 ms apart, at about `goodput` tokens/s."""
    rows = []
    for i in range(n):
        latency = 0.02 * (1 + 0.05 * rng.standard_normal())
        tokens = goodput * 0.02 * (1 + 0.05 * rng.standard_normal())
        rows.append(StepRecord(
            engine_id="e", model="llama", drafter="eagle", hardware="h100",
            ts_ns=int((t0 + 0.02 * i) * 1e9), step_seq=seq0 + i, batch_size=64,
            num_decode_reqs=64, num_prefill_reqs=0, num_prefill_tokens=0, k=3, k_next=3,
            table_version=version, num_drafts=64, num_draft_tokens=192,
            num_accepted_tokens=int(round(tokens - 64)), accepted_per_pos=(40, 30, 20),
            kv_tokens=64_000, ctx_len_mean=1000.0, ctx_len_max=1200, step_latency_s=latency,
            inter_step_s=latency))
    return records_to_table(rows)


def envelope(version: int) -> TableEnvelope:
    return TableEnvelope(key=KEY, version=version, table=DraftTable.from_vllm([[1, 64, 3]]),
                         startup_k_values=(0, 1, 3), max_batch=64,
                         created_at="2026-11-29T00:00:00+00:00")


def test_regressing_table_is_rolled_back_through_the_agent(tmp_path):
    status = StatusPublisher(None, "e", str(KEY))
    agent = TableAgent(EngineLimits(KEY, frozenset({0, 1, 3}), 64), {}, status.emit)
    agent.on_envelope(envelope(1))
    agent.on_envelope(envelope(2))
    tap = TapSink(FileSink(tmp_path))
    watch = EngineWatch(agent, status, tap, max_batch=64)
    rng = np.random.default_rng(0)
    seq = 0
    for second in range(60):  # the previous table, as a baseline
        tap.write(frame(rng, version=1, t0=second, n=50, goodput=6000.0, seq0=seq))
        seq += 50
        assert watch.check() is False
    watch.table_applied(2, 1, None, at_s=60.0)
    rolled_back_at = None
    for second in range(60, 90):  # the new table is 15% worse
        tap.write(frame(rng, version=2, t0=second, n=50, goodput=5100.0, seq0=seq))
        seq += 50
        if watch.check():
            rolled_back_at = second
            break
    assert rolled_back_at is not None and rolled_back_at - 60 <= 15
    assert agent.desired().version == 1
    event = [e for e in status.recent if e["event"] == "rolled_back"][-1]
    assert event["version"] == 2 and event["to_version"] == 1 and event["reason"] == "guardrail"
    # The tap forwarded every frame to the engine's real sink.
    assert read_file_sink(tmp_path).num_rows == seq


def test_equal_table_is_kept(tmp_path):
    status = StatusPublisher(None, "e", str(KEY))
    agent = TableAgent(EngineLimits(KEY, frozenset({0, 1, 3}), 64), {}, status.emit)
    agent.on_envelope(envelope(1))
    agent.on_envelope(envelope(2))
    tap = TapSink(FileSink(tmp_path))
    watch = EngineWatch(agent, status, tap, max_batch=64)
    rng = np.random.default_rng(1)
    for second in range(60):
        tap.write(frame(rng, version=1, t0=second, n=50, goodput=6000.0, seq0=second * 50))
        watch.check()
    watch.table_applied(2, 1, None, at_s=60.0)
    for second in range(60, 100):
        tap.write(frame(rng, version=2, t0=second, n=50, goodput=6000.0, seq0=second * 50))
        assert watch.check() is False
    assert agent.desired().version == 2
