"""Two writers for one engine id: forged copies of honest steps (same engine ids and step
numbers, 3x the latency at K >= 3, stamped an hour earlier, in Parquet files that sort first)
neither replace the honest rows nor reach a fit, and are counted; a frame stored twice is
still read once."""

from __future__ import annotations

import datetime as dt

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from fitter.dataset import SOURCE_OFFSET, SOURCE_PARTITION, file_name, hive_path, load_dataset
from fitter.refit import decide_refit
from fitter.step_conflicts import drop_conflicts
from fitter.surface.synthetic import make_step_records
from tabletune.fit_job import RefitJob, refit_once

FIT = {"max_k": 7, "max_batch": 256, "startup_k_values": tuple(range(8)), "half_life_s": None}
ENGINE_PREFIX = "nœud/7 vLLM:0 "
"""Engine ids with a slash, a colon, spaces and a non-ASCII letter: they must come back as
they were sent, in counts and events."""
ENGINES = (f"{ENGINE_PREFIX}-0", f"{ENGINE_PREFIX}-1")
FORGED_SHARE = 2 / 3
"""The forger copies the first two thirds of each engine's steps: enough to move every
latency cell's median when they replace the honest rows."""
HOUR_NS = 3600 * 10**9


def honest_records() -> pa.Table:
    """Two honest engines of one key, 12,000 steps each."""
    return make_step_records(24_000, seed=5, n_engines=2, engine_prefix=ENGINE_PREFIX)


def forged_mask(honest: pa.Table) -> np.ndarray:
    """The honest rows whose steps the forger copies."""
    seq = honest.column("step_seq").to_numpy()
    return seq < int(FORGED_SHARE * seq.max())


def forged_copies(honest: pa.Table) -> pa.Table:
    """The attack seen, on the first two thirds of the honest steps."""
    return forge(honest.filter(pa.array(forged_mask(honest))))


def forge(steps: pa.Table) -> pa.Table:
    """Copies of `steps` under their engine ids and step numbers, 3x the latency at K >= 3,
    stamped an hour earlier."""
    copies = steps
    latency = copies.column("step_latency_s").to_numpy()
    slow = np.where(copies.column("k_next").to_numpy() >= 3, 3.0 * latency, latency)
    for name, values in (("step_latency_s", pa.array(slow)),
                         ("ts_ns", pc.subtract(copies.column("ts_ns"), HOUR_NS))):
        index = copies.schema.get_field_index(name)
        copies = copies.set_column(index, copies.schema.field(index), values)
    return copies


def _stored(records: pa.Table, first_offset: int) -> pa.Table:
    """`records` as ingest stores them: with the partition and offset they were read at."""
    n = records.num_rows
    return (records.append_column(SOURCE_PARTITION, pa.array(np.zeros(n, np.int32)))
            .append_column(SOURCE_OFFSET, pa.array(np.arange(first_offset, first_offset + n))))


def _write(root, records: pa.Table, first_offset: int) -> None:
    """One ingest file, in the hive folder of its first step's hour."""
    start = dt.datetime.fromtimestamp(records.column("ts_ns")[0].as_py() / 1e9, dt.UTC)
    folder = root / hive_path("llama-3.1-8b", "eagle", "h100", start.date().isoformat(),
                              start.hour)
    folder.mkdir(parents=True, exist_ok=True)
    name = file_name("tabletune.telemetry", 0, first_offset,
                     first_offset + records.num_rows - 1)
    pq.write_table(_stored(records, first_offset), folder / name)


def test_copies_of_a_step_are_read_once_and_conflicting_ones_not_at_all():
    honest = make_step_records(1_000, seed=3, n_engines=2)
    forged = forge(honest.slice(100, 30))  # 15 steps of each engine, K >= 3 or not
    resent = honest.slice(500, 40)
    mixed = pa.concat_tables([forged, honest, resent])
    for records in (mixed, pl.from_arrow(mixed)):
        kept, conflicts = drop_conflicts(records)
        assert type(kept) is type(records)
        kept = kept if isinstance(kept, pa.Table) else kept.to_arrow()
        # the honest rows, in their order, less the 30 steps that came in two versions
        expected = pa.concat_tables([honest.slice(0, 100), honest.slice(130)])
        assert kept.column("step_seq").to_pylist() == expected.column("step_seq").to_pylist()
        assert kept.column("step_latency_s").to_pylist() == \
            expected.column("step_latency_s").to_pylist()
        assert conflicts.steps == {"engine-0": 15, "engine-1": 15}
        assert conflicts.records == 60  # both copies of each
        assert conflicts.to_dict() == {"steps": 30, "records": 60, "engine_count": 2,
                                       "engines": {"engine-0": 15, "engine-1": 15}}
    # where ingest stored a row is not the step's content: a frame stored twice is a copy
    twice = pa.concat_tables([_stored(honest, 0), _stored(honest.slice(0, 50), 5_000)])
    kept, conflicts = drop_conflicts(twice)
    assert kept.num_rows == honest.num_rows and len(conflicts) == 0
    assert kept.column(SOURCE_OFFSET).to_pylist() == list(range(honest.num_rows))
    unchanged, none = drop_conflicts(honest)
    assert unchanged is honest and len(none) == 0


def test_forged_copies_that_sort_first_do_not_replace_the_honest_rows(tmp_path, caplog):
    honest = honest_records()
    forged = forged_copies(honest)
    untouched = honest.filter(pa.array(~forged_mask(honest)))
    _write(tmp_path, forged, 0)  # an hour earlier: its folder sorts first
    _write(tmp_path, honest, forged.num_rows)
    _write(tmp_path, honest.slice(20_000, 1_000), forged.num_rows + honest.num_rows)  # re-sent
    assert sorted(tmp_path.rglob("*.parquet"))[0].parent.name == "hour=21"

    # the attack is real: forged rows in place of the honest ones move the table
    clean = decide_refit(honest, None, **FIT).envelope.table.to_vllm()
    replaced = pa.concat_tables([forged, untouched])
    poisoned = decide_refit(replaced, None, **FIT).envelope.table.to_vllm()
    assert poisoned != clean

    dataset = load_dataset(tmp_path)
    records = dataset.records
    # every row read is an honest one, unchanged; the steps with two versions are not read
    assert records.height == untouched.num_rows
    assert int(records["ts_ns"].min()) >= pc.min(honest.column("ts_ns")).as_py()
    expected = pl.from_arrow(untouched).sort(["engine_id", "step_seq"])
    assert records["step_latency_s"].to_list() == expected["step_latency_s"].to_list()
    assert records["engine_id"].to_list() == expected["engine_id"].to_list()
    per_engine = forged.num_rows // 2
    assert dataset.conflicts.steps == {ENGINES[0]: per_engine, ENGINES[1]: per_engine}
    assert dataset.conflicts.records == 2 * forged.num_rows
    assert any(ENGINES[0] in record.getMessage() and "left out" in record.getMessage()
               for record in caplog.records)

    outcome = refit_once(RefitJob(parquet=tmp_path, max_k=7, max_batch=256,
                                  startup_k_values=tuple(range(8)), half_life_s=None))
    table = outcome.decision.envelope.table.to_vllm()
    assert table == decide_refit(untouched, None, **FIT).envelope.table.to_vllm()
    assert table != poisoned
    reported = outcome.to_dict()["conflicts"]
    assert reported == {"steps": forged.num_rows, "records": 2 * forged.num_rows,
                        "engines": {ENGINES[0]: per_engine, ENGINES[1]: per_engine},
                        "engine_count": 2}
    assert outcome.decision.envelope.provenance["conflicts"] == reported
    assert outcome.records == untouched.num_rows


def test_a_dataset_of_nothing_but_conflicts_fails_naming_them(tmp_path):
    honest = honest_records().slice(0, 2_000)
    _write(tmp_path, forge(honest), 0)
    _write(tmp_path, honest, honest.num_rows)
    with pytest.raises(ValueError, match="but 2000 steps stored in two different records"):
        refit_once(RefitJob(parquet=tmp_path))
