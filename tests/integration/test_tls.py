"""TLS and mutual TLS on every channel, with real handshakes on loopback: learners
and the coordinator, Admin, peers (gRPC and the bulk port), replicas and etcd.

Each refusal is checked for the words that name the problem and for the state it
leaves: nothing joined, nothing merged.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from chaos.etcd import EtcdCluster
from chaos.failover import ReplicaSet
from coordinator.certs import make_certificates
from learner.api import Learner
from learner.client import Refused, Retry, SynchronizerClient
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc
from protos import tls
from protos.tls import TlsConfig, TlsMaterial
from tests.daemon import Daemon, wait_until
from tests.integration.test_catchup import holds_published, mlp, push_every_fragment_once
from tests.integration.test_ha import REPLICA_SETTINGS, Learners, check_audit, wait_for

pytestmark = pytest.mark.timeout(120)

NUMELS = [3000, 1000]
LEARNERS = ("a", "b", "l0", "l1", "l2")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    make_certificates(out, [], LEARNERS)
    make_certificates(out / "other", [], ["a"])  # a CA the coordinator never heard of
    return out


def files(certs: Path, stem: str, ca: bool = True) -> TlsConfig:
    return TlsConfig(cert=str(certs / f"{stem}.pem"), key=str(certs / f"{stem}.key"),
                     ca=str(certs / "ca.pem") if ca else "")


def material(certs: Path, stem: str) -> TlsMaterial:
    loaded = tls.load(files(certs, stem))
    assert loaded is not None
    return loaded


def server_flags(certs: Path, mutual: bool = True) -> list[str]:
    flags = ["--tls-cert", str(certs / "coordinator.pem"),
             "--tls-key", str(certs / "coordinator.key")]
    return [*flags, "--tls-ca", str(certs / "ca.pem")] if mutual else flags


@pytest.fixture
def mutual(start_daemon: Callable[..., Daemon], certs: Path) -> Daemon:
    return start_daemon(*server_flags(certs), admin_tls=files(certs, "admin"))


def client(daemon: Daemon, learner_id: str, credentials: TlsMaterial | None,
           token: str | None = None) -> SynchronizerClient:
    return SynchronizerClient(daemon.address, learner_id, "layout-a", NUMELS, token=token,
                              retry=Retry(give_up_after_s=3), tls=credentials)


async def join_push_pull(c: SynchronizerClient) -> None:
    """Join, offer version 0, contribute once and pull the merged version 1."""
    await c.join()
    for p, n in enumerate(NUMELS):
        await c.push_initial(p, np.ones(n, dtype=np.float32))
    await c.push(0, np.full(NUMELS[0], 0.1, dtype=np.float32), base_version=0, c_tokens=100,
                 c_steps=10, local_step=10)
    pulled = await c.pull(0, have_version=0, wait_s=10.0)
    assert pulled is not None and pulled.version == 1
    await c.leave("done")
    await c.close()


def assert_untouched(daemon: Daemon) -> None:
    status = daemon.status()
    assert not status.learners and not status.fragments and status.bytes_in == 0


def test_a_learner_joins_pushes_and_pulls_as_itself_over_mutual_tls(mutual: Daemon,
                                                                     certs: Path) -> None:
    asyncio.run(join_push_pull(client(mutual, "a", material(certs, "learner-a"))))
    status = mutual.status()
    assert [learner.learner_id for learner in status.learners] == ["a"]
    assert status.fragments[0].merged_contributions == 1


def test_a_certificate_issued_to_another_learner_is_refused_counted_and_changes_nothing(
        mutual: Daemon, certs: Path) -> None:
    with pytest.raises(Refused) as refused:
        asyncio.run(client(mutual, "b", material(certs, "learner-a")).join())
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "issued to" in refused.value.details and "not to learner 'b'" in refused.value.details
    assert_untouched(mutual)
    assert mutual.status().rejections["unauthenticated"] >= 1


@pytest.mark.parametrize("case, words", [
    ("another CA", "not signed by the CA the server trusts"),
    ("no client certificate", "requires a client certificate"),
    ("plaintext", "serves TLS and this client speaks plaintext"),
    ("distrusts the server", "presents is not trusted"),
])
def test_a_learner_the_coordinator_cannot_trust_is_refused_with_the_reason(
        mutual: Daemon, certs: Path, case: str, words: str) -> None:
    credentials = {
        "another CA": tls.load(TlsConfig(cert=str(certs / "other" / "learner-a.pem"),
                                         key=str(certs / "other" / "learner-a.key"),
                                         ca=str(certs / "ca.pem"))),
        "no client certificate": tls.load(TlsConfig(ca=str(certs / "ca.pem"))),
        "plaintext": None,
        "distrusts the server": tls.load(TlsConfig(
            cert=str(certs / "learner-a.pem"), key=str(certs / "learner-a.key"),
            ca=str(certs / "other" / "ca.pem"))),
    }[case]
    with pytest.raises(Refused, match=words) as refused:
        asyncio.run(client(mutual, "a", credentials).join())
    assert refused.value.reason == "tls"
    assert_untouched(mutual)


def test_tls_without_client_certificates_keeps_bearer_tokens(
        start_daemon: Callable[..., Daemon], certs: Path) -> None:
    daemon = start_daemon(*server_flags(certs, mutual=False), "--set", 'auth.tokens.a="s3cret"',
                          admin_tls=TlsConfig(ca=str(certs / "ca.pem")))
    server_only = tls.load(TlsConfig(ca=str(certs / "ca.pem")))
    with pytest.raises(Refused, match="bad or missing bearer token"):
        asyncio.run(client(daemon, "a", server_only, token="wrong").join())
    assert_untouched(daemon)
    asyncio.run(join_push_pull(client(daemon, "a", server_only, token="s3cret")))


def test_admin_status_takes_the_admin_certificate_not_a_learners(
        mutual: Daemon, certs: Path) -> None:
    with tls.channel(mutual.address, material(certs, "learner-a")) as channel, \
            pytest.raises(grpc.RpcError) as refused:
        pb_grpc.AdminStub(channel).Status(pb.StatusRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "ftsync-admin" in str(refused.value.details())

    def status(stem: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "coordinator", "status", "--once", "--address",
             mutual.address, "--tls-cert", str(certs / f"{stem}.pem"),
             "--tls-key", str(certs / f"{stem}.key"), "--tls-ca", str(certs / "ca.pem")],
            capture_output=True, text=True, timeout=60)

    shown = status("admin")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "quorum" in shown.stdout
    refused_cli = status("learner-a")
    assert refused_cli.returncode == 1 and "refused by" in refused_cli.stdout


@pytest.mark.parametrize("flags, words", [
    (["--listen", "0.0.0.0:0"], "without TLS: give --tls-cert and --tls-key"),
    (["--tls-ca", "CA"], "tls.ca alone is not enough"),
    (["--tls-cert", "CERT"], "tls.cert and tls.key go together"),
])
def test_a_coordinator_refuses_to_start_insecurely_in_one_line(
        tmp_path: Path, certs: Path, flags: list[str], words: str) -> None:
    flags = [{"CA": str(certs / "ca.pem"), "CERT": str(certs / "coordinator.pem")}.get(f, f)
             for f in flags]
    started = subprocess.run([sys.executable, "-m", "coordinator", "--state-dir",
                              str(tmp_path / "state"), *flags],
                             capture_output=True, text=True, timeout=60)
    assert started.returncode != 0
    assert words in started.stderr.strip().splitlines()[-1]
    assert "listening" not in started.stdout


@pytest.mark.parametrize("transport", ["bulk", "grpc"])
def test_a_learner_catches_up_from_a_peer_over_mutual_tls(
        start_daemon: Callable[..., Daemon], certs: Path, transport: str) -> None:
    daemon = start_daemon(*server_flags(certs), "--set", "policy.grace_max_s=0",
                          admin_tls=files(certs, "admin"))
    model_a = mlp(seed=0)
    with Learner(daemon.address, model_a, sync_every=4, fragments=4, device="cpu",
                 learner_id="a", serve_peers="127.0.0.1:0",
                 tls=files(certs, "learner-a")) as a:
        assert a.peer_address is not None
        push_every_fragment_once(a, model_a)
        wait_until(lambda: min(f.version for f in daemon.status().fragments) == 1
                   and holds_published(daemon, str(a.peer_address),
                                       material(certs, "learner-b")),
                   message="version 1 of every fragment, held by the peer")
        with Learner(daemon.address, mlp(seed=1), sync_every=4, fragments=4, device="cpu",
                     learner_id="b", peers=[a.peer_address], peer_transport=transport,
                     tls=files(certs, "learner-b")) as b:
            assert b.catch_up is not None
            assert b.catch_up.sources == {p: a.peer_address for p in range(4)}
            assert b.catch_up.bytes_from_coordinator == 0


def test_a_peer_refuses_a_fetcher_without_a_certificate(
        start_daemon: Callable[..., Daemon], certs: Path) -> None:
    daemon = start_daemon(*server_flags(certs), admin_tls=files(certs, "admin"))
    with Learner(daemon.address, mlp(seed=0), sync_every=4, fragments=4, device="cpu",
                 learner_id="a", serve_peers="127.0.0.1:0",
                 tls=files(certs, "learner-a")) as a:
        assert a.peer_address is not None
        assert "requires a client certificate" in tls.diagnose(
            a.peer_address, tls.load(TlsConfig(ca=str(certs / "ca.pem"))))
        assert "serves TLS" in tls.diagnose(a.peer_address, None)


@pytest.fixture
def secure_etcd(tmp_path: Path, certs: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path / "etcd", size=1, tls=files(certs, "coordinator"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def test_replicas_replicate_and_fail_over_over_mutual_tls_with_etcd_on_tls(
        tmp_path: Path, certs: Path, secure_etcd: EtcdCluster) -> None:
    """No replication token: a standby takes versions only from a client presenting
    the coordinator's certificate, and etcd only serves clients with certificates."""
    cluster = ReplicaSet(tmp_path / "replicas", secure_etcd.endpoints, count=2,
                         args=[*REPLICA_SETTINGS, *server_flags(certs)],
                         admin_tls=files(certs, "admin"))
    cluster.root.mkdir()

    async def scenario() -> None:
        old, epoch = cluster.leader()
        learners = Learners(tmp_path, [cluster.addresses,
                                       f"etcd://{','.join(secure_etcd.endpoints)}/default"],
                            tls=lambda learner: material(certs, f"learner-{learner}"))
        learners.start()
        await wait_for(lambda: len(cluster.commits(old)) >= 5, 30, "commits by the leader")
        await asyncio.to_thread(cluster.wait_in_sync)
        cluster.replicas[old].kill()
        new, _ = await asyncio.to_thread(cluster.leader, 30.0, epoch)
        assert new != old
        await wait_for(lambda: cluster.commits(new, epoch), 30, "a commit by the new leader")
        await learners.finish()
        check_audit(cluster, learners)

    try:
        cluster.start()
        asyncio.run(scenario())
    finally:
        cluster.stop()


def test_a_standby_refuses_replication_from_a_learners_certificate(
        tmp_path: Path, certs: Path, secure_etcd: EtcdCluster) -> None:
    cluster = ReplicaSet(tmp_path / "replicas", secure_etcd.endpoints, count=2,
                         args=server_flags(certs), admin_tls=files(certs, "admin"))
    cluster.root.mkdir()
    try:
        cluster.start()
        old, _ = cluster.leader()
        standby = cluster.replicas[1 - old]
        with tls.channel(standby.address, material(certs, "learner-a")) as channel, \
                pytest.raises(grpc.RpcError) as refused:
            pb_grpc.ReplicationStub(channel).Replicate(iter([pb.ReplicaMessage()]), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "ftsync-coordinator" in str(refused.value.details())
        assert standby.status().rejections["unauthenticated"] == 1
    finally:
        cluster.stop()

