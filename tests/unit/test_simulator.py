"""The discrete-event simulator (`chaos.sim`): analytic cases, the policy
core really in the loop, determinism, scenario validation and the CLI.

Every run here is small (a few learners, simulated hours) so the file stays
fast; bench/simulator.py times the 2.4M-chip month and checks the storm.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Literal

import pytest

from chaos import cli
from chaos.experiment import load_experiment, schedule
from chaos.sim import replay_kills, run_once, simulate, sweep, table
from chaos.sim.results import Result
from chaos.sim.scenario import (
    ClusterSpec,
    FailureSpec,
    HostSpec,
    Scenario,
    SweepSpec,
    TrainingSpec,
    load_scenario,
)
from coordinator import policy as policy_module
from coordinator.config import ConfigError
from coordinator.policy import PolicyConfig
from learner.schedule import offsets

ROOT = Path(__file__).parents[2]
SCENARIOS = sorted((ROOT / "experiments" / "sim").glob("*.toml"))
NEVER = 1e15  # an MTBF no run reaches


def scenario(method: str = "ftsync", chips: int = 64, learners: int = 4,
             duration_s: float = 20_000.0, seed: int = 3, **parts: Any) -> Scenario:
    """A small scenario; `parts` replaces whole sections (cluster=..., failures=...)."""
    base = Scenario(
        name="t", seed=seed, duration_s=duration_s, method=method,  # type: ignore[arg-type]
        uptime_window_s=60.0,
        cluster=ClusterSpec(chips=chips, learners=learners),
        failures=FailureSpec(mtbf_chip_s=NEVER, restart_s=60.0, startup_s=0.0,
                             catchup_s=0.0, reform_s=10.0),
        training=TrainingSpec(step_s=1.0, sync_every=40, fragments=4, overlap=2,
                              push_s=0.5, sync_s=0.2, pull_s=0.5))
    return dataclasses.replace(base, **parts)


def with_failures(s: Scenario, **kw: Any) -> Scenario:
    return dataclasses.replace(s, failures=dataclasses.replace(s.failures, **kw))


def with_training(s: Scenario, **kw: Any) -> Scenario:
    return dataclasses.replace(s, training=dataclasses.replace(s.training, **kw))


def with_policy(s: Scenario, **kw: Any) -> Scenario:
    return dataclasses.replace(s, policy=dataclasses.replace(s.policy, **kw))


# -- analytic cases --------------------------------------------------------------------


def test_without_failures_dp_goodput_is_one() -> None:
    for method in ("dp", "elastic-dp"):
        r = simulate(scenario(method=method))
        assert r.failures == 0
        assert r.goodput == pytest.approx(1.0, abs=1e-3), method
        assert r.uptime == pytest.approx(1.0)


def test_without_failures_ftsync_overwriting_loses_only_the_overlap() -> None:
    """A pulled fragment overwrites the τ steps since its push: goodput 1 − τ/H,
    and 1 as τ/H -> 0."""
    overwrite = with_training(scenario(), apply_rule="overwrite")
    r = simulate(overwrite)
    assert r.failures == 0 and r.dropped == {} and r.merged == r.contributions
    assert r.goodput == pytest.approx(1 - 2 / 40, abs=0.005)
    assert r.uptime == pytest.approx(1.0)
    long_h = simulate(with_training(overwrite, sync_every=2000, overlap=1))
    assert long_h.goodput == pytest.approx(1.0, abs=0.002)


@pytest.mark.parametrize("rule", ["carry", "boundary"])
def test_without_failures_ftsync_keeping_the_steps_since_the_push_loses_nothing(
        rule: str) -> None:
    """Carried onto the merged version, or applied right after the next push (which
    sent them), the τ steps since a push are work: goodput 1 at the same τ/H."""
    r = simulate(with_training(scenario(), apply_rule=rule))
    assert r.failures == 0 and r.dropped == {} and r.merged == r.contributions
    assert r.goodput == pytest.approx(1.0, abs=0.001)


@pytest.mark.parametrize(("mtbf_cluster", "restart", "startup", "catchup"), [
    (1000.0, 300.0, 0.0, 0.0),
    (5000.0, 200.0, 60.0, 40.0),
])
def test_dp_matches_the_closed_form(mtbf_cluster: float, restart: float, startup: float,
                                    catchup: float) -> None:
    chips = 1000
    s = with_failures(scenario(method="dp", chips=chips, duration_s=3000 * mtbf_cluster,
                               seed=7),
                      mtbf_chip_s=mtbf_cluster * chips, restart_s=restart,
                      startup_s=startup, catchup_s=catchup)
    r = simulate(s)
    mttr = restart + startup + catchup
    assert r.failures > 1000
    assert r.goodput == pytest.approx(1 / (1 + mttr / mtbf_cluster), abs=0.01)


def test_elastic_dp_pays_the_re_form_not_the_restart() -> None:
    base = with_failures(scenario(method="dp", chips=1000, duration_s=2e6),
                         mtbf_chip_s=1000 * 1000, restart_s=600, reform_s=20)
    dp = simulate(base)
    elastic = simulate(dataclasses.replace(base, method="elastic-dp"))
    assert elastic.goodput > dp.goodput + 0.2
    # About one re-form per failure, each a re-form's worth of every chip's time.
    assert elastic.goodput == pytest.approx(1 / (1 + 20 / 1000), abs=0.02)


def test_more_learners_never_lower_uptime() -> None:
    base = with_training(with_failures(scenario(chips=64, duration_s=100_000, seed=5),
                                       mtbf_chip_s=64 * 2000, restart_s=1500),
                         step_s=5.0, sync_every=20)
    base = dataclasses.replace(base, uptime_window_s=300.0)
    uptimes = [simulate(dataclasses.replace(
        base, cluster=dataclasses.replace(base.cluster, learners=m))).uptime
        for m in (1, 2, 4, 8, 16)]
    assert uptimes == sorted(uptimes), uptimes
    assert uptimes[0] < 0.8 < uptimes[-1]


def test_elastic_learners_beat_restarting_ones() -> None:
    base = with_training(with_failures(scenario(chips=64, duration_s=50_000),
                                       mtbf_chip_s=64 * 500, restart_s=1500, reform_s=10),
                         step_s=2.0)
    restarting = simulate(base)
    elastic = simulate(dataclasses.replace(
        base, cluster=dataclasses.replace(base.cluster, elastic=True)))
    assert elastic.goodput > restarting.goodput + 0.1
    assert elastic.failures > 50
    # A learner of 16 chips fails every 2000 s: it pauses 10 s to re-form, and
    # runs a chip short for the 1500 s that chip takes to come back (the τ steps
    # after each push are carried onto the merged version: no loss there).
    expected = (1 - 10 / 2000) * (1 - 1500 / 2000 / 16)
    assert elastic.goodput == pytest.approx(expected, abs=0.02)


def test_slow_chips_cost_throughput_not_goodput() -> None:
    base = scenario(method="dp", chips=10_000, duration_s=5000)
    even = simulate(base)
    varied = simulate(dataclasses.replace(
        base, cluster=dataclasses.replace(base.cluster, speed_sigma=0.1)))
    assert even.throughput == pytest.approx(even.goodput)
    assert varied.goodput == pytest.approx(1.0, abs=1e-3)
    # The whole job waits for its slowest chip, about 4 sigmas out.
    assert 1 / math.exp(0.1 * 4.5) < varied.throughput < 1 / math.exp(0.1 * 3)


def test_learners_sharing_cores_slow_each_other_down() -> None:
    base = with_training(scenario(chips=2, learners=2, duration_s=10_000), steps=100,
                         push_s=0.0, pull_s=0.0, sync_s=0.0)
    alone = simulate(base)
    shared = simulate(dataclasses.replace(base, host=HostSpec(cores=1.0)))
    assert alone.run_s == pytest.approx(100.0, abs=1.0)
    assert shared.run_s == pytest.approx(200.0, abs=2.0)
    assert shared.goodput == pytest.approx(alone.goodput, abs=0.01)  # wall time either way


def test_a_kill_of_a_finished_learner_changes_nothing() -> None:
    """The harness skips a kill (and its heal) of a learner that is done."""
    base = with_failures(with_training(scenario(chips=2, learners=2, duration_s=10_000),
                                       steps=100), restart_s=5.0, startup_s=10.0)
    # Both join at 10 s. learner-1 is killed at 40 s, back at 55 s and done at
    # 125.5 s; learner-0 is done at 110.5 s, before its kill at 112 s.
    result = run_once(base, 1, [(40.0, 1), (112.0, 0)])
    assert result.failures == 1
    assert result.run_s == pytest.approx(125.5, abs=0.5)


# -- the policy core is in the loop ----------------------------------------------------


def test_a_quorum_above_the_learner_count_never_advances() -> None:
    r = simulate(with_policy(scenario(learners=2), min_quorum=3))
    assert r.contributions > 100
    assert r.commits == 0 and r.merged == 0
    assert r.goodput == 0 and r.uptime == 0


def test_the_grace_window_batches_contributions() -> None:
    """γ = 1, τ = 8 steps of 1 s: a round with quorum waits up to ~8 s for more."""
    base = with_training(with_policy(scenario(learners=8), gamma=1.0, max_staleness=100),
                         overlap=8)
    none = simulate(with_policy(base, grace_max_s=0.0))
    wide = simulate(with_policy(base, grace_max_s=30.0))
    assert none.merged == wide.merged == none.contributions
    assert wide.commits < 0.7 * none.commits
    # Sync mode (quorum M, no grace) closes a round only with every learner in it.
    sync = simulate(with_policy(base, min_quorum=8, grace_max_s=0.0))
    assert sync.commits <= sync.merged / 8 + 4


def test_staleness_rejections_come_from_the_policy() -> None:
    r = simulate(with_policy(scenario(learners=8), max_staleness=0))
    assert r.dropped.get("stale", 0) > 0
    assert r.merged + sum(r.dropped.values()) == r.contributions


def test_the_simulator_calls_the_production_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, int] = {}
    for name in ("join", "heartbeat", "admit", "accept", "due", "close", "next_deadline",
                 "record_sync_time", "initialize", "leave"):
        original = getattr(policy_module.Policy, name)

        def spy(self: Any, *args: Any, _name: str = name, _original: Any = original,
                **kwargs: Any) -> Any:
            calls[_name] = calls.get(_name, 0) + 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(policy_module.Policy, name, spy)
    s = with_training(with_failures(scenario(duration_s=3000), mtbf_chip_s=64 * 400),
                      steps=2000)
    r = simulate(s)
    assert r.failures > 0
    assert calls["close"] == r.commits
    assert calls["accept"] >= r.merged > 0
    assert calls["initialize"] == 4  # the first learner in pushes every fragment's value
    assert calls["join"] > 4  # restarted learners join again
    for name in ("heartbeat", "admit", "due", "next_deadline", "record_sync_time"):
        assert calls[name] > 0, name


def test_pushes_follow_the_learner_schedule() -> None:
    """Fragment p is pushed at steps where (step − t_p) mod H == 0, and whatever is
    left is flushed at the end (learner.streaming)."""
    steps, h, p = 333, 20, 4
    s = with_training(scenario(learners=1, chips=1, duration_s=1e6), sync_every=h,
                      fragments=p, steps=steps)
    r = simulate(s)
    def due_fragments(k: int) -> list[int]:  # DESIGN §2: (k − t_p) mod H == 0, k > t_p
        return [q for q, t in enumerate(offsets(h, p)) if k > t and (k - t) % h == 0]

    due = [q for k in range(1, steps + 1) for q in due_fragments(k)]
    last = {q: max(k for k in range(1, steps + 1) if q in due_fragments(k)) for q in range(p)}
    flushed = sum(1 for q in range(p) if last[q] < steps)
    assert r.contributions == len(due) + flushed


# -- determinism -----------------------------------------------------------------------


def comparable(r: Result) -> dict[str, Any]:
    fields = r.as_dict()
    fields.pop("wall_s")
    return fields


def test_the_same_seed_gives_the_same_run() -> None:
    s = with_failures(scenario(chips=256, duration_s=20_000), mtbf_chip_s=256 * 300)
    elastic = dataclasses.replace(s, cluster=dataclasses.replace(
        s.cluster, elastic=True, speed_sigma=0.05))
    for case in (s, elastic, dataclasses.replace(s, method="elastic-dp")):
        assert comparable(simulate(case)) == comparable(simulate(case))
        assert comparable(simulate(case)) != comparable(simulate(case, seed=case.seed + 1))


# -- scenario files --------------------------------------------------------------------


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_shipped_scenarios_load(path: Path) -> None:
    s = load_scenario(path)
    assert s.name == path.stem
    assert s.rows()


def test_the_storm_scenario_describes_the_storm_experiment() -> None:
    s = load_scenario(ROOT / "experiments" / "sim" / "learner-storm.toml")
    e = load_experiment(ROOT / "experiments" / "learner-storm.toml")
    (kill,) = e.faults
    assert s.cluster.learners == s.cluster.chips == e.learners.count
    assert s.duration_s == e.max_duration_s
    assert s.seed == e.seed
    assert (s.training.sync_every, s.training.fragments, s.training.overlap,
            s.training.steps) == (e.learners.sync_every, e.learners.fragments,
                                  e.learners.overlap, e.learners.steps)
    assert s.policy.min_quorum == e.coordinator.min_quorum
    assert s.policy.grace_max_s == float(e.coordinator.settings["policy.grace_max_s"])
    assert s.failures.restart_s == kill.duration_s
    assert s.failures.mtbf_chip_s == kill.mtbf_s * e.learners.count  # type: ignore[operator]
    assert s.uptime_window_s == e.checks.window_s
    kills = replay_kills(s)
    injected = [a for a in schedule(e) if not a.heal]
    assert [t for t, _ in kills] == [a.at_s + s.failures.replay_offset_s for a in injected]
    assert {i for _, i in kills} <= set(range(e.learners.count))


def test_the_storm_scenario_runs_and_is_plausible() -> None:
    s = load_scenario(ROOT / "experiments" / "sim" / "learner-storm.toml")
    r = simulate(dataclasses.replace(s, replicas=3))
    assert 0.4 < r.goodput < 0.95
    assert r.uptime > 0.8
    assert r.failures > 0


SMALL = """\
name = "small"
duration_s = 5000

[cluster]
chips = 16
learners = 2

[failures]
mtbf_chip_s = 40000
restart_s = 100

[sweep]
chips = [16, 32]
methods = ["dp", "elastic-dp", "ftsync:2"]
"""


def error_of(tmp_path: Path, text: str) -> str:
    path = tmp_path / "s.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_scenario(path)
    return str(info.value)


@pytest.mark.parametrize(("old", "new", "needles"), [
    ("chips = 16\n", "chips = 0\n", ["cluster.chips must be at least 1", "line 5"]),
    ("learners = 2", "learners = 17", ["cluster.learners", "line 6"]),
    ("restart_s = 100", "restart_s = -1", ["failures.restart_s must be >= 0", "line 10"]),
    ("restart_s = 100", "restart = 100", ["unknown key 'failures.restart'", "line 10",
                                          "did you mean 'failures.restart_s'"]),
    ('"ftsync:2"]', '"ftsync:x"]', ["sweep.methods", "entry 2", "'ftsync:x'", "line 14"]),
    ("duration_s = 5000", 'duration_s = "long"', ["duration_s must be float", "line 2"]),
    ("[sweep]", '[policy]\nmin_quorum = 0\n\n[sweep]', ["policy.min_quorum", "line 13"]),
    ("[sweep]", '[failures.x]\n[sweep]', ["unknown key 'failures.x'"]),
    ("learners = 2", "learners = 2\nlearner_speeds = [1.0]",
     ["cluster.learner_speeds needs one speed per learner (2) (got [1.0])"]),
    ("learners = 2", "learners = 2\nlearner_speeds = [1.0, 0.0]",
     ["cluster.learner_speeds must all be > 0"]),
    ("[sweep]", "[training]\nnoise_ratio = -1\n\n[sweep]",
     ["training.noise_ratio must be >= 0"]),
])
def test_bad_scenarios_name_key_and_line(tmp_path: Path, old: str, new: str,
                                         needles: list[str]) -> None:
    assert old in SMALL
    message = error_of(tmp_path, SMALL.replace(old, new))
    for needle in needles:
        assert needle in message, message


def test_a_missing_replay_file_is_named(tmp_path: Path) -> None:
    message = error_of(tmp_path, SMALL.replace("restart_s = 100",
                                               'restart_s = 100\nreplay = "nope.toml"'))
    assert "failures.replay" in message and "nope.toml" in message


def heterogeneous(speeds: list[float], noise: float, quorum: int | Literal["auto"]) -> Result:
    s = scenario(chips=4, learners=4, duration_s=4_000.0,
                 cluster=ClusterSpec(chips=4, learners=4, learner_speeds=speeds))
    s = with_training(s, noise_ratio=noise)
    return simulate(with_policy(s, min_quorum=quorum, grace_max_s=5.0, max_staleness=32))


def test_slow_learners_make_merged_work_staler_and_a_full_quorum_fresher() -> None:
    speeds = [1.0, 1.0, 0.5, 0.25]
    equal = heterogeneous([1.0] * 4, 2.0, 1)
    any_one, everyone = heterogeneous(speeds, 2.0, 1), heterogeneous(speeds, 2.0, 4)
    assert equal.mean_staleness < 0.05  # in step: each round gathers all four anyway
    assert any_one.mean_staleness > 1.0 > everyone.mean_staleness
    assert everyone.mean_quorum == 4 and any_one.mean_quorum == 1


def test_the_automatic_quorum_waits_for_more_when_noise_dominates_fewer_when_some_are_slow(
        ) -> None:
    """The simulator feeds the policy norms from its noise model, so the production
    estimator chooses K here as it does in the daemon."""
    speeds = [1.0, 1.0, 0.5, 0.25]
    assert heterogeneous([1.0] * 4, 2.0, "auto").mean_quorum > 3.9
    quiet, noisy = heterogeneous(speeds, 0.25, "auto"), heterogeneous(speeds, 16.0, "auto")
    assert 1.5 < quiet.mean_quorum < noisy.mean_quorum < 3.5
    assert noisy.mean_staleness < quiet.mean_staleness
    # Without norms (noise_ratio 0) it never measures the noise: it waits for two.
    assert abs(heterogeneous(speeds, 0.0, "auto").mean_quorum - 2.0) < 0.05


def test_a_sweep_makes_a_table(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(SMALL)
    results = sweep(load_scenario(path))
    assert [(r.label, r.chips) for r in results] == [
        (m, c) for c in (16, 32) for m in ("dp", "elastic-dp", "ftsync:2")]
    text = table(results)
    assert "| 32 |" in text and "elastic-dp" in text and "ftsync:2" in text


def test_quorum_fraction_scales_the_quorum_with_m() -> None:
    s = dataclasses.replace(scenario(chips=64), sweep=SweepSpec(
        chips=[64], methods=["ftsync:1", "ftsync:16"], quorum_fraction=0.25))
    assert [s.configure(m, 64).policy.min_quorum for m in ("ftsync:1", "ftsync:16")] == [1, 4]
    assert s.configure("elastic-ftsync:8", 64).cluster.elastic
    assert s.configure("dp", 64).method == "dp"
    assert PolicyConfig().min_quorum == s.configure("dp", 64).policy.min_quorum


def test_the_cli_writes_json_table_and_plots(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.toml"
    path.write_text(SMALL)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["simulate", str(path), "--out", str(out), "--json",
                  "--set", "sweep.chips=[16]"])
    assert exit_info.value.code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["label"] for r in report["results"]] == ["dp", "elastic-dp", "ftsync:2"]
    for name in ("results.json", "table.md", "goodput.png", "uptime.png"):
        assert (out / name).stat().st_size > 0, name
    path.write_text(SMALL.replace("chips = 16\n", "chips = -4\n"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["simulate", str(path), "--out", str(out)])
    assert exit_info.value.code == 2
    assert "cluster.chips" in capsys.readouterr().err
