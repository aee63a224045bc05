"""Tests of the chaos report: every file written, and what a reader needs in it."""

from __future__ import annotations

import json
from pathlib import Path

from chaos.checkers import CheckConfig, run_all
from chaos.history import events_from_records
from chaos.report import fault_spans, write_report
from tests.unit.test_checkers import LogBuilder, healthy_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def faulty_run() -> LogBuilder:
    log = healthy_run()
    log.fault(5.0, "pause_learner", "l2")
    log.fault(6.0, "pause_learner", "l2", action="heal")
    log.fault(8.0, "kill_learner", "l1")
    log.harness(8.05, "process_exit", name="l1", code=-9)
    log.fault(9.0, "kill_learner", "l1", action="heal")
    log.harness(9.0, "process_start", role="learner", name="l1", pid=300)
    log.fault(11.0, "latency", "l2")
    log.fault(12.0, "reset_connections", "l1")
    log.harness(12.5, "fault_skipped", fault="pause_learner", target="l1",
                reason="learner is killed")
    return log


def test_report_writes_every_file(tmp_path: Path) -> None:
    events = faulty_run().events()
    results = run_all(events, CheckConfig(max_blocked_s=5.0, min_goodput=0.0,
                                          min_uptime=0.4, window_s=1.0))
    assert all(r.passed for r in results), [r.message for r in results if not r.passed]
    report = write_report(events, results, tmp_path / "out", "unit-faults")
    out = tmp_path / "out"
    assert report == out / "report.md"
    for name in ("loss.png", "versions.png", "goodput.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name

    summary = json.loads((out / "summary.json").read_text())
    assert summary["experiment"] == "unit-faults" and summary["passed"] is True
    assert summary["run"]["learners"] == ["l1", "l2"] and summary["run"]["fragments"] == 2
    assert summary["run"]["end_reason"] == "finished"
    assert [c["name"] for c in summary["checks"]] == [r.name for r in results]
    assert summary["uptime"]["window_s"] == 1.0  # taken from the uptime check
    assert 0 < summary["goodput"]["value"] <= 1
    assert [(f["t_s"], f["fault"], f["target"], f["action"]) for f in summary["faults"]] == [
        (5.0, "pause_learner", "l2", "inject"), (6.0, "pause_learner", "l2", "heal"),
        (8.0, "kill_learner", "l1", "inject"), (9.0, "kill_learner", "l1", "heal"),
        (11.0, "latency", "l2", "inject"), (12.0, "reset_connections", "l1", "inject")]
    assert summary["faults_skipped"][0]["reason"] == "learner is killed"
    assert all(span["survived"] for span in summary["fault_spans"])
    l1 = summary["learners"]["l1"]
    assert (l1["eval_start"], l1["eval_end"], l1["restarts"]) == (3.0, 1.0, 1)
    assert l1["merged"] == l1["acknowledged"] > 0
    assert summary["versions"] == {"0": 4, "1": 4}

    text = report.read_text()
    for link in ("](loss.png)", "](versions.png)", "](goodput.png)", "](summary.json)"):
        assert link in text
    assert "**PASS**" in text
    assert "| 8.00 | kill_learner | l1 | inject |" in text
    assert "| no_learner_blocked | pass |" in text
    assert "Goodput **" in text and "uptime **" in text


def test_report_of_a_failed_run_names_the_events_and_the_faults_near_them(
        tmp_path: Path) -> None:
    log = faulty_run()
    # l2 goes silent for 8 s right after its pause healed: blocked, not excused.
    log.records = [r for r in log.records if not (
        r["kind"] == "train" and r["source"] == "l2" and 7.0 < r["t"] < 15.5)]
    events = log.events()
    results = run_all(events, CheckConfig(max_blocked_s=2.0))
    blocked = next(r for r in results if r.name == "no_learner_blocked")
    assert not blocked.passed
    report = write_report(events, results, tmp_path, "unit-blocked")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is False
    pause = next(s for s in summary["fault_spans"] if s["fault"] == "pause_learner")
    assert pause["failed_checks_nearby"] == ["no_learner_blocked"] and not pause["survived"]
    text = report.read_text()
    assert "**FAIL**" in text
    assert "| no_learner_blocked | **FAIL** |" in text
    assert ", ".join(f"#{i}" for i in blocked.events) in text
    assert "pause_learner l2 at 5.00 s: no_learner_blocked" in text


def test_report_survives_a_run_that_did_nothing(tmp_path: Path) -> None:
    events = events_from_records([
        {"t": 10.0, "source": "harness", "kind": "run_start", "learners": ["a"]},
        {"t": 11.0, "source": "harness", "kind": "fault", "fault": "kill_coordinator",
         "target": "coordinator", "action": "inject", "detail": ""},
        {"t": 12.0, "source": "harness", "kind": "run_end", "reason": "crash"}])
    results = run_all(events)
    report = write_report(events, results, tmp_path, "empty")
    assert (tmp_path / "loss.png").stat().st_size > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["uptime"]["value"] == 0.0 and summary["commits"] == 0
    assert "**FAIL**" in report.read_text()  # loss_decreased has nothing to go on


def test_fault_spans_pair_injects_with_heals() -> None:
    spans = fault_spans(faulty_run().events())
    assert [(s.fault, s.target, s.start, s.end) for s in spans] == [
        ("pause_learner", "l2", 5.0, 6.0), ("kill_learner", "l1", 8.0, 9.0),
        ("latency", "l2", 11.0, None), ("reset_connections", "l1", 12.0, 12.0)]
