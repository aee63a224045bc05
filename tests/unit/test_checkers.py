"""Tests of the chaos history, checkers and metrics on hand-made event logs.

Each checker gets a small log that satisfies it and variants that break it,
and must name exactly the events that broke it. Goodput and uptime are
checked against numbers worked out by hand; loading is checked on real
files, including one cut short by a SIGKILL.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from chaos import checkers, metrics
from chaos.checkers import CheckConfig, CheckResult, run_all
from chaos.history import (
    DOWN,
    PAUSED,
    Event,
    events_from_records,
    fragment_count,
    learner_ids,
    load_events,
    load_log,
    outages,
    stale_exits,
    write_events,
)
from protos.contribution import ContributionId

# -- a hand-made log ----------------------------------------------------------------------


class LogBuilder:
    """Records in any order; `events()` sorts them by t (ties: insertion order)
    and `at(handle)` is the index a record ends up with."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._seq: dict[str, int] = {}
        self.version: dict[int, int] = {}  # the last version committed per fragment

    def add(self, t: float, source: str, kind: str, **fields: Any) -> int:
        self.records.append({"t": t, "source": source, "kind": kind, **fields})
        return len(self.records) - 1

    def events(self) -> list[Event]:
        return events_from_records(self.records)

    def at(self, handle: int) -> int:
        order = sorted(range(len(self.records)), key=lambda i: self.records[i]["t"])
        return order.index(handle)

    # shorthands ----------------------------------------------------------------------

    def harness(self, t: float, kind: str, **fields: Any) -> int:
        return self.add(t, "harness", kind, **fields)

    def coord(self, t: float, kind: str, **fields: Any) -> int:
        return self.add(t, "coordinator", kind, **fields)

    def learner(self, t: float, lid: str, kind: str, **fields: Any) -> int:
        return self.add(t, lid, kind, learner=lid, **fields)

    def fault(self, t: float, fault: str, target: str, action: str = "inject") -> int:
        return self.harness(t, "fault", fault=fault, target=target, action=action, detail="")

    def next_seq(self, lid: str) -> int:
        self._seq[lid] = self._seq.get(lid, 0) + 1
        return self._seq[lid]

    def push(self, t: float, lid: str, fragment: int, target: int, base: int | None = None,
             work_s: float = 2.0, seq: int | None = None) -> tuple[int, int]:
        """A learner's push, acknowledged: returns (seq, coordinator ack handle)."""
        seq = self.next_seq(lid) if seq is None else seq
        base = target - 1 if base is None else base
        self.learner(t, lid, "push_invoke", fragment=fragment, seq=seq, base_version=base,
                     c_steps=10, work_s=work_s)
        ack = self.coord(t + 0.01, "push_ack", learner=lid, fragment=fragment, seq=seq,
                         base_version=base, weight=1.0, staleness=0, target=target)
        self.learner(t + 0.02, lid, "push_ack", fragment=fragment, seq=seq, target=target,
                     weight=1.0, staleness=0)
        return seq, ack

    def commit(self, t: float, fragment: int, version: int,
               ids: list[tuple[str, int]]) -> int:
        manifest = [{"learner": lid, "seq": seq, "base_version": version - 1, "weight": 1.0,
                     "staleness": 0} for lid, seq in ids]
        handle = self.coord(t, "commit", fragment=fragment, version=version, manifest=manifest,
                            quorum_wait_s=0.1, grace_s=0.2, sync_s=0.01)
        self.version[fragment] = max(self.version.get(fragment, 0), version)
        for lid, seq in ids:
            self.learner(t + 0.05, lid, "merged", fragment=fragment, seq=seq)
        return handle


LEARNERS = ["l1", "l2"]


def healthy_run(end: float = 20.0, pushes_until: float | None = None) -> LogBuilder:
    """Two learners, two fragments, one commit per fragment every 4 s until
    `pushes_until` (default: the end), no faults."""
    log = LogBuilder()
    log.harness(0.0, "run_start", experiment="unit", seed=7, mode="async", learners=LEARNERS,
                fragments=2)
    log.harness(0.0, "process_start", role="coordinator", name="coordinator", pid=100)
    for i, lid in enumerate(LEARNERS):
        log.harness(0.1, "process_start", role="learner", name=lid, pid=101 + i)
        log.coord(0.5, "join", learner=lid, host="h", pid=101 + i, next_seq=1)
        log.learner(0.5, lid, "join", run_id="r", versions={"0": -1, "1": -1})
    for p in (0, 1):
        log.coord(0.6, "init", learner="l1", fragment=p, seq=log.next_seq("l1"))
    for lid, loss in zip(LEARNERS, (3.0, 3.1), strict=True):
        log.learner(1.0, lid, "eval", step=0, loss=loss)
    t = 1.0
    while t <= end - 1.0:
        for lid in LEARNERS:
            log.learner(t, lid, "train", step=int(t * 10), loss=3.0 - t / 10, tokens=100)
        t += 1.0
    version = {0: 0, 1: 0}
    for k, push_t in enumerate(range(2, int(pushes_until or end - 3), 2)):
        p = k % 2
        version[p] += 1
        ids = [(lid, log.push(push_t + 0.1 * i, lid, p, version[p])[0])
               for i, lid in enumerate(LEARNERS)]
        log.commit(push_t + 0.5, p, version[p], ids)
        for lid in LEARNERS:
            log.learner(push_t + 0.9, lid, "applied", fragment=p, version=version[p],
                        step=int(push_t * 10))
    for lid, loss in zip(LEARNERS, (1.0, 1.1), strict=True):
        log.learner(end - 0.5, lid, "eval", step=int(end * 10), loss=loss)
        log.harness(end - 0.2, "process_exit", name=lid, code=0)
    log.harness(end, "run_end", reason="finished")
    return log


def by_name(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {r.name: r for r in results}


# -- history -------------------------------------------------------------------------------


def test_healthy_run_passes_every_check() -> None:
    results = run_all(healthy_run().events(), CheckConfig(max_blocked_s=5.0, min_goodput=0.1,
                                                          min_uptime=0.8))
    assert [r.name for r in results] == [
        "merged_at_most_once", "acknowledged_settled", "versions_monotonic",
        "no_learner_blocked", "loss_decreased", "goodput_at_least", "uptime_at_least"]
    for r in results:
        assert r.passed, r.message
        assert r.events == []


def test_load_events_merges_sorts_and_skips_a_truncated_last_line(tmp_path: Path) -> None:
    a, b = tmp_path / "coordinator.events.jsonl", tmp_path / "l1.events.jsonl"
    a.write_text('{"t":1.0,"source":"coordinator","kind":"join","learner":"l1"}\n'
                 '{"t":3.0,"source":"coordinator","kind":"push_ack","learner":"l1"}\n')
    b.write_text('{"t":2.0,"source":"l1","kind":"join","learner":"l1"}\n'
                 '{"t":3.0,"source":"l1","kind":"train","step":1}\n'
                 '{"t":4.0,"source":"l1","kind":"tra')  # SIGKILLed mid-line
    log = load_log([a, b])
    assert [(e.t, e.source, e.kind) for e in log.events] == [
        (1.0, "coordinator", "join"), (2.0, "l1", "join"),
        (3.0, "coordinator", "push_ack"), (3.0, "l1", "train")]  # ties keep file order
    assert [e.index for e in log.events] == [0, 1, 2, 3]
    assert log.events[3].get("step") == 1
    assert len(log.skipped) == 1
    assert (log.skipped[0].path, log.skipped[0].line) == (str(b), 3)
    assert load_events([a, b]) == log.events


def test_load_keeps_the_whole_record_after_a_predecessors_broken_tail(tmp_path: Path) -> None:
    # A restarted learner appends to the log its killed predecessor cut short.
    path = tmp_path / "l1.events.jsonl"
    path.write_text('{"t":1.0,"source":"l1","kind":"train","step":1}\n'
                    '{"t":2.0,"source":"l1","ki{"t":5.0,"source":"l1","kind":"join"}\n'
                    'not json at all\n'
                    '[1, 2]\n'
                    '{"t":6.0,"source":"l1","kind":"eval","loss":1.5}\n')
    log = load_log([path])
    assert [e.kind for e in log.events] == ["train", "join", "eval"]
    assert [s.line for s in log.skipped] == [2, 3, 4]


def test_write_events_round_trips(tmp_path: Path) -> None:
    events = healthy_run().events()
    write_events(events, tmp_path / "events.jsonl")
    assert load_events([tmp_path / "events.jsonl"]) == events


def test_history_facts() -> None:
    log = healthy_run()
    pause = log.fault(5.0, "pause_learner", "l2")
    resume = log.fault(7.0, "pause_learner", "l2", action="heal")
    kill = log.fault(9.0, "kill_learner", "l1")
    restart = log.harness(11.0, "process_start", role="learner", name="l1", pid=200)
    log.harness(3.0, "process_start", role="adversary", name="evil", pid=300)
    log.add(3.5, "evil", "adversary", learner="evil", attack="nan")
    events = log.events()
    assert learner_ids(events) == LEARNERS
    assert fragment_count(events) == 2
    found = [(o.target, o.cause, o.start_index, o.end_index) for o in outages(events)
             if o.end is not None and o.start < 12]
    assert found == [("l2", PAUSED, log.at(pause), log.at(resume)),
                     ("l1", DOWN, log.at(kill), log.at(restart))]
    ack = next(e for e in events if e.kind == "push_ack" and e.source == "coordinator")
    assert ack.cid == ContributionId("l1", 0, 3)
    assert str(ack.cid) == "l1/0/3"
    assert "push_ack" in ack.describe(t0=0.0) and f"#{ack.index}" in ack.describe()


# -- merged_at_most_once ---------------------------------------------------------------------


def test_merged_twice_names_both_commits() -> None:
    log = healthy_run()
    first = next(i for i, r in enumerate(log.records)
                 if r["kind"] == "commit" and r["fragment"] == 0 and r["version"] == 1)
    again = log.commit(17.0, 0, 99, [("l2", 1)])
    result = checkers.merged_at_most_once(log.events())
    assert not result.passed
    assert result.events == [log.at(first), log.at(again)]
    assert "l2/0/1" in result.message


def test_merged_twice_in_one_manifest_is_caught() -> None:
    log = healthy_run()
    twice = log.commit(17.0, 1, 99, [("l2", 50), ("l2", 50)])
    result = checkers.merged_at_most_once(log.events())
    assert not result.passed and result.events == [log.at(twice)]


# -- acknowledged_settled -------------------------------------------------------------------


def test_dropped_pending_and_lost_with_killed_learner_are_allowed() -> None:
    log = healthy_run(end=30.0, pushes_until=10.0)
    assert log.version == {0: 2, 1: 2}
    seq, _ = log.push(20.0, "l1", 0, target=3)
    log.learner(20.5, "l1", "dropped", fragment=0, seq=seq, reason="stale", detail="too old")
    log.learner(20.6, "l2", "dropped", fragment=0, reason="backlog_full", work_s=1.0)
    log.push(21.0, "l2", 0, target=3)  # the coordinator then dies; l2 is killed too
    log.fault(21.5, "kill_coordinator", "coordinator")
    log.fault(21.6, "kill_learner", "l2")
    log.coord(22.0, "resume", run_id="r", versions={"0": 2, "1": 2})
    log.push(23.0, "l1", 1, target=3)  # fragment 1 never commits again: pending at end
    log.commit(24.0, 0, 3, [])
    result = checkers.acknowledged_settled(log.events())
    assert result.passed, result.message
    assert result.details["dropped"] == 1
    assert result.details["drop_reasons"] == {"stale": 1}
    assert result.details["lost_with_killed_learner"] == 1
    assert result.details["pending_at_end"] == 1


def test_a_round_committed_without_an_acknowledged_contribution_fails() -> None:
    log = healthy_run(end=30.0, pushes_until=10.0)
    _, ack = log.push(20.0, "l1", 0, target=3)
    commit = log.commit(21.0, 0, 3, [])
    result = checkers.acknowledged_settled(log.events())
    assert not result.passed
    assert result.events == [log.at(ack), log.at(commit)]
    assert "omits it" in result.message


def test_lost_to_a_coordinator_restart_while_its_learner_lived_fails() -> None:
    log = healthy_run(end=30.0, pushes_until=10.0)
    _, ack = log.push(20.0, "l1", 0, target=3)
    resume = log.coord(22.0, "resume", run_id="r", versions={"0": 2, "1": 2})
    commit = log.commit(24.0, 0, 3, [])
    result = checkers.acknowledged_settled(log.events())
    assert not result.passed
    assert result.events == [log.at(ack), log.at(resume), log.at(commit)]


def test_a_learner_killed_after_rejoining_must_have_been_re_pushing() -> None:
    log = healthy_run(end=30.0, pushes_until=10.0)
    seq, ack = log.push(20.0, "l1", 0, target=3)
    resume = log.coord(21.0, "resume", run_id="r", versions={"0": 2, "1": 2})
    log.learner(21.5, "l1", "join", run_id="r", versions={"0": 2, "1": 2})
    log.fault(23.0, "kill_learner", "l1")
    commit = log.commit(24.0, 0, 3, [])
    result = checkers.acknowledged_settled(log.events())
    assert not result.passed  # it re-joined and had time to push again, but never did
    assert result.events == [log.at(ack), log.at(resume), log.at(commit)]
    log.learner(21.6, "l1", "push_invoke", fragment=0, seq=seq, base_version=2, c_steps=10,
                work_s=2.0)
    result = checkers.acknowledged_settled(log.events())
    assert result.passed, result.message
    assert result.details["lost_with_killed_learner"] == 1


def test_a_re_pushed_contribution_is_judged_by_its_last_ack() -> None:
    log = healthy_run(end=30.0, pushes_until=10.0)
    seq, first = log.push(20.0, "l1", 0, target=3)
    log.coord(22.0, "resume", run_id="r", versions={"0": 2, "1": 2})
    _, again = log.push(23.0, "l1", 0, target=3, seq=seq)
    log.commit(24.0, 0, 3, [("l1", seq)])
    assert checkers.acknowledged_settled(log.events()).passed
    # Not merged after the re-push: both acks are named.
    log.records.pop()  # the learner's merged event
    log.records.pop()  # the commit
    commit = log.commit(24.0, 0, 3, [])
    result = checkers.acknowledged_settled(log.events())
    assert not result.passed
    assert result.events == [log.at(first), log.at(again), log.at(commit)]


def test_merged_and_dropped_fails() -> None:
    log = healthy_run(end=30.0, pushes_until=10.0)
    seq, ack = log.push(20.0, "l1", 0, target=3)
    commit = log.commit(21.0, 0, 3, [("l1", seq)])
    drop = log.learner(22.0, "l1", "dropped", fragment=0, seq=seq, reason="stale")
    result = checkers.acknowledged_settled(log.events())
    assert not result.passed
    assert result.events == [log.at(ack), log.at(commit), log.at(drop)]


def test_dropped_without_a_reason_fails() -> None:
    log = healthy_run(end=30.0, pushes_until=10.0)
    seq, ack = log.push(20.0, "l1", 0, target=3)
    drop = log.learner(22.0, "l1", "dropped", fragment=0, seq=seq, reason="")
    result = checkers.acknowledged_settled(log.events())
    assert not result.passed and result.events == [log.at(ack), log.at(drop)]


def test_merged_by_the_learners_account_needs_an_unlogged_commit() -> None:
    log = healthy_run(end=30.0, pushes_until=10.0)
    seq, ack = log.push(20.0, "l1", 0, target=3)
    seen = log.learner(23.0, "l1", "merged", fragment=0, seq=seq)
    result = checkers.acknowledged_settled(log.events())
    assert not result.passed and result.events == [log.at(ack), log.at(seen)]
    # The coordinator died after committing v5 durably but before logging it.
    log.coord(22.0, "resume", run_id="r", versions={"0": 3, "1": 2})
    result = checkers.acknowledged_settled(log.events())
    assert result.passed, result.message
    assert result.details["merged_unlogged"] == 1


def test_an_adversarys_acknowledged_pushes_are_only_counted() -> None:
    log = healthy_run(end=30.0, pushes_until=10.0)
    log.harness(19.0, "process_start", role="adversary", name="evil", pid=300)
    log.coord(20.0, "push_ack", learner="evil", fragment=0, seq=1, base_version=4, weight=1.0,
              staleness=0, target=3)
    log.coord(21.0, "resume", run_id="r", versions={"0": 2, "1": 2})
    log.commit(22.0, 0, 3, [])
    result = checkers.acknowledged_settled(log.events())
    assert result.passed and result.details["adversary"] == 1


# -- versions_monotonic ------------------------------------------------------------------------


def test_a_skipped_version_names_both_commits() -> None:
    log = healthy_run()
    last = max((i for i, r in enumerate(log.records)
                if r["kind"] == "commit" and r["fragment"] == 1), key=lambda i: log.records[i]["t"])
    skipped = log.commit(19.0, 1, log.records[last]["version"] + 2, [])
    result = checkers.versions_monotonic(log.events())
    assert not result.passed
    assert result.events == [log.at(last), log.at(skipped)]


def test_resume_may_go_forward_but_never_back() -> None:
    log = healthy_run(end=30.0, pushes_until=10.0)
    log.commit(20.0, 0, 3, [])
    log.coord(21.0, "resume", run_id="r", versions={"0": 4, "1": 2})  # v4 durable, unlogged
    last = log.commit(22.0, 0, 5, [])
    result = checkers.versions_monotonic(log.events())
    assert result.passed, result.message
    assert result.details["final_versions"] == {"0": 5, "1": 2}
    back = log.coord(23.0, "resume", run_id="r", versions={"0": 1, "1": 2})
    result = checkers.versions_monotonic(log.events())
    assert not result.passed
    assert result.events == [log.at(last), log.at(back)]


def test_commit_without_init_and_applied_going_back_fail() -> None:
    log = healthy_run()
    orphan = log.commit(18.0, 7, 1, [])
    first = log.learner(18.1, "l2", "applied", fragment=0, version=9, step=1)
    back = log.learner(18.2, "l2", "applied", fragment=0, version=8, step=2)
    result = checkers.versions_monotonic(log.events())
    assert not result.passed
    assert result.events == [log.at(orphan), log.at(first), log.at(back)]
    assert result.details["violation_count"] == 2


def test_a_restarted_learner_may_apply_an_older_version_than_its_predecessor() -> None:
    log = healthy_run()
    log.learner(18.1, "l2", "applied", fragment=0, version=9, step=1)
    log.harness(18.15, "process_start", role="learner", name="l2", pid=9)
    log.learner(18.2, "l2", "applied", fragment=0, version=8, step=2)
    result = checkers.versions_monotonic(log.events())
    assert result.passed, result.message


# -- no_learner_blocked -------------------------------------------------------------------------


def _trains(log: LogBuilder, lid: str, times: list[float]) -> list[int]:
    return [log.learner(t, lid, "train", step=i, loss=1.0, tokens=1) for i, t in enumerate(times)]


def test_a_long_gap_while_healthy_names_the_train_events_around_it() -> None:
    log = LogBuilder()
    log.harness(0.0, "run_start", learners=["a", "b"])
    a = _trains(log, "a", [1, 2, 3, 15, 16])
    _trains(log, "b", [1, 2, 3, 4])
    result = checkers.no_learner_blocked(log.events(), bound_s=5.0)
    assert not result.passed
    assert result.events == [log.at(a[2]), log.at(a[3])]
    assert result.details["longest_healthy_gap_s"] == {"a": 12.0, "b": 1.0}


def test_gaps_during_and_just_after_faults_are_excused() -> None:
    log = LogBuilder()
    log.harness(0.0, "run_start", learners=["a", "b", "c"])
    _trains(log, "a", [1, 2, 10, 11])  # paused 2.5..7, heal + 5 s bound covers ..12
    log.fault(2.5, "pause_learner", "a")
    log.fault(7.0, "pause_learner", "a", action="heal")
    _trains(log, "b", [1, 2, 14, 15])  # killed at 3, restarted at 10
    log.fault(3.0, "kill_learner", "b")
    log.harness(3.1, "process_exit", name="b", code=-9)
    log.harness(10.0, "process_start", role="learner", name="b", pid=1)
    _trains(log, "c", [1, 2, 9])  # partitioned, never healed
    log.fault(4.0, "partition_learner", "c")
    log.fault(4.0, "kill_coordinator", "coordinator")  # does not excuse anyone
    result = checkers.no_learner_blocked(log.events(), bound_s=5.0)
    assert result.passed, result.message


def test_a_fault_does_not_excuse_a_long_healthy_stretch_before_it() -> None:
    log = LogBuilder()
    log.harness(0.0, "run_start", learners=["a"])
    a = _trains(log, "a", [1, 20])
    log.fault(15.0, "pause_learner", "a")
    log.fault(16.0, "pause_learner", "a", action="heal")
    result = checkers.no_learner_blocked(log.events(), bound_s=5.0)
    assert not result.passed and result.events == [log.at(a[0]), log.at(a[1])]
    assert result.details["longest_healthy_gap_s"] == {"a": 14.0}


def test_a_cluster_frozen_until_the_run_is_cut_is_blocked() -> None:
    log = LogBuilder()
    log.harness(0.0, "run_start", learners=["a", "b"])
    a = _trains(log, "a", [1, 2, 3])
    _trains(log, "b", [1, 2, 3, 4])
    log.harness(4.5, "process_exit", name="b", code=0)  # b finished: not judged after
    cut = log.harness(50.0, "run_stop", reason="max_duration_s reached")
    log.harness(60.0, "run_end", reason="max_duration_s reached")
    result = checkers.no_learner_blocked(log.events(), bound_s=5.0)
    assert not result.passed
    assert result.events == [log.at(a[2]), log.at(cut)]
    assert "to the cut at max_duration_s" in result.message, result.message
    assert result.details["longest_healthy_gap_s"] == {"a": 47.0, "b": 1.0}


def test_a_learner_winding_down_at_the_cut_is_not_blocked() -> None:
    """Past its last step a learner evaluates and flushes (for up to 30 s when the
    coordinator is away); cut meanwhile, it was not blocked."""
    log = LogBuilder()
    log.harness(0.0, "run_start", learners=["a"])
    _trains(log, "a", [1, 2, 3])
    log.learner(3.1, "a", "train_end", step=3, reason="budget")
    log.harness(50.0, "run_stop", reason="max_duration_s reached")
    result = checkers.no_learner_blocked(log.events(), bound_s=5.0)
    assert result.passed, result.message


def test_a_run_whose_learners_finished_is_not_judged_after_them() -> None:
    log = LogBuilder()
    log.harness(0.0, "run_start", learners=["a"])
    _trains(log, "a", [1, 2, 3])
    log.harness(50.0, "run_stop", reason="learners finished")
    result = checkers.no_learner_blocked(log.events(), bound_s=5.0)
    assert result.passed, result.message


# -- loss_decreased ------------------------------------------------------------------------------


def test_loss_not_decreasing_names_first_and_last_eval() -> None:
    log = healthy_run()
    first = log.learner(19.7, "l2", "eval", step=1, loss=3.5)
    events = log.events()
    result = checkers.loss_decreased(events)
    assert not result.passed
    start = next(e.index for e in events if e.kind == "eval" and e.learner == "l2")
    assert result.events == [start, log.at(first)]
    assert result.details["per_learner"]["l1"] == {"start": 3.0, "end": 1.0}


def test_loss_decreased_needs_a_learner_with_two_evals() -> None:
    log = LogBuilder()
    only = log.learner(1.0, "a", "eval", step=0, loss=2.0)
    result = checkers.loss_decreased(log.events())
    assert not result.passed and result.events == [log.at(only)]
    log.learner(2.0, "b", "eval", step=0, loss=2.0)
    log.learner(3.0, "b", "eval", step=9, loss=1.0)
    result = checkers.loss_decreased(log.events())
    assert result.passed and result.details["mean_start"] == 2.0
    assert result.details["mean_end"] == 1.0


# -- goodput and uptime ---------------------------------------------------------------------------


def goodput_log() -> tuple[LogBuilder, dict[str, int]]:
    """P = 2. l1 allocated 0..20 (20 s), l2 0..10 then gone (10 s): 30 s.
    Merged: l1 two pushes of 4 s (4 s useful), l2 one of 2 s (1 s).
    Unmerged: l2's 6 s push (3 s), a backlog_full drop of 2 s (1 s)."""
    log = LogBuilder()
    log.harness(0.0, "run_start", learners=["l1", "l2"], fragments=2)
    log.harness(0.0, "process_start", role="learner", name="l1", pid=1)
    log.harness(0.0, "process_start", role="learner", name="l2", pid=2)
    log.coord(0.1, "init", learner="l1", fragment=0, seq=1)
    log.coord(0.1, "init", learner="l1", fragment=1, seq=2)
    a, _ = log.push(4.0, "l1", 0, target=1, work_s=4.0, seq=3)
    b, _ = log.push(4.0, "l2", 0, target=1, work_s=2.0, seq=1)
    c, _ = log.push(6.0, "l1", 1, target=1, work_s=4.0, seq=4)
    log.push(8.0, "l2", 1, target=1, work_s=6.0, seq=2)
    log.learner(9.0, "l2", "dropped", fragment=0, reason="backlog_full", work_s=2.0)
    commits = {"first": log.commit(5.0, 0, 1, [("l1", a), ("l2", b)]),
               "second": log.commit(7.0, 1, 1, [("l1", c)]),
               "third": log.commit(13.0, 0, 2, [])}
    log.harness(10.0, "process_exit", name="l2", code=0)
    _trains(log, "l1", [1.0, 12.0, 15.0])
    log.harness(20.0, "run_end", reason="finished")
    return log, commits


def test_goodput_on_a_known_log() -> None:
    log, _ = goodput_log()
    g = metrics.goodput(log.events())
    assert g.fragments == 2
    assert g.allocated_s == pytest.approx(30.0)
    assert g.useful_s == pytest.approx(5.0)
    assert g.value == pytest.approx(5.0 / 30.0)
    assert g.unmerged_s == pytest.approx(4.0)
    assert g.per_learner["l1"].allocated_s == pytest.approx(20.0)
    assert g.per_learner["l2"].goodput == pytest.approx(0.1)
    assert g.per_learner["l1"].merged == 2


def test_goodput_counts_a_killed_learners_downtime_until_its_restart() -> None:
    log, _ = goodput_log()
    log.fault(2.0, "kill_learner", "l1")
    log.harness(3.0, "process_start", role="learner", name="l1", pid=3)
    # The killed process's exit, logged after its replacement started, changes nothing.
    stale = log.harness(3.5, "process_exit", name="l1", code=-9, pid=1)
    assert metrics.allocations(log.events())["l1"] == (0.0, 20.0)
    assert [o.end for o in outages(log.events()) if o.target == "l1"] == [3.0]
    assert stale_exits(log.events()) == {log.at(stale)}
    log.fault(16.0, "kill_learner", "l1")  # never restarted: allocated until the kill
    assert metrics.allocations(log.events())["l1"] == (0.0, 16.0)


def test_allocation_starts_at_the_first_join_but_counts_restarts_in_full() -> None:
    log, _ = goodput_log()
    log.learner(3.0, "l1", "join", run_id="r", versions={})
    assert metrics.allocations(log.events())["l1"] == (3.0, 20.0)
    # A restart's start-up is the fault's cost: from the kill on, it is all allocated.
    log.fault(8.0, "kill_learner", "l1")
    log.harness(9.0, "process_start", role="learner", name="l1", pid=3)
    log.learner(11.0, "l1", "join", run_id="r", versions={})
    assert metrics.allocations(log.events())["l1"] == (3.0, 20.0)


def test_goodput_names_its_bound_and_where_the_rest_went() -> None:
    """l1 joins at 1, is killed 8..10 (scripted), restarts at 10 and joins at 11, caught
    up at 12; l2 is paused 4..6 (clipped to its allocation, 0..10) and partitioned
    from 9 to beyond its end. Allocated 19 + 10 = 29 s."""
    log, _ = goodput_log()
    log.learner(1.0, "l1", "join", run_id="r", versions={})
    log.learner(1.5, "l1", "catch_up", versions={})
    log.fault(8.0, "kill_learner", "l1")
    log.fault(10.0, "kill_learner", "l1", action="heal")
    log.harness(10.0, "process_start", role="learner", name="l1", pid=3)
    log.learner(11.0, "l1", "join", run_id="r", versions={})
    log.learner(12.0, "l1", "catch_up", versions={})
    log.fault(4.0, "pause_learner", "l2")
    log.fault(6.0, "pause_learner", "l2", action="heal")
    log.fault(9.0, "partition_learner", "l2")
    g = metrics.goodput(log.events())
    assert g.allocated_s == pytest.approx(29.0)
    assert g.down_s == pytest.approx(2.0 + 2.0 + 1.0)
    assert g.startup_s == pytest.approx(1.0)
    assert g.catchup_s == pytest.approx(0.5 + 1.0)
    assert g.bound == pytest.approx(1 - 5.0 / 29.0)
    losses = g.losses
    assert losses["unmerged"] == pytest.approx(4.0 / 29.0)
    assert losses["other"] == pytest.approx((29.0 - 5.0 - 5.0 - 1.0 - 1.5 - 4.0) / 29.0)
    assert g.value + sum(losses.values()) == pytest.approx(1.0)


def test_uptime_on_a_known_log() -> None:
    # Span: first commit (5) to last train (15) = 10 s, windows [5,7) [7,9) [9,11) [11,13)
    # [13,15]; commits at 5, 7, 13 advance windows 0, 1, 4: 6 s of 10.
    log, commits = goodput_log()
    u = metrics.uptime(log.events(), window_s=2.0)
    assert (u.start, u.end, u.windows, u.advanced) == (5.0, 15.0, 5, 3)
    assert u.value == pytest.approx(0.6)
    assert u.longest_stall is not None
    assert u.longest_stall.seconds == pytest.approx(6.0)
    assert (u.longest_stall.before, u.longest_stall.after) == (
        log.at(commits["second"]), log.at(commits["third"]))
    # A shorter last window weighs by its length: windows of 3 s are [5,8) [8,11) [11,14)
    # [14,15]; commits advance windows 0 and 2: 6 s of 10.
    assert metrics.uptime(log.events(), window_s=3.0).value == pytest.approx(0.6)
    assert metrics.uptime(LogBuilder().events()).value == 0.0


def test_goodput_and_uptime_checks_name_the_events_behind_a_miss() -> None:
    log, commits = goodput_log()
    events = log.events()
    assert checkers.goodput_at_least(events, 0.15).passed
    low = checkers.goodput_at_least(events, 0.5)
    assert not low.passed
    unmerged = next(e.index for e in events if e.kind == "push_invoke" and e.get("work_s") == 6)
    drop = next(e.index for e in events if e.kind == "dropped")
    assert low.events == [unmerged, drop]  # most lost work first
    assert checkers.uptime_at_least(events, 0.6).passed
    stalled = checkers.uptime_at_least(events, 0.9)
    assert not stalled.passed
    assert stalled.events == [log.at(commits["second"]), log.at(commits["third"])]
    assert "longest stall 6.0s" in stalled.message


def test_timelines_add_up_to_the_run_totals() -> None:
    log, _ = goodput_log()
    events = log.events()
    windows = metrics.timeline(events, window_s=3.0)
    assert [w.start for w in windows] == [0, 3, 6, 9, 12, 15, 18]
    assert windows[-1].end == 20.0
    assert sum(w.allocated_s for w in windows) == pytest.approx(30.0)
    assert sum(w.useful_s for w in windows) == pytest.approx(5.0)
    # Window [0, 3) holds 3/4 of l1's push at 4 (2 s over [0, 4]), 1/2 of l2's at 4
    # (1 s over [2, 4]) and 1/4 of l1's at 6 (2 s over [2, 6]).
    assert windows[0].useful_s == pytest.approx(1.5 + 0.5 + 0.5)
    assert [w.commits for w in windows] == [0, 1, 1, 0, 1, 0, 0]
    assert windows[0].goodput == pytest.approx(2.5 / 6.0)


# -- run_all --------------------------------------------------------------------------------------


def test_run_all_turns_a_malformed_event_into_a_failure_naming_it() -> None:
    log = healthy_run()
    bad = log.coord(19.0, "commit", fragment=0, version="three", manifest=[])
    results = by_name(run_all(log.events(), CheckConfig(max_blocked_s=None,
                                                        loss_must_drop=False)))
    assert set(results) == {"merged_at_most_once", "acknowledged_settled",
                            "versions_monotonic"}
    assert not results["versions_monotonic"].passed
    assert results["versions_monotonic"].events == [log.at(bad)]
    assert "'version' is not an integer" in results["versions_monotonic"].message


def test_named_events_are_capped_and_results_serialize() -> None:
    log = healthy_run(end=30.0, pushes_until=10.0)
    for k in range(30):
        log.push(20.0 + k * 0.1, "l1", 0, target=3)
    log.commit(25.0, 0, 3, [])
    result = checkers.acknowledged_settled(log.events())
    assert not result.passed
    assert len(result.events) == checkers.MAX_NAMED
    assert result.details["violation_count"] == 30
    assert "and 27 more" in result.message
    json.dumps(result.to_json())


# -- high availability ---------------------------------------------------------------------


def ha_run() -> tuple[LogBuilder, int]:
    """Fragment 0 committed at epochs 1 then 2, around a leader kill at t=10
    (the harness logged epoch 1); returns the log and the kill's handle."""
    log = healthy_run(end=30.0, pushes_until=8.0)
    for record in log.records:
        if record["kind"] == "commit":
            record["epoch"] = 1
    kill = log.harness(10.0, "fault", fault="kill_leader", target="r0", action="inject",
                       detail="in a grace window", epoch=1)
    log.coord(12.5, "elected", replica="r1", epoch=2, run_id="r",
              versions={"0": log.version[0], "1": log.version[1]})
    return log, kill


def test_failover_is_timed_from_the_fault_to_the_newer_epochs_first_commit() -> None:
    log, kill = ha_run()
    first = log.commit(13.0, 0, log.version[0] + 1, [])
    log.records[first]["epoch"] = 2
    events = log.events()
    assert checkers.failover_within(events, 4.0).passed
    assert checkers.failover_within(events, 4.0).details["failover_s"] == [3.0]
    slow = checkers.failover_within(events, 2.5)
    assert not slow.passed
    assert slow.events == [log.at(kill), log.at(first)]
    assert "3.00s later" in slow.message


def test_a_leader_fault_with_no_newer_epoch_committing_fails() -> None:
    log, kill = ha_run()
    same_epoch = log.commit(13.0, 0, log.version[0] + 1, [])  # no failover happened
    log.records[same_epoch]["epoch"] = 1
    result = checkers.failover_within(log.events(), 4.0)
    assert not result.passed
    assert result.events == [log.at(kill)]
    assert "no commit under a newer epoch" in result.message


def test_a_version_committed_under_two_epochs_is_split_brain() -> None:
    log, _ = ha_run()
    version = log.version[0] + 1
    new = log.commit(13.0, 0, version, [])
    log.records[new]["epoch"] = 2
    assert checkers.no_split_brain(log.events()).passed
    late = log.commit(13.5, 0, version, [])  # the deposed leader's late write
    log.records[late]["epoch"] = 1
    result = checkers.no_split_brain(log.events())
    assert not result.passed
    assert result.events == [log.at(new), log.at(late)]
    assert "epoch 2" in result.message and "epoch 1" in result.message


def test_an_election_that_loses_committed_versions_breaks_monotonic_versions() -> None:
    log, _ = ha_run()
    assert checkers.versions_monotonic(log.events()).passed
    log.coord(20.0, "elected", replica="r0", epoch=3, run_id="r",
              versions={"0": log.version[0] - 1, "1": log.version[1]})
    result = checkers.versions_monotonic(log.events())
    assert not result.passed
    assert "resumed" in result.message


def test_run_all_adds_the_ha_checks_when_commits_carry_epochs() -> None:
    log, _ = ha_run()
    first = log.commit(13.0, 0, log.version[0] + 1, [])
    log.records[first]["epoch"] = 2
    names = set(by_name(checkers.run_all(log.events(), checkers.CheckConfig(
        max_failover_s=4.0))))
    assert {"no_split_brain", "failover_within"} <= names
    assert "no_split_brain" not in by_name(checkers.run_all(healthy_run().events()))
