"""A table key as vLLM spells it (an HF model id with `/`, a GPU name with spaces) survives
engine -> telemetry topic -> ingest -> Parquet -> fit -> tables topic -> the engine's feed."""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from controller.engine.follower import TableFeed
from controller.engine.table_switch import TableSwitch
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from fitter.dataset import escape, hive_path, read_dataset, unescape
from fitter.ingest import IngestConfig, Ingestor
from fitter.surface.synthetic import make_step_records
from producers.kafka_sink import KafkaSink
from schemas import DraftTable, TableKey
from schemas.settings import Settings
from tabletune.fit_job import RefitJob, refit_once

KEY = TableKey("meta-llama/Llama-3.1-8B-Instruct", "eagle:EAGLE3-LLaMA3.1-Instruct-8B",
               "NVIDIA H100 80GB HBM3")
MAX_BATCH = 64


@pytest.fixture
def settings(topic_settings) -> Settings:
    return topic_settings


def _stamped(records: pa.Table, key: TableKey, engine_id: str) -> pa.Table:
    for name, value in (("model", key.model), ("drafter", key.drafter),
                        ("hardware", key.hardware), ("engine_id", engine_id)):
        column = pa.array([value] * records.num_rows, type=pa.string())
        records = records.set_column(records.schema.get_field_index(name), name, column)
    return records


@pytest.mark.parametrize("value", ["meta-llama/Llama-3.1-8B-Instruct", "NVIDIA H100 80GB HBM3",
                                   "a_b", "a/b", "..", ".", "x=y", "100%", "ü", "", "%00"])
def test_escape_is_reversible_and_makes_one_folder(value):
    spelled = escape(value)
    assert unescape(spelled) == value
    assert "/" not in spelled and spelled not in (".", "..") and spelled


def test_escapes_of_different_names_differ():
    # The old escape wrote both of these as model=meta-llama_Llama-3.1-8B
    assert escape("meta-llama/Llama-3.1-8B") != escape("meta-llama_Llama-3.1-8B")


def test_a_real_vllm_key_reaches_its_engine(settings, tmp_path, unique_name):
    engine_id = "gpu-node-7/engine 0"
    sink = KafkaSink(settings)
    records = _stamped(make_step_records(6_000, seed=3, max_batch=MAX_BATCH, k_values=range(6)),
                       KEY, engine_id)
    for start in range(0, records.num_rows, 1000):
        sink.write(records.slice(start, 1000))
    assert sink.flush(timeout_s=20)
    sink.close()

    parquet = tmp_path / "parquet"
    counters = Ingestor(settings, IngestConfig(out_dir=parquet, group_id=unique_name,
                                               until_idle_s=2.0)).run()
    assert counters.records == records.num_rows and counters.dlq == 0
    folder = parquet / hive_path(KEY.model, KEY.drafter, KEY.hardware, "2023-11-14", 22)
    assert folder.is_dir(), sorted(p.as_posix() for p in parquet.rglob("*"))[:5]
    stored = pq.read_table(next(folder.glob("*.parquet")))
    assert set(stored.column("model").to_pylist()) == {KEY.model}
    frame = read_dataset(parquet)
    assert frame.select("model", "drafter", "hardware", "engine_id").unique().rows() == [
        (KEY.model, KEY.drafter, KEY.hardware, engine_id)]

    outcome = refit_once(RefitJob(parquet=parquet, publish=True, settings=settings))
    assert outcome.offset is not None and outcome.decision.envelope.key == KEY

    switch = TableSwitch(DraftTable.from_vllm([[1, MAX_BATCH, 5]]), max_k=5, max_batch=MAX_BATCH)
    status = StatusPublisher(None, engine_id, str(KEY))
    feed = TableFeed(settings, switch, EngineLimits(KEY, frozenset(range(6)), MAX_BATCH),
                     status, explore_share=0.0).start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and switch.version != outcome.decision.envelope.version:
            switch.apply_staged()  # the engine's step boundary
            time.sleep(0.05)
    finally:
        feed.stop()
    assert switch.version == outcome.decision.envelope.version
    assert switch.table == outcome.decision.envelope.table
