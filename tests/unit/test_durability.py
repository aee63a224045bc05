"""Tests for coordinator.durability: run and fragment records survive a round trip bit for bit,
overwrites are atomic, manifests accumulate, and any damaged file is refused with StateError.

The daemon resumes from these files after a crash, so a damaged file must never load as a
plausible record, nor crash the start-up with an unrelated exception.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import xxhash

from coordinator import durability
from coordinator.durability import (
    FragmentRecord,
    Regression,
    RunRecord,
    StateDir,
    StateError,
    new_commit_id,
)

MAGIC_LEN = 8
LEN_FIELD = 8
CHECKSUM_FIELD = 8  # xxh3-64


def record(fragment: int = 0, version: int = 1, numel: int = 1000, seed: int = 0,
           manifest: list[dict[str, object]] | None = None) -> FragmentRecord:
    rng = np.random.default_rng(seed)
    params = rng.standard_normal(numel).astype(np.float32)
    # Random bit patterns exercise every float, NaN payloads and subnormals included.
    momentum = rng.integers(0, 2**32, numel, dtype=np.uint32).view(np.float32)
    if numel >= 4:
        params[:4] = np.array([-0.0, np.inf, -np.inf, 1e-45], np.float32)
    return FragmentRecord(
        fragment=fragment, version=version, params=params, momentum=momentum,
        watermarks={"learner-a": 3, "learner-b": 17},
        manifest=manifest if manifest is not None else [
            {"learner": "learner-a", "seq": 3, "weight": 0.5},
            {"learner": "learner-b", "seq": 17, "weight": 1.5, "staleness": 1},
        ], commit_id=new_commit_id())


def assert_same(loaded: FragmentRecord | None, saved: FragmentRecord) -> None:
    assert loaded is not None
    assert loaded.fragment == saved.fragment
    assert loaded.version == saved.version
    assert loaded.params.dtype == np.float32 and loaded.momentum.dtype == np.float32
    np.testing.assert_array_equal(loaded.params.view(np.uint32),
                                  np.asarray(saved.params, np.float32).view(np.uint32))
    np.testing.assert_array_equal(loaded.momentum.view(np.uint32),
                                  np.asarray(saved.momentum, np.float32).view(np.uint32))
    assert loaded.watermarks == saved.watermarks
    assert loaded.manifest == saved.manifest
    assert (loaded.epoch, loaded.commit_id) == (saved.epoch, saved.commit_id)


def header_span(blob: bytes) -> tuple[int, int]:
    """Start and end offsets of the JSON header of a fragment file."""
    start = MAGIC_LEN + LEN_FIELD + CHECKSUM_FIELD
    length = int.from_bytes(blob[MAGIC_LEN:MAGIC_LEN + LEN_FIELD], "little")
    return start, start + length


@pytest.fixture(params=[True, False], ids=["fsync", "no-fsync"])
def state(request: pytest.FixtureRequest, tmp_path: Path) -> StateDir:
    return StateDir(tmp_path / "state", fsync=request.param)


# -- run record ------------------------------------------------------------------------------


def test_run_record_round_trip(state: StateDir) -> None:
    assert state.load_run() is None
    run = RunRecord(run_id="run-42", layout_hash="abc123", numels=(10, 70000, 3))
    state.save_run(run)
    assert state.load_run() == run
    # A second StateDir on the same directory (a restarted daemon) reads the same.
    assert StateDir(state.root).load_run() == run


def test_run_record_overwrite(state: StateDir) -> None:
    state.save_run(RunRecord("a", "h1", (1,)))
    state.save_run(RunRecord("b", "h2", (2, 3)))
    assert state.load_run() == RunRecord("b", "h2", (2, 3))
    assert not list(state.root.rglob("*.tmp"))


@pytest.mark.parametrize("text", ["", "{", "[]", '{"run_id": "a"}',
                                  '{"run_id": "a", "layout_hash": "h", "numels": ["x"]}'])
def test_invalid_run_record_raises_state_error(state: StateDir, text: str) -> None:
    (state.root / "run.json").write_text(text)
    with pytest.raises(StateError, match=r"run\.json"):
        state.load_run()


# -- fragments -------------------------------------------------------------------------------


def test_missing_fragment_is_none(state: StateDir) -> None:
    assert state.load_fragment(0) is None
    assert state.manifests() == []


@pytest.mark.parametrize("numel", [1, 5, 70000])
def test_fragment_round_trip_is_bit_exact(state: StateDir, numel: int) -> None:
    saved = record(fragment=3, version=12, numel=numel)
    written = state.save_fragment(saved)
    assert written == state.fragment_path(3).stat().st_size
    loaded = state.load_fragment(3)
    assert_same(loaded, saved)
    assert StateDir(state.root).load_fragment(3) is not None


def test_a_zero_momentum_is_left_out_of_the_file_and_loads_as_zeros(state: StateDir) -> None:
    saved = record(numel=70000)
    saved.momentum, saved.zero_momentum = np.zeros(70000, np.float32), True
    written = state.save_fragment(saved)
    assert written == state.fragment_path(0).stat().st_size
    blob = state.fragment_path(0).read_bytes()
    start, end = header_span(blob)
    assert json.loads(blob[start:end])["momentum"] == "zero"
    assert len(blob) - end == 4 * 70000
    loaded = state.load_fragment(0)
    assert_same(loaded, saved)
    assert loaded is not None and loaded.momentum.flags.writeable
    assert loaded.zero_momentum
    # What the record says, not a scan: one not known to be zero is written whole.
    saved.zero_momentum = False
    assert state.save_fragment(saved) == written + 4 * 70000 - len(b', "momentum": "zero"')
    assert_same(state.load_fragment(0), saved)


def test_loaded_arrays_are_writable_copies(state: StateDir) -> None:
    # The store updates momentum in place after a resume.
    state.save_fragment(record())
    loaded = state.load_fragment(0)
    assert loaded is not None
    assert loaded.params.flags.writeable and loaded.momentum.flags.writeable
    assert loaded.params.flags.c_contiguous and loaded.momentum.flags.c_contiguous
    assert not np.shares_memory(loaded.params, loaded.momentum)


def test_non_native_and_strided_arrays_are_stored_as_little_endian_fp32(state: StateDir) -> None:
    saved = record(numel=64)
    strided = np.repeat(saved.params, 2)[::2]
    big_endian = saved.momentum.astype(">f4")
    state.save_fragment(FragmentRecord(0, 1, strided, big_endian, {}, []))
    loaded = state.load_fragment(0)
    assert loaded is not None
    np.testing.assert_array_equal(loaded.params.view(np.uint32), saved.params.view(np.uint32))
    np.testing.assert_array_equal(loaded.momentum.view(np.uint32),
                                  saved.momentum.view(np.uint32))
    assert loaded.watermarks == {} and loaded.manifest == []


def test_fragments_are_independent(state: StateDir) -> None:
    first, second = record(fragment=0, seed=1), record(fragment=1, seed=2, numel=7)
    state.save_fragment(first)
    state.save_fragment(second)
    assert_same(state.load_fragment(0), first)
    assert_same(state.load_fragment(1), second)


def test_an_overwrite_keeps_the_version_before_as_the_next_temporary_file(
        state: StateDir) -> None:
    old, new = record(fragment=2, version=1, seed=1), record(fragment=2, version=2, seed=2)
    state.save_fragment(old)
    first_inode = state.fragment_path(2).stat().st_ino
    state.save_fragment(new)
    assert_same(state.load_fragment(2), new)
    fragments = state.root / "fragments"
    assert sorted(p.name for p in fragments.iterdir()) == ["2.bin", "2.bin.tmp"]
    # Exchanged, not unlinked: the old version's file (and its blocks) is the spare.
    assert (fragments / "2.bin.tmp").stat().st_ino == first_inode
    spare = StateDir(tmp := state.root.parent / "spare")
    (tmp / "fragments" / "2.bin").write_bytes((fragments / "2.bin.tmp").read_bytes())
    assert_same(spare.load_fragment(2), old)
    # The third version is written into that file, and the second becomes the spare.
    newest = record(fragment=2, version=3, seed=3, numel=10)
    state.save_fragment(newest)
    assert state.fragment_path(2).stat().st_ino == first_inode
    assert_same(state.load_fragment(2), newest)
    assert state.fragment_path(2).stat().st_size < (fragments / "2.bin.tmp").stat().st_size


def test_a_torn_spare_never_touches_the_committed_version(state: StateDir) -> None:
    state.save_fragment(record(fragment=0, version=1, seed=1))
    committed = record(fragment=0, version=2, seed=2)
    state.save_fragment(committed)
    # A crash in the middle of the next rewrite leaves the spare half written.
    (state.root / "fragments" / "0.bin.tmp").write_bytes(b"FTSYNCF2" + b"\xff" * 50_000)
    assert_same(StateDir(state.root).load_fragment(0), committed)
    after = record(fragment=0, version=3, seed=3, numel=3)
    state.save_fragment(after)
    assert_same(StateDir(state.root).load_fragment(0), after)


def test_a_hard_linked_spare_is_made_anew_and_its_other_name_kept(state: StateDir) -> None:
    first = record(fragment=0, version=1, seed=1)
    state.save_fragment(first)
    state.save_fragment(record(fragment=0, version=2, seed=2))
    # An operator's hard-link backup (`cp -al`) of the directory names the spare too.
    backup = state.root.parent / "backup.bin"
    os.link(state.root / "fragments" / "0.bin.tmp", backup)
    newest = record(fragment=0, version=3, seed=3)
    state.save_fragment(newest)
    assert_same(state.load_fragment(0), newest)
    copy = StateDir(state.root.parent / "copy")
    copy.fragment_path(0).write_bytes(backup.read_bytes())
    assert_same(copy.load_fragment(0), first)


@pytest.mark.parametrize("operation", ["save", "load"])
def test_a_fragments_reads_and_writes_wait_for_each_other(state: StateDir,
                                                         operation: str) -> None:
    # The file a reader opens becomes the next commit's temporary file, and a commit and
    # a replicated version of one fragment can overlap in a failover: one at a time.
    state.save_fragment(record(fragment=0, version=1, seed=1))
    newer = record(fragment=0, version=2, seed=2)
    other = threading.Thread(target=lambda: (state.save_fragment(newer) if operation == "save"
                                             else state.load_fragment(0)))
    with state._fragment_lock(0):  # a read or a write of fragment 0 under way
        other.start()
        other.join(timeout=0.2)
        assert other.is_alive()
        state.save_fragment(record(fragment=1, version=1, seed=3))  # other fragments go on
    other.join(timeout=30)
    assert not other.is_alive()
    assert state.load_fragment(0).version == (2 if operation == "save" else 1)  # type: ignore[union-attr]


@pytest.mark.parametrize(("error", "replaced"), [(errno.EPERM, True), (errno.EINVAL, True),
                                                  (errno.EIO, False)])
def test_an_exchange_the_system_refuses_falls_back_and_any_other_error_is_raised(
        state: StateDir, monkeypatch: pytest.MonkeyPatch, error: int, replaced: bool) -> None:
    def refused(*_: object) -> int:
        ctypes.set_errno(error)
        return -1

    state.save_fragment(record(fragment=0, version=1, seed=1))
    monkeypatch.setattr(durability, "_renameat2", refused)
    new = record(fragment=0, version=2, seed=2)
    if replaced:
        state.save_fragment(new)
        assert_same(state.load_fragment(0), new)
        assert not (state.root / "fragments" / "0.bin.tmp").exists()
    else:
        with pytest.raises(OSError, match=os.strerror(error)):
            state.save_fragment(new)
        assert state.load_fragment(0) is not None


def test_without_an_atomic_exchange_the_new_version_replaces_the_old(
        state: StateDir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(durability, "_renameat2", None)
    old, new = record(fragment=2, version=1, seed=1), record(fragment=2, version=2, seed=2)
    state.save_fragment(old)
    state.save_fragment(new)
    assert_same(state.load_fragment(2), new)
    assert sorted(p.name for p in (state.root / "fragments").iterdir()) == ["2.bin"]


def test_manifests_accumulate_one_line_per_save_in_order(state: StateDir) -> None:
    saves = [record(fragment=f, version=v, numel=4, manifest=[{"learner": f"l{f}", "seq": v}])
             for v, f in [(1, 0), (1, 1), (2, 0), (3, 0), (2, 1)]]
    for saved in saves:
        state.save_fragment(saved)
    expected = [{"fragment": r.fragment, "version": r.version, "manifest": r.manifest}
                for r in saves]
    assert state.manifests() == expected
    lines = (state.root / "manifests.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == expected
    # Reopening appends to the log rather than starting it over.
    reopened = StateDir(state.root, fsync=state.fsync)
    reopened.save_fragment(record(fragment=0, version=4, numel=4, manifest=[]))
    assert reopened.manifests() == [*expected, {"fragment": 0, "version": 4, "manifest": []}]


def test_a_manifest_lost_between_rename_and_append_is_restored_from_the_file(
        state: StateDir) -> None:
    first = record(fragment=0, version=1, numel=4, manifest=[{"learner": "a", "seq": 1}])
    second = record(fragment=0, version=2, numel=4, manifest=[{"learner": "a", "seq": 2}])
    other = record(fragment=1, version=1, numel=4, manifest=[{"learner": "b", "seq": 1}])
    for saved in (first, other, second):
        state.save_fragment(saved)
    log = state.root / "manifests.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:-1]))  # the crash came after the rename, before the append
    reopened = StateDir(state.root, fsync=state.fsync)
    loaded = [reopened.load_fragment(0), reopened.load_fragment(1)]
    # A file newer than the log is the crash between the two: nothing was lost.
    assert reopened.restore_manifests(loaded) == []
    assert [(m["version"], m["manifest"]) for m in reopened.manifests() if m["fragment"] == 0] \
        == [(1, first.manifest), (2, second.manifest)]
    # Nothing is appended twice.
    assert reopened.restore_manifests(loaded) == []
    assert len(reopened.manifests()) == 3


# -- damaged files ---------------------------------------------------------------------------


@pytest.fixture
def plain(tmp_path: Path) -> StateDir:
    """A state directory for the tests that damage files: fsync plays no part in reading."""
    return StateDir(tmp_path / "state", fsync=False)


def saved_blob(state: StateDir, numel: int = 100) -> tuple[Path, bytes]:
    state.save_fragment(record(numel=numel))
    path = state.fragment_path(0)
    return path, path.read_bytes()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_corrupt_payload_byte_fails_the_checksum(plain: StateDir, where: str) -> None:
    path, blob = saved_blob(plain)
    _, payload_start = header_span(blob)
    index = {"first": payload_start, "middle": (payload_start + len(blob)) // 2,
             "last": len(blob) - 1}[where]
    damaged = bytearray(blob)
    damaged[index] ^= 0x01
    path.write_bytes(bytes(damaged))
    with pytest.raises(StateError, match="checksum"):
        plain.load_fragment(0)


def test_a_fragment_file_in_another_fragments_place_raises_state_error(plain: StateDir) -> None:
    path, blob = saved_blob(plain)
    plain.fragment_path(1).write_bytes(blob)  # fragment 0's file copied as fragment 1's
    with pytest.raises(StateError, match="holds fragment 0, not 1"):
        plain.load_fragment(1)
    assert plain.load_fragment(0) is not None and path.read_bytes() == blob


def test_truncated_file_raises_state_error(plain: StateDir) -> None:
    path, blob = saved_blob(plain)
    header_start, header_end = header_span(blob)
    cuts = sorted({0, 1, MAGIC_LEN - 1, MAGIC_LEN, MAGIC_LEN + 1, header_start - 1,
                   header_start, header_start + 1, (header_start + header_end) // 2,
                   header_end - 1, header_end, header_end + 1, header_end + 4 * 100,
                   len(blob) - 4, len(blob) - 1})
    unexpected: list[str] = []
    for cut in cuts:
        path.write_bytes(blob[:cut])
        try:
            plain.load_fragment(0)
        except StateError:
            continue
        except Exception as exc:
            unexpected.append(f"cut at {cut}: {type(exc).__name__}: {exc}")
        else:
            unexpected.append(f"cut at {cut}: loaded without error")
    assert not unexpected, "\n".join(unexpected)


def test_trailing_bytes_raise_state_error(plain: StateDir) -> None:
    path, blob = saved_blob(plain)
    path.write_bytes(blob + b"\0\0\0\0")
    with pytest.raises(StateError):
        plain.load_fragment(0)


@pytest.mark.parametrize("magic", [b"FTSYNCF4", b"\0" * 8, b"ftsyncf1"])
def test_bad_magic_raises_state_error(plain: StateDir, magic: bytes) -> None:
    path, blob = saved_blob(plain)
    path.write_bytes(magic + blob[MAGIC_LEN:])
    with pytest.raises(StateError, match="not an ftsync fragment"):
        plain.load_fragment(0)


def first_format_blob(saved: FragmentRecord) -> bytes:
    """A fragment file as written before xxh3: magic FTSYNCF1, then the header's length
    and a CRC-32 of header and payload."""
    header = json.dumps({
        "fragment": saved.fragment, "version": saved.version, "numel": saved.params.size,
        "watermarks": saved.watermarks, "manifest": saved.manifest, "epoch": saved.epoch,
        "commit_id": saved.commit_id}).encode()
    payload = saved.params.astype("<f4").tobytes() + saved.momentum.astype("<f4").tobytes()
    return (b"FTSYNCF1" + struct.pack("<QI", len(header), zlib.crc32(header + payload))
            + header + payload)


def test_a_file_of_the_crc32_format_still_loads(plain: StateDir) -> None:
    saved = record()
    plain.fragment_path(0).write_bytes(first_format_blob(saved))
    assert_same(plain.load_fragment(0), saved)


def test_a_damaged_file_of_the_crc32_format_fails_its_checksum(plain: StateDir) -> None:
    damaged = bytearray(first_format_blob(record()))
    damaged[-1] ^= 0x01
    plain.fragment_path(0).write_bytes(bytes(damaged))
    with pytest.raises(StateError, match="checksum"):
        plain.load_fragment(0)


def test_garbled_header_raises_state_error(plain: StateDir) -> None:
    path, blob = saved_blob(plain)
    start, end = header_span(blob)
    path.write_bytes(blob[:start] + b"\xff" * (end - start) + blob[end:])
    with pytest.raises(StateError):
        plain.load_fragment(0)


@pytest.mark.parametrize(("old", "new"), [(b'"numel"', b'"numal"'),
                                          (b'"version"', b'"versiom"')])
def test_header_with_a_damaged_key_raises_state_error(plain: StateDir, old: bytes,
                                                      new: bytes) -> None:
    # One flipped byte in a key name: still valid JSON, but not a header the loader can use.
    path, blob = saved_blob(plain)
    start, end = header_span(blob)
    header = blob[start:end]
    assert header.count(old) == 1
    path.write_bytes(blob[:start] + header.replace(old, new) + blob[end:])
    with pytest.raises(StateError):
        plain.load_fragment(0)


@pytest.mark.parametrize(("old", "new"), [(b'"version": 1,', b'"version": 7,'),
                                          (b'"learner-b": 17', b'"learner-b": 97')])
def test_damaged_header_value_raises_state_error(plain: StateDir, old: bytes,
                                                 new: bytes) -> None:
    # The module promises a checksummed header: a flipped digit in the version or a watermark
    # must not load as a plausible record, or a resumed daemon would republish a wrong version
    # or merge a contribution twice.
    path, blob = saved_blob(plain)
    start, end = header_span(blob)
    header = blob[start:end]
    assert header.count(old) == 1
    path.write_bytes(blob[:start] + header.replace(old, new) + blob[end:])
    with pytest.raises(StateError):
        plain.load_fragment(0)


@pytest.mark.parametrize(("momentum", "payload_numels", "problem"), [
    ("half", 1, "momentum is 'half'"), ("zero", 2, "expected 4000"), (None, 1, "expected 8000")])
def test_a_checksummed_header_that_misstates_its_momentum_raises_state_error(
        plain: StateDir, momentum: str | None, payload_numels: int, problem: str) -> None:
    saved = record(numel=1000)
    fields = {"fragment": 0, "version": 1, "numel": 1000, "watermarks": {}, "manifest": [],
              **({} if momentum is None else {"momentum": momentum})}
    header = json.dumps(fields).encode()
    payload = saved.params.tobytes() * payload_numels
    digest = xxhash.xxh3_64_intdigest(header + payload)
    plain.fragment_path(0).write_bytes(
        b"FTSYNCF2" + struct.pack("<QQ", len(header), digest) + header + payload)
    with pytest.raises(StateError, match=problem):
        plain.load_fragment(0)


def test_an_older_file_is_a_regression_said_once_and_a_missing_one_until_rewritten(
        state: StateDir) -> None:
    """With fsync = false a power loss can keep the log's appends and lose the files'
    renames: the older file stands, and restore says which versions it lost. An older
    file's record is logged again, so it is said once; a missing file has no record to
    log, so it is said at every start until the fragment is written again."""
    state.save_fragment(record(fragment=0, version=1, numel=4))
    kept = state.fragment_path(0).read_bytes()
    for version in (2, 3):
        state.save_fragment(record(fragment=0, version=version, numel=4))
    state.save_fragment(record(fragment=1, version=1, numel=4))
    state.fragment_path(0).write_bytes(kept)  # the renames of versions 2 and 3 were lost
    state.fragment_path(1).unlink()  # and the first rename of fragment 1
    reopened = StateDir(state.root, fsync=state.fsync)
    loaded = [reopened.load_fragment(0), reopened.load_fragment(1)]
    assert loaded[0] is not None and loaded[0].version == 1 and loaded[1] is None
    assert reopened.restore_manifests(loaded) == [Regression(0, 1, 3, 0), Regression(1, -1, 1, 0)]
    # The log now says fragment 0 resumed at version 1: said once, not at every start.
    assert reopened.manifests()[-1]["version"] == 1
    again = StateDir(state.root, fsync=state.fsync)
    assert again.restore_manifests([again.load_fragment(0), None]) == [Regression(1, -1, 1, 0)]
    # A newer epoch's record at an older version is a new leader's resynchronisation.
    resynced = record(fragment=0, version=1, numel=4)
    resynced.epoch = 7
    assert again.restore_manifests([resynced, None]) == [Regression(1, -1, 1, 0)]
    # Fragment 1 written again (its initial value pushed anew): nothing more to say.
    again.save_fragment(record(fragment=1, version=0, numel=4))
    assert again.restore_manifests([resynced, again.load_fragment(1)]) == []


def test_a_torn_last_manifest_line_is_cut_and_restored(state: StateDir) -> None:
    first = record(fragment=0, version=1, numel=4, manifest=[{"learner": "a", "seq": 1}])
    second = record(fragment=0, version=2, numel=4, manifest=[{"learner": "a", "seq": 2}])
    for saved in (first, second):
        state.save_fragment(saved)
    log = state.root / "manifests.jsonl"
    log.write_bytes(log.read_bytes()[:-10])  # the append was cut short
    reopened = StateDir(state.root, fsync=state.fsync)
    loaded = reopened.load_fragment(0)
    assert loaded is not None
    reopened.restore_manifests([loaded])
    assert [(m["version"], m["manifest"]) for m in reopened.manifests()] == [
        (1, first.manifest), (2, second.manifest)]
