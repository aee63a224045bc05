"""Running a chaos experiment on local processes (the `process` backend).

Starts the coordinator, a fault-injecting proxy per learner and the
learners, plays the seeded fault timeline against them, shows a live view,
and stops everything it started — also on Ctrl-C or its own crash. Every
process writes its own JSONL event log; the harness logs its faults and
process starts/exits, then merges all of them into `events.jsonl`, the one
history the checkers and the report read.

A highly available topology adds an etcd cluster (`chaos.etcd`), started
first and stopped last, and runs the coordinator as replicas
(`chaos.failover.ReplicaSet`), optionally each behind its own proxy to etcd;
leader faults find the leader by asking every replica its role.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from chaos.etcd import EtcdCluster, free_port
from chaos.experiment import LEADER_FAULTS, Action, Experiment, schedule
from chaos.failover import ReplicaSet, Tail
from chaos.history import load_log
from chaos.local import CoordinatorProcess, StartError
from chaos.metrics import goodput
from chaos.proxy import ThreadedProxy
from coordinator.certs import make_certificates
from protos import ftsync_pb2 as pb
from protos import tls
from protos.events import EventLog
from protos.tls import TlsConfig

# How long a kill waits for its moment (during = "grace" or "push").
_MOMENT_WAIT_S = 10.0
_GOODPUT_EVERY_S = 5.0

_PROGRESS = re.compile(r" step (\d+) loss (\S+)")


@dataclass
class LearnerSlot:
    """One learner of the run, across its restarts."""

    learner_id: str
    shard: int
    log: Path
    process: subprocess.Popen[str] | None = None
    proxy: ThreadedProxy | None = None
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


class ProcessCluster:
    """The topology of one experiment, as local processes."""

    def __init__(self, experiment: Experiment, out: Path) -> None:
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
            make_certificates(self.certs, [], [*experiment.learners.ids(), *sorted(adversaries)],
                              force=True)
            args += tls.as_flags(self.credentials("coordinator"))
        # Shared by a single coordinator and by replicas (each with its own event log).
        self.coordinator_args = args
        self.admin_token = spec.overrides().get("auth.admin_token", "")
        self.admin_tls = self.credentials("admin") if experiment.tls else None
        self.coordinator_log = out / "coordinator.events.jsonl"
        self.coordinator = CoordinatorProcess(state_dir=out / "state", args=[
            "--event-log", str(self.coordinator_log), *args], admin_token=self.admin_token,
            admin_tls=self.admin_tls)
        self.coordinator_up = False
        self.etcd = (EtcdCluster(out / "etcd", experiment.etcd.members,
                                 tls=self.credentials("coordinator") if experiment.tls else None)
                     if experiment.etcd.members else None)
        # Per replica, its proxies to the etcd members (coordinator.etcd_proxies).
        self.etcd_proxies: list[list[ThreadedProxy]] = []
        self.replicas: ReplicaSet | None = None
        # The replica each leader fault hit, so that its heal reaches the same one.
        self._leader_hit: dict[tuple[int, int], int] = {}
        # The coordinator each drain stopped (its name and process), restarted by its heal.
        self._drained: dict[tuple[int, int], tuple[str, CoordinatorProcess]] = {}
        self.learners = [LearnerSlot(lid, i, out / f"{lid}.events.jsonl",
                                     peer_port=free_port() if experiment.learners.peers else 0)
                         for i, lid in enumerate(experiment.learners.ids())]
        self.adversaries: list[subprocess.Popen[str]] = []
        self._skipped: set[tuple[int, int]] = set()

    def credentials(self, stem: str) -> TlsConfig:
        """The files of one certificate the run made (`learner-ID`, `admin`, ...)."""
        return TlsConfig(cert=str(self.certs / f"{stem}.pem"),
                         key=str(self.certs / f"{stem}.key"), ca=str(self.certs / "ca.pem"))

    def tls_flags(self, learner_id: str) -> list[str]:
        """The flags a learner or an adversary is started with."""
        if not self.experiment.tls:
            return []
        return tls.as_flags(self.credentials(f"learner-{learner_id}"))

    # -- processes -------------------------------------------------------------

    def start(self) -> None:
        """Start every process of the topology; `StartError` names what did not start."""
        if self.etcd is not None:
            self.etcd.start()
            for member in self.etcd.members:
                self._started("etcd", member.name, member.process)
        if self.experiment.highly_available:
            self._start_replicas()
        else:
            self.coordinator.start()
            self.coordinator_up = True
            self._started("coordinator", "coordinator", self.coordinator.process)
        for slot in self.learners:
            if self.experiment.proxy:
                slot.proxy = ThreadedProxy(self.coordinator.address)
                slot.proxy.start()
            self.start_learner(slot, self.experiment.learners.steps)

    def _start_replicas(self) -> None:
        assert self.etcd is not None
        spec = self.experiment.coordinator
        if spec.etcd_proxies:
            for _ in range(spec.replicas):
                proxies = [ThreadedProxy(endpoint) for endpoint in self.etcd.endpoints]
                for proxy in proxies:
                    proxy.start()
                self.etcd_proxies.append(proxies)
        self.replicas = ReplicaSet(
            self.out, self.etcd.endpoints, count=spec.replicas, args=self.coordinator_args,
            admin_token=self.admin_token, admin_tls=self.admin_tls,
            replica_etcd=[[f"127.0.0.1:{p.port}" for p in proxies]
                          for proxies in self.etcd_proxies])
        for i, replica in enumerate(self.replicas.replicas):
            replica.start()
            self._started("replica", f"r{i}", replica.process)
        try:
            index, epoch = self.replicas.leader(timeout=60)
        except TimeoutError:
            raise StartError(f"no coordinator replica became leader within 60 s; see "
                             f"{self.out}/replica*.stderr.log") from None
        self.events.emit("leader", replica=f"r{index}", epoch=epoch)

    def learner_address(self, slot: LearnerSlot) -> str:
        if slot.proxy is not None:
            return f"127.0.0.1:{slot.proxy.port}"
        if self.replicas is None:
            return self.coordinator.address
        if self.experiment.learners.discovery == "etcd":
            assert self.etcd is not None
            return f"etcd://{','.join(self.etcd.endpoints)}/{self.experiment.coordinator.run}"
        return self.replicas.addresses

    def leader_status(self, timeout: float = 1.0) -> pb.StatusResponse | None:
        """The leading coordinator's status, or None while none answers as leader."""
        candidates = (self.replicas.replicas if self.replicas is not None
                      else [self.coordinator] if self.coordinator_up else [])
        for coordinator in candidates:
            try:
                status = coordinator.status(timeout=timeout)
            except Exception:  # down, paused or restarting: grpc raises many kinds
                continue
            if status.role in ("", "leader"):
                return status
        return None

    def start_learner(self, slot: LearnerSlot, steps: int) -> None:
        spec = self.experiment.learners
        command = [
            sys.executable, "-m", "learner", "--coordinator", self.learner_address(slot),
            "--learner-id", slot.learner_id, "--task", spec.task, "--size", spec.size,
            "--shard", str(slot.shard), "--num-shards", str(spec.count),
            "--steps", str(steps), "--sync-every", str(spec.sync_every),
            "--fragments", str(spec.fragments), "--overlap", str(spec.overlap),
            "--compression", spec.compression, "--threads", str(spec.threads),
            "--seed", str(self.experiment.seed), "--progress-every", "10",
            "--event-log", str(slot.log), *self.tls_flags(slot.learner_id), *spec.args]
        if slot.peer_port:
            command += ["--serve-peers", f"127.0.0.1:{slot.peer_port}"] + [
                arg for other in self.learners if other is not slot
                for arg in ("--peers", f"127.0.0.1:{other.peer_port}")]
        if self.experiment.coordinator.mode == "sync":
            command.append("--lockstep")
        slot.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(spec.threads)})
        slot.state = "running"
        self._started("learner", slot.learner_id, slot.process)
        threading.Thread(target=self._follow, args=(slot, slot.process), daemon=True).start()

    def _follow(self, slot: LearnerSlot, process: subprocess.Popen[str]) -> None:
        """Track a learner's progress lines and keep its output in a file."""
        assert process.stdout is not None
        with open(self.out / f"{slot.learner_id}.out", "a") as keep:
            for line in process.stdout:
                keep.write(line)
                match = _PROGRESS.search(line)
                if match:
                    slot.step = slot.step_base + int(match.group(1))
                    slot.loss = match.group(2)
        code = process.wait()
        self.events.emit("process_exit", name=slot.learner_id, code=code, pid=process.pid)
        if process is slot.process:
            slot.exit_codes.append(code)
            if slot.state == "running":
                slot.state = "done" if code == 0 else f"exited {code}"

    def _started(self, role: str, name: str, process: subprocess.Popen[Any] | None) -> None:
        self.events.emit("process_start", role=role, name=name,
                         pid=process.pid if process else None)

    # -- faults ------------------------------------------------------------------

    def apply(self, action: Action) -> None:
        fault, target = action.fault, action.target
        kind = fault.kind
        slot = next((s for s in self.learners if s.learner_id == target), None)
        detail = ""
        # A fault on a process that is not running (down, done) is skipped, and so
        # is its heal: overlapping windows would start a second process in its place.
        occurrence = (id(fault), action.occurrence)
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
        if kind == "kill_learner" and slot is not None:
            if not action.heal:
                assert slot.process is not None
                if fault.during == "push":
                    detail = self._await_push(slot)
                slot.state = "killed"
                slot.process.kill()
            else:
                slot.step_base = slot.step
                remaining = max(self.experiment.learners.steps - slot.step, 1)
                detail = f"restarted for {remaining} steps"
                self.start_learner(slot, remaining)
        elif kind in ("pause_learner", "straggle") and slot is not None:
            assert slot.process is not None
            if kind == "straggle" and not action.heal:
                slot.straggler = threading.Event()
                threading.Thread(target=_duty_cycle, args=(slot.process, fault.duty,
                                                           slot.straggler), daemon=True).start()
                slot.state = "straggling"
            elif kind == "straggle":
                if slot.straggler is not None:
                    slot.straggler.set()
                slot.state = "running" if slot.running else slot.state
            elif not action.heal:
                slot.process.send_signal(signal.SIGSTOP)
                slot.state = "paused"
            else:
                slot.process.send_signal(signal.SIGCONT)
                slot.state = "running" if slot.running else slot.state
        elif kind == "kill_coordinator":
            if not action.heal:
                self.coordinator.kill()
                self.coordinator_up = False
            else:
                self.coordinator.start()
                self.coordinator_up = True
                self._started("coordinator", "coordinator", self.coordinator.process)
        elif kind == "adversary":
            if not action.heal:
                self._start_adversary(target, fault.adversary, fault.duration_s)
        elif kind in LEADER_FAULTS:
            self._leader_fault(action, occurrence)
            return
        elif kind == "drain_replica":
            self._drain_fault(action, occurrence)
            return
        elif kind == "kill_etcd_member":
            detail = self._etcd_fault(target, action.heal)
        elif slot is not None and slot.proxy is not None:
            detail = self._network(slot, kind, action.heal, fault.latency_ms,
                                   fault.bandwidth_bytes_s)
        self.events.emit("fault", fault=kind, target=target,
                         action="heal" if action.heal else "inject", detail=detail)

    def _not_running(self, kind: str, target: str, slot: LearnerSlot | None) -> str | None:
        """Why the process a kill or pause targets is not running now; None if it is
        (or the fault targets no single process)."""
        if kind in ("kill_learner", "pause_learner", "straggle") and slot is not None:
            return None if slot.running else f"learner is {slot.state}"
        if kind == "kill_coordinator":
            return None if self.coordinator_up else "the coordinator is down"
        if kind == "kill_etcd_member" and self.etcd is not None:
            member = self.etcd.members[int(target.removeprefix("m"))]
            return None if member.running else f"etcd member {target} is down"
        return None

    def _leader_fault(self, action: Action, occurrence: tuple[int, int]) -> None:
        """Kill, pause or cut off from etcd the replica leading now; heal that one."""
        assert self.replicas is not None
        kind = action.fault.kind
        if action.heal:
            index = self._leader_hit.pop(occurrence, None)
            if index is None:
                return  # its injection was skipped
            replica = self.replicas.replicas[index]
            if kind == "kill_leader":
                replica.start()
                self._started("replica", f"r{index}", replica.process)
            elif kind == "pause_leader":
                replica.resume()
            else:
                for proxy in self.etcd_proxies[index]:
                    proxy.heal()
            self.events.emit("fault", fault=kind, target=f"r{index}", action="heal", detail="")
            return
        try:
            index, epoch = self.replicas.leader(timeout=10)
        except TimeoutError:
            self.events.emit("fault_skipped", fault=kind, target="leader", action="inject",
                             reason="no replica answered as leader within 10 s")
            return
        detail = ""
        if action.fault.during == "grace":
            detail = ("in a grace window" if self._await_grace(index)
                      else f"no grace window seen in {_MOMENT_WAIT_S:g} s")
        replica = self.replicas.replicas[index]
        if kind == "kill_leader":
            replica.kill()
        elif kind == "pause_leader":
            replica.pause()
        else:
            for proxy in self.etcd_proxies[index]:
                proxy.partition()
        self._leader_hit[occurrence] = index
        # The epoch lets the checker time the failover to the next epoch's first commit.
        self.events.emit("fault", fault=kind, target=f"r{index}", action="inject",
                         detail=detail, epoch=epoch)

    def _drain_fault(self, action: Action, occurrence: tuple[int, int]) -> None:
        """Drain a coordinator as an upgrade does: Admin.Drain commits its open rounds,
        hands its leadership to an in-sync standby (replicas) and it exits; the heal
        restarts it on its state directory. A drain it refuses (no standby in sync to
        take over) changes nothing and is skipped, and so is its heal."""
        fault = action.fault
        if action.heal:
            name, coordinator = self._drained.pop(occurrence)
            coordinator.start()
            if coordinator is self.coordinator:
                self.coordinator_up = True
            self._started("coordinator" if coordinator is self.coordinator else "replica", name,
                          coordinator.process)
            self.events.emit("fault", fault=fault.kind, target=name, action="heal",
                             detail="restarted on its state directory")
            return
        found = self._drain_candidate(action.target)
        if isinstance(found, str):
            self._skipped.add(occurrence)
            self.events.emit("fault_skipped", fault=fault.kind, target=action.target,
                             action="inject", reason=found)
            return
        name, coordinator = found
        try:
            response, code = coordinator.drain(fault.drain_timeout_s)
        except grpc.RpcError as exc:
            self._skipped.add(occurrence)
            self.events.emit("fault_skipped", fault=fault.kind, target=name, action="inject",
                             reason=f"the drain was refused: {exc.details()}")
            return
        if coordinator is self.coordinator:
            self.coordinator_up = False
        assert coordinator.process is not None
        self.events.emit("process_exit", name=name, code=code, pid=coordinator.process.pid)
        self._drained[occurrence] = (name, coordinator)
        detail = f"{response.role}: {response.rounds_committed} versions committed"
        if response.rounds_left_open:
            detail += f", rounds left open on fragments {list(response.rounds_left_open)}"
        if response.leader:
            detail += f"; {response.leader} leads (epoch {response.epoch})"
        self.events.emit("fault", fault=fault.kind, target=name, action="inject",
                         detail=f"{detail}; exited {code}")

    def _drain_candidate(self, target: str) -> tuple[str, CoordinatorProcess] | str:
        """(name, process) of the coordinator a drain targets now, or why there is none."""
        if self.replicas is None:
            return (("coordinator", self.coordinator) if self.coordinator_up
                    else "the coordinator is down")
        if target == "leader":
            try:
                index, _ = self.replicas.leader(timeout=10)
            except TimeoutError:
                return "no replica answered as leader within 10 s"
        else:
            roles = self.replicas.roles()
            wanted = [i for i, (role, _) in enumerate(roles)
                      if (role == "standby" if target == "standby" else f"r{i}" == target)
                      and role != "down"]
            if not wanted:
                return f"no replica answers as {target}"
            index = wanted[0]
        return f"r{index}", self.replicas.replicas[index]

    def _await_grace(self, index: int) -> bool:
        """Until replica `index` shows a round in its grace window (or the wait ends)."""
        assert self.replicas is not None
        deadline = time.monotonic() + _MOMENT_WAIT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # a status poll racing a fault
                status = self.replicas.replicas[index].status(timeout=0.5)
                if any(f.grace_left_s > 0 for f in status.fragments):
                    return True
            time.sleep(0.005)
        return False

    def _await_push(self, slot: LearnerSlot) -> str:
        """Until a push is on the wire: invoked in the learner's log, and answered
        neither there nor in any coordinator's log (on a slow link the answer takes
        long to travel back, and a push the coordinator has acknowledged is whole,
        not cut); or until the wait ends. Says which, so a checker can look for what
        the kill left behind."""
        learner_log = Tail(slot.log)
        coordinator_logs = [Tail(path) for path in self._coordinator_logs()]
        open_pushes: dict[tuple[int, int], None] = {}
        answered: set[tuple[int, int]] = set()
        seen = [0] * (1 + len(coordinator_logs))
        deadline = time.monotonic() + _MOMENT_WAIT_S
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
        return f"no push in flight within {_MOMENT_WAIT_S:g} s"

    def _coordinator_logs(self) -> list[Path]:
        if self.replicas is not None:
            return [self.replicas.event_log(i) for i in range(len(self.replicas.replicas))]
        return [self.coordinator_log]

    def _etcd_fault(self, target: str, heal: bool) -> str:
        assert self.etcd is not None
        index = int(target.removeprefix("m"))
        if heal:
            self.etcd.restart(index)
            self._started("etcd", target, self.etcd.members[index].process)
            return "restarted on its data directory"
        self.etcd.kill(index)
        return ""

    def _network(self, slot: LearnerSlot, kind: str, heal: bool, latency_ms: float,
                 bandwidth: int) -> str:
        proxy = slot.proxy
        assert proxy is not None
        if kind == "partition_learner":
            if heal:
                proxy.heal()
                slot.state = "running" if slot.running else slot.state
            else:
                proxy.partition()
                slot.state = "partitioned"
            return ""
        if kind == "latency":
            proxy.set_latency(0 if heal else latency_ms)
            return "" if heal else f"{latency_ms:g} ms"
        if kind == "bandwidth":
            proxy.set_bandwidth(None if heal else bandwidth)
            return "" if heal else f"{bandwidth} B/s"
        if not heal:
            proxy.reset_connections()
        return ""

    def _start_adversary(self, name: str, kinds: list[str], duration_s: float) -> None:
        spec = self.experiment.learners
        process = subprocess.Popen(
            [sys.executable, "-m", "chaos.adversary", "--coordinator", self.coordinator.address,
             "--learner-id", name, "--task", spec.task, "--size", spec.size,
             "--fragments", str(spec.fragments), "--kinds", ",".join(kinds),
             "--duration", str(duration_s),
             "--event-log", str(self.out / f"{name}.events.jsonl"), *self.tls_flags(name)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
        self.adversaries.append(process)
        self._started("adversary", name, process)

    # -- the end ----------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Every learner has run out of steps (none down waiting for a restart)."""
        return all(s.state == "done" or s.state.startswith("exited") for s in self.learners)

    def stop(self, reason: str, grace_s: float = 60.0) -> None:
        """Stop everything started, politely first; safe to call more than once."""
        # The moment the run was cut, before the seconds stopping takes.
        self.events.emit("run_stop", reason=reason)
        for slot in self.learners:
            if slot.straggler is not None:
                slot.straggler.set()
            if slot.proxy is not None:
                slot.proxy.heal()
            if slot.running:
                assert slot.process is not None
                slot.process.send_signal(signal.SIGCONT)
                slot.process.send_signal(signal.SIGTERM)
        for adversary in self.adversaries:
            if adversary.poll() is None:
                adversary.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in [s.process for s in self.learners if s.process] + self.adversaries:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if not self.coordinator_up and self.coordinator.process is not None:
            with contextlib.suppress(Exception):
                self.coordinator.start()  # bring it back so its state is read cleanly
        self.coordinator.stop()
        self.coordinator_up = False
        if self.replicas is not None:
            self.replicas.stop()
        for proxy in [p for proxies in self.etcd_proxies for p in proxies] + [
                s.proxy for s in self.learners if s.proxy is not None]:
            proxy.stop()
        self.etcd_proxies = []
        for slot in self.learners:
            slot.proxy = None
        if self.etcd is not None:
            self.etcd.stop()
        self.events.emit("run_end", reason=reason)
        self.events.close()


def _duty_cycle(process: subprocess.Popen[str], duty: float, done: threading.Event,
                period_s: float = 0.1) -> None:
    """SIGSTOP/SIGCONT a process so it runs `duty` of each period: a straggler."""
    try:
        while not done.is_set() and process.poll() is None:
            process.send_signal(signal.SIGCONT)
            done.wait(duty * period_s)
            if done.is_set():
                break
            process.send_signal(signal.SIGSTOP)
            done.wait((1 - duty) * period_s)
    except ProcessLookupError:
        pass
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)


def run_cluster(experiment: Experiment, out: Path,
                on_tick: Callable[[ProcessCluster, float, Action | None], None] | None = None,
                ) -> ProcessCluster:
    """Start the topology, play the timeline, stop; returns the stopped cluster."""
    out.mkdir(parents=True, exist_ok=True)
    cluster = ProcessCluster(experiment, out)
    actions = schedule(experiment)
    cluster.events.emit("run_start", experiment=experiment.name, seed=experiment.seed,
                        mode=experiment.coordinator.mode,
                        learners=experiment.learners.ids(),
                        fragments=experiment.learners.fragments)
    reason = "crash"
    try:
        cluster.start()
        started = time.monotonic()
        while True:
            elapsed = time.monotonic() - started
            while actions and actions[0].at_s <= elapsed:
                cluster.apply(actions.pop(0))
            if on_tick is not None:
                on_tick(cluster, elapsed, actions[0] if actions else None)
            if cluster.finished:
                reason = "learners finished"
                break
            if elapsed >= experiment.max_duration_s:
                reason = "max_duration_s reached"
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        reason = "interrupted"
        raise
    finally:
        cluster.stop(reason)
    return cluster


def live_view(console: Console) -> tuple[Live, Callable[[ProcessCluster, float,
                                                          Action | None], None]]:
    """A rich Live display and the tick callback that refreshes it."""
    live = Live(console=console, auto_refresh=False)
    last = 0.0
    # Goodput from the logs so far, recomputed every few seconds (a full read).
    goodput_at, goodput_line = -math.inf, "goodput so far: -"

    def tick(cluster: ProcessCluster, elapsed: float, upcoming: Action | None) -> None:
        nonlocal last, goodput_at, goodput_line
        if elapsed - last < 0.5:
            return
        last = elapsed
        if elapsed - goodput_at >= _GOODPUT_EVERY_S:
            events = load_log(sorted(cluster.out.glob("*.events.jsonl"))).events
            goodput_at = elapsed
            goodput_line = f"goodput so far: {goodput(events).value:.2f}"
        table = Table(title=f"{cluster.experiment.name}  t={elapsed:.0f}s", expand=False)
        for column in ("learner", "state", "step", "loss"):
            table.add_column(column)
        for slot in cluster.learners:
            table.add_row(slot.learner_id, slot.state, str(slot.step), slot.loss)
        status = cluster.leader_status()
        versions = "no coordinator answering" if status is None else (
            (f"leader {status.replica_id} epoch {status.epoch}  " if status.replica_id else "")
            + "versions " + " ".join(f"{f.fragment}:{f.version}" for f in status.fragments))
        nxt = (f"next: {upcoming.fault.kind} {'heal' if upcoming.heal else 'inject'} "
               f"{upcoming.target} at {upcoming.at_s:.0f}s" if upcoming else "no more faults")
        live.update(Group(table, versions, goodput_line, nxt), refresh=True)

    return live, tick
