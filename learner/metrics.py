"""A learner's own metrics: pushes, backlog, apply lag and tokens per second.

The coordinator counts what reaches it; these say what a learner sees: how
its pushes end, how many contributions wait for a committed manifest, how
long a pushed contribution takes to come back as an applied version, and how
fast it trains. Each learner has its own meter provider, whose resource names
it (`service.instance.id`), exported over OTLP when
`OTEL_EXPORTER_OTLP_ENDPOINT` is set (`protos.telemetry`); with no reader the
instruments are the API's no-ops. Recorded by the client (`learner.client`)
and the streaming runtime (`learner.streaming`).
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.metrics import Meter, NoOpMeter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

from protos import telemetry

# Seconds from a push to applying the version that merges it: at least τ steps
# and a round's quorum wait and grace window, up to a fall-back's τ more steps.
APPLY_LAG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                     120.0, 300.0, 600.0)

VIEWS = [View(instrument_name="ftsync_learner_apply_lag",
              aggregation=ExplicitBucketHistogramAggregation(APPLY_LAG_BUCKETS))]


class LearnerMetrics:
    """The instruments of one learner; `readers` default to OTLP when configured."""

    def __init__(self, learner_id: str, readers: Sequence[MetricReader] | None = None) -> None:
        readers = list(telemetry.otlp_metric_readers() if readers is None else readers)
        self._provider: MeterProvider | None = None
        meter: Meter = NoOpMeter("ftsync.learner")
        if readers:
            self._provider = MeterProvider(
                metric_readers=readers, views=VIEWS,
                resource=telemetry.resource("ftsync-learner", learner_id))
            meter = self._provider.get_meter("ftsync.learner")
        self.pushes = meter.create_counter(
            "ftsync_learner_pushes",
            description="contributions pushed, by outcome: acked, held (the open round "
                        "already had it), merged (a committed version already had it), "
                        "refused, unsent (pushed again later)")
        self.backlog = meter.create_gauge(
            "ftsync_learner_backlog",
            description="contributions no committed manifest names yet: queued, in flight "
                        "or acknowledged")
        self.apply_lag = meter.create_histogram(
            "ftsync_learner_apply_lag", unit="s",
            description="time from a push to applying the merged version pulled for it")
        self.bulk_fallbacks = meter.create_counter(
            "ftsync_learner_bulk_fallbacks",
            description="coordinators whose bulk port could not be reached: pushes and "
                        "pulls to them go as gRPC chunks")
        self.tokens_per_s = meter.create_gauge(
            "ftsync_learner_tokens_per_s", unit="1/s",
            description="tokens trained per second of work, over a fragment's last sync "
                        "interval")

    @property
    def exporting(self) -> bool:
        return self._provider is not None

    def flush(self, timeout_s: float = 5.0) -> None:
        """Export what was recorded (a learner closing); the provider stays usable."""
        if self._provider is not None:
            self._provider.force_flush(int(timeout_s * 1000))
