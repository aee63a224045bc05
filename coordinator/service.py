"""The gRPC shell: translates `Synchronizer`, `Replication` and `Admin` RPCs to the engine.

It authenticates (per-learner bearer tokens in the `authorization`
metadata), turns protobuf into engine calls and back (`Admin.Status` it
reads from the engine's policy, store and metrics: `status_of`), and maps
every `Rejected` to a gRPC status here, in one table. Every refusal carries its
reason code in the `ftsync-reason` trailing metadata, and the facts a client
acts on beside it (a standby names the leader in `ftsync-leader`), so that
learners never parse the message. A call to another version of the contract
(another protobuf package) is answered by `OtherVersions`, naming both
versions. No policy lives here.

A push is traced as an `ftsync.admit` span whose parent is the learner's push
span, named by the W3C `traceparent` in the call's metadata; a pull names the
round span that committed the version it serves (`ftsync-commit-trace`).
"""

from __future__ import annotations

import asyncio
import hmac
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
import numpy as np
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from coordinator.engine import Engine, FragmentView, LearnerStats
from coordinator.errors import Cut, Reason, Rejected
from coordinator.references import AdvanceFailed, References, Served
from coordinator.replication import read_replica
from coordinator.store import Published
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc
from protos import metadata, telemetry
from protos.bulk import Grant, Handoff, send_frames
from protos.codec import (
    Codec,
    CodecError,
    chunk_message,
    codec_for,
    codec_named,
    iter_chunk_messages,
)
from protos.tls import ADMIN_NAME, REPLICA_NAME, peer_names

T = TypeVar("T")
Context = grpc.aio.ServicerContext[Any, Any]

# Longest a pull may wait for a newer version before answering not_modified.
MAX_PULL_WAIT_S = 60.0
# The contract's version, as the protobuf package every service path starts with.
PACKAGE = pb.DESCRIPTOR.package

# One rule for the codes: INVALID_ARGUMENT when the request is wrong whatever the
# run's state (sending it again never helps), FAILED_PRECONDITION when it is refused
# because of the state it met (another version, a layout hash that another run or
# the first learner set, this replica's role), NOT_FOUND and ALREADY_EXISTS for a
# learner or contribution id the coordinator lacks or already holds. A fragment
# index or size that the request's own layout contradicts is INVALID_ARGUMENT.
STATUS_CODES: dict[Reason, grpc.StatusCode] = {
    Reason.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Reason.UNKNOWN_LEARNER: grpc.StatusCode.NOT_FOUND,
    Reason.UNKNOWN_FRAGMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.LAYOUT_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.NOT_INITIALIZED: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.ALREADY_INITIALIZED: grpc.StatusCode.ALREADY_EXISTS,
    Reason.FUTURE_VERSION: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.STALE: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.REPLAYED: grpc.StatusCode.ALREADY_EXISTS,
    Reason.BAD_COUNTS: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.BAD_SHAPE: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.BAD_ENCODING: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.NOT_FINITE: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.NORM_BOUND: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.OVERSIZE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.MALFORMED: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.NOT_LEADER: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.STALE_EPOCH: grpc.StatusCode.FAILED_PRECONDITION,
    # Retried by learners, as a call that timed out is: the push is sent again.
    Reason.IDLE: grpc.StatusCode.DEADLINE_EXCEEDED,
    # Learners go elsewhere, as for not_leader.
    Reason.DRAINING: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.NO_STANDBY: grpc.StatusCode.FAILED_PRECONDITION,
    # gRPC's own answer to a method it does not serve, with the versions named.
    Reason.VERSION_MISMATCH: grpc.StatusCode.UNIMPLEMENTED,
    # The bulk channel. A bad ticket is answered on the bulk connection itself; a
    # corrupt frame and a cut connection are retried by learners: the push is sent
    # again. So is a compressed pull cut by its reference's failed advance.
    Reason.BAD_TICKET: grpc.StatusCode.UNAUTHENTICATED,
    Reason.CORRUPT: grpc.StatusCode.DATA_LOSS,
    Reason.CUT: grpc.StatusCode.UNAVAILABLE,
}

_FP32 = codec_named("fp32")
_TRACER = trace.get_tracer(__name__)


def bearer_token(context: Context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


def role_allowed(context: Context, token: str, role: str, mutual: bool) -> bool:
    """Admin calls and replication: a client certificate issued to `role`, or the
    role's token. With neither configured they are open, except under mutual TLS,
    where a learner's certificate must not be enough."""
    names = peer_names(context)
    if names is not None and role in names:
        return True
    if token:
        return hmac.compare_digest(bearer_token(context) or "", token)
    return not mutual


class SynchronizerService(pb_grpc.SynchronizerServicer):  # type: ignore[misc]
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # What learners pulling with a codec rebuild from deltas.
        self.references = References(engine.config.limits.chunk_bytes)

    async def Join(self, request: pb.JoinRequest,
                   context: Context) -> pb.JoinResponse:
        def join() -> pb.JoinResponse:
            result = self.engine.join(request)
            config = self.engine.config
            return pb.JoinResponse(
                run_id=result.run_id, fragments=_statuses(result.fragments),
                heartbeat_interval_ms=config.heartbeat_interval_ms,
                chunk_bytes=config.limits.chunk_bytes,
                max_staleness=config.policy.max_staleness, next_seq=result.next_seq,
                epoch=self.engine.epoch, sync_every=result.sync_every)
        return await self._call("Join", request.learner_id, context, join)

    async def Heartbeat(self, request: pb.HeartbeatRequest,
                        context: Context) -> pb.HeartbeatResponse:
        def heartbeat() -> pb.HeartbeatResponse:
            views, sync_every = self.engine.heartbeat(request.learner_id, request.local_step,
                                                      request.backlog)
            run_id = self.engine.run.run_id if self.engine.run else ""
            return pb.HeartbeatResponse(run_id=run_id, fragments=_statuses(views),
                                        epoch=self.engine.epoch, sync_every=sync_every)
        return await self._call("Heartbeat", request.learner_id, context, heartbeat)

    async def Leave(self, request: pb.LeaveRequest,
                    context: Context) -> pb.LeaveResponse:
        def leave() -> pb.LeaveResponse:
            self.engine.leave(request.learner_id, request.reason)
            return pb.LeaveResponse()
        return await self._call("Leave", request.learner_id, context, leave)

    async def PushFragment(self, request_iterator: AsyncIterator[pb.PushMessage],
                           context: Context) -> pb.PushResponse:
        with _TRACER.start_as_current_span(
                "ftsync.admit", context=telemetry.extract(context.invocation_metadata()),
                kind=SpanKind.SERVER, record_exception=False, set_status_on_exception=False):
            self.engine.metrics.push_streams.add(1)
            try:
                return await self._push_fragment(request_iterator, context)
            finally:
                self.engine.metrics.push_streams.add(-1)

    async def _push_fragment(self, request_iterator: AsyncIterator[pb.PushMessage],
                             context: Context) -> pb.PushResponse:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("kind") != "header":
            if not self.engine.token_accepted(bearer_token(context), peer_names(context)):
                # Refused at once: a caller without a learner's token neither waits
                # here nor, by cancelling, counts as a learner's push cut short.
                await self._abort(context, "PushFragment", "", Rejected(
                    Reason.UNAUTHENTICATED, "bad or missing bearer token (and the push "
                    "stream sent no header naming its learner)"))
            if first is None:
                await self.engine.wait_out_cut(None)
            await self._abort(context, "PushFragment", "", Rejected(
                Reason.MALFORMED, "a push stream starts with a header message"))
        assert first is not None
        header = first.header
        trace.get_current_span().set_attributes({
            "ftsync.learner": header.learner_id, "ftsync.fragment": header.fragment,
            "ftsync.seq": header.seq, "ftsync.base_version": header.base_version,
            "ftsync.init": header.init})

        announce = announcer(context)

        async def push() -> pb.PushResponse:
            if header.bulk and self.engine.bulk is None:
                await announce(b"", 0)  # no bulk port here: the chunks come on the call
            result = await self.engine.push(header, request_iterator,
                                            announce if header.bulk else None)
            return pb.PushResponse(seq=result.seq, target_version=result.target_version,
                                   weight=result.weight, staleness=result.staleness,
                                   epoch=self.engine.epoch)
        context_fields = {"fragment": header.fragment, "seq": header.seq,
                          "base_version": header.base_version}
        return await self._call_async("PushFragment", header.learner_id, context, push,
                                      **context_fields)

    async def PullFragment(self, request: pb.PullRequest,
                           context: Context) -> AsyncIterator[pb.PullMessage]:
        wait_s = min(request.wait_ms / 1000.0, MAX_PULL_WAIT_S)
        try:
            self.engine.authenticate(request.learner_id, bearer_token(context),
                                     peer_names(context))
            try:
                codec = codec_for(request.codec)
            except CodecError as exc:
                raise Rejected(Reason.BAD_ENCODING, str(exc)) from exc
            published = await self.engine.pull(request.learner_id, request.fragment,
                                               request.have_version, wait_s)
        except Rejected as rejected:
            await self._abort(context, "PullFragment", request.learner_id, rejected)
        if published is None:
            yield pb.PullMessage(header=pb.PullHeader(
                fragment=request.fragment, version=request.have_version, not_modified=True,
                epoch=self.engine.epoch))
            return
        served: Served | None = None
        if codec is not _FP32:
            # The newest version when it is served: a pull that waits for an advance
            # under way gets what was published meanwhile.
            pulled = published
            served = await self.references.serve(
                request.fragment, codec, request.have_reference,
                lambda: self.engine.newest(request.fragment) or pulled)
            published = served.published
        # The trace of the version served, which may be newer than the one waited for.
        if published.trace is not None:
            await context.send_initial_metadata(
                ((telemetry.COMMIT_TRACE, telemetry.traceparent(published.trace)),))
        values, fields = published.params, {}
        if served is not None:
            if served.values is None:
                try:
                    async for message in self._stream_delta(request.learner_id,
                                                            request.fragment, published, codec,
                                                            served):
                        yield message
                except AdvanceFailed as exc:
                    # Cut, not refused: the learner pulls again, and the chain, which
                    # the failure dropped, starts again from the values.
                    await self._abort(context, "PullFragment", request.learner_id,
                                      Rejected(Reason.CUT, str(exc)))
                return
            values, fields = served.values, {"reference": served.reference}
        stream = (self._send_bulk(request.learner_id, request.fragment, published, values,
                                  fields)
                  if request.bulk and self.engine.bulk is not None else
                  self._stream(request.learner_id, request.fragment, published, values, fields))
        async for message in stream:
            yield message

    async def FetchSnapshot(self, request: pb.SnapshotRequest,
                            context: Context) -> AsyncIterator[pb.PullMessage]:
        try:
            self.engine.authenticate(request.learner_id, bearer_token(context),
                                     peer_names(context))
            snapshot = self.engine.snapshot(request.learner_id)
        except Rejected as rejected:
            await self._abort(context, "FetchSnapshot", request.learner_id, rejected)
        for fragment, published in enumerate(snapshot):
            if published is None:
                yield pb.PullMessage(header=pb.PullHeader(fragment=fragment, version=-1,
                                                          epoch=self.engine.epoch))
                continue
            async for message in self._stream(request.learner_id, fragment, published,
                                              published.params, {}):
                yield message

    def _pull_header(self, learner_id: str, fragment: int, published: Published,
                     **fields: Any) -> pb.PullMessage:
        return pb.PullMessage(header=pb.PullHeader(
            fragment=fragment, version=published.version, numel=published.params.size,
            merged_seq=published.watermarks.get(learner_id, 0), epoch=self.engine.epoch,
            commit_id=published.commit_id, **fields))

    async def _stream(self, learner_id: str, fragment: int, published: Published,
                      values: np.ndarray, fields: dict[str, Any],
                      ) -> AsyncIterator[pb.PullMessage]:
        """`values` (the version's own, or a codec's reference at it) as fp32 chunks."""
        yield self._pull_header(learner_id, fragment, published, **fields)
        for message in iter_chunk_messages(values, _FP32, pb.PullMessage,
                                           self.engine.config.limits.chunk_bytes):
            # 4 bytes per fp32 element: reading len(chunk.data) would copy the chunk.
            self.engine.count_sent(4 * message.chunk.count)
            yield message
        self.engine.metrics.transfers.add(1, {"direction": "pull", "transport": "grpc"})

    async def _stream_delta(self, learner_id: str, fragment: int, published: Published,
                            codec: Codec, served: Served) -> AsyncIterator[pb.PullMessage]:
        """The changes to the learner's reference, in order, as the chunks encoded at
        the chain's advances, each sent as soon as it is encoded: on the call, since
        compressed they are a fraction of the values."""
        yield self._pull_header(learner_id, fragment, published, codec=codec.wire,
                                delta=True, deltas=len(served.deltas),
                                reference=served.reference)
        for step in served.deltas:
            index = 0
            while (encoded := await step.chunk(index)) is not None:
                self.engine.count_sent(len(encoded[3]))
                yield chunk_message(pb.PullMessage, *encoded)
                index += 1
        self.engine.metrics.transfers.add(1, {"direction": "pull", "transport": "grpc"})

    async def _send_bulk(self, learner_id: str, fragment: int, published: Published,
                         values: np.ndarray, fields: dict[str, Any],
                         ) -> AsyncIterator[pb.PullMessage]:
        """A header with a ticket, then `values` (the committed buffer itself, or a
        codec's reference at it) as frames on the connection the ticket opens. A
        learner that never comes, or goes away, gets nothing more: its pull fails and it
        pulls again."""
        bulk = self.engine.bulk
        assert bulk is not None
        handoff = Handoff(Grant(learner_id, fragment, published.version))
        ticket = bulk.tickets.issue(handoff)
        try:
            yield self._pull_header(learner_id, fragment, published, ticket=ticket,
                                    bulk_port=bulk.port, **fields)
            try:
                async with asyncio.timeout(bulk.tickets.ttl_s):
                    conn = await asyncio.shield(handoff.connection)
            except TimeoutError:
                return
            reusable = False
            try:
                sent = await bulk.run(conn, lambda: send_frames(conn, values))
                reusable = True
            except (OSError, ConnectionError):
                return
            finally:
                handoff.release(reusable)
            self.engine.count_sent(sent)
            self.engine.metrics.transfers.add(1, {"direction": "pull", "transport": "bulk"})
        finally:
            bulk.tickets.withdraw(ticket)
            handoff.close()

    async def _call(self, rpc: str, learner_id: str, context: Context,
                    handler: Callable[[], T]) -> T:
        async def run() -> T:
            return handler()
        return await self._call_async(rpc, learner_id, context, run)

    async def _call_async(self, rpc: str, learner_id: str, context: Context,
                          handler: Callable[[], Awaitable[T]], **event_fields: object) -> T:
        try:
            self.engine.authenticate(learner_id, bearer_token(context), peer_names(context))
            return await handler()
        except Rejected as rejected:
            await self._abort(context, rpc, learner_id, rejected, **event_fields)

    async def _abort(self, context: Context, rpc: str, learner_id: str,
                     rejected: Rejected, **event_fields: object) -> NoReturn:
        if not isinstance(rejected, Cut):  # a cut is counted where it was cut
            self.engine.record_rejection(rpc, learner_id, rejected, **event_fields)
        span = trace.get_current_span()  # the admit span of a push; none otherwise
        span.set_attribute("ftsync.reason", rejected.reason.value)
        span.set_status(Status(StatusCode.ERROR, rejected.message))
        await abort(context, rejected)


async def abort(context: Context, rejected: Rejected) -> NoReturn:
    """End the RPC with the reason's status code, its code and facts in trailing metadata."""
    context.set_trailing_metadata(((metadata.REASON, rejected.reason.value),
                                   *rejected.facts))
    await context.abort(STATUS_CODES.get(rejected.reason, grpc.StatusCode.INVALID_ARGUMENT),
                        f"{rejected.reason.value}: {rejected.message}")
    raise AssertionError("context.abort returned")


def announcer(context: Context) -> Callable[[bytes, int], Awaitable[None]]:
    """Tells a call's client where its bytes go: the bulk port and the ticket to open
    it with, in the initial metadata; port 0 (no ticket): as chunks on the call."""
    async def announce(ticket: bytes, port: int) -> None:
        sent = [(metadata.BULK_PORT, str(port))]
        if ticket:
            sent.append((metadata.BULK_TICKET, ticket.hex()))
        await context.send_initial_metadata(tuple(sent))
    return announce


class ReplicationService(pb_grpc.ReplicationServicer):  # type: ignore[misc]
    """A standby's end of replication: each stream is one committed version."""

    def __init__(self, engine: Engine, token: str) -> None:
        self.engine = engine
        self.token = token

    async def Replicate(self, request_iterator: AsyncIterator[pb.ReplicaMessage],
                        context: Context) -> pb.ReplicaAck:
        try:
            if not role_allowed(context, self.token, REPLICA_NAME,
                                bool(self.engine.config.tls.ca)):
                raise Rejected(Reason.UNAUTHENTICATED,
                               f"replication needs the replicas' shared token (ha.token) "
                               f"or a client certificate issued to {REPLICA_NAME!r}")
            epoch, run, record, transport = await read_replica(
                request_iterator, self.engine.check_room, self.engine.bulk, announcer(context),
                self.engine.config.limits.push_idle_s)
            known = await self.engine.apply_replica(epoch, run, record)
        except Rejected as rejected:
            self.engine.record_rejection("Replicate", "", rejected)
            await abort(context, rejected)
        self.engine.metrics.transfers.add(1, {"direction": "replicate",
                                              "transport": transport})
        return pb.ReplicaAck(fragment=record.fragment, version=record.version, epoch=known)


class AdminService(pb_grpc.AdminServicer):  # type: ignore[misc]
    """Operators' calls: `Status`, and `Drain` through the daemon's `drain`."""

    def __init__(self, engine: Engine, token: str,
                 drain: Callable[[float], Awaitable[pb.DrainResponse]]) -> None:
        self.engine = engine
        self.token = token
        self.drain = drain

    async def Status(self, request: pb.StatusRequest,
                     context: Context) -> pb.StatusResponse:
        await self._authorize("Status", context)
        return status_of(self.engine)

    async def Drain(self, request: pb.DrainRequest, context: Context) -> pb.DrainResponse:
        await self._authorize("Drain", context)
        try:
            return await self.drain(request.timeout_s)
        except Rejected as rejected:
            self.engine.record_rejection("Drain", "", rejected)
            await abort(context, rejected)

    async def _authorize(self, rpc: str, context: Context) -> None:
        if not role_allowed(context, self.token, ADMIN_NAME, bool(self.engine.config.tls.ca)):
            command = rpc.lower()
            rejected = Rejected(Reason.UNAUTHENTICATED,
                                f"{rpc} needs the admin token (auth.admin_token; "
                                f"ftsync-coordinator {command} --token) or a client "
                                f"certificate issued to {ADMIN_NAME!r}")
            self.engine.record_rejection(rpc, "", rejected)
            await abort(context, rejected)


def status_of(engine: Engine) -> pb.StatusResponse:
    """What `Admin.Status` answers, read where each fact is kept: the daemon-wide and
    per-learner counts from the metrics' instruments, liveness, steps and rounds from
    the policy, versions and commits from the fragment store."""
    now = engine.clock()
    counts = engine.metrics.counts()
    run = engine.run
    leading = engine.role == "leader"
    response = pb.StatusResponse(
        run_id=run.run_id if run else "", uptime_s=now - engine.started_at,
        min_quorum=quorum if isinstance(quorum := engine.config.policy.min_quorum, int) else 0,
        bytes_in=counts.total("ftsync_bytes_in"), bytes_out=counts.total("ftsync_bytes_out"),
        layout_hash=run.layout_hash if run else "", role=engine.role,
        epoch=engine.epoch if leading else engine.known_epoch, leader=engine.leader_address,
        replica_id=engine.leadership.replica_id, draining=engine.draining)
    response.rejections.update(counts.by("ftsync_rejections", "reason"))
    policy, store = engine.policy, engine.store
    if policy is None or store is None:
        return response
    bytes_in = counts.by("ftsync_bytes_in", "learner")
    for learner_id in sorted(policy.known_learners()):
        stats = engine.learners.get(learner_id, LearnerStats())
        response.learners.append(pb.LearnerStatus(
            learner_id=learner_id, live=policy.is_live(learner_id, now),
            heartbeat_age_s=now - policy.last_seen(learner_id),
            step_time_s=policy.step_time(learner_id) or 0.0,
            local_step=policy.local_step(learner_id), contributions=stats.contributions,
            rejections=stats.rejections, bytes_in=bytes_in[learner_id],
            backlog=stats.backlog, host=stats.host))
    for p, published in enumerate(store.snapshot()):
        opened_at, deadline = policy.round_timing(p)
        commits, merged = store.stats(p)
        response.fragments.append(pb.FragmentInfo(
            fragment=p, version=published.version if published else -1,
            numel=store.numel(p), round_learners=sorted(policy.round_learners(p)),
            round_age_s=now - opened_at if opened_at is not None else 0.0,
            grace_left_s=deadline - now if deadline is not None else -1.0,
            commits=commits, merged_contributions=merged,
            last_commit_age_s=now - published.committed_at if published else -1.0))
    return response


def _statuses(views: list[FragmentView]) -> list[pb.FragmentStatus]:
    return [pb.FragmentStatus(fragment=v.fragment, version=v.version, merged_seq=v.merged_seq,
                              commit_id=v.commit_id) for v in views]


# The packages of every version of the contract, and the unversioned name before them.
_CONTRACT = re.compile(r"ftsync(\.v\d+)?")


class OtherVersions(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """Answers a call to another version of the contract (`/ftsync.v2.Synchronizer/Join`,
    or an unversioned `/ftsync.Synchronizer/Join`) with UNIMPLEMENTED and a message that
    names both versions, where gRPC alone would say only that the method is unknown.
    Every other call, this version's included, is left to the other handlers."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def service(self, handler_call_details: grpc.HandlerCallDetails
                ) -> grpc.RpcMethodHandler[bytes, bytes] | None:
        method: str = handler_call_details.method
        package = method.lstrip("/").partition("/")[0].rpartition(".")[0]
        if package == PACKAGE or not _CONTRACT.fullmatch(package):
            return None
        rejected = Rejected(Reason.VERSION_MISMATCH,
                            f"this coordinator speaks {PACKAGE}, the call {method} is "
                            f"{package}: build the learner from the {PACKAGE} ftsync.proto "
                            f"(docs/protocol.md, Versions)")

        async def refuse(requests: AsyncIterator[bytes], context: Context) -> NoReturn:
            self.engine.record_rejection(method, "", rejected)
            await abort(context, rejected)

        # Streaming both ways whatever the method: the answer is the same for any shape
        # of call, and nothing of the request is read.
        return grpc.stream_stream_rpc_method_handler(refuse)
