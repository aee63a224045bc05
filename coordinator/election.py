"""Leader election among coordinator replicas, on an etcd lease.

Each replica holds a session: one etcd lease of `lease_ttl_s`, renewed every
sixth of it, under which it registers itself (`/replicas/<id>`). A replica
campaigns by creating the leader key under that lease in a transaction that
succeeds only while the key is absent; the key's create revision is the new
leader's epoch, so epochs only grow. Standbys wait on the key and campaign
again the moment it disappears (its lease expired or was revoked).

Fencing: a leader may act only while `holds()`, that is until a third of the
TTL before the earliest moment its lease could expire, counted from when the
last successful renewal was *sent* (etcd measures the TTL from when it
received it, later). A leader that cannot renew in time steps down by itself
before another replica can be elected; one that finds its lease gone
(SIGSTOPped past its TTL, say) steps down at once. Either way it revokes
what is left of its session and starts a new one as a standby.

Called by `coordinator.ha`, which turns elections into engine promotions.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from coordinator.etcd import Etcd, EtcdError
from coordinator.tasks import cancel_and_wait
from protos import discovery
from protos.discovery import LeaderRecord

# Pause after a failed etcd call before trying again.
_RETRY_S = 0.2


@dataclass(frozen=True)
class Callbacks:
    """What the election tells its owner."""

    elected: Callable[[int], Awaitable[None]]
    deposed: Callable[[str], Awaitable[None]]
    leader_seen: Callable[[LeaderRecord | None], None]
    may_campaign: Callable[[], Awaitable[bool]]


class Election:
    """This replica's session and campaign."""

    def __init__(self, etcd: Etcd, run: str, replica_id: str, address: str, ttl_s: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.etcd = etcd
        self.run = run
        self.replica_id = replica_id
        self.address = address
        self.ttl_s = ttl_s
        self.clock = clock
        self.renew_every_s = ttl_s / 6
        self.margin_s = ttl_s / 3
        self.lease = 0
        self.renewed_at = -math.inf  # when the last successful renewal was sent
        self.epoch = 0  # > 0 while leading
        self.leader: LeaderRecord | None = None
        self._lost = asyncio.Event()
        self._lost_reason = ""
        self._keepalive: asyncio.Task[None] | None = None

    @property
    def leading(self) -> bool:
        return self.epoch > 0

    def holds(self) -> bool:
        """Whether this replica leads and its lease surely has not expired yet."""
        return (self.leading and not self._lost.is_set()
                and self.clock() < self.renewed_at + self.ttl_s - self.margin_s)

    def resign(self, reason: str) -> None:
        """Give up leadership (the engine could not publish safely)."""
        if self.leading and not self._lost.is_set():
            self._lost_reason = reason
            self._lost.set()

    async def run_forever(self, callbacks: Callbacks) -> None:
        try:
            while True:
                try:
                    await self._step(callbacks)
                except EtcdError:
                    await asyncio.sleep(_RETRY_S)
        finally:
            await self._end_session()

    async def _step(self, callbacks: Callbacks) -> None:
        if self.leading:
            await self._lost.wait()
            reason = self._lost_reason or "lease lost"
            self.epoch = 0
            await callbacks.deposed(reason)
            await self._end_session()
            return
        if not self.lease or self._lost.is_set():
            await self._new_session()
        key = discovery.leader_key(self.run)
        entry, revision = await self.etcd.read(key)
        if entry is None and await callbacks.may_campaign():
            record = LeaderRecord(self.replica_id, self.address, 0)
            created, entry = await self.etcd.create(key, record.encode(), self.lease)
            if created and entry is not None and self.holds_session():
                self.epoch = entry.create_revision
                self.leader = LeaderRecord(self.replica_id, self.address, self.epoch)
                callbacks.leader_seen(self.leader)
                await callbacks.elected(self.epoch)
                return
        self.leader = (None if entry is None
                       else LeaderRecord.decode(entry.value, entry.create_revision))
        callbacks.leader_seen(self.leader)
        after = entry.mod_revision if entry is not None else revision
        await self.etcd.wait_change(key, max(after, revision), timeout_s=1.0)

    def holds_session(self) -> bool:
        return self.clock() < self.renewed_at + self.ttl_s - self.margin_s

    async def _new_session(self) -> None:
        await self._end_session()
        self._lost.clear()
        self._lost_reason = ""
        sent = self.clock()
        self.lease = await self.etcd.grant(self.ttl_s)
        self.renewed_at = sent
        value = discovery.ReplicaRecord(self.replica_id, self.address).encode()
        await self.etcd.put(discovery.replicas_prefix(self.run) + self.replica_id.encode(),
                            value, self.lease)
        self._keepalive = asyncio.create_task(self._renew(), name="lease-keepalive")

    async def _end_session(self) -> None:
        await cancel_and_wait(self._keepalive)
        self._keepalive = None
        if self.lease:
            lease, self.lease = self.lease, 0
            # Free the leader key now rather than at expiry; unreachable etcd lets it expire.
            with contextlib.suppress(EtcdError):
                await self.etcd.revoke(lease, timeout_s=1.0)
        self.renewed_at = -math.inf

    async def _renew(self) -> None:
        while True:
            sent = self.clock()
            try:
                remaining = await self.etcd.keepalive(self.lease, timeout_s=self.renew_every_s * 2)
            except EtcdError:
                remaining = -1
            if remaining == 0:
                self._lost_reason = "lease expired"
                self._lost.set()
                return
            if remaining > 0:
                self.renewed_at = sent
            if not self.holds_session():
                self._lost_reason = "lease not renewed in time"
                self._lost.set()
                return
            await asyncio.sleep(max(0.0, sent + self.renew_every_s - self.clock()))
