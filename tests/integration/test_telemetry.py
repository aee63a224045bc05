"""Traces and metrics over OTLP: a learner process and a daemon process export to an
OTLP receiver run here, and one contribution's trace crosses both.

The receiver is the collector's own gRPC contract (`TraceService`,
`MetricsService` from opentelemetry-proto) on an ephemeral loopback port; the
processes find it through `OTEL_EXPORTER_OTLP_ENDPOINT`, with short batch and
export intervals so the test waits on spans, not on timers.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.daemon import Daemon, wait_until


def _attributes(values: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for kv in values:
        assert isinstance(kv, KeyValue)
        found[kv.key] = getattr(kv.value, kv.value.WhichOneof("value") or "string_value")
    return found


@dataclass
class Received:
    """What the processes exported, by the service.name of their resource."""

    spans: list[tuple[str, Span]] = field(default_factory=list)
    # (service, metric name, the metric message)
    metrics: list[tuple[str, str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def named(self, name: str, service: str | None = None) -> list[Span]:
        with self.lock:
            return [s for svc, s in self.spans if s.name == name and service in (None, svc)]

    def metric(self, service: str, name: str) -> list[Any]:
        with self.lock:
            return [m for svc, n, m in self.metrics if (svc, n) == (service, name)]


def _exported(request: Any, kind: str) -> Iterator[tuple[str, Any]]:
    """(service.name, item) for each span or metric (`kind`) of an OTLP export request."""
    for resource in getattr(request, f"resource_{kind}"):
        service = _attributes(resource.resource.attributes).get("service.name", "")
        for scope in getattr(resource, f"scope_{kind}"):
            for item in getattr(scope, kind):
                yield service, item


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request: Any, context: Any) -> Any:
        with self.received.lock:
            self.received.spans.extend(_exported(request, "spans"))
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):  # type: ignore[misc]
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request: Any, context: Any) -> Any:
        with self.received.lock:
            self.received.metrics.extend((svc, m.name, m)
                                         for svc, m in _exported(request, "metrics"))
        return metrics_service_pb2.ExportMetricsServiceResponse()


@pytest.fixture
def otlp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Received]:
    """An OTLP receiver; the processes started in the test export to it."""
    received = Received()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Traces(received), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(received), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
    try:
        yield received
    finally:
        server.stop(grace=None)


def run_learner(daemon: Daemon, learner_id: str, *args: str) -> str:
    """Train a synthetic-task learner process to its end; returns its stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "learner", "--coordinator", daemon.address, "--task",
         "synthetic", "--dim", "64", "--sync-every", "5", "--overlap", "1", "--step-ms", "5",
         "--learner-id", learner_id, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stderr


def test_a_contributions_trace_crosses_the_learner_and_the_daemon(
        otlp: Received, start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon("--set", "policy.grace_max_s=0.2")
    run_learner(daemon, "traced", "--fragments", "2", "--steps", "40")

    def traced() -> bool:
        pushes = {(s.trace_id, s.span_id) for s in otlp.named("ftsync.push", "ftsync-learner")}
        admits = [s for s in otlp.named("ftsync.admit", "ftsync-coordinator")
                  if (s.trace_id, s.parent_span_id) in pushes]
        admitted = {(s.trace_id, s.span_id) for s in admits}
        rounds = [r for r in otlp.named("ftsync.round_close", "ftsync-coordinator")
                  if any((link.trace_id, link.span_id) in admitted for link in r.links)]
        return bool(rounds) and bool(otlp.named("ftsync.apply", "ftsync-learner"))

    wait_until(traced, timeout=30, message="a push, its admit, its round and an apply")

    # The admit span is the push span's child: one trace across the two processes.
    pushes = {s.span_id: s for s in otlp.named("ftsync.push", "ftsync-learner")}
    admit = next(s for s in otlp.named("ftsync.admit", "ftsync-coordinator")
                 if s.parent_span_id in pushes)
    push = pushes[admit.parent_span_id]
    assert admit.trace_id == push.trace_id
    assert admit.kind == Span.SPAN_KIND_SERVER and push.kind == Span.SPAN_KIND_CLIENT
    assert _attributes(push.attributes)["ftsync.learner"] == "traced"
    assert _attributes(push.attributes)["ftsync.outcome"] == "acked"
    assert _attributes(admit.attributes)["ftsync.seq"] == _attributes(push.attributes)["ftsync.seq"]
    (fold,) = [s for s in otlp.named("ftsync.fold") if s.parent_span_id == admit.span_id]
    assert fold.trace_id == push.trace_id

    # The round that merged it links to the admit (in the push's trace) and says why it
    # closed; merge, outer step, durable write and publish are its children.
    round_close = next(r for r in otlp.named("ftsync.round_close")
                       if any(link.span_id == admit.span_id for link in r.links))
    link = next(link for link in round_close.links if link.span_id == admit.span_id)
    assert link.trace_id == push.trace_id
    attributes = _attributes(round_close.attributes)
    assert attributes["ftsync.round.why"] == "all_live"  # the only learner contributed
    assert attributes["ftsync.fragment"] == _attributes(push.attributes)["ftsync.fragment"]
    wait_until(lambda: {"ftsync.merge", "ftsync.outer_step", "ftsync.durable_write",
                        "ftsync.publish"} <= {s.name for _, s in list(otlp.spans)
                                              if s.parent_span_id == round_close.span_id},
               timeout=10, message="the round's children")

    # Applying a merged version links to the round span that committed it.
    rounds = {r.span_id: r for r in otlp.named("ftsync.round_close")}
    applies = otlp.named("ftsync.apply", "ftsync-learner")
    linked = [(a, rounds[a.links[0].span_id]) for a in applies
              if a.links and a.links[0].span_id in rounds]
    assert linked, "no apply span links to a round span"
    apply, committed = linked[0]
    assert apply.links[0].trace_id == committed.trace_id
    assert (_attributes(apply.attributes)["ftsync.version"]
            == _attributes(committed.attributes)["ftsync.version"])


def test_learner_and_daemon_metrics_arrive_over_otlp(
        otlp: Received, start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon("--set", "policy.grace_max_s=0.2")
    # Lock-step: each apply waits for the version that merges its own push, so the
    # apply lag is recorded however long a commit takes (streaming, a busy machine's
    # commits outlasting τ steps would make every apply a fall-back, which has none).
    run_learner(daemon, "measured", "--fragments", "1", "--steps", "30", "--lockstep")
    wanted = ("ftsync_learner_pushes", "ftsync_learner_backlog", "ftsync_learner_apply_lag",
              "ftsync_learner_tokens_per_s")
    wait_until(lambda: all(otlp.metric("ftsync-learner", name) for name in wanted)
               and otlp.metric("ftsync-coordinator", "ftsync_rounds_committed"), timeout=30,
               message="the learner's and the daemon's metrics")
    pushes = otlp.metric("ftsync-learner", "ftsync_learner_pushes")[-1]
    acked = [p for p in pushes.sum.data_points
             if _attributes(p.attributes).get("outcome") == "acked"]
    assert acked and acked[0].as_int >= 1
    lag = otlp.metric("ftsync-learner", "ftsync_learner_apply_lag")[-1]
    point = lag.histogram.data_points[0]
    assert point.count >= 1 and list(point.explicit_bounds)[:3] == [0.01, 0.025, 0.05]
    tokens = otlp.metric("ftsync-learner", "ftsync_learner_tokens_per_s")[-1]
    assert tokens.gauge.data_points[0].as_double > 0
    quorum = otlp.metric("ftsync-coordinator", "ftsync_quorum_wait")
    assert quorum and list(quorum[-1].histogram.data_points[0].explicit_bounds)[:3] == [
        0.0, 0.001, 0.005]


def test_spans_go_to_the_console_on_request(monkeypatch: pytest.MonkeyPatch,
                                            start_daemon: Callable[..., Daemon],
                                            tmp_path: Path) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.setenv("FTSYNC_TRACE_CONSOLE", "1")
    daemon = start_daemon("--set", "policy.grace_max_s=0.2")
    stderr = run_learner(daemon, "printed", "--fragments", "1", "--steps", "5")
    assert '"name": "ftsync.push"' in stderr
    log = tmp_path / "state0.stderr.log"
    wait_until(lambda: '"name": "ftsync.round_close"' in log.read_text(), timeout=10,
               message="the daemon to print its round span")
