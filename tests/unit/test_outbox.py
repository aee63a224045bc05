"""The learner's outbox (`learner.outbox`): worked cases, and a Hypothesis state
machine of exactly-once bookkeeping against a small reference model."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from learner.outbox import Contribution, Outbox, Settled

DELTA = np.zeros(2, np.float32)


def pushed(outbox: Outbox, fragment: int = 0) -> Contribution:
    return outbox.add(fragment, DELTA, base_version=0, c_tokens=1, c_steps=1, local_step=1)


def test_a_watermark_settles_every_contribution_at_or_below_it_as_merged() -> None:
    outbox = Outbox()
    a, b, c = pushed(outbox), pushed(outbox), pushed(outbox, fragment=1)
    assert [a.seq, b.seq, c.seq] == [1, 2, 3]
    assert outbox.observe(0, 1) == [Settled(0, 1, merged=True)]
    assert outbox.held() == [b, c] and outbox.watermarks == {0: 1}
    # Fragment 1's watermark does not reach fragment 0's contributions.
    assert outbox.observe(1, 5) == [Settled(1, 3, merged=True)]
    assert outbox.held() == [b] and outbox.stats.merged == 2


def test_a_new_seq_is_above_every_watermark_and_next_seq_reported() -> None:
    outbox = Outbox()
    outbox.observe(0, 7)
    assert pushed(outbox).seq == 8
    outbox.joined(next_seq=20)
    assert outbox.take_seq() == 20
    outbox.joined(next_seq=3)  # a coordinator that knows less does not lower it
    assert pushed(outbox).seq == 21


def test_a_replay_settles_as_merged_at_or_below_the_watermark_and_is_held_above() -> None:
    outbox = Outbox()
    old, new = pushed(outbox), pushed(outbox)
    assert outbox.refused(new, "replayed", merged_seq=1) is None
    assert new.acknowledged and outbox.holds(new)
    assert outbox.refused(old, "replayed", merged_seq=1) == Settled(0, 1, merged=True)
    assert outbox.stats.merged == 1 and outbox.stats.dropped == {}


def test_a_refusal_drops_with_its_reason_once() -> None:
    outbox = Outbox()
    c = pushed(outbox)
    assert outbox.refused(c, "stale", 0, "too old") == Settled(0, 1, False, "stale", "too old")
    # Refused again (a retry's answer), or named by a watermark later: settled already.
    assert outbox.refused(c, "stale", 0) is None
    assert outbox.observe(0, 1) == []
    assert outbox.stats.dropped == {"stale": 1} and len(outbox) == 0


def test_a_join_leaves_every_contribution_to_push_again_but_the_one_in_flight() -> None:
    outbox = Outbox()
    a, b, c = pushed(outbox), pushed(outbox), pushed(outbox)
    outbox.acked(a, 4)
    outbox.acked(b, 4)
    assert outbox.stats.pushed == {0: 4}
    with outbox.sending(c):
        outbox.joined(next_seq=1)
        assert outbox.to_push_again() == [a, b]
        assert outbox.pushing_again(a) and not outbox.pushing_again(c)
    assert not c.in_flight and outbox.to_push_again() == [a, b, c]
    outbox.observe(0, 2)  # b settles while a is pushed again: b is not pushed
    assert not outbox.pushing_again(b) and outbox.stats.repushed == 1


def test_an_ack_of_a_push_under_way_when_the_learner_joined_again_does_not_stand() -> None:
    """The coordinator that answered may be the one the join replaced (a leader
    that stepped down mid-push and led again under a new epoch): the push goes
    again, and the repeat's answer stands."""
    outbox = Outbox()
    c = pushed(outbox)
    with outbox.sending(c):
        outbox.joined(next_seq=1)
    assert not outbox.acked(c, 4)
    assert not c.acknowledged and outbox.to_push_again() == [c]
    assert outbox.stats.repushed == 1 and outbox.stats.pushed == {}
    with outbox.sending(c):
        pass
    assert outbox.acked(c, 4) and c.acknowledged and outbox.stats.pushed == {0: 4}
    # A join while nothing is under way leaves the next ack standing.
    d = pushed(outbox)
    outbox.joined(next_seq=1)
    with outbox.sending(d):
        pass
    assert outbox.acked(d, 5)


def test_a_contribution_never_sent_is_dropped_without_a_seq() -> None:
    outbox = Outbox()
    assert outbox.dropped_unsent(1, "backlog_full", work_s=0.5) == Settled(
        1, None, merged=False, reason="backlog_full", work_s=0.5)
    assert outbox.stats.dropped == {"backlog_full": 1} and len(outbox) == 0
    assert outbox.take_seq() == 1


FRAGMENTS = (0, 1)
REASONS = st.sampled_from(["replayed", "stale", "layout_mismatch", "future_base"])


class OutboxMachine(RuleBasedStateMachine):
    """Pushes, acks, refusals, watermarks and joins in any order: every
    contribution settles at most once, as merged or dropped with a reason, a
    seq is never reused, and a watermark settles everything at or below it."""

    contributions = Bundle("contributions")

    def __init__(self) -> None:
        super().__init__()
        self.outbox = Outbox()
        # The reference: seq → how it settled ("merged", a reason, or None: held).
        self.fate: dict[int, str | None] = {}
        self.fragment_of: dict[int, int] = {}
        self.marks: dict[int, int] = {}
        self.seqs: list[int] = []
        self.unsent_drops: dict[str, int] = {}

    def _expect(self, settled: list[Settled]) -> None:
        for s in settled:
            assert s.seq is not None and self.fate[s.seq] is None, f"settled twice: {s}"
            self.fate[s.seq] = "merged" if s.merged else s.reason
            assert s.merged or s.reason, f"dropped without a reason: {s}"

    @rule(target=contributions, fragment=st.sampled_from(FRAGMENTS))
    def push(self, fragment: int) -> Contribution:
        c = pushed(self.outbox, fragment)
        assert c.seq > max(self.marks.values(), default=0), "a seq a watermark settled"
        self.seqs.append(c.seq)
        self.fate[c.seq], self.fragment_of[c.seq] = None, fragment
        return c

    @rule(c=contributions, version=st.integers(0, 5))
    def ack(self, c: Contribution, version: int) -> None:
        self.outbox.acked(c, version)

    @rule(c=contributions, reason=REASONS, below=st.booleans())
    def refuse(self, c: Contribution, reason: str, below: bool) -> None:
        mark = c.seq if below else c.seq - 1
        was = self.fate[c.seq]
        settled = self.outbox.refused(c, reason, mark)
        if was is not None:
            assert settled is None
            return
        if reason == "replayed" and not below:
            assert settled is None and c.acknowledged
            return
        assert settled is not None
        self._expect([settled])
        assert self.fate[c.seq] == ("merged" if reason == "replayed" else reason)

    @rule(fragment=st.sampled_from(FRAGMENTS), shift=st.integers(-3, 2))
    def watermark(self, fragment: int, shift: int) -> None:
        # Above the newest seq too: an earlier incarnation of this learner's pushes.
        mark = max(0, max(self.seqs, default=0) + shift)
        self._expect(self.outbox.observe(fragment, mark))
        self.marks[fragment] = mark
        for seq, fate in self.fate.items():
            if self.fragment_of[seq] == fragment and seq <= mark:
                assert fate is not None, f"seq {seq} at or below the watermark {mark} held"

    @rule(next_seq=st.integers(0, 30))
    def join(self, next_seq: int) -> None:
        self.outbox.joined(next_seq)
        assert not any(c.acknowledged for c in self.outbox.held())

    @rule()
    def push_again(self) -> None:
        for c in self.outbox.to_push_again():
            assert self.outbox.pushing_again(c)
            with self.outbox.sending(c):
                assert not self.outbox.pushing_again(c)

    @rule(reason=st.sampled_from(["backlog_full"]))
    def drop_before_sending(self, reason: str) -> None:
        assert self.outbox.dropped_unsent(0, reason).seq is None
        self.unsent_drops[reason] = self.unsent_drops.get(reason, 0) + 1

    @invariant()
    def seqs_are_never_reused(self) -> None:
        assert self.seqs == sorted(set(self.seqs))

    @invariant()
    def held_is_exactly_what_has_not_settled(self) -> None:
        assert [c.seq for c in self.outbox.held()] == sorted(
            s for s, fate in self.fate.items() if fate is None)

    @invariant()
    def stats_count_each_settlement_once(self) -> None:
        fates = [f for f in self.fate.values() if f is not None]
        assert self.outbox.stats.merged == fates.count("merged")
        dropped = dict(self.unsent_drops)
        for f in fates:
            if f != "merged":
                dropped[f] = dropped.get(f, 0) + 1
        assert self.outbox.stats.dropped == dropped


OutboxMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                           deadline=None)
TestOutboxMachine = OutboxMachine.TestCase
