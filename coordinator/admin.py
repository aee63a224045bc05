"""The operator's side of a running coordinator: `ftsync-coordinator health` and `drain`.

`health` asks the standard health service whether a coordinator can commit
now, the probe docker and Kubernetes run; its exit status is the verdict.
`drain` asks, through `Admin.Drain`, that it take no new rounds, commit the
open ones, hand its leadership to an in-sync standby (replicas) and exit,
then waits until it has, so a script can upgrade and restart it at once.
Both take the TLS flags of every console script; `drain` needs the admin
token or certificate, as `status` does. The chaos harness drains through
`request_drain` too.
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.errors import Reason
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc
from protos import metadata, tls

# Exit statuses of `drain` besides 0 (drained) and 2 (bad flags or TLS files).
DRAIN_FAILED = 1  # unreachable, or refused (credentials)
DRAIN_NO_STANDBY = 3  # refused with nothing changed: no standby in sync to take over
# How long `drain` waits for the drained daemon to exit.
_EXIT_WAIT_S = 15.0


def check_health(address: str, material: tls.TlsMaterial | None, service: str = "",
                 timeout_s: float = 5.0) -> str:
    """The status the health service reports for `service` ("SERVING", ...);
    raises `grpc.RpcError` (NOT_FOUND for a service it does not know)."""
    with tls.channel(address, material) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def request_drain(address: str, material: tls.TlsMaterial | None, token: str,
                  timeout_s: float) -> pb.DrainResponse:
    """`Admin.Drain`, answered once the coordinator has drained; `grpc.RpcError`
    when it cannot be reached or refuses."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with tls.channel(address, material) as channel:
        response: pb.DrainResponse = pb_grpc.AdminStub(channel).Drain(
            pb.DrainRequest(timeout_s=timeout_s), timeout=timeout_s + 30, metadata=metadata)
    return response


def run(args: argparse.Namespace) -> int:
    """`ftsync-coordinator health` or `drain` (`args.command`); the exit status."""
    try:
        material = tls.load(tls.from_flags(args))
    except (ValueError, tls.TlsError) as exc:
        print(f"ftsync-coordinator {args.command}: {exc}", file=sys.stderr)
        return 2
    command = _health if args.command == "health" else _drain
    return command(args, material)


def _health(args: argparse.Namespace, material: tls.TlsMaterial | None) -> int:
    """0 when the coordinator is SERVING, 1 otherwise; the status on stdout."""
    try:
        status = check_health(args.address, material, args.service, args.timeout)
    except grpc.RpcError as exc:
        print(f"UNKNOWN: {_unreachable(args.address, material, exc)}")
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def _drain(args: argparse.Namespace, material: tls.TlsMaterial | None) -> int:
    try:
        response = request_drain(args.address, material, args.token or "", args.timeout)
    except grpc.RpcError as exc:
        if metadata.reason(exc) == Reason.NO_STANDBY.value:
            print(f"ftsync-coordinator drain: {args.address} did not drain, nothing changed: "
                  f"{exc.details()}", file=sys.stderr)
            return DRAIN_NO_STANDBY
        print(f"ftsync-coordinator drain: {_unreachable(args.address, material, exc)}",
              file=sys.stderr)
        return DRAIN_FAILED
    left = (f"; rounds short of quorum left to their learners on fragments "
            f"{', '.join(map(str, response.rounds_left_open))}"
            if response.rounds_left_open else "")
    leader = (f"; {response.leader} leads now (epoch {response.epoch})" if response.leader
              else "")
    print(f"drained {args.address} ({response.role}): {response.rounds_committed} versions "
          f"committed{left}{leader}")
    if _exited(args.address, material):
        print("it has exited: restart it (upgraded) on the same state directory")
    else:
        print(f"it had not exited {_EXIT_WAIT_S:g} s later", file=sys.stderr)
    return 0


def _unreachable(address: str, material: tls.TlsMaterial | None, exc: grpc.RpcError) -> str:
    """Why a call to `address` failed, in one line (a TLS mismatch said as such)."""
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        problem = tls.diagnose(address, material)
        if problem:
            return problem
    verb = "refused by" if code == grpc.StatusCode.UNAUTHENTICATED else "cannot reach"
    if code == grpc.StatusCode.NOT_FOUND:
        verb = "no such service at"
    return f"{verb} the coordinator at {address}: {code.name} {exc.details()}"


def _exited(address: str, material: tls.TlsMaterial | None) -> bool:
    """Whether the daemon at `address` stops answering within _EXIT_WAIT_S."""
    deadline = time.monotonic() + _EXIT_WAIT_S
    while time.monotonic() < deadline:
        try:
            check_health(address, material, timeout_s=1.0)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                return True
        time.sleep(0.1)
    return False
