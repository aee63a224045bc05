"""A daemon past many commits: resume reads the right state from a segmented
manifest log, the exactly-once audit still holds across segments, and the soak
and load benchmarks run (small) to their JSON line.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench import load, soak
from chaos.failover import audit, drain, steady_learner
from coordinator.durability import SEGMENT_BYTES, StateDir, read_manifests
from learner.client import SynchronizerClient
from protos.events import EventLog
from tests.daemon import Daemon, wait_until

NUMELS = [8, 8, 8, 8]


def commits(daemon: Daemon) -> int:
    return sum(max(f.version, 0) for f in daemon.status().fragments)


def latest_logged(state: Path) -> dict[int, int]:
    latest: dict[int, int] = {}
    for record in read_manifests(state):
        latest[int(record["fragment"])] = int(record["version"])
    return latest


@pytest.mark.slow
def test_a_crash_past_a_segment_roll_resumes_every_fragment_and_loses_nothing(
        tmp_path: Path, start_daemon: Callable[..., Daemon]) -> None:
    state = tmp_path / "state"
    events = tmp_path / "coordinator.events.jsonl"
    daemon = start_daemon("--min-quorum", "1", "--set", "policy.grace_max_s=0",
                          "--set", "fsync=false", "--event-log", str(events), state_dir=state)
    learner_logs = [tmp_path / f"l{i}.events.jsonl" for i in range(4)]
    clients = [SynchronizerClient(daemon.address, f"l{i}", "long-run", NUMELS,
                                  events=EventLog(str(log), source=f"l{i}"))
               for i, log in enumerate(learner_logs)]
    resumed: dict[int, int] = {}
    on_disk: dict[int, int] = {}
    logged: dict[int, int] = {}

    async def run() -> None:
        stop = asyncio.Event()
        learners = [asyncio.create_task(steady_learner(c, NUMELS, stop, pace_s=0.0))
                    for c in clients]
        sealed = state / "manifests"
        await asyncio.to_thread(wait_until, lambda: sealed.is_dir() and any(sealed.iterdir()),
                                180, 0.1, "the manifest log's first roll")
        past_roll = commits(daemon) + 200
        await asyncio.to_thread(wait_until, lambda: commits(daemon) >= past_roll, 120, 0.1,
                                "commits after the roll")
        # SIGKILL with pushes in flight and the log already rolled once.
        daemon.kill()
        on_disk.update({p: r.version for p in range(len(NUMELS))
                        if (r := StateDir(state).load_fragment(p)) is not None})
        daemon.start()
        resumed.update({f.fragment: f.version for f in daemon.status().fragments})
        logged.update(latest_logged(state))
        target = commits(daemon) + 200
        await asyncio.to_thread(wait_until, lambda: commits(daemon) >= target, 120, 0.1,
                                "commits after the restart")
        stop.set()
        await asyncio.gather(*learners)
        for client in clients:
            await drain(client)
            await client.leave("done")
            await client.close()

    asyncio.run(run())
    # The resumed daemon serves what its files hold, and its log's last records say so
    # (a crash between a file and its log line leaves the line to the resume).
    assert resumed == on_disk == logged and min(resumed.values()) > 0
    active = state / "manifests.jsonl"
    assert active.stat().st_size < SEGMENT_BYTES + 1000
    assert active.read_text().startswith('{"snapshot"')
    # Every version logged once, none missing, across the segments.
    versions: dict[int, list[int]] = {}
    for record in read_manifests(state):
        versions.setdefault(record["fragment"], []).append(record["version"])
    final = {f.fragment: f.version for f in daemon.status().fragments}
    assert versions == {p: list(range(final[p] + 1)) for p in final}
    result = audit([state], [events], learner_logs)
    assert result.ok, (result.lost[:5], result.doubled[:5])
    assert result.merged > 1000


def last_json(out: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    for key in ("name", "ratio", "target", "unit"):
        assert key in result
    return result


def test_soak_bench_small(capsys: pytest.CaptureFixture[str]) -> None:
    soak.main(["--commits", "1500", "--checkpoints", "100", "--resume-repeats", "2",
               "--sample-s", "0.2"])
    result = last_json(capsys.readouterr().out)
    assert result["name"] == "soak" and result["target"] == 1.5
    assert result["resume_growth"] == result["ratio"]
    assert result["commits"] >= 1500 and result["audit"]["doubled"] == 0
    assert set(result["resume_ms"]) == {str(c["commits"]) for c in result["checkpoints"]}


def test_load_bench_small(capsys: pytest.CaptureFixture[str]) -> None:
    load.main(["--learners", "8", "--seconds", "3", "--drivers", "1", "--fragments", "4"])
    result = last_json(capsys.readouterr().out)
    assert result["name"] == "load"
    assert result["false_deaths"] == 0 and result["errors"] == {}
    assert result["pushes"] > 0
    assert result["ratio"] == pytest.approx(100.0 / result["ack_p99_ms"])
