"""An engine resuming a state directory: one that a power loss with `fsync = false` set
back (the older file stands, and the engine says which versions were lost), and one a
run with outer momentum left to a run without."""

from __future__ import annotations

import shutil
from pathlib import Path

from coordinator.config import OuterConfig
from coordinator.durability import StateDir
from tests.unit.test_leadership import JOIN, committed, engine_in, events, push, run


def test_a_fragment_file_older_than_the_log_is_resumed_and_said(tmp_path: Path) -> None:
    fragment_file = StateDir(tmp_path / "state").fragment_path(0)
    kept = tmp_path / "version-0.bin"
    first = engine_in(tmp_path)

    async def train() -> None:
        first.join(JOIN)
        await push(first, 1, init=True)
        shutil.copyfile(fragment_file, kept)  # version 0, the initial value
        await push(first, 2)
        await committed(first)

    run(first, train)
    assert events(tmp_path, "state_regressed") == []
    shutil.copyfile(kept, fragment_file)  # version 1's rename did not survive
    second = engine_in(tmp_path)

    async def resumed() -> None:
        assert second.store is not None
        published = second.store.published(0)
        assert published is not None and published.version == 0

    run(second, resumed)
    assert [(e["fragment"], e["version"], e["logged_version"], e["logged_epoch"])
            for e in events(tmp_path, "state_regressed")] == [(0, 0, 1, 0)]
    assert events(tmp_path, "resume")[-1]["versions"] == {"0": 0}


def test_a_run_with_momentum_resumed_without_it_zeroes_it_once(tmp_path: Path) -> None:
    """The store knows a momentum is zero from its settings, not from a scan per commit:
    a buffer a run with outer momentum left is zeroed at resume, and every commit
    after it leaves the momentum out of the file."""
    state = StateDir(tmp_path / "state")
    with_momentum = engine_in(tmp_path, outer=OuterConfig(momentum=0.9))

    async def train() -> None:
        with_momentum.join(JOIN)
        await push(with_momentum, 1, init=True)
        await push(with_momentum, 2)
        await committed(with_momentum)

    run(with_momentum, train)
    left = state.load_fragment(0)
    assert left is not None and not left.zero_momentum and left.momentum.any()
    without = engine_in(tmp_path)

    async def resumed() -> None:
        assert without.store is not None
        assert not without.store.slots[0].momentum.any()
        without.join(JOIN)
        await push(without, 3)
        published = await without.store.wait_newer(0, 1, 10.0)
        assert published is not None and published.version == 2

    run(without, resumed)
    written = state.load_fragment(0)
    # Loaded from a file whose header says the momentum is zero, and holds none.
    assert written is not None and written.version == 2 and written.zero_momentum
