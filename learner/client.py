"""The learner's gRPC client to the synchronizer.

It joins, heartbeats, pushes outer gradients and pulls merged fragments, and
it owns the learner's half of exactly-once: every pushed contribution stays
in an outbox until a committed manifest names it (the durable merged-seq
watermark the coordinator reports reaches its seq), and is pushed again
when the coordinator comes back without it. A contribution leaves the
outbox only as merged, or as dropped with the coordinator's reason. That
bookkeeping is the pure `learner.outbox`; this module makes the calls.
Transport failures are retried with exponential backoff and jitter.

A highly available synchronizer is named by a comma-separated list of
replica addresses or by `etcd://HOST:PORT[,HOST:PORT]/RUN` (the leader is
read from etcd). A standby answers `not_leader` naming the leader, which
the client follows at once; an unreachable replica sends it to the next
one, and so does a replica that answers `draining` (an operator's
`Admin.Drain`: it takes no new rounds and hands over, or exits to be
upgraded). Every answer carries the leader's epoch, and the client ignores one
from an epoch older than it has seen (a deposed leader); which replica to
call is `learner.routing`'s, and this module's retry loop drives it. After a change of
leader the new one does not know the learner: the client joins again and
pushes every contribution still in the outbox; the ones already merged are
recognised by their ids and settled.

A learner that pushes with a codec pulls with it too: it holds, per fragment,
the coordinator's reference for that codec (`PullHeader.reference`) and asks
for the next version as a compressed delta to add to it (`protos.codec.add_delta`,
the coordinator's own addition, so the two copies agree bit for bit); without
one it gets the reference itself in fp32.

Called by the learner runtime (`learner.streaming`) on its background loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc
import numpy as np
from opentelemetry import trace
from opentelemetry.trace import SpanContext, SpanKind

from learner.metrics import LearnerMetrics
from learner.outbox import Contribution, Outbox, OutboxStats, Settled
from learner.routing import Replicas, Router, WrongReplica
from protos import ftsync_pb2 as pb
from protos import metadata, telemetry
from protos.bulk import (
    BulkError,
    BulkPool,
    BulkUnreachable,
    bulk_host,
    open_stream,
    push_announced,
)
from protos.codec import (
    FP32,
    Codec,
    CodecError,
    add_delta,
    codec_for,
    codec_named,
    iter_chunk_messages,
)
from protos.events import EventLog
from protos.stream import ChunkReader, StreamError
from protos.tls import TlsMaterial, diagnose

T = TypeVar("T")

# Codes worth retrying: the coordinator is down, restarting or overloaded.
_TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED,
              # A bulk frame that failed its checksum: corrupted on the way, sent again.
              grpc.StatusCode.DATA_LOSS}
# Refusals that mean "not here, not now": a standby's, and a draining replica's.
_GO_ELSEWHERE = ("not_leader", "draining")
# Pause before asking the leader a replica named, or the next replica.
_REDIRECT_S = (0.01, 0.05)
# Longest pause between rounds over every replica while none answers.
_FAILOVER_BACKOFF_S = 0.1
# How long a failover may take (the failed leader's lease, 3 s by default, and a
# campaign): while a call has failed for less, replicas are asked again within
# _FAILOVER_BACKOFF_S; after it, the backoff grows as for a coordinator that is down.
FAILOVER_WINDOW_S = 10.0
# A heartbeat answers in milliseconds; one that takes this long means a frozen
# or cut-off coordinator, and the search for the leader starts.
_HEARTBEAT_DEADLINE_S = 2.0

_TRACER = trace.get_tracer(__name__)


class Refused(Exception):
    """The coordinator refused a request for a reason retrying won't fix."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: str | None = None,
                 facts: Mapping[str, str] | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self._reason = reason
        # The trailing metadata the refusal came with (`protos.metadata` keys).
        self.facts = dict(facts or {})

    @classmethod
    def of(cls, error: grpc.aio.AioRpcError) -> Refused:
        """The coordinator's refusal, with its reason code and facts from the trailing
        metadata."""
        trailing: Any = error.trailing_metadata() or ()
        facts = {key: value for key, value in trailing if isinstance(value, str)}
        return cls(error.code(), error.details() or "", facts.get(metadata.REASON, ""), facts)

    @property
    def reason(self) -> str:
        """The coordinator's reason code (e.g. `stale`): `ftsync-reason`, or for a
        refusal made here from a message alone, its `reason:` prefix."""
        return self.details.split(":", 1)[0] if self._reason is None else self._reason


@dataclass(frozen=True)
class Retry:
    """Exponential backoff with full jitter, given up after `give_up_after_s` of
    failing (counted from a call's first failure)."""

    initial_s: float = 0.1
    max_s: float = 2.0
    give_up_after_s: float = 60.0

    def delays(self) -> Iterator[float]:
        delay = self.initial_s
        while True:
            yield random.uniform(0, delay)
            delay = min(delay * 2, self.max_s)


@dataclass(frozen=True)
class Pulled:
    fragment: int
    version: int
    values: np.ndarray
    merged_seq: int
    commit_id: int
    # The coordinator's newest version, older than the one asked past: it lost versions.
    rewound: bool = False
    # The coordinator's span of the round that committed it, when it says.
    trace: SpanContext | None = None


class SynchronizerClient:
    """One learner's connection to a coordinator (or to the leader of its replicas)."""

    def __init__(self, address: str, learner_id: str, layout_hash: str,
                 numels: list[int], *, token: str | None = None, overlap_steps: int = 1,
                 codec: str = "fp32", retry: Retry | None = None,
                 events: EventLog | None = None, device: str = "cpu",
                 tls: TlsMaterial | None = None, metrics: LearnerMetrics | None = None,
                 bulk: bool = True, pull_codec: str | None = None,
                 auto_sync_every: bool = False) -> None:
        """`pull_codec`: the codec pulls ask for deltas in (None: `codec`'s; "fp32":
        the committed values, as before compressed pulls). `auto_sync_every`: ask the
        coordinator for H at every Join; `sync_every` holds the last one assigned."""
        self.learner_id = learner_id
        # Fragment bytes on the coordinator's bulk port (TLS as the gRPC channel is);
        # gRPC chunks with `bulk` off, and to a coordinator whose port is unreachable.
        self.bulk = bulk
        self._bulk = BulkPool(learner_id, tls)
        self._no_bulk: set[str] = set()
        # Exported over OTLP when the environment names an endpoint; no-ops otherwise.
        self.metrics = metrics or LearnerMetrics(learner_id)
        # This learner's certificate, for the coordinator, etcd and its peers alike.
        self.tls = tls
        self.layout_hash = layout_hash
        self.numels = numels
        self.overlap_steps = overlap_steps
        self.auto_sync_every = auto_sync_every
        # The H the coordinator last assigned (0: none, or not asked for).
        self.sync_every = 0
        self.codec: Codec = codec_named(codec)
        self.pull_codec: Codec = self.codec if pull_codec is None else codec_named(pull_codec)
        # Per fragment, the coordinator's reference of `pull_codec` held: (version, its id,
        # values), read-only, since the next delta is added to exactly these values.
        self.references: dict[int, tuple[int, int, np.ndarray]] = {}
        self.retry = retry or Retry()
        self.events = events or EventLog("")
        self.device = device
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        # Which replica to call (the leader's epoch, hints, etcd), and its channel.
        self.replicas = Replicas(address)
        self.router = Router(self.replicas, tls)
        # Replicas whose TLS has been checked after a failed connection.
        self._tls_checked: set[str] = set()
        self.run_id = ""
        # A Join once sent may have been taken even if its reply never came (the call
        # cancelled or timed out): from then until a Leave, this learner may be a
        # member of the run, and one that stops must say Leave.
        self.may_be_member = False
        self.chunk_bytes = 2 << 20
        self.heartbeat_interval_s = 1.0
        # (version, commit id) of each fragment as the coordinator last reported it.
        self.published: dict[int, tuple[int, int]] = {}
        self.outbox = Outbox()
        self._joins = 0
        self._rejoin = asyncio.Lock()
        self._left = False

    # -- membership -------------------------------------------------------------

    async def join(self) -> pb.JoinResponse:
        """Join (or re-join after a coordinator restart), retrying while it is down."""
        self._left = False
        request = pb.JoinRequest(
            learner_id=self.learner_id, overlap_steps=self.overlap_steps,
            host=socket.gethostname(), pid=os.getpid(), device=self.device,
            auto_sync_every=self.auto_sync_every,
            layout=pb.Layout(hash=self.layout_hash, fragments=[
                pb.FragmentSpec(fragment=i, numel=n) for i, n in enumerate(self.numels)]))
        async def join_once() -> pb.JoinResponse:
            self.may_be_member = True
            reply: pb.JoinResponse = await self.router.stub.Join(request, metadata=self._metadata,
                                                           timeout=10)
            self.replicas.check_epoch(reply.epoch)
            return reply
        response = await self._retrying(join_once)
        self.run_id = response.run_id
        self.chunk_bytes = response.chunk_bytes or self.chunk_bytes
        self.heartbeat_interval_s = response.heartbeat_interval_ms / 1000.0 or 1.0
        self.sync_every = response.sync_every
        self.outbox.joined(response.next_seq)
        self._observe(response.fragments)
        self._joins += 1
        self.events.emit("join", learner=self.learner_id, run_id=self.run_id,
                         versions=dict(self.versions), coordinator=self.address,
                         epoch=response.epoch)
        return response

    async def heartbeat(self, local_step: int) -> None:
        request = pb.HeartbeatRequest(learner_id=self.learner_id, local_step=local_step,
                                      backlog=len(self.outbox))
        async def heartbeat_once() -> pb.HeartbeatResponse:
            reply: pb.HeartbeatResponse = await self.router.stub.Heartbeat(
                request, metadata=self._metadata, timeout=_HEARTBEAT_DEADLINE_S)
            self.replicas.check_epoch(reply.epoch)
            return reply
        response = await self._call(heartbeat_once)
        self.sync_every = response.sync_every or self.sync_every
        self._observe(response.fragments)

    async def leave(self, reason: str) -> None:
        # From here on a refusal as unknown must not join again (a pull or heartbeat
        # still under way would otherwise bring the learner back after it left).
        self._left = True
        self.may_be_member = False
        # Leaving a coordinator that is gone is nothing to report.
        with contextlib.suppress(grpc.RpcError):
            await self.router.stub.Leave(pb.LeaveRequest(learner_id=self.learner_id, reason=reason),
                                   metadata=self._metadata, timeout=5)

    async def close(self) -> None:
        self._bulk.close()
        await self.router.close()
        if self.metrics.exporting:  # the last export
            await asyncio.to_thread(self.metrics.flush)

    @property
    def stats(self) -> OutboxStats:
        """How the contributions pushed so far settled."""
        return self.outbox.stats

    @property
    def versions(self) -> dict[int, int]:
        """Each fragment's version as the coordinator last reported it."""
        return {p: version for p, (version, _) in self.published.items()}

    @property
    def address(self) -> str:
        """The replica this client talks to now ("" while none is known)."""
        return self.replicas.address

    async def _find_leader(self, hint: str, failed: bool) -> None:
        """Move on after a replica refused or failed (`Router.find_leader`)."""
        left = await self.router.find_leader(hint, failed, wait_s=_HEARTBEAT_DEADLINE_S)
        if left is not None:
            self.events.emit("redirect", learner=self.learner_id, source_address=left,
                             to=self.address)

    # -- pushes ---------------------------------------------------------------------

    async def push_initial(self, fragment: int, values: np.ndarray) -> bool:
        """Offer our values as the fragment's version 0; False if another learner won."""
        header = pb.PushHeader(learner_id=self.learner_id, fragment=fragment,
                               layout_hash=self.layout_hash, seq=self.outbox.take_seq(),
                               init=True, codec=codec_named("fp32").wire, numel=values.size)
        try:
            await self._call(lambda: self._push(header, values, codec_named("fp32")))
        except Refused as refused:
            if refused.code == grpc.StatusCode.ALREADY_EXISTS:
                return False
            raise
        return True

    async def push(self, fragment: int, delta: np.ndarray, base_version: int, c_tokens: int,
                   c_steps: int, local_step: int, work_s: float = 0.0) -> int | None:
        """Push an outer gradient; it stays in the outbox until merged or dropped.
        Returns the version the coordinator will merge it into, when it says."""
        return await self._send(self.outbox.add(fragment, delta, base_version, c_tokens,
                                                c_steps, local_step, work_s))

    async def repush_unacknowledged(self) -> None:
        """Push again whatever the coordinator does not hold (after it restarted)."""
        for contribution in self.outbox.to_push_again():
            if self.outbox.pushing_again(contribution):
                await self._send(contribution)

    @property
    def backlog(self) -> int:
        return len(self.outbox)

    async def _send(self, c: Contribution) -> int | None:
        """Push `c` (retrying as `_call` does) under a span of its own, which the
        coordinator's admit span takes as parent; counted by outcome."""
        with _TRACER.start_as_current_span("ftsync.push", kind=SpanKind.CLIENT, attributes={
                "ftsync.learner": self.learner_id, "ftsync.fragment": c.fragment,
                "ftsync.seq": c.seq, "ftsync.base_version": c.base_version,
                "ftsync.c_tokens": c.c_tokens, "ftsync.c_steps": c.c_steps}) as span:
            merged = self.stats.merged
            target = await self._send_once(c)
            if target is not None:
                outcome = "acked"
            elif self.outbox.holds(c):
                outcome = "held" if c.acknowledged else "unsent"  # held: in the open round
            else:
                outcome = "merged" if self.stats.merged > merged else "refused"
            span.set_attribute("ftsync.outcome", outcome)
        self.metrics.pushes.add(1, {"outcome": outcome})
        return target

    async def _send_once(self, c: Contribution) -> int | None:
        header = pb.PushHeader(
            learner_id=self.learner_id, fragment=c.fragment, layout_hash=self.layout_hash,
            seq=c.seq, base_version=c.base_version, c_tokens=c.c_tokens, c_steps=c.c_steps,
            local_step=c.local_step, codec=self.codec.wire, numel=c.delta.size)
        self.events.emit("push_invoke", learner=self.learner_id, fragment=c.fragment,
                         seq=c.seq, base_version=c.base_version, c_steps=c.c_steps,
                         work_s=round(c.work_s, 4))
        while True:
            try:
                with self.outbox.sending(c):
                    ack = await self._call(lambda: self._push(header, c.delta, self.codec))
            except Refused as refused:
                if refused.reason in _GO_ELSEWHERE:  # none led while it retried
                    self._unsent(c, refused)
                else:
                    self._report(self.outbox.refused(
                        c, refused.reason, int(refused.facts.get(metadata.MERGED_SEQ, "0")),
                        refused.details))
                return None
            except (grpc.RpcError, TimeoutError) as exc:
                self._unsent(c, exc)
                return None
            if self.outbox.acked(c, int(ack.target_version)):
                break
        self.events.emit("push_ack", learner=self.learner_id, fragment=c.fragment, seq=c.seq,
                         target=ack.target_version, weight=ack.weight,
                         staleness=ack.staleness)
        return int(ack.target_version)

    def _unsent(self, c: Contribution, error: Exception) -> None:
        """Still in the outbox: pushed again once a coordinator leads and answers."""
        self.events.emit("push_unsent", learner=self.learner_id, fragment=c.fragment,
                         seq=c.seq, error=str(error)[:200])

    async def _push(self, header: pb.PushHeader, values: np.ndarray,
                    codec: Codec) -> pb.PushResponse:
        chunk_bytes = self.chunk_bytes
        address = self.address
        header.bulk = self.bulk and address not in self._no_bulk

        def on_bulk(call: Any) -> Awaitable[str]:
            return push_announced(self._bulk, call, bulk_host(address), values, codec,
                                  lambda exc: self._fall_back(address, exc))

        # The current span (a contribution's push) becomes the admit span's parent.
        call = await open_stream(
            lambda messages: self.router.stub.PushFragment(
                messages, metadata=self._metadata + telemetry.inject(), timeout=300),
            pb.PushMessage(header=header),
            lambda: iter_chunk_messages(values, codec, pb.PushMessage, chunk_bytes),
            on_bulk if header.bulk else None)
        response: pb.PushResponse = await call
        self.replicas.check_epoch(response.epoch)
        return response

    def _fall_back(self, address: str, error: Exception) -> None:
        """Pushes and pulls to `address` go as gRPC chunks from now on; said once."""
        if address in self._no_bulk:
            return
        self._no_bulk.add(address)
        self.metrics.bulk_fallbacks.add(1)
        self.events.emit("bulk_fallback", learner=self.learner_id, coordinator=address,
                         error=str(error)[:200])

    # -- pulls ----------------------------------------------------------------------

    async def pull(self, fragment: int, have_version: int, wait_s: float) -> Pulled | None:
        """The fragment if a version newer than `have_version` appears within `wait_s`."""
        request = pb.PullRequest(learner_id=self.learner_id, fragment=fragment,
                                 have_version=have_version, wait_ms=int(wait_s * 1000),
                                 codec=self.pull_codec.wire)
        held = self.references.get(fragment)
        if held is not None:  # whatever version the pull waits past
            request.have_reference = held[1]

        async def pull_once() -> Pulled | None:
            address = self.address
            request.bulk = self.bulk and address not in self._no_bulk
            stream = self.router.stub.PullFragment(request, metadata=self._metadata,
                                             timeout=wait_s + 300)
            try:
                pulled = await self._read_fragments(aiter(stream), only=fragment,
                                                    host=bulk_host(address))
            except (BulkError, OSError, ConnectionError) as exc:
                if not request.bulk:
                    raise
                # The bulk transfer failed: the same version again, as gRPC chunks.
                stream.cancel()
                if isinstance(exc, BulkUnreachable):
                    self._fall_back(address, exc)
                request.bulk = False
                stream = self.router.stub.PullFragment(request, metadata=self._metadata,
                                                 timeout=wait_s + 300)
                pulled = await self._read_fragments(aiter(stream), only=fragment)
            if pulled is None:
                return None
            commit = telemetry.span_context(await stream.initial_metadata(),
                                            telemetry.COMMIT_TRACE)
            return replace(pulled, trace=commit) if commit is not None else pulled
        return await self._call(pull_once)

    async def pull_newer(self, fragment: int, have_version: int,
                         wait_s: float) -> Pulled | None:
        """`pull`, or the coordinator's newest version (`rewound`) when it has none as
        new as `have_version`: it lost the versions past its newest (a failover under
        async or no replication, a restored state directory), so its newest is the
        run's now. Waiting past `have_version` would wait for good, and every push
        based on it would be refused."""
        try:
            return await self.pull(fragment, have_version, wait_s)
        except Refused as refused:
            if refused.reason != "future_version":
                raise
        newest = await self.pull(fragment, -1, 0.0)
        if newest is None or newest.version > have_version:
            return newest  # none yet, or it caught up in between: news as asked for
        self.events.emit("rewound", learner=self.learner_id, fragment=fragment,
                         had_version=have_version, version=newest.version)
        return replace(newest, rewound=True)

    async def snapshot(self) -> dict[int, Pulled]:
        """Every published fragment, at one consistent vector of versions."""
        async def fetch() -> dict[int, Pulled]:
            stream = aiter(self.router.stub.FetchSnapshot(
                pb.SnapshotRequest(learner_id=self.learner_id), metadata=self._metadata,
                timeout=600))
            result: dict[int, Pulled] = {}
            while (pulled := await self._read_fragments(stream)) is not None:
                result[pulled.fragment] = pulled
            return result
        return await self._call(fetch)

    async def _read_fragments(self, stream: AsyncIterator[pb.PullMessage],
                              only: int | None = None, host: str = "") -> Pulled | None:
        """Read the next fragment (header + chunks) of a pull or snapshot stream;
        None at the end of the stream or for a pull answered not_modified. A header
        with a ticket has its values come on the bulk port of `host`."""
        while True:
            message = await anext(stream, None)
            if message is None:
                return None
            header = message.header
            if message.WhichOneof("kind") != "header" or (only is not None
                                                          and header.fragment != only):
                raise StreamError("malformed", "pull stream out of order: expected a header "
                                               f"of fragment {only if only is not None else 'any'}")
            self.replicas.check_epoch(header.epoch)
            if header.not_modified:
                return None
            if header.version >= 0:
                break  # fragments without a version yet come as a bare header
        if header.fragment >= len(self.numels) or header.numel != self.numels[header.fragment]:
            # Checked before the header's size allocates anything.
            raise StreamError("bad_shape", f"pulled fragment {header.fragment} of "
                                           f"{header.numel} elements does not fit the layout "
                                           f"({len(self.numels)} fragments)")
        base = self._delta_base(header)
        try:
            codec = codec_for(header.codec) if base is not None else FP32
        except CodecError as exc:
            raise StreamError("bad_encoding", f"pulled fragment {header.fragment}: {exc}") \
                from None
        values = np.empty(header.numel, dtype=np.float32)
        reader = ChunkReader(header.numel, f"fragment {header.fragment}", codec)
        if header.ticket:
            await asyncio.to_thread(self._bulk.pull, host, header.bulk_port, header.ticket,
                                    reader, values)
            reader.refuse_more(await anext(stream, None))
        elif base is None:
            await reader.read_into(lambda: anext(stream, None), values)
        else:
            # Each delta in turn, added as the coordinator added it. The sums go into
            # `values` in place (one fresh vector per pull, not one per delta and sum);
            # deltas after the first decode into a scratch vector.
            decoded = values
            for index in range(max(1, header.deltas)):
                if index == 1:
                    decoded = np.empty_like(values)
                reader = ChunkReader(header.numel, f"a delta of fragment {header.fragment}",
                                     codec)
                await reader.read_into(lambda: anext(stream, None), decoded)
                base = add_delta(base, decoded, out=values)
        if header.reference:
            values.flags.writeable = False
            self.references[header.fragment] = (header.version, header.reference, values)
        self._observe([pb.FragmentStatus(fragment=header.fragment, version=header.version,
                                         merged_seq=header.merged_seq,
                                         commit_id=header.commit_id)])
        return Pulled(header.fragment, header.version, values, header.merged_seq,
                      header.commit_id)

    def _delta_base(self, header: pb.PullHeader) -> np.ndarray | None:
        """The reference a delta pull's chunks are added to (None: they are values);
        a delta the learner cannot add up is refused as malformed."""
        if not header.delta:
            if header.codec != FP32.wire:
                raise StreamError("malformed", f"pulled fragment {header.fragment} comes in "
                                               f"codec {header.codec}, but not as a delta")
            return None
        held = self.references.get(header.fragment)
        if header.ticket:
            raise StreamError("malformed", f"a delta of fragment {header.fragment} on the "
                                           f"bulk channel")
        if held is None:
            raise StreamError("malformed", f"a delta of fragment {header.fragment}, but no "
                                           f"reference of it is held")
        return held[2]

    # -- internals ------------------------------------------------------------------

    def _observe(self, statuses: Iterable[pb.FragmentStatus]) -> None:
        """Learn versions and durable watermarks; settle merged contributions."""
        for status in statuses:
            self.published[status.fragment] = (status.version, status.commit_id)
            for settled in self.outbox.observe(status.fragment, status.merged_seq):
                self._report(settled)

    def count_drop(self, fragment: int, reason: str, work_s: float = 0.0) -> None:
        """A contribution given up before it was sent (the send queue was full)."""
        self._report(self.outbox.dropped_unsent(fragment, reason, work_s))

    def _report(self, settled: Settled | None) -> None:
        """Say how a contribution left the outbox (None: it did not)."""
        if settled is None:
            return
        if settled.merged:
            self.events.emit("merged", learner=self.learner_id, fragment=settled.fragment,
                             seq=settled.seq)
        elif settled.seq is None:
            self.events.emit("dropped", learner=self.learner_id, fragment=settled.fragment,
                             reason=settled.reason, work_s=settled.work_s)
        else:
            self.events.emit("dropped", learner=self.learner_id, fragment=settled.fragment,
                             reason=settled.reason, seq=settled.seq, detail=settled.detail)

    async def _call(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run `call`, re-joining once if the coordinator no longer knows us
        (it restarted), and then pushing again what it lost."""
        joins = self._joins
        try:
            return await self._retrying(call)
        except Refused as refused:
            if refused.reason != "unknown_learner" or self._left:
                raise
            unknown = refused
        async with self._rejoin:
            if self._left:  # it left while this call waited for the lock
                raise unknown
            if joins == self._joins:
                await self.join()
                await self.repush_unacknowledged()
        return await self._retrying(call)

    async def _refuse_on_tls_mismatch(self, exc: grpc.aio.AioRpcError) -> None:
        """Give up at once, saying why, on a replica whose TLS will never accept this
        learner (gRPC calls that unavailable too); asked once per replica."""
        address = self.address
        if not address or address in self._tls_checked:
            return
        self._tls_checked.add(address)
        problem = await asyncio.to_thread(diagnose, address, self.tls)
        if problem:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, f"tls: {problem}", "tls") from exc

    async def _retrying(self, call: Callable[[], Awaitable[T]]) -> T:
        loop = asyncio.get_running_loop()
        delays = self.retry.delays()
        # Measured from the first failure, not the call's start: a long pull that
        # fails late still gets its retries and its quick look for a new leader.
        failing_since: float | None = None

        def failing_for() -> float:
            nonlocal failing_since
            if failing_since is None:
                failing_since = loop.time()
            return loop.time() - failing_since

        # Replicas tried since the last backoff: go round them all before waiting.
        tried = 0
        while True:
            switches = self.router.switches
            try:
                if not self.replicas.addresses and self.replicas.etcd is not None:
                    await self._find_leader("", failed=False)
                return await call()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling() or switches == self.router.switches:
                    raise
                # Its replica was left behind (closing its channel cancels the call).
                if failing_for() >= self.retry.give_up_after_s:
                    raise Refused(grpc.StatusCode.UNAVAILABLE,
                                  "the coordinator changed while the call waited",
                                  "") from None
            except WrongReplica as wrong:
                out_of_time = failing_for() >= self.retry.give_up_after_s
                if out_of_time and not self.address:
                    # Nobody to be refused by: etcd names no leader, or cannot be reached.
                    raise TimeoutError("no coordinator leads this run: etcd names none or "
                                       "cannot be reached") from wrong
                if out_of_time:
                    raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"not_leader: {wrong}", "not_leader") from wrong
                await self._find_leader(wrong.leader, failed=True)
                await asyncio.sleep(random.uniform(*_REDIRECT_S))
            except grpc.aio.AioRpcError as exc:
                refused = Refused.of(exc)
                not_leader = refused.reason in _GO_ELSEWHERE
                if not not_leader and exc.code() not in _TRANSIENT:
                    raise refused from exc
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    await self._refuse_on_tls_mismatch(exc)
                if failing_for() >= self.retry.give_up_after_s:
                    if not_leader:
                        raise refused from exc
                    raise
                leader = refused.facts.get(metadata.LEADER, "") if not_leader else ""
                if leader:
                    if self.replicas.failed_within(leader, loop.time(),
                                                   _HEARTBEAT_DEADLINE_S):
                        # Sent back to a replica that just failed: its lease has yet to
                        # expire. Ask this one again; it may be the next leader.
                        await asyncio.sleep(_FAILOVER_BACKOFF_S)
                        continue
                    await self._find_leader(leader, failed=False)
                    await asyncio.sleep(random.uniform(*_REDIRECT_S))
                    continue
                # Unreachable, or a standby that knows no leader (a campaign under
                # way, or none to come): go round the replicas, then back off.
                tried += 1
                if not not_leader:
                    self.replicas.failed(self.address, loop.time())
                if self.replicas.several:
                    await self._find_leader("", failed=not not_leader)
                if tried < max(len(self.replicas.addresses), 1):
                    await asyncio.sleep(random.uniform(*_REDIRECT_S))
                else:
                    tried = 0
                    delay = next(delays)
                    if (not_leader or self.replicas.several) and failing_for() < FAILOVER_WINDOW_S:
                        # A failover may be under way: look again soon.
                        delay = min(delay, _FAILOVER_BACKOFF_S)
                    await asyncio.sleep(delay)
