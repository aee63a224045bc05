"""The plain daemon converges at every quorum on every built-in task.

A new user starts `ftsync-coordinator` with no outer settings: DiLoCo's lr 0.7
and Nesterov 0.9, made for lock-step rounds. Here a real daemon and real
`ftsync-learner` processes train each built-in task at quorum 1..M and the
learners' held-out loss must fall. Without the adaptive outer step
(`outer.adaptive = false`) two synthetic learners at quorum 2 and two digits
learners at quorum 1 end above where they started.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest

from tests.daemon import Daemon

# (task, learners, steps, largest end/start ratio of the mean held-out loss).
TASKS = [("synthetic", 3, 400, 0.5), ("digits", 2, 400, 0.5),
         pytest.param("lm-stdlib", 2, 150, 0.8, marks=pytest.mark.slow)]


def run_learners(daemon: Daemon, task: str, learners: int, steps: int) -> list[dict[str, float]]:
    """Start `learners` learners on shards of `task` at the CLI's defaults; their summaries."""
    processes = [subprocess.Popen(
        [sys.executable, "-m", "learner", "--coordinator", daemon.address, "--task", task,
         "--size", "tiny", "--learner-id", f"learner-{i}", "--shard", str(i),
         "--num-shards", str(learners), "--steps", str(steps), "--progress-every", "1000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(learners)]
    summaries = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-2000:]
        summaries.append(json.loads(out.strip().splitlines()[-1]))
    return summaries


@pytest.mark.parametrize(("task", "learners", "steps", "ratio"), TASKS)
def test_the_plain_daemon_converges_at_every_quorum(
        start_daemon: Callable[..., Daemon], task: str, learners: int, steps: int,
        ratio: float) -> None:
    for quorum in range(1, learners + 1):
        daemon = start_daemon("--set", f"policy.min_quorum={quorum}")
        summaries = run_learners(daemon, task, learners, steps)
        daemon.stop()
        start = sum(s["eval_loss_start"] for s in summaries) / learners
        end = sum(s["eval_loss_end"] for s in summaries) / learners
        assert end <= ratio * start, (
            f"{task} at quorum {quorum} of {learners}: held-out loss {start:.3f} -> {end:.3f}")
