"""Simulator scenario files: a cluster, its failures, its training, the policy.

A scenario is one TOML file loaded into the frozen dataclasses below with
the coordinator's configuration loader (`coordinator.config.load`), so a
mistake is reported with its key and line before anything runs, and `--set
key=value` overrides any key. The `[policy]` table is the daemon's own
`PolicyConfig`: the same knobs, the same validation. `chaos.sim` runs a
scenario; `chaos.sim.ftsync` and `chaos.sim.baselines` are what it drives.

Times are seconds of simulated time. A *chip* is the unit that fails; a
learner is a group of chips that trains as one data-parallel job and talks
to the synchronizer as one learner.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from coordinator.config import ConfigError, load
from coordinator.policy import PolicyConfig
from learner.schedule import DEFAULT_RULE, ApplyRule
from protos.settings import check

Method = Literal["ftsync", "dp", "elastic-dp"]
YEAR_S = 365.0 * 86400.0
MONTH_S = 30.0 * 86400.0
_METHOD = re.compile(r"(dp|elastic-dp|ftsync:(\d+)|elastic-ftsync:(\d+))")


@dataclass(frozen=True)
class ClusterSpec:
    chips: int = 1024
    # M, for method "ftsync": chips are split evenly across the learners.
    learners: int = 8
    # ftsync learners that lose a chip drop it and re-form at reduced capacity
    # instead of restarting (as elastic-dp does); the chip rejoins without a
    # pause once it is replaced, started and caught up.
    elastic: bool = False
    # Chip speed variance: each chip's step-time factor is exp(σ·Z), Z
    # standard normal, redrawn when a chip is replaced. A data-parallel group
    # steps at the pace of its slowest chip.
    speed_sigma: float = 0.0
    # Each learner's own speed (1: nominal, 0.5: half), one per learner, on top of
    # its chips' (heterogeneous learners, as experiments/heterogeneous.toml has
    # them); empty: all nominal.
    learner_speeds: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        check(self, [
            (self.chips >= 1, "chips", "must be at least 1"),
            (1 <= self.learners <= self.chips, "learners",
             f"must be in [1, cluster.chips] ({self.chips} chips)"),
            (self.speed_sigma >= 0, "speed_sigma", "must be >= 0"),
            (not self.learner_speeds or len(self.learner_speeds) == self.learners,
             "learner_speeds", f"needs one speed per learner ({self.learners})"),
            (all(0 < v < math.inf for v in self.learner_speeds), "learner_speeds",
             "must all be > 0 and finite"),
        ], "cluster.")


@dataclass(frozen=True)
class HostSpec:
    """Learner processes sharing one machine's cores, as in the chaos harness
    (cores = 0: every learner has chips of its own and nothing is shared).

    With cores > 0 the start-up, catch-up, step, final-eval and exit times of
    a scenario are seconds of one core, and every live learner process runs
    at min(1, cores / (live processes + background))."""

    cores: float = 0.0
    # Other busy processes on the machine (coordinator, harness, proxies).
    background: float = 0.0

    def __post_init__(self) -> None:
        check(self, [(self.cores >= 0, "cores", "must be >= 0"),
                     (self.background >= 0, "background", "must be >= 0")], "host.")


@dataclass(frozen=True)
class FailureSpec:
    # Per-chip mean time between interruptions; interruptions are exponential.
    # A group of c chips fails at rate c / mtbf_chip_s while its process lives.
    mtbf_chip_s: float = YEAR_S
    # A failed learner (or data-parallel job): failure -> its process starts
    # again (replace the host, reschedule; the harness's down time).
    restart_s: float = 300.0
    # Process start -> join (interpreter, framework and collective set-up, data).
    startup_s: float = 60.0
    # The very first start (all processes at once); negative: as startup_s.
    # Not allocated: allocation starts at the first join, as in chaos.metrics.
    initial_startup_s: float = -1.0
    # Spread of start-up times: each takes its median (above) times exp(σ·Z).
    startup_sigma: float = 0.0
    # Join -> first step: fetch the current fragments (a data-parallel job
    # loads its checkpoint); the real learner also runs a held-out eval here.
    catchup_s: float = 30.0
    # Elastic: drop the failed chip and re-form the group. A failure during a
    # re-form starts it again.
    reform_s: float = 30.0
    # dp: a failure loses the work since the last checkpoint (0: a checkpoint
    # every step, only the interrupted step is lost).
    checkpoint_every_s: float = 0.0
    # A chaos experiment file (relative to this scenario): when set, its seeded
    # kill_learner timeline replaces the random failures, kill by kill.
    replay: str = ""
    # Seconds from the harness's run_start to the clock its fault timeline
    # counts from (the process launch it does first).
    replay_offset_s: float = 0.0

    def __post_init__(self) -> None:
        check(self, [(self.mtbf_chip_s > 0, "mtbf_chip_s", "must be > 0"),
                     *((getattr(self, key) >= 0, key, "must be >= 0")
                       for key in ("restart_s", "startup_s", "startup_sigma", "catchup_s",
                                   "reform_s", "checkpoint_every_s", "replay_offset_s"))],
              "failures.")

    @property
    def first_startup_s(self) -> float:
        return self.startup_s if self.initial_startup_s < 0 else self.initial_startup_s


@dataclass(frozen=True)
class TrainingSpec:
    # One inner step of a group at nominal chip speed.
    step_s: float = 1.0
    # H, P and τ of the streaming schedule (learner.streaming).
    sync_every: int = 100
    fragments: int = 4
    overlap: int = 2
    # Upload of one fragment's outer gradient (learner -> synchronizer).
    push_s: float = 1.0
    # Merge + outer step + durable publish of one fragment (the daemon's ξ_sync).
    sync_s: float = 1.0
    # Download of a merged fragment.
    pull_s: float = 1.0
    # How long a learner's pull waits for a newer version (learner default 30 s).
    pull_wait_s: float = 30.0
    # Steps per learner slot over the run (0: train until the end). A
    # restarted learner runs the steps its slot has left.
    steps: int = 0
    # The harness counts a slot's steps from progress lines every this many
    # steps, so a restart redoes the steps since the last line.
    progress_every: int = 1
    # Whether join -> first step counts as work: the real learner starts its
    # work clock when it has the fragments, before its start-up eval.
    catchup_is_work: bool = False
    # At the end: final held-out eval (counted in the flushed contributions'
    # work, as in the real learner), then flushing pushes, then exiting.
    finish_s: float = 0.0
    exit_s: float = 0.0
    # The gradient noise of one contribution, ν = E‖ε‖²/‖g‖² (the simulator has no
    # loss: each contribution's Σ Δ² is 1 + ν and a merge of weights w has
    # 1 + ν·Σw²/(Σw)²), which min_quorum = "auto" measures; 0: no norms reported.
    noise_ratio: float = 0.0
    # What an apply keeps of the steps since the push (`learner.schedule.ApplyRule`),
    # the learner's default unless the run it describes set another.
    apply_rule: str = DEFAULT_RULE.value

    def __post_init__(self) -> None:
        rules = [rule.value for rule in ApplyRule]
        check(self, [
            (self.apply_rule in rules, "apply_rule", f"must be one of {', '.join(rules)}"),
            *((getattr(self, key) >= 1, key, "must be at least 1")
              for key in ("sync_every", "fragments", "overlap", "progress_every")),
            (self.step_s > 0, "step_s", "must be > 0"),
            *((getattr(self, key) >= 0, key, "must be >= 0")
              for key in ("push_s", "sync_s", "pull_s", "pull_wait_s", "finish_s", "exit_s",
                          "steps")),
            (0 <= self.noise_ratio < math.inf, "noise_ratio", "must be >= 0 and finite"),
        ], "training.")


@dataclass(frozen=True)
class SweepSpec:
    """A table: every method at every chip count (empty: just this scenario)."""

    chips: list[int] = field(default_factory=list)
    # "dp", "elastic-dp", "ftsync:M" (the scenario's cluster.elastic) or
    # "elastic-ftsync:M" (elastic learners whatever cluster.elastic says).
    methods: list[str] = field(default_factory=list)
    # > 0: every ftsync:M row uses min_quorum = max(1, round(f·M)) instead of
    # policy.min_quorum (one quorum would not suit M = 1 and M = 16 alike).
    quorum_fraction: float = 0.0

    def __post_init__(self) -> None:
        for chips in self.chips:
            if chips < 1:
                raise ValueError(f"sweep.chips must all be at least 1 (got {chips})")
        for i, method in enumerate(self.methods):
            match = _METHOD.fullmatch(method)
            if match is None or (match.group(2) or match.group(3) or "1") == "0":
                raise ValueError(f"sweep.methods: entry {i}, {method!r}, is not 'dp', "
                                 f"'elastic-dp', 'ftsync:M' or 'elastic-ftsync:M' (M >= 1)")
        check(self, [(0 <= self.quorum_fraction <= 1, "quorum_fraction", "must be in [0, 1]")],
              "sweep.")


@dataclass(frozen=True)
class Scenario:
    name: str
    seed: int = 0
    # Simulated time (the harness's max_duration_s); the run may end sooner
    # when every learner has run out of steps.
    duration_s: float = MONTH_S
    method: Method = "ftsync"
    # Independent runs (seeds seed, seed+1, ...) averaged into the result.
    replicas: int = 1
    # Uptime is counted in windows of this width (chaos checks.window_s).
    uptime_window_s: float = 600.0
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    host: HostSpec = field(default_factory=HostSpec)
    failures: FailureSpec = field(default_factory=FailureSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    sweep: SweepSpec = field(default_factory=SweepSpec)

    def __post_init__(self) -> None:
        check(self, [(self.duration_s > 0, "duration_s", "must be > 0"),
                     (self.replicas >= 1, "replicas", "must be at least 1"),
                     (self.uptime_window_s > 0, "uptime_window_s", "must be > 0")])
        for chips in self.sweep.chips:
            for method in self.sweep.methods:
                m = method_learners(method)
                if m > chips:
                    raise ValueError(f"sweep.chips: {chips} chips cannot form "
                                     f"{method!r} ({m} learners)")

    def configure(self, method: str, chips: int) -> Scenario:
        """This scenario as one row of the sweep: `method` at `chips` chips."""
        learners = method_learners(method)
        base = method.split(":")[0]
        elastic = self.cluster.elastic or base in ("elastic-ftsync", "elastic-dp")
        policy = self.policy
        if base.endswith("ftsync") and self.sweep.quorum_fraction > 0:
            quorum = max(1, round(self.sweep.quorum_fraction * learners))
            policy = dataclasses.replace(policy, min_quorum=quorum)
        return dataclasses.replace(
            self, method="ftsync" if base.endswith("ftsync") else base,  # type: ignore[arg-type]
            cluster=dataclasses.replace(self.cluster, chips=chips, learners=learners,
                                        elastic=elastic),
            policy=policy, sweep=SweepSpec())

    def rows(self) -> list[tuple[str, int]]:
        """The (method, chips) pairs of the sweep; just this scenario without one."""
        if not self.sweep.chips or not self.sweep.methods:
            return [(self.label(), self.cluster.chips)]
        return [(method, chips) for chips in self.sweep.chips for method in self.sweep.methods]

    def label(self) -> str:
        if self.method != "ftsync":
            return self.method
        prefix = "elastic-ftsync" if self.cluster.elastic else "ftsync"
        return f"{prefix}:{self.cluster.learners}"


def method_learners(method: str) -> int:
    """M of a sweep method name: `ftsync:16` -> 16; dp and elastic-dp -> 1."""
    match = _METHOD.fullmatch(method)
    if match is None:
        raise ValueError(f"unknown method {method!r}")
    return int(match.group(2) or match.group(3) or 1)


def load_scenario(path: str | Path, overrides: Mapping[str, str] | None = None) -> Scenario:
    """Read and validate a scenario file; `ConfigError` names key and line."""
    scenario = load(Scenario, path, overrides)
    if not scenario.name:
        raise ConfigError(f"{path}: name must not be empty")
    if scenario.failures.replay:
        replay = Path(scenario.failures.replay)
        if not replay.is_absolute():
            replay = Path(path).parent / replay
        if not replay.is_file():
            raise ConfigError(f"failures.replay: no experiment file {replay} ({path})")
        scenario = dataclasses.replace(scenario, failures=dataclasses.replace(
            scenario.failures, replay=str(replay.resolve())))
    return scenario
