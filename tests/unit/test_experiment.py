"""Experiment files: validation with key and line, and the seeded fault timeline."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from chaos.cluster import make_cluster
from chaos.experiment import Experiment, FaultKind, load_experiment, schedule
from chaos.proxy import LinkSpec
from chaos.runner import Timeline
from chaos.sim import load_scenario, replay_kills
from coordinator.config import ConfigError

EXPERIMENTS = sorted(Path(__file__).parents[2].joinpath("experiments").glob("*.toml"))
SIM_STORM = Path(__file__).parents[2] / "experiments" / "sim" / "learner-storm.toml"

BASE = """\
name = "t"
seed = 4
max_duration_s = 100

[learners]
count = 3
"""


def error_of(tmp_path: Path, text: str) -> str:
    path = tmp_path / "exp.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_experiment(path)
    return str(info.value)


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_shipped_experiments_load(path: Path) -> None:
    experiment = load_experiment(path)
    assert experiment.name == path.stem
    assert schedule(experiment)


def test_the_shipped_set_is_complete() -> None:
    assert {p.stem for p in EXPERIMENTS} >= {
        "quickstart", "quickstart-sync", "learner-storm", "stragglers", "partition",
        "adversarial", "coordinator-restart", "ha-leader-kill", "ha-partition-leader",
        "ha-etcd-member-kill", "ha-secure", "rolling-upgrade"}


@pytest.mark.parametrize(("fault", "needles"), [
    ('kind = "explode"\nat_s = 1', ["faults.0.kind", "must be one of", "line 9"]),
    ('kind = "kill_learner"', ["exactly one of at_s, every_s or mtbf_s", "line 9"]),
    ('kind = "kill_learner"\nat_s = 1\nevery_s = 2', ["exactly one of", "line 9"]),
    ('kind = "kill_learner"\ntarget = "learner-9"\nat_s = 1',
     ["faults.0.target 'learner-9' is not a learner", "line 10"]),
    ('kind = "straggle"\nat_s = 1\nduty = 1.5', ["faults.0.duty", "(0, 1)", "line 11"]),
    ('kind = "adversary"\nat_s = 1\nadversary = ["nan", "flood"]',
     ["adversary kinds ['flood'] unknown", "line 11"]),
    ('kind = "kill_coordinator"\ntarget = "learner-1"\nat_s = 1',
     ["target of kill_coordinator must be 'coordinator'"]),
    ('kind = "latency"\nat_s = 1\nlatency_ms = "slow"', ["faults.0.latency_ms must be float",
                                                          "line 11"]),
    ('kind = "kill_learner"\nat_s = 1\nwhen = 3', ["unknown key 'faults.0.when'", "line 11"]),
    # A NaN time sorts first and froze the schedule behind it.
    ('kind = "kill_learner"\nat_s = nan', ["faults.0.at_s", "finite", "line 10"]),
    ('kind = "kill_learner"\nat_s = 1\nduration_s = inf', ["duration_s", "finite", "line 11"]),
    ('kind = "kill_learner"\nevery_s = 5\ncount = -1', ["count must be >= 0", "line 11"]),
    ('kind = "kill_learner"\nat_s = 120', ["at_s 120 is not before the end of the run",
                                             "max_duration_s 100", "line 10"]),
    ('target = "learner-1"\nat_s = 1', ["needs key 'faults.0.kind'", "line 8"]),
    ('kind = "kill_learner"\nat_s = 1\nafter_version = -1',
     ["faults.0.after_version", "must be >= 0", "line 11"]),
    ('kind = "kill_learner"\nat_s = 1\nafter_version = 1.5',
     ["faults.0.after_version must be int", "line 11"]),
])
def test_bad_fault_names_key_and_line(tmp_path: Path, fault: str, needles: list[str]) -> None:
    message = error_of(tmp_path, BASE + "\n[[faults]]\n" + fault + "\n")
    for needle in needles:
        assert needle in message, message


def test_a_later_fault_table_is_located(tmp_path: Path) -> None:
    text = (BASE + '\n[[faults]]\nkind = "kill_learner"\nat_s = 1\n'
            '\n[[faults]]\nkind = "pause_learner"\nat_s = -3\n')
    message = error_of(tmp_path, text)
    assert "at_s must be positive" in message and "line 14" in message, message


def test_network_faults_need_the_proxy(tmp_path: Path) -> None:
    text = BASE.replace('name = "t"', 'name = "t"\nproxy = false') + (
        '\n[[faults]]\nkind = "partition_learner"\nat_s = 1\n')
    assert "needs proxy = true" in error_of(tmp_path, text)


def test_links_from_the_start_per_experiment_and_per_learner(tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text(BASE + '\n[link]\nlatency_ms = 25\nbandwidth_bytes_s = 12_500_000\n'
                    '\n[links.learner-2]\nlatency_ms = 150\n')
    experiment = load_experiment(path)
    assert experiment.link_for("learner-0") == LinkSpec(25, 12.5e6)
    assert experiment.link_for("learner-2") == LinkSpec(150, 0)
    assert load_experiment_text(tmp_path, BASE).link_for("learner-1") == LinkSpec()


@pytest.mark.parametrize(("extra", "needles"), [
    ("[link]\nlatency_ms = -1\n", ["link.latency_ms", "must be >= 0 and finite", "line 9"]),
    ("[link]\nbandwidth_bytes_s = nan\n", ["bandwidth_bytes_s must be >= 0", "line 9"]),
    ("[link]\nlatency = 5\n", ["unknown key 'link.latency'", "line 9"]),
    ("[links.learner-7]\nlatency_ms = 5\n", ["links.learner-7 is not a learner"]),
])
def test_bad_links_are_refused_naming_the_key(tmp_path: Path, extra: str,
                                              needles: list[str]) -> None:
    message = error_of(tmp_path, BASE + "\n" + extra)
    assert all(needle in message for needle in needles), message


def test_a_link_needs_the_proxy(tmp_path: Path) -> None:
    text = BASE.replace('name = "t"', 'name = "t"\nproxy = false') + (
        "\n[link]\nlatency_ms = 25\n")
    assert "link and links need proxy = true" in error_of(tmp_path, text)


def load_experiment_text(tmp_path: Path, text: str) -> Experiment:
    path = tmp_path / "plain.toml"
    path.write_text(text)
    return load_experiment(path)


def test_other_sections_are_checked_too(tmp_path: Path) -> None:
    assert "learners.count must be at least 1" in error_of(
        tmp_path, BASE.replace("count = 3", "count = 0"))
    assert "coordinator.mode must be one of" in error_of(
        tmp_path, BASE + '\n[coordinator]\nmode = "eventual"\n')
    assert "unknown key 'chekcs'" in error_of(tmp_path, BASE + "\n[chekcs]\nmin_uptime = 1\n")
    assert "the file needs key 'name'" in error_of(tmp_path, BASE.replace('name = "t"\n', ""))


@pytest.mark.parametrize(("section", "needles"), [
    ("[checks]\nmin_goodput = 7", ["checks.min_goodput", "[0, 1]", "line 9"]),
    ("[checks]\nwindow_s = 0", ["checks.window_s", "> 0", "line 9"]),
    ("[checks]\nmax_blocked_s = -5", ["checks.max_blocked_s", ">= 0", "line 9"]),
    # The coordinator's own settings are checked as it will read them, before it starts.
    ('[coordinator.settings]\n"policy.grace_max_sec" = 0.3',
     ["coordinator.settings", "did you mean 'policy.grace_max_s'", "line 8"]),
    ('[coordinator.settings]\n"outer.lr" = -1', ["coordinator.settings", "outer.lr", "line 8"]),
])
def test_checks_and_coordinator_settings_are_validated(tmp_path: Path, section: str,
                                                       needles: list[str]) -> None:
    message = error_of(tmp_path, BASE + "\n" + section + "\n")
    for needle in needles:
        assert needle in message, message


def test_missing_file_and_syntax_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_experiment(tmp_path / "absent.toml")
    assert "line 2" in error_of(tmp_path, 'name = "t"\nseed = = 3\n')


def test_schedule_is_seeded_and_pairs_every_injection_with_a_heal(tmp_path: Path) -> None:
    text = BASE + ('\n[[faults]]\nkind = "kill_learner"\nmtbf_s = 10\nduration_s = 4\n'
                   '\n[[faults]]\nkind = "pause_learner"\nevery_s = 30\ncount = 2\n')
    path = tmp_path / "exp.toml"
    path.write_text(text)
    first, again = schedule(load_experiment(path)), schedule(load_experiment(path))
    assert first == again
    path.write_text(text.replace("seed = 4", "seed = 5"))
    assert schedule(load_experiment(path)) != first
    injections = [a for a in first if not a.heal]
    heals = [a for a in first if a.heal]
    assert len(injections) == len(heals)
    for action in injections:
        heal = next(h for h in heals if h.fault is action.fault
                    and h.occurrence == action.occurrence)
        assert heal.at_s == action.at_s + action.fault.duration_s
        assert heal.target == action.target
        assert action.target in {"learner-0", "learner-1", "learner-2"}
    pauses = [a for a in injections if a.fault.kind == "pause_learner"]
    assert [a.at_s for a in pauses] == [30.0, 60.0]
    assert all(a.at_s < 100 for a in injections)
    assert [a.at_s for a in first] == sorted(a.at_s for a in first)


HA = BASE.replace('name = "t"', 'name = "t"\nproxy = false') + (
    '\n[etcd]\nmembers = 3\n\n[coordinator]\nreplicas = 2\n')


@pytest.mark.parametrize(("text", "needle"), [
    (HA.replace("members = 3", "members = 0"), "coordinator.replicas = 2 needs an etcd"),
    (HA, "learners.discovery must be 'addresses' or 'etcd'"),
    (BASE.replace("count = 3", 'count = 3\ndiscovery = "etcd"'),
     "learners.discovery = 'etcd' needs coordinator.replicas > 1"),
    (HA.replace("proxy = false", "proxy = true").replace("count = 3", 'count = 3\n'
                                                         'discovery = "etcd"'),
     "set proxy = false with coordinator.replicas > 1"),
    (BASE + '\n[[faults]]\nkind = "kill_leader"\nat_s = 1\n',
     "faults.0.kind 'kill_leader' needs coordinator.replicas > 1"),
    (HA.replace("count = 3", 'count = 3\ndiscovery = "etcd"')
     + '\n[[faults]]\nkind = "partition_leader_from_etcd"\nat_s = 1\n',
     "needs coordinator.etcd_proxies = true"),
    (HA.replace("count = 3", 'count = 3\ndiscovery = "etcd"')
     + '\n[[faults]]\nkind = "kill_etcd_member"\ntarget = "m3"\nat_s = 1\n',
     "faults.0.target 'm3' is not an etcd member (m0, m1, m2 or 'random')"),
    (HA.replace("count = 3", 'count = 3\ndiscovery = "etcd"')
     + '\n[[faults]]\nkind = "kill_coordinator"\nat_s = 1\n', "use 'kill_leader'"),
    (HA.replace("count = 3", 'count = 3\ndiscovery = "etcd"')
     + '\n[[faults]]\nkind = "pause_leader"\ntarget = "r1"\nat_s = 1\n',
     "target of pause_leader is always the leader"),
    (BASE + '\n[[faults]]\nkind = "kill_learner"\nduring = "grace"\nat_s = 1\n',
     "applies to kill_leader only"),
])
def test_bad_high_availability_topology_or_fault(tmp_path: Path, text: str,
                                                  needle: str) -> None:
    assert needle in error_of(tmp_path, text)


def test_leader_faults_target_the_leader_and_etcd_faults_a_seeded_member(
        tmp_path: Path) -> None:
    text = HA.replace("count = 3", 'count = 3\ndiscovery = "addresses"') + (
        '\n[[faults]]\nkind = "kill_leader"\nduring = "grace"\nevery_s = 20\n'
        '\n[[faults]]\nkind = "kill_etcd_member"\nevery_s = 30\n')
    path = tmp_path / "exp.toml"
    path.write_text(text)
    actions = schedule(load_experiment(path))
    assert {a.target for a in actions if a.fault.kind == "kill_leader"} == {"leader"}
    members = [a.target for a in actions if a.fault.kind == "kill_etcd_member"]
    assert members and set(members) <= {"m0", "m1", "m2"}
    assert members == [a.target for a in schedule(load_experiment(path))
                       if a.fault.kind == "kill_etcd_member"]


HA_ADDRESSES = HA.replace("count = 3", 'count = 3\ndiscovery = "addresses"')


@pytest.mark.parametrize(("text", "needle"), [
    (BASE + '\n[[faults]]\nkind = "drain_replica"\ntarget = "leader"\nat_s = 1\n',
     "faults.0.target 'leader' needs coordinator.replicas > 1"),
    (HA_ADDRESSES + '\n[[faults]]\nkind = "drain_replica"\ntarget = "coordinator"\nat_s = 1\n',
     "faults.0.target 'coordinator' is for a single coordinator"),
    (HA_ADDRESSES + '\n[[faults]]\nkind = "drain_replica"\ntarget = "r2"\nat_s = 1\n',
     "faults.0.target 'r2' is not a replica of this experiment (r0..r1)"),
    (BASE + '\n[[faults]]\nkind = "drain_replica"\ntarget = "learner-0"\nat_s = 1\n',
     "target of drain_replica must be 'coordinator', 'leader', 'standby' or a replica"),
    (BASE + '\n[[faults]]\nkind = "drain_replica"\ndrain_timeout_s = 0\nat_s = 1\n',
     "drain_timeout_s must be positive"),
])
def test_bad_drain_target(tmp_path: Path, text: str, needle: str) -> None:
    assert needle in error_of(tmp_path, text)


@pytest.mark.parametrize(("text", "target"), [
    (BASE, "coordinator"), (HA_ADDRESSES, "leader")])
def test_a_drain_of_no_named_target_drains_the_coordinator_or_the_leader(
        tmp_path: Path, text: str, target: str) -> None:
    path = tmp_path / "exp.toml"
    path.write_text(text + '\n[[faults]]\nkind = "drain_replica"\nat_s = 1\n')
    actions = schedule(load_experiment(path))
    assert [(a.target, a.heal) for a in actions] == [(target, False), (target, True)]


def test_every_adversary_runs_as_a_learner_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text(BASE + '\n[[faults]]\nkind = "adversary"\nat_s = 1\n'
                    '\n[[faults]]\nkind = "adversary"\nevery_s = 30\ncount = 2\n')
    injections = [a.target for a in schedule(load_experiment(path)) if not a.heal]
    assert sorted(injections) == ["adversary-0", "adversary-1", "adversary-2"]


def test_coordinator_settings_keep_toml_booleans(tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text(BASE + '\n[coordinator.settings]\n"outer.nesterov" = false\n')
    assert load_experiment(path).coordinator.overrides()["outer.nesterov"] == "false"


def test_a_quorum_that_chooses_itself(tmp_path: Path) -> None:
    experiment = load_experiment_text(tmp_path, BASE + '\n[coordinator]\nmin_quorum = "auto"\n')
    assert experiment.coordinator.min_quorum == "auto"
    message = error_of(tmp_path, BASE + '\n[coordinator]\nmin_quorum = "most"\n')
    assert "coordinator.min_quorum must be int or one of ['auto']" in message, message


def test_every_fault_kind_has_an_inject_and_heal(tmp_path: Path) -> None:
    """One table of fault handlers: a kind an experiment accepts and the harness
    cannot carry out would fail only when a run strikes with it. (Building the
    cluster starts nothing.)"""
    cluster = make_cluster(load_experiment(EXPERIMENTS[0]), tmp_path)
    assert set(cluster._faults) == set(typing.get_args(FaultKind))


def test_learners_take_sync_every_auto_and_refuse_other_words(tmp_path: Path) -> None:
    experiment = load_experiment_text(tmp_path, BASE + 'sync_every = "auto"\n')
    assert experiment.learners.sync_every == "auto"
    assert "learners.sync_every must be int or one of ['auto']" in error_of(
        tmp_path, BASE + 'sync_every = "banana"\n')
    assert "learners.sync_every must be at least 1" in error_of(tmp_path,
                                                                BASE + "sync_every = 0\n")


def test_a_fault_after_a_version_counts_from_when_every_fragment_reached_it(
        tmp_path: Path) -> None:
    """The run's clock for the others; the version's, once the driver reports it, for
    the fault with after_version: its injection and its heal both move."""
    text = BASE + ('\n[[faults]]\nkind = "pause_learner"\ntarget = "learner-0"\nat_s = 2\n'
                   'duration_s = 3\n'
                   '\n[[faults]]\nkind = "kill_learner"\ntarget = "learner-1"\nat_s = 1\n'
                   'duration_s = 2\nafter_version = 1\n')
    path = tmp_path / "exp.toml"
    path.write_text(text)
    timeline = Timeline(schedule(load_experiment(path)), started=100.0)

    def due(now: float, reached: int | None) -> list[tuple[str, bool]]:
        return [(a.fault.kind, a.heal) for a in timeline.due(now, reached)]

    assert timeline.waiting
    assert due(101.0, None) == []
    assert due(102.0, 0) == [("pause_learner", False)]  # version 0: the kill still waits
    assert due(104.0, 1) == []  # version 1 reached now: the kill is 1 s away
    assert not timeline.waiting
    assert due(105.0, None) == [("kill_learner", False), ("pause_learner", True)]
    assert due(106.9, None) == []
    assert due(107.0, None) == [("kill_learner", True)]
    assert timeline.upcoming is None


def test_the_simulator_refuses_to_replay_kills_that_wait_for_a_version(
        tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text(BASE + '\n[[faults]]\nkind = "kill_learner"\nat_s = 1\n'
                           'after_version = 1\n')
    scenario = load_scenario(SIM_STORM)
    replayed = dataclasses.replace(scenario, failures=dataclasses.replace(
        scenario.failures, replay=str(path)), cluster=dataclasses.replace(
        scenario.cluster, learners=3))
    with pytest.raises(ConfigError, match="after_version"):
        replay_kills(replayed)
