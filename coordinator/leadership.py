"""Whether this replica may lead, as the engine asks it: the part of high availability
the engine calls out to.

The engine (`coordinator.engine`) gets one in its constructor. `AlwaysLeader` is
the embedded coordinator's: it leads from the start and publishes each version
as soon as it is durable. `coordinator.ha.Replica` is the elected one: leading is
won on an etcd lease, a version is published only once `replicate` handed it to
the standbys and while `holds()`, and the engine tells it when it stepped down
by itself (`resign`) and when the first learner fixed the run (`run_created`).
What the election learns flows the other way, as calls on the engine
(`promote`, `demote`, `leader_seen`).
"""

from __future__ import annotations

import abc

from coordinator.durability import FragmentRecord, RunRecord


class Leadership(abc.ABC):
    """This replica's right to lead, and what leading owes the other replicas."""

    # Whether leading is won in an election: the replica starts as a standby, leads
    # once promoted, publishes through `replicate` and stamps commits with its epoch.
    elected: bool
    # Who this replica is, in events and Status, and where learners find it when it
    # leads ("" embedded).
    replica_id: str
    address: str

    @abc.abstractmethod
    def holds(self) -> bool:
        """Whether this replica may still act as the leader (its lease holds)."""

    @abc.abstractmethod
    async def replicate(self, record: FragmentRecord) -> None:
        """Hand a durable version to the standbys before it is published; `NotLeader`
        when this replica turns out to lead no longer."""

    @abc.abstractmethod
    def resign(self, reason: str) -> None:
        """The engine stepped down by itself (it could not publish safely)."""

    @abc.abstractmethod
    def run_created(self, run: RunRecord) -> None:
        """The first learner fixed the run's layout."""


class AlwaysLeader(Leadership):
    """The embedded coordinator: the only replica, so always the leader, with no
    standby to replicate to and no one to hand the run over to."""

    elected = False
    replica_id = ""
    address = ""

    def holds(self) -> bool:
        return True

    async def replicate(self, record: FragmentRecord) -> None:
        """Nothing to hand over: no standby exists."""

    def resign(self, reason: str) -> None:
        """Never asked: an embedded engine does not step down."""

    def run_created(self, run: RunRecord) -> None:
        """The state directory holds the run; no one else needs it."""
