"""The control service reads an engine's telemetry as the key's that the engine announced
it follows: `TABLETUNE_TABLE_KEY` may differ from its model|drafter|hardware (one table for
fleets on two GPU names, or a walkthrough's short key), and that key's loop must see it."""

from __future__ import annotations

import pyarrow as pa

from controller.fleet.service import ControlService
from controller.validation import EngineLimits
from fitter.surface.synthetic import make_step_records
from schemas import DraftTable, TableKey

IDENTITY = TableKey("llama-3.1-8b", "eagle", "h100")
SHARED = TableKey("llama-3.1-8b", "eagle", "h100-fleet")


class Channel:
    def send(self, message: object) -> None:
        pass


def service(only_key: TableKey | None = None) -> ControlService:
    return ControlService(lambda *a, **k: None, lambda _key: Channel(),  # type: ignore[arg-type,return-value]
                          only_key=only_key)


def announce(control: ControlService, key: TableKey, engine_id: str) -> None:
    control.engine_started(key, EngineLimits(key, frozenset(range(8)), 256),
                           DraftTable.from_vllm([[1, 256, 3]]), engine_id=engine_id)


def test_telemetry_goes_to_the_key_its_engine_announced() -> None:
    records = make_step_records(400, seed=1, n_engines=2)  # engine-0, engine-1, identity h100
    control = service(only_key=SHARED)
    announce(control, SHARED, "engine-0")
    control.records(records)
    assert set(control.keys) == {SHARED}
    pending = pa.concat_tables(control.keys[SHARED].pending)
    assert set(pending.column("engine_id").to_pylist()) == {"engine-0"}
    assert pending.num_rows == sum(e == "engine-0" for e in records["engine_id"].to_pylist())


def test_engines_that_announce_nothing_keep_their_identity_key() -> None:
    records = make_step_records(400, seed=2, n_engines=2)
    control = service()
    announce(control, IDENTITY, "engine-9")  # the limits of the identity key, another engine
    announce(control, SHARED, "engine-1")
    control.records(pa.concat_tables([records, records.slice(0, 10)]))
    served = {key: pa.concat_tables(k.pending) for key, k in control.keys.items()}
    assert set(served) == {IDENTITY, SHARED}
    assert set(served[IDENTITY].column("engine_id").to_pylist()) == {"engine-0"}
    assert set(served[SHARED].column("engine_id").to_pylist()) == {"engine-1"}
