"""Hardening defect 7, in the engine: an envelope with a malformed or oversized field is
refused with a `rejected` event, once, before anything is sized from it, and the engine keeps
the table it runs; a feed that fails goes on after the last message it read instead of
folding the whole log again."""

from __future__ import annotations

import copy
import json
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from kafka import KafkaProducer

from controller.drift import DriftDetector
from controller.engine.feed import EngineFeed
from controller.engine.follower import TableFeed, wall_clock
from controller.engine.table_switch import TableSwitch
from controller.fleet.table_log import control
from controller.status import StatusPublisher
from controller.validation import EngineLimits
from fitter.derive import fit_table
from fitter.surface.synthetic import make_step_records
from schemas import DraftTable, TableKey
from schemas.envelope import MAX_ENVELOPE_BYTES
from schemas.settings import Settings
from tests.kafka_helpers import wait_until

KEY = TableKey("meta-llama/Llama-3.1-8B-Instruct", "eagle", "NVIDIA H100 80GB HBM3")
LIMITS = EngineLimits(KEY, frozenset(range(6)), 64)
STARTUP = DraftTable.from_vllm([[1, 64, 1]])
PEAK_BYTES = 64 << 20
"""What folding a handful of envelopes may allocate at most (a fitted one is ~18 KB)."""


@pytest.fixture(scope="module")
def fitted() -> dict[str, Any]:
    """A fitted envelope for this engine's limits, as a JSON object."""
    records = make_step_records(20_000, seed=3, max_batch=64)
    return fit_table(records, key=KEY, max_k=5, max_batch=64, startup_k_values=range(6),
                     version=1, half_life_s=None).to_dict()


def variant(fitted: dict[str, Any], version: int,
            change: Callable[[dict[str, Any]], None] | None = None) -> bytes:
    data = copy.deepcopy(fitted)
    data["version"] = version
    if change is not None:
        change(data)
    return json.dumps(data).encode()


def huge_k(data: dict[str, Any]) -> None:
    """The attack as found: one K of three million in the surface's K grid."""
    data["surface"]["k_values"][-1] = 3_000_000


def bad_plan(data: dict[str, Any]) -> None:
    data["exploration"]["buckets"] = [{"batch_start": "one", "batch_end": 8,
                                       "candidates": [{"k": 2}]}]


def oversized(data: dict[str, Any]) -> None:
    data["provenance"]["notes"] = "x" * MAX_ENVELOPE_BYTES


def rejected(status: StatusPublisher) -> list[dict[str, Any]]:
    return [e for e in status.recent if e["event"] == "rejected"]


def test_bad_envelopes_are_refused_before_anything_is_sized_from_them(fitted) -> None:
    """The engine's drift detector sizes a (batch, K) grid from the applied envelope's
    surface: with K = 3,000,000 that was 1.5 GB."""
    switch = TableSwitch(STARTUP, max_k=5, max_batch=64)
    status = StatusPublisher(None, "engine-0", str(KEY))
    feed = EngineFeed(switch, LIMITS, status, wall_clock)
    drift = DriftDetector(LIMITS.max_batch)
    feed.on_applied = lambda version, previous, desired: drift.set_envelope(
        version, None if desired is None else desired.surface, 0.0)

    def deliver(value: bytes, offset: int) -> None:
        feed.handle_bytes(value, offset)
        feed.sync()
        switch.apply_staged()
        feed.sync()  # confirms `applied`

    deliver(variant(fitted, 1), 0)
    assert switch.version == 1
    tracemalloc.start()
    try:
        deliver(variant(fitted, 2, huge_k), 1)
        deliver(variant(fitted, 3, bad_plan), 2)
        deliver(variant(fitted, 4, oversized), 3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert switch.version == 1  # the engine keeps the table it runs
    assert peak < PEAK_BYTES, f"{peak / 2**20:.0f} MiB"
    assert [(e["offset"], e["reason"]) for e in rejected(status)] == [
        (1, "bad_envelope"), (2, "bad_envelope"), (3, "too_large")]
    assert "surface.k_values" in rejected(status)[0]["detail"]
    assert "exploration.buckets[0].batch_start" in rejected(status)[1]["detail"]
    deliver(variant(fitted, 5), 4)
    assert switch.version == 5 and status.counts["rejected"] == 3


def _send(settings: Settings, values: list[bytes]) -> None:
    producer = KafkaProducer(bootstrap_servers=list(settings.bootstrap_servers))
    for value in values:
        producer.send(settings.topics.tables, key=str(KEY).encode(), value=value).get(10)
    producer.close()


def _nan_share(data: dict[str, Any]) -> None:
    data["surface"]["draft_share"] = float("nan")  # json.dumps writes NaN


def test_bad_envelopes_on_the_broker_are_each_refused_once(topic_settings: Settings,
                                                           fitted) -> None:
    """The malformed exploration block was silently not applied, and the feed folded the
    whole log again and again (every earlier rejection re-emitted, none for it)."""
    switch = TableSwitch(STARTUP, max_k=5, max_batch=64)
    status = StatusPublisher(None, "engine-0", str(KEY))
    _send(topic_settings, [variant(fitted, 1), variant(fitted, 2, bad_plan),
                           variant(fitted, 3, huge_k), variant(fitted, 4, _nan_share)])
    feed = TableFeed(topic_settings, switch, LIMITS, status).start()  # explores: 2%
    try:
        def running(version: int) -> bool:
            switch.apply_staged()
            return switch.version == version
        assert wait_until(lambda: running(1))
        assert wait_until(lambda: len(rejected(status)) >= 3)
        # a feed that fails retries (after 1 s) before it reads on: once it has folded a
        # release sent now (which changes nothing), any retry has shown
        marker = control(KEY, "release")
        _send(topic_settings, [marker.to_json()])
        assert wait_until(lambda: marker.control_id in feed.agent.state.folded_controls)
        assert running(1) and not switch.pending
        assert [(e["offset"], e["reason"]) for e in rejected(status)] == [
            (1, "bad_envelope"), (2, "bad_envelope"), (3, "bad_envelope")]
        _send(topic_settings, [variant(fitted, 5)])
        assert wait_until(lambda: running(5))
        assert len(rejected(status)) == 3
    finally:
        feed.stop()


class FailsOnce(TableSwitch):
    """A switch whose first stage fails with a surprise (not a refusal)."""

    failed = False

    def stage(self, *args: Any, **kwargs: Any) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("a surprise in the engine")
        super().stage(*args, **kwargs)


def test_a_feed_that_fails_goes_on_after_the_last_message_it_read(topic_settings: Settings,
                                                                  fitted) -> None:
    switch = FailsOnce(STARTUP, max_k=5, max_batch=64)
    status = StatusPublisher(None, "engine-0", str(KEY))
    _send(topic_settings, [b"not an envelope", variant(fitted, 1)])
    feed = TableFeed(topic_settings, switch, LIMITS, status, explore_share=0.0).start()
    try:
        def running(version: int) -> bool:
            switch.apply_staged()
            return switch.version == version
        assert wait_until(lambda: running(1))
        assert switch.failed
        assert [(e["offset"], e["reason"]) for e in rejected(status)] == [(0, "bad_envelope")]
    finally:
        feed.stop()
