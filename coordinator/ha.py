"""One coordinator replica of a highly available run: the engine's etcd side.

`Replica` wires the election (`coordinator.election`), learner membership on
etcd leases (`coordinator.etcd_membership`) and replication
(`coordinator.replication`) around one engine, and turns their news into
role changes: elected → the engine resumes from its own state directory (the
newest replicated state) and leads at the new epoch; deposed, or unable to
publish safely → the engine drops what it held as leader and waits to be
resynchronised as a standby. It also keeps the run's configuration (its id
and layout) in etcd, and lets only an in-sync replica campaign under sync
replication. `coordinator.daemon` starts one when `ha.etcd` is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable

from coordinator.config import CoordinatorConfig
from coordinator.durability import RunRecord, StateError
from coordinator.election import Callbacks, Election
from coordinator.engine import Engine
from coordinator.errors import NotLeader
from coordinator.etcd import Etcd, EtcdError
from coordinator.etcd_membership import EtcdMembership
from coordinator.replication import Replicator
from coordinator.tasks import cancel_and_wait
from protos import discovery
from protos.discovery import LeaderRecord
from protos.tls import TlsMaterial


class Replica:
    """Election, membership and replication for one engine."""

    def __init__(self, engine: Engine, config: CoordinatorConfig, address: str,
                 material: TlsMaterial | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        ha = config.ha
        self.engine = engine
        self.config = config
        self.address = ha.advertise or address
        self.replica_id = ha.replica_id or self.address
        # One certificate for etcd, the other replicas and the learners alike.
        self.etcd = Etcd(ha.etcd, material=material)
        self.election = Election(self.etcd, ha.run, self.replica_id, self.address,
                                 ha.lease_ttl_s, clock)
        self.membership = EtcdMembership(self.etcd, ha.run, config.policy.heartbeat_timeout_s)
        self.replicator = Replicator(engine, self.etcd, ha, self.replica_id, clock, material)
        engine.membership = self.membership
        engine.replica_id = self.replica_id
        engine.address = self.address
        engine.lease_valid = self.election.holds
        engine.replicate = self.replicator.replicate
        engine.on_demoted = self._demoted
        engine.on_run_created = self.run_created
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        # Said once: this replica will not lead (see `_holds_the_run`).
        self._standing_by = False

    async def start(self) -> None:
        self._task = asyncio.create_task(self.election.run_forever(Callbacks(
            elected=self._elected, deposed=self._deposed, leader_seen=self._leader_seen,
            may_campaign=self._may_campaign)), name="election")

    async def stop(self) -> None:
        """Hand leadership over at once (the lease is revoked, not left to expire)."""
        # Stop publishing first; then ending the election revokes the lease.
        self.engine.demote("shutting down")
        await cancel_and_wait(self._task)
        await self.replicator.stop()
        await self.membership.stop()
        await self.etcd.close()

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

    def _leader_seen(self, leader: LeaderRecord | None) -> None:
        if leader is None:
            if self.engine.role != "leader":
                self.engine.leader_address = ""
            return
        self.engine.known_epoch = max(self.engine.known_epoch, leader.epoch)
        if self.engine.role != "leader":
            self.engine.leader_address = leader.address

    async def _may_campaign(self) -> bool:
        """Under sync replication only a replica holding every published version
        may lead: the in-sync set the last leader recorded names it (or none exists).
        Without replication, only one holding the run at all."""
        if self.config.ha.replication == "none":
            return await self._holds_the_run()
        if self.config.ha.replication != "sync":
            return True
        entry, _ = await self.etcd.read(discovery.insync_key(self.config.ha.run))
        if entry is None:
            return True
        try:
            replicas = json.loads(entry.value)["replicas"]
        except (ValueError, KeyError, TypeError):
            return True
        return self.replica_id in replicas

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

    def _demoted(self, reason: str) -> None:
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
