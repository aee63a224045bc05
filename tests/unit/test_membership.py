"""Membership behind its interface: the embedded heartbeat table, and the policy
counting quorum and early closes from whatever membership it is given."""

from __future__ import annotations

from coordinator.membership import HeartbeatTable, Membership
from coordinator.policy import Offer, Policy, PolicyConfig
from protos.contribution import ContributionId


def test_heartbeat_table_is_live_within_the_timeout() -> None:
    table = HeartbeatTable(timeout_s=10.0)
    assert not table.is_live("a", 0.0)
    table.renew("a", 5.0)
    assert table.is_live("a", 15.0) and not table.is_live("a", 15.1)
    table.renew("a", 15.0)
    assert table.is_live("a", 20.0)
    table.drop("a")
    assert not table.is_live("a", 20.0)


class Listed(Membership):
    """Live is whoever the test says (as etcd keys would)."""

    def __init__(self) -> None:
        self.live: set[str] = set()

    def renew(self, learner_id: str, now: float) -> None:
        pass

    def drop(self, learner_id: str) -> None:
        self.live.discard(learner_id)

    def is_live(self, learner_id: str, now: float) -> bool:
        return learner_id in self.live


def test_policy_takes_liveness_from_its_membership() -> None:
    membership = Listed()
    policy = Policy(PolicyConfig(grace_max_s=60.0), {0: 0}, membership=membership)
    for learner in ("a", "b"):
        policy.join(learner, 0.0)
    membership.live = {"a", "b"}
    assert policy.live_learners(0.0) == {"a", "b"}
    offer = Offer(ContributionId("a", 0, 1), 0, c_tokens=10, c_steps=1, local_step=1)
    policy.accept(policy.admit(offer, 1.0), 1.0)
    # b is live and silent: the round waits for it (grace of 60 s)...
    assert policy.due(2.0) == []
    # ...until b's lease ends, far sooner than any heartbeat timeout would.
    membership.live = {"a"}
    assert policy.due(2.0) == [0]
    # Leaving drops the learner from the membership too.
    policy.leave("a")
    assert policy.live_learners(3.0) == frozenset()
