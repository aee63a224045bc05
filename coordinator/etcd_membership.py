"""Learner membership on etcd leases, the highly available implementation.

Each learner the leader hears from gets an etcd lease of the policy's
`heartbeat_timeout_s` and a key `/ftsync/<run>/learners/<id>` under it; its
heartbeats (and contributions) renew the lease through the leader, and
leaving deletes the key. A learner is live while its key exists, which the
leader follows with a watch, so liveness does not depend on which replica
leads: a new leader finds the learners' leases still running and keeps
renewing the same ones. The `Membership` calls stay free of I/O; etcd is
written from background tasks, and a learner whose key is being written
counts as live meanwhile.

Used by `coordinator.ha` as the engine's membership while it leads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Coroutine
from typing import Any

from coordinator.etcd import Etcd, EtcdError
from coordinator.membership import Membership
from coordinator.tasks import cancel_and_wait
from protos import discovery


class EtcdMembership(Membership):
    """Live learners are those with a lease key in etcd."""

    def __init__(self, etcd: Etcd, run: str, timeout_s: float) -> None:
        self.etcd = etcd
        self.prefix = discovery.learners_prefix(run)
        self.ttl_s = max(2, math.ceil(timeout_s))
        self._live: set[str] = set()
        self._leases: dict[str, int] = {}
        self._renewed: dict[str, float] = {}
        self._busy: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._follow: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._follow is None:
            self._follow = asyncio.create_task(self._follow_keys(), name="learner-leases")

    async def stop(self) -> None:
        await cancel_and_wait(self._follow, *self._tasks)
        self._follow = None
        self._tasks.clear()
        self._busy.clear()

    # -- Membership --------------------------------------------------------------

    def renew(self, learner_id: str, now: float) -> None:
        # Renew at most three times per lease term; the lease outlives the gaps.
        if learner_id in self._busy or now - self._renewed.get(learner_id, -math.inf) < \
                self.ttl_s / 3:
            return
        self._renewed[learner_id] = now
        self._busy.add(learner_id)
        self._spawn(self._renew(learner_id))

    def drop(self, learner_id: str) -> None:
        self._live.discard(learner_id)
        self._renewed.pop(learner_id, None)
        lease = self._leases.pop(learner_id, 0)
        self._spawn(self._delete(learner_id, lease))

    def is_live(self, learner_id: str, now: float) -> bool:
        return learner_id in self._live or learner_id in self._busy

    # -- internals ---------------------------------------------------------------

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _renew(self, learner_id: str) -> None:
        try:
            lease = self._leases.get(learner_id, 0)
            if lease and await self.etcd.keepalive(lease) > 0:
                return
            lease = await self.etcd.grant(self.ttl_s)
            await self.etcd.put(self.prefix + learner_id.encode(),
                                json.dumps({"lease": lease}).encode(), lease)
            self._leases[learner_id] = lease
            self._live.add(learner_id)
        except EtcdError:
            self._renewed.pop(learner_id, None)  # try again at the next renewal
        finally:
            self._busy.discard(learner_id)

    async def _delete(self, learner_id: str, lease: int) -> None:
        with contextlib.suppress(EtcdError):
            if lease:
                await self.etcd.revoke(lease)
            else:
                await self.etcd.delete(self.prefix + learner_id.encode())

    async def _follow_keys(self) -> None:
        while True:
            try:
                entries, revision = await self.etcd.get_prefix(self.prefix)
            except EtcdError:
                await asyncio.sleep(0.2)
                continue
            live: set[str] = set()
            for entry in entries:
                learner_id = entry.key[len(self.prefix):].decode()
                live.add(learner_id)
                if learner_id not in self._leases and entry.lease:
                    self._leases[learner_id] = entry.lease  # renewed by an earlier leader
            for learner_id in set(self._leases) - live - self._busy:
                del self._leases[learner_id]
            self._live = live
            with contextlib.suppress(EtcdError):
                await self.etcd.wait_change(self.prefix, revision, timeout_s=1.0, prefix=True)
