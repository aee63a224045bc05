"""The OpenTelemetry plumbing: W3C context in gRPC metadata and the learner's
instruments."""

from __future__ import annotations

from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.trace import SpanContext, TraceFlags

from learner.metrics import APPLY_LAG_BUCKETS, LearnerMetrics
from protos import telemetry

SPAN = SpanContext(trace_id=0x0AF7651916CD43DD8448EB211C80319C, span_id=0xB7AD6B7169203331,
                   is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))


def test_no_recorded_span_adds_no_metadata() -> None:
    assert telemetry.inject() == ()


def test_a_span_context_round_trips_through_metadata_in_w3c_form() -> None:
    value = telemetry.traceparent(SPAN)
    assert value == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    found = telemetry.span_context([("other", "x"), (telemetry.COMMIT_TRACE, value)],
                                   telemetry.COMMIT_TRACE)
    assert found is not None
    assert (found.trace_id, found.span_id) == (SPAN.trace_id, SPAN.span_id)


def test_a_malformed_or_missing_traceparent_names_no_span() -> None:
    assert telemetry.span_context([(telemetry.TRACEPARENT, "00-zz-01")]) is None
    assert telemetry.span_context(None) is None
    assert telemetry.links([None, SpanContext(0, 0, False)]) == []


def test_learner_instruments_record_with_apply_lag_buckets() -> None:
    reader = InMemoryMetricReader()
    metrics = LearnerMetrics("l0", readers=[reader])
    metrics.pushes.add(1, {"outcome": "acked"})
    metrics.apply_lag.record(0.3)
    metrics.backlog.set(2)
    data = reader.get_metrics_data()
    assert data is not None
    found = {m.name: m for r in data.resource_metrics for s in r.scope_metrics
             for m in s.metrics}
    assert set(found) == {"ftsync_learner_pushes", "ftsync_learner_apply_lag",
                          "ftsync_learner_backlog"}
    (lag,) = found["ftsync_learner_apply_lag"].data.data_points
    assert isinstance(lag, HistogramDataPoint)
    assert tuple(lag.explicit_bounds) == APPLY_LAG_BUCKETS
    assert lag.bucket_counts[APPLY_LAG_BUCKETS.index(0.5)] == 1  # in (0.25, 0.5]
    resource = data.resource_metrics[0].resource.attributes
    assert (resource["service.name"], resource["service.instance.id"]) == ("ftsync-learner",
                                                                          "l0")
    assert not LearnerMetrics("l1", readers=[]).exporting
