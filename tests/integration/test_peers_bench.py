"""`bench.peers` runs, small, to its JSON line: torchft 0.2.0 (the `peers` extra) and
ftsync side by side with no faults, ftsync's learners carrying their steps across an
apply, and the overwrite's run beside them for the held-out loss. Nothing else in the
suite runs torchft, so a change in either side's worker or in the figures' reading
would otherwise go unseen until the benchmark's next full run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_peers_bench_small_runs_to_its_json_line() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.peers", "--scenarios", "no_fault", "--duration", "6",
         "--baseline-s", "3", "--startup-s", "15", "--apply-rule", "carry",
         "--set", "policy.grace_max_s=0.5"],
        capture_output=True, text=True, timeout=380)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["name"] == "peers" and result["apply_rule"] == "carry"
    assert result["settings"] == ["policy.grace_max_s=0.5"]
    assert set(result["goodput_ratios"]) == {"no_fault"}
    for system in ("ftsync", "torchft"):
        assert result[system]["goodput"]["no_fault"] > 0, result[system]
        assert result[system]["held_out_loss"]["no_fault"] > 0, result[system]
    # Every ftsync step that was pushed and merged counted; with no faults and the
    # steps carried, most of them.
    assert result["goodput_no_fault"] > 0.5, result["runs"]["ftsync"]["no_fault"]
    assert result["held_out_loss_vs_overwrite"] > 0
    assert result["survivor_stall_s"] is None and result["others_rate_straggler"] is None


def test_a_wrong_coordinator_setting_is_refused_before_any_run() -> None:
    run = subprocess.run([sys.executable, "-m", "bench.peers", "--set", "outer.speed=2"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--set: " in run.stderr and "outer.speed" in run.stderr, \
        run.stderr
