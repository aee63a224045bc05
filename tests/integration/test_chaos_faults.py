"""Each fault kind against a real local cluster (synthetic task), through the
user's command, with every checker passing and the fault's own traces in the
merged event log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXPERIMENT = """\
name = "fault-{kind}"
seed = 2
max_duration_s = 60

[coordinator.settings]
"policy.grace_max_s" = 0.3
"policy.max_staleness" = 64
"outer.lr" = 0.3
"outer.momentum" = 0.0

[learners]
count = 2
task = "synthetic"
steps = 900
sync_every = 20
args = ["--step-ms", "5"]

[[faults]]
kind = "{kind}"
target = "{target}"
at_s = 2.5
duration_s = 2
{extra}

[checks]
max_blocked_s = 10
"""

FAULTS = {
    "kill_learner": ("learner-0", ""),
    "pause_learner": ("learner-1", ""),
    "straggle": ("learner-0", "duty = 0.3"),
    "kill_coordinator": ("coordinator", ""),
    "partition_learner": ("learner-1", ""),
    "latency": ("learner-0", "latency_ms = 150"),
    "bandwidth": ("learner-1", "bandwidth_bytes_s = 50000"),
    "reset_connections": ("learner-0", ""),
    "adversary": ("random", ""),
}


def run(tmp_path: Path, kind: str) -> tuple[list[dict[str, object]], dict[str, object]]:
    target, extra = FAULTS[kind]
    path = tmp_path / f"{kind}.toml"
    path.write_text(EXPERIMENT.format(kind=kind, target=target, extra=extra))
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "chaos", "run", str(path), "--out", str(out),
                             "--quiet"], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return events, summary


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_fault_kind_is_survived(tmp_path: Path, kind: str) -> None:
    events, summary = run(tmp_path, kind)
    faults = [e for e in events if e["kind"] == "fault" and e["fault"] == kind]
    assert [f["action"] for f in faults] == ["inject", "heal"]
    assert all(check["passed"] for check in summary["checks"]), summary["checks"]
    starts = [e for e in events if e["kind"] == "process_start"]
    if kind == "kill_learner":
        assert [e["name"] for e in starts].count("learner-0") == 2
        assert any(e["kind"] == "join" and e["source"] == "learner-0" for e in events
                   if e["t"] > faults[1]["t"])
    if kind == "kill_coordinator":
        assert any(e["kind"] == "resume" for e in events)
        assert [e["name"] for e in starts].count("coordinator") == 2
    if kind == "adversary":
        attacks = [e for e in events if e["kind"] == "adversary"]
        assert {a["attack"] for a in attacks} >= {"nan", "shape", "norm", "replay"}
        # Corrupt pushes are all refused; of a replayed pair at most the first is taken.
        assert not any(a["accepted"] for a in attacks if a["attack"] in (
            "nan", "shape", "norm", "replay-again"))
        rejects = {e["reason"] for e in events if e["kind"] == "reject"
                   and e["source"] == "coordinator"}
        assert {"not_finite", "bad_shape", "norm_bound"} <= rejects
    if kind == "partition_learner":
        cut = [e for e in events if e["source"] == "learner-1"
               and faults[0]["t"] + 0.5 < e["t"] < faults[1]["t"]
               and e["kind"] in ("push_ack", "merged", "applied")]
        assert not cut, "a partitioned learner reached the coordinator"
