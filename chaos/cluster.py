"""The chaos backend interface: what a topology must do, and what every backend shares.

`Cluster` is one experiment's topology — a coordinator or replicas on etcd,
learners, adversaries — on some backend: local processes (`chaos.runner.
ProcessCluster`) or docker containers (`chaos.docker.DockerCluster`). It owns
what does not depend on where a process runs: the learner slots, the
adversaries' names, the run's TLS certificates, the harness's event log, the
flags every coordinator and learner gets, and the fault dispatch — which fault
is skipped because its process is down, waiting for a push on the wire or a
grace window, finding the leader, and the `fault` events the checkers read.
A backend supplies the primitives: start, kill, freeze and restart a process,
cut a link, stop everything. `make_cluster` picks one by `backend`.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from chaos.experiment import Action, Experiment, schedule
from chaos.failover import Tail, find_leader
from coordinator.certs import make_certificates
from learner.cli import PROGRESS
from protos import ftsync_pb2 as pb
from protos import tls
from protos.events import EventLog
from protos.tls import TlsConfig

# How long a kill waits for its moment (during = "grace" or "push").
MOMENT_WAIT_S = 10.0



class Handle(Protocol):
    """A started process as a backend keeps it: a Popen, a container."""

    def poll(self) -> int | None: ...


class Admin(Protocol):
    """A coordinator the harness can ask for its Admin.Status."""

    def status(self, timeout: float = ...) -> pb.StatusResponse: ...


class Link(Protocol):
    """The fault proxy between one learner and the coordinator: in this process
    (`ThreadedProxy`) or in a container of its own (`chaos.docker.ProxyContainer`)."""

    def set_latency(self, ms: float) -> None: ...
    def set_bandwidth(self, bytes_per_s: float | None) -> None: ...
    def partition(self) -> None: ...
    def heal(self) -> None: ...
    def reset_connections(self) -> None: ...


H = TypeVar("H", bound=Handle)


@dataclass
class LearnerSlot(Generic[H]):
    """One learner of the run, across its restarts."""

    learner_id: str
    shard: int
    log: Path
    process: H | None = None
    proxy: Link | None = None
    state: str = "starting"
    step: int = 0
    # Steps done before the current process started (it was restarted).
    step_base: int = 0
    loss: str = "-"
    exit_codes: list[int] = field(default_factory=list)
    straggler: threading.Event | None = None
    # Where it serves its fragments to peers (learners.peers), kept across restarts.
    peer_port: int = 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def progress(self, line: str) -> None:
        """Take a learner's output line; a progress line moves its step and loss."""
        match = PROGRESS.search(line)
        if match:
            self.step = self.step_base + int(match.group(1))
            self.loss = match.group(2)


class Cluster(abc.ABC, Generic[H]):
    """The topology of one experiment on one backend."""

    # A straggler is frozen and thawed in periods of this long (duty of each running).
    straggle_period_s = 0.1

    def __init__(self, experiment: Experiment, out: Path, cert_hosts: Sequence[str] = ()) -> None:
        self.experiment = experiment
        self.out = out
        self.events = EventLog(str(out / "harness.events.jsonl"), source="harness")
        spec = experiment.coordinator
        args: list[str] = []
        if spec.mode == "sync":
            args += ["--sync-mode", str(experiment.learners.count)]
        else:
            args += ["--min-quorum", str(spec.min_quorum)]
        for key, value in spec.overrides().items():
            args += ["--set", f"{key}={value}"]
        self.certs = out / "certs"
        if experiment.tls:
            adversaries = {a.target for a in schedule(experiment) if a.fault.kind == "adversary"}
            # The run's own CA, made anew each run.
            make_certificates(self.certs, list(cert_hosts),
                              [*experiment.learners.ids(), *sorted(adversaries)], force=True)
            args += tls.as_flags(self.credentials("coordinator", inside=True))
        # Shared by a single coordinator and by replicas (each with its own event log).
        self.coordinator_args = args
        self.admin_token = spec.overrides().get("auth.admin_token", "")
        self.admin_tls = self.credentials("admin") if experiment.tls else None
        self.coordinator_up = False
        self.learners: list[LearnerSlot[H]] = [
            LearnerSlot(lid, i, out / f"{lid}.events.jsonl")
            for i, lid in enumerate(experiment.learners.ids())]
        # Each fault kind's inject and heal: the `fault` event's detail, or None
        # where the handler emits its own events.
        self._faults: dict[str, Callable[[Action, tuple[int, int]], str | None]] = {
            "kill_learner": self._kill_learner_fault,
            "pause_learner": self._pause_learner_fault,
            "straggle": self._straggle_fault,
            "partition_learner": self._partition_learner_fault,
            "latency": self._link_fault,
            "bandwidth": self._link_fault,
            "reset_connections": self._link_fault,
            "kill_coordinator": self._kill_coordinator_fault,
            "adversary": self._adversary_fault,
            "kill_leader": self._leader_fault,
            "pause_leader": self._leader_fault,
            "partition_leader_from_etcd": self._leader_fault,
            "kill_etcd_member": self._etcd_member_fault,
            "drain_replica": self._drain_fault,
            "partition": self._partition_fault,
        }
        # The replica each leader fault hit, so that its heal reaches the same one.
        self._leader_hit: dict[tuple[int, int], int] = {}
        # Per partition occurrence, what it cut (the leader resolved), for its heal.
        self._partitioned: dict[tuple[int, int], tuple[str, list[str]]] = {}
        self._skipped: set[tuple[int, int]] = set()
        # Kills whose slot a spare took: their scripted restart is skipped.
        self._taken_over: set[tuple[int, int]] = set()

    # -- what processes see ------------------------------------------------------------

    def cert_dir(self) -> str:
        """Where the run's certificates are, as the topology's processes see them."""
        return str(self.certs)

    def credentials(self, stem: str, inside: bool = False) -> TlsConfig:
        """The files of one certificate the run made (`learner-ID`, `admin`, ...),
        as this process (or, `inside`, the topology's processes) reads them."""
        root = self.cert_dir() if inside else str(self.certs)
        return TlsConfig(cert=f"{root}/{stem}.pem", key=f"{root}/{stem}.key",
                         ca=f"{root}/ca.pem")

    def tls_flags(self, learner_id: str) -> list[str]:
        """The flags a learner or an adversary is started with."""
        if not self.experiment.tls:
            return []
        return tls.as_flags(self.credentials(f"learner-{learner_id}", inside=True))

    def learner_args(self, slot: LearnerSlot[H], steps: int, coordinator: str, event_log: str,
                     serve_peers: str = "", peers: Iterable[str] = ()) -> list[str]:
        """ftsync-learner's flags for `slot`, on either backend."""
        spec = self.experiment.learners
        args = [
            "--coordinator", coordinator, "--learner-id", slot.learner_id, "--task", spec.task,
            "--size", spec.size, "--shard", str(slot.shard), "--num-shards", str(spec.count),
            "--steps", str(steps), "--sync-every", str(spec.sync_every),
            "--fragments", str(spec.fragments), "--overlap", str(spec.overlap),
            "--compression", spec.compression, "--threads", str(spec.threads),
            "--seed", str(self.experiment.seed), "--progress-every", "10",
            "--event-log", event_log, *self.tls_flags(slot.learner_id), *spec.args]
        if serve_peers:
            args += ["--serve-peers", serve_peers] + [a for p in peers for a in ("--peers", p)]
        if self.experiment.coordinator.mode == "sync":
            args.append("--lockstep")
        return args

    def spare_args(self) -> list[str]:
        """The flags a warm spare starts with: those that build the model its slots
        will ask for (learner/spare.py checks they match)."""
        spec = self.experiment.learners
        return ["--task", spec.task, "--size", spec.size, "--seed", str(self.experiment.seed),
                "--threads", str(spec.threads), "--num-shards", str(spec.count), *spec.args]

    def adversary_args(self, name: str, coordinator: str, kinds: list[str], duration_s: float,
                       event_log: str) -> list[str]:
        spec = self.experiment.learners
        return ["--coordinator", coordinator, "--learner-id", name, "--task", spec.task,
                "--size", spec.size, "--fragments", str(spec.fragments),
                "--kinds", ",".join(kinds), "--duration", str(duration_s),
                "--event-log", event_log, *self.tls_flags(name)]

    # -- what a backend provides ---------------------------------------------------------

    @abc.abstractmethod
    def start(self) -> None:
        """Start every process of the topology; `StartError` names what did not start."""

    @abc.abstractmethod
    def start_learner(self, slot: LearnerSlot[H], steps: int) -> None: ...

    @abc.abstractmethod
    def kill_learner(self, slot: LearnerSlot[H]) -> None:
        """SIGKILL, as in a crash."""

    @abc.abstractmethod
    def freeze(self, slot: LearnerSlot[H], frozen: bool) -> None:
        """Freeze (SIGSTOP, docker pause) or thaw a learner; a no-op once it exited."""

    @abc.abstractmethod
    def kill_coordinator(self) -> None: ...

    @abc.abstractmethod
    def restart_coordinator(self) -> None: ...

    @abc.abstractmethod
    def replica_admins(self) -> Sequence[Admin]:
        """The coordinator replicas, in order (r0, r1, ...); none without replicas."""

    @abc.abstractmethod
    def replica_fault(self, kind: str, index: int, heal: bool) -> None:
        """kill_leader (heal: restart), pause_leader (heal: resume) or
        partition_leader_from_etcd (heal: reconnect) on replica `index`."""

    @abc.abstractmethod
    def coordinator_admin(self) -> Admin:
        """The single coordinator (no replicas)."""

    @abc.abstractmethod
    def coordinator_logs(self) -> list[Path]: ...

    @abc.abstractmethod
    def etcd_running(self, index: int) -> bool: ...

    @abc.abstractmethod
    def etcd_fault(self, index: int, heal: bool) -> str:
        """Kill etcd member `index`, or restart it on its data; says what it did."""

    @abc.abstractmethod
    def start_adversary(self, name: str, kinds: list[str], duration_s: float) -> None: ...

    @abc.abstractmethod
    def adversaries_running(self) -> bool:
        """Whether an adversary the run started is still sending."""

    @abc.abstractmethod
    def stop_all(self) -> None:
        """Stop (and on docker remove) everything started; safe to call more than once."""

    def partition_learner(self, slot: LearnerSlot[H], heal: bool) -> None:
        """Cut a learner off from the synchronizer, or heal: through its proxy."""
        assert slot.proxy is not None
        if heal:
            slot.proxy.heal()
        else:
            slot.proxy.partition()

    def partition(self, target: str, cut_from: list[str], heal: bool,
                  occurrence: tuple[int, int]) -> str:
        """The `partition` fault: cut process `target` from `cut_from` (empty: from
        every other); says what it did. Only some backends can."""
        raise NotImplementedError(f"partition is not supported on {type(self).__name__}")

    def _drain_fault(self, action: Action, occurrence: tuple[int, int]) -> None:
        raise NotImplementedError(f"drain_replica is not supported on {type(self).__name__}")

    def hand_to_spare(self, slot: LearnerSlot[H], steps: int) -> None:
        """Give `slot` (killed) to a warm spare for `steps` more steps, and warm another."""
        raise NotImplementedError(f"learners.spares is not supported on {type(self).__name__}")

    # -- faults ----------------------------------------------------------------------

    def apply(self, action: Action) -> None:
        fault, target = action.fault, action.target
        kind = fault.kind
        slot = next((s for s in self.learners if s.learner_id == target), None)
        # A fault on a process that is not running (down, done) is skipped, and so
        # is its heal: overlapping windows would start a second process in its place.
        occurrence = (id(fault), action.occurrence)
        if action.heal and occurrence in self._taken_over:
            self.events.emit("fault_skipped", fault=kind, target=target, action="heal",
                             reason="a warm spare took the slot")
            return
        not_running = self._not_running(kind, target, slot)
        if not_running is not None and (occurrence in self._skipped or not action.heal):
            self._skipped.add(occurrence)
            self.events.emit("fault_skipped", fault=kind, target=target,
                             action="heal" if action.heal else "inject", reason=not_running)
            return
        if occurrence in self._skipped:
            self.events.emit("fault_skipped", fault=kind, target=target, action="heal",
                             reason="its injection was skipped")
            return
        detail = self._faults[kind](action, occurrence)
        if detail is not None:
            self._emit_fault(action, detail)

    def _emit_fault(self, action: Action, detail: str) -> None:
        self.events.emit("fault", fault=action.fault.kind, target=action.target,
                         action="heal" if action.heal else "inject", detail=detail)

    def _slot(self, learner_id: str) -> LearnerSlot[H]:
        """The slot a learner fault targets (experiments name only their own learners)."""
        return next(s for s in self.learners if s.learner_id == learner_id)

    # -- the fault kinds (`_faults`) ----------------------------------------------

    def _kill_learner_fault(self, action: Action, occurrence: tuple[int, int]) -> str | None:
        slot = self._slot(action.target)
        if action.heal:
            slot.step_base = slot.step
            remaining = max(self.experiment.learners.steps - slot.step, 1)
            self.start_learner(slot, remaining)
            return f"restarted for {remaining} steps"
        detail = self._await_push(slot) if action.fault.during == "push" else ""
        slot.state = "killed"
        self.kill_learner(slot)
        if self.experiment.learners.spares == 0:
            return detail
        self._emit_fault(action, detail)
        self._take_over(slot, occurrence)
        return None

    def _pause_learner_fault(self, action: Action, occurrence: tuple[int, int]) -> str:
        slot = self._slot(action.target)
        self.freeze(slot, not action.heal)
        slot.state = self._back_to_running(slot) if action.heal else self._under(slot, "paused")
        return ""

    def _straggle_fault(self, action: Action, occurrence: tuple[int, int]) -> str:
        slot = self._slot(action.target)
        if action.heal:
            if slot.straggler is not None:
                slot.straggler.set()
            slot.state = self._back_to_running(slot)
            return ""
        slot.straggler = threading.Event()
        threading.Thread(target=self._duty_cycle,
                         args=(slot, action.fault.duty, slot.straggler), daemon=True).start()
        slot.state = self._under(slot, "straggling")
        return ""

    def _partition_learner_fault(self, action: Action, occurrence: tuple[int, int]) -> str:
        slot = self._slot(action.target)
        self.partition_learner(slot, action.heal)
        slot.state = (self._back_to_running(slot) if action.heal
                      else self._under(slot, "partitioned"))
        return ""

    def _link_fault(self, action: Action, occurrence: tuple[int, int]) -> str:
        """`latency`, `bandwidth`, `reset_connections`: on the learner's proxy; heal
        goes back to the experiment's link for it."""
        slot, fault, heal = self._slot(action.target), action.fault, action.heal
        if slot.proxy is None:
            return ""
        link = self.experiment.link_for(slot.learner_id)
        if fault.kind == "latency":
            slot.proxy.set_latency(link.latency_ms if heal else fault.latency_ms)
            return "" if heal else f"{fault.latency_ms:g} ms"
        if fault.kind == "bandwidth":
            slot.proxy.set_bandwidth(link.bandwidth if heal else fault.bandwidth_bytes_s)
            return "" if heal else f"{fault.bandwidth_bytes_s} B/s"
        if not heal:
            slot.proxy.reset_connections()
        return ""

    def _kill_coordinator_fault(self, action: Action, occurrence: tuple[int, int]) -> str:
        if action.heal:
            self.restart_coordinator()
        else:
            self.kill_coordinator()
        self.coordinator_up = action.heal
        return ""

    def _adversary_fault(self, action: Action, occurrence: tuple[int, int]) -> str:
        if not action.heal:
            self.start_adversary(action.target, action.fault.adversary, action.fault.duration_s)
        return ""

    def _etcd_member_fault(self, action: Action, occurrence: tuple[int, int]) -> str:
        return self.etcd_fault(int(action.target.removeprefix("m")), action.heal)

    @staticmethod
    def _back_to_running(slot: LearnerSlot[H]) -> str:
        """A healed learner's state: running again, unless it ended meanwhile."""
        return "running" if slot.running else slot.state

    @staticmethod
    def _under(slot: LearnerSlot[H], fault_state: str) -> str:
        """A learner's state as a fault begins: the fault's while its process runs; one
        that has ended (done, exited, killed and waiting for its restart) keeps its own."""
        return fault_state if slot.running else slot.state

    def _take_over(self, slot: LearnerSlot[H], occurrence: tuple[int, int]) -> None:
        """A killed learner's slot goes to a warm spare now: its down time ends here,
        and the kill's scripted restart is skipped."""
        slot.step_base = slot.step
        remaining = max(self.experiment.learners.steps - slot.step, 1)
        self.hand_to_spare(slot, remaining)
        self._taken_over.add(occurrence)
        self.events.emit("fault", fault="kill_learner", target=slot.learner_id, action="heal",
                         detail=f"a warm spare took the slot for {remaining} steps")

    def _not_running(self, kind: str, target: str, slot: LearnerSlot[H] | None) -> str | None:
        """Why the process a kill or pause targets is not running now; None if it is
        (or the fault targets no single process)."""
        if kind in ("kill_learner", "pause_learner", "straggle") and slot is not None:
            return None if slot.running else f"learner is {slot.state}"
        if kind == "kill_coordinator":
            return None if self.coordinator_up else "the coordinator is down"
        if kind == "kill_etcd_member" and self.experiment.etcd.members:
            running = self.etcd_running(int(target.removeprefix("m")))
            return None if running else f"etcd member {target} is down"
        return None

    def leader_status(self, timeout: float = 1.0) -> pb.StatusResponse | None:
        """The leading coordinator's status, or None while none answers as leader."""
        candidates = (list(self.replica_admins()) if self.experiment.highly_available
                      else [self.coordinator_admin()] if self.coordinator_up else [])
        for coordinator in candidates:
            try:
                status = coordinator.status(timeout=timeout)
            except Exception:  # down, paused or restarting: grpc raises many kinds
                continue
            if status.role in ("", "leader"):
                return status
        return None

    def leader(self, timeout: float = 10.0) -> tuple[int, int]:
        """(index, epoch) of the replica leading now; `TimeoutError` if none does."""
        return find_leader(self.replica_admins(), timeout=timeout)

    def _leader_fault(self, action: Action, occurrence: tuple[int, int]) -> None:
        """Kill, pause or cut off from etcd the replica leading now; heal that one."""
        kind = action.fault.kind
        if action.heal:
            index = self._leader_hit.pop(occurrence, None)
            if index is None:
                return  # its injection was skipped
            self.replica_fault(kind, index, heal=True)
            self.events.emit("fault", fault=kind, target=f"r{index}", action="heal", detail="")
            return
        try:
            index, epoch = self.leader(timeout=10)
        except TimeoutError:
            self.events.emit("fault_skipped", fault=kind, target="leader", action="inject",
                             reason="no replica answered as leader within 10 s")
            return
        detail = ""
        if action.fault.during == "grace":
            detail = ("in a grace window" if self._await_grace(index)
                      else f"no grace window seen in {MOMENT_WAIT_S:g} s")
        self.replica_fault(kind, index, heal=False)
        self._leader_hit[occurrence] = index
        # The epoch lets the checker time the failover to the next epoch's first commit.
        self.events.emit("fault", fault=kind, target=f"r{index}", action="inject",
                         detail=detail, epoch=epoch)

    def _partition_fault(self, action: Action, occurrence: tuple[int, int]) -> None:
        """`partition`: "leader" (as target or in cut_from) is the replica leading
        when it strikes, and its heal reaches the same one; a partitioned leader's
        event carries its epoch, so that the failover is timed as for other leader
        faults."""
        fault = action.fault
        epoch: int | None = None
        if action.heal:
            names = self._partitioned.pop(occurrence, None)
            if names is None:
                return  # its injection was skipped
            target, cut_from = names
        else:
            target, cut_from = action.target, list(fault.cut_from)
            if "leader" in (target, *cut_from):
                try:
                    index, leading = self.leader(timeout=10)
                except TimeoutError:
                    self._skipped.add(occurrence)
                    self.events.emit("fault_skipped", fault=fault.kind, target=target,
                                     action="inject",
                                     reason="no replica answered as leader within 10 s")
                    return
                if target == "leader":
                    epoch = leading
                target = f"r{index}" if target == "leader" else target
                cut_from = [f"r{index}" if n == "leader" else n for n in cut_from]
            self._partitioned[occurrence] = (target, cut_from)
        slot = next((s for s in self.learners if s.learner_id == target), None)
        began = time.monotonic()
        detail = self.partition(target, cut_from, action.heal, occurrence)
        if slot is not None:
            slot.state = (self._back_to_running(slot) if action.heal
                          else self._under(slot, "partitioned"))
        extra: dict[str, Any] = {} if epoch is None else {"epoch": epoch}
        # took_s: how long the backend took to cut or mend (docker starts helpers).
        self.events.emit("fault", fault=fault.kind, target=target,
                         action="heal" if action.heal else "inject", detail=detail,
                         cut_from=cut_from, took_s=round(time.monotonic() - began, 3), **extra)

    def _await_grace(self, index: int) -> bool:
        """Until replica `index` shows a round in its grace window (or the wait ends)."""
        deadline = time.monotonic() + MOMENT_WAIT_S
        replica = self.replica_admins()[index]
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # a status poll racing a fault
                status = replica.status(timeout=0.5)
                if any(f.grace_left_s > 0 for f in status.fragments):
                    return True
            time.sleep(0.005)
        return False

    def _await_push(self, slot: LearnerSlot[H]) -> str:
        """Until a push is on the wire: invoked in the learner's log, and answered
        neither there nor in any coordinator's log (on a slow link the answer takes
        long to travel back, and a push the coordinator has acknowledged is whole,
        not cut); or until the wait ends. Says which, so a checker can look for what
        the kill left behind."""
        learner_log = Tail(slot.log)
        coordinator_logs = [Tail(path) for path in self.coordinator_logs()]
        open_pushes: dict[tuple[int, int], None] = {}
        answered: set[tuple[int, int]] = set()
        seen = [0] * (1 + len(coordinator_logs))
        deadline = time.monotonic() + MOMENT_WAIT_S
        while time.monotonic() < deadline:
            for i, log in enumerate([learner_log, *coordinator_logs]):
                events = log.read()
                for event in events[seen[i]:]:
                    key = (event.get("fragment", -1), event.get("seq", -1))
                    if i == 0 and event["kind"] == "push_invoke":
                        open_pushes[key] = None
                    elif i == 0 and event["kind"] in (
                            "push_ack", "push_unsent", "dropped", "merged"):
                        open_pushes.pop(key, None)
                    elif i > 0 and event.get("learner") == slot.learner_id and event[
                            "kind"] in ("push_ack", "reject"):
                        answered.add(key)
                seen[i] = len(events)
            on_the_wire = [key for key in open_pushes if key not in answered]
            if on_the_wire:
                fragment, seq = on_the_wire[-1]
                return f"mid-push of fragment {fragment} seq {seq}"
            time.sleep(0.005)
        return f"no push in flight within {MOMENT_WAIT_S:g} s"

    def _duty_cycle(self, slot: LearnerSlot[H], duty: float, done: threading.Event) -> None:
        """Freeze and thaw a learner so it runs `duty` of each period: a straggler."""
        process, period_s = slot.process, self.straggle_period_s
        try:
            while not done.is_set() and slot.process is process and slot.running:
                self.freeze(slot, False)
                done.wait(duty * period_s)
                if done.is_set():
                    break
                self.freeze(slot, True)
                done.wait((1 - duty) * period_s)
        finally:
            if slot.process is process:
                self.freeze(slot, False)

    def _record_start(self, role: str, name: str, **ident: Any) -> None:
        """The `process_start` event (`pid` of a process, `container` of a container)."""
        self.events.emit("process_start", role=role, name=name, **ident)

    def _exited(self, slot: LearnerSlot[H], process: H, code: int, **ident: Any) -> None:
        """A learner's process ended: its `process_exit` event and its state. One the
        harness killed stays `killed` (its restart or a spare comes); one that ended by
        itself while under a fault (straggling, say, when its last step came before
        the fault's end) is done like any other."""
        self.events.emit("process_exit", name=slot.learner_id, code=code, **ident)
        if process is slot.process:
            slot.exit_codes.append(code)
            if slot.state != "killed":
                slot.state = "done" if code == 0 else f"exited {code}"

    # -- the end ----------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Every learner has run out of steps (none down waiting for a restart), and
        every adversary has sent its last attack (each sends every kind at least once,
        which the checks look for, however slowly it started)."""
        return all(self._ended(s) for s in self.learners) and not self.adversaries_running()

    @staticmethod
    def _ended(slot: LearnerSlot[H]) -> bool:
        """Done or exited; or under a fault's state with its process ended (a fault that
        began as the process ended can leave its state behind): the exit decides."""
        if slot.state == "done" or slot.state.startswith("exited"):
            return True
        return slot.state not in ("killed", "running", "starting") and not slot.running

    def stop(self, reason: str) -> None:
        """Stop everything started, politely first; safe to call more than once."""
        # The moment the run was cut, before the seconds stopping takes.
        self.events.emit("run_stop", reason=reason)
        for slot in self.learners:
            if slot.straggler is not None:
                slot.straggler.set()
        try:
            self.stop_all()
        finally:
            self.events.emit("run_end", reason=reason)
            self.events.close()


def make_cluster(experiment: Experiment, out: Path) -> Cluster[Any]:
    """The experiment's topology on the backend it names."""
    if experiment.backend == "docker":
        from chaos.docker import DockerCluster

        return DockerCluster(experiment, out)
    from chaos.runner import ProcessCluster

    return ProcessCluster(experiment, out)
