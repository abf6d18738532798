from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from controller.engine.table_switch import TableSwitch
from producers.identity import EngineIdentity
from producers.metrics import CountersCollector, engine_counters, serve_metrics
from producers.recorder import StepRecorder
from producers.sinks import FileSink
from schemas import DraftTable
from schemas.settings import SettingsError
from tabletune.broker import free_port
from tests.test_producers.test_recorder import record


def test_engine_counters_are_exposed(tmp_path):
    recorder = StepRecorder(EngineIdentity("e1", "m", "eagle", "h100"), FileSink(tmp_path),
                            max_k=4)
    switch = TableSwitch(DraftTable.from_vllm([[1, 8, 3]]), max_k=4, max_batch=8)
    for i in range(7):
        record(recorder, i)
    recorder.flush()
    switch.stage(DraftTable.from_vllm([[1, 8, 2]]), version=5)
    switch.apply_staged()
    registry = CollectorRegistry()
    registry.register(CountersCollector("engine", lambda: engine_counters(recorder, switch,
                                                                          None),
                                        {"engine_id": "e1"}))
    text = generate_latest(registry).decode()
    assert 'tabletune_engine_records_total{engine_id="e1"} 7.0' in text
    assert 'tabletune_engine_table_version{engine_id="e1"} 5.0' in text
    assert 'tabletune_engine_table_swaps_total{engine_id="e1"} 1.0' in text
    assert 'tabletune_engine_exploration_probes_total{engine_id="e1"} 0.0' in text
    recorder.close()


def test_metrics_endpoint_serves_on_the_configured_port(monkeypatch):
    monkeypatch.delenv("TABLETUNE_METRICS_ADDR", raising=False)
    port = free_port()
    endpoint = serve_metrics("ingest", lambda: {"records_total": 42, "lag_messages": 3},
                             {"group": "g"}, port=port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        endpoint.close()
    assert 'tabletune_ingest_records_total{group="g"} 42.0' in text
    assert 'tabletune_ingest_lag_messages{group="g"} 3.0' in text


def test_metrics_listen_on_loopback_unless_widened(monkeypatch):
    """The endpoint has no authentication (issue 31 defect 10): 127.0.0.1 by default, any
    wider address only when TABLETUNE_METRICS_ADDR (or `addr`) names it."""
    monkeypatch.delenv("TABLETUNE_METRICS_ADDR", raising=False)
    monkeypatch.setenv("TABLETUNE_METRICS_PORT", str(free_port()))
    endpoint = serve_metrics("engine", dict, {})
    try:
        assert endpoint.host == "127.0.0.1"
        assert endpoint.server.server_address[0] == "127.0.0.1"
    finally:
        endpoint.close()
    monkeypatch.setenv("TABLETUNE_METRICS_ADDR", "0.0.0.0")  # noqa: S104
    endpoint = serve_metrics("engine", dict, {}, port=free_port())
    try:
        assert endpoint.server.server_address[0] == "0.0.0.0"  # noqa: S104
    finally:
        endpoint.close()


@pytest.mark.parametrize("text", ["abc", "-1", "70000"])
def test_a_bad_metrics_port_names_the_variable(monkeypatch, text):
    monkeypatch.setenv("TABLETUNE_METRICS_PORT", text)
    with pytest.raises(SettingsError, match=f"TABLETUNE_METRICS_PORT='{text}'"):
        serve_metrics("engine", dict, {})


def test_a_taken_metrics_port_names_the_variable_and_the_port(monkeypatch):
    monkeypatch.delenv("TABLETUNE_METRICS_ADDR", raising=False)
    taken = serve_metrics("engine", dict, {}, port=free_port())
    try:
        monkeypatch.setenv("TABLETUNE_METRICS_PORT", str(taken.port))
        with pytest.raises(SettingsError,
                           match=f"127.0.0.1:{taken.port} \\(TABLETUNE_METRICS_PORT"):
            serve_metrics("engine", dict, {})
    finally:
        taken.close()
