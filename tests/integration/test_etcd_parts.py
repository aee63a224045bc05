"""The etcd-facing parts on a real etcd, in process: the election (epochs,
fencing by time, handing over) and learner membership on leases."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable

from chaos.etcd import EtcdCluster
from coordinator.election import Callbacks, Election
from coordinator.etcd import Etcd
from coordinator.etcd_membership import EtcdMembership
from learner.routing import leader_from_etcd
from protos import discovery
from protos.discovery import LeaderRecord


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def key_reads(etcd: EtcdCluster) -> int:
    """Reads (Range calls) etcd has served: the sign that a poller looked again."""
    with urllib.request.urlopen(f"{etcd.members[0].client_url}/metrics", timeout=5) as page:
        lines = page.read().decode().splitlines()
    (line,) = [line for line in lines if line.startswith("etcd_mvcc_range_total ")]
    return int(float(line.split()[1]))


async def reads_past(etcd: EtcdCluster, count: int) -> None:
    """Wait until etcd has served more than `count` reads."""
    deadline = time.monotonic() + 10.0
    while await asyncio.to_thread(key_reads, etcd) <= count:
        assert time.monotonic() < deadline, f"etcd served no read past {count}"
        await asyncio.sleep(0.02)


class Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class Candidate:
    def __init__(self, etcd: Etcd, name: str) -> None:
        self.clock = Clock()
        self.election = Election(etcd, "t", name, f"{name}:1", ttl_s=2, clock=self.clock)
        self.elected: list[int] = []
        self.deposed: list[str] = []
        self.seen: LeaderRecord | None = None

    def callbacks(self) -> Callbacks:
        async def elected(epoch: int) -> None:
            self.elected.append(epoch)

        async def deposed(reason: str) -> None:
            self.deposed.append(reason)

        def seen(leader: LeaderRecord | None) -> None:
            self.seen = leader

        async def may_campaign() -> bool:
            return True
        return Callbacks(elected, deposed, seen, may_campaign)


def test_election_epochs_fencing_and_handover(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        clients = [Etcd(etcd.endpoints), Etcd(etcd.endpoints)]
        a, b = Candidate(clients[0], "a"), Candidate(clients[1], "b")
        tasks = [asyncio.create_task(c.election.run_forever(c.callbacks())) for c in (a, b)]
        await until(lambda: bool(a.elected or b.elected))
        leader, other = (a, b) if a.elected else (b, a)
        epoch = leader.elected[0]
        entry, _ = await clients[0].read(discovery.leader_key("t"))
        assert entry is not None and entry.create_revision == epoch
        await until(lambda: other.seen is not None and other.seen.epoch == epoch)
        assert other.seen is not None and other.seen.replica == leader.election.replica_id
        assert leader.election.holds() and not other.election.holds()
        # Fencing by time: once the lease could have expired, the leader may not act,
        # whatever its renewals say later.
        leader.clock.offset = 2.0
        assert not leader.election.holds()
        leader.clock.offset = 0.0
        # Resigning revokes the lease: the other replica leads at a newer epoch.
        leader.election.resign("test")
        await until(lambda: bool(other.elected))
        assert leader.deposed == ["test"] and other.elected[0] > epoch
        await until(lambda: leader.seen is not None and leader.seen.epoch == other.elected[0])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Stopping ends the session: no leader key is left behind.
        entry, _ = await clients[0].read(discovery.leader_key("t"))
        assert entry is None
        for client in clients:
            await client.close()

    asyncio.run(scenario())


def test_learner_leases_outlive_the_leader_and_expire_without_heartbeats(
        etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        client = Etcd(etcd.endpoints)
        # Leases long beside a busy machine's delays: a must outlive second's start.
        first = EtcdMembership(client, "t", timeout_s=5.0)
        first.start()
        first.renew("a", time.monotonic())
        first.renew("b", time.monotonic())
        assert first.is_live("a", 0.0)  # counted while its key is being written
        await until(lambda: {"a", "b"} <= first._live)
        # A new leader finds the same learners live, under the same leases.
        second = EtcdMembership(client, "t", timeout_s=5.0)
        second.start()
        await until(lambda: {"a", "b"} <= second._live)
        assert second._leases == first._leases
        second.drop("b")
        assert not second.is_live("b", 0.0)
        await until(lambda: "b" not in first._live)
        # Nobody renews a: its lease runs out after its 5 s.
        await until(lambda: not first.is_live("a", 0.0) and not second.is_live("a", 0.0),
                    timeout=30.0)
        await first.stop()
        await second.stop()
        await client.close()

    asyncio.run(scenario())


def test_a_learner_looking_past_a_failed_leader_waits_out_the_election_gap(
        etcd: EtcdCluster) -> None:
    """Between the failed leader's lease expiring and a standby's campaign landing
    no leader key exists; a learner that took that gap for an answer called the
    failed leader again and waited out another deadline."""
    async def scenario() -> None:
        client = Etcd(etcd.endpoints)
        key = discovery.leader_key("t")
        await client.put(key, LeaderRecord("a", "127.0.0.1:1", 0).encode())
        reads = key_reads(etcd)
        looking = asyncio.create_task(
            leader_from_etcd(etcd.endpoints, "t", avoid="127.0.0.1:1", wait_s=60.0))
        await reads_past(etcd, reads + 1)  # it read the failed leader, and again
        await client.delete(key)
        reads = key_reads(etcd)
        await reads_past(etcd, reads + 1)  # it read the gap, and again
        assert not looking.done()
        await client.put(key, LeaderRecord("b", "127.0.0.1:2", 0).encode())
        assert await asyncio.wait_for(looking, 30.0) == "127.0.0.1:2"
        # Not looking past anyone, the gap is the answer, at once.
        await client.delete(key)
        assert await asyncio.wait_for(leader_from_etcd(etcd.endpoints, "t"), 30.0) == ""
        # Nobody campaigns: after `wait_s` the learner has its answer all the same.
        started = time.monotonic()
        assert await leader_from_etcd(etcd.endpoints, "t", avoid="127.0.0.1:1",
                                       wait_s=0.5) == ""
        assert time.monotonic() - started < 30.0  # the answer, not a hang
        await client.close()

    asyncio.run(scenario())
