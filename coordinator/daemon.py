"""Running the synchronizer: the gRPC server around one engine.

`serve()` is what `ftsync-coordinator` runs: it resumes from the state
directory, listens, prints one `listening on HOST:PORT` line (the real port,
also when asked for port 0) and stops cleanly on SIGTERM or SIGINT, or
once an operator's `Admin.Drain` has committed its open rounds and handed its
leadership over (`Drainer`). Beside the synchronizer it serves the standard
health service (`coordinator.health`). With `ha.etcd` set it is one replica of
a highly available run (`coordinator.ha`): it starts as a standby, serves
replication to the leader and campaigns.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import signal
import sys
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2_grpc

from coordinator.config import CoordinatorConfig, describe
from coordinator.engine import Engine
from coordinator.errors import Reason, Rejected
from coordinator.ha import Replica
from coordinator.health import Health
from coordinator.service import (
    AdminService,
    OtherVersions,
    ReplicationService,
    SynchronizerService,
)
from coordinator.tasks import cancel_and_wait
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc
from protos import telemetry, tls
from protos.bulk import BulkServer, Tickets
from protos.codec import MESSAGE_SIZE_OPTIONS

# How long a drain waits when the request names no time (DrainRequest.timeout_s).
DRAIN_TIMEOUT_S = 30.0
# How long a bulk ticket waits for its connection: a learner opens it at once.
BULK_TICKET_S = 30.0


def tune_allocator() -> None:
    """Keep glibc from trimming and re-faulting the heap around every chunk.

    Each streamed chunk allocates and frees a few MiB of bytes objects; with
    glibc's defaults those come from fresh mmaps or a heap that is trimmed
    after every free, so every copy faults in new pages (measured: pulls took
    twice as long). Raising both thresholds keeps chunk-sized buffers in a
    warm heap; fragment-sized arrays still use their own mmaps."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc (e.g. musl): nothing to tune
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


class Drainer:
    """`Admin.Drain` for this process: drain the engine, hand leadership over
    (replicas), then set `done`, on which `serve` exits. One drain, however many
    calls ask for it. A leader with no standby to hand over to refuses: at once,
    with nothing changed, when none answers; after committing its open rounds,
    taking rounds again, when none has caught up in time. A later call may try
    again."""

    def __init__(self, engine: Engine, replica: Replica | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.replica = replica
        self.clock = clock
        self.done = asyncio.Event()
        self._drain: asyncio.Task[pb.DrainResponse] | None = None

    async def __call__(self, timeout_s: float) -> pb.DrainResponse:
        if not 0 <= timeout_s < math.inf:
            raise Rejected(Reason.MALFORMED, f"timeout_s must be >= 0 and finite (got "
                                             f"{timeout_s}; 0: {DRAIN_TIMEOUT_S:g} s)")
        if self._drain is None:
            self._drain = asyncio.create_task(self._run(timeout_s or DRAIN_TIMEOUT_S),
                                              name="drain")
        drain = self._drain
        try:
            # Shielded: a caller that stops waiting does not stop a drain under way.
            return await asyncio.shield(drain)
        except Rejected:
            if self._drain is drain:
                self._drain = None
            raise

    async def _run(self, timeout_s: float) -> pb.DrainResponse:
        deadline = self.clock() + timeout_s
        if self.replica is not None:
            await self.replica.await_standby(timeout_s, in_sync=False)
        drained = await self.engine.drain(max(deadline - self.clock(), 0.0))
        leader = None
        if self.replica is not None:
            try:
                await self.replica.await_standby(max(deadline - self.clock(), 0.0),
                                                 in_sync=True)
            except Rejected as rejected:
                self.engine.undrain(rejected.message)
                raise
            leader = await self.replica.leave(max(deadline - self.clock(), 0.0))
        self.done.set()
        return pb.DrainResponse(role=drained.role, rounds_committed=drained.committed,
                                rounds_left_open=drained.left_open,
                                leader=leader.address if leader else "",
                                epoch=leader.epoch if leader else 0)


def server_tls(config: CoordinatorConfig) -> tls.TlsMaterial | None:
    """The checked TLS material the daemon serves with (`tls.check_server`)."""
    material = tls.load(config.tls)
    tls.check_server(config.listen, material, config.tls.insecure, "ftsync-coordinator")
    return material


async def serve(config: CoordinatorConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set or a termination signal arrives."""
    tune_allocator()
    # Spans go where OTEL_EXPORTER_OTLP_ENDPOINT (or FTSYNC_TRACE_CONSOLE) says; else none.
    telemetry.configure_tracing("ftsync-coordinator", config.ha.replica_id or config.listen)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        material = server_tls(config)
    except tls.TlsError as exc:
        raise SystemExit(f"ftsync-coordinator: cannot start: {exc}") from None
    def bulk_refused(reason: str, learner_id: str, message: str) -> None:
        engine.record_rejection("Bulk", learner_id, Rejected(Reason(reason), message))

    # Pushes and pulls move their bytes here; TLS with the gRPC side's certificates.
    bulk = BulkServer(Tickets(BULK_TICKET_S), tls.server_context(material) if material else None,
                      bulk_refused, idle_s=config.limits.push_idle_s)
    server = grpc.aio.server(options=[
        *MESSAGE_SIZE_OPTIONS,
        # Learners ping every 10 s to notice cut connections; let them.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        # gRPC shares ports by default: a second daemon on the same address (and the
        # same state directory) must fail to start, not split the learners with it.
        ("grpc.so_reuseport", 0),
    ])
    host = config.listen.rsplit(":", 1)[0]
    try:
        port = tls.add_port(server, config.listen, material)
    except RuntimeError:  # how grpcio reports a failed bind
        port = 0
    if port == 0:
        raise SystemExit(f"ftsync-coordinator: cannot listen on {config.listen}: the address "
                         f"is in use or not on this machine")
    # Built once the port is known: a replica's leadership advertises it.
    try:
        replica = (Replica(config, f"{host}:{port}", material, bulk=bulk)
                   if config.ha.enabled else None)
        engine = replica.engine if replica is not None else Engine(config, bulk=bulk)
    except OSError as exc:  # the state directory, the event log, the metrics port
        raise SystemExit(f"ftsync-coordinator: cannot start: {exc}") from None
    await engine.start()
    try:
        await bulk.start(host.strip("[]"), config.bulk_port)
    except OSError as exc:
        await engine.stop()
        which = f"bulk_port {config.bulk_port}" if config.bulk_port else "a bulk port"
        raise SystemExit(f"ftsync-coordinator: cannot open {which} on {host}: "
                         f"{exc}") from None
    drainer = Drainer(engine, replica)
    health = Health(engine)
    pb_grpc.add_SynchronizerServicer_to_server(SynchronizerService(engine), server)
    pb_grpc.add_AdminServicer_to_server(
        AdminService(engine, config.auth.admin_token, drainer), server)
    if config.ha.enabled:  # an embedded coordinator has no leader to take versions from
        pb_grpc.add_ReplicationServicer_to_server(ReplicationService(engine, config.ha.token),
                                                  server)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    server.add_generic_rpc_handlers((OtherVersions(engine),))
    await health.update()
    await server.start()
    print(describe(config), file=sys.stderr, flush=True)
    if engine.metrics.prometheus_address:
        print(f"ftsync-coordinator metrics on http://{engine.metrics.prometheus_address}"
              f"/metrics", file=sys.stderr, flush=True)
    if replica is not None:
        await replica.start()
    following = asyncio.create_task(health.follow(), name="health")
    print(f"ftsync-coordinator listening on {host}:{port}", flush=True)
    try:
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(engine.failed.wait()),
                 asyncio.ensure_future(drainer.done.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
    finally:
        await cancel_and_wait(following)
        await health.stop()
        if replica is not None:
            await replica.stop()
        await server.stop(grace=2.0)
        await bulk.stop()
        await engine.stop()
    if drainer.done.is_set():
        print("ftsync-coordinator: drained and stopped; restart it (upgraded) on the same "
              "state directory", file=sys.stderr, flush=True)
    if engine.failure:
        raise SystemExit(f"ftsync-coordinator: stopped: {engine.failure}. Nothing unwritten "
                         f"was published; restart it once the state directory is writable "
                         f"and learners re-push what no written version merged")
