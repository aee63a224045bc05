"""Coordinator failover on local processes: replicas, steady learners, and the audit.

`ReplicaSet` runs the coordinator replicas of one highly available run as
local processes against an etcd cluster, each with its own port (kept across
restarts), state directory and event log, and finds, kills, pauses and
restarts the leader. `steady_learner` is an in-process learner that pushes
small contributions as fast as they are acknowledged, and `drain` waits
until a learner's outbox is empty. `audit` judges a run afterwards from the
files alone (the Jepsen split: history, then checker):

- the published history is, per fragment and version, the manifest of the
  newest epoch found in any replica's manifest log (`read_manifests`; an
  older epoch's record of the same version was written by a deposed leader
  and never published);
- split brain: a fragment version committed (a `commit` event) under two epochs;
- doubled: a contribution id in two versions of that history;
- lost: a contribution a learner saw acknowledged or settled as merged that
  is neither in the history nor dropped with a reason.

`first_commit_after` finds when a new epoch first committed, to measure a
failover from the kill. Used by the high-availability tests and
`bench/recovery.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
import numpy as np

from chaos.checkers import CheckResult
from chaos.local import CoordinatorProcess
from coordinator.durability import read_manifests
from learner.client import Refused, SynchronizerClient
from protos import ftsync_pb2 as pb
from protos.tls import TlsConfig

Contribution = tuple[str, int, int]  # (learner, fragment, seq)


@dataclass
class ReplicaSet:
    """`count` coordinator replicas of one run, as local processes."""

    root: Path
    etcd: list[str]
    count: int = 2
    args: list[str] = field(default_factory=list)
    # Per replica, the endpoints it reaches etcd at (its own fault proxies);
    # empty: every replica uses `etcd`.
    replica_etcd: list[list[str]] = field(default_factory=list)
    replicas: list[CoordinatorProcess] = field(default_factory=list)
    admin_token: str = ""
    # An operator's TLS settings, for replicas serving TLS.
    admin_tls: TlsConfig | None = None
    _tails: dict[Path, Tail] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.replicas = [
            CoordinatorProcess(state_dir=self.root / f"replica{i}", args=[
                "--etcd", ",".join(self.replica_etcd[i] if self.replica_etcd else self.etcd),
                "--replica-id", f"r{i}", "--event-log", str(self.event_log(i)), *self.args],
                admin_token=self.admin_token, admin_tls=self.admin_tls)
            for i in range(self.count)]

    def start(self) -> ReplicaSet:
        for replica in self.replicas:
            replica.start()
        return self

    def stop(self) -> None:
        """Standbys first, so that none takes over from a leader shutting down."""
        roles = self.roles()
        for index in sorted(range(self.count), key=lambda i: roles[i][0] == "leader"):
            self.replicas[index].stop()

    @property
    def addresses(self) -> str:
        """The comma-separated list learners are given."""
        return ",".join(r.address for r in self.replicas)

    def event_log(self, index: int) -> Path:
        return self.root / f"replica{index}.events.jsonl"

    def events(self, index: int) -> list[dict[str, Any]]:
        """Every event replica `index` logged so far (read incrementally)."""
        path = self.event_log(index)
        tail = self._tails.setdefault(path, Tail(path))
        return tail.read()

    def commits(self, index: int, epoch_above: int = 0,
                after_t: float = 0.0) -> list[dict[str, Any]]:
        return [e for e in self.events(index) if e["kind"] == "commit"
                and e.get("epoch", 0) > epoch_above and e["t"] >= after_t]

    def state_dirs(self) -> list[Path]:
        return [r.state_dir for r in self.replicas]

    def roles(self) -> list[tuple[str, int]]:
        """(role, epoch) of each replica; ("down", 0) for one that does not answer."""
        return roles(self.replicas)

    def leader(self, timeout: float = 30.0, newer_than: int = 0) -> tuple[int, int]:
        """(index, epoch) of the leader, once one leads with an epoch above `newer_than`."""
        return find_leader(self.replicas, timeout, newer_than)

    def wait_in_sync(self, timeout: float = 30.0) -> None:
        """Until the leader has recorded every live replica as in sync."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            index, epoch = self.leader(timeout=deadline - time.monotonic())
            live = {f"r{i}" for i, r in enumerate(self.replicas)
                    if r.process is not None and r.process.poll() is None}
            insync = [e for e in self.events(index)
                      if e["kind"] == "insync" and e.get("epoch") == epoch]
            if insync and live <= set(insync[-1]["replicas"]):
                return
            time.sleep(0.05)
        raise TimeoutError(f"replicas not in sync within {timeout}s")


class Replica(Protocol):
    """A replica the harness asks for its Admin.Status: a local process or a container."""

    def status(self, timeout: float = ...) -> pb.StatusResponse: ...


def roles(replicas: Sequence[Replica]) -> list[tuple[str, int]]:
    """(role, epoch) of each replica; ("down", 0) for one that does not answer."""
    result = []
    for replica in replicas:
        try:
            status = replica.status(timeout=0.5)
            result.append((status.role, int(status.epoch)))
        except Exception:  # a dead or paused replica: anything grpc raises
            result.append(("down", 0))
    return result


def find_leader(replicas: Sequence[Replica], timeout: float = 30.0,
                newer_than: int = 0) -> tuple[int, int]:
    """(index, epoch) of the leader, once one leads with an epoch above `newer_than`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for index, (role, epoch) in enumerate(roles(replicas)):
            if role == "leader" and epoch > newer_than:
                return index, epoch
        time.sleep(0.05)
    raise TimeoutError(f"no leader above epoch {newer_than} within {timeout}s")


# -- learners ------------------------------------------------------------------------

async def steady_learner(client: SynchronizerClient, numels: list[int], stop: asyncio.Event,
                         pace_s: float = 0.02) -> int:
    """Join, offer initial values, then push small contributions until `stop`;
    returns the number of pushes."""
    await client.join()
    for fragment, numel in enumerate(numels):
        await client.push_initial(fragment, np.ones(numel, dtype=np.float32))
    step = 0

    async def heartbeats() -> None:
        # Beside the pushes, as in a real learner: it notices a leader change
        # even while a push waits on a frozen replica.
        while not stop.is_set():
            with contextlib.suppress(Refused, grpc.RpcError):
                await client.heartbeat(step)
            await asyncio.sleep(0.25)

    beating = asyncio.create_task(heartbeats())
    try:
        while not stop.is_set():
            step += 1
            fragment = step % len(numels)
            base = max(client.versions.get(fragment, 0), 0)
            await client.push(fragment, np.full(numels[fragment], 1e-3, dtype=np.float32),
                              base_version=base, c_tokens=100, c_steps=10, local_step=step)
            await asyncio.sleep(pace_s)
    finally:
        stop.set()
        await beating
    return step


async def drain(client: SynchronizerClient, timeout: float = 30.0) -> None:
    """Heartbeat (and push again what is unacknowledged) until the outbox is empty."""
    deadline = time.monotonic() + timeout
    while client.outbox:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{client.learner_id} still has {len(client.outbox)} "
                               f"contributions outstanding after {timeout}s")
        await client.repush_unacknowledged()
        await client.heartbeat(0)
        await asyncio.sleep(0.1)


# -- the audit -------------------------------------------------------------------------

class Tail:
    """A growing JSONL event log, read from where the last read stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.events: list[dict[str, Any]] = []

    def read(self) -> list[dict[str, Any]]:
        if self.path.exists():
            with open(self.path, "rb") as log:
                log.seek(self.offset)
                data = log.read()
            complete = data.rfind(b"\n") + 1  # a line still being written waits
            self.offset += complete
            for line in data[:complete].splitlines():
                with contextlib.suppress(ValueError):
                    self.events.append(json.loads(line))
        return self.events


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return events


def published_history(state_dirs: list[Path]) -> dict[tuple[int, int], dict[str, Any]]:
    """Per (fragment, version), the manifest record of the newest epoch."""
    history: dict[tuple[int, int], dict[str, Any]] = {}
    for state_dir in state_dirs:
        for record in read_manifests(state_dir):
            key = (int(record["fragment"]), int(record["version"]))
            if key not in history or record.get("epoch", 0) > history[key].get("epoch", 0):
                history[key] = record
    return history


@dataclass
class Audit:
    merged: int
    doubled: list[Contribution]
    lost: list[Contribution]
    split_brain: list[tuple[int, int]]
    # Published versions whose record the final history replaced.
    overwritten: list[tuple[int, int, int]]

    @property
    def lost_or_doubled(self) -> int:
        return len(self.lost) + len(self.doubled)

    @property
    def ok(self) -> bool:
        return not (self.doubled or self.lost or self.split_brain or self.overwritten)


def audit(state_dirs: list[Path], coordinator_logs: list[Path],
          learner_logs: list[Path]) -> Audit:
    history = published_history(state_dirs)
    counts: Counter[Contribution] = Counter()
    for record in history.values():
        for item in record["manifest"]:
            counts[(str(item["learner"]), int(record["fragment"]), int(item["seq"]))] += 1
    commits = [e for path in coordinator_logs for e in read_events(path)
               if e["kind"] == "commit"]
    epochs: dict[tuple[int, int], set[int]] = {}
    for commit in commits:
        epochs.setdefault((commit["fragment"], commit["version"]), set()).add(
            commit.get("epoch", 0))
    split_brain = sorted(key for key, seen in epochs.items() if len(seen) > 1)
    overwritten = sorted((c["fragment"], c["version"], c.get("epoch", 0)) for c in commits
                         if history.get((c["fragment"], c["version"]), {}).get("epoch", 0)
                         != c.get("epoch", 0))
    claimed: set[Contribution] = set()
    dropped: set[Contribution] = set()
    for path in learner_logs:
        for event in read_events(path):
            contribution = (str(event.get("learner")), int(event.get("fragment", -1)),
                            int(event.get("seq", -1)))
            if event["kind"] in ("push_ack", "merged"):
                claimed.add(contribution)
            elif event["kind"] == "dropped":
                dropped.add(contribution)
    lost = sorted(claimed - set(counts) - dropped)
    doubled = sorted(c for c, n in counts.items() if n > 1)
    return Audit(merged=len(counts), doubled=doubled, lost=lost, split_brain=split_brain,
                 overwritten=overwritten)


def audit_check(root: Path, replicas: int, learner_logs: list[Path]) -> CheckResult:
    """The audit of a chaos run's replicas (`replicaI/` and `replicaI.events.jsonl`
    under `root`) as a check: exactly-once against the published history."""
    logs = [root / f"replica{i}.events.jsonl" for i in range(replicas)]
    missing = [str(log) for log in logs if not log.exists()]
    if missing:
        return CheckResult("exactly_once_replicas", False,
                           f"no event log from replica(s): {', '.join(missing)}")
    result = audit([root / f"replica{i}" for i in range(replicas)], logs, learner_logs)
    details: dict[str, Any] = {
        "merged": result.merged, "lost": [list(c) for c in result.lost[:50]],
        "doubled": [list(c) for c in result.doubled[:50]],
        "split_brain": [list(k) for k in result.split_brain[:50]],
        "overwritten": [list(k) for k in result.overwritten[:50]]}
    if result.ok:
        return CheckResult("exactly_once_replicas", True,
                           f"{result.merged} contributions in the published history, each "
                           f"once; none acknowledged and lost", [], details)
    problems = [f"{len(items)} {what} (first {items[0]})" for what, items in (
        ("lost", result.lost), ("doubled", result.doubled),
        ("split-brain versions", result.split_brain),
        ("published versions overwritten", result.overwritten)) if items]
    return CheckResult("exactly_once_replicas", False, "; ".join(problems), [], details)


def first_commit_after(logs: list[Path], epoch_above: int, after_t: float) -> float | None:
    """Wall-clock time of the first commit of an epoch above `epoch_above` after `after_t`."""
    times = [e["t"] for path in logs for e in read_events(path)
             if e["kind"] == "commit" and e.get("epoch", 0) > epoch_above and e["t"] >= after_t]
    return min(times, default=None)
