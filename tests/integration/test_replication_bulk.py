"""Replication on the bulk channel, between real coordinator replicas on real etcd.

A standby's durable state after replication over its bulk port equals the leader's,
bit for bit, and leaves out a zero momentum only for a standby whose registration asks
for that; a replica whose frame fails its checksum is refused as `corrupt` and
nothing of it is written; and a standby whose bulk port the leader cannot reach (its
advertised address is a fault proxy that mirrors only the gRPC port, as behind a
NAT) takes the same versions as gRPC chunks, the fall-back said once.

Each test starts its own etcd and replicas on ephemeral loopback ports, and waits on
the replicas' event logs and metrics, never on the clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from chaos.etcd import EtcdCluster
from chaos.failover import ReplicaSet
from chaos.local import CoordinatorProcess
from chaos.proxy import ThreadedProxy
from coordinator.config import HaConfig
from coordinator.durability import FragmentRecord, RunRecord, StateDir
from coordinator.etcd import Etcd
from coordinator.replication import replica_header
from protos import discovery, metadata
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc
from protos.bulk import send_frames
from protos.tls import REPLICA_NAME
from tests.daemon import wait_until
from tests.integration.test_bad_input import free_port, metrics_text
from tests.integration.test_bulk import frame, hello
from tests.integration.test_ha import NUMELS, REPLICA_ARGS, REPLICA_TOKEN, Learners, wait_for

pytestmark = pytest.mark.slow

TIMEOUT = 20.0


class Replicas:
    """Two replicas, each with its own metrics port; the second started only once the
    first leads, optionally advertised through `proxy` (gRPC only, no bulk port)."""

    def __init__(self, root: Path, etcd: EtcdCluster, behind_proxy: bool = False) -> None:
        self.set = ReplicaSet(root / "replicas", etcd.endpoints, count=2, args=REPLICA_ARGS)
        self.set.root.mkdir()
        self.metrics = [free_port(), free_port()]
        for replica, port in zip(self.set.replicas, self.metrics, strict=True):
            replica.args += ["--prometheus-listen", str(port)]
        self.proxy: ThreadedProxy | None = None
        if behind_proxy:
            standby = self.set.replicas[1]
            standby.port = free_port()
            self.proxy = ThreadedProxy(f"127.0.0.1:{standby.port}", host="127.0.0.2")
            standby.args += ["--advertise", f"127.0.0.2:{self.proxy.start()}"]

    def start(self) -> Replicas:
        self.set.replicas[0].start()
        assert self.set.leader()[0] == 0
        self.set.replicas[1].start()
        self.set.wait_in_sync()
        return self

    def stop(self) -> None:
        self.set.stop()
        if self.proxy is not None:
            self.proxy.stop()

    def transfers(self, index: int) -> dict[str, float]:
        """The replica's `ftsync_transfers` of replicas, by transport."""
        counts = {}
        for line in metrics_text(self.metrics[index]).splitlines():
            if line.startswith("ftsync_transfers_total{") and 'direction="replicate"' in line:
                transport = line.split('transport="', 1)[1].split('"', 1)[0]
                counts[transport] = float(line.rsplit(" ", 1)[1])
        return counts

    def train(self, root: Path, commits: int) -> None:
        """Learners pushing until the leader has committed `commits` versions."""
        async def run() -> None:
            learners = Learners(root, [self.set.addresses] * 2)
            learners.start()
            await wait_for(lambda: len(self.set.commits(0)) >= commits, 60,
                           f"{commits} commits by the leader")
            await learners.finish()
        asyncio.run(run())


@pytest.fixture
def replicas(tmp_path: Path, etcd: EtcdCluster) -> Iterator[Replicas]:
    pair = Replicas(tmp_path, etcd)
    try:
        yield pair.start()
    finally:
        pair.stop()


@pytest.fixture
def replicas_behind_nat(tmp_path: Path, etcd: EtcdCluster) -> Iterator[Replicas]:
    pair = Replicas(tmp_path, etcd, behind_proxy=True)
    try:
        yield pair.start()
    finally:
        pair.stop()


def records(state_dir: Path) -> list[FragmentRecord | None]:
    state = StateDir(state_dir, fsync=False)
    return [state.load_fragment(p) for p in range(len(NUMELS))]


def assert_standby_equals_leader(pair: Replicas) -> None:
    """Once the standby holds the leader's newest version of every fragment, the two
    durable records are the same, bit for bit."""
    leader = records(pair.set.state_dirs()[0])
    assert all(r is not None and r.version > 0 for r in leader), leader
    wait_until(lambda: [r and r.version for r in records(pair.set.state_dirs()[1])]
               == [r and r.version for r in leader], TIMEOUT)
    for mine, theirs in zip(leader, records(pair.set.state_dirs()[1]), strict=True):
        assert mine is not None and theirs is not None
        np.testing.assert_array_equal(theirs.params, mine.params)
        np.testing.assert_array_equal(theirs.momentum, mine.momentum)
        assert (theirs.watermarks, theirs.manifest, theirs.epoch, theirs.commit_id) == (
            mine.watermarks, mine.manifest, mine.epoch, mine.commit_id)


@pytest.mark.timeout(120)
def test_a_standby_replicated_over_its_bulk_port_holds_the_leaders_state(
        replicas: Replicas, tmp_path: Path) -> None:
    replicas.train(tmp_path, commits=6)
    assert_standby_equals_leader(replicas)
    # Every version went as frames on the standby's bulk port, none as chunks.
    assert set(replicas.transfers(1)) == {"bulk"}, replicas.transfers(1)
    assert not [e for e in replicas.set.events(0) if e["kind"] == "bulk_fallback"]
    # Without outer momentum (the default) each version went without it, as the
    # standby's registration asks, and its files leave it out too.
    assert all(r is not None and r.zero_momentum for r in records(replicas.set.state_dirs()[1]))


@pytest.mark.timeout(120)
def test_a_standby_registered_by_an_older_build_gets_whole_records(
        replicas: Replicas, tmp_path: Path, etcd: EtcdCluster) -> None:
    """A registration without `zero_momentum` is an older build's, which reads only
    whole records: the leader rebuilds its link and sends the momentum, zero or not."""
    async def reregister_as_an_older_build() -> None:
        client = Etcd(etcd.endpoints)
        try:
            key = discovery.replicas_prefix(HaConfig().run) + b"r1"
            entry = await client.get(key)
            assert entry is not None and json.loads(entry.value)["zero_momentum"] is True
            older = json.dumps({"replica": "r1", "address": replicas.set.replicas[1].address})
            await client.put(key, older.encode(), entry.lease)
        finally:
            await client.close()

    asyncio.run(reregister_as_an_older_build())
    # The rebuilt link catches the standby up again, then it is in sync once more.
    wait_until(lambda: sum(e["kind"] == "standby_in_sync" for e in replicas.set.events(0)) >= 2,
               TIMEOUT)
    replicas.train(tmp_path, commits=4)
    assert_standby_equals_leader(replicas)
    standby = records(replicas.set.state_dirs()[1])
    assert all(r is not None and not r.zero_momentum and not r.momentum.any()
               for r in standby), standby


@contextlib.contextmanager
def bulk_replicate(standby: CoordinatorProcess, header: pb.ReplicaMessage
                   ) -> Iterator[tuple[socket.socket, Callable[[], pb.ReplicaAck]]]:
    """A `Replicate` call to `standby` asking for its bulk port, the connection opened
    there with the call's ticket, taken (the frames are the caller's to send), and the
    call's result, which ends the stream as a leader does once its frames are sent."""
    header.header.bulk = True
    sent = threading.Event()

    def messages() -> Iterator[pb.ReplicaMessage]:
        yield header
        sent.wait(TIMEOUT)  # the stream ends once the frames are sent

    with grpc.insecure_channel(standby.address) as channel:
        call = pb_grpc.ReplicationStub(channel).Replicate.future(
            messages(), timeout=TIMEOUT, metadata=(("authorization", f"Bearer {REPLICA_TOKEN}"),))
        try:
            initial = dict(call.initial_metadata())
            ticket = bytes.fromhex(initial[metadata.BULK_TICKET])
            with socket.create_connection(("127.0.0.1", int(initial[metadata.BULK_PORT])),
                                          timeout=TIMEOUT) as conn:
                conn.sendall(hello(ticket, REPLICA_NAME))
                assert conn.recv(1) == b"\x00"  # the ticket taken

                def result() -> pb.ReplicaAck:
                    sent.set()
                    ack: pb.ReplicaAck = call.result()
                    return ack

                yield conn, result
        finally:
            sent.set()


@pytest.mark.timeout(120)
def test_a_replica_whose_frame_fails_its_checksum_is_refused_and_nothing_is_written(
        replicas: Replicas) -> None:
    _, epoch = replicas.set.leader()
    standby = replicas.set.replicas[1]
    before = records(standby.state_dir)
    numel = NUMELS[0]
    values = np.random.default_rng(0).standard_normal(2 * numel).astype(np.float32)
    record = FragmentRecord(0, 10_000, values[:numel], values[numel:], {}, [], epoch)
    header = replica_header(epoch, "r0", RunRecord("x", "layout-ha", tuple(NUMELS)), record)
    with bulk_replicate(standby, header) as (conn, result):
        conn.sendall(frame(values, 0, digest=12345))
        with pytest.raises(grpc.RpcError) as refused:
            result()
    assert refused.value.code() == grpc.StatusCode.DATA_LOSS
    assert metadata.reason(refused.value) == "corrupt"
    assert "frame at offset 0 of the replica of fragment 0 fails its checksum" in (
        refused.value.details() or "")
    assert dict(standby.status().rejections).get("corrupt") == 1
    after = records(standby.state_dir)
    assert [r and r.version for r in after] == [r and r.version for r in before]
    assert not [e for e in replicas.set.events(1)
                if e["kind"] == "replicated" and e["version"] == 10_000]


@pytest.mark.timeout(120)
def test_a_replica_without_its_zero_momentum_is_written_with_it(replicas: Replicas) -> None:
    _, epoch = replicas.set.leader()
    standby = replicas.set.replicas[1]
    numel = NUMELS[0]
    params = np.random.default_rng(1).standard_normal(numel).astype(np.float32)
    record = FragmentRecord(0, 10_000, params, np.zeros(numel, np.float32), {}, [], epoch)
    header = replica_header(epoch, "r0", RunRecord("x", "layout-ha", tuple(NUMELS)), record,
                            zero_momentum=True)
    with bulk_replicate(standby, header) as (conn, result):
        assert send_frames(conn, params) == 4 * numel  # the parameters only
        ack = result()
    assert (ack.fragment, ack.version) == (0, 10_000)
    written = records(standby.state_dir)[0]
    assert written is not None and written.version == 10_000
    np.testing.assert_array_equal(written.params, params)
    # Written as zero, and so left out of the standby's file too.
    assert written.zero_momentum and written.momentum.shape == (numel,)
    assert not written.momentum.any()


@pytest.mark.timeout(120)
def test_a_standby_whose_bulk_port_cannot_be_reached_takes_the_versions_as_grpc_chunks(
        replicas_behind_nat: Replicas, tmp_path: Path) -> None:
    pair = replicas_behind_nat
    pair.train(tmp_path, commits=6)
    assert_standby_equals_leader(pair)
    fallbacks = [e for e in pair.set.events(0) if e["kind"] == "bulk_fallback"]
    assert len(fallbacks) == 1, fallbacks  # said once, for the standby
    assert fallbacks[0]["replica"] == "r1"
    assert fallbacks[0]["address"].startswith("127.0.0.2:")
    # The first replica asked for bulk and fell back on its call; the rest asked for none.
    transfers = pair.transfers(1)
    assert transfers.get("grpc_fallback") == 1 and transfers.get("grpc", 0) >= 1, transfers
    assert "bulk" not in transfers
