"""Local processes for clusters: coordinators and learners on this machine.

The `process` backend of the chaos harness and the launcher of the demo and
the integration tests: each coordinator is its own process on an ephemeral
port with its own state directory, and callers wait on its `listening on`
line, never on a sleep.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.admin import request_drain
from coordinator.config import CoordinatorConfig, load, parse_overrides
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc
from protos import tls
from protos.tls import TlsConfig


class StartError(RuntimeError):
    """A process of an experiment's topology did not start; says why in one line."""


def setting_flags(pairs: list[str]) -> list[str]:
    """`--set KEY=VALUE` flags for a coordinator, checked against its configuration
    first (raises `ConfigError`), so that a benchmark given a wrong key fails before
    its first run instead of at each coordinator's start."""
    load(CoordinatorConfig, overrides=parse_overrides(pairs))
    return [flag for pair in pairs for flag in ("--set", pair)]


def admin_status(address: str, admin_tls: TlsConfig | None, admin_token: str,
                 timeout: float = 10.0) -> pb.StatusResponse:
    """A coordinator's Admin.Status, asked as an operator (token, admin certificate)."""
    with tls.channel(address, tls.load(admin_tls)) as channel:
        metadata = [("authorization", f"Bearer {admin_token}")] if admin_token else None
        response: pb.StatusResponse = pb_grpc.AdminStub(channel).Status(
            pb.StatusRequest(), timeout=timeout, metadata=metadata)
        return response


@dataclass
class CoordinatorProcess:
    """A `python -m coordinator` process; start() returns once it listens."""

    state_dir: Path
    args: list[str] = field(default_factory=list)
    process: subprocess.Popen[str] | None = None
    address: str = ""
    port: int = 0
    # The daemon's auth.admin_token, which its Admin.Status then asks for.
    admin_token: str = ""
    # An operator's TLS settings (the admin certificate), for a daemon serving TLS.
    admin_tls: TlsConfig | None = None

    def start(self, timeout: float = 30.0) -> CoordinatorProcess:
        listen = f"127.0.0.1:{self.port}"
        log_path = self.state_dir.parent / f"{self.state_dir.name}.stderr.log"
        with open(log_path, "a") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [sys.executable, "-m", "coordinator", "--listen", listen,
                 "--state-dir", str(self.state_dir), *self.args],
                stdout=subprocess.PIPE, stderr=log, text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout
        assert self.process.stdout is not None
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                # The daemon's start-up errors are one line: its last.
                said = next((text for text in reversed(log_path.read_text().splitlines())
                             if text.strip()), "")
                raise StartError(f"coordinator exited with {self.process.wait()}: {said} "
                                 f"(log: {log_path})")
            match = re.search(r"listening on (\S+):(\d+)", line)
            if match:
                self.port = int(match.group(2))
                self.address = f"127.0.0.1:{self.port}"
                return self
        raise StartError(f"coordinator did not start listening within {timeout:g} s "
                         f"(log: {log_path})")

    def kill(self) -> None:
        """SIGKILL: no clean shutdown, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: the process freezes with its sockets open, as in a partition
        that also stops its lease renewals."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused process cannot exit
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def status(self, timeout: float = 10.0) -> pb.StatusResponse:
        return admin_status(self.address, self.admin_tls, self.admin_token, timeout)

    def drain(self, timeout_s: float = 30.0) -> tuple[pb.DrainResponse, int]:
        """`Admin.Drain`, then the daemon's exit: (its answer, its exit status).
        Raises `grpc.RpcError` when it refuses (nothing changed then)."""
        assert self.process is not None
        response = request_drain(self.address, tls.load(self.admin_tls), self.admin_token,
                                 timeout_s)
        return response, self.process.wait(timeout=30)
