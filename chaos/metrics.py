"""Goodput and uptime of a chaos run, computed from its merged event log.

DESIGN.md §6 defines both; this module fixes the details so the real chaos
runs and the simulator report the same numbers. Called by the checkers
(`goodput_at_least`, `uptime_at_least`) and by the report (headline numbers
and the per-window timelines it plots).

**Goodput** = learner time whose work reached the global model / learner
time allocated.

- Work that reached the model: every contribution id found in a commit
  manifest carries `work_s / P` seconds, `work_s` being the learner wall time
  its steps took (from the learner's first `push_invoke` of that id) and P
  the number of fragments: each step's work is split across the P fragments,
  so a contribution of one fragment carries 1/P of its steps' time.
- Allocated: per learner slot, from its first `join` (the initial start-up —
  interpreter, imports, data — is the same for every method and no fault's
  doing; a *restart* after a kill counts in full) to `run_end`, or to its
  last `process_exit` (or `kill_learner`) when no start follows —
  a learner that finished or was removed for good stops counting. Time the
  learner spent down, paused or partitioned in between counts: it was
  allocated and produced nothing. A learner the harness never started (no
  process events) counts from its first to its last own event.

**Where the rest went** (`Goodput.losses`, shares of allocated time):
`down`, learner time inside a scripted kill, pause or partition window (the
schedule's own cost: `bound` = 1 − down / allocated is the best goodput that
schedule allows); `startup`, from a restarted process's start to its join;
`catchup`, from each join to its learner caught up; `unmerged`, work pushed or
dropped that no commit merged; `other`, the rest: steps not yet pushed when a
learner was killed or the run ended, evaluations, waits.

**Uptime** = share of wall time in which the global model advanced. The
measured span runs from the first commit of a version >= 1 (before it the
run is warming up: learners load data and do their first H/P steps) to the
last learner `train` event, capped by `run_end` (after every learner stopped
training nothing is expected to advance, but a coordinator that stays dead
while learners still train is counted down). The span is cut into windows
of `window_s` seconds from its start; a window advanced if at least one
fragment committed in it; the last, shorter window weighs by its length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from chaos.history import (
    COORDINATOR,
    HARNESS,
    Event,
    fragment_count,
    learner_ids,
    run_bounds,
    stale_exits,
)
from protos.contribution import ContributionId

DEFAULT_WINDOW_S = 2.0


@dataclass(frozen=True)
class LearnerGoodput:
    allocated_s: float
    useful_s: float
    merged: int

    @property
    def goodput(self) -> float:
        return self.useful_s / self.allocated_s if self.allocated_s > 0 else 0.0


@dataclass(frozen=True)
class Goodput:
    value: float
    useful_s: float
    allocated_s: float
    fragments: int
    per_learner: dict[str, LearnerGoodput]
    # Work (already divided by P) pushed or dropped but never merged, pending included.
    unmerged_s: float = 0.0
    # Merged contributions without a push_invoke to take work_s from (counted as 0).
    missing_work: list[ContributionId] = field(default_factory=list)
    # Allocated learner seconds spent down (scripted fault windows), starting up
    # after a restart and catching up after a join (see the module doc).
    down_s: float = 0.0
    startup_s: float = 0.0
    catchup_s: float = 0.0

    @property
    def bound(self) -> float:
        """The best goodput the schedule allows: 1 − scripted down time / allocated."""
        return 1.0 - self.down_s / self.allocated_s if self.allocated_s > 0 else 0.0

    @property
    def losses(self) -> dict[str, float]:
        """Shares of allocated time that did not reach the model, by cause; with
        `value` they sum to 1."""
        if self.allocated_s <= 0:
            return {}
        named = {"down": self.down_s, "startup": self.startup_s, "catchup": self.catchup_s,
                 "unmerged": self.unmerged_s}
        other = self.allocated_s - self.useful_s - sum(named.values())
        return {k: v / self.allocated_s for k, v in {**named, "other": max(other, 0.0)}.items()}


@dataclass(frozen=True)
class Stall:
    """The longest stretch without a commit; `before`/`after` index the
    commits around it (`after` None: it lasted to the end of the span)."""

    start: float
    end: float
    before: int | None
    after: int | None

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Uptime:
    value: float
    window_s: float
    start: float
    end: float
    windows: int
    advanced: int
    longest_stall: Stall | None


@dataclass(frozen=True)
class Window:
    """One window of the timelines the report plots."""

    start: float
    end: float
    allocated_s: float
    useful_s: float
    commits: int

    @property
    def goodput(self) -> float:
        return self.useful_s / self.allocated_s if self.allocated_s > 0 else 0.0

    @property
    def advanced(self) -> bool:
        return self.commits > 0


# -- goodput ---------------------------------------------------------------------------


def allocations(events: Sequence[Event]) -> dict[str, tuple[float, float]]:
    """Per learner slot, the (start, end) of its allocation (see the module doc)."""
    _, run_end = run_bounds(events)
    stale = stale_exits(events)
    result: dict[str, tuple[float, float]] = {}
    for learner in learner_ids(events):
        start: float | None = None
        stopped: float | None = None  # time of the last exit/kill not followed by a start
        own = [e.t for e in events if e.source == learner]
        for e in events:
            if e.source != HARNESS:
                continue
            if e.kind == "process_start" and e.get("name") == learner:
                start = e.t if start is None else start
                stopped = None
            elif ((e.kind == "process_exit" and e.get("name") == learner
                   and e.index not in stale)
                  or (e.kind == "fault" and e.get("fault") == "kill_learner"
                      and e.get("target") == learner and e.get("action", "inject") == "inject")):
                stopped = e.t if stopped is None else stopped
        if start is None:
            if own:
                result[learner] = (own[0], own[-1])
            continue
        joins = [e.t for e in events if e.source == learner and e.kind == "join"]
        if joins and joins[0] > start and (stopped is None or joins[0] < stopped):
            start = joins[0]
        result[learner] = (start, stopped if stopped is not None else max(run_end, start))
    return result


def merged_ids(events: Sequence[Event]) -> set[ContributionId]:
    return {cid for e in events if e.kind == "commit" and e.source == COORDINATOR
            for cid in e.manifest()}


def invocations(events: Sequence[Event]) -> dict[ContributionId, Event]:
    """The first push_invoke of every contribution id (re-pushes carry the same work)."""
    first: dict[ContributionId, Event] = {}
    for e in events:
        if e.kind == "push_invoke" and e.source != COORDINATOR:
            first.setdefault(e.cid, e)
    return first


def goodput(events: Sequence[Event]) -> Goodput:
    p = max(fragment_count(events), 1)
    merged = merged_ids(events)
    invoked = invocations(events)
    useful: dict[str, float] = {}
    counts: dict[str, int] = {}
    learners = set(learner_ids(events))
    missing = []
    for cid in sorted(merged):
        if cid.learner_id not in learners:
            continue  # an adversary's: no learner time behind it
        invoke = invoked.get(cid)
        if invoke is None or not invoke.has("work_s"):
            missing.append(cid)
            continue
        useful[cid.learner_id] = useful.get(cid.learner_id, 0.0) + invoke.number("work_s") / p
        counts[cid.learner_id] = counts.get(cid.learner_id, 0) + 1
    unmerged = sum(e.number("work_s") for cid, e in invoked.items()
                 if cid not in merged and e.has("work_s"))
    unmerged += sum(e.number("work_s") for e in events
                  if e.kind == "dropped" and not e.has("seq") and e.has("work_s"))
    allocated_spans = allocations(events)
    per_learner = {lid: LearnerGoodput(end - start, useful.get(lid, 0.0), counts.get(lid, 0))
                   for lid, (start, end) in allocated_spans.items()}
    allocated = sum(g.allocated_s for g in per_learner.values())
    total_useful = sum(useful.values())
    down, startup, catchup = _time_away(events, allocated_spans)
    return Goodput(value=total_useful / allocated if allocated > 0 else 0.0,
                   useful_s=total_useful, allocated_s=allocated, fragments=p,
                   per_learner=per_learner, unmerged_s=unmerged / p, missing_work=missing,
                   down_s=down, startup_s=startup, catchup_s=catchup)


# Learner faults whose scripted windows take the learner away from training.
DOWN_FAULTS = ("kill_learner", "pause_learner", "partition_learner")


def _time_away(events: Sequence[Event],
               spans: dict[str, tuple[float, float]]) -> tuple[float, float, float]:
    """Allocated seconds spent (down, starting up, catching up), summed over learners."""
    down = startup = catchup = 0.0
    for learner, (lo, hi) in spans.items():

        def clipped(start: float, end: float, lo: float = lo, hi: float = hi) -> float:
            return max(0.0, min(end, hi) - max(start, lo))

        opened: dict[str, float] = {}
        started: float | None = None
        joined: float | None = None
        for e in events:
            if (e.source == HARNESS and e.kind == "fault" and e.get("fault") in DOWN_FAULTS
                    and e.get("target") == learner):
                fault = str(e.get("fault"))
                if e.get("action", "inject") == "inject":
                    opened.setdefault(fault, e.t)
                elif fault in opened:
                    down += clipped(opened.pop(fault), e.t)
            elif (e.source == HARNESS and e.kind == "process_start"
                  and e.get("name") == learner and e.t > lo):
                started = e.t  # a restart: the first start is before the allocation
            elif e.source == learner and e.kind == "join":
                if started is not None:
                    startup += clipped(started, e.t)
                    started = None
                joined = e.t
            elif e.source == learner and e.kind == "catch_up" and joined is not None:
                catchup += clipped(joined, e.t)
                joined = None
        down += sum(clipped(t, hi) for t in opened.values())  # never healed
    return down, startup, catchup


# -- uptime ------------------------------------------------------------------------------


def _commits(events: Sequence[Event]) -> list[Event]:
    return [e for e in events if e.kind == "commit" and e.source == COORDINATOR
            and isinstance(e.get("version"), int) and e.get("version") >= 1]


def uptime_span(events: Sequence[Event]) -> tuple[float, float] | None:
    """The (start, end) uptime is measured over; None if nothing ever committed."""
    commits = _commits(events)
    if not commits:
        return None
    _, run_end = run_bounds(events)
    start = commits[0].t
    trains = [e.t for e in events if e.kind == "train" and e.source != COORDINATOR]
    end = min(max(trains), run_end) if trains else commits[-1].t
    return start, max(start, end)


def uptime(events: Sequence[Event], window_s: float = DEFAULT_WINDOW_S) -> Uptime:
    if window_s <= 0:
        raise ValueError(f"window_s must be positive, got {window_s}")
    span = uptime_span(events)
    if span is None:
        start, end = run_bounds(events)
        return Uptime(0.0, window_s, start, end, 0, 0, Stall(start, end, None, None))
    start, end = span
    commits = [e for e in _commits(events) if start <= e.t <= end]
    if end <= start:
        return Uptime(1.0, window_s, start, end, 1, 1, None)
    n = math.ceil((end - start) / window_s)
    hit = [False] * n
    for e in commits:
        hit[min(int((e.t - start) / window_s), n - 1)] = True
    stall = Stall(start, start, None, None)
    for before, after in pairwise(commits):
        if after.t - before.t > stall.seconds:
            stall = Stall(before.t, after.t, before.index, after.index)
    if end - commits[-1].t > stall.seconds:
        stall = Stall(commits[-1].t, end, commits[-1].index, None)
    return Uptime(advanced_share(hit, start, end, window_s), window_s, start, end, n,
                  sum(hit), stall)


def advanced_share(hit: Sequence[bool], start: float, end: float, window_s: float) -> float:
    """Uptime from the windows of [start, end] that advanced (`hit[k]`, k-th window):
    their share of the span, the last, shorter window weighed by its length. The
    simulator calls this with the windows it marks from its own commit times."""
    if end <= start:
        return 1.0
    up = sum(min(start + (k + 1) * window_s, end) - (start + k * window_s)
             for k, advanced in enumerate(hit) if advanced)
    return up / (end - start)


# -- timelines ---------------------------------------------------------------------------


def timeline(events: Sequence[Event], window_s: float = DEFAULT_WINDOW_S) -> list[Window]:
    """Per window of the whole run: allocated and useful learner seconds, commits.

    A merged contribution's useful time is spread evenly over the `work_s`
    before its first push, the stretch in which its steps ran.
    """
    if window_s <= 0:
        raise ValueError(f"window_s must be positive, got {window_s}")
    run_start, run_end = run_bounds(events)
    if run_end <= run_start:
        return []
    n = math.ceil((run_end - run_start) / window_s)
    edges = [run_start + k * window_s for k in range(n)] + [run_end]
    allocated = [0.0] * n
    useful = [0.0] * n
    commits = [0] * n

    def spread(into: list[float], lo: float, hi: float, amount: float) -> None:
        if hi <= lo:
            k = min(max(int((lo - run_start) / window_s), 0), n - 1)
            into[k] += amount
            return
        for k in range(max(int((lo - run_start) / window_s), 0), n):
            overlap = min(hi, edges[k + 1]) - max(lo, edges[k])
            if overlap > 0:
                into[k] += amount * overlap / (hi - lo)
            if edges[k + 1] >= hi:
                break

    for lo, hi in allocations(events).values():
        spread(allocated, lo, hi, hi - lo)
    p = max(fragment_count(events), 1)
    invoked = invocations(events)
    for cid in merged_ids(events):
        invoke = invoked.get(cid)
        if invoke is not None and invoke.has("work_s"):
            work = invoke.number("work_s")
            spread(useful, invoke.t - work, invoke.t, work / p)
    for e in _commits(events):
        if run_start <= e.t <= run_end:
            commits[min(int((e.t - run_start) / window_s), n - 1)] += 1
    return [Window(edges[k], edges[k + 1], allocated[k], useful[k], commits[k])
            for k in range(n)]
