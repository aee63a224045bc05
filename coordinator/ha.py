"""One coordinator replica of a highly available run: the engine's etcd side.

`Replica` builds one engine with the election (`coordinator.election`),
learner membership on etcd leases (`coordinator.etcd_membership`) and
replication (`coordinator.replication`) around it. It is the engine's elected
`Leadership` (the engine asks it whether the lease holds and hands it every
version to replicate before publishing), and it turns the election's news into
role changes: elected → the engine resumes from its own state directory (the
newest replicated state) and leads at the new epoch; deposed, or unable to
publish safely → the engine drops what it held as leader and waits to be
resynchronised as a standby. It also keeps the run's configuration (its id
and layout) in etcd, and lets only an in-sync replica campaign under sync
replication. A drained replica (Admin.Drain) never campaigns: as the leader it
waits for an in-sync standby, steps down and leaves the run (`await_standby`,
`leave`). `coordinator.daemon` starts one when `ha.etcd` is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.config import CoordinatorConfig
from coordinator.durability import FragmentRecord, RunRecord, StateError
from coordinator.election import Callbacks, Election
from coordinator.engine import Engine
from coordinator.errors import NotLeader, Reason, Rejected
from coordinator.etcd import Etcd, EtcdError
from coordinator.etcd_membership import EtcdMembership
from coordinator.leadership import Leadership
from coordinator.replication import Replicator
from coordinator.tasks import cancel_and_wait
from protos import discovery, tls
from protos.bulk import BulkServer
from protos.discovery import LeaderRecord
from protos.tls import TlsMaterial

# How often a drain looks again for an in-sync standby, and for the next leader.
_DRAIN_POLL_S = 0.05
# How long an in-sync standby has to answer before a drain looks for another.
_PING_S = 1.0


class Replica(Leadership):
    """Election, membership and replication for the engine it builds (`engine`)."""

    elected = True

    def __init__(self, config: CoordinatorConfig, address: str,
                 material: TlsMaterial | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 bulk: BulkServer | None = None) -> None:
        ha = config.ha
        self.config = config
        self.clock = clock
        self.address = ha.advertise or address
        self.replica_id = ha.replica_id or self.address
        # One certificate for etcd, the other replicas and the learners alike.
        self.etcd = Etcd(ha.etcd, material=material)
        self.election = Election(self.etcd, ha.run, self.replica_id, self.address,
                                 ha.lease_ttl_s, clock)
        self.membership = EtcdMembership(self.etcd, ha.run, config.policy.heartbeat_timeout_s)
        self.engine = Engine(config, self, clock, self.membership, bulk)
        self.replicator = Replicator(self.engine, self.etcd, ha, self.replica_id, clock,
                                     material)
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        # Said once: this replica will not lead (see `_holds_the_run`).
        self._standing_by = False

    async def start(self) -> None:
        self._task = asyncio.create_task(self.election.run_forever(Callbacks(
            elected=self._elected, deposed=self._deposed, leader_seen=self.engine.leader_seen,
            may_campaign=self._may_campaign)), name="election")

    async def stop(self) -> None:
        """Hand leadership over at once (the lease is revoked, not left to expire)."""
        # Stop publishing first; then ending the election revokes the lease.
        self.engine.demote("shutting down")
        await cancel_and_wait(self._task)
        await self.replicator.stop()
        await self.membership.stop()
        await self.etcd.close()

    # -- draining -----------------------------------------------------------------------

    async def await_standby(self, timeout_s: float, in_sync: bool) -> None:
        """Until a standby this leader replicates to answers, one in sync if `in_sync`;
        `Rejected` (no_standby) when none does within `timeout_s`, or none ever can.

        A drain asks twice: before it begins, for a standby at all (a refusal then
        changes nothing); once it has committed its open rounds, for one in sync. A
        standby catching up under load may never empty its queue while rounds commit,
        but it does once the drain stops them."""
        if self.engine.role != "leader":
            return
        if self.config.ha.replication == "none":
            raise Rejected(Reason.NO_STANDBY,
                           "nothing is replicated (ha.replication = none), so no standby can "
                           "take this run over; stop this replica and restart it on its state "
                           "directory instead")
        deadline = self.clock() + timeout_s
        while not await self._standby_answers(in_sync):
            if self.clock() >= deadline:
                which = "in sync " if in_sync else ""
                raise Rejected(Reason.NO_STANDBY,
                               f"no standby {which}answered within {timeout_s:g} s to take "
                               f"over; start one, or let it catch up, and drain again")
            await asyncio.sleep(_DRAIN_POLL_S)

    async def _standby_answers(self, in_sync: bool) -> bool:
        """Whether a standby (in sync, if asked) answers its health service now. The
        in-sync set hears of a dead standby only once its link fails, and handing the
        run to one would leave the run without a leader."""
        for link in list(self.replicator.links.values()):
            if in_sync and not link.in_sync:
                continue
            async with tls.aio_channel(link.address, self.replicator.material) as channel:
                try:
                    await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=_PING_S)
                    return True
                except grpc.RpcError:
                    continue
        return False

    async def leave(self, timeout_s: float) -> LeaderRecord | None:
        """Leave the run once drained. A leader steps down and the end of its session
        revokes its lease at once, so an in-sync standby is elected without waiting
        out the lease; a standby's registration goes with it, so the leader stops
        replicating to it rather than waiting out its acknowledgements. Returns the
        leader once etcd names another replica and no in-sync set names this one
        (None if that takes longer than `timeout_s`)."""
        self.engine.demote("drained: leadership handed to an in-sync standby")
        await cancel_and_wait(self._task)
        self._task = None
        await self.replicator.stop()
        await self.membership.stop()
        deadline = self.clock() + timeout_s
        while True:
            with contextlib.suppress(EtcdError):
                entry, _ = await self.etcd.read(discovery.leader_key(self.config.ha.run))
                insync, _ = await self.etcd.read(discovery.insync_key(self.config.ha.run))
                leader = (None if entry is None
                          else LeaderRecord.decode(entry.value, entry.create_revision))
                named = insync is not None and self.replica_id in (_replicas(insync.value) or ())
                if leader is not None and leader.replica != self.replica_id and not named:
                    return leader
            if self.clock() >= deadline:
                return None
            await asyncio.sleep(_DRAIN_POLL_S)

    # -- the election's news ------------------------------------------------------------

    async def _elected(self, epoch: int) -> None:
        try:
            run = await self._run_config()
            await self.engine.promote(epoch, run)
            await self.replicator.lead(epoch)
            self.membership.start()
            if self.engine.run is not None and run is None:
                await self._publish_run(self.engine.run)
        except (EtcdError, NotLeader) as exc:
            self.engine.demote(f"could not take over: {exc}")
            self.election.resign(f"could not take over: {exc}")

    async def _deposed(self, reason: str) -> None:
        self.engine.demote(reason)
        await self.replicator.stop()
        await self.membership.stop()

    async def _may_campaign(self) -> bool:
        """Under sync replication only a replica holding every published version
        may lead: the in-sync set the last leader recorded names it (or none exists).
        Without replication, only one holding the run at all. A drained one never."""
        if self.engine.draining:
            return False
        if self.config.ha.replication == "none":
            return await self._holds_the_run()
        if self.config.ha.replication != "sync":
            return True
        entry, _ = await self.etcd.read(discovery.insync_key(self.config.ha.run))
        replicas = None if entry is None else _replicas(entry.value)
        return replicas is None or self.replica_id in replicas

    async def _holds_the_run(self) -> bool:
        """A replica only has what it wrote while leading when nothing is replicated:
        one holding nothing of a run under way would lead it with no model at all
        (every push refused as not initialised), so it waits for one that does, such
        as the last leader restarted on its state directory."""
        run = await self._run_config()
        unreadable = ""
        try:
            held = self.engine.state.load_run()
        except StateError as exc:
            held, unreadable = None, f" ({exc})"
        holds = run is None or (held is not None and held.run_id == run.run_id)
        if not holds and not self._standing_by:
            assert run is not None
            message = (f"replica {self.replica_id} holds none of run {run.run_id}{unreadable} "
                       f"and nothing is replicated (ha.replication = none): it will not lead; "
                       f"restart the last leader on its state directory, or start a new run "
                       f"under another ha.run")
            print(f"ftsync-coordinator: {message}", file=sys.stderr, flush=True)
            self.engine.events.emit("standing_by", replica=self.replica_id, run_id=run.run_id,
                                    reason=message)
        self._standing_by = not holds
        return holds

    # -- the engine's leadership -----------------------------------------------------------

    def holds(self) -> bool:
        return self.election.holds()

    async def replicate(self, record: FragmentRecord) -> None:
        await self.replicator.replicate(record)

    def resign(self, reason: str) -> None:
        """The engine stepped down by itself: give up the lease (the election then
        reports the deposition, which stops the links)."""
        self.election.resign(reason)

    # -- the run's configuration ----------------------------------------------------------

    async def _run_config(self) -> RunRecord | None:
        entry, _ = await self.etcd.read(discovery.config_key(self.config.ha.run))
        if entry is None:
            return None
        data = json.loads(entry.value)
        return RunRecord(str(data["run_id"]), str(data["layout_hash"]),
                         tuple(int(n) for n in data["numels"]))

    async def _publish_run(self, run: RunRecord) -> None:
        value = json.dumps({"run_id": run.run_id, "layout_hash": run.layout_hash,
                            "numels": list(run.numels)}).encode()
        await self.etcd.create(discovery.config_key(self.config.ha.run), value)

    def run_created(self, run: RunRecord) -> None:
        """The first learner fixed the run's layout: keep it in etcd."""
        async def publish() -> None:
            with contextlib.suppress(EtcdError):
                await self._publish_run(run)
        task = asyncio.get_running_loop().create_task(publish())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _replicas(insync: bytes) -> list[str] | None:
    """The replicas an in-sync record names; None if it cannot be read."""
    try:
        replicas = json.loads(insync)["replicas"]
    except (ValueError, KeyError, TypeError):
        return None
    return [str(r) for r in replicas] if isinstance(replicas, list) else None
