"""Health and drain of a highly available synchronizer, on real etcd and replicas.

The health service is SERVING on the leader only, through a leader kill (the
new leader turns SERVING, the restarted one is a NOT_SERVING standby). A
drained leader commits its open rounds, steps down so that the in-sync
standby leads at once, answers with the new leader and exits 0; learners
follow the new leader and `chaos.failover.audit` finds nothing lost or
doubled. A leader whose standby does not answer refuses to drain and goes
on leading.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from chaos.etcd import EtcdCluster
from chaos.failover import ReplicaSet, read_events
from coordinator.admin import check_health, request_drain
from tests.daemon import wait_until
from tests.integration import test_ha
from tests.integration.test_ha import Learners, check_audit, wait_for

# Whole experiments or clusters: `deploy/dev test -m 'not slow'` leaves them out.
pytestmark = pytest.mark.slow

# Two replicas on a one-member etcd, as in test_ha.
replicas = test_ha.replicas
# The drain test's lease: long beside a drain, however busy the machine, so that only a
# lease revoked at once lets the standby lead within it.
LONG_TTL_S = 30


@pytest.fixture
def long_lease_replicas(tmp_path: Path, etcd: EtcdCluster) -> Iterator[ReplicaSet]:
    cluster = ReplicaSet(tmp_path / "replicas", etcd.endpoints, count=2,
                         args=[*test_ha.REPLICA_ARGS, "--set", f"ha.lease_ttl_s={LONG_TTL_S}"])
    cluster.root.mkdir()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def health(cluster: ReplicaSet, index: int) -> str:
    return check_health(cluster.replicas[index].address, None)


def healths(cluster: ReplicaSet) -> list[str]:
    return [health(cluster, i) for i in range(cluster.count)]


@pytest.mark.timeout(120)
def test_only_the_leader_is_serving_through_a_kill_and_an_unanswering_standby_stops_a_drain(
        replicas: ReplicaSet) -> None:
    old, epoch = replicas.leader()
    wait_until(lambda: healths(replicas)[old] == "SERVING", 10, message="the leader SERVING")
    assert healths(replicas)[1 - old] == "NOT_SERVING"
    probe = subprocess.run([sys.executable, "-m", "coordinator", "health", "--address",
                            replicas.replicas[1 - old].address],
                           capture_output=True, text=True, timeout=60)
    assert (probe.returncode, probe.stdout.strip()) == (1, "NOT_SERVING")
    replicas.wait_in_sync()

    replicas.replicas[old].kill()
    new, _ = replicas.leader(timeout=30, newer_than=epoch)
    wait_until(lambda: health(replicas, new) == "SERVING", 10, message="the new leader SERVING")
    replicas.replicas[old].start()
    assert health(replicas, old) == "NOT_SERVING"
    replicas.wait_in_sync()

    # A standby that stops answering cannot take over: the drain is refused and the
    # leader goes on leading, not draining.
    replicas.replicas[old].pause()
    try:
        with pytest.raises(grpc.RpcError) as refused:
            request_drain(replicas.replicas[new].address, None, "", timeout_s=2)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (refused.value.details() or "").startswith("no_standby: ")
        status = replicas.replicas[new].status()
        assert (status.role, status.draining) == ("leader", False)
        assert health(replicas, new) == "SERVING"
    finally:
        replicas.replicas[old].resume()


@pytest.mark.timeout(150)
def test_a_drained_leader_hands_over_to_the_standby_and_learners_follow_losing_nothing(
        long_lease_replicas: ReplicaSet, etcd: EtcdCluster, tmp_path: Path) -> None:
    replicas = long_lease_replicas

    async def scenario() -> None:
        old, epoch = replicas.leader()
        standby = 1 - old
        learners = Learners(tmp_path, [replicas.addresses, replicas.addresses,
                                       f"etcd://{','.join(etcd.endpoints)}/default"])
        learners.start()
        await wait_for(lambda: len(replicas.commits(old)) >= 10, 30, "commits by the leader")
        await asyncio.to_thread(replicas.wait_in_sync)
        asked = time.time()
        response = await asyncio.to_thread(
            request_drain, replicas.replicas[old].address, None, "", 20.0)
        assert response.role == "leader"
        assert response.leader == replicas.replicas[standby].address
        assert response.epoch > epoch
        process = replicas.replicas[old].process
        assert process is not None
        assert await asyncio.to_thread(process.wait, 15) == 0
        # Stepped down at once (its lease revoked), not after it expired.
        await wait_for(lambda: replicas.commits(standby, epoch, asked), 30,
                       "a commit by the new leader")
        took = replicas.commits(standby, epoch, asked)[0]["t"] - asked
        print(f"drain to first commit of epoch {response.epoch}: {took:.2f}s")
        assert took < LONG_TTL_S
        assert health(replicas, standby) == "SERVING"
        events = read_events(replicas.event_log(old))
        assert any(e["kind"] == "drain" for e in events)
        assert any(e["kind"] == "step_down" and e["reason"].startswith("drained")
                   for e in events)
        # Every learner follows the new leader.
        await wait_for(lambda: len(replicas.commits(standby, epoch)) >= 10, 30,
                       "commits after the hand-over")
        # The upgraded replica comes back as a standby.
        await asyncio.to_thread(replicas.replicas[old].start)
        assert health(replicas, old) == "NOT_SERVING"
        await asyncio.to_thread(replicas.wait_in_sync)
        await learners.finish()
        assert {c.address for c in learners.clients} == {replicas.replicas[standby].address}
        check_audit(replicas, learners)

    asyncio.run(scenario())
