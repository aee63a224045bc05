"""The README's main job, exactly as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from protos.events import problems

# Whole experiments or clusters: `deploy/dev test -m 'not slow'` leaves them out.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_experiment_passes_its_checks_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "quickstart"
    result = subprocess.run(
        [sys.executable, "-m", "chaos", "run", "experiments/quickstart.toml", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all checks passed" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert all(check["passed"] for check in summary["checks"])
    for name in ("report.md", "loss.png", "versions.png", "goodput.png", "events.jsonl"):
        assert (out / name).stat().st_size > 0, name
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    wrong = [(event, problem) for event in events for problem in problems(event)]
    assert not wrong, f"{len(wrong)} events do not match protos/events.py: {wrong[:5]}"
    report = (out / "report.md").read_text()
    assert "kill_learner" in report and "straggle" in report and "adversary" in report


def test_a_bad_experiment_file_stops_before_anything_starts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\n\n[[faults]]\nkind = "kill_learner"\nat_s = 1\nevry_s = 3\n')
    result = subprocess.run([sys.executable, "-m", "chaos", "run", str(bad), "--out",
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "unknown key 'faults.0.evry_s'" in result.stderr and "line 6" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_coordinator_that_cannot_start_is_named_in_one_line(tmp_path: Path) -> None:
    """Settings the experiment file can check pass; one the daemon finds wrong at
    start-up (a tokens file that is not there) ends the run with the daemon's reason."""
    bad = tmp_path / "tokens.toml"
    bad.write_text('name = "tokens"\nmax_duration_s = 20\n[coordinator.settings]\n'
                   '"auth.tokens_file" = "/nonexistent/tokens.toml"\n'
                   '[learners]\ncount = 1\ntask = "synthetic"\nsteps = 10\n')
    result = subprocess.run([sys.executable, "-m", "chaos", "run", str(bad), "--out",
                             str(tmp_path / "out"), "--quiet"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "the cluster did not start" in lines[0], lines
    assert "auth.tokens_file /nonexistent/tokens.toml" in lines[0], lines


def test_an_out_directory_that_is_not_an_earlier_run_is_left_alone(tmp_path: Path) -> None:
    mine = tmp_path / "notes.txt"
    mine.write_text("not a run")
    result = subprocess.run([sys.executable, "-m", "chaos", "run", "experiments/quickstart.toml",
                             "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2, result.stderr
    assert "does not hold an earlier run's output" in result.stderr
    assert mine.read_text() == "not a run"


SMALL = """\
name = "stopped"
max_duration_s = 120

[learners]
count = 2
task = "synthetic"
steps = 100000
args = ["--step-ms", "5"]
"""


def test_a_terminated_harness_stops_everything_it_started(tmp_path: Path) -> None:
    experiment = tmp_path / "small.toml"
    experiment.write_text(SMALL)
    out = tmp_path / "out"
    harness = subprocess.Popen([sys.executable, "-m", "chaos", "run", str(experiment), "--out",
                                str(out), "--quiet"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    log = out / "harness.events.jsonl"

    def started() -> list[dict[str, object]]:
        lines = log.read_text().splitlines() if log.exists() else []
        return [e for e in map(json.loads, lines) if e["kind"] == "process_start"]

    deadline = time.monotonic() + 60
    while len([e for e in started() if e["role"] == "learner"]) < 2:
        assert time.monotonic() < deadline and harness.poll() is None, harness.stderr
        time.sleep(0.2)
    harness.send_signal(signal.SIGTERM)
    _, err = harness.communicate(timeout=120)
    assert harness.returncode == 130, err[-2000:]
    for process in started():
        pid = int(str(process["pid"]))
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(
            f"/proc/{pid}/status").read_text().lower(), f"{process['name']} ({pid}) outlived it"


def test_the_live_view_shows_learners_versions_goodput_and_the_next_fault(
        tmp_path: Path) -> None:
    experiment = tmp_path / "small.toml"
    experiment.write_text(SMALL.replace("steps = 100000", "steps = 600")
                          + '\n[[faults]]\nkind = "pause_learner"\ntarget = "learner-1"\n'
                            'at_s = 100\nduration_s = 1\n')
    result = subprocess.run([sys.executable, "-m", "chaos", "run", str(experiment), "--out",
                             str(tmp_path / "out")], capture_output=True, text=True,
                            timeout=180, env={**os.environ, "COLUMNS": "120"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for needle in ("learner-0", "versions 0:", "goodput so far: 0.", "next: pause_learner"):
        assert needle in result.stdout, result.stdout[-3000:]
