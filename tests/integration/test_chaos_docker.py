"""The chaos harness's docker backend: the same experiment files and checkers, with
every process a container on a network of the run's own and faults through the
docker API — kill, pause, latency and bandwidth through proxy containers, and
partitions of a learner, of the leader and of an etcd member in a replicated
topology, which the process backend cannot cut. Every run leaves no container,
network or volume behind, also when interrupted with SIGINT midway; without a
docker engine a run fails before anything starts, in one line.

Synthetic task, small steps: each run takes well under a minute of containers. A
step takes at least `step_ms`, so that the learners outlive the fault schedule
on an idle machine too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import docker
import pytest

from chaos.docker import EXPERIMENT_LABEL, leftovers
from chaos.experiment import Experiment
from coordinator.config import ConfigError, load
from tests.integration.test_chaos_faults import interrupt_midway, run

EXPERIMENT = """\
name = "{name}"
seed = 3
max_duration_s = 90
backend = "docker"
{top}
[docker]
image = "{image}"

[coordinator]
{coordinator}

[coordinator.settings]
"policy.grace_max_s" = 0.3
"policy.max_staleness" = 64
"outer.lr" = 0.3
"outer.momentum" = 0.0
{settings}

[learners]
count = 2
task = "synthetic"
steps = {steps}
sync_every = 20
args = ["--step-ms", "{step_ms}"]
{learners}
{etcd}
{faults}

[checks]
max_blocked_s = 10
{checks}
"""

SINGLE = dict(top="", coordinator="", settings="", learners="", etcd="", checks="")
HA = dict(top="proxy = false", coordinator="replicas = 2", settings='"ha.lease_ttl_s" = 3',
          learners='discovery = "etcd"', etcd="[etcd]\nmembers = 3",
          checks="max_failover_s = 6.0")


def fault(kind: str, target: str, at_s: float, duration_s: float, extra: str = "") -> str:
    return (f'[[faults]]\nkind = "{kind}"\ntarget = "{target}"\nat_s = {at_s}\n'
            f"duration_s = {duration_s}\n{extra}\n")


def faults_of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == "fault" and e["fault"] == kind]


def nothing_left(name: str) -> list[str]:
    client = docker.from_env()
    try:
        return leftovers(client, f"{EXPERIMENT_LABEL}={name}")
    finally:
        client.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_pause_latency_and_bandwidth_in_containers(image: str, tmp_path: Path) -> None:
    faults = (fault("kill_learner", "learner-0", 3, 2)
              + fault("pause_learner", "learner-1", 3, 2)
              + fault("latency", "learner-0", 8, 3, "latency_ms = 150")
              + fault("bandwidth", "learner-1", 8, 3, "bandwidth_bytes_s = 50000"))
    name = "docker-faults-single"
    events, summary = run(tmp_path, name, EXPERIMENT.format(name=name, image=image, steps=1500,
                                                      step_ms=10, faults=faults, **SINGLE))
    assert all(check["passed"] for check in summary["checks"]), summary["checks"]
    for kind in ("kill_learner", "pause_learner", "latency", "bandwidth"):
        assert [f["action"] for f in faults_of(events, kind)] == ["inject", "heal"], kind
    starts = [e for e in events if e["kind"] == "process_start"]
    assert [e["name"] for e in starts].count("learner-0") == 2
    heal = faults_of(events, "kill_learner")[1]
    assert any(e["kind"] == "join" and e["source"] == "learner-0" and e["t"] > heal["t"]
               for e in events), "the restarted learner container never joined again"
    assert faults_of(events, "latency")[0]["detail"] == "150 ms"
    assert nothing_left(name) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_partitions_of_a_learner_the_leader_and_an_etcd_member(image: str,
                                                               tmp_path: Path) -> None:
    """What the process backend cannot do: in a replicated topology, a learner cut
    from the leader only, the leader cut from everything (a standby takes over), an
    etcd member cut off (etcd keeps its quorum), and a learner cut from the
    synchronizer."""
    faults = (fault("partition", "learner-1", 4, 4, 'cut_from = ["leader"]')
              + fault("partition", "leader", 10, 5)
              + fault("partition", "m1", 18, 4)
              + fault("partition_learner", "learner-0", 24, 3))
    name = "docker-faults-ha"
    events, summary = run(tmp_path, name, EXPERIMENT.format(name=name, image=image, steps=3500,
                                                      step_ms=10, faults=faults, **HA))
    checks = {check["name"]: check for check in summary["checks"]}
    assert all(check["passed"] for check in checks.values()), summary["checks"]
    assert {"no_split_brain", "exactly_once_replicas", "failover_within"} <= set(checks)
    cuts = faults_of(events, "partition")
    assert [(f["action"]) for f in cuts] == ["inject", "heal"] * 3, cuts
    from_leader, leader, member = cuts[0], cuts[2], cuts[4]
    assert from_leader["cut_from"][0] in ("r0", "r1") and from_leader["target"] == "learner-1"
    assert leader["target"] in ("r0", "r1") and leader["epoch"] >= 1
    assert leader["detail"] == "disconnected from the run's network"
    assert member["target"] == "m1"
    # The cut-off leader stepped down or was deposed: a newer epoch was elected.
    assert any(e["kind"] == "elected" and e["epoch"] > leader["epoch"] for e in events)
    assert [f["action"] for f in faults_of(events, "partition_learner")] == ["inject", "heal"]
    assert not [e for e in events if e["kind"] == "fault_note"], "a route change failed"
    # A learner cut from the leader (the standby refuses what is the leader's) has
    # nothing acknowledged while the cut lasts: from a second after it was in force
    # until its heal began (the routes' removal takes a helper container's start).
    healed = cuts[1]["t"] - cuts[1]["took_s"]
    cut = [e for e in events if e["source"] == "learner-1" and e["kind"] == "push_ack"
           and from_leader["t"] + 1.0 < e["t"] < healed]
    assert not cut, (cut, healed)
    assert nothing_left(name) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_interrupted_midway_leaves_no_container_network_or_volume(
        image: str, tmp_path: Path) -> None:
    name = "docker-interrupted"
    path = tmp_path / "experiment.toml"
    path.write_text(EXPERIMENT.format(name=name, image=image, steps=100000, step_ms=5,
                                      faults="", **SINGLE))
    out = tmp_path / "out"
    # Midway: every learner container running and logging, and the network, the
    # coordinator, 2 proxies and 2 learners there.
    code, said = interrupt_midway(
        path, out, lambda: all((out / f"learner-{i}.events.jsonl").exists()
                               for i in range(2)) and len(nothing_left(name)) >= 5, 120)
    assert code == 130, said
    assert nothing_left(name) == []


def test_docker_backend_without_an_engine_fails_before_anything_starts(tmp_path: Path) -> None:
    path = tmp_path / "experiment.toml"
    path.write_text(EXPERIMENT.format(name="no-engine", image="ftsync:test", steps=100,
                                      step_ms=5, faults="", **SINGLE))
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "chaos", "run", str(path), "--out", str(tmp_path / "out"),
         "--quiet"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock"})
    assert result.returncode == 3
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "needs a docker engine" in lines[0] and "start one" in lines[0]
    assert "dockerd" in lines[0] and "DOCKER_HOST" in lines[0]
    assert not (tmp_path / "out").exists()
    assert time.monotonic() - started < 60


@pytest.mark.parametrize(("text", "says"), [
    ('backend = "vm"', "backend"),
    ('[[faults]]\nkind = "partition"\ntarget = "learner-0"\nat_s = 1', 'needs backend = "docker"'),
])
def test_backend_and_partition_are_validated(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "experiment.toml"
    path.write_text(f'name = "x"\n{text}\n')
    with pytest.raises(ConfigError, match=says):
        load(Experiment, path)
