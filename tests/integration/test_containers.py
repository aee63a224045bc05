"""The image and the compose deployment, for real: containers on networks of the
test's own, learners joining coordinators over them, faults through docker.

Traffic stays inside the test's docker networks; the host looks in with
`docker exec` and `docker-compose exec`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator

import pytest

from tests.docker import ROOT, docker, wait_for

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

COMPOSE = ROOT / "deploy" / "compose"


# Admin.Status asked from inside a coordinator's container: the admin token (plaintext
# compose) or the admin certificate (the TLS overlay) in argv.
STATUS = """\
import json, sys
from google.protobuf.json_format import MessageToDict
from protos import ftsync_pb2 as pb, ftsync_pb2_grpc as g, tls
token, *files = sys.argv[1:]
credentials = tls.load(tls.TlsConfig(*files)) if files else None
metadata = [("authorization", f"Bearer {token}")] if token else None
with tls.channel("127.0.0.1:50051", credentials) as channel:
    reply = g.AdminStub(channel).Status(pb.StatusRequest(), timeout=5, metadata=metadata)
print(json.dumps(MessageToDict(reply)))
"""
CERTS = "/etc/ftsync/certs"
ADMIN_FILES = [f"{CERTS}/admin.pem", f"{CERTS}/admin.key", f"{CERTS}/ca.pem"]


def status(container: str, token: str = "", files: tuple[str, ...] = ()) -> dict[str, object]:
    result: dict[str, object] = json.loads(
        docker("exec", container, "python3", "-c", STATUS, token, *files))
    return result


def merged(container: str, token: str = "", files: tuple[str, ...] = ()) -> int:
    """Contributions merged so far; 0 while the coordinator does not answer."""
    if not container:
        return 0
    try:
        fragments = status(container, token, files).get("fragments", [])
    except AssertionError:
        return 0
    assert isinstance(fragments, list)
    return sum(int(f.get("mergedContributions", 0)) for f in fragments)


def test_the_image_runs_every_console_script_as_a_non_root_user(image: str) -> None:
    assert docker("run", "--rm", image, "id", "-u").strip() == "10001"
    for script in ("ftsync-coordinator", "ftsync-learner", "ftsync-chaos"):
        assert "usage" in docker("run", "--rm", image, script, "--help")
    config = json.loads(docker("image", "inspect", image))[0]["Config"]
    assert "PYTHONUNBUFFERED=1" in config["Env"]
    assert config["Healthcheck"]["Test"][1:4] == ["ftsync-coordinator", "health", "--address"]


def test_a_learner_container_joins_a_coordinator_container_and_is_merged(
        image: str, network: str) -> None:
    coordinator = f"{network}-coordinator"
    docker("run", "-d", "--name", coordinator, "--network", network, "--network-alias",
           "coordinator", image, "ftsync-coordinator", "--listen", "0.0.0.0:50051",
           "--insecure", "--state-dir", "/var/lib/ftsync/state", "--min-quorum", "1")
    wait_for(lambda: "listening on" in logs(coordinator), 60,
             "the coordinator to listen")
    for i in range(2):
        docker("run", "-d", "--name", f"{network}-learner-{i}", "--network", network, image,
               "ftsync-learner", "--coordinator", "coordinator:50051", "--task", "synthetic",
               "--learner-id", f"learner-{i}", "--shard", str(i), "--num-shards", "2",
               "--steps", "20000", "--sync-every", "10", "--step-ms", "5")  # still running

    def contributions() -> dict[str, int]:
        learners = status(coordinator)["learners"]
        assert isinstance(learners, list)
        return {str(learner["learnerId"]): int(learner.get("contributions", 0))
                for learner in learners}

    # Each learner's own contributions: on a busy machine one container may start
    # seconds after the other, and the first alone reaches any total.
    wait_for(lambda: len(taken := contributions()) == 2 and min(taken.values()) >= 4
             and merged(coordinator) >= 8, 120, "contributions of both learners merged")
    assert set(contributions()) == {"learner-0", "learner-1"}
    # A plaintext coordinator on a container's address needs --insecure: one line, exit 1.
    refused = subprocess.run(["docker", "run", "--rm", "--network", network, image,
                              "ftsync-coordinator", "--listen", "0.0.0.0:50051"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "--insecure" in refused.stderr.strip().splitlines()[-1]


class Compose:
    """`docker-compose` on the shipped files, as a project of the test's own."""

    def __init__(self, project: str, files: list[str], env: dict[str, str]) -> None:
        self.project = project
        self.files = files
        self.env = {**os.environ, **env}

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        command = ["docker-compose", "--project-name", self.project]
        for file in self.files:
            command += ["--file", str(COMPOSE / file)]
        done = subprocess.run([*command, *args], capture_output=True, text=True,
                              timeout=timeout, env=self.env, cwd=COMPOSE)
        if check and done.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)} exited {done.returncode}: "
                                 f"{done.stderr[-3000:]}")
        return done.stdout + done.stderr

    def container(self, service: str, number: int = 1) -> str:
        return f"{self.project}_{service}_{number}"

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        return [*docker("ps", "-aq", "--filter", label).split(),
                *docker("volume", "ls", "-q", "--filter", label).split(),
                *docker("network", "ls", "-q", "--filter", label).split()]


@pytest.fixture
def compose_env(image: str) -> Iterator[dict[str, str]]:
    secrets = COMPOSE / "secrets" / "coordinator.toml"
    subprocess.run([str(COMPOSE / "make-secrets")], check=True, capture_output=True)
    assert secrets.exists()
    yield {"FTSYNC_IMAGE": image, "FTSYNC_TASK": "synthetic", "FTSYNC_STEPS": "20000",
           "FTSYNC_STEP_MS": "20",
           "FTSYNC_LEARNERS": "3", "FTSYNC_MIN_QUORUM": "1"}


def leader(compose: Compose, token: str, files: tuple[str, ...]) -> str:
    """The coordinator container that leads ("" while none does)."""
    for replica in ("coordinator-0", "coordinator-1"):
        try:
            if status(compose.container(replica), token, files).get("role") == "leader":
                return compose.container(replica)
        except AssertionError:
            continue
    return ""


def logs(container: str) -> str:
    """What the container wrote so far, stdout and stderr together."""
    done = subprocess.run(["docker", "logs", container], capture_output=True, text=True,
                          timeout=60)
    return done.stdout + done.stderr


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "mutual-tls"])
def test_compose_trains_with_scaled_learners_survives_a_learner_kill_and_leaves_nothing(
        compose_env: dict[str, str], tls: bool) -> None:
    compose = Compose(f"ftsynctest{'tls' if tls else ''}",
                      ["docker-compose.yml", *(["docker-compose.tls.yml"] if tls else [])],
                      compose_env)
    token = (COMPOSE / "secrets" / "admin-token").read_text().strip()
    files = tuple(ADMIN_FILES) if tls else ()
    learners = [compose.container("learner", n) for n in (1, 2, 3)]

    def lead() -> str:
        return leader(compose, token, files)

    try:
        compose("up", "-d", "--scale", "learner=3", timeout=600)
        # Container n is learner-(n-1), shard n-1: distinct ids and shards.
        wait_for(lambda: all("learner-slot:" in logs(c) for c in learners), 120, "slots")
        slots = [re.search(r"is (learner-\d) \(shard (\d) of 3\)", logs(c)) for c in learners]
        assert [(m.group(1), m.group(2)) if m else None for m in slots] == [
            ("learner-0", "0"), ("learner-1", "1"), ("learner-2", "2")]
        wait_for(lead, 120, "a leader")
        wait_for(lambda: merged(lead(), token, files) >= 30, 240,
                 "learners' contributions merged")
        tls_flags = [f"--tls-cert={files[0]}", f"--tls-key={files[1]}",
                     f"--tls-ca={files[2]}"] if tls else []
        shown = docker("exec", lead(), "ftsync-coordinator", "status", "--once",
                       f"--token={token}", *tls_flags)
        assert "learners 3/3 live" in shown, shown
        # A learner killed and started again joins as itself and is merged again.
        victim = learners[1]
        docker("kill", victim)
        before = merged(lead(), token, files)
        docker("start", victim)
        wait_for(lambda: logs(victim).count("learner-slot: ") >= 2, 120, "the restart")
        wait_for(lambda: merged(lead(), token, files) >= before + 10, 240,
                 "merges after the restart")
        known = status(lead(), token, files)["learners"]
        assert isinstance(known, list)
        assert {learner["learnerId"] for learner in known} == {
            "learner-0", "learner-1", "learner-2"}
    finally:
        compose("down", "--volumes", "--timeout", "5", check=False)
    assert compose.leftovers() == []
