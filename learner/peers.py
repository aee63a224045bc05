"""Learners serving their fragments to each other, for catch-up after a restart.

A restarted learner needs every fragment at the versions the synchronizer
publishes now, and its peers already hold most of them in memory: the merged
values each applied last and, until it applies it, a newer version it has
pulled (`HeldFragments`). `PeerServer` serves exactly those versions from the
learner's background loop, so serving never runs on the training thread:
over gRPC (`PeerFragments.Fetch`, the same header-and-chunks stream as a
pull) or, after `PeerFragments.Reserve`, on the bulk channel
(`protos.bulk`, the one that carries pushes and pulls too), which moves a
large model at socket speed rather than gRPC's (on loopback here gRPC in
Python manages a third to a half of it). `fetch_from_peers` is
the other side, called by `learner.streaming.FragmentSync` when it starts:
each fragment comes from the first peer that holds its exact version, and
the caller loads what no peer holds from the coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NoReturn

import grpc
import numpy as np

from protos import ftsync_pb2 as pb
from protos import peer_pb2 as peer_pb
from protos import peer_pb2_grpc as peer_grpc
from protos.bulk import BulkPool, BulkServer, BulkUnreachable, Grant, Handoff, Tickets, send_frames
from protos.codec import FP32, MESSAGE_SIZE_OPTIONS, iter_chunk_messages
from protos.events import EventLog
from protos.settings import check
from protos.stream import ChunkReader
from protos.tls import (
    TlsError,
    TlsMaterial,
    add_port,
    aio_channel,
    check_server,
    server_context,
)

# How a catching-up learner fetches: "bulk" (Reserve, then the bulk channel;
# it falls back to "grpc" for a peer whose bulk port it cannot reach) or "grpc".
TRANSPORTS: Final = ("bulk", "grpc")

_CHANNEL_OPTIONS: Final = [
    *MESSAGE_SIZE_OPTIONS,
    # One connection per peer, as if each were its own process.
    ("grpc.use_local_subchannel_pool", 1),
]
_RESERVATION_S: Final = 30.0
# Control calls to a peer: a peer that cannot answer in this long is skipped.
_RPC_TIMEOUT_S: Final = 5.0
# A version the learner is pushing into or pulling right now is worth waiting this
# long for: just after a commit, the learners that contributed to it are all still
# between their push's acknowledgement and the end of their pull.
_ARRIVAL_WAIT_S: Final = 2.0
_ARRIVAL_POLL_S: Final = 0.02
# A bulk send that makes no progress for this long (the receiver stalled) is given up.
_SEND_IDLE_S: Final = 30.0
# Bulk sends run in threads of their own at this nice value: serving peers is
# background work, so where cores are short the training thread goes first.
_SENDER_NICE: Final = 10
_SENDERS: Final = 4

Context = grpc.aio.ServicerContext[Any, Any]


class PeerRefusal(Exception):
    """Why a learner does not serve a request; `_STATUS` maps each reason to its
    gRPC status, in this one place."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


_STATUS: Final[dict[str, grpc.StatusCode]] = {
    "not_held": grpc.StatusCode.NOT_FOUND,
    "other_run": grpc.StatusCode.FAILED_PRECONDITION,
    "unknown_fragment": grpc.StatusCode.INVALID_ARGUMENT,
}


class PeerMiss(Exception):
    """A peer could not serve one fragment version (it holds another, belongs to
    another run, or its transfer failed); the next peer or the coordinator will."""


def split_address(address: str) -> tuple[str, int]:
    """`host:port` (or `[v6]:port`) as `(host, port)`."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"peer address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class PeerSettings:
    """Where a learner serves its fragments and where it catches up from."""

    # Other learners' peer addresses (HOST:PORT), tried in turn for each fragment.
    peers: tuple[str, ...] = ()
    # HOST:PORT to serve this learner's fragments on (port 0: any free port); None: don't.
    serve: str | None = None
    transport: str = "bulk"
    # Fragments fetched at once (each from whichever peer holds it).
    concurrency: int = 4
    # A transfer with no progress for this long moves on to the next peer.
    idle_timeout_s: float = 10.0
    # Serve plaintext on a non-loopback address (refused otherwise).
    insecure: bool = False

    def __post_init__(self) -> None:
        for address in (*self.peers, *([self.serve] if self.serve else [])):
            split_address(address)
        check(self, [(self.transport in TRANSPORTS, "transport",
                      f"must be one of {', '.join(TRANSPORTS)}"),
                     (self.concurrency >= 1, "concurrency", "must be >= 1")], "peer ")


# -- what a learner holds ---------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    version: int
    commit_id: int
    values: np.ndarray


class HeldFragments:
    """The global values a learner can serve, per fragment: the version it applied
    last and, until it applies it, a newer one it has pulled (and whether a push
    or pull that may bring a newer one is under way).

    Arrays are kept by reference, never copied: the runtime never writes a pulled
    array in place (it replaces its base instead), so a held version stays exact.
    Holding costs at most one copy of the model, once the runtime has moved its
    base on to its own values at the next push. Written from the training thread
    (apply) and the background loop (pull), read by the server on the loop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._applied: dict[int, Held] = {}
        self._pulled: dict[int, Held] = {}
        # (fragment, version) per push or pull under way that may bring a newer one.
        self._awaiting: list[tuple[int, int]] = []

    def applied(self, fragment: int, version: int, commit_id: int, values: np.ndarray) -> None:
        with self._lock:
            self._applied[fragment] = Held(version, commit_id, np.ascontiguousarray(values))
            pulled = self._pulled.get(fragment)
            if pulled is not None and pulled.version <= version:
                del self._pulled[fragment]

    def pulled(self, fragment: int, version: int, commit_id: int, values: np.ndarray) -> None:
        with self._lock:
            if all(_supersedes(version, commit_id, held.get(fragment))
                   for held in (self._applied, self._pulled)):
                self._pulled[fragment] = Held(version, commit_id,
                                              np.ascontiguousarray(values))

    @contextlib.contextmanager
    def awaiting(self, fragment: int, have_version: int) -> Iterator[None]:
        """While inside, a version newer than `have_version` may arrive: a push is
        on its way to a round, or a pull is under way. Entries overlap (a fall-back
        pull starts before the cancelled one has ended), so each removes only itself."""
        entry = (fragment, have_version)
        with self._lock:
            self._awaiting.append(entry)
        try:
            yield
        finally:
            with self._lock:
                self._awaiting.remove(entry)

    def may_arrive(self, fragment: int, version: int) -> bool:
        """Whether a push or pull under way could still bring `version`."""
        with self._lock:
            return any(p == fragment and have < version for p, have in self._awaiting)

    def get(self, fragment: int, version: int, commit_id: int) -> np.ndarray | None:
        """The values of exactly this commit: the version number alone may name a
        commit of a history the synchronizer has lost since."""
        with self._lock:
            for held in (self._applied.get(fragment), self._pulled.get(fragment)):
                if held is not None and (held.version, held.commit_id) == (version, commit_id):
                    return held.values
        return None

    def versions(self) -> list[tuple[int, int, int]]:
        """(fragment, version, commit id) of everything held."""
        with self._lock:
            return sorted((p, h.version, h.commit_id) for held in (self._applied, self._pulled)
                          for p, h in held.items())


def _supersedes(version: int, commit_id: int, held: Held | None) -> bool:
    """Newer than `held`, or its number committed again after it was lost."""
    return held is None or version > held.version or (
        version == held.version and commit_id != held.commit_id)


# -- serving ----------------------------------------------------------------------------


class PeerServer:
    """`PeerFragments` over gRPC plus the bulk TCP port, on the caller's event loop."""

    def __init__(self, held: HeldFragments, identity: Callable[[], tuple[str, str]],
                 numels: Sequence[int], chunk_bytes: Callable[[], int],
                 events: EventLog, learner_id: str, tls: TlsMaterial | None = None) -> None:
        self.held = held
        # With TLS both the gRPC port and the bulk port serve this certificate, and
        # with a CA both require a client's signed by it.
        self.tls = tls
        # (run_id, layout_hash) of this learner's run, read at each request.
        self.identity = identity
        self.numels = list(numels)
        self.chunk_bytes = chunk_bytes
        self.events = events
        self.learner_id = learner_id
        self.address = ""
        self.bulk_port = 0
        self._server: grpc.aio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Bulk sends run in threads at a raised nice value: serving peers is
        # background work, so where cores are short the training thread goes first.
        self._bulk = BulkServer(
            Tickets(_RESERVATION_S), server_context(tls) if tls is not None and tls.can_serve
            else None, self._bulk_refused, idle_s=_SEND_IDLE_S, workers=_SENDERS,
            initializer=_lower_priority)

    async def start(self, address: str, insecure: bool = False) -> str:
        """Listen on `address` (gRPC) and on a free port of the same host (bulk);
        returns the gRPC address as bound."""
        host, _ = split_address(address)
        try:
            check_server(address, self.tls, insecure, "serving peers")
        except TlsError as exc:
            raise OSError(str(exc)) from None
        self.bulk_port = await self._bulk.start(host)
        # No SO_REUSEPORT: a second learner given the same address must fail to start,
        # not share the port with the first.
        server = grpc.aio.server(options=[*MESSAGE_SIZE_OPTIONS, ("grpc.so_reuseport", 0)])
        peer_grpc.add_PeerFragmentsServicer_to_server(_Servicer(self), server)
        try:
            port = add_port(server, address, self.tls)
        except RuntimeError as exc:  # grpcio reports a failed bind this way
            port = 0
            cause: Exception | None = exc
        else:
            cause = None
        if port == 0:
            await self._bulk.stop()
            raise OSError(f"cannot serve peers on {address}: the address is not "
                          f"available") from cause
        await server.start()
        self._server = server
        self.address = f"{address.rpartition(':')[0]}:{port}"
        return self.address

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._bulk.stop()
        if self._server is not None:
            await self._server.stop(grace=1.0)

    async def values(self, request: peer_pb.PeerFetchRequest) -> np.ndarray:
        """The exact version asked for, or a `PeerRefusal` saying why not; waits a
        little for a version that a pull under way may bring."""
        if request.fragment >= len(self.numels):
            raise PeerRefusal("unknown_fragment",
                              f"fragment {request.fragment} does not exist (this run has "
                              f"fragments 0..{len(self.numels) - 1})")
        run_id, layout_hash = self.identity()
        if (request.run_id, request.layout_hash) != (run_id, layout_hash):
            raise PeerRefusal("other_run",
                              f"asked for run {request.run_id!r} layout "
                              f"{request.layout_hash!r}; this learner is in run {run_id!r} "
                              f"layout {layout_hash!r}")
        values = self.held.get(request.fragment, request.version, request.commit_id)
        deadline = time.monotonic() + _ARRIVAL_WAIT_S
        while (values is None and time.monotonic() < deadline
               and self.held.may_arrive(request.fragment, request.version)):
            await asyncio.sleep(_ARRIVAL_POLL_S)
            values = self.held.get(request.fragment, request.version, request.commit_id)
        if values is None:
            held = [f"{v} (commit {c:x})" for p, v, c in self.held.versions()
                    if p == request.fragment]
            raise PeerRefusal("not_held",
                              f"fragment {request.fragment} version {request.version} (commit "
                              f"{request.commit_id:x}) is not held here (held: "
                              f"{', '.join(held) or 'none'})")
        return values

    async def reserve(self, request: peer_pb.PeerFetchRequest) -> peer_pb.Reservation:
        values = await self.values(request)
        # Any learner may catch up from a peer: the ticket is for whoever asked.
        handoff = Handoff(Grant("", request.fragment, request.version))
        ticket = self._bulk.tickets.issue(handoff)
        # The reservation pins this array: a newer version applied meanwhile changes nothing.
        self._spawn(self._serve_reservation(handoff, ticket, values))
        return peer_pb.Reservation(fragment=request.fragment, version=request.version,
                                   numel=values.size, ticket=ticket, bulk_port=self.bulk_port,
                                   expires_ms=int(_RESERVATION_S * 1000),
                                   commit_id=request.commit_id)

    def served(self, to: str, fragment: int, version: int, transport: str, nbytes: int,
               started: float) -> None:
        self.events.emit("peer_serve", learner=self.learner_id, to=to, fragment=fragment,
                         version=version, transport=transport, bytes=nbytes,
                         seconds=round(time.monotonic() - started, 4))

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_reservation(self, handoff: Handoff, ticket: bytes,
                                 values: np.ndarray) -> None:
        """Send the reserved values on the connection its ticket opens, if one comes."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(_RESERVATION_S):
                conn = await asyncio.shield(handoff.connection)
            sent = await self._bulk.run(conn, lambda: send_frames(conn, values))
            handoff.release(True)
            self.served(str(conn.getpeername()[0]), handoff.grant.fragment,
                        handoff.grant.version, "bulk", sent, started)
        except (OSError, TimeoutError, ConnectionError):
            pass  # the fetcher gave up, or never came: it moves on to another peer
        finally:
            self._bulk.tickets.withdraw(ticket)
            handoff.close()

    def _bulk_refused(self, reason: str, learner_id: str, message: str) -> None:
        self.events.emit("peer_refused", learner=self.learner_id, reason=reason,
                         message=message)


class _Servicer(peer_grpc.PeerFragmentsServicer):  # type: ignore[misc]
    def __init__(self, server: PeerServer) -> None:
        self.server = server

    async def Fetch(self, request: peer_pb.PeerFetchRequest,
                    context: Context) -> AsyncIterator[pb.PullMessage]:
        started = time.monotonic()
        try:
            values = await self.server.values(request)
        except PeerRefusal as refusal:
            await _abort(context, refusal)
        yield pb.PullMessage(header=pb.PullHeader(
            fragment=request.fragment, version=request.version, numel=values.size,
            commit_id=request.commit_id))
        for message in iter_chunk_messages(values, FP32, pb.PullMessage,
                                           self.server.chunk_bytes()):
            yield message
        self.server.served(context.peer(), request.fragment, request.version, "grpc",
                           4 * values.size, started)

    async def Reserve(self, request: peer_pb.PeerFetchRequest,
                      context: Context) -> peer_pb.Reservation:
        try:
            return await self.server.reserve(request)
        except PeerRefusal as refusal:
            await _abort(context, refusal)

    async def ListHoldings(self, request: peer_pb.HoldingsRequest,
                           context: Context) -> peer_pb.Holdings:
        run_id, layout_hash = self.server.identity()
        return peer_pb.Holdings(run_id=run_id, layout_hash=layout_hash, fragments=[
            pb.FragmentStatus(fragment=p, version=v, commit_id=c)
            for p, v, c in self.server.held.versions()])


async def _abort(context: Context, refusal: PeerRefusal) -> NoReturn:
    await context.abort(_STATUS[refusal.reason], str(refusal))
    raise AssertionError("context.abort returned")


# -- fetching ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Fetched:
    fragment: int
    version: int
    commit_id: int
    values: np.ndarray
    source: str  # the peer's address
    transport: str
    seconds: float


@dataclass
class _Peer:
    address: str
    channel: grpc.aio.Channel
    stub: peer_grpc.PeerFragmentsStub
    bulk_reachable: bool = True
    # Unreachable (connection refused, no answer): skipped for the rest of the catch-up.
    down: bool = False


@dataclass
class PeerFetchReport:
    """What a catch-up got from its peers, and why the rest came from elsewhere."""

    fetched: dict[int, Fetched] = field(default_factory=dict)
    misses: list[str] = field(default_factory=list)


async def fetch_from_peers(
        addresses: Sequence[str], run_id: str, layout_hash: str,
        wanted: Mapping[int, pb.FragmentStatus], numels: Sequence[int], *,
        transport: str = "bulk", concurrency: int = 4, idle_timeout_s: float = 10.0,
        deliver: Callable[[Fetched], Awaitable[None]] | None = None,
        tls: TlsMaterial | None = None) -> PeerFetchReport:
    """Fetch fragment p at exactly the version and commit `wanted[p]` names (as
    the synchronizer published it), from the first of `addresses`
    that holds it (fragment p starts at peer p mod n, so several peers share the
    load). `deliver` is awaited on each fragment as it arrives. Never raises for
    a peer's failure: what no peer served is missing from the report."""
    report = PeerFetchReport()
    if not addresses or not wanted:
        return report
    peers = [_open_peer(address, tls) for address in addresses]
    pool = BulkPool("", tls, idle_timeout_s)
    limit = asyncio.Semaphore(concurrency)

    async def one(fragment: int) -> None:
        request = peer_pb.PeerFetchRequest(
            run_id=run_id, layout_hash=layout_hash, fragment=fragment,
            version=wanted[fragment].version, commit_id=wanted[fragment].commit_id)
        for i in range(len(peers)):
            peer = peers[(fragment + i) % len(peers)]
            if peer.down:
                continue
            try:
                async with limit:
                    fetched = await _fetch(peer, request, numels[fragment], transport,
                                           idle_timeout_s, pool)
            except PeerMiss as miss:
                report.misses.append(f"{peer.address} fragment {fragment}: {miss}")
                continue
            report.fetched[fragment] = fetched
            if deliver is not None:
                await deliver(fetched)
            return

    try:
        await asyncio.gather(*(one(p) for p in sorted(wanted)))
    finally:
        await asyncio.gather(*(peer.channel.close(grace=None) for peer in peers))
        pool.close()
    return report


def _open_peer(address: str, tls: TlsMaterial | None) -> _Peer:
    channel = aio_channel(address, tls, _CHANNEL_OPTIONS)
    return _Peer(address, channel, peer_grpc.PeerFragmentsStub(channel))


async def _fetch(peer: _Peer, request: peer_pb.PeerFetchRequest, numel: int, transport: str,
                 idle_timeout_s: float, pool: BulkPool) -> Fetched:
    """One fragment version from one peer, or `PeerMiss`."""
    started = time.monotonic()
    try:
        if transport == "bulk" and peer.bulk_reachable:
            reservation: peer_pb.Reservation = await peer.stub.Reserve(
                request, timeout=_RPC_TIMEOUT_S)
            if reservation.numel != numel:
                raise PeerMiss(f"reserved {reservation.numel} elements, the fragment has {numel}")
            if reservation.commit_id != request.commit_id:
                raise PeerMiss(f"reserved commit {reservation.commit_id:x}, not the one "
                               f"published ({request.commit_id:x})")
            host, _ = split_address(peer.address)
            values = np.empty(numel, dtype=np.float32)
            reader = ChunkReader(numel, f"fragment {request.fragment}")
            try:
                await asyncio.to_thread(pool.pull, host, reservation.bulk_port,
                                        reservation.ticket, reader, values)
            except BulkUnreachable:
                # A firewall or NAT in the way of the bulk port: gRPC still gets through.
                peer.bulk_reachable = False
            else:
                return Fetched(request.fragment, request.version, request.commit_id, values,
                               peer.address, "bulk", time.monotonic() - started)
        values = await _receive_stream(peer, request, numel, idle_timeout_s)
        return Fetched(request.fragment, request.version, request.commit_id, values,
                       peer.address, "grpc", time.monotonic() - started)
    except grpc.aio.AioRpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            peer.down = True
        raise PeerMiss(f"{exc.code().name}: {exc.details()}") from exc
    except (OSError, TimeoutError, ValueError) as exc:
        raise PeerMiss(f"{type(exc).__name__}: {exc}") from exc


async def _receive_stream(peer: _Peer, request: peer_pb.PeerFetchRequest, numel: int,
                          idle_timeout_s: float) -> np.ndarray:
    call = peer.stub.Fetch(request)
    stream = aiter(call)
    try:
        message = await asyncio.wait_for(anext(stream), _RPC_TIMEOUT_S)
        header = message.header
        if (message.WhichOneof("kind") != "header" or header.fragment != request.fragment
                or header.version != request.version or header.numel != numel
                or header.commit_id != request.commit_id):
            raise ValueError(f"peer sent {header} for fragment {request.fragment} version "
                             f"{request.version} (commit {request.commit_id:x}) of {numel} "
                             f"elements")
        values = np.empty(numel, dtype=np.float32)
        reader = ChunkReader(numel, f"fragment {request.fragment}")
        await reader.read_into(lambda: asyncio.wait_for(anext(stream, None), idle_timeout_s),
                               values)
        return values
    finally:
        call.cancel()


def _lower_priority() -> None:
    """Raise the calling thread's nice value (Linux: per thread; elsewhere a no-op)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       os.getpriority(os.PRIO_PROCESS, 0) + _SENDER_NICE)
