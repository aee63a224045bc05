"""The generated gRPC stubs in protos/ match protos/ftsync.proto.

The stubs are committed so that installing ftsync needs no protoc; this test regenerates them
with the pinned grpcio-tools and fails, saying how to regenerate, when someone edited the
.proto and forgot to.
"""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO = "protos/ftsync.proto"
GENERATED = ["protos/ftsync_pb2.py", "protos/ftsync_pb2.pyi", "protos/ftsync_pb2_grpc.py"]
REGENERATE = ("python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. "
              f"--grpc_python_out=. {PROTO}")


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stubs")
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
