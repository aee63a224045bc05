"""`sync_every = "auto"` against a real daemon: two torch learners, one four times
slower (a sleep per step in its training loop stands in for a slower accelerator).
The coordinator assigns the slow one fewer local steps, and the slow one's merged
contributions are less stale than with one H for both. Judged on the daemon's
event log."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from learner.api import Learner
from protos.events import problems
from tests.daemon import Daemon, wait_until
from tests.integration.test_learner import small_model, train_step

H_MAX = 16
# Emulated step times (s): the slow learner is four times slower. Long beside a
# training step's own few milliseconds, which a busy machine stretches for both alike:
# 10 ms more each still leaves the slow one 2.5 times slower, given at most H_MAX / 2.
FAST_S, SLOW_S = 0.01, 0.04
# The slow learner's steps: some 8 s, of which the first second or two are spent
# measuring.
SLOW_STEPS = 200


def run_pair(daemon: Daemon, sync_every: int | Literal["auto"]) -> dict[str, int]:
    """Both learners train until the slow one has done SLOW_STEPS steps; the H each
    had in force at the end."""
    slow_done = threading.Event()
    errors: list[BaseException] = []
    in_force: dict[str, int] = {}

    def train(learner_id: str, step_s: float) -> None:
        try:
            model = small_model(seed=0)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            with Learner(daemon.address, model, sync_every=sync_every,
                         fragments=2, overlap=1, device="cpu",
                         learner_id=learner_id) as learner:
                steps = 0
                while not slow_done.is_set():
                    train_step(model, opt)
                    time.sleep(step_s)  # the emulated device time, not a synchronization
                    learner.step(tokens=32)
                    steps += 1
                    if learner_id == "slow" and steps == SLOW_STEPS:
                        slow_done.set()
                in_force[learner_id] = learner.progress()["sync_every"]
        except BaseException as exc:
            errors.append(exc)
            slow_done.set()

    threads = [threading.Thread(target=train, args=(lid, s))
               for lid, s in (("fast", FAST_S), ("slow", SLOW_S))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    return in_force


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def mean_staleness(log: list[dict[str, Any]], learner: str | None = None) -> float:
    merged = [c["staleness"] for e in log if e["kind"] == "commit" for c in e["manifest"]
              if c["weight"] > 0 and learner in (None, c["learner"])]
    assert merged
    return sum(merged) / len(merged)


@pytest.fixture
def start_logged(start_daemon: Callable[..., Daemon],
                 tmp_path: Path) -> Callable[[str], tuple[Daemon, Path]]:
    def start(name: str) -> tuple[Daemon, Path]:
        log = tmp_path / f"{name}.jsonl"
        daemon = start_daemon("--event-log", str(log), "--set", "policy.grace_max_s=0.2",
                              "--set", f"policy.h_max={H_MAX}", "--set", "policy.h_min=2",
                              "--set", "policy.max_staleness=64",
                              "--set", "heartbeat_interval_ms=200", "--set", "fsync=false")
        return daemon, log
    return start


def test_the_slow_learner_gets_fewer_steps_and_its_merges_are_less_stale(
        start_logged: Callable[[str], tuple[Daemon, Path]]) -> None:
    fixed_daemon, fixed_log = start_logged("fixed")
    run_pair(fixed_daemon, H_MAX)
    fixed = events(fixed_log)
    assert not [e for e in fixed if e["kind"] == "sync_every"]  # nobody asked

    auto_daemon, auto_log = start_logged("auto")
    in_force = run_pair(auto_daemon, "auto")
    wait_until(lambda: any(e["kind"] == "leave" for e in events(auto_log)),
               message="the learners' leave")
    auto = events(auto_log)
    assigned: dict[str, list[int]] = {}
    for e in auto:
        if e["kind"] == "sync_every":
            assigned.setdefault(e["learner"], []).append(e["sync_every"])
    # Both started at h_max (no step time known at join); once measured, the fast
    # one keeps h_max and the slow one is given about a quarter of it.
    assert assigned["fast"][0] == assigned["slow"][0] == H_MAX, assigned
    assert assigned["fast"][-1] == H_MAX, assigned
    assert 2 <= assigned["slow"][-1] <= H_MAX // 2, assigned
    assert in_force["fast"] == H_MAX and in_force["slow"] <= H_MAX // 2, in_force
    assert not [problem for e in auto for problem in problems(e)]
    # The slow learner's pushes no longer arrive four of the fast one's versions behind.
    # (At quorum 1 the fast one's own come a version behind instead, one per slow
    # commit: the mean over both moves less; with a quorum that waits for both, equal
    # periods are what lets a round merge both pushes.)
    slow_fixed, slow_auto = mean_staleness(fixed, "slow"), mean_staleness(auto, "slow")
    assert slow_auto <= 0.7 * slow_fixed, (slow_auto, slow_fixed)
