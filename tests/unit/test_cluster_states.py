"""When the harness counts a learner as ended: its process decides, not the label a fault
left on it. A run whose learners are all done ends there instead of at max_duration_s,
whatever fault was on a learner as it took its last step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from chaos.experiment import load_experiment, schedule
from chaos.runner import ProcessCluster

EXPERIMENT = """\
name = "states"
seed = 1
max_duration_s = 60

[learners]
count = 2
task = "synthetic"
steps = 10

[[faults]]
kind = "straggle"
target = "learner-0"
at_s = 1
duration_s = 5
duty = 0.5

[[faults]]
kind = "pause_learner"
target = "learner-0"
at_s = 2
duration_s = 1
"""


@pytest.fixture
def cluster(tmp_path: Path) -> ProcessCluster:
    path = tmp_path / "states.toml"
    path.write_text(EXPERIMENT)
    built = ProcessCluster(load_experiment(path), tmp_path / "out")
    ended = subprocess.Popen([sys.executable, "-c", "pass"], text=True)
    ended.wait()
    for slot in built.learners:
        slot.process, slot.state = ended, "done"
    return built


def test_a_fault_state_left_on_an_ended_learner_does_not_hold_the_run(
        cluster: ProcessCluster) -> None:
    slot = cluster.learners[0]
    for label in ("straggling", "paused", "partitioned"):
        slot.state = label
        assert cluster.finished, label
    slot.state = "killed"  # waiting for its scripted restart
    assert not cluster.finished


def test_a_running_learner_under_a_fault_holds_the_run(cluster: ProcessCluster) -> None:
    slot = cluster.learners[0]
    slot.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                                    text=True)
    try:
        slot.state = "straggling"
        assert not cluster.finished
    finally:
        slot.process.kill()
        slot.process.wait()
    assert cluster.finished


def test_a_fault_that_begins_after_its_learner_ended_leaves_it_done(
        cluster: ProcessCluster) -> None:
    slot = cluster.learners[0]
    straggle, pause = (next(a for a in schedule(cluster.experiment)
                            if a.fault.kind == kind and not a.heal)
                       for kind in ("straggle", "pause_learner"))
    cluster._straggle_fault(straggle, (0, 0))
    assert slot.state == "done"
    cluster._pause_learner_fault(pause, (1, 0))
    assert slot.state == "done"
    assert slot.straggler is not None
    slot.straggler.set()  # the duty cycle's thread ends
