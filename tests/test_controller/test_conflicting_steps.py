"""The control service against two writers for one engine id: its fits see neither copy of
a step sent in two versions, and a `conflict` event on the status topic names the engines,
once per step."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from controller.fleet.conflict_watch import ConflictWatch
from controller.fleet.decisions import What
from controller.fleet.loop_config import LoopConfig
from controller.fleet.service import ControlService
from controller.fleet.table_log import read_topic
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from fitter.derive import fit_table
from fitter.engine_consensus import with_screening
from schemas import DraftTable, TableEnvelope, TableKey
from tests.test_fitter.test_step_conflicts import (
    ENGINES,
    forge,
    forged_copies,
    forged_mask,
    honest_records,
)

KEY = TableKey("llama-3.1-8b", "eagle", "h100")
STARTUP = DraftTable.from_vllm([[1, 256, 3]])
LIVE_ROWS = 2_000
"""The newest honest steps come in live (the loop's clock and its refit); the rest, forged
copies among them, are the restarted service's lookback."""


class Channel:
    def send(self, message: object) -> None:
        pass


def test_the_control_service_fits_neither_copy_and_names_the_engines(topic_settings):
    honest = honest_records()
    forged = forged_copies(honest)
    fitted: list[pa.Table] = []
    screened = with_screening(fit_table)

    def fit(records: pa.Table, **options: Any) -> TableEnvelope:
        fitted.append(records)
        return screened(records, **options)

    # a window of two hours: the copies stamped an hour earlier are among the steps it fits
    control = ControlService(fit, lambda _key: Channel(), settings=topic_settings,  # type: ignore[arg-type,return-value]
                             config=LoopConfig(fit_window_s=7_200.0, refit_interval_s=1.0))
    control.engine_started(KEY, EngineLimits(KEY, frozenset(range(8)), 256), STARTUP)
    control.table_seen(TableEnvelope(key=KEY, version=1, table=STARTUP,
                                     startup_k_values=tuple(range(8)), max_batch=256,
                                     created_at="2023-11-14T22:00:00+00:00"))
    lookback, live = honest.slice(0, honest.num_rows - LIVE_ROWS), honest.slice(
        honest.num_rows - LIVE_ROWS)
    control.history(pa.concat_tables([forged, lookback]))
    control.records(live.slice(0, LIVE_ROWS // 2))
    control.tick()  # starts the loop's clock
    control.records(live.slice(LIVE_ROWS // 2))
    control.tick()  # a refit is due
    loop = control.loop(KEY)
    assert loop is not None
    loop.status.close()  # what the status publisher holds, delivered

    assert [d.what for d in loop.decisions if d.what in (What.REFIT, What.FIT_FAILED)] == \
        [What.REFIT]
    [records] = fitted
    untouched = honest.filter(pa.array(~forged_mask(honest)))
    assert records.num_rows == untouched.num_rows
    assert pc.min(records.column("ts_ns")).as_py() >= pc.min(honest.column("ts_ns")).as_py()
    assert sorted(records.column("step_latency_s").to_pylist()) == \
        sorted(untouched.column("step_latency_s").to_pylist())
    per_engine = forged.num_rows // 2
    assert loop.conflicts.steps == {ENGINES[0]: per_engine, ENGINES[1]: per_engine}

    events = [json.loads(m.value) for m in read_topic(topic_settings,
                                                      topic_settings.topics.status,
                                                      idle_polls=2, timeout_s=10)]
    [event] = [e for e in events if e["event"] == "conflict"]
    assert event["table_key"] == str(KEY)
    assert event["engines"] == {ENGINES[0]: per_engine, ENGINES[1]: per_engine}
    assert event["steps"] == forged.num_rows and event["records"] == 2 * forged.num_rows
    assert event["engine_count"] == 2


def test_a_conflicting_step_is_counted_and_reported_once():
    honest = honest_records().slice(0, 2_000)
    status = StatusPublisher(None, "control", str(KEY))
    watch = ConflictWatch(status)
    first = pa.concat_tables([forge(honest.slice(0, 100)), honest])
    watch.screen(first)
    watch.screen(first)  # the next refit's window holds the same steps
    later = pa.concat_tables([first, forge(honest.slice(1_000, 10))])
    kept = watch.screen(later)
    assert kept.num_rows == honest.num_rows - 110
    assert [e["engines"] for e in status.recent] == [{ENGINES[0]: 50, ENGINES[1]: 50},
                                                     {ENGINES[0]: 5, ENGINES[1]: 5}]
    assert watch.steps == {ENGINES[0]: 55, ENGINES[1]: 55}
    assert watch.to_dict() == {"steps": 110, "engine_count": 2,
                               "engines": {ENGINES[0]: 55, ENGINES[1]: 55}}
