"""The learner's schedule (`learner.schedule`): worked cases, bad input, and a
Hypothesis state machine against a small reference model of its rules."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from learner.schedule import (
    DEFAULT_RULE,
    Action,
    Apply,
    ApplyRule,
    FallBack,
    Phase,
    Pull,
    Push,
    Schedule,
    ScheduleConfig,
    lockstep_resume_step,
    offsets,
)

# What the default rule's applies say of the steps since the push (the tests of when
# and what to apply hold for every rule).
DEFAULT_CARRIES = DEFAULT_RULE is ApplyRule.CARRY


def started(**kwargs: object) -> Schedule:
    config = ScheduleConfig(**{"sync_every": 4, "fragments": 2, "overlap": 1, **kwargs})  # type: ignore[arg-type]
    schedule = Schedule(config)
    schedule.start({p: 0 for p in range(config.fragments)}, {p: 1 for p in range(config.fragments)})
    return schedule


def run_to(schedule: Schedule, k: int, tokens: int = 1) -> list[Action]:
    actions: list[Action] = []
    for step in range(schedule.step_count + 1, k + 1):
        actions += schedule.step(step, tokens)
    return actions


def test_fragments_are_due_at_staggered_steps() -> None:
    assert offsets(4, 2) == [0, 2]
    schedule = started()
    pushes = [(a.p, a.step) for a in run_to(schedule, 8) if isinstance(a, Push)]
    assert pushes == [(0, 4), (1, 6), (0, 8)]  # never at step t_p itself


def test_a_push_is_applied_overlap_steps_later_once_its_version_came() -> None:
    schedule = started(overlap=2)
    push = next(a for a in run_to(schedule, 4) if isinstance(a, Push) and a.p == 0)
    assert (push.base, push.tokens, push.steps) == (0, 4, 4)
    [pull] = schedule.acked(0, 3, push.ticket)
    assert pull == Pull(0, 2, pull.ticket)  # the first version holding the push
    schedule.pulled(0, 3, 7, pull.ticket)
    assert not [a for a in schedule.step(5, 1) if isinstance(a, Apply)]
    assert Apply(0, 3, 0.0, DEFAULT_CARRIES) in schedule.step(6, 1)
    assert schedule.version(0) == 3


def test_a_late_version_falls_back_to_the_newest_overlap_steps_after() -> None:
    schedule = started(overlap=1)
    push = next(a for a in run_to(schedule, 4) if isinstance(a, Push) and a.p == 0)
    schedule.acked(0, 5, push.ticket)
    assert schedule.step(5, 1) == []
    actions = schedule.step(6, 1)
    fallback = [a for a in actions if a.p == 0]
    assert isinstance(fallback[0], FallBack)
    assert isinstance(fallback[1], Pull) and fallback[1].newer_than == 0
    assert schedule.phase(0) == Phase.FALLBACK


def test_overwrite_discards_and_carry_keeps_the_steps_since_the_push() -> None:
    for apply_rule, kept in ((ApplyRule.OVERWRITE, 0), (ApplyRule.CARRY, 1)):
        schedule = started(rule=apply_rule)
        push = next(a for a in run_to(schedule, 4) if isinstance(a, Push) and a.p == 0)
        [pull] = schedule.acked(0, 1, push.ticket)
        schedule.pulled(0, 1, 9, pull.ticket)
        [apply] = [a for a in schedule.step(5, 1) if isinstance(a, Apply)]
        assert apply.carry is (apply_rule == ApplyRule.CARRY)
        next_push = next(a for a in run_to(schedule, 8) if isinstance(a, Push) and a.p == 0)
        assert next_push.steps == 3 + kept and next_push.base == 1


def test_boundary_applies_right_after_the_next_push() -> None:
    schedule = started(rule=ApplyRule.BOUNDARY)
    push = next(a for a in run_to(schedule, 4) if isinstance(a, Push) and a.p == 0)
    [pull] = schedule.acked(0, 1, push.ticket)
    schedule.pulled(0, 1, 9, pull.ticket)
    assert not [a for a in run_to(schedule, 7) if isinstance(a, Apply)]
    actions = [a for a in schedule.step(8, 1) if a.p == 0]
    assert isinstance(actions[0], Push) and actions[0].steps == 4 and actions[0].base == 0
    assert actions[1] == Apply(0, 1, 0.0, False)
    assert schedule.phase(0) == Phase.ACKING  # the push just made awaits its own version


def test_a_version_committed_again_is_pulled_at_once() -> None:
    schedule = started()
    schedule.published(0, 0, 2)  # version 0 under another commit than the applied one
    [pull] = schedule.step(1, 1)
    assert isinstance(pull, Pull) and (pull.p, pull.newer_than) == (0, -1)
    schedule.pulled(0, 0, 2, pull.ticket)
    assert Apply(0, 0, 0.0, DEFAULT_CARRIES) in schedule.step(2, 1)


def test_a_rewind_is_followed() -> None:
    schedule = started()
    push = next(a for a in run_to(schedule, 4) if isinstance(a, Push) and a.p == 0)
    [pull] = schedule.acked(0, None, push.ticket)
    schedule.pulled(0, 0, 5, pull.ticket, rewound=True)
    assert Apply(0, 0, 0.0, DEFAULT_CARRIES) in schedule.step(5, 1)


def test_lockstep_waits_instead_of_falling_back_and_resumes_in_phase() -> None:
    assert lockstep_resume_step({0: 3, 1: 2}, 4) == 12
    schedule = Schedule(ScheduleConfig(sync_every=4, fragments=2, lockstep=True))
    schedule.start({0: 3, 1: 2})
    assert schedule.step_count == 12
    push = next(a for a in run_to(schedule, 16) if isinstance(a, Push) and a.p == 0)
    assert schedule.waits_at(17) == [0, 1]  # fragment 1 was pushed at step 14
    [pull] = schedule.acked(0, 4, push.ticket)
    assert pull.newer_than == 3
    schedule.pulled(0, 4, 1, pull.ticket)
    assert schedule.waits_at(17) == [1]


def test_a_driver_that_waits_applies_each_merge_before_the_next_step() -> None:
    """The Flower adapter's use: H = 1, so every fragment is pushed at every step (a
    fit); once the answers are in, what came is applied before the next fit."""
    schedule = Schedule(ScheduleConfig(sync_every=1, fragments=2))
    schedule.start({0: 0, 1: 0}, {0: 1, 1: 1})
    pushes = [a for a in schedule.step(1, 10) if isinstance(a, Push)]
    assert [(a.p, a.base, a.tokens, a.steps) for a in pushes] == [(0, 0, 10, 1), (1, 0, 10, 1)]
    assert schedule.unanswered() == [0, 1]
    [pull_0] = schedule.acked(0, 1, pushes[0].ticket)
    [pull_1] = schedule.acked(1, None, pushes[1].ticket)  # not acknowledged: the newest
    assert (pull_0.newer_than, pull_1.newer_than) == (0, 0)
    schedule.pulled(0, 1, 5, pull_0.ticket)
    assert schedule.unanswered() == [1]
    schedule.pulled(1, None, 0, pull_1.ticket)  # none came within the pull's wait
    assert schedule.unanswered() == []
    assert schedule.apply_now() == [Apply(0, 1, 0.0, DEFAULT_CARRIES)]
    assert schedule.apply_now() == [] and schedule.versions() == {0: 1, 1: 0}
    # The next fit's pushes: fragment 0 from the merged version, fragment 1 from its own.
    assert [(a.p, a.base, a.steps) for a in schedule.step(2, 10) if isinstance(a, Push)] == [
        (0, 1, 1), (1, 0, 1)]


def test_an_assigned_h_takes_effect_at_the_next_cycle_boundary() -> None:
    schedule = started()  # H 4, offsets 0 and 2
    run_to(schedule, 1)
    schedule.assigned(8)
    # Fragment 0 is due at 4 under the old H: from there the offsets are those of 8
    # (0 and 4), so fragment 1 waits until 8 instead of 6, and its push holds all 8.
    pushes = [(a.p, a.step, a.steps) for a in run_to(schedule, 16) if isinstance(a, Push)]
    assert pushes == [(0, 4, 4), (1, 8, 8), (0, 12, 8), (1, 16, 8)]
    assert schedule.sync_every == 8


def test_an_assigned_h_before_start_is_the_one_it_starts_with() -> None:
    schedule = Schedule(ScheduleConfig(sync_every=1, fragments=2))
    schedule.assigned(6)
    schedule.start({0: 0, 1: 0})
    assert [(a.p, a.step) for a in run_to(schedule, 12) if isinstance(a, Push)] == [
        (0, 6), (1, 9), (0, 12)]


def test_assigning_the_h_in_force_again_cancels_one_waiting() -> None:
    schedule = started()
    schedule.assigned(6)
    schedule.assigned(4)
    pushes = [(a.p, a.step) for a in run_to(schedule, 8) if isinstance(a, Push)]
    assert pushes == [(0, 4), (1, 6), (0, 8)]


def test_a_bad_assignment_is_refused_and_changes_nothing() -> None:
    schedule = started(overlap=3)
    with pytest.raises(ValueError, match=re.escape("at least overlap (τ = 3), got 2")):
        schedule.assigned(2)
    assert [(a.p, a.step) for a in run_to(schedule, 6) if isinstance(a, Push)] == [
        (0, 4), (1, 6)]
    lockstep = Schedule(ScheduleConfig(sync_every=4, fragments=2, lockstep=True))
    with pytest.raises(ValueError, match="needs lockstep off"):
        lockstep.assigned(8)
    assert lockstep.sync_every == 4


def test_stale_answers_are_ignored() -> None:
    schedule = started()
    push = next(a for a in run_to(schedule, 4) if isinstance(a, Push) and a.p == 0)
    assert schedule.acked(0, 1, push.ticket + 100) == []
    schedule.pulled(0, 1, 1, push.ticket)  # a pull was never asked for
    assert schedule.phase(0) == Phase.ACKING


@pytest.mark.parametrize(("kwargs", "problem"), [
    ({"sync_every": 0}, "sync_every (H) must be >= 1"),
    ({"overlap": 5}, "overlap (τ) must be at most sync_every"),
    ({"alpha": 1.0}, "alpha must be in [0, 1)"),
    ({"alpha": 0.5, "rule": ApplyRule.CARRY}, "alpha must be 0"),
])
def test_bad_config_is_refused(kwargs: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        ScheduleConfig(**{"sync_every": 4, "fragments": 2, **kwargs})  # type: ignore[arg-type]


def test_bad_events_are_refused_and_change_nothing() -> None:
    schedule = Schedule(ScheduleConfig(sync_every=4, fragments=2))
    with pytest.raises(RuntimeError, match="before start"):
        schedule.step(1, 1)
    with pytest.raises(ValueError, match="a version for each of the 2 fragments"):
        schedule.start({0: 0})
    schedule.start({0: 0, 1: 0})
    schedule.step(1, 1)
    with pytest.raises(ValueError, match="step 1 is not after step 1"):
        schedule.step(1, 1)
    with pytest.raises(ValueError, match="fragment 7 is not one of the 2"):
        schedule.acked(7, 1, 1)
    assert schedule.step_count == 1 and schedule.versions() == {0: 0, 1: 0}


# -- the state machine against a reference model --------------------------------------


@dataclass
class _Ref:
    """What a fragment is waiting for, written as the rules read in DESIGN §2."""

    base: int = 0
    commit: int = 1
    steps: int = 0
    # The outstanding request: None, "ack" or "pull"; the ticket that answers it.
    waiting: str | None = None
    ticket: int = 0
    own: bool = False  # a pull for this learner's own push, which may fall back
    lost: bool = False  # a pull for a version committed again
    apply_at: int = 0
    result: tuple[int, int, bool] | None = None
    published: tuple[int, int] = (-1, 0)


class ScheduleMachine(RuleBasedStateMachine):
    H, P, TAU = 6, 2, 2

    def __init__(self) -> None:
        super().__init__()
        self.rule = ApplyRule.OVERWRITE
        self.start()
        self.ref = [_Ref() for _ in range(self.P)]
        self.k = 0
        self.stepped = [0] * self.P
        self.pushed = [0] * self.P
        self.discarded = [0] * self.P
        self.take: dict[int, int] = {}
        # The H in force, the step it took effect at (None: from the start), and one
        # assigned that waits for fragment 0's next due step.
        self.h, self.cycle, self.pending = self.H, None, None

    def start(self) -> None:
        self.schedule = Schedule(ScheduleConfig(self.H, self.P, self.TAU, rule=self.rule))
        self.schedule.start({0: 0, 1: 0}, {0: 1, 1: 1})

    @precondition(lambda self: self.k == 0)
    @rule(apply_rule=st.sampled_from(list(ApplyRule)))
    def choose_rule(self, apply_rule: ApplyRule) -> None:
        self.rule = apply_rule
        self.start()
        self.ref = [_Ref() for _ in range(self.P)]
        self.h, self.cycle, self.pending = self.H, None, None

    @rule(h=st.integers(TAU, 9))
    def assign(self, h: int) -> None:
        self.schedule.assigned(h)
        self.pending = None if h == self.h else h

    def due(self, p: int, k: int) -> bool:
        t = p * self.h // self.P
        if self.cycle is None:  # from the start: never at step t_p itself
            return k > t and (k - t) % self.h == 0
        return k >= self.cycle + t and (k - self.cycle - t) % self.h == 0

    def expect(self, k: int) -> list[Action]:
        """The actions step k should give, from the reference's rules; `take`
        says which action's ticket each fragment now waits on."""
        out: list[Action] = []
        self.take = {}
        boundary = self.rule == ApplyRule.BOUNDARY
        if self.pending is not None and self.due(0, k):
            self.h, self.cycle, self.pending = self.pending, k, None
        for p, r in enumerate(self.ref):
            if r.result is not None and k >= r.apply_at and not (boundary and self.due(p, k)):
                self.ref_apply(p, r, out)
            elif r.waiting is not None and r.own and k >= r.apply_at + self.TAU:
                r.own, r.waiting = False, "pull"
                out += [FallBack(p), Pull(p, r.base, -1)]
                self.take[p] = len(out) - 1
        for p, r in enumerate(self.ref):
            if not self.due(p, k):
                continue
            out.append(Push(p, r.base, -1, r.steps, k, -1))
            self.pushed[p] += r.steps
            r.steps = 0
            if r.result is not None and boundary:
                self.ref_apply(p, r, out)
            if r.result is None and (r.waiting is None or r.lost):
                r.waiting, r.own, r.lost = "ack", True, False
                r.apply_at = k + (self.h if boundary else self.TAU)
                self.take[p] = len(out) - 1 - (isinstance(out[-1], Apply))
        for p, r in enumerate(self.ref):
            version, commit = r.published
            # An unknown commit (0) on either side says nothing.
            if (r.waiting is None and r.result is None and version == r.base
                    and 0 not in (commit, r.commit) and commit != r.commit):
                r.waiting, r.own, r.lost, r.apply_at = "pull", False, True, k + 1
                out.append(Pull(p, version - 1, -1))
                self.take[p] = len(out) - 1
        return out

    def ref_apply(self, p: int, r: _Ref, out: list[Action]) -> None:
        assert r.result is not None
        version, commit, rewound = r.result
        r.result, r.waiting, r.own, r.lost = None, None, False, False
        if version > r.base or rewound or (version == r.base and commit not in (0, r.commit)):
            out.append(Apply(p, version, 0.0, self.rule == ApplyRule.CARRY))
            r.base, r.commit = version, commit
            if self.rule != ApplyRule.CARRY:
                self.discarded[p] += r.steps
                r.steps = 0

    @rule(n=st.integers(1, 5))
    def step(self, n: int) -> None:
        for _ in range(n):
            self.k += 1
            for p in range(self.P):
                self.stepped[p] += 1
                self.ref[p].steps += 1
            want = self.expect(self.k)
            got = self.schedule.step(self.k, 1)
            assert [shape(a) for a in got] == [shape(a) for a in want]
            for p, index in self.take.items():
                self.ref[p].ticket = got[index].ticket  # type: ignore[union-attr]

    @rule(p=st.integers(0, 1), target_version=st.one_of(st.none(), st.integers(0, 8)),
          refuse=st.booleans(), stale=st.booleans())
    def answer_push(self, p: int, target_version: int | None, refuse: bool, stale: bool) -> None:
        r = self.ref[p]
        ticket = r.ticket + (1000 if stale else 0)
        got = (self.schedule.refused(p, "stale", ticket) if refuse
               else self.schedule.acked(p, target_version, ticket))
        if r.waiting != "ack" or stale:
            assert got == []
            return
        want = (r.base if refuse or target_version is None
                else max(r.base, target_version - 1))
        r.waiting = "pull"
        assert [(a.p, a.newer_than) for a in got if isinstance(a, Pull)] == [(p, want)]
        r.ticket = got[0].ticket

    @rule(p=st.integers(0, 1), version=st.one_of(st.none(), st.integers(0, 8)),
          commit=st.integers(0, 3), rewound=st.booleans())
    def answer_pull(self, p: int, version: int | None, commit: int, rewound: bool) -> None:
        r = self.ref[p]
        self.schedule.pulled(p, version, commit, r.ticket, rewound)
        if r.waiting != "pull" or r.result is not None:
            return
        if version is None:
            r.waiting, r.own, r.lost = None, False, False
        else:
            r.result = (version, commit, rewound)

    @rule()
    def apply_now(self) -> None:
        want: list[Action] = []
        for p, r in enumerate(self.ref):
            if r.result is not None:
                self.ref_apply(p, r, want)
        assert [shape(a) for a in self.schedule.apply_now()] == [shape(a) for a in want]

    @rule(p=st.integers(0, 1), version=st.integers(0, 8), commit=st.integers(0, 3))
    def heartbeat(self, p: int, version: int, commit: int) -> None:
        self.schedule.published(p, version, commit)
        self.ref[p].published = (version, commit)

    @invariant()
    def same_versions(self) -> None:
        assert self.schedule.versions() == {p: r.base for p, r in enumerate(self.ref)}

    @invariant()
    def unanswered_are_the_requests_without_a_result(self) -> None:
        assert self.schedule.unanswered() == [
            p for p, r in enumerate(self.ref) if r.waiting is not None and r.result is None]

    @invariant()
    def every_step_is_pushed_discarded_or_still_held(self) -> None:
        for p in range(self.P):
            held, _ = self.schedule.held(p)
            assert self.stepped[p] == self.pushed[p] + self.discarded[p] + held


def shape(a: Action) -> tuple[object, ...]:
    """An action without its ticket (the reference does not number requests)."""
    if isinstance(a, Push):
        return ("push", a.p, a.base, a.steps, a.step)
    if isinstance(a, Pull):
        return ("pull", a.p, a.newer_than)
    return (type(a).__name__, *a)


ScheduleMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                             deadline=None)
TestScheduleMachine = ScheduleMachine.TestCase
