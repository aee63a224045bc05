"""OpenTelemetry metrics of the synchronizer.

One place names every instrument, so the proto, the logs and the dashboards
share one vocabulary. Exported to Prometheus (a scrape endpoint at
`metrics.prometheus_listen`), periodically to the console, and over OTLP when
`OTEL_EXPORTER_OTLP_ENDPOINT` is set, as the config and the environment say.
`Admin.Status` reads its daemon-wide counts from these same instruments
(`counts()`, through an in-memory reader), so with no exporter at all they
still count, at negligible cost.

Each time histogram has buckets that fit what it measures (`VIEWS`): the
SDK's default boundaries (0, 5, 10, 25, ... 10000) put every quorum wait,
grace window and sync time of a healthy run in the first bucket or two,
which leaves nothing to take a percentile from.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    InMemoryMetricReader,
    MetricReader,
    MetricsData,
    NumberDataPoint,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

from coordinator.config import MetricsConfig
from protos import telemetry

# Seconds, from the milliseconds of a small fragment to the minutes a quorum of
# slow learners can take (a round waits for K learners' next due push).
QUORUM_WAIT_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                       10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Seconds granted: clamped to policy.grace_max_s (5 s by default); 0 in sync mode.
GRACE_BUCKETS = (0.0, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0,
                 7.5, 10.0, 15.0, 30.0, 60.0)
# Seconds of merge, outer step and durable write: milliseconds for a small
# fragment, seconds for a large one fsynced to a slow disk.
SYNC_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0, 30.0)
# Whole versions, refused beyond policy.max_staleness (8 by default).
STALENESS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0)

VIEWS = [
    View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(buckets))
    for name, buckets in (("ftsync_quorum_wait", QUORUM_WAIT_BUCKETS),
                          ("ftsync_grace", GRACE_BUCKETS),
                          ("ftsync_sync_time", SYNC_TIME_BUCKETS),
                          ("ftsync_staleness", STALENESS_BUCKETS))
]


class Counts:
    """The counters' values at one collection, summed over the attributes not asked for."""

    def __init__(self, data: MetricsData | None) -> None:
        self._points: dict[str, list[NumberDataPoint]] = {}
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    points = [p for p in metric.data.data_points
                              if isinstance(p, NumberDataPoint)]
                    self._points.setdefault(metric.name, []).extend(points)

    def total(self, name: str) -> int:
        return int(sum(p.value for p in self._points.get(name, ())))

    def by(self, name: str, key: str) -> Counter[str]:
        """`name`'s values per value of attribute `key`."""
        found: Counter[str] = Counter()
        for point in self._points.get(name, ()):
            attributes = point.attributes or {}
            if key in attributes:
                found[str(attributes[key])] += int(point.value)
        return found


class Metrics:
    """The daemon's instruments; `close()` stops exporters and the HTTP endpoint."""

    def __init__(self, config: MetricsConfig) -> None:
        # What Status reads: cumulative sums since start, whatever else exports.
        self._status_reader = InMemoryMetricReader()
        readers: list[MetricReader] = [self._status_reader, *telemetry.otlp_metric_readers()]
        self._http_server: Any = None
        # Where /metrics is served, with the real port ("" when it is not).
        self.prometheus_address = ""
        if config.prometheus_listen:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import start_http_server

            readers.append(PrometheusMetricReader())
            host, port = config.prometheus_address()
            self._http_server, _ = start_http_server(port, addr=host)
            bound = self._http_server.server_port
            self.prometheus_address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        if config.console_interval_s > 0:
            readers.append(PeriodicExportingMetricReader(
                ConsoleMetricExporter(out=sys.stderr),
                export_interval_millis=int(config.console_interval_s * 1000)))
        self.provider = MeterProvider(metric_readers=readers, views=VIEWS,
                                      resource=telemetry.resource("ftsync-coordinator"))
        meter = self.provider.get_meter("ftsync.coordinator")
        self.rounds_committed = meter.create_counter(
            "ftsync_rounds_committed",
            description="rounds committed, per fragment and why each closed")
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
        self.push_streams = meter.create_up_down_counter(
            "ftsync_push_streams_open",
            description="push calls being served now: pushes in flight, and stuck ones "
                        "that limits.push_idle_s will cut")
        self.quorum = meter.create_gauge(
            "ftsync_quorum",
            description="the quorum the last closed round of a fragment needed (with "
                        "policy.min_quorum = \"auto\", the one it chose)")
        self.sync_every = meter.create_gauge(
            "ftsync_sync_every",
            description="the H (local steps between two pushes of a fragment) last "
                        "assigned to each learner that takes it from the coordinator "
                        "(sync_every = \"auto\")")
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
        self.transfers = meter.create_counter(
            "ftsync_transfers",
            description="transfers by direction (push, pull, and replicate: versions "
                        "a standby took) and transport: bulk (the bulk channel), grpc "
                        "(chunks on the call), grpc_fallback (asked for bulk, sent as "
                        "chunks: the sender could not reach the port)")

    def counts(self) -> Counts:
        """Every counter's value now, from the instruments themselves."""
        return Counts(self._status_reader.get_metrics_data())

    def close(self) -> None:
        self.provider.shutdown()
        if self._http_server is not None:
            self._http_server.shutdown()
