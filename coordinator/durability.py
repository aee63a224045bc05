"""Durable state of the synchronizer in its state directory.

The daemon writes a fragment's file before it publishes the version in it,
so a version a learner has seen is never lost when the daemon dies. Each
file holds one fragment's committed version: fp32 parameters, outer-momentum,
the per-learner merged-seq watermarks and the version's manifest, behind a
checksummed header, written to a temporary file, fsynced and renamed into
place. `manifests.jsonl` keeps every manifest, for the exactly-once checkers.
With high availability each record also names the epoch of the leader that
committed it, and a standby writes the versions the leader streams to it the
same way; where two records share a fragment and version, the one of the
newer epoch stands (the other was written by a deposed leader and never
published). Called by `coordinator.store` on each commit and at start-up,
and by `coordinator.engine` for replicated versions.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"FTSYNCF1"
# Header length, then the CRC-32 of header and payload together.
_PREFIX = struct.Struct("<QI")


class StateError(RuntimeError):
    """The state directory holds something the daemon cannot resume from."""


@dataclass(frozen=True)
class RunRecord:
    """What fixes a run: its id and the fragment layout every learner shares."""

    run_id: str
    layout_hash: str
    numels: tuple[int, ...]


@dataclass
class FragmentRecord:
    fragment: int
    version: int
    params: np.ndarray
    momentum: np.ndarray
    watermarks: dict[str, int]
    manifest: list[dict[str, Any]]
    # Epoch of the leader that committed the version (0: no high availability).
    epoch: int = 0
    # Random, nonzero (`new_commit_id`); 0 in records written before there were ids.
    commit_id: int = 0


def new_commit_id() -> int:
    """A version's id, unique to its commit: a version number committed again after
    versions were lost gets another one, so learners never mix the two histories."""
    return 1 + secrets.randbelow(2**64 - 1)


class StateDir:
    """The files of one run under one directory."""

    def __init__(self, root: str | Path, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "fragments").mkdir(exist_ok=True)

    # -- run ---------------------------------------------------------------

    def load_run(self) -> RunRecord | None:
        path = self.root / "run.json"
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            return RunRecord(run_id=str(data["run_id"]), layout_hash=str(data["layout_hash"]),
                             numels=tuple(int(n) for n in data["numels"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise StateError(f"{path} is not a valid run record: {exc}") from exc

    def save_run(self, run: RunRecord) -> None:
        body = json.dumps({"run_id": run.run_id, "layout_hash": run.layout_hash,
                           "numels": list(run.numels)}).encode()
        self._atomic_write(self.root / "run.json", [body])

    # -- fragments -----------------------------------------------------------

    def fragment_path(self, fragment: int) -> Path:
        return self.root / "fragments" / f"{fragment}.bin"

    def save_fragment(self, record: FragmentRecord) -> int:
        """Write one fragment's committed version durably; returns bytes written."""
        params = np.ascontiguousarray(record.params, dtype="<f4")
        momentum = np.ascontiguousarray(record.momentum, dtype="<f4")
        header = json.dumps({
            "fragment": record.fragment, "version": record.version, "numel": params.size,
            "watermarks": record.watermarks, "manifest": record.manifest,
            "epoch": record.epoch, "commit_id": record.commit_id,
        }).encode()
        crc = zlib.crc32(momentum.data.cast("B"),
                         zlib.crc32(params.data.cast("B"), zlib.crc32(header)))
        parts: list[bytes | memoryview] = [_MAGIC, _PREFIX.pack(len(header), crc), header,
                                          params.data.cast("B"), momentum.data.cast("B")]
        self._atomic_write(self.fragment_path(record.fragment), parts)
        self._append_manifest(record)
        return sum(len(p) for p in parts)

    def load_fragment(self, fragment: int) -> FragmentRecord | None:
        path = self.fragment_path(fragment)
        if not path.exists():
            return None
        blob = path.read_bytes()
        try:
            return _parse_fragment(blob)
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            raise StateError(f"{path}: {exc}") from exc

    def manifests(self) -> list[dict[str, Any]]:
        """Every committed manifest, oldest first."""
        path = self.root / "manifests.jsonl"
        return _manifest_lines(path.read_text()) if path.exists() else []

    def restore_manifests(self, records: Iterable[FragmentRecord]) -> None:
        """Append the manifest of every record the log lacks: a fragment file is
        renamed into place before its manifest line is appended, so a crash between
        the two leaves the line missing, and the file still holds it. A last line
        torn by the crash (or a full disk) is cut off first; its record restores it."""
        path = self.root / "manifests.jsonl"
        complete = ""
        if path.exists():
            text = path.read_text()
            complete = text[:text.rfind("\n") + 1]
            if complete != text:
                self._atomic_write(path, [complete.encode()])
        logged = {(m["fragment"], m["version"]) for m in _manifest_lines(complete)}
        for record in records:
            if (record.fragment, record.version) not in logged:
                self._append_manifest(record)

    # -- internals -------------------------------------------------------------

    def _append_manifest(self, record: FragmentRecord) -> None:
        entry: dict[str, Any] = {"fragment": record.fragment, "version": record.version,
                                 "manifest": record.manifest}
        if record.epoch:  # embedded runs keep the format they always had
            entry["epoch"] = record.epoch
        line = json.dumps(entry) + "\n"
        with open(self.root / "manifests.jsonl", "a") as log:
            log.write(line)
            log.flush()
            if self.fsync:
                os.fsync(log.fileno())

    def _atomic_write(self, path: Path, parts: list[bytes | memoryview] | list[bytes]) -> None:
        tmp = path.with_suffix(path.suffix + ".tmp")
        with open(tmp, "wb") as out:
            for part in parts:
                out.write(part)
            out.flush()
            if self.fsync:
                os.fsync(out.fileno())
        os.replace(tmp, path)
        if self.fsync:
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


def _parse_fragment(blob: bytes) -> FragmentRecord:
    if blob[:len(_MAGIC)] != _MAGIC:
        raise ValueError("not an ftsync fragment file")
    offset = len(_MAGIC)
    header_len, crc = _PREFIX.unpack_from(blob, offset)
    offset += _PREFIX.size
    if zlib.crc32(memoryview(blob)[offset:]) != crc:
        raise ValueError("checksum mismatch; the file is truncated or corrupt")
    header = json.loads(blob[offset:offset + header_len])
    offset += header_len
    numel = int(header["numel"])
    payload = memoryview(blob)[offset:]
    if len(payload) != 8 * numel:
        raise ValueError(f"holds {len(payload)} payload bytes, expected {8 * numel}")
    values = np.frombuffer(payload, dtype="<f4")
    return FragmentRecord(
        fragment=int(header["fragment"]), version=int(header["version"]),
        params=values[:numel].copy(), momentum=values[numel:].copy(),
        watermarks={str(k): int(v) for k, v in header["watermarks"].items()},
        manifest=list(header["manifest"]), epoch=int(header.get("epoch", 0)),
        commit_id=int(header.get("commit_id", 0)))


def _manifest_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]
