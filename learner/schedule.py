"""The learner's schedule: a pure state machine of when to push, pull and apply.

Fragment p is due after local step k when `k > t_p` and `(k − t_p) mod H == 0`
with `t_p = floor(p·H/P)`. A due fragment's outer gradient is pushed; the
version that merges it is pulled once the push is acknowledged (its target
version is known) and applied τ steps after the push, or as soon after as it
has come. When it is still missing τ steps after that, the machine falls back
to the newest version instead: waiting on would age the base until pushes are
refused as stale. A version the coordinator reports under another commit
than the one applied (it lost it and committed the number again) is pulled at
once; a coordinator whose newest version is older than ours (a rewind) is
followed. In lock-step the learner waits for each merge instead of falling
back, and a learner joining mid-run resumes at the step that keeps it in
phase with the others.

With `sync_every = "auto"` the coordinator assigns H (`assigned`). A new H
takes effect at a cycle boundary, the next step at which fragment 0 is due:
from that step k₀ on, fragment p is due at `k₀ + t_p + n·H` with the new
offsets, so the fragments stay staggered and no push is cut short.

The machine does no I/O and reads no clock: the streaming runtime
(`learner.streaming.FragmentSync`), the Flower adapter (`learner.flower`) and
the simulator (`chaos.sim`) feed it events (`step`, `acked`, `refused`,
`pulled`, `published`, `assigned`) and carry out the actions it returns (`Push`,
`Pull`, `Apply`, `FallBack`) in order; the Flower adapter steps once per fit and,
before the next fit, waits for every answer and applies what came
(`unanswered`, `apply_now`). What an apply keeps of the local steps since
the push (`ApplyRule`) is decided here too, so all three drivers count the
same work as kept or lost.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, NamedTuple

from protos.settings import check


class ApplyRule(enum.Enum):
    """What applying a merged version does with the steps trained since the push.

    - `overwrite`: θ ← α·θ + (1−α)·Θ_new, τ steps after the push; with α = 0 the
      local progress since the push is lost.
    - `carry` (the default, `DEFAULT_RULE`): θ ← Θ_new + (θ − θ_push), τ steps
      after the push: the progress since the push rides on the merged version and
      into the next push (DiLoCo's eager updates).
    - `boundary`: applied at the fragment's next due step, right after that
      step's push, which has already sent the progress since the last push.
    """

    OVERWRITE = "overwrite"
    CARRY = "carry"
    BOUNDARY = "boundary"


# Chosen by held-out loss and goodput together (BENCHMARKS.md, "What an apply keeps of
# the steps since the push"): `carry` kept 99% of the steps, and its held-out loss was
# 3-5% below the overwrite's at H = 20 and 0.5% above it at H = 40.
DEFAULT_RULE: Final = ApplyRule.CARRY


class Phase(enum.IntEnum):
    """Where a fragment's pull stands (integers: the simulator looks them up
    millions of times, and an int hashes in C)."""

    IDLE = 0       # no pull outstanding
    ACKING = 1     # pushed; its pull starts once the push's target is known
    OWN = 2        # pulling the version that holds this learner's push
    FALLBACK = 3   # the own version was late: pulling the newest instead
    LOST = 4       # the applied version was lost: pulling its replacement
    READY = 5      # a pulled version waits for its apply step


class Event(enum.IntEnum):
    PUSH = 0
    ACKED = 1
    REFUSED = 2
    LATE = 3
    LOST = 4
    PULLED = 5
    EMPTY = 6
    APPLY = 7


# Module constants for the hot paths: an enum member looked up on its class costs
# several times a global's lookup, and the simulator steps millions of times.
_IDLE, _ACKING, _OWN, _FALLBACK, _LOST, _READY = Phase
_PUSH, _ACKED, _REFUSED, _LATE, _LOST_SEEN, _PULLED, _EMPTY, _APPLY = Event

# The whole machine per fragment: (phase, event) -> next phase. A pair that is
# not here leaves the phase as it is (a push while a pull is outstanding starts
# no second one; an ack or pull result for a superseded request is ignored).
TRANSITIONS: Mapping[tuple[Phase, Event], Phase] = {
    (Phase.IDLE, Event.PUSH): Phase.ACKING,
    (Phase.IDLE, Event.LOST): Phase.LOST,
    (Phase.ACKING, Event.ACKED): Phase.OWN,
    (Phase.ACKING, Event.REFUSED): Phase.OWN,
    (Phase.ACKING, Event.LATE): Phase.FALLBACK,
    (Phase.OWN, Event.LATE): Phase.FALLBACK,
    (Phase.OWN, Event.PULLED): Phase.READY,
    (Phase.OWN, Event.EMPTY): Phase.IDLE,
    (Phase.FALLBACK, Event.PULLED): Phase.READY,
    (Phase.FALLBACK, Event.EMPTY): Phase.IDLE,
    # This push's own pull brings a version past the one committed again.
    (Phase.LOST, Event.PUSH): Phase.ACKING,
    (Phase.LOST, Event.PULLED): Phase.READY,
    (Phase.LOST, Event.EMPTY): Phase.IDLE,
    (Phase.READY, Event.APPLY): Phase.IDLE,
}
_PULLING = frozenset({Phase.OWN, Phase.FALLBACK, Phase.LOST})
_UNANSWERED = _PULLING | {Phase.ACKING}
# Waiting for its own version: falls back when that is late.
_LATE_ABLE = frozenset({Phase.ACKING, Phase.OWN})


class Push(NamedTuple):
    """Send fragment p's outer gradient since the last push (or apply), measured
    from version `base`; `ticket` names it in the `acked`/`refused` that answer."""

    p: int
    base: int
    tokens: int
    steps: int
    step: int
    ticket: int


class Pull(NamedTuple):
    """Pull fragment p's first version newer than `newer_than`; answer with `pulled`
    carrying `ticket` (a newer Pull of the fragment supersedes this one)."""

    p: int
    newer_than: int
    ticket: int


class Apply(NamedTuple):
    """Write the pulled version of fragment p: `θ ← α·θ + (1−α)·Θ` or, with `carry`,
    `θ ← Θ + (θ − θ_push)`; the new base is Θ. Without `carry` the steps since the
    last push are discarded (the driver restarts its work clock)."""

    p: int
    version: int
    alpha: float
    carry: bool


class FallBack(NamedTuple):
    """Fragment p's own version is late: the pull under way is cancelled (a Pull of
    the newest version follows)."""

    p: int


# Named tuples, not frozen dataclasses: the simulator makes hundreds of thousands.
Action = Push | Pull | Apply | FallBack


def offsets(sync_every: int, fragments: int) -> list[int]:
    """t_p = floor(p·H/P): fragments are due at staggered steps."""
    return [p * sync_every // fragments for p in range(fragments)]


def lockstep_resume_step(versions: Mapping[int, int], sync_every: int) -> int:
    """The local step a learner joining a lock-step run resumes at.

    In lock-step every learner pushes fragment p for version v at step
    `t_p + v·H`. A learner that restarted at step 0 would push in another
    phase than the others, and each side would wait for a round the other
    has not reached. Resuming at `max_p (t_p + v_p·H)` over the published
    versions (0 for a fragment at v0) makes its next push of every fragment
    the one for version `v_p + 1`."""
    starts = offsets(sync_every, len(versions))
    return max((starts[p] + v * sync_every if v > 0 else 0 for p, v in versions.items()),
               default=0)


@dataclass(frozen=True)
class ScheduleConfig:
    # H, the steps between two pushes of a fragment (the coordinator may assign
    # another: `Schedule.assigned`).
    sync_every: int
    fragments: int
    overlap: int = 1
    alpha: float = 0.0
    lockstep: bool = False
    rule: ApplyRule = DEFAULT_RULE

    def __post_init__(self) -> None:
        check(self, [
            (self.sync_every >= 1, "sync_every", "(H) must be >= 1"),
            (self.fragments >= 1, "fragments", "must be >= 1"),
            (self.overlap >= 1, "overlap", "(τ) must be >= 1"),
            # The fragment would come due again before its merge is applied.
            (self.overlap <= self.sync_every, "overlap",
             f"(τ) must be at most sync_every (H = {self.sync_every})"),
            (0.0 <= self.alpha < 1.0, "alpha", "must be in [0, 1)"),
            (self.alpha == 0.0 or self.rule == ApplyRule.OVERWRITE, "alpha",
             f"must be 0 with apply rule {self.rule.value}: it applies the merged values "
             f"whole (α blends them in under the overwrite rule)"),
        ])


class _Fragment:
    __slots__ = ("apply_at", "base", "commit", "due", "fell_back", "phase", "published",
                 "ready", "step_mark", "ticket", "token_mark", "want")

    def __init__(self, base: int, commit: int, due: int) -> None:
        self.phase = _IDLE
        self.base, self.commit = base, commit
        # The next step at which the fragment is due.
        self.due = due
        # The learner's step and token totals when its work was last pushed or
        # discarded: what it holds is the difference.
        self.step_mark = self.token_mark = 0
        self.apply_at = 0
        # The outstanding push or pull's ticket; answers with another are stale.
        self.ticket = 0
        # The pull waits for a version above this.
        self.want = base
        self.fell_back = False
        self.ready: tuple[int, int, bool] | None = None  # version, commit id, rewound
        self.published = (-1, 0)


class Schedule:
    """One learner's schedule over all its fragments, from `start` on. Cheap per
    step (the simulator runs millions): each fragment knows its next due step."""

    def __init__(self, config: ScheduleConfig) -> None:
        self.config = config
        self._boundary = config.rule == ApplyRule.BOUNDARY
        self._carry = config.rule == ApplyRule.CARRY
        # The H in force, and one assigned that waits for the next cycle boundary.
        self.sync_every = config.sync_every
        self._assigned: int | None = None
        self.offsets = offsets(config.sync_every, config.fragments)
        self.step_count = 0
        self.fragments: list[_Fragment] = []
        self._tokens = 0
        self._tickets = 0
        # The first step at which some fragment is due.
        self._due = 0
        # Whether `published` was ever told a commit: only then can a version be lost.
        self._reported = False
        # `next_step`, until an event changes the state it is computed from.
        self._next: int | None = None

    # -- events ------------------------------------------------------------------------

    def start(self, versions: Mapping[int, int], commits: Mapping[int, int] | None = None,
              step: int | None = None) -> None:
        """Caught up at `versions` (every fragment): counting starts here, at
        `step` (default 0; in lock-step, the step that keeps it in phase)."""
        if sorted(versions) != list(range(self.config.fragments)):
            raise ValueError(f"start needs a version for each of the {self.config.fragments} "
                             f"fragments, got {sorted(versions)}")
        if step is None:
            step = (lockstep_resume_step(versions, self.config.sync_every)
                    if self.config.lockstep else 0)
        commits = commits or {}
        h = self.sync_every
        self.step_count = step
        self.fragments = [_Fragment(versions[p], commits.get(p, 0),
                                    t + h * max(1, (step - t) // h + 1))
                          for p, t in enumerate(self.offsets)]
        for f in self.fragments:
            f.step_mark = step
        self._due = min(f.due for f in self.fragments)
        self._next = None

    def step(self, k: int, tokens: int) -> list[Action]:
        """Local step k is done (k may skip steps at which, per `next_step`, nothing
        happens), with `tokens` trained since the previous call."""
        if not self.fragments:
            raise RuntimeError("step() before start(): the schedule has no base versions")
        if k <= self.step_count:
            raise ValueError(f"step {k} is not after step {self.step_count}")
        self.step_count = k
        self._tokens += tokens
        self._next = None
        config = self.config
        actions: list[Action] = []
        boundary = self._boundary
        if self._assigned is not None and k >= self._due:
            self._realign(k)
        for p, f in enumerate(self.fragments):
            phase = f.phase
            if phase == _IDLE:
                continue
            if phase == _READY:
                if k >= f.apply_at and not (boundary and k == f.due):
                    self._apply(p, f, actions)
            elif (phase in _LATE_ABLE and not config.lockstep and not f.fell_back
                  and k >= f.apply_at + config.overlap):
                self._fall_back(p, f, actions)
        if k >= self._due:
            h = self.sync_every
            for p, f in enumerate(self.fragments):
                if f.due < k:  # a driver skipped past it: due again a period later
                    f.due += h * ((k - f.due + h - 1) // h)
                if f.due != k:
                    continue
                f.due += h
                ready = f.phase == _READY
                push = self._push(p, f, k, actions)
                if boundary and ready:
                    # Sent first, the progress since the last push is kept.
                    self._apply(p, f, actions)
                    self._awaits(f, push, k)
            self._due = min(f.due for f in self.fragments)
        # After the pushes: a fragment pushed just now has its own pull under way.
        if self._reported and not config.lockstep:
            for p, f in enumerate(self.fragments):
                self._check_history(p, f, k, actions)
        return actions

    def apply_now(self) -> list[Action]:
        """Apply every pulled version at the current step instead of at its own
        apply step. For a driver whose next step must start from this one's merge
        and that waits for `unanswered` to empty first: the Flower adapter, where a
        step is a whole fit and the next fit trains on the merged fragments."""
        actions: list[Action] = []
        for p, f in enumerate(self.fragments):
            if f.phase == _READY:
                self._apply(p, f, actions)
        self._next = None
        return actions

    def flush(self) -> list[Action]:
        """Pushes of the work not yet pushed (closing: nothing more is pulled)."""
        actions: list[Action] = []
        for p, f in enumerate(self.fragments):
            if self.step_count > f.step_mark:
                actions.append(self._push_action(p, f, self.step_count))
        return actions

    def acked(self, p: int, target_version: int | None, ticket: int) -> list[Pull]:
        """The push `ticket` will be merged into `target_version` (None: it was
        not acknowledged, e.g. dropped from the backlog or unsent)."""
        f = self._fragment(p)
        if ticket != f.ticket or f.phase != _ACKING:
            return []
        f.phase = TRANSITIONS[(f.phase, _ACKED)]
        self._next = None
        # The first version that holds the push: an earlier one (another learner's
        # round) lacks the progress just pushed. In lock-step, any next version: a
        # push that missed its round waits for the next one, which needs the
        # others' next pushes, which wait for this learner.
        if target_version is not None and not self.config.lockstep:
            f.want = max(f.base, target_version - 1)
        return [self._pull(p, f)]

    def refused(self, p: int, reason: str, ticket: int) -> list[Pull]:
        """The push `ticket` was refused (`reason`): its progress is gone; the
        learner catches up on the newest version."""
        f = self._fragment(p)
        if ticket != f.ticket or f.phase != _ACKING:
            return []
        f.phase = TRANSITIONS[(f.phase, _REFUSED)]
        self._next = None
        return [self._pull(p, f)]

    def pulled(self, p: int, version: int | None, commit_id: int, ticket: int,
               rewound: bool = False) -> bool:
        """The pull `ticket` brought `version` (None: none came within its wait,
        or it failed; the next push pulls again). False when that pull was
        superseded: the driver drops what it brought."""
        f = self._fragment(p)
        if ticket != f.ticket or f.phase not in _PULLING:
            return False
        self._next = None
        if version is None:
            f.phase = TRANSITIONS[(f.phase, _EMPTY)]
            return False
        f.phase = TRANSITIONS[(f.phase, _PULLED)]
        f.ready = (version, commit_id, rewound)
        return True

    def assigned(self, sync_every: int) -> None:
        """The coordinator assigns H = `sync_every`. Before `start` the schedule
        starts with it; after, it takes effect at the next step at which fragment 0
        is due (a later assignment before then replaces this one)."""
        if self.config.lockstep:
            raise ValueError("an assigned sync_every needs lockstep off: lock-step "
                             "resumes learners in phase by one H for all")
        if sync_every < self.config.overlap:
            raise ValueError(f"assigned sync_every (H) must be at least overlap (τ = "
                             f"{self.config.overlap}), got {sync_every}")
        self._next = None
        if not self.fragments:
            self.sync_every = sync_every
            self.offsets = offsets(sync_every, self.config.fragments)
            return
        self._assigned = None if sync_every == self.sync_every else sync_every

    def published(self, p: int, version: int, commit_id: int) -> None:
        """The coordinator publishes `version` of p under `commit_id` (heartbeats)."""
        self._fragment(p).published = (version, commit_id)
        self._reported = self._reported or commit_id != 0

    # -- queries -----------------------------------------------------------------------

    def phase(self, p: int) -> Phase:
        return self._fragment(p).phase

    def version(self, p: int) -> int:
        """The version fragment p's next push is measured from."""
        return self._fragment(p).base

    def versions(self) -> dict[int, int]:
        return {p: f.base for p, f in enumerate(self.fragments)}

    def held(self, p: int) -> tuple[int, int]:
        """The steps and tokens of fragment p's work not yet pushed (nor discarded)."""
        f = self._fragment(p)
        return self.step_count - f.step_mark, self._tokens - f.token_mark

    def unanswered(self) -> list[int]:
        """The fragments whose push or pull is still to be answered (`acked` or
        `refused`, `pulled`)."""
        return [p for p, f in enumerate(self.fragments) if f.phase in _UNANSWERED]

    def waits_at(self, k: int) -> list[int]:
        """Lock-step: the fragments whose pull result `step(k)` needs first (the
        driver blocks until it has fed them in)."""
        if not self.config.lockstep:
            return []
        return [p for p, f in enumerate(self.fragments)
                if f.phase in _LATE_ABLE and k >= f.apply_at]

    def next_step(self) -> int:
        """The first step after the current one at which `step` may act: a due
        fragment, a ready apply, a fall-back. Drivers that skip steps (the
        simulator) call `step` there; a pull result can bring it earlier."""
        if self._next is not None:
            return self._next
        k, soonest = self.step_count, self._due
        late = not self.config.lockstep
        for f in self.fragments:
            phase = f.phase
            if phase == _IDLE:
                continue
            if phase == _READY:
                at = f.apply_at
            elif late and phase in _LATE_ABLE and not f.fell_back:
                at = f.apply_at + self.config.overlap
            else:
                continue
            if at < soonest:
                soonest = at if at > k else k + 1
        self._next = soonest
        return soonest

    # -- the rules ---------------------------------------------------------------------

    def _fragment(self, p: int) -> _Fragment:
        if not 0 <= p < len(self.fragments):
            raise ValueError(f"fragment {p} is not one of the {len(self.fragments)} started")
        return self.fragments[p]

    def _realign(self, k: int) -> None:
        """At a cycle boundary (fragment 0 due at k) take the assigned H: fragment
        p is next due at k + t_p with the new offsets (fragment 0 now)."""
        h, zero = self.sync_every, self.fragments[0]
        if zero.due < k:  # a driver skipped past it
            zero.due += h * ((k - zero.due + h - 1) // h)
        if zero.due != k or self._assigned is None:
            return
        self.sync_every, self._assigned = self._assigned, None
        self.offsets = offsets(self.sync_every, self.config.fragments)
        for f, t in zip(self.fragments, self.offsets, strict=True):
            f.due = k + t
        self._due = k

    def _push_action(self, p: int, f: _Fragment, k: int) -> Push:
        self._tickets += 1
        push = Push(p, f.base, self._tokens - f.token_mark, k - f.step_mark, k, self._tickets)
        f.step_mark, f.token_mark = k, self._tokens
        return push

    def _push(self, p: int, f: _Fragment, k: int, actions: list[Action]) -> Push:
        push = self._push_action(p, f, k)
        actions.append(push)
        self._awaits(f, push, k)
        return push

    def _awaits(self, f: _Fragment, push: Push, k: int) -> None:
        """A push starts a pull of the version that merges it, unless one is
        outstanding."""
        phase = TRANSITIONS.get((f.phase, _PUSH), f.phase)
        if phase != _ACKING or f.phase == _ACKING:
            return
        f.phase = phase
        f.ticket = push.ticket
        f.want, f.fell_back = f.base, False
        gap = self.sync_every if self._boundary else self.config.overlap
        f.apply_at = k + gap

    def _pull(self, p: int, f: _Fragment) -> Pull:
        self._tickets += 1
        f.ticket = self._tickets
        return Pull(p, f.want, f.ticket)

    def _fall_back(self, p: int, f: _Fragment, actions: list[Action]) -> None:
        f.phase = TRANSITIONS[(f.phase, _LATE)]
        f.fell_back = True
        f.want = f.base
        actions.append(FallBack(p))
        actions.append(self._pull(p, f))

    def _apply(self, p: int, f: _Fragment, actions: list[Action]) -> None:
        assert f.ready is not None
        version, commit, rewound = f.ready
        f.phase = TRANSITIONS[(f.phase, _APPLY)]
        f.ready = None
        if not (version > f.base or rewound
                or (version == f.base and commit not in (0, f.commit))):
            return  # nothing newer than what the fragment holds
        carry = self._carry
        actions.append(Apply(p, version, self.config.alpha, carry))
        f.base, f.commit = version, commit
        if not carry:
            f.step_mark, f.token_mark = self.step_count, self._tokens

    def _check_history(self, p: int, f: _Fragment, k: int, actions: list[Action]) -> None:
        """The coordinator reports this fragment's version under another commit: it
        lost the one applied here (a failover under async replication, a restored
        state directory) and committed the number again. Take its version now
        rather than train on from a history that is gone. Not in lock-step: applied
        just before a due push, it would leave that push empty, and the round that
        needs it waiting; there every round's pull brings the new history anyway."""
        version, commit = f.published
        if (f.phase != _IDLE or version != f.base
                or 0 in (commit, f.commit) or commit == f.commit):
            return
        f.phase = TRANSITIONS[(f.phase, _LOST_SEEN)]
        f.apply_at, f.fell_back, f.want = k + 1, True, version - 1
        actions.append(self._pull(p, f))
