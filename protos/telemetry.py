"""OpenTelemetry plumbing shared by the coordinator and the learners.

Each process calls `configure_tracing` once as it starts (the daemon's
`serve`, a learner's `FragmentSync`). It reads the standard environment: with
`OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) set,
spans go through a batch processor to an OTLP/gRPC exporter; with
`FTSYNC_TRACE_CONSOLE=1` they are also printed to stderr. With neither, no
tracer provider is installed and the API's tracer is a no-op: a span costs a
function call, and `inject` adds nothing to a call's metadata.

Spans of one contribution's life cross processes through W3C trace context
(`traceparent`) in gRPC metadata: `inject` on the calling side, `extract`
on the serving side. `otlp_metric_readers` gives a process's meter provider
the OTLP metric exporter under the same variables
(`OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` too).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from opentelemetry.trace import Link, SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

# Print spans to stderr (any value but "", "0" or "false").
CONSOLE_ENV = "FTSYNC_TRACE_CONSOLE"
# The W3C header, as gRPC metadata (keys are lower case there).
TRACEPARENT = "traceparent"
# Initial metadata of a pull: the round span that committed the version served,
# in `traceparent` form, for the learner's apply span to link to.
COMMIT_TRACE = "ftsync-commit-trace"

_PROPAGATOR = TraceContextTextMapPropagator()

Metadata = Sequence[tuple[str, Any]]


def exporting(signal: str) -> bool:
    """Whether the environment names an OTLP endpoint for `signal` (TRACES, METRICS)."""
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"))


def console_requested() -> bool:
    return os.environ.get(CONSOLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def resource(service: str, instance: str = "") -> Resource:
    """The process's resource; `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` win."""
    attributes = {"service.name": service,
                  "service.instance.id": instance or f"{os.uname().nodename}-{os.getpid()}"}
    return Resource.create(attributes)


def configure_tracing(service: str, instance: str = "") -> bool:
    """Install this process's tracer provider as the environment asks; True when spans
    are recorded. Once per process: a provider installed before (by us or the
    application embedding a learner) is kept."""
    current = trace.get_tracer_provider()
    if not isinstance(current, trace.ProxyTracerProvider):
        return isinstance(current, TracerProvider)
    otlp, console = exporting("TRACES"), console_requested()
    if not (otlp or console):
        return False
    provider = TracerProvider(resource=resource(service, instance))
    if otlp:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if console:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    trace.set_tracer_provider(provider)
    return True


def flush_traces(timeout_s: float = 5.0) -> None:
    """Export the spans still buffered (a process about to exit, a learner closing)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush(int(timeout_s * 1000))


def otlp_metric_readers() -> list[MetricReader]:
    """An OTLP metric reader when the environment names an endpoint (its interval:
    `OTEL_METRIC_EXPORT_INTERVAL`, 60 s by default), else none."""
    if not exporting("METRICS"):
        return []
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    return [PeriodicExportingMetricReader(OTLPMetricExporter())]


def inject(context: Context | None = None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the current span (or `context`'s) as `traceparent`;
    empty when no span is recorded."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context)
    return tuple(carrier.items())


def extract(metadata: Iterable[tuple[str, Any]] | None) -> Context:
    """The remote parent named by a call's `traceparent` metadata (an empty context
    when there is none or it is malformed)."""
    carrier = {key: value for key, value in metadata or ()
               if key in (TRACEPARENT, "tracestate") and isinstance(value, str)}
    return _PROPAGATOR.extract(carrier)


def span_context(metadata: Iterable[tuple[str, Any]] | None,
                 key: str = TRACEPARENT) -> SpanContext | None:
    """The span named in W3C form under `key` of some metadata, if valid."""
    for name, value in metadata or ():
        if name == key and isinstance(value, str):
            parent = trace.get_current_span(extract(((TRACEPARENT, value),)))
            found = parent.get_span_context()
            return found if found.is_valid else None
    return None


def traceparent(context: SpanContext) -> str:
    """`context` in W3C `traceparent` form ("" for an invalid one)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(trace.NonRecordingSpan(context)))
    return carrier.get(TRACEPARENT, "")


def links(contexts: Iterable[SpanContext | None]) -> list[Link]:
    """Links to the valid ones of `contexts`."""
    return [Link(c) for c in contexts if c is not None and c.is_valid]
