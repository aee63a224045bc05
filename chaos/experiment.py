"""Chaos experiment files: a topology, a workload, a fault schedule, checks.

An experiment is one TOML file loaded into the frozen dataclasses below with
the same loader as the coordinator's configuration, so every mistake is
reported with its key and line before anything starts. `schedule()` turns
the fault specs into a concrete, seeded timeline, so a run can be replayed.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from chaos.proxy import LinkSpec
from coordinator.config import ConfigError, CoordinatorConfig, load
from protos.settings import check

FaultKind = Literal[
    "kill_learner", "pause_learner", "straggle", "kill_coordinator", "partition_learner",
    "latency", "bandwidth", "reset_connections", "adversary",
    "kill_leader", "pause_leader", "partition_leader_from_etcd", "kill_etcd_member",
    "drain_replica", "partition",
]
LEARNER_FAULTS = {"kill_learner", "pause_learner", "straggle", "partition_learner",
                  "latency", "bandwidth", "reset_connections"}
NETWORK_FAULTS = {"partition_learner", "latency", "bandwidth", "reset_connections"}
# Faults on the replica that leads a highly available synchronizer.
LEADER_FAULTS = {"kill_leader", "pause_leader", "partition_leader_from_etcd"}
# What drain_replica may target: the one coordinator, or with replicas the leader,
# a standby or a replica by name (r0, r1, ...).
DRAIN_TARGETS = re.compile(r"random|coordinator|leader|standby|r\d+")
ADVERSARY_KINDS = ("nan", "shape", "norm", "replay")
# What `partition` cuts and cuts from, beside learner ids: the one coordinator, the
# leader (found when it strikes), a replica (r0, ...), an etcd member (m0, ...), or
# every etcd member ("etcd", in cut_from only).
PARTITION_NAME = re.compile(r"coordinator|leader|r\d+|m\d+|learner-\d+|random")
# The outer optimizer of async runs unless their settings say otherwise (BENCHMARKS.md):
# the fixed values they were measured with, not scaled per round.
ASYNC_OUTER: Final = {"outer.lr": 0.3, "outer.momentum": 0.0, "outer.adaptive": False}


@dataclass(frozen=True)
class CoordinatorSpec:
    # async: quorum `min_quorum` with a grace window; sync: lock-step DiLoCo
    # (quorum = every learner, no grace, learners wait for each merge).
    mode: Literal["async", "sync"] = "async"
    # A count, or "auto": each round chooses (the coordinator's policy.min_quorum).
    min_quorum: int | Literal["auto"] = 1
    # Any further coordinator settings, as `--set key=value` (e.g. "outer.lr" = 0.3).
    settings: Mapping[str, Any] = field(default_factory=dict)
    # More than one: a highly available synchronizer on etcd (needs [etcd] members).
    replicas: int = 1
    # Each replica reaches etcd through its own fault proxy, so the leader can
    # be cut off from etcd while its learners still reach it.
    etcd_proxies: bool = False

    def __post_init__(self) -> None:
        check(self, [
            (self.min_quorum == "auto" or (isinstance(self.min_quorum, int)
                                           and self.min_quorum >= 1),
             "min_quorum", "must be at least 1 or \"auto\""),
            (self.replicas >= 1, "replicas", "must be at least 1"),
        ], "coordinator.")
        # Checked as the coordinator will read them, before anything starts.
        try:
            load(CoordinatorConfig, None, self.overrides())
        except ConfigError as exc:
            raise ValueError(f"coordinator.settings: {exc}".replace(
                " (from the command line)", "")) from None

    def overrides(self) -> dict[str, str]:
        """The settings as the coordinator's `--set` overrides. Async runs default to
        an outer step without momentum: with quorum 1 each round merges a few stale
        deltas, and DiLoCo's Nesterov momentum diverges there."""
        defaults = ASYNC_OUTER if self.mode == "async" else {}
        # Written back as TOML values (true, not Python's True), as --set parses them.
        return {key: str(value).lower() if isinstance(value, bool) else str(value)
                for key, value in {**defaults, **self.settings}.items()}

    @property
    def run(self) -> str:
        """The run's name in etcd (the replicas' `ha.run`)."""
        return str(self.settings.get("ha.run", "default"))


@dataclass(frozen=True)
class EtcdSpec:
    # Members of the local etcd cluster (0: none, the embedded membership).
    members: int = 0

    def __post_init__(self) -> None:
        check(self, [(0 <= self.members <= 7, "members", "must be 0..7")], "etcd.")

    def ids(self) -> list[str]:
        return [f"m{i}" for i in range(self.members)]


@dataclass(frozen=True)
class LearnerSpec:
    count: int = 4
    task: Literal["lm-stdlib", "digits", "synthetic"] = "lm-stdlib"
    size: Literal["tiny", "small", "base"] = "small"
    steps: int = 600
    # H, or "auto": the coordinator assigns each learner its own (policy.h_min/h_max).
    sync_every: int | Literal["auto"] = 20
    fragments: int = 4
    overlap: int = 2
    compression: Literal["fp32", "bf16", "int8", "e3m0"] = "fp32"
    threads: int = 1
    # Further ftsync-learner flags, passed as they are.
    args: list[str] = field(default_factory=list)
    # How learners find a replicated synchronizer: "addresses" (every replica,
    # following redirects) or "etcd" (the leader record). "direct": the one coordinator.
    discovery: Literal["direct", "addresses", "etcd"] = "direct"
    # Every learner serves its fragments to the others, and a restarted learner
    # catches up from them (the coordinator serves what no peer holds).
    peers: bool = False
    # Warm spares kept beside the learners (learner/spare.py): a killed learner's slot
    # goes to one at once, and a new one warms; the kill's scripted restart is skipped.
    spares: int = 0

    def __post_init__(self) -> None:
        check(self, [
            *((getattr(self, key) >= 1, key, "must be at least 1")
              for key in ("count", "steps", "fragments", "overlap", "threads")),
            (self.sync_every == "auto" or self.sync_every >= 1, "sync_every",
             "must be at least 1 or \"auto\""),
            (0 <= self.spares <= self.count, "spares", f"must be in 0..count ({self.count})"),
        ], "learners.")

    def ids(self) -> list[str]:
        return [f"learner-{i}" for i in range(self.count)]


@dataclass(frozen=True)
class FaultSpec:
    kind: FaultKind
    # A learner id ("learner-2"), "random" (a learner drawn with the seed) or
    # "coordinator"; adversaries join as their own learner and need no target.
    target: str = "random"
    # When: exactly one of at_s (once), every_s (repeatedly) or mtbf_s
    # (exponential gaps with this mean), in seconds from the start of the run.
    at_s: float | None = None
    every_s: float | None = None
    mtbf_s: float | None = None
    # Or counted from the moment every fragment has reached this version (1: each one's
    # first merge), which the harness asks the leader for: a fault that must find the
    # learners joined and training lands there however long they take to start.
    after_version: int | None = None
    # With every_s/mtbf_s: the most times it happens (0: as often as the run allows).
    count: int = 0
    # How long until the fault heals: a killed process restarts, a paused one
    # resumes, a partition heals, a link fault is lifted.
    duration_s: float = 5.0
    latency_ms: float = 200.0
    bandwidth_bytes_s: int = 200_000
    # straggle: the share of each 100 ms the learner may run (1/3: 3× slower).
    duty: float = 1 / 3
    # adversary: what the corrupt learner sends.
    adversary: list[str] = field(default_factory=lambda: list(ADVERSARY_KINDS))
    # kill_leader: "grace" waits (up to 10 s) for a round's grace window to open;
    # kill_learner: "push" waits (up to 10 s) until the learner is in a push.
    during: Literal["any", "grace", "push"] = "any"
    # drain_replica: how long the coordinator may take to commit its open rounds
    # and hand its leadership over (Admin.Drain); then it exits, and restarts (as
    # an upgraded binary would) duration_s later.
    drain_timeout_s: float = 30.0
    # partition (backend = "docker"): whom the target is cut from; empty: from every
    # other process of the run.
    cut_from: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        when = [k for k in ("at_s", "every_s", "mtbf_s") if getattr(self, k) is not None]
        if len(when) != 1:
            raise ValueError(f"a fault needs exactly one of at_s, every_s or mtbf_s "
                             f"(kind {self.kind!r} has {when or 'none'})")
        value = getattr(self, when[0])
        if not math.isfinite(value) or value < 0 or (when[0] != "at_s" and value <= 0):
            raise ValueError(f"{when[0]} must be positive and finite (got {value})")
        check(self, [
            (0 <= self.duration_s < math.inf, "duration_s", "must be >= 0 and finite"),
            (self.count >= 0, "count", "must be >= 0 (0: as often as the run allows)"),
            (self.after_version is None or self.after_version >= 0, "after_version",
             "must be >= 0 (1: every fragment merged once)"),
            (0 < self.drain_timeout_s < math.inf, "drain_timeout_s",
             "must be positive and finite"),
            (0 < self.duty < 1, "duty", "must be in (0, 1)"),
            (self.latency_ms >= 0, "latency_ms", "must be >= 0"),
            (self.bandwidth_bytes_s > 0, "bandwidth_bytes_s", "must be > 0"),
        ])
        if self.kind == "kill_coordinator" and self.target not in ("coordinator", "random"):
            raise ValueError(f"target of kill_coordinator must be 'coordinator' "
                             f"(got {self.target!r})")
        if self.kind == "drain_replica" and not DRAIN_TARGETS.fullmatch(self.target):
            raise ValueError(f"target of drain_replica must be 'coordinator', 'leader', "
                             f"'standby' or a replica (r0, r1, ...) (got {self.target!r})")
        if self.kind in LEADER_FAULTS and self.target not in ("leader", "random"):
            raise ValueError(f"target of {self.kind} is always the leader "
                             f"(got {self.target!r}; leave it out or write 'leader')")
        needs = {"grace": "kill_leader", "push": "kill_learner"}.get(self.during, self.kind)
        if self.kind != needs:
            raise ValueError(f"during = {self.during!r} applies to {needs} only "
                             f"(kind is {self.kind!r})")
        if self.kind in LEARNER_FAULTS and self.target == "coordinator":
            raise ValueError(f"target of {self.kind} must be a learner id or 'random'")
        unknown = sorted(set(self.adversary) - set(ADVERSARY_KINDS))
        if unknown:
            raise ValueError(f"adversary kinds {unknown} unknown; valid: {list(ADVERSARY_KINDS)}")
        if self.kind == "partition":
            self._check_partition()
        elif self.cut_from:
            raise ValueError(f"cut_from applies to partition only (kind is {self.kind!r})")

    def _check_partition(self) -> None:
        if not PARTITION_NAME.fullmatch(self.target):
            raise ValueError(f"target of partition must be a learner id, 'coordinator', "
                             f"'leader', a replica (r0, ...), an etcd member (m0, ...) or "
                             f"'random' (got {self.target!r})")
        for name in self.cut_from:
            if name == "random" or not (name == "etcd" or PARTITION_NAME.fullmatch(name)):
                raise ValueError(f"cut_from {name!r}: a learner id, 'coordinator', 'leader', "
                                 f"a replica (r0, ...), an etcd member (m0, ...) or 'etcd'")


@dataclass(frozen=True)
class ChecksSpec:
    # Longest a healthy learner may go without a training step (0: not
    # checked, e.g. for lock-step baselines, whose learners do wait).
    max_blocked_s: float = 20.0
    min_goodput: float = 0.0
    min_uptime: float = 0.0
    loss_must_drop: bool = True
    # Width of the windows uptime is counted in.
    window_s: float = 2.0
    # From each leader fault to the first commit of a newer epoch (0: not checked).
    max_failover_s: float = 0.0

    def __post_init__(self) -> None:
        for key in ("max_blocked_s", "max_failover_s"):
            if not 0 <= getattr(self, key) < math.inf:
                raise ValueError(f"{key} must be >= 0 and finite (0: not checked)")
        for key in ("min_goodput", "min_uptime"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"{key} is a share: it must be in [0, 1] "
                                 f"(got {getattr(self, key)})")
        if not 0 < self.window_s < math.inf:
            raise ValueError(f"window_s must be > 0 and finite (got {self.window_s})")


@dataclass(frozen=True)
class DockerSpec:
    # The image every container of a docker run starts from (deploy/docker/build).
    image: str = "ftsync:latest"

    def __post_init__(self) -> None:
        if not self.image:
            raise ValueError("docker.image must not be empty")


@dataclass(frozen=True)
class Experiment:
    name: str
    seed: int = 0
    # The run stops (learners are told to finish) after this long.
    max_duration_s: float = 300.0
    # Put a fault-injecting TCP proxy between every learner and the coordinator.
    proxy: bool = True
    # Every learner's link through its proxy from the start (one-way latency_ms and
    # bandwidth_bytes_s each direction, 0: no cap), e.g. a cross-region link; a
    # latency or bandwidth fault switches away from it and its heal comes back to it.
    link: LinkSpec = field(default_factory=LinkSpec)
    # One learner's own link instead: [links.learner-2].
    links: Mapping[str, LinkSpec] = field(default_factory=dict)
    # Mutual TLS on every channel (learners, replicas, peers, etcd, the harness's own
    # Admin calls), with a CA and certificates the run makes under OUT/certs.
    tls: bool = False
    # Where the topology runs: "process" (local processes) or "docker" (a container
    # per process on a network of the run's own; see chaos/docker.py).
    backend: Literal["process", "docker"] = "process"
    docker: DockerSpec = field(default_factory=DockerSpec)
    coordinator: CoordinatorSpec = field(default_factory=CoordinatorSpec)
    etcd: EtcdSpec = field(default_factory=EtcdSpec)
    learners: LearnerSpec = field(default_factory=LearnerSpec)
    faults: list[FaultSpec] = field(default_factory=list)
    checks: ChecksSpec = field(default_factory=ChecksSpec)

    def __post_init__(self) -> None:
        if not 0 < self.max_duration_s < math.inf:
            raise ValueError(f"max_duration_s must be positive and finite "
                             f"(got {self.max_duration_s})")
        ids = set(self.learners.ids())
        for learner_id in self.links:
            if learner_id not in ids:
                raise ValueError(f"links.{learner_id} is not a learner of this experiment "
                                 f"({', '.join(sorted(ids))})")
        if not self.proxy and (self.links or self.link != LinkSpec()):
            raise ValueError("link and links need proxy = true (the proxy emulates the link)")
        for i, fault in enumerate(self.faults):
            if fault.at_s is not None and fault.at_s >= self.max_duration_s:
                raise ValueError(f"faults.{i}.at_s {fault.at_s:g} is not before the end of the "
                                 f"run (max_duration_s {self.max_duration_s:g})")
            if fault.kind in LEARNER_FAULTS and fault.target not in ids | {"random"}:
                raise ValueError(f"faults.{i}.target {fault.target!r} is not a learner of "
                                 f"this experiment ({', '.join(sorted(ids))} or 'random')")
            # Containers cut a learner off with network rules; its link faults need
            # the proxy on either backend.
            if fault.kind in NETWORK_FAULTS and not self.proxy and not (
                    self.backend == "docker" and fault.kind == "partition_learner"):
                raise ValueError(f"faults.{i}.kind {fault.kind!r} needs proxy = true")
            self._check_ha_fault(i, fault)
            self._check_backend_fault(i, fault)
        self._check_ha_topology()
        if self.backend == "docker" and self.learners.spares:
            raise ValueError("learners.spares runs on backend = \"process\" only (under "
                             "Kubernetes a spare is a standby pod: docs/architecture.md)")

    @property
    def highly_available(self) -> bool:
        return self.coordinator.replicas > 1

    def link_for(self, learner_id: str) -> LinkSpec:
        """The link `learner_id`'s proxy emulates when no fault is on it."""
        return self.links.get(learner_id, self.link)

    def _check_ha_topology(self) -> None:
        replicas, discovery = self.coordinator.replicas, self.learners.discovery
        if replicas > 1 and self.etcd.members < 1:
            raise ValueError(f"coordinator.replicas = {replicas} needs an etcd "
                             f"([etcd] members = 1 or 3)")
        if replicas > 1 and discovery == "direct":
            raise ValueError("learners.discovery must be 'addresses' or 'etcd' when "
                             "coordinator.replicas > 1")
        if replicas == 1 and discovery != "direct":
            raise ValueError(f"learners.discovery = {discovery!r} needs coordinator.replicas "
                             f"> 1")
        if replicas > 1 and self.proxy:
            raise ValueError("proxy = true puts one proxy in front of one coordinator; "
                             "set proxy = false with coordinator.replicas > 1")
        if self.coordinator.etcd_proxies and self.backend == "docker":
            raise ValueError("coordinator.etcd_proxies is for backend = \"process\"; docker cuts "
                             "a leader from etcd with network rules")
        if self.coordinator.etcd_proxies and replicas == 1:
            raise ValueError("coordinator.etcd_proxies needs coordinator.replicas > 1")
        if replicas > 1 and self.coordinator.mode == "sync":
            raise ValueError("coordinator.mode = 'sync' is a single-coordinator baseline")

    def _check_ha_fault(self, i: int, fault: FaultSpec) -> None:
        if fault.kind in LEADER_FAULTS and not self.highly_available:
            raise ValueError(f"faults.{i}.kind {fault.kind!r} needs coordinator.replicas > 1")
        if (fault.kind == "partition_leader_from_etcd" and not self.coordinator.etcd_proxies
                and self.backend == "process"):
            raise ValueError(f"faults.{i}.kind 'partition_leader_from_etcd' needs "
                             f"coordinator.etcd_proxies = true")
        if fault.kind == "kill_coordinator" and self.highly_available:
            raise ValueError(f"faults.{i}.kind 'kill_coordinator' is for a single "
                             f"coordinator; use 'kill_leader' with replicas")
        if fault.kind == "adversary" and self.highly_available:
            raise ValueError(f"faults.{i}.kind 'adversary' needs a single coordinator")
        if fault.kind == "drain_replica":
            self._check_drain_target(i, fault.target)
        if fault.kind == "kill_etcd_member":
            members = self.etcd.ids()
            if not members:
                raise ValueError(f"faults.{i}.kind 'kill_etcd_member' needs [etcd] members")
            if fault.target not in (*members, "random"):
                raise ValueError(f"faults.{i}.target {fault.target!r} is not an etcd member "
                                 f"({', '.join(members)} or 'random')")


    def _check_backend_fault(self, i: int, fault: FaultSpec) -> None:
        if self.backend == "process" and fault.kind == "partition":
            raise ValueError(f"faults.{i}.kind 'partition' needs backend = \"docker\" (local "
                             f"processes share one network stack; use partition_learner)")
        if self.backend == "docker" and fault.kind == "drain_replica":
            raise ValueError(f"faults.{i}.kind 'drain_replica' runs on backend = \"process\" "
                             f"only")
        if fault.kind != "partition":
            return
        names = {*self.learners.ids(), *self.etcd.ids(), "random", "etcd",
                 *(("leader", *(f"r{r}" for r in range(self.coordinator.replicas)))
                   if self.highly_available else ("coordinator",))}
        for name in [fault.target, *fault.cut_from]:
            if name not in names:
                raise ValueError(f"faults.{i}: {name!r} is not a process of this experiment "
                                 f"({', '.join(sorted(names - {'random', 'etcd'}))})")
        if fault.target in fault.cut_from:
            raise ValueError(f"faults.{i}.cut_from names its own target {fault.target!r}")

    def _check_drain_target(self, i: int, target: str) -> None:
        replicas = self.coordinator.replicas
        if self.highly_available and target == "coordinator":
            raise ValueError(f"faults.{i}.target 'coordinator' is for a single coordinator; "
                             f"with replicas drain 'leader', 'standby' or r0..r{replicas - 1}")
        if not self.highly_available and target not in ("coordinator", "random"):
            raise ValueError(f"faults.{i}.target {target!r} needs coordinator.replicas > 1; "
                             f"a single coordinator is 'coordinator'")
        if target.startswith("r") and target[1:].isdigit() and int(target[1:]) >= replicas:
            raise ValueError(f"faults.{i}.target {target!r} is not a replica of this "
                             f"experiment (r0..r{replicas - 1})")


def load_experiment(path: str | Path) -> Experiment:
    """Read and validate an experiment file; `ConfigError` names key and line."""
    experiment = load(Experiment, path)
    if not experiment.name:
        raise ConfigError(f"{path}: name must not be empty")
    return experiment


@dataclass(frozen=True)
class Action:
    """One step of the fault timeline."""

    at_s: float
    fault: FaultSpec
    target: str
    heal: bool
    # Occurrence number of this fault spec, to pair inject and heal.
    occurrence: int


def schedule(experiment: Experiment) -> list[Action]:
    """The concrete timeline of injections and heals, the same for the same seed."""
    rng = random.Random(experiment.seed)
    horizon = experiment.max_duration_s
    actions: list[Action] = []
    # Numbered across every adversary entry: each runs as a learner of its own.
    adversaries = itertools.count()
    for fault in experiment.faults:
        for n, start in enumerate(_occurrences(fault, horizon, rng)):
            target = fault.target
            if fault.kind in LEADER_FAULTS:
                target = "leader"
            elif fault.kind == "kill_etcd_member" and target == "random":
                target = rng.choice(experiment.etcd.ids())
            elif fault.kind == "partition" and target == "random":
                target = rng.choice(experiment.learners.ids())
            elif fault.kind == "drain_replica" and target == "random":
                target = "leader" if experiment.highly_available else "coordinator"
            elif target == "random":
                target = ("coordinator" if fault.kind == "kill_coordinator"
                          else rng.choice(experiment.learners.ids()))
            if fault.kind == "adversary":
                target = f"adversary-{next(adversaries)}"
            actions.append(Action(start, fault, target, heal=False, occurrence=n))
            actions.append(Action(start + fault.duration_s, fault, target, heal=True,
                                  occurrence=n))
    return sorted(actions, key=lambda a: (a.at_s, a.heal))


def _occurrences(fault: FaultSpec, horizon: float, rng: random.Random) -> list[float]:
    if fault.at_s is not None:
        return [fault.at_s]
    times: list[float] = []
    t = 0.0
    limit = fault.count or 10_000
    while len(times) < limit:
        t += fault.every_s if fault.every_s is not None else rng.expovariate(
            1.0 / (fault.mtbf_s or 1.0))
        if t >= horizon:
            break
        times.append(t)
    return times
