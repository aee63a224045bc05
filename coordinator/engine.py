"""The synchronizer's engine: policy core + fragment store + clock + timers.

The gRPC servicer (`coordinator.service`) is a thin translation layer over
this; the engine validates every request, asks the pure policy what to do,
does the numeric and durable work through the fragment store, counts
everything in metrics and the event log, and closes rounds when the policy
says they are due. Every refusal is a `Rejected` raised before any state
changes.

Its leadership (`coordinator.leadership`) comes in its constructor. With
`AlwaysLeader` (embedded) the engine always leads. As one replica of a highly
available synchronizer (`coordinator.ha.Replica` is its leadership and drives
it) it is a leader or a standby: a standby refuses learners with `NotLeader`
naming the leader the election last saw (`leader_seen`) and writes the
versions the leader replicates to it; `promote` makes it serve from its
newest replicated state, `demote` drops everything it held as leader. A
leader publishes a version only after the leadership's `replicate` returned
and while it still `holds()`, and stamps every commit with its epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from coordinator.config import CoordinatorConfig
from coordinator.durability import FragmentRecord, RunRecord, StateDir, StateError
from coordinator.errors import Cut, NotLeader, Reason, Rejected
from coordinator.leadership import AlwaysLeader, Leadership
from coordinator.membership import Membership
from coordinator.merge import first_non_finite
from coordinator.metrics import Metrics
from coordinator.policy import Offer, Policy, RoundClose
from coordinator.store import FragmentStore, Guard, Published
from protos import ftsync_pb2 as pb
from protos.bulk import BulkCut, BulkServer, Grant
from protos.codec import Codec, CodecError, codec_for
from protos.contribution import ContributionId
from protos.discovery import LeaderRecord
from protos.events import EventLog
from protos.stream import ChunkReader, StreamEnded, StreamError

# How often the round timer looks at liveness when no deadline is nearer.
_TICK_S = 0.05
# fp32 parameters, momentum and one open round's sum per parameter.
_BYTES_PER_PARAM = 12
# How long a push stream that ended early waits for gRPC to cancel its call
# (cut short) before it is refused as incomplete (the learner sent too little).
_CUT_NOTICE_S = 0.5


# Tells a learner pushing on the bulk channel its ticket and the bulk port.
Announce = Callable[[bytes, int], Awaitable[None]]


def physical_memory() -> int:
    """Bytes of RAM on this machine (what a run's arrays must fit in)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

Role = Literal["leader", "standby"]


@dataclass
class LearnerStats:
    """What Status reports of a learner that neither the policy nor the metrics keep."""

    host: str = ""
    contributions: int = 0
    rejections: int = 0
    backlog: int = 0


@dataclass(frozen=True)
class FragmentView:
    """One fragment as a learner sees it: published version and its watermark."""

    fragment: int
    version: int
    merged_seq: int
    commit_id: int


@dataclass(frozen=True)
class JoinResult:
    run_id: str
    fragments: list[FragmentView]
    next_seq: int
    # The H assigned to a learner that asked for one (0: it keeps its own).
    sync_every: int = 0


@dataclass(frozen=True)
class PushResult:
    seq: int
    target_version: int
    weight: float
    staleness: int


@dataclass(frozen=True)
class Drained:
    """What draining did: versions committed meanwhile, and the fragments whose
    open round was still short of quorum when the time ran out."""

    role: Role
    committed: int
    left_open: list[int]


class Engine:
    """Everything the daemon does, minus gRPC."""

    def __init__(self, config: CoordinatorConfig, leadership: Leadership | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 membership: Membership | None = None,
                 bulk: BulkServer | None = None) -> None:
        """`leadership` (default `AlwaysLeader`: embedded) says whether and how this
        replica may lead; `membership` (default: the policy's heartbeat table) who is
        live."""
        self.config = config
        self.leadership = leadership or AlwaysLeader()
        # The bulk port pushes and pulls asked with `bulk` move their bytes on; None:
        # every transfer goes as gRPC chunks.
        self.bulk = bulk
        self.clock = clock
        self.started_at = clock()
        self.state = StateDir(config.state_dir, fsync=config.fsync)
        self.tokens = config.tokens()
        self.metrics = Metrics(config.metrics)
        self.events = EventLog(config.event_log)
        self.learners: dict[str, LearnerStats] = {}
        self.run: RunRecord | None = None
        self.store: FragmentStore | None = None
        self.policy: Policy | None = None
        self._wake = asyncio.Event()
        self._timer: asyncio.Task[None] | None = None
        # Set, with `failure` saying why, when rounds can no longer be committed.
        self.failed = asyncio.Event()
        self.failure = ""
        # Liveness of learners; None: the policy's own heartbeat table.
        self.membership = membership
        # An elected replica starts as a standby; embedded, it always leads.
        self.role: Role = "standby" if self.leadership.elected else "leader"
        self.epoch = 0  # the epoch this replica leads in (0 embedded)
        self.known_epoch = 0  # the newest epoch this replica has heard of
        # Where learners are sent: this replica's own address while it leads.
        self.leader_address = ""
        # Standby: newest replicated (sender epoch, version) per fragment.
        self.replicated: dict[int, tuple[int, int]] = {}
        # Set by `drain`: this replica takes no new rounds and never leads again, unless
        # the drain is abandoned (`undrain`).
        self.draining = False
        # Held while a seq reservation is written (`_reserve_seq`).
        self._reserving = asyncio.Lock()

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        """Resume from the state directory, if it holds a run, and start the round timer.

        A replica of a highly available run starts as a standby and resumes
        only once it is elected (`promote`)."""
        run = self.state.load_run()
        pinned = self.config.layout_hash
        if run is not None and pinned and run.layout_hash != pinned:
            raise StateError(f"it holds run {run.run_id} of layout {run.layout_hash!r}, but "
                             f"layout_hash pins {pinned!r}; use another state directory or "
                             f"unpin the layout")
        if run is not None and self.role == "leader":
            versions = self._adopt(run)
            self.events.emit("resume", run_id=run.run_id, versions=versions)
        else:
            self.run = run
        self._timer = asyncio.create_task(self._round_timer(), name="round-timer")

    # -- leadership -------------------------------------------------------------

    @property
    def serving(self) -> bool:
        """Whether this replica can commit: it leads (so it has resumed its run's
        state), its lease holds, and it is neither draining nor stopped by a failure."""
        return (self.role == "leader" and self.leadership.holds() and not self.draining
                and not self.failed.is_set())

    def require_leader(self) -> None:
        """Raise `NotLeader` unless this replica leads and its lease still holds."""
        if self.role != "leader":
            raise NotLeader(self.leader_address, self.known_epoch)
        if not self.leadership.holds():
            raise NotLeader("", self.epoch)

    def leader_seen(self, leader: LeaderRecord | None) -> None:
        """The election names the leader (None: none holds the key now): a standby
        sends learners there, and every replica learns the newest epoch."""
        if leader is not None:
            self.known_epoch = max(self.known_epoch, leader.epoch)
        if self.role != "leader":
            self.leader_address = leader.address if leader is not None else ""

    async def promote(self, epoch: int, run: RunRecord | None) -> None:
        """Lead from the newest state this replica holds (its state directory, or
        `run` from etcd when it never saw one)."""
        self.known_epoch = max(self.known_epoch, epoch)
        self.replicated.clear()
        run = self.state.load_run() or run
        versions: dict[int, int] = {}
        self.run, self.store, self.policy = None, None, None
        if run is not None:
            self.state.save_run(run)
            # Reading every fragment back takes a while for a large model: not on the
            # loop, whose lease renewals must go on.
            versions = await asyncio.to_thread(self._adopt, run)
        self.role, self.epoch = "leader", epoch
        self.leader_address = self.leadership.address
        self.events.emit("elected", replica=self.leadership.replica_id, epoch=epoch,
                         run_id=run.run_id if run else "", versions=versions)
        self._wake.set()

    def demote(self, reason: str) -> None:
        """Stop leading: forget open rounds and learners; standbys get resynced."""
        if self.role != "leader":
            return
        self.role = "standby"
        self.events.emit("step_down", replica=self.leadership.replica_id, epoch=self.epoch,
                         reason=reason)
        self.policy, self.store = None, None
        self.leader_address = ""
        self.leadership.resign(reason)

    async def _publish_guard(self, record: FragmentRecord) -> None:
        """Replicate a durable version, then make sure this replica may still publish it.

        Nothing awaits between this check and the store's publish."""
        epoch = self.epoch
        if not self.leadership.holds():
            self.demote("lease not renewed in time")
            raise NotLeader("", epoch)
        try:
            await self.leadership.replicate(record)
        except NotLeader as exc:
            self.demote(f"cannot replicate version {record.version} of fragment "
                        f"{record.fragment}: {exc.message}")
            raise
        if self.role != "leader" or self.epoch != epoch:
            raise NotLeader(self.leader_address, self.known_epoch)
        if not self.leadership.holds():
            self.demote("lease not renewed in time")
            raise NotLeader("", epoch)

    async def apply_replica(self, epoch: int, run: RunRecord, record: FragmentRecord) -> int:
        """Write a version the leader of `epoch` streamed here; returns the newest
        epoch this replica knows. Older epochs are refused."""
        if epoch < self.known_epoch or (self.role == "leader" and epoch <= self.epoch):
            raise Rejected(Reason.STALE_EPOCH,
                           f"replication from epoch {epoch}, but this replica knows epoch "
                           f"{max(self.known_epoch, self.epoch)}")
        if self.role == "leader":
            self.demote(f"a leader of epoch {epoch} replicates to this one")
        self.known_epoch = epoch
        if self.run != run:
            if self.run is not None and self.run.run_id != run.run_id:
                self.replicated.clear()
            self.state.save_run(run)
            self.run = run
        last = self.replicated.get(record.fragment)
        if last is not None and last[0] == epoch and last[1] >= record.version:
            return self.known_epoch  # already here (a catch-up overlapping the stream)
        await asyncio.to_thread(self.state.save_fragment, record)
        # The leader may have changed while writing: only the newest epoch counts.
        if epoch >= self.known_epoch:
            self.replicated[record.fragment] = (epoch, record.version)
        self.events.emit("replicated", fragment=record.fragment, version=record.version,
                         epoch=epoch, commit_epoch=record.epoch)
        return self.known_epoch

    async def drain(self, timeout_s: float) -> Drained:
        """Take no new rounds, then wait (up to `timeout_s`) until every open round
        has reached quorum and committed. An embedded coordinator then exits; a
        replica hands its leadership over first (`coordinator.ha`)."""
        role = self.role
        if not self.draining:
            self.draining = True
            self.events.emit("drain", replica=self.leadership.replica_id, role=role)
        policy, store = self.policy, self.store
        if policy is None or store is None or role != "leader":
            return Drained(role, 0, [])
        policy.drain()
        commits = sum(store.stats(p)[0] for p in range(len(store.slots)))
        deadline = self.clock() + timeout_s
        self._wake.set()
        while (policy is self.policy and policy.open_rounds() and self.clock() < deadline
               and not self.failed.is_set()):
            await asyncio.sleep(_TICK_S)
        for p in range(len(store.slots)):
            async with store.lock(p):
                pass  # a commit under way ends first
        committed = sum(store.stats(p)[0] for p in range(len(store.slots))) - commits
        left_open = policy.open_rounds() if policy is self.policy else []
        self.events.emit("drained", replica=self.leadership.replica_id, committed=committed,
                         left_open=left_open)
        return Drained(role, committed, left_open)

    def undrain(self, reason: str) -> None:
        """Abandon a drain (its leader found no standby to hand over to): take rounds
        again."""
        if not self.draining:
            return
        self.draining = False
        if self.policy is not None:
            self.policy.drain(False)
        self.events.emit("drain_abandoned", replica=self.leadership.replica_id, reason=reason)

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
        self.metrics.close()
        self.events.close()

    # -- membership -----------------------------------------------------------

    def authenticate(self, learner_id: str, token: str | None,
                     names: frozenset[str] | None = None) -> None:
        """Check the caller may act as `learner_id`: with a verified client
        certificate (`names`, its CN and SANs) only as a name it was issued to;
        without one, by the learner's bearer token when tokens are configured."""
        if not learner_id:
            raise Rejected(Reason.MALFORMED, "learner_id is empty")
        if names is not None:
            if learner_id not in names:
                raise Rejected(Reason.UNAUTHENTICATED,
                               f"the client certificate is issued to "
                               f"{', '.join(sorted(names))}, not to learner {learner_id!r}")
            return
        if not self.tokens:
            return
        expected = self.tokens.get(learner_id)
        if expected is None:
            raise Rejected(Reason.UNAUTHENTICATED,
                           f"learner {learner_id!r} has no token configured on this coordinator")
        if not hmac.compare_digest(token or "", expected):
            raise Rejected(Reason.UNAUTHENTICATED,
                           f"bad or missing bearer token for learner {learner_id!r}")

    def token_accepted(self, token: str | None, names: frozenset[str] | None = None) -> bool:
        """Whether the caller is some learner: all a push stream that sent no header
        (so no learner id) can be checked against. A verified certificate is one."""
        matched = not self.tokens or names is not None
        for expected in self.tokens.values():  # all of them: the time says not which
            matched |= hmac.compare_digest(token or "", expected)
        return matched

    def join(self, request: pb.JoinRequest) -> JoinResult:
        self.require_leader()
        layout = request.layout
        numels = tuple(int(f.numel) for f in layout.fragments)
        if [f.fragment for f in layout.fragments] != list(range(len(numels))) or not numels:
            raise Rejected(Reason.MALFORMED,
                           "layout must list fragments 0..P-1 in order, at least one")
        if any(n == 0 for n in numels):
            raise Rejected(Reason.MALFORMED, "layout has an empty fragment")
        if self.run is None:
            self.check_room(sum(numels))
            pinned = self.config.layout_hash
            if pinned and pinned != layout.hash:
                raise Rejected(Reason.LAYOUT_MISMATCH,
                               f"layout hash {layout.hash!r} differs from the pinned "
                               f"{pinned!r}; learners must use the run's model and "
                               f"fragment count")
            run = RunRecord(run_id=uuid.uuid4().hex[:12], layout_hash=layout.hash, numels=numels)
            self.state.save_run(run)
            self._adopt(run)
            self.leadership.run_created(run)
        assert self.run is not None and self.policy is not None
        if layout.hash != self.run.layout_hash:
            raise Rejected(Reason.LAYOUT_MISMATCH,
                           f"layout hash {layout.hash!r} ({len(numels)} fragments) differs "
                           f"from the run's {self.run.layout_hash!r} "
                           f"({len(self.run.numels)} fragments); learners must use the "
                           f"same model and fragment count")
        if numels != self.run.numels:
            diffs = [f"fragment {p} has {mine} elements, the run's has {theirs}"
                     for p, (mine, theirs) in enumerate(zip(numels, self.run.numels,
                                                            strict=False)) if mine != theirs]
            counts = f"it has {len(numels)} fragments, the run has {len(self.run.numels)} fragments"
            raise Rejected(Reason.LAYOUT_MISMATCH,
                           f"layout {layout.hash!r} does not match the run's: "
                           f"{'; '.join(diffs) or counts}")
        next_seq = self.policy.join(request.learner_id, self.clock(),
                                    request.overlap_steps or None, request.auto_sync_every)
        stats = self.learners.setdefault(request.learner_id, LearnerStats())
        stats.host = request.host
        self.events.emit("join", learner=request.learner_id, host=request.host,
                         pid=request.pid, next_seq=next_seq)
        return JoinResult(self.run.run_id, self.views(request.learner_id), next_seq,
                          self.assign_sync_every(request.learner_id))

    def check_room(self, params: int) -> None:
        """Refuse a run this daemon could not hold, before allocating any of it."""
        limit = self.config.limits.max_params
        where = "limits.max_params"
        if not limit:
            memory = physical_memory()
            limit = memory // _BYTES_PER_PARAM
            where = f"{memory / 1e9:.1f} GB of memory at {_BYTES_PER_PARAM} bytes each"
        if params > limit:
            raise Rejected(Reason.OVERSIZE,
                           f"the layout has {params:,} parameters; this coordinator takes at "
                           f"most {limit:,} ({where})")

    def heartbeat(self, learner_id: str, local_step: int,
                  backlog: int) -> tuple[list[FragmentView], int]:
        """The learner's views and the H assigned to it (0: it keeps its own)."""
        self.require_leader()
        self._policy().heartbeat(learner_id, self.clock(), local_step)
        self.learners.setdefault(learner_id, LearnerStats()).backlog = backlog
        self._wake.set()
        return self.views(learner_id), self.assign_sync_every(learner_id)

    def assign_sync_every(self, learner_id: str) -> int:
        """The H for a learner that takes it from here (0 for one that does not);
        a new one goes to the event log and the ftsync_sync_every gauge."""
        choice = self._policy().assign_sync_every(learner_id, self.clock())
        if choice is None:
            return 0
        if choice.sync_every != choice.previous:
            config = self.config.policy
            self.metrics.sync_every.set(choice.sync_every, {"learner": learner_id})
            self.events.emit("sync_every", learner=learner_id, sync_every=choice.sync_every,
                             previous=choice.previous, step_s=choice.step_s,
                             period_s=choice.period_s, h_min=config.h_min,
                             h_max=config.h_max)
        return choice.sync_every

    def leave(self, learner_id: str, reason: str) -> None:
        self.require_leader()
        self._policy().leave(learner_id)
        self.events.emit("leave", learner=learner_id, reason=reason)
        self._wake.set()

    def views(self, learner_id: str) -> list[FragmentView]:
        """Published (durable) versions and this learner's merged-seq watermarks."""
        store = self._store()
        views = []
        for p, published in enumerate(store.snapshot()):
            if published is None:
                views.append(FragmentView(p, -1, 0, 0))
            else:
                views.append(FragmentView(p, published.version,
                                          published.watermarks.get(learner_id, 0),
                                          published.commit_id))
        return views

    # -- pushes ---------------------------------------------------------------

    async def push(self, header: pb.PushHeader, chunks: AsyncIterator[pb.PushMessage],
                   announce: Announce | None = None) -> PushResult:
        """Receive one contribution (or a fragment's initial value) and fold it in.

        With `announce` (the push asked for the bulk channel) the chunks come as
        frames on a bulk connection: `announce(ticket, port)` tells the learner where,
        once the header is checked and a staging buffer is free."""
        self.require_leader()
        policy, store = self._policy(), self._store()
        # Before the header's own checks, which read the fragment's size; `admit`
        # makes these two again for a contribution, which is why it is asked last.
        policy.require_member(header.learner_id)
        p = header.fragment
        policy.require_fragment(p)
        assert self.run is not None
        if header.layout_hash != self.run.layout_hash:
            raise Rejected(Reason.LAYOUT_MISMATCH,
                           f"layout hash {header.layout_hash!r} differs from the run's "
                           f"{self.run.layout_hash!r}")
        if header.numel != store.numel(p):
            raise Rejected(Reason.BAD_SHAPE,
                           f"fragment {p} has {store.numel(p)} elements, the push declares "
                           f"{header.numel}")
        try:
            codec = codec_for(header.codec)
        except CodecError as exc:
            raise Rejected(Reason.BAD_ENCODING, str(exc)) from exc
        offer = Offer(ContributionId(header.learner_id, p, header.seq), header.base_version,
                      c_tokens=header.c_tokens, c_steps=header.c_steps,
                      local_step=header.local_step)
        # Decoding applies the weight the header earns now, so folding is one pass.
        prescale = 1.0
        if header.init:
            if codec.name != "fp32":
                raise Rejected(Reason.BAD_ENCODING, "an initial value must be sent as fp32")
            policy.check_initialize(p, header.seq)
        else:
            prescale = policy.admit(offer, self.clock()).weight
        try:
            return await self._fold_in(header, codec, chunks, offer, prescale, announce)
        except StreamEnded as ended:
            # Outside the staging lease, which other pushes may be waiting for.
            await self.wait_out_cut(header)
            raise Rejected(Reason.BAD_SHAPE, ended.message) from None

    def _require_term(self, policy: Policy, store: FragmentStore) -> None:
        """`NotLeader` unless this replica still leads with the state a push began
        with. One that stepped down while the push streamed, and maybe leads again
        under a new epoch, dropped that state's open rounds: acknowledged, the push
        would sit in a round nothing commits, and its learner, which pushes again only
        what was unacknowledged when it joined again, would count it merged once a
        newer seq of it is. Refused, it is pushed again to whoever leads."""
        self.require_leader()
        if self.policy is not policy or self.store is not store:
            raise NotLeader(self.leader_address, self.epoch)

    async def wait_out_cut(self, header: pb.PushHeader | None) -> None:
        """Before a push stream that ended too early is refused: a call cut short
        (the learner cancelled it, died or moved to another replica, or gRPC refused
        a message over its size limit) ends its stream early too, and gRPC cancels
        this handler soon after. A push cut short is not a malformed one: it is
        counted apart, and the caller never gets to refuse it."""
        with self._counting_cuts(header):
            await asyncio.sleep(_CUT_NOTICE_S)

    @contextlib.contextmanager
    def _counting_cuts(self, header: pb.PushHeader | None) -> Iterator[None]:
        """Counts the push as cut if its call is cancelled meanwhile."""
        try:
            yield
        except asyncio.CancelledError:
            self._count_cut(header)
            raise

    def _count_cut(self, header: pb.PushHeader | None, **why: Any) -> None:
        self.metrics.pushes_cut.add(1)
        if header is None:  # cut before its header arrived
            self.events.emit("push_cut", **why)
        else:
            self.events.emit("push_cut", learner=header.learner_id,
                             fragment=header.fragment, seq=header.seq, **why)

    async def _fold_in(self, header: pb.PushHeader, codec: Codec,
                       chunks: AsyncIterator[pb.PushMessage], offer: Offer,
                       prescale: float, announce: Announce | None) -> PushResult:
        """Receive the contribution into a staging buffer and fold it into the round
        (or make it the fragment's version 0)."""
        policy, store, p = self._policy(), self._store(), header.fragment
        asked_at = self.clock()
        async with store.staging.lease(header.learner_id, store.numel(p)) as lease:
            assert lease.buffer is not None
            self.events.emit("push_staged", learner=header.learner_id, fragment=p,
                             seq=header.seq, waited_s=round(self.clock() - asked_at, 4))
            with self._counting_cuts(header):
                norm, nbytes = await self._receive(header, codec, chunks, lease.buffer,
                                                   prescale, announce)
            self.metrics.bytes_in.add(nbytes, {"learner": header.learner_id})
            async with store.lock(p):
                self._require_term(policy, store)
                if header.init:
                    policy.check_initialize(p, header.seq)
                    await store.initialize(p, lease.buffer, {header.learner_id: header.seq},
                                           self.epoch, self._guard())
                    lease.buffer = None
                    policy.initialize(p, header.learner_id, header.seq)
                    self.events.emit("init", learner=header.learner_id, fragment=p,
                                     seq=header.seq)
                    return PushResult(header.seq, 0, 0.0, 0)
                admission = policy.admit(offer, self.clock())
                await self._reserve_seq(policy, header.learner_id, header.seq)
                lease.buffer = await store.fold(p, lease.buffer, admission.weight, norm,
                                                prescale)
                self._require_term(policy, store)
                policy.accept(admission, self.clock(), norm_sq=norm * norm)
        self.learners.setdefault(header.learner_id, LearnerStats()).contributions += 1
        self.metrics.contributions.add(1, {"fragment": str(p)})
        self.metrics.staleness.record(admission.staleness)
        replaces = {} if admission.replaces is None else {"replaces": admission.replaces.seq}
        self.events.emit("push_ack", learner=header.learner_id, fragment=p, seq=header.seq,
                         base_version=header.base_version, weight=admission.weight,
                         staleness=admission.staleness, target=admission.target_version,
                         **replaces)
        self._wake.set()
        return PushResult(header.seq, admission.target_version, admission.weight,
                          admission.staleness)

    async def _receive(self, header: pb.PushHeader, codec: Codec,
                       messages: AsyncIterator[pb.PushMessage], out: np.ndarray,
                       prescale: float, announce: Announce | None) -> tuple[float, int]:
        """Decode the chunks (on the call, or frames on a bulk connection) into `out`
        as `prescale · values`, checking order, sizes and values; returns
        (‖values‖, bytes received)."""
        # The norm comes from the decoding pass itself (`Codec.decode_norm_into`).
        reader = ChunkReader(out.size, f"fragment {header.fragment}", codec, norm=True)
        stream = aiter(messages)

        def receive() -> Awaitable[pb.PushMessage | None]:
            return self._next_message(header, stream, reader.received)

        try:
            if announce is not None and self.bulk is not None:
                transport = await self._receive_bulk(header, reader, stream, receive, announce,
                                                     out, prescale)
            else:
                await reader.read_into(receive, out, prescale)
                reader.refuse_more(await receive())
                transport = "grpc"
        except StreamEnded:
            raise  # cut short, or the learner sent too little: `push` tells which
        except StreamError as exc:
            raise Rejected(Reason(exc.reason), exc.message) from exc
        self.metrics.transfers.add(1, {"direction": "push", "transport": transport})
        total_sq = reader.square_sum
        if not math.isfinite(total_sq):
            index = first_non_finite(out)
            if index is not None:
                raise Rejected(Reason.NOT_FINITE,
                               f"element {index} of fragment {header.fragment} is "
                               f"{float(out[index]) / prescale}; contributions must be finite")
            raise Rejected(Reason.NORM_BOUND, "the contribution's norm overflows fp32")
        norm = math.sqrt(total_sq) / prescale
        bound = self.config.limits.norm_bound
        if not header.init and bound and norm > bound:
            raise Rejected(Reason.NORM_BOUND,
                           f"outer-gradient norm {norm:.4g} exceeds the bound {bound:.4g} "
                           f"(limits.norm_bound)")
        return norm, reader.nbytes

    async def _receive_bulk(self, header: pb.PushHeader, reader: ChunkReader,
                            stream: AsyncIterator[pb.PushMessage],
                            receive: Callable[[], Awaitable[pb.PushMessage | None]],
                            announce: Announce, out: np.ndarray, prescale: float) -> str:
        """The frames on the bulk connection the push's ticket opens, or its chunks on
        the call (`BulkServer.receive`); returns the transport the bytes took."""
        assert self.bulk is not None
        grant = Grant(header.learner_id, header.fragment, header.base_version)
        try:
            return await self.bulk.receive(grant, announce, stream, receive, reader, out,
                                           prescale, self.config.limits.push_idle_s)
        except BulkCut as cut:
            self._count_cut(header, reason=cut.reason)
            raise Cut(Reason(cut.reason), f"the push of fragment {header.fragment} (seq "
                                          f"{header.seq}) {cut.message}; push it "
                                          f"again") from None

    async def _next_message(self, header: pb.PushHeader,
                            messages: AsyncIterator[pb.PushMessage],
                            received: int) -> pb.PushMessage | None:
        """The push stream's next message, None at its end. A stream that sends
        nothing for `limits.push_idle_s` is cut: its learner is stuck or gone, and
        its staging buffer is what other pushes wait for."""
        idle_s = self.config.limits.push_idle_s
        try:
            async with asyncio.timeout(idle_s):
                return await anext(messages)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            self._count_cut(header, reason=Reason.IDLE.value)
            raise Cut(Reason.IDLE,
                      f"the push of fragment {header.fragment} (seq {header.seq}) sent "
                      f"nothing for {idle_s:g} s after {received} of {header.numel} "
                      f"elements (limits.push_idle_s); push it again") from None

    async def _reserve_seq(self, policy: Policy, learner_id: str, seq: int) -> None:
        """Make the seq reservation covering `seq` durable before it is acknowledged,
        so that a restart's next_seq is above it (`Policy.reservation`); one write at
        a time, so none overwrites a newer one with an older map."""
        if policy.reservation(learner_id, seq) is None:
            return
        async with self._reserving:
            reservation = policy.reservation(learner_id, seq)
            if reservation is not None:
                await asyncio.to_thread(self.state.save_seq_reservations, reservation)
                policy.reserved(reservation)

    # -- pulls ------------------------------------------------------------------

    async def pull(self, learner_id: str, fragment: int, have_version: int,
                   wait_s: float) -> Published | None:
        """The fragment if a version newer than `have_version` is published in time."""
        self._check_pull(learner_id, fragment)
        current = self._store().published(fragment)
        newest = current.version if current is not None else -1
        if have_version > newest:
            raise Rejected(Reason.FUTURE_VERSION,
                           f"have_version {have_version} of fragment {fragment} is newer than "
                           f"its current version {newest}")
        published = await self._store().wait_newer(fragment, have_version, wait_s)
        self.require_leader()  # it may have stepped down while the pull waited
        return published

    def newest(self, fragment: int) -> Published | None:
        """The fragment's newest published version (None before its first)."""
        return self._store().published(fragment)

    def snapshot(self, learner_id: str) -> list[Published | None]:
        self._check_pull(learner_id, 0)
        return self._store().snapshot()

    def count_sent(self, nbytes: int) -> None:
        self.metrics.bytes_out.add(nbytes)

    def _check_pull(self, learner_id: str, fragment: int) -> None:
        self.require_leader()
        policy = self._policy()
        policy.require_member(learner_id)
        policy.require_fragment(fragment)

    # -- rounds -----------------------------------------------------------------

    async def _round_timer(self) -> None:
        while True:
            policy, store = self.policy, self.store
            if policy is not None and store is not None and self.role == "leader":
                # Fragments commit in parallel: their locks, buffers and files are separate.
                try:
                    await asyncio.gather(*(self._close(policy, store, p)
                                           for p in policy.due(self.clock())))
                except OSError as exc:
                    self._fail(f"a committed version could not be written to "
                               f"{self.config.state_dir}: {exc}")
                    return
                deadline = policy.next_deadline()
            else:
                deadline = None
            wait = _TICK_S if deadline is None else min(_TICK_S, deadline - self.clock())
            self._wake.clear()
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the inner
            # wait's result when a cancel arrives as the wake is set (a heartbeat just
            # before `stop`), and the timer would then run on and `stop` wait for ever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(wait, 0.0)):
                    await self._wake.wait()

    def _fail(self, reason: str) -> None:
        """Stop committing for good. The round is closed and its momentum stepped in
        memory but not on disk: only a restart from the state directory is consistent,
        and the contributions no written manifest names are re-pushed by their learners."""
        self.failure = reason
        self.events.emit("fatal", reason=reason)
        self.failed.set()

    async def _close(self, policy: Policy, store: FragmentStore, fragment: int) -> None:
        async with store.lock(fragment):
            if policy is not self.policy or fragment not in policy.due(self.clock()):
                return
            started = self.clock()
            close = policy.close(fragment, started)
            manifest = [{"learner": c.id.learner_id, "seq": c.id.seq,
                         "base_version": c.base_version, "weight": c.weight,
                         "staleness": c.staleness,
                         **({} if c.replaced_by is None else {"replaced_by": c.replaced_by})}
                        for c in close.manifest]
            epoch = self.epoch
            try:
                published = await store.commit(close, manifest, epoch, self._guard())
            except NotLeader as exc:
                # Durable here but never published: the next leader resynchronises us.
                self.events.emit("commit_abandoned", fragment=fragment, version=close.version,
                                 epoch=epoch, reason=exc.message)
                return
            sync_s = self.clock() - started
            policy.record_sync_time(fragment, sync_s)
            policy.record_merge(fragment, close.version, published.merged_norm_sq)
        attrs = {"fragment": str(fragment)}
        self.metrics.quorum.set(close.quorum, attrs)
        self.metrics.rounds_committed.add(1, {**attrs, "why": close.why})
        self.metrics.quorum_wait.record(close.quorum_at - close.opened_at, attrs)
        self.metrics.grace.record(close.grace_s, attrs)
        self.metrics.sync_time.record(sync_s, attrs)
        fields: dict[str, Any] = {"epoch": epoch} if self.leadership.elected else {}
        self.events.emit("commit", t=published.published_t, fragment=fragment,
                         version=close.version, manifest=manifest,
                         quorum_wait_s=close.quorum_at - close.opened_at, grace_s=close.grace_s,
                         sync_s=sync_s, why=close.why, quorum=close.quorum,
                         step_scale=close.step_scale, **fields, **_choice_fields(close))

    # -- internals ---------------------------------------------------------------

    def _adopt(self, run: RunRecord) -> dict[int, int]:
        """Set up store and policy for `run`, resuming what the state directory
        holds; returns the resumed versions."""
        self.run = run
        self.store = FragmentStore(self.state, self.config.outer, self.config.policy.merge,
                                   run.numels, self.config.limits.staging_bytes)
        records, regressions = self.store.resume()
        for lost in regressions:
            # What a power loss with fsync = false can leave: said, not hidden.
            self.events.emit("state_regressed", fragment=lost.fragment, version=lost.version,
                             logged_version=lost.logged_version,
                             logged_epoch=lost.logged_epoch)
        versions = {p: records[p].version if p in records else -1
                    for p in range(len(run.numels))}
        watermarks = {p: r.watermarks for p, r in records.items()}
        self.policy = Policy(self.config.policy, versions, watermarks, self.membership,
                             self.state.load_seq_reservations())
        if self.draining:
            self.policy.drain()
        return {p: v for p, v in versions.items() if v >= 0}

    def _guard(self) -> Guard | None:
        return self._publish_guard if self.leadership.elected else None

    def _policy(self) -> Policy:
        if self.policy is None:
            raise Rejected(Reason.UNKNOWN_LEARNER, "no learner has joined this coordinator yet")
        return self.policy

    def _store(self) -> FragmentStore:
        if self.store is None:
            raise Rejected(Reason.UNKNOWN_LEARNER, "no learner has joined this coordinator yet")
        return self.store

    def record_rejection(self, rpc: str, learner_id: str, rejected: Rejected,
                         **context: Any) -> None:
        """Count a refusal in metrics and the event log; the one place that does."""
        self.metrics.rejections.add(1, {"reason": rejected.reason.value, "rpc": rpc})
        if learner_id in self.learners:
            self.learners[learner_id].rejections += 1
        self.events.emit("reject", rpc=rpc, learner=learner_id, reason=rejected.reason.value,
                         message=rejected.message, **context)


def _choice_fields(close: RoundClose) -> dict[str, Any]:
    """What `min_quorum = "auto"` chose the round's quorum from, for the commit event."""
    if close.choice is None:
        return {}
    return {"noise_ratio": close.choice.noise_ratio, "cycles_s": list(close.choice.cycles_s),
            "fixed_s": close.choice.fixed_s}
