"""A key's latency knowledge on the status topic: read back exactly, signed where keys are
configured, and a hostile event refused by name rather than crashing the service."""

from __future__ import annotations

import json

import pytest

from controller.fleet.knowledge_event import knowledge_fields, read_knowledge
from controller.fleet.regimes import Regime, Signature
from fitter.surface.latency_memory import LatencyCells
from fitter.surface.synthetic import make_step_records
from schemas import TableKey
from schemas.settings import Settings
from schemas.signing import generate_private_key

KEY = TableKey("meta-llama/Llama-3.1-8B-Instruct", "eagle", "NVIDIA H100 80GB HBM3")
"""A model id with a slash and a GPU name with spaces: the key comes back byte for byte."""


REGIMES = [Regime(Signature({2: 0.31, 5: 0.42}, {2: 900.0, 5: 1200.0}, 32.0), None, (4, 5, 6),
                  None, 120.0, "stale", version=3),
           Regime(Signature({7: 0.81}, {7: 3000.0}, 30.5), None, None, None, 300.0, "profile",
                  version=None)]  # published no table: nothing to send again, left out


def _event(settings: Settings | None) -> dict:
    cells = LatencyCells.from_records(make_step_records(4000, seed=2, max_batch=64,
                                                        context_tokens=512.0))
    fields = knowledge_fields(settings, str(KEY), 1234.5678, cells, REGIMES)
    return json.loads(json.dumps({"event": "latency_knowledge", "table_key": str(KEY),
                                  **fields}))


def _signing() -> Settings:
    private = generate_private_key()
    return Settings(signing_key_id="control-1", signing_key=private)


def test_a_signed_event_is_read_back_exactly_and_a_forged_one_refused() -> None:
    settings = _signing()
    event = _event(settings)
    memory = read_knowledge(event, settings.keyring())
    assert memory.key == KEY and str(memory.key) == event["table_key"]
    assert memory.clock_s == 1234.568
    assert len(memory.cells) > 0 and memory.cells.to_json() == event["cells"]
    [regime] = memory.regimes
    assert regime.signature == REGIMES[0].signature and regime.version == 3
    assert regime.k_values == (4, 5, 6) and regime.records is None
    for tamper in (lambda e: e["cells"]["step_s"].__setitem__(0, 3 * e["cells"]["step_s"][0]),
                   lambda e: e["regimes"][0].__setitem__("version", 1)):
        forged = json.loads(json.dumps(event))
        tamper(forged)  # a compromised engine's slower step, or an older table recalled
        with pytest.raises(ValueError, match="not signed by a known key"):
            read_knowledge(forged, settings.keyring())
    with pytest.raises(ValueError, match="not signed by a known key"):
        read_knowledge(_event(None), settings.keyring())  # unsigned, where keys are set
    assert len(read_knowledge(_event(None), {}).cells) > 0  # no keys: taken, as controls are


@pytest.mark.parametrize(("field", "value", "named"), [
    ("clock_s", int("9" * 400), "int too large"),
    ("clock_s", "nan", "not finite"),
    ("table_key", "no-bars", "table key"),
    ("cells", {"columns": ["x"] * 10_000}, "columns"),
    ("regimes", [{"acceptance": {"2": 0.3}, "drafts": {"2": 9.0}, "batch": 8.0,
                  "version": True, "k_values": None, "learned_s": 1.0, "reason": "stale"}],
     "version"),
    ("regimes", [{"acceptance": {"x": 0.3}}], "regime"),
    ("regimes", [{}] * 9, "at most 8"),
])
def test_a_hostile_event_is_refused_by_name(field, value, named) -> None:
    event = _event(None)
    event[field] = value
    with pytest.raises(ValueError, match=named) as refused:
        read_knowledge(event, {})
    assert len(str(refused.value)) < 400  # the log quotes a bounded part of it
