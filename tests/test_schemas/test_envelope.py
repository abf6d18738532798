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
from schemas.signing import generate_private_key
from tests.test_schemas.strategies import draft_tables

KEY_1 = generate_private_key()
OTHER = generate_private_key()


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
    signed = envelope.signed("k1", KEY_1)
    engine_keys = {"k1": KEY_1.public_key()}  # an engine holds the public key only
    TableEnvelope.from_json(signed.to_json()).verify(engine_keys)
    assert json.loads(signed.to_json())["signature"]["algorithm"] == "Ed25519"
    assert len(json.loads(signed.to_json())["signature"]["sig"]) == 128

    with pytest.raises(SignatureError, match="^unsigned"):
        envelope.verify(engine_keys)
    with pytest.raises(SignatureError, match="^unknown_key: key id 'k1'"):
        signed.verify({"k2": KEY_1.public_key()})
    with pytest.raises(SignatureError, match="^bad_signature: the signature is not key 'k1'"):
        signed.verify({"k1": OTHER.public_key()})  # signed by another key
    with pytest.raises(SignatureError, match="^bad_signature"):
        envelope.signed("k1", OTHER).verify(engine_keys)
    data = json.loads(signed.to_json())
    data["table"][0][2] = 7
    with pytest.raises(SignatureError, match="^bad_signature"):
        TableEnvelope.from_dict(data).verify(engine_keys)
    data = json.loads(signed.to_json())
    data["signature"]["sig"] = "zz" * 64
    with pytest.raises(SignatureError, match="^bad_signature"):
        TableEnvelope.from_dict(data).verify(engine_keys)


def test_an_hmac_signed_envelope_is_refused_naming_the_algorithm():
    """What an earlier release published: parsed, then refused with the reason, whatever
    key it names."""
    import hashlib
    import hmac

    envelope = make_envelope(DraftTable.from_vllm([[1, 64, 3]]))
    mac = hmac.new(b"the shared secret", canonical_json(envelope.unsigned_payload()),
                   hashlib.sha256).hexdigest()
    legacy = {**envelope.to_dict(),
              "signature": {"key_id": "k1", "algorithm": "HMAC-SHA256", "mac": mac}}
    parsed = TableEnvelope.from_json(json.dumps(legacy))
    assert parsed.signature is not None and parsed.signature.algorithm == "HMAC-SHA256"
    with pytest.raises(SignatureError, match="^bad_algorithm: algorithm 'HMAC-SHA256': "
                       "HMAC-SHA256 signatures are no longer accepted") as refused:
        parsed.verify({"k1": KEY_1.public_key()})
    assert refused.value.reason == "bad_algorithm"
    without_algorithm = {**legacy, "signature": {"key_id": "k1", "mac": mac}}
    with pytest.raises(SignatureError, match="^bad_algorithm: algorithm 'HMAC-SHA256'"):
        TableEnvelope.from_json(json.dumps(without_algorithm)).verify(
            {"k1": KEY_1.public_key()})


def test_signature_is_stable_across_key_order():
    envelope = make_envelope(DraftTable.from_vllm([[1, 64, 3]])).signed("k1", KEY_1)
    data = json.loads(envelope.to_json())
    reordered = json.dumps(dict(reversed(list(data.items()))), indent=2)
    TableEnvelope.from_json(reordered).verify({"k1": KEY_1.public_key()})


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
