"""The generated stubs of protos/peer.proto (learner-to-learner catch-up) are current.

Like `test_proto_stubs` for ftsync.proto: the stubs are committed so that installing
ftsync needs no protoc; this regenerates them with the pinned grpcio-tools and fails,
saying how to regenerate, when someone edited the .proto and forgot to.
"""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO = "protos/peer.proto"
GENERATED = ["protos/peer_pb2.py", "protos/peer_pb2.pyi", "protos/peer_pb2_grpc.py"]
REGENERATE = ("python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. "
              f"--grpc_python_out=. {PROTO}")


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("peer-stubs")
    result = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={out}",
         f"--pyi_out={out}", f"--grpc_python_out={out}", PROTO],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, f"protoc failed on {PROTO}:\n{result.stderr}"
    return out


@pytest.mark.parametrize("name", GENERATED)
def test_committed_stub_matches_the_proto(regenerated: Path, name: str) -> None:
    fresh = (regenerated / name).read_bytes()
    committed_path = ROOT / name
    assert committed_path.exists(), f"{name} is missing; generate it with:\n  {REGENERATE}"
    committed = committed_path.read_bytes()
    if committed != fresh:
        diff = "".join(list(difflib.unified_diff(
            committed.decode(errors="replace").splitlines(keepends=True),
            fresh.decode(errors="replace").splitlines(keepends=True),
            fromfile=f"{name} (committed)", tofile=f"{name} (from {PROTO})"))[:40])
        pytest.fail(f"{name} is out of date with {PROTO}; regenerate the stubs from the "
                    f"repository root with:\n  {REGENERATE}\n\n{diff}", pytrace=False)


def test_nothing_else_is_generated(regenerated: Path) -> None:
    produced = sorted(str(p.relative_to(regenerated)) for p in regenerated.rglob("*")
                      if p.is_file())
    assert produced == sorted(GENERATED)


def test_the_peer_stream_reuses_the_pull_stream_of_ftsync_proto() -> None:
    """Fetch answers with `ftsync.v1.PullMessage`, so the two protos must agree on it."""
    from protos import ftsync_pb2, peer_pb2

    fetch = peer_pb2.DESCRIPTOR.services_by_name["PeerFragments"].methods_by_name["Fetch"]
    assert fetch.output_type is ftsync_pb2.PullMessage.DESCRIPTOR
