"""The torch `Learner` against a real daemon: overlap and blend, and training on
through a coordinator outage."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from learner.api import Learner
from learner.client import SynchronizerClient
from learner.fragments import FragmentView
from learner.schedule import Phase
from learner.streaming import FragmentSync
from tests.daemon import Daemon, wait_until
from tests.integration.test_catchup import coordinator_values, push_as_another_learner


def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(32, 8)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_merged_fragment_is_applied_overlap_steps_after_its_push_blended_by_alpha(
        start_daemon: Callable[..., Daemon], alpha: float) -> None:
    daemon = start_daemon("--set", "policy.grace_max_s=0")
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    overlap = 3
    with Learner(daemon.address, model, sync_every=4, fragments=2, overlap=overlap,
                 alpha=alpha, device="cpu", learner_id="solo",
                 apply_rule="overwrite") as learner:
        view = FragmentView(model, learner.plan)
        # Fragment 0 is due at step 4 (t_0 = 0, H = 4): push, then apply at step 4 + τ.
        for _ in range(4):
            train_step(model, opt)
            assert learner.step(tokens=32) == []
        wait_until(lambda: daemon.status().fragments[0].version == 1, message="commit")
        global_v1 = asyncio.run(fetch_fragment(daemon, learner, 0))
        applied_at = None
        for step in range(5, 5 + overlap + 1):
            train_step(model, opt)
            before = view.read(0)
            wait_until(lambda: pull_arrived(learner, 0), message="the pull of v1")
            applied = learner.step(tokens=32)
            if applied:
                applied_at = step
                assert applied == [0]
                after = view.read(0)
                break
        assert applied_at == 4 + overlap
        assert learner.applied_versions[0] == 1
        np.testing.assert_allclose(after, alpha * before + (1 - alpha) * global_v1,
                                   rtol=1e-6, atol=1e-7)


def test_carry_applies_the_merged_version_plus_the_progress_since_the_push(
        start_daemon: Callable[..., Daemon]) -> None:
    """ApplyRule.CARRY: θ ← Θ_new + (θ − θ_push), and those steps stay the learner's."""
    daemon = start_daemon("--set", "policy.grace_max_s=0")
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Learner(daemon.address, model, sync_every=4, fragments=2, overlap=2,
                 apply_rule="carry", device="cpu", learner_id="solo") as learner:
        view = FragmentView(model, learner.plan)
        for _ in range(4):  # fragment 0 is pushed at step 4
            train_step(model, opt)
            learner.step(tokens=32)
        pushed = view.read(0)
        wait_until(lambda: daemon.status().fragments[0].version == 1, message="commit")
        global_v1 = asyncio.run(fetch_fragment(daemon, learner, 0))
        train_step(model, opt)
        learner.step(tokens=32)
        train_step(model, opt)
        before = view.read(0)
        wait_until(lambda: pull_arrived(learner, 0), message="the pull of v1")
        assert learner.step(tokens=32) == [0]  # step 6 = 4 + τ
        np.testing.assert_allclose(view.read(0), global_v1 + (before - pushed),
                                   rtol=1e-5, atol=1e-6)
        assert learner._sync.schedule.held(0) == (2, 64)  # steps 5 and 6 are kept


def test_a_push_is_answered_by_the_version_that_merges_it_not_an_earlier_one(
        start_daemon: Callable[..., Daemon]) -> None:
    """Another learner's round publishing first must not overwrite the local progress
    just pushed: the learner waits for the version its own contribution went into."""
    daemon = start_daemon("--set", "policy.grace_max_s=0")
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Learner(daemon.address, model, sync_every=4, fragments=1, overlap=1,
                 device="cpu", learner_id="slow") as learner:
        view = FragmentView(model, learner.plan)
        others_commit_version_1(daemon, learner, ["fast"])
        for _ in range(4):  # pushes with base version 0: merged into version 2
            train_step(model, opt)
            learner.step(tokens=32)
        pushed = view.read(0)
        wait_until(lambda: daemon.status().fragments[0].version == 2, message="v2 commit")
        global_v2 = asyncio.run(fetch_fragment(daemon, learner, 0))
        wait_until(lambda: pull_arrived(learner, 0), message="the pull of v2")
        train_step(model, opt)
        before = view.read(0)
        assert learner.step(tokens=32) == [0]
        assert learner.applied_versions[0] == 2
        # Version 2 with the step since the push carried onto it (the default rule).
        np.testing.assert_allclose(view.read(0), global_v2 + (before - pushed),
                                   rtol=1e-5, atol=1e-6)


def test_a_push_whose_round_is_slow_to_close_falls_back_to_the_newest_version(
        start_daemon: Callable[..., Daemon]) -> None:
    """Quorum 2: two other learners make version 1, then our push waits alone in the
    round for version 2. τ steps after it was due, the learner takes version 1."""
    daemon = start_daemon("--min-quorum", "2", "--set", "policy.grace_max_s=0")
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Learner(daemon.address, model, sync_every=4, fragments=1, overlap=1,
                 device="cpu", learner_id="alone") as learner:
        others_commit_version_1(daemon, learner, ["a", "b"])
        # Pushed at step 4 into the round for v2, due at 5, fallen back at 6, applied at 7.
        for step in range(1, 7):
            train_step(model, opt)
            assert learner.step(tokens=32) == [], step
            if step == 5:
                # Its push is in the round for v2, which stays open: still no pull.
                wait_until(lambda: "alone" in daemon.status().fragments[0].round_learners,
                           message="the push in the round for v2")
                assert not pull_arrived(learner, 0)
        wait_until(lambda: pull_arrived(learner, 0), message="the fall-back pull")
        train_step(model, opt)
        assert learner.step(tokens=32) == [0]
        assert learner.applied_versions[0] == 1
        assert daemon.status().fragments[0].version == 1  # its own round is still open


def test_a_lock_step_push_that_missed_its_round_is_refused_and_its_learner_stays_in_phase(
        start_daemon: Callable[..., Daemon]) -> None:
    """`--sync-mode 2` with three participants: a and b make version 1 without the
    lock-step learner, whose push against v0 is then refused as stale. It applies v1
    and its next push, against v1, is the one that makes version 2 with a's."""
    daemon = start_daemon("--sync-mode", "2")
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Learner(daemon.address, model, sync_every=4, fragments=1, overlap=1,
                 lockstep=True, device="cpu", learner_id="late") as learner:
        others_commit_version_1(daemon, learner, ["a", "b"])
        for _ in range(4):  # the push at step 4 is against v0: one round late
            train_step(model, opt)
            learner.step(tokens=32)
        train_step(model, opt)
        assert learner.step(tokens=32) == [0]  # lock-step: waits for v1, applies it
        assert learner.applied_versions[0] == 1
        assert learner.client.stats.dropped == {"stale": 1}
        for _ in range(3):  # the push at step 8 is against v1
            train_step(model, opt)
            learner.step(tokens=32)
        numel = learner.plan.numels[0]

        async def a_pushes_against_v1() -> None:
            a = SynchronizerClient(daemon.address, "a", learner.plan.hash, learner.plan.numels)
            await a.join()
            await a.push(0, np.full(numel, 1e-2, dtype=np.float32), base_version=1,
                         c_tokens=32, c_steps=1, local_step=5)
            await a.close()
        asyncio.run(a_pushes_against_v1())  # quorum 2: a's and late's, in either order
        wait_until(lambda: daemon.status().fragments[0].version == 2, message="v2 commit")
        train_step(model, opt)
        assert learner.step(tokens=32) == [0]
        assert learner.applied_versions[0] == 2
        assert learner.client.stats.dropped == {"stale": 1}


def test_a_failed_start_stops_everything_it_started(tmp_path: Path) -> None:
    """Nothing listens on port 9 here: the join gives up, and the background loop,
    its thread, the peer server and the gRPC channels are gone when start() raises
    (left running, they can abort the interpreter's exit)."""
    before = {t.ident for t in threading.enumerate()}
    learner = Learner("127.0.0.1:9", small_model(), sync_every=4, fragments=1,
                      device="cpu", learner_id="nowhere", connect_timeout_s=0.5,
                      serve_peers="127.0.0.1:0", event_log=str(tmp_path / "events.jsonl"))
    with pytest.raises(grpc.RpcError):
        learner.start()
    sync = learner._sync
    assert not sync._thread.is_alive() and sync._loop.is_closed()
    assert not sync.client.router.open and learner.events._out is None
    assert [t.name for t in threading.enumerate()
            if t.ident not in before and t.name.startswith("ftsync")] == []
    learner.close()  # a no-op after a failed start, not a hang


def others_commit_version_1(daemon: Daemon, learner: Learner, names: list[str]) -> None:
    """Learners `names` each push once against v0, and the daemon commits version 1."""
    numel = learner.plan.numels[0]

    async def push_all() -> None:
        for name in names:
            other = SynchronizerClient(daemon.address, name, learner.plan.hash,
                                       learner.plan.numels)
            await other.join()
            await other.push(0, np.full(numel, 1e-2, dtype=np.float32), base_version=0,
                             c_tokens=32, c_steps=1, local_step=1)
            await other.close()
    asyncio.run(push_all())
    wait_until(lambda: daemon.status().fragments[0].version == 1, message="v1 commit")


def pull_arrived(learner: Learner, fragment: int) -> bool:
    """Whether the learner's outstanding pull of `fragment` has its answer (white box:
    the background loop exposes no event for it)."""
    return learner._sync.schedule.phase(fragment) == Phase.READY


async def fetch_fragment(daemon: Daemon, learner: Learner, fragment: int) -> np.ndarray:
    """The fragment's published values, as an observer client sees them."""
    observer = SynchronizerClient(daemon.address, "observer", learner.plan.hash,
                                  learner.plan.numels)
    await observer.join()
    pulled = await observer.pull(fragment, have_version=0, wait_s=5)
    await observer.close()
    assert pulled is not None
    return pulled.values


def test_learner_keeps_stepping_while_the_coordinator_is_down_then_catches_up(
        start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon("--set", "policy.grace_max_s=0")
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Learner(daemon.address, model, sync_every=4, fragments=2, overlap=1,
                 device="cpu", learner_id="steady", connect_timeout_s=30) as learner:
        for _ in range(12):
            train_step(model, opt)
            learner.step(tokens=32)
            time.sleep(0.02)
        wait_until(lambda: min(learner.applied_versions.values()) >= 1, message="first sync")
        daemon.kill()
        slowest = 0.0
        for _ in range(40):
            started = time.monotonic()
            train_step(model, opt)
            learner.step(tokens=32)
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.01)
        # A dead coordinator never blocks a step; work piles up as backlog instead. A
        # step that waited on it would wait out the client's retries (60 s).
        assert slowest < 5.0, slowest
        assert learner.backlog > 0
        # 20 pushes fell due; the send queue holds 8 (max_backlog), and the oldest
        # beyond them are dropped, counted where the summary reads them.
        assert learner.progress()["dropped"].get("backlog_full", 0) > 0, learner.progress()
        daemon.start()
        # What the coordinator committed before it died, some of which the learner may
        # not have applied yet: only versions past these hold work pushed since.
        restored = {f.fragment: f.version for f in daemon.status().fragments}
        deadline = time.monotonic() + 60  # the learner's reconnect backs off meanwhile
        while time.monotonic() < deadline:
            train_step(model, opt)
            learner.step(tokens=32)
            time.sleep(0.02)
            if all(v > restored[p] for p, v in learner.applied_versions.items()):
                break
        assert all(v > restored[p] for p, v in learner.applied_versions.items()), \
            (learner.applied_versions, restored)
        status = daemon.status()
        assert [learner_status.learner_id for learner_status in status.learners] == ["steady"]
        assert status.learners[0].contributions > 0
    with pytest.raises(RuntimeError, match="not closed"):
        learner.step(tokens=32)  # closed: its steps would reach no run


def test_a_learner_ahead_of_a_coordinator_that_lost_versions_takes_its_newest(
        start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """A coordinator back with older versions than the learner applied (a failover
    under async or no replication, a restored state directory) would refuse every
    push based on them and never answer a pull past them: the learner takes the
    coordinator's newest version and its pushes are merged again."""
    state, backup, log = tmp_path / "state", tmp_path / "backup", tmp_path / "events.jsonl"
    daemon = start_daemon("--set", "policy.grace_max_s=0", state_dir=state)
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def versions() -> dict[int, int]:
        return {f.fragment: f.version for f in daemon.status().fragments}

    with Learner(daemon.address, model, sync_every=4, fragments=2, overlap=1, device="cpu",
                 learner_id="ahead", connect_timeout_s=30, event_log=str(log)) as learner:
        def train_until(done: Callable[[], bool]) -> None:
            for _ in range(600):
                train_step(model, opt)
                learner.step(tokens=32)
                time.sleep(0.01)  # a step's compute, so that rounds commit between steps
                if done():
                    return
            raise AssertionError(f"applied {learner.applied_versions}, coordinator at "
                                 f"{versions()}")

        train_until(lambda: min(learner.applied_versions.values()) >= 2)
        daemon.stop()
        shutil.copytree(state, backup)
        daemon.start()
        restored = versions()
        train_until(lambda: all(v >= restored[p] + 3
                                for p, v in learner.applied_versions.items()))
        daemon.kill()
        shutil.rmtree(state)
        shutil.copytree(backup, state)
        daemon.start()
        assert versions() == restored
        train_until(lambda: all(restored[p] < v <= versions()[p]
                                for p, v in learner.applied_versions.items()))
    rewound = [json.loads(line) for line in log.read_text().splitlines()
               if '"rewound"' in line]
    assert rewound and all(e["version"] < e["had_version"] for e in rewound), rewound


def test_a_learner_whose_version_the_coordinator_lost_and_committed_again_takes_the_new_one(
        start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """The coordinator, restored from an older state directory, commits version 1
    again with other contents while a learner still trains on the lost version 1.
    Nothing is ahead or behind by number; the commit ids tell them apart, and the
    learner takes the new version before its next push instead of a round later."""
    state, backup, log = tmp_path / "state", tmp_path / "backup", tmp_path / "events.jsonl"
    daemon = start_daemon("--set", "policy.grace_max_s=0", state_dir=state)
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    # One fragment, pushed at steps 8, 16, ...: steps 10 to 15 push nothing. Each
    # step waits for the pull under way, as a step's compute longer than a commit
    # would: with fsync a commit can outlast several of this model's steps.
    with Learner(daemon.address, model, sync_every=8, fragments=1, overlap=1, device="cpu",
                 learner_id="behind", connect_timeout_s=30, event_log=str(log)) as learner:
        view = FragmentView(model, learner.plan)
        daemon.stop()
        shutil.copytree(state, backup)  # version 0
        daemon.start()
        for _ in range(8):
            train_step(model, opt)
            learner.step(tokens=32)
        wait_until(lambda: pull_arrived(learner, 0), message="the pull of version 1")
        assert learner.step(tokens=32) == [0] and learner.applied_versions[0] == 1
        lost = asyncio.run(coordinator_values(daemon, learner))[0]
        daemon.kill()
        shutil.rmtree(state)
        shutil.copytree(backup, state)
        daemon.start()
        push_as_another_learner(daemon, learner, [0], value=0.05)
        wait_until(lambda: daemon.status().fragments[0].version == 1, 10,
                   message="version 1 committed again")
        new = asyncio.run(coordinator_values(daemon, learner))[0]
        assert new.version == 1 and new.commit_id != lost.commit_id
        assert not np.array_equal(new.values, lost.values)
        wait_until(lambda: learner.client.published.get(0) == (1, new.commit_id), 10,
                   message="a heartbeat reporting the new version 1")
        # No training from here: the model holds what was applied.
        assert learner.step(tokens=32) == []  # step 10 sees the other commit and pulls it
        wait_until(lambda: pull_arrived(learner, 0), message="the pull of the new version 1")
        assert learner.step(tokens=32) == [0]  # step 11, before the next push at 16
        np.testing.assert_array_equal(view.read(0), new.values)
    lost_events = [json.loads(line) for line in log.read_text().splitlines()
                   if '"version_lost"' in line]
    assert [(e["version"], e["commit"]) for e in lost_events] == [(1, f"{new.commit_id:x}")]


def test_an_interrupt_that_comes_just_as_the_start_ends_still_leaves_the_run(
        start_daemon: Callable[..., Daemon], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in the instant the start ends: cancelling it is too late, so no
    cancellation cleans up; the learner must still say Leave before it stops."""
    log = tmp_path / "coordinator.jsonl"
    daemon = start_daemon("--event-log", str(log))
    run = FragmentSync._run

    def interrupted_as_it_ends(self: FragmentSync, coroutine: Any, timeout: float) -> None:
        run(self, coroutine, timeout)
        if not self._stopping:  # the start, not the close
            raise KeyboardInterrupt

    monkeypatch.setattr(FragmentSync, "_run", interrupted_as_it_ends)
    learner = Learner(daemon.address, small_model(), sync_every=4, fragments=2, device="cpu",
                      learner_id="interrupted", connect_timeout_s=30)
    with pytest.raises(KeyboardInterrupt):
        learner.start()
    left = [json.loads(line) for line in log.read_text().splitlines() if '"leave"' in line]
    assert [(e["learner"], e["reason"]) for e in left] == [("interrupted", "interrupted")]
    assert not any(s.live for s in daemon.status().learners)


def test_a_step_before_start_is_refused() -> None:
    learner = Learner("127.0.0.1:9", small_model(), sync_every=4, fragments=2, device="cpu")
    with pytest.raises(RuntimeError, match="call start"):
        learner.step(tokens=32)
    assert learner.local_step == 0
