"""OpenTelemetry metrics of the synchronizer.

One place names every instrument, so the proto, the logs and the dashboards
share one vocabulary. Exported to Prometheus (a scrape endpoint on
127.0.0.1) and/or periodically to the console, as the config says; with
neither, the instruments still count (at negligible cost) for `Status`.
"""

from __future__ import annotations

import sys
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)

from coordinator.config import MetricsConfig


class Metrics:
    """The daemon's instruments; `close()` stops exporters and the HTTP endpoint."""

    def __init__(self, config: MetricsConfig) -> None:
        readers: list[MetricReader] = []
        self._http_server: Any = None
        if config.prometheus_port:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import start_http_server

            readers.append(PrometheusMetricReader())
            self._http_server, _ = start_http_server(config.prometheus_port, addr="127.0.0.1")
        if config.console_interval_s > 0:
            readers.append(PeriodicExportingMetricReader(
                ConsoleMetricExporter(out=sys.stderr),
                export_interval_millis=int(config.console_interval_s * 1000)))
        self.provider = MeterProvider(metric_readers=readers)
        meter = self.provider.get_meter("ftsync.coordinator")
        self.rounds = meter.create_counter(
            "ftsync_rounds", description="rounds committed, per fragment and why each closed")
        self.contributions = meter.create_counter(
            "ftsync_contributions", description="contributions folded into a round")
        self.rejections = meter.create_counter(
            "ftsync_rejections", description="requests refused, by reason")
        self.pushes_cut = meter.create_counter(
            "ftsync_pushes_cut",
            description="pushes whose call ended before their last chunk: the learner "
                        "cancelled it, died or moved to another replica, the daemon "
                        "stopped, gRPC refused a message over its size limit, or the "
                        "stream sent nothing for limits.push_idle_s")
        self.quorum_wait = meter.create_histogram(
            "ftsync_quorum_wait", unit="s",
            description="time from a round's first contribution to quorum")
        self.grace = meter.create_histogram(
            "ftsync_grace", unit="s", description="grace window granted after quorum")
        self.sync_time = meter.create_histogram(
            "ftsync_sync_time", unit="s", description="merge + outer step + durable write")
        self.staleness = meter.create_histogram(
            "ftsync_staleness", description="versions between a contribution's base and now")
        self.bytes_in = meter.create_counter(
            "ftsync_bytes_in", unit="By", description="tensor bytes received")
        self.bytes_out = meter.create_counter(
            "ftsync_bytes_out", unit="By", description="tensor bytes sent")

    def close(self) -> None:
        self.provider.shutdown()
        if self._http_server is not None:
            self._http_server.shutdown()
