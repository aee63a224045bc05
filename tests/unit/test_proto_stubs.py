"""The generated gRPC stubs in protos/ match their .proto files.

The stubs are committed so that installing ftsync needs no protoc; this test regenerates them
with the pinned grpcio-tools and fails, saying how to regenerate, when someone edited a
.proto and forgot to.
"""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# ftsync.proto is the learner/coordinator contract; peer.proto is learner-to-learner catch-up.
PROTOS = ["protos/ftsync.proto", "protos/peer.proto"]


def generated(proto: str) -> list[str]:
    stem = proto.removesuffix(".proto")
    return [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"]


def regenerate_command(proto: str) -> str:
    return ("python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. "
            f"--grpc_python_out=. {proto}")


@pytest.fixture(scope="module", params=PROTOS)
def regenerated(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    proto: str = request.param
    out = tmp_path_factory.mktemp("stubs")
    result = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={out}",
         f"--pyi_out={out}", f"--grpc_python_out={out}", proto],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, f"protoc failed on {proto}:\n{result.stderr}"
    return proto, out


def test_committed_stubs_match_the_proto(regenerated: tuple[str, Path]) -> None:
    proto, out = regenerated
    for name in generated(proto):
        fresh = (out / name).read_bytes()
        committed_path = ROOT / name
        assert committed_path.exists(), (
            f"{name} is missing; generate it with:\n  {regenerate_command(proto)}")
        committed = committed_path.read_bytes()
        if committed != fresh:
            diff = "".join(list(difflib.unified_diff(
                committed.decode(errors="replace").splitlines(keepends=True),
                fresh.decode(errors="replace").splitlines(keepends=True),
                fromfile=f"{name} (committed)", tofile=f"{name} (from {proto})"))[:40])
            pytest.fail(f"{name} is out of date with {proto}; regenerate the stubs from the "
                        f"repository root with:\n  {regenerate_command(proto)}\n\n{diff}",
                        pytrace=False)


def test_nothing_else_is_generated(regenerated: tuple[str, Path]) -> None:
    proto, out = regenerated
    produced = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert produced == sorted(generated(proto))


def test_the_peer_stream_reuses_the_pull_stream_of_ftsync_proto() -> None:
    """Fetch answers with `ftsync.v1.PullMessage`, so the two protos must agree on it."""
    from protos import ftsync_pb2, peer_pb2

    fetch = peer_pb2.DESCRIPTOR.services_by_name["PeerFragments"].methods_by_name["Fetch"]
    assert fetch.output_type is ftsync_pb2.PullMessage.DESCRIPTOR
