"""Prometheus metrics for engines and fitter jobs, collected lazily at scrape time.

Nothing is updated on the engine's hot path: a custom collector reads the recorder's,
switch's and feed's own counters when Prometheus scrapes (prometheus_client's collector
pattern), so metrics cost the engine nothing between scrapes.

The endpoint has no authentication, so it listens on loopback unless
TABLETUNE_METRICS_ADDR says otherwise: a Prometheus that scrapes the pod IP (k8s) needs
TABLETUNE_METRICS_ADDR=0.0.0.0, set in the manifest that scrapes it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from schemas.settings import SettingsError

log = logging.getLogger(__name__)

Source = Callable[[], dict[str, float]]

DEFAULT_ADDR = "127.0.0.1"
"""Where metrics listen unless TABLETUNE_METRICS_ADDR widens it (no authentication)."""


class CountersCollector(Collector):
    """Exposes named numbers from `source()` as `tabletune_<prefix>_<name>`.

    Names ending in `_total` become counters, everything else gauges."""

    def __init__(self, prefix: str, source: Source, labels: dict[str, str]) -> None:
        self.prefix = prefix
        self.source = source
        self.labels = labels

    def collect(self) -> Iterator[Any]:
        try:
            values = self.source()
        except Exception:  # a scrape must never break the process being scraped
            log.debug("metrics source failed", exc_info=True)
            return
        names, label_values = list(self.labels), list(self.labels.values())
        for name, value in sorted(values.items()):
            metric = f"tabletune_{self.prefix}_{name}"
            if name.endswith("_total"):
                family = CounterMetricFamily(metric[: -len("_total")], name, labels=names)
            else:
                family = GaugeMetricFamily(metric, name, labels=names)
            family.add_metric(label_values, float(value))
            yield family


@dataclass(frozen=True)
class MetricsEndpoint:
    registry: CollectorRegistry
    host: str
    """The address it listens on (DEFAULT_ADDR unless configured)."""
    port: int
    server: Any
    """prometheus_client's HTTP server."""

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_metrics(prefix: str, source: Source, labels: dict[str, str],
                  port: int | None = None, addr: str | None = None) -> MetricsEndpoint | None:
    """Start an HTTP endpoint on `port` (or TABLETUNE_METRICS_PORT; None when neither) at
    `addr` (or TABLETUNE_METRICS_ADDR, or loopback)."""
    if port is None:
        text = os.environ.get("TABLETUNE_METRICS_PORT")
        if not text:
            return None
        port = _port_of(text)
    host = addr or os.environ.get("TABLETUNE_METRICS_ADDR") or DEFAULT_ADDR
    registry = CollectorRegistry()
    registry.register(CountersCollector(prefix, source, labels))
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise SettingsError(f"metrics port {host}:{port} (TABLETUNE_METRICS_PORT, "
                            f"TABLETUNE_METRICS_ADDR): {exc.strerror or exc}") from None
    log.info("TableTune %s metrics on %s:%d%s", prefix, host, port,
             "" if host == DEFAULT_ADDR else " (no authentication: keep it off public networks)")
    return MetricsEndpoint(registry, host, port, server)


def _port_of(text: str) -> int:
    """TABLETUNE_METRICS_PORT as a port number, or an error naming the variable."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise SettingsError(f"TABLETUNE_METRICS_PORT={text!r}: expected a port number "
                            "0..65535")
    return port


def engine_counters(recorder: Any, switch: Any, feed: Any) -> dict[str, float]:
    """What an engine exposes: telemetry delivery, the active table and the controller."""
    out: dict[str, float] = {}
    if recorder is not None:
        counters = recorder.counters()
        out["records_total"] = counters["records_total"]
        out["records_dropped_total"] = counters["records_dropped"] + counters.get(
            "sink_dropped_records", 0)
        out["records_sent_total"] = counters.get("sink_sent_records", 0)
        out["sink_errors_total"] = counters["write_errors"] + counters.get("sink_errors", 0)
        out["queue_frames"] = counters.get("sink_queue_frames", 0)
        out["queue_bytes"] = counters.get("sink_queue_bytes", 0)
    if switch is not None:
        out["table_version"] = switch.version
        out["table_swaps_total"] = len(switch.applied)
        out["forced"] = float(switch.forced)
        explorer = switch.explorer
        # rate(probes_total) / rate(records_total) is the realised exploration share.
        out["exploration_probes_total"] = getattr(explorer, "probes", 0)
        out["exploration_share_target"] = 1.0 / explorer.period if explorer else 0.0
    if feed is not None:
        counts = feed.status.counts
        out["table_rejections_total"] = counts["rejected"]
        out["table_replayed_controls_total"] = feed.status.rejections["replayed"]
        out["table_rollbacks_total"] = counts["rolled_back"]
        out["table_stale_total"] = counts["stale"]
    return out
