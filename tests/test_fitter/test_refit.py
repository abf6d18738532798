"""Refit: publish only when the predicted gain beats the threshold or the table is stale."""

from __future__ import annotations

import dataclasses
import datetime as dt

import polars as pl
import pyarrow.parquet as pq
import pytest
from kafka import KafkaAdminClient
from kafka.admin import NewTopic

from controller.fleet.table_log import newest_version, publish, read_log
from fitter.dataset import file_name, hive_path
from fitter.refit import RefitError, decide_refit, key_from_records, parse_since
from fitter.surface.synthetic import make_step_records
from schemas import DraftTable, TableEnvelope, TableKey
from schemas.settings import Settings, TopicNames
from tabletune.fit_job import RefitJob, refit_once

KEY = TableKey("m", "eagle", "h100")
MAX_BATCH = 256
SERVING = [0] + [5] * 16 + [4] * 16 + [3] * 32 + [2] * 64 + [1] * 128


def _live_records(n: int = 6_000, *, start_ns: int = 1_700_000_000_000_000_000, seed: int = 1):
    """A table in service plus a share of exploration, as live windows look."""
    import pyarrow as pa

    served = make_step_records(n, seed=seed, k_table=SERVING, max_batch=MAX_BATCH,
                               start_ns=start_ns)
    explored = make_step_records(n // 10, seed=seed + 1, max_batch=MAX_BATCH,
                                 engine_prefix="explorer", forced=True, start_ns=start_ns)
    table = pa.concat_tables([served, explored])
    return pl.from_arrow(table).with_columns(model=pl.lit(KEY.model),
                                             drafter=pl.lit(KEY.drafter),
                                             hardware=pl.lit(KEY.hardware))


@pytest.fixture(scope="module")
def records() -> pl.DataFrame:
    return _live_records()


@pytest.fixture(scope="module")
def fitted(records) -> TableEnvelope:
    return decide_refit(records, None, newest_version=4).envelope


def _with_table(envelope: TableEnvelope, table: DraftTable, version: int) -> TableEnvelope:
    return dataclasses.replace(envelope, table=table, version=version,
                               predicted_goodput_tok_s=())


def test_without_a_current_table_the_first_fit_is_published(records):
    decision = decide_refit(records, None, newest_version=4)
    assert decision.publish and decision.reason == "no current table"
    assert decision.envelope.version == 5
    assert decision.envelope.key == KEY == key_from_records(records)
    assert decision.envelope.max_batch == MAX_BATCH


def test_same_table_is_not_republished_unless_stale(records, fitted):
    decision = decide_refit(records, fitted, newest_version=fitted.version)
    assert not decision.publish and decision.reason == "below threshold"
    assert abs(decision.predicted_gain) < 0.01
    stale = decide_refit(records, fitted, newest_version=fitted.version, stale=True)
    assert stale.publish and stale.reason == "stale"
    assert stale.envelope.version == fitted.version + 1


def test_a_clearly_worse_current_table_is_replaced(records, fitted):
    no_spec = _with_table(fitted, DraftTable.from_vllm([[1, MAX_BATCH, 0]]), 7)
    decision = decide_refit(records, no_spec, newest_version=7)
    assert decision.publish and decision.reason == "gain"
    assert decision.predicted_gain > 0.05
    assert decision.envelope.version == 8
    # A threshold above the predicted gain keeps the current table.
    held = decide_refit(records, no_spec, newest_version=7,
                        threshold=decision.predicted_gain + 0.01)
    assert not held.publish


def test_mixed_keys_need_an_explicit_key(records):
    other = records.head(100).with_columns(model=pl.lit("other"))
    with pytest.raises(RefitError, match="2 table keys"):
        decide_refit(pl.concat([records, other]), None)


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("30m", 1800), ("2h", 7200),
                                               ("1d", 86400), ("15", 900)])
def test_parse_since(text, seconds):
    assert parse_since(text).total_seconds() == seconds


def test_parse_since_rejects_garbage():
    with pytest.raises(RefitError, match="expected a number"):
        parse_since("soon")


def _write_dataset(root, frame: pl.DataFrame, name: str) -> None:
    folder = root / hive_path(KEY.model, KEY.drafter, KEY.hardware, "2024-01-01", 0)
    folder.mkdir(parents=True, exist_ok=True)
    table = frame.drop(["model", "drafter", "hardware"]).to_arrow()
    pq.write_table(table, folder / file_name(name, 0, 0, frame.height))


def test_since_keeps_only_recent_steps(tmp_path):
    now = dt.datetime.now(dt.UTC)
    old_ns = int((now - dt.timedelta(hours=3)).timestamp() * 1e9)
    new_ns = int((now - dt.timedelta(minutes=10)).timestamp() * 1e9)
    old = _live_records(3_000, start_ns=old_ns, seed=5).with_columns(
        engine_id=pl.concat_str([pl.lit("old-"), pl.col("engine_id")]))
    new = _live_records(3_000, start_ns=new_ns, seed=6)
    _write_dataset(tmp_path, old, "old")
    _write_dataset(tmp_path, new, "new")
    everything = refit_once(RefitJob(parquet=tmp_path))
    recent = refit_once(RefitJob(parquet=tmp_path, since=parse_since("30m"),
                                 out=tmp_path / "cand.json"))
    assert everything.records == old.height + new.height
    assert recent.records == new.height
    assert recent.decision.envelope.provenance["ts_min_ns"] >= new_ns
    assert (tmp_path / "cand.json").exists()
    with pytest.raises(ValueError, match="no telemetry"):
        refit_once(RefitJob(parquet=tmp_path, since=dt.timedelta(seconds=1)),
                   now=now + dt.timedelta(hours=1))


@pytest.fixture
def settings(broker, unique_name) -> Settings:
    names = TopicNames(telemetry=f"{unique_name}.telemetry", tables=f"{unique_name}.tables",
                       status=f"{unique_name}.status", dlq=f"{unique_name}.dlq")
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic(names.tables, 1, 1), NewTopic(names.status, 1, 1)])
    admin.close()
    return Settings(bootstrap_servers=(broker.bootstrap,), topics=names)


def test_publishes_on_gain_only_and_versions_follow_the_topic(tmp_path, settings, records,
                                                              fitted):
    _write_dataset(tmp_path, records, "live")
    no_spec = _with_table(fitted, DraftTable.from_vllm([[1, MAX_BATCH, 0]]), 3)
    publish(settings, no_spec)
    job = RefitJob(parquet=tmp_path, out=tmp_path / "c.json", publish=True, settings=settings,
                   half_life_s=None)
    first = refit_once(job)
    assert first.decision.publish and first.offset is not None
    assert first.decision.envelope.version == 4
    assert first.decision.current_version == 3
    second = refit_once(job)  # the current table is now the fitted one: nothing to gain
    assert not second.decision.publish and second.offset is None
    assert newest_version(settings, KEY) == 4
    third = refit_once(job, stale=True)
    assert third.decision.publish and third.decision.reason == "stale"
    versions = [e.message.version for e in read_log(settings, KEY)]
    assert versions == [3, 4, 5]
