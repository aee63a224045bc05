"""Where a highly available run keeps its state in etcd, for both sides.

Coordinator replicas write these keys (`coordinator.etcd`, the election and
the replicator); learners given `etcd://HOST:PORT[,HOST:PORT]/RUN` read the
leader key to find the replica that leads. One prefix per run:

    /ftsync/<run>/leader          {"replica", "address", "epoch"}, under the leader's lease
    /ftsync/<run>/replicas/<id>   {"replica", "address", "zero_momentum"}, under each
                                  replica's lease
    /ftsync/<run>/insync          {"epoch", "replicas"}: who may take over (sync replication)
    /ftsync/<run>/config          {"run_id", "layout_hash", "numels"}: the run's layout
    /ftsync/<run>/learners/<id>   {"lease"}, under the learner's membership lease
"""

from __future__ import annotations

import json
from dataclasses import dataclass


def prefix(run: str) -> str:
    return f"/ftsync/{run}/"


def leader_key(run: str) -> bytes:
    return f"{prefix(run)}leader".encode()


def replicas_prefix(run: str) -> bytes:
    return f"{prefix(run)}replicas/".encode()


def insync_key(run: str) -> bytes:
    return f"{prefix(run)}insync".encode()


def config_key(run: str) -> bytes:
    return f"{prefix(run)}config".encode()


def learners_prefix(run: str) -> bytes:
    return f"{prefix(run)}learners/".encode()


@dataclass(frozen=True)
class LeaderRecord:
    """The value of the leader key: who leads, where, since which epoch."""

    replica: str
    address: str
    epoch: int

    def encode(self) -> bytes:
        return json.dumps({"replica": self.replica, "address": self.address,
                           "epoch": self.epoch}).encode()

    @classmethod
    def decode(cls, value: bytes, create_revision: int) -> LeaderRecord:
        """The epoch is the key's create revision, which the value may not know yet."""
        try:
            data = json.loads(value)
            return cls(str(data["replica"]), str(data["address"]), create_revision)
        except (ValueError, KeyError, TypeError):
            return cls("", "", create_revision)


@dataclass(frozen=True)
class ReplicaRecord:
    """The value of a replica's key: who it is, where, and what replication streams
    it reads. `zero_momentum`: a version with all-zero momentum may come without it
    (`ReplicaHeader.zero_momentum`); a replica of a build before that writes no such
    field, and the leader keeps sending it the whole record."""

    replica: str
    address: str
    zero_momentum: bool = True

    def encode(self) -> bytes:
        return json.dumps({"replica": self.replica, "address": self.address,
                           "zero_momentum": self.zero_momentum}).encode()

    @classmethod
    def decode(cls, value: bytes) -> ReplicaRecord | None:
        """None for a value that is not a replica's record."""
        try:
            data = json.loads(value)
            return cls(str(data["replica"]), str(data["address"]),
                       data.get("zero_momentum") is True)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def parse_etcd_url(url: str) -> tuple[list[str], str]:
    """`etcd://HOST:PORT[,HOST:PORT...][/RUN]` into (endpoints, run)."""
    rest = url.removeprefix("etcd://")
    hosts, _, run = rest.partition("/")
    endpoints = [h.strip() for h in hosts.split(",") if h.strip()]
    if not endpoints:
        raise ValueError(f"{url!r} names no etcd endpoint")
    return endpoints, run.strip("/") or "default"
