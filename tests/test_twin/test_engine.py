"""The twin's engine semantics: determinism, token accounting, the lookup index, phases."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from schemas import DraftTable
from twin import (
    DrafterConfig,
    EngineConfig,
    PhaseConfig,
    Policy,
    Scenario,
    build_engine,
    run_scenario,
)

GSM8K_EAGLE = (0.72, 0.67, 0.65, 0.65, 0.65)
"""GSM8K's conditional acceptance under EAGLE, for the one test that needs parametric requests."""

Workload = Callable[..., PhaseConfig]


@pytest.fixture
def gsm8k(generated_traces: Path) -> Path:
    return generated_traces / "gsm8k.jsonl"


@pytest.fixture
def workload(gsm8k: Path) -> Workload:
    """Phases of GSM8K-shaped trace requests; no acceptance to fall back on, so a missing
    trace fails the test instead of swapping in parametric requests."""

    def make(**overrides) -> PhaseConfig:
        fields = dict(duration_s=20.0, concurrency=8, trace=str(gsm8k))
        fields.update(overrides)
        return PhaseConfig(**fields)

    return make


def scenario(*phases: PhaseConfig, seed: int = 1, **engine) -> Scenario:
    return Scenario(seed=seed, engine=EngineConfig(**engine), phases=phases)


class Recording(Policy):
    """A static table that keeps every step's statistics."""

    step_interval = 1

    def __init__(self, table: list[list[int]]) -> None:
        self.table = DraftTable.from_vllm(table)
        self.name = "recording"
        self.steps = []

    def initial_table(self, *, max_k, max_batch):
        return DraftTable.from_dense(self.table.to_dense(max_batch)), 0

    def on_step(self, engine, step):
        self.steps.append(step)


def test_same_seed_same_run_and_another_seed_differs(workload):
    first = run_scenario(scenario(workload(), seed=5), "vllm-doc").to_dict()
    again = run_scenario(scenario(workload(), seed=5), "vllm-doc").to_dict()
    other = run_scenario(scenario(workload(), seed=6), "vllm-doc").to_dict()
    assert json.dumps(first) == json.dumps(again)
    assert first["output_tokens"] != other["output_tokens"]


def test_k0_emits_exactly_one_token_per_request_per_step(workload):
    policy = Recording([[1, 256, 0]])
    engine, _, _ = build_engine(scenario(workload(concurrency=16)), policy)
    engine.run(policy)
    assert policy.steps
    for step in policy.steps:
        assert step.k == 0 and step.num_draft_tokens == 0 and step.num_accepted_tokens == 0
        if step.num_prefill_reqs == 0:
            assert step.emitted_tokens == step.batch_size
        else:  # a completed prefill emits the request's first token
            assert step.num_decode_reqs <= step.emitted_tokens <= step.batch_size


def test_single_request_takes_one_step_per_token_at_k0(workload):
    policy = Recording([[1, 256, 0]])
    engine, _, _ = build_engine(scenario(workload(concurrency=1, duration_s=1e-3)), policy,
                                drain=True)
    engine.run(policy)
    finished = engine.log.finished()
    assert len(finished["output_tokens"]) == 1
    assert len(policy.steps) == finished["output_tokens"][0]  # one prefill + G-1 decodes


def _trace_output_lengths(trace: Path) -> np.ndarray:
    """len(acc_eagle.acc_len) per row of the trace, read independently of the twin."""
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    return np.array([len(r["acc_eagle"]["acc_len"]) for r in rows])


def test_emitted_tokens_equal_the_generated_lengths(workload, gsm8k):
    expected = _trace_output_lengths(gsm8k)
    generated = np.array([len(json.loads(line)["generated_token_ids"])
                          for line in gsm8k.read_text().splitlines()])
    assert (expected != generated).any()  # EAGLE's column, not generated_token_ids, counts
    for policy in ("fixed:0", "fixed:5"):
        engine, _, chosen = build_engine(scenario(workload(concurrency=24)), policy, drain=True)
        log = engine.run(chosen)
        finished = log.finished()
        assert engine.batch.n == 0 and not engine.waiting
        assert sorted(finished["request_id"]) == list(range(len(finished["request_id"])))
        assert sum(log.emitted) == finished["output_tokens"].sum()
        np.testing.assert_array_equal(finished["output_tokens"], expected[finished["pool_index"]])


def test_lookup_uses_all_scheduled_requests_and_drafts_are_verified_next_step(workload):
    table = [[1, 3, 5], [4, 4, 2], [5, 256, 0]]
    dense = DraftTable.from_vllm(table).to_dense(256)
    policy = Recording(table)
    engine, _, _ = build_engine(scenario(workload(concurrency=4, duration_s=30.0)), policy)
    engine.run(policy)
    steps = policy.steps
    for step in steps:
        assert step.batch_size == step.num_decode_reqs + step.num_prefill_reqs
        assert step.k_next == dense[step.batch_size]
    mixed = [s for s in steps if s.num_prefill_reqs and s.num_decode_reqs]
    assert any(dense[s.num_decode_reqs] != dense[s.batch_size] for s in mixed)
    for previous, step in zip(steps, steps[1:], strict=False):
        if step.num_drafts:
            assert step.k == previous.k_next


class CheckingInvariants(Recording):
    """Also checks the batch layout after every step: decodes first, prefills a suffix."""

    def on_step(self, engine, step):
        super().on_step(engine, step)
        batch = engine.batch
        n, d = batch.n, batch.n - engine._prefilling
        assert np.all(batch.computed[:d] == batch.prompt[:d])
        assert np.all(batch.computed[d:n] < batch.prompt[d:n])
        assert np.all(batch.generated[:n] < batch.output[:n])


def test_chunked_prefill_stays_within_the_token_budget(workload):
    policy = CheckingInvariants([[1, 256, 7]])
    sc = scenario(workload(concurrency=40, prompt_len=700, output_len=166, trace=None,
                           acceptance=GSM8K_EAGLE, duration_s=30.0),
                  max_num_seqs=32, max_num_batched_tokens=512)
    engine, _, _ = build_engine(sc, policy)
    engine.run(policy)
    used = [s.num_decode_reqs + s.num_draft_tokens + s.num_prefill_tokens for s in policy.steps]
    assert max(used) == 512  # a chunked prompt takes whatever the decodes leave
    assert all(s.batch_size <= 32 for s in policy.steps)
    assert len(engine.log.finished()["output_tokens"]) > 10  # long prompts still complete


def test_closed_loop_phases_switch_at_their_virtual_time(workload):
    policy = Recording([[1, 256, 3]])
    phases = (workload(concurrency=2, duration_s=20.0), workload(concurrency=24, duration_s=20.0))
    engine, _, _ = build_engine(scenario(*phases), policy)
    engine.run(policy)
    before = [s for s in policy.steps if s.t_s < 20.0]
    after = [s for s in policy.steps if s.t_s >= 20.0]
    assert before and after
    assert all(s.phase == 0 and s.batch_size <= 2 for s in before)
    assert all(s.phase == 1 for s in after)
    assert after[0].batch_size > 2  # the new users arrive at the first step of the phase
    summary = run_scenario(scenario(*phases), "fixed:3")
    assert [(p["start_s"], p["end_s"]) for p in summary.phases] == [(0.0, 20.0), (20.0, 40.0)]
    assert summary.phases[0]["steps"] == len(before)
    assert summary.phases[1]["mean_batch_size"] > 5 * summary.phases[0]["mean_batch_size"]


def test_open_loop_rate_follows_the_phases(workload):
    phases = (workload(concurrency=None, rate_rps=2.0, duration_s=30.0),
              workload(concurrency=None, rate_rps=20.0, duration_s=30.0))
    engine, _, policy = build_engine(scenario(*phases), "fixed:3", drain=True)
    engine.run(policy)
    arrivals = engine.log.finished()["arrival_s"]
    first, second = np.count_nonzero(arrivals < 30.0), np.count_nonzero(arrivals >= 30.0)
    assert 30 <= first <= 100 and 450 <= second <= 750  # Poisson means 60 and 600
    assert arrivals.max() < 60.0


def test_ngram_without_a_match_proposes_nothing(workload):
    def drafts_short(match_prob: float) -> int:
        policy = Recording([[1, 256, 3]])
        sc = Scenario(seed=2, drafter=DrafterConfig(method="ngram", ngram_match_prob=match_prob),
                      phases=(workload(),))
        engine, _, _ = build_engine(sc, policy)
        engine.run(policy)
        return sum(s.num_decode_reqs - s.num_drafts for s in policy.steps if s.k)

    assert drafts_short(1.0) == 0
    assert drafts_short(0.0) > 0


def test_realtime_paces_virtual_time_to_the_wall_clock(workload):
    start = time.monotonic()
    summary = run_scenario(scenario(workload(duration_s=0.3)), "fixed:3", realtime=True)
    assert time.monotonic() - start >= 0.28
    assert summary.steps > 5


def test_abort_drops_waiting_first_then_random_running_requests(workload):
    policy = Recording([[1, 256, 3]])
    engine, _, _ = build_engine(scenario(workload(concurrency=32, duration_s=2.0),
                                         max_num_seqs=16), policy)
    engine.run(policy)
    running, waiting = engine.batch.n, len(engine.waiting)
    # closed loop of 32 on 16 slots (a request that finished in the last step is replaced at
    # the next step's start)
    assert running >= 15 and waiting >= 15 and running + waiting >= 31
    before = set(engine.batch.request_id[:running].tolist())
    assert engine.abort(waiting + 4) == waiting + 4
    assert not engine.waiting and engine.batch.n == running - 4
    left = engine.batch.request_id[:running - 4].tolist()
    assert set(left) < before and left == sorted(left)  # admission order is kept
    aborted = before - set(left)
    engine.end_s += 2.0
    engine.run(policy)  # aborted requests emit nothing more and never finish
    finished = set(engine.log.finished()["request_id"].tolist())
    assert set(left) & finished and not aborted & finished


def test_aborting_requests_in_prefill_keeps_the_engine_consistent(workload):
    policy = Recording([[1, 256, 2]])
    engine, _, _ = build_engine(scenario(workload(concurrency=48, duration_s=0.05,
                                                  prompt_scale=40.0)), policy)
    engine.run(policy)
    assert engine._prefilling > 0  # long prompts: some requests are mid-prefill
    engine.abort(engine.batch.n // 2)
    d = engine.batch.n - engine._prefilling
    assert (engine.batch.computed[:d] >= engine.batch.prompt[:d]).all()
    assert (engine.batch.computed[d:engine.batch.n] < engine.batch.prompt[d:engine.batch.n]).all()
    engine.end_s += 5.0
    engine.run(policy)  # steps on from the aborted state without tripping an invariant
    assert engine.clock_s >= engine.end_s


def test_each_phase_serves_the_same_requests_whatever_the_earlier_phases_drew(workload):
    """Common random numbers: a faster policy draws more requests in a closed loop's phase;
    the next phase must still start with the same requests in the same order, or a paired
    comparison of two policies there compares different traffic."""
    sc = scenario(workload(duration_s=10.0, concurrency=8), workload(duration_s=10.0,
                                                                     concurrency=8))

    def second_phase_requests(first_phase_arrivals: int) -> list[int]:
        engine, _, _ = build_engine(sc, Recording([[1, 256, 3]]))
        traffic = engine.traffic
        for _ in range(first_phase_arrivals):
            traffic.arrivals(1.0, in_system=7)  # one request finished per call
        drawn = traffic.arrivals(11.0, in_system=0) + traffic.arrivals(12.0, in_system=4)
        assert all(phase == 1 for _, phase, _ in drawn)
        return [index for _, _, index in drawn]

    few, many = second_phase_requests(5), second_phase_requests(50)
    assert len(few) == 12 and few == many
    assert len(set(few)) > 1


class KeepingSink:
    """Keeps copies of the recorder's frames (its buffers are reused after `write`)."""

    def __init__(self) -> None:
        self.frames = []

    def write(self, records):
        self.frames.append(records.take(list(range(records.num_rows))))

    def flush(self, timeout_s=5.0):
        return True

    def close(self, timeout_s=5.0):
        return None

    def counters(self):
        return {}


class StepByStep(Policy):
    """A static table and a (no-op) look at every step: the engine steps one by one."""

    step_interval = 1

    def __init__(self, table: list[list[int]], interval: int) -> None:
        self.table = DraftTable.from_vllm(table)
        self.name = "table"
        self.step_interval = interval

    def initial_table(self, *, max_k, max_batch):
        return DraftTable.from_dense(self.table.to_dense(max_batch)), 0


@pytest.mark.parametrize("case", ["closed", "by-batch", "open-drain", "queue", "k0"])
def test_runs_of_steps_computed_at_once_change_nothing(workload, case):
    """The engine computes stretches of steps at once (planned runs for a policy that never
    looks, decode runs between the looks of one that does): every step, record and draw
    must be what stepping one by one gives."""
    table, drain, engine_limits = [[1, 256, 3]], False, {}
    phases = (workload(concurrency=12, duration_s=8.0), workload(concurrency=20, duration_s=8.0))
    if case == "by-batch":
        table = [[1, 8, 5], [9, 14, 3], [15, 256, 1]]
    elif case == "open-drain":
        phases, drain = (workload(concurrency=None, rate_rps=30.0, duration_s=6.0),), True
    elif case == "queue":
        engine_limits = {"max_num_seqs": 8}
    elif case == "k0":
        table = [[1, 256, 0]]
    results = []
    for interval in (0, 4, 1):  # planned runs, decode runs, step by step
        sink = KeepingSink()
        policy = StepByStep(table, interval)
        engine, recorder, _ = build_engine(scenario(*phases, **engine_limits), policy,
                                           sink=sink, drain=drain)
        log = engine.run(policy)
        recorder.close()
        records = pa.concat_tables(sink.frames)
        results.append((log, records, engine.batch.n, engine.clock_s))
    *runs, (log_1, records_1, n_1, clock_1) = results
    for log, records, n, clock in runs:
        assert (n, clock) == (n_1, clock_1) and len(log.emitted) > 500
        for name in ("step_start_s", "step_latency_s", "batch_size", "k_next", "emitted",
                     "phase"):
            assert getattr(log, name) == getattr(log_1, name)
        for name, column in log.finished().items():
            np.testing.assert_array_equal(column, log_1.finished()[name])
        assert records.equals(records_1)
