"""The simulator's ftsync run: chips, failures, the real policy and the real schedule.

`chaos.sim.run_once` runs it for one configuration and one seed; the
data-parallel baselines (`chaos.sim.baselines`) share its failure model:

- **ftsync**: chips split into M learners, each a data-parallel group that
  streams fragments on the learner's schedule (`learner.streaming.offsets`)
  to a synchronizer whose decisions — admission, staleness, quorum, grace
  window, round close, manifests, liveness — come from the production
  policy core (`coordinator.policy.Policy`), fed the same calls in the same
  order as the daemon's engine feeds it, under a simulated clock. A failed
  learner restarts (start-up, join, catch-up); an elastic one drops the chip,
  re-forms, and takes the chip back when it is repaired. When a learner
  pushes, pulls and applies is decided by the production schedule
  (`learner.schedule.Schedule`), as in `learner.streaming.FragmentSync`: the
  simulator calls its `step` only at the steps where it may act
  (`next_step`), and an apply that overwrites (`training.apply_rule`) loses the
  work since the push.
- **dp**: one synchronous data-parallel job on every chip; any failure stops
  it until it is restarted.
- **elastic-dp**: one job that drops a failed chip and re-forms without it.

To replay a chaos experiment, learners can also share a host's cores (the
harness runs every process on one machine) and follow the harness's kill and
heal timeline.

Failures are aggregate processes: a group of c live chips fails at rate
c / mtbf_chip_s, so a month on millions of chips costs one event per
failure, not one object per chip. Per-chip state exists only where a
quantity is per chip — speed factors, when speeds vary — and lives in numpy
arrays.

Goodput and uptime are counted as `chaos.metrics` counts them from a real
run's events: a merged contribution carries its steps' learner time divided
by P; a learner slot is allocated from its first join to its final exit (or
to the kill that left it down at the end); uptime is the share of windows,
from the first commit of a version >= 1 to the last training step, in which
some fragment committed. Time is weighted by chips.
"""

from __future__ import annotations

import heapq
import math
import random
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from chaos.metrics import advanced_share
from chaos.sim.chips import Chips
from chaos.sim.results import Result
from chaos.sim.scenario import Scenario
from coordinator.errors import Reason, Rejected
from coordinator.policy import Admission, Offer, Policy, RoundClose
from learner.schedule import Apply, ApplyRule, Pull, Push, Schedule, ScheduleConfig
from protos.contribution import ContributionId

# A kill of the replayed timeline: (time, learner index).
Kill = tuple[float, int]

# Order of events at equal times: steps first, everything else after.
_STEP, _OTHER = 0, 1

# Group states.
STARTING, CATCHUP, RUNNING, REFORMING, FINISHING, DOWN, DONE = (
    "starting", "catchup", "running", "reforming", "finishing", "down", "done")
_ALIVE = {STARTING, CATCHUP, RUNNING, REFORMING, FINISHING}


def _uptime(commits: np.ndarray, start: float, end: float, window_s: float) -> float:
    """`chaos.metrics.uptime` over commit times: windows of the span with a commit."""
    if commits.size == 0:
        return 0.0
    if end <= start:
        return 1.0
    n = math.ceil((end - start) / window_s)
    inside = commits[(commits >= start) & (commits <= end)]
    hit = np.zeros(n, dtype=bool)
    hit[np.minimum(((inside - start) / window_s).astype(np.int64), n - 1)] = True
    return advanced_share(hit.tolist(), start, end, window_s)


class _Fragment:
    """What the simulator keeps of a learner's fragment beside its schedule."""

    __slots__ = ("pull", "since_w")

    def __init__(self, since_w: float) -> None:
        # Where the next contribution's work is counted from (chip-seconds).
        self.since_w = since_w
        # The pull under way (a newer one supersedes it).
        self.pull: Pull | None = None


class _Group:
    """One data-parallel group of chips: a learner slot across its restarts."""

    def __init__(self, index: int, lid: str, lo: int, hi: int, slow: float,
                 pace: float) -> None:
        self.index = index
        self.lid = lid
        self.lo, self.hi = lo, hi
        self.nominal = hi - lo
        self.active = self.nominal
        self.slow = slow
        # The learner's own speed (cluster.learner_speeds), whatever its chips.
        self.pace = pace
        self.state = DOWN
        # Bumped when the process dies: its in-flight pushes and pulls are void.
        self.incarnation = 0
        # Bumped whenever the step clock stops or changes pace: scheduled steps are void.
        self.clock = 0
        self.fail_token = 0
        self.reform_token = 0
        # Chips dropped by an elastic group and not yet back (their indices).
        self.removed: list[int] = []
        # A timed phase (start-up, catch-up, final eval, exit): `phase_left`
        # seconds of work at full speed remain as of `phase_t`, then `phase_fn`.
        self.phase_fn: Callable[[float, _Group], None] | None = None
        self.phase_left = 0.0
        self.phase_t = 0.0
        self.phase_token = 0
        # Step clock: step k completes at anchor_t + (k - anchor_step)·step_s
        # (anchor_step is fractional after a change of pace mid-step).
        self.anchor_t = 0.0
        self.anchor_step = 0.0
        self.step_s = 1.0
        self.local_step = 0
        self.end_step = -1
        self.slot_done = 0
        # Work (chip-seconds of wall time) accrued at rate w_rate since w_t.
        self.w = 0.0
        self.w_t = 0.0
        self.w_rate = 0.0
        self.frags: list[_Fragment] = []
        self.schedule: Schedule | None = None
        # Steps with an event of clock `planned_clock` in the queue.
        self.planned: set[int] = set()
        self.planned_clock = -1
        # Pull results on their way: (time they arrive, the pull, the version).
        self.arriving: list[tuple[float, Pull, int]] = []
        self.next_seq = 1
        self.hb_t = -math.inf
        self.first_join: float | None = None
        self.stopped_at: float | None = None
        # When the learner last reported progress (a `train` event).
        self.last_train_t: float | None = None

    def work(self, t: float) -> float:
        return self.w + self.w_rate * (t - self.w_t)

    def set_rate(self, t: float, rate: float) -> None:
        self.w = self.work(t)
        self.w_t = t
        self.w_rate = rate

    def steps_at(self, t: float) -> int:
        if self.state != RUNNING:
            return self.local_step
        return int(self.anchor_step + (t - self.anchor_t) / self.step_s + 1e-9)

    def time_of(self, k: int) -> float:
        return self.anchor_t + (k - self.anchor_step) * self.step_s

    def first_step_from(self, t: float) -> int:
        return math.ceil(self.anchor_step + max(t - self.anchor_t, 0.0) / self.step_s - 1e-9)


class FtsyncRun:
    def __init__(self, scenario: Scenario, seed: int, kills: Sequence[Kill] | None) -> None:
        s = scenario
        self.s = s
        self.rng = random.Random(seed)
        cluster, training = s.cluster, s.training
        self.chips = Chips(cluster.chips, cluster.speed_sigma, self.rng, seed)
        m = cluster.learners
        size, extra = divmod(cluster.chips, m)
        starts = [i * size + min(i, extra) for i in range(m)]
        ends = [*starts[1:], cluster.chips]
        slow = self.chips.slowest_of(starts)
        paces = cluster.learner_speeds or [1.0] * m
        self.groups = [_Group(i, f"learner-{i}", lo, hi, slow[i], paces[i])
                       for i, (lo, hi) in enumerate(zip(starts, ends, strict=True))]
        self.P = training.fragments
        self.H = training.sync_every
        self.tau = training.overlap
        self.config = ScheduleConfig(self.H, self.P, self.tau,
                                     rule=ApplyRule(training.apply_rule))
        self.policy = Policy(s.policy, {p: -1 for p in range(self.P)})
        # Every policy call is preceded by `_refresh`, so a beat is due only when the last
        # is nearly a timeout old; the margin keeps float error away from the boundary.
        # (Half the timeout beat 1.9M times in a 2.4M-chip month: 14% of its CPU more.)
        # The policy samples step times from beats (grace, automatic H): 9 s apart here
        # at the default timeout where a learner beats each second, which its EWMA of
        # seconds over steps measures the same for a steady pace.
        self.hb_period = s.policy.heartbeat_timeout_s * 0.9
        self.refreshed_at = -math.inf
        # Share of a core each busy learner process gets (host.cores > 0 only).
        self.speed = 1.0
        self.published = [-1] * self.P
        # Pulls waiting for a version: (learner, incarnation, pull, deadline).
        self.waiters: list[list[tuple[_Group, int, Pull, float]]] = [[] for _ in range(self.P)]
        # Accepted, not yet merged: (learner, fragment, seq) -> (chip-seconds, chip-steps).
        self.accepted: dict[tuple[str, int, int], tuple[float, int]] = {}
        self.joined: dict[int, _Group] = {}
        self.initialized = False
        self.kills = kills
        self.heap: list[tuple[float, int, int, Callable[..., None], tuple[Any, ...]]] = []
        self.seq = 0
        self.events = 0
        self.timer_at = math.inf
        self.ended = False
        self.run_end = s.duration_s
        self.commit_times = array("d")
        self.useful = 0.0
        self.useful_steps = 0.0
        self.failures = 0
        self.contributions = 0
        self.merged = 0
        self.staleness_sum = 0
        self.rounds = 0
        self.quorum_sum = 0
        self.lost_in_flight = 0
        self.dropped: dict[str, float] = {}
        # Σ Δ² of every contribution under the noise model (`training.noise_ratio`),
        # and of each round's merge: what the automatic quorum measures noise from.
        self.norm_sq = 1.0 + training.noise_ratio if training.noise_ratio > 0 else None

    # -- the event loop ----------------------------------------------------------------

    def at(self, t: float, order: int, fn: Callable[..., None], *args: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, order, self.seq, fn, args))

    def run(self) -> Result:
        s = self.s
        offset = s.failures.replay_offset_s if self.kills is not None else 0.0
        for g in self.groups:
            self._process_start(offset, g, s.failures.first_startup_s)
        for t, index in self.kills or ():
            self.at(t, _OTHER, self._kill_event, index)
        self.at(offset + s.duration_s, _OTHER, self._end)
        heap = self.heap
        while heap:
            t, _, _, fn, args = heapq.heappop(heap)
            self.events += 1
            fn(t, *args)
        return self._result()

    # -- timed phases and the shared host ----------------------------------------------

    def _after(self, t: float, g: _Group, seconds: float,
               fn: Callable[[float, _Group], None]) -> None:
        """Run fn after `seconds` of the process's work (longer while it shares
        the host's cores); a kill or another phase cancels it."""
        g.phase_token += 1
        g.phase_fn, g.phase_left, g.phase_t = fn, seconds, t
        self.at(t + seconds / self.speed, _OTHER, self._phase_done, g, g.phase_token)

    def _phase_done(self, t: float, g: _Group, token: int) -> None:
        fn = g.phase_fn
        if token != g.phase_token or fn is None:
            return
        g.phase_fn = None
        fn(t, g)

    def _busy_changed(self, t: float) -> None:
        """A learner process started or stopped: every busy one changes pace."""
        host = self.s.host
        if host.cores <= 0:
            return
        busy = sum(1 for g in self.groups if g.state in _ALIVE)
        speed = min(1.0, host.cores / max(busy + host.background, 1e-9))
        if speed == self.speed:
            return
        old, self.speed = self.speed, speed
        for g in self.groups:
            if g.phase_fn is not None:
                g.phase_left -= (t - g.phase_t) * old
                g.phase_t = t
                g.phase_token += 1
                self.at(t + max(g.phase_left, 0.0) / speed, _OTHER, self._phase_done, g,
                        g.phase_token)
            if g.state == RUNNING:
                self._repace(t, g)

    def _repace(self, t: float, g: _Group) -> None:
        """The step clock goes on from t at a new pace (host share or slowest chip)."""
        g.anchor_step += (t - g.anchor_t) / g.step_s
        g.anchor_t = t
        g.step_s = self.s.training.step_s * g.slow / (self.speed * g.pace)
        g.clock += 1
        self._reschedule(g)

    # -- a learner's life ---------------------------------------------------------------

    def _process_start(self, t: float, g: _Group, startup_s: float) -> None:
        g.state = STARTING
        g.stopped_at = None
        g.local_step = 0
        self._arm_failure(t, g)
        sigma = self.s.failures.startup_sigma
        if sigma > 0:
            startup_s *= math.exp(sigma * self.rng.gauss(0.0, 1.0))
        self._after(t, g, startup_s, self._join)
        self._busy_changed(t)

    def _join(self, t: float, g: _Group) -> None:
        g.state = CATCHUP
        if g.first_join is None:
            g.first_join = t
        g.next_seq = self.policy.join(g.lid, t, self.tau)
        g.hb_t = t
        self.joined[g.index] = g
        if not self.initialized:
            # The first learner in pushes every fragment's initial value.
            for p in range(self.P):
                self.policy.initialize(p, g.lid, g.next_seq)
                g.next_seq += 1
                self.published[p] = 0
            self.initialized = True
        g.set_rate(t, g.active if self.s.training.catchup_is_work else 0.0)
        w = g.work(t)
        g.frags = [_Fragment(w) for p in range(self.P)]
        g.schedule = Schedule(self.config)
        g.schedule.start({p: self.published[p] for p in range(self.P)})
        g.arriving = []
        self._after(t, g, self.s.failures.catchup_s, self._begin)

    def _begin(self, t: float, g: _Group) -> None:
        # A learner starts beating once caught up, as `FragmentSync` starts its heartbeats.
        self._heartbeat(t, g)
        steps = self.s.training.steps
        g.end_step = max(steps - g.slot_done, 1) if steps else -1
        if self.ended:
            g.end_step = 0
            self._finish(t, g)
        else:
            self._run_clock(t, g)

    def _run_clock(self, t: float, g: _Group) -> None:
        """(Re)start the step clock at t: steps at the pace of the slowest chip."""
        g.state = RUNNING
        g.clock += 1
        g.anchor_t = t
        g.anchor_step = float(g.local_step)
        g.step_s = self.s.training.step_s * g.slow / (self.speed * g.pace)
        g.set_rate(t, g.active)
        self._reschedule(g)

    def _reschedule(self, g: _Group) -> None:
        """Plan the next step at which the schedule may act, a pull result on its
        way may be applied, or the last step comes."""
        assert g.schedule is not None
        k = g.schedule.next_step()
        for ready_t, _, _ in g.arriving:
            k = min(k, max(g.first_step_from(ready_t), g.schedule.step_count + 1))
        if g.end_step >= 0:
            k = min(k, g.end_step)
        if g.planned_clock != g.clock:
            g.planned_clock = g.clock
            g.planned.clear()
        if k not in g.planned:  # a pull's result can bring a step before the planned one
            g.planned.add(k)
            self.at(g.time_of(k), _STEP, self._step, g, g.clock, k)

    def _step(self, t: float, g: _Group, clock: int, k: int) -> None:
        if clock != g.clock:
            return
        g.planned.discard(k)
        schedule = g.schedule
        assert schedule is not None
        if g.arriving:
            # Pull results that came by this step are the schedule's now.
            for item in [a for a in g.arriving if a[0] <= t + 1e-9]:
                g.arriving.remove(item)
                schedule.pulled(item[1].p, item[2], 0, item[1].ticket)
        if k < schedule.next_step() and k != g.end_step:
            # Planned for a fall-back that its pull's arrival made needless, or for
            # a result that is not applied yet.
            self._reschedule(g)
            return
        g.local_step = k
        self._trained(g, k)
        self._carry_out(t, g, schedule.step(k, (k - schedule.step_count) * g.active))
        if k == g.end_step:
            self._finish(t, g)
        else:
            self._reschedule(g)

    def _carry_out(self, t: float, g: _Group, actions: Sequence[Push | Pull | Apply | object],
                   ) -> None:
        """The schedule's pushes, pulls and applies, in its order (a fall-back needs
        nothing here: the pull that follows it supersedes the one under way)."""
        for action in actions:
            if isinstance(action, Push):
                self._push(t, g, action)
            elif isinstance(action, Pull):
                self._pull(t, g, action)
            elif isinstance(action, Apply) and not action.carry:
                # The merged values overwrite the fragment: work since the push is gone.
                g.frags[action.p].since_w = g.work(t)

    def _push(self, t: float, g: _Group, push: Push) -> None:
        f = g.frags[push.p]
        w = g.work(t)
        work = w - f.since_w
        f.since_w = w
        if push.steps > 0 and work > 0:
            seq = g.next_seq
            g.next_seq += 1
            offer = Offer(ContributionId(g.lid, push.p, seq), push.base,
                          c_tokens=push.tokens, c_steps=push.steps, local_step=push.step)
            self.contributions += 1
            try:  # the header: refused before any bytes move
                self._admit(t, g, offer)
            except Rejected as rejected:
                self._drop(rejected)
                self._answered(t, g, push, None, rejected.reason)
            else:
                self.at(t + self.s.training.push_s, _OTHER, self._arrive, g, g.incarnation,
                        offer, work, push)
        else:
            self._answered(t, g, push, None, None)  # nothing sent: not acknowledged

    def _answered(self, t: float, g: _Group, push: Push, target: int | None,
                  refused: Reason | None) -> None:
        assert g.schedule is not None
        pulls = (g.schedule.acked(push.p, target, push.ticket) if refused is None
                 else g.schedule.refused(push.p, refused.value, push.ticket))
        for pull in pulls:
            self._pull(t, g, pull)

    def _pull(self, t: float, g: _Group, pull: Pull) -> None:
        """Long-poll for a version newer than `pull.newer_than`, up to pull_wait_s."""
        g.frags[pull.p].pull = pull
        if self.published[pull.p] > pull.newer_than:
            self._deliver(t, g, pull)
        else:
            deadline = t + self.s.training.pull_wait_s
            self.waiters[pull.p].append((g, g.incarnation, pull, deadline))

    def _deliver(self, t: float, g: _Group, pull: Pull) -> None:
        """The version comes back pull_s from now; the step that applies it takes it."""
        g.frags[pull.p].pull = None
        g.arriving.append((t + self.s.training.pull_s, pull, self.published[pull.p]))
        if g.state == RUNNING:
            self._reschedule(g)

    def _trained(self, g: _Group, k: int) -> None:
        """The learner reports progress every progress_every steps (uptime's span
        ends at the last report)."""
        reported = k // self.s.training.progress_every * self.s.training.progress_every
        if reported > 0 and g.state == RUNNING:
            g.last_train_t = max(g.last_train_t or 0.0, g.time_of(reported))

    def _finish(self, t: float, g: _Group) -> None:
        """Out of steps (or told to stop): final eval, flush, leave, exit."""
        self._trained(g, g.local_step)
        self._count_steps(g)
        g.state = FINISHING
        g.clock += 1
        self._after(t, g, self.s.training.finish_s, self._flush)

    def _flush(self, t: float, g: _Group) -> None:
        assert g.schedule is not None
        self._carry_out(t, g, g.schedule.flush())
        g.set_rate(t, 0.0)
        self.at(t + self.s.training.push_s, _OTHER, self._leave, g, g.incarnation)

    def _leave(self, t: float, g: _Group, incarnation: int) -> None:
        if incarnation != g.incarnation:
            return
        self._heartbeat(t, g)
        self.policy.leave(g.lid)
        if self.joined.get(g.index) is g:
            del self.joined[g.index]
        self._coordinate(t)
        self._after(t, g, self.s.training.exit_s, self._exit)

    def _exit(self, t: float, g: _Group) -> None:
        g.state = DONE
        g.stopped_at = t
        g.incarnation += 1
        if self.ended:
            self.run_end = max(self.run_end, t)
        elif all(other.state == DONE for other in self.groups):
            self.ended = True  # every slot ran out of steps: the harness stops
            self.run_end = t
        self._busy_changed(t)

    # -- failures ------------------------------------------------------------------------

    def _arm_failure(self, t: float, g: _Group) -> None:
        """The group's next chip failure, armed at the rate of all its chips and thinned
        at `_fail` to the chips it has then (a Poisson process thinned by
        active/nominal has the rate of the active chips): a chip lost or back changes
        the rate without arming again, which cost an event and a draw per change."""
        g.fail_token += 1
        if self.kills is not None or g.nominal == 0:
            return
        rate = g.nominal / self.s.failures.mtbf_chip_s
        self.at(t + self.rng.expovariate(rate), _OTHER, self._fail, g, g.fail_token)

    def _fail(self, t: float, g: _Group, token: int) -> None:
        if token != g.fail_token or self.ended or g.state not in _ALIVE:
            return
        if g.active < g.nominal and self.rng.random() * g.nominal >= g.active:
            self._arm_failure(t, g)  # it fell on a chip the group has not got now
        elif self.s.cluster.elastic and g.active > 1:
            self._lose_chip(t, g)
            self._arm_failure(t, g)
        else:
            self._kill(t, g)

    def _kill_event(self, t: float, index: int) -> None:
        if not self.ended:
            self._kill(t, self.groups[index])

    def _kill(self, t: float, g: _Group) -> None:
        """The learner's process dies: everything not yet pushed is lost."""
        if g.state not in _ALIVE:
            return  # the harness skips a kill of a learner that is down or done
        self.failures += 1
        if self.joined.get(g.index) is g:
            self._heartbeat(t, g)
            del self.joined[g.index]
            # It stays live to the policy until its heartbeats time out.
            self.at(t + self.s.policy.heartbeat_timeout_s + 1e-6, _OTHER, self._timer)
        g.local_step = g.steps_at(t)
        if g.state != FINISHING:
            self._trained(g, g.local_step)
            self._count_steps(g)
        g.state = DOWN
        g.incarnation += 1
        g.clock += 1
        g.fail_token += 1
        g.phase_token += 1
        g.phase_fn = None
        g.set_rate(t, 0.0)
        g.stopped_at = t
        chip = self.chips.pick(g.lo, g.hi)
        g.slow = self.chips.renew(chip, g.slow, g.lo, g.hi) if chip >= 0 else g.slow
        for chip in g.removed:  # an elastic group restarted whole gets its chips back
            g.slow = self.chips.renew(chip, g.slow, g.lo, g.hi) if chip >= 0 else g.slow
        g.removed.clear()
        g.active = g.nominal
        self.at(t + self.s.failures.restart_s, _OTHER, self._heal, g.index, g.incarnation)
        self._busy_changed(t)

    def _count_steps(self, g: _Group) -> None:
        """The harness's count of the slot's steps, from progress lines."""
        every = self.s.training.progress_every
        g.slot_done += g.local_step // every * every

    def _heal(self, t: float, index: int, incarnation: int) -> None:
        """The kill's heal: the harness starts the slot's learner again."""
        g = self.groups[index]
        if self.ended or incarnation != g.incarnation or g.state != DOWN:
            return
        self._process_start(t, g, self.s.failures.startup_s)

    def _lose_chip(self, t: float, g: _Group) -> None:
        """Elastic: drop the failed chip and re-form the group without it."""
        self.failures += 1
        chip = self.chips.pick(g.lo, g.hi)
        g.slow = self.chips.remove(chip, g.slow, g.lo, g.hi) if chip >= 0 else g.slow
        g.active -= 1
        g.removed.append(chip)
        f = self.s.failures
        # The chip comes back repaired, started and caught up, without a pause.
        self.at(t + f.restart_s + f.startup_s + f.catchup_s, _OTHER, self._repaired, g, chip,
                g.incarnation)
        if g.state == RUNNING:
            # The interrupted step is lost; what was done before it is kept.
            g.local_step = g.steps_at(t)
            g.w = g.work(g.time_of(g.local_step))
            g.w_t, g.w_rate = t, 0.0
            g.clock += 1
            g.state = REFORMING
        elif g.w_rate > 0:
            g.set_rate(t, g.active)
        if g.state == REFORMING:
            g.reform_token += 1
            self.at(t + f.reform_s, _OTHER, self._reformed, g, g.reform_token)

    def _repaired(self, t: float, g: _Group, chip: int, incarnation: int) -> None:
        if incarnation != g.incarnation or g.state not in _ALIVE:
            return  # the group restarted whole (and got it back) or is gone
        g.removed.remove(chip)
        g.active += 1
        slow = g.slow
        g.slow = self.chips.renew(chip, g.slow, g.lo, g.hi) if chip >= 0 else g.slow
        if g.w_rate > 0:
            g.set_rate(t, g.active)
        if g.state == RUNNING and g.slow != slow:
            # Paced by its slowest chip: only a slower new chip moves the step clock
            # (one repair in about as many as the group has chips).
            self._repace(t, g)

    def _reformed(self, t: float, g: _Group, token: int) -> None:
        if token != g.reform_token or g.state != REFORMING:
            return
        if self.ended:
            self._finish(t, g)
        else:
            self._run_clock(t, g)

    # -- the synchronizer ------------------------------------------------------------------

    def _heartbeat(self, t: float, g: _Group) -> None:
        self.policy.heartbeat(g.lid, t, g.steps_at(t))
        g.hb_t = t

    def _rejoin(self, t: float, g: _Group) -> bool:
        """What the client does on unknown_learner: join again."""
        if g.state not in _ALIVE or self.groups[g.index] is not g:
            return False
        g.next_seq = max(g.next_seq, self.policy.join(g.lid, t, self.tau))
        self.joined[g.index] = g
        return True

    def _refresh(self, t: float) -> None:
        """Live learners beat every second; the policy only needs to have heard
        one within its timeout whenever it is asked, so beat lazily (and once per
        instant: an arrival's round timer asks again at the same time)."""
        if t == self.refreshed_at:
            return
        self.refreshed_at = t
        for g in self.joined.values():
            if t - g.hb_t >= self.hb_period:
                self._heartbeat(t, g)

    def _arrive(self, t: float, g: _Group, incarnation: int, offer: Offer,
                work: float, push: Push) -> None:
        if incarnation != g.incarnation:
            self.lost_in_flight += 1  # the process died mid-push
            return
        self._refresh(t)
        p = offer.id.fragment
        try:
            admission = self._admit(t, g, offer)
            self.policy.accept(admission, t, norm_sq=self.norm_sq)
        except Rejected as rejected:
            self._drop(rejected)
            self._answered(t, g, push, None, rejected.reason)
            return
        self.accepted[(offer.id.learner_id, p, offer.id.seq)] = (work, offer.c_tokens)
        self._coordinate(t)
        self._answered(t, g, push, admission.target_version, None)

    def _admit(self, t: float, g: _Group, offer: Offer) -> Admission:
        try:
            return self.policy.admit(offer, t)
        except Rejected as rejected:
            if rejected.reason != Reason.UNKNOWN_LEARNER or not self._rejoin(t, g):
                raise
            return self.policy.admit(offer, t)

    def _drop(self, rejected: Rejected) -> None:
        reason = rejected.reason.value
        self.dropped[reason] = self.dropped.get(reason, 0.0) + 1

    def _timer(self, t: float) -> None:
        if t >= self.timer_at:
            self.timer_at = math.inf
        self._coordinate(t)

    def _coordinate(self, t: float) -> None:
        """The daemon's round timer: close what is due, wait for the next deadline."""
        self._refresh(t)
        policy = self.policy
        for p in policy.due(t):
            close = policy.close(p, t)
            for c in close.manifest:
                work, chip_steps = self.accepted.pop(
                    (c.id.learner_id, c.id.fragment, c.id.seq))
                self.useful += work / self.P
                self.useful_steps += chip_steps / self.P
                self.merged += 1
                self.staleness_sum += c.staleness
            self.rounds += 1
            self.quorum_sum += close.quorum
            self.at(t + self.s.training.sync_s, _OTHER, self._publish, p, close.version)
            if self.norm_sq is not None:  # the daemon's merge reports it (sooner: no matter)
                policy.record_merge(p, close.version, self._merged_norm_sq(close))
        deadline = policy.next_deadline()
        if deadline is not None and deadline < self.timer_at:
            self.timer_at = max(deadline, t)
            self.at(self.timer_at, _OTHER, self._timer)

    def _merged_norm_sq(self, close: RoundClose) -> float:
        """‖Δ̄‖² of a round under the noise model: each contribution g + ε_i with
        ‖g‖² = 1 and E‖ε_i‖² = ν, so the weighted mean has 1 + ν·Σw²/(Σw)²."""
        weights = [c.weight for c in close.manifest if c.weight > 0]
        total = sum(weights)
        if total <= 0:
            return math.nan
        return 1.0 + self.s.training.noise_ratio * sum(w * w for w in weights) / total ** 2

    def _publish(self, t: float, p: int, version: int) -> None:
        """The committed version is durable and served; waiting pulls get it."""
        self.policy.record_sync_time(p, self.s.training.sync_s)
        self.published[p] = max(self.published[p], version)
        self.commit_times.append(t)
        waiters, self.waiters[p] = self.waiters[p], []
        for g, incarnation, pull, deadline in waiters:
            if incarnation != g.incarnation or g.frags[pull.p].pull is not pull:
                continue  # gone or superseded
            if t > deadline:
                # Timed out empty-handed (seen here, lazily: no event per pull).
                g.frags[p].pull = None
                if g.schedule is not None:
                    g.schedule.pulled(p, None, 0, pull.ticket)
                continue
            if self.published[p] <= pull.newer_than:
                self.waiters[p].append((g, incarnation, pull, deadline))  # not its version yet
                continue
            self._deliver(t, g, pull)

    # -- the end ---------------------------------------------------------------------------

    def _end(self, t: float) -> None:
        """max_duration_s: every live learner is told to stop (SIGTERM)."""
        if self.ended:
            return
        self.ended = True
        self.run_end = t
        for g in self.groups:
            if g.state == RUNNING:
                g.local_step = g.steps_at(t)
                g.end_step = g.local_step + 1
                g.clock += 1
                self._reschedule(g)
            elif g.state == STARTING:
                g.state = DONE
                g.stopped_at = t
                g.incarnation += 1
                g.phase_token += 1
                g.phase_fn = None
            # CATCHUP learners stop before their first step, REFORMING ones once
            # re-formed; FINISHING ones are on their way out; DOWN ones stay down.
        self._busy_changed(t)

    def _result(self) -> Result:
        s = self.s
        allocated = 0.0
        for g in self.groups:
            if g.first_join is None:
                continue
            end = g.stopped_at if g.stopped_at is not None else self.run_end
            allocated += g.nominal * max(end - g.first_join, 0.0)
        commits = np.frombuffer(self.commit_times, dtype=np.float64)
        last_steps = [g.last_train_t for g in self.groups if g.last_train_t is not None]
        uptime = 0.0
        if commits.size:
            end = min(max(last_steps), self.run_end) if last_steps else float(commits[-1])
            uptime = _uptime(commits, float(commits.min()), max(end, float(commits.min())),
                             s.uptime_window_s)
        return Result(
            label=s.label(), method=s.method, chips=s.cluster.chips,
            learners=s.cluster.learners, elastic=s.cluster.elastic,
            min_quorum=s.policy.min_quorum,
            goodput=self.useful / allocated if allocated > 0 else 0.0, uptime=uptime,
            throughput=(self.useful_steps * s.training.step_s / allocated
                        if allocated > 0 else 0.0),
            useful_chip_s=self.useful, allocated_chip_s=allocated, run_s=self.run_end,
            failures=self.failures, commits=float(commits.size),
            contributions=self.contributions, merged=self.merged, dropped=dict(self.dropped),
            mean_staleness=self.staleness_sum / self.merged if self.merged else 0.0,
            mean_quorum=self.quorum_sum / self.rounds if self.rounds else 0.0,
            lost_in_flight=self.lost_in_flight, events=self.events)
