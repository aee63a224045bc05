"""docs/protocol.md stays in step with the proto and the daemon it describes.

The guide is the contract for learners written without ftsync's code, so what it
states is checked against what runs: its Python examples execute, its refusal table
is the status table of `coordinator.service`, its metadata keys and codec table are
those of `protos`, every message field it names exists, every RPC is described, and
the version it is written for is the proto's package. The documented layout hash of
the synthetic task is the one the built-in learner computes, as the minimal learner
computes it. And the README and docs/ link only files in the repository.
(tests/unit/test_proto_stubs.py keeps the generated stubs in step with the proto.)
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from coordinator.errors import Reason
from coordinator.health import SERVICES
from coordinator.service import PACKAGE, STATUS_CODES
from learner.synthetic import RegressionTask, layout_hash
from protos import ftsync_pb2 as pb
from protos import metadata
from protos.codec import codec_for

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "protocol.md"
TEXT = GUIDE.read_text()


def table(heading: str) -> list[list[str]]:
    """The rows of the first table whose header row starts with `heading`."""
    lines = TEXT.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {heading} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def unquoted(cell: str) -> str:
    return cell.strip("`")


def test_the_guide_is_for_the_protos_version() -> None:
    assert PACKAGE == pb.DESCRIPTOR.package == "ftsync.v1"
    assert TEXT.splitlines()[0] == f"# The ftsync protocol, version `{PACKAGE}`"
    assert f"package {PACKAGE};" in TEXT
    for path in re.findall(r"/ftsync\.v\d+\.\w+/\w+", TEXT):
        service, method = path.strip("/").rsplit("/", 1)
        if service.startswith(PACKAGE + "."):
            assert method in pb.DESCRIPTOR.services_by_name[service.split(".")[-1]] \
                .methods_by_name, path


@pytest.mark.parametrize("block", re.findall(r"```python\n(.*?)```", TEXT, re.DOTALL))
def test_every_example_runs(block: str) -> None:
    exec(compile(block, str(GUIDE), "exec"), {})


def test_the_refusal_table_is_the_daemons() -> None:
    documented = {unquoted(row[0]): unquoted(row[1]) for row in table("reason")}
    assert documented == {r.value: STATUS_CODES[r].name for r in Reason}


def test_the_metadata_keys_are_the_ones_protos_names() -> None:
    keys = {unquoted(row[0]) for row in table("metadata key")}
    assert keys == {metadata.REASON, metadata.LEADER, metadata.MERGED_SEQ}
    bulk = {unquoted(row[0]) for row in table("initial metadata key")}
    assert bulk == {metadata.BULK_TICKET, metadata.BULK_PORT}


def test_the_codec_table_is_the_codecs() -> None:
    sizes = {"4n": 32, "2n": 16, "n": 8, "ceil(n / 2)": 4}
    rows = table("codec")
    assert {unquoted(row[0]) for row in rows} == set(pb.Codec.keys())
    for row in rows:
        codec = codec_for(pb.Codec.Value(unquoted(row[0])))
        assert codec.bits == sizes[row[1]], row
        assert codec.scaled == (row[3] != "ignored"), row


def test_every_field_the_guide_names_exists() -> None:
    named = set(re.findall(r"`([A-Z][A-Za-z]+)\.([a-z_]+)", TEXT))
    assert named, "the guide names no fields"
    for message, field in named:
        if message in ("Admin",):
            continue
        descriptor = pb.DESCRIPTOR.message_types_by_name.get(message)
        assert descriptor is not None, f"{message} is not a message of ftsync.proto"
        assert field in descriptor.fields_by_name, f"{message}.{field} does not exist"


def test_every_rpc_is_described() -> None:
    for service in pb.DESCRIPTOR.services_by_name.values():
        if service.name == "Replication":  # between replicas: not a learner's business
            continue
        for method in service.methods:
            name = method.name if service.name == "Synchronizer" else \
                f"{service.name}.{method.name}"
            assert f"`{name}" in TEXT, f"{service.name}.{method.name} is not in the guide"


def test_the_health_service_names_are_the_daemons() -> None:
    assert ("", f"{PACKAGE}.Synchronizer") == SERVICES
    assert f'`""` (the server) and `{SERVICES[1]}`' in TEXT


def minimal_learner() -> ModuleType:
    path = ROOT / "learner" / "examples" / "minimal_learner.py"
    spec = importlib.util.spec_from_file_location("minimal_learner", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("dim", "fragments"), [(1024, 4), (512, 3), (30, 22), (7, 7)])
def test_the_documented_layout_hash_is_the_built_in_learners(dim: int, fragments: int) -> None:
    bounds = RegressionTask(dim=dim).fragment_bounds(fragments)
    built_in = layout_hash([b - a for a, b in bounds], f"synthetic-{dim}")
    assert minimal_learner().layout(dim, fragments) == (bounds, built_in)


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", ["README.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_links_stay_in_the_repository(page: str) -> None:
    path = ROOT / page
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+://", target):
            continue  # a web page, not a file
        resolved = (path.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{page} links {target}, outside the repository"
        assert resolved.exists(), f"{page} links {target}, which does not exist"
