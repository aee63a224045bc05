"""The chaos harness's `docker` backend: every process of the topology a container.

`DockerCluster` runs an experiment's etcd members, coordinator or replicas,
learners, adversaries and per-learner fault proxies (`python -m chaos.proxy`)
as containers of one image on a network the run creates, through the docker
SDK. Faults go through the docker API: kill and start, pause and unpause (a
straggler is paused for part of each second), disconnect from the network and
connect again (a partition from every other process), and per-pair cuts — a
learner from the leader, the leader from etcd, any container from any other —
as `unreachable` routes in both containers' network namespaces
(`chaos.routes`, run by a helper container that shares the namespace). A
restarted container is given the routes of the cuts still open on it. Every
container keeps its address across restarts and reconnects (the run's network
has a subnet of its own and each container a fixed address in it).

The out directory is bind-mounted into every container, so each process writes
its JSONL event log (and a replica its state directory) where the process
backend writes them, and the checkers, the report and the HA audit read the
run unchanged. The harness reaches coordinators and etcd only through ports
published on 127.0.0.1 (its Admin.Status polls, its etcd health checks) and
proxies through their control ports, also on 127.0.0.1.

Everything the run creates carries the label `ftsync.chaos.run=RUN`; stopping
removes every container, network and volume with it — at the end, on Ctrl-C
(the runner's `finally`), on the harness's own crash, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
from docker.models.containers import Container
from docker.models.networks import Network

from chaos import proxy as proxy_control
from chaos import routes
from chaos.cluster import Admin, Cluster, LearnerSlot
from chaos.etcd import EtcdMember
from chaos.experiment import Experiment, schedule
from chaos.failover import Tail, roles
from chaos.local import StartError, admin_status
from protos import ftsync_pb2 as pb
from protos.tls import TlsConfig

RUN_LABEL = "ftsync.chaos.run"
EXPERIMENT_LABEL = "ftsync.chaos.experiment"
# Where the run's out directory is mounted in every container.
INSIDE = "/run/ftsync"
GRPC_PORT, ETCD_PORT, ETCD_PEER_PORT = 50051, 2379, 2380
PROXY_PORT, CONTROL_PORT, PEER_PORT = 7000, 7001, 7100
_START_TIMEOUT_S = 60.0
_ROUTES_SOURCE = Path(routes.__file__).read_text()
# Candidate subnets for a run's network, far from docker's default pools.
_SUBNETS = [f"10.{second}.{third}.0/24" for second in range(210, 226) for third in range(256)]


def engine_problem() -> str | None:
    """Why no docker engine answers (one line saying how to start one), or None."""
    where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        client = docker.from_env(timeout=10)
        try:
            client.ping()
        finally:
            client.close()
    except docker.errors.DockerException as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return (f'backend = "docker" needs a docker engine, and none answers at {where} '
                f"({reason[:160]}): start one (sudo systemctl start docker, or sudo dockerd &) "
                f"or point DOCKER_HOST at one")
    return None


def leftovers(client: docker.DockerClient, label: str) -> list[str]:
    """Names of the containers, networks and volumes carrying `label` (key=value)."""
    filters: dict[str, Any] = {"label": label}
    return ([str(c.name) for c in client.containers.list(all=True, filters=filters)]
            + [str(n.name) for n in client.networks.list(filters=filters)]
            + [str(v.name) for v in client.volumes.list(filters=filters)])


@dataclass
class ContainerProcess:
    """A learner's or adversary's container, as a `Handle`: its exit status once
    it has exited (the follower thread or a kill records it)."""

    container: Container
    exit_code: int | None = None
    pid: int | None = None

    def poll(self) -> int | None:
        return self.exit_code


@dataclass
class CoordinatorContainer:
    """A coordinator (or replica) container, asked for Admin.Status on its port
    published on 127.0.0.1."""

    name: str
    container: Container
    admin_tls: TlsConfig | None
    admin_token: str
    address: str = ""
    # "listening on" lines seen so far: a restart waits for one more.
    starts: int = 0

    def status(self, timeout: float = 10.0) -> pb.StatusResponse:
        if not self.address:
            raise ConnectionError(f"{self.name} publishes no port now")
        return admin_status(self.address, self.admin_tls, self.admin_token, timeout)


@dataclass
class ProxyContainer:
    """A learner's fault proxy in a container of its own, switched through its
    control port (published on 127.0.0.1): a `Link`."""

    container: Container
    control: str

    def _send(self, command: str) -> None:
        proxy_control.control(self.control, command)

    def set_latency(self, ms: float) -> None:
        self._send(f"latency {ms}")

    def set_bandwidth(self, bytes_per_s: float | None) -> None:
        self._send(f"bandwidth {bytes_per_s or 0}")

    def partition(self) -> None:
        self._send("partition")

    def heal(self) -> None:
        self._send("heal")

    def reset_connections(self) -> None:
        self._send("reset")


@dataclass
class _Cut:
    """Pairs of container names cut from each other by routes."""

    pairs: list[tuple[str, str]] = field(default_factory=list)


Slot = LearnerSlot[ContainerProcess]


class DockerCluster(Cluster[ContainerProcess]):
    """The topology of one experiment, as containers on a network of the run's own."""

    straggle_period_s = 1.0  # a pause or unpause is an API call, not a signal

    def __init__(self, experiment: Experiment, out: Path) -> None:
        problem = engine_problem()
        if problem is not None:
            raise StartError(problem)
        self.run_id = secrets.token_hex(4)
        spec = experiment.coordinator
        replicas = [f"r{i}" for i in range(spec.replicas)] if experiment.highly_available \
            else ["coordinator"]
        proxies = [f"proxy-{lid}" for lid in experiment.learners.ids()] if experiment.proxy \
            else []
        # Names the coordinator's certificate must hold: how the others dial it.
        super().__init__(experiment, out, cert_hosts=[*replicas, *proxies,
                                                      *experiment.etcd.ids()])
        self.image = experiment.docker.image
        self.client = docker.from_env(timeout=60)
        self.labels = {RUN_LABEL: self.run_id, EXPERIMENT_LABEL: experiment.name}
        os.chmod(out, 0o777)  # the containers run as uid 10001
        if experiment.tls:
            os.chmod(self.certs, 0o755)
            for key in self.certs.glob("*.key"):
                os.chmod(key, 0o644)  # the run's own throwaway CA, read by uid 10001
        self.network: Network | None = None
        self.addresses: dict[str, str] = {}
        self.coordinator_names = replicas
        self.coordinators: list[CoordinatorContainer] = []
        self.etcd: dict[str, Container] = {}
        self.etcd_health: dict[str, EtcdMember] = {}
        self.proxies: dict[str, ProxyContainer] = {}
        self.adversaries: list[Container] = []
        self._followers: list[threading.Thread] = []
        # Per open cut (a fault occurrence), the container pairs it cut.
        self._cuts: dict[tuple[Any, ...], _Cut] = {}
        self._removed = False
        atexit.register(self.remove_all)

    # -- naming --------------------------------------------------------------------

    def cert_dir(self) -> str:
        return f"{INSIDE}/certs"

    def container_name(self, name: str) -> str:
        return f"ftsync-{self.run_id}-{name}"

    def _address(self, name: str) -> str:
        """The fixed address of process `name` on the run's network."""
        if name not in self.addresses:
            assert self.network is not None
            subnet = ipaddress.ip_network(self.network.attrs["IPAM"]["Config"][0]["Subnet"])
            self.addresses[name] = str(subnet.network_address + 2 + len(self.addresses))
        return self.addresses[name]

    # -- containers ------------------------------------------------------------------

    def _create_network(self) -> None:
        taken = []
        for network in self.client.networks.list():
            for config in (network.attrs.get("IPAM") or {}).get("Config") or []:
                with contextlib.suppress(KeyError, ValueError):
                    taken.append(ipaddress.ip_network(config["Subnet"]))
        with open("/proc/net/route") as table:
            for line in table.readlines()[1:]:
                fields = line.split()
                destination, mask = (ipaddress.IPv4Address(bytes.fromhex(fields[i])[::-1])
                                     for i in (1, 7))
                if int(mask):
                    taken.append(ipaddress.ip_network(f"{destination}/{mask}", strict=False))
        candidates = random.Random(self.run_id).sample(_SUBNETS, 64)
        for candidate in candidates:
            subnet = ipaddress.ip_network(candidate)
            if any(subnet.overlaps(other) for other in taken):
                continue
            pool = docker.types.IPAMPool(subnet=candidate,
                                         gateway=str(subnet.network_address + 1))
            try:
                self.network = self.client.networks.create(
                    f"ftsync-{self.run_id}", driver="bridge", labels=self.labels,
                    ipam=docker.types.IPAMConfig(pool_configs=[pool]))
                # Every address fixed up front, so containers may start in parallel.
                adversaries = [a.target for a in schedule(self.experiment)
                               if a.fault.kind == "adversary" and not a.heal]
                for name in [*self.experiment.etcd.ids(), *self.coordinator_names,
                             *(f"proxy-{lid}" for lid in self.experiment.learners.ids()),
                             *self.experiment.learners.ids(), *adversaries]:
                    self._address(name)
                return
            except docker.errors.APIError as exc:
                if "overlap" not in str(exc).lower():
                    raise StartError(f"could not create the run's network: {exc}") from None
        raise StartError("no free /24 subnet in 10.210.0.0/12 for the run's network")

    def _run(self, name: str, command: list[str], *, ports: Iterable[int] = (),
             environment: dict[str, str] | None = None) -> Container:
        """Create and start process `name` as a container on the run's network."""
        assert self.network is not None
        network = str(self.network.name)
        endpoint = self.client.api.create_endpoint_config(
            aliases=[name], ipv4_address=self._address(name))
        # Published on loopback only, on a port the engine picks.
        published: dict[str, Any] = {f"{port}/tcp": ("127.0.0.1", None) for port in ports}
        try:
            container: Container = self.client.containers.run(
                self.image, command, name=self.container_name(name), hostname=name,
                detach=True, labels=self.labels, network=network,
                networking_config={network: endpoint}, ports=published,
                volumes={str(self.out.resolve()): {"bind": INSIDE, "mode": "rw"}},
                environment={"PYTHONUNBUFFERED": "1", **(environment or {})},
                working_dir=INSIDE, init=True)
        except docker.errors.ImageNotFound:
            raise StartError(f"image {self.image} not found: build it with "
                             f"deploy/docker/build --tag {self.image}") from None
        return container

    @staticmethod
    def _published(container: Container, port: int) -> str:
        container.reload()
        bound = (container.ports or {}).get(f"{port}/tcp") or []
        return f"127.0.0.1:{bound[0]['HostPort']}" if bound else ""

    @staticmethod
    def _pid(container: Container) -> int | None:
        container.reload()
        pid = int(container.attrs["State"].get("Pid") or 0)
        return pid or None

    def _last_words(self, container: Container) -> str:
        with contextlib.suppress(docker.errors.APIError):
            lines = [line for line in container.logs(tail=20).decode(
                errors="replace").splitlines() if line.strip()]
            return lines[-1] if lines else "(no output)"
        return "(no logs)"

    # -- start -------------------------------------------------------------------------

    def start(self) -> None:
        try:
            self.client.images.get(self.image)
        except docker.errors.ImageNotFound:
            raise StartError(f"image {self.image} not found: build it with "
                             f"deploy/docker/build --tag {self.image}") from None
        self._create_network()
        if self.experiment.etcd.members:
            self._start_etcd()
        for name in self.coordinator_names:
            self.coordinators.append(CoordinatorContainer(
                name, self._run(name, self._coordinator_command(name), ports=[GRPC_PORT]),
                self.admin_tls, self.admin_token))
        for coordinator in self.coordinators:
            self._await_listening(coordinator)
            self._record_start("replica" if self.experiment.highly_available else "coordinator",
                               coordinator.name, pid=self._pid(coordinator.container))
        if self.experiment.highly_available:
            try:
                index, epoch = self.leader(timeout=_START_TIMEOUT_S)
            except TimeoutError:
                raise StartError(f"no coordinator replica became leader within "
                                 f"{_START_TIMEOUT_S:g} s: {roles(self.coordinators)}") from None
            self.events.emit("leader", replica=f"r{index}", epoch=epoch)
        self.coordinator_up = True
        # Containers start in parallel: each takes a second or more on a busy machine.
        with ThreadPoolExecutor(max_workers=len(self.learners)) as pool:
            if self.experiment.proxy:
                list(pool.map(self._start_proxy, self.learners))
            steps = self.experiment.learners.steps
            list(pool.map(lambda slot: self.start_learner(slot, steps), self.learners))
        self._await_joined()

    def _await_joined(self) -> None:
        """Until every learner has joined (or exited): the fault schedule starts then,
        since starting containers takes longer than starting processes, and varies."""
        tails = {slot.learner_id: Tail(slot.log) for slot in self.learners}
        deadline = time.monotonic() + 2 * _START_TIMEOUT_S
        while tails and time.monotonic() < deadline:
            for slot in self.learners:
                tail = tails.get(slot.learner_id)
                if tail is not None and (not slot.running or any(
                        e["kind"] == "join" for e in tail.read())):
                    del tails[slot.learner_id]
            time.sleep(0.1)
        self.events.emit("topology_ready", waiting_for=sorted(tails))

    def _etcd_command(self, name: str) -> list[str]:
        members = self.experiment.etcd.ids()
        scheme = "https" if self.experiment.tls else "http"
        command = [
            "etcd", "--name", name, "--data-dir", "/var/lib/ftsync/etcd",
            "--listen-client-urls", f"{scheme}://0.0.0.0:{ETCD_PORT}",
            "--advertise-client-urls", f"{scheme}://{name}:{ETCD_PORT}",
            "--listen-peer-urls", f"http://0.0.0.0:{ETCD_PEER_PORT}",
            "--initial-advertise-peer-urls", f"http://{name}:{ETCD_PEER_PORT}",
            "--initial-cluster", ",".join(f"{m}=http://{m}:{ETCD_PEER_PORT}" for m in members),
            "--initial-cluster-state", "new", "--initial-cluster-token", f"ftsync-{self.run_id}",
            "--log-level", "warn", "--unsafe-no-fsync"]
        if self.experiment.tls:
            inside = self.credentials("coordinator", inside=True)
            command += ["--cert-file", inside.cert, "--key-file", inside.key,
                        "--trusted-ca-file", inside.ca, "--client-cert-auth"]
        return command

    def _start_etcd(self) -> None:
        for name in self.experiment.etcd.ids():
            self.etcd[name] = self._run(name, self._etcd_command(name), ports=[ETCD_PORT])
        for name in self.etcd:
            self._await_etcd(name)
            self._record_start("etcd", name, pid=self._pid(self.etcd[name]))

    def _await_etcd(self, name: str) -> None:
        container = self.etcd[name]
        address = self._published(container, ETCD_PORT)
        probe = EtcdMember(name, self.out, client_port=int(address.rsplit(":", 1)[1]),
                           tls=self.credentials("coordinator") if self.experiment.tls else None)
        self.etcd_health[name] = probe
        self._await(container, f"etcd member {name}", probe.healthy, "become healthy")

    def _await(self, container: Container, name: str, ready: Callable[[], bool],
               what: str, hint: str = "") -> None:
        """Until `ready()`; `StartError` with the container's last line if it exits
        or the start timeout passes first."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not ready():
            container.reload()
            if container.status == "exited":
                raise StartError(f"{name} exited with {container.attrs['State']['ExitCode']}: "
                                 f"{self._last_words(container)}{hint}")
            if time.monotonic() > deadline:
                raise StartError(f"{name} did not {what} within {_START_TIMEOUT_S:g} s: "
                                 f"{self._last_words(container)}{hint}")
            time.sleep(0.1)

    def _coordinator_command(self, name: str) -> list[str]:
        command = ["ftsync-coordinator", "--listen", f"0.0.0.0:{GRPC_PORT}"]
        if not self.experiment.tls:
            command.append("--insecure")
        if self.experiment.highly_available:
            index = name.removeprefix("r")
            command += ["--state-dir", f"{INSIDE}/replica{index}",
                        "--event-log", f"{INSIDE}/replica{index}.events.jsonl",
                        "--etcd", ",".join(f"{m}:{ETCD_PORT}" for m in self.etcd),
                        "--replica-id", name, "--advertise", f"{name}:{GRPC_PORT}"]
        else:
            command += ["--state-dir", f"{INSIDE}/state",
                        "--event-log", f"{INSIDE}/coordinator.events.jsonl"]
        return command + self.coordinator_args

    def _await_listening(self, coordinator: CoordinatorContainer) -> None:
        """Until the coordinator logs one more `listening on` line; then its port."""
        container = coordinator.container
        starts = coordinator.starts

        def listening() -> bool:
            coordinator.starts = container.logs().decode(errors="replace").count("listening on")
            return coordinator.starts > starts

        self._await(container, coordinator.name, listening, "start listening")
        coordinator.address = self._published(container, GRPC_PORT)

    def _start_proxy(self, slot: Slot) -> None:
        name = f"proxy-{slot.learner_id}"
        spec = self.experiment.link_for(slot.learner_id)
        # Flags only for a link of the experiment's: images from before them still run.
        flags = [] if spec == proxy_control.LinkSpec() else [
            "--latency-ms", str(spec.latency_ms), "--bandwidth-bytes-s",
            str(spec.bandwidth_bytes_s)]
        container = self._run(name, [
            "python3", "-m", "chaos.proxy", "--listen", f"0.0.0.0:{PROXY_PORT}",
            "--upstream", f"coordinator:{GRPC_PORT}", "--control", f"0.0.0.0:{CONTROL_PORT}",
            *flags],
            ports=[CONTROL_PORT])
        self._await(container, name,
                    lambda: "proxy listening on" in container.logs().decode(errors="replace"),
                    "start listening", " (an image older than `python -m chaos.proxy`? "
                                       "rebuild it with deploy/docker/build)")
        link = ProxyContainer(container, self._published(container, CONTROL_PORT))
        self.proxies[slot.learner_id] = link
        slot.proxy = link

    def learner_address(self, slot: Slot) -> str:
        if slot.proxy is not None:
            return f"proxy-{slot.learner_id}:{PROXY_PORT}"
        if not self.experiment.highly_available:
            return f"coordinator:{GRPC_PORT}"
        if self.experiment.learners.discovery == "etcd":
            return (f"etcd://{','.join(f'{m}:{ETCD_PORT}' for m in self.etcd)}/"
                    f"{self.experiment.coordinator.run}")
        return ",".join(f"{c.name}:{GRPC_PORT}" for c in self.coordinators)

    def start_learner(self, slot: Slot, steps: int) -> None:
        peers = self.experiment.learners.peers
        args = self.learner_args(
            slot, steps, self.learner_address(slot), f"{INSIDE}/{slot.log.name}",
            serve_peers=f"0.0.0.0:{PEER_PORT}" if peers else "",
            peers=[f"{o.learner_id}:{PEER_PORT}" for o in self.learners if o is not slot])
        if peers and not self.experiment.tls:
            args.append("--insecure")  # peers served plaintext on the run's network
        with contextlib.suppress(docker.errors.NotFound):  # the killed one, before its restart
            self.client.containers.get(self.container_name(slot.learner_id)).remove(force=True)
        container = self._run(slot.learner_id, ["ftsync-learner", *args], environment={
            "OMP_NUM_THREADS": str(self.experiment.learners.threads)})
        handle = ContainerProcess(container, pid=self._pid(container))
        slot.process = handle
        slot.state = "running"
        self._record_start("learner", slot.learner_id, pid=handle.pid, container=container.name)
        self._reapply_cuts(slot.learner_id)
        follower = threading.Thread(target=self._follow, args=(slot, handle), daemon=True)
        follower.start()
        self._followers.append(follower)

    def _follow(self, slot: Slot, handle: ContainerProcess) -> None:
        """Track a learner's progress lines, keep its output in a file, and record
        its exit."""
        pending = b""
        with open(self.out / f"{slot.learner_id}.out", "a") as keep, \
                contextlib.suppress(docker.errors.APIError, OSError):
            for chunk in handle.container.logs(stream=True, follow=True):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace") + "\n"
                    keep.write(line)
                    slot.progress(line)
        code = handle.exit_code
        if code is None:
            try:
                code = int(handle.container.wait(timeout=60)["StatusCode"])
            except Exception:  # removed under us (the run is being torn down)
                code = -1
            handle.exit_code = code
        self._exited(slot, handle, code, pid=handle.pid, container=handle.container.name)

    # -- the backend's primitives -------------------------------------------------------

    def kill_learner(self, slot: Slot) -> None:
        assert slot.process is not None
        container = slot.process.container
        with contextlib.suppress(docker.errors.APIError):  # it exited by itself meanwhile
            container.kill()
        slot.process.exit_code = int(container.wait(timeout=30)["StatusCode"])

    def freeze(self, slot: Slot, frozen: bool) -> None:
        if slot.process is None or slot.process.exit_code is not None:
            return
        with contextlib.suppress(docker.errors.APIError):  # exited, or not paused
            if frozen:
                slot.process.container.pause()
            else:
                slot.process.container.unpause()

    def _restart(self, coordinator: CoordinatorContainer, role: str) -> None:
        coordinator.address = ""
        coordinator.container.start()
        self._reapply_cuts(coordinator.name)
        self._await_listening(coordinator)
        self._record_start(role, coordinator.name, pid=self._pid(coordinator.container))

    def kill_coordinator(self) -> None:
        container = self.coordinators[0].container
        container.kill()
        container.wait(timeout=30)

    def restart_coordinator(self) -> None:
        self._restart(self.coordinators[0], "coordinator")

    def coordinator_admin(self) -> Admin:
        return self.coordinators[0]

    def replica_admins(self) -> Sequence[Admin]:
        return self.coordinators if self.experiment.highly_available else []

    def replica_fault(self, kind: str, index: int, heal: bool) -> None:
        replica = self.coordinators[index]
        if kind == "kill_leader":
            if heal:
                self._restart(replica, "replica")
            else:
                replica.container.kill()
                replica.container.wait(timeout=30)
        elif kind == "pause_leader":
            if heal:
                replica.container.unpause()
            else:
                replica.container.pause()
        else:
            self._cut(("partition_leader_from_etcd", index),
                      [(replica.name, member) for member in self.etcd], heal)

    def coordinator_logs(self) -> list[Path]:
        if self.experiment.highly_available:
            return [self.out / f"replica{i}.events.jsonl" for i in range(len(self.coordinators))]
        return [self.out / "coordinator.events.jsonl"]

    def etcd_running(self, index: int) -> bool:
        container = self.etcd[f"m{index}"]
        container.reload()
        return bool(container.status in ("running", "paused"))

    def etcd_fault(self, index: int, heal: bool) -> str:
        name = f"m{index}"
        container = self.etcd[name]
        if not heal:
            container.kill()
            container.wait(timeout=30)
            return ""
        container.start()
        self._reapply_cuts(name)
        self._await_etcd(name)
        self._record_start("etcd", name, pid=self._pid(container))
        return "restarted on its data directory"

    def adversaries_running(self) -> bool:
        for container in self.adversaries:
            with contextlib.suppress(docker.errors.NotFound):  # removed: not running
                container.reload()
                if container.status in ("created", "running", "restarting"):
                    return True
        return False

    def start_adversary(self, name: str, kinds: list[str], duration_s: float) -> None:
        container = self._run(name, ["python3", "-m", "chaos.adversary", *self.adversary_args(
            name, f"coordinator:{GRPC_PORT}", kinds, duration_s,
            f"{INSIDE}/{name}.events.jsonl")])
        self.adversaries.append(container)
        self._record_start("adversary", name, pid=self._pid(container), container=container.name)

    # -- partitions ------------------------------------------------------------------------

    def _members(self, name: str) -> list[str]:
        """The containers a name of the experiment stands for."""
        if name == "etcd":
            return list(self.etcd)
        return [name]

    def _links(self, target: str, others: list[str]) -> list[tuple[str, str]]:
        """The container pairs to cut so that `target` reaches none of `others`: a
        learner behind a proxy reaches the coordinator through that proxy, so the
        learner is cut from its proxy."""
        pairs = []
        for other in others:
            pairs.append((target, other))
            learner = (target if other == "coordinator" else
                       other if target == "coordinator" else "")
            if learner in self.proxies:
                pairs.append((learner, f"proxy-{learner}"))
        return pairs

    def partition(self, target: str, cut_from: list[str], heal: bool,
                  occurrence: tuple[int, int]) -> str:
        if not cut_from:
            return self._isolate(target, heal)
        others = [m for name in cut_from for m in self._members(name)]
        self._cut(occurrence, self._links(target, others), heal)
        return "" if heal else f"cut from {', '.join(others)}"

    def partition_learner(self, slot: Slot, heal: bool) -> None:
        if slot.proxy is not None:
            super().partition_learner(slot, heal)
            return
        # Cut off from the synchronizer: every replica and the etcd it finds them in.
        others = [c.name for c in self.coordinators] + list(self.etcd)
        self._cut(("partition_learner", slot.learner_id),
                  self._links(slot.learner_id, others), heal)

    def _isolate(self, name: str, heal: bool) -> str:
        """Disconnect a container from the run's network, or connect it again at its
        address and name."""
        assert self.network is not None
        container = self.client.containers.get(self.container_name(name))
        if heal:
            self.network.connect(container, ipv4_address=self._address(name), aliases=[name])
            for coordinator in self.coordinators:
                if coordinator.name == name:  # its published port is mapped anew
                    coordinator.address = self._published(container, GRPC_PORT)
            return ""
        self.network.disconnect(container, force=True)
        return "disconnected from the run's network"

    def _cut(self, key: tuple[Any, ...], pairs: list[tuple[str, str]], heal: bool) -> None:
        if heal:
            cut = self._cuts.pop(key, None)
            if cut is not None:
                self._routes("del", cut.pairs)
            return
        self._cuts[key] = _Cut(pairs)
        self._routes("add", pairs)

    def _reapply_cuts(self, name: str) -> None:
        """A restarted container has a new network namespace: give it the routes of
        the cuts still open on it."""
        pairs = [p for cut in self._cuts.values() for p in cut.pairs if name in p]
        if pairs:
            self._routes("add", pairs, only=name)

    def _routes(self, action: str, pairs: list[tuple[str, str]], only: str = "") -> None:
        """Add or delete the unreachable routes of `pairs`, on both sides of each
        (or only in container `only`), one helper container per side, in parallel."""
        per_side: dict[str, list[str]] = {}
        for a, b in pairs:
            for here, there in ((a, b), (b, a)):
                if not only or here == only:
                    per_side.setdefault(here, []).append(self._address(there))
        threads = [threading.Thread(target=self._route_helper, args=(name, action, addresses))
                   for name, addresses in per_side.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _route_helper(self, name: str, action: str, addresses: list[str]) -> None:
        try:
            target = self.client.containers.get(self.container_name(name))
            target.reload()
            if target.status not in ("running", "paused"):
                return  # down: its restart gets the routes (_reapply_cuts)
            helper = self.client.containers.run(
                self.image, ["python3", "-c", _ROUTES_SOURCE, action, *addresses],
                detach=True, labels=self.labels, network_mode=f"container:{target.id}",
                cap_add=["NET_ADMIN"], user="root")
            code = int(helper.wait(timeout=60)["StatusCode"])
            said = helper.logs().decode(errors="replace").strip()
            helper.remove(force=True)
            if code != 0:
                self.events.emit("fault_note", target=name,
                                 note=f"routes {action} failed: {said}")
        except docker.errors.APIError as exc:
            self.events.emit("fault_note", target=name, note=f"routes {action} failed: {exc}")

    # -- the end -------------------------------------------------------------------------

    def stop_all(self, grace_s: float = 60.0) -> None:
        try:
            self._stop_politely(grace_s)
        finally:
            self.remove_all()

    def _stop_politely(self, grace_s: float) -> None:
        if self.network is None:
            return
        learners = [s.process.container for s in self.learners
                    if s.process is not None and s.process.exit_code is None]
        for container in learners + self.adversaries:
            with contextlib.suppress(docker.errors.APIError):
                container.reload()
                if container.status == "paused":
                    container.unpause()
                if container.status in ("running", "paused"):
                    container.kill(signal="SIGTERM")
        deadline = time.monotonic() + grace_s
        for container in learners + self.adversaries:
            with contextlib.suppress(Exception):
                container.wait(timeout=max(deadline - time.monotonic(), 1))
        for follower in self._followers:
            follower.join(timeout=10)
        coordinators = self.coordinators
        if not self.experiment.highly_available and coordinators and not self.coordinator_up:
            with contextlib.suppress(Exception):
                self._restart(coordinators[0], "coordinator")  # so its state is read cleanly
        # Standbys first, so that none takes over from a leader shutting down.
        found = roles(coordinators)
        for index in sorted(range(len(coordinators)), key=lambda i: found[i][0] == "leader"):
            with contextlib.suppress(docker.errors.APIError):
                container = coordinators[index].container
                container.reload()
                if container.status == "paused":
                    container.unpause()
                container.stop(timeout=15)
        self.coordinator_up = False
        for container in self.etcd.values():
            with contextlib.suppress(docker.errors.APIError):
                container.stop(timeout=10)

    def remove_all(self) -> None:
        """Remove every container, network and volume labelled with this run; safe to
        call more than once, and from atexit."""
        if self._removed:
            return
        label: dict[str, Any] = {"label": f"{RUN_LABEL}={self.run_id}"}
        with contextlib.suppress(docker.errors.DockerException):
            for container in self.client.containers.list(all=True, filters=label):
                with contextlib.suppress(docker.errors.NotFound):
                    container.remove(force=True)
            for network in self.client.networks.list(filters=label):
                with contextlib.suppress(docker.errors.NotFound):
                    network.remove()
            for volume in self.client.volumes.list(filters=label):
                with contextlib.suppress(docker.errors.NotFound):
                    volume.remove(force=True)
            self._removed = not leftovers(self.client, f"{RUN_LABEL}={self.run_id}")
        if self._removed:
            atexit.unregister(self.remove_all)
