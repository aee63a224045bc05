"""Tests of the synchronizer's pure policy core (`coordinator.policy`).

The policy reads no clock, so every test drives time by hand: example tests
pin down quorum, the grace window, weights, rejections, membership and sync
mode with numbers worked out on paper; the stateful hypothesis machine then
throws random joins, heartbeats, leaves, contributions, clock advances,
closes and restarts at it and checks the invariants of DESIGN.md §3 against
a small reference model after every step.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from coordinator.errors import Reason, Rejected
from coordinator.policy import (
    MAX_SEQ,
    SEQ_BLOCK,
    Admission,
    MergedContribution,
    Offer,
    Policy,
    PolicyConfig,
    RoundClose,
)
from protos.contribution import ContributionId
from protos.metadata import MERGED_SEQ

# -- helpers -----------------------------------------------------------------


def make_offer(learner: str, fragment: int = 0, seq: int = 1, base: int = 0,
               tokens: int = 100, steps: int = 10, local_step: int = 0) -> Offer:
    return Offer(id=ContributionId(learner_id=learner, fragment=fragment, seq=seq),
                 base_version=base, c_tokens=tokens, c_steps=steps, local_step=local_step)


def contribute(policy: Policy, now: float, learner: str, **kw: Any) -> Admission:
    """Admit and accept in one go, as the shell does when nothing races."""
    admission = policy.admit(make_offer(learner, **kw), now)
    policy.accept(admission, now)
    return admission


def snapshot(policy: Policy, now: float) -> dict[str, Any]:
    """Everything observable about the policy, to prove a refusal changed nothing."""
    return {
        "versions": {p: policy.version(p) for p in policy.fragments},
        "round_learners": {p: policy.round_learners(p) for p in policy.fragments},
        "round_timing": {p: policy.round_timing(p) for p in policy.fragments},
        "watermarks": {p: policy.watermarks(p) for p in policy.fragments},
        "due": policy.due(now),
        "due_later": policy.due(now + 1e6),
        "next_deadline": policy.next_deadline(),
        "live": policy.live_learners(now),
        "known": policy.known_learners(),
        "step_times": {lid: policy.step_time(lid) for lid in policy.known_learners()},
    }


def three_learners(config: PolicyConfig, versions: dict[int, int] | None = None,
                   now: float = 0.0) -> Policy:
    policy = Policy(config, versions=versions if versions is not None else {0: 0})
    for lid in ("a", "b", "c"):
        policy.join(lid, now)
    return policy


# -- quorum, early close and the grace window --------------------------------


def test_quorum_two_of_three_waits_for_the_grace_deadline() -> None:
    # No step-time estimate yet, so the grace window is grace_max.
    policy = three_learners(PolicyConfig(min_quorum=2, grace_max_s=4.0))
    contribute(policy, 1.0, "a", seq=1)
    assert policy.due(1.0) == []
    assert policy.due(100.0) == []  # below quorum nothing ever closes
    assert policy.next_deadline() is None
    assert policy.round_timing(0) == (1.0, None)

    contribute(policy, 2.0, "b", seq=1)
    assert policy.round_timing(0) == (1.0, 6.0)
    assert policy.next_deadline() == 6.0
    assert policy.due(2.0) == []
    assert policy.due(5.999) == []
    assert policy.due(6.0) == [0]

    closed = policy.close(0, 6.0)
    assert closed.fragment == 0
    assert closed.version == 1
    assert {c.id.learner_id for c in closed.manifest} == {"a", "b"}
    assert (closed.opened_at, closed.quorum_at, closed.closed_at) == (1.0, 2.0, 6.0)
    assert closed.grace_s == 4.0
    assert closed.why == "grace_ended"
    assert policy.version(0) == 1
    assert policy.round_learners(0) == frozenset()
    assert policy.watermarks(0) == {"a": 1, "b": 1}
    assert policy.next_deadline() is None
    assert policy.due(1e9) == []


def test_quorum_two_of_three_closes_early_when_the_third_contributes() -> None:
    policy = three_learners(PolicyConfig(min_quorum=2, grace_max_s=4.0))
    contribute(policy, 1.0, "a", seq=1)
    contribute(policy, 2.0, "b", seq=1)
    assert policy.due(3.0) == []
    contribute(policy, 3.0, "c", seq=1)
    assert policy.due(3.0) == [0]
    closed = policy.close(0, 3.0)
    assert closed.closed_at == 3.0
    assert closed.why == "all_live"
    assert {c.id.learner_id for c in closed.manifest} == {"a", "b", "c"}


def test_early_close_does_not_happen_below_quorum_even_if_everyone_live_contributed() -> None:
    policy = Policy(PolicyConfig(min_quorum=2), versions={0: 0})
    policy.join("a", 0.0)
    contribute(policy, 1.0, "a", seq=1)
    assert policy.live_learners(1.0) == {"a"}
    assert policy.due(1.0) == []
    assert policy.due(1e6) == []


def test_second_contribution_from_same_learner_does_not_make_quorum() -> None:
    policy = three_learners(PolicyConfig(min_quorum=2, grace_max_s=0.0))
    contribute(policy, 1.0, "a", seq=1)
    contribute(policy, 2.0, "a", seq=2)
    assert policy.round_learners(0) == {"a"}
    assert policy.due(1e6) == []
    contribute(policy, 3.0, "b", seq=1)
    assert policy.due(3.0) == [0]
    closed = policy.close(0, 3.0)
    assert len(closed.manifest) == 3
    assert closed.why == "no_grace"  # c is live and has not contributed


def test_a_second_push_against_the_same_base_replaces_the_first() -> None:
    """A learner's pushes into one open round against one base count once: the newer
    replaces the older, at the older's weight (the daemon folded the older's values at
    that weight, and the newer carries the progress since it, so together they are the
    learner's outer gradient since the base). Merged beside it at full weight, a lone
    learner's two pushes would each count half."""
    policy = three_learners(PolicyConfig(min_quorum=2, grace_max_s=0.0), versions={0: 3})
    first = contribute(policy, 1.0, "a", seq=1, base=3, tokens=100, steps=10)
    assert first.replaces is None and first.weight == pytest.approx(1000.0)
    second = contribute(policy, 2.0, "a", seq=2, base=3, tokens=400, steps=10)
    assert second.replaces == first.offer.id
    assert second.weight == first.weight  # not 400·40: the older's values are in at 1000
    assert second.target_version == first.target_version == 4
    # Against another base: the learner applied a version in between, so the push
    # holds none of the older one's progress and is merged beside it.
    beside = contribute(policy, 2.5, "a", seq=3, base=2, tokens=100, steps=10)
    assert beside.replaces is None and beside.staleness == 1
    contribute(policy, 3.0, "b", seq=1, base=3)
    closed = policy.close(0, 3.0)
    a1, a2, a3, b1 = closed.manifest
    assert (a1.id.seq, a1.weight, a1.replaced_by) == (1, 0.0, 2)
    assert (a2.id.seq, a2.weight, a2.replaced_by) == (2, pytest.approx(1000.0), None)
    assert a3.replaced_by is None and a3.weight == pytest.approx(1000.0 * 2 ** -0.5)
    assert closed.total_weight == pytest.approx(a2.weight + a3.weight + b1.weight)
    # Every id is in the manifest once, and the watermark covers the replaced one.
    assert policy.merged_seq(0, "a") == 3


def test_a_restarted_learner_s_push_is_merged_beside_its_previous_life_s() -> None:
    """Killed after its push was acknowledged into a round still open, a learner
    restarts, catches up to the same version and pushes against it: an outer gradient
    of its new life alone, holding none of the old push's progress. Replacing the old
    push would count the two at one weight, summed (twice the learner's step)."""
    policy = three_learners(PolicyConfig(min_quorum=2, grace_max_s=0.0), versions={0: 3})
    before = contribute(policy, 1.0, "a", seq=1, base=3, tokens=100, steps=10)
    first_seq = policy.join("a", 2.0)  # the restarted process
    assert first_seq == 2
    after = contribute(policy, 3.0, "a", seq=first_seq, base=3, tokens=100, steps=10)
    assert after.replaces is None and after.weight == pytest.approx(1000.0)
    # Within the new life, a second push does replace the first.
    again = contribute(policy, 3.5, "a", seq=3, base=3, tokens=200, steps=10)
    assert again.replaces == after.offer.id
    contribute(policy, 4.0, "b", seq=1, base=3)
    closed = policy.close(0, 4.0)
    weights = {c.id.seq: c.weight for c in closed.manifest if c.id.learner_id == "a"}
    assert weights == {1: before.weight, 2: 0.0, 3: after.weight}


def test_a_replacement_admitted_before_the_round_changed_is_admitted_again() -> None:
    policy = three_learners(PolicyConfig(min_quorum=3))
    stale = policy.admit(make_offer("a", seq=2), 0.0)  # nothing to replace yet
    contribute(policy, 0.0, "a", seq=1)
    with pytest.raises(ValueError, match="admit again"):
        policy.accept(stale, 0.0)
    assert policy.admit(make_offer("a", seq=2), 0.0).replaces == make_offer("a", seq=1).id


def test_a_replayed_refusal_carries_the_learners_merged_seq() -> None:
    """A client tells "held by the open round" (seq above it) from "merged" (at or
    below it) by the `ftsync-merged-seq` fact, not by the message's words."""
    policy = three_learners(PolicyConfig(min_quorum=1, grace_max_s=0.0))
    contribute(policy, 0.0, "a", seq=4)
    policy.close(0, 0.0)
    contribute(policy, 0.0, "a", seq=6, base=1)
    for seq in (6, 3):
        with pytest.raises(Rejected) as info:
            policy.admit(make_offer("a", seq=seq, base=1), 0.0)
        assert info.value.reason is Reason.REPLAYED
        assert info.value.facts == ((MERGED_SEQ, "4"),)


def _policy_with_known_step_times(config: PolicyConfig) -> Policy:
    """Learners a, b, c with overlap 4, 3, 5 and step times 2 s, 3 s, 1 s."""
    policy = Policy(config, versions={0: 0})
    for lid, overlap in (("a", 4), ("b", 3), ("c", 5)):
        policy.join(lid, 0.0, overlap_steps=overlap)
        policy.heartbeat(lid, 0.0, local_step=0)
    policy.heartbeat("a", 2.0, local_step=1)
    policy.heartbeat("b", 3.0, local_step=1)
    policy.heartbeat("c", 1.0, local_step=1)
    return policy


def test_step_time_estimates_come_from_heartbeats_and_are_smoothed() -> None:
    policy = _policy_with_known_step_times(PolicyConfig())
    assert policy.step_time("a") == 2.0
    assert policy.step_time("b") == 3.0
    assert policy.step_time("c") == 1.0
    # A later sample of 8 s over two steps: seconds and steps each smoothed (EWMA
    # 0.3), the step time their ratio.
    policy.heartbeat("a", 10.0, local_step=3)
    smoothed = (0.7 * 2.0 + 0.3 * 8.0) / (0.7 * 1 + 0.3 * 2)
    assert policy.step_time("a") == pytest.approx(smoothed)
    # No progress, no sample.
    policy.heartbeat("a", 50.0, local_step=3)
    assert policy.step_time("a") == pytest.approx(smoothed)
    assert policy.step_time("nobody") is None


def test_grace_formula_numerically() -> None:
    config = PolicyConfig(min_quorum=2, gamma=0.5, grace_max_s=100.0)
    policy = _policy_with_known_step_times(config)
    policy.record_sync_time(0, 0.5)
    # local_step=1 is no progress for a and b, so contributing adds no sample.
    contribute(policy, 4.0, "a", seq=1, local_step=1)
    contribute(policy, 5.0, "b", seq=1, local_step=1)
    # ξ_step = 3 (b, slowest live), τ = 3 (min overlap), ξ_quorum = 5 − 4,
    # ξ_sync = 0.5: grace = 0.5 · (3·3 − 1 − 0.5) = 3.75.
    expected = 0.5 * (3 * 3.0 - 1.0 - 0.5)
    assert expected == 3.75
    assert policy.round_timing(0) == (4.0, 5.0 + expected)
    assert policy.due(5.0 + expected - 1e-9) == []
    assert policy.due(5.0 + expected) == [0]
    closed = policy.close(0, 8.75)
    assert closed.grace_s == pytest.approx(expected)
    assert closed.quorum_at == 5.0


def test_grace_uses_smoothed_sync_time() -> None:
    config = PolicyConfig(min_quorum=2, gamma=0.5, grace_max_s=100.0)
    policy = _policy_with_known_step_times(config)
    policy.record_sync_time(0, 0.5)
    policy.record_sync_time(0, 1.5)  # EWMA: 0.7·0.5 + 0.3·1.5 = 0.8
    contribute(policy, 4.0, "a", seq=1, local_step=1)
    contribute(policy, 4.0, "b", seq=1, local_step=1)
    assert policy.round_timing(0)[1] == pytest.approx(4.0 + 0.5 * (9.0 - 0.0 - 0.8))


def test_grace_is_clamped_to_grace_max() -> None:
    config = PolicyConfig(min_quorum=2, gamma=0.5, grace_max_s=1.0)
    policy = _policy_with_known_step_times(config)
    contribute(policy, 4.0, "a", seq=1, local_step=1)
    contribute(policy, 4.0, "b", seq=1, local_step=1)
    assert policy.round_timing(0) == (4.0, 5.0)  # formula says 4.5, clamped to 1


def test_grace_is_clamped_at_zero_when_quorum_took_longer_than_the_budget() -> None:
    config = PolicyConfig(min_quorum=2, gamma=0.5, grace_max_s=100.0)
    policy = _policy_with_known_step_times(config)
    contribute(policy, 4.0, "a", seq=1, local_step=1)
    contribute(policy, 14.0, "b", seq=1, local_step=1)  # ξ_quorum = 10 > τ·ξ_step = 9
    assert policy.round_timing(0) == (4.0, 14.0)
    assert policy.due(14.0) == [0]


def test_grace_ignores_step_time_of_dead_learners() -> None:
    config = PolicyConfig(min_quorum=2, gamma=0.5, grace_max_s=100.0, heartbeat_timeout_s=5.0)
    policy = _policy_with_known_step_times(config)
    # Keep a and c alive; b (slowest, last seen at 3) is dead by 9.
    policy.heartbeat("c", 8.0, local_step=1)
    contribute(policy, 8.5, "a", seq=1, local_step=1)
    contribute(policy, 9.0, "c", seq=1, local_step=1)
    assert policy.live_learners(9.0) == {"a", "c"}
    # ξ_step = 2 (a), τ = 4 (min of a's 4, c's 5), ξ_quorum = 0.5.
    assert policy.round_timing(0)[1] == pytest.approx(9.0 + 0.5 * (4 * 2.0 - 0.5))


def test_unknown_step_time_gives_grace_max() -> None:
    policy = three_learners(PolicyConfig(min_quorum=2, gamma=0.5, grace_max_s=7.0))
    policy.record_sync_time(0, 0.1)
    contribute(policy, 1.0, "a", seq=1)
    contribute(policy, 1.5, "b", seq=1)
    assert policy.round_timing(0) == (1.0, 8.5)


def test_deadline_is_fixed_when_quorum_is_reached() -> None:
    policy = three_learners(PolicyConfig(min_quorum=1, grace_max_s=3.0))
    policy.join("d", 0.0)
    contribute(policy, 1.0, "a", seq=1)
    contribute(policy, 2.0, "b", seq=1)
    assert policy.round_timing(0) == (1.0, 4.0)


def test_next_deadline_is_the_earliest_over_fragments() -> None:
    policy = three_learners(PolicyConfig(min_quorum=1, grace_max_s=3.0),
                            versions={0: 0, 1: 0, 2: 0})
    contribute(policy, 2.0, "a", fragment=1, seq=1)
    contribute(policy, 1.0, "a", fragment=2, seq=2)
    assert policy.next_deadline() == 4.0
    assert policy.due(4.0) == [2]
    assert sorted(policy.due(5.0)) == [1, 2]


# -- weights ------------------------------------------------------------------


def test_weight_formula() -> None:
    policy = Policy(PolicyConfig(staleness_exponent=0.5), versions={0: 0})
    assert policy.weight(100, 10, 0) == pytest.approx(1000.0)
    assert policy.weight(100, 10, 3) == pytest.approx(1000.0 / 2.0)
    assert policy.weight(30, 4, 1) == pytest.approx(30 * 7.5 * 2 ** -0.5)
    cubic = Policy(PolicyConfig(staleness_exponent=2.0), versions={0: 0})
    assert cubic.weight(10, 1, 4) == pytest.approx(100.0 / 25.0)


def test_staleness_exponent_zero_disables_decay() -> None:
    policy = Policy(PolicyConfig(staleness_exponent=0.0), versions={0: 0})
    assert policy.weight(100, 10, 0) == policy.weight(100, 10, 8) == 1000.0


def test_admission_carries_weight_staleness_and_target_version() -> None:
    policy = three_learners(PolicyConfig(max_staleness=4), versions={0: 5})
    admission = policy.admit(make_offer("a", seq=1, base=2, tokens=100, steps=10), 0.0)
    assert admission.staleness == 3
    assert admission.target_version == 6
    assert admission.weight == pytest.approx(1000.0 * 4 ** -0.5)
    policy.accept(admission, 0.0)
    closed = policy.close(0, 100.0)
    assert closed.manifest == (MergedContribution(
        id=admission.offer.id, base_version=2, weight=admission.weight, staleness=3),)


def test_staleness_exactly_max_is_admitted() -> None:
    policy = three_learners(PolicyConfig(max_staleness=2), versions={0: 5})
    assert policy.admit(make_offer("a", base=3), 0.0).staleness == 2
    with pytest.raises(Rejected) as info:
        policy.admit(make_offer("a", base=2), 0.0)
    assert info.value.reason is Reason.STALE


# -- rejections -----------------------------------------------------------------


def _rejection_fixture() -> Policy:
    """Fragment 0 at version 2 with a in its open round (seq 5) and b's
    watermark at 3; fragment 1 without an initial value; 'gone' has left."""
    policy = Policy(PolicyConfig(min_quorum=2, max_staleness=1),
                    versions={0: 2, 1: -1}, merged_seq={0: {"b": 3}})
    for lid in ("a", "b", "c", "gone"):
        policy.join(lid, 0.0)
    policy.leave("gone")
    contribute(policy, 0.5, "a", seq=5, base=2)
    return policy


REJECTIONS = [
    # (offer, reason, substring of the message)
    (make_offer("zed", seq=1, base=2), Reason.UNKNOWN_LEARNER, "'zed'"),
    (make_offer("gone", seq=1, base=2), Reason.UNKNOWN_LEARNER, "left"),
    (make_offer("c", fragment=9, seq=1, base=2), Reason.UNKNOWN_FRAGMENT, "fragment 9"),
    (make_offer("c", fragment=1, seq=1, base=0), Reason.NOT_INITIALIZED, "no initial value"),
    (make_offer("c", seq=1, base=3), Reason.FUTURE_VERSION, "base version 3"),
    (make_offer("c", seq=1, base=-1), Reason.MALFORMED, "negative"),
    (make_offer("c", seq=1, base=0), Reason.STALE, "max_staleness 1"),
    (make_offer("a", seq=5, base=2), Reason.REPLAYED, "already in the open round"),
    (make_offer("a", seq=5, base=1), Reason.REPLAYED, "a/0/5"),
    (make_offer("b", seq=3, base=2), Reason.REPLAYED, "already merged"),
    (make_offer("b", seq=1, base=2), Reason.REPLAYED, "at or below seq 3"),
    (make_offer("c", seq=1, base=2, tokens=0), Reason.BAD_COUNTS, "positive"),
    (make_offer("c", seq=1, base=2, steps=0), Reason.BAD_COUNTS, "positive"),
    (make_offer("c", seq=1, base=2, tokens=-5, steps=3), Reason.BAD_COUNTS, "-5"),
    (make_offer("c", seq=1, base=2, tokens=2**62, steps=1), Reason.BAD_COUNTS, "2^64"),
]


@pytest.mark.parametrize(("offer", "reason", "needle"), REJECTIONS,
                         ids=[f"{r.value}-{i}" for i, (_, r, _) in enumerate(REJECTIONS)])
def test_rejections_name_the_problem_and_change_nothing(
        offer: Offer, reason: Reason, needle: str) -> None:
    policy = _rejection_fixture()
    before = snapshot(policy, 1.0)
    with pytest.raises(Rejected) as info:
        policy.admit(offer, 1.0)
    assert info.value.reason is reason
    assert needle in info.value.message
    assert needle in str(info.value)
    assert str(info.value).startswith(reason.value)
    assert snapshot(policy, 1.0) == before
    # The policy still works normally afterwards.
    contribute(policy, 1.0, "c", seq=7, base=2)
    assert policy.round_learners(0) == {"a", "c"}
    assert policy.round_timing(0) == (0.5, 1.0 + policy.config.grace_max_s)


def test_heartbeat_and_leave_of_unknown_learner_are_rejected() -> None:
    policy = Policy(PolicyConfig(), versions={0: 0})
    with pytest.raises(Rejected) as info:
        policy.heartbeat("x", 0.0, 0)
    assert info.value.reason is Reason.UNKNOWN_LEARNER
    assert "'x'" in info.value.message
    with pytest.raises(Rejected) as info:
        policy.leave("x")
    assert info.value.reason is Reason.UNKNOWN_LEARNER
    assert policy.known_learners() == frozenset()


def test_accept_of_a_left_learner_is_rejected() -> None:
    policy = three_learners(PolicyConfig())
    admission = policy.admit(make_offer("a"), 0.0)
    policy.leave("a")
    with pytest.raises(Rejected) as info:
        policy.accept(admission, 0.0)
    assert info.value.reason is Reason.UNKNOWN_LEARNER
    assert policy.round_learners(0) == frozenset()


def test_initialize() -> None:
    policy = three_learners(PolicyConfig(), versions={0: -1, 1: 4})
    assert policy.version(0) == -1
    policy.initialize(0, "z", 1)
    assert policy.version(0) == 0
    contribute(policy, 0.0, "a", seq=1, base=0)
    assert policy.close(0, 100.0).version == 1
    for fragment in (0, 1):
        with pytest.raises(Rejected) as info:
            policy.initialize(fragment, "a", 1)
        assert info.value.reason is Reason.ALREADY_INITIALIZED
        assert f"fragment {fragment} already has version" in info.value.message
    with pytest.raises(Rejected) as info:
        policy.initialize(5, "a", 1)
    assert info.value.reason is Reason.UNKNOWN_FRAGMENT


def test_admit_of_seq_zero_is_rejected_not_a_crash() -> None:
    # BUG (coordinator/policy.py, Policy._check_fresh): a seq <= 0 from a
    # learner with no watermark on the fragment is caught by
    # `cid.seq <= frag.merged_seq.get(learner, 0)`, but the message then reads
    # `frag.merged_seq[cid.learner_id]`, which raises KeyError instead of
    # Rejected. Seqs start at 1 (join's answer), so seq 0 is a malformed or
    # replayed request that must be refused with a reason, not crash the shell.
    policy = three_learners(PolicyConfig())
    before = snapshot(policy, 0.0)
    with pytest.raises(Rejected) as info:
        policy.admit(make_offer("a", seq=0), 0.0)
    assert info.value.reason in (Reason.REPLAYED, Reason.MALFORMED)
    assert snapshot(policy, 0.0) == before


def test_same_admission_accepted_twice_is_not_merged_twice() -> None:
    # BUG (coordinator/policy.py, Policy.accept): accept re-checks only that the
    # round is still open, not that the contribution id is still fresh. Two
    # admissions of the same offer (a retried push whose first attempt is
    # still streaming: admit is documented as side-effect free and called on
    # the header, before the bytes) can both be accepted, and the manifest
    # then lists the same (learner, fragment, seq) twice: merged twice,
    # breaking exactly-once.
    policy = three_learners(PolicyConfig())
    offer = make_offer("a", seq=1)
    first = policy.admit(offer, 0.0)
    second = policy.admit(offer, 0.0)
    policy.accept(first, 0.0)
    with pytest.raises((Rejected, ValueError)):
        policy.accept(second, 0.0)
    closed = policy.close(0, 100.0)
    ids = [c.id for c in closed.manifest]
    assert len(ids) == len(set(ids)), f"contribution merged twice: {ids}"


# -- membership ------------------------------------------------------------------


def test_heartbeat_timeout_makes_a_learner_not_live_and_stops_it_blocking_early_close() -> None:
    policy = three_learners(PolicyConfig(min_quorum=2, grace_max_s=100.0,
                                         heartbeat_timeout_s=10.0))
    contribute(policy, 1.0, "a", seq=1)
    contribute(policy, 2.0, "b", seq=1)
    assert policy.is_live("c", 10.0)  # exactly at the timeout: still live
    assert policy.due(10.0) == []
    assert not policy.is_live("c", 10.001)
    assert policy.live_learners(10.001) == {"a", "b"}
    assert policy.due(10.001) == [0]
    assert policy.close(0, 10.001).closed_at == 10.001


def test_heartbeat_keeps_a_learner_live_and_blocking() -> None:
    policy = three_learners(PolicyConfig(min_quorum=2, grace_max_s=100.0,
                                         heartbeat_timeout_s=10.0))
    contribute(policy, 1.0, "a", seq=1)
    contribute(policy, 2.0, "b", seq=1)
    policy.heartbeat("c", 9.0, local_step=0)
    assert policy.due(15.0) == []
    # a and b timed out at 11 and 12, c at 19: nobody live, everybody contributed.
    assert policy.live_learners(19.5) == frozenset()
    assert policy.due(19.5) == [0]


def test_leave_makes_a_learner_not_live_and_a_rejoin_is_live_once_heard_from() -> None:
    policy = three_learners(PolicyConfig(min_quorum=2, grace_max_s=100.0))
    contribute(policy, 1.0, "a", seq=1)
    contribute(policy, 1.0, "b", seq=1)
    assert policy.due(1.0) == []
    policy.leave("c")
    assert not policy.is_live("c", 1.0)
    assert "c" in policy.known_learners()
    assert policy.due(1.0) == [0]
    policy.close(0, 1.0)
    assert policy.join("c", 2.0) == 1
    # Back, but catching up: it holds no round open until it heartbeats.
    assert not policy.is_live("c", 2.0)
    contribute(policy, 2.0, "a", seq=2, base=1)
    contribute(policy, 2.0, "b", seq=2, base=1)
    assert policy.due(2.0) == [0]
    policy.close(0, 2.0)
    policy.heartbeat("c", 3.0, local_step=0)
    assert policy.is_live("c", 3.0)
    contribute(policy, 3.0, "a", seq=3, base=2)
    contribute(policy, 3.0, "b", seq=3, base=2)
    assert policy.due(3.0) == []  # now the round waits for c


def test_unknown_learner_is_not_live() -> None:
    policy = Policy(PolicyConfig(), versions={0: 0})
    assert not policy.is_live("nobody", 0.0)
    assert policy.live_learners(0.0) == frozenset()


def test_join_returns_next_seq_above_everything_seen() -> None:
    policy = three_learners(PolicyConfig(min_quorum=3), versions={0: 0, 1: 0})
    assert policy.join("d", 0.0) == 1
    contribute(policy, 0.0, "a", fragment=0, seq=4)
    contribute(policy, 0.0, "a", fragment=1, seq=9)
    contribute(policy, 0.0, "a", fragment=0, seq=6)
    # Seen, not yet merged: still never reused.
    assert policy.join("a", 1.0) == 10
    # An initial value pushed as seq 12 uses that id up too.
    fresh = Policy(PolicyConfig(), versions={0: -1, 1: -1})
    fresh.join("b", 0.0)
    fresh.initialize(0, "b", 12)
    assert fresh.join("b", 1.0) == 13
    fresh.initialize(1, "b", 2)
    assert fresh.join("b", 1.0) == 13
    assert fresh.merged_seq(0, "b") == 12 and fresh.merged_seq(1, "b") == 2
    policy.leave("a")
    assert policy.join("a", 2.0) == 10


def test_join_after_restart_is_above_every_acknowledged_seq() -> None:
    """A contribution acknowledged in a round that a crash then lost is named by no
    watermark; the durable reservation made before its acknowledgement keeps the
    restarted policy's next seq above it."""
    policy = three_learners(PolicyConfig(min_quorum=3))
    durable: dict[str, int] = {}
    for seq in (5, 6, SEQ_BLOCK + 9):
        reservation = policy.reservation("a", seq)
        if seq == 6:
            assert reservation is None  # covered by the block reserved for seq 5
        else:
            assert reservation is not None and reservation["a"] == seq + SEQ_BLOCK
            durable = reservation
            policy.reserved(reservation)
        contribute(policy, 0.0, "a", seq=seq)
    assert policy.join("a", 1.0) == SEQ_BLOCK + 10  # in this life: one above the highest
    restarted = Policy(PolicyConfig(), versions={0: 0}, reservations=durable)
    assert restarted.join("a", 2.0) == 2 * SEQ_BLOCK + 10
    assert restarted.join("b", 2.0) == 1
    # A reservation never passes the last seq a learner may use.
    assert policy.reservation("b", MAX_SEQ - 1) == {**durable, "b": MAX_SEQ}


def test_join_after_restart_resumes_above_restored_watermarks() -> None:
    restored = Policy(PolicyConfig(), versions={0: 3, 1: 7},
                      merged_seq={0: {"a": 4, "b": 2}, 1: {"a": 9}})
    assert restored.join("a", 0.0) == 10
    assert restored.join("b", 0.0) == 3
    assert restored.join("c", 0.0) == 1
    assert restored.watermarks(0) == {"a": 4, "b": 2}
    assert restored.merged_seq(1, "a") == 9
    assert restored.merged_seq(1, "b") == 0
    # The restored watermarks keep refusing replays.
    with pytest.raises(Rejected) as info:
        restored.admit(make_offer("a", fragment=1, seq=9, base=7), 0.0)
    assert info.value.reason is Reason.REPLAYED
    assert restored.admit(make_offer("a", fragment=1, seq=10, base=7), 0.0).staleness == 0


def test_restart_round_trip_through_watermarks() -> None:
    config = PolicyConfig(min_quorum=1, grace_max_s=0.0)
    policy = three_learners(config)
    contribute(policy, 0.0, "a", seq=3)
    contribute(policy, 0.0, "b", seq=8)
    policy.close(0, 0.0)
    restarted = Policy(config, versions={0: policy.version(0)},
                       merged_seq={0: policy.watermarks(0)})
    assert restarted.version(0) == 1
    assert restarted.join("a", 1.0) == 4
    assert restarted.join("b", 1.0) == 9


def test_accept_refreshes_liveness_and_samples_step_time() -> None:
    policy = Policy(PolicyConfig(heartbeat_timeout_s=5.0), versions={0: 0})
    policy.join("a", 0.0)
    policy.heartbeat("a", 0.0, local_step=0)
    admission = policy.admit(make_offer("a", local_step=4), 8.0)
    assert policy.step_time("a") is None  # admit changes nothing
    assert not policy.is_live("a", 8.0)
    policy.accept(admission, 8.0)
    assert policy.is_live("a", 8.0)
    assert policy.step_time("a") == 2.0


# -- sync mode --------------------------------------------------------------------


def test_sync_mode_closes_exactly_when_all_contributed() -> None:
    policy = three_learners(PolicyConfig(min_quorum=3, grace_max_s=0.0))
    contribute(policy, 1.0, "a", seq=1)
    contribute(policy, 2.0, "b", seq=1)
    assert policy.due(2.0) == []
    contribute(policy, 3.0, "c", seq=1)
    assert policy.round_timing(0) == (1.0, 3.0)
    assert policy.due(3.0) == [0]
    closed = policy.close(0, 3.0)
    assert closed.grace_s == 0.0
    assert closed.why == "all_live"
    assert len({c.id.learner_id for c in closed.manifest}) == 3


def test_sync_mode_stalls_with_a_dead_learner() -> None:
    policy = three_learners(PolicyConfig(min_quorum=3, grace_max_s=0.0,
                                         heartbeat_timeout_s=1.0))
    contribute(policy, 1.0, "a", seq=1)
    contribute(policy, 1.0, "b", seq=1)
    # c is dead long since; a and b stay live, and they are all that is live.
    for t in (10.0, 1e3, 1e6):
        policy.heartbeat("a", t, local_step=0)
        policy.heartbeat("b", t, local_step=0)
        assert policy.live_learners(t) == {"a", "b"}
        assert policy.due(t) == []
        assert policy.next_deadline() is None
        with pytest.raises(ValueError, match="not due"):
            policy.close(0, t)
    policy.leave("c")
    assert policy.due(1e7) == []


def test_sync_mode_refuses_a_push_that_missed_its_round() -> None:
    # Lock-step as `--sync-mode 3` configures it; a fourth participant (an
    # adversary, say) helps make quorum without c.
    policy = three_learners(PolicyConfig(min_quorum=3, grace_max_s=0.0, max_staleness=0))
    policy.join("x", 0.0)
    for lid in ("a", "b", "x"):
        contribute(policy, 1.0, lid, seq=1)
    policy.close(0, 1.0)
    before = snapshot(policy, 1.0)
    with pytest.raises(Rejected) as info:
        policy.admit(make_offer("c", seq=1, base=0), 1.0)
    assert info.value.reason is Reason.STALE
    assert snapshot(policy, 1.0) == before
    # Having applied version 1, c's next push is in phase with everyone's.
    contribute(policy, 2.0, "c", seq=2, base=1)
    assert policy.round_learners(0) == {"c"}


# -- misuse ------------------------------------------------------------------------


def test_accept_after_its_round_closed_raises() -> None:
    policy = three_learners(PolicyConfig(min_quorum=1, grace_max_s=0.0))
    late = policy.admit(make_offer("a", seq=1), 0.0)
    contribute(policy, 0.0, "b", seq=1)
    policy.close(0, 0.0)
    before = snapshot(policy, 0.0)
    with pytest.raises(ValueError, match="closed"):
        policy.accept(late, 0.0)
    assert snapshot(policy, 0.0) == before
    # Admitting again targets the new round.
    again = policy.admit(make_offer("a", seq=1, base=1), 0.0)
    assert again.target_version == 2
    policy.accept(again, 0.0)


def test_close_of_a_round_that_is_not_due_raises() -> None:
    policy = three_learners(PolicyConfig(min_quorum=2, grace_max_s=5.0))
    with pytest.raises(ValueError, match="not due"):
        policy.close(0, 0.0)  # empty round
    contribute(policy, 0.0, "a", seq=1)
    contribute(policy, 1.0, "b", seq=1)
    before = snapshot(policy, 2.0)
    with pytest.raises(ValueError, match="fragment 0 is not due"):
        policy.close(0, 2.0)
    assert snapshot(policy, 2.0) == before
    with pytest.raises(Rejected) as info:
        policy.close(3, 2.0)
    assert info.value.reason is Reason.UNKNOWN_FRAGMENT


def test_record_sync_time_of_unknown_fragment_is_rejected() -> None:
    policy = Policy(PolicyConfig(), versions={0: 0})
    with pytest.raises(Rejected) as info:
        policy.record_sync_time(1, 0.1)
    assert info.value.reason is Reason.UNKNOWN_FRAGMENT


@pytest.mark.parametrize(("key", "value"), [
    ("min_quorum", 0),
    ("gamma", -0.1),
    ("gamma", 1.5),
    ("gamma", math.nan),
    ("grace_max_s", -1.0),
    ("staleness_exponent", -0.5),
    ("max_staleness", -1),
    ("merge", "median"),
    ("heartbeat_timeout_s", 0.0),
    ("default_overlap_steps", 0),
])
def test_config_validation_names_the_key(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"policy\.{key} ") as info:
        PolicyConfig(**{key: value})
    assert repr(value) in str(info.value)


def test_config_defaults_match_the_design() -> None:
    config = PolicyConfig()
    assert (config.min_quorum, config.gamma, config.staleness_exponent, config.merge) == (
        1, 0.5, 0.5, "mean")


# -- properties of the weight function -------------------------------------------


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(1, 10**7), steps=st.integers(1, 10**5),
       staleness=st.integers(0, 64), exponent=st.floats(0.0, 4.0))
def test_weights_are_positive_finite_and_decay_with_staleness(
        tokens: int, steps: int, staleness: int, exponent: float) -> None:
    policy = Policy(PolicyConfig(staleness_exponent=exponent), versions={0: 0})
    w = policy.weight(tokens, steps, staleness)
    assert math.isfinite(w) and w > 0.0
    assert w <= policy.weight(tokens, steps, 0)
    assert w >= policy.weight(tokens, steps, staleness + 1)
    assert w == pytest.approx(tokens * tokens / steps * (1 + staleness) ** -exponent, rel=1e-12)
    flat = Policy(PolicyConfig(staleness_exponent=0.0), versions={0: 0})
    assert flat.weight(tokens, steps, staleness) == flat.weight(tokens, steps, 0)


# -- the merge formula fed by the policy's weights -------------------------------


def check_merge(closed: RoundClose, rng: np.random.Generator, dim: int = 8) -> None:
    """The fp32 accumulate loop the daemon runs agrees with a float64 reference,
    for the weighted mean and for radial-directional averaging."""
    weights = np.array([c.weight for c in closed.manifest], dtype=np.float64)
    total = closed.total_weight
    assert total > 0.0
    assert math.fsum(weights / total) == pytest.approx(1.0, abs=1e-9)
    vectors = rng.standard_normal((len(weights), dim)) * rng.uniform(0.1, 10.0, (len(weights), 1))

    # Weighted mean.
    reference = (weights[:, None] * vectors).sum(axis=0) / weights.sum()
    acc = np.zeros(dim, dtype=np.float32)
    for c, v in zip(closed.manifest, vectors, strict=True):
        acc += np.float32(c.weight) * v.astype(np.float32)
    merged = acc / np.float32(total)
    scale = float(np.abs(vectors).max())
    np.testing.assert_allclose(merged, reference, rtol=1e-5, atol=1e-5 * scale)

    # RDA: (Σ w‖v‖/Σ w) · normalize(Σ w·normalize(v)/Σ w).
    norms = np.linalg.norm(vectors, axis=1)
    directions = vectors / norms[:, None]
    radius = (weights * norms).sum() / weights.sum()
    mean_direction = (weights[:, None] * directions).sum(axis=0) / weights.sum()
    if np.linalg.norm(mean_direction) < 1e-3:
        return  # directions cancel: normalising is ill-conditioned, nothing to compare
    rda_reference = radius * mean_direction / np.linalg.norm(mean_direction)
    acc_norm = np.float32(0.0)
    acc_dir = np.zeros(dim, dtype=np.float32)
    for c, v in zip(closed.manifest, vectors, strict=True):
        v32 = v.astype(np.float32)
        n32 = np.float32(np.linalg.norm(v32))
        acc_norm += np.float32(c.weight) * n32
        acc_dir += np.float32(c.weight) * (v32 / n32)
    direction = acc_dir / np.float32(total)
    rda = (acc_norm / np.float32(total)) * direction / np.linalg.norm(direction)
    np.testing.assert_allclose(rda, rda_reference, rtol=1e-5, atol=1e-5 * radius)
    assert float(np.linalg.norm(rda_reference)) == pytest.approx(radius, rel=1e-9)


def test_merge_of_a_hand_built_round() -> None:
    policy = three_learners(PolicyConfig(min_quorum=3, grace_max_s=0.0), versions={0: 2})
    contribute(policy, 0.0, "a", seq=1, base=2, tokens=100, steps=10)
    contribute(policy, 0.0, "b", seq=1, base=1, tokens=50, steps=50)
    contribute(policy, 0.0, "c", seq=1, base=0, tokens=1000, steps=500)
    closed = policy.close(0, 0.0)
    assert [c.staleness for c in closed.manifest] == [0, 1, 2]
    assert [c.weight for c in closed.manifest] == pytest.approx(
        [1000.0, 50.0 * 2 ** -0.5, 2000.0 * 3 ** -0.5])
    check_merge(closed, np.random.default_rng(0))
    # Two opposite unit vectors with equal weight: the mean is zero.
    w = closed.manifest[0].weight
    assert np.allclose((w * np.ones(3) + w * -np.ones(3)) / (2 * w), 0.0)


# -- the outer step a round deserves --------------------------------------------------


def test_a_round_of_every_live_learner_at_current_versions_steps_in_full() -> None:
    policy = three_learners(PolicyConfig(min_quorum=3, grace_max_s=0.0))
    for lid in ("a", "b", "c"):
        contribute(policy, 1.0, lid, seq=1)
    closed = policy.close(0, 1.0)
    assert (closed.live, closed.mean_staleness, closed.step_scale) == (3, 0.0, 1.0)


def test_a_round_of_a_share_of_the_learners_steps_by_that_share() -> None:
    policy = three_learners(PolicyConfig(min_quorum=1, grace_max_s=0.0))
    contribute(policy, 1.0, "a", seq=1)
    closed = policy.close(0, 1.0)
    assert closed.live == 3
    assert closed.step_scale == pytest.approx(1 / 3)


def test_stale_outer_gradients_step_less() -> None:
    # a's push against version 0 arrives when version 1 is out: a delay of one round,
    # weighted like the merge weighs it.
    policy = Policy(PolicyConfig(min_quorum=1, grace_max_s=0.0, staleness_exponent=0.0),
                    versions={0: 0})
    policy.join("a", 0.0)
    contribute(policy, 1.0, "a", seq=1, base=0)
    policy.close(0, 1.0)
    contribute(policy, 2.0, "a", seq=2, base=0)
    closed = policy.close(0, 2.0)
    assert closed.mean_staleness == 1.0
    assert closed.step_scale == pytest.approx(0.5)


def test_a_learner_that_died_counts_no_more_in_the_share() -> None:
    policy = three_learners(PolicyConfig(min_quorum=1, grace_max_s=0.0,
                                         heartbeat_timeout_s=1.0))
    policy.heartbeat("a", 5.0, local_step=0)
    contribute(policy, 5.0, "a", seq=1)
    closed = policy.close(0, 5.0)  # b and c are dead: a is every live learner
    assert (closed.live, closed.step_scale) == (1, 1.0)


# -- the stateful model -------------------------------------------------------------

LEARNERS = ("a", "b", "c", "d")
GHOST = "ghost"  # never joins
FRAGMENTS = (0, 1, 2)
MISSING_FRAGMENT = 7

configs = st.builds(
    PolicyConfig,
    min_quorum=st.one_of(st.integers(1, 4), st.just("auto")),
    min_quorum_max=st.integers(0, 4),
    gamma=st.floats(0.0, 1.0),
    grace_max_s=st.one_of(st.just(0.0), st.floats(0.0, 20.0)),
    staleness_exponent=st.one_of(st.just(0.0), st.floats(0.0, 3.0)),
    max_staleness=st.integers(0, 4),
    merge=st.sampled_from(["mean", "rda"]),
    heartbeat_timeout_s=st.floats(1.0, 30.0),
    default_overlap_steps=st.integers(1, 4),
)


@dataclass
class ModelLearner:
    last_seen: float
    local_step: int = 0
    first_seq: int = 1  # of its current life: older pushes are never replaced


class PolicyMachine(RuleBasedStateMachine):
    """Random event streams against the policy, checked against a small model.

    The driver closes promptly: every clock advance stops at each grace
    deadline on the way and closes whatever is due there."""

    @initialize(config=configs,
                initial=st.lists(st.sampled_from([-1, 0, 0, 3, 10]), min_size=3, max_size=3),
                joined=st.lists(st.sampled_from(LEARNERS), unique=True))
    def setup(self, config: PolicyConfig, initial: list[int], joined: list[str]) -> None:
        self.config = config
        self.now = 0.0
        self.versions = dict(zip(FRAGMENTS, initial, strict=True))
        self.policy = Policy(config, versions=dict(self.versions))
        self.members: dict[str, ModelLearner] = {}  # joined and not left
        self.joined_ever: set[str] = set()
        self.seen: dict[str, int] = {}
        self.rounds: dict[int, list[MergedContribution]] = {p: [] for p in FRAGMENTS}
        self.watermarks: dict[int, dict[str, int]] = {p: {} for p in FRAGMENTS}
        self.merged_ids: set[tuple[str, int, int]] = set()
        # The seq reservations the shell made durable (`Policy.reservation`).
        self.reserved: dict[str, int] = {}
        # Every seq accepted, per learner, across restarts: join stays above them.
        self.acknowledged: dict[str, int] = {}
        # The first seq of each of a learner's lives (each join's), in order.
        self.lives: dict[str, list[int]] = {}
        self.closes = 0
        self.accepted = 0
        for learner in joined:
            self.join(learner, overlap=None)

    # -- model helpers --

    def live(self) -> set[str]:
        return {lid for lid, m in self.members.items()
                if self.now - m.last_seen <= self.config.heartbeat_timeout_s}

    def has_quorum(self, p: int) -> bool:
        # "auto": the quorum the round chose when it opened (None before).
        quorum = (self.config.min_quorum if isinstance(self.config.min_quorum, int)
                  else self.policy.round_quorum(p) or math.inf)
        return len({c.id.learner_id for c in self.rounds[p]}) >= quorum

    def standing(self, offer: Offer) -> int | None:
        """The model's entry the learner has in the open round against `offer`'s base."""
        cid = offer.id
        first_seq = self.members[cid.learner_id].first_seq
        return next((i for i, c in enumerate(self.rounds[cid.fragment])
                     if c.id.learner_id == cid.learner_id and c.id.seq >= first_seq
                     and c.base_version == offer.base_version and c.replaced_by is None),
                    None)

    def expected_reasons(self, offer: Offer) -> set[Reason]:
        cid = offer.id
        reasons = set()
        if cid.learner_id not in self.members:
            reasons.add(Reason.UNKNOWN_LEARNER)
        if cid.fragment not in self.versions:
            return reasons | {Reason.UNKNOWN_FRAGMENT}
        version = self.versions[cid.fragment]
        if version < 0:
            reasons.add(Reason.NOT_INITIALIZED)
        if offer.c_tokens <= 0 or offer.c_steps <= 0:
            reasons.add(Reason.BAD_COUNTS)
        if offer.base_version > version:
            reasons.add(Reason.FUTURE_VERSION)
        if offer.base_version < 0:
            reasons.add(Reason.MALFORMED)
        in_round = any(c.id.learner_id == cid.learner_id and c.id.seq == cid.seq
                       for c in self.rounds[cid.fragment])
        if in_round or cid.seq <= self.watermarks[cid.fragment].get(cid.learner_id, 0):
            reasons.add(Reason.REPLAYED)
        if version - offer.base_version > self.config.max_staleness:
            reasons.add(Reason.STALE)
        return reasons

    def close_and_check(self, p: int) -> None:
        deadline = self.policy.round_timing(p)[1]
        closed = self.policy.close(p, self.now)
        if deadline is None:  # "auto", below its quorum: every live learner came
            assert self.config.min_quorum == "auto" and closed.why == "all_live"
            assert self.live() <= {c.id.learner_id for c in closed.manifest}
            deadline = self.now
        self.closes += 1
        # Versions go up by exactly one per close.
        assert closed.version == self.versions[p] + 1
        self.versions[p] = closed.version
        # The manifest is exactly what was accepted, in order, with the replacements.
        assert closed.manifest == tuple(self.rounds[p])
        # One standing contribution per learner, base and life; a replaced one weighs
        # nothing and names the later push of the same learner and base that took its
        # place, in the same life.
        def life(c: MergedContribution) -> int:
            return bisect.bisect_right(self.lives[c.id.learner_id], c.id.seq)
        standing = [(c.id.learner_id, c.base_version, life(c)) for c in closed.manifest
                    if c.replaced_by is None]
        assert len(standing) == len(set(standing))
        for i, c in enumerate(closed.manifest):
            if c.replaced_by is not None:
                assert c.weight == 0.0
                assert any(later.id.seq == c.replaced_by
                           and later.id.learner_id == c.id.learner_id
                           and later.base_version == c.base_version
                           and life(later) == life(c)
                           for later in closed.manifest[i + 1:])
        learners = {c.id.learner_id for c in closed.manifest}
        if self.config.min_quorum == "auto":
            assert 1 <= closed.quorum <= (self.config.min_quorum_max or len(LEARNERS))
            assert closed.choice is not None and closed.choice.quorum == closed.quorum
        else:
            assert closed.quorum == self.config.min_quorum
        assert len(learners) >= closed.quorum or closed.why == "all_live", "below quorum"
        # Closed promptly: never after the deadline fixed at quorum.
        assert closed.quorum_at <= closed.closed_at <= deadline
        assert deadline == closed.quorum_at + closed.grace_s
        assert 0.0 <= closed.grace_s <= self.config.grace_max_s
        assert closed.live >= len(learners)
        assert 0.0 < closed.step_scale <= 1.0
        for c in closed.manifest:
            assert 0 <= c.staleness <= self.config.max_staleness
            assert math.isfinite(c.weight) and c.weight >= 0.0
            key = (c.id.learner_id, c.id.fragment, c.id.seq)
            assert key not in self.merged_ids, f"{key} merged twice"
            self.merged_ids.add(key)
            marks = self.watermarks[p]
            marks[c.id.learner_id] = max(marks.get(c.id.learner_id, 0), c.id.seq)
        check_merge(closed, np.random.default_rng([p, closed.version]))
        self.rounds[p] = []

    def close_all_due(self) -> None:
        for p in self.policy.due(self.now):
            self.close_and_check(p)

    # -- rules --

    @rule(learner=st.sampled_from(LEARNERS), overlap=st.one_of(st.none(), st.integers(1, 4)))
    def join(self, learner: str, overlap: int | None) -> None:
        seq = self.policy.join(learner, self.now, overlap_steps=overlap)
        assert seq == self.seen.get(learner, 0) + 1
        # Above every seq ever acknowledged, in rounds a restart lost too.
        assert seq > self.acknowledged.get(learner, 0)
        self.lives.setdefault(learner, []).append(seq)
        # Joining again (a restart): not live until heard from, while it catches up.
        again = learner in self.joined_ever
        self.joined_ever.add(learner)
        self.members[learner] = ModelLearner(last_seen=-math.inf if again else self.now,
                                             first_seq=seq)

    @rule(learner=st.sampled_from((*LEARNERS, GHOST)), progress=st.integers(0, 3))
    def heartbeat(self, learner: str, progress: int) -> None:
        member = self.members.get(learner)
        if member is None:
            with pytest.raises(Rejected) as info:
                self.policy.heartbeat(learner, self.now, 0)
            assert info.value.reason is Reason.UNKNOWN_LEARNER
            return
        member.local_step += progress
        member.last_seen = self.now
        self.policy.heartbeat(learner, self.now, member.local_step)
        step_time = self.policy.step_time(learner)
        assert step_time is None or (math.isfinite(step_time) and step_time >= 0.0)

    @rule(learner=st.sampled_from((*LEARNERS, GHOST)))
    def leave(self, learner: str) -> None:
        if learner not in self.members:
            with pytest.raises(Rejected) as info:
                self.policy.leave(learner)
            assert info.value.reason is Reason.UNKNOWN_LEARNER
            return
        self.policy.leave(learner)
        del self.members[learner]

    @rule(fragment=st.sampled_from(FRAGMENTS))
    def initialize_fragment(self, fragment: int) -> None:
        if self.versions[fragment] >= 0:
            with pytest.raises(Rejected) as info:
                self.policy.initialize(fragment, "initializer", 1)
            assert info.value.reason is Reason.ALREADY_INITIALIZED
            return
        self.policy.initialize(fragment, "initializer", 1)
        self.versions[fragment] = 0
        self.watermarks[fragment]["initializer"] = 1

    def try_contribution(self, offer: Offer) -> None:
        """Admit `offer` and accept it when admitted, checking both against the model."""
        expected = self.expected_reasons(offer)
        before = snapshot(self.policy, self.now)
        try:
            admission = self.policy.admit(offer, self.now)
        except Rejected as rejected:
            assert rejected.reason in expected, (rejected.reason, expected)
            assert snapshot(self.policy, self.now) == before
            return
        assert not expected, f"admitted {offer} despite {expected}"
        assert snapshot(self.policy, self.now) == before  # admit changes nothing
        cid = offer.id
        staleness = self.versions[cid.fragment] - offer.base_version
        assert admission.staleness == staleness
        assert admission.target_version == self.versions[cid.fragment] + 1
        standing = self.standing(offer)
        if standing is None:
            assert admission.replaces is None
            assert admission.weight == pytest.approx(
                offer.c_tokens * (offer.c_tokens / offer.c_steps)
                * (1 + staleness) ** -self.config.staleness_exponent, rel=1e-12)
        else:
            # It replaces the learner's contribution against that base, at its weight.
            replaced = self.rounds[cid.fragment][standing]
            assert admission.replaces == replaced.id
            assert admission.weight == replaced.weight
            self.rounds[cid.fragment][standing] = replace(replaced, weight=0.0,
                                                          replaced_by=cid.seq)
        had_quorum = self.has_quorum(cid.fragment)
        # As the shell does: the reservation covering the seq is durable before the ack.
        reservation = self.policy.reservation(cid.learner_id, cid.seq)
        if reservation is not None:
            self.policy.reserved(reservation)
            self.reserved = reservation
        assert self.reserved[cid.learner_id] >= cid.seq
        self.policy.accept(admission, self.now)
        self.acknowledged[cid.learner_id] = max(self.acknowledged.get(cid.learner_id, 0),
                                                cid.seq)
        member = self.members[cid.learner_id]
        member.last_seen = self.now
        member.local_step = max(member.local_step, offer.local_step)
        self.seen[cid.learner_id] = max(self.seen.get(cid.learner_id, 0), cid.seq)
        self.rounds[cid.fragment].append(MergedContribution(
            id=cid, base_version=offer.base_version, weight=admission.weight,
            staleness=staleness))
        self.accepted += 1
        opened_at, deadline = self.policy.round_timing(cid.fragment)
        assert opened_at is not None and opened_at <= self.now
        if self.has_quorum(cid.fragment) and not had_quorum:
            # The deadline is set when quorum is reached, within [now, now + grace_max].
            assert deadline is not None
            assert self.now <= deadline <= self.now + self.config.grace_max_s

    def fresh_offer(self, learner: str, fragment: int, behind: int = 0, tokens: int = 1000,
                    steps: int = 10, progress: int = 1) -> Offer:
        member = self.members.get(learner)
        return make_offer(learner, fragment=fragment, seq=self.seen.get(learner, 0) + 1,
                          base=self.versions.get(fragment, 0) - behind, tokens=tokens,
                          steps=steps,
                          local_step=(member.local_step if member else 0) + progress)

    @rule(who=st.integers(0, 19), where=st.integers(0, 9),
          seq=st.sampled_from(["fresh"] * 4 + ["in_round", "watermark", "below"]),
          behind=st.integers(0, 9), tokens=st.integers(1, 10**6), steps=st.integers(1, 1000),
          bad_counts=st.sampled_from([None] * 8 + [(0, 5), (5, 0), (-2, 3), (3, -1)]),
          progress=st.integers(0, 3))
    def contribute(self, who: int, where: int, seq: str, behind: int, tokens: int,
                   steps: int, bad_counts: tuple[int, int] | None, progress: int) -> None:
        """Mostly plausible contributions from members to initialized fragments,
        with a tail of every kind of bad one."""
        members = sorted(self.members)
        if who < 16 and members:
            learner = members[who % len(members)]
        else:
            learner = (*LEARNERS, GHOST)[who % (len(LEARNERS) + 1)]
        ready = [p for p in FRAGMENTS if self.versions[p] >= 0]
        if where < 7 and ready:
            fragment = ready[where % len(ready)]
        elif where < 9:
            fragment = FRAGMENTS[where % len(FRAGMENTS)]
        else:
            fragment = MISSING_FRAGMENT
        version = self.versions.get(fragment, 0)
        # Mostly an admissible base version; then future, stale, negative.
        base = {7: -1, 8: version + 1, 9: version - self.config.max_staleness - 1}.get(
            behind, version - behind % (min(self.config.max_staleness, max(version, 0)) + 1))
        if bad_counts is not None:
            tokens, steps = bad_counts
        member = self.members.get(learner)
        in_round = [c.id.seq for c in self.rounds.get(fragment, [])
                    if c.id.learner_id == learner]
        mark = self.watermarks.get(fragment, {}).get(learner, 0)
        number = {"in_round": in_round[-1] if in_round else None,
                  "watermark": mark or None,
                  "below": mark - 1 if mark > 1 else None}.get(seq)
        if number is None:
            number = self.seen.get(learner, 0) + 1
        offer = make_offer(learner, fragment=fragment, seq=number, base=base,
                           tokens=tokens, steps=steps,
                           local_step=(member.local_step if member else 0) + progress)
        self.try_contribution(offer)

    @precondition(lambda self: self.members and any(v >= 0 for v in self.versions.values()))
    @rule(where=st.integers(0, 2), count=st.integers(1, 4))
    def members_contribute(self, where: int, count: int) -> None:
        """The first `count` members push a fresh contribution to a fragment."""
        ready = [p for p in FRAGMENTS if self.versions[p] >= 0]
        for learner in sorted(self.members)[:count]:
            self.try_contribution(self.fresh_offer(learner, ready[where % len(ready)]))

    @rule(dt=st.one_of(st.just(0.0), st.floats(0.01, 2.0), st.floats(0.5, 40.0)))
    def advance(self, dt: float) -> None:
        target = self.now + dt
        while (deadline := self.policy.next_deadline()) is not None and deadline <= target:
            assert deadline >= self.now, "a deadline passed without its round closing"
            self.now = deadline
            self.close_all_due()
        self.now = target

    @rule()
    def close_due(self) -> None:
        self.close_all_due()

    @rule(fragment=st.sampled_from(FRAGMENTS))
    def close_not_due(self, fragment: int) -> None:
        if fragment in self.policy.due(self.now):
            return
        before = snapshot(self.policy, self.now)
        with pytest.raises(ValueError, match="not due"):
            self.policy.close(fragment, self.now)
        assert snapshot(self.policy, self.now) == before

    @rule(fragment=st.sampled_from(FRAGMENTS), seconds=st.floats(0.0, 3.0))
    def record_sync_time(self, fragment: int, seconds: float) -> None:
        self.policy.record_sync_time(fragment, seconds)

    @precondition(lambda self: self.closes > 0)
    @rule()
    def restart(self) -> None:
        """The daemon restarts from its committed versions, watermarks and seq
        reservations: open rounds and memberships are lost, learners must join again."""
        self.policy = Policy(self.config, versions=dict(self.versions),
                             merged_seq={p: dict(m) for p, m in self.watermarks.items()},
                             reservations=dict(self.reserved))
        self.members = {}
        self.rounds = {p: [] for p in FRAGMENTS}
        self.seen = dict(self.reserved)
        for marks in self.watermarks.values():
            for lid, seq in marks.items():
                self.seen[lid] = max(self.seen.get(lid, 0), seq)
        # What the restored policy knows of a learner: its merged and reserved seqs.
        self.joined_ever = set(self.seen)

    def teardown(self) -> None:
        # Every round with quorum closes by its deadline once time moves on.
        self.advance(self.config.grace_max_s + 1.0)
        for p in FRAGMENTS:
            assert self.policy.round_timing(p)[1] is None
            assert not self.has_quorum(p)

    # -- invariants --

    @invariant()
    def model_agrees(self) -> None:
        policy = self.policy
        assert {p: policy.version(p) for p in FRAGMENTS} == self.versions
        for p in FRAGMENTS:
            assert policy.watermarks(p) == self.watermarks[p]
            assert policy.round_learners(p) == {c.id.learner_id for c in self.rounds[p]}
        assert policy.live_learners(self.now) == self.live()

    @invariant()
    def rounds_close_exactly_when_due(self) -> None:
        due = set(self.policy.due(self.now))
        live = self.live()
        for p in FRAGMENTS:
            deadline = self.policy.round_timing(p)[1]
            # A deadline exists exactly when the round has quorum.
            assert (deadline is not None) == self.has_quorum(p)
            learners = {c.id.learner_id for c in self.rounds[p]}
            expected = deadline is not None and (self.now >= deadline or live <= learners)
            # "auto" chose its quorum from the learners live at the open; once all that
            # are live now came, it waits for no one who died since.
            expected = expected or (self.config.min_quorum == "auto" and bool(learners)
                                    and live <= learners)
            assert (p in due) == expected, (p, due, deadline, self.now, live, learners)
        deadline = self.policy.next_deadline()
        if deadline is not None and self.now >= deadline:
            assert any(self.policy.round_timing(p)[1] == deadline for p in due)


PolicyMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestPolicyMachine = PolicyMachine.TestCase
