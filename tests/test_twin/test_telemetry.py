"""The twin speaks the real engine's interfaces: StepRecorder records, sinks, TableSwitch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from producers.sinks import read_file_sink
from schemas import DraftTable
from tests.kafka_helpers import read_telemetry
from twin import EngineConfig, FixedK, PhaseConfig, Scenario, run_scenario


def chat(traces: Path, engine_id: str = "twin-test", duration_s: float = 60.0,
         concurrency: int = 32, seed: int = 1) -> Scenario:
    """EAGLE chat on the ShareGPT-shaped trace in `traces` (a missing file is an error)."""
    phase = PhaseConfig(duration_s=duration_s, concurrency=concurrency,
                        trace=str(traces / "sharegpt.jsonl"))
    return Scenario(seed=seed, engine=EngineConfig(engine_id=engine_id), phases=(phase,))


def _sorted_records(directory: Path):
    table = read_file_sink(directory)
    return table.sort_by([("step_seq", "ascending")]).to_pydict()


def test_file_sink_records_match_the_summary(generated_traces, tmp_path):
    summary = run_scenario(chat(generated_traces), "vllm-doc", sink=f"file://{tmp_path}")
    records = _sorted_records(tmp_path)
    steps = summary.steps
    assert steps > 2048  # several frames
    assert len(list(tmp_path.glob("*.arrow"))) >= 2
    assert records["step_seq"] == list(range(steps))
    assert set(records["engine_id"]) == {"twin-test"}
    assert summary.telemetry["records_total"] == steps
    assert summary.telemetry["records_dropped"] == 0
    ts = np.array(records["ts_ns"])
    assert ts[0] == 0 and np.all(np.diff(ts) > 0) and ts[-1] < 60e9  # virtual time
    latency = np.array(records["step_latency_s"])
    np.testing.assert_allclose(np.diff(ts) / 1e9, latency[:-1], rtol=1e-6, atol=2e-9)
    np.testing.assert_allclose(records["inter_step_s"][1:], latency[:-1], rtol=1e-6, atol=2e-9)
    assert np.mean(records["batch_size"]) == summary.mean_batch_size
    ks, counts = np.unique(records["k_next"], return_counts=True)
    assert {str(k): c / steps for k, c in zip(ks, counts, strict=True)} == summary.k_share
    for k, per_pos, accepted, drafts, draft_tokens in zip(
            records["k"], records["accepted_per_pos"], records["num_accepted_tokens"],
            records["num_drafts"], records["num_draft_tokens"], strict=True):
        assert len(per_pos) == k
        assert sum(per_pos) == accepted
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
        assert draft_tokens <= drafts * k and (not per_pos or per_pos[0] <= drafts)
    kv = np.array(records["kv_tokens"])
    np.testing.assert_allclose(records["ctx_len_mean"], kv / np.array(records["batch_size"]))
    assert np.all(np.array(records["ctx_len_max"]) <= kv)


def test_twin_telemetry_reaches_the_real_broker(generated_traces, broker, unique_name):
    summary = run_scenario(chat(generated_traces, engine_id=unique_name, duration_s=10.0),
                           "fixed:3", sink=f"kafka://{broker.bootstrap}")
    table = read_telemetry(broker.bootstrap, engine_id=unique_name, min_records=summary.steps)
    assert table.num_rows == summary.steps
    assert table.column("step_seq").to_pylist() == list(range(summary.steps))
    assert pc.all(pc.equal(table.column("k_next"), 3)).as_py()


class SwitchAtStep(FixedK):
    """Starts with fixed K; after step `at` stages another table through the switch."""

    step_interval = 1

    def __init__(self, k: int, at: int, new_k: int, version: int) -> None:
        super().__init__(k)
        self.at, self.new_k, self.version = at, new_k, version

    def on_step(self, engine, step):
        if step.step_seq == self.at:
            table = DraftTable.from_vllm([[1, engine.switch.max_batch, self.new_k]])
            engine.switch.stage(table, self.version)


def test_a_table_staged_mid_run_changes_k_next_from_the_next_step(generated_traces, tmp_path):
    run_scenario(chat(generated_traces, duration_s=5.0, concurrency=8),
                 SwitchAtStep(5, at=40, new_k=1, version=3), sink=f"file://{tmp_path}")
    records = _sorted_records(tmp_path)
    k_next, version, k = records["k_next"], records["table_version"], records["k"]
    assert len(k_next) > 60
    assert set(k_next[:41]) == {5} and set(version[:41]) == {0}
    assert set(k_next[41:]) == {1} and set(version[41:]) == {3}
    assert k[41] == 5 and k[42] == 1  # drafts proposed at step N are verified at step N+1


def test_finished_requests_add_up_to_their_steps(generated_traces, tmp_path):
    summary = run_scenario(chat(generated_traces, duration_s=40.0), FixedK(3),
                           sink=f"file://{tmp_path}")
    table = read_file_sink(tmp_path)
    requests: dict[tuple[int, int], list[dict]] = {}
    for seq, rows in zip(table.column("step_seq").to_pylist(),
                         table.column("finished_requests").to_pylist(), strict=True):
        for row in rows:
            requests.setdefault((seq, row["request"]), []).append(row)
    # every finished request that decoded at least once (outputs of one token never do)
    assert 0.9 * summary.requests_finished <= len(requests) <= summary.requests_finished
    for rows in requests.values():
        assert [r["segment"] for r in rows] == sorted({r["segment"] for r in rows})
        for r in rows:
            reached, accepted = np.array(r["reached_per_pos"]), np.array(r["accepted_per_pos"])
            assert r["decode_steps"] >= r["drafting_steps"] >= 0
            assert reached[0] == r["drafting_steps"]  # every draft reaches position 1
            assert (accepted <= reached).all() and (reached[1:] <= accepted[:-1]).all()
            assert r["decode_steps"] <= r["tokens"] <= r["decode_steps"] + accepted.sum()
            assert reached[3:].sum() == 0  # K3
    # the sums are the decode steps: their context matches the step records'
    decode_ctx = sum(r["context_tokens"] for rows in requests.values() for r in rows)
    decode_steps = sum(r["decode_steps"] for rows in requests.values() for r in rows)
    per_step = np.array(table.column("kv_tokens")) / np.maximum(
        np.array(table.column("batch_size")), 1)
    assert abs(decode_ctx / decode_steps / per_step.mean() - 1) < 0.25
