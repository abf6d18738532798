"""The fitter against spoofed engine ids: a minority of engines that disagree with the rest
does not move the table, one id cannot outweigh the fleet, honest fleets lose nothing."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from fitter.derive import fit_table
from fitter.engine_consensus import RECORD_CAP_FACTOR, screen, with_screening
from fitter.refit import decide_refit
from fitter.surface.synthetic import make_step_records

MAX_BATCH = 256
FIT = {"max_k": 7, "max_batch": MAX_BATCH, "startup_k_values": tuple(range(8)),
       "half_life_s": None}


@pytest.fixture(scope="module")
def honest() -> pa.Table:
    """Four honest engines of one key."""
    return make_step_records(24_000, seed=5, n_engines=4, max_batch=MAX_BATCH)


def _renamed(records: pa.Table, engine_id: str, *, latency_factor: float = 1.0,
             from_k: int = 3) -> pa.Table:
    """`records` under another engine id, `latency_factor` times slower at K >= `from_k`."""
    latency = records.column("step_latency_s").to_numpy()
    latency = np.where(records.column("k_next").to_numpy() >= from_k,
                       latency * latency_factor, latency)
    schema = records.schema
    out = records.set_column(schema.get_field_index("engine_id"), schema.field("engine_id"),
                             pa.array([engine_id] * records.num_rows))
    return out.set_column(schema.get_field_index("step_latency_s"),
                          schema.field("step_latency_s"), pa.array(latency))


def _engine(records: pa.Table, engine_id: str) -> pa.Table:
    return records.filter(pc.equal(records.column("engine_id"), engine_id))


def _poisoned(honest: pa.Table) -> pa.Table:
    """The attack seen: copies of two honest engines' steps under new ids, 3x slower at
    K >= 3 (2 engine ids of 6)."""
    copies = [_renamed(_engine(honest, f"engine-{i}"), f"spoof-{i}", latency_factor=3.0)
              for i in range(2)]
    return pa.concat_tables([honest, *copies])


def test_a_spoofed_minority_of_engines_does_not_move_the_table(honest):
    poisoned = _poisoned(honest)
    unprotected = fit_table(poisoned, key="m|eagle|h100", version=1, **FIT).table
    clean = decide_refit(honest, None, **FIT)
    attacked = decide_refit(poisoned, None, **FIT)
    # the attack is real: the fit without the consensus step moves (it did in production)
    assert unprotected.to_vllm() != clean.envelope.table.to_vllm()
    assert attacked.envelope.table.to_vllm() == clean.envelope.table.to_vllm()
    screening = attacked.screening
    assert screening is not None and set(screening.dropped_engines) == {"spoof-0", "spoof-1"}
    assert all(ratio > 2.5 for ratio in screening.dropped_engines.values())
    assert attacked.envelope.provenance["screening"]["dropped_engines"] == ["spoof-0",
                                                                           "spoof-1"]
    assert attacked.to_dict()["screening"]["dropped_engine_count"] == 2
    assert clean.screening is not None and not clean.screening.changed


def test_a_hundred_spoofed_steps_are_judged_too(honest):
    """A sparse id (100 steps, no cell of its own with enough steps) is judged on all its
    steps against the cells' consensus, as slow or as fast."""
    for factor in (3.0, 0.3):
        spoof = _renamed(honest.slice(0, 100), "sparse", latency_factor=factor, from_k=0)
        _, screening = screen(pa.concat_tables([honest, spoof]))
        assert set(screening.dropped_engines) == {"sparse"}


def test_one_engine_id_cannot_outweigh_the_fleet(honest):
    flood = pa.concat_tables([_renamed(honest, "flood")] * 3)  # 72,000 steps under one id
    kept, screening = screen(pa.concat_tables([honest, flood]))
    assert screening.capped_engines == {"flood": flood.num_rows}
    assert not screening.dropped_engines  # it agrees; it is only too many
    counts = dict(zip(*np.unique(kept.column("engine_id").to_numpy(zero_copy_only=False),
                                 return_counts=True), strict=True))
    assert counts["flood"] == math.ceil(RECORD_CAP_FACTOR * np.median(
        [counts[f"engine-{i}"] for i in range(4)] + [flood.num_rows]))
    assert all(counts[f"engine-{i}"] == 6_000 for i in range(4))


def test_honest_fleets_of_unlike_traffic_lose_nothing():
    """Engines at other contexts and batch ranges are compared like for like (cells), not
    with each other's averages; two engines are never judged."""
    fleet = pa.concat_tables([
        make_step_records(9_000, seed=1, n_engines=3, engine_prefix="short",
                          context_tokens=256),
        make_step_records(9_000, seed=2, n_engines=3, engine_prefix="long",
                          context_tokens=4096, max_batch=64, noise_rel=0.08)])
    kept, screening = screen(fleet)
    assert kept is fleet and not screening.changed and screening.engines == 6
    pair = pa.concat_tables([_engine(fleet, "short-0"),
                             _renamed(_engine(fleet, "short-1"), "slow", latency_factor=3)])
    assert not screen(pair)[1].changed


def test_the_control_service_fit_drops_invalid_rows_and_names_spoofed_engines(honest):
    poisoned = _poisoned(honest)
    latency = poisoned.column("step_latency_s").to_numpy().copy()
    latency[:50] = np.nan
    poisoned = poisoned.set_column(poisoned.schema.get_field_index("step_latency_s"),
                                   "step_latency_s", pa.array(latency))
    fit = with_screening(fit_table)
    envelope = fit(poisoned, key="m|eagle|h100", version=3, provenance={"reason": "refit"},
                   **FIT)
    screening = envelope.provenance["screening"]
    assert screening["dropped_engines"] == ["spoof-0", "spoof-1"]
    assert screening["invalid_records"] == 50
    assert envelope.provenance["reason"] == "refit"
