"""An engine resuming a state directory that a power loss with `fsync = false` set
back: the older file stands, and the engine says which versions were lost."""

from __future__ import annotations

import shutil
from pathlib import Path

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
