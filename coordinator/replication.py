"""Replication of committed versions from the leader to its standbys.

The leader keeps one link per standby registered in etcd. A new link first
sends the standby every fragment's durable record (catch-up), then every
version the leader commits, in order, each as one `Replicate` call: a
header, then the raw fp32 parameters followed by the momentum, which is left
out when it is all zero (no outer momentum, the default) and the standby's
registration says it reads such a stream (`zero_momentum`). The bytes
move on the standby's bulk port as a push's do (`protos.bulk`): the standby
is the call's server, so, as the daemon does for a push, it issues the
ticket and listens, and the leader dials the host it already reaches for
gRPC (no port of the leader's need be open to its standbys); where that port
cannot be reached the leader sends the same bytes as chunks on the call,
from then on, said once (`bulk_fallback`). A frame that fails its checksum
is a refused replica (`corrupt`): nothing is written, and the link starts
over. A standby writes a version durably before acknowledging it.

`replication = sync` (the default) publishes a version only once every
in-sync standby has acknowledged it; a standby that does not within
`replication_timeout_s`, or whose link fails, first leaves the in-sync set
kept in etcd (written only while this leader's key stands, so a deposed
leader cannot), and the version is published without it. A link is in sync
once its queue has drained after catch-up. Only an in-sync replica may
campaign to lead, so a new leader always holds every published version.
`async` streams without waiting (a failover may lose the newest versions);
`none` replicates nothing.

Called by `coordinator.ha.Replica`, the engine's leadership, before each
publish (leader side) and by `coordinator.service` (`read_replica`, standby
side).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from coordinator.config import HaConfig
from coordinator.durability import FragmentRecord, RunRecord
from coordinator.errors import NotLeader, Reason, Rejected
from coordinator.etcd import Etcd, EtcdError
from coordinator.tasks import cancel_and_wait
from protos import discovery, tls
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc
from protos.bulk import (
    BulkCut,
    BulkError,
    BulkPool,
    BulkServer,
    BulkUnreachable,
    Grant,
    bulk_host,
    open_stream,
    push_announced,
)
from protos.codec import MESSAGE_SIZE_OPTIONS, codec_named, iter_chunk_messages
from protos.stream import ChunkReader, StreamError
from protos.tls import REPLICA_NAME, TlsMaterial

if TYPE_CHECKING:
    from coordinator.engine import Engine

_FP32 = codec_named("fp32")
_CHUNK_BYTES = 4 << 20
# Pause before a failed link dials its standby again.
_RECONNECT_S = 0.5
_CHANNEL_OPTIONS = [
    *MESSAGE_SIZE_OPTIONS,
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 1_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


# -- the wire format, both sides -------------------------------------------------------

def replica_messages(epoch: int, leader_id: str, run: RunRecord, record: FragmentRecord,
                     zero_momentum: bool = False) -> Iterator[pb.ReplicaMessage]:
    """One version as a `Replicate` stream: header, parameters, momentum (none with
    `zero_momentum`)."""
    header = replica_header(epoch, leader_id, run, record, zero_momentum)
    yield header
    yield from replica_chunks(replica_vectors(header, record))


def replica_header(epoch: int, leader_id: str, run: RunRecord, record: FragmentRecord,
                   zero_momentum: bool = False) -> pb.ReplicaMessage:
    """`zero_momentum`: the record's momentum is all zero and left out of the stream."""
    return pb.ReplicaMessage(header=pb.ReplicaHeader(
        epoch=epoch, leader_id=leader_id, run_id=run.run_id, layout_hash=run.layout_hash,
        numels=run.numels, fragment=record.fragment, version=record.version,
        numel=record.params.size, watermarks=record.watermarks,
        manifest_json=json.dumps(record.manifest), commit_epoch=record.epoch,
        commit_id=record.commit_id, zero_momentum=zero_momentum))


def replica_vectors(header: pb.ReplicaMessage,
                    record: FragmentRecord) -> tuple[np.ndarray, ...]:
    """What the stream `header` opens carries: the parameters, then the momentum."""
    if header.header.zero_momentum:
        return (record.params,)
    return record.params, record.momentum


def replica_chunks(vectors: tuple[np.ndarray, ...]) -> Iterator[pb.ReplicaMessage]:
    """`vectors` as the chunks of one vector, one after the other."""
    start = 0
    for vector in vectors:
        for message in iter_chunk_messages(vector, _FP32, pb.ReplicaMessage, _CHUNK_BYTES):
            message.chunk.offset += start
            yield message
        start += vector.size


async def send_replica(stub: pb_grpc.ReplicationStub, header: pb.ReplicaMessage,
                       record: FragmentRecord, address: str, pool: BulkPool | None,
                       unreachable: Callable[[BulkUnreachable], None],
                       metadata: tuple[tuple[str, str], ...] = ()) -> pb.ReplicaAck:
    """One version to the standby at `address`: the header on the call, the bytes on
    its bulk port through `pool` (None: as chunks on the call, as they go too when
    the port cannot be reached, which `unreachable` is told)."""
    header.header.bulk = pool is not None
    vectors = replica_vectors(header, record)

    def on_bulk(call: Any) -> Awaitable[str]:
        assert pool is not None
        return push_announced(pool, call, bulk_host(address), vectors, _FP32, unreachable)

    call = await open_stream(
        lambda messages: stub.Replicate(messages, timeout=60, metadata=metadata),
        header, lambda: replica_chunks(vectors), None if pool is None else on_bulk)
    ack: pb.ReplicaAck = await call
    return ack


async def read_replica(
        messages: AsyncIterator[pb.ReplicaMessage],
        check_room: Callable[[int], None] = lambda params: None,
        bulk: BulkServer | None = None,
        announce: Callable[[bytes, int], Awaitable[None]] | None = None,
        idle_s: float = 30.0,
) -> tuple[int, RunRecord, FragmentRecord, str]:
    """(sender epoch, run, record, transport) from a `Replicate` stream; `Rejected` if
    malformed, cut, or a bulk frame fails its checksum (`corrupt`).

    `check_room(params)` refuses a run too large for this replica (the engine's rule
    for a first Join) before the header's sizes allocate anything. A header asking
    for the bulk channel is answered through `announce(ticket, port)`: the frames
    then come on `bulk` (`BulkServer.receive`, `idle_s` for the connection), or,
    with no bulk port here (port 0), the chunks on the call. The transport is the
    one the bytes took: bulk, grpc, or grpc_fallback."""
    stream = aiter(messages)
    first = await anext(stream, None)
    if first is None or first.WhichOneof("kind") != "header":
        raise Rejected(Reason.MALFORMED, "a replication stream starts with a header")
    header = first.header
    numel = int(header.numel)
    if header.fragment >= len(header.numels) or header.numels[header.fragment] != numel:
        raise Rejected(Reason.BAD_SHAPE, f"fragment {header.fragment} of {numel} elements "
                                         f"does not fit the run's layout")
    check_room(sum(int(n) for n in header.numels))
    values = np.empty(numel if header.zero_momentum else 2 * numel, dtype=np.float32)
    subject = f"the replica of fragment {header.fragment}"
    reader = ChunkReader(values.size, subject)

    def receive() -> Awaitable[pb.ReplicaMessage | None]:
        return anext(stream, None)

    try:
        if header.bulk and bulk is not None and announce is not None:
            # Bound to the replicas' name: under mutual TLS only a replica's
            # certificate redeems it.
            grant = Grant(REPLICA_NAME, int(header.fragment), int(header.version))
            transport = await bulk.receive(grant, announce, stream, receive, reader, values,
                                           1.0, idle_s)
        else:
            if header.bulk and announce is not None:
                await announce(b"", 0)  # no bulk port here: the chunks come on the call
            await reader.read_into(receive, values)
            reader.refuse_more(await receive())
            transport = "grpc"
    except BulkCut as cut:
        raise Rejected(Reason(cut.reason), f"{subject}: {cut.message}") from None
    except StreamError as exc:
        raise Rejected(Reason(exc.reason), exc.message) from exc
    run = RunRecord(header.run_id, header.layout_hash, tuple(int(n) for n in header.numels))
    record = FragmentRecord(
        fragment=int(header.fragment), version=int(header.version),
        params=values[:numel],
        momentum=np.zeros(numel, np.float32) if header.zero_momentum else values[numel:],
        watermarks={k: int(v) for k, v in header.watermarks.items()},
        manifest=_manifest(header.manifest_json), epoch=int(header.commit_epoch),
        commit_id=int(header.commit_id), zero_momentum=header.zero_momentum)
    return int(header.epoch), run, record, transport


def _manifest(text: str) -> list[Any]:
    try:
        manifest = json.loads(text or "[]")
    except (ValueError, RecursionError) as exc:  # nested past the parser's recursion limit
        raise Rejected(Reason.MALFORMED, f"the replicated manifest is not JSON: {exc}") from None
    if not isinstance(manifest, list):
        raise Rejected(Reason.MALFORMED, "the replicated manifest is not a list")
    return manifest


# -- the leader's side -----------------------------------------------------------------

@dataclass
class _Item:
    record: FragmentRecord
    acked: asyncio.Future[None]


@dataclass
class _Link:
    """The leader's stream of versions to one standby."""

    replica_id: str
    address: str
    # The standby reads a stream with the momentum left out (`ReplicaRecord`).
    zero_momentum: bool
    queue: asyncio.Queue[_Item] = field(default_factory=asyncio.Queue)
    in_sync: bool = False
    task: asyncio.Task[None] | None = None

    def enqueue(self, record: FragmentRecord) -> asyncio.Future[None]:
        acked: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Only in-sync links are waited on: mark the others' failures as seen.
        acked.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.queue.put_nowait(_Item(record, acked))
        return acked

    def fail_pending(self) -> None:
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if not item.acked.done():
                item.acked.set_exception(ConnectionError(f"standby {self.replica_id} lost"))


class Replicator:
    """Streams every committed version to the standbys while this replica leads."""

    def __init__(self, engine: Engine, etcd: Etcd, config: HaConfig, replica_id: str,
                 clock: Callable[[], float], material: TlsMaterial | None = None) -> None:
        self.engine = engine
        self.etcd = etcd
        # The coordinator's own certificate: standbys take it as a replica's.
        self.material = material
        self.config = config
        self.replica_id = replica_id
        self.clock = clock
        self.epoch = 0
        self.links: dict[str, _Link] = {}
        self._insync_written: frozenset[str] | None = None
        self._insync_lock = asyncio.Lock()
        self._follow: asyncio.Task[None] | None = None
        self._metadata = (("authorization", f"Bearer {config.token}"),) if config.token else ()
        # Versions' bytes to the standbys' bulk ports, as a replica (its certificate
        # under mutual TLS); as gRPC chunks to a standby whose port cannot be reached.
        self._bulk = BulkPool(REPLICA_NAME, material)
        self._no_bulk: set[str] = set()

    @property
    def mode(self) -> str:
        return self.config.replication

    async def lead(self, epoch: int) -> None:
        """Start replicating as the leader of `epoch`: record that only this replica
        is in sync yet, then follow the registered standbys."""
        self.epoch = epoch
        self._insync_written = None
        await self._write_insync()
        if self.mode != "none":
            self._follow = asyncio.create_task(self._follow_standbys(), name="replication")

    async def stop(self) -> None:
        await cancel_and_wait(self._follow, *(link.task for link in self.links.values()))
        for link in self.links.values():
            link.fail_pending()
        self.links.clear()
        self._bulk.close()
        self._follow = None
        self.epoch = 0

    def in_sync(self) -> list[str]:
        return sorted([self.replica_id, *(r for r, link in self.links.items() if link.in_sync)])

    async def replicate(self, record: FragmentRecord) -> None:
        """The engine's publish guard: hand the version to every link; with sync
        replication wait for the in-sync ones, dropping laggards from the set."""
        if self.mode == "none" or not self.links:
            return
        # The next commit of this fragment updates the momentum in place, and a
        # laggard may still be sending this version then (an all-zero one is not
        # copied: `np.zeros` maps zero pages, touched only if it is sent).
        momentum = (np.zeros(record.momentum.shape, np.float32) if record.zero_momentum
                    else record.momentum.copy())
        record = FragmentRecord(record.fragment, record.version, record.params, momentum,
                                dict(record.watermarks), record.manifest, record.epoch,
                                record.commit_id, record.zero_momentum)
        waits = {link.replica_id: (link, link.enqueue(record), link.in_sync)
                 for link in list(self.links.values())}
        if self.mode == "async":
            return
        pending = {r: fut for r, (_, fut, in_sync) in waits.items() if in_sync}
        if pending:
            await asyncio.wait(pending.values(), timeout=self.config.replication_timeout_s)
        lagging = [waits[r][0] for r, fut in pending.items()
                   if not fut.done() or fut.cancelled() or fut.exception() is not None]
        for link in lagging:
            link.in_sync = False
            self.engine.events.emit("standby_lagging", replica=link.replica_id,
                                    fragment=record.fragment, version=record.version)
        if lagging:
            await self._write_insync()

    # -- internals -------------------------------------------------------------------

    async def _write_insync(self) -> None:
        """Record the in-sync set in etcd, fenced by this leader's key; a deposed
        leader's write fails and it must not publish."""
        async with self._insync_lock:
            replicas = frozenset(self.in_sync())
            if replicas == self._insync_written:
                return
            value = json.dumps({"epoch": self.epoch, "replicas": sorted(replicas)}).encode()
            try:
                written = await self.etcd.put_fenced(
                    discovery.insync_key(self.config.run), value,
                    discovery.leader_key(self.config.run), self.epoch)
            except EtcdError as exc:
                raise NotLeader("", self.epoch) from exc
            if not written:
                raise NotLeader("", self.epoch)
            self._insync_written = replicas
            self.engine.events.emit("insync", epoch=self.epoch, replicas=sorted(replicas))

    async def _follow_standbys(self) -> None:
        prefix = discovery.replicas_prefix(self.config.run)
        while True:
            try:
                entries, revision = await self.etcd.get_prefix(prefix)
            except EtcdError:
                await asyncio.sleep(_RECONNECT_S)
                continue
            registered: dict[str, discovery.ReplicaRecord] = {}
            for entry in entries:
                standby = discovery.ReplicaRecord.decode(entry.value)
                if standby is not None:
                    registered[standby.replica] = standby
            registered.pop(self.replica_id, None)
            for replica_id, link in list(self.links.items()):
                known = registered.get(replica_id)
                if known is None or (known.address, known.zero_momentum) != (
                        link.address, link.zero_momentum):
                    await self._drop(link)
            for replica_id, standby in registered.items():
                old = self.links.get(replica_id)
                if old is not None and old.task is not None and not old.task.done():
                    continue
                if old is not None:
                    await self._drop(old)
                link = _Link(replica_id, standby.address, standby.zero_momentum)
                self.links[replica_id] = link
                link.task = asyncio.create_task(self._run_link(link),
                                                name=f"replicate-{replica_id}")
            with contextlib.suppress(EtcdError):
                await self.etcd.wait_change(prefix, revision, timeout_s=1.0, prefix=True)

    async def _drop(self, link: _Link) -> None:
        await cancel_and_wait(link.task)
        link.fail_pending()
        self.links.pop(link.replica_id, None)
        if link.in_sync:
            link.in_sync = False
            with contextlib.suppress(NotLeader):
                await self._write_insync()

    async def _run_link(self, link: _Link) -> None:
        try:
            async with tls.aio_channel(link.address, self.material,
                                       _CHANNEL_OPTIONS) as channel:
                stub = pb_grpc.ReplicationStub(channel)
                await self._catch_up(link, stub)
                while True:
                    if link.queue.empty() and not link.in_sync:
                        # Everything published so far is on the standby: it may wait on it now.
                        link.in_sync = True
                        self.engine.events.emit("standby_in_sync", replica=link.replica_id,
                                                epoch=self.epoch)
                        await self._write_insync()
                    item = await link.queue.get()
                    try:
                        await self._send(stub, link, item.record)
                    except BaseException as exc:
                        if not item.acked.done():
                            item.acked.set_exception(ConnectionError(str(exc)))
                        raise
                    if not item.acked.done():
                        item.acked.set_result(None)
        except asyncio.CancelledError:
            raise
        except (grpc.RpcError, ConnectionError, OSError, NotLeader, BulkError) as exc:
            self.engine.events.emit("standby_lost", replica=link.replica_id,
                                    error=str(exc)[:200])
            link.fail_pending()
            if link.in_sync:
                link.in_sync = False
                with contextlib.suppress(NotLeader):
                    await self._write_insync()
            await asyncio.sleep(_RECONNECT_S)

    async def _catch_up(self, link: _Link, stub: pb_grpc.ReplicationStub) -> None:
        """Send the standby every fragment's durable record, as the link starts."""
        run = self.engine.run
        if run is None:
            return
        for fragment in range(len(run.numels)):
            record = await asyncio.to_thread(self.engine.state.load_fragment, fragment)
            if record is not None:
                await self._send(stub, link, record)

    async def _send(self, stub: pb_grpc.ReplicationStub, link: _Link,
                    record: FragmentRecord) -> None:
        run = self.engine.run
        if run is None:
            raise ConnectionError("no run to replicate")
        header = replica_header(self.epoch, self.replica_id, run, record,
                                link.zero_momentum and record.zero_momentum)
        pool = None if link.address in self._no_bulk else self._bulk
        try:
            await send_replica(stub, header, record, link.address, pool,
                               lambda exc: self._fall_back(link, exc), self._metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                # The standby knows a newer epoch: this replica no longer leads.
                raise NotLeader("", self.epoch) from exc
            raise

    def _fall_back(self, link: _Link, error: BulkUnreachable) -> None:
        """Versions to this standby go as gRPC chunks from now on; said once."""
        if link.address in self._no_bulk:
            return
        self._no_bulk.add(link.address)
        self.engine.events.emit("bulk_fallback", replica=link.replica_id,
                                address=link.address, error=str(error)[:200])
