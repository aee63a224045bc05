"""Tests for the segmented manifest log of coordinator.durability.

The log rolls into sealed segments, keeps a bounded number of them, and resume
reads the active segment only. What must not change with segments: the audit
trail (`read_manifests`) holds every record still kept, oldest first, once; and
a daemon that crashes anywhere (between a fragment file and its log line, in the
middle of a line, in the middle of a roll) resumes to the same log an
unsegmented one would, which the Hypothesis test checks against a plain list.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator import durability
from coordinator.durability import FragmentRecord, StateDir, StateError, read_manifests

FRAGMENTS = 3


def record(fragment: int, version: int, epoch: int = 0, seq: int = 0) -> FragmentRecord:
    return FragmentRecord(fragment, version, np.zeros(2, np.float32), np.zeros(2, np.float32),
                          {}, [{"learner": "a", "seq": seq or version}], epoch)


def entry(r: FragmentRecord) -> dict[str, Any]:
    line: dict[str, Any] = {"fragment": r.fragment, "version": r.version,
                            "manifest": r.manifest}
    if r.epoch:
        line["epoch"] = r.epoch
    return line


def resume(root: Path, **kwargs: Any) -> StateDir:
    """What the daemon does at start: load every fragment file, restore the log."""
    state = StateDir(root, fsync=False, **kwargs)
    state.restore_manifests([state.load_fragment(p) for p in range(FRAGMENTS)])
    return state


class Crash(Exception):
    """The process died here."""


@contextmanager
def crash_at_replace(n: int) -> Iterator[None]:
    """The n-th rename from here on (1-based) is where the process dies: an os.replace,
    or the exchange that puts a fragment's next version in place of its last."""
    real_replace, real_exchange = os.replace, durability._renameat2
    calls = 0

    def count(src: Any, dst: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == n:
            raise Crash(f"before replace {src} -> {dst}")

    def replace(src: Any, dst: Any) -> None:
        count(src, dst)
        real_replace(src, dst)

    def exchange(src_dir: int, src: bytes, dst_dir: int, dst: bytes, flags: int) -> int:
        count(src, dst)
        return int(real_exchange(src_dir, src, dst_dir, dst, flags))

    with mock.patch("coordinator.durability.os.replace", replace), \
            mock.patch("coordinator.durability._renameat2", exchange):
        yield


@contextmanager
def files_read() -> Iterator[dict[Path, int]]:
    """Bytes read meanwhile, per path: by the module's own opens and by Path.read_text."""
    real_open, real_read_text = open, Path.read_text
    counts: dict[Path, int] = {}

    class Counting:
        def __init__(self, path: Path, file: Any) -> None:
            self.path, self.file = path, file

        def read(self, *args: Any) -> Any:
            data = self.file.read(*args)
            counts[self.path] = counts.get(self.path, 0) + len(data)
            return data

        def readline(self, *args: Any) -> Any:
            data = self.file.readline(*args)
            counts[self.path] = counts.get(self.path, 0) + len(data)
            return data

        def __getattr__(self, name: str) -> Any:
            return getattr(self.file, name)

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.close()

    def counting_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Counting:
        return Counting(Path(path), real_open(path, mode, *args, **kwargs))

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        text = real_read_text(self, *args, **kwargs)
        counts[self] = counts.get(self, 0) + len(text)
        return text

    with mock.patch("coordinator.durability.open", counting_open, create=True), \
            mock.patch.object(Path, "read_text", read_text):
        yield counts


def sealed(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "manifests").iterdir())


def size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# -- rolling and keeping ---------------------------------------------------------------------


def test_the_log_rolls_into_numbered_segments_each_opened_by_a_snapshot(tmp_path: Path) -> None:
    state = StateDir(tmp_path, fsync=True, segment_bytes=1)  # a roll before every append
    saved = [record(v % FRAGMENTS, v) for v in range(10)]
    for r in saved:
        state.save_fragment(r)
    assert sealed(tmp_path) == [f"{n:012d}.jsonl" for n in range(9)]
    assert state.manifests() == [entry(r) for r in saved]
    lines = (tmp_path / "manifests.jsonl").read_text().splitlines()
    # The snapshot: what was logged before the segment's first record.
    assert json.loads(lines[0]) == {"snapshot": {"segment": 9, "latest": {
        "0": [6, 0], "1": [7, 0], "2": [8, 0]}}}
    assert [json.loads(line) for line in lines[1:]] == [entry(saved[9])]
    # The first segment has no snapshot: a run shorter than one segment keeps the old format.
    first = (tmp_path / "manifests" / "000000000000.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in first] == [entry(saved[0])]
    assert not list(tmp_path.glob("manifests.next.jsonl"))


def test_segments_stay_near_their_size(tmp_path: Path) -> None:
    state = StateDir(tmp_path, fsync=False, segment_bytes=400, keep_segments=None)
    saved = [record(v % FRAGMENTS, v) for v in range(60)]
    for r in saved:
        state.save_fragment(r)
    segments = list((tmp_path / "manifests").iterdir())
    assert len(segments) >= 8
    longest = max(len(json.dumps(entry(r))) + 1 for r in saved)
    assert all(p.stat().st_size < 400 + longest for p in segments)
    assert state.manifests() == [entry(r) for r in saved]


def test_only_the_newest_segments_are_kept_and_the_directory_stays_bounded(
        tmp_path: Path) -> None:
    state = StateDir(tmp_path, fsync=False, segment_bytes=1, keep_segments=2)
    saved = [record(0, v) for v in range(100)]
    sizes = []
    for r in saved:
        state.save_fragment(r)
        sizes.append(size(tmp_path))
    assert sealed(tmp_path) == ["000000000097.jsonl", "000000000098.jsonl"]
    assert state.manifests() == [entry(r) for r in saved[97:]]
    assert max(sizes[50:]) <= max(sizes[:20]) + 64


def test_keep_none_keeps_every_segment_and_zero_only_the_active_one(tmp_path: Path) -> None:
    every = StateDir(tmp_path / "every", fsync=False, segment_bytes=1, keep_segments=None)
    active = StateDir(tmp_path / "active", fsync=False, segment_bytes=1, keep_segments=0)
    saved = [record(0, v) for v in range(9)]
    for r in saved:
        every.save_fragment(r)
        active.save_fragment(r)
    assert every.manifests() == [entry(r) for r in saved]
    assert active.manifests() == [entry(saved[8])]


def test_resume_reads_a_few_blocks_of_the_active_segment_however_long_the_run(
        tmp_path: Path) -> None:
    state = StateDir(tmp_path, fsync=False, segment_bytes=1 << 20)
    read_at: dict[int, int] = {}
    for v in range(3000):
        state.save_fragment(record(v % FRAGMENTS, v))
        if v + 1 in (300, 3000):
            with files_read() as counts:
                resume(tmp_path, segment_bytes=1 << 20)
            assert set(counts) == {tmp_path / "manifests.jsonl"}
            read_at[v + 1] = counts[tmp_path / "manifests.jsonl"]
    # One block from the end (and the first line), at 300 records as at 3,000.
    assert read_at[300] == read_at[3000] <= (8 << 10) + 200
    assert (tmp_path / "manifests.jsonl").stat().st_size > 20 * read_at[3000]
    assert len(state.manifests()) == 3000


def test_resume_after_many_commits_does_not_need_the_sealed_segments(tmp_path: Path) -> None:
    # A lost manifest line is restored from the active segment's snapshot and lines alone.
    state = StateDir(tmp_path, fsync=False, segment_bytes=500, keep_segments=None)
    for v in range(100):
        state.save_fragment(record(v % FRAGMENTS, v))
    state._append_manifest = lambda record: None  # type: ignore[method-assign]
    lost = record(1, 100)
    state.save_fragment(lost)  # renamed into place; the crash came before its line
    (tmp_path / "manifests").rename(tmp_path / "hidden")
    resume(tmp_path, segment_bytes=500)
    (tmp_path / "hidden").rename(tmp_path / "manifests")
    assert read_manifests(tmp_path) == [entry(record(v % FRAGMENTS, v))
                                        for v in range(100)] + [entry(lost)]


def test_lines_of_several_fragments_lost_at_once_are_restored_across_a_roll(
        tmp_path: Path) -> None:
    # Fragments commit in parallel: one crash can lose the lines of several, and
    # restoring the first may roll the log before the next is looked up.
    state = StateDir(tmp_path, fsync=False, segment_bytes=1)
    for v in range(6):
        state.save_fragment(record(v % FRAGMENTS, v))
    state._append_manifest = lambda record: None  # type: ignore[method-assign]
    lost = [record(p, 6 + p) for p in range(FRAGMENTS)]
    for r in lost:
        state.save_fragment(r)
    resumed = resume(tmp_path, segment_bytes=1)
    assert resumed.manifests() == [entry(record(v % FRAGMENTS, v)) for v in range(6)] + [
        entry(r) for r in lost]
    assert resume(tmp_path, segment_bytes=1).manifests() == resumed.manifests()


def test_an_idle_fragment_is_found_in_the_snapshot(tmp_path: Path) -> None:
    # Fragment 0 last committed many segments ago: its record is in no active line.
    state = StateDir(tmp_path, fsync=False, segment_bytes=300)
    state.save_fragment(record(0, 5))
    for v in range(30):
        state.save_fragment(record(1, v))
    resumed = resume(tmp_path, segment_bytes=300)
    assert [m for m in resumed.manifests() if m["fragment"] == 0] == [entry(record(0, 5))]


def test_records_longer_than_a_read_block_are_found_and_cut_when_torn(tmp_path: Path) -> None:
    big = FragmentRecord(0, 1, np.zeros(2, np.float32), np.zeros(2, np.float32), {},
                         [{"learner": f"learner-{i}", "seq": i} for i in range(2000)])
    state = StateDir(tmp_path, fsync=False)
    state.save_fragment(big)
    for v in range(1, 4):
        state.save_fragment(record(1, v))
    assert len(json.dumps(entry(big))) > 4 * (8 << 10)
    resume(tmp_path)  # finds fragment 0's record behind fragment 1's, across the long line
    assert read_manifests(tmp_path) == [entry(big)] + [entry(record(1, v)) for v in (1, 2, 3)]
    # The crash tore a long last line: it is cut, and its fragment file restores it.
    bigger = FragmentRecord(0, 2, big.params, big.momentum, {}, big.manifest * 2)
    state.save_fragment(bigger)
    log = tmp_path / "manifests.jsonl"
    log.write_bytes(log.read_bytes()[:-30_000])
    resume(tmp_path)
    assert read_manifests(tmp_path)[-1] == entry(bigger)
    assert len(read_manifests(tmp_path)) == 5


def test_parallel_commits_roll_the_log_once_each(tmp_path: Path) -> None:
    # The store commits fragments in parallel worker threads.
    state = StateDir(tmp_path, fsync=False, segment_bytes=300, keep_segments=None)
    per_thread = 200

    def commit(fragment: int) -> None:
        for v in range(per_thread):
            state.save_fragment(record(fragment, v))

    threads = [threading.Thread(target=commit, args=(p,)) for p in range(FRAGMENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    logged = state.manifests()
    assert len(logged) == FRAGMENTS * per_thread
    for p in range(FRAGMENTS):
        assert [m["version"] for m in logged if m["fragment"] == p] == list(range(per_thread))
    names = sealed(tmp_path)
    assert names == [f"{n:012d}.jsonl" for n in range(len(names))] and len(names) > 100


def test_a_log_from_before_segments_is_sealed_whole(tmp_path: Path) -> None:
    saved = [record(v % FRAGMENTS, v) for v in range(12)]
    (tmp_path / "manifests.jsonl").write_text(
        "".join(json.dumps(entry(r)) + "\n" for r in saved))
    state = StateDir(tmp_path, fsync=False, segment_bytes=100)
    state.save_fragment(record(0, 12))
    assert sealed(tmp_path) == ["000000000000.jsonl"]
    assert state.manifests() == [entry(r) for r in saved] + [entry(record(0, 12))]


def test_a_damaged_segment_is_refused_with_state_error(tmp_path: Path) -> None:
    state = StateDir(tmp_path, fsync=False, segment_bytes=150)
    for v in range(5):
        state.save_fragment(record(0, v))
    log = tmp_path / "manifests.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.write_text(lines[0] + '{"fragment": "x"}\n' + "".join(lines[1:]))
    with pytest.raises(StateError, match=r"manifests\.jsonl"):
        read_manifests(tmp_path)
    log.write_text('{"snapshot": {"segment": "x"}}\n' + "".join(lines[1:]))
    with pytest.raises(StateError, match="snapshot"):
        resume(tmp_path, segment_bytes=150)


def test_a_reader_during_a_roll_sees_every_record_once(tmp_path: Path) -> None:
    state = StateDir(tmp_path, fsync=False, segment_bytes=1, keep_segments=None)
    saved = [record(0, v) for v in range(4)]
    for r in saved:
        state.save_fragment(r)
    # The roll for the fifth record stops between its two renames.
    with crash_at_replace(3), pytest.raises(Crash):
        state.save_fragment(record(0, 4))
    assert not (tmp_path / "manifests.jsonl").exists()
    assert read_manifests(tmp_path) == [entry(r) for r in saved]
    resumed = resume(tmp_path, segment_bytes=1, keep_segments=None)
    assert resumed.manifests() == [entry(r) for r in saved] + [entry(record(0, 4))]


# -- resume equivalence ----------------------------------------------------------------------

# A commit: save (the fragment's next version), recommit (the same version again under a
# new epoch: a new leader re-committed what a deposed one had logged) or resync (an older
# version under a new epoch: a standby takes the new leader's), and its fate: ok, lost
# (the crash came after the file, before its line) or torn (the crash cut its line short).
# crash k: the process died at the k-th os.replace of a commit (1: the fragment file, 2
# and 3: the roll's). restart: a clean stop and start.
operations = st.lists(st.one_of(
    st.tuples(st.sampled_from(["save", "save", "recommit", "resync"]),
              st.integers(0, FRAGMENTS - 1), st.sampled_from(["ok", "ok", "lost", "torn"])),
    st.tuples(st.just("crash"), st.integers(1, 3), st.just("")),
    st.tuples(st.just("restart"), st.just(0), st.just("")),
), max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, segment=st.integers(1, 400), cut=st.integers(1, 200))
def test_resume_restores_the_log_an_unsegmented_one_would(
        tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int, str]],
        segment: int, cut: int) -> None:
    root = tmp_path_factory.mktemp("state")
    state = StateDir(root, fsync=False, segment_bytes=segment, keep_segments=None)
    expected: list[dict[str, Any]] = []  # the one plain list an unsegmented log would be
    versions = dict.fromkeys(range(FRAGMENTS), -1)
    epoch = 0

    def restart() -> StateDir:
        # Resume reads the active segment only, however many segments there are.
        with files_read() as counts:
            resumed = resume(root, segment_bytes=segment, keep_segments=None)
        assert set(counts) <= {root / "manifests.jsonl"}
        return resumed

    for op, arg, fate in ops:
        if op == "restart":
            state = restart()
            assert state.manifests() == expected
            continue
        if op == "crash":
            fragment = len(expected) % FRAGMENTS
            r = record(fragment, versions[fragment] + 1, epoch)
            with crash_at_replace(arg), contextlib.suppress(Crash):
                state.save_fragment(r)
            if arg == 1:  # the file never made it: nothing was committed
                assert read_manifests(root) == expected
            else:
                versions[fragment] = r.version
                expected.append(entry(r))
            state = restart()
            assert state.manifests() == expected
            continue
        fragment, current = arg, versions[arg]
        if op == "save":
            r = record(fragment, current + 1, epoch)
        elif current < (1 if op == "resync" else 0):
            continue
        else:
            epoch += 1
            r = record(fragment, current - (op == "resync"), epoch, seq=1000 + len(expected))
        if fate == "lost":
            state._append_manifest = lambda record: None  # type: ignore[method-assign]
        state.save_fragment(r)
        versions[fragment] = r.version
        expected.append(entry(r))
        if fate == "torn":
            log = root / "manifests.jsonl"
            text = log.read_bytes()
            last = text.rstrip(b"\n").rfind(b"\n") + 1
            log.write_bytes(text[:last + cut % (len(text) - last)])
        if fate in ("lost", "torn"):
            assert read_manifests(root) == expected[:-1]
            state = restart()
        assert state.manifests() == expected
        assert (root / "manifests.jsonl").stat().st_size < segment + 400
