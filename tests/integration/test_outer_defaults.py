"""The plain daemon converges at every quorum on every built-in task.

A new user starts `ftsync-coordinator` with no outer settings: lr 0.7 without
momentum, scaled per round. Here a real daemon and real `ftsync-learner` processes
train each built-in task at quorum 1..M, with the CLI's fixed H and with
`sync_every = "auto"`, and the learners' held-out loss must fall. With the auto H
and a step as long as a small accelerator's (`--step-ms`) each round closes before
its learners push again: rounds merge every learner at staleness 0 (step scale 1),
DiLoCo's lock-step case, where its Nesterov 0.9 (the default before) steps several
times as far as the learners moved: digits ended at about half its start instead of
a tenth (BENCHMARKS.md "Outer defaults").
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest

from tests.daemon import Daemon

# (task, learners, steps, largest end/start ratio of the mean held-out loss).
TASKS = [("synthetic", 3, 400, 0.5), ("digits", 2, 400, 0.3),
         pytest.param("lm-stdlib", 2, 150, 0.8, marks=pytest.mark.slow)]


def run_learners(daemon: Daemon, task: str, learners: int, steps: int,
                 local: list[str]) -> list[dict[str, float]]:
    """Start `learners` learners on shards of `task` at the CLI's defaults but for the
    flags in `local`; their summaries."""
    processes = [subprocess.Popen(
        [sys.executable, "-m", "learner", "--coordinator", daemon.address, "--task", task,
         "--size", "tiny", "--learner-id", f"learner-{i}", "--shard", str(i),
         "--num-shards", str(learners), "--steps", str(steps), "--progress-every", "1000",
         *local],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(learners)]
    summaries = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-2000:]
        summaries.append(json.loads(out.strip().splitlines()[-1]))
    return summaries


# The CLI's fixed H, and H from the coordinator with a step of 20 ms.
@pytest.mark.parametrize("local", [[], ["--sync-every", "auto", "--step-ms", "20"]],
                         ids=["fixed-h", "auto-h"])
@pytest.mark.parametrize(("task", "learners", "steps", "ratio"), TASKS)
def test_the_plain_daemon_converges_at_every_quorum(
        start_daemon: Callable[..., Daemon], task: str, learners: int, steps: int,
        ratio: float, local: list[str]) -> None:
    for quorum in range(1, learners + 1):
        daemon = start_daemon("--set", f"policy.min_quorum={quorum}")
        summaries = run_learners(daemon, task, learners, steps, local)
        daemon.stop()
        start = sum(s["eval_loss_start"] for s in summaries) / learners
        end = sum(s["eval_loss_end"] for s in summaries) / learners
        assert end <= ratio * start, (
            f"{task} at quorum {quorum} of {learners}, {' '.join(local) or 'fixed H'}: "
            f"held-out loss {start:.3f} -> {end:.3f}")
