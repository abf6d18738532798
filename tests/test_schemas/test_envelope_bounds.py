"""Hardening defect 7, the contract: every field of an envelope is checked, with bounds,
when it is parsed, so nothing a reader sizes from it (the drift detector's per-K grid, the
explorer's per-batch lookup) can be made huge or malformed; the message itself is bounded in
bytes before it is parsed and the table in ranges."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from fitter.derive import fit_table
from fitter.surface.synthetic import make_step_records
from schemas import EnvelopeError, TableEnvelope, TableError, TableKey, parse_table_message
from schemas.draft_table import MAX_TABLE_RANGES
from schemas.envelope import MAX_ENVELOPE_BYTES

KEY = TableKey("meta-llama/Llama-3.1-8B-Instruct", "eagle", "NVIDIA H100 80GB HBM3")
PLAN_BUCKET = {"batch_start": 15, "batch_end": 32, "chosen_k": 4, "expected_gain": 0.01,
               "candidates": [{"k": 5, "p_better": 0.3, "expected_gain": 0.01,
                               "goodput_ratio": 1.01}]}


@pytest.fixture(scope="module")
def fitted() -> dict[str, Any]:
    """An envelope as the fitter writes it (max_batch 64, K 0..5), with one exploration
    bucket, as a JSON object."""
    records = make_step_records(20_000, seed=3, max_batch=64)
    envelope = fit_table(records, key=KEY, max_k=5, max_batch=64, startup_k_values=range(6),
                         version=1, half_life_s=None)
    data = envelope.to_dict()
    data["exploration"]["buckets"] = [PLAN_BUCKET]
    return data


def test_a_fitted_envelope_passes_and_round_trips(fitted: dict[str, Any]) -> None:
    envelope = TableEnvelope.from_json(json.dumps(fitted))
    assert TableEnvelope.from_json(envelope.to_json()) == envelope
    assert len(envelope.to_json()) < MAX_ENVELOPE_BYTES / 20


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation setting `path` (dots; list indexes as numbers) to `value`."""
    def mutate(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(last) if isinstance(node, list) else last] = value
    return mutate


def _widen_latency(data: dict[str, Any]) -> None:
    data["surface"]["latency_s"][3].append(0.01)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (_set("surface.k_values", [0, 1, 2, 3, 4, 3_000_000]), "surface.k_values"),
        (_set("surface.k_values", [0, 1, 2, 3, 5, 4]), "surface.k_values"),
        (_set("surface.k_values", "012345"), "surface.k_values"),
        (_set("surface.batch_sizes.0", 0), "surface.batch_sizes"),
        (_set("surface.batch_sizes.1", 1), "surface.batch_sizes"),
        (_set("surface.batch_sizes.5", 10**6), "surface.batch_sizes"),
        (_widen_latency, "surface.latency_s"),
        (_set("surface.latency_s.2.1", -0.01), "surface.latency_s"),
        (_set("surface.latency_s.2.1", "fast"), "surface.latency_s"),
        (_set("surface.goodput_tok_s.0", []), "surface.goodput_tok_s"),
        (_set("surface.acceptance_length", [1.0, 1.5]), "surface.acceptance_length"),
        (_set("surface.tokens_per_request.2", None), "surface.tokens_per_request"),
        (_set("surface.draft_share", 3.0), "surface.draft_share"),
        (_set("surface", [1, 2]), "surface"),
        (_set("exploration", [PLAN_BUCKET]), "exploration"),
        (_set("exploration.buckets", {"0": PLAN_BUCKET}), "exploration.buckets"),
        (_set("exploration.buckets.0.batch_start", "15"), "exploration.buckets[0].batch_start"),
        (_set("exploration.buckets.0.batch_end", 10**7), "exploration.buckets[0].batch_end"),
        (_set("exploration.buckets.0.batch_start", 40), "exploration.buckets[0]"),
        (_set("exploration.buckets.0.candidates.0.k", 9), "exploration.buckets[0].candidates"),
        (_set("exploration.buckets.0.candidates.0", {"p_better": 0.3}),
         "exploration.buckets[0].candidates[0].k"),
        (_set("exploration.buckets.0.candidates", "5"), "exploration.buckets[0].candidates"),
        (_set("exploration.tolerance", "1%"), "exploration.tolerance"),
        (_set("max_batch", 10**9), "max_batch"),
        (_set("startup_k_values", [0, 1, 2, 3, 4, 5, 10**6]), "startup_k_values"),
        (_set("startup_k_values", [0, 1, 1, 2, 3, 4, 5]), "startup_k_values"),
        (_set("startup_k_values", []), "startup_k_values"),
        (_set("predicted_goodput_tok_s.3", -5.0), "predicted_goodput_tok_s"),
        (_set("predicted_goodput_tok_s.3", "many"), "predicted_goodput_tok_s"),
        (_set("created_at", "yesterday"), "created_at"),
        (_set("provenance", "fitted"), "provenance"),
        (_set("provenance", [["records", 1]]), "provenance"),
        (_set("key.model", "m" * 5000), "key.model"),
        (_set("version", True), "version"),
        (_set("version", 2**64), "version"),
        (_set("signature", {"key_id": "", "mac": "00"}), "signature.key_id"),
        (_set("signature", "signed"), "signature"),
    ],
)
def test_each_malformed_field_is_refused_naming_it(fitted: dict[str, Any],
                                                   mutate: Callable[[dict[str, Any]], None],
                                                   field: str) -> None:
    data = copy.deepcopy(fitted)
    mutate(data)
    with pytest.raises(EnvelopeError) as refused:
        parse_table_message(json.dumps(data).encode())
    assert field in str(refused.value)


def test_a_table_of_too_many_ranges_is_refused_before_it_is_built(fitted: dict[str, Any]
                                                                  ) -> None:
    bound = MAX_TABLE_RANGES
    data = {**fitted, "max_batch": bound + 1,
            "table": [[b, b, 1] for b in range(1, bound + 2)]}
    with pytest.raises((EnvelopeError, TableError), match="ranges"):
        parse_table_message(json.dumps(data).encode())


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"format": 1, "version": NaN}', "NaN"),
        (b'{"format": 1, "version": 1e999}', "inf"),
        (b'{"format": 1, "version": ' + b"9" * 5000 + b"}", "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested"),
    ],
)
def test_json_that_no_canonical_writer_makes_is_refused(raw: bytes, message: str) -> None:
    with pytest.raises(EnvelopeError, match=message):
        parse_table_message(raw)


def test_an_envelope_is_bounded_in_bytes_before_it_is_parsed(fitted: dict[str, Any]) -> None:
    bound = MAX_ENVELOPE_BYTES
    padded = {**fitted, "provenance": {"notes": "x" * bound}}
    with pytest.raises(EnvelopeError, match="bytes") as refused:
        parse_table_message(json.dumps(padded).encode())
    assert refused.value.reason == "too_large"
    with pytest.raises(EnvelopeError, match="bytes"):
        TableEnvelope.from_json(json.dumps(padded))
