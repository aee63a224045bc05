"""The real daemon process driven by real gRPC learner clients: quorum, grace
window, early close, long-poll pulls, concurrent pushers, and a SIGKILL."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from coordinator.durability import StateDir
from learner.client import Refused, Retry, SynchronizerClient
from tests.daemon import Daemon, wait_until

NUMELS = [3000, 1000]


def client(daemon: Daemon, learner_id: str) -> SynchronizerClient:
    return SynchronizerClient(daemon.address, learner_id, "layout-a", NUMELS,
                              retry=Retry(give_up_after_s=20))


async def joined(daemon: Daemon, *learner_ids: str) -> list[SynchronizerClient]:
    """Clients that joined; the first one sets every fragment's initial value."""
    clients = [client(daemon, lid) for lid in learner_ids]
    for c in clients:
        await c.join()
    for p, n in enumerate(NUMELS):
        assert await clients[0].push_initial(p, np.ones(n, dtype=np.float32))
    return clients


async def contribute(c: SynchronizerClient, fragment: int = 0, value: float = 0.1,
                     base_version: int = 0) -> None:
    delta = np.full(NUMELS[fragment], value, dtype=np.float32)
    await c.push(fragment, delta, base_version=base_version, c_tokens=100, c_steps=10,
                 local_step=10)


def versions(daemon: Daemon) -> dict[int, int]:
    return {f.fragment: f.version for f in daemon.status().fragments}


def closed_why(event_log: Path, commits: int) -> list[str]:
    """Why each of the first `commits` committed rounds closed, in order (the daemon's
    `commit` events, logged just after the version is served): what tells a round
    closed early from one that waited, however busy the machine."""
    def reasons() -> list[str]:
        events = (json.loads(line) for line in event_log.read_text().splitlines())
        return [e["why"] for e in events if e["kind"] == "commit"]
    wait_until(lambda: len(reasons()) >= commits, 10, message=f"{commits} commit events")
    return reasons()


def test_quorum_holds_a_round_until_enough_learners_contribute(
        start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    # DiLoCo's outer step as given: the round merges two of three live learners, which
    # the adaptive step would scale by 2/3.
    log = tmp_path / "events.jsonl"
    daemon = start_daemon("--min-quorum", "2", "--set", "policy.grace_max_s=0.3",
                          "--set", "outer.adaptive=false", "--event-log", str(log))

    async def scenario() -> None:
        a, b, c = await joined(daemon, "a", "b", "c")
        await contribute(a)
        # Below quorum: no pull may see a new version, however long it waits.
        assert await a.pull(0, have_version=0, wait_s=1.0) is None
        assert versions(daemon)[0] == 0
        started = time.monotonic()
        await contribute(b)
        pulled = await a.pull(0, have_version=0, wait_s=5.0)
        waited = time.monotonic() - started
        assert pulled is not None and pulled.version == 1
        # Quorum reached, c still live and silent: the grace window (0.3 s) ran out.
        assert waited >= 0.2 and closed_why(log, 1) == ["grace_ended"]
        # Both contributions merged with equal weights: Θ = 1 − 0.7·0.1 (no momentum).
        np.testing.assert_allclose(pulled.values, 1 - 0.7 * 0.1, rtol=1e-6)
        fragment = daemon.status().fragments[0]
        assert fragment.merged_contributions == 2 and fragment.commits == 1
        for x in (a, b, c):
            await x.close()

    asyncio.run(scenario())


def test_round_closes_early_once_every_live_learner_contributed(
        start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    daemon = start_daemon("--set", "policy.grace_max_s=30", "--event-log", str(log))

    async def scenario() -> None:
        a, b = await joined(daemon, "a", "b")
        await contribute(a)
        # Quorum (1) is met but b is live: the round waits out its grace window...
        assert await a.pull(0, have_version=0, wait_s=0.8) is None
        await contribute(b)
        # ...until b contributes too, not its 30 s.
        pulled = await a.pull(0, have_version=0, wait_s=10.0)
        assert pulled is not None and pulled.version == 1
        assert closed_why(log, 1) == ["all_live"]
        await a.close()
        await b.close()

    asyncio.run(scenario())


def test_a_learner_that_stops_beating_no_longer_holds_rounds(
        start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    # a beats 15 times per lease: a busy machine delays some, never a lease's worth.
    log = tmp_path / "events.jsonl"
    daemon = start_daemon("--set", "policy.grace_max_s=60",
                          "--set", "policy.heartbeat_timeout_s=3.0", "--event-log", str(log))

    async def scenario() -> None:
        a, b = await joined(daemon, "a", "b")

        async def beat() -> None:
            # No step progress, so no step-time estimate: the grace window is its 60 s max.
            while True:
                await a.heartbeat(local_step=10)
                await asyncio.sleep(0.2)

        beating = asyncio.create_task(beat())
        await contribute(a)
        # b never beats again: once its lease lapses every live learner has contributed.
        pulled = await a.pull(0, have_version=0, wait_s=10.0)
        assert pulled is not None and pulled.version == 1
        learners = {learner.learner_id: learner.live for learner in daemon.status().learners}
        assert learners == {"a": True, "b": False}
        assert closed_why(log, 1) == ["all_live"]  # a alone is live: not the 60 s grace
        beating.cancel()
        await a.close()
        await b.close()

    asyncio.run(scenario())


def test_a_learner_joining_again_holds_no_round_open_until_it_is_heard_from(
        start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """A restarted learner joins, then catches up; until it heartbeats it counts for
    nothing, so the others' rounds close as soon as they have all contributed."""
    log = tmp_path / "events.jsonl"
    daemon = start_daemon("--set", "policy.grace_max_s=30", "--event-log", str(log))

    async def run() -> None:
        a, b = await joined(daemon, "a", "b")
        await contribute(a)
        await contribute(b, value=0.3)
        assert (await a.pull(0, have_version=0, wait_s=10.0)).version == 1  # type: ignore[union-attr]
        restarted = client(daemon, "b")
        await restarted.join()  # and stays silent, as while it loads the model
        await contribute(a, base_version=1)
        pulled = await a.pull(0, have_version=1, wait_s=10.0)
        assert pulled is not None and pulled.version == 2
        assert closed_why(log, 2) == ["all_live", "all_live"]  # not the 30 s grace window
        live = {s.learner_id: s.live for s in daemon.status().learners}
        assert live == {"a": True, "b": False}
        await restarted.heartbeat(local_step=0)
        assert {s.learner_id: s.live for s in daemon.status().learners}["b"]
        for c in (a, b, restarted):
            await c.close()

    asyncio.run(run())


def test_a_learner_that_left_is_not_brought_back_by_a_late_call(
        start_daemon: Callable[..., Daemon]) -> None:
    """A heartbeat or pull still under way when a learner leaves is refused as unknown;
    the client must not take that for a coordinator restart and join again."""
    daemon = start_daemon()

    async def run() -> None:
        (a,) = await joined(daemon, "a")
        await a.leave("done")
        with pytest.raises(Refused) as refused:
            await a.heartbeat(local_step=1)
        assert refused.value.reason == "unknown_learner"
        assert [(s.learner_id, s.live) for s in daemon.status().learners] == [("a", False)]
        await a.close()

    asyncio.run(run())


def test_concurrent_pushers_each_merge_exactly_once(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon("--min-quorum", "6", "--set", "policy.grace_max_s=0",
                          "--set", "limits.staging_bytes=24000")

    async def scenario() -> None:
        clients = await joined(daemon, *[f"l{i}" for i in range(6)])
        # Staging room for two fragments at once: the other four pushes wait their turn.
        await asyncio.gather(*(contribute(c, value=0.01 * (i + 1))
                               for i, c in enumerate(clients)))
        pulled = await clients[0].pull(0, have_version=0, wait_s=10.0)
        assert pulled is not None and pulled.version == 1
        mean = np.mean([0.01 * (i + 1) for i in range(6)])
        # One outer step at the defaults: lr 0.7, no momentum.
        np.testing.assert_allclose(pulled.values, 1 - 0.7 * mean, rtol=1e-5)
        for c in clients:
            await c.heartbeat(local_step=11)
            assert c.backlog == 0 and c.stats.merged == 1
            await c.close()

    asyncio.run(scenario())


def test_long_poll_answers_not_modified_then_a_newer_version(
        start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon("--set", "policy.grace_max_s=0")

    async def scenario() -> None:
        (a,) = await joined(daemon, "a")
        started = time.monotonic()
        assert await a.pull(1, have_version=0, wait_s=0.5) is None
        assert time.monotonic() - started >= 0.45
        waiting = asyncio.create_task(a.pull(1, have_version=0, wait_s=20.0))
        await asyncio.sleep(0)  # the waiting poll goes out first
        # A later poll waited its 0.2 s out on the daemon and answered "not modified":
        # that window passed with the first one still waiting.
        assert await a.pull(1, have_version=0, wait_s=0.2) is None
        assert not waiting.done()
        await contribute(a, fragment=1)
        pulled = await asyncio.wait_for(waiting, 10)
        assert pulled is not None and pulled.version == 1 and pulled.values.size == NUMELS[1]
        await a.close()

    asyncio.run(scenario())


def test_sigkill_loses_no_committed_version_and_open_rounds_are_repushed(
        start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    state = tmp_path / "state"
    events = tmp_path / "coordinator.jsonl"
    # DiLoCo's momentum, so that the resumed momentum shows in the next step.
    args = ("--min-quorum", "2", "--set", "policy.grace_max_s=0", "--set", "outer.momentum=0.9",
            "--event-log", str(events))
    daemon = start_daemon(*args, state_dir=state)

    async def before_crash() -> list[SynchronizerClient]:
        a, b = await joined(daemon, "a", "b")
        await contribute(a, value=0.1)
        await contribute(b, value=0.3)
        assert (await a.pull(0, have_version=0, wait_s=10.0)).version == 1  # type: ignore[union-attr]
        # An open round the crash will lose: a's second contribution, below quorum.
        await contribute(a, value=0.2, base_version=1)
        assert a.backlog == 1 and all(c.acknowledged for c in a.outbox.held())
        return [a, b]

    loop = asyncio.new_event_loop()
    clients = loop.run_until_complete(before_crash())
    committed = StateDir(state).load_fragment(0)
    assert committed is not None and committed.version == 1
    daemon.kill()
    daemon.start()  # same port, same state directory
    resumed = daemon.status()
    assert {f.fragment: f.version for f in resumed.fragments} == {0: 1, 1: 0}
    on_disk = StateDir(state).load_fragment(0)
    assert on_disk is not None
    np.testing.assert_array_equal(on_disk.params, committed.params)
    np.testing.assert_array_equal(on_disk.momentum, committed.momentum)
    assert on_disk.manifest == committed.manifest

    async def after_restart() -> None:
        a, b = clients
        # The restarted daemon no longer knows a: its heartbeat re-joins and re-pushes.
        await a.heartbeat(local_step=20)
        assert a.stats.repushed == 1
        await contribute(b, value=0.4, base_version=1)
        pulled = await b.pull(0, have_version=1, wait_s=10.0)
        assert pulled is not None and pulled.version == 2
        # Version 2 steps on from the resumed momentum (Nesterov, lr 0.7, μ 0.9): the
        # round merged a's 0.2 and b's 0.4 with equal weights.
        delta = np.float32(0.3)
        momentum = np.float32(0.9) * committed.momentum + delta
        expected = committed.params - np.float32(0.7) * (delta + np.float32(0.9) * momentum)
        np.testing.assert_allclose(pulled.values, expected, rtol=1e-5)
        await a.heartbeat(local_step=21)
        await b.heartbeat(local_step=21)
        assert a.backlog == 0 and b.backlog == 0
        for c in clients:
            await c.close()

    loop.run_until_complete(after_restart())
    loop.close()
    manifests = StateDir(state).manifests()
    ids = [(m["fragment"], c["learner"], c["seq"]) for m in manifests for c in m["manifest"]]
    assert len(ids) == len(set(ids)) == 4
    assert [(m["fragment"], m["version"]) for m in manifests] == [(0, 0), (1, 0), (0, 1), (0, 2)]
    commits = [json.loads(line) for line in events.read_text().splitlines()
               if '"commit"' in line]
    assert [c["version"] for c in commits] == [1, 2]


def test_a_version_that_cannot_be_written_stops_the_daemon_with_nothing_published(
        start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    state = tmp_path / "state"
    daemon = start_daemon("--set", "policy.grace_max_s=0", state_dir=state)

    async def run() -> None:
        (a,) = await joined(daemon, "a")
        await contribute(a, fragment=1)
        assert (await a.pull(1, have_version=0, wait_s=10.0)).version == 1  # type: ignore[union-attr]
        # Fragment 0's next write fails: its temporary file's name is taken by a directory.
        (state / "fragments" / "0.bin.tmp").mkdir()
        await contribute(a, fragment=0)
        await a.close()

    asyncio.run(run())
    assert daemon.process is not None
    assert daemon.process.wait(timeout=30) == 1
    stderr = (tmp_path / "state.stderr.log").read_text()
    assert "could not be written" in stderr and "0.bin.tmp" in stderr, stderr[-2000:]
    # Restarted once the disk is fine: what was written is there, nothing else.
    (state / "fragments" / "0.bin.tmp").rmdir()
    daemon.start()
    assert versions(daemon) == {0: 0, 1: 1}


@pytest.mark.parametrize("merge", ["mean", "rda"])
def test_three_synthetic_learner_processes_lower_the_held_out_loss(
        start_daemon: Callable[..., Daemon], tmp_path: Path, merge: str) -> None:
    import subprocess
    import sys

    # The outer defaults, which adapt the step to what each round merged. They scale it
    # down by the rounds' staleness, which grows with the machine's load: at load 5, 200
    # steps ended at 0.08-0.26 of the start (4 of 15 runs over this bound), 600 steps at
    # load 7 at 0.003-0.03.
    daemon = start_daemon("--set", "policy.grace_max_s=0.3", "--set", f"policy.merge={merge!r}")
    processes = [subprocess.Popen(
        [sys.executable, "-m", "learner", "--coordinator", daemon.address, "--learner-id",
         f"l{i}", "--task", "synthetic", "--shard", str(i), "--num-shards", "3", "--steps", "600",
         "--step-ms", "5", "--dim", "512"],
        stdout=subprocess.PIPE, text=True) for i in range(3)]
    summaries = []
    for process in processes:
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 0, out
        summaries.append(json.loads(out.strip().splitlines()[-1]))
    for s in summaries:
        assert s["eval_loss_end"] < 0.2 * s["eval_loss_start"], s
        assert s["merged"] > 0
    assert min(f.version for f in daemon.status().fragments) >= 3
