"""Who is live: the interface the policy asks, and the embedded heartbeat table.

The policy counts a learner towards quorum and early round closes only while
its membership holds. Two implementations decide that: `HeartbeatTable`
here (the embedded default: a learner is live while it was heard from within
`heartbeat_timeout_s`, pure and driven by the time the shell passes in) and
`coordinator.etcd_membership.EtcdMembership` (a learner is live while its
lease key exists in etcd, so liveness survives a change of leader). The
shells tell the membership whenever a learner is heard from (join,
heartbeat, contribution) or leaves; neither call does I/O.
"""

from __future__ import annotations

import abc


class Membership(abc.ABC):
    """Liveness of learners; `now` is the caller's clock."""

    @abc.abstractmethod
    def renew(self, learner_id: str, now: float) -> None:
        """The learner was heard from at `now` (join, heartbeat or contribution)."""

    @abc.abstractmethod
    def drop(self, learner_id: str) -> None:
        """The learner left; it is not live until it renews again."""

    @abc.abstractmethod
    def is_live(self, learner_id: str, now: float) -> bool:
        """Whether the learner counts as live at `now`."""


class HeartbeatTable(Membership):
    """The embedded membership: live while heard from within the timeout."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last_seen: dict[str, float] = {}

    def renew(self, learner_id: str, now: float) -> None:
        self._last_seen[learner_id] = now

    def drop(self, learner_id: str) -> None:
        self._last_seen.pop(learner_id, None)

    def is_live(self, learner_id: str, now: float) -> bool:
        seen = self._last_seen.get(learner_id)
        return seen is not None and now - seen <= self.timeout_s
