"""Synthetic telemetry with a known truth (the H100 model and acceptance of docs/TWIN.md)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from fitter.surface.fit import SurfaceFit, fit_surface
from fitter.surface.synthetic import make_step_records

MAX_BATCH = 256
MAX_K = 7
TRAIN_K = (0, 2, 5)
HELD_OUT_K = (1, 3, 4, 6, 7)


def mean_abs_pct_error(predicted: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean(np.abs(predicted / truth - 1.0)) * 100.0)


@pytest.fixture(scope="session")
def all_k_records() -> pa.Table:
    """Every K explored uniformly: the uncensored reference data set."""
    return make_step_records(120_000, seed=11, max_batch=MAX_BATCH)


@pytest.fixture(scope="session")
def all_k_fit(all_k_records: pa.Table) -> SurfaceFit:
    return fit_surface(all_k_records, max_k=MAX_K, max_batch=MAX_BATCH, half_life_s=None)


@pytest.fixture(scope="session")
def censored_records() -> pa.Table:
    """Telemetry under a table in service: K is a function of B and never exceeds 5."""
    table = [0] + [5] * 16 + [4] * 16 + [3] * 32 + [2] * 64 + [1] * 128
    return make_step_records(120_000, seed=12, k_table=table, max_batch=MAX_BATCH)
