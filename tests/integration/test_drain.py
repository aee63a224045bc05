"""Health, drain and metrics of an embedded coordinator, on real daemon processes.

The standard health service says SERVING while the coordinator can commit and
NOT_SERVING while it drains; `ftsync-coordinator health` turns that into its
exit status. `Admin.Drain` (and `ftsync-coordinator drain`) refuses to open
new rounds, lets the open ones reach quorum and commit, answers and exits 0;
restarted on its state directory the coordinator resumes every committed
version, and `chaos.failover.audit` finds every acknowledged contribution
merged exactly once. Without the admin credentials a drain is refused and
changes nothing. Prometheus serves /metrics at `--prometheus-listen`.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from chaos.etcd import free_port
from chaos.failover import audit
from coordinator.admin import check_health, request_drain
from learner.client import Retry, SynchronizerClient
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc
from protos.events import EventLog
from tests.daemon import Daemon, wait_until
from tests.integration import test_tls
from tests.integration.test_tls import server_flags

StartDaemon = Callable[..., Daemon]
# A CA with coordinator, admin and learner certificates (module-scoped), as in test_tls.
certs = test_tls.certs
NUMELS = [1000, 500]
SYNCHRONIZER = "ftsync.v1.Synchronizer"


def coordinator_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator", *args], capture_output=True,
                          text=True, timeout=60)


def health(daemon: Daemon, service: str = "") -> str:
    return check_health(daemon.address, None, service)


async def contribute(client: SynchronizerClient, fragment: int) -> None:
    await client.push(fragment, np.full(NUMELS[fragment], 0.01, dtype=np.float32),
                      base_version=0, c_tokens=100, c_steps=10, local_step=10)


def push_raw(daemon: Daemon, learner_id: str, fragment: int, seq: int) -> pb.PushResponse:
    """One contribution over a bare stub: its refusal reaches the test as it is."""
    header = pb.PushHeader(learner_id=learner_id, fragment=fragment, layout_hash="layout-d",
                           seq=seq, base_version=0, c_tokens=100, c_steps=10, local_step=1,
                           codec=pb.CODEC_FP32, numel=NUMELS[fragment])
    chunk = pb.Chunk(offset=0, count=NUMELS[fragment],
                     data=np.zeros(NUMELS[fragment], "<f4").tobytes())
    with grpc.insecure_channel(daemon.address) as channel:
        response: pb.PushResponse = pb_grpc.SynchronizerStub(channel).PushFragment(
            iter([pb.PushMessage(header=header), pb.PushMessage(chunk=chunk)]), timeout=10)
    return response


def test_the_health_command_says_serving_then_drain_stops_the_daemon(
        start_daemon: StartDaemon) -> None:
    daemon = start_daemon()
    assert health(daemon) == "SERVING"
    assert health(daemon, SYNCHRONIZER) == "SERVING"
    probe = coordinator_cli("health", "--address", daemon.address)
    assert (probe.returncode, probe.stdout.strip()) == (0, "SERVING")
    unknown = coordinator_cli("health", "--address", daemon.address, "--service", "nope")
    assert unknown.returncode == 1 and "no such service" in unknown.stdout
    drained = coordinator_cli("drain", "--address", daemon.address)
    assert drained.returncode == 0, drained.stderr
    assert "(leader): 0 versions committed" in drained.stdout
    assert "it has exited" in drained.stdout
    assert daemon.process is not None and daemon.process.wait(timeout=15) == 0
    gone = coordinator_cli("health", "--address", daemon.address, "--timeout", "2")
    assert gone.returncode == 1 and gone.stdout.startswith("UNKNOWN")


def test_health_and_drain_over_mutual_tls_take_the_tls_flags(
        start_daemon: StartDaemon, certs: Path) -> None:
    daemon = start_daemon(*server_flags(certs), admin_tls=test_tls.files(certs, "admin"))

    def as_(stem: str) -> list[str]:
        return ["--tls-cert", str(certs / f"{stem}.pem"), "--tls-key", str(certs / f"{stem}.key"),
                "--tls-ca", str(certs / "ca.pem")]

    plaintext = coordinator_cli("health", "--address", daemon.address)
    assert plaintext.returncode == 1 and "this client speaks plaintext" in plaintext.stdout
    # Any certificate the CA signed may probe; only the admin's may drain.
    probe = coordinator_cli("health", "--address", daemon.address, *as_("learner-a"))
    assert (probe.returncode, probe.stdout.strip()) == (0, "SERVING")
    refused = coordinator_cli("drain", "--address", daemon.address, *as_("learner-a"))
    assert refused.returncode == 1 and "ftsync-admin" in refused.stderr
    assert not daemon.status().draining
    drained = coordinator_cli("drain", "--address", daemon.address, *as_("admin"))
    assert drained.returncode == 0, drained.stderr
    assert daemon.process is not None and daemon.process.wait(timeout=15) == 0


def test_drain_without_the_admin_credentials_is_refused_and_changes_nothing(
        start_daemon: StartDaemon) -> None:
    daemon = start_daemon("--set", "auth.admin_token=ops-only")
    daemon.admin_token = "ops-only"  # for the test's own Status calls
    for token in ("", "wrong"):
        with pytest.raises(grpc.RpcError) as refused:
            request_drain(daemon.address, None, token, timeout_s=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "Drain needs the admin token" in (refused.value.details() or "")
    command = coordinator_cli("drain", "--address", daemon.address)
    assert command.returncode == 1 and "UNAUTHENTICATED" in command.stderr
    status = daemon.status()
    assert not status.draining and status.role == "leader"
    assert status.rejections["unauthenticated"] == 3
    assert health(daemon) == "SERVING"
    assert daemon.process is not None and daemon.process.poll() is None
    # Still taking rounds.
    client = SynchronizerClient(daemon.address, "a", "layout-d", NUMELS)

    async def scenario() -> None:
        await client.join()
        assert await client.push_initial(0, np.ones(NUMELS[0], dtype=np.float32))
        await contribute(client, 0)
        assert await client.pull(0, have_version=0, wait_s=10) is not None
        await client.close()

    asyncio.run(scenario())
    # With the token it drains.
    assert request_drain(daemon.address, None, "ops-only", timeout_s=10).role == "leader"
    assert daemon.process.wait(timeout=15) == 0


def test_drain_commits_the_open_round_refuses_new_ones_and_exits_with_nothing_lost(
        start_daemon: StartDaemon, tmp_path: Path) -> None:
    """Quorum 2 and a long grace window: a's contribution holds a round open as the
    drain begins. The drain refuses a push that would open another round, takes
    b's contribution into the open one, commits it and exits 0."""
    log = tmp_path / "coordinator.events.jsonl"
    state = tmp_path / "state"
    daemon = start_daemon("--min-quorum", "2", "--set", "policy.grace_max_s=30",
                          "--event-log", str(log), state_dir=state)
    logs = [tmp_path / f"{lid}.events.jsonl" for lid in ("a", "b")]
    a, b = (SynchronizerClient(daemon.address, lid, "layout-d", NUMELS,
                               retry=Retry(give_up_after_s=20),
                               events=EventLog(str(path), source=lid))
            for lid, path in zip(("a", "b"), logs, strict=True))

    async def scenario() -> pb.DrainResponse:
        await a.join()
        await b.join()
        for fragment, numel in enumerate(NUMELS):
            assert await a.push_initial(fragment, np.ones(numel, dtype=np.float32))
        await contribute(a, 0)
        assert daemon.status().fragments[0].round_learners == ["a"]
        drain = asyncio.ensure_future(asyncio.to_thread(
            request_drain, daemon.address, None, "", 20.0))
        await asyncio.to_thread(wait_until, lambda: daemon.status().draining, 10, 0.02,
                                "the drain to begin")
        await asyncio.to_thread(wait_until, lambda: health(daemon) == "NOT_SERVING", 10, 0.02,
                                "NOT_SERVING while draining")
        with pytest.raises(grpc.RpcError) as refused:
            push_raw(daemon, "b", fragment=1, seq=100)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (refused.value.details() or "").startswith("draining: ")
        assert not drain.done()  # the round short of quorum keeps it waiting
        await contribute(b, 0)
        response = await drain
        for client in (a, b):
            await client.close()
        return response

    response = asyncio.run(scenario())
    assert (response.role, response.rounds_committed) == ("leader", 1)
    assert list(response.rounds_left_open) == [] and response.leader == ""
    assert daemon.process is not None and daemon.process.wait(timeout=15) == 0
    result = audit([state], [log], logs)
    assert result.ok and result.merged == 2, result
    # The upgraded coordinator resumes the committed version.
    again = start_daemon(state_dir=state)
    assert [f.version for f in again.status().fragments] == [1, 0]
    assert health(again) == "SERVING"


def test_prometheus_serves_metrics_at_the_given_host_and_port(
        start_daemon: StartDaemon) -> None:
    port = free_port()
    daemon = start_daemon("--prometheus-listen", f"localhost:{port}")
    with grpc.insecure_channel(daemon.address) as channel, pytest.raises(grpc.RpcError):
        pb_grpc.SynchronizerStub(channel).Join(pb.JoinRequest(learner_id=""), timeout=10)
    with urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert any(line.startswith("ftsync_rejections") and 'reason="malformed"' in line
               for line in text.splitlines()), text[:2000]
    # Said at start, before the listening line the harness waits for.
    log = daemon.state_dir.parent / f"{daemon.state_dir.name}.stderr.log"
    assert f"metrics on http://localhost:{port}/metrics" in log.read_text()
