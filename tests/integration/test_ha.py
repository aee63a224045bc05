"""High availability on real etcd and real coordinator processes.

Two coordinator replicas of one run against etcd (one member, or three),
in-process learners given both addresses: the leader is SIGKILLed, or
SIGSTOPped past its lease (a partition that also freezes its renewals), or
an etcd member dies. Afterwards `chaos.failover.audit` reads the replicas'
state directories and every event log: no fragment version committed under
two epochs, no acknowledged contribution lost, none merged twice.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from chaos.etcd import EtcdCluster
from chaos.failover import (
    ReplicaSet,
    audit,
    drain,
    read_events,
    steady_learner,
)
from coordinator.durability import FragmentRecord, RunRecord
from coordinator.replication import replica_messages
from learner.api import Learner
from learner.client import FAILOVER_WINDOW_S, Retry, SynchronizerClient
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc
from protos.events import EventLog
from protos.tls import TlsMaterial
from tests.integration.test_learner import small_model, train_step

# Whole experiments or clusters: `deploy/dev test -m 'not slow'` leaves them out.
pytestmark = pytest.mark.slow

NUMELS = [2000, 1000]
TTL_S = 3
REPLICA_TOKEN = "replicas-only"
# The run's settings; replicas authenticate each other by the token here, by their
# certificate under mutual TLS (tests/integration/test_tls.py).
REPLICA_SETTINGS = ["--set", "policy.grace_max_s=0.2", "--set", "policy.max_staleness=64",
                    "--set", f"ha.lease_ttl_s={TTL_S}", "--set", "outer.lr=0.1",
                    "--set", "outer.momentum=0.0"]
REPLICA_ARGS = [*REPLICA_SETTINGS, "--set", f"ha.token={REPLICA_TOKEN}"]


@pytest.fixture
def replicas(tmp_path: Path, etcd: EtcdCluster) -> Iterator[ReplicaSet]:
    cluster = ReplicaSet(tmp_path / "replicas", etcd.endpoints, count=2, args=REPLICA_ARGS)
    cluster.root.mkdir()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


class Learners:
    """In-process steady learners, each given its own way to the leader."""

    def __init__(self, root: Path, addresses: list[str],
                 tls: Callable[[str], TlsMaterial | None] = lambda learner: None) -> None:
        self.logs = [root / f"learner{i}.events.jsonl" for i in range(len(addresses))]
        self.clients = [
            SynchronizerClient(address, f"l{i}", "layout-ha", NUMELS,
                               retry=Retry(give_up_after_s=30),
                               events=EventLog(str(log), source=f"l{i}"), tls=tls(f"l{i}"))
            for i, (address, log) in enumerate(zip(addresses, self.logs, strict=True))]
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[int]] = []

    def start(self, quiet: int = 0) -> None:
        """The last `quiet` learners only heartbeat: live, they hold every round
        open until its grace window ends."""
        steady, silent = self.clients[:len(self.clients) - quiet], self.clients[-quiet:]
        self.tasks = [asyncio.create_task(steady_learner(c, NUMELS, self.stop))
                      for c in steady]
        self.tasks += [asyncio.create_task(self._heartbeats(c)) for c in silent[:quiet]]

    async def _heartbeats(self, client: SynchronizerClient) -> int:
        await client.join()
        while not self.stop.is_set():
            await client.heartbeat(0)
            await asyncio.sleep(0.25)
        return 0

    async def finish(self) -> None:
        """Stop pushing, then wait until every contribution is settled."""
        self.stop.set()
        await asyncio.gather(*self.tasks)
        await asyncio.gather(*(drain(c) for c in self.clients))
        for client in self.clients:
            await client.close()


async def wait_for(predicate: object, timeout: float, message: str) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        await asyncio.sleep(0.05)


def check_audit(cluster: ReplicaSet, learners: Learners) -> None:
    result = audit(cluster.state_dirs(), [cluster.event_log(i) for i in range(cluster.count)],
                   learners.logs)
    assert result.merged > 0
    assert not result.split_brain, f"versions committed under two epochs: {result.split_brain}"
    assert not result.overwritten, f"published versions lost: {result.overwritten}"
    assert not result.lost, f"acknowledged contributions lost: {result.lost[:10]}"
    assert not result.doubled, f"contributions merged twice: {result.doubled[:10]}"


@pytest.mark.timeout(120)
def test_a_killed_leader_hands_over_to_the_standby_and_loses_nothing(
        replicas: ReplicaSet, etcd: EtcdCluster, tmp_path: Path) -> None:
    async def scenario() -> None:
        old, epoch = replicas.leader()
        # Two learners know both replicas; one finds the leader through etcd.
        learners = Learners(tmp_path, [replicas.addresses, replicas.addresses,
                                       f"etcd://{','.join(etcd.endpoints)}/default"])
        learners.start()
        await wait_for(lambda: len(replicas.commits(old)) >= 10, 30, "commits by the leader")
        replicas.wait_in_sync()
        killed_at = time.time()
        replicas.replicas[old].kill()
        new, new_epoch = await asyncio.to_thread(replicas.leader, 30.0, epoch)
        assert new != old and new_epoch > epoch
        await wait_for(lambda: replicas.commits(new, epoch, killed_at), 30,
                       "a commit by the new leader")
        # How soon is bench.recovery's figure (failover p99 ≤ lease TTL + 1 s, over 20
        # kills); here, that it happens and loses nothing.
        failover_s = replicas.commits(new, epoch, killed_at)[0]["t"] - killed_at
        print(f"failover: kill to first commit of epoch {new_epoch} in {failover_s:.2f}s")
        await wait_for(lambda: len(replicas.commits(new)) >= 10, 30, "commits after failover")
        # The killed replica comes back as a standby and is resynchronised.
        await asyncio.to_thread(replicas.replicas[old].start)
        await asyncio.to_thread(replicas.wait_in_sync)
        await learners.finish()
        assert replicas.roles()[old] == ("standby", new_epoch)
        check_audit(replicas, learners)

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_without_replication_a_standby_holding_nothing_waits_for_the_leader_to_restart(
        etcd: EtcdCluster, tmp_path: Path) -> None:
    """With `ha.replication = none` a standby has none of the run: leading it, it would
    refuse every push as not initialised for good. It stands by; the killed leader,
    restarted on its state directory, leads again from where it was."""
    cluster = ReplicaSet(tmp_path / "replicas", etcd.endpoints, count=2,
                         args=[*REPLICA_ARGS, "--set", "ha.replication=none"])
    cluster.root.mkdir()

    async def scenario() -> None:
        old, epoch = cluster.leader()
        standby = 1 - old
        learners = Learners(tmp_path, [cluster.addresses, cluster.addresses])
        learners.start()
        await wait_for(lambda: len(cluster.commits(old)) >= 10, 30, "commits by the leader")
        cluster.replicas[old].kill()
        killed = time.monotonic()
        # Declined once the old lease expired, when it was free to campaign.
        await wait_for(lambda: any(e["kind"] == "standing_by" for e in cluster.events(standby)),
                       TTL_S + 10, "the standby declining to lead")
        assert cluster.roles()[standby][0] == "standby"

        def refused() -> int:
            return int(cluster.replicas[standby].status().rejections.get("not_leader", 0))

        # Past a failover's time, learners back off as from a coordinator that is down.
        await asyncio.sleep(max(0.0, killed + FAILOVER_WINDOW_S - time.monotonic()))
        before, since = refused(), time.monotonic()
        await asyncio.sleep(3)
        rate = (refused() - before) / (time.monotonic() - since)
        # Measured: 5.7/s; 40/s when learners went round the replicas every 10-50 ms.
        assert rate < 15, f"learners asked a leaderless standby {rate:.1f} times a second"
        await asyncio.to_thread(cluster.replicas[old].start)
        new, _ = await asyncio.to_thread(cluster.leader, 30.0, epoch)
        assert new == old
        await wait_for(lambda: len(cluster.commits(old, epoch)) >= 5, 30,
                       "commits after the restart")
        await learners.finish()
        check_audit(cluster, learners)

    try:
        cluster.start()
        asyncio.run(scenario())
    finally:
        cluster.stop()


@pytest.mark.timeout(120)
def test_under_async_replication_a_learner_ahead_of_the_new_leader_syncs_on(
        etcd: EtcdCluster, tmp_path: Path) -> None:
    """The standby lags (paused while the leader commits on), then the leader dies: the
    new leader lacks versions a learner already applied. The learner takes the new
    leader's newest version and its pushes are merged again."""
    cluster = ReplicaSet(tmp_path / "replicas", etcd.endpoints, count=2,
                         args=[*REPLICA_ARGS, "--set", "ha.replication=async"])
    cluster.root.mkdir()
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = tmp_path / "learner.events.jsonl"

    def train_until(learner: Learner, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 60
        while not done():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            train_step(model, opt)
            learner.step(tokens=32)
            time.sleep(0.01)  # a step's compute, so that rounds commit between steps

    try:
        cluster.start()
        old, _ = cluster.leader()
        standby = cluster.replicas[1 - old]
        with Learner(cluster.addresses, model, sync_every=4, fragments=2, overlap=1,
                     device="cpu", learner_id="ahead", connect_timeout_s=30,
                     event_log=str(log)) as learner:
            train_until(learner, lambda: min(learner.applied_versions.values()) >= 2,
                        "the first versions")
            cluster.wait_in_sync()
            standby.pause()
            lagged = dict(learner.applied_versions)
            train_until(learner, lambda: all(v >= lagged[p] + 3
                                             for p, v in learner.applied_versions.items()),
                        "versions the paused standby lacks")
            ahead = dict(learner.applied_versions)
            cluster.replicas[old].kill()
            standby.resume()
            new, _ = cluster.leader(timeout=30)
            assert new == 1 - old
            taken_over = {f.fragment: f.version for f in standby.status().fragments}
            assert any(taken_over[p] < v for p, v in ahead.items()), (taken_over, ahead)
            train_until(learner, lambda: all(
                v > taken_over[p] and v <= standby.status().fragments[p].version
                for p, v in learner.applied_versions.items()), "versions of the new leader")
    finally:
        cluster.stop()
    rewound = [json.loads(line) for line in log.read_text().splitlines()
               if '"rewound"' in line]
    assert rewound, "the learner never took the new leader's older version"


@pytest.mark.timeout(120)
def test_a_partitioned_leader_steps_down_and_its_late_writes_are_refused(
        replicas: ReplicaSet, tmp_path: Path) -> None:
    async def scenario() -> None:
        old, epoch = replicas.leader()
        learners = Learners(tmp_path, [replicas.addresses] * 4)
        learners.start(quiet=1)
        await wait_for(lambda: len(replicas.commits(old)) >= 10, 30, "commits by the leader")
        replicas.wait_in_sync()
        # Frozen mid-run, most likely with an open round whose grace window ends while
        # it is stopped: it tries to commit that round as soon as it runs again.
        paused_at = time.time()
        replicas.replicas[old].pause()
        try:
            new, new_epoch = await asyncio.to_thread(replicas.leader, 30.0, epoch)
            await wait_for(lambda: replicas.commits(new, epoch, paused_at), 30,
                           "a new leader's commit")
        finally:
            # Taken before it runs again: frozen until then, it emits nothing later than
            # this, and once resumed it may step down before this thread reads the clock.
            resumed_at = time.time()
            replicas.replicas[old].resume()
        await wait_for(lambda: replicas.roles()[old] == ("standby", new_epoch), 15,
                       "the old leader to step down and follow the new one")
        await learners.finish()
        # Not one commit of the old epoch once it was frozen: it stepped down instead.
        late = replicas.commits(old, after_t=paused_at)
        assert late == [], late
        events = read_events(replicas.event_log(old))
        assert any(e["kind"] == "step_down" and e["epoch"] == epoch and e["t"] >= resumed_at
                   for e in events)
        abandoned = [e for e in events if e["kind"] == "commit_abandoned"]
        print(f"old leader abandoned {len(abandoned)} commits after resuming")
        # A write of the old epoch is refused by the new leader...
        with grpc.insecure_channel(replicas.replicas[new].address) as channel:
            stub = pb_grpc.ReplicationStub(channel)
            record = FragmentRecord(0, 10_000, np.zeros(NUMELS[0], np.float32),
                                    np.zeros(NUMELS[0], np.float32), {}, [], epoch)
            run = RunRecord("x", "layout-ha", tuple(NUMELS))
            token = (("authorization", f"Bearer {REPLICA_TOKEN}"),)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Replicate(replica_messages(epoch, f"r{old}", run, record), timeout=5,
                               metadata=token)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "stale_epoch" in (refused.value.details() or "")
            # Without the replicas' token nothing is taken, whatever the epoch...
            future = replica_messages(new_epoch + 100, "intruder", run, record)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Replicate(future, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "ha.token" in (refused.value.details() or "")
            # ...and with it, a manifest that is not JSON is named, not a crash.
            garbled = list(replica_messages(new_epoch, "r?", run, record))
            garbled[0].header.manifest_json = "{not json"
            with pytest.raises(grpc.RpcError) as refused:
                stub.Replicate(iter(garbled), timeout=5, metadata=token)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "manifest is not JSON" in (refused.value.details() or "")
        assert replicas.roles()[new] == ("leader", new_epoch)
        # ...and the old leader redirects learners to the new one.
        with grpc.insecure_channel(replicas.replicas[old].address) as channel:
            with pytest.raises(grpc.RpcError) as redirected:
                pb_grpc.SynchronizerStub(channel).Heartbeat(
                    pb.HeartbeatRequest(learner_id="l0"), timeout=5)
            assert redirected.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            details = redirected.value.details() or ""
            assert details.startswith(f"not_leader: leader is {replicas.replicas[new].address}")
            assert ("ftsync-leader", replicas.replicas[new].address) in (
                redirected.value.trailing_metadata() or ())  # type: ignore[attr-defined]
        check_audit(replicas, learners)

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_losing_one_of_three_etcd_members_keeps_the_run_going(
        tmp_path: Path, etcd_cluster: EtcdCluster) -> None:
    cluster = ReplicaSet(tmp_path / "replicas", etcd_cluster.endpoints, count=2,
                         args=REPLICA_ARGS)
    cluster.root.mkdir()
    cluster.start()
    try:
        async def scenario() -> None:
            leader, _ = cluster.leader()
            learners = Learners(tmp_path, [cluster.addresses] * 3)
            learners.start()
            await wait_for(lambda: len(cluster.commits(leader)) >= 10, 30, "commits")
            cluster.wait_in_sync()
            etcd_cluster.kill(0)
            killed_at = time.time()

            def commits_since() -> int:
                return sum(len(cluster.commits(i, after_t=killed_at))
                           for i in range(cluster.count))
            await wait_for(lambda: commits_since() >= 20, 20, "commits after losing a member")
            await learners.finish()
            check_audit(cluster, learners)

        asyncio.run(scenario())
    finally:
        cluster.stop()
