"""Draining in the pure policy core (`Policy.drain`): what Admin.Drain asks of it.

A draining policy opens no new round, lets an open round take contributions
until it closes, closes every round with quorum at once instead of waiting
out its grace window, and leaves a round short of quorum open (its learners
push those contributions again to the next leader).
"""

from __future__ import annotations

import pytest

from coordinator.errors import Reason, Rejected
from coordinator.policy import Offer, Policy, PolicyConfig
from tests.unit.test_policy import contribute, make_offer, snapshot, three_learners


def refusal(policy: Policy, offer: Offer, now: float) -> Rejected:
    with pytest.raises(Rejected) as info:
        policy.admit(offer, now)
    return info.value


def test_a_draining_policy_refuses_to_open_a_round_and_changes_nothing() -> None:
    policy = three_learners(PolicyConfig(), versions={0: 0, 1: 0})
    policy.drain()
    before = snapshot(policy, 1.0)
    refused = refusal(policy, make_offer("a", fragment=1, seq=1), 1.0)
    assert refused.reason is Reason.DRAINING
    assert "fragment 1" in refused.message and "next leader" in refused.message
    assert snapshot(policy, 1.0) == before


def test_an_invalid_contribution_is_refused_for_what_it_is_not_as_draining() -> None:
    policy = three_learners(PolicyConfig(max_staleness=1), versions={0: 5})
    policy.drain()
    assert refusal(policy, make_offer("a", seq=1, base=2), 1.0).reason is Reason.STALE


def test_a_round_with_quorum_closes_at_once_without_its_grace_window() -> None:
    policy = three_learners(PolicyConfig(min_quorum=1, grace_max_s=30.0))
    contribute(policy, 1.0, "a", seq=1)
    assert policy.due(1.0) == []  # b and c are live: the grace window runs
    policy.drain()
    assert policy.open_rounds() == [0]
    assert policy.due(1.0) == [0]
    closed = policy.close(0, 1.0)
    assert [c.id.learner_id for c in closed.manifest] == ["a"]
    assert closed.why == "draining"
    assert policy.open_rounds() == []
    # The next contribution would open a new round.
    assert refusal(policy, make_offer("b", seq=1, base=1), 1.5).reason is Reason.DRAINING


def test_an_open_round_short_of_quorum_still_takes_contributions_until_it_closes() -> None:
    policy = three_learners(PolicyConfig(min_quorum=2, grace_max_s=30.0))
    contribute(policy, 1.0, "a", seq=1)
    policy.drain()
    assert policy.due(1e6) == []  # draining never waives the quorum
    contribute(policy, 2.0, "b", seq=1)
    assert policy.due(2.0) == [0]
    closed = policy.close(0, 2.0)
    assert {c.id.learner_id for c in closed.manifest} == {"a", "b"}
    assert policy.open_rounds() == []


def test_an_abandoned_drain_takes_rounds_again_with_their_grace_windows() -> None:
    policy = three_learners(PolicyConfig(min_quorum=1, grace_max_s=30.0))
    policy.drain()
    policy.drain(False)
    contribute(policy, 1.0, "a", seq=1)
    assert policy.due(1.0) == [] and policy.due(31.0) == [0]
