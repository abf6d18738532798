"""A key's latency knowledge on the status topic: read back exactly, signed where keys are
configured, and a hostile event refused by name rather than crashing the service."""

from __future__ import annotations

import json

import pytest

from controller.fleet.knowledge_event import knowledge_fields, read_knowledge
from fitter.surface.latency_memory import LatencyCells
from fitter.surface.synthetic import make_step_records
from schemas import TableKey
from schemas.settings import Settings
from schemas.signing import generate_private_key

KEY = TableKey("llama-3.1-8b-instruct", "eagle", "twin-h100")


def _event(settings: Settings | None) -> dict:
    cells = LatencyCells.from_records(make_step_records(4000, seed=2, max_batch=64,
                                                        context_tokens=512.0))
    fields = knowledge_fields(settings, str(KEY), 1234.5678, cells)
    return json.loads(json.dumps({"event": "latency_knowledge", "table_key": str(KEY),
                                  **fields}))


def _signing() -> Settings:
    private = generate_private_key()
    return Settings(signing_key_id="control-1", signing_key=private)


def test_a_signed_event_is_read_back_exactly_and_a_forged_one_refused() -> None:
    settings = _signing()
    event = _event(settings)
    key, clock_s, cells = read_knowledge(event, settings.keyring())
    assert key == KEY and str(key) == event["table_key"] and clock_s == 1234.568
    assert len(cells) > 0 and cells.to_json() == event["cells"]
    forged = json.loads(json.dumps(event))
    forged["cells"]["step_s"][0] *= 3  # a compromised engine's slower step
    with pytest.raises(ValueError, match="not signed by a known key"):
        read_knowledge(forged, settings.keyring())
    with pytest.raises(ValueError, match="not signed by a known key"):
        read_knowledge(_event(None), settings.keyring())  # unsigned, where keys are set
    assert len(read_knowledge(_event(None), {})[2]) > 0  # no keys: taken, as controls are


@pytest.mark.parametrize(("field", "value", "named"), [
    ("clock_s", int("9" * 400), "int too large"),
    ("clock_s", "nan", "not finite"),
    ("table_key", "no-bars", "table key"),
    ("cells", {"columns": ["x"] * 10_000}, "columns"),
])
def test_a_hostile_event_is_refused_by_name(field, value, named) -> None:
    event = _event(None)
    event[field] = value
    with pytest.raises(ValueError, match=named) as refused:
        read_knowledge(event, {})
    assert len(str(refused.value)) < 400  # the log quotes a bounded part of it
