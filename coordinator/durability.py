"""Durable state of the synchronizer in its state directory.

The daemon writes a fragment's file before it publishes the version in it,
so a version a learner has seen is never lost when the daemon dies. Each
file holds one fragment's committed version: fp32 parameters, outer-momentum
(left out when all zero, as it is without outer momentum, the default), the
per-learner merged-seq watermarks and the version's manifest, behind a
checksummed header, written to a temporary file, fsynced and put in place.
The temporary file is the version before's: the two are exchanged
(`renameat2`), not replaced, so the next commit rewrites blocks the file
system already holds instead of allocating them anew. The checksum is
xxh3-64 (the `xxhash` package): a commit hashes params and momentum, up to
800 MB per 100M parameters, and xxh3 does that ten times faster
than zlib's crc32 (23 GB/s against 2 GB/s on the machine BENCHMARKS.md
names). Files written before it (`FTSYNCF1`, CRC-32) are still read. With
high availability each record also names the epoch of the leader
that committed it, and a standby writes the versions the leader streams to it
the same way; where two records share a fragment and version, the one of the
newer epoch stands (the other was written by a deposed leader and never
published). Called by `coordinator.store` on each commit and at start-up,
and by `coordinator.engine` for replicated versions.

Every manifest is also appended to a log, the audit trail the exactly-once
checkers read (`read_manifests`, its one reader). The daemon runs for weeks,
so the log is segmented: `manifests.jsonl` is the active segment, and the
first commit that finds it `segment_bytes` long (512 KiB by default) seals it
as `manifests/<its number>.jsonl` and starts the next segment with a snapshot
line: its number and, per fragment, the version and epoch last logged. That
is all resume needs of the history (was the manifest of each fragment's file
logged before the daemon died?), so resume reads the active segment's first
line and then its lines from the end, only as far back as each fragment's
last record (a fragment that did not commit in this segment is in the
snapshot): a few kilobytes, at most one segment, however old the run. Sealed
segments are never read on the daemon's path; the newest `keep_segments` of
them (16 by default, so the log stays under 8.5 MiB) are kept for audits and
older ones deleted, so the directory stays bounded too. An audit sees that
window only (about 50,000 commits of one small contribution each; the chaos
harness's runs stay far inside it); whoever needs every manifest of a longer
run has them in the event log's `commit` events, the operator's file to keep
or rotate. A state directory written before segments has no snapshot line:
its log is sealed whole, as segment 0, at the first roll.

A roll survives a crash at any point: the new segment is written as
`manifests.next.jsonl` first, then the active one is renamed into
`manifests/`, then the new one into place. Found at start with the active
segment still there, the next one is dropped (the roll had not begun);
found alone, it is moved into place (the roll had sealed the old one). A
last line torn by a crash (or a full disk) is cut off. One `StateDir` writes
a directory at a time: it reads the active segment once and keeps what it
learned; its appends and rolls take a lock, as fragments commit in parallel
worker threads.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import secrets
import stat
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
import xxhash

_MAGIC = b"FTSYNCF3"
# Header length, then the xxh3-64 of header and payload together.
_PREFIX = struct.Struct("<QQ")
# What each file format begins with: its prefix and the checksum of what follows it.
# FTSYNCF2 always holds the momentum (F3 may leave a zero one out, a build that reads
# only F2 says so instead of misreading it); FTSYNCF1, the format before xxh3, has a
# CRC-32. Both are read, never written.
_FORMATS: dict[bytes, tuple[struct.Struct, Callable[[memoryview], int]]] = {
    _MAGIC: (_PREFIX, xxhash.xxh3_64_intdigest),
    b"FTSYNCF2": (_PREFIX, xxhash.xxh3_64_intdigest),
    b"FTSYNCF1": (struct.Struct("<QI"), zlib.crc32),
}
# A fragment header's "momentum" when the buffer, all zero, is left out of the payload.
_ZERO = "zero"
# The manifest log: the active segment, the next one while a roll is under way,
# and the directory of sealed segments.
_ACTIVE = "manifests.jsonl"
_NEXT = "manifests.next.jsonl"
_SEALED = "manifests"
SEGMENT_BYTES = 512 << 10
KEEP_SEGMENTS = 16
# Bytes read at a time when the active segment is parsed from its end.
_BLOCK = 8 << 10


def _libc_renameat2() -> Callable[[int, bytes, int, bytes, int], int] | None:
    """glibc's `renameat2` (2.28 and later), which Python does not wrap; None without it."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint]
    function.restype = ctypes.c_int
    return cast(Callable[[int, bytes, int, bytes, int], int], function)


_renameat2 = _libc_renameat2()
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


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
    # The momentum is all zero, as without outer momentum (the default), and the durable
    # file and a replica's stream leave it out. Set by whoever knows it (the store's
    # outer step, a file or stream that said so) rather than found by a scan per write.
    zero_momentum: bool = False


@dataclass(frozen=True)
class Regression:
    """A fragment whose durable file is older than the manifest log's last record
    of it (`StateDir.restore_manifests`): versions after `version` were lost."""

    fragment: int
    # The file's version; -1 when the fragment has no file.
    version: int
    logged_version: int
    logged_epoch: int


def new_commit_id() -> int:
    """A version's id, unique to its commit: a version number committed again after
    versions were lost gets another one, so learners never mix the two histories."""
    return 1 + secrets.randbelow(2**64 - 1)


class _Log:
    """What the writer knows of the manifest log, from the active segment.

    The last record logged for a fragment is found by parsing the active
    segment from its end, only as far back as needed (the fragments that
    committed lately are at its end), and else in the segment's snapshot;
    what was parsed is kept, and appends update it."""

    def __init__(self, path: Path, segment: int, base: dict[int, tuple[int, int]],
                 start: int, size: int) -> None:
        self.path = path
        self.segment = segment
        # Bytes in the active segment.
        self.size = size
        # Fragment → (version, epoch) last logged before the active segment.
        self._base = base
        # Records in [start, cursor) are not parsed yet; cursor is at a line's end.
        self._start = start
        self._cursor = size
        # Fragment → (version, epoch) of its newest record in the active segment.
        self._newest: dict[int, tuple[int, int]] = {}

    def latest(self, fragment: int) -> tuple[int, int] | None:
        """(version, epoch) of the last record logged for `fragment`, if any."""
        self._parse_back(fragment)
        return self._newest.get(fragment, self._base.get(fragment))

    def every_latest(self) -> dict[int, tuple[int, int]]:
        self._parse_back(None)
        return {**self._base, **self._newest}

    def appended(self, fragment: int, version: int, epoch: int, nbytes: int) -> None:
        self._newest[fragment] = (version, epoch)
        self.size += nbytes

    def _parse_back(self, fragment: int | None) -> None:
        """Parse records from the cursor backwards until `fragment`'s is found
        (None: all of them)."""
        block = _BLOCK
        while self._cursor > self._start and (fragment is None
                                              or fragment not in self._newest):
            low = max(self._start, self._cursor - block)
            with open(self.path, "rb") as log:
                log.seek(low)
                data = log.read(self._cursor - low)
            # Up to its first newline, the block may end a line that starts before it.
            keep = data.find(b"\n") + 1 if low > self._start else 0
            if low > self._start and keep in (0, len(data)):
                block *= 2  # a line longer than the block
                continue
            for line in reversed(data[keep:].split(b"\n")):
                if line.strip():
                    self._take(line)
            self._cursor = low + keep

    def _take(self, line: bytes) -> None:
        try:
            entry = json.loads(line)
            key = (int(entry["version"]), int(entry.get("epoch", 0)))
            self._newest.setdefault(int(entry["fragment"]), key)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StateError(f"{self.path}: not a manifest record: {line[:80]!r} "
                             f"({exc!r})") from exc


class StateDir:
    """The files of one run under one directory."""

    def __init__(self, root: str | Path, fsync: bool = True,
                 segment_bytes: int = SEGMENT_BYTES,
                 keep_segments: int | None = KEEP_SEGMENTS) -> None:
        """`keep_segments`: sealed manifest segments kept (None: all of them)."""
        self.root = Path(root)
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self.keep_segments = keep_segments
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "fragments").mkdir(exist_ok=True)
        self._log: _Log | None = None
        # Fragments commit in parallel, each in a worker thread: one appends (or
        # rolls the log) at a time.
        self._log_lock = threading.Lock()
        # Until the file system refuses it once: fragment files are exchanged, not replaced.
        self._exchanges = True
        self._fragment_locks: dict[int, threading.Lock] = {}
        self._fragment_locks_lock = threading.Lock()

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

    # -- seqs ----------------------------------------------------------------

    def load_seq_reservations(self) -> dict[str, int]:
        """Per learner, the seq up to which contributions may have been
        acknowledged (`Policy.reservation`); empty before the first."""
        path = self.root / "seqs.json"
        if not path.exists():
            return {}
        try:
            return {str(k): int(v) for k, v in json.loads(path.read_text()).items()}
        except (ValueError, TypeError, AttributeError) as exc:
            raise StateError(f"{path} is not a valid seq reservation record: {exc}") from exc

    def save_seq_reservations(self, reservations: dict[str, int]) -> None:
        self._atomic_write(self.root / "seqs.json", [json.dumps(reservations).encode()])

    # -- fragments -----------------------------------------------------------

    def fragment_path(self, fragment: int) -> Path:
        return self.root / "fragments" / f"{fragment}.bin"

    def save_fragment(self, record: FragmentRecord) -> int:
        """Write one fragment's committed version durably; returns bytes written."""
        with self._fragment_lock(record.fragment):
            return self._save_fragment(record)

    def _save_fragment(self, record: FragmentRecord) -> int:
        params = np.ascontiguousarray(record.params, dtype="<f4")
        # Without outer momentum (the default) the record says its momentum is zero: left
        # out, which halves what a commit hashes and writes.
        payload = [params.data.cast("B")]
        if not record.zero_momentum:
            payload.append(np.ascontiguousarray(record.momentum, dtype="<f4").data.cast("B"))
        header = json.dumps({
            "fragment": record.fragment, "version": record.version, "numel": params.size,
            "watermarks": record.watermarks, "manifest": record.manifest,
            "epoch": record.epoch, "commit_id": record.commit_id,
            **({} if len(payload) == 2 else {"momentum": _ZERO}),
        }).encode()
        digest = xxhash.xxh3_64(header)
        for part in payload:
            digest.update(part)
        parts: list[bytes | memoryview] = [
            _MAGIC, _PREFIX.pack(len(header), digest.intdigest()), header, *payload]
        self._atomic_write(self.fragment_path(record.fragment), parts, recycle=True)
        self._append_manifest(record)
        return sum(len(p) for p in parts)

    def load_fragment(self, fragment: int) -> FragmentRecord | None:
        path = self.fragment_path(fragment)
        if not path.exists():
            return None
        # The file a read opens is the next commit's temporary file: no commit meanwhile.
        with self._fragment_lock(fragment):
            blob = path.read_bytes()
        try:
            record = _parse_fragment(blob)
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            raise StateError(f"{path}: {exc}") from exc
        if record.fragment != fragment:
            raise StateError(f"{path}: holds fragment {record.fragment}, not {fragment} "
                             f"(a file copied into the wrong place?)")
        return record

    # -- manifest log ----------------------------------------------------------

    def manifests(self) -> list[dict[str, Any]]:
        """Every manifest the directory still holds, oldest first (`read_manifests`)."""
        return read_manifests(self.root)

    def restore_manifests(self, records: Sequence[FragmentRecord | None]) -> list[Regression]:
        """Append the manifest of every record the log lacks, given each fragment's
        file (None: none): a fragment file is renamed into place before its manifest
        line is appended, so a crash between the two leaves the line missing, and
        the file still holds it. The log lacks it when the last record logged for
        its fragment is another version or epoch. Reads the active segment's
        snapshot and its end only; a last line torn by the crash (or a full disk) is
        cut off first, and its record restores it.

        Returns the fragments whose file is older than what the log last recorded
        (by epoch, then version), or missing: with `fsync = false` a power loss can
        keep the log's append and lose the file's rename. The file stands (its
        record is logged again, so the log says where the fragment resumed, and
        the next start says nothing), and the versions after it are lost; the
        caller says so. A missing file has no record to log: it is said at every
        start until the fragment is written again."""
        regressions = []
        with self._log_lock:
            for fragment, record in enumerate(records):
                # Asked anew each time: an append may have rolled the log.
                log = self._opened_log()
                logged = log.latest(fragment)
                if logged is not None and (record is None or (record.epoch, record.version)
                                           < (logged[1], logged[0])):
                    regressions.append(Regression(
                        fragment, -1 if record is None else record.version, *logged))
                if record is not None and logged != (record.version, record.epoch):
                    self._append(record)
        return regressions

    # -- internals -------------------------------------------------------------

    def _opened_log(self) -> _Log:
        if self._log is None:
            self._log = self._open_log()
        return self._log

    def _open_log(self) -> _Log:
        """Finish or undo a roll a crash interrupted, cut a torn last line, and
        read the active segment's snapshot; its records are parsed as needed."""
        active, pending = self.root / _ACTIVE, self.root / _NEXT
        if pending.exists():
            if active.exists():
                pending.unlink()
            else:
                os.replace(pending, active)
                self._sync_dir(self.root)
        if not active.exists():
            return _Log(active, 0, {}, 0, 0)
        with open(active, "rb") as log:
            first = log.readline()
            size = log.seek(0, os.SEEK_END)
            log.seek(max(size - 1, 0))
            torn = size > 0 and log.read(1) != b"\n"
        segment, base, start = 0, {}, 0
        if first.startswith(b'{"snapshot"') and first.endswith(b"\n"):
            try:
                snapshot = json.loads(first)["snapshot"]
                segment = int(snapshot["segment"])
                base = {int(f): (int(v), int(e)) for f, (v, e) in snapshot["latest"].items()}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise StateError(f"{active}: its first line is not a snapshot: "
                                 f"{exc!r}") from exc
            start = len(first)
        if torn:
            size = self._cut_torn_line(active, start, size)
        return _Log(active, segment, base, start, size)

    def _cut_torn_line(self, path: Path, start: int, size: int) -> int:
        """Truncate `path` after its last complete line (not before `start`)."""
        end = size
        with open(path, "r+b") as log:
            while end > start:
                low = max(start, end - _BLOCK)
                log.seek(low)
                newline = log.read(end - low).rfind(b"\n")
                if newline >= 0:
                    end = low + newline + 1
                    break
                end = low
            log.truncate(end)
            log.flush()
            if self.fsync:
                os.fsync(log.fileno())
        return end

    def _append_manifest(self, record: FragmentRecord) -> None:
        with self._log_lock:
            self._append(record)

    def _append(self, record: FragmentRecord) -> None:
        """Append one manifest record, rolling the log first if it is full; hold
        the log's lock."""
        log = self._opened_log()
        if log.size >= self.segment_bytes:
            log = self._roll(log)
        entry: dict[str, Any] = {"fragment": record.fragment, "version": record.version,
                                 "manifest": record.manifest}
        if record.epoch:  # embedded runs keep the format they always had
            entry["epoch"] = record.epoch
        line = (json.dumps(entry) + "\n").encode()
        with open(self.root / _ACTIVE, "ab") as out:
            out.write(line)
            out.flush()
            if self.fsync:
                os.fsync(out.fileno())
        log.appended(record.fragment, record.version, record.epoch, len(line))

    def _roll(self, log: _Log) -> _Log:
        """Seal the active segment and start the next one with a snapshot."""
        latest = log.every_latest()
        snapshot = {"segment": log.segment + 1,
                    "latest": {str(f): list(ve) for f, ve in sorted(latest.items())}}
        line = (json.dumps({"snapshot": snapshot}) + "\n").encode()
        pending = self.root / _NEXT
        with open(pending, "wb") as out:
            out.write(line)
            out.flush()
            if self.fsync:
                os.fsync(out.fileno())
        sealed = self.root / _SEALED
        sealed.mkdir(exist_ok=True)
        os.replace(self.root / _ACTIVE, sealed / f"{log.segment:012d}.jsonl")
        os.replace(pending, self.root / _ACTIVE)
        self._sync_dir(sealed)
        self._sync_dir(self.root)
        self._log = _Log(self.root / _ACTIVE, log.segment + 1, latest, len(line), len(line))
        if self.keep_segments is not None:
            segments = _sealed_segments(self.root)
            for old in segments[:max(len(segments) - self.keep_segments, 0)]:
                old.unlink()
        return self._log

    def _fragment_lock(self, fragment: int) -> threading.Lock:
        """One writer or reader of a fragment's files at a time, in this process: a
        commit and a replicated version of one fragment can overlap in a failover, and
        a replication catch-up reads while the fragment commits."""
        with self._fragment_locks_lock:
            return self._fragment_locks.setdefault(fragment, threading.Lock())

    def _atomic_write(self, path: Path, parts: list[bytes | memoryview] | list[bytes],
                      recycle: bool = False) -> None:
        """Write `parts` to a temporary file, fsync it, put it in place.

        `recycle` (fragment files) writes into the pages of the version before: its
        file is kept as the next temporary one, exchanged with the new version's
        (`renameat2`) instead of unlinked, and overwritten in place. A fresh file of
        200 MB took 0.05-0.6 s to write into the page cache here, a rewrite 0.02 s:
        commit time a pull waits for. Costs one more file per fragment on disk. Where
        the file system cannot exchange, the new file replaces the old."""
        tmp = path.with_suffix(path.suffix + ".tmp")
        with self._reusable(tmp) if recycle else open(tmp, "wb") as out:
            for part in parts:
                out.write(part)
            out.truncate()
            out.flush()
            if self.fsync:
                os.fsync(out.fileno())
        if not (recycle and self._exchanges and path.exists() and self._exchange(tmp, path)):
            os.replace(tmp, path)
        self._sync_dir(path.parent)

    @staticmethod
    def _reusable(tmp: Path) -> BinaryIO:
        """`tmp` opened for a rewrite in place (no O_TRUNC: truncating frees the blocks
        the rewrite is to reuse), made anew if it is not a plain file of its own: a hard
        link (an operator's `cp -al` backup of the directory) would be overwritten too."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
        fd = os.open(tmp, flags, 0o644)
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_nlink > 1:
            os.close(fd)
            os.unlink(tmp)
            fd = os.open(tmp, flags | os.O_EXCL, 0o644)
        return os.fdopen(fd, "r+b")

    def _exchange(self, a: Path, b: Path) -> bool:
        """Swap two paths atomically; False (and never again) where unsupported."""
        if _renameat2 is not None and _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD,
                                                 os.fsencode(b), _RENAME_EXCHANGE) == 0:
            return True
        error = ctypes.get_errno() if _renameat2 is not None else errno.ENOSYS
        # EPERM: a seccomp filter that refuses the call; os.replace names a real one.
        if error not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV,
                         errno.EPERM):
            raise OSError(error, os.strerror(error), str(a), None, str(b))
        self._exchanges = False
        return False

    def _sync_dir(self, path: Path) -> None:
        if self.fsync:
            dir_fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


def read_manifests(root: str | Path) -> list[dict[str, Any]]:
    """Every manifest record a state directory still holds, oldest first: the kept
    sealed segments, then the active one (snapshot lines left out). The one reader
    of the manifest log, for audits (`chaos.failover`, tests, benchmarks); it reads
    every kept segment and is never on the daemon's resume path. Safe while a daemon
    writes: an unfinished last line is left out, and the active segment is read
    first, so a roll meanwhile cannot make it miss a segment (the one just sealed
    has the active segment's number, and only older ones are read)."""
    root = Path(root)
    active, text = _active_segment(root)
    tail = _log_lines(text or "", active)
    # With no active segment at all (removed by hand), every sealed one is older.
    number = next((int(e["snapshot"]["segment"]) for e in tail if "snapshot" in e),
                  0 if text is not None else math.inf)
    entries: list[dict[str, Any]] = []
    for segment in _sealed_segments(root):
        if int(segment.stem) < number:
            entries.extend(_log_lines(_complete(segment) or "", segment))
    entries.extend(tail)
    return [e for e in entries if "snapshot" not in e]


def _active_segment(root: Path) -> tuple[Path, str | None]:
    """The active segment's path and complete lines (None: there is none). A roll
    moves it away and the next one in: between the two renames the next one is
    the active one, and after them the active one is there again."""
    for path in (root / _ACTIVE, root / _NEXT, root / _ACTIVE):
        text = _complete(path)
        if text is not None:
            return path, text
    return root / _ACTIVE, None


def _sealed_segments(root: Path) -> list[Path]:
    """The sealed manifest segments, oldest first (their names sort as they count)."""
    sealed = root / _SEALED
    if not sealed.is_dir():
        return []
    return sorted(p for p in sealed.iterdir()
                  if p.suffix == ".jsonl" and p.stem.isdigit())


def _complete(path: Path) -> str | None:
    """The file's complete lines (None if it is not there)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return text[:text.rfind("\n") + 1]


def _log_lines(text: str, path: Path) -> list[dict[str, Any]]:
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise StateError(f"{path}:{number}: not a manifest record: {exc}") from exc
        snapshot = entry.get("snapshot") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or not (
                (isinstance(snapshot, dict) and isinstance(snapshot.get("segment"), int))
                or (isinstance(entry.get("fragment"), int)
                    and isinstance(entry.get("version"), int)
                    and isinstance(entry.get("manifest"), list))):
            raise StateError(f"{path}:{number}: not a manifest record: {line[:80]!r}")
        entries.append(entry)
    return entries


def _parse_fragment(blob: bytes) -> FragmentRecord:
    magic = blob[:len(_MAGIC)]
    if magic not in _FORMATS:
        raise ValueError(f"not an ftsync fragment file (it starts {magic!r}; this version "
                         f"reads {' and '.join(repr(m) for m in _FORMATS)})")
    prefix, checksum = _FORMATS[magic]
    offset = len(magic)
    header_len, digest = prefix.unpack_from(blob, offset)
    offset += prefix.size
    if checksum(memoryview(blob)[offset:]) != digest:
        raise ValueError("checksum mismatch; the file is truncated or corrupt")
    header = json.loads(blob[offset:offset + header_len])
    offset += header_len
    numel = int(header["numel"])
    momentum = header.get("momentum")
    if momentum not in (None, _ZERO):
        raise ValueError(f"momentum is {momentum!r}; this version reads {_ZERO!r} or none")
    zero_momentum = momentum == _ZERO
    expected = (4 if zero_momentum else 8) * numel
    payload = memoryview(blob)[offset:]
    if len(payload) != expected:
        raise ValueError(f"holds {len(payload)} payload bytes, expected {expected}")
    values = np.frombuffer(payload, dtype="<f4")
    return FragmentRecord(
        fragment=int(header["fragment"]), version=int(header["version"]),
        params=values[:numel].copy(),
        momentum=np.zeros(numel, np.float32) if zero_momentum else values[numel:].copy(),
        watermarks={str(k): int(v) for k, v in header["watermarks"].items()},
        manifest=list(header["manifest"]), epoch=int(header.get("epoch", 0)),
        commit_id=int(header.get("commit_id", 0)), zero_momentum=zero_momentum)
