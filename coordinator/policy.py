"""The synchronizer's policy: a pure core, no I/O, clock injected.

It asks a membership (`coordinator.membership`) who is live and decides
which contributions are admitted and with what weight, when each
fragment's open round closes, and what every committed version's manifest
is. It never touches a socket, a file, a tensor or a
clock: the gRPC shell (`coordinator.service`), the chaos harness and the
simulator feed it events with a time `now` and act on what it answers. That
is what makes every policy test deterministic and lets the simulator run the
very rules the daemon runs.

Per fragment there is one open round at a time. A round closes once it has
contributions from at least `min_quorum` distinct learners and then either
every live learner has contributed or its grace window has ended:

    grace = clamp(γ · (τ · ξ_step − ξ_quorum − ξ_sync), 0, grace_max)

and contributions are weighted `c_tokens · (c_tokens / c_steps) · (1 + s)^−a`
with `s` the staleness in versions. A closed round also says how large an outer
step it deserves (`RoundClose.step_scale`): the share of the live learners it
merged over one plus its mean staleness.

With `min_quorum = "auto"` each round chooses its own quorum K when it opens
(`choose_quorum`): the K that maximises estimated progress per second, progress
`1 / (1 + ν/K)` for a noise ratio ν = σ²/‖g‖² estimated from what rounds merged
(the merged outer gradient's squared norm against the contributions' own, an
EWMA; a fragment that has not measured its own yet takes the others'), time
from the live learners' recent push intervals (each one's median, not its mean):
a round of K waits for the K-th fastest.

With `sync_every = "auto"` a learner takes its H, the local steps between two
pushes of a fragment, from the coordinator (`choose_sync_every`): every such
learner is given the same wall-clock period, `h_max` steps of the fastest, so
H_i ≈ h_max · ξ_fastest / ξ_i within [h_min, h_max]. A learner four times slower
gets a quarter of the steps and pushes each fragment as often as the others, so
their pushes meet in one round instead of the slow one's arriving versions behind.

A round holds one contribution per learner and base version: a second push of
a learner against the base of one it has in the open round replaces it (each
push carries the progress since the learner's previous one, so the newer stands
for both, counted once).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from coordinator.errors import Reason, Rejected
from coordinator.membership import HeartbeatTable, Membership
from protos.contribution import ContributionId
from protos.metadata import MERGED_SEQ
from protos.settings import check

MergeRule = Literal["mean", "rda"]
# Why a round closed: every live learner had contributed, its grace window ran
# out, it reached quorum with no grace window to wait (sync mode, or no time
# left in the budget), or it had quorum as its coordinator drained (Admin.Drain),
# which waits out no grace window.
CloseReason = Literal["all_live", "grace_ended", "no_grace", "draining"]

# Smoothing of the running timing estimates (ξ_step, ξ_sync) and of the gradient
# signal and noise behind the automatic quorum.
_EWMA = 0.3
# Push intervals kept per learner for the automatic quorum's arrival model.
_INTERVALS = 16
# The largest c_tokens²/c_steps taken (4M-token steps summed over 500 steps give
# 8e15): merging pre-multiplies fp32 values by the weight, which must stay finite.
MAX_TOKEN_WEIGHT = float(2**64)
# The largest seq taken: `JoinResponse.next_seq` (a uint64) is one above every seq a
# learner used, so 2^64-1 would leave it none to hand out.
MAX_SEQ = 2**64 - 2
# Seqs are reserved durably this many ahead (`Policy.reservation`), so that a restarted
# coordinator hands out next_seq above every seq acknowledged before, open rounds
# included, at one durable write per learner every SEQ_BLOCK contributions.
SEQ_BLOCK = 1 << 10


@dataclass(frozen=True)
class PolicyConfig:
    """The knobs of the policy; sync mode is just `min_quorum = M, grace_max_s = 0`."""

    # Distinct learners a round needs, or "auto": each round chooses (`choose_quorum`).
    min_quorum: int | Literal["auto"] = 1
    # The largest quorum "auto" chooses; 0: every live learner.
    min_quorum_max: int = 0
    gamma: float = 0.5
    grace_max_s: float = 5.0
    staleness_exponent: float = 0.5
    max_staleness: int = 8
    merge: MergeRule = "mean"
    heartbeat_timeout_s: float = 10.0
    default_overlap_steps: int = 1
    # Bounds of the H assigned to learners that ask for one (`sync_every = "auto"`):
    # the fastest gets h_max, none fewer than h_min (nor than its own τ).
    h_min: int = 4
    h_max: int = 50

    def __post_init__(self) -> None:
        checks = [
            (self.min_quorum == "auto" or (isinstance(self.min_quorum, int)
                                           and self.min_quorum >= 1),
             "min_quorum", "must be at least 1 or \"auto\""),
            (self.min_quorum_max >= 0, "min_quorum_max", "must be >= 0 (0: no ceiling)"),
            (0.0 <= self.gamma <= 1.0, "gamma", "must be in [0, 1]"),
            (self.grace_max_s >= 0.0, "grace_max_s", "must be >= 0"),
            (self.staleness_exponent >= 0.0, "staleness_exponent", "must be >= 0"),
            (self.max_staleness >= 0, "max_staleness", "must be >= 0"),
            (self.merge in ("mean", "rda"), "merge", "must be 'mean' or 'rda'"),
            (self.heartbeat_timeout_s > 0.0, "heartbeat_timeout_s", "must be > 0"),
            (self.default_overlap_steps >= 1, "default_overlap_steps", "must be >= 1"),
            (self.h_min >= 1, "h_min", "must be >= 1"),
            (self.h_max >= self.h_min, "h_max", f"must be >= policy.h_min ({self.h_min})"),
        ]
        check(self, checks, "policy.")


@dataclass(frozen=True)
class Offer:
    """A contribution's header, as it arrives before its bytes: who, which fragment
    and seq (`id`), and the version its outer gradient was measured from."""

    id: ContributionId
    base_version: int
    c_tokens: int
    c_steps: int
    local_step: int


@dataclass(frozen=True)
class Admission:
    """An offer the policy would accept now, and with what weight; `replaces` is
    the learner's contribution against the same base that it would replace in the
    open round (it then takes over that one's weight)."""

    offer: Offer
    weight: float
    staleness: int
    target_version: int
    replaces: ContributionId | None = None


@dataclass(frozen=True)
class MergedContribution:
    """One contribution of a closed round. `replaced_by` is the seq of the push of
    the same learner and base that replaced it: its work is merged (the newer push
    carries the progress since it) and its weight, now 0, counts there."""

    id: ContributionId
    base_version: int
    weight: float
    staleness: int
    replaced_by: int | None = None


@dataclass(frozen=True)
class QuorumChoice:
    """The quorum a round chose and what it was chosen from: `noise_ratio` ν =
    σ²/‖g‖² (None before any round could measure it), `cycles_s[k-1]` the k-th
    shortest push interval among the live learners (the time a round takes to gather
    fresh work from k of them), `fixed_s` the time every round costs whatever its K
    (merge and publish), `rates[k-1]` the estimated progress per second with k."""

    quorum: int
    noise_ratio: float | None
    cycles_s: tuple[float, ...]
    fixed_s: float
    rates: tuple[float, ...]


def choose_quorum(noise_ratio: float | None, cycles_s: Sequence[float], fixed_s: float,
                  ceiling: int) -> QuorumChoice:
    """The K in 1..min(len(cycles_s), ceiling) with the most progress per second.

    A round of K contributions merges K learners' work, each worth `1/(1 + ν/K)` of
    noiseless work at noise ratio ν (the gain of a K-fold batch: DBW, McCandlish et
    al.'s noise scale), and takes `fixed_s + cycles_s[K-1]`: rate(K) = K·gain(K)/time.
    Work not waited for is not lost (it comes in the next round, older), so only the
    wait for a slow learner, not the count, argues for a smaller K; noise argues for
    a larger one. Before ν is known it waits for two: a round of two or more
    learners is what measures it, and waiting for all would leave the faster
    learners replacing their pushes, which measures nothing. Near ties go to the
    larger K."""
    top = max(1, min(len(cycles_s), ceiling))
    if noise_ratio is None:
        return QuorumChoice(min(2, top), None, tuple(cycles_s[:top]), fixed_s, ())
    rates = tuple(k / (1.0 + noise_ratio / k) / max(fixed_s + cycles_s[k - 1], 1e-9)
                  for k in range(1, top + 1))
    best = max(rates)
    quorum = max(k for k in range(1, top + 1) if rates[k - 1] >= best * (1 - 1e-9))
    return QuorumChoice(quorum, noise_ratio, tuple(cycles_s[:top]), fixed_s, rates)


@dataclass(frozen=True)
class SyncEveryChoice:
    """The H assigned to one learner and what it came from: `step_s` its measured
    step time (None: not measured yet; then it was taken at the median of those
    measured), `period_s` the wall-clock period every assigned learner is fitted to
    (None before any step time is known: then H is h_max), `previous` the H it was
    assigned before (0: none)."""

    sync_every: int
    step_s: float | None
    period_s: float | None
    previous: int = 0


def choose_sync_every(step_times: Mapping[str, float | None], overlaps: Mapping[str, int],
                      h_min: int, h_max: int) -> dict[str, SyncEveryChoice]:
    """Each learner's H, so that all push each fragment once per the same period.

    The period is h_max steps of the fastest learner; learner i gets
    H_i = round(period / ξ_i) clamped to [max(h_min, τ_i), h_max] (the schedule needs
    H ≥ τ): a learner k times slower does k times fewer steps per period, so its
    push of a fragment comes with the others' instead of k rounds behind them. A
    learner whose step time is not measured yet is taken at the median of those
    measured. The weights still count each push's c_tokens and c_steps, so a learner
    with more steps counts for its work."""
    known = sorted(s for s in step_times.values() if s is not None and s > 0)
    period = h_max * known[0] if known else None
    typical = known[len(known) // 2] if known else None
    choices = {}
    for lid, step_s in step_times.items():
        low = max(h_min, overlaps.get(lid, 1))
        each = step_s if step_s is not None and step_s > 0 else typical
        h = h_max if period is None or each is None else math.floor(period / each + 0.5)
        choices[lid] = SyncEveryChoice(min(max(h, low), max(h_max, low)), step_s, period)
    return choices


@dataclass(frozen=True)
class RoundClose:
    """A closed round: the version it commits as and its manifest."""

    fragment: int
    version: int
    manifest: tuple[MergedContribution, ...]
    opened_at: float
    quorum_at: float
    closed_at: float
    grace_s: float
    why: CloseReason
    # Live learners at the close, those merged included.
    live: int = 1
    # The quorum this round needed, and with "auto" how it was chosen.
    quorum: int = 1
    choice: QuorumChoice | None = None

    @property
    def total_weight(self) -> float:
        return sum(c.weight for c in self.manifest)

    @property
    def mean_staleness(self) -> float:
        """Weighted mean staleness of the merged contributions: how many versions
        behind the outer gradient this round applies is."""
        total = self.total_weight
        if total <= 0:
            return 0.0
        return sum(c.weight * c.staleness for c in self.manifest) / total

    @property
    def step_scale(self) -> float:
        """What the outer step's lr and momentum are multiplied by: 1 for a round that
        merged every live learner at their current versions (DiLoCo's lock-step
        round), less for one that merged a share of them, or outer gradients taken
        from older versions. Momentum on delayed gradients diverges (a delay of d
        rounds needs lr and momentum about 1/(1+d) of DiLoCo's, BENCHMARKS.md
        "Outer defaults"), and each of several rounds that merge one learner's
        work apart would otherwise step as far as one that merges all."""
        learners = len({c.id.learner_id for c in self.manifest})
        share = min(learners / max(self.live, 1), 1.0)
        return share / (1.0 + self.mean_staleness)


@dataclass
class _Learner:
    overlap_steps: int
    joined_at: float
    last_seen: float
    # Whether it takes its H from the coordinator (`sync_every = "auto"`), and the
    # one it was last assigned (0: none yet).
    auto_sync_every: bool = False
    sync_every: int = 0
    # The first seq of its current life (the `next_seq` its last Join was given). A
    # push of a life that ended (the process restarted) is never replaced by one since:
    # the new life's outer gradient holds none of the old one's progress.
    first_seq: int = 1
    left: bool = False
    local_step: int = 0
    step_sample_at: float | None = None
    # Seconds and steps between two samples, each averaged: their ratio is the step
    # time. Averaging the per-sample ratio instead is biased when a beat sees whole
    # steps only (1 or 2 steps a second average 0.75 s a step, not 0.67).
    sampled_s: float | None = None
    sampled_steps: float | None = None
    # The automatic quorum's arrival model: when it last pushed each fragment, and
    # its recent intervals between two pushes of one fragment.
    pushed_at: dict[int, float] = field(default_factory=dict)
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=_INTERVALS))

    @property
    def step_time_s(self) -> float | None:
        if self.sampled_s is None or not self.sampled_steps:
            return None
        return self.sampled_s / self.sampled_steps

    def push_interval(self) -> float | None:
        """The median of its recent push intervals: robust to the odd slow round."""
        if not self.intervals:
            return None
        ordered = sorted(self.intervals)
        return ordered[len(ordered) // 2]


@dataclass
class _Round:
    version: int  # the version this round commits as
    contributions: list[MergedContribution] = field(default_factory=list)
    opened_at: float | None = None  # first contribution's arrival
    quorum_at: float | None = None
    deadline: float | None = None
    grace_s: float = 0.0
    quorum: int = 1
    choice: QuorumChoice | None = None
    # Σ Δ² of each contribution (by seq), for the noise estimate.
    norms_sq: dict[tuple[str, int], float] = field(default_factory=dict)

    def learners(self) -> set[str]:
        return {c.id.learner_id for c in self.contributions}

    def standing(self, learner_id: str, base_version: int, first_seq: int) -> int | None:
        """Index of the learner's contribution against `base_version`, of its
        current life (seq from `first_seq` on), that no later push has replaced, if
        the round holds one."""
        for i, c in enumerate(self.contributions):
            if (c.id.learner_id == learner_id and c.base_version == base_version
                    and c.id.seq >= first_seq and c.replaced_by is None):
                return i
        return None


@dataclass
class _Fragment:
    version: int  # -1: no initial value yet
    round: _Round
    sync_time_s: float | None = None
    # Highest merged seq per learner: anything at or below it is done with.
    merged_seq: dict[str, int] = field(default_factory=dict)
    # EWMAs of the outer gradient's signal ‖g‖² and per-contribution noise σ².
    signal_sq: float | None = None
    noise_sq: float | None = None
    closed_at: float | None = None
    # What the last closed round merged, until its merged norm comes back.
    last_close: RoundClose | None = None
    last_norms_sq: dict[tuple[str, int], float] = field(default_factory=dict)


class Policy:
    """Membership, admission, rounds and manifests for every fragment."""

    def __init__(self, config: PolicyConfig, versions: Mapping[int, int],
                 merged_seq: Mapping[int, Mapping[str, int]] | None = None,
                 membership: Membership | None = None,
                 reservations: Mapping[str, int] | None = None) -> None:
        """`versions` maps each fragment to its committed version (-1: none yet);
        `merged_seq` restores the per-learner watermarks after a restart;
        `membership` decides liveness (default: the embedded heartbeat table);
        `reservations` restores the durable seq reservations (`reservation`)."""
        self.config = config
        self.membership = membership or HeartbeatTable(config.heartbeat_timeout_s)
        self._fragments = {
            p: _Fragment(version=v, round=_Round(version=v + 1),
                         merged_seq=dict((merged_seq or {}).get(p, {})))
            for p, v in versions.items()
        }
        self._learners: dict[str, _Learner] = {}
        # Taking no new rounds (`drain`).
        self.draining = False
        # Highest seq ever seen per learner, so a restarted learner never reuses one.
        # Restored: the watermarks and the reservations, which cover every seq the
        # previous life acknowledged, also in rounds it never closed.
        self._reserved = dict(reservations or {})
        self._seen_seq: dict[str, int] = dict(self._reserved)
        for watermarks in (merged_seq or {}).values():
            for learner_id, seq in watermarks.items():
                self._seen_seq[learner_id] = max(self._seen_seq.get(learner_id, 0), seq)

    # -- membership -------------------------------------------------------

    def join(self, learner_id: str, now: float, overlap_steps: int | None = None,
             auto_sync_every: bool = False) -> int:
        """Register (or re-register) a learner; returns the first seq it may use:
        above every seq of it this policy has seen or restored. `auto_sync_every`:
        it takes its H from `assign_sync_every`.

        A learner joining again (restarted) is not live until it heartbeats or
        contributes: it catches up first and meanwhile holds no round open, and
        its previous life's liveness does not carry over."""
        again = learner_id in self._learners or learner_id in self._seen_seq
        first_seq = self._seen_seq.get(learner_id, 0) + 1
        self._learners[learner_id] = _Learner(
            overlap_steps=overlap_steps or self.config.default_overlap_steps,
            joined_at=now, last_seen=now, first_seq=first_seq,
            auto_sync_every=auto_sync_every)
        if again:
            self.membership.drop(learner_id)
        else:
            self.membership.renew(learner_id, now)
        return first_seq

    def heartbeat(self, learner_id: str, now: float, local_step: int) -> None:
        learner = self._member(learner_id)
        learner.last_seen = now
        self.membership.renew(learner_id, now)
        self._sample_step_time(learner, now, local_step)

    def leave(self, learner_id: str) -> None:
        self._member(learner_id).left = True
        self.membership.drop(learner_id)

    def require_member(self, learner_id: str) -> None:
        """Raise `Rejected(UNKNOWN_LEARNER)` unless the learner has joined."""
        self._member(learner_id)

    def is_live(self, learner_id: str, now: float) -> bool:
        learner = self._learners.get(learner_id)
        return (learner is not None and not learner.left
                and self.membership.is_live(learner_id, now))

    def live_learners(self, now: float) -> frozenset[str]:
        return frozenset(lid for lid in self._learners if self.is_live(lid, now))

    def known_learners(self) -> frozenset[str]:
        return frozenset(self._learners)

    def last_seen(self, learner_id: str) -> float:
        learner = self._learners.get(learner_id)
        return learner.last_seen if learner else math.nan

    def step_time(self, learner_id: str) -> float | None:
        learner = self._learners.get(learner_id)
        return learner.step_time_s if learner else None

    def assign_sync_every(self, learner_id: str, now: float) -> SyncEveryChoice | None:
        """The H to tell `learner_id` now (None: it keeps its own), from the step times
        of it and of every live learner that takes its H from here (`choose_sync_every`);
        recorded as the learner's current H. The step times come from the local steps
        that heartbeats and pushes report (a push's local step is c_steps past the
        previous push's), so a straggler fault that starts or ends moves the H within
        a few heartbeats."""
        learner = self._member(learner_id)
        if not learner.auto_sync_every:
            return None
        fitted = {lid: self._learners[lid] for lid in self.live_learners(now)
                  if self._learners[lid].auto_sync_every}
        fitted[learner_id] = learner
        choice = choose_sync_every({lid: lr.step_time_s for lid, lr in fitted.items()},
                                   {lid: lr.overlap_steps for lid, lr in fitted.items()},
                                   self.config.h_min, self.config.h_max)[learner_id]
        previous, learner.sync_every = learner.sync_every, choice.sync_every
        return replace(choice, previous=previous)

    def local_step(self, learner_id: str) -> int:
        """The inner step its last heartbeat or contribution reported (0 before any)."""
        learner = self._learners.get(learner_id)
        return learner.local_step if learner else 0

    # -- fragments ---------------------------------------------------------

    @property
    def fragments(self) -> tuple[int, ...]:
        return tuple(self._fragments)

    def version(self, fragment: int) -> int:
        """The newest version decided (closed) for `fragment`; -1 before init."""
        return self._fragment(fragment).version

    def merged_seq(self, fragment: int, learner_id: str) -> int:
        return self._fragment(fragment).merged_seq.get(learner_id, 0)

    def watermarks(self, fragment: int) -> dict[str, int]:
        return dict(self._fragment(fragment).merged_seq)

    def round_learners(self, fragment: int) -> frozenset[str]:
        return frozenset(self._fragment(fragment).round.learners())

    def round_timing(self, fragment: int) -> tuple[float | None, float | None]:
        """(first arrival, grace deadline) of the open round."""
        rnd = self._fragment(fragment).round
        return rnd.opened_at, rnd.deadline

    def require_fragment(self, fragment: int) -> None:
        """Raise `Rejected(UNKNOWN_FRAGMENT)` unless the run has `fragment`."""
        self._fragment(fragment)

    def check_initialize(self, fragment: int, seq: int) -> None:
        """Raise `Rejected` unless `fragment` may take its initial value now, pushed
        as contribution `seq`. Changes nothing: the shell calls it on the header (to
        refuse early) and again before writing the value, then `initialize`."""
        frag = self._fragment(fragment)
        if frag.version >= 0:
            raise Rejected(Reason.ALREADY_INITIALIZED,
                           f"fragment {fragment} already has version {frag.version}; "
                           f"pull it instead")
        check_seq(seq)

    def initialize(self, fragment: int, learner_id: str, seq: int) -> None:
        """Record that `fragment` now has its initial value as version 0, pushed by
        `learner_id` as contribution `seq` (an id that is then used up)."""
        self.check_initialize(fragment, seq)
        frag = self._fragment(fragment)
        frag.version = 0
        frag.round = _Round(version=1)
        frag.merged_seq[learner_id] = max(frag.merged_seq.get(learner_id, 0), seq)
        self._seen_seq[learner_id] = max(self._seen_seq.get(learner_id, 0), seq)

    # -- contributions -----------------------------------------------------

    def admit(self, offer: Offer, now: float) -> Admission:
        """Whether `offer` would join the open round now, and its weight.

        Changes nothing: the shell calls it on the header (to refuse early) and
        again before folding the bytes in, then `accept`."""
        cid = offer.id
        self._member(cid.learner_id)
        frag = self._fragment(cid.fragment)
        if frag.version < 0:
            raise Rejected(Reason.NOT_INITIALIZED,
                           f"fragment {cid.fragment} has no initial value yet; push it with init")
        if offer.c_tokens <= 0 or offer.c_steps <= 0:
            raise Rejected(Reason.BAD_COUNTS,
                           f"c_tokens and c_steps must be positive "
                           f"(got {offer.c_tokens} and {offer.c_steps})")
        if offer.c_tokens * offer.c_tokens / offer.c_steps > MAX_TOKEN_WEIGHT:
            raise Rejected(Reason.BAD_COUNTS,
                           f"c_tokens²/c_steps is over 2^64 (c_tokens {offer.c_tokens}, "
                           f"c_steps {offer.c_steps}): c_tokens counts the tokens of the "
                           f"steps this push sums up, c_steps those steps")
        if offer.base_version > frag.version:
            raise Rejected(Reason.FUTURE_VERSION,
                           f"base version {offer.base_version} of fragment {cid.fragment} is newer "
                           f"than its current version {frag.version}")
        if offer.base_version < 0:
            raise Rejected(Reason.MALFORMED, f"base version {offer.base_version} is negative")
        check_seq(cid.seq)
        self._check_fresh(frag, cid)
        staleness = frag.version - offer.base_version
        if staleness > self.config.max_staleness:
            raise Rejected(Reason.STALE,
                           f"base version {offer.base_version} is {staleness} versions behind "
                           f"{frag.version} (max_staleness {self.config.max_staleness}); "
                           f"pull fragment {cid.fragment} and contribute against it")
        if self.draining and not frag.round.contributions:
            raise Rejected(Reason.DRAINING,
                           f"this coordinator is draining: it opens no new round (fragment "
                           f"{cid.fragment}); push to the next leader, or again once it is back")
        standing = frag.round.standing(cid.learner_id, offer.base_version,
                                       self._member(cid.learner_id).first_seq)
        if standing is not None:
            # The newer push carries the progress since the older one, which the round
            # already holds at its weight: the two count once, at that weight.
            replaced = frag.round.contributions[standing]
            return Admission(offer=offer, weight=replaced.weight, staleness=staleness,
                             target_version=frag.round.version, replaces=replaced.id)
        weight = self.weight(offer.c_tokens, offer.c_steps, staleness)
        return Admission(offer=offer, weight=weight, staleness=staleness,
                         target_version=frag.round.version)

    def accept(self, admission: Admission, now: float, norm_sq: float | None = None) -> None:
        """Add an admitted contribution to its fragment's open round (replacing the
        learner's contribution there against the same base, if any). `norm_sq`, its
        Σ Δ², feeds the automatic quorum's noise estimate."""
        offer = admission.offer
        frag = self._fragment(offer.id.fragment)
        if admission.target_version != frag.round.version:
            raise ValueError("admission is for a round that has closed; admit again")
        self._check_fresh(frag, offer.id)
        learner = self._member(offer.id.learner_id)
        standing = frag.round.standing(offer.id.learner_id, offer.base_version,
                                       learner.first_seq)
        replaces = None if standing is None else frag.round.contributions[standing].id
        if admission.replaces != replaces:
            raise ValueError("the round changed since the admission; admit again")
        learner.last_seen = now
        self.membership.renew(offer.id.learner_id, now)
        self._sample_step_time(learner, now, offer.local_step)
        self._seen_seq[offer.id.learner_id] = max(
            self._seen_seq.get(offer.id.learner_id, 0), offer.id.seq)
        rnd = frag.round
        if rnd.opened_at is None:
            rnd.opened_at = now
            rnd.quorum, rnd.choice = self._quorum(frag, now)
        if standing is not None:
            rnd.contributions[standing] = replace(rnd.contributions[standing], weight=0.0,
                                                  replaced_by=offer.id.seq)
        rnd.contributions.append(MergedContribution(
            id=offer.id, base_version=offer.base_version, weight=admission.weight,
            staleness=admission.staleness))
        if norm_sq is not None:
            rnd.norms_sq[(offer.id.learner_id, offer.id.seq)] = norm_sq
        previous = learner.pushed_at.get(offer.id.fragment)
        if previous is not None and now > previous:
            learner.intervals.append(now - previous)
        learner.pushed_at[offer.id.fragment] = now
        if rnd.quorum_at is None and len(rnd.learners()) >= rnd.quorum:
            rnd.quorum_at = now
            rnd.grace_s = self._grace(frag, quorum_wait=now - rnd.opened_at, now=now)
            rnd.deadline = now + rnd.grace_s

    def reservation(self, learner_id: str, seq: int) -> dict[str, int] | None:
        """The seq reservations to make durable before `seq` of `learner_id` is
        acknowledged, or None when those held cover it. Restored after a restart
        (`reservations`), they keep `join` above every seq acknowledged before;
        each covers SEQ_BLOCK seqs ahead, so few pushes wait for a write."""
        if seq <= self._reserved.get(learner_id, 0):
            return None
        return {**self._reserved, learner_id: min(seq + SEQ_BLOCK, MAX_SEQ)}

    def reserved(self, reservations: Mapping[str, int]) -> None:
        """Record that `reservations` (from `reservation`) are durable."""
        self._reserved = dict(reservations)

    def weight(self, c_tokens: int, c_steps: int, staleness: int) -> float:
        decay: float = (1.0 + staleness) ** (-self.config.staleness_exponent)
        return c_tokens * (c_tokens / c_steps) * decay

    # -- rounds ------------------------------------------------------------

    def due(self, now: float) -> list[int]:
        """Fragments whose open round should close now."""
        return [p for p, frag in self._fragments.items() if self._is_due(frag, now)]

    def next_deadline(self) -> float | None:
        """The earliest grace deadline among rounds that have quorum."""
        deadlines = [f.round.deadline for f in self._fragments.values()
                     if f.round.deadline is not None]
        return min(deadlines, default=None)

    def close(self, fragment: int, now: float) -> RoundClose:
        """Close the open round of `fragment` and open the next one."""
        frag = self._fragment(fragment)
        rnd = frag.round
        if not self._is_due(frag, now):
            raise ValueError(f"round of fragment {fragment} is not due at {now}")
        assert rnd.opened_at is not None
        if rnd.quorum_at is None:  # "auto": every live learner came before its quorum
            rnd.quorum_at = rnd.deadline = now
        assert rnd.deadline is not None
        live = self.live_learners(now)
        why: CloseReason = ("all_live" if live <= rnd.learners()
                            else "no_grace" if rnd.grace_s == 0
                            else "grace_ended" if now >= rnd.deadline else "draining")
        for c in rnd.contributions:
            frag.merged_seq[c.id.learner_id] = max(
                frag.merged_seq.get(c.id.learner_id, 0), c.id.seq)
        frag.version = rnd.version
        frag.round = _Round(version=rnd.version + 1)
        frag.closed_at = now
        closed = RoundClose(fragment=fragment, version=rnd.version,
                            manifest=tuple(rnd.contributions), opened_at=rnd.opened_at,
                            quorum_at=rnd.quorum_at, closed_at=now, grace_s=rnd.grace_s,
                            why=why, live=len(live | rnd.learners()), quorum=rnd.quorum,
                            choice=rnd.choice)
        frag.last_close, frag.last_norms_sq = closed, rnd.norms_sq
        return closed

    def drain(self, draining: bool = True) -> None:
        """Take no new rounds, so that this replica can stop with nothing lost: a
        contribution that would open a round is refused as draining, an open round
        still takes contributions and closes as soon as it has quorum, without
        waiting out its grace window. `drain(False)` takes rounds again."""
        self.draining = draining

    def open_rounds(self) -> list[int]:
        """Fragments whose open round holds contributions."""
        return [p for p, frag in self._fragments.items() if frag.round.contributions]

    def record_sync_time(self, fragment: int, seconds: float) -> None:
        """Feed back how long merging and publishing a version took (ξ_sync)."""
        frag = self._fragment(fragment)
        frag.sync_time_s = _ewma(frag.sync_time_s, seconds)

    def record_merge(self, fragment: int, version: int, merged_norm_sq: float) -> None:
        """Feed back Σ Δ² of the outer gradient that `version` merged: against the
        contributions' own it measures the gradient's signal and noise. With weights
        w, E‖Δ_m‖² (w-weighted) = ‖g‖² + σ² and E‖Δ̄‖² = ‖g‖² + σ²/K_eff, K_eff =
        (Σw)²/Σw². A round of one learner, one with a replaced push (its merged work
        is two pushes' sum) or one lacking a norm measures nothing."""
        frag = self._fragment(fragment)
        close, norms = frag.last_close, frag.last_norms_sq
        if close is None or close.version != version or not math.isfinite(merged_norm_sq):
            return
        frag.last_close = None
        merged = [c for c in close.manifest if c.weight > 0]
        if (len(merged) != len(close.manifest) or self.config.merge != "mean"
                or any((c.id.learner_id, c.id.seq) not in norms for c in merged)):
            return
        total = sum(c.weight for c in merged)
        k_eff = total * total / sum(c.weight * c.weight for c in merged)
        if k_eff < 1.0 + 1e-6:
            return
        each = sum(c.weight * norms[(c.id.learner_id, c.id.seq)] for c in merged) / total
        noise = max(each - merged_norm_sq, 0.0) / (1.0 - 1.0 / k_eff)
        signal = max(each - noise, 0.0)
        frag.noise_sq = _ewma(frag.noise_sq, noise)
        frag.signal_sq = _ewma(frag.signal_sq, signal)

    def noise_ratio(self, fragment: int) -> float | None:
        """ν = σ²/‖g‖² of the fragment's outer gradient (None before it is measured)."""
        return _noise_ratio(self._fragment(fragment))

    def round_quorum(self, fragment: int) -> int | None:
        """The quorum the open round needs; None before its first contribution."""
        rnd = self._fragment(fragment).round
        return rnd.quorum if rnd.opened_at is not None else None

    # -- internals ---------------------------------------------------------

    def _member(self, learner_id: str) -> _Learner:
        learner = self._learners.get(learner_id)
        if learner is None or learner.left:
            raise Rejected(Reason.UNKNOWN_LEARNER,
                           f"learner {learner_id!r} has not joined (or has left); call Join first")
        return learner

    def _fragment(self, fragment: int) -> _Fragment:
        frag = self._fragments.get(fragment)
        if frag is None:
            raise Rejected(Reason.UNKNOWN_FRAGMENT,
                           f"fragment {fragment} does not exist "
                           f"(this run has fragments 0..{len(self._fragments) - 1})")
        return frag

    def _check_fresh(self, frag: _Fragment, cid: ContributionId) -> None:
        # The learner's merged seq tells the two cases apart: above it, the open round
        # holds the contribution; at or below, a committed version merged it.
        merged = frag.merged_seq.get(cid.learner_id, 0)
        facts = ((MERGED_SEQ, str(merged)),)
        for c in frag.round.contributions:
            if c.id.learner_id == cid.learner_id and c.id.seq == cid.seq:
                raise Rejected(Reason.REPLAYED,
                               f"contribution {cid.learner_id}/{cid.fragment}/{cid.seq} is "
                               f"already in the open round for version {frag.round.version}",
                               facts)
        if cid.seq <= merged:
            raise Rejected(Reason.REPLAYED,
                           f"contribution {cid.learner_id}/{cid.fragment}/{cid.seq} is at or below "
                           f"seq {merged}, already merged into fragment {cid.fragment} by "
                           f"version {frag.version}", facts)

    def _is_due(self, frag: _Fragment, now: float) -> bool:
        rnd = frag.round
        if rnd.quorum_at is None or rnd.deadline is None:
            # "auto" chose from the learners live when the round opened; if some died
            # since, the round must not wait for them.
            return (self.config.min_quorum == "auto" and bool(rnd.contributions)
                    and self.live_learners(now) <= rnd.learners())
        return (self.draining or now >= rnd.deadline
                or self.live_learners(now) <= rnd.learners())

    def _quorum(self, frag: _Fragment, now: float) -> tuple[int, QuorumChoice | None]:
        """The quorum of a round that opens now: the configured one, or with "auto"
        `choose_quorum` over the live learners' median push intervals (one with none
        yet is taken at the others' median), the merge and publish time as the fixed
        cost of every round."""
        if isinstance(self.config.min_quorum, int):
            return self.config.min_quorum, None
        intervals = [self._learners[lid].push_interval() for lid in self.live_learners(now)]
        known = sorted(i for i in intervals if i is not None)
        typical = known[len(known) // 2] if known else 0.0
        cycles = sorted(typical if i is None else i for i in intervals) or [0.0]
        ceiling = self.config.min_quorum_max or len(cycles)
        choice = choose_quorum(self._round_noise_ratio(frag), cycles, frag.sync_time_s or 0.0,
                               ceiling)
        return choice.quorum, choice

    def _round_noise_ratio(self, frag: _Fragment) -> float | None:
        """The fragment's ν; before it has measured its own, the median of the others'
        (slices of one model's outer gradient), so that only the run's first rounds
        wait for two to measure it, not every fragment's first."""
        own = _noise_ratio(frag)
        if own is not None:
            return own
        measured = sorted(nu for f in self._fragments.values()
                          if (nu := _noise_ratio(f)) is not None)
        return measured[len(measured) // 2] if measured else None

    def _grace(self, frag: _Fragment, quorum_wait: float, now: float) -> float:
        live = [self._learners[lid] for lid in self.live_learners(now)]
        step_times = [lr.step_time_s for lr in live if lr.step_time_s is not None]
        if not step_times:
            return self.config.grace_max_s
        overlap = min(lr.overlap_steps for lr in live)
        budget = overlap * max(step_times) - quorum_wait - (frag.sync_time_s or 0.0)
        return min(max(self.config.gamma * budget, 0.0), self.config.grace_max_s)

    @staticmethod
    def _sample_step_time(learner: _Learner, now: float, local_step: int) -> None:
        if local_step < learner.local_step:
            learner.step_sample_at = None  # the learner restarted its count: re-anchor
        if learner.step_sample_at is not None and local_step > learner.local_step:
            learner.sampled_s = _ewma(learner.sampled_s, now - learner.step_sample_at)
            learner.sampled_steps = _ewma(learner.sampled_steps, local_step - learner.local_step)
        if learner.step_sample_at is None or local_step > learner.local_step:
            learner.local_step = local_step
            learner.step_sample_at = now


def check_seq(seq: int) -> None:
    """Raise `Rejected(MALFORMED)` unless a contribution may carry `seq`."""
    if not 1 <= seq <= MAX_SEQ:
        raise Rejected(Reason.MALFORMED, f"seq must be in 1..{MAX_SEQ} (got {seq}): a learner "
                                         f"must always have a next one")


def _noise_ratio(frag: _Fragment) -> float | None:
    if frag.noise_sq is None or frag.signal_sq is None:
        return None
    # No measurable signal: noise a trillion times over it, finite for the event log.
    return frag.noise_sq / max(frag.signal_sq, 1e-12 * frag.noise_sq, 1e-300)


def _ewma(previous: float | None, sample: float) -> float:
    if previous is None:
        return sample
    return (1.0 - _EWMA) * previous + _EWMA * sample

