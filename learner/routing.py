"""Which replica of a highly available synchronizer a learner calls.

A synchronizer is named by a comma-separated list of replica addresses or by
`etcd://HOST:PORT[,HOST:PORT]/RUN` (the leader is read from etcd). `Replicas`
is the pure part: the addresses, the current one, the newest leader epoch seen
(an answer from an older one is a deposed leader's), and when each replica
last failed; it moves to the leader a standby's hint or etcd names, or to the
next address. `Router` is the part that must touch the network: a gRPC channel
per replica, reading etcd, and closing the channel of a replica left behind,
which cancels the calls still waiting on it so that they are retried on the
new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random

import grpc

from protos import discovery
from protos import ftsync_pb2_grpc as pb_grpc
from protos.codec import MESSAGE_SIZE_OPTIONS
from protos.tls import TlsMaterial, aio_channel

_CHANNEL_OPTIONS = [
    *MESSAGE_SIZE_OPTIONS,
    # Notice a cut connection in seconds, not at the next call's deadline.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
# How often to read the leader record while waiting for it to change.
_ETCD_POLL_S = 0.1


class WrongReplica(Exception):
    """The replica asked does not lead (now); `leader` is a hint where to go."""

    def __init__(self, why: str, leader: str = "") -> None:
        super().__init__(why)
        self.leader = leader


class Replicas:
    """The replicas to try, the current one first, and the newest epoch seen."""

    def __init__(self, address: str) -> None:
        # With etcd, the addresses are found there (its endpoints, the run).
        self.etcd: tuple[list[str], str] | None = None
        if address.startswith("etcd://"):
            self.etcd = discovery.parse_etcd_url(address)
            self.addresses: list[str] = []
        else:
            self.addresses = [a.strip() for a in address.split(",") if a.strip()]
        self._current = 0
        self.epoch = 0
        # When each replica last failed to answer (the caller's clock).
        self._failed_at: dict[str, float] = {}

    @property
    def address(self) -> str:
        """The replica to call now ("" while none is known)."""
        return self.addresses[self._current] if self.addresses else ""

    @property
    def several(self) -> bool:
        """Whether there are other replicas to go to (a list of them, or etcd)."""
        return len(self.addresses) > 1 or self.etcd is not None

    def check_epoch(self, epoch: int) -> None:
        """Ignore a deposed leader: it answers with an epoch older than one seen."""
        if epoch < self.epoch:
            raise WrongReplica(f"{self.address} answered for epoch {epoch}, but epoch "
                               f"{self.epoch} has been seen")
        self.epoch = epoch

    def move(self, leader: str, failed: bool) -> None:
        """Go to `leader` (named by a replica or etcd); without one, to the next
        address, except under etcd for a replica that refused rather than failed
        (etcd names no leader yet: the current one may become it)."""
        if leader:
            if leader not in self.addresses:
                self.addresses.append(leader)
            self._current = self.addresses.index(leader)
        elif self.addresses and (failed or self.etcd is None):
            self._current = (self._current + 1) % len(self.addresses)

    def failed(self, address: str, now: float) -> None:
        self._failed_at[address] = now

    def failed_within(self, address: str, now: float, window_s: float) -> bool:
        """Whether `address` failed to answer less than `window_s` ago."""
        return now - self._failed_at.get(address, -math.inf) < window_s


class Router:
    """A gRPC channel per replica, made on first use on the loop that drives it;
    `find_leader` moves on and leaves the old replica's channel behind."""

    def __init__(self, replicas: Replicas, tls: TlsMaterial | None) -> None:
        self.replicas = replicas
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task[None]] = set()
        # Changes of replica so far: a call cancelled by one is retried.
        self.switches = 0

    @property
    def stub(self) -> pb_grpc.SynchronizerStub:
        address = self.replicas.address
        if not address:
            raise WrongReplica("no leader is known yet")
        channel = self._channels.get(address)
        if channel is None:
            channel = aio_channel(address, self.tls, _CHANNEL_OPTIONS)
            self._channels[address] = channel
        return pb_grpc.SynchronizerStub(channel)

    @property
    def open(self) -> bool:
        """Whether a channel is open (none is after `close`)."""
        return bool(self._channels)

    async def find_leader(self, hint: str, failed: bool, wait_s: float) -> str | None:
        """Move on after a replica refused or failed: to the leader it named, to
        the leader etcd names (waited for up to `wait_s` while it still names the
        failed replica), or to the next address. Returns the replica left, None
        when it stays."""
        before = self.replicas.address
        leader = hint
        if not hint and self.replicas.etcd is not None:
            leader = await leader_from_etcd(*self.replicas.etcd,
                                            avoid=before if failed else "", wait_s=wait_s,
                                            tls=self.tls)
        self.replicas.move(leader, failed)
        if self.replicas.address == before:
            return None
        # Calls still waiting on the old replica (frozen, or partitioned with its
        # connections open) are cancelled, and so retried on the new one.
        self.switches += 1
        old = self._channels.pop(before, None)
        if old is not None:
            task = asyncio.get_running_loop().create_task(old.close(grace=None))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return before

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(grace=None)


async def leader_from_etcd(endpoints: list[str], run: str, avoid: str = "",
                           wait_s: float = 0.0, tls: TlsMaterial | None = None) -> str:
    """The leader's address as etcd has it; "" when none leads or etcd is unreachable.

    While it is `avoid` (a replica that just failed) or absent, it is read again,
    on the same connection, for up to `wait_s`: a frozen or cut-off leader's record
    stays until its lease expires, then none leads until a standby's campaign lands,
    and calling the failed replica again meanwhile would only wait out another
    deadline."""
    import aetcd  # only learners that discover through etcd need it

    from protos import etcd_tls

    host, _, port = endpoints[random.randrange(len(endpoints))].rpartition(":")
    client = etcd_tls.client(host, int(port), tls, timeout=2)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    try:
        while True:
            entry = await asyncio.wait_for(client.get(discovery.leader_key(run)), 3)
            leader = ("" if entry is None else
                      discovery.LeaderRecord.decode(entry.value, entry.create_revision).address)
            if not avoid or leader not in (avoid, "") or loop.time() >= deadline:
                return leader
            await asyncio.sleep(_ETCD_POLL_S)
    except (aetcd.ClientError, grpc.RpcError, TimeoutError):
        return ""
    finally:
        with contextlib.suppress(aetcd.ClientError, grpc.RpcError, TimeoutError):
            await asyncio.wait_for(client.close(), 2)
