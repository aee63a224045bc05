"""Running a chaos experiment: the `process` backend, the run loop and the live view.

`ProcessCluster` is the topology on local processes: the coordinator, a
fault-injecting proxy per learner and the learners, each process writing its
own JSONL event log. `run_cluster` starts the topology of either backend
(`chaos.cluster.make_cluster`), plays the seeded fault timeline against it,
shows a live view, and stops everything it started — also on Ctrl-C or its
own crash; then the harness's log and every process's are merged into
`events.jsonl`, the one history the checkers and the report read.

A highly available topology adds an etcd cluster (`chaos.etcd`), started
first and stopped last, and runs the coordinator as replicas
(`chaos.failover.ReplicaSet`), optionally each behind its own proxy to etcd;
leader faults find the leader by asking every replica its role.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from chaos.cluster import Admin, Cluster, LearnerSlot, make_cluster
from chaos.etcd import EtcdCluster, free_port
from chaos.experiment import Action, Experiment, schedule
from chaos.failover import ReplicaSet
from chaos.history import load_log
from chaos.local import CoordinatorProcess, StartError
from chaos.metrics import goodput
from chaos.proxy import ThreadedProxy, listening_ports
from learner.spare import Spare

_GOODPUT_EVERY_S = 5.0

Slot = LearnerSlot[subprocess.Popen[str]]


def proxy_host(index: int) -> str:
    """The loopback address of learner `index`'s proxy: one of its own, so that the
    coordinator's ports it mirrors do not collide with another proxy's."""
    return f"127.0.0.{2 + index}"


class ProcessCluster(Cluster[subprocess.Popen[str]]):
    """The topology of one experiment, as local processes."""

    def __init__(self, experiment: Experiment, out: Path) -> None:
        # Learners call the coordinator through their proxies' addresses: under TLS its
        # certificate names them too.
        proxies = [proxy_host(i) for i in range(experiment.learners.count)]
        super().__init__(experiment, out, cert_hosts=proxies if experiment.proxy else [])
        self.coordinator_log = out / "coordinator.events.jsonl"
        self.coordinator = CoordinatorProcess(state_dir=out / "state", args=[
            "--event-log", str(self.coordinator_log), *self.coordinator_args],
            admin_token=self.admin_token, admin_tls=self.admin_tls)
        self.etcd = (EtcdCluster(out / "etcd", experiment.etcd.members,
                                 tls=self.credentials("coordinator") if experiment.tls else None)
                     if experiment.etcd.members else None)
        # Per replica, its proxies to the etcd members (coordinator.etcd_proxies).
        self.etcd_proxies: list[list[ThreadedProxy]] = []
        self.replicas: ReplicaSet | None = None
        # The coordinator each drain stopped (its name and process), restarted by its heal.
        self._drained: dict[tuple[int, int], tuple[str, CoordinatorProcess]] = {}
        for slot in self.learners:
            slot.peer_port = free_port() if experiment.learners.peers else 0
        self.adversaries: list[subprocess.Popen[str]] = []
        # Warm spares holding no slot yet (learner/spare.py); their lines before a
        # hand-over (`ready`) go to one file.
        self.spares: list[Spare] = []
        self._spare_log = out / "spares.out"

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
        for _ in range(self.experiment.learners.spares):
            self._start_spare()
        if self.spares:
            self._await_spares()
        # Each learner's proxy on a loopback address of its own, mirroring every port of
        # the coordinator: its bulk connections cross the learner's link and faults too.
        mirrored: tuple[int, ...] = ()
        if self.experiment.proxy and self.coordinator.process is not None:
            mirrored = tuple(port for port in listening_ports(self.coordinator.process.pid)
                             if port != self.coordinator.port)
        for index, slot in enumerate(self.learners):
            if self.experiment.proxy:
                proxy = ThreadedProxy(self.coordinator.address, host=proxy_host(index),
                                      link=self.experiment.link_for(slot.learner_id),
                                      mirror_ports=mirrored)
                proxy.start()
                slot.proxy = proxy
            self.start_learner(slot, self.experiment.learners.steps)

    def _await_spares(self, timeout_s: float = 120.0) -> None:
        """Until every spare is warm (or the wait ends), before any learner starts: the
        fault schedule starts with the learners, so its first kill finds a warm spare and
        its times are the learners' training time. (Warmed beside the learners instead, a
        spare took 13-18 s at a load of 4-7, and on a quiet machine the learners had done
        half their steps before the schedule began, and all of them before its second
        kill.)"""
        deadline = time.monotonic() + timeout_s
        for spare in self.spares:
            # A spare that died warming is not waited for (kills then find no warm one).
            while (spare.alive and not spare.ready.wait(0.1)
                   and time.monotonic() < deadline):
                pass
        self.events.emit("topology_ready", waiting_for=[
            f"spare {s.pid}" for s in self.spares if not s.ready.is_set()])

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

    def learner_address(self, slot: Slot) -> str:
        if slot.proxy is not None:
            assert isinstance(slot.proxy, ThreadedProxy)
            return slot.proxy.address
        if self.replicas is None:
            return self.coordinator.address
        if self.experiment.learners.discovery == "etcd":
            assert self.etcd is not None
            return f"etcd://{','.join(self.etcd.endpoints)}/{self.experiment.coordinator.run}"
        return self.replicas.addresses

    def _slot_args(self, slot: Slot, steps: int) -> list[str]:
        peers = [f"127.0.0.1:{other.peer_port}" for other in self.learners if other is not slot]
        return self.learner_args(
            slot, steps, self.learner_address(slot), str(slot.log),
            serve_peers=f"127.0.0.1:{slot.peer_port}" if slot.peer_port else "", peers=peers)

    def _env(self) -> dict[str, str]:
        threads = str(self.experiment.learners.threads)
        return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": threads}

    def start_learner(self, slot: Slot, steps: int) -> None:
        slot.process = subprocess.Popen(
            [sys.executable, "-m", "learner", *self._slot_args(slot, steps)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self._env())
        slot.state = "running"
        self._started("learner", slot.learner_id, slot.process)
        threading.Thread(target=self._follow, args=(slot, slot.process), daemon=True).start()

    def _follow(self, slot: Slot, process: subprocess.Popen[str]) -> None:
        """Track a learner's progress lines and keep its output in a file."""
        assert process.stdout is not None
        with open(self.out / f"{slot.learner_id}.out", "a") as keep:
            for line in process.stdout:
                keep.write(line)
                slot.progress(line)
        self._exited(slot, process, process.wait(), pid=process.pid)

    def _start_spare(self) -> None:
        spare = Spare(self.spare_args(), env=self._env(), log=self._spare_log)
        self.spares.append(spare)
        self.events.emit("spare_start", pid=spare.pid)

    def hand_to_spare(self, slot: Slot, steps: int) -> None:
        """The first warm spare (else the one warming longest) takes the slot; its
        output is followed as a learner's from the hand-over line on."""
        spare = next((s for s in self.spares if s.ready.is_set() and s.alive),
                     None) or min((s for s in self.spares if s.alive), key=lambda s: s.started)
        self.spares.remove(spare)
        keep = self.out / f"{slot.learner_id}.out"

        def line(text: str) -> None:
            with open(keep, "a") as f:
                f.write(text)
            slot.progress(text)

        def exited(code: int) -> None:
            self._exited(slot, spare.process, code, pid=spare.pid)

        slot.process = spare.process
        slot.state = "running"
        self.events.emit("process_start", role="learner", name=slot.learner_id,
                         pid=spare.pid, spare=True, warm=spare.ready.is_set())
        spare.hand_over(self._slot_args(slot, steps), line, exited)
        self._start_spare()

    def _started(self, role: str, name: str, process: subprocess.Popen[Any] | None) -> None:
        self._record_start(role, name, pid=process.pid if process else None)

    # -- the backend's primitives ----------------------------------------------------

    def kill_learner(self, slot: Slot) -> None:
        assert slot.process is not None
        slot.process.kill()
        # Gone, its sockets closed, before anything (a spare) takes its peer port.
        slot.process.wait(timeout=10)

    def freeze(self, slot: Slot, frozen: bool) -> None:
        if slot.process is not None and slot.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                slot.process.send_signal(signal.SIGSTOP if frozen else signal.SIGCONT)

    def kill_coordinator(self) -> None:
        self.coordinator.kill()

    def restart_coordinator(self) -> None:
        self.coordinator.start()
        self._started("coordinator", "coordinator", self.coordinator.process)

    def coordinator_admin(self) -> Admin:
        return self.coordinator

    def replica_admins(self) -> Sequence[Admin]:
        return self.replicas.replicas if self.replicas is not None else []

    def replica_fault(self, kind: str, index: int, heal: bool) -> None:
        assert self.replicas is not None
        replica = self.replicas.replicas[index]
        if kind == "kill_leader":
            if heal:
                replica.start()
                self._started("replica", f"r{index}", replica.process)
            else:
                replica.kill()
        elif kind == "pause_leader":
            if heal:
                replica.resume()
            else:
                replica.pause()
        else:
            for proxy in self.etcd_proxies[index]:
                if heal:
                    proxy.heal()
                else:
                    proxy.partition()

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

    def coordinator_logs(self) -> list[Path]:
        if self.replicas is not None:
            return [self.replicas.event_log(i) for i in range(len(self.replicas.replicas))]
        return [self.coordinator_log]

    def etcd_running(self, index: int) -> bool:
        return self.etcd is not None and self.etcd.members[index].running

    def etcd_fault(self, index: int, heal: bool) -> str:
        assert self.etcd is not None
        if heal:
            self.etcd.restart(index)
            self._started("etcd", f"m{index}", self.etcd.members[index].process)
            return "restarted on its data directory"
        self.etcd.kill(index)
        return ""

    def adversaries_running(self) -> bool:
        return any(process.poll() is None for process in self.adversaries)

    def start_adversary(self, name: str, kinds: list[str], duration_s: float) -> None:
        process = subprocess.Popen(
            [sys.executable, "-m", "chaos.adversary", *self.adversary_args(
                name, self.coordinator.address, kinds, duration_s,
                str(self.out / f"{name}.events.jsonl"))],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
        self.adversaries.append(process)
        self._started("adversary", name, process)

    # -- the end ----------------------------------------------------------------

    def stop_all(self, grace_s: float = 60.0) -> None:
        for spare in self.spares:
            spare.stop()
        self.spares = []
        for slot in self.learners:
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
                s.proxy for s in self.learners if isinstance(s.proxy, ThreadedProxy)]:
            proxy.stop()
        self.etcd_proxies = []
        for slot in self.learners:
            slot.proxy = None
        if self.etcd is not None:
            self.etcd.stop()


class Timeline:
    """The fault actions still to come, each on its fault's clock: the run's, from the
    start, or for a fault with `after_version`, from the moment every fragment has
    reached that version (the driver says, from the leader's status, while `waiting`)."""

    def __init__(self, actions: list[Action], started: float) -> None:
        self.actions = actions
        self.origins: dict[int | None, float] = {None: started}

    @property
    def upcoming(self) -> Action | None:
        return self.actions[0] if self.actions else None

    @property
    def waiting(self) -> bool:
        """Some fault's clock waits for a version."""
        return any(a.fault.after_version not in self.origins for a in self.actions)

    def due(self, now: float, reached: int | None = None) -> list[Action]:
        """The actions due at `now`, every fragment being at version `reached` or newer
        (None: not known), in timeline order and taken off the timeline."""
        if reached is not None:
            for action in self.actions:
                version = action.fault.after_version
                if version is not None and version not in self.origins and reached >= version:
                    self.origins[version] = now
        due = [a for a in self.actions
               if (origin := self.origins.get(a.fault.after_version)) is not None
               and now - origin >= a.at_s]
        taken = {id(a) for a in due}
        self.actions = [a for a in self.actions if id(a) not in taken]
        return due


def versions_reached(cluster: Cluster[Any]) -> int | None:
    """The version every fragment has reached, by the leader's status (None: no leader
    answers, or no fragment has one yet)."""
    status = cluster.leader_status()
    if status is None or not status.fragments:
        return None
    return min(f.version for f in status.fragments)


def run_cluster(experiment: Experiment, out: Path,
                on_tick: Callable[[Cluster[Any], float, Action | None], None] | None = None,
                ) -> Cluster[Any]:
    """Start the topology, play the timeline, stop; returns the stopped cluster."""
    out.mkdir(parents=True, exist_ok=True)
    cluster = make_cluster(experiment, out)
    cluster.events.emit("run_start", experiment=experiment.name, seed=experiment.seed,
                        mode=experiment.coordinator.mode,
                        learners=experiment.learners.ids(),
                        fragments=experiment.learners.fragments)
    reason = "crash"
    try:
        cluster.start()
        started = time.monotonic()
        timeline = Timeline(schedule(experiment), started)
        while True:
            now = time.monotonic()
            elapsed = now - started
            reached = versions_reached(cluster) if timeline.waiting else None
            for action in timeline.due(now, reached):
                cluster.apply(action)
            if on_tick is not None:
                on_tick(cluster, elapsed, timeline.upcoming)
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


def live_view(console: Console) -> tuple[Live, Callable[[Cluster[Any], float,
                                                          Action | None], None]]:
    """A rich Live display and the tick callback that refreshes it."""
    live = Live(console=console, auto_refresh=False)
    last = 0.0
    # Goodput from the logs so far, recomputed every few seconds (a full read).
    goodput_at, goodput_line = -math.inf, "goodput so far: -"

    def tick(cluster: Cluster[Any], elapsed: float, upcoming: Action | None) -> None:
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
        after = ("" if upcoming is None or upcoming.fault.after_version is None
                 else f" after version {upcoming.fault.after_version}")
        nxt = (f"next: {upcoming.fault.kind} {'heal' if upcoming.heal else 'inject'} "
               f"{upcoming.target} at {upcoming.at_s:.0f}s{after}" if upcoming
               else "no more faults")
        live.update(Group(table, versions, goodput_line, nxt), refresh=True)

    return live, tick
