from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import (
    DraftTable,
    EnvelopeError,
    SignatureError,
    TableEnvelope,
    TableError,
    TableKey,
    canonical_json,
)
from tests.test_schemas.strategies import draft_tables


def make_envelope(table: DraftTable, version: int = 3) -> TableEnvelope:
    return TableEnvelope(
        key=TableKey("llama-3.1-8b", "eagle", "h100"),
        version=version,
        table=table,
        startup_k_values=tuple(range(8)),
        max_batch=table.max_batch,
        created_at="2026-11-29T12:00:00Z",
        provenance={"records": 1234, "engines": ["e1", "e2"]},
        predicted_goodput_tok_s=tuple(100.0 + b for b in range(table.max_batch)),
        surface={"batch_sizes": [1], "k_values": [0, 5], "stderr": [[0.1, 0.2]]},
    )


@settings(max_examples=80, deadline=None)
@given(draft_tables(), st.integers(min_value=1, max_value=2**40))
def test_json_round_trip_is_canonical(table, version):
    envelope = make_envelope(table, version)
    raw = envelope.to_json()
    back = TableEnvelope.from_json(raw)
    assert back == envelope
    assert back.to_json() == raw
    assert raw == canonical_json(json.loads(raw))
    back.validate()


def test_signature_verifies_and_detects_tampering():
    envelope = make_envelope(DraftTable.from_vllm([[1, 8, 5], [9, 64, 2]]))
    signed = envelope.signed("k1", b"secret-1")
    TableEnvelope.from_json(signed.to_json()).verify({"k1": b"secret-1"})

    with pytest.raises(SignatureError, match="^unsigned"):
        envelope.verify({"k1": b"secret-1"})
    with pytest.raises(SignatureError, match="^unknown_key: key id 'k1'"):
        signed.verify({"k2": b"secret-1"})
    with pytest.raises(SignatureError, match="^bad_signature"):
        signed.verify({"k1": b"another secret"})
    data = json.loads(signed.to_json())
    data["table"][0][2] = 7
    with pytest.raises(SignatureError, match="^bad_signature"):
        TableEnvelope.from_dict(data).verify({"k1": b"secret-1"})


def test_signature_is_stable_across_key_order():
    envelope = make_envelope(DraftTable.from_vllm([[1, 64, 3]])).signed("k1", b"s")
    data = json.loads(envelope.to_json())
    reordered = json.dumps(dict(reversed(list(data.items()))), indent=2)
    TableEnvelope.from_json(reordered).verify({"k1": b"s"})


def test_envelope_validate_refuses_k_outside_startup_set():
    envelope = make_envelope(DraftTable.from_vllm([[1, 8, 5], [9, 64, 2]]))
    envelope = TableEnvelope.from_dict({**envelope.to_dict(), "startup_k_values": [0, 2, 3, 5]})
    envelope.validate()
    odd = TableEnvelope.from_dict({**envelope.to_dict(), "startup_k_values": [0, 3, 5]})
    with pytest.raises(TableError, match=r"K values \[2\] are not in the engine's startup set"):
        odd.validate()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("version"), "field 'version' is missing"),
        (lambda d: d.update(version="3"), "version must be an integer"),
        (lambda d: d.update(version=0), "version 0 must be >= 1"),
        (lambda d: d.update(key={"model": "a|b", "drafter": "x", "hardware": "y"}),
         "key.model 'a|b'"),
        (lambda d: d.update(format=9), "format 9 is unknown"),
        (lambda d: d.update(predicted_goodput_tok_s=[1.0]), "predicted_goodput_tok_s has 1"),
    ],
)
def test_malformed_envelopes_name_the_field(mutate, message):
    data = make_envelope(DraftTable.from_vllm([[1, 64, 3]])).to_dict()
    mutate(data)
    with pytest.raises(EnvelopeError, match=message):
        TableEnvelope.from_dict(data)


def test_table_key_parse_round_trip():
    key = TableKey.parse("llama|eagle|h100")
    assert str(key) == "llama|eagle|h100"
    with pytest.raises(EnvelopeError, match="not model|drafter|hardware"):
        TableKey.parse("llama|eagle")


def test_from_json_refuses_garbage():
    with pytest.raises(EnvelopeError, match="not JSON"):
        TableEnvelope.from_json(b"\xff{")
    with pytest.raises(EnvelopeError, match="must be an object"):
        TableEnvelope.from_json(b"[1, 2]")
