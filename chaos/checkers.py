"""Invariant checkers: each judges a run's merged history after the fact.

The Jepsen split: the harness runs the experiment and records everything to
one event log; these functions read only that log (`chaos.history`) and
return a `CheckResult` per invariant of DESIGN.md §6. A failed check names
the events that broke it — their indices in the merged log — and its
message quotes the first few, so a reader can grep the log for `"#17"`
context or open `summary.json`. `run_all` runs every check the experiment
configures; the report and the harness's exit status read its results.

Every checker is a pure function of the events; none raises on a malformed
event: `run_all` turns a `MalformedEvent` into a failed result naming it.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any

from chaos import metrics
from chaos.history import (
    COORDINATOR,
    HARNESS,
    Event,
    MalformedEvent,
    adversary_ids,
    outages,
    versions_of,
)
from protos.contribution import ContributionId

# At most this many offending events are named per check (the count is in details).
MAX_NAMED = 20
# At most this many violations are spelled out in a result's details.
MAX_LISTED = 50
# ... and this many in its one-line message.
_MAX_IN_MESSAGE = 3


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    message: str
    events: list[int] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CheckConfig:
    """Which checks `run_all` runs and their thresholds; None (False) skips a check."""

    # A healthy learner must log `train` at least this often (no_learner_blocked).
    max_blocked_s: float | None = 30.0
    min_goodput: float | None = None
    min_uptime: float | None = None
    loss_must_drop: bool = True
    # Window of the uptime measure.
    window_s: float = metrics.DEFAULT_WINDOW_S
    # From each leader fault to the first commit of a newer epoch (failover_within).
    max_failover_s: float | None = None


@dataclass(frozen=True)
class _Violation:
    text: str
    events: tuple[int, ...]


def _result(name: str, violations: list[_Violation], passed_message: str,
            failed_summary: str, details: dict[str, Any]) -> CheckResult:
    if not violations:
        return CheckResult(name, True, passed_message, [], details)
    named: dict[int, None] = {}
    for violation in violations:
        named.update((i, None) for i in violation.events)
    shown = "; ".join(v.text for v in violations[:_MAX_IN_MESSAGE])
    more = len(violations) - _MAX_IN_MESSAGE
    message = f"{failed_summary}: {shown}" + (f"; and {more} more" if more > 0 else "")
    details = {**details, "violation_count": len(violations),
               "violations": [{"text": v.text, "events": list(v.events)}
                              for v in violations[:MAX_LISTED]]}
    return CheckResult(name, False, message, list(named)[:MAX_NAMED], details)


def _coordinator(events: Sequence[Event], kind: str) -> list[Event]:
    return [e for e in events if e.kind == kind and e.source == COORDINATOR]


def _learner_side(events: Sequence[Event], kind: str) -> list[Event]:
    return [e for e in events if e.kind == kind and e.source not in (COORDINATOR, HARNESS)]


def _resumes(events: Sequence[Event]) -> list[Event]:
    """Where a coordinator took over the run from its durable state: a restart
    (`resume`) or a replica elected leader (`elected`); both list the versions."""
    return [e for e in events if e.source == COORDINATOR and e.kind in ("resume", "elected")]


# -- exactly-once ---------------------------------------------------------------------------


def merged_at_most_once(events: Sequence[Event]) -> CheckResult:
    """No contribution id appears in two commit manifests (or twice in one)."""
    first: dict[ContributionId, Event] = {}
    violations = []
    for commit in _coordinator(events, "commit"):
        for cid in commit.manifest():
            earlier = first.get(cid)
            if earlier is None:
                first[cid] = commit
                continue
            where = ("twice in commit" if earlier.index == commit.index
                     else f"in commit #{earlier.index} (v{earlier.get('version')}) and again in")
            violations.append(_Violation(
                f"{cid} merged {where} #{commit.index} (v{commit.get('version')})",
                tuple(sorted({earlier.index, commit.index}))))
    return _result("merged_at_most_once", violations,
                   f"{len(first)} contributions merged, none twice",
                   "contributions merged more than once", {"merged": len(first)})


def _kills(events: Sequence[Event]) -> dict[str, list[Event]]:
    """Per learner, the events that cost it its in-memory outbox: kill faults
    and unclean process exits (a clean exit owes its reports)."""
    kills: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        if e.source != HARNESS:
            continue
        if (e.kind == "fault" and e.get("fault") in ("kill_learner", "restart_learner")
                and e.get("action", "inject") == "inject"):
            kills[str(e.get("target"))].append(e)
        elif e.kind == "process_exit" and e.get("code") != 0:
            kills[str(e.get("name"))].append(e)
    return kills


def _lost_with_learner(cid: ContributionId, ack: Event, resume: Event, kills: list[Event],
                       events: Sequence[Event]) -> bool:
    """Whether the learner was killed after `ack` before it could push `cid`
    again: before it re-joined the restarted coordinator, or while its re-push
    was under way (invoked, never acknowledged)."""
    for kill in kills:
        if kill.index <= ack.index:
            continue
        between = [e for e in events if resume.index < e.index < kill.index]
        rejoined = any(e.kind == "join" and e.source == cid.learner_id for e in between)
        repushing = any(e.kind == "push_invoke" and e.source == cid.learner_id
                        and e.get("fragment") == cid.fragment and e.get("seq") == cid.seq
                        for e in between)
        if not rejoined or repushing:
            return True
    return False


def acknowledged_settled(events: Sequence[Event]) -> CheckResult:
    """Every contribution the coordinator acknowledged was merged or reported dropped.

    Judged per contribution id, from its last coordinator push_ack (a re-push
    after a coordinator restart acknowledges it again). Besides merged (in a
    commit manifest) and dropped (a learner `dropped` event with a reason),
    three outcomes are allowed and counted:

    - merged_unlogged: the learner saw it merged and no manifest in the log
      holds it, but a later `resume` shows the fragment reached the version
      the ack targeted while the log's last commit was below it — the
      coordinator died between making that commit durable and logging it.
    - lost_with_killed_learner: after the ack the coordinator restarted (its
      open round died with it) and the learner was killed (its outbox too)
      before it could push it again: before it re-joined the restarted
      coordinator, or with that re-push under way. A clean exit excuses
      nothing.
    - pending_at_end: the fragment never committed after the ack.

    Contributions an adversary process got acknowledged are only counted.
    Failures: an id both merged and dropped; merged by the learner's account
    only, with no unlogged commit to explain it; dropped without a reason; the
    round that accepted it committed without it; or lost to a coordinator
    restart while its learner lived on and never re-pushed or dropped it.
    """
    acks: dict[ContributionId, list[Event]] = defaultdict(list)
    for e in _coordinator(events, "push_ack"):
        acks[e.cid].append(e)
    in_manifest: dict[ContributionId, Event] = {}
    commits: dict[int, list[Event]] = defaultdict(list)
    for commit in _coordinator(events, "commit"):
        commits[commit.integer("fragment")].append(commit)
        for cid in commit.manifest():
            in_manifest.setdefault(cid, commit)
    seen_merged = {e.cid: e for e in _learner_side(events, "merged")}
    dropped = {e.cid: e for e in _learner_side(events, "dropped") if e.has("seq")}
    resumes = _resumes(events)
    kills = _kills(events)
    adversaries = adversary_ids(events)

    outcomes: Counter[str] = Counter()
    drop_reasons: Counter[str] = Counter()
    violations = []
    for cid, cid_acks in acks.items():
        if cid.learner_id in adversaries:
            outcomes["adversary"] += 1  # an attacker owes no one a report
            continue
        ack = cid_acks[-1]
        named = tuple(a.index for a in cid_acks)
        merged_by = in_manifest.get(cid)
        drop = dropped.get(cid)
        resume = next((r for r in resumes if r.index > ack.index), None)
        if merged_by is not None and drop is not None:
            violations.append(_Violation(
                f"{cid} merged in #{merged_by.index} but reported dropped "
                f"({drop.get('reason')!r}) in #{drop.index}",
                (*named, merged_by.index, drop.index)))
        elif merged_by is not None:
            outcomes["merged"] += 1
        elif cid in seen_merged:
            if _unlogged_commit(ack, resume, commits[cid.fragment]):
                outcomes["merged_unlogged"] += 1
            else:
                violations.append(_Violation(
                    f"{cid} acknowledged (#{ack.index}), reported merged by its learner "
                    f"(#{seen_merged[cid].index}), but no commit manifest holds it",
                    (*named, seen_merged[cid].index)))
        elif drop is not None:
            reason = drop.get("reason")
            if isinstance(reason, str) and reason:
                outcomes["dropped"] += 1
                drop_reasons[reason] += 1
            else:
                violations.append(_Violation(f"{cid} dropped without a reason in #{drop.index}",
                                             (*named, drop.index)))
        else:
            after = [c for c in commits[cid.fragment] if c.index > ack.index]
            if after and (resume is None or after[0].index < resume.index):
                violations.append(_Violation(
                    f"{cid} accepted (#{ack.index}) into the round for v{ack.get('target')}, "
                    f"but commit #{after[0].index} (v{after[0].get('version')}) omits it and it "
                    f"was never merged nor dropped", (*named, after[0].index)))
            elif not after:
                outcomes["pending_at_end"] += 1
            elif resume is not None and _lost_with_learner(
                    cid, ack, resume, kills.get(cid.learner_id, []), events):
                outcomes["lost_with_killed_learner"] += 1
            else:
                assert resume is not None
                violations.append(_Violation(
                    f"{cid} acknowledged (#{ack.index}) then lost: the coordinator restarted "
                    f"(#{resume.index}) and fragment {cid.fragment} committed again "
                    f"(#{after[0].index}), but its learner, not killed before it could, "
                    f"neither re-pushed nor dropped it", (*named, resume.index, after[0].index)))
    details: dict[str, Any] = {"acknowledged": len(acks), **outcomes,
                               "drop_reasons": dict(drop_reasons)}
    summary = ", ".join(f"{n} {what}" for what, n in sorted(outcomes.items()))
    return _result("acknowledged_settled", violations,
                   f"{len(acks)} acknowledged contributions settled ({summary or 'none'})",
                   "acknowledged contributions not settled", details)


def _unlogged_commit(ack: Event, resume: Event | None, commits: list[Event]) -> bool:
    """Whether `resume` shows a commit of the ack's target version that the log lacks."""
    if resume is None or not isinstance(ack.get("target"), int):
        return False
    fragment, target = ack.integer("fragment"), ack.integer("target")
    logged = max((c.integer("version") for c in commits if c.index < resume.index), default=0)
    return logged < target <= versions_of(resume).get(fragment, -1)


# -- versions -------------------------------------------------------------------------------


def versions_monotonic(events: Sequence[Event]) -> CheckResult:
    """Per fragment: init is v0, each commit is the last version + 1, and a
    coordinator resume never goes back below the last version committed.
    Per learner process and fragment, applied versions strictly increase."""
    last: dict[int, Event] = {}  # fragment -> the event that set its current version
    version: dict[int, int] = {}
    violations = []
    for e in events:
        if e.source == COORDINATOR and e.kind == "init":
            p = e.integer("fragment")
            if p in version:
                violations.append(_Violation(
                    f"fragment {p} initialized again (#{e.index}) at v{version[p]} "
                    f"(set by #{last[p].index})", (last[p].index, e.index)))
            last[p], version[p] = e, 0
        elif e.source == COORDINATOR and e.kind == "commit":
            p, v = e.integer("fragment"), e.integer("version")
            if p not in version:
                violations.append(_Violation(
                    f"fragment {p} committed v{v} (#{e.index}) without an init or resume "
                    f"before it", (e.index,)))
            elif v != version[p] + 1:
                violations.append(_Violation(
                    f"fragment {p} went from v{version[p]} (#{last[p].index}) to v{v} "
                    f"(#{e.index})", (last[p].index, e.index)))
            last[p], version[p] = e, v
        elif e.source == COORDINATOR and e.kind in ("resume", "elected"):
            resumed = versions_of(e)
            for p in sorted(version):
                if resumed.get(p, -1) < version[p]:
                    violations.append(_Violation(
                        f"coordinator resumed (#{e.index}) fragment {p} at "
                        f"v{resumed.get(p, -1)}, below v{version[p]} (#{last[p].index})",
                        (last[p].index, e.index)))
            for p, v in resumed.items():
                last[p], version[p] = e, v
    violations.extend(_applied_violations(events))
    versions = {str(p): v for p, v in sorted(version.items())}
    return _result("versions_monotonic", violations,
                   f"versions advanced one at a time; final {versions}",
                   "versions not monotonic", {"final_versions": versions})


def _applied_violations(events: Sequence[Event]) -> list[_Violation]:
    applied: dict[tuple[str, int], Event] = {}
    violations = []
    for e in events:
        if e.source == HARNESS and e.kind == "process_start":
            name = str(e.get("name"))
            for key in [k for k in applied if k[0] == name]:
                del applied[key]  # a new process of that learner starts from scratch
        elif e.kind == "applied" and e.source not in (COORDINATOR, HARNESS):
            key = (e.learner, e.integer("fragment"))
            before = applied.get(key)
            if before is not None and e.integer("version") <= before.integer("version"):
                violations.append(_Violation(
                    f"learner {key[0]} applied fragment {key[1]} v{e.get('version')} "
                    f"(#{e.index}) after v{before.get('version')} (#{before.index})",
                    (before.index, e.index)))
            applied[key] = e
    return violations


# -- high availability ------------------------------------------------------------------------


def no_split_brain(events: Sequence[Event]) -> CheckResult:
    """At most one epoch commits each version of each fragment, and a fragment's
    commits never go back to an older epoch (a deposed leader's late write)."""
    first: dict[tuple[int, int], Event] = {}
    newest: dict[int, Event] = {}
    violations = []
    for commit in _coordinator(events, "commit"):
        if not commit.has("epoch"):
            continue
        p, v, epoch = commit.integer("fragment"), commit.integer("version"), commit.integer("epoch")
        earlier = first.setdefault((p, v), commit)
        if earlier.integer("epoch") != epoch:
            violations.append(_Violation(
                f"fragment {p} v{v} committed under epoch {earlier.get('epoch')} "
                f"(#{earlier.index}) and epoch {epoch} (#{commit.index})",
                (earlier.index, commit.index)))
        before = newest.get(p)
        if before is not None and before.integer("epoch") > epoch:
            violations.append(_Violation(
                f"fragment {p} committed v{v} under epoch {epoch} (#{commit.index}) after "
                f"epoch {before.get('epoch')} had (#{before.index})",
                (before.index, commit.index)))
        else:
            newest[p] = commit
    epochs = sorted({e.integer("epoch") for e in newest.values()})
    return _result("no_split_brain", violations,
                   f"{len(first)} fragment versions, each committed under one epoch "
                   f"(epochs at the end: {epochs})",
                   "split brain", {"versions": len(first)})


def failover_within(events: Sequence[Event], bound_s: float) -> CheckResult:
    """After each leader fault, a newer epoch commits within `bound_s`.

    The harness logs the leader's epoch with each injection; the failover ends
    at the first `commit` of a higher epoch at or after the injection."""
    commits = [c for c in _coordinator(events, "commit") if c.has("epoch")]
    violations = []
    seconds: list[float] = []
    for fault in events:
        if not (fault.source == HARNESS and fault.kind == "fault"
                and fault.get("action") == "inject" and fault.has("epoch")):
            continue
        epoch = fault.integer("epoch")
        after = next((c for c in commits
                      if c.integer("epoch") > epoch and c.t >= fault.t), None)
        if after is None:
            violations.append(_Violation(
                f"{fault.get('fault')} of {fault.get('target')} (#{fault.index}, epoch {epoch}): "
                f"no commit under a newer epoch followed", (fault.index,)))
            continue
        took = after.t - fault.t
        seconds.append(took)
        if took > bound_s:
            violations.append(_Violation(
                f"{fault.get('fault')} of {fault.get('target')} (#{fault.index}): first commit "
                f"of epoch {after.get('epoch')} (#{after.index}) {took:.2f}s later",
                (fault.index, after.index)))
    details = {"failover_s": [round(x, 3) for x in seconds], "bound_s": bound_s}
    if not seconds and not violations:
        return CheckResult("failover_within", True, "no leader faults injected", [], details)
    return _result("failover_within", violations,
                   f"{len(seconds)} failovers, longest {max(seconds):.2f}s <= {bound_s:g}s"
                   if seconds else "", f"failover longer than {bound_s:g}s", details)


# -- liveness -------------------------------------------------------------------------------


def no_learner_blocked(events: Sequence[Event], bound_s: float) -> CheckResult:
    """While a learner is healthy, it logs `train` at least every `bound_s` seconds.

    Not healthy: down, paused or partitioned (`history.outages`), and the
    `bound_s` after such an outage heals (a restarted learner catches up
    first). The span between a learner's first and last `train` is judged,
    and, when the run was cut at `max_duration_s`, the span from its last
    `train` to the cut if its process was still running then and had not
    ended its training (`train_end`: it evaluates and flushes after that): a
    cluster that froze near its end would otherwise pass. What counts is the
    longest healthy stretch inside each gap.
    """
    if bound_s <= 0:
        raise ValueError(f"bound_s must be positive, got {bound_s}")
    exempt: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for o in outages(events):
        exempt[o.target].append((o.start, math.inf if o.end is None else o.end + bound_s))
    trains: dict[str, list[Event]] = defaultdict(list)
    for e in _learner_side(events, "train"):
        trains[e.learner].append(e)
    cut = next((e for e in events if e.source == HARNESS and e.kind == "run_stop"
                and e.get("reason") == "max_duration_s reached"), None)
    found: list[tuple[float, _Violation]] = []
    longest: dict[str, float] = {}
    for learner in sorted(trains):
        series = trains[learner]
        longest[learner] = 0.0
        gaps = [(a, b, f"between train #{a.index} and #{b.index}")
                for a, b in pairwise(series)]
        last = series[-1]
        if cut is not None and not any(
                ((e.source == HARNESS and e.kind == "process_exit" and e.get("name") == learner)
                 or (e.source == learner and e.kind == "train_end"))
                and last.t <= e.t <= cut.t for e in events):
            gaps.append((last, cut, f"from train #{last.index} to the cut at "
                                    f"max_duration_s (#{cut.index})"))
        for a, b, where in gaps:
            stretch = _longest_uncovered(a.t, b.t, exempt[learner])
            longest[learner] = max(longest[learner], stretch)
            if stretch > bound_s:
                found.append((stretch, _Violation(
                    f"learner {learner} made no progress for {stretch:.1f}s while healthy "
                    f"(bound {bound_s:g}s) {where}", (a.index, b.index))))
    found.sort(key=lambda f: -f[0])
    details = {"bound_s": bound_s,
               "longest_healthy_gap_s": {k: round(v, 3) for k, v in longest.items()}}
    worst = max(longest.values(), default=0.0)
    return _result("no_learner_blocked", [v for _, v in found],
                   f"{len(trains)} learners progressed; longest healthy gap {worst:.1f}s "
                   f"<= {bound_s:g}s", "learners blocked while healthy", details)


def _longest_uncovered(lo: float, hi: float, covered: list[tuple[float, float]]) -> float:
    """The longest part of (lo, hi) outside every interval in `covered`."""
    best, cursor = 0.0, lo
    for start, end in sorted(covered):
        if end <= cursor or start >= hi:
            continue
        best = max(best, min(start, hi) - cursor)
        cursor = max(cursor, end)
        if cursor >= hi:
            break
    return max(best, hi - cursor)


# -- training quality ------------------------------------------------------------------------


def loss_decreased(events: Sequence[Event]) -> CheckResult:
    """Each learner's last held-out loss is below its first (learners with two
    or more evals; at least one learner must have two)."""
    evals: dict[str, list[Event]] = defaultdict(list)
    for e in _learner_side(events, "eval"):
        evals[e.learner].append(e)
    per_learner: dict[str, dict[str, float]] = {}
    violations = []
    for learner in sorted(evals):
        series = evals[learner]
        if len(series) < 2:
            continue
        first, last = series[0], series[-1]
        start, end = first.number("loss"), last.number("loss")
        per_learner[learner] = {"start": start, "end": end}
        if not end < start:
            violations.append(_Violation(
                f"learner {learner} eval loss {start:.4g} (#{first.index}) -> {end:.4g} "
                f"(#{last.index})", (first.index, last.index)))
    details: dict[str, Any] = {"per_learner": per_learner}
    if per_learner:
        details["mean_start"] = sum(v["start"] for v in per_learner.values()) / len(per_learner)
        details["mean_end"] = sum(v["end"] for v in per_learner.values()) / len(per_learner)
    if not per_learner:
        return CheckResult("loss_decreased", False, "no learner logged two eval events",
                           [e.index for series in evals.values() for e in series][:MAX_NAMED],
                           details)
    return _result("loss_decreased", violations,
                   f"eval loss fell on {len(per_learner)} learners: mean "
                   f"{details['mean_start']:.4g} -> {details['mean_end']:.4g}",
                   "eval loss did not fall", details)


# -- goodput and uptime ----------------------------------------------------------------------


def goodput_at_least(events: Sequence[Event], floor: float) -> CheckResult:
    """Goodput (`chaos.metrics.goodput`) is at least `floor`. On failure names
    the contributions whose work was lost, most work first."""
    g = metrics.goodput(events)
    details = {"goodput": g.value, "floor": floor, "useful_s": g.useful_s,
               "allocated_s": g.allocated_s, "unmerged_s": g.unmerged_s, "bound": g.bound,
               "losses": {k: round(v, 4) for k, v in g.losses.items()},
               "fragments": g.fragments,
               "per_learner": {k: round(v.goodput, 4) for k, v in g.per_learner.items()}}
    message = (f"goodput {g.value:.3f} ({g.useful_s:.1f}s useful of {g.allocated_s:.1f}s "
               f"allocated)")
    if g.value >= floor:
        return CheckResult("goodput_at_least", True, f"{message} >= {floor:g}", [], details)
    merged = metrics.merged_ids(events)
    lost = [e for cid, e in metrics.invocations(events).items() if cid not in merged]
    lost += [e for e in events if e.kind == "dropped" and not e.has("seq")]
    lost.sort(key=lambda e: -float(e.get("work_s") or 0.0))
    return CheckResult("goodput_at_least", False, f"{message} < {floor:g}",
                       [e.index for e in lost[:MAX_NAMED]], details)


def uptime_at_least(events: Sequence[Event], floor: float,
                    window_s: float = metrics.DEFAULT_WINDOW_S) -> CheckResult:
    """Uptime (`chaos.metrics.uptime`) is at least `floor`. On failure names
    the two commits around the longest stretch without one."""
    u = metrics.uptime(events, window_s)
    stall = u.longest_stall
    details: dict[str, Any] = {"uptime": u.value, "floor": floor, "window_s": window_s,
                               "windows": u.windows, "advanced": u.advanced}
    if stall is not None:
        details["longest_stall_s"] = stall.seconds
    message = f"uptime {u.value:.3f} ({u.advanced} of {u.windows} windows of {window_s:g}s)"
    if u.value >= floor:
        return CheckResult("uptime_at_least", True, f"{message} >= {floor:g}", [], details)
    named = [i for i in (stall.before, stall.after) if i is not None] if stall else []
    if stall is not None and stall.seconds > 0:
        message += f"; longest stall {stall.seconds:.1f}s"
    return CheckResult("uptime_at_least", False, f"{message} < {floor:g}", named, details)


# -- all ---------------------------------------------------------------------------------------


def run_all(events: Sequence[Event], config: CheckConfig | None = None) -> list[CheckResult]:
    """Every check `config` enables, in a fixed order."""
    config = config or CheckConfig()
    checks: list[tuple[str, Callable[[], CheckResult]]] = [
        ("merged_at_most_once", lambda: merged_at_most_once(events)),
        ("acknowledged_settled", lambda: acknowledged_settled(events)),
        ("versions_monotonic", lambda: versions_monotonic(events)),
    ]
    if any(e.kind == "commit" and e.source == COORDINATOR and e.has("epoch") for e in events):
        checks.append(("no_split_brain", lambda: no_split_brain(events)))
    failover_bound = config.max_failover_s
    if failover_bound is not None:
        checks.append(("failover_within", lambda: failover_within(events, failover_bound)))
    bound = config.max_blocked_s
    if bound is not None:
        checks.append(("no_learner_blocked", lambda: no_learner_blocked(events, bound)))
    if config.loss_must_drop:
        checks.append(("loss_decreased", lambda: loss_decreased(events)))
    goodput_floor, uptime_floor = config.min_goodput, config.min_uptime
    if goodput_floor is not None:
        checks.append(("goodput_at_least", lambda: goodput_at_least(events, goodput_floor)))
    if uptime_floor is not None:
        checks.append(("uptime_at_least",
                       lambda: uptime_at_least(events, uptime_floor, config.window_s)))
    results = []
    for name, check in checks:
        try:
            results.append(check())
        except MalformedEvent as exc:
            results.append(CheckResult(name, False, f"malformed event: {exc}",
                                       [exc.index] if exc.index is not None else []))
    return results

